"""Neighbour selection for DFL: AFIND+'s rules (Wang et al. 2024, Eqs. 8-16) and a pluggable strategy.

The pure functions below are AFIND+'s equations; :class:`AfindState` keeps its per-client state (stored
sampling probabilities p_ij and thresholds theta_i) in both readings of the spec:

* ``resolved`` (spec 2.5, default): B_i^t = a random subset of the graph neighbours each round, fresh
  proxies for all of B_i^t, p by Eq. (8), C_i^t = {j : p_ij >= theta_i}, theta from the previous round;
* ``literal`` (Alg. 1 as printed): B_i^t = all graph neighbours, C_i^t chosen from the *stored* p
  (initially 1/n_i), proxies only from C_i^t, p updated by Eq. (9). Degenerate on large graphs (spec 2.7).

:class:`NeighbourSelector` is the strategy any DFL method can use: ``random``, ``topk`` (by proxy
similarity) or ``afind`` (threshold selection and Boltzmann weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from fedweave.config import ConfigError
from fedweave.execution import ParamLayout
from fedweave.models import layer_parameter_names
from fedweave.tasks import Loss, cross_entropy

Selection = Literal["threshold", "topk", "random", "all"]


# -------------------------------------------------------------------------------------- the equations
def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sim(a, b) = a.b / (|a| |b|) of a vector ``a`` with each row of ``b`` (0 for a zero vector)."""
    a64, b64 = a.double(), b.double()
    den = a64.norm() * b64.norm(dim=-1)
    return torch.where(den > 0, (b64 @ a64) / den.clamp_min(1e-300), torch.zeros_like(den))


def sampling_probs(sims: torch.Tensor, upsilon: float) -> torch.Tensor:
    """Eq. (8): p_ij = exp(s_ij / v) / sum_k exp(s_ik / v) over the available set."""
    return torch.softmax(sims.double() / upsilon, dim=-1)


def eq9_update(p_old: torch.Tensor, chosen: torch.Tensor, sims_chosen: torch.Tensor, upsilon: float) -> torch.Tensor:
    """Eq. (9): renew p over the coreset with fresh similarities, keep the mass of the rest.

    ``p_old`` holds p_i over B_i (all graph neighbours in the literal reading); ``chosen`` indexes C_i in it.
    p_ij = softmax_C(s/v)_j * (1 - sum_{k in B \\ C} p_ik) for j in C; other entries are unchanged.
    """
    p = p_old.clone().double()
    if len(chosen) == 0:
        return p
    rest = torch.ones(len(p), dtype=torch.bool, device=p.device)
    rest[chosen] = False
    p[chosen] = torch.softmax(sims_chosen.double() / upsilon, 0) * (1.0 - p[rest].sum())
    return p


def uncertainty(sims_chosen: torch.Tensor, mode: Literal["sum", "mean"] = "sum") -> float:
    """Eq. (10): h_i = -sum_{j in C_i} e_ij ln e_ij with e_ij = (s_ij + 1)/2 (0 when C_i is empty).

    ``mode='mean'`` divides by |C_i| (spec A9 option; the printed equation is the sum).
    """
    if len(sims_chosen) == 0:
        return 0.0
    e = ((sims_chosen.double() + 1) / 2).clamp(1e-6, 1 - 1e-6)  # clip before the log (spec 2.5 notes)
    h = float(-(e * e.log()).sum())
    return h / len(e) if mode == "mean" else h


def threshold(h: float, tau: float) -> float:
    """Eqs. (11)-(13): theta_i = tau * (1 - sigmoid(h_i)), an element-wise sigmoid (decentralized)."""
    return tau * (1.0 - 1.0 / (1.0 + math.exp(-h)))


def boltzmann(losses: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """Eqs. (14)/(16): w_j = exp(-F_j / T) / Z (max-shifted for stability)."""
    z = -losses.double() / T
    return torch.softmax(z, 0)


def smoothed_loss(after: torch.Tensor, before: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. (15): F~ = (1 - gamma) * F(after K local steps) + gamma * F(before)."""
    return (1 - gamma) * after + gamma * before


def pick(rule: Selection, p: torch.Tensor, theta: float, k: int, rng: np.random.Generator) -> np.ndarray:
    """Positions (into the candidate list) kept by a selection rule (spec 2.6 variants)."""
    n = len(p)
    if rule == "threshold":  # Alg. 1 lines 3-5
        return np.flatnonzero((p >= theta).numpy())
    if rule == "topk":  # Table 2 "+i": a fixed number by p
        return np.sort(np.argsort(-p.numpy(), kind="stable")[: min(k, n)])
    if rule == "random":
        return np.sort(rng.choice(n, size=min(k, n), replace=False)) if n else np.zeros(0, dtype=np.int64)
    return np.arange(n)


# ----------------------------------------------------------------------------------------- the proxy
def declared_layer(model: nn.Module, layer: Literal["featurizer", "classifier"], option: str) -> list[str]:
    """The parameter names of the model's declared ``layer``; a model that declares none (one's own
    ``nn.Module``) is refused in one line naming ``algorithm.<option>``, the option that needs the layer."""
    try:
        return layer_parameter_names(model, layer)
    except ValueError:
        raise ConfigError(
            f"algorithm.{option}: the model ({type(model).__name__}) declares no {layer} layer; give it a "
            f"'{layer}' attribute, the tuple of that layer's module names, as the registered models declare it "
            f"(mlp: {layer} = ('{'hidden.0' if layer == 'featurizer' else 'out'}',)), or use a registered model"
        ) from None


class ProxyComputer:
    """phi = the gradient restricted to one layer, and the loss, of a model on several clients' data.

    The gradient of the mean loss (the task's; cross-entropy in the paper) of each client's proxy data (its
    full local training set by default, spec A13) at one parameter vector; all clients in one forward pass and
    one batched backward. The forward passes run on the layout's placement (the proxy data placed once);
    the proxies phi stay there, the losses come back to the host (selection bookkeeping, float64).
    """

    def __init__(
        self,
        layout: ParamLayout,
        model: nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        parts: Sequence[np.ndarray],
        layer: Literal["featurizer", "classifier"] | None = "featurizer",
        max_samples: int | None = None,
        seed: int = 0,
        loss: Loss = cross_entropy,
    ) -> None:
        self.layout = layout
        pl = self.placement = layout.placement
        self.loss = loss  # the task's loss (cross-entropy for the classification the papers use)
        self.index = torch.zeros(0, dtype=torch.long, device=pl.device)  # layer None: losses only (PENS, FedeRiCo)
        if layer is not None:
            names = set(declared_layer(model, layer, f"proxy_layer {layer!r}"))
            idx, off = [], 0
            for n, k in zip(layout.names, layout.numels, strict=True):
                if n in names:
                    idx.append(torch.arange(off, off + k, device=pl.device))
                off += k
            if not idx:
                raise ConfigError(f"algorithm.proxy_layer {layer!r}: the model has no parameters in that layer")
            self.index = torch.cat(idx)
        empty = [i for i, p in enumerate(parts) if len(p) == 0]
        if empty:  # a peer without data has no loss or proxy to score a model by (its forward pass is of nothing)
            more = f" and {len(empty) - 1} more of the {len(parts)}" if len(empty) > 1 else ""
            raise ConfigError(
                f"partition: client {empty[0]}{more} holds no training sample, but the algorithm scores models on each "
                "peer's own data (pens, federico, fomo, afind_plus, afind, and the selection plug-ins topk and afind); "
                "give every client a sample (partition.min_size >= 1)"
            )
        self.train_x, self.train_y = pl.data(train_x), pl.data(train_y)
        rng = np.random.default_rng(seed)
        self.parts = []
        for p in parts:  # 'minibatch' proxy data: a fixed random subset per client
            p = np.asarray(p, dtype=np.int64)
            if max_samples is not None and len(p) > max_samples:
                p = np.sort(rng.choice(p, size=max_samples, replace=False))
            self.parts.append(torch.as_tensor(p, device=self.train_x.device))

    @property
    def size(self) -> int:
        return len(self.index)

    def losses(self, w: torch.Tensor, clients: Sequence[int]) -> torch.Tensor:
        """F_j(w) on each client's proxy data (float64, on the host)."""
        with torch.no_grad():
            return self._forward(w, clients).cpu().double()

    def proxies(self, w: torch.Tensor, clients: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(phi_j, F_j(w)) for each j in ``clients``: shapes (len, d_phi) and (len,)."""
        if len(clients) == 0:
            empty = torch.zeros(0, dtype=torch.float64, device="cpu")
            return torch.zeros(0, self.size, dtype=w.dtype, device=w.device), empty
        phis, losses = [], []
        base = w.detach()
        for c in clients:  # one backward per client: a batched (vmapped) backward measured far slower on CPU
            # differentiate w.r.t. the proxy layer only: layers below it need no backward pass
            phi = base[self.index].clone().requires_grad_(True)
            loss = self._forward(base.index_put((self.index,), phi), [c])[0]
            (g,) = torch.autograd.grad(loss, phi)
            phis.append(g)
            losses.append(loss.detach())
        return torch.stack(phis), torch.stack(losses).cpu().double()  # one trip to the host

    def model_losses(self, Ws: torch.Tensor, client: int) -> torch.Tensor:
        """F_i(w_k) of each row ``w_k`` of ``Ws`` on client ``client``'s proxy data (float64, on the host)."""
        idx = self.parts[int(client)]
        x, y = self.train_x[idx], self.train_y[idx]
        with torch.no_grad():
            return torch.stack([self.loss(self._logits(w, x), y) for w in Ws]).cpu().double()

    def _logits(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with self.placement.autocast():
            out = self.layout.functional(w, x)
        return out.to(w.dtype)

    def _forward(self, w: torch.Tensor, clients: Sequence[int]) -> torch.Tensor:
        idx = [self.parts[int(c)] for c in clients]
        sizes = [len(i) for i in idx]
        allidx = torch.cat(idx)
        logits = self._logits(w, self.train_x[allidx])
        per = self.loss.per_sample(logits, self.train_y[allidx])
        dev = per.device
        owner = torch.repeat_interleave(torch.arange(len(idx), device=dev), torch.tensor(sizes, device=dev))
        sums = torch.zeros(len(idx), dtype=per.dtype, device=dev).index_add(0, owner, per)
        return sums / torch.tensor(sizes, dtype=per.dtype, device=dev).clamp_min(1)


# ---------------------------------------------------------------------------------------- the state
@dataclass
class AfindOptions:
    """The selection part of AFIND+ (names as in spec A37)."""

    reading: Literal["resolved", "literal"] = "resolved"
    selection: Selection = "threshold"
    tau: float = 0.5
    upsilon: float = 0.1
    topk: int = 5
    theta0: float = 0.0
    h_mode: Literal["sum", "mean"] = "sum"
    empty_fallback: Literal["none", "top1"] = "none"

    def validate(self) -> None:
        if self.tau < 0:
            raise ConfigError(f"algorithm.tau must be >= 0, got {self.tau}")
        if self.upsilon <= 0:
            raise ConfigError(f"algorithm.upsilon must be > 0, got {self.upsilon}")
        if self.topk < 1:
            raise ConfigError(f"algorithm.topk must be >= 1, got {self.topk}")
        if self.theta0 < 0:
            raise ConfigError(f"algorithm.theta0 must be >= 0, got {self.theta0}")


class AfindState:
    """Per-client thresholds theta_i and (literal reading) stored probabilities p_ij over S_i.

    One round for client i: ``pool`` gives the neighbours asked for a proxy, ``choose`` the coreset from
    their similarities, ``set_threshold`` the next theta_i (Eqs. 10-13). ``end_round`` commits.
    """

    def __init__(self, neighbours: Sequence[np.ndarray], opts: AfindOptions) -> None:
        self.opts = opts
        self.neighbours = [np.asarray(nb, dtype=np.int64) for nb in neighbours]
        n = len(self.neighbours)
        self.theta = torch.full((n,), float(opts.theta0), dtype=torch.float64, device="cpu")  # host bookkeeping
        self._next_theta = self.theta.clone()
        # literal reading: p_i over S_i, initialised to 1/n_i (Alg. 1 Init)
        self.p = [
            torch.full((len(nb),), 1.0 / max(len(nb), 1), dtype=torch.float64, device="cpu") for nb in self.neighbours
        ]

    def pool(self, i: int, available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Resolved: B_i^t (fresh proxies from all of it). Literal: C_i^t from the stored p (lines 3-5)."""
        if self.opts.reading == "resolved":
            return available
        pos = pick(self.opts.selection, self.p[i], float(self.theta[i]), self.opts.topk, rng)
        pos = self._fallback(pos, self.p[i])
        return self.neighbours[i][pos]

    def choose(self, i: int, pool: np.ndarray, sims: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
        """Positions in ``pool`` of the coreset C_i^t; updates p (Eq. 8 or Eq. 9)."""
        o = self.opts
        if o.reading == "literal":  # the pool is the coreset; renew its p by Eq. (9)
            where = np.searchsorted(self.neighbours[i], pool)
            self.p[i] = eq9_update(self.p[i], torch.as_tensor(where, device="cpu"), sims, o.upsilon)
            return np.arange(len(pool))
        p = sampling_probs(sims, o.upsilon)  # Eq. (8) over B_i^t
        return self._fallback(pick(o.selection, p, float(self.theta[i]), o.topk, rng), p)

    def _fallback(self, pos: np.ndarray, p: torch.Tensor) -> np.ndarray:
        if len(pos) == 0 and len(p) and self.opts.empty_fallback == "top1":
            return np.array([int(torch.argmax(p))])
        return pos

    def set_threshold(self, i: int, sims_chosen: torch.Tensor) -> None:
        """theta_i^{t+1} = tau (1 - sigmoid(h_i)) (Eqs. 10-13), committed by ``end_round``."""
        self._next_theta[i] = threshold(uncertainty(sims_chosen, self.opts.h_mode), self.opts.tau)

    def end_round(self) -> None:
        self.theta = self._next_theta.clone()

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta.clone(), "p": [p.clone() for p in self.p]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta = state["theta"].cpu().clone()  # host bookkeeping, wherever the checkpoint was mapped
        self._next_theta = self.theta.clone()
        self.p = [p.cpu().clone() for p in state["p"]]


# ------------------------------------------------------------------------------- the plug-in strategy
@dataclass
class SelectionHparams:
    """Neighbour selection of a DFL method: ``random`` (the default of every baseline), ``topk`` by proxy
    similarity, or ``afind`` (AFIND+'s threshold and, with ``boltzmann_weights``, Boltzmann weights).

    A plug-in aggregates the neighbours' *own* models, so its Boltzmann weight of j is exp(-F_i(w_j)/T),
    the loss of j's model on i's data (spec A5 ``own_model``, A31), with F_i(w_i) for i itself."""

    selection: Literal["random", "topk", "afind"] = "random"
    select_k: int | None = None  # random/topk: how many of the available; null = all available (random)
    tau: float = 0.5
    upsilon: float = 0.1
    boltzmann_T: float = 1.0
    boltzmann_weights: bool = True  # afind: weight the selected by exp(-F_j(w_i)/T) (Eq. 14) incl. self
    proxy_layer: Literal["featurizer", "classifier"] = "featurizer"

    def __post_init__(self) -> None:
        if self.select_k is not None and self.select_k < 1:
            raise ConfigError(f"algorithm.select_k must be >= 1 or null, got {self.select_k}")
        if self.selection == "topk" and self.select_k is None:
            raise ConfigError("algorithm.selection 'topk' needs algorithm.select_k (how many neighbours)")
        if self.boltzmann_T <= 0:
            raise ConfigError(f"algorithm.boltzmann_T must be > 0, got {self.boltzmann_T}")
        AfindOptions(tau=self.tau, upsilon=self.upsilon).validate()
        # an option the chosen selection does not read, set to other than its default, is refused: random draws
        # without proxies (NeighbourSelector.select), top-k weighs its choice uniformly, and afind's threshold
        # (Alg. 1 lines 3-5) decides how many it keeps
        unread = {
            "random": ("tau", "upsilon", "boltzmann_T", "boltzmann_weights", "proxy_layer"),
            "topk": ("tau", "boltzmann_T", "boltzmann_weights"),
            "afind": ("select_k",),
        }.get(self.selection, ())
        readers = {"proxy_layer": "topk or afind", "select_k": "random or topk"}
        for f in fields(SelectionHparams):
            if f.name in unread and getattr(self, f.name) != f.default:
                used = readers.get(f.name, "afind")
                raise ConfigError(
                    f"algorithm.{f.name}: selection {self.selection!r} does not read it (selection {used} does); "
                    "leave it out or set algorithm.selection"
                )


class NeighbourSelector:
    """Chooses, for every client, the neighbours whose models it aggregates this round, and their weights.

    ``random`` needs no messages. ``topk`` and ``afind`` send w_i to each available neighbour j and receive
    phi_j(w_i) and F_j(w_i) (ledger kinds ``model``, ``feature_proxy``, ``loss``), as in AFIND+ R3.
    """

    def __init__(self, algo: Any, hp: SelectionHparams, *, weighs: bool = True) -> None:
        """``weighs``: whether the method mixes with the weights :meth:`select` returns; one that weighs what it
        receives by a rule of its own (FOMO's u~) gets uniform weights, and no Boltzmann losses are computed."""
        self.algo, self.hp, self.weighs = algo, hp, weighs
        self.state: AfindState | None = None
        self.proxy: ProxyComputer | None = None
        if hp.selection != "random":
            algo.ctx.placement.check_float64("neighbour selection by proxy similarity")
            ds = algo.ctx.dataset
            self.proxy = ProxyComputer(  # with the run's loss, as afind_plus (cross-entropy by default)
                algo.layout,
                algo.ctx.model,
                ds.train_x,
                ds.train_y,
                algo.ctx.partition,
                hp.proxy_layer,
                loss=algo.ctx.task.loss,
            )
            opts = AfindOptions(
                selection="threshold" if hp.selection == "afind" else "topk",
                tau=hp.tau,
                upsilon=hp.upsilon,
                topk=hp.select_k or 1,
            )
            self.state = AfindState(algo.neighbours, opts)
            if hp.selection == "afind":  # theta_i (Eqs. 10-13), one float64 a peer
                algo.hold("selection_state", self.state.theta[:1].numel() * self.state.theta.element_size())
        self.last_sizes: list[int] = []

    def select(
        self, r: int, W: torch.Tensor, sent: torch.Tensor | None = None
    ) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Per client i: (selected neighbour ids, weights over [i, *selected] summing to one).

        ``W`` are the round-start models (proxies are computed at w_i); ``sent`` the models the method
        will aggregate (default ``W``), used for the Boltzmann weights."""
        sent = W if sent is None else sent
        algo, hp = self.algo, self.hp
        out = []
        for i in range(algo.num_clients):
            if not algo.is_up(r, i):  # dropped out: no messages, no selection state change, keeps its model
                out.append((np.zeros(0, dtype=np.int64), torch.ones(1, dtype=torch.float64, device="cpu")))
                continue
            avail = algo.available(r, i)  # only peers reachable this round
            rng = algo.seeds.numpy("neighbour_selection", r, i)
            if hp.selection == "random":
                k = len(avail) if hp.select_k is None else min(hp.select_k, len(avail))
                chosen = np.sort(rng.choice(avail, size=k, replace=False)) if k < len(avail) else avail
                uniform = torch.full((len(chosen) + 1,), 1.0 / (len(chosen) + 1), dtype=torch.float64, device="cpu")
                out.append((chosen, uniform))
                continue
            assert self.proxy is not None and self.state is not None
            w_i = W[i]
            phis, _ = self.proxy.proxies(w_i, [i, *avail.tolist()])
            phis = torch.stack([algo.noisy(phis[q], r, int(c), i, 1) for q, c in enumerate([i, *avail])])
            algo.send_model(r, i, len(avail))  # w_i -> each j in B_i
            algo.peer(r, "feature_proxy", self.proxy.size * algo.ctx.float_bytes, len(avail))
            algo.peer(r, "loss", algo.ctx.float_bytes, len(avail))  # F_j(w_i): one value at the model's width
            sims = cosine(phis[0], phis[1:]).cpu()  # selection is host bookkeeping
            pos = self.state.choose(i, avail, sims, rng)
            self.state.set_threshold(i, sims[pos])
            chosen = avail[pos]
            algo.hold("feature_proxies", phis.numel() * phis.element_size())  # phi_i and those of B_i
            if len(avail):  # each j of B_i computes phi_j and F_j at w_i, one request at a time
                algo.hold("requested_model", algo.layout.numel * algo.ctx.float_bytes)
            scored = 2 * len(avail)  # float64 s_ij and Eq. (8)'s p_ij over B_i
            if hp.selection == "afind" and hp.boltzmann_weights and self.weighs:
                # i holds only what crossed the link (under dp_mode exchange a noised draw): it scores the very
                # models it then mixes
                held = [sent[i], *(algo.as_received(sent, r, int(j), i) for j in chosen)]
                losses = self.proxy.model_losses(torch.stack(held), i)
                weights = boltzmann(losses, hp.boltzmann_T)  # Eq. (14), own-model reading
                scored += len(losses)  # and F_i(w_j) of i and the selected
            else:
                weights = torch.full((len(chosen) + 1,), 1.0 / (len(chosen) + 1), dtype=torch.float64, device="cpu")
            algo.hold("scores", scored * sims.element_size())
            out.append((chosen, weights))
        if self.state is not None:
            self.state.end_round()
        self.last_sizes = [len(c) for c, _ in out]
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict() if self.state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.state is not None and state:
            self.state.load_state_dict(state)


# ------------------------------------------------------------------------ the selection rule in isolation
def pair_similarities(
    group: np.ndarray, within: float, across: float, noise: float, rng: np.random.Generator
) -> np.ndarray:
    """Spec 2.7's proxy similarities: ``within`` for two clients of one group, ``across`` otherwise, plus one
    N(0, noise^2) effect per pair, the same both ways. (Averaging a matrix of draws with its transpose, as this
    did until 28 Nov 2026, left the effect N(0, noise^2 / 2): std 0.071 for the spec's 0.1.) It draws an m x m
    matrix, so the draws after it are what they were."""
    m = len(group)
    pair = np.triu(rng.normal(0, noise, (m, m)), 1)
    return np.where(group[:, None] == group[None, :], within, across) + pair + pair.T


def synthetic_selection(
    opts: AfindOptions,
    *,
    num_clients: int = 100,
    groups: int = 10,
    within: float = 0.7,
    across: float = 0.0,
    noise: float = 0.1,
    measure_noise: float = 0.05,
    available: int | None = 10,
    rounds: int = 30,
    seed: int = 0,
) -> dict[str, list[float]]:
    """The selection dynamics of spec 2.7 without training: a fully connected graph of clients in
    ``groups`` groups, proxy cosine similarity ``within`` inside a group and ``across`` between groups,
    plus a fixed N(0, noise^2) pair effect and N(0, measure_noise^2) per-round measurement noise.

    ``available=None`` offers all neighbours each round (B_i = S_i). Returns per round the mean coreset
    size and the fraction of selected neighbours in the client's own group.
    """
    rng = np.random.default_rng(seed)
    m = num_clients
    group = np.arange(m) % groups
    base = pair_similarities(group, within, across, noise, rng)
    neighbours = [np.delete(np.arange(m), i) for i in range(m)]
    state = AfindState(neighbours, opts)
    sizes, purity = [], []
    for _ in range(rounds):
        n_sel, n_same = 0, 0
        for i in range(m):
            nb = neighbours[i]
            avail = nb if available is None or available >= len(nb) else np.sort(rng.choice(nb, available, False))
            pool = state.pool(i, avail, rng)
            sims = torch.as_tensor(
                np.clip(base[i, pool] + rng.normal(0, measure_noise, len(pool)), -1, 1), device="cpu"
            )
            pos = state.choose(i, pool, sims, rng)
            state.set_threshold(i, sims[pos])
            n_sel += len(pos)
            n_same += int((group[pool[pos]] == group[i]).sum())
        state.end_round()
        sizes.append(n_sel / m)
        purity.append(n_same / n_sel if n_sel else float("nan"))
    return {"selected": sizes, "same_group": purity}
