"""CHOCO-SGD (Koloskova, Stich and Jaggi 2019, Alg. 2): decentralized SGD whose gossip sends compressed messages.

Every node i keeps its model x_i and a public copy x̂_i of it, which each of its neighbours holds too
(x̂_i = 0 at the start). One round:

  x_i^{+} = the local training from x_i                  (the stochastic gradient step x^{t+1/2}; here the
                                                           run's local steps, as DFedAvg trains before it mixes)
  q_i     = Q(x_i^{+} - x̂_i), sent to every neighbour     (the compressed message)
  x̂_j    <- x̂_j + q_j for j in N_i and i itself           (every holder of a copy adds the same q_j)
  x_i     <- x_i^{+} + gamma sum_j w_ij (x̂_j - x̂_i)      (the consensus step)

with w the Metropolis weights of the graph (symmetric and doubly stochastic, so the mean of the models is what
the training left it: sum_i (W x̂ - x̂)_i = 0). What Q drops stays in x_i^{+} - x̂_i and is sent in a later round:
the public copies are CHOCO's error feedback. Q is the run's ``compression.upload`` compressor, which must be a
contraction (Assumption 1: E ||Q(v) - v||^2 <= (1 - delta) ||v||^2): ``topk``, ``efsign``, or ``randk`` with
``error_feedback: true`` (its unscaled form); ``qsgd``, ``int8`` and the d/k-scaled ``randk`` are unbiased, not
contractions, and are refused. Without a compressor Q is the identity, and gamma = 1 is DFedAvg with Metropolis
mixing (to float rounding). Every node talks to all its graph neighbours every round (``neighbours`` is
refused).

Injected faults (docs/reliability.md): a node that drops out in a round (``faults.dropout``,
``faults.outage_rounds``) neither trains, compresses, sends nor updates anything: its x_j, its x̂_j and every
neighbour's copy of x̂_j stay as they are, so every copy of x̂_j stays the same. The live nodes run the round
with W^(t), the Metropolis weights with the edges to the dropped nodes removed and their weight moved to the
diagonal (``faults.mixing_without``, as ``dfedavg`` with ``mixing: metropolis``): a dropped node's row is
then e_j (it changes nothing), and W^(t) is still symmetric and doubly stochastic, so the consensus step keeps
the models' average, the invariant x̄^{t+1} = x̄^{t+1/2} of the paper's analysis. Using a dropped neighbour's
stale x̂_j with the full W instead would be well defined too (its copy is consistent), but the exchange would
be one-sided: the live node moves towards x̂_j and the dropped node does not move back, so the average drifts.
A live node still sends its q_i to a dropped neighbour: links are reliable, the message waits, and the node
adds the messages it missed to its copies, in order, when it comes back, before any consensus step reads
them, so the one table of copies kept here is every holder's copy whenever it is read; the ledger bills
every message sent (a live node's, once per graph neighbour) and none of a dropped node. A round in which
nobody takes part is skipped. Lost links (``faults.link_loss``) are refused: a node that misses a q_j would
hold a copy of x̂_j that its other neighbours do not, and no later message repairs it. Byzantine peers
(``faults.byzantine``) are refused too: robust gossip is the gossip methods' (docs/robustness.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import GraphAlgorithm, GraphHparams
from fedweave.compression import EFSign, RandK, TopK, build_compressor
from fedweave.config import ConfigError
from fedweave.faults import mixing_without
from fedweave.registry import ALGORITHMS
from fedweave.topology.graph import gossip, metropolis_weights

PUBLIC = "public"  # the store's table of the public copies x̂


@dataclass
class ChocoHparams(GraphHparams):
    gamma: float = 1.0  # the consensus step size of Alg. 2; 1 with exact messages, below 1 with compression

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"algorithm.gamma must be in (0, 1] (the consensus step size), got {self.gamma}")


@ALGORITHMS.register("choco_sgd")
class ChocoSGD(GraphAlgorithm):
    name = "choco_sgd"
    Hparams = ChocoHparams
    undeployable = (
        "its compressed messages Q(x - x_hat) and public copies would be computed by the ServerApp that relays "
        "the gossip, so the wire would carry dense models"
    )
    # a dropped node keeps x_j and x̂_j, so every copy of x̂_j stays the same; a lost link would not (docstring)
    handles_faults: ClassVar[tuple[str, ...]] = ("dropout",)
    dp_refusal = None  # its compressed messages are functions of the models its DP-SGD steps produced
    compresses_uploads: ClassVar[bool] = True  # compression.upload is its Q

    def __init__(self, ctx: RunContext, hp: ChocoHparams) -> None:
        super().__init__(ctx, hp)
        if hp.dp_sigma and hp.dp_mode == "exchange":
            raise ConfigError(
                "algorithm.dp_mode 'exchange': choco_sgd's neighbours must add the same message to their copies; "
                "use dp_mode 'sgd'"
            )
        section = ctx.config.compression.upload_section
        self.compressor = None if section is None else build_compressor(section)
        if self.compressor is not None:
            c = self.compressor
            if not (isinstance(c, TopK | EFSign) or (isinstance(c, RandK) and c.error_feedback)):
                raise ConfigError(
                    f"compression.upload: choco_sgd needs a contraction for Q (Koloskova et al. 2019, Assumption 1): "
                    f"topk, efsign, or randk with error_feedback: true (unscaled); {section.name!r} as configured "
                    "is unbiased, not a contraction"
                )
            c.check(self.layout.numel)
        self.mixing = metropolis_weights(self.graph)
        self.degrees = np.array([len(nb) for nb in self.neighbours])
        self.store.create(PUBLIC, self.layout.numel, on_device=True)  # x̂_i = 0 at the start (Alg. 2)
        # the one table stands for every node's own x̂_i and its copies of its neighbours' x̂_j (Alg. 2: node i
        # adds q_j to deg_i + 1 of them): the copies grow with the degree, so the peak is the graph's max degree
        self.hold("public_copy", self.model_bytes)
        self.hold("neighbour_copies", int(self.degrees.max()) * self.model_bytes)

    def unread_options(self, hp: ChocoHparams) -> dict[str, str]:
        why = "choco_sgd talks to every graph neighbour each round (Metropolis weights; choose them with the topology)"
        return {"neighbours": why}

    def messages(self, r: int, diffs: torch.Tensor) -> torch.Tensor:
        """q_i = Q(diffs_i) for every node that takes part in round ``r``, each sent to its graph neighbours: the
        ledger bills the encoded bytes once per neighbour. A dropped node sends nothing: its row is not read."""
        up = self.clients_up(r)
        if self.compressor is None:  # dense: every message one model row
            self.peer(r, "model_delta", self.model_bytes, int(self.degrees[up].sum()))
            return diffs
        c, out = self.compressor, torch.zeros_like(diffs)
        for i in up.tolist():  # the fault-free stream of node i: a dropout elsewhere changes no draw of i's
            rng = self.seeds.torch("compression", r, i, 0) if c.random else None
            encoded = c.encode(diffs[i].detach().to("cpu"), rng)
            out[i] = c.decode(encoded).to(out.device)
            self.peer(r, "model_delta", encoded.nbytes, int(self.degrees[i]))
        return out

    def round_mixing(self, r: int) -> tuple[torch.Tensor, float]:
        """W^(t) of round ``r`` and the mean over the live nodes of the neighbours each mixes with: without a
        dropout, the graph's Metropolis weights; else those with the edges to the dropped nodes removed, their
        weight on the diagonal (still symmetric and doubly stochastic; a dropped node's row is e_j)."""
        up = self.up(r) if self.faulty else None
        if up is None or up.all():
            return self.mixing, float(self.degrees.mean())
        ok = up[:, None] & up[None, :]
        M = torch.as_tensor(mixing_without(self.mixing.numpy(), ok), device="cpu")
        live = ((self.mixing.numpy() > 0) & ok & ~np.eye(self.num_clients, dtype=bool)).sum(1)
        return M, float(live[up].mean())

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        own = self.train_up(r, self.trainer, self.W)  # x^{t+1/2}; a dropped node's row: its x, untrained
        x_hat = self.store[PUBLIC]
        # x̂ + q; a dropped node sends no q, so its x̂ (every copy of it) stays as it was, bit for bit
        public = self.hold_dropped(r, x_hat + self.messages(r, own.params - x_hat), x_hat)
        M, k = self.round_mixing(r)
        mixed = gossip(public, M) - public  # sum_j w_ij (x̂_j - x̂_i), W^(t) doubly stochastic
        self.commit(PUBLIC, public)
        # the consensus step; a dropped node keeps its x (its row of W^(t) is e_j: held all the same)
        self.commit("model", self.hold_dropped(r, own.params + self.hp.gamma * mixed, self.W))
        return {"train_loss": self.train_loss(r, own), "selected_mean": k, **self.round_fault_metrics(r)}
