"""The declarative pieces the studies share: per-cell summaries over seeds (``aggregate.per_cell``), table
columns declared as data (``tables.Col``), and a report's files declared and written by the pipeline
(``study.Report``)."""

from __future__ import annotations

import json
import math

import pytest

from fedweave.experiments.aggregate import diverged, mean_of, median_of, per_cell, per_seed, ranks, std_of
from fedweave.experiments.study import Json, Report, Rows
from fedweave.experiments.tables import Col, bold_best, indent, layout, signed

RECORDS = [
    {"method": "a", "seed": 1, "acc": 70.0, "reach": 5},
    {"method": "b", "seed": 0, "acc": 60.0, "reach": None},
    {"method": "a", "seed": 0, "acc": 72.0, "reach": 3},
    {"method": "b", "seed": 1, "acc": math.nan, "reach": 4},
]


def test_per_cell_summarizes_each_cell_in_order_of_first_appearance():
    finite = lambda rs: [r for r in rs if math.isfinite(r["acc"])]  # noqa: E731
    stats = {
        "seeds": len,
        "mean": mean_of("acc", finite),
        "std": std_of("acc", finite),
        "per_seed": per_seed("acc", ".1f"),
        "diverged": diverged("acc"),
        "reach": median_of("reach"),
    }
    a, b = per_cell(RECORDS, ("method",), stats)
    assert a == {
        "method": "a",
        "seeds": 2,
        "mean": 71.0,
        "std": pytest.approx(math.sqrt(2)),
        "per_seed": "72.0 / 70.0",
        "diverged": 0,
        "reach": 4,
    }
    # b: one seed diverged (left out of the mean, counted), one never reached the target (no median)
    assert (b["method"], b["mean"], b["std"], b["diverged"], b["reach"]) == ("b", 60.0, 0.0, 1, None)
    assert b["per_seed"] == "60.0 / diverged"  # a seed without a finite value is named, not printed as nan


def test_ranks_put_the_largest_first_and_keep_ties_in_order():
    assert ranks({"x": 1.0, "y": 3.0, "z": 1.0}) == {"y": 1, "x": 2, "z": 3}


def test_declared_columns_render_keys_functions_formats_and_none():
    cols = [
        Col("method", "method"),
        Col("acc", "acc", ".2f"),
        Col("twice", lambda r: 2 * r["seed"]),
        Col("reach", "reach"),
    ]
    assert layout(cols, RECORDS[:2]) == (
        "| method | acc | twice | reach |\n|---|---|---|---|\n| a | 70.00 | 2 | 5 |\n| b | 60.00 | 0 | — |\n"
    )


def test_bold_best_signed_and_indent():
    assert bold_best(["1", "3", "2"], [1.0, 3.0, 2.0]) == ["1", "**3**", "2"]
    assert bold_best(["1", "3"], [1.0, 3.0], best=min) == ["**1**", "3"]
    assert (signed(-0.5), signed(1.234)) == ("−0.50", "+1.23")
    assert indent("| a |\n|---|\n") == "  | a |\n  |---|\n  "


def test_a_report_writes_its_declared_files_then_its_figures_then_prints(tmp_path, capsys):
    drawn = []

    def figures(out):
        drawn.append(sorted(p.name for p in out.iterdir()))  # the files are there before any figure

    report = Report(
        {"rows.csv": Rows(RECORDS[:2], ["method", "acc"], ".3g"), "data.json": Json({"x": 1}), "table.md": "# t\n"},
        show="table.md",
        status=1,
        say="done",
        figures=figures,
    )
    assert report.write(tmp_path) == 1
    assert (tmp_path / "rows.csv").read_text() == "method,acc\na,70\nb,60\n"
    assert json.loads((tmp_path / "data.json").read_text()) == {"x": 1}
    assert drawn == [["data.json", "rows.csv", "table.md"]]
    assert capsys.readouterr().out == "# t\n\ndone\n"
    report.write(tmp_path, show=False)
    assert capsys.readouterr().out == ""
