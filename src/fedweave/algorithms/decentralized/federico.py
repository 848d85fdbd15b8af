"""FedeRiCo, "Find your friends" (Sui et al. 2022), as summarized in afind-plus spec 5.

Client i keeps weights pi_i over its neighbours and itself (uniform at first) and tracked losses L_ij.
Each round: with probability eps it samples ``neighbours`` uniformly, otherwise takes the ones with the
largest pi_ij (epsilon-greedy); receives their round-start models, measures l_ij = F_i(w_j) on its own
training data, tracks L_ij <- (1-b) L_ij + b l_ij, runs the E-step pi_ij <- pi_ij exp(-L_ij) (normalized,
i itself included with l_ii), aggregates the received models and its own with pi restricted to them
(renormalized), then trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import SCORED_ON_OWN_DATA, SCORES_ON_OWN_DATA, GraphAlgorithm, GraphHparams
from fedweave.algorithms.decentralized.selection import ProxyComputer
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class FedeRiCoHparams(GraphHparams):
    eps: float = 0.3  # exploration probability of the epsilon-greedy sampling
    loss_beta: float = 0.9  # b: weight of the new loss in the tracked loss

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.eps <= 1:
            raise ConfigError(f"algorithm.eps must be in [0, 1], got {self.eps}")
        if not 0 < self.loss_beta <= 1:
            raise ConfigError(f"algorithm.loss_beta must be in (0, 1], got {self.loss_beta}")


@ALGORITHMS.register("federico")
class FedeRiCo(GraphAlgorithm):
    name = "federico"
    undeployable = SCORES_ON_OWN_DATA
    dp_refusal = SCORED_ON_OWN_DATA
    Hparams = FedeRiCoHparams
    state_fields = ("pi", "tracked")

    def __init__(self, ctx: RunContext, hp: FedeRiCoHparams) -> None:
        super().__init__(ctx, hp)
        ds = ctx.dataset
        self.proxy = ProxyComputer(
            self.layout, ctx.model, ds.train_x, ds.train_y, ctx.partition, None, loss=ctx.task.loss
        )
        n = self.num_clients
        adj = torch.eye(n, dtype=torch.bool, device="cpu")  # host bookkeeping
        for i, nb in enumerate(self.neighbours):
            adj[i, nb] = True
        self.pi = adj.double() / adj.sum(1, keepdim=True)  # uniform over S_i and i
        self.tracked = torch.full((n, n), float("nan"), dtype=torch.float64, device="cpu")
        # peer i keeps pi_ij and L_ij over its graph neighbours and itself: the peak is the max degree + 1
        held = max(len(nb) for nb in self.neighbours) + 1
        self.hold("mixture_weights", held * self.pi.element_size())
        self.hold("tracked_losses", held * self.tracked.element_size())

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        n, W0, b = self.num_clients, self.W, self.hp.loss_beta
        mixed = torch.empty_like(W0)
        sizes = []
        for i in range(n):
            if not self.is_up(r, i):  # dropped out: no messages, weights and model unchanged
                mixed[i] = W0[i]
                continue
            nb = self.neighbours[i]
            rng = self.seeds.numpy("neighbour_selection", r, i)
            k = min(self.hp.neighbours, len(nb))
            if rng.random() < self.hp.eps:
                chosen = self.available(r, i)
            else:  # the k largest weights (ties by id), of which the reachable ones answer
                chosen = self.reachable(r, i, np.sort(nb[np.argsort(-self.pi[i, nb].numpy(), kind="stable")[:k]]))
            self.peer(r, "model", self.model_bytes, len(chosen))
            received = torch.stack([self.noisy(W0[j], r, int(j), i) for j in chosen]) if len(chosen) else W0[:0]
            group = [i, *chosen.tolist()]
            losses = self.proxy.model_losses(torch.cat([W0[i : i + 1], received]), i)
            self.hold_received(len(chosen))  # scored, then aggregated together
            old = self.tracked[i, group]
            self.tracked[i, group] = torch.where(old.isnan(), losses, (1 - b) * old + b * losses)
            post = self.pi[i, group] * torch.exp(-self.tracked[i, group])  # E-step
            if not post.sum() > 0:  # every exp(-L) underflowed (losses above ~745): the same ratios, shifted
                post = self.pi[i, group] * torch.exp(-(self.tracked[i, group] - self.tracked[i, group].min()))
            self.pi[i, group] = post / post.sum() * self.pi[i, group].sum()
            self.pi[i] /= self.pi[i].sum()
            wts = self.on_device(self.pi[i, group] / self.pi[i, group].sum(), W0)
            mixed[i] = (wts[:, None] * torch.cat([W0[i : i + 1], received])).sum(0)
            sizes.append(len(chosen))
        own = self.train_up(r, self.trainer, mixed)
        self.commit("model", self.hold_dropped(r, own.params, W0))
        return {
            "train_loss": self.train_loss(r, own),
            "selected_mean": float(np.mean(sizes)),
            **self.round_fault_metrics(r),
        }
