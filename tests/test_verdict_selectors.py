"""Selectors of per-seed records for declared verdict rules (fedweave.experiments.verdicts.cell): a side of a
paired rule picked by its fields, and derived quantities (a drop between settings, a margin) combined pair by
pair, so a claim about them is one declaration."""

from __future__ import annotations

import pytest

from fedweave.config import ConfigError
from fedweave.experiments.verdicts import Paired, cell, mean, median

RECORDS = [
    {"method": m, "alpha": a, "seed": s, "acc": acc}
    for m, a, s, acc in [
        ("zo", 1000, 0, 80.0),
        ("zo", 0.1, 0, 70.0),
        ("avg", 1000, 0, 90.0),
        ("avg", 0.1, 0, 60.0),
        ("zo", 1000, 1, 81.0),
        ("zo", 0.1, 1, 72.0),
        ("avg", 1000, 1, 91.0),
        ("avg", 0.1, 1, 65.0),
        ("zo", 1000, 2, 79.0),  # seed 2 has no low-alpha run: no drop, not a pair
    ]
]


def test_a_selector_gives_the_metric_per_seed_of_the_records_it_picks():
    assert cell(method="zo", alpha=1000).values(RECORDS, "acc") == {0: 80.0, 1: 81.0, 2: 79.0}
    assert cell(method="fedprox").values(RECORDS, "acc") == {}


def test_selectors_combine_pair_by_pair_on_the_seeds_every_side_has():
    drop = cell(method="avg", alpha=1000) - cell(method="avg", alpha=0.1)
    assert drop.values(RECORDS, "acc") == {0: 30.0, 1: 26.0}
    assert (drop * 0.5).values(RECORDS, "acc") == {0: 15.0, 1: 13.0}
    assert (cell(method="zo", alpha=1000) - 5.0).values(RECORDS, "acc") == {0: 75.0, 1: 76.0, 2: 74.0}
    assert (cell(method="zo", alpha=1000) + cell(method="zo", alpha=0.1)).values(RECORDS, "acc") == {
        0: 150.0,
        1: 153.0,
    }


def test_a_paired_rule_on_derived_sides_is_the_same_as_on_records_built_by_hand():
    half_avg = (cell(method="avg", alpha=1000) - cell(method="avg", alpha=0.1)) * 0.5
    zo = cell(method="zo", alpha=1000) - cell(method="zo", alpha=0.1)
    got = Paired("acc", half_avg, zo).judge(RECORDS)
    built = [{"side": "half", "seed": 0, "x": 15.0}, {"side": "half", "seed": 1, "x": 13.0}]
    built += [{"side": "zo", "seed": 0, "x": 10.0}, {"side": "zo", "seed": 1, "x": 9.0}]
    assert got == Paired("x", {"side": "half"}, {"side": "zo"}).judge(built)
    assert got.detail == "per seed: 0 +5.00, 1 +4.00"
    assert Paired("acc", cell(method="fedprox") * 0.5, zo).judge(RECORDS) is None  # no records: untested


def test_a_selector_with_two_records_of_one_seed_or_a_missing_value_is_one_line():
    with pytest.raises(ConfigError, match=r"two records with seed 0; a pairing needs one record per seed"):
        (cell(method="zo") - 1.0).values(RECORDS, "acc")
    broken = [*RECORDS[:2], {"method": "zo", "alpha": 0.5, "seed": 0, "acc": None}]
    with pytest.raises(ConfigError, match=r"acc at seed 0 is None; a verdict needs finite values"):
        (cell(alpha=0.5) - cell(alpha=1000)).values(broken, "acc")


def test_a_constant_side_is_a_bound_at_every_seed_of_the_other():
    got = Paired("acc", cell(method="zo", alpha=1000), 79.0).judge(RECORDS)
    built = [*(r for r in RECORDS if (r["method"], r["alpha"]) == ("zo", 1000))]
    built += [{"method": "bound", "seed": s, "acc": 79.0} for s in (0, 1, 2)]
    assert got == Paired("acc", {"method": "zo", "alpha": 1000}, {"method": "bound"}).judge(built)
    assert got.detail == "per seed: 0 +1.00, 1 +2.00, 2 +0.00"
    assert Paired("acc", cell(method="fedprox"), 79.0).judge(RECORDS) is None
    with pytest.raises(ConfigError, match=r"B's bound is nan; a verdict needs finite values"):
        Paired("acc", cell(method="zo"), float("nan"))


def test_the_median_of_selectors_is_taken_seed_by_seed():
    sides = (cell(method="zo", alpha=1000), cell(method="avg", alpha=1000), cell(method="avg", alpha=0.1))
    assert median(*sides).values(RECORDS, "acc") == {0: 80.0, 1: 81.0}


def test_the_mean_of_selectors_is_taken_seed_by_seed():
    drops = [cell(method=m, alpha=1000) - cell(method=m, alpha=0.1) for m in ("zo", "avg")]
    assert mean(*drops).values(RECORDS, "acc") == {0: 20.0, 1: 17.5}
