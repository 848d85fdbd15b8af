"""Injected faults in the decentralized family (docs/reliability.md): dropped peers, lost links, skipped rounds."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import tests.conftest  # noqa: F401  (registers the _toy dataset)
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.faults import Faults
from fedweave.runner import run

DFL = ["local", "gossip", "fedavg_ft", "dfedavg", "dfedavgm", "pens", "federico", "ditto", "fomo", "dispfl",
       "afind", "afind_plus"]  # fmt: skip


def config(algo: str, faults: dict, rounds: int = 12, clients: int = 8, backend: str = "auto", **opts) -> dict:
    if algo == "pens":  # PENS keeps the m_top best of the 3 it samples (m_top must be below neighbours)
        opts = {"m_top": 2, **opts}
    return {
        "name": "dfl-faults",
        "seed": 1,
        "rounds": rounds,
        "backend": backend,
        "dataset": {"name": "_toy"},
        "partition": {"name": "iid", "num_clients": clients},
        "model": {"name": "logistic"},
        "algorithm": {"name": algo, "neighbours": 3, "finetune_epochs": 0, **opts},
        "faults": faults,
        "local": {"epochs": 1, "batch_size": 20, "lr": 0.2},
        "eval": {"every": rounds},
        "output": {"progress": False, "plots": False},
    }


def build(algo: str, faults: dict, **kw):
    return build_algorithm(RunContext(load(config(algo, faults, **kw))))


def test_every_dfl_method_declares_dropout_and_link_loss():
    from fedweave.registry import ALGORITHMS

    gossiping = {"gossip", "fedavg_ft", "dfedavg", "dfedavgm"}  # these also take Byzantine peers (robustness)
    for name in DFL:
        extra = {"byzantine"} if name in gossiping else set()
        assert set(ALGORITHMS.get(name).handles_faults) == {"dropout", "link_loss"} | extra, name
    with pytest.raises(ConfigError, match="faults.server_miss"):
        run(load(config("gossip", {"server_miss": 0.1})), progress=False)


@pytest.mark.parametrize("faults", [{"dropout": 0.2}, {"link_loss": 0.2}])
def test_gossip_still_converges_under_faults(tmp_path, faults):
    acc = {}
    for name, f in (("clean", {}), ("faulty", faults)):
        acc[name] = run(load(config("gossip", f)), run_dir=tmp_path / name, progress=False).summary
    local = run(load(config("local", {})), run_dir=tmp_path / "local", progress=False).summary
    # chance is 0.25 (4 classes); local training alone reaches ~0.74 here, gossip ~0.87
    assert acc["faulty"]["final_test_accuracy"] > 0.82
    assert acc["faulty"]["final_test_accuracy"] > local["final_test_accuracy"] + 0.08
    assert acc["faulty"]["communication"]["bytes_total"] < acc["clean"]["communication"]["bytes_total"]


@pytest.mark.parametrize("algo", DFL)
def test_dropped_clients_train_nothing(algo, monkeypatch):
    from fedweave.execution import LocalTrainer

    calls = []
    train = LocalTrainer.train

    def recording(self, starts, clients, r, **kw):
        calls.append(list(clients))
        return train(self, starts, clients, r, **kw)

    monkeypatch.setattr(LocalTrainer, "train", recording)
    a = build(algo, {"dropout": 0.4}, rounds=3)
    a.run_round(1)
    up = set(np.flatnonzero(a.up(1)).tolist())
    assert 0 < len(up) < a.num_clients
    assert calls and all(set(c) <= up for c in calls)  # every local-training call: clients that are up only


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize("algo", ["ditto", "dispfl"])  # rules with per-client tensors: anchors, masks
def test_training_only_the_clients_up_gives_their_rows_of_a_call_over_everyone(algo, backend):
    from fedweave.algorithms.decentralized.dispfl import MaskedRule
    from fedweave.execution.local import LocalRule

    a = build(algo, {"dropout": 0.4}, rounds=3, backend=backend)
    a.run_round(0)
    n, r = a.num_clients, 1
    starts = a.W + 0.01 * torch.randn(a.W.shape, generator=torch.Generator().manual_seed(0))
    table = torch.randn(a.W.shape, generator=torch.Generator().manual_seed(1))

    class Anchored(LocalRule):  # a per-client tensor, indexed by job position
        def direction(self, w, grad, jobs):
            return grad(w) + 0.5 * (w - table[jobs])

    rule = MaskedRule(a.store["mask"]) if algo == "dispfl" else Anchored()
    full = a.trainer.train(starts, range(n), r, rule=rule)
    part = a.train_up(r, a.trainer, starts, rule=rule)
    up = torch.as_tensor(a.up(r))
    assert 0 < up.sum() < n
    torch.testing.assert_close(part.params[up], full.params[up], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(part.loss[up], full.loss[up], rtol=1e-6, atol=1e-7)
    assert torch.equal(part.params[~up], starts[~up]) and (part.steps[~up] == 0).all()
    assert part.loss[~up].isnan().all() and not torch.equal(full.params[~up], starts[~up])


@pytest.mark.parametrize("algo", DFL)
def test_dropped_clients_keep_their_state_and_send_nothing(algo):
    a = build(algo, {"dropout": 0.4, "link_loss": 0.3}, rounds=3)
    a.run_round(0)
    before = {k: v.clone() for k, v in a.store.state_dict().items()}  # models, personal models, masks
    theta = a.state.theta.clone() if hasattr(a, "state") else None  # AFIND+ thresholds
    out = a.run_round(1)
    up = a.up(1)
    assert 0 < up.sum() < len(up), "the fixture needs some dropped and some active clients in round 1"
    assert out["reported_clients"] == float(up.sum())
    down = torch.as_tensor(~up)
    for name, old in before.items():
        assert torch.equal(a.store[name][down], old[down]), name  # a dropped client changes nothing
    assert not torch.equal(a.W[~down], before["model"][~down])  # the others trained
    if theta is not None:
        assert torch.equal(a.state.theta[down], theta[down])


@pytest.mark.parametrize("algo", DFL)
def test_a_round_nobody_reports_in_is_skipped(algo, tmp_path, caplog):
    a = build(algo, {"outage_rounds": [2]}, rounds=3)
    a.run_round(0)
    W, nbytes = a.W.clone(), a.ledger.bytes()
    assert a.run_round(1) == {"reported_clients": 0.0}
    assert torch.equal(a.W, W) and a.ledger.bytes() == nbytes
    if algo in ("gossip", "afind_plus"):  # through the runner: logged, counted, training goes on
        with caplog.at_level(logging.WARNING, logger="fedweave"):
            res = run(load(config(algo, {"dropout": 1.0}, rounds=2)), run_dir=tmp_path / algo, progress=False)
        assert res.summary["skipped_rounds"] == [1, 2]
        assert "no client reported" in caplog.text


def _expected_messages(algo_clean, faults: Faults, r: int) -> int:
    """Peer models delivered in round r: each active i pulls from the sampled peers that are up over an up link."""
    n = algo_clean.num_clients
    up = ~faults.dropped(r, np.arange(n))
    total = 0
    for i in range(n):
        if up[i]:
            sampled = algo_clean.available(r, i)  # the fault-free sample of the same stream
            total += int((up[sampled] & faults.links_up(r, i, sampled)).sum())
    return total


def test_ledger_counts_only_delivered_models_sampled_gossip():
    faults = {"dropout": 0.25, "link_loss": 0.3}
    a, clean = build("gossip", faults, rounds=4), build("gossip", {}, rounds=4)
    for r in range(4):
        before = a.ledger.bytes()
        a.run_round(r)
        want = _expected_messages(clean, a.faults, r)
        assert want > 0
        assert a.ledger.bytes() - before == want * a.model_bytes


def test_ledger_counts_only_delivered_models_metropolis():
    faults = {"dropout": 0.25, "link_loss": 0.3}
    cfg = config("dfedavg", faults, mixing="metropolis", topology="ring", rounds=3)
    del cfg["algorithm"]["neighbours"]  # Metropolis mixing talks to every graph neighbour (the option is refused)
    a = build_algorithm(RunContext(load(cfg)))
    n = a.num_clients
    for r in range(3):
        before = a.ledger.bytes()
        a.run_round(r)
        up = a.up(r)
        edges = [(u, v) for u, v in a.graph.edges() if up[u] and up[v] and a.faults.link_up(r, u, v)]
        assert a.ledger.bytes() - before == 2 * len(edges) * a.model_bytes  # both directions of each live edge
    # the mixing of what arrived keeps the network average of the active clients' sent models
    W = torch.randn(n, 5, dtype=torch.float64)
    from fedweave.faults import mixing_without

    idx = np.arange(n)
    ok = a.faults.links_up(0, idx[:, None], idx[None, :]) & a.up(0)[:, None] & a.up(0)[None, :]
    M = torch.as_tensor(mixing_without(a.mixing.numpy(), ok))
    assert torch.allclose((M @ W).mean(0), W.mean(0))


def test_afind_plus_counts_only_reachable_peers():
    a = build("afind_plus", {"link_loss": 0.5}, rounds=1, clients=6)
    clean = build("afind_plus", {}, rounds=1, clients=6)
    a.run_round(0)
    pool = sum(len(a.reachable(0, i, clean.available(0, i))) for i in range(6))
    full = sum(len(clean.available(0, i)) for i in range(6))
    proxies = [e.count for e in a.ledger.entries() if e.kind == "feature_proxy"]
    assert 0 < pool < full and proxies == [pool]  # one proxy per reachable pool member, none over a lost link
    assert a.ledger.bytes(kind="feature_proxy") == pool * a.proxy.size * 4


@pytest.mark.parametrize("algo", DFL)
def test_faults_that_hit_nobody_change_no_number(algo, tmp_path):
    """With the fault machinery active but no fault landing (an outage after the last round), every method
    computes exactly what it computes without faults."""
    clean = run(load(config(algo, {}, rounds=3)), run_dir=tmp_path / "clean", progress=False)
    idle = run(load(config(algo, {"outage_rounds": [99]}, rounds=3)), run_dir=tmp_path / "idle", progress=False)
    keys = ("test_accuracy", "test_loss", "bytes_total")
    assert [[r[k] for k in keys] for r in clean.metrics] == [[r[k] for k in keys] for r in idle.metrics]


def test_fomo_greedy_choice_contacts_its_fault_free_top_k_under_link_loss():
    """FOMO's greedy branch contacts the top-k of its graph neighbours by affinity, k = min(neighbours, degree) as
    without faults, and keeps those that are reachable. It took k from the random pool after the fault filter, so a
    lost link to a random peer it never contacts shrank the top-k it asked (often to none)."""
    algo = build("fomo", {"link_loss": 0.5}, greedy=1.0)
    for r in range(3):
        for i in range(algo.num_clients):
            nb = algo.neighbours[i]
            top = np.sort(nb[np.argsort(-algo.affinity[i, nb].numpy(), kind="stable")[: min(3, len(nb))]])
            assert np.array_equal(algo._native(r, i), algo.reachable(r, i, top)), (r, i)
        algo.run_round(r)
