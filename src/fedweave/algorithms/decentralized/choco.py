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
refused). Injected faults are refused: a node that misses a q_j would hold a copy of x̂_j that its neighbours do
not, and the algorithm assumes none (reliable synchronous links).
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
    handles_faults: ClassVar[tuple[str, ...]] = ()  # reliable links assumed (module docstring)
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

    def unread_options(self, hp: ChocoHparams) -> dict[str, str]:
        why = "choco_sgd talks to every graph neighbour each round (Metropolis weights; choose them with the topology)"
        return {"neighbours": why}

    def messages(self, r: int, diffs: torch.Tensor) -> torch.Tensor:
        """q_i = Q(diffs_i) for every node, each sent to its graph neighbours: the ledger bills the encoded bytes
        once per neighbour."""
        if self.compressor is None:  # dense: every message one model row
            self.peer(r, "model_delta", self.model_bytes, int(self.degrees.sum()))
            return diffs
        c, out = self.compressor, torch.empty_like(diffs)
        for i, d in enumerate(self.degrees.tolist()):
            rng = self.seeds.torch("compression", r, i, 0) if c.random else None
            encoded = c.encode(diffs[i].detach().to("cpu"), rng)
            out[i] = c.decode(encoded).to(out.device)
            self.peer(r, "model_delta", encoded.nbytes, d)
        return out

    def run_round(self, r: int) -> dict[str, float]:
        own = self.train_up(r, self.trainer, self.W)  # x^{t+1/2}
        public = self.store[PUBLIC] + self.messages(r, own.params - self.store[PUBLIC])  # x̂ + q
        mixed = gossip(public, self.mixing) - public  # sum_j w_ij (x̂_j - x̂_i), w doubly stochastic
        self.commit(PUBLIC, public)
        self.commit("model", own.params + self.hp.gamma * mixed)  # the consensus step
        return {"train_loss": float(own.loss.mean()), "selected_mean": float(self.degrees.mean())}
