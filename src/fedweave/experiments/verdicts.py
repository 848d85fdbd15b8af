"""Declared verdict rules for a reproduction's claims: held, did not hold, or inconclusive, by a stated test.

A claim that compares two methods (or two variants of one) over seeds declares a ``Paired`` rule: the
statistic (the difference of one metric, A minus B, times ``scale``), the pairing (records with the same
``pair`` value, the seed: the same seed gives the same partition and initialisation, so the seeds' differences
are paired), the test (``"t"``: the paired t interval; ``"bootstrap"``: the percentile interval of the mean
difference over ``resamples`` resamples of the pairs, drawn from the generator seeded with ``seed``, so the
verdict is the same on every call), the confidence ``level``, the claimed ``direction`` and the
``min_effect``. Its verdict (a ``Decision``) is

- **held** when the whole interval is beyond the minimum effect in the claimed direction,
- **did not hold** when the whole interval is on the other side of it,
- **inconclusive** when the interval includes it (the seeds cannot decide).

Directions: ``"greater"`` (A - B > min_effect), ``"less"`` (A - B < -min_effect) and ``"within"``
(|A - B| < min_effect, a claim of similar accuracy; held when the whole interval lies inside
(-min_effect, min_effect), did not hold when it lies wholly outside). An interval that touches the bound counts
as including it.

The percentile bootstrap is too narrow with few pairs: with 3 pairs its 95 % interval is exactly the range of
the 3 differences (each extreme resample, all pairs the same, has chance 1/27 > 2.5 %), so 3 seeds that agree in
sign "hold" by it whatever their spread. Declare ``"t"`` for 3 to 5 seeds; the bootstrap is for 10 or more.

A claim about one deterministic quantity (bytes against a closed form, one run's accuracy against a bound)
declares a ``Threshold`` rule instead: held or did not hold, no interval. So every claim can declare a rule.

A side of a paired rule is a mapping of fields to values (the records it selects) or a selector, ``cell(**keys)``:
the records whose fields have those values, one per pairing value. Selectors combine pair by pair with ``-``,
``+`` and ``*`` by a number or another selector, and ``mean(*selectors)`` / ``median(*selectors)`` are their
mean / median, so a claim about a derived quantity (half of FedAvg's drop from one setting to another, the best
baseline less a margin, a gain averaged over several methods) is declared as one rule,
``Paired("acc", (cell(method="fedavg", alpha=1000) - cell(method="fedavg", alpha=0.1)) * 0.5, ...)``,
instead of building records by hand; ``Select.values`` gives a selector's values on records. B may also be a
number: a constant bound at every pairing value of A.

A bad declaration (an unknown test or direction, a level outside (0, 1), a negative minimum effect, fewer than
2 pairs given to ``decide``, a value that is not finite) is a ``ConfigError`` of one line naming the rule. Records
on which fewer than 2 seeds ran both sides (a time budget stopped a preset part-way) are no error: the rule's
verdict is **untestable**, and says why; a conjunction with such a part is untestable unless another did not hold.

A run that diverged has no value to pair: a rule given ``no_pair`` (a function of a record: why it is no pair,
e.g. ``"diverged"``, or None) leaves such a run's seed out of its pairs, and where fewer than 2 pairs are left
its verdict is untestable and counts, per side, the runs that left and why. A side that selects no record at all
(the preset did not run it) still leaves the claim out.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedweave.config import ConfigError
from fedweave.experiments.aggregate import is_finite

HELD, NOT_HELD, INCONCLUSIVE, UNTESTABLE = "held", "did not hold", "inconclusive", "untestable"
TESTS = {"t": "paired t", "bootstrap": "paired bootstrap"}  # a test's name -> its name in a verdict's line
DIRECTIONS = ("greater", "less", "within")
OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq}


@dataclass(frozen=True)
class Decision:
    """A rule's verdict: ``outcome`` (held, did not hold, inconclusive), the point ``estimate``, the interval
    (``low``, ``high``; None for a threshold), ``n`` (pairs, or 1 for a single run), ``text``, its one
    line, e.g. ``+0.42 points [0.11, 0.73], 95 % paired t, n=5: held``, and ``detail``, what it was computed
    from (the difference per seed, or the one value)."""

    outcome: str
    estimate: float
    low: float | None
    high: float | None
    n: int
    text: str
    detail: str = ""

    @property
    def held(self) -> bool | None:
        """True (held), False (did not hold) or None (inconclusive): what ``study.Verdict.held`` holds."""
        return {HELD: True, NOT_HELD: False}.get(self.outcome)


def _where(records: Sequence[Mapping[str, Any]], where: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The records whose fields have the values of ``where``."""
    return [r for r in records if all(r.get(k) == v for k, v in where.items())]


@dataclass(frozen=True)
class Select:
    """Per-pair values of a metric chosen from records (module docstring): a leaf (``where``: the fields and
    values of its records) or ``op`` applied pair by pair to ``args`` (selectors or numbers)."""

    where: Mapping[str, Any] = field(default_factory=dict)
    op: Any = None
    args: tuple = ()

    def values(self, records: Sequence[Mapping[str, Any]], metric: str, pair: str = "seed", who: str = "") -> dict:
        """The value of ``metric`` per ``pair`` value (in the records' order), on the pairs every leaf has;
        a leaf with two records of one pairing value (or one without it) is a ``ConfigError`` of one line."""
        if self.op is None:
            return _pick(records, self.where, metric, pair, who or metric, "a side")
        sides = [a.values(records, metric, pair, who) if isinstance(a, Select) else a for a in self.args]
        maps = [s for s in sides if isinstance(s, dict)]

        def at(side: Any, k: Any) -> float:  # a number, or the side's value at k, which must be finite
            return _finite(who or metric, f"{metric} at {pair} {k}", side[k]) if isinstance(side, dict) else side

        return {k: self.op(*(at(s, k) for s in sides)) for k in maps[0] if all(k in m for m in maps)}

    def leaves(self) -> list[Mapping[str, Any]]:
        """The selections (``where``) of the leaves under this selector, in order."""
        if self.op is None:
            return [self.where]
        return [w for a in self.args if isinstance(a, Select) for w in a.leaves()]

    def __sub__(self, other: Select | float) -> Select:
        return Select(op=operator.sub, args=(self, other))

    def __add__(self, other: Select | float) -> Select:
        return Select(op=operator.add, args=(self, other))

    def __mul__(self, other: Select | float) -> Select:
        return Select(op=operator.mul, args=(self, other))

    # a number on the left, as the module docstring's "combined with a number" reads (0.5 * cell(...) was a
    # TypeError)
    def __rsub__(self, other: float) -> Select:
        return Select(op=operator.sub, args=(other, self))

    __radd__ = __add__
    __rmul__ = __mul__

    def __repr__(self) -> str:
        if self.op is None:
            return f"cell({', '.join(f'{k}={v!r}' for k, v in self.where.items())})"
        return f"{self.op.__name__}{self.args!r}"


def cell(**where: Any) -> Select:
    """The selector of the records whose fields have the values ``where``, e.g. ``cell(method="fedmim")``."""
    return Select(where)


def _sides(name: str, sides: tuple) -> tuple:
    if not sides or not any(isinstance(s, Select) for s in sides):  # else an IndexError when judged
        raise ConfigError(f"verdict rule: {name}() needs at least one selector, e.g. {name}(cell(method='a'))")
    return sides


def mean(*sides: Select) -> Select:
    """The mean of several selectors' values, pair by pair (e.g. a gain averaged over several methods)."""
    return Select(op=_mean, args=_sides("mean", sides))


def _mean(*values: float) -> float:
    return float(np.mean(values))


def median(*sides: Select) -> Select:
    """The median of several selectors' values, pair by pair (e.g. over every CFL-SAGA setting of a seed)."""
    return Select(op=_median, args=_sides("median", sides))


def _median(*values: float) -> float:
    return statistics.median(values)


def complete_pairs(
    records: Sequence[Mapping[str, Any]], cell: Callable[[Any], Any], metrics: Sequence[str] = (), pair: str = "seed"
) -> list[Mapping[str, Any]]:
    """The records with finite ``metrics`` of the ``pair`` values (seeds) that have such a record in every cell
    (``cell(record)``) of ``records``: the pairs of a paired rule; none when fewer than 2 seeds do (a paired
    claim cannot be tested on one)."""
    ok = [r for r in records if all(is_finite(r[k]) for k in metrics)]
    cells = {cell(r) for r in records}
    seeds = {s for s in {r[pair] for r in ok} if {cell(r) for r in ok if r[pair] == s} == cells}
    return [r for r in ok if r[pair] in seeds] if len(seeds) >= 2 else []


def _pick(records, where: Mapping[str, Any], metric: str, pair: str, who: str, side: str) -> dict:
    """``metric`` per ``pair`` value of the records ``where`` selects (one record per pairing value)."""
    values: dict[Any, Any] = {}
    for r in _where(records, where):
        key = r.get(pair)
        if key is None or key in values:
            raise ConfigError(
                f"verdict rule {who}: {side} ({where}) has "
                + (f"a record without {pair!r}" if key is None else f"two records with {pair} {key!r}")
                + f"; a pairing needs one record per {pair}"
            )
        values[key] = r.get(metric)  # a missing metric is None: not finite, one line in decide
    return values


def _finite(name: str, what: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v):
        raise ConfigError(f"verdict rule {name}: {what} is {value!r}; a verdict needs finite values")
    return v


@dataclass(frozen=True)
class Paired:
    """A paired comparison of ``metric`` between the records of A (``a``: the fields and values that select
    them, e.g. ``{"method": "fedmim"}``, or a selector, ``cell(method="fedmim")``) and of B, paired by
    ``pair`` (module docstring); B may be a number, a constant bound at every pairing value (a one-sample
    test as a paired one). ``scale`` turns the difference into ``unit`` (100: fractions into points);
    ``name`` names the rule in an error line."""

    metric: str
    a: Mapping[str, Any] | Select
    b: Mapping[str, Any] | Select | float
    direction: str = "greater"
    min_effect: float = 0.0
    test: str = "t"
    level: float = 0.95
    pair: str = "seed"
    scale: float = 1.0
    unit: str = "points"
    resamples: int = 10_000
    seed: int = 0
    digits: int = 2
    name: str = field(default="", compare=False)
    # why a record is no pair (a run that diverged: "diverged"), or None: a run with a value (module docstring)
    no_pair: Callable[[Mapping[str, Any]], str | None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        who = self.name or self.metric
        if self.test not in TESTS:
            raise ConfigError(f"verdict rule {who}: test {self.test!r} unknown; allowed {', '.join(TESTS)}")
        if self.direction not in DIRECTIONS:
            raise ConfigError(
                f"verdict rule {who}: direction {self.direction!r} unknown; allowed {', '.join(DIRECTIONS)}"
            )
        if not (isinstance(self.level, int | float) and 0 < self.level < 1):
            raise ConfigError(f"verdict rule {who}: level {self.level!r} is not in (0, 1), e.g. 0.95")
        effect = _finite(who, "min_effect", self.min_effect)
        if effect < 0 or (self.direction == "within" and effect == 0):
            raise ConfigError(
                f"verdict rule {who}: min_effect {self.min_effect!r} must be >= 0 (> 0 for direction 'within')"
            )
        if not (isinstance(self.resamples, int) and self.resamples >= 1):
            raise ConfigError(f"verdict rule {who}: resamples {self.resamples!r} is not a whole number >= 1")
        if isinstance(self.b, int | float):
            _finite(who, "B's bound", self.b)
        if _finite(who, "scale", self.scale) == 0:
            raise ConfigError(f"verdict rule {who}: scale 0 makes every difference 0")

    def judge(self, records: Sequence[Mapping[str, Any]]) -> Decision | None:
        """The decision on ``records`` (A's and B's paired by ``pair``), or None when A or B has no record
        (the records cannot test the claim, e.g. a variant the preset does not run). With ``no_pair``, the runs
        it names leave the pairs first (module docstring)."""
        sides = self.selections()
        if self.no_pair is not None:
            if not all(_where(records, w) for w in sides):
                return None  # a side without records: nothing to pair (the other side's no-pair runs are not read)
            kept = [r for r in records if self.no_pair(r) is None]
            got = self._judge(kept)
            if got is not None and got.outcome != UNTESTABLE:
                return got
            left = "; ".join(filter(None, (self._left(_where(records, w), w) for w in sides)))
            return self._untestable(got.n if got else 0, left) if left else got
        return self._judge(records)

    def _left(self, records: Sequence[Mapping[str, Any]], where: Mapping[str, Any]) -> str:
        """How many of a side's ``records`` are no pair, and why (``fedavg: 2 of 3 diverged``); "" if none."""
        whys = Counter(why for r in records if (why := self.no_pair(r)) is not None)
        counts = ", ".join(f"{k} of {len(records)} {why}" for why, k in whys.items())
        return f"{', '.join(map(str, where.values()))}: {counts}" if whys else ""

    def _judge(self, records: Sequence[Mapping[str, Any]]) -> Decision | None:
        a = self._values(records, self.a, "A")
        constant = isinstance(self.b, int | float)  # a bound, the same at every pairing value of A
        b = dict.fromkeys(a, self.b) if constant else self._values(records, self.b, "B")
        if not (a and b):
            return None
        if (n := len(set(a) & set(b))) < 2:  # a side's other seeds did not run (a time budget): no test, said so
            return self._untestable(n)
        return self.decide(a, b)

    def _untestable(self, n: int, left: str = "") -> Decision:
        """Fewer than 2 pairs: ``n`` seeds with both sides run, and ``left``, the runs that were no pair."""
        why = f"untestable: {n} {self.pair}{'s' * (n != 1 and bool(left))} with both sides run"
        why += f" ({left})" if left else ""
        return Decision(UNTESTABLE, math.nan, None, None, n, f"{why}; a {TESTS[self.test]} test needs 2")

    def selections(self) -> list[Mapping[str, Any]]:
        """The selections (fields and values) of the records its sides read, A's then B's (none for a bound)."""
        return [w for side in (self.a, self.b) for w in (side.leaves() if isinstance(side, Select) else [side])
                if isinstance(w, Mapping)]  # fmt: skip

    def _values(self, records: Sequence[Mapping[str, Any]], where: Mapping[str, Any] | Select, side: str) -> dict:
        who = self.name or self.metric
        if isinstance(where, Select):
            return where.values(records, self.metric, self.pair, who)
        return _pick(records, where, self.metric, self.pair, who, side)

    def decide(self, a: Mapping[Any, Any], b: Mapping[Any, Any]) -> Decision:
        """The decision on A's and B's values, each a mapping from the pairing value (the seed) to the metric;
        the pairs are the keys both have."""
        keys, d = self._paired(a, b)
        low, high = self.interval(d)
        detail = f"per {self.pair}: " + ", ".join(f"{k} {x:+.{self.digits}f}" for k, x in zip(keys, d))
        return self._decision(float(d.mean()), low, high, len(d), detail)

    def differences(self, a: Mapping[Any, Any], b: Mapping[Any, Any]) -> np.ndarray:
        """The paired differences that :meth:`decide` tests (A minus B times ``scale``, by sorted pairing value),
        with its checks and error lines."""
        return self._paired(a, b)[1]

    def _paired(self, a: Mapping[Any, Any], b: Mapping[Any, Any]) -> tuple[list[Any], np.ndarray]:
        who = self.name or self.metric
        keys = sorted(set(a) & set(b))
        if len(keys) < 2:
            raise ConfigError(
                f"verdict rule {who}: a {TESTS[self.test]} test needs at least 2 pairs ({self.pair}s both ran); "
                f"got {len(keys)}"
            )
        at = f"{self.metric} at {self.pair}"
        d = np.array(
            [self.scale * (_finite(who, f"A's {at} {k}", a[k]) - _finite(who, f"B's {at} {k}", b[k])) for k in keys]
        )
        return keys, d

    def interval(self, d: np.ndarray) -> tuple[float, float]:
        """The ``level`` interval of the mean of the paired differences ``d`` by the rule's test."""
        if self.test == "t":
            from scipy import stats  # here: importing scipy.stats costs every command that imports the Study

            # mean +- t_{(1+level)/2, n-1} * s / sqrt(n), s the sample standard deviation
            half = float(stats.t.ppf((1 + self.level) / 2, len(d) - 1) * stats.sem(d))
            return float(d.mean()) - half, float(d.mean()) + half
        low, high = np.percentile(self._resampled(d), [50 * (1 - self.level), 50 * (1 + self.level)])
        return float(low), float(high)

    def _resampled(self, d: np.ndarray) -> np.ndarray:
        """The bootstrap's ``resamples`` means of ``d`` resampled with replacement, from the rule's ``seed``."""
        rng = np.random.default_rng(self.seed)
        return d[rng.integers(0, len(d), size=(self.resamples, len(d)))].mean(axis=1)

    def p_value(self, d: np.ndarray) -> float:
        """The two-sided p-value of a zero mean difference by the rule's test, the one its interval inverts:
        the interval of ``d`` at level L lies wholly on one side of 0 exactly when p < 1 - L (a multiple-
        comparison correction, ``baseline.adjust``, ranks and scales these).

        ``"t"``: 2 P(T_{n-1} > |mean| / (s / sqrt(n))), the paired t test's (0 when every difference is the
        same non-zero value, 1 when every one is 0). ``"bootstrap"``: the smallest 1 - L at which the
        percentile interval of the same resampled means (the same seed) excludes 0, found by inverting its
        linear interpolation between order statistics (about twice the share of the resampled means on the far
        side of 0 from the median)."""
        mean = float(d.mean())
        if self.test == "t":
            from scipy import stats

            sem = float(stats.sem(d))
            if sem == 0:  # no spread: the interval is the one point, which excludes 0 at every level unless 0
                return 0.0 if mean != 0 else 1.0
            return float(min(1.0, 2 * stats.t.sf(abs(mean) / sem, len(d) - 1)))
        s = np.sort(self._resampled(d))
        r = len(s) - 1  # np.percentile (linear) reads quantile q at position h = r q of the sorted means
        if r == 0:
            return 0.0 if s[0] != 0 else 1.0
        # the low end, at position r (1 - L) / 2, is > 0 past h0 = the last position where the interpolation is <= 0
        j = int(np.searchsorted(s, 0.0, side="right"))  # the means <= 0
        p_low = 0.0 if j == 0 else 1.0 if j == len(s) else 2 * (j - 1 - s[j - 1] / (s[j] - s[j - 1])) / r
        # the high end, at position r (1 + L) / 2, is < 0 before h1 = the first position where it is >= 0
        k = int(np.searchsorted(s, 0.0, side="left"))  # the means < 0
        p_high = 0.0 if k == len(s) else 1.0 if k == 0 else 2 * (r - (k - 1 - s[k - 1] / (s[k] - s[k - 1]))) / r
        return float(min(1.0, p_low, p_high))

    def _decision(self, estimate: float, low: float, high: float, n: int, detail: str) -> Decision:
        m = float(self.min_effect)
        if self.direction == "greater":
            outcome = HELD if low > m else NOT_HELD if high < m else INCONCLUSIVE
        elif self.direction == "less":
            outcome = HELD if high < -m else NOT_HELD if low > -m else INCONCLUSIVE
        else:  # within
            outcome = HELD if -m < low and high < m else NOT_HELD if low > m or high < -m else INCONCLUSIVE
        nd, unit = self.digits, f" {self.unit}" if self.unit else ""
        text = f"{estimate:+.{nd}f}{unit} [{low:.{nd}f}, {high:.{nd}f}], {self.describe()}, n={n}: {outcome}"
        return Decision(outcome, estimate, low, high, n, text, detail)

    def describe(self) -> str:
        """The test and the bound as a verdict's line names them: ``95 % paired t, min effect +1.00``."""
        return ", ".join(filter(None, (self.test_name(), self.bound())))

    def test_name(self) -> str:
        """The test as a verdict's line names it: ``95 % paired t``."""
        return f"{100 * self.level:g} % {TESTS[self.test]}"

    def bound(self) -> str:
        """The bound as a verdict's line names it (``min effect +1.00``, ``within ±0.50``), or "" for an
        ordering (min effect 0)."""
        m, nd = float(self.min_effect), self.digits
        if self.direction != "within" and m == 0:
            return ""
        return {"greater": f"min effect {m:+.{nd}f}", "less": f"min effect {-m:+.{nd}f}"}.get(
            self.direction, f"within ±{m:.{nd}f}"
        )


@dataclass(frozen=True)
class Threshold:
    """A single deterministic quantity against a bound: ``metric`` (times ``scale``) of the one record that
    ``where`` selects, held when ``value op bound`` and did not hold otherwise; for claims that are not
    statistical (one run, a count, bytes against a closed form)."""

    metric: str
    op: str
    bound: float
    where: Mapping[str, Any] = field(default_factory=dict)
    scale: float = 1.0
    unit: str = ""
    digits: int = 2
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        who = self.name or self.metric
        if self.op not in OPS:
            raise ConfigError(f"verdict rule {who}: op {self.op!r} unknown; allowed {', '.join(OPS)}")
        _finite(who, "bound", self.bound)
        _finite(who, "scale", self.scale)

    def judge(self, records: Sequence[Mapping[str, Any]]) -> Decision | None:
        """The decision on the one record ``where`` selects, or None when it selects none."""
        chosen = _where(records, self.where)
        if len(chosen) > 1:
            raise ConfigError(
                f"verdict rule {self.name or self.metric}: {self.where} selects {len(chosen)} records; "
                "a threshold rule reads one run"
            )
        return self.decide(chosen[0].get(self.metric)) if chosen else None

    def decide(self, value: Any) -> Decision:
        """The decision on one value (before ``scale``)."""
        v = self.scale * _finite(self.name or self.metric, "the value", value)
        outcome = HELD if OPS[self.op](v, float(self.bound)) else NOT_HELD
        nd, unit = self.digits, f" {self.unit}" if self.unit else ""
        text = f"{v:.{nd}f}{unit} {self.op} {float(self.bound):.{nd}f}, single run: {outcome}"
        return Decision(outcome, v, None, None, 1, text, f"{v:.{nd}f}{unit}")

    # as a part of ``All`` (a claim about several deterministic quantities): each part's line states its own
    # value and bound, and the conjunction's line ends in what they are, single runs
    def test_name(self) -> str:
        return "single run"

    def describe(self) -> str:
        return self.test_name()


@dataclass(frozen=True)
class All:
    """A claim that is a conjunction of paired comparisons (an ordering, "best of the methods run"): ``parts``,
    (label, ``Paired``) pairs, all with the same test. **held** when every part held, **did not hold** when one
    did not hold, **inconclusive** otherwise; its line gives each part's estimate, interval and outcome. The
    parts may also be ``Threshold`` rules (a claim about several deterministic quantities, e.g. storage at
    several client counts), each shown by its own line."""

    parts: tuple[tuple[str, Paired | Threshold], ...]  # any iterable of them, kept as a tuple

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))

    def judge(self, records: Sequence[Mapping[str, Any]]) -> Decision | None:
        """The decision on ``records``, or None when a part finds no record of A or of B."""
        got = [(label, rule.judge(records)) for label, rule in self.parts]
        if not got or any(d is None for _, d in got):
            return None
        outcomes = {d.outcome for _, d in got}
        outcome = NOT_HELD if NOT_HELD in outcomes else HELD if outcomes == {HELD} else INCONCLUSIVE
        outcome = UNTESTABLE if UNTESTABLE in outcomes and outcome != NOT_HELD else outcome
        first, nd = self.parts[0][1], self.parts[0][1].digits
        # parts with bounds of their own (ZO-HFL's C4: one std per setting) each name theirs, and the line's
        # end only the test: the first part's bound there would misstate the others'
        bound = [
            rule.bound() if isinstance(rule, Paired) else "" for _, rule in self.parts
        ]  # a threshold's: its line's
        own = len(set(bound)) > 1
        bounds = [f" {b}" if own and b else "" for b in bound]
        each = "; ".join(
            f"{label} {d.estimate:+.{nd}f} [{d.low:.{nd}f}, {d.high:.{nd}f}]{b} {d.outcome}"
            if d.low is not None
            else f"{label} {d.text}"  # untestable, or a threshold: no interval
            for (label, d), b in zip(got, bounds)
        )
        # the pairs of the paired parts (a threshold's single run, n=1, said "n=1" beside n=3 pairs)
        paired = [d.n for (_, d), (_, rule) in zip(got, self.parts) if isinstance(rule, Paired)]
        n = min(paired or [d.n for _, d in got])
        unit = f" ({first.unit})" if first.unit and isinstance(first, Paired) else ""  # a threshold states its own
        text = f"all of {len(got)}{unit}: {each}; {first.test_name() if own else first.describe()}, n={n}: {outcome}"
        return Decision(outcome, min(d.estimate for _, d in got), None, None, n, text, "")


@dataclass(frozen=True)
class Untestable:
    """A claim the committed records cannot test by a declared rule (no per-seed values of its statistic):
    its verdict says so and why (``reason``), instead of a verdict read from means."""

    reason: str

    def judge(self, records: Sequence[Mapping[str, Any]]) -> Decision:
        """Always the same decision: untestable, with the reason."""
        return Decision(UNTESTABLE, math.nan, None, None, 0, f"untestable by a declared rule: {self.reason}")


Rule = Paired | Threshold | All | Untestable


def selections(rule: Any) -> list[Mapping[str, Any]]:
    """The selections (fields and values) of the records a declared rule compares: a ``Paired`` rule's sides, an
    ``All``'s parts'; none for another rule."""
    if isinstance(rule, All):
        return [w for _, part in rule.parts for w in selections(part)]
    return rule.selections() if isinstance(rule, Paired) else []


# ---- the power of the paired t test: what a declared rule over n seeds could find ------------------------
def paired_power(delta: float, sd: float | None, n: int, level: float = 0.95) -> float | None:
    """The power of the two-sided ``level`` paired t test over ``n`` pairs to find a true mean difference
    ``delta`` when the pairs' differences have standard deviation ``sd`` (the noncentral t); None where no test
    can run (fewer than 2 pairs, so no ``sd``)."""
    from scipy import stats

    if sd is None or n < 2:
        return None
    if sd == 0:  # no spread: the paired rule's interval is the one point, which excludes 0 unless delta is 0
        return float(delta != 0)  # (before: NaN, from a division by zero)
    crit = stats.t.ppf((1 + level) / 2, n - 1)
    # the two-sided power is even in delta: a loss is found as often as a gain of the same size, so the
    # noncentrality is taken positive (and the far tail below is the negligible one)
    nc = abs(delta) * np.sqrt(n) / sd
    # the lower tail is below 1e-9 once nc > 10, where scipy's cdf can return NaN
    return float(stats.nct.sf(crit, n - 1, nc) + (stats.nct.cdf(-crit, n - 1, nc) if abs(nc) < 10 else 0.0))


def detectable(sd: float | None, n: int, power: float = 0.8, level: float = 0.95) -> float | None:
    """The smallest true mean difference the paired t test finds with probability ``power`` (``paired_power``);
    None where no test can run (fewer than 2 pairs)."""
    from scipy.optimize import brentq

    if sd is None or n < 2:
        return None
    if sd == 0:  # any difference but 0 is found (``paired_power``); before: a ValueError from the solver
        return 0.0
    return float(brentq(lambda d: paired_power(d, sd, n, level) - power, 1e-9 * sd, 30 * sd))
