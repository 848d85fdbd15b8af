"""Byzantine clients and robust aggregation (fedweave.robust, docs/robustness.md): each aggregator against its
definition or a numpy/scipy reference, each attack against its paper's update, and the runs they join."""

from __future__ import annotations

import copy
import json
import math
from statistics import NormalDist

import numpy as np
import pytest
import scipy.optimize
import scipy.stats
import torch

import fedweave
from fedweave.checkpoints import CHECKPOINT, read_checkpoint
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError, load
from fedweave.registry import AGGREGATORS, ATTACKS
from fedweave.robust.aggregators import (
    Bulyan,
    CenteredClipping,
    DnC,
    GeometricMedian,
    Krum,
    Mean,
    Median,
    NormBound,
    TrimmedMean,
    bucketed,
    krum_scores,
)
from fedweave.robust.attacks import AttackInfo, alie_z
from fedweave.robust.stage import RobustStage, attackers, poisoned_data
from fedweave.runner import resume
from fedweave.seeding import Seeds

F64 = torch.float64


def _rows(n: int = 9, d: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _uniform(n: int) -> torch.Tensor:
    return torch.full((n,), 1.0 / n, dtype=F64)


# ---- aggregators ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", [Median(), TrimmedMean(beta=0.2), TrimmedMean(), GeometricMedian()])
def test_identical_updates_come_back(agg):
    u = torch.tensor([0.1, -3.7, 2.0e-5, 1e3], dtype=F64).expand(7, 4).clone()
    out = agg(u, _uniform(7), 2)
    if isinstance(agg, TrimmedMean):  # a mean of equal values: exact up to the rounding of the sum
        torch.testing.assert_close(out, u[0], rtol=1e-15, atol=0)
    else:
        assert torch.equal(out, u[0])


def test_median_is_numpys_median():
    for n in (6, 7):
        u = _rows(n, 11, seed=n)
        np.testing.assert_array_equal(Median()(u, _uniform(n), 0).numpy(), np.median(u.numpy(), axis=0))


def test_trimmed_mean_without_trimming_is_the_mean_bit_for_bit():
    u = _rows(10, 6)
    assert torch.equal(TrimmedMean(beta=0.0)(u, _uniform(10), 3), u.mean(0))
    assert torch.equal(TrimmedMean()(u, _uniform(10), 0), u.mean(0))  # f = 0: nothing trimmed


@pytest.mark.parametrize("beta", [0.1, 0.2, 0.3, 0.45])
def test_trimmed_mean_equals_scipy_trim_mean(beta):
    u = _rows(13, 8, seed=1)
    ref = scipy.stats.trim_mean(u.numpy(), beta, axis=0)
    np.testing.assert_allclose(TrimmedMean(beta=beta)(u, _uniform(13), 0).numpy(), ref, rtol=1e-13, atol=1e-15)
    k = int(beta * 13)  # f = k: the same cut
    np.testing.assert_allclose(TrimmedMean()(u, _uniform(13), k).numpy(), ref, rtol=1e-13, atol=1e-15)


def test_a_trimmed_mean_cutting_fewer_than_the_attackers_warns_and_runs(caplog):
    """beta 0.1 of 20 updates cuts 2 of each end against f = 4: allowed (a study of too small a beta), with one
    warning saying the attackers' most extreme values stay in; beta null (cut f), or enough, says nothing."""
    with caplog.at_level("WARNING", logger="fedweave.robust.aggregators"):
        TrimmedMean(beta=0.1).check(20, 4)
        TrimmedMean().check(20, 4)
        TrimmedMean(beta=0.2).check(20, 4)
    (rec,) = caplog.records
    assert rec.getMessage().startswith("aggregator.beta 0.1 cuts 2 of each end of 20 updates, fewer than the 4")


def _honest_and_byzantine(n: int, f: int, seed: int = 0) -> tuple[torch.Tensor, set[int]]:
    """``n - f`` honest updates around (1, 1, ...) and ``f`` colluding ones far away, mixed in order."""
    g = torch.Generator().manual_seed(seed)
    honest = 1.0 + 0.1 * torch.randn(n - f, 4, generator=g, dtype=F64)
    bad = torch.full((f, 4), -20.0, dtype=F64) + 0.01 * torch.randn(f, 4, generator=g, dtype=F64)
    order = torch.randperm(n, generator=g)
    u = torch.cat([honest, bad])[order]
    return u, {i for i in range(n) if int(order[i]) < n - f}


@pytest.mark.parametrize(("n", "f"), [(7, 2), (9, 3), (12, 4)])
def test_krum_picks_an_honest_update_within_n_gt_2f_plus_2(n, f):
    u, honest = _honest_and_byzantine(n, f)
    out = Krum()(u, _uniform(n), f)
    assert any(torch.equal(out, u[i]) for i in honest)
    # Multi-Krum with m = n - f averages exactly the honest ones
    want = u[sorted(honest)].mean(0)
    torch.testing.assert_close(AGGREGATORS.get("multi_krum")()(u, _uniform(n), f), want, rtol=1e-14, atol=1e-14)


def test_multi_krum_takes_n_minus_f_of_each_rounds_updates():
    agg = AGGREGATORS.get("multi_krum")()
    u, honest = _honest_and_byzantine(12, 2)
    torch.testing.assert_close(agg(u, _uniform(12), 2), u[sorted(honest)].mean(0), rtol=1e-14, atol=1e-14)
    small, honest = _honest_and_byzantine(8, 2, seed=1)  # a smaller round after a larger one is no refusal
    torch.testing.assert_close(agg(small, _uniform(8), 2), small[sorted(honest)].mean(0), rtol=1e-14, atol=1e-14)


def test_krum_scores_by_hand():
    u = torch.tensor([[0.0], [1.0], [3.0], [10.0]], dtype=F64)
    # n = 4, f = 0: n - f - 2 = 2 nearest: 0 -> 1 + 9, 1 -> 1 + 4, 3 -> 4 + 9, 10 -> 49 + 81
    assert torch.equal(Krum()(u, _uniform(4), 0), u[1])


def test_krum_breaks_exact_ties_by_row_order():
    # scores 3, 3, 3, 10, 5 (f = 0: the 3 nearest others): the first row is Krum's, rows 0 and 1 Multi-Krum's
    # m = 2; the squared distances were cdist's, squared again (sqrt(2)^2 = 2.0000000000000004), and the rounding,
    # not the row order, broke the tie: Krum took row 1
    u = torch.tensor([[-1.0, 0.0], [-1.0, -1.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0]], dtype=F64)
    assert krum_scores(u, 0).tolist() == [3.0, 3.0, 3.0, 10.0, 5.0]
    assert Krum()(u, _uniform(5), 0).tolist() == [-1.0, 0.0]
    assert Krum(m=2)(u, _uniform(5), 0).tolist() == [-1.0, -0.5]


@pytest.mark.parametrize("agg", ["krum", "multi_krum"])
def test_an_m_beyond_the_rounds_updates_is_refused_naming_m(toy_config, tmp_path, agg):
    # 10 updates satisfy n > 2f + 2 for f = 0; m = 11 alone is what fails, and the line said "needs at least 11
    # client updates per round against f = 0 Byzantine ones ...; lower aggregator.f", which cannot help
    from fedweave.registry import ALGORITHMS
    from fedweave.robust.stage import build, check

    cfg = load({**toy_config, "aggregator": {"name": agg, "m": 11}})
    check(cfg, ALGORITHMS.get("fedavg"))
    with pytest.raises(ConfigError) as e:
        build(cfg, Seeds(0), 10, 10)
    assert str(e.value) == (
        "aggregator.m must be at most the 10 client updates a round reduces (the updates Multi-Krum averages), got 11"
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_krum_never_picks_an_update_that_is_not_finite(bad):
    # a NaN row's score is NaN, and argmin took NaN for the least score: Krum picked the NaN update that
    # Multi-Krum's sort (NaN last) ranks worst; a row that is not finite is the farthest outlier
    u = torch.cat([torch.full((2, 3), bad, dtype=F64), _rows(9, 3)])
    out = Krum()(u, _uniform(11), 2)
    assert any(torch.equal(out, u[i]) for i in range(2, 11))
    assert bool(torch.isfinite(Bulyan()(u, _uniform(11), 2)).all())


def test_krum_and_bulyan_refuse_too_few_updates_in_one_line():
    u = _rows(6, 3)
    with pytest.raises(ConfigError, match=r"^aggregator 'krum' needs at least 7 client updates .* f = 2") as e:
        Krum()(u, _uniform(6), 2)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^aggregator 'bulyan' needs at least 11 client updates .* f = 2"):
        Bulyan()(_rows(10, 3), _uniform(10), 2)


@pytest.mark.parametrize(
    ("byzantine", "aggregator", "message"),
    [
        ({"fraction": 0.2, "attack": "min_max", "perturbation": "foo"}, None,
         r"^faults\.byzantine\.perturbation must be one of \['unit_vec', 'std', 'sign'\], got 'foo'$"),
        ({"fraction": 0.2, "attack": "sign_flip", "scale": "abc"}, None,
         r"^faults\.byzantine\.scale must be a number, got 'abc'$"),
        (None, {"name": "krum", "m": 1.5}, r"^aggregator\.m must be an integer, got 1\.5$"),
        (None, {"name": "geometric_median", "iters": "abc"}, r"^aggregator\.iters must be an integer, got 'abc'$"),
    ],
)  # fmt: skip
def test_attack_and_aggregator_options_of_the_wrong_type_are_one_line_naming_the_key(
    byzantine, aggregator, message, tmp_path
):
    # the options are the classes' __init__ parameters: their types are checked as every other option's (before,
    # a misspelt perturbation silently ran as 'sign' and a string gave a raw TypeError inside the round)
    data = {"seed": 0, "rounds": 1, "dataset": "digits", "partition": {"name": "iid", "num_clients": 10},
            "model": "logistic", "algorithm": {"name": "fedavg", "clients_per_round": 10},
            "output": {"dir": str(tmp_path / "run"), "plots": False, "progress": False}}  # fmt: skip
    if byzantine is not None:
        data["faults"] = {"byzantine": byzantine}
    if aggregator is not None:
        data["aggregator"] = aggregator
    with pytest.raises(ConfigError, match=message) as e:
        fedweave.run(data)
    assert "\n" not in str(e.value)


def test_bulyan_on_its_bound_keeps_to_the_honest_updates():
    n, f = 11, 2  # n = 4f + 3
    u, honest = _honest_and_byzantine(n, f, seed=3)
    out = Bulyan()(u, _uniform(n), f)
    h = u[sorted(honest)]
    assert bool(((out >= h.min(0).values) & (out <= h.max(0).values)).all())


def test_bulyan_by_hand_with_f_0_is_the_mean():
    u = _rows(5, 3)
    torch.testing.assert_close(Bulyan()(u, _uniform(5), 0), u.mean(0), rtol=1e-14, atol=1e-14)


def test_geometric_median_minimizes_the_weighted_sum_of_distances():
    u = _rows(9, 5, seed=2)
    w = torch.arange(1, 10, dtype=F64)
    w = w / w.sum()

    def cost(v: np.ndarray) -> float:
        return float(w.numpy() @ np.linalg.norm(u.numpy() - v, axis=1))

    opts = {"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000, "maxfev": 40000}
    ref = scipy.optimize.minimize(cost, (w @ u).numpy(), method="Nelder-Mead", options=opts)
    out = GeometricMedian(iters=1000, nu=1e-12, tol=1e-15)(u, w, 0).numpy()
    assert cost(out) <= ref.fun + 1e-10
    np.testing.assert_allclose(out, ref.x, atol=1e-5)


def test_the_geometric_median_does_not_depend_on_which_row_comes_first():
    # computed relative to the first row, an attacker's row at 1e6 first left float32 the honest rows only to its
    # step there (0.0625): every coordinate came out 0.125; relative to the coordinate-wise median, the order of the
    # rows changes nothing
    honest = 0.1 + 0.01 * torch.randn(9, 5, generator=torch.Generator().manual_seed(0))
    attacker = torch.full((1, 5), 1e6)
    w = _uniform(10).float()
    first, last = (
        GeometricMedian()(torch.cat([attacker, honest]), w, 1),
        GeometricMedian()(torch.cat([honest, attacker]), w, 1),
    )
    assert torch.equal(first, last)
    # float64's answer to within where the relative stop leaves each (the objective is the attacker's distance)
    want = GeometricMedian()(torch.cat([attacker, honest]).double(), w.double(), 1)
    torch.testing.assert_close(first.double(), want, rtol=0, atol=5e-3)
    same = honest[:1].repeat(4, 1)  # identical updates: that update exactly
    assert torch.equal(GeometricMedian()(same, _uniform(4).float(), 0), same[0])


def test_the_geometric_medians_relative_stop_ends_early_against_far_outliers_as_the_page_says(tmp_path):
    # RFA's stop (the objective's relative change below tol) is met far from the minimizer when the objective is
    # the attackers' distances; the page said only "the weighted geometric median" and now states the limit
    from pathlib import Path

    honest = torch.randn(8, 650, generator=torch.Generator().manual_seed(0)).double() * 0.01
    u = torch.cat([honest, -1e10 * honest[:2]])
    early = GeometricMedian()(u, _uniform(10), 2)
    full = GeometricMedian(tol=0.0)(u, _uniform(10), 2)
    assert round(float((early - honest.mean(0)).norm()), 1) == 12.0
    assert round(float((full - honest.mean(0)).norm()), 2) == 0.05
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "robustness.md").read_text().split())
    assert "stop at 12.0 from the honest mean, where the minimizer is 0.05 from it" in page
    cfg = {"name": "g", "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
           "partition": {"name": "iid", "num_clients": 10}, "model": {"name": "logistic"},
           "local": {"epochs": 1, "batch_size": 32, "lr": 0.1},
           "algorithm": {"name": "fedavg", "clients_per_round": 10},
           "faults": {"byzantine": {"fraction": 0.2, "attack": "sign_flip", "scale": 1e18}},
           "output": {"progress": False, "plots": False}}  # fmt: skip
    status = {
        agg: fedweave.run({**cfg, "aggregator": agg}, run_dir=tmp_path / agg, on_divergence="return").summary["status"]
        for agg in ("geometric_median", "median", "krum")
    }
    assert status == {"geometric_median": "diverged", "median": "completed", "krum": "completed"}


def test_centered_clipping_one_iteration_closed_form_and_its_center_carries_over():
    u, w = _rows(6, 4, seed=4), _uniform(6)
    cc = CenteredClipping(tau=1.5, iters=1)
    # first round: the center is 0, v = sum_i w_i u_i min(1, tau / ||u_i||)
    want = sum(w[i] * u[i] * min(1.0, 1.5 / float(u[i].norm())) for i in range(6))
    torch.testing.assert_close(cc(u, w, 0), want, rtol=1e-14, atol=1e-14)
    u2 = _rows(6, 4, seed=5)
    want2 = want + sum(w[i] * (u2[i] - want) * min(1.0, 1.5 / float((u2[i] - want).norm())) for i in range(6))
    torch.testing.assert_close(cc(u2, w, 0), want2, rtol=1e-14, atol=1e-14)
    # a radius above every distance: the weighted mean
    torch.testing.assert_close(CenteredClipping(tau=1e9)(u, w, 0), w @ u, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("agg", [NormBound(), NormBound(bound=0.05), CenteredClipping(tau=0.05)])
def test_length_measuring_aggregators_scale_updates_whose_float32_norm_overflows(agg):
    # two attackers' rows of about 1e30 are finite in float32, their norms (squares summed) are not: the scale
    # M / ||u|| came out 0 and the rows were dropped, not scaled to length M (or tau); float64 is the reference
    honest = torch.randn(8, 650, generator=torch.Generator().manual_seed(0)) * 0.01
    u = torch.cat([honest, -1e30 * honest[:2]])
    assert bool(torch.isfinite(u).all()) and not bool(torch.isfinite(u.norm(dim=1)).all())
    want = copy.deepcopy(agg)(u.double(), _uniform(10), 2)
    got = agg(u, _uniform(10).float(), 2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tol", [1e-7, 0.0])
def test_geometric_median_of_float32_rows_whose_distances_overflow_is_float64s_not_nan(tol):
    # attackers' rows of about 1e30 are finite in float32, every distance to the iterate (squares summed) is not:
    # each Weiszfeld weight w_i / ||v - u_i|| was 0 and v = 0 / 0, so the aggregate was NaN; float64 is the reference
    honest = torch.randn(8, 650, generator=torch.Generator().manual_seed(0)) * 0.01
    u = torch.cat([honest, -1e30 * honest[:2]])
    want = GeometricMedian(tol=tol)(u.double(), _uniform(10), 2)
    got = GeometricMedian(tol=tol)(u, _uniform(10).float(), 2)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert float((got.double() - want).norm()) <= 1e-6 * float(want.norm())


def test_norm_bounding_scales_the_long_updates_to_the_bound_by_hand():
    u, w = _rows(6, 4, seed=6), torch.tensor([0.1, 0.3, 0.2, 0.1, 0.2, 0.1], dtype=F64)
    norms = [float(r.norm()) for r in u]
    want = sum(w[i] * u[i] * min(1.0, 1.5 / norms[i]) for i in range(6))
    torch.testing.assert_close(NormBound(bound=1.5)(u, w, 0), want, rtol=1e-14, atol=1e-14)
    # null: M is the median of the round's norms (the mean of the two middle ones for an even count)
    m = float(np.median(norms))
    want = sum(w[i] * u[i] * min(1.0, m / norms[i]) for i in range(6))
    torch.testing.assert_close(NormBound()(u, w, 0), want, rtol=1e-14, atol=1e-14)
    # no update longer than the bound: the weighted mean, bit for bit
    assert torch.equal(NormBound(bound=1e9)(u, w, 0), Mean()(u, w, 0))


def test_norm_bounding_caps_a_boosted_attackers_pull():
    honest = _rows(9, 5, seed=7) * 0.1
    boosted = 1000.0 * honest[:1]  # model replacement: one update scaled by the round's clients and more
    u, w = torch.cat([honest, boosted]), _uniform(10)
    moved = (NormBound()(u, w, 1) - honest.mean(0)).norm()
    assert float(moved) < float(honest.norm(dim=1).max())  # the attacker's share is at most M / n
    assert float((Mean()(u, w, 1) - honest.mean(0)).norm()) > 10.0


def _dnc_reference(u: np.ndarray, f: int, niters: int, c: float, coords: list[np.ndarray]) -> np.ndarray:
    """Alg. 2 of Shejwalkar & Houmansadr (NDSS 2021) in numpy, on the given sampled coordinates."""
    n, good = len(u), set(range(len(u)))
    for r in coords:
        sub = u[:, r]
        centered = sub - sub.mean(0)
        v = np.linalg.svd(centered, full_matrices=False)[2][0]
        scores = (centered @ v) ** 2
        good &= set(np.argsort(scores, kind="stable")[: n - int(math.floor(c * f))].tolist())
    return u[sorted(good)].mean(0)


def test_dnc_keeps_the_honest_updates_against_obvious_outliers():
    u, honest = _honest_and_byzantine(10, 2)
    want = u[sorted(honest)].mean(0)
    rng = np.random.default_rng(0)
    torch.testing.assert_close(DnC()(u, _uniform(10), 2, rng=rng), want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(DnC(b=2, niters=7)(u, _uniform(10), 2, rng=rng), want, rtol=1e-14, atol=1e-14)
    # c = 2 cuts 4 a round: the good set is a subset of the honest ones
    out = DnC(b=2, c=2.0)(u, _uniform(10), 2, rng=rng)
    assert float((out - want).abs().max()) < 0.2 and float((out - u[sorted(set(range(10)) - honest)][0]).norm()) > 30


@pytest.mark.parametrize(("niters", "b", "c", "f"), [(1, 4, 1.0, 2), (5, 3, 1.0, 2), (4, 6, 1.5, 1), (3, 40, 1.0, 3)])
def test_dnc_equals_an_independent_implementation_on_the_same_coordinates(niters, b, c, f):
    u = _rows(11, 30, seed=niters + b)
    u[3] += 2.0  # one update off the others, so the sets differ between iterations
    agg = DnC(niters=niters, b=b, c=c)
    coords = [agg.coordinates(30, rng) for rng in [np.random.default_rng(9)] for _ in range(niters)]
    assert all(len(r) == min(b, 30) and len(set(r.tolist())) == len(r) for r in coords)
    ref = _dnc_reference(u.numpy(), f, niters, c, coords)
    got = agg(u, _uniform(11), f, rng=np.random.default_rng(9))  # the same stream: the same coordinates
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12, atol=1e-14)


def test_dnc_refuses_bad_options_too_few_updates_and_an_empty_intersection_in_one_line():
    for opts, message in [
        ({"niters": 0}, r"^aggregator\.niters must be >= 1 .*, got 0$"),
        ({"b": 0}, r"^aggregator\.b must be >= 1 .*, got 0$"),
        ({"c": 0.0}, r"^aggregator\.c must be > 0 .*, got 0\.0$"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DnC(**opts)
    # n > floor(c f): with c = 1.5 and f = 2, three updates are cut, so three are too few
    with pytest.raises(ConfigError, match=r"^aggregator 'dnc' needs at least 4 client updates .* f = 2 "):
        DnC(c=1.5)(_rows(3, 4), _uniform(3), 2, rng=np.random.default_rng(0))
    # b = 1: each iteration keeps the update nearest the mean on its one coordinate; coordinate 0 keeps row 1,
    # coordinate 1 keeps row 3, so two iterations that sample one each have no update in common
    u = torch.tensor([[0.0, 5.0], [10.0, 0.0], [11.0, 100.0], [12.0, 6.0]], dtype=F64)
    agg, drawn = DnC(niters=2, b=1), iter([np.array([0]), np.array([1])])
    agg.coordinates = lambda d, rng: next(drawn)  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"^aggregator 'dnc': its 2 iterations kept no update in common") as e:
        agg(u, _uniform(4), 3, rng=np.random.default_rng(0))
    assert "\n" not in str(e.value)


def test_bucketing_averages_consecutive_buckets_of_the_permutation():
    u, w = _rows(5, 3), torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=F64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    means, ws = bucketed(u, w, 2, perm)
    torch.testing.assert_close(means[0], (0.25 * u[3] + 0.1 * u[0]) / 0.35)
    torch.testing.assert_close(means[1], (0.15 * u[4] + 0.2 * u[1]) / 0.35)
    torch.testing.assert_close(means[2], u[2])
    torch.testing.assert_close(ws, torch.tensor([0.35, 0.35, 0.3], dtype=F64))


# ---- attacks -------------------------------------------------------------------------------------------------


def _attack(name: str, **options):
    return ATTACKS.get(name)(**options)


def test_attacks_send_what_their_papers_define():
    own, honest = _rows(2, 6, seed=7), _rows(8, 6, seed=8)
    info = AttackInfo(round=3, attackers=np.array([4, 9]), n=10, seeds=Seeds(5))
    assert torch.equal(_attack("sign_flip")(own, honest, info), -own)
    assert torch.equal(_attack("scaled")(own, honest, info), 10.0 * own)  # gamma = n (server step 1)
    assert torch.equal(_attack("scaled", boost=3.0)(own, honest, info), 3.0 * own)
    noise = torch.stack([torch.randn(6, generator=Seeds(5).torch("byzantine_noise", 3, c), dtype=F64) for c in (4, 9)])
    assert torch.equal(_attack("gaussian", std=2.0)(own, honest, info), 2.0 * noise)
    mu, sd = honest.mean(0), honest.std(0)
    # ALIE: n = 10, f = 2: s = floor(10/2 + 1) - 2 = 4, z = Phi^-1((10 - 4)/10)
    z = NormalDist().inv_cdf(0.6)
    assert alie_z(10, 2) == z
    assert torch.equal(_attack("alie")(own, honest, info), (mu - z * sd).expand(2, 6))
    assert torch.equal(_attack("ipm", eps=0.5)(own, honest, info), (-0.5 * mu).expand(2, 6))
    assert torch.equal(_attack("label_flip")(own, honest, info), own)
    x = torch.zeros(3, 2)
    px, py = _attack("label_flip").poison(x, torch.tensor([0, 3, 9]), 10, 1.0, np.random.default_rng(0))
    assert px is x and torch.equal(py, torch.tensor([9, 6, 0]))


def test_alie_refuses_a_run_whose_attackers_are_a_majority_and_sends_the_mean_in_a_sampled_majority_round(
    toy_config, tmp_path
):
    """Alg. 3 of Baruch et al. needs s = floor(n/2 + 1) - f > 0 supporters; 7 attackers of the toy's 12 clients
    leave a full round none: refused before round 0 naming z (before: every round sent the honest mean, z = 0).
    A round that sampling leaves with a majority (s <= 0) sends the mean, as documented."""
    byz = {"fraction": 0.55, "attack": "alie"}  # 6.6 -> 7 of 12
    with pytest.raises(ConfigError, match=r"^faults\.byzantine\.z: ALIE's z .* 7 attackers of 12 clients") as e:
        fedweave.run(_cfg(toy_config, faults={"byzantine": byz}), run_dir=tmp_path / "r")
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    given = fedweave.run(_cfg(toy_config, rounds=1, faults={"byzantine": {**byz, "z": 1.0}}), run_dir=tmp_path / "z")
    assert given.summary["status"] == "completed"
    half = {"fraction": 0.5, "attack": "alie"}  # 6 of 12: s = 7 - 6 = 1 in a full round
    assert fedweave.run(_cfg(toy_config, rounds=1, faults={"byzantine": half}), run_dir=tmp_path / "h").metrics
    assert alie_z(10, 6) == 0.0 and alie_z(10, 5) == NormalDist().inv_cdf(0.9)  # s = 0, then s = 1


def _perturbed_mean(name: str, perturbation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Min-Max's or Min-Sum's upload from 8 honest rows, checked to be ``mu - gamma p`` for both attackers:
    the honest rows, the upload, the direction ``p`` and ``gamma``."""
    own, honest = _rows(2, 6, seed=7), _rows(8, 6, seed=8)
    attack = _attack(name, perturbation=perturbation)
    sent = attack(own, honest, AttackInfo(0, np.array([0, 1]), 10, Seeds(0)))
    mu = honest.mean(0)
    p = {"unit_vec": mu / mu.norm(), "std": honest.std(0), "sign": mu.sign()}[perturbation]
    gamma = attack.gamma(honest, p)
    assert torch.equal(sent, (mu - gamma * p).expand(2, 6))
    return honest, sent[0], p, gamma


@pytest.mark.parametrize("perturbation", ["unit_vec", "std", "sign"])
def test_min_max_takes_the_largest_gamma_within_the_honest_diameter(perturbation):
    honest, sent, p, gamma = _perturbed_mean("min_max", perturbation)
    mu = honest.mean(0)
    diameter = torch.cdist(honest, honest).max()
    assert (honest - sent).norm(dim=1).max() <= diameter  # Min-Max's constraint holds
    assert (honest - (mu - (gamma + 1e-4) * p)).norm(dim=1).max() > diameter  # and gamma is (nearly) the largest
    assert gamma > 0


def test_min_max_keeps_to_the_honest_diameter_with_more_than_25_honest_updates():
    # torch.cdist's default takes ||a||^2 + ||b||^2 - 2ab beyond 25 rows: for 40 close float32 updates of norm
    # about 30 the diameter came out 0.0547 against 0.0475, and the upload went past eq. 6's bound
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(1000, generator=g) + 0.001 * torch.randn(40, 1000, generator=g)
    sent = _attack("min_max")(honest[:2], honest, AttackInfo(0, np.array([0, 1]), 42, Seeds(0)))[0]
    h, m = honest.double(), sent.double()
    diameter = max(float((h - h[i]).norm(dim=1).max()) for i in range(len(h)))
    assert float((h - m).norm(dim=1).max()) <= diameter * (1 + 1e-5)


def _min_sum_constraint(honest: torch.Tensor, m: torch.Tensor) -> bool:
    """Min-Sum's constraint (Shejwalkar & Houmansadr), in numpy: sum_i ||m - g_i||^2 <= max_i sum_j ||g_i - g_j||^2."""
    h, m = honest.numpy(), m.numpy()
    bound = max(sum(float(np.sum((h[i] - h[j]) ** 2)) for j in range(len(h))) for i in range(len(h)))
    return sum(float(np.sum((m - g) ** 2)) for g in h) <= bound


@pytest.mark.parametrize("perturbation", ["unit_vec", "std", "sign"])
def test_min_sum_takes_the_largest_gamma_within_the_largest_honest_sum_of_squared_distances(perturbation):
    honest, sent, p, gamma = _perturbed_mean("min_sum", perturbation)
    mu = honest.mean(0)
    assert _min_sum_constraint(honest, sent)  # the constraint holds at the returned gamma ...
    assert not _min_sum_constraint(honest, mu - (gamma + 1e-4) * p)  # ... and fails just above it
    # closed form: mu is the honest mean, so sum_i ||mu - gamma p - g_i||^2 = sum_i ||mu - g_i||^2 + n gamma^2 ||p||^2
    h = honest.numpy()
    bound = max(float(np.sum((h[i] - h) ** 2)) for i in range(8))
    closed = math.sqrt((bound - float(np.sum((h - h.mean(0)) ** 2))) / (8 * float(p @ p)))
    assert closed - 2e-5 <= gamma <= closed
    # and a brute-force scan of gamma on a grid of step 1e-4 agrees to the grid's step
    ok = [g for g in np.arange(0.0, 20.0, 1e-2) if _min_sum_constraint(honest, mu - g * p)]  # coarse, then fine
    fine = [g for g in np.arange(ok[-1], ok[-1] + 1e-2, 1e-4) if _min_sum_constraint(honest, mu - g * p)]
    assert abs(fine[-1] - gamma) <= 1e-4


def test_min_sum_and_min_max_share_the_direction_and_the_search_and_differ_in_the_objective():
    honest = _rows(8, 6, seed=8)
    min_max, min_sum = _attack("min_max"), _attack("min_sum")
    p = min_max.direction(honest)
    assert torch.equal(p, min_sum.direction(honest))
    assert type(min_max).gamma is type(min_sum).gamma  # one search, parametrised by bound() and spread()
    assert min_sum.gamma(honest, p) != min_max.gamma(honest, p)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_dnc_cuts_an_update_that_is_not_finite(bad):
    # before, the SVD raised a LinAlgError traceback mid-run
    honest = _rows(8, 40, seed=3).float()
    updates = torch.cat([honest, torch.full((2, 40), bad)])
    out = AGGREGATORS.get("dnc")(b=16)(updates, torch.full((10,), 0.1), 2, rng=np.random.default_rng(0))
    assert torch.equal(out, honest.mean(0))  # every iteration cuts c f = 2 rows: the attackers'


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("name", ["geometric_median", "centered_clipping", "norm_bound"])
def test_the_length_measuring_aggregators_drop_an_update_that_is_not_finite(name, bad, tmp_path):
    """Weiszfeld's weights, centered clipping's and norm bounding's scale of a row of no finite length are 0, and
    0 * inf (or anything * NaN) is NaN: one attacker's overflowing update made the aggregate NaN, where the median,
    Krum and DnC held (the run ended diverged in round 1 under sign_flip scaled past float32's range). Such a row
    is dropped: the aggregate of the others, bit for bit."""
    honest = _rows(9, 4, seed=5).float()
    updates = torch.cat([honest[:3], torch.full((1, 4), bad), honest[3:]])
    weights = torch.full((10,), 0.1)
    options = {"norm_bound": {"bound": 1.0}}.get(name, {})
    got = AGGREGATORS.get(name)(**options)(updates, weights, 1)
    assert torch.equal(
        got, AGGREGATORS.get(name)(**options)(honest, torch.full((9,), 0.1) / torch.full((9,), 0.1).sum(), 1)
    )
    cfg = {"name": "d", "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
           "partition": {"name": "iid", "num_clients": 10}, "model": {"name": "logistic"},
           "local": {"epochs": 1, "batch_size": 32, "lr": 0.1}, "aggregator": {"name": name, **options},
           "algorithm": {"name": "fedavg", "clients_per_round": 10}, "output": {"progress": False, "plots": False},
           "faults": {"byzantine": {"clients": [3], "attack": "sign_flip", "scale": 1e39}}}  # fmt: skip
    res = fedweave.run(cfg, run_dir=tmp_path / "a", on_divergence="return")
    assert res.summary["status"] == "completed" and all(math.isfinite(r["test_loss"]) for r in res.metrics)


def test_dnc_holds_against_updates_whose_svd_overflows_float32(tmp_path):
    # sign flipping scaled by 1e30: the SVD of the float32 updates came back NaN and DnC kept the attackers (the
    # run diverged in round 2 where the median and Krum held); now it keeps the honest updates
    cfg = {"name": "d", "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
           "partition": {"name": "iid", "num_clients": 10}, "model": {"name": "logistic"},
           "local": {"epochs": 1, "batch_size": 32, "lr": 0.1}, "aggregator": {"name": "dnc"},
           "algorithm": {"name": "fedavg", "clients_per_round": 10}, "output": {"progress": False}}  # fmt: skip
    attacked = {**cfg, "faults": {"byzantine": {"fraction": 0.2, "attack": "sign_flip", "scale": 1e30}}}
    res = fedweave.run(attacked, run_dir=tmp_path / "a", on_divergence="return")
    assert res.summary["status"] == "completed"
    assert all(r["byzantine_clients"] == 2 for r in res.metrics)


@pytest.mark.parametrize("name", ["min_max", "min_sum"])
def test_unit_vec_attacks_send_the_honest_mean_when_it_is_zero(name, tmp_path):
    # mu / ||mu|| is 0 / 0 there: before, every attacker sent NaN (gamma * NaN, even at gamma 0)
    own, honest = _rows(2, 6), _rows(3, 6, seed=4)
    honest = torch.cat([honest, -honest]).round()  # whole numbers: the mean is exactly 0, the updates far from it
    sent = _attack(name)(own, honest, AttackInfo(0, np.array([0, 1]), 8, Seeds(0)))
    assert torch.equal(sent, torch.zeros_like(own))
    # gossip trains after mixing: in round 1 every peer holds the initial model, every displacement is 0
    cfg = {"name": "g", "rounds": 2, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 8},
           "model": {"name": "logistic"}, "algorithm": {"name": "gossip", "neighbours": 3},
           "local": {"epochs": 1, "batch_size": 32, "lr": 0.1}, "aggregator": {"name": "dnc"},
           "faults": {"byzantine": {"fraction": 0.25, "attack": name}}, "output": {"progress": False}}  # fmt: skip
    res = fedweave.run(cfg, run_dir=tmp_path / "run")
    assert res.summary["status"] == "completed" and all(math.isfinite(r["test_accuracy"]) for r in res.metrics)


def test_omniscient_attacks_read_their_own_updates_when_no_honest_client_reports():
    own = _rows(3, 4)
    out = _attack("ipm", eps=1.0)(own, own[:0], AttackInfo(0, np.array([0, 1, 2]), 3, Seeds(0)))
    assert torch.equal(out, (-own.mean(0)).expand(3, 4))


def test_attackers_come_from_the_seed_and_label_flip_poisons_only_their_samples():
    spec = {"fraction": 0.25, "attack": "label_flip"}
    a = attackers(spec, 20, Seeds(1))
    assert len(a) == 5 and np.array_equal(a, attackers(spec, 20, Seeds(1)))
    assert not np.array_equal(a, attackers(spec, 20, Seeds(2)))
    assert np.array_equal(attackers({"clients": [7, 2], "attack": "ipm"}, 20, Seeds(1)), [2, 7])
    cfg = load({"faults": {"byzantine": {"clients": [1], "attack": "label_flip"}}})
    parts = [np.array([0, 1]), np.array([2, 3, 4]), np.array([5])]
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    x = torch.arange(6.0).unsqueeze(1)
    px, py = poisoned_data(cfg, Seeds(0), x, y, parts, 6)
    assert torch.equal(py, torch.tensor([0, 1, 3, 2, 1, 5])) and px is x  # labels only: the inputs not copied
    assert torch.equal(y, torch.tensor([0, 1, 2, 3, 4, 5]))  # the dataset is untouched


def test_a_fraction_that_rounds_to_no_attacker_is_refused():
    """0.1 of 4 clients is 0 attackers: the run went unattacked, its rows saying byzantine_clients 0."""
    with pytest.raises(ConfigError, match=r"^faults\.byzantine\.fraction 0\.1 of 4 clients is 0 attackers .* 0\.125"):
        attackers({"fraction": 0.1, "attack": "sign_flip"}, 4, Seeds(0))
    assert len(attackers({"fraction": 0.125, "attack": "sign_flip"}, 4, Seeds(0))) == 1
    assert len(attackers({"fraction": 0.0, "attack": "sign_flip"}, 4, Seeds(0))) == 0  # none, as asked
    # the fraction the line suggests gives one attacker (rounded down, 0.0714 of 7 clients gave none again)
    with pytest.raises(ConfigError, match=r"give at least 0\.0715 for one attacker"):
        attackers({"fraction": 0.05, "attack": "sign_flip"}, 7, Seeds(0))
    assert len(attackers({"fraction": 0.0715, "attack": "sign_flip"}, 7, Seeds(0))) == 1


@pytest.mark.parametrize(
    ("fraction", "n", "want"),
    [(0.25, 10, 3), (0.35, 10, 4), (0.15, 10, 2), (0.05, 10, 1), (0.07, 50, 4), (0.24, 10, 2)],
)
def test_a_fraction_of_the_clients_rounds_halves_up(fraction, n, want):
    # the documented rule, floor(fraction * N + 1/2), for every half (Python's round took 2.5 to 2 and 0.5 to 0)
    assert len(attackers({"fraction": fraction, "attack": "ipm"}, n, Seeds(0))) == want


def test_backdoor_attackers_stamp_the_trigger_on_their_share_and_label_it_the_target():
    cfg = load({"faults": {"byzantine": {"clients": [1], "attack": "backdoor", "target": 2, "poison_fraction": 0.5}}})
    parts = [np.arange(0, 4), np.arange(4, 12), np.arange(12, 16)]
    x, y = torch.rand(16, 1, 6, 6, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 5
    px, py = poisoned_data(cfg, Seeds(3), x, y, parts, 5)
    changed = np.flatnonzero((px != x).flatten(1).any(1).numpy() | (py != y).numpy())
    chosen = 4 + np.sort(Seeds(3).numpy("poison", 1).permutation(8)[:4])  # half of client 1's 8 samples
    assert np.array_equal(np.union1d(changed, chosen), chosen)  # nothing outside the attacker's chosen rows
    high = float(x.max())
    for i in chosen:
        assert int(py[i]) == 2 and torch.all(px[i, :, -3:, -3:] == high)  # the 3x3 corner at the largest value
        assert torch.equal(px[i, :, :3, :], x[i, :, :3, :])  # and the rest of the image as it was
    assert torch.equal(x, torch.rand(16, 1, 6, 6, generator=torch.Generator().manual_seed(0)))  # untouched


@pytest.mark.parametrize("shape, side", [((16, 1, 6, 6), 6), ((16, 1, 4, 9), 4), ((16, 5), 5)])
def test_a_backdoor_trigger_larger_than_the_sample_is_refused_in_one_line(shape, side):
    """A trigger as large as the sample (or its smaller side) is stamped; a larger one would cover the whole
    sample without saying so: refused, naming the key and the largest size allowed."""
    parts = [np.arange(0, 8), np.arange(8, 16)]
    x, y = torch.rand(*shape, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 5
    ok = load({"faults": {"byzantine": {"clients": [1], "attack": "backdoor", "size": side}}})
    poisoned_data(ok, Seeds(3), x, y, parts, 5)
    bad = load({"faults": {"byzantine": {"clients": [1], "attack": "backdoor", "size": side + 1}}})
    with pytest.raises(ConfigError, match=rf"^faults\.byzantine\.size must be at most {side} for these samples, got "):
        poisoned_data(bad, Seeds(3), x, y, parts, 5)


def test_a_trimmed_mean_warns_once_per_round_shape_not_every_round(caplog):
    agg = TrimmedMean(beta=0.1)
    with caplog.at_level("WARNING", logger="fedweave.robust.aggregators"):
        for _ in range(5):
            agg.check(20, 4)
        agg.check(30, 4)  # another number of updates: its own cut, said once more
    assert [r.getMessage().split(" updates")[0] for r in caplog.records] == [
        "aggregator.beta 0.1 cuts 2 of each end of 20",
        "aggregator.beta 0.1 cuts 3 of each end of 30",
    ]


@pytest.mark.parametrize(
    "algorithm, local",
    [
        ({"name": "fedavg", "clients_per_round": 20}, {"epochs": 1}),
        ({"name": "hier_fedavg", "participation": 1.0}, {}),  # at the hierarchical edge, on its own test set
    ],
    ids=["star", "hierarchical"],
)
def test_a_backdoor_implants_its_trigger_and_norm_bounding_blunts_its_boosted_form(tmp_path, algorithm, local):
    """``test_backdoor_success`` under a backdoor attack, none without one; the boosted trigger is implanted, and
    norm bounding at the server step blunts it."""
    base = {
        "name": "bd", "seed": 0, "rounds": 10, "dataset": "digits",
        "partition": {"name": "iid", "num_clients": 20}, "model": "logistic", "algorithm": algorithm,
        "local": {**local, "batch_size": 16, "lr": 0.1}, "eval": {"every": 10},
        "output": {"progress": False, "plots": False},
    }  # fmt: skip
    attack = {"byzantine": {"fraction": 0.05, "attack": "backdoor", "boost": 10.0}}  # one attacker, boosted
    clean = fedweave.run(base, run_dir=tmp_path / "clean").metrics[-1]
    hit = fedweave.run({**base, "faults": attack}, run_dir=tmp_path / "hit").metrics[-1]
    bounded = fedweave.run({**base, "faults": attack, "aggregator": "norm_bound"}, run_dir=tmp_path / "nb").metrics[-1]
    assert "test_backdoor_success" not in clean
    assert hit["test_backdoor_success"] > 0.8 and hit["test_accuracy"] > 0.8  # the trigger works, the task too
    assert bounded["test_backdoor_success"] < 0.2  # its long update is cut to the median norm


def test_label_flip_attackers_train_on_flipped_labels_in_a_run(toy_config):
    from fedweave.algorithms.base import RunContext, build_algorithm

    cfg = load(_cfg(toy_config, faults={"byzantine": {"clients": [0, 3], "attack": "label_flip"}}))
    ctx = RunContext(cfg)
    algo = build_algorithm(ctx)
    y, got = ctx.dataset.train_y, algo.trainer.train_y.cpu()
    bad = np.concatenate([ctx.partition[0], ctx.partition[3]])
    good = np.setdiff1d(np.arange(len(y)), bad)
    assert torch.equal(got[bad], 3 - y[bad]) and torch.equal(got[good], y[good])  # 4 classes: c -> 3 - c


def test_byzantine_client_ids_take_whole_floats_as_every_integer_key_does():
    # num_clients: 10.0 and rounds: 2.0 are integers; the attackers' ids were the one integer list that refused
    # 2.0. They are written back as ints, so the run, its saved config and a resume see the same numbers.
    cfg = load({"faults": {"byzantine": {"clients": [1.0, 2.0], "attack": "sign_flip"}}})
    ids = cfg.faults.byzantine["clients"]
    assert ids == [1, 2] and all(type(c) is int for c in ids)
    assert attackers(cfg.faults.byzantine, 8, Seeds(0)).tolist() == [1, 2]


def test_stage_replaces_only_the_attackers_rows():
    cfg = load({"faults": {"byzantine": {"clients": [2, 5], "attack": "sign_flip"}}})
    stage = RobustStage(cfg, Seeds(0), 8)
    u = _rows(4, 3)
    out = stage.attack(0, np.array([1, 2, 4, 5]), u, None)
    assert torch.equal(out[[0, 2]], u[[0, 2]]) and torch.equal(out[[1, 3]], -u[[1, 3]])
    x = _rows(1, 3, seed=9)[0]  # rows that are models: the attack acts on y_i - x
    out = stage.attack(0, np.array([1, 2, 4, 5]), u, x)
    torch.testing.assert_close(out[1], x - (u[1] - x))
    assert torch.equal(out[[0, 2]], u[[0, 2]])  # honest models untouched, bit for bit
    assert stage.metrics() == {"byzantine_clients": 2.0}


@pytest.mark.parametrize(
    "aggregator", [{"name": "norm_bound", "bound": 1.0}, {"name": "centered_clipping", "tau": 0.5}]
)
def test_length_measuring_aggregators_see_displacements_when_the_rows_are_models(aggregator):
    """Rows that are models ``x + d_i`` (FedDyn, hier_fedavg): a norm bound or centered clipping reduces the
    displacements ``d_i`` and adds ``x`` back, so a far-off ``x`` changes nothing; the translation-equivariant
    aggregators get the models as before, bit for bit."""
    cfg = load({"aggregator": aggregator})
    d, w = _rows(6, 4), torch.full((6,), 1 / 6, dtype=torch.float64)
    x = torch.full((4,), 100.0, dtype=torch.float64)  # far from zero: the models' norms say nothing of the updates
    on_displacements = RobustStage(cfg, Seeds(0), 6).aggregate(d, w)
    torch.testing.assert_close(RobustStage(cfg, Seeds(0), 6).aggregate(x + d, w, x), x + on_displacements)
    on_models = RobustStage(cfg, Seeds(0), 6).aggregate(x + d, w)  # what the models alone would give
    assert (on_models - (x + on_displacements)).abs().max() > 1.0
    median = RobustStage(load({"aggregator": "median"}), Seeds(0), 6)
    assert torch.equal(median.aggregate(x + d, w, x), median.aggregate(x + d, w))


def test_dnc_draws_from_the_rounds_and_the_peers_own_seeded_streams():
    cfg = load({"aggregator": {"name": "dnc", "b": 2, "niters": 3, "f": 2}})
    u, w = _rows(9, 12, seed=4), _uniform(9)
    u[0] += 1.5
    stage = RobustStage(cfg, Seeds(7), 9)
    stage.at_round(5)
    got = stage.aggregate(u, w)
    assert torch.equal(got, DnC(b=2, niters=3)(u, w, 2, rng=Seeds(7).numpy("robust_aggregator", 5)))
    assert torch.equal(stage.aggregate(u, w), got)  # a function of the seed and the round, not of the calls
    peer = stage.reduce_at_peer(u, w, u[0], peer=3)
    assert torch.equal(peer, DnC(b=2, niters=3)(u, w, 2, rng=Seeds(7).numpy("robust_aggregator", 5, 3)))
    draws = {tuple(stage.aggregate(u, w).tolist()) for stage.round in range(6)}
    assert len(draws) > 1  # other rounds sample other coordinates


# ---- runs ----------------------------------------------------------------------------------------------------


def _cfg(toy_config: dict, **extra) -> dict:
    cfg = {**toy_config, "algorithm": {"name": "fedavg", "clients_per_round": 8}}
    cfg.update(extra)
    return cfg


def _numbers(metrics: list[dict]) -> list[tuple]:
    return [(m["test_accuracy"], m["test_loss"], m["train_loss"]) for m in metrics]


def test_no_attackers_and_the_mean_give_the_clean_run_bit_for_bit(toy_config, tmp_path):
    clean = fedweave.run(_cfg(toy_config), run_dir=tmp_path / "clean")
    zero = fedweave.run(
        _cfg(toy_config, faults={"byzantine": {"fraction": 0.0, "attack": "sign_flip"}}, aggregator="mean"),
        run_dir=tmp_path / "zero",
    )
    assert _numbers(zero.metrics) == _numbers(clean.metrics)
    assert [m["byzantine_clients"] for m in zero.metrics] == [0.0] * 4
    named = fedweave.run(_cfg(toy_config, aggregator={"name": "mean"}), run_dir=tmp_path / "named")
    assert _numbers(named.metrics) == _numbers(clean.metrics)


@pytest.mark.parametrize("method", ["fedadam", "fedmim", "feddyn"])
def test_any_star_method_steps_from_the_robust_aggregate(toy_config, tmp_path, method):
    base = {**_cfg(toy_config), "algorithm": {"name": method, "clients_per_round": 8}, "rounds": 2}
    mean = fedweave.run(base, run_dir=tmp_path / "mean")
    med = fedweave.run({**base, "aggregator": "median"}, run_dir=tmp_path / "median")
    assert _numbers(med.metrics) != _numbers(mean.metrics)
    assert all(math.isfinite(m["test_loss"]) for m in med.metrics)


def test_attack_and_robust_aggregator_runs_are_deterministic_and_resume_identically(toy_config, tmp_path):
    cfg = _cfg(
        toy_config,
        aggregator={"name": "centered_clipping", "tau": 0.5, "bucketing": 2},
        faults={"byzantine": {"fraction": 0.25, "attack": "gaussian", "std": 0.5}},
        output={"progress": False, "plots": False, "checkpoint_every": 1},
    )
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    again = fedweave.run(cfg, run_dir=tmp_path / "again")
    assert _numbers(again.metrics) == _numbers(full.metrics)
    other = fedweave.run({**cfg, "seed": cfg["seed"] + 1}, run_dir=tmp_path / "other")
    assert _numbers(other.metrics) != _numbers(full.metrics)
    fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = resume(tmp_path / "part", ["rounds=4"], progress=False)
    assert _numbers(resumed.metrics) == _numbers(full.metrics)
    ckpt = read_checkpoint(tmp_path / "part" / CHECKPOINT)
    assert "robust" in ckpt["algorithm"]  # the clipping center travels with the checkpoint


def test_a_dnc_run_is_deterministic_and_resumes_bit_for_bit(toy_config, tmp_path):
    cfg = _cfg(
        toy_config,
        aggregator={"name": "dnc", "b": 3, "niters": 3},
        faults={"byzantine": {"fraction": 0.25, "attack": "min_sum"}},
        output={"progress": False, "plots": False, "checkpoint_every": 1},
    )
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    assert _numbers(fedweave.run(cfg, run_dir=tmp_path / "again").metrics) == _numbers(full.metrics)
    assert all(math.isfinite(m["test_loss"]) for m in full.metrics)
    fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = resume(tmp_path / "part", ["rounds=4"], progress=False)
    assert _numbers(resumed.metrics) == _numbers(full.metrics)


def test_hierarchical_averaging_uses_the_aggregator_and_zo_hfl_refuses_it(tmp_path):
    cfg = {
        "name": "h",
        "seed": 0,
        "rounds": 2,
        "precision": "float64",
        "dataset": {"name": "_toy"},
        "partition": {"name": "iid", "num_clients": 8},
        "model": {"name": "logistic"},
        "algorithm": {"name": "hier_fedavg", "participation": 1.0},
        "output": {"progress": False, "plots": False},
    }
    mean = fedweave.run(cfg, run_dir=tmp_path / "mean")
    named = fedweave.run({**cfg, "aggregator": "mean"}, run_dir=tmp_path / "named")
    med = fedweave.run({**cfg, "aggregator": "median"}, run_dir=tmp_path / "median")
    assert _numbers(named.metrics) == _numbers(mean.metrics) != _numbers(med.metrics)
    with pytest.raises(ConfigError, match=r"aggregator: krum: algorithm 'zo_hfl' \(hierarchical family\)"):
        fedweave.run({**cfg, "algorithm": {"name": "zo_hfl"}, "aggregator": "krum"}, run_dir=tmp_path / "zo")
    with pytest.raises(ConfigError, match=r"faults.byzantine: algorithm 'zo_hfl' does not handle"):
        bad = {"algorithm": {"name": "zo_hfl"}, "faults": {"byzantine": {"fraction": 0.2, "attack": "ipm"}}}
        fedweave.run({**cfg, **bad}, run_dir=tmp_path / "b")


# ---- attacks at the hierarchical edge step ---------------------------------------------------------------------


HIER = {
    "name": "h", "seed": 0, "rounds": 3, "precision": "float64", "dataset": {"name": "_toy"},
    "partition": {"name": "iid", "num_clients": 8}, "model": {"name": "logistic"},
    "algorithm": {"name": "hier_fedavg", "participation": 1.0}, "local": {"batch_size": 16, "lr": 0.1},
    "output": {"progress": False, "plots": False},
}  # fmt: skip


def _with(base: dict, **extra) -> dict:
    """A copy of the settings ``base`` with ``extra``'s keys replaced."""
    return copy.deepcopy(base) | extra


@pytest.mark.parametrize("name", ["hier_fedavg", "hier_scaffold"])
def test_no_attackers_at_the_edge_give_the_clean_hierarchical_run_bit_for_bit(tmp_path, name):
    algorithm = {"name": name, "participation": 0.75, "server_data": "client"}
    clean = fedweave.run(_with(HIER, algorithm=algorithm), run_dir=tmp_path / "clean")
    zero = fedweave.run(
        _with(HIER, algorithm=algorithm, faults={"byzantine": {"fraction": 0.0, "attack": "sign_flip"}}),
        run_dir=tmp_path / "zero",
    )
    assert _numbers(zero.metrics) == _numbers(clean.metrics)
    assert [m["byzantine_clients"] for m in zero.metrics] == [0.0] * 3


def _edge_updates(cfg: dict) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, dict]:
    """The first round's edge step of ``cfg``: x before it, the rows it reduced, their jobs, and what its
    reduction got and gave (``weights``, ``mean``)."""
    from fedweave.algorithms.base import RunContext, build_algorithm

    algo = build_algorithm(RunContext(load(cfg)))
    seen = {}
    reduce, attack = algo.aggregate, algo.robust.attack if algo.robust is not None else None

    def aggregate(updates, weights):
        seen["updates"], seen["weights"], seen["mean"] = updates, weights, reduce(updates, weights)
        return seen["mean"]

    def attack_seeing_jobs(r, jobs, updates, center):
        seen["jobs"] = np.asarray(jobs)
        return attack(r, jobs, updates, center)

    algo.aggregate = aggregate
    if attack is not None:
        algo.robust.attack = attack_seeing_jobs
    x = algo.x.clone()
    algo.run_round(0)
    return x, seen["updates"], seen.get("jobs"), seen


@pytest.mark.parametrize("name", ["hier_fedavg", "hier_scaffold"])
def test_an_attack_at_the_edge_replaces_the_attackers_updates_as_defined(name):
    """Sign flip at the edge: an attacker's row is the model ``x - (y_i - x)`` where the method averages models
    (hier_fedavg), its flipped displacement ``-dy_i`` where it averages displacements (hier_scaffold); the
    honest rows and the server's own job are untouched, bit for bit; ALIE sees the edge's honest updates."""
    algorithm = {"name": name, "participation": 1.0, "server_data": "client"}
    x, clean, _, _ = _edge_updates(_with(HIER, algorithm=algorithm))
    byz = {"clients": [1, 6], "attack": "sign_flip"}
    _, got, jobs, seen = _edge_updates(_with(HIER, algorithm=algorithm, faults={"byzantine": byz}))
    assert list(jobs) == [*range(8), 8]  # the 8 clients and the server's own job
    bad, good = [1, 6], [0, 2, 3, 4, 5, 7, 8]
    assert torch.equal(got[good], clean[good])
    if name == "hier_fedavg":  # the edge averages models by sample count
        torch.testing.assert_close(got[bad], x - (clean[bad] - x))
        torch.testing.assert_close(seen["mean"], seen["weights"] @ got)
    else:  # the edge averages the displacements, uniformly
        assert torch.equal(got[bad], -clean[bad])
        torch.testing.assert_close(seen["mean"], got.mean(0))
    assert not torch.allclose(seen["mean"], _edge_updates(_with(HIER, algorithm=algorithm))[3]["mean"])
    alie = {"clients": [1, 6], "attack": "alie", "z": 1.5}
    _, got, _, _ = _edge_updates(_with(HIER, algorithm=algorithm, faults={"byzantine": alie}))
    honest = clean[good] - x if name == "hier_fedavg" else clean[good]
    want = honest.mean(0) - 1.5 * honest.std(0)  # mu - z sigma over the edge's honest rows
    torch.testing.assert_close(got[1] - x if name == "hier_fedavg" else got[1], want)


def test_a_robust_aggregator_at_the_edge_resists_sign_flip(tmp_path):
    """A quarter of the clients send their update flipped and boosted (sign flip, scale 4): the mean at the edge
    is thrown off, the coordinate-wise median stays near the clean run."""
    byz = {"faults": {"byzantine": {"clients": [0, 5], "attack": "sign_flip", "scale": 4.0}}}
    clean = fedweave.run(_with(HIER, rounds=5), run_dir=tmp_path / "clean").metrics[-1]
    mean = fedweave.run(_with(HIER, rounds=5, **byz), run_dir=tmp_path / "mean").metrics[-1]
    med = fedweave.run(_with(HIER, rounds=5, aggregator="median", **byz), run_dir=tmp_path / "med").metrics[-1]
    assert med["test_loss"] < mean["test_loss"]
    assert abs(med["test_loss"] - clean["test_loss"]) < abs(mean["test_loss"] - clean["test_loss"]) / 4
    assert mean["byzantine_clients"] == med["byzantine_clients"] == 2.0


def test_label_flip_attackers_at_the_edge_train_on_flipped_labels():
    from fedweave.algorithms.base import RunContext, build_algorithm

    poisoned = _with(HIER, faults={"byzantine": {"clients": [2], "attack": "label_flip"}})
    algo = build_algorithm(RunContext(load(poisoned)))
    y, got = algo.data.train_y, algo.trainer.train_y.cpu()
    bad = algo.data.parts[2]
    good = np.setdiff1d(np.arange(len(y)), bad)
    assert torch.equal(got[bad], 3 - y[bad]) and torch.equal(got[good], y[good])  # 4 classes: c -> 3 - c


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"name": "choco_sgd"}, "aggregator": "median"}, r"aggregator: median: algorithm 'choco_sgd'"),
        (
            {
                "algorithm": {"name": "dfedavg", "selection": "topk", "select_k": 2},
                "faults": {"byzantine": {"fraction": 0.2, "attack": "ipm"}},
            },
            r"algorithm.selection: 'topk' scores the models the peers send",
        ),
        (
            {"algorithm": {"name": "dfedavg"}, "aggregator": {"name": "median", "bucketing": 2}},
            r"aggregator.bucketing: a peer",
        ),
        ({"aggregator": "krum_x"}, r"unknown aggregator 'krum_x'\. Did you mean 'krum'\?"),
        ({"aggregator": {"name": "trimmed_mean", "beta": 0.7}}, r"aggregator.beta must be in \[0, 0.5\)"),
        ({"aggregator": {"name": "norm_bound", "bound": 0}}, r"aggregator.bound must be > 0 .* or null, got 0"),
        (
            {"faults": {"byzantine": {"fraction": 0.2, "attack": "backdoor", "poison_fraction": 0}}},
            r"faults.byzantine.poison_fraction must be in \(0, 1\], got 0",
        ),
        (
            {"faults": {"byzantine": {"fraction": 0.2, "attack": "backdoor", "target": 99}}},
            r"faults.byzantine.target must be a class, 0..\d+, got 99",
        ),
        ({"aggregator": {"name": "median", "bucketing": 0}}, r"aggregator.bucketing must be a whole number >= 1"),
        ({"aggregator": {"name": "krum", "q": 1}}, r"unknown key 'aggregator.q'"),
        ({"faults": {"byzantine": {"fraction": 1.2, "attack": "ipm"}}}, r"faults.byzantine.fraction must be"),
        ({"faults": {"byzantine": {"fraction": 0.1, "clients": [1], "attack": "ipm"}}}, r"exactly one of fraction"),
        ({"faults": {"byzantine": {"fraction": 0.1}}}, r"faults.byzantine.attack must be an attack's name"),
        ({"faults": {"byzantine": {"fraction": 0.1, "attack": "alie", "zz": 1}}}, r"unknown key 'faults.byzantine.zz'"),
        ({"faults": {"byzantine": {"clients": [99], "attack": "ipm"}}}, r"faults.byzantine.clients names client 99"),
        (
            {"faults": {"byzantine": {"clients": [1.5], "attack": "ipm"}}},
            r"^faults\.byzantine\.clients\[0\] must be an integer, got 1\.5$",
        ),
        (
            {"faults": {"byzantine": {"clients": [0, True], "attack": "ipm"}}},
            r"^faults\.byzantine\.clients\[1\] must be an integer, got True$",
        ),
        (
            {"faults": {"byzantine": {"clients": [-1.0], "attack": "ipm"}}},
            r"^faults\.byzantine\.clients\[0\] must be a client id \(an integer >= 0\), got -1$",
        ),
        (
            {"faults": {"byzantine": {"clients": [1, 1.0], "attack": "ipm"}}},
            r"^faults\.byzantine\.clients must hold distinct client ids, got 1 twice in \[1, 1\.0\]$",
        ),
        ({"aggregator": "bulyan", "faults": {"byzantine": {"fraction": 0.25, "attack": "ipm"}}}, r"'bulyan' needs at"),
    ],
)
def test_bad_robustness_input_is_one_line(toy_config, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message) as e:
        fedweave.run(_cfg(toy_config, **change), run_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r" / "metrics.csv").exists()


def test_list_shows_aggregators_and_attacks(capsys):
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "aggregators: bulyan, centered_clipping, dnc, geometric_median, krum, mean, median" in out
    assert "attacks: alie, backdoor, gaussian, ipm, label_flip, min_max, min_sum, scaled, sign_flip" in out


# ---- docs/robustness.md ------------------------------------------------------------------------------------


def test_privacy_with_a_robust_aggregator_is_refused_as_the_page_says(tmp_path):
    # the page listed DP among the stages that compose with every aggregator; a robust aggregator with privacy
    # is refused (DP's guarantee is the noised sum's), and the page now says so
    from pathlib import Path

    data = {"seed": 0, "rounds": 1, "dataset": "digits", "partition": {"name": "iid", "num_clients": 10},
            "model": "logistic", "algorithm": {"name": "fedavg", "clients_per_round": 10},
            "aggregator": "median", "privacy": {"clip": 1.0, "noise_multiplier": 0.5},
            "output": {"dir": str(tmp_path / "run"), "plots": False, "progress": False}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^aggregator: median and privacy both decide") as e:
        fedweave.run(data)
    assert "\n" not in str(e.value)
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "robustness.md").read_text().split())
    assert "With the other server stages (compression, DP) in the agreed order above." not in page
    assert "a non-default `aggregator` with `privacy` is refused in one line" in page


def test_the_committed_table_rebuilds_from_the_committed_records_byte_for_byte(tmp_path):
    from pathlib import Path

    from fedweave.robust.report import main, read_records, table

    docs = Path(__file__).resolve().parents[1] / "docs"
    rows = read_records(docs / "robustness" / "records.csv")
    committed = (docs / "robustness" / "table.md").read_text()
    assert table(rows) == committed
    assert main(["--records", str(docs / "robustness" / "records.csv"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "table.md").read_text() == committed and (tmp_path / "accuracy.png").stat().st_size > 0
    assert committed in (docs / "robustness.md").read_text()  # the page shows the table it was built from
    # every aggregator and attack of the registries is in the records, 3 seeds each
    assert {r["aggregator"] for r in rows} == set(AGGREGATORS.names()) - {"multi_krum"}
    assert {r["attack"] for r in rows} - {"none"} == set(ATTACKS.names())
    assert {r["seed"] for r in rows} == {"0", "1", "2"}


def test_a_cell_of_the_committed_gossip_grid_runs_again_to_its_record(tmp_path):
    """The median against Gaussian noise from 20 % of the peers, seed 0, run again from the committed sweep
    file: the final accuracy of its record, to the last digit."""
    from pathlib import Path

    import yaml

    from fedweave.robust.report import read_records

    folder = Path(__file__).resolve().parents[1] / "docs" / "robustness" / "gossip"
    cfg = yaml.safe_load((folder / "attacked.yaml").read_text())
    del cfg["sweep"]
    cfg |= {
        "seed": 0,
        "aggregator": {"name": "median"},
        "faults": {"byzantine": {"attack": "gaussian", "fraction": 0.2}},
    }
    (record,) = [
        r
        for r in read_records(folder / "records.csv")
        if (r["aggregator"], r["attack"], r["fraction"], r["seed"]) == ("median", "gaussian", "0.2", "0")
    ]
    final = fedweave.run(cfg, run_dir=tmp_path / "again").metrics[-1]
    assert repr(final["test_accuracy"]) == record["final_test_accuracy"]


def test_the_committed_gossip_table_rebuilds_from_its_records_and_is_on_the_page(tmp_path):
    from pathlib import Path

    from fedweave.robust.report import main, read_records, table

    docs = Path(__file__).resolve().parents[1] / "docs"
    folder = docs / "robustness" / "gossip"
    rows = read_records(folder / "records.csv")
    committed = (folder / "table.md").read_text()
    assert table(rows) == committed
    assert main(["--records", str(folder / "records.csv"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "table.md").read_text() == committed
    assert committed in (docs / "robustness.md").read_text()
    # every attack, every aggregator whose bound a peer's 9 rows allow, 3 seeds each
    assert {r["aggregator"] for r in rows} == set(AGGREGATORS.names()) - {"multi_krum", "bulyan"}
    assert {r["attack"] for r in rows} - {"none"} == set(ATTACKS.names())
    assert {r["seed"] for r in rows} == {"0", "1", "2"}


def test_bad_robustness_input_on_the_command_line_is_one_error_line(toy_config, tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cfg(toy_config, aggregator={"name": "krum", "f": 4})))
    assert cli_main(["run", str(path), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fedweave: error: aggregator 'krum' needs at least 11 client updates per round against f = 4 Byzantine ones "
        "(got 8); lower aggregator.f, give each reduction more updates (algorithm.clients_per_round, the sampler's "
        "clients, fedbuff's buffer_size) or choose another aggregator"
    ]


def test_a_round_that_dropouts_leave_below_the_bound_stops_the_run_with_one_line(toy_config, tmp_path):
    cfg = _cfg(toy_config, aggregator={"name": "krum", "f": 2}, faults={"dropout": 0.5})  # n >= 7 of 8 needed
    with pytest.raises(ConfigError, match=r"^aggregator 'krum' needs at least 7 client updates .* \(got [0-6]\)"):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    # recorded as a failed run with its error (a report and a sweep read it so), not left like a killed one
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("ConfigError: aggregator 'krum' needs")


# ---- Byzantine peers in gossip -----------------------------------------------------------------------------------


GOSSIP = {  # the settings of the committed gossip grid (docs/robustness/gossip/clean.yaml)
    "name": "rg", "seed": 0, "rounds": 15, "dataset": "digits", "partition": {"name": "iid", "num_clients": 20},
    "model": "logistic", "algorithm": {"name": "dfedavg", "neighbours": 8, "finetune_epochs": 0},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.1}, "eval": {"every": 15},
    "output": {"progress": False, "plots": False},
}  # fmt: skip


@pytest.mark.parametrize("mixing", ["sampled", "metropolis"])
def test_no_byzantine_peers_give_the_clean_gossip_run_bit_for_bit(tmp_path, mixing):
    algorithm = {"name": "dfedavg", "mixing": mixing, "topology": "random_regular", "degree": 4, "finetune_epochs": 0}
    clean = fedweave.run(_with(GOSSIP, algorithm=algorithm, rounds=3, eval={"every": 1}), run_dir=tmp_path / "clean")
    zero = fedweave.run(
        _with(
            GOSSIP,
            algorithm=algorithm,
            rounds=3,
            eval={"every": 1},
            faults={"byzantine": {"fraction": 0.0, "attack": "ipm"}},
        ),
        run_dir=tmp_path / "zero",
    )
    assert _numbers(zero.metrics) == _numbers(clean.metrics)
    assert [m["byzantine_clients"] for m in zero.metrics] == [0.0] * 3


def test_clipped_gossip_clips_around_the_peers_own_model_afresh_at_every_peer():
    """centered_clipping at a peer is ClippedGossip: ``x_i + sum_j w_j clip(x_j - x_i, tau)`` (its own row
    first, moving it nothing), whatever the peer before it reduced."""
    stage = RobustStage(load({"aggregator": {"name": "centered_clipping", "tau": 0.5}}), Seeds(0), 6)
    own, rows = _rows(1, 4, seed=3)[0], _rows(4, 4)
    rows[0] = own
    w = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=F64)
    diff = rows - own
    want = own + (w[:, None] * diff * (0.5 / diff.norm(dim=1)).clamp(max=1.0).nan_to_num(1.0)[:, None]).sum(0)
    torch.testing.assert_close(stage.reduce_at_peer(rows, w, own), want)
    stage.reduce_at_peer(_rows(4, 4, seed=7), w, own + 5)  # another peer in between
    torch.testing.assert_close(stage.reduce_at_peer(rows, w, own), want)


METROPOLIS = {
    "name": "dfedavg",
    "mixing": "metropolis",
    "topology": "random_regular",
    "degree": 6,
    "finetune_epochs": 0,
}


@pytest.mark.parametrize("algorithm", [copy.deepcopy(GOSSIP)["algorithm"], METROPOLIS], ids=["sampled", "metropolis"])
def test_robust_gossip_survives_byzantine_peers_that_break_plain_gossip(tmp_path, algorithm):
    """Four of 20 peers send their model plus Gaussian noise (std 10) to every neighbour that takes their
    message (8 sampled of all, or every neighbour of a 6-regular graph with Metropolis weights): plain DFedAvg
    collapses, a coordinate-wise median or ClippedGossip at each peer keeps the clean accuracy. The accuracy is
    the honest peers' (an attacker's own model is not what the run learns)."""
    attack = {"byzantine": {"fraction": 0.2, "attack": "gaussian", "std": 10.0}}
    clean = fedweave.run(_with(GOSSIP, algorithm=algorithm), run_dir=tmp_path / "clean").metrics[-1]["test_accuracy"]
    runs = {"hit": {}, "median": {"aggregator": "median"}}
    runs["clipped"] = {"aggregator": {"name": "centered_clipping", "tau": 1.0}}
    acc = {
        k: fedweave.run(_with(GOSSIP, algorithm=algorithm, faults=attack, **v), run_dir=tmp_path / k).metrics[-1]
        for k, v in runs.items()
    }
    assert clean > 0.9 and acc["hit"]["test_accuracy"] < 0.5
    assert acc["median"]["test_accuracy"] > clean - 0.02 and acc["clipped"]["test_accuracy"] > clean - 0.02
    assert acc["hit"]["byzantine_clients"] == 4.0


def test_gossip_evaluation_reads_the_honest_peers_only():
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.execution import evaluate_clients

    cfg = load(_with(GOSSIP, faults={"byzantine": {"clients": [0, 3], "attack": "gaussian"}}))
    ctx = RunContext(cfg)
    algo = build_algorithm(ctx)
    honest = np.setdiff1d(np.arange(20), [0, 3])
    assert np.array_equal(algo.evaluated_clients(), honest)
    algo.commit("model", algo.W.clone().index_fill_(0, torch.tensor([0, 3]), 0.0))  # the attackers' own rows
    tx, ty, parts = ctx.personal_test_set(None)
    accs, _ = evaluate_clients(algo.layout, algo.W[honest], tx, ty, [parts[k] for k in honest], cfg.eval.batch_size)
    assert algo.evaluate(0)["test_accuracy"] == pytest.approx(float(accs.mean()), abs=0)


def test_a_backdoor_among_gossip_peers_is_scored_on_the_honest_peers_models(tmp_path):
    """Two of 20 peers train on triggered samples and send boosted messages: ``test_backdoor_success`` (the mean
    over the honest peers' models) is high with the plain weighted sum and near 0 with a median at each peer;
    a run without the attack reports none."""
    attack = {"byzantine": {"fraction": 0.1, "attack": "backdoor", "boost": 10.0}}
    clean = fedweave.run(copy.deepcopy(GOSSIP), run_dir=tmp_path / "clean").metrics[-1]
    hit = fedweave.run(_with(GOSSIP, faults=attack), run_dir=tmp_path / "hit").metrics[-1]
    median = fedweave.run(_with(GOSSIP, faults=attack, aggregator="median"), run_dir=tmp_path / "median").metrics[-1]
    assert "test_backdoor_success" not in clean
    assert hit["test_backdoor_success"] > 0.5 and median["test_backdoor_success"] < 0.2
    assert median["test_accuracy"] > clean["test_accuracy"] - 0.02


# ---- the build-time bound against the sampler's own count (fixed, schedule) ----------------------------------
KRUM_F2 = {"name": "krum", "f": 2}  # n > 2f + 2: at least 7 updates per round


def _krum_line(n: int) -> str:
    """The line a round of ``n`` updates gets from Krum with f = 2, in the round itself."""
    with pytest.raises(ConfigError) as e:
        Krum()(_rows(n, 3), _uniform(n), 2)
    return str(e.value)


@pytest.mark.parametrize(
    "sampler,got",
    [
        ({"name": "schedule", "clients": [list(range(8))] * 3 + [list(range(6))]}, 6),  # round 3 takes 6
        ({"name": "fixed", "clients": [0, 1, 2, 3, 4]}, 5),
    ],
)
def test_a_sampler_that_gives_too_few_updates_is_refused_before_round_0_with_the_rounds_line(
    toy_config, tmp_path, sampler, got
):
    """The bound is checked against the fewest clients the sampler gives (before: against clients_per_round = 8,
    so the run started and stopped in the round that took too few, with the same line)."""
    cfg = _cfg(toy_config, aggregator=KRUM_F2, sampler=sampler)
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert str(e.value) == _krum_line(got) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_every_round_size_is_checked_where_the_bound_is_not_monotone_in_it():
    """With f a share of the round's count rounded up, the bound is not monotone in the count: Bulyan with a
    fifth of 20 clients as attackers passes a round of 15 (f = 3, 4f + 3 = 15) and fails one of 16 (f = 4: 19).
    Every count is checked (before: only the fewest, so a schedule of 15 and 16 started and stopped mid-run)."""
    from fedweave.robust.stage import build

    cfg = load({"aggregator": "bulyan", "faults": {"byzantine": {"fraction": 0.2, "attack": "ipm"}}})
    assert build(cfg, Seeds(0), 20, [15]) is not None
    with pytest.raises(ConfigError, match=r"^aggregator 'bulyan' needs at least 19 .* f = 4 .*\(got 16\)"):
        build(cfg, Seeds(0), 20, [16, 15])


def test_a_schedule_with_one_round_size_beyond_the_bound_is_refused_before_round_0(toy_config, tmp_path):
    """The toy's 12 clients, 4 of them attackers (0.34): Krum (n > 2f + 2, f = ceil(n/3)) takes a round of 9
    (f = 3) but not one of 10 (f = 4); a schedule of 9 and 10 is refused up front with the 10's line."""
    sampler = {"name": "schedule", "clients": [list(range(9)), list(range(10))]}
    byz = {"byzantine": {"fraction": 0.34, "attack": "sign_flip"}}
    cfg = _cfg(toy_config, aggregator="krum", sampler=sampler, faults=byz)
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert str(e.value).startswith("aggregator 'krum' needs at least 11 client updates per round against f = 4")
    assert "(got 10)" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "sampler",
    [
        {"name": "fixed", "clients": 8},
        {"name": "schedule", "clients": [list(range(8)), list(range(4, 12))]},
        {"name": "schedule", "clients": [list(range(8)), list(range(1, 9)), [0, 1]]},  # the short entry is unused
    ],
)
def test_a_sampler_that_gives_enough_updates_is_not_refused(toy_config, tmp_path, sampler):
    """clients_per_round (4) is below Krum's bound, but the sampler gives 8 in every one of the run's rounds
    (before: refused, for a count the run never reduced)."""
    cfg = {**_cfg(toy_config, aggregator=KRUM_F2, sampler=sampler), "rounds": 2}
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 4}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert len(res.metrics) == 2 and res.summary["status"] == "completed"


def test_the_hierarchical_bound_is_checked_against_the_samplers_own_count(tmp_path):
    """hier_fedavg likewise: the fewest clients its sampler gives, not participation * clients."""
    few = _with(HIER, aggregator=KRUM_F2, sampler={"name": "fixed", "clients": [0, 1, 2, 3, 4]})
    with pytest.raises(ConfigError) as e:
        fedweave.run(few, run_dir=tmp_path / "few")
    assert str(e.value) == _krum_line(5) and not (tmp_path / "few").exists()
    enough = _with(HIER, aggregator=KRUM_F2, sampler={"name": "fixed", "clients": 8}, rounds=1)
    enough["algorithm"] = {"name": "hier_fedavg", "participation": 0.5}  # 4 of 8: below the bound
    assert fedweave.run(enough, run_dir=tmp_path / "enough").summary["status"] == "completed"


def test_a_gossip_attack_counts_the_receivers_own_row_among_the_updates_reduced(tmp_path, monkeypatch):
    """A peer reduces its own model beside the 8 messages it receives, so the attacks' ``n`` (ALIE's
    ``s = floor(n/2 + 1) - f``, model replacement's boost ``n``) is 9, the rows its aggregator sees: a scaled
    attacker's boosted displacement, weighted 1/9, then replaces the peer's mean (Bagdasaryan et al., eq. 3)."""
    from fedweave.robust.attacks import Scaled

    seen_n, reduced = [], []
    call, reduce = Scaled.__call__, RobustStage.reduce_at_peer

    def spy_call(self, own, honest, info):
        seen_n.append(info.n)
        return call(self, own, honest, info)

    def spy_reduce(self, rows, weights, own, peer=None):
        reduced.append(len(rows))
        return reduce(self, rows, weights, own, peer)

    monkeypatch.setattr(Scaled, "__call__", spy_call)
    monkeypatch.setattr(RobustStage, "reduce_at_peer", spy_reduce)
    cfg = _with(GOSSIP, rounds=1, aggregator={"name": "median"})
    fedweave.run(cfg | {"faults": {"byzantine": {"attack": "scaled", "fraction": 0.2}}}, run_dir=tmp_path / "r")
    assert seen_n and set(seen_n) == set(reduced) == {9}


@pytest.mark.parametrize("name", ["mean", "median", "geometric_median", "centered_clipping", "norm_bound"])
def test_aggregator_f_is_refused_where_the_aggregator_reads_no_byzantine_count(toy_config, tmp_path, name):
    # f sets what krum, bulyan, dnc and the trimmed mean cut; these reductions have no such count, and f: 3 was
    # accepted and changed nothing (the run was the one without it)
    cfg = {**toy_config, "aggregator": {"name": name, "f": 1}}
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    msg = str(e.value)
    assert msg.startswith(f"aggregator.f: aggregator '{name}' reads no Byzantine count") and "\n" not in msg
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["trimmed_mean", "krum", "multi_krum", "bulyan", "dnc"])
def test_aggregator_f_is_taken_where_the_aggregator_reads_it(toy_config, name):
    from fedweave.registry import ALGORITHMS
    from fedweave.robust.stage import check

    check(load({**toy_config, "aggregator": {"name": name, "f": 1}}), ALGORITHMS.get("fedavg"))  # no ConfigError


def test_krum_distances_formed_in_blocks_equal_the_whole_differences():
    # models of millions of parameters form the differences a block of rows at a time, not as a second copy of
    # every update: the distances, and so Krum's picks and ties, are those of the differences formed whole
    from fedweave.robust.aggregators import _sq_dists

    torch.manual_seed(0)
    updates = torch.randn(7, 3_000_000)  # 5 rows a block
    whole = torch.stack([(updates - row).pow(2).sum(1) for row in updates])
    assert torch.equal(_sq_dists(updates), whole)


def test_the_robustness_report_never_writes_into_a_folder_of_the_users(tmp_path, capsys):
    from pathlib import Path

    from fedweave.robust.report import main

    records = Path(__file__).resolve().parents[1] / "docs" / "robustness" / "records.csv"
    users = tmp_path / "mine"
    users.mkdir()
    (users / "table.md").write_text("my notes\n")
    with pytest.raises(SystemExit):
        main(["--records", str(records), "--out", str(users)])
    assert "--out" in capsys.readouterr().err and (users / "table.md").read_text() == "my notes\n"
    assert not (users / "accuracy.png").exists()
    # an earlier report's folder (its records.csv) and a new one are written
    assert main(["--records", str(records), "--out", str(tmp_path / "new")]) == 0
    assert main(["--records", str(records), "--out", str(tmp_path / "new")]) == 0
