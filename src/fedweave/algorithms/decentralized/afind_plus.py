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

Partial personalization (``personal: head``, Alg. 1's general form, spec A15): the classifier layer is the
personal block beta_i, never sent. Local update = ``head_epochs`` (K_beta) epochs on beta with w frozen,
then K_w epochs on w with the new beta frozen (lines 17-23); neighbour j computes its proxy, losses and
trained copy at (w_i, beta_j) with a copy of its own beta_j (A5); only w is aggregated (line 13) and only w
is on the wire (ledger bytes of the shared part). Spec A15 evaluates this mode without fine-tuning
(``finetune_epochs: 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import (
    COPY_KEY,
    SCORED_ON_OWN_DATA,
    SCORES_ON_OWN_DATA,
    GraphAlgorithm,
    GraphHparams,
    with_local,
)
from fedweave.algorithms.decentralized.selection import (
    AfindOptions,
    AfindState,
    ProxyComputer,
    Selection,
    boltzmann,
    cosine,
    declared_layer,
    smoothed_loss,
)
from fedweave.config import MAX_LOCAL_EPOCHS, ConfigError
from fedweave.execution import LocalResult, LocalRule
from fedweave.registry import ALGORITHMS

HEAD_KEY = 1_000_081  # batch-stream key of the personal-head epochs (K_beta) of a local update


class FrozenRule(LocalRule):
    """SGD on the coordinates in ``mask`` only; the others stay at their start values ``anchor`` (per job)."""

    def __init__(self, mask: torch.Tensor, anchor: torch.Tensor) -> None:
        self.mask, self.anchor = mask, anchor
        self._scale = mask.to(anchor.dtype)

    def direction(self, w, grad, jobs):
        return grad(w) * self._scale

    def project(self, w, jobs):  # also undoes weight decay on the frozen block
        return torch.where(self.mask, w, self.anchor[jobs])


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
    personal: Literal["none", "head"] = "none"  # A15: beta = nothing (FedAvg-FT backbone) or the classifier
    head_epochs: int = 1  # K_beta: local epochs on the personal head before the K_w epochs on w (A14)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.afind_options().validate()
        if not 0 <= self.loss_gamma <= 1:
            raise ConfigError(f"algorithm.loss_gamma must be in [0, 1], got {self.loss_gamma}")
        if self.boltzmann_T <= 0:
            raise ConfigError(f"algorithm.boltzmann_T must be > 0, got {self.boltzmann_T}")
        if self.proxy_samples is not None and self.proxy_samples < 1:
            raise ConfigError(f"algorithm.proxy_samples must be >= 1 or null, got {self.proxy_samples}")
        if not 1 <= self.head_epochs <= MAX_LOCAL_EPOCHS:  # bounded as local.epochs is: 1e300 would never end
            raise ConfigError(f"algorithm.head_epochs must be in [1, {MAX_LOCAL_EPOCHS:,}], got {self.head_epochs:.6g}")
        if self.personal == "head" and self.proxy_layer == "classifier":
            raise ConfigError(
                "algorithm.proxy_layer 'classifier' is the personal head with personal 'head'; use 'featurizer'"
            )

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
    undeployable = SCORES_ON_OWN_DATA
    dp_refusal = SCORED_ON_OWN_DATA

    def __init__(self, ctx: RunContext, hp: AfindPlusHparams) -> None:
        super().__init__(ctx, hp)
        ctx.placement.check_float64("AFIND+'s similarities")
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
            loss=ctx.task.loss,
        )
        self.state = AfindState(self.neighbours, hp.afind_options())
        n = self.num_clients
        # ema_rounds smoothing (host bookkeeping)
        self.prev_loss = torch.full((n, n), float("nan"), dtype=torch.float64, device="cpu")
        self.last_coreset: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
        # peer i keeps theta_i, the literal reading's p_ij over its graph neighbours (Alg. 1 Init) and the
        # ema_rounds smoothing's F~_ij over them and itself: the peak is at the graph's max degree
        deg = max(len(nb) for nb in self.neighbours)
        kept = 1 + (deg if hp.reading == "literal" else 0) + (deg + 1 if hp.loss_smoothing == "ema_rounds" else 0)
        self.hold("selection_state", kept * self.prev_loss.element_size())
        self.head: torch.Tensor | None = None  # bool mask of the personal block beta over the flat parameters
        if hp.personal == "head":
            names = set(declared_layer(ctx.model, "classifier", "personal 'head'"))
            self.head = torch.cat(
                [
                    torch.full((k,), nm in names, device=ctx.device)
                    for nm, k in zip(self.layout.names, self.layout.numels, strict=True)
                ]
            )
            self.model_bytes = int((~self.head).sum()) * ctx.float_bytes  # only w is sent
            # beta never leaves the client: its epochs are plain SGD even under DP-SGD
            self.head_trainer = with_local(self.ft_trainer, epochs=hp.head_epochs, steps=None)

    def unread_options(self, hp: AfindPlusHparams) -> dict[str, str]:
        out, me = {}, self.name
        if hp.reading == "literal":
            out["neighbours"] = (
                f"{me} with reading 'literal' takes every graph neighbour each round (Alg. 1 as printed; or use "
                "reading 'resolved')"
            )
        if hp.selection != "threshold":  # theta_i (Eqs. 10-13) is still logged, but chooses nobody
            why = f"{me} with selection {hp.selection!r} applies no threshold (Alg. 1 lines 3-5; threshold does)"
            out.update(dict.fromkeys(("tau", "theta0", "h_mode", "empty_fallback"), why))
        if hp.selection in ("threshold", "all"):
            out["topk"] = f"{me} with selection {hp.selection!r} keeps no fixed number of neighbours (topk, random do)"
        if hp.selection in ("random", "all"):
            out["upsilon"] = f"{me} with selection {hp.selection!r} does not rank the pool by Eq. (8) (threshold does)"
        if hp.aggregation == "uniform":  # the smoothed losses F~ (Eq. 15) only feed the Boltzmann weights
            why = f"{me} with aggregation 'uniform' does not weigh by the smoothed losses (Eqs. 14-16; boltzmann does)"
            out.update(dict.fromkeys(("boltzmann_T", "loss_gamma", "loss_smoothing"), why))
        if hp.personal == "none":
            out["head_epochs"] = f"{me} with personal 'none' has no personal head to train (personal 'head' does)"
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "afind": self.state.state_dict(), "prev_loss": self.prev_loss.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.state.load_state_dict(state.pop("afind"))
        self.prev_loss = state.pop("prev_loss").cpu().clone()  # host bookkeeping
        super().load_state_dict(state)

    @property
    def reads_before(self) -> bool:
        """Whether a neighbour's F~ reads its before loss F(w^t): Eq. (15) with gamma != 0, when F~ weighs the
        aggregate (Eq. 16). Not under ema_rounds (A11), gamma 0 (F~ = the after loss) or uniform weights."""
        hp = self.hp
        return hp.aggregation == "boltzmann" and hp.loss_smoothing == "eq15" and hp.loss_gamma != 0

    def judged(self, models: torch.Tensor, own_i: torch.Tensor) -> torch.Tensor:
        """The rows i scores on its data in own_model (A5): the shared part of each, with i's own beta_i."""
        return models if self.head is None else torch.where(self.head, own_i, models)

    def _smooth(self, i: int, j: int, after: float, before: float | None) -> float:
        """F~_ij (Eq. 15, or A11's ema_rounds). ``before`` is None where it is not read (:attr:`reads_before`)."""
        g = self.hp.loss_gamma
        if self.hp.loss_smoothing == "eq15":  # Eq. (15): same-round before/after
            if before is None:  # gamma 0 (or unweighted): F~ is the after loss, (1 - 0) * after exactly
                return after
            # at the run's precision: a float64 run keeps F~ exact; float32 is what the committed records used
            dt = self.ctx.dtype
            return float(
                smoothed_loss(
                    torch.tensor(after, dtype=dt, device="cpu"), torch.tensor(before, dtype=dt, device="cpu"), g
                )
            )
        prev = float(self.prev_loss[i, j])  # A11 option: EMA over rounds
        val = after if np.isnan(prev) else (1 - g) * after + g * prev
        self.prev_loss[i, j] = val
        return val

    def local_update(self, starts: torch.Tensor, clients, r: int, key: tuple[int, ...] = ()) -> LocalResult:
        """Alg. 1 lines 17-23: K_beta epochs on beta (w frozen), then K_w epochs on w (new beta frozen)."""
        if self.head is None:
            return self.trainer.train(starts, clients, r, key=key)
        starts = starts if starts.dim() == 2 else starts.expand(len(clients), -1)
        h = self.head_trainer.train(starts, clients, r, rule=FrozenRule(self.head, starts), key=(*key, HEAD_KEY))
        return self.trainer.train(h.params, clients, r, rule=FrozenRule(~self.head, h.params), key=key)

    def at(self, W: torch.Tensor, i: int, j: int) -> torch.Tensor:
        """The parameters j evaluates for i: (w_i, beta_j) with a personal head, else w_i."""
        return W[i] if self.head is None else torch.where(self.head, W[j], W[i])

    def proxies_for(self, W: torch.Tensor, i: int, peers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """phi_j and F_j at (w_i^t, beta_j^t) for j in [i, *peers] (R2-R3)."""
        if self.head is None:
            return self.proxy.proxies(W[i], [i, *peers])
        got = [self.proxy.proxies(self.at(W, i, j), [j]) for j in [i, *peers]]
        return torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        hp, n = self.hp, self.num_clients
        W0 = self.W  # round-start models: read-only until commit
        up = self.clients_up(r)  # R7, lines 17-23 (a dropped client trains nothing)
        own = self.fill_dropped(r, self.local_update(W0[torch.as_tensor(up, device=W0.device)], up, r), W0)
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
            phis, lpre = self.proxies_for(W0, i, pool.tolist())
            phis = torch.stack([self.noisy(phis[q], r, int(c), i, 1) for q, c in enumerate([i, *pool])])
            self.peer(r, "model", self.model_bytes, len(pool))
            self.peer(r, "feature_proxy", d_phi * self.ctx.float_bytes, len(pool))  # at the model's width
            self.peer(r, "loss", self.ctx.float_bytes, len(pool))  # F_j(w_i^t): one value at the model's width
            sims = cosine(phis[0], phis[1:]).cpu()  # selection is host bookkeeping
            pos = self.state.choose(i, pool, sims, rng)  # R4-R5 (Eq. 8 or 9, threshold)
            self.hold("feature_proxies", phis.numel() * phis.element_size())  # phi_i and the pool's phi_j
            if len(pool):  # each j of the pool computes phi_j, F_j (and trains a copy) at i's model, one at a time
                self.hold("requested_model", self.layout.numel * self.ctx.float_bytes)
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
            if len(C) and hp.exchange == "train_copy":  # Alg. 1 line 7: w_j^{t,0} = w_i^t (with a copy of beta_j)
                starts = W0[i] if self.head is None else torch.stack([self.at(W0, i, int(j)) for j in C])
                models = self.local_update(starts, C.tolist(), r, key=(COPY_KEY + i,)).params
                # j measures both losses on its exact copy and sends them as values (F~_j, line 8)
                after = [float(self.proxy.losses(models[q], [int(j)])[0]) for q, j in enumerate(C)]
                before = lpre[1:][pos].tolist()
                models = torch.stack([self.noisy(models[q], r, int(j), i, 2) for q, j in enumerate(C)])
            elif len(C):  # own_model (A5): j's own new model, judged on i's data (as PENS/FedeRiCo), with beta_i
                # i holds only what crossed the link: it judges the very tensor it then aggregates (one draw)
                models = torch.stack([self.noisy(own.params[j], r, int(j), i, 2) for j in C])
                after = self.proxy.model_losses(self.judged(models, own.params[i]), i).tolist()
                before = [None] * len(C)
                if self.reads_before:  # Eq. (15)'s F_i(w_j^t): w_j^t must cross the link too, as its own message
                    prior = torch.stack([self.noisy(W0[j], r, int(j), i, 3) for j in C])
                    before = self.proxy.model_losses(self.judged(prior, own.params[i]), i).tolist()
                    self.peer(r, "model", self.model_bytes, len(C))
            else:
                models, after, before = W0[:0], [], []
            self.peer(r, "model", self.model_bytes, len(C))
            if hp.exchange == "train_copy":  # F~_j as a value; own_model's i measures its losses itself
                self.peer(r, "loss", self.ctx.float_bytes, len(C))
            self.hold_received(len(C))  # aggregated together (R8)
            losses = [self._smooth(i, int(j), a, b) for j, a, b in zip(C, after, before)]

            # R8: aggregate over C_i (+ i itself, A6) with Eq. (16) or uniform weights
            cand, cand_loss = list(models), losses
            if hp.include_self:
                self_after = float(self.proxy.losses(own.params[i], [i])[0])
                cand = [own.params[i], *cand]
                cand_loss = [self._smooth(i, i, self_after, float(lpre[0])), *losses]
            # float64 scores of the round: F_j(w_i^t) of i and the pool, s_ij, Eq. (8)'s p_ij (the literal
            # reading's p is selection_state) and F~ of the candidates (Eq. 15)
            fresh = len(pool) if hp.reading == "resolved" else 0
            self.hold("scores", (len(lpre) + len(sims) + fresh + len(cand_loss)) * lpre.element_size())
            if not cand:  # empty coreset without self: keep the own update (A7)
                new[i] = own.params[i]
                continue
            if hp.aggregation == "boltzmann":
                wts = boltzmann(torch.tensor(cand_loss, dtype=torch.float64, device="cpu"), hp.boltzmann_T)
            else:
                wts = torch.full((len(cand),), 1.0 / len(cand), dtype=torch.float64, device="cpu")
            new[i] = (self.on_device(wts, W0)[:, None] * torch.stack(cand)).sum(0)
            if self.head is not None:  # only w is aggregated; beta_i^{t+1} is i's own (never sent)
                new[i] = torch.where(self.head, own.params[i], new[i])
        self.state.end_round()
        self.commit("model", new)
        out = {
            **self.round_fault_metrics(r),
            "train_loss": self.train_loss(r, own),
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
