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
from typing import Any, Literal

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import GraphAlgorithm, GraphHparams, with_local
from fedweave.algorithms.decentralized.selection import NeighbourSelector, SelectionHparams
from fedweave.config import ConfigError
from fedweave.faults import mixing_without
from fedweave.registry import ALGORITHMS
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

    def __init__(self, ctx: RunContext, hp: DFedAvgHparams) -> None:
        super().__init__(ctx, hp)
        if hp.local_momentum is not None:
            self.trainer = with_local(self.trainer, momentum=hp.local_momentum)
        self.selector = NeighbourSelector(self, hp)
        self.mixing = metropolis_weights(self.graph) if hp.mixing == "metropolis" else None

    def unread_options(self, hp: DFedAvgHparams) -> dict[str, str]:
        if hp.mixing != "metropolis":
            return {}
        why = "mixing 'metropolis' mixes with every graph neighbour each round (or use mixing 'sampled')"
        return {"neighbours": why}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.selector.load_state_dict(state.pop("selector"))
        super().load_state_dict(state)

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
            return gossip(sent, M), messages / max(1, int(self.up(r).sum()) if self.faulty else self.num_clients)
        new = torch.empty_like(sent)
        picks = self.selector.select(r, W, sent)
        for i, (chosen, wts) in enumerate(picks):
            self.peer(r, "model", self.model_bytes, len(chosen))  # each j in R_i -> i (delivered only)
            rows = [sent[i], *(self.noisy(sent[j], r, int(j), i) for j in chosen)]
            new[i] = (self.on_device(wts, sent)[:, None] * torch.stack(rows)).sum(0)
        sizes = torch.tensor([float(len(c)) for c, _ in picks], dtype=torch.float64, device="cpu")
        return new, self.mean_over_up(r, sizes)

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
        return {"train_loss": self.mean_over_up(r, own.loss), "selected_mean": k, **self.round_fault_metrics(r)}


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
