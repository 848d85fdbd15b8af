"""Gossip / DFedAvg / DFedAvgM / FedAvg-FT: average with neighbours, train locally.

* ``gossip`` = ``fedavg_ft`` (Hegedus et al. 2019; the FedAvg-FT base row of AFIND+'s Table 2): each round
  client i pulls the round-start models of its sampled neighbours R_i, sets
  w_i <- (w_i + sum_{j in R_i} w_j) / (|R_i| + 1), then trains K local epochs ("aggregate then train").
* ``dfedavg`` (Sun et al. 2022, DFedAvg): K local epochs first, then one gossip step
  x_i^{t+1} = sum_j m_ij z_j^t with the sampled uniform weights or, with ``mixing: metropolis``, the
  doubly-stochastic Metropolis matrix of the whole graph. ``dfedavgm`` is DFedAvg with heavy-ball
  momentum (``local_momentum``, default 0.9) in the local steps.
* The neighbours come from a pluggable :class:`NeighbourSelector` (``selection: random|topk|afind``);
  with ``afind`` the sampled uniform weights become AFIND+'s Boltzmann weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave import robust
from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import GraphAlgorithm, GraphHparams, with_local
from fedweave.algorithms.decentralized.selection import NeighbourSelector, SelectionHparams
from fedweave.config import ConfigError
from fedweave.faults import mixing_without
from fedweave.registry import ALGORITHMS
from fedweave.robust.stage import is_default
from fedweave.topology.graph import gossip, metropolis_weights


@dataclass
class DFedAvgHparams(SelectionHparams, GraphHparams):
    order: Literal["train_aggregate", "aggregate_train"] = "train_aggregate"
    mixing: Literal["sampled", "metropolis"] = "sampled"
    local_momentum: float | None = None  # heavy-ball momentum of the local steps; null = local.momentum

    def __post_init__(self) -> None:
        GraphHparams.__post_init__(self)
        SelectionHparams.__post_init__(self)
        if self.local_momentum is not None and not 0 <= self.local_momentum < 1:
            raise ConfigError(f"algorithm.local_momentum must be in [0, 1), got {self.local_momentum}")
        if self.mixing == "metropolis" and self.selection != "random":
            raise ConfigError("algorithm.mixing 'metropolis' mixes with every graph neighbour; use selection 'random'")
        if self.mixing == "metropolis" and self.dp_sigma and self.dp_mode == "exchange":
            raise ConfigError("algorithm.dp_sigma with dp_mode 'exchange' needs mixing 'sampled' (per-message noise)")


@ALGORITHMS.register("dfedavg")
class DFedAvg(GraphAlgorithm):
    name = "dfedavg"
    Hparams = DFedAvgHparams
    state_fields = ("selector",)  # its neighbour selection's state (AFIND's thresholds)
    undeployable = None  # its peers touch their data only in local training (selection random: deploy/support.py)
    dp_refusal = None  # the same: with selection random its messages are functions of the DP-SGD steps only
    # robustness: Byzantine peers send what their attack makes of their model, and each peer reduces what it
    # receives with the run's aggregator (its mixing weights as the weights) instead of the weighted sum
    handles_faults = (*GraphAlgorithm.handles_faults, "byzantine")
    robust_aggregation = True

    def __init__(self, ctx: RunContext, hp: DFedAvgHparams) -> None:
        super().__init__(ctx, hp)
        if hp.local_momentum is not None:
            local = ctx.config.local.momentum  # 0 unless set: two different values would leave one silently unread
            if local not in (0.0, hp.local_momentum):
                raise ConfigError(
                    f"algorithm.local_momentum ({hp.local_momentum}; {self.name}'s default: {type(hp).local_momentum}) "
                    f"and local.momentum ({local}) both set the momentum of the local steps; keep one"
                )
            self.trainer = with_local(self.trainer, momentum=hp.local_momentum)
            self.hold_momentum()  # DFedAvgM's heavy-ball buffer (Sun et al. 2022), held while training
        self.selector = NeighbourSelector(self, hp)
        self.mixing = metropolis_weights(self.graph) if hp.mixing == "metropolis" else None
        self.robust = self._robust_stage(ctx, hp)

    def _robust_stage(self, ctx: RunContext, hp: DFedAvgHparams) -> robust.RobustStage | None:
        """The run's attack and per-peer reduction (None without either), checked against the count of models
        each peer mixes: itself and its neighbours (``neighbours`` of them when sampled)."""
        section = ctx.config.aggregator
        if not ctx.config.faults.byzantine and is_default(section):
            return None
        if hp.selection != "random":
            raise ConfigError(
                f"algorithm.selection: {hp.selection!r} scores the models the peers send, which Byzantine peers "
                "forge; robust gossip (faults.byzantine, aggregator) takes selection 'random'"
            )
        if (section.options.get("bucketing") or 1) > 1:
            raise ConfigError(
                f"aggregator.bucketing: a peer reduces the few models it receives; leave it out for {self.name}"
            )
        # every peer's count (a bound that reads f from the count is not monotone in it, so not the fewest alone)
        rows = {1 + (len(nb) if self.mixing is not None else min(hp.neighbours, len(nb))) for nb in self.neighbours}
        return robust.build(ctx.config, ctx.seeds, self.num_clients, rows)

    def evaluated_clients(self) -> np.ndarray | None:
        return None if self.robust is None else self.robust.evaluated()

    def model_metrics(self, models: torch.Tensor) -> dict[str, float]:
        """Under a backdoor attack (robustness), ``test_backdoor_success``: its mean over the evaluated peers'
        models, each scored as the star scores its global model."""
        if self.robust is None:
            return {}
        return self.robust.mean_backdoor_metrics(self.layout, models, self.ctx.dataset, self.config.eval.batch_size)

    def unread_options(self, hp: DFedAvgHparams) -> dict[str, str]:
        if hp.mixing != "metropolis":
            return {}
        why = "mixing 'metropolis' mixes with every graph neighbour each round (or use mixing 'sampled')"
        return {"neighbours": why, "select_k": f"{self.name} with {why}"}

    def mix(self, r: int, W: torch.Tensor, sent: torch.Tensor) -> tuple[torch.Tensor, float]:
        """New rows from the round-start ``W`` (proxies) and the models ``sent`` (double-buffered).

        Under faults only delivered models are mixed: the sampled weights are re-normalized over them, and
        the Metropolis matrix moves the weight of a lost link or a dropped peer to the diagonal."""
        if self.mixing is not None:  # every client sends to every graph neighbour
            M = self.mixing
            messages = 2 * self.graph.number_of_edges()
            if self.faulty:
                n = self.num_clients
                idx, up = np.arange(n), self.up(r)
                ok = self.faults.links_up(r, idx[:, None], idx[None, :]) & up[:, None] & up[None, :]
                M = torch.as_tensor(mixing_without(M.numpy(), ok), device="cpu")
                messages = int(((self.mixing.numpy() > 0) & ok & ~np.eye(n, dtype=bool)).sum())
            self.peer(r, "model", self.model_bytes, messages)
            # each peer gathers the models of every delivered graph neighbour: the peak over peers of that count
            self.hold_received(int(((M.numpy() > 0) & ~np.eye(self.num_clients, dtype=bool)).sum(1).max()))
            k = messages / max(1, int(self.up(r).sum()) if self.faulty else self.num_clients)
            if self.robust is None or (self.robust.plain and not len(self.robust.attackers)):
                return gossip(sent, M), k  # one product; every peer's row is the same weighted sum
            heard = [np.setdiff1d(np.flatnonzero(M[i] > 0), [i]) for i in range(self.num_clients)]  # the delivered
            picks = [(nb, torch.cat([M[i, i : i + 1], M[i, nb]])) for i, nb in enumerate(heard)]  # own weight first
            return self.reduce_received(r, sent, picks), k
        picks = self.selector.select(r, W, sent)
        for chosen, _ in picks:
            self.peer(r, "model", self.model_bytes, len(chosen))  # each j in R_i -> i (delivered only)
            self.hold_received(len(chosen))  # i mixes them together
        sizes = torch.tensor([float(len(c)) for c, _ in picks], dtype=torch.float64, device="cpu")
        return self.reduce_received(r, sent, picks), self.mean_over_up(r, sizes)

    def reduce_received(self, r: int, sent: torch.Tensor, picks: list[tuple[np.ndarray, torch.Tensor]]) -> torch.Tensor:
        """Each peer i's new row from its own model and those ``picks[i]`` names (``(chosen, weights)``, its own
        weight first): their weighted sum; with Byzantine peers (robustness) an attacker's message is what its
        attack makes of its model's displacement from i's, and a non-default aggregator reduces them."""
        new = torch.empty_like(sent)
        for i, (chosen, wts) in enumerate(picks):
            received = [self.noisy(sent[j], r, int(j), i) for j in chosen]
            rows = torch.stack([sent[i], *received]) if len(chosen) else sent[i : i + 1]
            wts = self.on_device(wts, sent)
            if self.robust is not None and len(chosen):
                # the peer reduces its own row too: the attacks' n counts it (ALIE's s, model replacement)
                rows = torch.cat([rows[:1], self.robust.attack(r, chosen, rows[1:], sent[i], reduced=len(rows))])
            if self.robust is None or self.robust.plain:
                new[i] = (wts[:, None] * rows).sum(0)
            else:
                new[i] = self.robust.reduce_at_peer(rows, wts.to(rows.dtype), sent[i], peer=i)
        return new

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        W0 = self.W
        if self.hp.order == "aggregate_train":
            mixed, k = self.mix(r, W0, W0)
            own = self.train_up(r, self.trainer, mixed)
            new = own.params
        else:
            own = self.train_up(r, self.trainer, W0)
            new, k = self.mix(r, W0, own.params)  # a dropped peer trained nothing and sends nothing
        self.commit("model", self.hold_dropped(r, new, W0))  # ... and does not update
        out = {"train_loss": self.train_loss(r, own), "selected_mean": k, **self.round_fault_metrics(r)}
        if self.robust is not None and self.robust.attack_fn is not None:  # the attackers taking part this round
            out["byzantine_clients"] = float(np.isin(self.clients_up(r), self.robust.attackers).sum())
        return out


@dataclass
class DFedAvgMHparams(DFedAvgHparams):
    local_momentum: float | None = 0.9


@ALGORITHMS.register("dfedavgm")
class DFedAvgM(DFedAvg):
    """DFedAvgM (Sun et al. 2022): DFedAvg with heavy-ball momentum in the local steps."""

    name = "dfedavgm"
    Hparams = DFedAvgMHparams


@dataclass
class GossipHparams(DFedAvgHparams):
    order: Literal["train_aggregate", "aggregate_train"] = "aggregate_train"


@ALGORITHMS.register("gossip")
class Gossip(DFedAvg):
    """Gossip learning with random neighbours, aggregate then train (AFIND+ Table 1 "Gossip")."""

    name = "gossip"
    Hparams = GossipHparams


@ALGORITHMS.register("fedavg_ft")
class FedAvgFT(Gossip):
    """FedAvg-FT in DFL (Cheng et al. 2021 backbone; Table 2 base row): Gossip + 1 fine-tune epoch at eval."""

    name = "fedavg_ft"
