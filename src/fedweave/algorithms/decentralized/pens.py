"""PENS, performance-based neighbour selection (Onoszko et al. 2021), as summarized in afind-plus spec 5.

Phase 1 (rounds < T_1): client i receives the round-start models of ``neighbours`` (n_s) random
neighbours, keeps the ``m_top`` with the lowest loss on its own training data, counts c_ij += 1 for each,
averages them with its own model (weights proportional to n_j) and trains. Then
N_i = {j : c_ij > E_i}, E_i = T_1 m_top / |S_i| (the count expected under random choice). Phase 2:
each round i samples m_top neighbours uniformly from N_i (all if fewer), averages, trains.
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
class PENSHparams(GraphHparams):
    m_top: int = 5
    phase1_rounds: int = 50  # T_1 (10% of T = 500; spec 5 suggestion)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.m_top < 1:
            raise ConfigError(f"algorithm.m_top must be >= 1, got {self.m_top}")
        if self.phase1_rounds < 1:
            raise ConfigError(f"algorithm.phase1_rounds must be >= 1, got {self.phase1_rounds}")
        if self.m_top >= self.neighbours:
            raise ConfigError(
                f"algorithm.m_top ({self.m_top}) must be below algorithm.neighbours ({self.neighbours}, n_s): PENS "
                "keeps the m_top best of the n_s models it samples, so with m_top >= n_s it selects nothing"
            )


@ALGORITHMS.register("pens")
class PENS(GraphAlgorithm):
    name = "pens"
    undeployable = SCORES_ON_OWN_DATA
    dp_refusal = SCORED_ON_OWN_DATA
    Hparams = PENSHparams
    state_fields = ("counts",)

    def __init__(self, ctx: RunContext, hp: PENSHparams) -> None:
        super().__init__(ctx, hp)
        ds = ctx.dataset
        self.proxy = ProxyComputer(
            self.layout, ctx.model, ds.train_x, ds.train_y, ctx.partition, None, loss=ctx.task.loss
        )
        n = self.num_clients
        self.counts = torch.zeros(n, n, dtype=torch.long, device="cpu")  # c_ij (host bookkeeping)
        # peer i counts c_ij over its graph neighbours only: the peak is the graph's max degree
        self.hold("counts", max(len(nb) for nb in self.neighbours) * self.counts.element_size())
        self.sizes = torch.tensor([len(p) for p in ctx.partition], dtype=torch.float64, device="cpu")
        # E_i = T_1 m_top / |S_i| is the count under random choice only while i samples more than m_top models a
        # round; a client with too few graph neighbours would keep all of them, exceed E_i never, and be left
        # with an empty N_i in phase 2 (local training alone)
        short = [i for i, nb in enumerate(self.neighbours) if min(hp.neighbours, len(nb)) <= hp.m_top]
        if short:
            i = short[0]
            raise ConfigError(
                f"algorithm.m_top ({hp.m_top}) must be below the models client {i} samples a round, "
                f"min(algorithm.neighbours, its {len(self.neighbours[i])} graph neighbours) on topology "
                f"{hp.topology!r}; lower m_top or use a denser graph"
            )

    def preferred(self, i: int) -> np.ndarray:
        """N_i: neighbours chosen more often than expected under random selection."""
        nb = self.neighbours[i]
        expected = self.hp.phase1_rounds * self.hp.m_top / len(nb)
        return nb[(self.counts[i, nb] > expected).numpy()]

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        hp, n, W0 = self.hp, self.num_clients, self.W
        mixed = torch.empty_like(W0)
        sizes = []
        for i in range(n):
            if not self.is_up(r, i):  # dropped out: no messages, counts and model unchanged
                mixed[i] = W0[i]
                continue
            if r < hp.phase1_rounds:  # phase 1: n_s random models, keep the m_top best on local data
                avail = self.available(r, i)  # those that arrive
                self.peer(r, "model", self.model_bytes, len(avail))
                if len(avail):
                    received = torch.stack([self.noisy(W0[j], r, int(j), i) for j in avail])
                    losses = self.proxy.model_losses(received, i)
                    self.hold_received(len(avail))  # scored together: the m_top lowest losses are kept
                    self.hold("scores", losses.numel() * losses.element_size())  # F_i(w_j) per received model
                    keep = np.sort(np.argsort(losses.numpy(), kind="stable")[: hp.m_top])
                    chosen, models = avail[keep], received[keep]
                else:
                    chosen, models = avail, W0[:0]
                self.counts[i, chosen] += 1
            else:  # phase 2: m_top uniformly from N_i
                pref = self.preferred(i)
                rng = self.seeds.numpy("neighbour_sampling", r, i)
                k = min(hp.m_top, len(pref))
                chosen = np.sort(rng.choice(pref, size=k, replace=False)) if k < len(pref) else pref
                chosen = self.reachable(r, i, chosen)
                self.peer(r, "model", self.model_bytes, len(chosen))
                self.hold_received(len(chosen))  # averaged together
                models = torch.stack([self.noisy(W0[j], r, int(j), i) for j in chosen]) if len(chosen) else W0[:0]
            wts = self.sizes[[i, *chosen.tolist()]]
            wts = self.on_device(wts / wts.sum(), W0)  # re-normalized over the models that arrived
            mixed[i] = (wts[:, None] * torch.cat([W0[i : i + 1], models])).sum(0)
            sizes.append(len(chosen))
        own = self.train_up(r, self.trainer, mixed)  # aggregate, then train
        self.commit("model", self.hold_dropped(r, own.params, W0))
        return {
            "train_loss": self.train_loss(r, own),
            "selected_mean": float(np.mean(sizes)),
            **self.round_fault_metrics(r),
        }
