"""Asynchronous FL on the simulated clock (FedAsync, FedBuff): the synchronous special case, hand-computed
event times, staleness, backends and resume."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
import yaml

import fedweave
from fedweave.algorithms.centralized.async_base import staleness_weight
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError, load
from fedweave.faults import Faults
from fedweave.plots import plot_runs
from fedweave.registry import PARTITIONERS
from fedweave.runner import run as run_config
from fedweave.seeding import Seeds
from tests.test_centralized import _algo, _cfg, _rounds

if "_thirds" not in PARTITIONERS._items:

    @PARTITIONERS.register("_thirds")
    def _thirds(labels, num_clients, rng, *, users=None):
        """Three clients with 1/6, 2/6 and 3/6 of the samples: 1, 2 and 3 local steps of one epoch."""
        n = len(labels) // 6
        return [np.arange(0, n), np.arange(n, 3 * n), np.arange(3 * n, 6 * n)]


if "_half_empty" not in PARTITIONERS._items:

    @PARTITIONERS.register("_half_empty")
    def _half_empty(labels, num_clients, rng, *, users=None):
        """Six clients of which 1, 3 and 5 hold no sample (as Dirichlet with ``min_size: 0`` may leave them)."""
        n = len(labels) // 3
        empty = np.arange(0)
        return [np.arange(0, n), empty, np.arange(n, 2 * n), empty, np.arange(2 * n, 3 * n), empty]


def _async(alg: str, rounds: int = 4, backend: str = "loop", sigma: float = 0.0, **opts) -> dict:
    cfg = _cfg(alg, rounds=rounds, backend=backend, **opts)
    return {**cfg, "faults": {"speed_sigma": sigma}}


def _three(alg: str = "fedasync", **opts) -> dict:
    """Client work 0.5, 1 and 1.5 (steps 1, 2, 3 over the mean 2), equal speeds: hand-computable times."""
    cfg = _async(alg, rounds=7, concurrency=3, clients_per_round=3, **opts)
    cfg["partition"] = {"name": "_thirds", "num_clients": 3}
    cfg["local"] = {"epochs": 1, "batch_size": 80, "lr": 0.1}
    return cfg


def _timed(cfg: dict, **faults) -> dict:
    """``cfg`` with the synchronous star's simulated clock on (``faults.sim_time``) and the given faults."""
    return {**cfg, "faults": {**cfg.get("faults", {}), "sim_time": True, **faults}}


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fedbuff_with_full_buffer_and_equal_latencies_is_fedavg_exactly(weighting):
    """Model, train loss and, with FedAvg's rounds on the simulated clock (faults.sim_time), the clock itself."""
    sync = _algo(_timed(_async("fedavg", weighting=weighting)))
    buff = _algo(_async("fedbuff", weighting=weighting, buffer_size=3, concurrency=3, staleness="constant"))
    for r in range(4):
        m_sync, m_buff = sync.run_round(r), buff.run_round(r)
        assert m_buff["train_loss"] == m_sync["train_loss"]
        assert m_buff["sim_time"] == m_sync["sim_time"] == r + 1 and m_buff["staleness_max"] == 0
    assert torch.equal(sync.x, buff.x)


def test_the_clock_matches_hand_computed_event_times():
    """Works 0.5, 1, 1.5 and concurrency 3 of 3 clients. t=0: all start (x_0). 0.5: client 0 arrives (step 0,
    staleness 0) and restarts from x_1. 1.0: client 1 (from x_0, step 1, staleness 1), then client 0 (from x_1,
    step 2, staleness 1); clients 0 and 1 restart from x_3 (due at 1.5 and 2.0). 1.5: client 2 (from x_0, step 3,
    staleness 3), then client 0 (from x_3, step 4, staleness 1); 0 and 2 restart from x_5. 2.0: client 1 (from
    x_3, step 5, staleness 2), then client 0 (from x_5, step 6, staleness 1)."""
    algo = _algo(_three())
    rows = [algo.run_round(r) for r in range(7)]
    assert [m["sim_time"] for m in rows] == [0.5, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0]
    assert [m["staleness_max"] for m in rows] == [0, 1, 1, 3, 1, 2, 1]
    arrivals = [(t, c, v, s) for t, e, c, _, v, s in algo.events if e == "arrive"]
    assert arrivals == [(0.5, 0, 0, 0), (1.0, 1, 0, 1), (1.0, 0, 1, 2), (1.5, 2, 0, 3), (1.5, 0, 3, 4),
                        (2.0, 1, 3, 5), (2.0, 0, 5, 6)]  # fmt: skip
    dispatches = [(t, c) for t, e, c, *_ in algo.events if e == "dispatch"]
    assert dispatches == [(0.0, 0), (0.0, 1), (0.0, 2), (0.5, 0), (1.0, 0), (1.0, 1), (1.5, 0), (1.5, 2)]


def test_max_staleness_discards_and_the_next_arrival_counts():
    algo = _algo(_three(max_staleness=2))
    rows = [algo.run_round(r) for r in range(4)]
    assert [m["staleness_max"] for m in rows] == [0, 1, 1, 0]  # client 2's staleness-3 update is discarded
    assert [(t, c) for t, e, c, *_ in algo.events if e == "discard"] == [(1.5, 2)]


# ---- discarded uploads: sent, so billed, and a compressing client's residual advances ----------------------
def _ends(run_dir) -> dict[str, int]:
    """The number of each event of a run's events.csv."""
    rows = list(csv.DictReader((run_dir / "events.csv").read_text().splitlines()))
    return {e: sum(r["event"] == e for r in rows) for e in ("arrive", "discard", "dispatch")}


@pytest.mark.parametrize("alg", ["fedbuff", "fedasync"])
@pytest.mark.parametrize("compression", [None, {"name": "topk", "k": 1, "error_feedback": False}])
def test_the_ledger_bills_discarded_uploads_as_accepted_ones(alg, compression, tmp_path):
    """The client sent its upload before the server read its staleness: the bytes crossed the link. Every upload
    here is the same size (dense, or one top-1 message), so the ledger's upload bytes are that size times the
    arrivals plus the discards of events.csv."""
    opts = {"buffer_size": 2} if alg == "fedbuff" else {}
    cfg = _async(alg, rounds=8, sigma=0.5, concurrency=5, max_staleness=1, **opts)
    if compression is not None:
        cfg["compression"] = {"upload": compression}
    result = fedweave.run(cfg, run_dir=tmp_path / "r")
    ends, algo = _ends(tmp_path / "r"), result.algorithm
    assert ends["discard"] >= 2 and ends["arrive"] == 8 * (2 if alg == "fedbuff" else 1)
    d = algo.num_params
    # dense: d floats; top-1: the index's bits and a 32-bit value, in whole bytes (test_compression_composes...)
    each = d * algo.x.element_size() if compression is None else -(-(((d - 1).bit_length()) + 32) // 8)
    assert algo.ledger.bytes("up") == (ends["arrive"] + ends["discard"]) * each
    assert sum(e.count for e in algo.ledger.entries() if e.sender == "client") == ends["arrive"] + ends["discard"]
    assert result.metrics[-1]["bytes_up"] == algo.ledger.bytes("up")


def test_a_discarded_upload_advances_the_clients_error_feedback_residual():
    """Client 2's staleness-3 upload at t = 1.5 (server step 3) is discarded under max_staleness 2. The client
    encoded it (top-1 with error feedback) not knowing that: its residual is e <- p - C(p), p its displacement
    (its first upload: e was 0), the residual it has when the server accepts it (max_staleness null)."""
    topk = {"upload": {"name": "topk", "k": 1}}
    discard, accept = _algo({**_three(max_staleness=2), "compression": topk}), _algo({**_three(), "compression": topk})
    for r in range(3):
        discard.run_round(r)
        accept.run_round(r)
    job = next(j for t, e, c, j, *_ in discard.events if e == "dispatch" and c == 2)
    p = discard.ys[job][0] - discard.starts[job]  # y_i - x_tau, the client's displacement
    discard.run_round(3)
    accept.run_round(3)
    assert [(c, j) for _, e, c, j, *_ in discard.events if e == "discard"] == [(2, job)]
    assert [(c, j) for _, e, c, j, *_ in accept.events if e == "arrive"][3] == (2, job)
    expect = p.clone()
    expect[p.abs().argmax()] = 0  # top-1 sends the largest coordinate, the rest stays behind
    residual = discard.compression.store.rows("update", [2])[0]
    assert torch.equal(residual, expect) and residual.abs().sum() > 0
    assert torch.equal(residual, accept.compression.store.rows("update", [2])[0])


@pytest.mark.parametrize("compressor", [{"name": "randk", "k": 2}, {"name": "qsgd", "levels": 4}])
def test_a_discarded_uploads_draws_leave_every_other_upload_bit_for_bit(compressor, monkeypatch):
    """The compression draws are keyed by job id: encoding a discarded upload takes no draw of another one, so
    each accepted upload decodes to exactly what its own stream ("compression", job, client, 0) gives, and
    the model is the one of a run where the discarded upload is never encoded (no error feedback: the discard
    leaves no state behind)."""
    cfg = {**_async("fedbuff", rounds=8, sigma=0.5, concurrency=5, max_staleness=1, buffer_size=2)}
    cfg["compression"] = {"upload": compressor}
    algo, unsent = _algo(cfg), _algo(cfg)
    sent: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
    transmit = algo.compression.transmit

    def recorded(key, clients, index, name, rows):
        out, nbytes = transmit(key, clients, index, name, rows)
        sent[key] = (int(clients[0]), rows[0].clone(), out[0].clone())
        return out, nbytes

    monkeypatch.setattr(algo.compression, "transmit", recorded)
    _rounds(algo, 8)
    discarded = {j for _, e, _, j, *_ in algo.events if e == "discard"}
    accepted = [j for _, e, _, j, *_ in algo.events if e == "arrive"]
    assert discarded and discarded <= sent.keys() and len(accepted) == 16
    c = algo.compression.compressor
    for job in accepted:
        client, rows, out = sent[job]
        own = c.decode(c.encode(rows.to("cpu"), algo.seeds.torch("compression", job, client, 0)))
        assert torch.equal(out, own.to(out.device))
    # the model of a run whose discarded uploads are never encoded (the server rejecting them unseen)
    plain = unsent.compression.transmit

    def skipping(key, clients, index, name, rows):
        return (rows, 0) if key in discarded else plain(key, clients, index, name, rows)

    monkeypatch.setattr(unsent.compression, "transmit", skipping)
    assert torch.equal(_rounds(unsent, 8), algo.x)


@pytest.mark.parametrize("compression", [None, {"name": "topk", "k": 1}])
def test_a_run_without_discards_keeps_its_ledger_and_model(compression):
    """A max_staleness that no upload exceeds changes nothing: the same events, ledger and model as none."""
    cfg = _async("fedbuff", rounds=8, sigma=0.5, concurrency=5, buffer_size=2)
    if compression is not None:
        cfg["compression"] = {"upload": compression}
    capped, free = _algo({**cfg, "algorithm": {**cfg["algorithm"], "max_staleness": 100}}), _algo(cfg)
    assert torch.equal(_rounds(capped, 8), _rounds(free, 8))
    assert capped.events == free.events and not any(e == "discard" for _, e, *_ in capped.events)
    assert list(capped.ledger.entries()) == list(free.ledger.entries())
    arrivals = sum(e == "arrive" for _, e, *_ in capped.events)
    assert sum(e.count for e in capped.ledger.entries() if e.sender == "client") == arrivals


def test_fedasync_mixes_with_the_staleness_weighted_alpha():
    algo = _algo(_three(alpha=0.5, staleness="hinge", staleness_a=1.0, staleness_b=0))
    algo.run_round(0)
    x1 = algo.x.clone()
    y = algo.ys[1][0]  # client 1's model, trained from x_0: it arrives next, with staleness 1
    algo.run_round(1)
    alpha = 0.5 * (1 / (1.0 * (1 - 0) + 1))  # hinge, b = 0: 1 / (a (tau - b) + 1)
    torch.testing.assert_close(algo.x, (1 - alpha) * x1 + alpha * y, rtol=0, atol=0)


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_fedasync_one_client_at_a_time_is_fedavg_of_one_client(alpha, monkeypatch):
    """concurrency 1: every arrival has staleness 0, so alpha_t = alpha and x <- (1 - alpha) x + alpha y_i is
    FedAvg's x + eta_g (y_i - x) with one client a round and eta_g = alpha, draw for draw (the same client, the
    same batches); with alpha = 1 the server takes the arriving model as it is. The two servers' arithmetic
    differs by rounding (x + (y - x) need not be y in floating point), so the models agree to float32 rounding
    and only the first round, trained from the same model, has the same training loss bit for bit; after it
    the losses agree to that rounding (which CPU's products round them alike is the machine's, not the
    method's)."""
    sync = _algo(_async("fedavg", clients_per_round=1, server_lr=alpha))
    fa = _algo(_async("fedasync", sigma=0.5, clients_per_round=1, alpha=alpha, staleness="hinge", staleness_b=0))
    arrived, apply = [], fa.apply

    def recorded(deltas, models, weights, s, clients):
        arrived.append(models[0].clone())
        apply(deltas, models, weights, s, clients)

    monkeypatch.setattr(fa, "apply", recorded)
    for r in range(4):
        m_sync, m_fa = sync.run_round(r), fa.run_round(r)
        assert m_fa["staleness_max"] == 0
        if r == 0:
            assert m_fa["train_loss"] == m_sync["train_loss"]
        assert m_fa["train_loss"] == pytest.approx(m_sync["train_loss"], rel=1e-6, abs=0)
        torch.testing.assert_close(fa.x, sync.x, rtol=0, atol=1e-6)
        if alpha == 1.0:
            assert torch.equal(fa.x, arrived[-1])


@pytest.mark.parametrize("k, staleness, server_lr", [(1, "polynomial", 0.6), (3, "polynomial", 1.0), (3, "hinge", 0.5)])
def test_fedbuff_without_staleness_is_fedavg_for_every_staleness_function(k, staleness, server_lr):
    """buffer_size = concurrency = clients_per_round with equal latencies: every update has staleness 0 and
    s(0) = 1 for each function, so the step is FedAvg's x + eta_g sum_i p_i Delta_i, bit for bit."""
    sync = _algo(_async("fedavg", clients_per_round=k, server_lr=server_lr))
    opts = {"buffer_size": k, "concurrency": k, "staleness": staleness, "server_lr": server_lr}
    if staleness == "hinge":
        opts["staleness_b"] = 0  # a discount from the first step of staleness on: none at staleness 0 still
    buff = _algo(_async("fedbuff", clients_per_round=k, **opts))
    for r in range(4):
        assert buff.run_round(r)["train_loss"] == sync.run_round(r)["train_loss"]
    assert torch.equal(sync.x, buff.x)


def record_jobs(algo, monkeypatch) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each job's start model and trained result, by job id, recorded as the server dispatches it."""
    jobs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    dispatch = algo.dispatch

    def recorded(r):
        dispatch(r)
        for j, start in algo.starts.items():
            jobs.setdefault(j, (start.clone(), algo.ys[j][0].clone()))

    monkeypatch.setattr(algo, "dispatch", recorded)
    return jobs


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fedbuffs_step_is_the_papers_under_staleness(weighting, monkeypatch):
    """Nguyen et al. 2022, Alg. 1 with the staleness scaling of Sec. 5: once K updates are in,
    x <- x + eta_g sum_i p_i s(t - tau_i) Delta_i, Delta_i = y_i - x_{tau_i} from the model client i was sent,
    checked against the hand formula with every job's start and result recorded at dispatch."""
    cfg = _three("fedbuff", buffer_size=2, server_lr=0.7, staleness="polynomial", staleness_a=0.5, weighting=weighting)
    algo = _algo(cfg)
    jobs = record_jobs(algo, monkeypatch)
    taus = []
    for r in range(6):
        x, n = algo.x.clone(), len(algo.events)
        algo.run_round(r)
        got = [(c, j, r - v) for _, e, c, j, v, _ in algo.events[n:] if e == "arrive"]
        sizes = torch.tensor([float(algo.sizes[c]) for c, _, _ in got], dtype=torch.float64)
        p = sizes / sizes.sum() if weighting == "samples" else torch.full((2,), 0.5, dtype=torch.float64)
        step = sum(float(p[i]) * (1 + tau) ** -0.5 * (jobs[j][1] - jobs[j][0]) for i, (_, j, tau) in enumerate(got))
        torch.testing.assert_close(algo.x, x + 0.7 * step, rtol=1e-6, atol=1e-7)
        taus += [tau for *_, tau in got]
    assert max(taus) >= 2 and 0 in taus  # stale and fresh updates both scaled


def test_fedasyncs_worker_is_the_papers_proximal_sgd():
    """Xie et al. 2019, Alg. 1 (Worker): local SGD on f_i(y) + (rho/2) ||y - x_tau||^2 about the model sent. With
    one client at a time it is FedProx's rule (mu = rho) with one client a round and eta_g = alpha; rho moves
    the model; loop and vmap agree with several clients in flight."""
    sync = _rounds(_algo(_async("fedprox", clients_per_round=1, server_lr=0.6, mu=0.5)), 4)
    fa = _rounds(_algo(_async("fedasync", clients_per_round=1, alpha=0.6, rho=0.5)), 4)
    torch.testing.assert_close(fa, sync, rtol=0, atol=1e-6)
    assert not torch.equal(fa, _rounds(_algo(_async("fedasync", clients_per_round=1, alpha=0.6)), 4))
    xs = [_rounds(_algo(_async("fedasync", backend=b, sigma=0.5, concurrency=5, rho=0.5)), 6) for b in ("loop", "vmap")]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)


def test_staleness_options_at_their_defaults_are_accepted_where_unread():
    """A config may write out the defaults of the options its staleness function does not read."""
    _algo(_async("fedbuff", buffer_size=2, staleness="constant", staleness_a=0.5, staleness_b=4))
    _algo(_async("fedbuff", buffer_size=2, staleness="polynomial", staleness_a=0.7, staleness_b=4))


def test_staleness_functions():
    assert staleness_weight("constant", 7, 0.5, 4) == 1.0
    assert staleness_weight("polynomial", 3, 0.5, 4) == pytest.approx(0.5)  # (1 + 3)^-1/2
    assert staleness_weight("hinge", 4, 2.0, 4) == 1.0
    assert staleness_weight("hinge", 6, 2.0, 4) == pytest.approx(1 / 5)  # 1 / (a (tau - b) + 1)


@pytest.mark.parametrize("alg", ["fedbuff", "fedasync"])
def test_loop_and_vmap_agree(alg):
    opts = {"buffer_size": 2} if alg == "fedbuff" else {}
    algos = [_algo(_async(alg, backend=b, sigma=0.5, concurrency=5, **opts)) for b in ("loop", "vmap")]
    xs = [_rounds(a, 6) for a in algos]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)
    assert algos[0].events == algos[1].events  # the same schedule: it never reads the trained numbers


@pytest.mark.parametrize("alg", ["fedbuff", "fedasync"])
def test_resume_continues_identically_and_writes_the_event_order(alg, tmp_path):
    cfg = _async(alg, rounds=6, sigma=0.5, concurrency=5, **({"buffer_size": 2} if alg == "fedbuff" else {}))
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 3}}
    fedweave.run({**cfg2, "rounds": 3}, run_dir=tmp_path / "part")
    resumed = run_config(load({**cfg2, "rounds": 6}), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    assert [r["sim_time"] for r in resumed.metrics] == [r["sim_time"] for r in full.metrics]
    text = (tmp_path / "full" / "events.csv").read_text()
    assert (tmp_path / "part" / "events.csv").read_text() == text
    assert not (tmp_path / "full" / "test_accuracy_vs_sim_time.png").exists()  # plots off
    rows = list(csv.DictReader(text.splitlines()))
    assert sum(r["event"] == "update" for r in rows) == 6
    times = [float(r["time"]) for r in rows]
    assert times == sorted(times)  # in the order they happened on the clock


def test_compression_composes_with_fedbuff():
    cfg = {**_async("fedbuff", buffer_size=2, concurrency=4), "compression": {"upload": {"name": "topk", "k": 1}}}
    algo = _algo(cfg)
    algo.run_round(0)
    d = algo.num_params
    assert algo.ledger.bytes("up", round=0) == 2 * -(-(((d - 1).bit_length()) + 32) // 8)  # two top-1 messages


@pytest.mark.parametrize("aggregator", ["median", {"name": "trimmed_mean", "beta": 0.2}, "geometric_median"])
def test_a_robust_aggregator_keeps_fedbuffs_staleness_weights(aggregator):
    """A buffer of one: any aggregator returns the one row, so the step is the paper's x + eta_g s(t - tau) Delta
    (the mean's), the staleness weight included; an aggregator that ignores or renormalizes weights does not
    drop it."""
    opts = {"buffer_size": 1, "staleness": "polynomial"}
    mean, robust = _algo(_three("fedbuff", **opts)), _algo({**_three("fedbuff", **opts), "aggregator": aggregator})
    stale = [robust.run_round(r)["staleness_max"] for r in range(7)]
    _rounds(mean, 7)
    assert max(stale) > 0  # some steps discount their update
    torch.testing.assert_close(robust.x, mean.x, rtol=1e-6, atol=1e-7)


def test_fedbuffs_bucketing_draws_each_server_step_from_its_own_stream(monkeypatch):
    """Bucketing's permutation of server step r comes from the ("bucketing", r) stream, as in the star's rounds."""
    algo = _algo({**_async("fedbuff", buffer_size=4, concurrency=5), "aggregator": {"name": "median", "bucketing": 2}})
    keys, draw = [], algo.seeds.numpy

    def numpy(name, *key):
        if name == "bucketing":
            keys.append(key)
        return draw(name, *key)

    monkeypatch.setattr(algo.seeds, "numpy", numpy)
    _rounds(algo, 3)
    assert keys == [(0,), (1,), (2,)]


def test_fedbuffs_aggregator_bound_is_checked_on_the_buffer_before_round_1():
    """A server step reduces buffer_size updates, not clients_per_round: the aggregator's bound is checked on
    the buffer when the run is built."""
    krum = {"name": "krum", "f": 1}  # n >= 2f + 3 = 5
    with pytest.raises(ConfigError, match=r"aggregator 'krum' needs at least 5 client updates .* \(got 4\)"):
        _algo({**_async("fedbuff", buffer_size=4, concurrency=8, clients_per_round=8), "aggregator": krum})
    algo = _algo({**_async("fedbuff", buffer_size=5, concurrency=3, clients_per_round=3), "aggregator": krum})
    _rounds(algo, 2)


@pytest.mark.parametrize(
    "opts, expect",
    [
        ({"concurrency": 9}, "algorithm.concurrency (9) exceeds partition.num_clients (8)"),
        ({"buffer_size": 0}, "algorithm.buffer_size must be >= 1"),
        ({"max_staleness": -1}, "algorithm.max_staleness must be >= 0 or null"),
        ({"staleness": "linear"}, "algorithm.staleness must be one of"),
        ({"sampling": "bernoulli"}, "sampler: fedbuff dispatches each free slot"),
        ({"consistency": True}, "algorithm.consistency: fedbuff has no round of local models"),
        ({"name": "fedasync", "server_lr": 0.5}, "algorithm.server_lr: fedasync's server step is its mixing weight"),
        ({"name": "fedasync", "alpha": 0.0}, "algorithm.alpha must be in (0, 1]"),
        ({"name": "fedasync", "rho": -0.1}, "algorithm.rho must be in [0, 3.40282e+38], got -0.1"),
        ({"name": "fedasync", "weighting": "uniform"}, "algorithm.weighting: fedasync steps on one arrival at a time"),
        ({"staleness": "polynomial", "staleness_b": 2}, "algorithm.staleness_b: staleness 'polynomial' does not read"),
        ({"staleness": "constant", "staleness_a": 0.9}, "algorithm.staleness_a: staleness 'constant' does not read it"),
        ({"faults": {"outage_rounds": [2]}}, "faults.outage_rounds: fedbuff has no round that every client misses"),
        ({"faults": {"dropout": 1.0}}, "faults.dropout must be < 1 for fedbuff"),
        # fedasync has no buffer: its step waits for one upload (before, the line spoke of its buffer_size)
        ({"name": "fedasync", "faults": {"outage_rounds": [2]}}, "(a server step waits for one upload)"),
        ({"faults": {"outage_rounds": [2]}}, "(a server step waits for buffer_size uploads)"),
        ({"name": "fedasync", "secure_aggregation": {}}, "its server steps on each upload as it arrives, which"),
        ({"secure_aggregation": {}}, "its server steps on a buffer of uploads that arrive one by one, which"),
    ],
)
def test_bad_async_config_is_one_line(opts, expect):
    opts = dict(opts)
    faults, sections = opts.pop("faults", {}), {k: opts.pop(k) for k in ["secure_aggregation"] if k in opts}
    cfg = _async(opts.pop("name", "fedbuff"), **opts)
    with pytest.raises(ConfigError) as e:
        _algo({**cfg, **sections, "faults": {**cfg["faults"], **faults}})
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_concurrency_alone_runs_fewer_clients_than_the_default_clients_per_round():
    """clients_per_round is only the default of concurrency: with concurrency set, its default (10) does not
    refuse a run of 6 clients, and at most concurrency clients train at once."""
    cfg = _async("fedbuff", buffer_size=2, concurrency=4)
    del cfg["algorithm"]["clients_per_round"]
    algo = _algo({**cfg, "partition": {**cfg["partition"], "num_clients": 6}})
    _rounds(algo, 4)
    busy, most = set(), 0
    for _, e, c, *_ in algo.events:
        if e == "dispatch":
            busy.add(c)
        elif e != "update":
            busy.discard(c)
        most = max(most, len(busy))
    assert most == 4


@pytest.mark.parametrize("alg", ["fedasync", "fedbuff"])
def test_only_clients_with_samples_are_dispatched(alg):
    """A client without samples would arrive at once with the model it was sent, and its null upload would take a
    server step (before, most steps of a run with many such clients moved nothing on a clock stuck at 0)."""
    cfg = _async(alg, rounds=6, concurrency=3, clients_per_round=3, sigma=0.5)
    algo = _algo({**cfg, "partition": {"name": "_half_empty", "num_clients": 6}})
    _rounds(algo, 6)
    dispatched = {c for _, e, c, *_ in algo.events if e == "dispatch"}
    assert dispatched == {0, 2, 4}
    more = {**cfg, "algorithm": {**cfg["algorithm"], "concurrency": 4}}
    with pytest.raises(ConfigError, match=r"algorithm.concurrency \(4\) exceeds the 3 clients with training samples"):
        _algo({**more, "partition": {"name": "_half_empty", "num_clients": 6}})


# ---- injected faults: dropouts and a deadline ----------------------------------------------------------
def _jobs(events: list) -> dict[int, list]:
    """Per job id, its events in order: (event, time, client)."""
    out: dict[int, list] = {}
    for t, e, c, j, *_ in events:
        if j >= 0:
            out.setdefault(j, []).append((e, t, c))
    return out


def test_a_deadline_abandons_the_slow_client_at_the_deadline():
    """Works 0.5, 1, 1.5 at equal speeds and a deadline of 1.2: client 2 never reports; the server frees its slot
    1.2 after each dispatch, and the other two arrive when they would have."""
    algo = _algo({**_three("fedbuff", buffer_size=1), "faults": {"speed_sigma": 0.0, "deadline": 1.2}})
    rows = [algo.run_round(r) for r in range(6)]
    jobs = _jobs(algo.events)
    timeouts = [ev for ev in jobs.values() if ev[0][2] == 2]
    assert len(timeouts) >= 2 and all(len(ev) <= 2 for ev in timeouts)
    for ev in timeouts:  # dispatch at s, timeout at s + 1.2 (while in flight: dispatched only)
        assert ev[0][0] == "dispatch" and (len(ev) == 1 or (ev[1][0], ev[1][1]) == ("timeout", ev[0][1] + 1.2))
    work = {0: 0.5, 1: 1.0}
    for ev in (ev for ev in jobs.values() if ev[0][2] != 2 and len(ev) == 2):
        assert ev[1][0] == "arrive" and ev[1][1] == ev[0][1] + work[ev[0][2]]
    assert [m["sim_time"] for m in rows] == [0.5, 1.0, 1.0, 1.5, 2.0, 2.0]
    assert algo.ledger.bytes("up") == 6 * algo.ledger.bytes("up", round=0)  # one upload a step, none from 2


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_dropped_clients_deliver_nothing_and_free_their_slot_when_they_would_have_reported(backend):
    cfg = _async("fedbuff", rounds=8, backend=backend, sigma=0.5, concurrency=5, buffer_size=2)
    faulty, clean = _algo({**cfg, "faults": {"speed_sigma": 0.5, "dropout": 0.4}}), _algo(cfg)
    for r in range(8):
        faulty.run_round(r)
        clean.run_round(r)
    jobs = _jobs(faulty.events)
    dropped = [ev for ev in jobs.values() if len(ev) == 2 and ev[1][0] == "drop"]
    arrived = [ev for ev in jobs.values() if len(ev) == 2 and ev[1][0] == "arrive"]
    assert len(dropped) >= 3 and len(arrived) == 16  # 8 steps of 2 uploads
    assert all(len(ev) in (1, 2) for ev in jobs.values())  # one end each (or still in flight)
    # a dropped client is lost when it would have reported: its time is its speed times its work, as an arrival's
    speed = lambda c: float(faulty.faults.arrival_times(0, np.array([c]), faulty.client_work(0, np.array([c])))[0])  # noqa: E731
    for ev in dropped + arrived:
        assert ev[1][1] - ev[0][1] == pytest.approx(speed(ev[0][2]), rel=1e-12)
    # only the arrivals upload (no compression: one dense message each), every dispatch downloads
    assert faulty.ledger.bytes("up") == 16 * clean.ledger.bytes("up", round=0) / 2
    sent = sum(e == "dispatch" for _, e, *_ in clean.events)
    assert faulty.ledger.bytes("down") == len(jobs) * clean.ledger.bytes("down") / sent
    assert not any(j in faulty.ys or j in faulty.starts for j, ev in jobs.items() if ev[-1][0] == "drop")
    assert not torch.equal(faulty.x, clean.x)


def test_faults_keep_loop_and_vmap_on_the_same_schedule_and_resume_identically(tmp_path):
    cfg = _async("fedbuff", rounds=6, sigma=0.5, concurrency=5, buffer_size=2)
    cfg["faults"] = {"speed_sigma": 0.5, "dropout": 0.3, "deadline": 2.0}
    algos = [_algo({**cfg, "backend": b}) for b in ("loop", "vmap")]
    xs = [_rounds(a, 6) for a in algos]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)
    assert algos[0].events == algos[1].events
    assert {e for _, e, *_ in algos[0].events} >= {"drop", "timeout", "arrive"}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 3}}
    fedweave.run({**cfg2, "rounds": 3}, run_dir=tmp_path / "part")
    resumed = run_config(load({**cfg2, "rounds": 6}), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    assert (tmp_path / "part" / "events.csv").read_text() == (tmp_path / "full" / "events.csv").read_text()


def test_a_checkpoint_written_before_faults_were_handled_resumes():
    """Checkpoints of fedbuff runs written before ``lost`` and ``lost_in_a_row`` were in its state record lack
    them; a run without faults loses no job, so the fresh values are the right ones."""
    cfg = _async("fedbuff", rounds=6, sigma=0.5, concurrency=5, buffer_size=2)
    full, part = _algo(cfg), _algo(cfg)
    _rounds(full, 6)
    _rounds(part, 3)
    old = {k: v for k, v in part.state_dict().items() if k not in ("lost", "lost_in_a_row")}
    resumed = _algo(cfg)
    resumed.load_state_dict(old)
    _rounds(resumed, 3, start=3)
    assert torch.equal(resumed.x, full.x) and resumed.events == full.events


def test_a_deadline_below_every_clients_time_stops_the_run_in_one_line():
    algo = _algo({**_three("fedbuff", buffer_size=1), "faults": {"speed_sigma": 0.0, "deadline": 0.1}})
    with pytest.raises(ConfigError, match=r"faults: 10,000 dispatches in a row delivered nothing"):
        algo.run_round(0)


def test_late_stragglers_and_flower_are_refused_and_list_shows_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = {**_cfg("fedbuff"), "dataset": {"name": "_toy"}, "partition": {"name": "iid", "num_clients": 4}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["flower-app", "c.yaml", "app"]) == 2
    assert "algorithm 'fedbuff' runs its asynchrony on the simulated clock" in capsys.readouterr().err
    assert cli_main(["run", "c.yaml", "faults.deadline=2", "faults.straggler_policy=late"]) == 2
    assert "algorithm 'fedbuff' does not handle this fault" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]
    assert cli_main(["list"]) == 0
    algorithms = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("algorithms:"))
    assert "fedasync" in algorithms.split(": ")[1].split(", ") and "fedbuff" in algorithms


@pytest.mark.parametrize("at_start", [False, True])
def test_plots_against_simulated_time(at_start, tmp_path):
    """eval.at_start: the initial model's row (round 0) is at time 0 of the clock; without sim_time on it the
    plot against simulated time was silently left out."""
    cfg = _async("fedbuff", rounds=3, sigma=0.5, concurrency=4, buffer_size=2)
    res = fedweave.run(
        {**cfg, "eval": {"at_start": at_start}, "output": {"progress": False, "plots": True}}, run_dir=tmp_path / "r"
    )
    assert (tmp_path / "r" / "test_accuracy_vs_sim_time.png").stat().st_size > 1000
    times = [m["sim_time"] for m in res.metrics]
    assert times == sorted(times) and (times[0] == 0.0) == at_start and len(times) == 3 + at_start
    fedweave.run({**_cfg("fedavg", rounds=2), "output": {"progress": False, "plots": True}}, run_dir=tmp_path / "s")
    assert not (tmp_path / "s" / "test_accuracy_vs_sim_time.png").exists()  # no clock, no such plot


# ---- the synchronous star on the simulated clock (faults.sim_time) ------------------------------------------
def _sync_thirds(alg: str = "fedavg", per_round: int = 3, rounds: int = 4, **faults) -> dict:
    """Synchronous rounds of ``per_round`` of the three clients of works 0.5, 1 and 1.5, on the clock."""
    cfg = _async(alg, rounds=rounds, clients_per_round=per_round)
    cfg["partition"] = {"name": "_thirds", "num_clients": 3}
    cfg["local"] = {"epochs": 1, "batch_size": 80, "lr": 0.1}
    return _timed(cfg, **faults)


WORK = np.array([0.5, 1.0, 1.5])  # the _thirds clients' local steps (1, 2, 3) over their mean (2)


def test_a_synchronous_round_lasts_until_its_slowest_sampled_client_reports():
    """Two of three clients a round, speeds exp(0.5 z_i) and a per-round jitter exp(0.3 z_{i,r}): each round lasts
    the slowest sampled client's work times its speed, from Faults.arrival_times itself; the rounds add up."""
    cfg = _sync_thirds(per_round=2, rounds=5, speed_sigma=0.5, speed_jitter=0.3)
    algo, ref = _algo(cfg), _algo(cfg)
    faults = Faults(load(cfg).faults, Seeds(cfg["seed"]))
    rows = [algo.run_round(r) for r in range(5)]
    now, expected = 0.0, []
    for r in range(5):
        sampled = ref.sample_clients(r)
        now += float(faults.arrival_times(r, sampled, WORK[sampled]).max())
        expected.append(now)
    assert [m["sim_time"] for m in rows] == expected
    assert len({tuple(ref.sample_clients(r)) for r in range(5)}) > 1  # the rounds sample different pairs
    assert algo.clock_metrics() == {"sim_time": expected[-1]}


def test_the_clock_changes_no_other_number_and_is_off_by_default():
    plain, timed = _algo(_async("fedavg", sigma=0.5)), _algo(_timed(_async("fedavg", sigma=0.5)))
    for r in range(3):
        m_plain, m_timed = plain.run_round(r), timed.run_round(r)
        assert "sim_time" not in m_plain and m_timed == {**m_plain, "sim_time": m_timed["sim_time"]}
    assert torch.equal(plain.x, timed.x) and list(plain.ledger.entries()) == list(timed.ledger.entries())
    assert "now" not in plain.state_dict() and "now" in timed.state_dict()
    # the config a run without the clock records (config.yaml, the checkpoint's) is the one it always had
    assert "sim_time" not in load(_async("fedavg")).to_dict()["faults"]
    assert load(_timed(_async("fedavg"))).to_dict()["faults"]["sim_time"] is True


def test_the_deadline_caps_a_round_and_a_dropped_client_counts_when_it_would_have_reported():
    """Works 0.5, 1, 1.5 at equal speeds. A deadline of 1.2: client 2 times out and every round lasts 1.2, the
    round of an outage (nobody reports) too. No deadline, 60 % dropout: a round lasts until its slowest client
    reports or would have, dropped or not."""
    algo = _algo(_sync_thirds(speed_sigma=0.0, deadline=1.2, outage_rounds=[2]))
    rows = [algo.run_round(r) for r in range(4)]
    assert [m["reported_clients"] for m in rows] == [2, 0, 2, 2]
    assert [m["sim_time"] for m in rows] == [1.2, 1.2 + 1.2, 1.2 + 1.2 + 1.2, 1.2 + 1.2 + 1.2 + 1.2]
    cfg = _sync_thirds(rounds=6, speed_sigma=0.5, dropout=0.6)
    algo = _algo(cfg)
    faults = Faults(load(cfg).faults, Seeds(cfg["seed"]))
    rows = [algo.run_round(r) for r in range(6)]
    now, slowest_dropped = 0.0, 0
    for r, m in enumerate(rows):
        times = faults.arrival_times(r, [0, 1, 2], WORK)
        now += float(times.max())
        assert m["sim_time"] == now
        slowest_dropped += bool(faults.dropped(r, [int(times.argmax())])[0])
    assert slowest_dropped >= 1 and 0 in [m["reported_clients"] for m in rows]  # the cases this test is about


def test_the_clock_resumes_bit_for_bit_and_cannot_be_switched_on_at_resume(tmp_path):
    cfg = _timed(_cfg("scaffold", rounds=6), speed_sigma=0.5, speed_jitter=0.2, dropout=0.2)
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 3}}
    fedweave.run({**cfg2, "rounds": 3}, run_dir=tmp_path / "part")
    resumed = run_config(load({**cfg2, "rounds": 6}), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    times = [r["sim_time"] for r in full.metrics]
    assert [r["sim_time"] for r in resumed.metrics] == times and times == sorted(times) and times[0] > 0
    assert resumed.algorithm.now == full.algorithm.now == times[-1]
    # a clock switched on at a resume would start from 0 there: refused, naming the section that changed
    plain = {**cfg2, "faults": {"speed_sigma": 0.5, "speed_jitter": 0.2, "dropout": 0.2}}
    fedweave.run({**plain, "rounds": 3}, run_dir=tmp_path / "plain")
    with pytest.raises(ConfigError, match="faults changed since the checkpoint was written"):
        fedweave.resume(tmp_path / "plain", ["rounds=6", "faults.sim_time=true"])


def test_fedavg_and_fedbuff_plot_against_simulated_time_together(tmp_path):
    """eval.at_start: FedAvg's initial row is at time 0 as FedBuff's; both runs on one plot against sim_time."""
    out = {"output": {"progress": False, "plots": True}, "eval": {"at_start": True}}
    sync = fedweave.run({**_timed(_async("fedavg", rounds=3, sigma=0.5)), **out}, run_dir=tmp_path / "avg")
    fedweave.run({**_async("fedbuff", rounds=3, sigma=0.5, buffer_size=3), **out}, run_dir=tmp_path / "buff")
    assert [m["sim_time"] for m in sync.metrics][0] == 0.0 and len(sync.metrics) == 4
    assert (tmp_path / "avg" / "test_accuracy_vs_sim_time.png").stat().st_size > 1000
    written = plot_runs([tmp_path / "avg", tmp_path / "buff"], tmp_path / "both")
    assert tmp_path / "both" / "test_accuracy_vs_sim_time.png" in written


def test_the_speeds_warn_of_nothing_on_the_clock(tmp_path, caplog):
    """Without a deadline the speeds change nothing in a synchronous run (a warning says so), except its clock."""
    with caplog.at_level("WARNING", logger="fedweave"):
        fedweave.run(_async("fedavg", rounds=1, sigma=0.7), run_dir=tmp_path / "a")
        assert "change nothing in fedavg" in caplog.text
        caplog.clear()
        fedweave.run(_timed(_async("fedavg", rounds=1, sigma=0.7)), run_dir=tmp_path / "b")
        assert "change nothing" not in caplog.text


def test_the_clock_is_refused_outside_the_star_in_one_line(tmp_path):
    cfg = {**_timed(_cfg("fedavg")), "algorithm": {"name": "gossip"}}
    with pytest.raises(ConfigError, match=r"^faults.sim_time: algorithm 'gossip' \(decentralized family\) has no "):
        run_config(load(cfg), run_dir=tmp_path / "g")
    with pytest.raises(ConfigError, match="does not handle this fault"):  # the star has no late delivery
        run_config(load(_timed(_cfg("fedavg"), deadline=1.0, straggler_policy="late")), run_dir=tmp_path / "l")
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_a_run_that_fails_mid_way_keeps_its_events_so_far(tmp_path):
    """An error after round 2 (here a callback's) leaves the failed run's events.csv beside its summary: the
    order of events up to the error, equal to the first rows of the same run's uninterrupted events."""

    class Broken(fedweave.Callback):
        def after_training(self, run, r, metrics):
            if r == 2:
                raise RuntimeError("broken callback")

    cfg = _async("fedbuff", rounds=5, sigma=0.5, concurrency=4, buffer_size=2)
    with pytest.raises(RuntimeError, match="broken callback"):
        fedweave.run(cfg, run_dir=tmp_path / "failed", callbacks=[Broken()])
    fedweave.run(cfg, run_dir=tmp_path / "full")
    failed = (tmp_path / "failed" / "events.csv").read_text().splitlines()
    full = (tmp_path / "full" / "events.csv").read_text().splitlines()
    assert '"status": "failed"' in (tmp_path / "failed" / "summary.json").read_text()
    updates = [row for row in csv.DictReader(failed) if row["event"] == "update"]
    assert len(updates) == 3 and full[: len(failed)] == failed


def test_a_latency_spread_that_would_overflow_the_clock_is_refused_in_one_line(tmp_path):
    """A client's time is exp(speed_sigma z + speed_jitter z'): a spread past MAX_SPEED_SPREAD is refused naming
    both keys (before, speed_jitter 1000 made the clock inf and the run 'diverged', told to lower local.lr);
    at the bound even the largest normal the draws give (|z| <= sqrt(2 * 53 ln 2)) keeps the clock finite."""
    for faults in ({"speed_sigma": 0.0, "speed_jitter": 1000.0}, {"speed_sigma": 30.0, "speed_jitter": 30.0}):
        with pytest.raises(ConfigError) as e:
            fedweave.run({**_async("fedbuff", rounds=2, buffer_size=2), "faults": faults}, run_dir=tmp_path / "r")
        assert str(e.value).startswith("faults.speed_sigma + faults.speed_jitter must be at most 50 ")
        assert "\n" not in str(e.value)
    from fedweave.config import MAX_SPEED_SPREAD

    z_max = float(np.sqrt(-2.0 * np.log(2.0**-53)))
    assert np.isfinite(np.exp(MAX_SPEED_SPREAD * z_max) * 1e10 * 1e7)  # 1e10 steps of work, 1e7 rounds summed
    at_bound = _algo({**_async("fedbuff", rounds=3, buffer_size=2), "faults": {"speed_sigma": 25, "speed_jitter": 25}})
    assert all(np.isfinite(at_bound.run_round(r)["sim_time"]) for r in range(3))
