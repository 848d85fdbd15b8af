"""The pieces a reproduction's page and report share (fedweave.experiments: blocks, tables, aggregate, study,
verdicts), each written once: a paper's module declares its own numbers with them."""

from __future__ import annotations

import math

import pytest

from fedweave.config import ConfigError
from fedweave.experiments.aggregate import finite_runs, iqr_of, per_cell
from fedweave.experiments.blocks import claim_table, cost_line, gap_table, run_values, same_runs_table, verdict_cell
from fedweave.experiments.study import Verdict, choices, judge, reading
from fedweave.experiments.tables import Col, layout, lookup, pm_cell, pm_of
from fedweave.experiments.verdicts import All, Paired, complete_pairs


def test_claim_table_shows_the_declared_rules_line_else_the_word():
    judged = [("results.csv", Verdict("a beats b", "+1.0", True, interval="+1.00 [0.5, 1.5]: held")),
              ("x/results.csv", Verdict("c", "n/a", None))]  # fmt: skip
    assert verdict_cell(judged[1][1]) == "untestable"
    assert claim_table(judged).splitlines() == [
        "| claim | source | verdict | measured |",
        "|---|---|---|---|",
        "| a beats b | `results.csv` | +1.00 [0.5, 1.5]: held | +1.0 |",
        "| c | `x/results.csv` | untestable | n/a |",
    ]


def test_cost_line_sums_the_cpu_seconds_per_group_or_each():
    rows = [{"v": "E=1", "cpu_seconds": 10.0}, {"v": "E=5", "cpu_seconds": 50.4}, {"v": "E=1", "cpu_seconds": 12.0}]
    assert cost_line(rows, "x/results.csv").startswith("Cost: 3 runs, 72 CPU-seconds in total (10–50 s each;")
    grouped = cost_line(rows, "x/results.csv", "v", lambda v: v.replace("=", " = "))
    assert "(10–12 s at E = 1, 50–50 s at E = 5; `cpu_seconds` of\n`x/results.csv`" in grouped


def test_same_runs_table_pairs_runs_by_method_and_seed():
    rows = [{"method": "a", "seed": 0, "acc": 1.0, "keep": True}, {"method": "a", "seed": 1, "acc": 2.0, "keep": True},
            {"method": "b", "seed": 0, "acc": 9.0, "keep": False}]  # fmt: skip
    first = run_values(rows, "acc", lambda r: r["keep"])
    assert first == {("a", 0): 1.0, ("a", 1): 2.0}
    second = run_values([{"m": "a", "seed": 0, "x": 1.5}, {"m": "a", "seed": 1, "x": 2.0}], "x", bool, lambda r: r["m"])
    third = {("z", 0): 1.0}  # nothing in common with the others: no row
    table = same_runs_table({"one": first, "two": second, "three": third}, lambda k: k, str.upper)
    assert table.splitlines()[2:] == ["| one | two | A | 1 of 2 | 0.50 |"]


def test_gap_table_gives_the_reference_minus_each_method_per_seed():
    rows = [{"method": m, "round": 5, "seed": s, "accuracy": a}
            for m, s, a in [("ref", 0, 80.0), ("ref", 1, 82.0), ("x", 0, 79.0), ("x", 1, 83.0)]]  # fmt: skip
    table = gap_table(rows, ["x", "ref"], "ref", str.upper)
    assert table.splitlines()[0] == "| round | X | REF | REF − X |"
    assert table.splitlines()[2] == "| 5 | 81.00 ± 2.83 | 81.00 ± 1.41 | +0.00 (+1.00, −1.00) |"


def test_columns_read_a_rows_record_and_a_cells_mean_std():
    by = {"a": {"acc_mean": 80.0, "acc_std": 1.0, "diverged": 1, "seeds": 3}}
    cols = [Col("method", str), Col("acc", lookup(by, lambda r: pm_cell(r, "acc"))), Col("n", lookup(by, "seeds"))]
    assert layout(cols, ["a", "b"]).splitlines()[2:] == ["| a | 80.00 ± 1.00 (1/3 diverged) | 3 |", "| b | — | — |"]
    assert pm_of("x", nd=1)([{"x": 1.0}, {"x": 3.0}, {"x": math.nan}]) == "2.0 ± 1.4 (1/3 diverged)"


def test_iqr_and_finite_runs_of_a_cell():
    runs = [{"seed": 2, "up": 30.0}, {"seed": 0, "up": math.nan}, {"seed": 1, "up": 10.0}]
    assert [r["seed"] for r in finite_runs("up")(runs)] == [2, 1]
    assert [r["seed"] for r in finite_runs("up", by_seed=True)(runs)] == [1, 2]
    assert finite_runs("up", or_all=True)(runs[1:2]) == runs[1:2]  # none finite: all of them (the cell reads NaN)
    cells = per_cell([{"c": 1, "u": 10}, {"c": 1, "u": 30}, {"c": 2, "u": 5}, {"c": 3, "u": None}, {"c": 3, "u": 1}],
                     ("c",), {"iqr": iqr_of("u")})  # fmt: skip
    assert [c["iqr"] for c in cells] == ["15-25", "", ""]  # one record, or one without a value: no range


def test_complete_pairs_keeps_the_seeds_that_finished_every_cell():
    rs = [{"m": m, "seed": s, "acc": a} for m, s, a in
          [("a", 0, 1.0), ("b", 0, 2.0), ("a", 1, 1.0), ("b", 1, math.nan), ("a", 2, 3.0), ("b", 2, 1.0)]]  # fmt: skip
    assert {r["seed"] for r in complete_pairs(rs, lambda r: r["m"], ("acc",))} == {0, 2}
    assert complete_pairs(rs[:4], lambda r: r["m"], ("acc",)) == []  # one seed left: no pair to test


def test_reading_is_one_function_for_what_was_measured_and_the_rule():
    rule = Paired("acc", {"m": "a"}, {"m": "b"})
    rows = [{"m": m, "seed": s, "acc": a + s} for s in range(3) for m, a in (("a", 2.0), ("b", 1.0))]
    claims = [reading("a beats b", lambda t, _: ("a ahead", rule), paper="a is better")]
    claims += [reading("left out", lambda t, _: None), reading("also out", lambda t, _: (None, rule))]
    got = judge(claims, rows)
    assert [(v.claim, v.measured, v.outcome) for v in got] == [("a beats b", "a ahead", "held")]
    assert claims[0].paper == "a is better"
    assert reading("x", lambda t, _: None).paper == "" and All(p for p in [("one", rule)]).parts == (("one", rule),)


def test_choices_is_one_line_naming_the_flag_and_what_is_allowed():
    assert choices(None, ["a", "b"], "--x") is None and choices(" b, a", ["a", "b"], "--x") == ["b", "a"]
    with pytest.raises(ConfigError, match=r"^--x: unknown \['c'\]; allowed a, b$"):
        choices("a,c", ["a", "b"], "--x")
    with pytest.raises(ConfigError, match=r"^--x: unknown \[','\]; allowed a, b$"):
        choices(",", ["a", "b"], "--x")


def test_one_value_is_shown_without_a_spread():
    """A cell over one finite value (one seed that reached the target, four of five diverged) printed
    ``53.5 ± 0.0`` and ``+1.88±0.00 (4/5 diverged)``, a spread of zero that nothing measured."""
    from fedweave.experiments.tables import mean_std_cell

    assert mean_std_cell([53.48], nd=1) == "53.5"
    assert mean_std_cell([1.88, math.nan, math.nan, math.nan, math.nan], sep="±") == "1.88 (4/5 diverged)"
    assert mean_std_cell([53.48, 53.48], nd=1) == "53.5 ± 0.0"  # two equal values: a spread measured as zero
    row = {"seeds": 3, "diverged": 2, "acc_mean": 91.234, "acc_std": 0.0}
    assert pm_cell(row, "acc") == "91.23 (2/3 diverged)"
    assert pm_cell({**row, "diverged": 1, "acc_std": 0.5}, "acc") == "91.23 ± 0.50 (1/3 diverged)"
