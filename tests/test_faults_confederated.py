"""Injected faults in the confederated family (docs/reliability.md): user dropout, servers that miss rounds,
lost server links. Convergence under faults, frozen servers, the tracking invariant under W_r, exact ledger
counts from the fault decisions, skipped rounds, refusals and resume."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import yaml

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.faults import Faults
from fedweave.runner import resume
from fedweave.seeding import Seeds

SMALL = {"num_servers": 6, "users_per_server": 5, "batch_size": 2, "graph_seed": 3}
DATA = {"name": "cfl_logreg", "num_samples": 300, "dim": 20, "seed": 1}
ALL = {"dropout": 0.2, "server_miss": 0.1, "link_loss": 0.1}
METHODS = [
    ("cfl_saga", {"rho": 1e3}),
    ("gt_saga", {"sample_rate": 0.4}),
    ("gt_svrg", {"inner_loop": 20}),
    ("gt_sarah", {"inner_loop": 20}),
    ("cfl_admm", {"local_gradient": "full", "beta_scale": 2.0}),  # the deterministic-user variant reaches x*
]
torch.set_num_threads(1)


def config(name: str, faults: dict, seed: int = 0, **opts):
    return load({"seed": seed, "dataset": DATA, "algorithm": {"name": name, **SMALL, **opts}, "faults": faults})


def make(name: str, faults: dict, seed: int = 0, **opts):
    return build_algorithm(RunContext(config(name, faults, seed, **opts)))


# ---- convergence -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "opts"), METHODS)
def test_converges_under_dropout_server_misses_and_lost_links(name, opts):
    algo = make(name, ALL, **opts)
    gaps, reported = [], []
    for r in range(400):
        m = algo.run_round(r)
        reported.append(m["reported_clients"])
        gaps.append(algo.opt_gap())
    assert gaps[-1] < 1e-3 * gaps[0]  # three orders of magnitude in 400 iterations, with 20% of users dropping
    assert 0.6 < np.mean(reported) / 30 < 0.8  # E = 0.8 * 0.9 of the 30 users take part


# ---- what a fault does to the state ----------------------------------------------------------------------
@pytest.mark.parametrize(("name", "opts"), METHODS[:4])
def test_missing_server_is_frozen_and_tracking_invariant_holds(name, opts):
    """A server that misses the round keeps x_i, y_i, g_i; W_r is symmetric doubly stochastic, so
    mean(y) = mean(g) (eq. 84) still holds after every round."""
    algo = make(name, {"dropout": 0.2, "server_miss": 0.3, "link_loss": 0.2}, **opts)
    down_seen = 0
    for r in range(40):
        before = [t.clone() for t in (algo.X, algo.Y, algo.G)]
        algo.run_round(r)
        w, down = algo.W_r.numpy(), ~algo.server_on
        assert np.allclose(w, w.T, atol=0) and np.allclose(w.sum(1), 1, atol=1e-15) and (w >= 0).all()
        for now, old in zip((algo.X, algo.Y, algo.G), before):
            assert torch.equal(now[down], old[down])
        assert torch.allclose(algo.Y.mean(0), algo.G.mean(0), atol=1e-10)
        down_seen += int(down.sum())
    assert down_seen > 20


def test_cfl_saga_dropped_users_keep_their_table_and_copy():
    algo = make("cfl_saga", {"dropout": 0.3, "server_miss": 0.2}, rho=0.0)  # rho = 0: every user that can fires
    pb = algo.problem
    for r in range(15):
        table, held = algo.table.clone().view(pb.N, pb.P, -1), algo.held.clone()
        m = algo.run_round(r)
        off = ~algo.user_on
        assert torch.equal(algo.table.view(pb.N, pb.P, -1)[off], table[off])
        assert torch.equal(algo.held[off], held[off])
        assert not torch.equal(algo.held[~off], held[~off])  # the others uploaded a fresh estimate
        assert torch.equal(algo.G, algo.held.sum(1))  # eq. (18) over the copies the server holds
        assert m["uploads_per_iteration"] == int(algo.user_on.sum())
        # the table sum stays the sum of the table (a dropped user's entries and the server's sum agree)
        assert torch.allclose(algo.table_sum, algo.table.view(pb.N, pb.P, pb.S, pb.d).sum(2), atol=1e-12)


def test_gt_saga_table_sum_stays_consistent_under_dropout():
    algo = make("gt_saga", ALL, sample_rate=0.6)
    pb = algo.problem
    for r in range(30):
        algo.run_round(r)
        assert torch.allclose(algo.table_sum, algo.table.view(pb.N, pb.P * pb.S, pb.d).sum(1), atol=1e-10)


def test_svrg_control_variate_stays_exact_and_snapshots_are_retried():
    algo = make("gt_svrg", {"dropout": 0.2, "server_miss": 0.1}, inner_loop=10)
    pb, retried = algo.problem, 0
    for r in range(40):
        algo.run_round(r)
        ok = algo.anchored & ~algo.due
        assert torch.allclose(algo.mu[ok], pb.server_grad(algo.anchor)[ok], atol=1e-10)  # mu_i = grad f_i(tau_i)
        retried += int(algo.due.sum())
    assert retried > 0 and bool(algo.anchored.all())


def test_admm_frozen_servers_dropped_users_and_dual_sum():
    algo = make("cfl_admm", {"dropout": 0.3, "server_miss": 0.3, "link_loss": 0.2})
    for r in range(30):
        z, gamma, xu, lam = algo.X.clone(), algo.gamma.clone(), algo.xu.clone(), algo.lam.clone()
        algo.run_round(r)
        down, off = ~algo.server_on, ~algo.user_on
        assert torch.equal(algo.X[down], z[down]) and torch.equal(algo.gamma[down], gamma[down])
        assert torch.equal(algo.xu[off], xu[off]) and torch.equal(algo.lam[off], lam[off])
        assert algo.gamma.sum(0).abs().max() < 1e-9 * (1 + algo.gamma.abs().max())  # sum_i gamma_i = 0 (A_r symmetric)


# ---- the ledger counts only what was delivered -----------------------------------------------------------
def test_ledger_counts_follow_the_fault_decisions_exactly():
    rounds = 25
    algo = make("gt_saga", ALL, sample_rate=0.4)
    pb, m, vb = algo.problem, algo.m, algo.vector_bytes
    f = Faults(algo.config.faults, Seeds(0))  # an independent instance: decisions are pure functions
    idx = np.arange(pb.N)
    up_users = down_bcast = links = 0
    for r in range(rounds):
        algo.run_round(r)
        up = f.servers_up(r, idx)
        dropped = f.dropped(r, np.arange(pb.N * pb.P)).reshape(pb.N, pb.P)
        alive = torch.from_numpy(~dropped & up[:, None])
        up_users += int(alive.gather(1, algo.select_users(r, m)).sum())  # selected, not dropped, server up
        down_bcast += int(up.sum()) * m
        lk = f.links_up(r, idx[:, None], idx[None, :]) & up[:, None] & up[None, :] & algo.net.adjacency
        links += int(np.triu(lk, 1).sum())
    led = algo.ledger
    assert algo.uploads == led.count(sender="user", receiver="edge") == up_users
    assert led.bytes(sender="user", receiver="edge") == up_users * vb
    assert led.count(sender="edge", receiver="user") == down_bcast  # a user that drops still got the model
    assert led.count(sender="edge", receiver="edge") == 2 * 2 * links  # x and y, both directions, surviving links
    assert led.bytes(sender="edge", receiver="edge") == 4 * links * vb
    assert up_users < rounds * pb.N * m and links < rounds * algo.net.num_edges  # faults did remove traffic


def test_no_faults_and_zero_rates_give_the_same_numbers():
    a, b = make("cfl_saga", {}, rho=1e3), make("cfl_saga", {"dropout": 0.0, "link_loss": 0.0})
    c = make("cfl_saga", {"outage_rounds": [99]}, rho=1e3)  # faults on, but none hits these rounds
    for r in range(20):
        a.run_round(r), b.run_round(r), c.run_round(r)
    assert torch.equal(a.X, c.X) and torch.equal(a.Y, c.Y) and a.uploads == c.uploads
    assert not b.faulty and c.faulty
    assert a.ledger.count(sender="edge", receiver="edge") == c.ledger.count(sender="edge", receiver="edge")


# ---- rounds nobody takes part in ---------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "opts"), METHODS)
def test_full_dropout_round_is_skipped_with_state_unchanged(name, opts):
    algo = make(name, {"dropout": 1.0}, **opts)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in algo.state_dict().items()}
    for r in range(3):
        m = algo.run_round(r)
        assert m["reported_clients"] == 0 and m["uploads_per_iteration"] == 0
    for k, v in algo.state_dict().items():
        assert torch.equal(v, state[k]) if isinstance(v, torch.Tensor) else v == state[k], k
    assert algo.ledger.count() == 0


def test_outage_round_is_logged_and_listed(tmp_path, caplog):
    cfg = {
        "name": "cfl_outage",
        "dataset": DATA,
        "rounds": 5,
        "algorithm": {"name": "gt_saga", **SMALL, "sample_rate": 0.4},
        "faults": {"dropout": 0.2, "outage_rounds": [3]},
        "output": {"progress": False, "plots": False},
    }
    with caplog.at_level(logging.WARNING, logger="fedweave"):
        res = fedweave.run(load(cfg), run_dir=tmp_path / "a")
    rows = {row["round"]: row for row in res.metrics}
    assert rows[3]["reported_clients"] == 0 and rows[2]["reported_clients"] > 0
    assert rows[3]["iterations"] == rows[2]["iterations"] == 2  # the skipped round does no iteration
    assert rows[3]["opt_gap"] == rows[2]["opt_gap"] and rows[5]["skipped_rounds"] == 1
    assert res.summary["skipped_rounds"] == [3]
    assert any("round 3: no client reported" in rec.getMessage() for rec in caplog.records)


def test_a_skipped_round_reports_no_trigger_ratio():
    """CFL-SAGA's ``trigger_ratio_median`` is the median of ||Delta||^2 / e over the round's last iteration: a
    skipped round checks no trigger, so its row has none (before: the previous round's value, repeated)."""
    algo = make("cfl_saga", {"outage_rounds": [3]}, rho=1e3, iterations_per_round=2)
    rows = [algo.run_round(r) for r in range(4)]  # round r + 1 of the metrics is r here
    assert "trigger_ratio_median" in rows[1] and "trigger_ratio_median" in rows[3]
    assert rows[2]["reported_clients"] == 0 and "trigger_ratio_median" not in rows[2]


# ---- refusals and resume --------------------------------------------------------------------------------
def test_faults_that_do_not_apply_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="faults.dropout.*decentralized"):
        make("gt_saga", {"dropout": 0.1}, mode="decentralized")
    solo = make("gt_saga", {"server_miss": 0.5}, mode="decentralized")  # servers are the nodes: allowed
    reported = [solo.run_round(r)["reported_clients"] for r in range(10)]
    assert set(reported) <= set(range(7)) and max(reported) <= 6
    cfg = {"dataset": DATA, "rounds": 1, "algorithm": {"name": "cfl_saga", **SMALL}, "faults": {"deadline": 1.0}}
    with pytest.raises(ConfigError, match=r"faults.deadline.*'cfl_saga' does not handle"):
        fedweave.run(load(cfg), run_dir=tmp_path / "x")


def test_resume_under_faults_is_exact(tmp_path):
    base = {
        "name": "cfl_faults",
        "dataset": DATA,
        "rounds": 8,
        "algorithm": {"name": "gt_svrg", **SMALL, "inner_loop": 5, "iterations_per_round": 3},
        "faults": ALL,
        "output": {"progress": False, "plots": False, "checkpoint_every": 4},
    }
    full = fedweave.run(load(base), run_dir=tmp_path / "a")
    fedweave.run(load({**base, "rounds": 4}), run_dir=tmp_path / "b")
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(load(base).to_dict()))
    resumed = resume(tmp_path / "b")
    a, b = full.metrics[-1], resumed.metrics[-1]
    assert a["opt_gap"] == b["opt_gap"] and a["uploads"] == b["uploads"] and a["bytes_up"] == b["bytes_up"]
    assert torch.equal(full.algorithm.due, resumed.algorithm.due)
