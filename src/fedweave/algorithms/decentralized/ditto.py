"""Ditto (Li, Hu, Beirami, Smith, ICML 2021) in DFL, with a pluggable neighbour selection (AFIND+ plug-in).

Each client keeps a shared model w_i and a personal model v_i (both rows of the state store). Per round:
  w_i <- sum_{j in {i} + R_i} a_ij w_j     (R_i and a_ij from the selector: random/uniform by default,
                                           AFIND+'s threshold and Boltzmann weights with selection: afind)
  w_i <- K local epochs of SGD on F_i from w_i
  v_i <- ``personal_epochs`` of SGD on F_i(v) + (lambda/2) |v - w_i|^2 from v_i, anchored at the
         aggregated w_i of the round (Ditto Alg. 1; DisPFL's script: lambda = 0.5)
The personal models v_i are evaluated (no extra fine-tuning by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.base import ProximalRule, RunContext, check_ditto
from fedweave.algorithms.decentralized.base import GraphAlgorithm, GraphHparams, with_local
from fedweave.algorithms.decentralized.selection import NeighbourSelector, SelectionHparams
from fedweave.registry import ALGORITHMS


@dataclass
class DittoHparams(SelectionHparams, GraphHparams):
    lam: float = 0.5
    personal_epochs: int = 3
    finetune_epochs: int = 0  # Ditto evaluates its personal models as they are

    def __post_init__(self) -> None:
        GraphHparams.__post_init__(self)
        SelectionHparams.__post_init__(self)
        check_ditto(self.lam, self.personal_epochs)


@ALGORITHMS.register("ditto")
class Ditto(GraphAlgorithm):
    name = "ditto"
    Hparams = DittoHparams
    state_fields = ("selector",)  # its neighbour selection's state (AFIND's thresholds)
    undeployable = "its personal models never leave their peers, and the deployment keeps no peer state on the nodes"
    # privacy: the shared models come from the DP-SGD steps only (with selection random); the personal models are
    # trained by plain SGD and never sent, so they are not covered (docs/privacy.md)
    dp_refusal = None

    def __init__(self, ctx: RunContext, hp: DittoHparams) -> None:
        super().__init__(ctx, hp)
        self.store.create("personal", self.layout.numel, fill=self.W[0], on_device=True)
        self.hold("personal_model", self.model_bytes)  # v_i beside the shared w_i (Ditto Alg. 1)
        # from the plain trainer: the personal model never leaves the client, so DP-SGD is not applied to it
        self.personal_trainer = with_local(self.ft_trainer, epochs=hp.personal_epochs, steps=None)
        self.selector = NeighbourSelector(self, hp)

    def eval_models(self, r: int) -> torch.Tensor:
        return self.store["personal"]

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        W0, V0 = self.W, self.store["personal"]
        mixed = torch.empty_like(W0)
        picks = self.selector.select(r, W0)  # a dropped client selects nobody and keeps w_i
        for i, (chosen, wts) in enumerate(picks):
            self.peer(r, "model", self.model_bytes, len(chosen))
            self.hold_received(len(chosen))  # mixed together into w_i
            rows = [W0[i], *(self.noisy(W0[j], r, int(j), i) for j in chosen)]
            mixed[i] = (self.on_device(wts, W0)[:, None] * torch.stack(rows)).sum(0)
        shared = self.train_up(r, self.trainer, mixed)
        rule = ProximalRule(self.hp.lam, mixed)
        personal = self.train_up(r, self.personal_trainer, V0, rule=rule, key=(1,))
        self.commit("model", self.hold_dropped(r, shared.params, W0))
        self.commit("personal", personal.params)  # a dropped client's v_i: untrained, unchanged
        sizes = torch.tensor([float(len(c)) for c, _ in picks], dtype=torch.float64, device="cpu")
        return {
            "train_loss": self.train_loss(r, personal),
            "selected_mean": self.mean_over_up(r, sizes),
            **self.round_fault_metrics(r),
        }
