"""Injected faults in the split family (docs/reliability.md): dropouts, stragglers dropped at the deadline,
late smashed data queued into later rounds by CSE-FSL's asynchronous server; exact ledger counts from the
fault decisions, skipped rounds, refusals, checkpoints.

All data here are SYNTHETIC (class means plus noise), chance accuracy 0.1.
"""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import pytest
import torch
import yaml

import fedweave
from fedweave.accounting.split import CIFAR, round_bytes, storage_params
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, from_dict, load
from fedweave.data.base import Dataset
from fedweave.faults import Faults
from fedweave.registry import DATASETS
from fedweave.runner import resume
from fedweave.seeding import Seeds

if "_toy_split_faults" not in DATASETS._items:

    @DATASETS.register("_toy_split_faults")
    def _toy_split_faults(n_train: int = 400, n_test: int = 200, side: int = 8) -> Dataset:
        """Synthetic class-conditional 1 x side x side images."""
        g = torch.Generator().manual_seed(0)
        mu = torch.randn(10, 1, side, side, generator=g)
        y = torch.randint(0, 10, (n_train + n_test,), generator=g)
        x = mu[y] + 0.8 * torch.randn(len(y), 1, side, side, generator=g)
        return Dataset("_toy_split_faults", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10, (1, side, side))


torch.set_num_threads(1)
METHODS = ("fsl_mc", "fsl_oc", "fsl_an", "cse_fsl")
B = 10


def cfg_dict(algorithm, faults, *, clients=10, n_train=400, seed=0, rounds=1):
    return {
        "seed": seed,
        "rounds": rounds,
        "dataset": {"name": "_toy_split_faults", "n_train": n_train},
        "partition": {"name": "iid", "num_clients": clients},
        "model": {"name": "split_small"},
        "algorithm": algorithm if isinstance(algorithm, dict) else {"name": algorithm},
        "local": {"batch_size": B, "lr": 0.05},
        "faults": faults,
    }


def make(algorithm, faults, **kw):
    return build_algorithm(RunContext(from_dict(cfg_dict(algorithm, faults, **kw))))


def opts(method: str) -> dict:
    return {"name": method, **({"h": 2} if method == "cse_fsl" else {})}


# ---- convergence and exact participation -----------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_learns_under_20_percent_dropout_with_exactly_the_decided_clients(method):
    algo = make(opts(method), {"dropout": 0.2}, n_train=800)  # 10 clients x 8 batches
    f = Faults(algo.config.faults, Seeds(0))  # an independent instance: decisions are pure functions
    for r in range(4):
        m = algo.run_round(r)
        clients = np.arange(10)
        assert m["reported_clients"] == len(clients[~f.dropped(r, clients)]) > 0
    assert algo.evaluate(3)["test_accuracy"] > 0.6  # chance 0.1 (fault-free after 4 rounds: 0.84 to 1.0)


@pytest.mark.parametrize("method", METHODS)
def test_ledger_counts_only_what_the_reporters_delivered(method):
    algo = make(opts(method), {"dropout": 0.3}, clients=5)
    m = algo.run_round(0)
    rep = int(m["reported_clients"])
    assert 0 < rep < 5  # the seed gives a partial round
    want = round_bytes(method, algo.split_sizes, [80] * rep, B, h=2 if method == "cse_fsl" else 1)
    led = algo.ledger
    for kind in ("smashed", "labels", "gradient"):
        assert led.bytes(kind=kind) == want[kind], kind
    up_model = rep * algo.split_sizes.client * 4  # reporters upload their client-side model ...
    down_model = 5 * algo.split_sizes.client * 4  # ... every sampled client received x_c
    assert led.bytes(kind="client_model", sender="client") == up_model
    assert led.bytes(kind="client_model", receiver="client") == down_model
    copies = {"fsl_mc": rep, "fsl_an": rep}.get(method, 1)
    assert m["server_copies"] == copies and m["storage_params"] == copies * algo.ls.numel + rep * (
        algo.lc.numel + (algo.la.numel if algo.uses_aux else 0)
    )


def test_aggregation_reweights_over_the_reporters():
    """With dropout, eq. (14) is the sample-weighted mean over the reporters: equal to a fault-free round of
    FSL_MC restricted to them (the same batches, the same copies)."""
    faulty = make("fsl_mc", {"dropout": 0.4}, clients=5)
    rep = Faults(faulty.config.faults, Seeds(0)).reporting(0, np.arange(5))
    faulty.run_round(0)
    plain = make("fsl_mc", {}, clients=5)
    plain.sample_clients = lambda r: rep  # the same clients, no faults
    plain.run_round(0)
    assert 0 < len(rep) < 5
    assert torch.equal(faulty.xc, plain.xc) and torch.equal(faulty.xs, plain.xs)


# ---- rounds nobody reports in -----------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_full_dropout_round_is_skipped_with_models_unchanged(method):
    algo = make(opts(method), {"dropout": 1.0}, clients=5)
    before = [t.clone() for t in (algo.xc, algo.xs, algo.xa)]
    for r in range(2):
        assert algo.run_round(r) == {"reported_clients": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(before, (algo.xc, algo.xs, algo.xa)))
    led = algo.ledger
    assert led.count(sender="client") == 0 and led.count(receiver="client") == 2 * 5 * (2 if algo.uses_aux else 1)


def test_outage_round_is_logged_and_listed(tmp_path, caplog):
    cfg = cfg_dict("fsl_oc", {"dropout": 0.2, "outage_rounds": [2]}, clients=5, rounds=3)
    cfg["output"] = {"progress": False, "plots": False}
    with caplog.at_level(logging.WARNING, logger="fedweave"):
        res = fedweave.run(load(cfg), run_dir=tmp_path / "a")
    rows = {row["round"]: row for row in res.metrics}
    assert rows[2]["reported_clients"] == 0 and rows[1]["reported_clients"] > 0 and rows[3]["skipped_rounds"] == 1
    assert rows[2]["test_accuracy"] == rows[1]["test_accuracy"]  # the models did not move
    assert res.summary["skipped_rounds"] == [2]
    assert any("round 2: no client reported" in rec.getMessage() for rec in caplog.records)


# ---- stragglers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ("fsl_mc", "fsl_an"))
def test_synchronous_server_drops_stragglers(method):
    faults = {"deadline": 1.2, "speed_sigma": 0.5}
    algo = make(method, faults)
    f = Faults(algo.config.faults, Seeds(0))
    clients = np.arange(10)
    on_time = clients[~f.late(0, clients, 1.0)]  # equal shards: every client's work is 1
    m = algo.run_round(0)
    assert 0 < len(on_time) < 10 and m["reported_clients"] == len(on_time)
    assert algo.ledger.count(kind="client_model", sender="client") == len(on_time)
    assert algo.ledger.count(kind="smashed") == len(on_time) * 4  # 4 batches each


def test_cse_fsl_deadline_drop_uses_the_fault_clock_per_upload():
    deadline = 1.1
    algo = make({"name": "cse_fsl", "h": 1, "server_order": "event"}, {"deadline": deadline, "dropout": 0.1})
    f = Faults(algo.config.faults, Seeds(0))
    clients = np.arange(10)
    m = algo.run_round(0)
    alive = clients[~f.dropped(0, clients)]
    # upload after local batch b (of 4) arrives at arrival_times(0, i, (b + 1) / 4)
    times = np.stack([f.arrival_times(0, alive, (b + 1) / 4) for b in range(4)], 1)
    assert algo.ledger.count(kind="smashed") == m["server_steps"] == int((times <= deadline).sum())
    assert 0 < (times > deadline).sum() < times.size
    models = f.reporting(0, clients, np.ones(10))  # the fed server aggregates exactly these
    assert algo.ledger.count(kind="client_model", sender="client") == len(models)
    assert m["reported_clients"] == int((times[:, 0] <= deadline).sum())  # anyone who delivered a batch
    assert m["late_uploads"] == m["in_flight_uploads"] == 0  # policy drop: late batches are discarded
    # a client cut off at the deadline (its model late) is billed for the batches that arrived before it
    cut_off = [k for k, i in enumerate(alive) if i not in models]
    assert any(times[k, 0] <= deadline for k in cut_off)  # the seed gives such a client
    assert algo.ledger.bytes(kind="smashed") == int((times <= deadline).sum()) * B * algo.split_sizes.smashed * 4


def test_cse_fsl_late_uploads_join_a_later_round_queue():
    deadline = 0.8
    faults = {"deadline": deadline, "straggler_policy": "late", "speed_sigma": 0.6}
    algo = make({"name": "cse_fsl", "h": 1, "server_order": "event"}, faults, clients=5)
    f = Faults(algo.config.faults, Seeds(0))
    clients = np.arange(5)
    delays = np.stack([f.delay_rounds(0, clients, (b + 1) / 8) for b in range(8)], 1)  # 8 batches each
    t = np.stack([f.arrival_times(0, clients, (b + 1) / 8) for b in range(8)], 1)
    assert (delays == np.maximum(np.ceil(t / deadline) - 1, 0)).all()
    m0 = algo.run_round(0)
    assert m0["server_steps"] == int((delays == 0).sum()) and m0["in_flight_uploads"] == int((delays > 0).sum())
    assert algo.ledger.count(kind="smashed") == int((delays == 0).sum())  # in flight: not delivered yet
    due = sorted({f_.due for f_ in algo.in_flight})
    assert due and due[0] == 1
    assert all(0 < x.upload.arrival <= deadline for x in algo.in_flight)  # a time within the round it joins
    # checkpoint with the uploads in flight: weights_only round trip, then both continue identically
    buf = io.BytesIO()
    torch.save(algo.state_dict(), buf)
    buf.seek(0)
    twin = make({"name": "cse_fsl", "h": 1, "server_order": "event"}, faults, clients=5)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    m1, t1 = algo.run_round(1), twin.run_round(1)
    cumulative = ("load_bytes", "smashed_uploads_per_client")  # the twin's ledger starts empty (not in the state)
    assert {k: v for k, v in m1.items() if k not in cumulative} == {k: v for k, v in t1.items() if k not in cumulative}
    assert torch.equal(algo.xs, twin.xs) and torch.equal(algo.xc, twin.xc)
    from_round0 = int((delays == 1).sum())
    on_time1 = np.stack([f.delay_rounds(1, clients, (b + 1) / 8) for b in range(8)], 1)
    assert m1["late_uploads"] == from_round0
    assert m1["server_steps"] == from_round0 + int((on_time1 == 0).sum())
    assert algo.ledger.count(kind="smashed") == m0["server_steps"] + m1["server_steps"]  # delivered in round 1


def test_cse_fsl_round_no_client_trains_holds_no_aggregation_buffer(monkeypatch):
    # round 1: every client drops out, only round 0's late uploads reach the server (a round, not a skip). No
    # client's model reaches the fed server, so neither storage figure holds one; before, the streaming figure
    # counted its running-sum buffer, P_s + P_c + P_a, above the buffered P_s
    faults = {"deadline": 0.8, "straggler_policy": "late", "speed_sigma": 0.6}
    algo = make({"name": "cse_fsl", "h": 1, "server_order": "event"}, faults, clients=5)
    algo.run_round(0)
    assert any(f.due == 1 for f in algo.in_flight)
    monkeypatch.setattr(algo, "dropped", lambda r, clients: np.ones(len(clients), dtype=bool))
    m = algo.run_round(1)
    assert m["late_uploads"] > 0 and m["server_steps"] == m["late_uploads"]
    assert m["storage_params"] == m["storage_params_streaming"] == algo.ls.numel
    assert storage_params("cse_fsl", CIFAR, 0, streaming=True) == storage_params("cse_fsl", CIFAR, 0) == CIFAR.server


def test_cse_fsl_resume_with_uploads_in_flight_is_exact(tmp_path):
    base = cfg_dict(
        {"name": "cse_fsl", "h": 1, "server_order": "event"},
        {"deadline": 0.8, "straggler_policy": "late", "speed_sigma": 0.6, "dropout": 0.2},
        clients=5,
        rounds=4,
    )
    base["output"] = {"progress": False, "plots": False, "checkpoint_every": 2}
    full = fedweave.run(load(base), run_dir=tmp_path / "a")
    fedweave.run(load({**base, "rounds": 2}), run_dir=tmp_path / "b")
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(load(base).to_dict()))
    resumed = resume(tmp_path / "b")

    def timeless(row: dict) -> dict:
        return {k: v for k, v in row.items() if "wall" not in k and "time_s" not in k}

    assert timeless(full.metrics[-1]) == timeless(resumed.metrics[-1])
    assert full.metrics[-1]["in_flight_uploads"] > 0 or full.metrics[-1]["late_uploads"] > 0
    assert torch.equal(full.algorithm.xs, resumed.algorithm.xs)


# ---- refusals and the fault-free path ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("algorithm", "faults", "match"),
    [
        ({"name": "cse_fsl", "server_order": "ordered"}, {"deadline": 1.0, "straggler_policy": "late"},
         "straggler_policy 'late'.*server_order 'event'"),
        ({"name": "cse_fsl", "speed_spread": 3.0}, {"deadline": 1.0}, "algorithm.speed_spread"),
        ({"name": "cse_fsl", "agg_every": 2}, {"deadline": 1.0}, "agg_every"),
    ],
)  # fmt: skip
def test_cse_fsl_refuses_fault_combinations_it_cannot_time(algorithm, faults, match):
    with pytest.raises(ConfigError, match=match):
        make(algorithm, faults)


@pytest.mark.parametrize("method", ("fsl_mc", "fsl_oc", "fsl_an"))
def test_synchronous_methods_refuse_late_delivery(tmp_path, method):
    cfg = cfg_dict(method, {"deadline": 1.0, "straggler_policy": "late"})
    with pytest.raises(ConfigError, match=rf"straggler_policy: late.*'{method}' does not handle"):
        fedweave.run(load(cfg), run_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match=rf"faults.link_loss.*'{method}' does not handle"):
        fedweave.run(load(cfg_dict(method, {"link_loss": 0.1})), run_dir=tmp_path / "y")


@pytest.mark.parametrize("method", METHODS)
def test_faults_that_hit_nobody_change_nothing(method):
    a, b = make(opts(method), {}, clients=5), make(opts(method), {"outage_rounds": [99]}, clients=5)
    ma, mb = a.run_round(0), b.run_round(0)
    assert torch.equal(a.xc, b.xc) and torch.equal(a.xs, b.xs) and torch.equal(a.xa, b.xa)
    assert mb.pop("reported_clients") == 5 and "reported_clients" not in ma
    for key in ("late_uploads", "in_flight_uploads"):
        mb.pop(key, None)
    assert ma == mb
    assert math.isclose(a.ledger.summary()["bytes_up"], b.ledger.summary()["bytes_up"])


@pytest.mark.parametrize("method", METHODS)
def test_smashed_uploads_per_client_stays_cumulative_under_dropout(method):
    """The cumulative smashed uploads per client count the uploads so far over the clients a round schedules:
    a round with fewer reporters must not inflate (nor a later one shrink) the count of the earlier rounds."""
    algo = make(opts(method), {"dropout": 0.5}, clients=5)
    seen = []
    for r in range(6):
        m = algo.run_round(r)
        if "smashed_uploads_per_client" in m:
            seen.append(m["smashed_uploads_per_client"])
            assert m["smashed_uploads_per_client"] == algo.ledger.count(kind="smashed") / 5
    assert len(seen) >= 4 and seen == sorted(seen)


@pytest.mark.parametrize(("policy", "order"), [("drop", "ordered"), ("late", "event")])
def test_cse_fsl_round_time_ends_at_the_deadline(policy, order):
    """With a deadline the fed server aggregates at the deadline and the next round starts then (late uploads
    are timed from it), so a client still training past it does not lengthen the simulated round."""
    faults = {"deadline": 0.8, "speed_sigma": 0.6, "straggler_policy": policy}
    algo = make({"name": "cse_fsl", "h": 2, "server_order": order}, faults, clients=5)
    late = Faults(algo.config.faults, Seeds(0)).late(0, np.arange(5), algo.client_work(0, np.arange(5)))
    assert late.any()  # the seed gives clients whose epoch ends past the deadline
    m = algo.run_round(0)
    assert m["sim_round_time"] <= 0.8  # server steps take no time here: the round ends by the deadline
