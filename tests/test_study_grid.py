"""A table declared as a grid over records (fedweave.experiments.tables.Grid) and rounded per-cell
statistics (aggregate.mean_of / std_of with ``nd``): the pieces a reproduction's tables are declared with."""

from __future__ import annotations

from fedweave.experiments.aggregate import mean_of, per_cell, std_of
from fedweave.experiments.tables import Grid

ROWS = [
    {"method": "b", "alpha": 1.0, "acc": 60.0},
    {"method": "a", "alpha": 1.0, "acc": 70.0},
    {"method": "a", "alpha": 0.1, "acc": 50.0},
    {"method": "c", "alpha": 0.1, "acc": 40.0},  # c has no label: not a row
]


def test_a_grid_has_the_declared_rows_that_ran_and_the_columns_in_order_of_appearance():
    grid = Grid(
        "method",
        "method",
        {"a": "A", "z": "never ran", "b": "B"},
        lambda r: r["alpha"],
        "α={:g}".format,
        lambda r: f"{r['acc']:.1f}",
    )
    assert grid.render(ROWS) == ("| method | α=1 | α=0.1 |\n|---|---|---|\n| A | 70.0 | 50.0 |\n| B | 60.0 | – |\n")


def test_rounded_statistics_round_the_mean_and_std_of_a_cell():
    records = [{"m": "a", "x": 1.0}, {"m": "a", "x": 2.0}, {"m": "a", "x": 2.0}]
    (got,) = per_cell(records, ("m",), {"mean": mean_of("x", ddof=0, nd=2), "std": std_of("x", ddof=0, nd=3)})
    assert got == {"m": "a", "mean": 1.67, "std": 0.471}
