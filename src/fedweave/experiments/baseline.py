"""A sweep's points against a baseline point, paired by seed: ``fedweave sweep --baseline``.

Each point's final metric is compared with the baseline point's on the seeds both ran to completion with a
finite value: the mean difference (point minus baseline), its ``level`` interval by the paired ``t`` or
``bootstrap`` test, the number of pairs, and the outcome in the metric's direction (``better``, ``worse`` or
``inconclusive``; ``n < 2`` when fewer than 2 seeds pair). The interval and the outcome are those of a
:class:`fedweave.experiments.verdicts.Paired` rule with minimum effect 0 (direction ``greater`` where higher
is better, ``less`` where lower is): the code the reproductions' verdicts use, not a copy of it. ``fedweave
sweep`` writes them into summary.csv and ``fedweave report`` renders them from the runs' files by the same
function, :func:`compare`.

Many points against one baseline: ``correction`` (``--correction``) ``holm`` or ``bonferroni`` makes the
comparisons a family whose chance of one or more false ``better``/``worse`` calls is at most ``1 - level``
(the family-wise error rate), instead of ``1 - level`` for each point. The family is the points with 2 or more
pairs (m of them); each has the two-sided p-value of a zero mean difference that its interval inverts
(:meth:`fedweave.experiments.verdicts.Paired.p_value`: the paired t test's, or the percentile bootstrap's
by inverting its interval), so a comparison is called at level ``L`` exactly when ``p < 1 - L``. With
``alpha = 1 - level``:

- ``bonferroni``: every interval at level ``1 - alpha / m``; adjusted p-value ``min(1, m p)``.
- ``holm`` (S. Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6 (1979)
  65-70; the step-down): the p-values ranked ``p_(1) <= ... <= p_(m)``; the comparison of rank
  ``i`` is called while ``p_(j) < alpha / (m - j + 1)`` for every ``j <= i``, and its interval is at its own
  rank's level ``1 - alpha / (m - i + 1)``; at the first rank ``k`` where that fails the step-down stops, and
  rank ``k`` and every later one are inconclusive, their intervals at rank ``k``'s level ``1 - alpha / (m - k +
  1)`` (where each of them includes 0, since their p-values are no smaller than ``p_(k)``, so every interval
  agrees with its outcome). Adjusted p-value ``max over j <= i of min(1, (m - j + 1) p_(j))``.
- ``none`` (the default): each interval at ``level``, as without the option.

An outcome is ``better`` or ``worse`` exactly when its adjusted p-value is below ``alpha``. The default is
``none`` so that a sweep run as before gives the outcomes and files it gave: a correction widens intervals, and
turned on by default it would turn some ``better`` points of existing sweeps ``inconclusive`` unasked.

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
from dataclasses import dataclass, replace
from typing import Any

import yaml

from fedweave.config import ConfigError, split_values, yaml_load
from fedweave.experiments.grid import _text
from fedweave.experiments.verdicts import HELD, INCONCLUSIVE, NOT_HELD, TESTS, Paired

BETTER, WORSE, FEW = "better", "worse", "n < 2"
OUTCOMES = {HELD: BETTER, NOT_HELD: WORSE, INCONCLUSIVE: INCONCLUSIVE}  # a verdict -> the point's outcome
BASELINE = "baseline"  # the baseline point's own outcome cell
CORRECTIONS = ("none", "holm", "bonferroni")  # --correction's values; none: each interval at --level on its own


@dataclass(frozen=True)
class Comparison:
    """A point against the baseline: the mean of the per-seed differences (point minus baseline) ``diff``,
    its interval ``low``-``high`` (None with fewer than 2 pairs), the pairs ``n``, the ``outcome`` (better,
    worse, inconclusive, ``n < 2``, or ``baseline`` for the baseline itself), ``unpaired``, the seeds of
    either point left out and why (``seed 5 diverged``, ``seed 6 baseline unfinished``), and, for a point with 2 or more
    pairs, ``level``, the confidence level of its interval (the one asked for, or the corrected one), ``p``, the
    two-sided p-value of a zero difference, and ``p_adjusted``, that p-value after the correction."""

    outcome: str
    diff: float | None
    low: float | None
    high: float | None
    n: int
    unpaired: str = ""
    level: float | None = None
    p: float | None = None
    p_adjusted: float | None = None


def parse_baseline(text: str | Mapping[str, Any], flag: str = "--baseline") -> dict[str, Any] | str:
    """``"KEY=VALUE[,KEY=VALUE]"`` -> ``{KEY: VALUE}`` (values read as YAML, the pairs cut at the commas
    outside brackets and quotes, as ``--grid``'s values are); a mapping is taken as it is; a bare ``"VALUE"``
    (no ``=``) is returned as a string, the one-axis shorthand that :func:`resolve` accepts when the sweep varies
    one key."""
    if isinstance(text, Mapping):
        if not text or not all(isinstance(k, str) for k in text):
            raise ConfigError(f"{flag} must name a grid point as KEY: VALUE entries, got {dict(text)!r}")
        return dict(text)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{flag} must name a grid point, e.g. algorithm.name=fedavg; got {text!r}")
    if "=" not in text:
        return text
    out: dict[str, Any] = {}
    try:
        items = split_values(text, after="=")  # a list value (model.hidden=[128,64]) is one pair's
    except ConfigError as e:
        raise ConfigError(f"{flag} {text!r}: {e}") from e
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {text!r}: {item!r} must look like KEY=VALUE (e.g. algorithm.name=fedavg)")
        if key in out:
            raise ConfigError(f"{flag} {text!r}: key {key!r} is given twice")
        try:
            out[key] = yaml_load(raw)  # as --grid's values and key=value overrides are read (012 is 12)
        except (yaml.YAMLError, ConfigError) as e:
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
    # the points by their labels: a list or mapping value ([128, 64]) cannot be a dict key itself
    values = list({_label(p): p for p in points}.values())
    keys = list(dict.fromkeys(k for p in values for k, _ in p))
    if not keys:
        raise ConfigError(f"{flag}: the sweep has no grid, so there is no other point to compare with a baseline")
    if isinstance(wanted, str):  # the shorthand: one value of the sweep's one key
        if len(keys) > 1:
            raise ConfigError(
                f"{flag} {wanted!r} must name its key when the sweep varies {len(keys)} keys "
                f"({', '.join(keys)}): e.g. {keys[0]}={_text(values[0][0][1])}"
            )
        try:
            wanted = {keys[0]: yaml_load(wanted)}
        except (yaml.YAMLError, ConfigError) as e:  # as a KEY=VALUE baseline's value: one line, no traceback
            raise ConfigError(f"{flag}: the value {wanted!r} is not valid YAML ({' '.join(str(e).split())})") from e
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
    return _label(chosen[0])


def _label(point: Sequence[tuple[str, Any]]) -> str:
    """A point's values as its label (``Point.label``): ``key=value,...``."""
    return ",".join(f"{k}={_text(v)}" for k, v in point)


def check_test(level: Any, test: Any, flag: str = "--") -> tuple[float, str]:
    """``(level, test)`` when ``level`` is in (0, 1) and ``test`` one of ``verdicts.TESTS``; else one line."""
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0 < level < 1:
        raise ConfigError(f"{flag}level {level!r} must be a confidence level in (0, 1), e.g. 0.95")
    if test not in TESTS:
        raise ConfigError(f"{flag}test {test!r} unknown; allowed: {', '.join(TESTS)}")
    return float(level), str(test)


def check_correction(correction: Any, flag: str = "--") -> str:
    """``correction`` when it is one of :data:`CORRECTIONS`; else one line naming the allowed values."""
    if correction not in CORRECTIONS:
        raise ConfigError(f"{flag}correction {correction!r} unknown; allowed: {', '.join(CORRECTIONS)}")
    return str(correction)


def _ranked(pvalues: Sequence[float]) -> list[int]:
    """The indices of ``pvalues`` from the smallest p-value up (ties in their given order: the sweep's)."""
    return sorted(range(len(pvalues)), key=lambda i: pvalues[i])


def adjust(pvalues: Sequence[float], correction: str) -> list[float]:
    """The adjusted p-values of a family of ``pvalues`` (module docstring), in their order: ``bonferroni``
    ``min(1, m p)``; ``holm`` the step-down's ``max_{j <= i} min(1, (m - j + 1) p_(j))`` at rank ``i``;
    ``none`` the p-values as they are. A comparison is called at family-wise level ``1 - alpha`` when its
    adjusted p-value is below ``alpha``."""
    m = len(pvalues)
    if correction == "none":
        return [float(p) for p in pvalues]
    if correction == "bonferroni":
        return [min(1.0, m * float(p)) for p in pvalues]
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(_ranked(pvalues)):  # rank 0 is Holm's i = 1, compared with alpha / m
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))  # adjusted p-values never decrease
        out[i] = running
    return out


def levels(pvalues: Sequence[float], level: float, correction: str) -> list[float]:
    """The confidence level of each comparison's interval (module docstring), in the order of ``pvalues``:
    ``level`` for ``none``; ``1 - alpha / m`` for ``bonferroni``; for ``holm`` ``1 - alpha / (m - i + 1)`` at
    rank ``i`` while the step-down calls, and the level of the rank where it stopped for that rank and every
    later one."""
    m, alpha = len(pvalues), 1 - level
    if correction == "none":
        return [level] * m
    if correction == "bonferroni":
        return [1 - alpha / m] * m
    out, stopped = [level] * m, None
    for rank, i in enumerate(_ranked(pvalues)):
        if stopped is None and not pvalues[i] < alpha / (m - rank):  # not below: an interval that touches 0
            stopped = 1 - alpha / (m - rank)
        out[i] = 1 - alpha / (m - rank) if stopped is None else stopped
    return out


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
    correction: str = "none",
) -> dict[str, Comparison]:
    """Every point of ``records`` (one dict per run: ``point``, ``seed``, ``status`` and the value ``key``)
    against the ``baseline`` point: a :class:`Comparison` per point, in the records' order. ``direction``
    (``max`` or ``min``, :func:`fedweave.tasks.column_direction`) says which sign is better. Only
    ``completed`` runs with a finite value pair; the others are named in ``unpaired``, never silently dropped.
    ``correction`` (:data:`CORRECTIONS`) corrects the points with 2 or more pairs as one family (module
    docstring); ``none`` gives each point's interval at ``level``."""
    check_correction(correction, "")
    points = list(dict.fromkeys(r["point"] for r in records))
    out: dict[str, Comparison] = {}
    tested: dict[str, tuple[Paired, dict, dict, float]] = {}  # the family: a rule, its sides and p-value
    for point in points:
        if point == baseline:
            out[point] = Comparison(BASELINE, None, None, None, 0)
            continue
        a = {r["seed"]: _value(r, key) for r in records if r["point"] == point}
        b = {r["seed"]: _value(r, key) for r in records if r["point"] == baseline}
        pairs = sorted(s for s in set(a) & set(b) if a[s][0] is not None and b[s][0] is not None)
        left = [f"seed {s} {a[s][1]}" for s in sorted(a, key=str) if a[s][0] is None]
        left += [f"seed {s} baseline {b[s][1]}" for s in sorted(b, key=str) if b[s][0] is None and s in a]
        left += [f"seed {s} no baseline run" for s in sorted(set(a) - set(b), key=str) if a[s][0] is not None]
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
        sides = {s: a[s][0] for s in pairs}, {s: b[s][0] for s in pairs}
        tested[point] = (rule, *sides, rule.p_value(rule.differences(*sides)))
        out[point] = Comparison(FEW, None, None, None, len(pairs), unpaired)  # its place; decided below
    ps = [p for *_, p in tested.values()]
    for (point, (rule, a_side, b_side, p)), at, adjusted in zip(
        tested.items(), levels(ps, level, correction), adjust(ps, correction)
    ):
        # none: at == level, the rule as it always was, so the interval and outcome are the uncorrected ones
        d = (rule if at == level else replace(rule, level=at)).decide(a_side, b_side)
        c = out[point]
        out[point] = Comparison(OUTCOMES[d.outcome], d.estimate, d.low, d.high, d.n, c.unpaired, at, p, adjusted)
    return out


CORRECTED = ("interval_level", "p_value", "p_adjusted", "correction")  # the columns --correction adds


def columns(metric: str, corrected: bool = False) -> tuple[str, ...]:
    """summary.csv's column names of a comparison: the mean difference, its interval's ends, the pairs, the
    outcome and the seeds left out; ``corrected`` (a sweep run with ``--correction``, whatever its value)
    adds :data:`CORRECTED`: the interval's level, the p-value, the adjusted p-value and the correction."""
    plain = (f"{metric}_diff", f"{metric}_diff_low", f"{metric}_diff_high", "pairs", "vs_baseline", "unpaired")
    return plain + CORRECTED if corrected else plain


def row(c: Comparison, metric: str, correction: str | None = None) -> dict[str, Any]:
    """A comparison as summary.csv's cells (:func:`columns`; an empty cell, None, where there is nothing);
    ``correction`` (the value given to ``--correction``; None when it was not given) adds its columns, the
    correction named on every row."""
    n = None if c.outcome == BASELINE else c.n
    cells = (c.diff, c.low, c.high, n, c.outcome, c.unpaired or None)
    if correction is not None:
        cells += (c.level, c.p, c.p_adjusted, correction)
    return dict(zip(columns(metric, correction is not None), cells))
