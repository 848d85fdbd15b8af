"""Statistics over a grid point's seeds: mean and standard deviation, the runs that did not diverge, a
statistic that needs every seed, and rounds/bytes to reach a target."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


def mean_std(values: list[float], ddof: int = 1) -> tuple[float, float]:
    """Mean and standard deviation with ``ddof`` (1: the sample std, 0: the population std; 0 for a single
    value); NaN, NaN for none. ``None`` values are left out; a NaN makes both NaN."""
    xs = np.asarray([float(v) for v in values if v is not None], dtype=float)
    if len(xs) == 0:
        return math.nan, math.nan
    return float(xs.mean()), float(xs.std(ddof=ddof)) if len(xs) > 1 else 0.0


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


def finite(values: list[float]) -> tuple[list[float], int]:
    """The finite values (the runs that did not diverge), and how many others there were."""
    ok = [v for v in values if math.isfinite(v)]
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
