"""FedFomo (Zhang et al. 2020, first-order model optimization) in DFL, as in the DisPFL code (spec 5).

Per round client i trains theta_i -> theta_i'. It then receives the trained models theta_j of k
neighbours: FOMO's own choice (with probability ``greedy`` the top-k by accumulated affinity P_i, else
uniformly at random) or, as the AFIND+ plug-in, those of a :class:`NeighbourSelector`. On its local data
it weighs u_ij = (L_i(theta_i) - L_i(theta_j)) / |theta_j - theta_i| (theta_i' for j = i), keeps the
positive part normalized, u~, and sets theta_i <- theta_i + sum_j u~_ij (theta_j - theta_i) (theta_i if
no u is positive). The affinities accumulate: P_i += u_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import SCORED_ON_OWN_DATA, SCORES_ON_OWN_DATA, GraphAlgorithm, GraphHparams
from fedweave.algorithms.decentralized.selection import NeighbourSelector, ProxyComputer, SelectionHparams
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class FomoHparams(SelectionHparams, GraphHparams):
    greedy: float = 0.5  # FOMO's own choice (selection: random): P(top-k by affinity)
    finetune_epochs: int = 0

    def __post_init__(self) -> None:
        GraphHparams.__post_init__(self)
        SelectionHparams.__post_init__(self)
        if not 0 <= self.greedy <= 1:
            raise ConfigError(f"algorithm.greedy must be in [0, 1], got {self.greedy}")
        if self.selection != "random" and self.greedy != FomoHparams.greedy:  # FOMO's own choice only
            raise ConfigError(
                f"algorithm.greedy: selection {self.selection!r} chooses the neighbours itself and does not read it "
                "(FOMO's own choice, selection 'random', does); leave it out"
            )


@ALGORITHMS.register("fomo")
class Fomo(GraphAlgorithm):
    name = "fomo"
    undeployable = SCORES_ON_OWN_DATA
    dp_refusal = SCORED_ON_OWN_DATA
    Hparams = FomoHparams
    state_fields = ("affinity", "selector")

    def __init__(self, ctx: RunContext, hp: FomoHparams) -> None:
        super().__init__(ctx, hp)
        ctx.placement.check_float64("FOMO's affinities")
        ds = ctx.dataset
        self.losses = ProxyComputer(
            self.layout, ctx.model, ds.train_x, ds.train_y, ctx.partition, None, loss=ctx.task.loss
        )
        self.selector = NeighbourSelector(self, hp, weighs=False)  # it weighs what it receives by its own u~
        n = self.num_clients
        self.affinity = torch.zeros(n, n, dtype=torch.float64, device="cpu")  # host bookkeeping
        # peer i accumulates P_ij over its graph neighbours only: the peak is the graph's max degree
        self.hold("affinities", max(len(nb) for nb in self.neighbours) * self.affinity.element_size())
        # theta_i' is trained, yet the update theta_i + sum_j u~_ij (theta_j - theta_i) reads the round-start theta_i
        self.hold("start_model", self.model_bytes)

    def unread_options(self, hp: FomoHparams) -> dict[str, str]:
        if hp.selection != "afind":  # random and topk refuse the Boltzmann options themselves (SelectionHparams)
            return {}
        why = "fomo weighs what it receives by its first-order weights u~, not the afind plug-in's Boltzmann weights"
        return {"boltzmann_T": why, "boltzmann_weights": why}

    def _native(self, r: int, i: int) -> np.ndarray:
        rng = self.seeds.numpy("neighbour_selection", r, i)
        if rng.random() < self.hp.greedy:  # top-k by affinity, of which the reachable ones answer
            # k as without faults: which random peers are unreachable has no bearing on the top-k contacted
            nb = self.neighbours[i]
            budget = min(self.hp.neighbours, len(nb))
            k = budget if self.hp.select_k is None else min(self.hp.select_k, budget)
            return self.reachable(r, i, np.sort(nb[np.argsort(-self.affinity[i, nb].numpy(), kind="stable")[:k]]))
        avail = self.available(r, i)
        k = len(avail) if self.hp.select_k is None else min(self.hp.select_k, len(avail))
        return np.sort(rng.choice(avail, size=k, replace=False)) if k < len(avail) else avail

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        n, W0 = self.num_clients, self.W
        own = self.train_up(r, self.trainer, W0)
        sent = own.params
        if self.hp.selection == "random":
            chosen_all = [self._native(r, i) if self.is_up(r, i) else np.zeros(0, dtype=np.int64) for i in range(n)]
        else:
            chosen_all = [c for c, _ in self.selector.select(r, W0, sent)]
        new = torch.empty_like(W0)
        for i, chosen in enumerate(chosen_all):
            if not self.is_up(r, i):  # dropped out: no messages, affinities and model unchanged
                new[i] = W0[i]
                continue
            self.peer(r, "model", self.model_bytes, len(chosen))
            models = torch.stack([sent[i], *(self.noisy(sent[j], r, int(j), i) for j in chosen)])
            base_loss = float(self.losses.losses(W0[i], [i])[0])
            dist = (models - W0[i]).double().norm(dim=1).clamp_min(1e-12).cpu()  # to the host bookkeeping
            u = (base_loss - self.losses.model_losses(models, i)) / dist
            self.hold_received(len(chosen))  # weighed together on i's data
            self.hold("scores", u.numel() * u.element_size())  # u_ij over theta_i' and the received models
            self.affinity[i, chosen] += u[1:]
            pos = u.clamp_min(0)
            if pos.sum() > 0:
                wts = self.on_device(pos / pos.sum(), W0)
                new[i] = W0[i] + (wts[:, None] * (models - W0[i])).sum(0)
            else:
                new[i] = W0[i]
        self.commit("model", new)
        sizes = torch.tensor([float(len(c)) for c in chosen_all], dtype=torch.float64, device="cpu")
        return {
            "train_loss": self.train_loss(r, own),
            "selected_mean": self.mean_over_up(r, sizes),
            **self.round_fault_metrics(r),
        }
