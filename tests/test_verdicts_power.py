"""``verdicts.paired_power`` / ``detectable``: what the declared rules' paired t test over n seeds can find."""

from __future__ import annotations

import pytest

from fedweave.experiments.verdicts import Paired, detectable, paired_power


def test_a_difference_found_with_80_percent_power_is_held_by_the_paired_t_that_often():
    # 4 pairs, differences of sd 1: the test's level when there is no difference, and at the detectable
    # difference a simulated paired t rule holds in about 80 % of draws
    import numpy as np

    assert paired_power(0.0, 1.0, 4) == pytest.approx(0.05, abs=1e-9)
    delta = detectable(1.0, 4)
    rule = Paired("x", {"m": "a"}, {"m": "b"}, direction="greater")
    rng = np.random.default_rng(0)
    draws = 2000
    held = sum(
        rule.decide(dict(enumerate(rng.normal(delta, 1.0, 4))), dict.fromkeys(range(4), 0.0)).low > 0
        for _ in range(draws)
    )
    # two-sided power: the lower tail is negligible at this delta, so the one-sided rejections are the power
    assert held / draws == pytest.approx(0.8, abs=0.03)


def test_the_two_sided_power_is_the_same_for_a_loss_as_for_a_gain():
    # the two-sided test rejects a mean difference -delta as often as +delta: its power is even in delta,
    # also past the noncentrality (|nc| > 10) where the far tail is dropped
    for delta in (0.5, 1.0, 5.0, 20.0):
        assert paired_power(-delta, 1.0, 5) == pytest.approx(paired_power(delta, 1.0, 5), rel=1e-12)
    assert paired_power(-5.0, 1.0, 5) == pytest.approx(1.0, abs=1e-6)
