"""IFCA (Ghosh et al. 2020): one cluster is FedAvg bit for bit, the server step is line 13's per-cluster average,
the clients' cluster estimates recover a planted clustering that FedAvg cannot fit, and the ledger, resume and
refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedweave
from fedweave.config import ConfigError, load
from fedweave.runner import run as run_config
from tests.test_centralized import _algo, _cfg

CLUSTERED = 8  # clients: the first half keep the labels, the second half swap them (IFCA Sec. 5's label swap)


def _label_swapped(rows: int = 200, d: int = 10, seed: int = 0):
    """Binary labels sign(<w, x>) for clients 0-3 and the swapped labels for clients 4-7, each client with its
    own training and test rows (a ``natural`` partition): no single linear model fits both halves."""
    g = np.random.default_rng(seed)
    w = g.standard_normal(d)

    def split(n):
        x = g.standard_normal((CLUSTERED * n, d)).astype(np.float32)
        users = np.repeat(np.arange(CLUSTERED), n)
        y = (x @ w > 0).astype(np.int64)
        return x, np.where(users < CLUSTERED // 2, y, 1 - y), users

    (tx, ty, tu), (vx, vy, vu) = split(rows), split(rows // 4)
    return tx, ty, vx, vy, tu, vu


def _clustered_cfg(alg: str, **opts) -> dict:
    return {
        "name": "t",
        "seed": 3,
        "rounds": 15,
        "backend": "loop",
        "dataset": {"name": "python"},
        "partition": {"name": "natural", "num_clients": 0},
        "model": {"name": "logistic"},
        "algorithm": {"name": alg, "clients_per_round": 4, **opts},
        "local": {"epochs": 1, "batch_size": 20, "lr": 0.5},
        "eval": {"personal_test": True} if alg == "fedavg" else {},
        "output": {"progress": False, "plots": False},
    }


def test_one_cluster_is_fedavg_bit_for_bit_with_fedavgs_evaluation_on_the_clients_own_sets():
    fedavg = _algo({**_cfg("fedavg", weighting="uniform"), "eval": {"personal_test": True}})
    ifca = _algo(_cfg("ifca", clusters=1))
    for r in range(3):
        a, b = fedavg.run_round(r), ifca.run_round(r)
        assert a["train_loss"] == b["train_loss"] and b["clusters_picked"] == 1
        assert torch.equal(fedavg.x, ifca.models[0])
    ev_a, ev_b = fedavg.evaluate(3), ifca.evaluate(3)
    for key in ("test_accuracy", "test_loss", "test_accuracy_min"):
        assert ev_a[key] == ev_b[key]
    assert ev_b["clusters_used"] == 1


def test_the_server_averages_each_cluster_over_the_clients_that_picked_it_and_keeps_the_others():
    algo = _algo(_cfg("ifca", clusters=4, local={"steps": 3, "batch_size": 16, "lr": 0.3}))
    seen = []
    train = algo.trainer.train
    algo.trainer.train = lambda *a, **k: seen.append(train(*a, **k)) or seen[-1]
    before = algo.models.clone()
    clients = algo.sample_clients(0)
    losses = algo.cluster_losses(clients)  # line 6 by hand: each client's loss under every cluster model
    algo.run_round(0)
    picks = losses.argmin(axis=0)
    assert np.array_equal(algo.picked, picks)
    (local,) = seen
    for j in range(4):
        mine = np.flatnonzero(picks == j)
        if len(mine) == 0:
            assert torch.equal(algo.models[j], before[j])  # nobody picked it: unchanged
        else:  # line 13: the plain average of the members' local models
            torch.testing.assert_close(algo.models[j], local.params[mine].mean(0), rtol=0, atol=1e-6)
    assert len(set(picks.tolist())) < 4  # 3 clients: at least one cluster kept its model this round


def test_the_clusters_start_from_their_own_initializations_and_the_run_model_is_cluster_0():
    algo = _algo(_cfg("ifca", clusters=3))
    fedavg = _algo(_cfg("fedavg"))
    assert torch.equal(algo.models[0], fedavg.x)
    assert not torch.equal(algo.models[1], algo.models[0]) and not torch.equal(algo.models[2], algo.models[1])
    again = _algo(_cfg("ifca", clusters=3))
    assert torch.equal(again.models, algo.models)  # the ("model_init", j) streams: same seed, same models


def test_ifca_recovers_a_planted_clustering_that_fedavg_cannot_fit(tmp_path):
    data = _label_swapped()
    ifca = fedweave.run(_clustered_cfg("ifca", clusters=2), dataset=data, run_dir=tmp_path / "ifca")
    fedavg = fedweave.run(_clustered_cfg("fedavg"), dataset=data, run_dir=tmp_path / "fedavg")
    algo = ifca.algorithm
    picks = algo.pick(range(CLUSTERED))
    half = CLUSTERED // 2
    assert len(set(picks[:half])) == 1 and len(set(picks[half:])) == 1 and picks[0] != picks[-1]
    final = ifca.metrics[-1]
    assert final["test_accuracy"] > 0.95 and final["test_accuracy_min"] > 0.9 and final["clusters_used"] == 2
    # one linear model for both halves: at best half of each client's labels are wrong for the other half
    assert fedavg.metrics[-1]["test_accuracy"] < 0.7


def test_under_another_task_each_clients_pick_is_scored_by_every_metric_and_the_worst_client():
    task = {"metrics": ["accuracy", "top3"]}
    fedavg = _algo({**_cfg("fedavg", weighting="uniform"), "task": task, "eval": {"personal_test": True}})
    ifca = _algo({**_cfg("ifca", clusters=1), "task": task})
    for r in range(2):
        fedavg.run_round(r), ifca.run_round(r)
    a, b = fedavg.evaluate(2), ifca.evaluate(2)
    for key in ("test_accuracy", "test_top3", "test_loss", "test_accuracy_worst"):
        assert a[key] == b[key]  # one cluster: FedAvg's model, scored as eval.personal_test scores it


def test_the_ledger_bills_every_cluster_model_down_and_one_model_and_its_index_up():
    algo = _algo(_cfg("ifca", clusters=3))
    algo.run_round(0)
    p, n = algo.num_params, algo.hp.clients_per_round
    rows = [(e.sender, e.receiver, e.kind, e.bytes) for e in algo.ledger.entries()]
    assert ("server", "client", "model", n * 3 * p * 4) in rows
    assert ("client", "server", "model", n * (p * 4 + 8)) in rows


def test_resume_continues_identically(tmp_path):
    cfg = {**_cfg("ifca", clusters=3), "rounds": 4}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.models, full.algorithm.models)
    assert resumed.summary["final"]["test_accuracy"] == full.summary["final"]["test_accuracy"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"algorithm": {"name": "ifca", "clusters": 0}}, "algorithm.clusters must be >= 1, got 0"),
        ({"model": {"name": "logistic", "init_from": "w.pt"}}, "model.init_from would start every cluster model"),
        ({"model": {"name": "logistic", "init": "zeros"}}, "model.init: zeros would start every cluster model"),
        ({"aggregator": "median"}, "aggregator: median: algorithm 'ifca'"),
        ({"faults": {"byzantine": {"fraction": 0.25, "attack": "sign_flip"}}}, "faults.byzantine"),
        ({"privacy": {"mechanism": "central", "noise_multiplier": 1.0, "clip": 1.0}}, "privacy"),
        ({"compression": {"upload": {"name": "topk", "fraction": 0.1}}}, "compression.upload"),
        ({"secure_aggregation": {}}, "secure_aggregation: algorithm 'ifca' is refused"),
    ],
)
def test_what_ifca_does_not_handle_is_refused_in_one_line(change, words, tmp_path):
    cfg = {**_cfg("ifca", clusters=2), **change}
    with pytest.raises(ConfigError) as err:
        fedweave.run(cfg, run_dir=tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_backends_agree():
    algos = [_algo(_cfg("ifca", clusters=3, backend=b)) for b in ("loop", "vmap", "pool")]
    for algo in algos:
        for r in range(2):
            algo.run_round(r)
    for other in algos[1:]:
        assert np.array_equal(other.picked, algos[0].picked)
        torch.testing.assert_close(other.models, algos[0].models, rtol=1e-5, atol=1e-6)


def test_eval_distribution_spreads_the_picks_metric_and_eval_per_client_is_refused(tmp_path):
    ev = {"personal_test": True, "distribution": True}
    fedavg = _algo({**_cfg("fedavg", weighting="uniform"), "eval": ev})
    ifca = _algo({**_cfg("ifca", clusters=1), "eval": {"distribution": True}})
    for r in range(2):
        fedavg.run_round(r), ifca.run_round(r)
    a, b = fedavg.evaluate(2), ifca.evaluate(2)
    for key in ("client_test_accuracy_mean", "client_test_accuracy_worst10", "client_test_accuracy_std"):
        assert a[key] == b[key]
    assert ifca.client_values["accuracy"] == fedavg.client_values["accuracy"]
    for name in ("ifca", "fedproto"):
        cfg = {**_cfg(name), "model": {"name": "mlp", "hidden": [8]}, "eval": {"per_client": True}}
        with pytest.raises(ConfigError, match=f"^eval.per_client scores the global model .* algorithm {name} has no"):
            fedweave.run(cfg, run_dir=tmp_path / name)


def test_dropped_clients_are_sent_the_models_and_deliver_nothing():
    algo = _algo({**_cfg("ifca", clusters=2), "faults": {"dropout": 0.5}})
    out = algo.run_round(0)
    sent = [e for e in algo.ledger.entries() if e.sender == "server"]
    got = [e for e in algo.ledger.entries() if e.sender == "client"]
    assert sent[0].count == algo.hp.clients_per_round and len(algo.picked) == out["reported_clients"] < sent[0].count
    assert sum(e.count for e in got) == out["reported_clients"]


def _shared(clusters: int, **opts):
    cfg = {**_cfg("ifca", clusters=clusters, share_body=True, **opts), "model": {"name": "mlp", "hidden": [8]}}
    return _algo(cfg)


def test_weight_sharing_keeps_one_body_moved_by_every_client_and_a_head_per_cluster():
    algo = _shared(3, local={"steps": 3, "batch_size": 16, "lr": 0.3})
    body = algo.shared
    assert body.any() and not body.all()
    for r in range(4):
        before = algo.models.clone()
        algo.run_round(r)
        assert torch.equal(algo.models[:, body], algo.models[0, body].expand(3, -1))  # one body
    heads = algo.models[:, ~body]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])
    # the last round's body moved by the mean of every reporting client's update, whatever their clusters
    assert not torch.equal(algo.models[0, body], before[0, body])
    p, k, n = int(body.sum()), 3, algo.hp.clients_per_round
    down = [e for e in algo.ledger.entries() if e.sender == "server" and e.round == 0][0]
    assert down.bytes == n * (p + k * int((~body).sum())) * 4  # the body once and k heads


def test_weight_sharing_with_one_cluster_is_fedavg_bit_for_bit():
    fedavg = _algo({**_cfg("fedavg", weighting="uniform"), "model": {"name": "mlp", "hidden": [8]}})
    ifca = _shared(1)
    for r in range(3):
        fedavg.run_round(r), ifca.run_round(r)
    assert torch.equal(ifca.models[0], fedavg.x)
