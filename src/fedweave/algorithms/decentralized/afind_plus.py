"""AFIND+ (Wang, Chen, Guo, Tang 2024, "Smart Sampling: Helping from Friendly Neighbors for DFL").

Per round and client i (spec 2.5; all reads from round-start state, all writes committed at the end):
  R1  B_i^t: ``neighbours`` random graph neighbours (resolved) or all of them (literal, Alg. 1)
  R2-R4  i sends w_i^t to its pool; each j returns phi_j = grad of the proxy layer of F_j at w_i^t and
      F_j(w_i^t); p_ij by Eq. (8) (resolved) or Eq. (9) over the coreset (literal)
  R5  C_i^t = {j : p_ij >= theta_i} (or top-k / random / all: the ablations of Table 2)
  R6  j in C_i^t trains a copy of w_i^t on its data (Alg. 1 line 7, ``train_copy``) and returns it with
      F~_j = (1-gamma) F_j(after) + gamma F_j(before) (Eq. 15); ``own_model`` sends j's own new model
  R7  i trains its own model (lines 17-23)
  R8  w_i^{t+1} = sum_{j in C_i + {i}} varpi_ij w_j, varpi = exp(-F~/T)/Z (Eq. 16) or uniform (AFIND)
  R9  theta_i^{t+1} = tau (1 - sigmoid(h_i)), h_i = -sum_{C_i} e ln e, e = (s+1)/2 (Eqs. 10-13)
Evaluation: FedAvg-FT backbone (1 fine-tune epoch on a copy), mean of per-client accuracies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.selection import (
    AfindOptions,
    AfindState,
    ProxyComputer,
    Selection,
    boltzmann,
    cosine,
    smoothed_loss,
)
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS
from fedweave.topology.graph import COPY_KEY, GraphAlgorithm, GraphHparams


@dataclass
class AfindPlusHparams(GraphHparams):
    reading: Literal["resolved", "literal"] = "resolved"  # spec 2.5 / Alg. 1 as printed (2.7)
    selection: Selection = "threshold"  # threshold (AFIND+), topk (Table 2 "+i"), random, all
    aggregation: Literal["boltzmann", "uniform"] = "boltzmann"  # Eq. 16 / AFIND
    exchange: Literal["train_copy", "own_model"] = "train_copy"  # A5
    tau: float = 0.5  # global threshold constant (Eq. 13)
    upsilon: float = 0.1  # proxy softmax temperature (Eq. 8; A3)
    loss_gamma: float = 0.9  # loss smoothing (Eq. 15)
    boltzmann_T: float = 1.0  # Boltzmann temperature (Eq. 14)
    topk: int = 5  # selection = topk / random: how many of the pool
    include_self: bool = True  # A6
    theta0: float = 0.0  # A2
    h_mode: Literal["sum", "mean"] = "sum"  # A9
    empty_fallback: Literal["none", "top1"] = "none"  # A7
    loss_smoothing: Literal["eq15", "ema_rounds"] = "eq15"  # A11
    proxy_layer: Literal["featurizer", "classifier"] = "featurizer"  # A4
    proxy_samples: int | None = None  # proxy data: full local train set (null) or a fixed random subset

    def __post_init__(self) -> None:
        super().__post_init__()
        self.afind_options().validate()
        if not 0 <= self.loss_gamma <= 1:
            raise ConfigError(f"algorithm.loss_gamma must be in [0, 1], got {self.loss_gamma}")
        if self.boltzmann_T <= 0:
            raise ConfigError(f"algorithm.boltzmann_T must be > 0, got {self.boltzmann_T}")
        if self.proxy_samples is not None and self.proxy_samples < 1:
            raise ConfigError(f"algorithm.proxy_samples must be >= 1 or null, got {self.proxy_samples}")

    def afind_options(self) -> AfindOptions:
        return AfindOptions(
            reading=self.reading,
            selection=self.selection,
            tau=self.tau,
            upsilon=self.upsilon,
            topk=self.topk,
            theta0=self.theta0,
            h_mode=self.h_mode,
            empty_fallback=self.empty_fallback,
        )


@ALGORITHMS.register("afind_plus")
class AfindPlus(GraphAlgorithm):
    name = "afind_plus"
    Hparams = AfindPlusHparams

    def __init__(self, ctx: RunContext, hp: AfindPlusHparams) -> None:
        super().__init__(ctx, hp)
        ds = ctx.dataset
        self.proxy = ProxyComputer(
            self.layout,
            ctx.model,
            ds.train_x,
            ds.train_y,
            ctx.partition,
            hp.proxy_layer,
            hp.proxy_samples,
            self.seeds.int_seed("proxy_data"),
        )
        self.state = AfindState(self.neighbours, hp.afind_options())
        n = self.num_clients
        self.prev_loss = torch.full((n, n), float("nan"), dtype=torch.float64)  # ema_rounds smoothing
        self.last_coreset: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "afind": self.state.state_dict(), "prev_loss": self.prev_loss.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.state.load_state_dict(state.pop("afind"))
        self.prev_loss = state.pop("prev_loss").clone()
        super().load_state_dict(state)

    def _smooth(self, i: int, j: int, after: float, before: float) -> float:
        g = self.hp.loss_gamma
        if self.hp.loss_smoothing == "eq15":  # Eq. (15): same-round before/after
            return float(smoothed_loss(torch.tensor(after), torch.tensor(before), g))
        prev = float(self.prev_loss[i, j])  # A11 option: EMA over rounds
        val = after if np.isnan(prev) else (1 - g) * after + g * prev
        self.prev_loss[i, j] = val
        return val

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.fault_metrics(r)
        hp, n = self.hp, self.num_clients
        W0 = self.W  # round-start models: read-only until commit
        own = self.trainer.train(W0, range(n), r)  # R7, lines 17-23
        new = torch.empty_like(W0)
        d_phi = self.proxy.size
        sizes, thetas, s_in, s_out, ov_in, ov_pool = [], [], [], [], [], []
        for i in range(n):
            if not self.is_up(r, i):  # dropped out: no messages, threshold and model unchanged
                new[i] = W0[i]
                continue
            rng = self.seeds.numpy("neighbour_selection", r, i)
            avail = self.available(r, i) if hp.reading == "resolved" else self.reachable(r, i, self.neighbours[i])
            thetas.append(float(self.state.theta[i]))
            pool = self.reachable(r, i, self.state.pool(i, avail, rng))  # literal: C_i from the stored p
            # R2-R3: w_i^t -> each j in the pool; phi_j(w_i^t) and F_j(w_i^t) come back
            phis, lpre = self.proxy.proxies(W0[i], [i, *pool.tolist()])
            phis = torch.stack([self.noisy(phis[q], r, int(c), i, 1) for q, c in enumerate([i, *pool])])
            self.peer(r, "model", self.model_bytes, len(pool))
            self.peer(r, "feature_proxy", d_phi * 4, len(pool))
            self.peer(r, "loss", 4, len(pool))
            sims = cosine(phis[0], phis[1:])
            pos = self.state.choose(i, pool, sims, rng)  # R4-R5 (Eq. 8 or 9, threshold)
            self.state.set_threshold(i, sims[pos])  # R9 (Eqs. 10-13), used next round
            C = pool[pos]
            rest = np.setdiff1d(np.arange(len(pool)), pos)
            self.last_coreset[i] = C
            sizes.append(len(C))
            if len(pos):
                s_in.append(float(sims[pos].mean()))
                ov_in.append(float(self.label_overlap[i, C].mean()))
            if len(rest):
                s_out.append(float(sims[rest].mean()))
            if len(pool):
                ov_pool.append(float(self.label_overlap[i, pool].mean()))

            # R6: the coreset's contributions and their smoothed losses (Eq. 15)
            if len(C) and hp.exchange == "train_copy":  # Alg. 1 line 7: w_j^{t,0} = w_i^t
                models = self.trainer.train(W0[i], C.tolist(), r, key=(COPY_KEY + i,)).params
                after = [float(self.proxy.losses(models[q], [int(j)])[0]) for q, j in enumerate(C)]
                before = lpre[1:][pos].tolist()
            elif len(C):  # own_model: j's own new model, judged on i's data (as PENS/FedeRiCo)
                models = own.params[C]
                after = self.proxy.model_losses(models, i).tolist()
                before = self.proxy.model_losses(W0[C], i).tolist()
            else:
                models, after, before = W0[:0], [], []
            self.peer(r, "model", self.model_bytes, len(C))
            self.peer(r, "loss", 4, len(C))
            models = (
                torch.stack([self.noisy(models[q], r, int(j), i, 2) for q, j in enumerate(C)]) if len(C) else models
            )
            losses = [self._smooth(i, int(j), a, b) for j, a, b in zip(C, after, before)]

            # R8: aggregate over C_i (+ i itself, A6) with Eq. (16) or uniform weights
            cand, cand_loss = list(models), losses
            if hp.include_self:
                self_after = float(self.proxy.losses(own.params[i], [i])[0])
                cand = [own.params[i], *cand]
                cand_loss = [self._smooth(i, i, self_after, float(lpre[0])), *losses]
            if not cand:  # empty coreset without self: keep the own update (A7)
                new[i] = own.params[i]
                continue
            if hp.aggregation == "boltzmann":
                wts = boltzmann(torch.tensor(cand_loss, dtype=torch.float64), hp.boltzmann_T)
            else:
                wts = torch.full((len(cand),), 1.0 / len(cand), dtype=torch.float64)
            new[i] = (wts.to(W0.dtype)[:, None] * torch.stack(cand)).sum(0)
        self.state.end_round()
        self.commit("model", new)
        out = {
            **self.fault_metrics(r),
            "train_loss": self.mean_over_up(r, own.loss),
            "selected_mean": float(np.mean(sizes)),
            "selected_min": float(np.min(sizes)),
            "selected_max": float(np.max(sizes)),
            "theta_mean": float(np.mean(thetas)),
        }
        # diagnostics (spec 2.5 notes); omitted in a round where a group is empty
        for key, vals in (("sim_selected", s_in), ("sim_rejected", s_out)):
            if vals:
                out[key] = float(np.mean(vals))
        for key, vals in (("overlap_selected", ov_in), ("overlap_pool", ov_pool)):
            if vals:
                out[key] = float(np.mean(vals))
        return out


@dataclass
class AfindHparams(AfindPlusHparams):
    aggregation: Literal["boltzmann", "uniform"] = "uniform"


@ALGORITHMS.register("afind")
class Afind(AfindPlus):
    """AFIND = AFIND+ with uniform aggregation over the selected set (Sec. 5.1, Fig. 4)."""

    name = "afind"
    Hparams = AfindHparams
