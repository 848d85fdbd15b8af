"""The hierarchical family under injected faults (docs/reliability.md): ZO-HFL and the hier_* baselines
converge under 20% dropout, count only delivered uploads, re-weight over the clients that reported, keep a
dropped client's state, survive rounds nobody reports in, and drop stragglers past the deadline."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from test_hierarchical import _config  # the tiny 3-class fixture (registers the dataset ``_toy_hier``)

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.hierarchical.base import unit_directions
from fedweave.config import ConfigError, FaultsConfig, load
from fedweave.faults import Faults
from fedweave.seeding import Seeds

METHODS = ["zo_hfl", "hier_fedavg", "hier_fedprox", "hier_scaffold"]
SEED = 2  # the fixture's root seed
ZO = {"server_lr": 0.5}  # gamma_0 large enough for the 48-parameter fixture to train in a few rounds


def _cfg(name: str, faults: dict, rounds: int = 3, **algo) -> dict:
    cfg = _config(**({**ZO, **algo} if name == "zo_hfl" else algo))
    cfg["algorithm"]["name"] = name
    if name != "zo_hfl":
        cfg["algorithm"].pop("server_batch_size")
    return {**cfg, "rounds": rounds, "faults": faults}


def _build(name: str, faults: dict, **algo):
    return build_algorithm(RunContext(load(_cfg(name, faults, **algo))))


def _up_bytes_per_client(a) -> int:
    d = a.dim * 4
    return 2 * d if a.name in ("zo_hfl", "hier_scaffold") else d  # y+ and y- / dy and dc / the model


@pytest.mark.parametrize("name", METHODS)
def test_converges_under_20_percent_dropout_and_counts_only_delivered_uploads(name, tmp_path):
    rounds = 12
    clean = fedweave.run(_cfg(name, {}, rounds), run_dir=tmp_path / "clean")
    res = fedweave.run(_cfg(name, {"dropout": 0.2}, rounds), run_dir=tmp_path / "faulty")
    a, faults = res.algorithm, Faults(FaultsConfig(dropout=0.2), Seeds(SEED))
    sampled = [a.sample_clients(r) for r in range(rounds)]
    expected = [int((~faults.dropped(r, s)).sum()) for r, s in enumerate(sampled)]  # the decisions, recomputed
    assert [int(m["reported_clients"]) for m in res.metrics] == expected
    assert 0 < sum(expected) < rounds * a.k  # some clients dropped, not all
    led, clean_led = a.ledger, clean.algorithm.ledger
    assert led.bytes("down") == clean_led.bytes("down")  # the server sent to every sampled client
    assert led.count(sender="server") == rounds * a.k
    assert led.count(sender="client") == sum(expected)  # one upload per delivered client, no more
    assert led.bytes("up") == sum(expected) * _up_bytes_per_client(a)
    for r in range(rounds):
        assert led.bytes("up", round=r) == expected[r] * _up_bytes_per_client(a)
    # 3 balanced classes (chance ~1/3): fault-free the methods reach 0.80-0.85 here in 12 rounds
    assert res.final_accuracy > 0.7 and res.final_accuracy > clean.final_accuracy - 0.05


def test_zo_term_alone_still_learns_under_dropout(tmp_path):
    """Without server data (f1 = 0) ZO-HFL learns only through the clients' solves (Alg. 1 line 7): under
    20% dropout its loss still falls clearly below the ln 3 of x^_0 = 0."""
    res = fedweave.run(_cfg("zo_hfl", {"dropout": 0.2}, 12, server_share=0.0), run_dir=tmp_path / "r")
    assert res.metrics[-1]["test_loss"] < math.log(3) - 0.08 and res.final_accuracy > 0.5


def test_zo_round_sums_only_the_reporters_terms():
    """Alg. 1 line 7 over the clients that reported: a dropout adds g_i = 0 (as H_{i,r} = 0, spec A3), and
    ``partial: rescale`` multiplies by m / k_r with k_r = |S_r| the number sampled (spec A3, §7), not the
    number that reported (which it used before); the penalty metric (A13(b)) takes the same k_r."""
    for partial in ("zero", "rescale"):
        a = _build("zo_hfl", {"dropout": 0.5}, participation=1.0, lam=4.0, eta=0.2, partial=partial)
        r, x0 = 0, a.x.clone()
        sampled = a.sample_clients(r)
        ok = ~Faults(FaultsConfig(dropout=0.5), Seeds(SEED)).dropped(r, sampled)
        rep = sampled[ok]
        assert 0 < len(rep) < len(sampled)
        g1, _ = a.server_gradient(r, 16)
        v = unit_directions(a.seeds, r, a.m, a.dim)[rep]
        inputs = torch.stack([x0 + 0.2 * v, x0 - 0.2 * v], 1).reshape(-1, a.dim)
        y = a.solve(r, rep, inputs, a.steps(r)).reshape(len(rep), 2, a.dim)
        gz = torch.zeros(a.dim, dtype=torch.float64)
        pen = torch.zeros((), dtype=torch.float64)
        for j, i in enumerate(rep):
            fp = 2.0 * a.rho[i] * ((inputs[2 * j] - y[j, 0]).double() ** 2).sum()  # (lam/2) rho_i ||x - y||^2
            fm = 2.0 * a.rho[i] * ((inputs[2 * j + 1] - y[j, 1]).double() ** 2).sum()
            gz = gz + a.dim / (2 * 0.2) * (fp - fm) * v[j].double()
            pen = pen + 0.5 * (fp + fm)
        scale = a.m / len(sampled) if partial == "rescale" else 1.0
        m = a.run_round(r)
        assert m["reported_clients"] == len(rep) and m["participants"] == len(sampled)
        assert m["zo_evaluations"] == 2 * len(rep)
        # the penalty metric (A13(b)) takes m / k_r with k_r = #S_r under either option, as the step's rescale
        # does: a dropout adds 0 (H_{i,r} = 0, A3); it divided by the reporters before
        assert m["penalty"] == pytest.approx(float(pen) * a.m / len(sampled), rel=1e-6)
        assert torch.allclose(a.x.double(), x0.double() - 0.5 * (g1.double() + scale * gz), atol=1e-5)


@pytest.mark.parametrize("server_data", ["none", "client"])
def test_fedavg_reweights_over_the_reporters(server_data):
    a = _build("hier_fedavg", {"dropout": 0.5}, participation=1.0, tau=3, server_data=server_data)
    sampled = a.sample_clients(0)
    rep = sampled[~Faults(FaultsConfig(dropout=0.5), Seeds(SEED)).dropped(0, sampled)]
    assert 0 < len(rep) < len(sampled)
    jobs = a.jobs_of(rep)  # the server's own job never drops
    local = a.trainer.train(a.x, jobs, 0, lr=a.local_lr(), steps=3)
    p = a.job_sizes[torch.as_tensor(jobs)] / a.job_sizes[torch.as_tensor(jobs)].sum()
    a.run_round(0)
    assert torch.allclose(a.x, p.float() @ local.params, atol=1e-6)


def test_scaffold_dropped_client_keeps_its_control_variate():
    a = _build("hier_scaffold", {"dropout": 0.5}, participation=1.0, tau=3)
    sampled = a.sample_clients(0)
    dropped = Faults(FaultsConfig(dropout=0.5), Seeds(SEED)).dropped(0, sampled)
    a.run_round(0)
    touched = a.store["c"][: a.m].abs().sum(1) > 0
    assert set(np.flatnonzero(touched.numpy())) == set(sampled[~dropped].tolist()) and dropped.any()


@pytest.mark.parametrize("name", METHODS)
def test_a_round_nobody_reports_in_is_skipped_and_logged(name, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="fedweave"):
        res = fedweave.run(_cfg(name, {"outage_rounds": [2]}, 3), run_dir=tmp_path / "r")
    rows, k = res.metrics, res.algorithm.k
    assert [r["reported_clients"] for r in rows] == [k, 0, k]
    assert [r["skipped_rounds"] for r in rows] == [0, 1, 1] and res.summary["skipped_rounds"] == [2]
    led = res.algorithm.ledger
    assert led.bytes("up", round=1) == 0 and led.bytes("down", round=1) == led.bytes("down", round=0)
    assert "round 2: no client reported" in caplog.text and res.summary["status"] == "completed"
    if name != "zo_hfl":
        assert rows[1]["test_loss"] == rows[0]["test_loss"]  # the model did not change


def test_zo_hfl_with_every_client_dropping_is_the_server_only_control():
    """100% dropout: no client solution ever arrives, so only the server's own step on f1 moves x, exactly
    as in the lambda = 0 control; nothing crashes and every upload is missing from the ledger."""
    a = _build("zo_hfl", {"dropout": 1.0})
    b = _build("zo_hfl", {}, lam=0.0)
    for r in range(3):
        assert a.run_round(r)["reported_clients"] == 0
        b.run_round(r)
    assert torch.equal(a.x, b.x) and a.ledger.bytes("up") == 0 and a.ledger.count(sender="server") == 3 * a.k


@pytest.mark.parametrize("name", ["hier_fedavg", "hier_fedprox", "hier_scaffold"])
def test_baselines_with_every_client_dropping_keep_the_model(name, tmp_path):
    res = fedweave.run(_cfg(name, {"dropout": 1.0}, 3), run_dir=tmp_path / "r")
    assert [r["reported_clients"] for r in res.metrics] == [0, 0, 0] and res.summary["skipped_rounds"] == [1, 2, 3]
    assert torch.count_nonzero(res.algorithm.x) == 0 and res.summary["communication"]["bytes_up"] == 0


def test_server_as_client_still_trains_when_every_client_drops():
    """The server's own data step is unaffected by client faults (``server_data: client``)."""
    a = _build("hier_fedavg", {"dropout": 1.0}, server_data="client", tau=3)
    local = a.trainer.train(a.x, np.array([a.server_job]), 0, lr=a.local_lr(), steps=3)
    assert a.run_round(0)["reported_clients"] == 0
    assert torch.allclose(a.x, local.params[0], atol=1e-6) and a.ledger.bytes("up") == 0


@pytest.mark.parametrize("name", ["zo_hfl", "hier_fedavg"])
def test_stragglers_past_the_deadline_are_dropped(name):
    faults = {"deadline": 1.2, "speed_sigma": 0.6}
    a = _build(name, faults, participation=1.0)
    f = Faults(FaultsConfig(**faults), Seeds(SEED))
    got, want = [], []
    for r in range(3):
        got.append(a.run_round(r)["reported_clients"])
        want.append(float((~f.late(r, a.sample_clients(r), 1.0)).sum()))  # equal work: only speed decides
    assert got == want and min(want) < a.m


# faults.work_unit: step (docs/reliability.md): a client's work is its local steps of the round. With tau 2,
# H_r = floor(2 sqrt(r+1)) = 2, 2, 3: ZO-HFL's two solves take 4, 4, 6 steps, a baseline's one job 2, 2, 3.
STEP_FAULTS = {"deadline": 3.0, "speed_sigma": 0.5, "speed_jitter": 0.3}


@pytest.mark.parametrize(
    ("name", "work", "kept"),
    [
        # seed 2, time per step of clients 0..5: r0 0.297 1.652 0.538 0.466 2.013 1.528; r1 0.566 1.467 0.313
        # 1.048 3.217 1.993; r2 0.678 2.310 0.526 0.481 2.908 0.911. Times steps, against the deadline of 3:
        # ZO-HFL r0 1.19 6.61 2.15 1.86 8.05 6.11, r1 2.26 5.87 1.25 4.19 12.87 7.97, r2 4.07 13.86 3.16 2.89 ...
        ("zo_hfl", [4.0, 4.0, 6.0], [[0, 2, 3], [0, 2], [3]]),
        # hier_fedavg r0 0.59 3.30 1.08 0.93 4.03 3.06, r1 1.13 2.93 0.63 2.10 6.43 3.99, r2 2.03 6.93 1.58 1.44
        # 8.72 2.73
        ("hier_fedavg", [2.0, 2.0, 3.0], [[0, 2, 3], [0, 1, 2, 3], [0, 2, 3, 5]]),
    ],
)
def test_a_deadline_in_steps_keeps_exactly_the_clients_whose_steps_times_speed_meet_it(name, work, kept):
    """Under ``work_unit: step`` client i of round r is late when its local steps times its time per step
    (``Faults.arrival_times`` at one unit of work) pass the deadline; the hand-computed sets differ from the
    ``round`` unit's, which keeps every client but client 4 in round 1 (3.217 > 3)."""
    a = _build(name, {**STEP_FAULTS, "work_unit": "step"}, participation=1.0)
    f = Faults(FaultsConfig(**STEP_FAULTS, work_unit="step"), Seeds(SEED))
    clients = np.arange(a.m)
    for r in range(3):
        assert a.client_work(r, clients).tolist() == [work[r]] * a.m
        on_time = clients[work[r] * f.arrival_times(r, clients, 1.0) <= STEP_FAULTS["deadline"]].tolist()
        assert on_time == kept[r]
        assert a.run_round(r)["reported_clients"] == len(kept[r])
    assert _build(name, STEP_FAULTS).reporting(1, clients).tolist() == [0, 1, 2, 3, 5]  # round: work 1


@pytest.mark.parametrize("name", METHODS)
def test_the_round_unit_gives_every_client_exactly_one_round_of_work(name):
    """``work_unit: round`` stays what the family always passed: work exactly 1.0 for every client, whatever
    H_r (so a run's rows are unchanged), and the steps_factor variant takes twice the steps under ``step``."""
    a = _build(name, {"deadline": 2.0}, participation=1.0)
    for r in range(5):
        work = a.client_work(r, np.arange(a.m))
        assert work.dtype == np.float64 and work.tolist() == [1.0] * a.m
    if name != "zo_hfl":
        b = _build(name, {"deadline": 2.0, "work_unit": "step"}, steps_factor=2)
        assert b.client_work(2, np.arange(3)).tolist() == [6.0] * 3  # 2 H_2 = 2 * 3


def test_resume_under_dropout_continues_identically():
    a = _build("zo_hfl", {"dropout": 0.3})
    for r in range(3):
        a.run_round(r)
    b = _build("zo_hfl", {"dropout": 0.3})
    b.run_round(0)
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = _build("zo_hfl", {"dropout": 0.3})
    c.load_state_dict(torch.load(buf, weights_only=True))
    for r in (1, 2):
        c.run_round(r)
    assert torch.equal(a.x, c.x)


@pytest.mark.parametrize("name", METHODS)
def test_unhandled_faults_are_refused_naming_the_key(name, tmp_path):
    with pytest.raises(ConfigError, match=rf"faults\.link_loss.*'{name}' does not handle.*deadline, dropout"):
        fedweave.run(_cfg(name, {"link_loss": 0.2}), run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match=r"straggler_policy: late"):
        fedweave.run(_cfg(name, {"deadline": 1.0, "straggler_policy": "late"}), run_dir=tmp_path / "r")
