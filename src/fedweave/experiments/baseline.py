"""A sweep's points against a baseline point, paired by seed: ``fedweave sweep --baseline``.

Each point's final metric is compared with the baseline point's on the seeds both ran to completion with a
finite value: the mean difference (point minus baseline), its ``level`` interval by the paired ``t`` or
``bootstrap`` test, the number of pairs, and the outcome in the metric's direction (``better``, ``worse`` or
``inconclusive``; ``n < 2`` when fewer than 2 seeds pair). The interval and the outcome are those of a
:class:`fedweave.experiments.verdicts.Paired` rule with minimum effect 0 (direction ``greater`` where higher
is better, ``less`` where lower is): the code the reproductions' verdicts use, not a copy of it. ``fedweave
sweep`` writes them into summary.csv and ``fedweave report`` renders them from the runs' files by the same
function, :func:`compare`.

Why a seed pairs: a point's seed is the root of every random stream of its run (``fedweave.seeding.Seeds``):
the partition, the model's initialisation, the clients sampled each round, each client's batches. A stream's
seed depends only on the root seed and its name and keys (e.g. ``("client_sampling", round)``), never on the
order of the draws, so the two runs of one seed at two points draw the same partition, initial weights and
sampled clients as long as the keys the grid varies do not change what those draws mean (a grid over
``partition.alpha``, ``model.name`` or ``algorithm.clients_per_round`` does: the seed still pairs, but the
paired runs no longer share that stream's outcome).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from fedweave.config import ConfigError
from fedweave.experiments.grid import _text
from fedweave.experiments.verdicts import HELD, INCONCLUSIVE, NOT_HELD, TESTS, Paired

BETTER, WORSE, FEW = "better", "worse", "n < 2"
OUTCOMES = {HELD: BETTER, NOT_HELD: WORSE, INCONCLUSIVE: INCONCLUSIVE}  # a verdict -> the point's outcome
BASELINE = "baseline"  # the baseline point's own outcome cell


@dataclass(frozen=True)
class Comparison:
    """A point against the baseline: the mean of the per-seed differences (point minus baseline) ``diff``,
    its interval ``low``-``high`` (None with fewer than 2 pairs), the pairs ``n``, the ``outcome`` (better,
    worse, inconclusive, ``n < 2``, or ``baseline`` for the baseline itself) and ``unpaired``, the seeds of
    either point left out and why (``5 diverged``, ``6 baseline unfinished``)."""

    outcome: str
    diff: float | None
    low: float | None
    high: float | None
    n: int
    unpaired: str = ""


def parse_baseline(text: str | Mapping[str, Any], flag: str = "--baseline") -> dict[str, Any] | str:
    """``"KEY=VALUE[,KEY=VALUE]"`` -> ``{KEY: VALUE}`` (values read as YAML, as ``--grid``'s are); a mapping
    is taken as it is; a bare ``"VALUE"`` (no ``=``) is returned as a string, the one-axis shorthand that
    :func:`resolve` accepts when the sweep varies one key."""
    if isinstance(text, Mapping):
        if not text or not all(isinstance(k, str) for k in text):
            raise ConfigError(f"{flag} must name a grid point as KEY: VALUE entries, got {dict(text)!r}")
        return dict(text)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{flag} must name a grid point, e.g. algorithm.name=fedavg; got {text!r}")
    if "=" not in text:
        return text
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {text!r}: {item!r} must look like KEY=VALUE (e.g. algorithm.name=fedavg)")
        if key in out:
            raise ConfigError(f"{flag} {text!r}: key {key!r} is given twice")
        try:
            out[key] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"{flag} {key}: the value {raw!r} is not valid YAML ({e})") from e
    return out


def _same(a: Any, b: Any) -> bool:
    """Whether a grid value and a baseline value are one value (``1e-3`` read as text matches ``0.001``)."""
    if a == b:
        return True
    try:
        return not isinstance(a, bool) and not isinstance(b, bool) and float(a) == float(b)
    except (TypeError, ValueError):
        return False


def resolve(
    wanted: dict[str, Any] | str, points: Sequence[tuple[tuple[str, Any], ...]], flag: str = "--baseline"
) -> str:
    """The label (``key=value,...``, a point's ``label``) of the one grid point ``wanted`` names, among the
    ``points`` (each its grid values, in the sweep's order). A key that is not a grid or zipped key, a value
    no point has, or keys that leave several points are one ``ConfigError`` line naming what is allowed."""
    values = list(dict.fromkeys(points))
    keys = list(dict.fromkeys(k for p in values for k, _ in p))
    if not keys:
        raise ConfigError(f"{flag}: the sweep has no grid, so there is no other point to compare with a baseline")
    if isinstance(wanted, str):  # the shorthand: one value of the sweep's one key
        if len(keys) > 1:
            raise ConfigError(
                f"{flag} {wanted!r} must name its key when the sweep varies {len(keys)} keys "
                f"({', '.join(keys)}): e.g. {keys[0]}={_text(values[0][0][1])}"
            )
        wanted = {keys[0]: yaml.safe_load(wanted)}
    for k in wanted:
        if k not in keys:
            raise ConfigError(f"{flag}: key {k!r} is not a key of the sweep's grid; allowed: {', '.join(keys)}")
    chosen = [p for p in values if all(_same(dict(p)[k], v) for k, v in wanted.items())]
    text = ",".join(f"{k}={_text(v)}" for k, v in wanted.items())
    if not chosen:
        have = {k: list(dict.fromkeys(_text(dict(p)[k]) for p in values)) for k in wanted}
        allowed = "; ".join(f"{k}: {', '.join(v)}" for k, v in have.items())
        raise ConfigError(f"{flag} {text} names no point of the sweep's grid; its values are {allowed}")
    if len(chosen) > 1:
        rest = [k for k in keys if k not in wanted]
        raise ConfigError(
            f"{flag} {text} names {len(chosen)} points of the sweep's grid; add a value for {', '.join(rest)}"
        )
    return ",".join(f"{k}={_text(v)}" for k, v in chosen[0])


def check_test(level: Any, test: Any, flag: str = "--") -> tuple[float, str]:
    """``(level, test)`` when ``level`` is in (0, 1) and ``test`` one of ``verdicts.TESTS``; else one line."""
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0 < level < 1:
        raise ConfigError(f"{flag}level {level!r} must be a confidence level in (0, 1), e.g. 0.95")
    if test not in TESTS:
        raise ConfigError(f"{flag}test {test!r} unknown; allowed: {', '.join(TESTS)}")
    return float(level), str(test)


def _value(r: Mapping[str, Any], key: str) -> tuple[float | None, str]:
    """A run's value and, when it has none to pair, why (its status, or its non-finite value)."""
    if r.get("status") != "completed":
        return None, str(r.get("status"))
    v = r.get(key)
    if v is None or not isinstance(v, int | float) or not math.isfinite(v):
        return None, f"{key} {v!r}"  # a completed run that ended on NaN is not paired either
    return float(v), ""


def per_seed(records: Sequence[Mapping[str, Any]], key: str, baseline: str) -> dict[tuple[str, Any], float]:
    """``{(point, seed): value minus the baseline's value at that seed}`` for every run that pairs (both it and
    the baseline's run of its seed completed with a finite ``key``): sweep.csv's per-run difference."""
    base = {r["seed"]: _value(r, key)[0] for r in records if r["point"] == baseline}
    out = {}
    for r in records:
        v, b = _value(r, key)[0], base.get(r["seed"])
        if v is not None and b is not None:
            out[(r["point"], r["seed"])] = v - b
    return out


def compare(
    records: Sequence[Mapping[str, Any]],
    key: str,
    baseline: str,
    direction: str,
    level: float = 0.95,
    test: str = "t",
) -> dict[str, Comparison]:
    """Every point of ``records`` (one dict per run: ``point``, ``seed``, ``status`` and the value ``key``)
    against the ``baseline`` point: a :class:`Comparison` per point, in the records' order. ``direction``
    (``max`` or ``min``, :func:`fedweave.tasks.column_direction`) says which sign is better. Only
    ``completed`` runs with a finite value pair; the others are named in ``unpaired``, never silently dropped."""
    points = list(dict.fromkeys(r["point"] for r in records))
    out = {}
    for point in points:
        if point == baseline:
            out[point] = Comparison(BASELINE, None, None, None, 0)
            continue
        a = {r["seed"]: _value(r, key) for r in records if r["point"] == point}
        b = {r["seed"]: _value(r, key) for r in records if r["point"] == baseline}
        pairs = sorted(s for s in set(a) & set(b) if a[s][0] is not None and b[s][0] is not None)
        left = [f"{s} {a[s][1]}" for s in sorted(a, key=str) if a[s][0] is None]
        left += [f"{s} baseline {b[s][1]}" for s in sorted(b, key=str) if b[s][0] is None and s in a]
        left += [f"{s} no baseline run" for s in sorted(set(a) - set(b), key=str) if a[s][0] is not None]
        unpaired = "; ".join(left)
        if len(pairs) < 2:
            diff = a[pairs[0]][0] - b[pairs[0]][0] if pairs else None  # type: ignore[operator]
            out[point] = Comparison(FEW, diff, None, None, len(pairs), unpaired)
            continue
        rule = Paired(
            key,
            {"point": point},
            {"point": baseline},
            direction="greater" if direction == "max" else "less",  # min effect 0: any difference counts
            test=test,
            level=level,
            unit="",
            name=f"{point} vs baseline {baseline}",
        )
        d = rule.decide({s: a[s][0] for s in pairs}, {s: b[s][0] for s in pairs})
        out[point] = Comparison(OUTCOMES[d.outcome], d.estimate, d.low, d.high, d.n, unpaired)
    return out


def columns(metric: str) -> tuple[str, str, str, str, str, str]:
    """summary.csv's column names of a comparison: the mean difference, its interval's ends, the pairs, the
    outcome and the seeds left out."""
    return (f"{metric}_diff", f"{metric}_diff_low", f"{metric}_diff_high", "pairs", "vs_baseline", "unpaired")


def row(c: Comparison, metric: str) -> dict[str, Any]:
    """A comparison as summary.csv's cells (:func:`columns`; an empty cell, None, where there is nothing)."""
    n = None if c.outcome == BASELINE else c.n
    return dict(zip(columns(metric), (c.diff, c.low, c.high, n, c.outcome, c.unpaired or None)))
