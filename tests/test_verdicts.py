"""Declared verdict rules (fedweave.experiments.verdicts): the paired t and paired bootstrap intervals against
values computed here independently, the three outcomes and the minimum effect, the one-line errors of a bad
declaration, and a claim that declares its rule in the Study pipeline."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedweave.config import ConfigError
from fedweave.experiments.study import HELD, Claim, Verdict, judge, verdict_table
from fedweave.experiments.verdicts import Paired, Threshold

A = {0: 3.0, 1: 5.0, 2: 4.0, 3: 6.0}
B = {0: 1.0, 1: 2.0, 2: 2.0, 3: 3.0}  # A - B per seed: 2, 3, 2, 3 (mean 2.5, s = sqrt(1/3))


def _seeds(values):
    return dict(enumerate(values))


def test_the_paired_t_interval_is_the_textbook_one():
    q = stats.t.ppf(0.975, df=3)
    assert q == pytest.approx(3.182446, abs=1e-6)  # the t table's t_{0.975, 3}
    half = q * math.sqrt(1 / 3) / math.sqrt(4)  # t * s / sqrt(n), s computed by hand
    got = Paired("acc", {}, {}).decide(A, B)
    assert (got.estimate, got.n) == (2.5, 4)
    assert got.low == pytest.approx(2.5 - half, rel=1e-12) and got.high == pytest.approx(2.5 + half, rel=1e-12)
    assert (round(got.low, 4), round(got.high, 4)) == (1.5813, 3.4187)
    assert got.text == "+2.50 points [1.58, 3.42], 95 % paired t, n=4: held"
    assert got.detail == "per seed: 0 +2.00, 1 +3.00, 2 +2.00, 3 +3.00"
    # 90 %: the t quantile at 0.95
    narrow = Paired("acc", {}, {}, level=0.9).decide(A, B)
    assert narrow.high - 2.5 == pytest.approx(stats.t.ppf(0.95, 3) * math.sqrt(1 / 3) / 2)


def test_a_clearly_positive_effect_held_a_clearly_negative_one_did_not():
    assert Paired("acc", {}, {}).decide(A, B).outcome == "held"
    lost = Paired("acc", {}, {}).decide(B, A)
    assert (lost.outcome, lost.held) == ("did not hold", False)
    assert lost.text == "-2.50 points [-3.42, -1.58], 95 % paired t, n=4: did not hold"
    # claimed the other way round ("less"), the same data decide the other way
    assert Paired("acc", {}, {}, direction="less").decide(B, A).outcome == "held"
    assert Paired("acc", {}, {}, direction="less").decide(A, B).outcome == "did not hold"


def test_an_interval_that_straddles_the_bound_is_inconclusive():
    got = Paired("acc", {}, {}).decide(_seeds([1.0, -1.0, 2.0, -2.0]), _seeds([0.0] * 4))
    assert (got.outcome, got.held, got.estimate) == ("inconclusive", None, 0.0)
    assert got.low < 0 < got.high and got.text.endswith("n=4: inconclusive")
    # the bootstrap agrees: the resampled means run from -2 to 2
    straddles = _seeds([1.0, -1.0, 2.0, -2.0]), _seeds([0.0] * 4)
    assert Paired("acc", {}, {}, test="bootstrap").decide(*straddles).held is None


def test_the_minimum_effect_is_respected():
    # interval [1.58, 3.42]: beyond 1, around 2, short of 4
    outcomes = [Paired("acc", {}, {}, min_effect=m).decide(A, B).outcome for m in (1.0, 2.0, 4.0)]
    assert outcomes == ["held", "inconclusive", "did not hold"]
    assert Paired("acc", {}, {}, min_effect=1).decide(A, B).text == (
        "+2.50 points [1.58, 3.42], 95 % paired t, min effect +1.00, n=4: held"
    )
    less = [Paired("acc", {}, {}, direction="less", min_effect=m).decide(B, A).outcome for m in (1.0, 2.0, 4.0)]
    assert less == outcomes


def test_a_within_claim_holds_inside_the_bound_and_fails_wholly_outside():
    rule = Paired("acc", {}, {}, direction="within", min_effect=1.0, unit="pp")
    small = rule.decide(_seeds([0.1, -0.1, 0.2, 0.0]), _seeds([0.0] * 4))
    assert small.outcome == "held" and small.low > -1 and small.high < 1
    assert small.text == "+0.05 pp [-0.16, 0.26], 95 % paired t, within ±1.00, n=4: held"  # 0.05 -+ 0.2054
    assert rule.decide(A, B).outcome == "did not hold"  # [1.58, 3.42] wholly above 1
    assert rule.decide(B, A).outcome == "did not hold"  # and wholly below -1
    assert rule.decide(_seeds([0.0, 2.0, 0.0, 2.0]), _seeds([0.0] * 4)).outcome == "inconclusive"


def test_the_bootstrap_is_the_percentile_interval_and_the_same_for_a_seed():
    # two pairs, differences 0 and 2: the resampled means are 0, 1, 2 with chances 1/4, 1/2, 1/4
    got = Paired("acc", {}, {}, test="bootstrap").decide({0: 0.0, 1: 2.0}, {0: 0.0, 1: 0.0})
    assert (got.low, got.high, got.estimate) == (0.0, 2.0, 1.0)
    assert got.text == "+1.00 points [0.00, 2.00], 95 % paired bootstrap, n=2: inconclusive"
    rng = np.random.default_rng(7)
    a, b = _seeds(rng.normal(1.0, 1.0, 12)), _seeds(np.zeros(12))
    first = Paired("acc", {}, {}, test="bootstrap", seed=3).decide(a, b)
    assert Paired("acc", {}, {}, test="bootstrap", seed=3).decide(a, b) == first  # reproducible
    assert Paired("acc", {}, {}, test="bootstrap", seed=4).decide(a, b).low != first.low  # it is resampled
    # by hand: the same generator, the same draws
    d = np.array([a[k] for k in sorted(a)])
    means = d[np.random.default_rng(3).integers(0, 12, size=(10_000, 12))].mean(axis=1)
    assert (first.low, first.high) == tuple(np.percentile(means, [2.5, 97.5]))


def test_with_3_pairs_the_bootstrap_interval_is_the_range_of_the_differences():
    # each extreme resample (the same pair 3 times) has chance 1/27 > 2.5 %: the percentiles are min and max
    a, b = {0: 3.50, 1: 6.35, 2: 3.85}, {0: 0.0, 1: 0.0, 2: 0.0}  # AFIND+ - Gossip per seed, fmnist-dir0.3
    boot = Paired("best", {}, {}, test="bootstrap", min_effect=2).decide(a, b)
    assert (boot.low, boot.high, boot.outcome) == (3.50, pytest.approx(6.35, abs=1e-12), "held")
    assert Paired("best", {}, {}, min_effect=2).decide(a, b).outcome == "inconclusive"  # t: [0.71, 8.43]


def test_the_bootstrap_is_close_to_the_t_interval_for_normal_data():
    rng = np.random.default_rng(0)
    a, b = _seeds(rng.normal(0.5, 1.0, 40)), _seeds(np.zeros(40))
    t = Paired("acc", {}, {}).decide(a, b)
    boot = Paired("acc", {}, {}, test="bootstrap", resamples=20_000).decide(a, b)
    half = (t.high - t.low) / 2
    assert boot.estimate == t.estimate
    # the percentile interval is a little narrower (z against t, n against n-1): within 10 % of the half width
    assert abs(boot.low - t.low) < 0.1 * half and abs(boot.high - t.high) < 0.1 * half


def test_records_are_paired_by_seed_and_a_missing_side_leaves_the_claim_untested():
    records = [
        {"method": "fedmim", "seed": 0, "acc": 77.0},
        {"method": "fedavg", "seed": 0, "acc": 75.0},
        {"method": "fedmim", "seed": 1, "acc": 76.0},
        {"method": "fedavg", "seed": 1, "acc": 75.5},
        {"method": "fedmim", "seed": 2, "acc": 77.5},  # fedavg seed 2 missing: not a pair
        {"method": "fedavg", "seed": 3, "acc": 70.0},
        {"method": "fedmim", "seed": 4, "acc": 78.0},
        {"method": "fedavg", "seed": 4, "acc": 76.0},
    ]
    rule = Paired("acc", {"method": "fedmim"}, {"method": "fedavg"})
    got = rule.judge(records)
    assert got.n == 3 and got.estimate == pytest.approx((2.0 + 0.5 + 2.0) / 3)
    assert got.detail == "per seed: 0 +2.00, 1 +0.50, 4 +2.00"
    assert Paired("acc", {"method": "scaffold"}, {"method": "fedavg"}).judge(records) is None
    scaled = Paired("acc", {"method": "fedmim"}, {"method": "fedavg"}, scale=0.01, unit="", digits=3).judge(records)
    assert scaled.estimate == pytest.approx(got.estimate / 100) and scaled.text.startswith("+0.015 [")


def test_a_threshold_is_held_or_not_on_one_value():
    rule = Threshold("acc", ">=", 97.0, where={"method": "fsl_mc", "seed": 0}, scale=100, unit="%")
    records = [{"method": "fsl_mc", "seed": 0, "acc": 0.9748}, {"method": "fsl_mc", "seed": 1, "acc": 0.95}]
    got = rule.judge(records)
    assert (got.outcome, got.estimate, got.n, got.low) == ("held", pytest.approx(97.48), 1, None)
    assert got.text == "97.48 % >= 97.00, single run: held"
    assert Threshold("bytes", "==", 1024).decide(1000).text == "1000.00 == 1024.00, single run: did not hold"
    assert Threshold("acc", ">=", 0.5, where={"method": "fsl_oc"}).judge(records) is None


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Paired("acc", {}, {}, test="z"), "verdict rule acc: test 'z' unknown; allowed t, bootstrap"),
        (lambda: Paired("acc", {}, {}, level=1.5), "verdict rule acc: level 1.5 is not in (0, 1), e.g. 0.95"),
        (lambda: Paired("acc", {}, {}, level=0, name="C2"), "verdict rule C2: level 0 is not in (0, 1)"),
        (lambda: Paired("acc", {}, {}, direction="up"), "direction 'up' unknown; allowed greater, less, within"),
        (lambda: Paired("acc", {}, {}, min_effect=-1), "min_effect -1 must be >= 0"),
        (lambda: Paired("acc", {}, {}, direction="within"), "min_effect 0.0 must be >= 0 (> 0 for direction"),
        (lambda: Paired("acc", {}, {}, resamples=0), "resamples 0 is not a whole number >= 1"),
        (lambda: Paired("acc", {}, {}).decide({0: 1.0}, {0: 0.0}), "a paired t test needs at least 2 pairs"),
        (lambda: Paired("acc", {}, {}, test="bootstrap").decide({0: 1.0, 1: 2.0}, {1: 0.0}), "got 1"),
        (lambda: Paired("acc", {}, {}).decide({0: 1.0, 1: math.nan}, {0: 0.0, 1: 0.0}), "A's acc at seed 1 is nan"),
        (lambda: Paired("acc", {}, {}).decide({0: 1.0, 1: None}, {0: 0.0, 1: 0.0}), "A's acc at seed 1 is None"),
        (lambda: Paired("acc", {}, {}).judge([{"acc": 1}]), "A ({}) has a record without 'seed'"),
        (
            lambda: Paired("acc", {"m": "x"}, {"m": "y"}).judge([{"m": "x", "seed": 0, "acc": 1}] * 2),
            "A ({'m': 'x'}) has two records with seed 0",
        ),
        (lambda: Threshold("acc", "=>", 1.0), "verdict rule acc: op '=>' unknown; allowed >, >=, <, <=, =="),
        (lambda: Threshold("acc", ">", 1.0).judge([{"acc": 1}, {"acc": 2}]), "{} selects 2 records"),
        (lambda: Threshold("acc", ">", 1.0).decide(None), "verdict rule acc: the value is None"),
        (lambda: Claim("C0", None), "claim 'C0': no rule"),
    ],
)
def test_a_bad_declaration_is_one_line(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- in the Study pipeline --------------------------------------------------------------------------------
RECORDS = [{"method": m, "seed": s, "acc": v} for s, (x, y) in enumerate([(77, 75), (77, 75.5), (78, 76)])
           for m, v in (("fedmim", x), ("fedavg", y))]  # fmt: skip


def test_a_claim_with_a_declared_rule_takes_its_verdict_and_interval():
    beats = Paired("acc", {"method": "fedmim"}, {"method": "fedavg"})
    claims = [
        Claim("FedMIM > FedAvg", None, declared=beats),
        Claim(
            "FedMIM > FedAvg by >= 2",
            lambda t, ctx: ("1.83 mean gap", True),
            declared=Paired("acc", {"method": "fedmim"}, {"method": "fedavg"}, min_effect=2),
        ),
        Claim("FedAvg > FedMIM", None, declared=Paired("acc", {"method": "fedavg"}, {"method": "fedmim"})),
        Claim("SCAFFOLD > FedAvg", None, declared=Paired("acc", {"method": "scaffold"}, {"method": "fedavg"})),
        Claim("left out by its rule", lambda t, ctx: None, declared=beats),
        Claim("records from the context", None, declared=beats, records=lambda t, ctx: ctx),
    ]
    verdicts = judge(claims, RECORDS, RECORDS[:4])
    first = beats.judge(RECORDS)
    assert verdicts[0] == Verdict("FedMIM > FedAvg", first.detail, True, outcome="held", interval=first.text)
    assert first.text == "+1.83 points [1.12, 2.55], 95 % paired t, n=3: held"  # 1.833 -+ 4.303 * 0.1667
    # the declared rule decides (the rule's own True is overruled), the rule still says what was measured
    assert (verdicts[1].measured, verdicts[1].held, verdicts[1].outcome) == ("1.83 mean gap", None, "inconclusive")
    assert (verdicts[2].held, verdicts[2].outcome) == (False, "did not hold")
    assert [v.claim for v in verdicts] == ["FedMIM > FedAvg", "FedMIM > FedAvg by >= 2", "FedAvg > FedMIM",
                                           "records from the context"]  # fmt: skip
    assert verdicts[3].interval.endswith("n=2: inconclusive")
    lines = verdict_table(verdicts, ["claim", "verdict", "measured"], HELD).splitlines()
    assert lines[2] == f"| FedMIM > FedAvg | {first.text} | {first.detail} |"
    assert tuple(verdicts[0]) == ("FedMIM > FedAvg", first.detail, True)  # unpacks as before


def test_a_claim_without_a_declared_rule_is_as_before():
    claim = Claim("C1", lambda t, ctx: ("3 vs 1", True))
    v = claim.verdict({})
    assert v == Verdict("C1", "3 vs 1", True) and (v.outcome, v.interval) == (None, None)
    assert verdict_table([v]).splitlines()[2] == "| C1 | 3 vs 1 | yes |"


def test_the_example_row_of_docs_results_md_is_what_the_rule_makes_of_the_committed_records():
    import csv
    from pathlib import Path

    root = Path(__file__).parents[1]
    with open(root / "docs/reproductions/fedmim/results.csv", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if (r["dataset"], r["split"]) == ("fashion_mnist", "dir0.1")]
    records = [{**r, "seed": int(r["seed"]), "final_acc": float(r["final_acc"])} for r in rows]
    beats = Paired("final_acc", {"method": "fedmim"}, {"method": "fedavg"})
    row = verdict_table(judge([Claim("FedMIM beats FedAvg (Table I)", None, declared=beats)], records))
    assert row.splitlines()[2] in (root / "docs/results.md").read_text(encoding="utf-8").splitlines()


def _recs(values: dict[str, list[float]]) -> list[dict]:
    return [{"method": m, "seed": s, "acc": v} for m, vs in values.items() for s, v in enumerate(vs)]


def test_a_conjunction_holds_only_when_every_part_holds_and_fails_when_one_fails():
    from fedweave.experiments.verdicts import All

    def rule(*others: str) -> All:
        return All(tuple((f"a > {o}", Paired("acc", {"method": "a"}, {"method": o})) for o in others))

    recs = _recs({"a": [5, 6, 7], "b": [1, 2, 3], "c": [4.9, 6.2, 6.8], "d": [9, 10, 11]})
    assert rule("b").judge(recs).outcome == "held"
    assert rule("b", "c").judge(recs).outcome == "inconclusive"  # a vs c straddles 0
    assert rule("b", "c", "d").judge(recs).outcome == "did not hold"  # one part wholly on the wrong side
    got = rule("b", "d").judge(recs)
    assert got.text.startswith("all of 2 (points): a > b +4.00 [4.00, 4.00] held; a > d -4.00 [-4.00, -4.00]")
    assert got.text.endswith("95 % paired t, n=3: did not hold") and got.held is False
    assert rule("b", "missing").judge(recs) is None  # a part without records: the claim is left out


def test_an_untestable_claim_says_why_and_is_neither_held_nor_failed():
    from fedweave.experiments.verdicts import Untestable

    claim = Claim("FedAvg is slowest", lambda t, c: ("means only", None), declared=Untestable("no per-seed rows"))
    (v,) = judge([claim], [])
    assert (v.held, v.outcome) == (None, "untestable")
    assert v.interval == "untestable by a declared rule: no per-seed rows"


def test_a_declared_rule_may_be_chosen_from_the_table():
    recs = _recs({"a": [5, 6, 7], "b": [1, 2, 3], "c": [0, 1, 2]})
    best_other = Claim(  # a beats the best of the others, chosen by mean
        "a beats the rest",
        None,
        declared=lambda t, _: Paired("acc", {"method": "a"}, {"method": max("bc", key=lambda m: _mean(t, m))}),
    )
    (v,) = judge([best_other], recs)
    assert v.interval.startswith("+4.00 points [4.00, 4.00]") and v.held is True


def _mean(recs: list[dict], m: str) -> float:
    return float(np.mean([r["acc"] for r in recs if r["method"] == m]))


def test_a_declared_rule_decides_whatever_the_claims_own_rule_says():
    recs = _recs({"a": [5, 9, 1], "b": [1, 2, 3]})  # mean gap +3, one seed behind
    claim = Claim(
        "a beats b", lambda t, c: ("means +3.00", True), declared=Paired("acc", {"method": "a"}, {"method": "b"})
    )
    (v,) = judge([claim], recs)
    assert (v.outcome, v.held, v.measured) == ("inconclusive", None, "means +3.00")


def test_the_cse_fsl_page_reads_the_per_seed_accuracies_its_table_files_list():
    from pathlib import Path

    from fedweave.reproduce.cse_fsl import seed_records

    md = (Path(__file__).parents[1] / "docs/reproductions/cse-fsl/table-fashion_mnist-noniid.md").read_text()
    got = {(r["method"], r["seed"]): r["accuracy"] for r in seed_records(md)}
    # the 5 seeds run on 26 Nov 2026 (the page's history): 7 methods x 5 seeds
    assert got[("fsl_oc", 2)] == 59.45 and got[("cse_fsl h=5 random", 4)] == 65.70 and len(got) == 35


def test_a_conjunction_whose_parts_have_their_own_bounds_names_each_not_the_firsts_for_all():
    """ZO-HFL's C4 bounds each setting by its own std: the line must not end with the first part's bound as
    if it were every part's."""
    from fedweave.experiments.verdicts import All

    records = [{"s": s, "seed": k, "acc": v} for s, vals in (("x", (1.0, 1.1, 0.9)), ("y", (1.0, 1.2, 0.8)))
               for k, v in enumerate(vals)]  # fmt: skip
    records += [{"s": "z", "seed": k, "acc": 1.0} for k in range(3)]
    rule = lambda s, m: Paired("acc", {"s": s}, {"s": "z"}, "within", m)  # noqa: E731
    text = All((("x", rule("x", 0.5)), ("y", rule("y", 2.0)))).judge(records).text
    assert "x +0.00 [-0.25, 0.25] within ±0.50 held; y +0.00 [-0.50, 0.50] within ±2.00 held" in text
    assert text.endswith("; 95 % paired t, n=3: held")
    # parts with one bound keep it once, at the line's end
    same = All((("x", rule("x", 0.5)), ("y", rule("y", 0.5)))).judge(records).text
    assert same.endswith("; 95 % paired t, within ±0.50, n=3: held") and same.count("±") == 1


def test_a_conjunction_of_thresholds_states_each_part_and_fails_on_one():
    """A claim about several deterministic quantities (CSE-FSL's C5: copies and storage growth at several n) is an
    ``All`` of ``Threshold`` parts, each shown by its own line (before: a TypeError, a threshold has no
    interval's bound)."""
    from fedweave.experiments.verdicts import All

    records = [{"q": "copies", "copies": 1}, {"q": "growth", "growth": 14698.0}]
    rule = All(
        (
            ("copies:", Threshold("copies", "==", 1, {"q": "copies"}, digits=0)),
            ("growth:", Threshold("growth", "==", 14698, {"q": "growth"}, unit="params", digits=0)),
        )
    )
    d = rule.judge(records)
    assert d.outcome == "held" and d.text == (
        "all of 2: copies: 1 == 1, single run: held; growth: 14698 params == 14698, single run: held; "
        "single run, n=1: held"
    )
    records[1]["growth"] = 81652.0  # grows by a whole model per client
    assert rule.judge(records).outcome == "did not hold"


def test_a_side_with_one_common_seed_is_untestable_not_an_error():
    """A time budget can leave one side of a comparison with a single seed that both sides ran: the claim is
    untestable, said in its line, and the report goes on (before: a ConfigError ended the report)."""
    from fedweave.experiments.verdicts import All

    records = [{"m": m, "seed": k, "acc": v} for m, vs in (("a", (3.0, 3.1, 2.9)), ("b", (1.0, 1.1, 0.9)))
               for k, v in enumerate(vs)]  # fmt: skip
    records += [{"m": "c", "seed": 0, "acc": 1.0}]  # c's seeds 1 and 2 did not run
    short = Paired("acc", {"m": "a"}, {"m": "c"})
    d = short.judge(records)
    assert (d.outcome, d.held, d.n) == ("untestable", None, 1) and "a paired t test needs 2" in d.text
    held, lost = Paired("acc", {"m": "a"}, {"m": "b"}), Paired("acc", {"m": "b"}, {"m": "a"})
    assert All((("a > b", held), ("a > c", short))).judge(records).outcome == "untestable"
    assert All((("b > a", lost), ("a > c", short))).judge(records).outcome == "did not hold"
    line = All((("a > b", held), ("a > c", short))).judge(records).text
    assert "a > c untestable: 1 seed with both sides run" in line and line.endswith("n=1: untestable")


@pytest.mark.parametrize("test", ["t", "bootstrap"])
def test_the_p_value_is_where_the_interval_leaves_zero(test):
    # p-value and interval are one test: the interval at level L excludes 0 exactly when p < 1 - L, so a
    # multiple-comparison correction of the p-values (fedweave.experiments.baseline) agrees with the intervals
    rng = np.random.default_rng(5)
    seen = 0
    for _ in range(60):
        d = rng.normal(rng.normal(0, 1), 1, size=int(rng.integers(3, 8)))
        rule = Paired("acc", {}, {}, test=test)
        p = rule.p_value(d)
        if test == "t":  # scipy's one-sample t test of the differences, computed apart from the rule
            assert p == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue, rel=1e-10)
        if not 1e-6 < p < 1 - 1e-6:
            continue
        seen += 1
        out = Paired("acc", {}, {}, test=test, level=1 - p * (1 + 1e-6)).interval(d)
        inside = Paired("acc", {}, {}, test=test, level=1 - p * (1 - 1e-6)).interval(d)
        assert (out[0] > 0 or out[1] < 0) and inside[0] <= 0 <= inside[1], (p, out, inside)
    assert seen > 20
    assert Paired("acc", {}, {}, test=test).p_value(np.zeros(4)) == 1.0  # all 0: the interval is [0, 0]
    assert Paired("acc", {}, {}, test=test).p_value(np.full(4, 0.2)) == 0.0  # no spread, not 0: any level


def test_a_number_may_stand_on_either_side_of_a_selector():
    """The docs combine selectors "with a number": ``0.5 * cell(...)`` and ``1 - cell(...)`` were TypeErrors."""
    from fedweave.experiments.verdicts import cell

    recs = [{"method": "a", "seed": s, "acc": v} for s, v in enumerate((1.0, 2.0, 4.0))]
    a = cell(method="a")
    assert (0.5 * a).values(recs, "acc") == (a * 0.5).values(recs, "acc") == {0: 0.5, 1: 1.0, 2: 2.0}
    assert (1 - a).values(recs, "acc") == {0: 0.0, 1: -1.0, 2: -3.0}
    assert (1 + a).values(recs, "acc") == (a + 1).values(recs, "acc")


@pytest.mark.parametrize("name", ["mean", "median"])
def test_a_mean_or_median_of_no_selector_is_one_line(name):
    """``mean()`` was an IndexError when the rule was judged."""
    from fedweave.experiments import verdicts

    with pytest.raises(ConfigError, match=rf"^verdict rule: {name}\(\) needs at least one selector"):
        getattr(verdicts, name)()


def test_a_missing_value_counts_as_no_finite_value():
    """A record read back without its value (None) raised a TypeError in the pairing, the ranks and the cells'
    counts; it is a run without a finite value, as a NaN is."""
    from fedweave.experiments.aggregate import diverged, finite_runs, ranks
    from fedweave.experiments.verdicts import complete_pairs

    recs = [{"m": m, "seed": s, "acc": None if (m, s) == ("b", 2) else 1.0 + s} for m in "ab" for s in range(3)]
    assert {r["seed"] for r in complete_pairs(recs, lambda r: r["m"], ("acc",))} == {0, 1}
    assert ranks({"a": None, "b": 1.0, "c": np.float32(2.0)}) == {"c": 1, "b": 2, "a": 3}
    assert diverged("acc")(recs) == 1 and len(finite_runs("acc")(recs)) == 5


def test_all_of_paired_and_threshold_parts_counts_the_pairs():
    """A threshold's single run (n=1) made the line end "n=1" beside a paired part of 3 pairs."""
    from fedweave.experiments.verdicts import All

    recs = [{"m": m, "seed": s, "acc": v + s} for m, v in (("a", 5.0), ("b", 1.0)) for s in range(3)]
    rule = All(
        (
            ("a - b", Paired("acc", {"m": "a"}, {"m": "b"})),
            ("a at 0", Threshold("acc", ">=", 0.5, where={"m": "a", "seed": 0})),
        )
    )
    got = rule.judge(recs)
    assert got.n == 3 and got.text.endswith("n=3: held"), got.text


def test_a_run_that_is_no_pair_leaves_its_seed_and_is_counted_when_too_few_are_left():
    """``no_pair``: a diverged run's seed leaves the pairs; with fewer than 2 left the verdict is untestable and
    says which runs left; a side the records never ran leaves the claim out."""
    recs = [
        {"m": m, "seed": s, "acc": v + s, "status": "diverged" if (m, s) == ("b", 0) else "completed"}
        for m, v in (("a", 5.0), ("b", 1.0))
        for s in range(3)
    ]
    rule = Paired("acc", {"m": "a"}, {"m": "b"}, no_pair=lambda r: "diverged" if r["status"] == "diverged" else None)
    assert rule.judge(recs).n == 2 and Paired("acc", {"m": "a"}, {"m": "b"}).judge(recs).n == 3
    two_gone = [r | {"status": "diverged"} if (r["m"], r["seed"]) == ("b", 1) else r for r in recs]
    assert rule.judge(two_gone).text == (
        "untestable: 1 seed with both sides run (b: 2 of 3 diverged); a paired t test needs 2"
    )
    assert rule.judge([r for r in recs if r["m"] == "a"]) is None  # b never ran: left out


def test_a_side_that_never_ran_leaves_the_claim_out_beside_a_diverged_run_of_the_other():
    """A difference of selectors on one side, a diverged (NaN) run on it and no records at all on the other: the
    claim is left out (before: the rule read the unfiltered records and refused the NaN, ``ConfigError: verdict
    rule acc: acc at seed 0 is nan``, which ended FedMIM's report when its IID control had not run)."""
    from fedweave.experiments.verdicts import cell

    nan = float("nan")
    recs = [
        {"s": "dir", "m": m, "seed": k, "acc": v}
        for m, vs in (("a", (nan, 5.0)), ("b", (1.0, 2.0)))
        for k, v in enumerate(vs)
    ]
    gap = lambda s: cell(s=s, m="a") - cell(s=s, m="b")  # noqa: E731
    rule = Paired("acc", gap("dir"), gap("iid"), no_pair=lambda r: None if math.isfinite(r["acc"]) else "diverged")
    assert rule.judge(recs) is None
