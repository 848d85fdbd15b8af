"""Experiments: expand a grid of configs over seeds, run it (resumably, in parallel), aggregate and tabulate."""

from fedweave.experiments.grid import GridError, Point, expand, parse_grid
from fedweave.experiments.sweep import SweepResult, sweep

__all__ = ["GridError", "Point", "SweepResult", "expand", "parse_grid", "sweep"]
