"""The confederated edge servers ask the run's sampler for their users when the config names one (DESIGN
principle 11); the default keeps the family's own vectorised uniform draw (spec A13)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load

# the spec's small configuration (tests/test_confederated.py): N=6 servers, P=5 users, synthetic data
_ALGO = {"num_servers": 6, "users_per_server": 5, "batch_size": 2, "graph_seed": 3, "sample_rate": 0.4}
_DATA = {"name": "cfl_logreg", "num_samples": 300, "dim": 20, "seed": 1}


def _make(name: str = "gt_saga", sampler: dict | None = None):
    cfg = {"seed": 0, "rounds": 4, "dataset": _DATA, "algorithm": {"name": name, **_ALGO}}
    return build_algorithm(RunContext(load({**cfg, **({"sampler": sampler} if sampler else {})})))


def test_default_and_explicit_uniform_keep_the_vectorised_draw():
    default, uniform = _make(), _make(sampler={"name": "uniform"})
    for k in range(4):
        keys = np.random.Generator(np.random.PCG64(default.seeds.sequence("user_selection", k))).random((6, 5))
        want = np.sort(np.argsort(keys, axis=1)[:, :2], axis=1)
        assert default.select_users(k, 2).tolist() == want.tolist()
        assert torch.equal(default.select_users(k, 2), uniform.select_users(k, 2))


@pytest.mark.parametrize("name", ["gt_saga", "gt_svrg", "cfl_admm"])
def test_every_edge_server_follows_a_schedule_through_whole_rounds(name):
    algo = _make(name, {"name": "schedule", "clients": [[0, 4], [1, 2], [3, 0], [2, 1]]})
    assert algo.select_users(2, 2).tolist() == [[0, 3]] * 6
    assert algo.select_users(5, 2).tolist() == [[1, 2]] * 6  # cycled
    for r in range(4):
        algo.run_round(r)
    assert np.isfinite(algo.opt_gap())


def test_fixed_users_every_iteration():
    algo = _make(sampler={"name": "fixed"})  # the first m = 2 users of every server
    assert all(algo.select_users(k, 2).tolist() == [[0, 1]] * 6 for k in range(3))
    listed = _make(sampler={"name": "fixed", "clients": [4, 2]})
    assert listed.select_users(0, 2).tolist() == [[2, 4]] * 6


def test_a_sampler_must_pick_m_users_per_server(tmp_path):
    # iteration 0 is drawn when the method is built: before, the first iteration found it, the run directory
    # (config.yaml, a failed summary.json) written, and a retry into it needed --overwrite
    with pytest.raises(ConfigError, match=r"picked 3 users of edge server 0 at iteration 0; .* exactly m = 2"):
        _make(sampler={"name": "fixed", "clients": 3})
    import fedweave

    cfg = {"seed": 0, "rounds": 1, "dataset": _DATA, "algorithm": {"name": "gt_svrg", **_ALGO}}
    with pytest.raises(ConfigError, match=r"picked 3 users of edge server 0 at iteration 0"):
        fedweave.run({**cfg, "sampler": {"name": "fixed", "clients": [0, 1, 2]}}, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match=r"picked \d users of edge server \d at iteration \d+"):
        algo = _make(sampler={"name": "bernoulli"})  # a random number of users: some server soon differs from m
        for k in range(50):
            algo.select_users(k, 2)


def test_a_sampler_that_reads_the_clients_context_is_refused_in_one_line():
    from test_tasks import _register_context_samplers

    _register_context_samplers()
    with pytest.raises(ConfigError, match="which the confederated family does not give") as e:
        _make(sampler={"name": "_power_of_choice"}).select_users(0, 2)
    assert "\n" not in str(e.value)


def test_a_method_that_draws_no_users_refuses_a_sampler_and_a_sample_rate():
    """CFL-SAGA's users all check their trigger every iteration, and GT-SAGA's Algorithm 1 has no users: a sampler
    section (or GT-SAGA's sample_rate) would be ignored, so it is refused in one line (before: silently unread)."""
    system = {k: v for k, v in _ALGO.items() if k != "sample_rate"}

    def make(sampler: dict | None = None, **algo):
        cfg = {"seed": 0, "rounds": 4, "dataset": _DATA, "algorithm": {**system, **algo}}
        return build_algorithm(RunContext(load({**cfg, **({"sampler": sampler} if sampler else {})})))

    with pytest.raises(ConfigError, match=r"^sampler: cfl_saga draws no users: every user checks its trigger"):
        make({"name": "fixed"}, name="cfl_saga")
    with pytest.raises(ConfigError, match=r"^sampler: gt_saga with mode 'decentralized' draws no users"):
        make({"name": "fixed"}, name="gt_saga", mode="decentralized")
    with pytest.raises(ConfigError, match=r"^algorithm.sample_rate: gt_saga with mode 'decentralized' selects no"):
        make(name="gt_saga", mode="decentralized", sample_rate=0.4)
    make(name="cfl_saga"), make(name="gt_saga", mode="decentralized")  # without either: accepted
    make({"name": "uniform"}, name="cfl_saga")  # the default section names no sampler


@pytest.mark.parametrize("name", ["gt_svrg", "gt_sarah"])
def test_inner_loop_1_refuses_a_sample_rate_and_a_sampler(name):
    """With inner_loop 1 every iteration of GT-SVRG / GT-SARAH is a snapshot (all users upload), so sample_rate
    and a sampler section were accepted and never read (before: silently ignored); refused in one line."""
    system = {k: v for k, v in _ALGO.items() if k != "sample_rate"}

    def make(sampler: dict | None = None, **algo):
        cfg = {"seed": 0, "rounds": 2, "dataset": _DATA, "algorithm": {**system, "name": name, **algo}}
        return build_algorithm(RunContext(load({**cfg, **({"sampler": sampler} if sampler else {})})))

    with pytest.raises(ConfigError, match=r"^algorithm.sample_rate: with inner_loop 1 every iteration is a snapshot"):
        make(inner_loop=1, sample_rate=0.4)
    with pytest.raises(ConfigError, match=rf"^sampler: {name} with inner_loop 1 draws no users"):
        make({"name": "fixed"}, inner_loop=1)
    make(inner_loop=1), make(inner_loop=1, sample_rate=0.15)  # left out, or written out as the default: accepted
    make(inner_loop=2, sample_rate=0.4)  # read by the inner iterations


def test_a_schedule_without_cycling_must_cover_every_iteration():
    """The edge servers ask the sampler every iteration k, not every round: a schedule of 2 entries with cycle
    false was accepted for 2 rounds of 3 iterations and silently cycled over the 6 iterations."""
    plan = {"name": "schedule", "clients": [[0, 1], [2, 3]], "cycle": False}
    cfg = {"seed": 0, "rounds": 2, "dataset": _DATA, "sampler": plan}
    with pytest.raises(
        ConfigError,
        match=r"^sampler: the schedule has 2 iterations but the run has 6 = rounds x algorithm.iterations_per_round",
    ):
        build_algorithm(RunContext(load({**cfg, "algorithm": {"name": "gt_saga", **_ALGO, "iterations_per_round": 3}})))
    algo = build_algorithm(RunContext(load({**cfg, "algorithm": {"name": "gt_saga", **_ALGO}})))  # 2 x 1: covered
    for r in range(2):
        algo.run_round(r)
    assert algo.k == 2
