"""Injected faults: the decisions of fedweave.faults, and FedAvg under dropout, outages and stragglers."""

from __future__ import annotations

import numpy as np
import pytest

import fedweave
from fedweave.algorithms.centralized.fedavg import FedAvg
from fedweave.config import ConfigError, FaultsConfig, load
from fedweave.faults import Faults, reweighted
from fedweave.registry import ALGORITHMS
from fedweave.seeding import Seeds

PARAMS = 36 * 4 + 4  # logistic on the 1x6x6, 4-class toy data
BYTES = PARAMS * 4


# ---- the star family's fault handling (see docs/reliability.md) ---------------------------------------
class _FedAvgNoFaults(FedAvg):
    handles_faults = ()


if "_fedavg_no_faults" not in ALGORITHMS._items:
    ALGORITHMS.register("_fedavg_no_faults")(_FedAvgNoFaults)

# every centralized method follows the star protocol: send to all sampled, use what arrives, re-weight
STAR = ["fedavg", "fedprox", "scaffold", "feddyn", "fedadam", "fedcm", "mofedsam", "fedmim", "fedsam"]


def _cfg(toy_config: dict, algo: str, faults: dict, **kw) -> dict:
    algorithm = {**toy_config["algorithm"], "name": algo}
    return {**toy_config, "backend": "loop", "algorithm": algorithm, "faults": faults, **kw}


# ---- decisions --------------------------------------------------------------------------------------
def test_decisions_are_pure_functions_of_seed_round_and_who():
    cfg = FaultsConfig(dropout=0.3, link_loss=0.4, server_miss=0.2, deadline=1.2, speed_jitter=0.3)
    a, b = Faults(cfg, Seeds(5)), Faults(cfg, Seeds(5))
    everyone = np.arange(200)
    some = np.array([17, 3, 150])
    # a client's fate does not depend on who else was sampled, nor on call order, nor on the instance
    assert np.array_equal(a.dropped(4, some), b.dropped(4, everyone)[some])
    assert np.array_equal(a.arrival_times(4, some), b.arrival_times(4, everyone)[some])
    assert np.array_equal(a.servers_up(2, some), b.servers_up(2, everyone)[some])
    assert a.link_up(3, 7, 11) == a.link_up(3, 11, 7) == bool(b.links_up(3, np.array([11]), np.array([7]))[0])
    # other rounds and other seeds draw differently
    assert not np.array_equal(a.dropped(4, everyone), a.dropped(5, everyone))
    assert not np.array_equal(a.dropped(4, everyone), Faults(cfg, Seeds(6)).dropped(4, everyone))


def test_rates_match_the_configured_probabilities():
    cfg = FaultsConfig(dropout=0.2, link_loss=0.3, server_miss=0.1, deadline=1.5, speed_sigma=0.5)
    f, n = Faults(cfg, Seeds(0)), np.arange(20000)
    assert f.dropped(0, n).mean() == pytest.approx(0.2, abs=0.01)
    assert 1 - f.links_up(0, n, n + 1).mean() == pytest.approx(0.3, abs=0.01)
    assert 1 - f.servers_up(0, n).mean() == pytest.approx(0.1, abs=0.01)
    # log-normal speeds: P(exp(0.5 z) > 1.5) = P(z > 2 ln 1.5) = 0.2087
    assert f.late(0, n).mean() == pytest.approx(0.2087, abs=0.01)


def test_stragglers_twice_the_work_take_twice_as_long_and_delay_counts_deadlines():
    f = Faults(FaultsConfig(deadline=1.0, speed_sigma=0.7, straggler_policy="late"), Seeds(1))
    c = np.arange(50)
    t1, t2 = f.arrival_times(3, c, 1.0), f.arrival_times(3, c, 2.0)
    assert np.allclose(t2, 2 * t1)
    assert np.array_equal(f.arrival_times(3, c), f.arrival_times(9, c))  # no jitter: a speed per client
    d = f.delay_rounds(3, c)
    assert np.array_equal(d > 0, f.late(3, c)) and np.all((d < t1) & (t1 <= d + 1))
    assert f.active() == {"late"} and len(f.reporting(3, c)) == int((d == 0).sum())


@pytest.mark.parametrize("policy", ["drop", "late"])
def test_outcomes_end_each_job_at_its_arrival_its_would_be_arrival_or_the_deadline(policy):
    """The simulated clocks' one latency rule: the server hears of a job when its upload arrives, when a dropped
    client would have reported, or at the deadline, whichever comes first; the outcome says which; a client
    that reports is exactly one that faults.reporting keeps."""
    f = Faults(FaultsConfig(dropout=0.3, deadline=1.0, speed_sigma=0.7, straggler_policy=policy), Seeds(1))
    c, work = np.arange(60), np.linspace(0.5, 1.5, 60)
    times, lost = f.outcomes(3, c, work)
    arrival, dropped = f.arrival_times(3, c, work), f.dropped(3, c)
    assert np.array_equal(times, np.minimum(arrival, 1.0))
    past = "timeout" if policy == "drop" else "late"
    assert np.array_equal(lost, np.where(dropped, "drop", np.where(arrival > 1.0, past, "")))
    assert {"drop", past, ""} <= set(lost.tolist())
    assert np.array_equal(c[lost == ""], f.reporting(3, c, work))
    untimed = Faults(FaultsConfig(speed_sigma=0.7), Seeds(1)).outcomes(3, c, work)
    assert np.array_equal(untimed[0], arrival) and set(untimed[1].tolist()) == {""}


def test_no_faults_by_default_and_outages_drop_everyone():
    f = Faults(FaultsConfig(), Seeds(0))
    c = np.arange(10)
    assert f.active() == set() and np.array_equal(f.reporting(0, c), c)
    assert f.surviving_links(0, np.ones((4, 4))).sum() == 16
    g = Faults(FaultsConfig(outage_rounds=[3]), Seeds(0))
    assert g.dropped(2, c).all() and not g.dropped(1, c).any() and g.active() == {"dropout"}


def test_surviving_links_are_symmetric_and_keep_self_loops():
    f = Faults(FaultsConfig(link_loss=0.5), Seeds(2))
    w = np.full((30, 30), 0.25)
    s = f.surviving_links(7, w)
    assert np.array_equal(s, s.T) and np.all(np.diag(s) == 0.25)
    assert 0.3 < (s == 0).sum() / (30 * 29) < 0.7


def test_reweighted_renormalizes_over_delivered():
    w = reweighted(np.array([1.0, 2.0, 3.0, 4.0]), np.array([True, False, True, False]))
    assert np.allclose(w, [0.25, 0, 0.75, 0])
    assert not reweighted(np.ones(3), np.zeros(3, dtype=bool)).any()


# ---- configuration ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "faults, key",
    [
        ({"dropout": 1.5}, "faults.dropout"),
        ({"link_loss": -0.1}, "faults.link_loss"),
        ({"server_miss": float("nan")}, "faults.server_miss"),
        ({"deadline": 0}, "faults.deadline"),
        ({"straggler_policy": "wait"}, "faults.straggler_policy"),
        ({"outage_rounds": [0]}, "faults.outage_rounds[0]"),
        ({"speed_sigma": "fast"}, "faults.speed_sigma"),
        ({"dropuot": 0.1}, "faults.dropuot"),
    ],
)
def test_bad_faults_name_the_key(toy_config, faults, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load({**toy_config, "faults": faults})


def test_a_fault_the_algorithm_does_not_handle_is_refused(toy_config, tmp_path):
    cfg = _cfg(toy_config, "_fedavg_no_faults", {"dropout": 0.2})
    with pytest.raises(ConfigError, match=r"faults\.dropout.*'_fedavg_no_faults' does not handle"):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    cfg = _cfg(toy_config, "fedavg", {"link_loss": 0.2})
    with pytest.raises(ConfigError, match=r"faults\.link_loss.*handles: byzantine, deadline, dropout"):
        fedweave.run(cfg, run_dir=tmp_path / "r")


# ---- the centralized family under faults ------------------------------------------------------------
@pytest.mark.parametrize("algo", STAR)
def test_star_methods_converge_under_20_percent_dropout_and_count_only_delivered(toy_config, tmp_path, algo):
    rounds, per_round = 12, 4
    clean = fedweave.run(_cfg(toy_config, algo, {}, rounds=rounds), run_dir=tmp_path / "clean")
    res = fedweave.run(_cfg(toy_config, algo, {"dropout": 0.2}, rounds=rounds), run_dir=tmp_path / "r")
    reported = [int(r["reported_clients"]) for r in res.metrics]
    # the same decisions, recomputed: sampled clients minus those that dropped
    algo_obj, faults = res.algorithm, Faults(FaultsConfig(dropout=0.2), Seeds(toy_config["seed"]))
    expected = [int((~faults.dropped(r, algo_obj.sample_clients(r))).sum()) for r in range(rounds)]
    assert reported == expected and sum(expected) < rounds * per_round  # some clients did drop
    comm, clean_comm = res.summary["communication"], clean.summary["communication"]
    assert comm["bytes_down"] == clean_comm["bytes_down"]  # the server sent to every sampled client
    up_per_client = clean_comm["bytes_up"] // (rounds * per_round)
    assert up_per_client >= BYTES and comm["bytes_up"] == sum(expected) * up_per_client  # only delivered
    # chance is 0.25; fault-free, the methods reach 0.67 (FedCM's slow start) to 0.88 in 12 rounds
    assert res.final_accuracy > 0.6 and res.final_accuracy > clean.final_accuracy - 0.05


def test_a_dropped_client_keeps_its_own_state(toy_config, tmp_path):
    """SCAFFOLD: only the clients that reported replace their control variate c_i."""
    res = fedweave.run(_cfg(toy_config, "scaffold", {"dropout": 0.5}, rounds=1), run_dir=tmp_path / "r")
    algo = res.algorithm
    sampled = algo.sample_clients(0)
    dropped = Faults(FaultsConfig(dropout=0.5), Seeds(toy_config["seed"])).dropped(0, sampled)
    assert dropped.any() and not dropped.all()
    c = algo.store["c"]
    touched = c.abs().sum(1) > 0
    assert set(np.flatnonzero(touched.numpy())) == set(sampled[~dropped].tolist())


@pytest.mark.parametrize("algo", STAR)
def test_a_round_nobody_reports_in_is_skipped_and_logged(toy_config, tmp_path, algo, caplog):
    cfg = _cfg(toy_config, algo, {"outage_rounds": [3]}, rounds=4)
    with caplog.at_level("WARNING", logger="fedweave"):
        res = fedweave.run(cfg, run_dir=tmp_path / "r")
    rows = res.metrics
    assert [r["reported_clients"] for r in rows] == [4, 4, 0, 4]
    assert [r["skipped_rounds"] for r in rows] == [0, 0, 1, 1]
    assert rows[2]["test_loss"] == rows[1]["test_loss"]  # the model did not change in round 3
    assert rows[2]["bytes_up"] == rows[1]["bytes_up"] and rows[2]["bytes_down"] > rows[1]["bytes_down"]
    assert res.summary["skipped_rounds"] == [3] and res.summary["status"] == "completed"
    assert "round 3: no client reported" in caplog.text


def test_every_client_dropping_every_round_does_not_crash(toy_config, tmp_path):
    res = fedweave.run(_cfg(toy_config, "fedavg", {"dropout": 1.0}, rounds=3), run_dir=tmp_path / "r")
    assert [r["reported_clients"] for r in res.metrics] == [0, 0, 0]
    assert len({r["test_loss"] for r in res.metrics}) == 1 and res.summary["communication"]["bytes_up"] == 0
    assert res.summary["skipped_rounds"] == [1, 2, 3]


def test_stragglers_past_the_deadline_are_dropped(toy_config, tmp_path):
    faults = {"deadline": 1.2, "speed_sigma": 0.5}
    res = fedweave.run(_cfg(toy_config, "fedavg", faults, rounds=3), run_dir=tmp_path / "r")
    f, algo = Faults(FaultsConfig(**faults), Seeds(toy_config["seed"])), res.algorithm
    expected = []
    for r in range(3):
        c = algo.sample_clients(r)
        work = np.array([algo.trainer.num_steps(int(i)) for i in c]) / algo.reference_steps()
        expected.append(float((~f.late(r, c, work)).sum()))
    assert [r["reported_clients"] for r in res.metrics] == expected and min(expected) < 4


def test_faults_off_changes_nothing(toy_config, tmp_path):
    a = fedweave.run({**toy_config, "backend": "loop"}, run_dir=tmp_path / "a")
    b = fedweave.run(_cfg(toy_config, "fedavg", {}), run_dir=tmp_path / "b")
    assert [r["test_loss"] for r in a.metrics] == [r["test_loss"] for r in b.metrics]


def test_mixing_without_lost_links_stays_doubly_stochastic():
    from fedweave.faults import mixing_without

    rng = np.random.default_rng(0)
    a = np.triu(rng.random((8, 8)) < 0.5, 1)
    adj = a | a.T
    deg = adj.sum(1)
    w = np.where(adj, 1.0 / (1 + np.maximum(deg[:, None], deg[None, :])), 0.0)  # Metropolis weights
    w[np.diag_indices(8)] = 1 - w.sum(1)
    f = Faults(FaultsConfig(link_loss=0.5, server_miss=0.3), Seeds(1))
    idx, servers = np.arange(8), f.servers_up(2, np.arange(8))
    up = f.links_up(2, idx[:, None], idx[None, :]) & servers[:, None] & servers[None, :]
    m = mixing_without(w, up)
    assert np.allclose(m.sum(0), 1) and np.allclose(m.sum(1), 1) and np.allclose(m, m.T)
    assert np.all(m[~up & ~np.eye(8, dtype=bool)] == 0)
    down = np.flatnonzero(~servers)
    assert len(down) and np.allclose(m[down], np.eye(8)[down])  # a server that misses keeps its value
    assert np.array_equal(mixing_without(w, np.ones((8, 8), bool)), w)


def test_a_skipped_round_between_evaluations_is_still_counted(toy_config, tmp_path):
    cfg = _cfg(toy_config, "fedavg", {"outage_rounds": [3]}, rounds=4, eval={"every": 2})
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert [(r["round"], r["reported_clients"], r["skipped_rounds"]) for r in res.metrics] == [(2, 4, 0), (4, 4, 1)]
    assert res.summary["skipped_rounds"] == [3]
