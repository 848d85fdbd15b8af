"""Robust aggregators: the server's reduction of a round's client updates to one (``aggregator:`` section).

Each is registered in :data:`fedweave.registry.AGGREGATORS` and called as ``agg(updates, weights, f)`` with
``updates`` the ``(n, d)`` rows of the round's reporting clients, ``weights`` their aggregation weights
(summing to one) and ``f`` the number of Byzantine updates the server guards against. The options of the
section are the keyword arguments of the class. ``mean`` (the weighted mean) is the default and is exactly the
star template's own reduction.

Weights: the weighted mean, norm bounding, the geometric median and centered clipping use the aggregation weights (their
papers state them weighted); the order statistics (median, trimmed mean, Krum, Bulyan) treat every update
alike, as their papers do; so does DnC, which averages the updates it keeps.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import numpy as np
import torch

from fedweave.config import MAX_LOCAL_STEPS, MAX_LR, ConfigError
from fedweave.registry import AGGREGATORS

log = logging.getLogger(__name__)


class Aggregator:
    """A reduction of ``(n, d)`` client updates to one ``(d,)`` update.

    ``stateful`` aggregators (centered clipping) keep state between rounds; :meth:`state_dict` is then what a
    checkpoint carries. ``translation_equivariant``: shifting every row by ``c`` shifts the result by ``c``
    (means, medians, Krum's picks); an aggregator that measures lengths (a norm bound, clipping around a
    center) is not, and must see the clients' displacements, never their models."""

    name: ClassVar[str] = ""
    stateful: ClassVar[bool] = False
    translation_equivariant: ClassVar[bool] = True
    random: ClassVar[bool] = False  # it draws: called with ``rng``, the stage's seeded stream of the reduction
    # it reads ``f`` (what it cuts or guards against); False: no Byzantine count enters it, and aggregator.f is refused
    reads_f: ClassVar[bool] = True

    def min_updates(self, f: int) -> int:
        """The fewest updates with which the aggregator is defined against ``f`` Byzantine ones."""
        return 1

    def check(self, n: int, f: int) -> None:
        """Refuse ``n`` updates with ``f`` Byzantine among them where the aggregator's bound fails (one line)."""
        need = self.min_updates(f)
        if n < need:
            raise ConfigError(
                f"aggregator {self.name!r} needs at least {need:.6g} client updates per round against f = {f} "
                f"Byzantine ones (got {n}); lower aggregator.f, give each reduction more updates "
                "(algorithm.clients_per_round, the sampler's clients, fedbuff's buffer_size) or choose another "
                "aggregator"
            )

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, f: int, rng: np.random.Generator | None = None
    ) -> torch.Tensor:
        """The checked reduction; ``rng``: the reduction's own stream, for a ``random`` aggregator (only)."""
        self.check(len(updates), f)
        if self.random:
            if rng is None:
                raise ValueError(f"aggregator {self.name!r} draws at random: call it with rng, a seeded stream")
            return self.reduce(updates, weights, f, rng=rng)
        return self.reduce(updates, weights, f)

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """The reduction of ``updates`` (``(n, d)``, weights summing to one, ``f`` Byzantine) to one ``(d,)``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries of a stateful aggregator (nothing for a stateless one)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave."""


@AGGREGATORS.register("mean")
class Mean(Aggregator):
    """The weighted mean ``sum_i w_i u_i``: the star template's reduction, bit for bit (the default)."""

    name = "mean"
    reads_f = False

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """``weights @ updates``."""
        return weights @ updates


def _median(sorted_rows: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of rows sorted along dim 0: the middle value, or the mean of the two
    middle ones for an even count (numpy's definition; torch.median would return the lower one)."""
    n = len(sorted_rows)
    if n % 2:
        return sorted_rows[n // 2]
    return (sorted_rows[n // 2 - 1] + sorted_rows[n // 2]) / 2


@AGGREGATORS.register("median")
class Median(Aggregator):
    """Coordinate-wise median (Yin et al., ICML 2018)."""

    name = "median"
    reads_f = False

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """The coordinate-wise median of the rows."""
        return _median(updates.sort(0).values)


@AGGREGATORS.register("trimmed_mean")
class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): per coordinate, drop the ``k`` largest and ``k``
    smallest values and average the rest. ``beta``: the fraction cut from each end, ``k = floor(beta n)``
    (scipy.stats.trim_mean's rule); null: ``k = f``."""

    name = "trimmed_mean"

    def __init__(self, beta: float | None = None) -> None:
        if beta is not None and not 0.0 <= beta < 0.5:
            raise ConfigError(f"aggregator.beta must be in [0, 0.5) (the fraction cut from each end), got {beta}")
        self.beta = beta
        self._warned: set[tuple[int, int]] = set()

    def trimmed(self, n: int, f: int) -> int:
        """k, the values cut from each end of ``n``: ``floor(beta n)``, or ``f`` when ``beta`` is null."""
        return int(self.beta * n) if self.beta is not None else f

    def min_updates(self, f: int) -> int:
        return 2 * f + 1 if self.beta is None else 1

    def check(self, n: int, f: int) -> None:
        super().check(n, f)
        if self.trimmed(n, f) < f and (n, f) not in self._warned:  # allowed (a too-small beta), rarely meant
            self._warned.add((n, f))  # once per round shape, not every round
            log.warning(
                "aggregator.beta %g cuts %d of each end of %d updates, fewer than the %d Byzantine ones guarded "
                "against: the attackers' most extreme values stay in the mean (beta null cuts f)",
                self.beta,
                self.trimmed(n, f),
                n,
                f,
            )

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """The coordinate-wise mean of the rows without the k largest and k smallest values."""
        n = len(updates)
        k = self.trimmed(n, f)
        if k == 0:  # nothing trimmed: the plain mean, in the same arithmetic as updates.mean(0)
            return updates.mean(0)
        return updates.sort(0).values[k : n - k].mean(0)


def _sq_dists(updates: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances, summed from the squared differences (no ||a||^2 + ||b||^2 - 2ab
    cancellation) and never through a square root: cdist's distance squared again is off by rounding
    (sqrt(2)^2 is 2.0000000000000004), which broke Krum's exact ties by noise rather than by row order. The
    differences are formed a block of rows at a time (at most 2^24 values), not as another copy of every update."""
    block = max(1, (1 << 24) // max(updates.shape[1], 1))
    return torch.stack([torch.cat([(part - row).pow_(2).sum(1) for part in updates.split(block)]) for row in updates])


def krum_scores(updates: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each update: the sum of squared distances to its ``n - f - 2`` nearest others
    (Blanchard et al. 2017, Sec. 4); at least one neighbour while there are two updates. A row that is not
    finite scores +inf, the farthest outlier (its NaN score was taken by argmin for the least)."""
    n = len(updates)
    if n == 1:
        return torch.zeros(1, dtype=updates.dtype, device=updates.device)
    k = min(max(n - f - 2, 1), n - 1)
    d = _sq_dists(updates)
    d.fill_diagonal_(math.inf)  # not one's own neighbour
    return d.topk(k, dim=1, largest=False).values.sum(1).nan_to_num(nan=math.inf, posinf=math.inf)


@AGGREGATORS.register("krum")
class Krum(Aggregator):
    """Krum and Multi-Krum (Blanchard et al., NeurIPS 2017): the update with the smallest sum of squared
    distances to its ``n - f - 2`` nearest neighbours; with ``m > 1`` (Multi-Krum) the mean of the ``m``
    best-scored ones. Defined for ``n > 2f + 2``."""

    name = "krum"

    def __init__(self, m: int = 1) -> None:
        if m < 1:
            raise ConfigError(f"aggregator.m must be >= 1 (the updates Multi-Krum averages), got {m}")
        self.m = m

    def min_updates(self, f: int) -> int:
        return max(2 * f + 3, self.m)

    def check(self, n: int, f: int) -> None:
        # n > 2f + 2 holds and only m asks for more: name m (lowering f, as the general line says, cannot help)
        if 2 * f + 3 <= n < self.m:
            raise ConfigError(
                f"aggregator.m must be at most the {n} client updates a round reduces (the updates Multi-Krum "
                f"averages), got {self.m:.6g}"
            )
        super().check(n, f)

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """Krum's choice, or Multi-Krum's mean of the ``m`` best."""
        return self.best(updates, f, self.m)

    @staticmethod
    def best(updates: torch.Tensor, f: int, m: int) -> torch.Tensor:
        """Krum's choice (``m`` 1), or the mean of the ``m`` best-scored updates (ties: the earlier row)."""
        scores = krum_scores(updates, f)
        if m == 1:
            return updates[int(scores.argmin())]
        return updates[scores.argsort(stable=True)[:m]].mean(0)


@AGGREGATORS.register("multi_krum")
class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al. 2017): the mean of the ``m`` best-scored updates; ``m`` null: ``n - f``."""

    name = "multi_krum"

    def __init__(self, m: int | None = None) -> None:
        super().__init__(1 if m is None else m)
        self.m_given = m

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """The mean of the ``m`` best-scored rows (``n - f`` when ``m`` is null)."""
        return self.best(updates, f, self.m_given if self.m_given is not None else len(updates) - f)


@AGGREGATORS.register("bulyan")
class Bulyan(Aggregator):
    """Bulyan (El Mhamdi et al., ICML 2018): select ``theta = n - 2f`` updates by Krum applied again and again
    to the remaining ones, then per coordinate average the ``beta = theta - 2f`` selected values closest to
    their median. Defined for ``n >= 4f + 3``."""

    name = "bulyan"

    def min_updates(self, f: int) -> int:
        return 4 * f + 3

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """Krum selection of ``n - 2f`` rows, then the coordinate-wise mean of the ``n - 4f`` closest to the median."""
        n = len(updates)
        theta = n - 2 * f
        left = torch.arange(n, device=updates.device)
        chosen = []
        for _ in range(theta):
            best = int(krum_scores(updates[left], f).argmin())
            chosen.append(left[best])
            left = torch.cat([left[:best], left[best + 1 :]])
        sel = updates[torch.stack(chosen)]
        beta = theta - 2 * f
        med = _median(sel.sort(0).values)
        closest = (sel - med).abs().argsort(dim=0, stable=True)[:beta]
        return sel.gather(0, closest).mean(0)


@AGGREGATORS.register("dnc")
class DnC(Aggregator):
    """Divide-and-Conquer (Shejwalkar & Houmansadr, NDSS 2021, Alg. 2): ``niters`` times, sample ``b``
    coordinates, center the updates' sampled coordinates on their mean ``mu``, take the top right singular
    vector ``v`` of the centered rows and score each update ``s_i = ((g_i - mu) . v)^2``; keep the
    ``n - floor(c f)`` lowest scores. The aggregate is the mean of the updates kept in every iteration (the
    intersection of the good sets). The coordinates come from the ``rng`` the stage passes (its seeded
    stream), ``b`` of them without replacement, sorted; all of them where the update has at most ``b``.
    Defined for ``n > floor(c f)``; a round whose good sets have no update in common is refused."""

    name = "dnc"
    random = True

    def __init__(self, niters: int = 5, b: int = 10000, c: float = 1.0) -> None:
        if niters < 1:
            raise ConfigError(f"aggregator.niters must be >= 1 (the subsampling iterations), got {niters}")
        if niters > MAX_LOCAL_STEPS:  # the same typo catcher as local.steps: 1e300 would never end
            raise ConfigError(f"aggregator.niters must be in [1, {MAX_LOCAL_STEPS:,}], got {niters:.6g}")
        if b < 1:
            raise ConfigError(f"aggregator.b must be >= 1 (the coordinates each iteration samples), got {b}")
        if not c > 0:
            raise ConfigError(f"aggregator.c must be > 0 (the filtering fraction: c f updates cut), got {c}")
        self.niters, self.b, self.c = niters, b, c

    def cut(self, f: int) -> int:
        """The updates each iteration removes: ``floor(c f)``."""
        return math.floor(self.c * f)

    def min_updates(self, f: int) -> int:
        return self.cut(f) + 1

    def coordinates(self, d: int, rng: np.random.Generator) -> np.ndarray:
        """One iteration's sampled coordinates: ``b`` of the ``d`` without replacement, sorted (all if d <= b)."""
        if d <= self.b:
            return np.arange(d)
        return np.sort(rng.choice(d, size=self.b, replace=False))

    def good(self, updates: torch.Tensor, f: int, rng: np.random.Generator) -> torch.Tensor:
        """The rows kept in every iteration, in row order."""
        n, keep = len(updates), len(updates) - self.cut(f)
        good = torch.ones(n, dtype=torch.bool, device=updates.device)
        for _ in range(self.niters):
            cols = torch.as_tensor(self.coordinates(updates.shape[1], rng), device=updates.device)
            scores = self.scores(updates[:, cols])
            kept = torch.zeros(n, dtype=torch.bool, device=updates.device)
            kept[scores.argsort(stable=True)[:keep]] = True  # ties: the earlier row
            good &= kept
        return good.nonzero().flatten()

    @staticmethod
    def scores(sub: torch.Tensor) -> torch.Tensor:
        """One iteration's outlier scores ``((g_i - mu) . v)^2`` of the rows of ``sub`` (the sampled coordinates).

        Where the run's float width overflows (sign flipping scaled by 1e30 in float32: the scores' squares, the
        honest updates' too, are all +inf, their order lost, and the ranking kept the attackers) or a row is not
        finite (a Gaussian attack at float32's limit, where the SVD raised): again in float64, divided by the
        largest centered value (the scores' order does not change with the scale), ``mu`` and ``v`` from the
        finite rows only, and a row that is not finite scores +inf, the farthest outlier. Where every score is
        finite they are the plain computation's, unchanged."""
        centered = sub - sub.mean(0)
        if torch.isfinite(centered).all():
            scores = (centered @ torch.linalg.svd(centered, full_matrices=False).Vh[0]).pow(2)
            if torch.isfinite(scores).all():
                return scores
        wide = sub.double()
        finite = torch.isfinite(wide).all(1)
        scores = torch.full((len(sub),), math.inf, dtype=torch.float64, device=sub.device)
        if finite.any():
            centered = wide[finite] - wide[finite].mean(0)
            scale = centered.abs().max()
            centered = centered / scale if scale > 0 else centered
            scores[finite] = (centered @ torch.linalg.svd(centered, full_matrices=False).Vh[0]).pow(2)
        return scores

    def reduce(
        self, updates: torch.Tensor, weights: torch.Tensor, f: int, rng: np.random.Generator | None = None
    ) -> torch.Tensor:
        """The mean of the rows every iteration keeps."""
        if rng is None:
            raise ValueError("aggregator 'dnc' samples coordinates: reduce with rng, a seeded stream")
        good = self.good(updates, f, rng)
        if len(good) == 0:
            raise ConfigError(
                f"aggregator 'dnc': its {self.niters} iterations kept no update in common among {len(updates)} "
                f"(each cuts floor(c f) = {self.cut(f)}); lower aggregator.niters, aggregator.c or aggregator.f, "
                "or give each reduction more updates"
            )
        return updates[good].mean(0)


@AGGREGATORS.register("geometric_median")
class GeometricMedian(Aggregator):
    """The weighted geometric median ``argmin_v sum_i w_i ||v - u_i||`` by the smoothed Weiszfeld algorithm of
    RFA (Pillutla, Kakade & Harchaoui, IEEE TSP 2022, Alg. 3): ``v <- sum_i b_i u_i / sum_i b_i`` with
    ``b_i = w_i / max(nu, ||v - u_i||)``, from the weighted mean, for at most ``iters`` iterations or until the
    objective improves by less than ``tol`` (relative). Computed relative to the coordinate-wise median of the
    updates, so identical updates give that update exactly, and an attacker's huge row is never the origin (from
    a first row at 1e6, float32 kept the honest rows only to its step there, 0.0625)."""

    name = "geometric_median"
    reads_f = False

    def __init__(self, iters: int = 100, nu: float = 1e-6, tol: float = 1e-7) -> None:
        if not 1 <= iters <= MAX_LOCAL_STEPS:  # the same typo catcher as local.steps
            raise ConfigError(f"aggregator.iters must be in [1, {MAX_LOCAL_STEPS:,}], got {iters:.6g}")
        if not 0 < nu <= MAX_LR:  # clamped in float32 at most: a larger nu overflows it
            raise ConfigError(f"aggregator.nu must be in (0, {MAX_LR:.6g}], got {nu}")
        if tol < 0:
            raise ConfigError(f"aggregator.tol must be >= 0, got {tol}")
        self.iters, self.nu, self.tol = iters, nu, tol

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """The smoothed Weiszfeld iterations from the weighted mean."""
        updates, weights = _finite_rows(updates, weights)  # a row of no finite length: no distance to weigh
        origin = updates.median(dim=0).values  # within the honest rows' range while attackers are a minority
        z = updates - origin
        w = weights.to(z.dtype)
        v = w @ z

        # _norms: in float64 where a distance overflows the run's float width (float32 attackers at about 1e30
        # are finite, the sum of their squares is not): every b_i was w_i / inf = 0 and v = 0/0, NaN
        def objective(v: torch.Tensor) -> float:
            norms = _norms(z - v)
            return float(w.to(norms.dtype) @ norms)

        obj = objective(v)
        for _ in range(self.iters):
            b = w / _norms(z - v).clamp_min(self.nu)
            v = (b / b.sum()).to(z.dtype) @ z
            new = objective(v)
            done = abs(obj - new) <= self.tol * max(new, 1e-300)
            obj = new
            if done:
                break
        return origin + v


def _norms(rows: torch.Tensor) -> torch.Tensor:
    """The rows' Euclidean norms; in float64 where a norm overflows the run's float width (float32 rows of about
    1e30 are finite, the sum of their squares is not), so that a length-measuring aggregator scales such a row
    rather than zeroing it (``M / inf`` was 0). Where every norm is finite they are the plain ones, unchanged."""
    norms = rows.norm(dim=1)
    return norms if bool(torch.isfinite(norms).all()) else rows.double().norm(dim=1)


def _finite_rows(updates: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows with every entry finite, their weights renormalised. An aggregator that measures lengths cannot
    scale a row of no finite length (``M / inf * inf`` and any NaN are NaN): such a row, which one attacker's
    overflowing update is, is dropped, as the scoring aggregators (Krum, DnC) rank it last; without one the
    rows are returned as they are (and where no row is finite the round diverges, as the mean would)."""
    finite = torch.isfinite(updates).all(dim=1)
    if bool(finite.all()) or not bool(finite.any()):
        return updates, weights
    kept = weights[finite]
    return updates[finite], kept / kept.sum()


@AGGREGATORS.register("centered_clipping")
class CenteredClipping(Aggregator):
    """Centered clipping (Karimireddy, He & Jaggi, ICML 2021, eq. 2): from the center ``v`` (the previous
    round's aggregate, zero at first), ``iters`` times ``v <- v + sum_i w_i (u_i - v) min(1, tau/||u_i - v||)``.
    The paper's clients send momentum; here the rows are whatever the method's clients send."""

    name = "centered_clipping"
    reads_f = False
    stateful = True
    translation_equivariant = False  # it clips lengths around its center

    def __init__(self, tau: float = 1.0, iters: int = 1) -> None:
        if not tau > 0:
            raise ConfigError(f"aggregator.tau must be > 0 (the clipping radius), got {tau}")
        if not 1 <= iters <= MAX_LOCAL_STEPS:  # the same typo catcher as local.steps: 1e300 would never end
            raise ConfigError(f"aggregator.iters must be in [1, {MAX_LOCAL_STEPS:,}], got {iters:.6g}")
        self.tau, self.iters = tau, iters
        self.center: torch.Tensor | None = None

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """``iters`` clipping steps from the last round's aggregate; the result is the next round's center."""
        updates, weights = _finite_rows(updates, weights)  # a row of no finite length cannot be clipped to tau
        v = self.center if self.center is not None else torch.zeros_like(updates[0])
        w = weights.to(updates.dtype)
        for _ in range(self.iters):
            diff = updates - v
            norms = _norms(diff)
            scale = (self.tau / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0).to(diff.dtype)
            v = v + (w * scale) @ diff
        self.center = v.clone()
        return v

    def state_dict(self) -> dict[str, Any]:
        """The center (the last aggregate), None before the first round."""
        return {"center": self.center}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the center."""
        self.center = state.get("center")


@AGGREGATORS.register("norm_bound")
class NormBound(Aggregator):
    """Norm bounding (Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated Learning?", 2019, Sec.
    4): every update longer than ``M`` is scaled to length ``M``, ``u_i min(1, M/||u_i||)``, then the weighted mean.
    ``bound``: M; null: the median of the round's update norms (the adaptive bound of FLAME, Nguyen et al.,
    USENIX Security 2022), which needs no scale and holds while attackers are fewer than half the updates. No
    update longer than M: the weighted mean, bit for bit."""

    name = "norm_bound"
    reads_f = False
    translation_equivariant = False  # it bounds lengths

    def __init__(self, bound: float | None = None) -> None:
        if bound is not None and not bound > 0:
            raise ConfigError(f"aggregator.bound must be > 0 (the largest update norm kept) or null, got {bound}")
        self.bound = bound

    def reduce(self, updates: torch.Tensor, weights: torch.Tensor, f: int) -> torch.Tensor:
        """The weighted mean of the updates, each scaled to norm at most M."""
        updates, weights = _finite_rows(updates, weights)  # a row of no finite length cannot be scaled to M
        norms = _norms(updates)
        m = self.bound if self.bound is not None else _median(norms.sort().values)
        long = norms > m
        scale = (m / norms.clamp_min(torch.finfo(norms.dtype).tiny)).to(updates.dtype)
        clipped = torch.where(long.unsqueeze(1), updates * scale.unsqueeze(1), updates)
        return weights @ clipped


def bucketed(updates: torch.Tensor, weights: torch.Tensor, size: int, perm: torch.Tensor):
    """Bucketing (Karimireddy, He & Jaggi, ICLR 2022, Alg. 1): the updates in the random order ``perm``, split
    into buckets of ``size`` consecutive ones (the last may be smaller); each bucket's weighted mean, and each
    bucket's weight (the sum of its members', so the weights still sum to one)."""
    u, w = updates[perm], weights[perm]
    means, ws = [], []
    for s in range(0, len(u), size):
        ub, wb = u[s : s + size], w[s : s + size]
        total = wb.sum()
        means.append((wb / total) @ ub if float(total) > 0 else ub.mean(0))
        ws.append(total)
    return torch.stack(means), torch.stack(ws)
