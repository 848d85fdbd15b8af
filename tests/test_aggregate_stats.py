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
