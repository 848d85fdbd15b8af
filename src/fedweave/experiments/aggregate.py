"""Statistics over a grid point's seeds: mean and standard deviation, the runs that did not diverge, a
statistic that needs every seed, and rounds/bytes to reach a target."""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np


def mean_std(values: list[float], ddof: int = 1) -> tuple[float, float]:
    """Mean and standard deviation with ``ddof`` (1: the sample std, 0: the population std; 0 for a single
    value); NaN, NaN for none. ``None`` values are left out; a NaN makes both NaN."""
    xs = np.asarray([float(v) for v in values if v is not None], dtype=float)
    if len(xs) == 0:
        return math.nan, math.nan
    if len(xs) == 1:  # one value has no spread, unless it is NaN: no run's value, no spread either
        return float(xs[0]), math.nan if math.isnan(xs[0]) else 0.0
    return float(xs.mean()), float(xs.std(ddof=ddof))


def group(records: list[Any], key: Callable[[Any], Any]) -> dict[Any, list[Any]]:
    """The records per ``key(record)`` (e.g. a grid point's seeds), keys in order of first appearance."""
    groups: dict[Any, list[Any]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return groups


def seed_gaps(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> list[float]:
    """Per seed both ran (in seed order): ``b``'s ``key`` minus ``a``'s."""
    x, y = {r["seed"]: r[key] for r in a}, {r["seed"]: r[key] for r in b}
    return [y[s] - x[s] for s in sorted(set(x) & set(y))]


def is_finite(value: Any) -> bool:
    """A finite number: not NaN or infinite (a diverged run), nor missing (None: a record read back without it,
    on which ``math.isfinite`` raised a TypeError)."""
    return isinstance(value, numbers.Real) and math.isfinite(value)  # numpy's scalars too


def finite(values: list[float]) -> tuple[list[float], int]:
    """The finite values (the runs that did not diverge), and how many others there were."""
    ok = [v for v in values if is_finite(v)]
    return ok, len(values) - len(ok)


def if_all(values: list[Any], stat: Callable[[list[Any]], Any]) -> Any:
    """``stat`` of the values when every seed has one (e.g. reached a target), else None."""
    return stat(values) if values and all(v is not None for v in values) else None


def to_target(
    rows: list[dict[str, Any]], metric: str, target: float, x: str = "round", direction: str = "max"
) -> float | None:
    """The first ``x`` (round or bytes_total) at which ``metric`` reaches ``target`` (at least it, or at most
    it where lower is better, ``direction="min"``); None if it never does."""
    for r in rows:
        v = r.get(metric)
        if v is not None and (v >= target if direction == "max" else v <= target):
            return r[x]
    return None


def best_trained(rows: list[dict[str, Any]], metric: str, direction: str = "max") -> float | None:
    """The best ``metric`` over a run's rounds trained (round > 0, as ``summary.json``'s best: an
    ``eval.at_start`` row 0 is the initial model, not a result); None if no such row has it."""
    better = max if direction == "max" else min
    return better((r[metric] for r in rows if r.get(metric) is not None and r["round"] > 0), default=None)


# ---- per-cell summaries over seeds, declared by keys --------------------------------------------------------
Stat = Callable[[list[Any]], Any]  # a cell's statistic: its records -> a value


def best_point(means: list[float], whole: list[bool], direction: str = "max") -> int | None:
    """The index of a sweep's best point: the best finite mean (``direction``: max or min) among the points
    whose every run completed (``whole``), so that a mean over the one seed of five that did not diverge does
    not make a point best; None when no point qualifies."""
    scored = [i for i, (m, w) in enumerate(zip(means, whole, strict=True)) if w and not math.isnan(m)]
    return (max if direction == "max" else min)(scored, key=lambda i: means[i]) if scored else None


def per_cell(records: list[Any], by: tuple[str, ...], stats: dict[str, Stat]) -> list[dict[str, Any]]:
    """One row per cell (the records that share their values of ``by``, e.g. a grid point's seeds), cells in
    order of first appearance: the cell's values of ``by``, then each named statistic of its records."""
    cells = group(records, lambda r: tuple(r[k] for k in by))
    return [{**dict(zip(by, key)), **{name: stat(rs) for name, stat in stats.items()}} for key, rs in cells.items()]


def mean_of(key: str, where: Callable[[list[Any]], list[Any]] = list, ddof: int = 1, nd: int | None = None) -> Stat:
    """The mean of ``key`` over a cell's records (those ``where`` keeps), rounded to ``nd`` decimals if given."""
    return lambda rs: _round(mean_std([r[key] for r in where(rs)], ddof)[0], nd)


def std_of(key: str, where: Callable[[list[Any]], list[Any]] = list, ddof: int = 1, nd: int | None = None) -> Stat:
    """The standard deviation of ``key`` over a cell's records (those ``where`` keeps), rounded to ``nd``
    decimals if given."""
    return lambda rs: _round(mean_std([r[key] for r in where(rs)], ddof)[1], nd)


def _round(x: float, nd: int | None) -> float:
    return x if nd is None else round(x, nd)


def seed_value(value: Any, fmt: str = ".2f") -> str:
    """One seed's value as a table lists it: formatted, or ``diverged`` where it is not finite (the run has none)."""
    return format(value, fmt) if is_finite(value) else "diverged"


def per_seed(key: str, fmt: str = ".2f", sep: str = " / ") -> Stat:
    """A cell's values of ``key`` in seed order, each a ``seed_value``, joined by ``sep``."""
    return lambda rs: sep.join(seed_value(r[key], fmt) for r in sorted(rs, key=lambda r: r["seed"]))


def median_of(key: str) -> Stat:
    """The median of ``key`` over a cell's records when every one has a value (e.g. reached a target), else None."""
    return lambda rs: if_all([r.get(key) for r in rs], statistics.median)


def iqr_of(key: str) -> Stat:
    """A cell's interquartile range of ``key`` (``q25-q75``, whole numbers) when every one of its 2 or more records
    has a value, else ""."""

    def stat(rs: list[Any]) -> str:
        got = [r[key] for r in rs if r[key] is not None]
        return f"{np.percentile(got, 25):.0f}-{np.percentile(got, 75):.0f}" if len(got) == len(rs) > 1 else ""

    return stat


def finite_runs(key: str, by_seed: bool = False, or_all: bool = False) -> Callable[[list[Any]], list[Any]]:
    """A cell's records whose ``key`` is finite (the runs that did not diverge), in seed order with ``by_seed``;
    with ``or_all`` all of them when none is (the cell then reads NaN)."""

    def runs(rs: list[Any]) -> list[Any]:
        ok = [r for r in rs if is_finite(r[key])]
        if by_seed:
            return sorted(ok, key=lambda r: r["seed"])
        return (ok or rs) if or_all else ok

    return runs


def diverged(key: str) -> Stat:
    """How many of a cell's records have no finite ``key`` (runs that diverged)."""
    return lambda rs: sum(not is_finite(r[key]) for r in rs)


def ranks(values: dict[Any, float]) -> dict[Any, int]:
    """The rank of each key by its value: 1 the largest; equal values keep the order given; a NaN (a cell whose
    every seed diverged) ranks after every number."""

    def order(k: Any) -> tuple[bool, float]:  # a NaN compares false with everything and would scramble the sort
        nan = not isinstance(values[k], numbers.Real) or math.isnan(values[k])  # None (missing) as a NaN
        return nan, 0.0 if nan else -values[k]

    return {k: i + 1 for i, k in enumerate(sorted(values, key=order))}
