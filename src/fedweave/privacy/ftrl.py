"""DP-FTRL (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, ICML 2021): the clipped sums released as noised prefix
sums by the binary tree aggregation mechanism, so that no sampling amplification is needed.

Round t of a tree (a leaf, t = 1, 2, ...) adds g_t = sum_i clip(Delta_i) / E. Every node of the binary tree over the
leaves holds the sum of its leaves plus its own noise N(0, sigma^2 C^2 I) / E; the prefix sum S~_t = sum_{s<=t} g_s +
N_t adds the noises N_t of the popcount(t) nodes of t's binary decomposition (one node per 1-bit of t, the node of bit
h covering the 2^h leaves ending at the bit's place). FTRL's model is ``x_t = x_0 + eta S~_t`` (Alg. 1 with the
regularizer ||x - x_0||^2 / (2 eta)); the server step of the method runs on the increment ``S~_t - S~_{t-1}``, a
function of the released prefix sums (post-processing), and FedAvg's ``x + eta (S~_t - S~_{t-1})`` telescopes to
FTRL's ``x_0 + eta S~_t``. DP-FTRLM (the paper's momentum variant, as in its reference implementation: a buffer
``m_t = gamma m_{t-1} + S~_t`` and ``x_t = x_0 + eta m_t``) is the same increment form: its increment
``d_t = m_t - m_{t-1} = gamma d_{t-1} + (S~_t - S~_{t-1})`` is heavy-ball momentum on the noised increments, reset
with the tree. A restart (every ``restart_every`` leaves, the paper's restart per epoch) starts a new tree from the
current model: new node noises, an empty prefix sum and a zero momentum buffer.

The node noises are never stored: node (tree, level h, index k) is drawn from its own named seed stream, so a resumed
run regenerates the very same tree.

Accounting (Theorem 3.1 of the paper and its Appendix D, the reduction of the tree to one Gaussian mechanism): the
released node values are one Gaussian mechanism whose sensitivity is that of the vector of node sums. The released
nodes of a tree of n leaves are those of the prefix sums S~_1..S~_n, one new node per leaf: leaf t brings the node
of t's lowest 1-bit h, ``(h, (t >> h) - 1)``, whose index is even: a left child. A right child (odd index) is never
in any binary decomposition: its noise is never drawn and nothing released depends on it, so it is not counted. The
n prefix sums and the n released nodes determine each other (a triangular linear map), so the released nodes'
sensitivity is that of the run's output, not merely a bound on it. A client whose clipped update sits in one leaf of
a tree of n leaves changes every released node that contains that leaf, at most
``depth(n) = floor(log2 n) + 1 = ceil(log2(n + 1))`` nodes (for the first leaf exactly: [1], [1, 2], [1, 4], ...),
each by at most C, so the sensitivity is ``sqrt(depth) C`` and the tree is the Gaussian mechanism with noise
multiplier ``sigma / sqrt(depth)``. A client that takes part in several leaves of one tree adds up inside the nodes
they share: the exact worst case is ``sum over released nodes of c_v^2`` (c_v: its leaves in node v, all of its
updates aligned), which this module computes from who actually reported (the participation is data-independent:
samplers that read losses are refused). With each client at most once per tree it is at most ``depth(n)``, the
paper's number.

Across trees (restarts; the paper's Appendix D composes the per-epoch trees of one example): every node of every
tree has its own independent noise N(0, sigma^2 C^2 I), so for the neighbouring pair of client i all the trees'
released nodes together are one Gaussian mechanism of squared sensitivity ``s_i = sum over trees of its count in
the tree`` (adaptively: each tree's Renyi DP ``alpha s_{i,tree} / (2 sigma^2)`` holds whatever the earlier trees
released, and they add up). The run's epsilon is the worst client's, noise multiplier ``sigma / sqrt(max_i s_i)``
at sample rate 1, asked of Opacus's RDP (or PRV) accountant; this is never above composing each tree's worst
client (``sum over trees of max_i``) and is below it when different clients are worst in different trees.
DP-FedBuff's server steps are accounted by the same function (:func:`client_history`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedweave.privacy.mechanism import UserDP
from fedweave.registry import PRIVACY_MECHANISMS

PRIVACY_MECHANISMS.register("ftrl")("DP-FTRL (Kairouz et al. 2021): tree-aggregated prefix sums, no amplification")


def depth(n: int) -> int:
    """The most released nodes of a tree of ``n`` leaves that contain one leaf: ``floor(log2 n) + 1`` (0 for 0)."""
    return int(n).bit_length()


def decomposition(t: int) -> list[tuple[int, int]]:
    """The nodes ``(level h, index k)`` whose sum is the prefix [1, t] (t >= 1): one per 1-bit h of t, covering
    leaves ``k 2^h + 1 .. (k + 1) 2^h`` with ``k = (t >> h) - 1``; popcount(t) nodes, highest level first."""
    return [(h, (t >> h) - 1) for h in reversed(range(t.bit_length())) if t >> h & 1]


def tree_counts(leaves: list[np.ndarray]) -> np.ndarray:
    """Each client's squared L2 sensitivity, in units of C^2, in the released nodes of a tree whose leaf j (0-based)
    had the clients ``leaves[j]``: ``sum over released nodes v of c_v^2``, c_v the client's leaves inside v (its
    updates all pointing the same way: the worst case); an int64 array indexed by client id (0 for a client that is
    not in the tree). Node (h, k) is released when some prefix sum [1, t], t <= n = len(leaves), has it in its
    binary decomposition: k even and its span ended by leaf n (a right child, k odd, is in no decomposition, so its
    noise is never drawn)."""
    n = len(leaves)
    ids = np.concatenate([np.zeros(0, dtype=np.int64), *(np.asarray(c, dtype=np.int64) for c in leaves)])
    total = np.zeros(int(ids.max(initial=-1)) + 1, dtype=np.int64)
    if len(ids) == 0:
        return total
    pos = np.repeat(np.arange(n, dtype=np.int64), [len(c) for c in leaves])
    for h in range(depth(n)):
        node = pos >> h
        released = (node % 2 == 0) & (((node + 1) << h) <= n)  # a left child whose span has ended
        pairs, counts = np.unique(np.stack([ids[released], node[released]], axis=1), axis=0, return_counts=True)
        np.add.at(total, pairs[:, 0], counts.astype(np.int64) ** 2)
    return total


def tree_sensitivity(leaves: list[np.ndarray]) -> int:
    """The squared L2 sensitivity, in units of C^2, of one tree's released nodes: the largest of
    :func:`tree_counts` over the clients (0 for an empty tree)."""
    return int(tree_counts(leaves).max(initial=0))


def plus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two per-client int64 arrays added, the shorter one padded with zeros (clients that are in one only)."""
    out = np.zeros(max(len(a), len(b)), dtype=np.int64)
    out[: len(a)] += a
    out[: len(b)] += b
    return out


def gaussian_history(z: float, squared_sensitivities: list[int] | list[float]) -> list[tuple[float, float, int]]:
    """Opacus's history of Gaussian releases of noise std ``z C`` whose L2 sensitivities are
    ``sqrt(s) C``, s in ``squared_sensitivities``: each the Gaussian mechanism with noise multiplier
    ``z / sqrt(s)`` at sample rate 1 (no amplification), equal neighbours merged; a release of sensitivity 0 is
    left out (it depends on nobody's data)."""
    out: list[tuple[float, float, int]] = []
    for s in squared_sensitivities:
        if s == 0:
            continue
        noise = z / math.sqrt(s) if z else 0.0
        if out and out[-1][0] == noise:
            out[-1] = (noise, 1.0, out[-1][2] + 1)
        else:
            out.append((noise, 1.0, 1))
    return out


def client_history(z: float, squared: np.ndarray, unattributed: int = 0) -> list[tuple[float, float, int]]:
    """Opacus's history of a run whose releases all carry independent Gaussian noise of std ``z C`` and in which
    client i's contributions have squared L2 sensitivity ``squared[i] C^2`` over the whole run (summed over its
    releases): for the neighbouring pair of client i the run is one Gaussian mechanism of noise multiplier
    ``z / sqrt(squared[i])`` (the releases' Renyi DP ``alpha s / (2 z^2)`` add up, and Gaussian mechanisms
    compose to a Gaussian one), so the run's epsilon is the largest client's. ``unattributed``: squared
    sensitivity known only as a bound for every client, added to each. DP-FTRL's trees and DP-FedBuff's server
    steps (:mod:`fedweave.privacy.buffered`) are both accounted through it."""
    return gaussian_history(z, [int(unattributed) + int(np.asarray(squared).max(initial=0))])


class TreeNoise:
    """Unit Gaussian node noises of the binary trees of a run, each node from its own seed stream
    ``("dp_tree", tree, level, index)``, drawn on the CPU in ``dtype`` (the same on every device)."""

    def __init__(self, seeds: Any, numel: int, dtype: torch.dtype) -> None:
        self.seeds, self.numel, self.dtype = seeds, int(numel), dtype

    def node(self, tree: int, level: int, index: int) -> torch.Tensor:
        """The N(0, I) noise of one node."""
        g = self.seeds.torch("dp_tree", tree, level, index)
        return torch.randn(self.numel, generator=g, dtype=self.dtype)

    def prefix(self, tree: int, t: int) -> torch.Tensor:
        """The noise of the prefix sum [1, t]: the sum of the nodes of t's binary decomposition (zero for t = 0)."""
        out = torch.zeros(self.numel, dtype=self.dtype)
        for h, k in decomposition(t):
            out = out + self.node(tree, h, k)
        return out

    def increment(self, tree: int, t: int) -> torch.Tensor:
        """``prefix(t) - prefix(t - 1)`` from the nodes that differ only (the nodes the two share cancel)."""
        now, before = set(decomposition(t)), set(decomposition(t - 1)) if t > 1 else set()
        out = torch.zeros(self.numel, dtype=self.dtype)
        for h, k in sorted(now - before, reverse=True):
            out = out + self.node(tree, h, k)
        for h, k in sorted(before - now, reverse=True):
            out = out - self.node(tree, h, k)
        return out


def planned_sensitivity(rounds: int, restart_every: int | None) -> int:
    """The most squared sensitivity a client can have over ``rounds`` releases with each client at most once per
    tree: ``depth`` of every tree's leaves, reached by a client in the first leaf of every tree (what
    ``noise_multiplier: auto`` calibrates for; a run whose clients repeat inside a tree is stopped by the
    budget)."""
    period = restart_every or rounds
    full, rest = divmod(rounds, period)
    return full * depth(period) + depth(rest)


class FTRLDP(UserDP):
    """DP-FTRL's stages on the star round: stage 3 clips as DP-FedAvg does (weights 1/E) and notes who reported;
    stage 5 adds the tree's noise increment (and DP-FTRLM's momentum) and accounts the trees."""

    def __init__(self, *, restart_every: int | None, momentum: float, **kw: Any) -> None:
        super().__init__(mechanism="ftrl", **kw)
        self.restart_every, self.momentum = restart_every, float(momentum)
        self.leaves: list[np.ndarray] = []  # the reporting clients of each leaf of the current tree
        self.closed: list[int] = []  # each finished tree's worst client's squared sensitivity (units of C^2)
        # per client, the sum over the finished trees of its squared sensitivity in each (units of C^2)
        self.squared = np.zeros(0, dtype=np.int64)
        # a bound added to every client: the finished trees of a checkpoint that kept only their worst clients
        self.unattributed = 0
        self.buffer: torch.Tensor | None = None  # DP-FTRLM's increment d_t (None: zero, a fresh tree)
        self._noise: TreeNoise | None = None
        self._clients: np.ndarray | None = None
        self.upcoming: Any = None  # round -> the clients the sampler draws (the budget's look-ahead)

    @property
    def tree(self) -> int:
        """The index of the current tree (the seed streams' key)."""
        return len(self.closed)

    def clip(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: DP-FedAvg's clipping and weights 1/E; who reported is kept for the tree's sensitivity."""
        if clients is None:
            raise ValueError("DP-FTRL's clipping stage needs the ids of the reporting clients")
        self._clients = np.asarray(clients, dtype=np.int64)
        return super().clip(updates, weights)

    def noise(self, mean: torch.Tensor) -> torch.Tensor:
        """Stage 5: ``g_t`` plus the tree's noise increment ``sigma C (N_t - N_{t-1}) / E``, through DP-FTRLM's
        momentum when set; the leaf is recorded and the tree restarts after ``restart_every`` leaves."""
        assert self._clients is not None, "clip() comes before noise()"
        t = len(self.leaves) + 1
        out = mean
        if self.z:
            if self._noise is None:
                self._noise = TreeNoise(self.seeds, mean.numel(), mean.dtype)
            inc = self._noise.increment(self.tree, t).reshape(mean.shape)
            out = mean + (self.z * self.clip_norm / self.expected) * inc.to(mean.device, non_blocking=True)
        if self.momentum:
            out = out if self.buffer is None else self.momentum * self.buffer + out
            self.buffer = out
        self.leaves.append(self._clients)
        self._clients = None
        self.releases += 1
        if self.restart_every is not None and len(self.leaves) == self.restart_every:
            counts = tree_counts(self.leaves)
            self.closed.append(int(counts.max(initial=0)))
            self.squared = plus(self.squared, counts)
            self.leaves, self.buffer = [], None
        self.accountant.impl.history = self.history()  # what Opacus is told, for whoever reads the accountant
        return out

    # ---- accounting -------------------------------------------------------------------------------
    def totals(self, current: list[np.ndarray] | None = None) -> np.ndarray:
        """Each client's squared sensitivity over the run: the finished trees' plus the current tree's (``current``
        in its place when given)."""
        return plus(self.squared, tree_counts(self.leaves if current is None else current))

    def history(self, current: list[np.ndarray] | None = None) -> list[tuple[float, float, int]]:
        """Opacus's history of the run: the worst client's composed Gaussian mechanism, noise multiplier
        ``sigma / sqrt(max_i sum_trees s_{i,tree})`` at sample rate 1 (every node's noise is an independent
        N(0, sigma^2 C^2 I), so all the trees' nodes together are one Gaussian mechanism per client)."""
        return client_history(self.z, self.totals(current), self.unattributed)

    def epsilon(self) -> float:
        """Epsilon at the run's delta after the trees so far (of the client with the largest sensitivity)."""
        return self.accountant.epsilon(self.history())

    def epsilon_after_next(self, next_round: int | None = None) -> float:
        """Epsilon after one more leaf: the clients the sampler draws for ``next_round`` (who reports is among
        them: an upper bound; the draw depends on the seed only, never on the data), or, without a round or a
        sampler, every client seen so far and a new one (a client's count only grows with the leaves it is in, so
        this bounds any next leaf). A full tree is closed by :meth:`noise`, so the next leaf is in this tree or,
        when it is empty, the first of a new one."""
        if next_round is not None and self.upcoming is not None:
            return self.accountant.epsilon(self.history([*self.leaves, np.asarray(self.upcoming(next_round))]))
        seen = np.concatenate([np.zeros(0, dtype=np.int64), *self.leaves])
        everyone = np.arange(max(len(self.squared), int(seen.max(initial=-1)) + 1) + 1)  # the last one is new
        return self.accountant.epsilon(self.history([*self.leaves, everyone]))

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(
            sample_rate=1.0,
            restart_every=self.restart_every,
            momentum=self.momentum,
            trees=len(self.closed) + (1 if self.leaves else 0),
            tree_sensitivities=[*self.closed, *([tree_sensitivity(self.leaves)] if self.leaves else [])],
            squared_sensitivity=self.unattributed + int(self.totals().max(initial=0)),
        )
        return out

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out.update(
            leaves=[c.tolist() for c in self.leaves],
            closed=list(self.closed),
            squared=self.squared.tolist(),
            unattributed=self.unattributed,
            buffer=None if self.buffer is None else self.buffer.clone(),
        )
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.leaves = [np.asarray(c, dtype=np.int64) for c in state["leaves"]]
        self.closed = [int(s) for s in state["closed"]]
        if "squared" in state:
            self.squared = np.asarray(state["squared"], dtype=np.int64)
            self.unattributed = int(state["unattributed"])
        else:  # a checkpoint that kept only each finished tree's worst client: every client may have been it
            self.squared, self.unattributed = np.zeros(0, dtype=np.int64), sum(self.closed)
        self.buffer = state["buffer"]
        self.accountant.impl.history = self.history()
