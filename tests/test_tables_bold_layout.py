"""``tables.Best`` / ``bold_layout``: a declared table whose best cell of a column is in bold."""

from __future__ import annotations

from fedweave.experiments.tables import Best, Col, bold_layout, layout

ROWS = [{"m": "a", "acc": 71.0, "std": 0.5}, {"m": "b", "acc": 74.25, "std": 1.0}, {"m": "c", "acc": 74.25, "std": 2.0}]


def test_the_best_cell_of_a_best_column_is_bold_the_first_of_equal_ones():
    cols = [
        Col("method", "m"),
        Best("acc", lambda r: f"{r['acc']:.2f} ± {r['std']:.2f}", key="acc"),
        Best("std", "std", ".1f", best=min),
    ]
    assert bold_layout(cols, ROWS) == (
        "| method | acc | std |\n|---|---|---|\n"
        "| a | 71.00 ± 0.50 | **0.5** |\n| b | **74.25 ± 1.00** | 1.0 |\n| c | 74.25 ± 2.00 | 2.0 |\n"
    )


def test_without_best_columns_it_is_layout():
    cols = [Col("method", "m"), Col("acc", "acc", ".1f"), Best("key", "m", key=lambda r: -r["acc"])]
    assert bold_layout(cols[:2], ROWS) == layout(cols[:2], ROWS)
    assert bold_layout(cols, ROWS).splitlines()[2] == "| a | 71.0 | **a** |"  # the key decides, not the cell


def test_a_cell_that_diverged_on_every_seed_is_never_the_best():
    # a NaN mean (every seed diverged) compares false with everything: max() kept it when it came first
    from fedweave.experiments.tables import bold_best

    nan = float("nan")
    assert bold_best(["a", "b", "c"], [nan, 0.8, 0.9]) == ["a", "b", "**c**"]
    assert bold_best(["a", "b", "c"], [0.8, nan, 0.7], min) == ["a", "b", "**c**"]
    assert bold_best(["a", "b"], [nan, nan]) == ["a", "b"]  # nothing finished: nothing in bold
