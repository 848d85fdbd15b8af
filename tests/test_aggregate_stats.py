"""``experiments.aggregate``: the statistics over a cell's seeds against their definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedweave.experiments.aggregate import mean_std


def test_mean_std_is_numpys_sample_mean_and_std():
    xs = [0.81, 0.79, 0.84, 0.8]
    assert mean_std(xs) == pytest.approx((np.mean(xs), np.std(xs, ddof=1)))
    assert mean_std(xs, ddof=0) == pytest.approx((np.mean(xs), np.std(xs)))
    assert mean_std([0.8]) == (0.8, 0.0) and mean_std([None, 0.8]) == (0.8, 0.0)  # one value: std 0, as documented
    assert all(map(math.isnan, mean_std([])))


def test_a_nan_makes_both_nan_also_when_it_is_the_only_value():
    # the docstring's promise: one NaN run is no run with zero spread
    assert all(map(math.isnan, mean_std([0.8, math.nan])))
    assert all(map(math.isnan, mean_std([math.nan])))


def test_ranks_put_a_nan_last_and_rank_the_others_by_value():
    from fedweave.experiments.aggregate import ranks

    nan = float("nan")
    assert ranks({"a": 0.8, "b": 0.9, "c": 0.8}) == {"b": 1, "a": 2, "c": 3}  # ties in the given order
    # a NaN (a cell whose every seed diverged) anywhere used to scramble the sort: 0.9 ranked third
    assert ranks({"a": 0.8, "b": nan, "c": 0.9}) == {"c": 1, "a": 2, "b": 3}
    assert ranks({"a": nan, "b": 0.8, "c": 0.9, "d": nan}) == {"c": 1, "b": 2, "a": 3, "d": 4}
