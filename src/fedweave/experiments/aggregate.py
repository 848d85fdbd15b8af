"""Statistics over a sweep's seeds: mean and standard deviation, and rounds/bytes to reach a target."""

from __future__ import annotations

import math
from typing import Any


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaN, NaN for none."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


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
