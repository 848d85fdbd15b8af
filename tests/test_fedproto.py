"""FedProto (Tan et al. 2022): the prototype term, the prototypes (Eq. 3) and their aggregation (Eq. 6) by hand,
lambda = 0 as plain local training of each client's own model, the pull towards the prototypes, the ledger,
backends, resume and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedweave
from fedweave.algorithms.centralized.personal.fedproto import PrototypeRule
from fedweave.config import ConfigError, load
from fedweave.registry import PARTITIONERS
from fedweave.runner import run as run_config
from tests.test_centralized import _algo, _cfg

MLP = {"name": "mlp", "hidden": [8]}


def _proto(rounds: int = 3, model: dict | None = None, **opts) -> dict:
    return {**_cfg("fedproto", rounds=rounds, **opts), "model": model or MLP}


def test_the_prototype_term_is_lambda_times_the_mean_squared_distance_to_the_class_prototype():
    class Identity:  # the representation is the input itself
        @staticmethod
        def features(w, x):
            return x + 0 * w.sum()

    protos = torch.tensor([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]])
    known = torch.tensor([True, True, False])
    x = torch.tensor([[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]])
    y = torch.tensor([0, 1, 2])
    term = PrototypeRule(0.5, protos, known).extra_loss(torch.zeros(3), x, y, 0, Identity())
    # (1-1)^2+(0-2)^2 = 4 -> mean 2; 9+16 = 25 -> 12.5; class 2 has no global prototype: 0
    assert torch.equal(term, torch.tensor([0.5 * 2.0, 0.5 * 12.5, 0.0]))


@pytest.mark.parametrize("weighting", ["clients", "samples"])
def test_the_global_prototypes_are_eq6_over_the_clients_eq3_prototypes(weighting):
    algo = _algo(_proto(prototype_weighting=weighting))
    clients = algo.sample_clients(0)
    algo.run_round(0)
    models = algo.store.rows("personal", clients)  # their models after the round
    ds = algo.ctx.dataset
    per_client = []  # client -> {class: (sum of representations, count)}
    for k, c in enumerate(clients):
        rows = torch.as_tensor(algo.ctx.partition[int(c)])
        z = algo.layout.features(models[k], ds.train_x[rows]).detach()
        labels = ds.train_y[rows]
        per_client.append({int(j): (z[labels == j].sum(0), int((labels == j).sum())) for j in labels.unique()})
    for j in range(algo.num_classes):
        held = [p[j] for p in per_client if j in p]
        if not held:
            assert not algo.known[j]
            continue
        if weighting == "clients":  # the plain mean of the clients' class means (the authors' code)
            want = torch.stack([s / n for s, n in held]).mean(0)
        else:  # sum_i |D_ij| C_i^(j) / N_j
            want = torch.stack([s for s, _ in held]).sum(0) / sum(n for _, n in held)
        assert algo.known[j]
        torch.testing.assert_close(algo.protos[j], want, rtol=1e-5, atol=1e-6)


def test_lambda_zero_is_each_client_training_its_own_model_alone_bit_for_bit():
    algo, replay = _algo(_proto(lam=0.0)), _algo(_proto(lam=0.0))
    for r in range(3):
        algo.run_round(r)
        clients = replay.sample_clients(r)
        start = replay.store.rows("personal", clients)
        local = replay.trainer.train(start, clients, r, lr=replay.trainer.lr(r))
        replay.store.set_rows("personal", clients, local.params)
    assert torch.equal(algo.store["personal"], replay.store["personal"])
    pulled = _algo(_proto(lam=1.0))
    for r in range(3):
        pulled.run_round(r)
    assert not torch.equal(pulled.store["personal"], algo.store["personal"])  # from round 2 on L_R acts


def _spread(algo) -> float:
    """How far the clients' class prototypes lie from the global ones, squared, averaged over (client, class)."""
    clients = np.arange(algo.ctx.num_clients)
    sums, counts = algo.class_sums(algo.store["personal"], clients)
    has = counts > 0
    means = sums[has] / counts[has].unsqueeze(1)
    return float((means - algo.protos.expand(len(clients), -1, -1)[has]).pow(2).sum(1).mean())


def test_the_prototype_term_pulls_the_clients_representations_towards_the_global_prototypes():
    free, pulled = _algo(_proto(rounds=8, lam=0.0)), _algo(_proto(rounds=8, lam=10.0))
    for r in range(8):
        free.run_round(r), pulled.run_round(r)
    assert _spread(pulled) < 0.5 * _spread(free)


def test_the_ledger_bills_the_known_prototypes_down_and_each_clients_classes_up():
    """Counted by hand: up, each client's classes at D float32 values and 8 bytes (class id, count); down, the
    classes known before the round at D values and their 4-byte class ids (before: the ids went unbilled)."""
    cfg = {**_proto(), "partition": {"name": "pathological", "num_clients": 8, "classes_per_client": 1}}
    algo = _algo(cfg)
    algo.run_round(0)
    algo.run_round(1)
    d, n = algo.dim, algo.hp.clients_per_round
    rows = {(e.round, e.sender, e.kind): e.bytes for e in algo.ledger.entries()}
    held = [{int(j) for j in algo.ctx.dataset.train_y[algo.ctx.partition[int(c)]].unique()} for c in algo.sampler(0)]
    known = set().union(*held)  # the classes round 0's clients reported: round 1's global prototypes
    assert (d, n, len(known), algo.num_classes) == (8, 3, 3, 4)  # three of the four classes known in round 1
    assert rows[(0, "server", "prototypes")] == 0  # nothing known yet
    assert rows[(1, "server", "prototypes")] == n * len(known) * (d * 4 + 4) == 3 * 3 * 36  # 324 (288 without ids)
    for r in (0, 1):
        clients = algo.sampler(r)
        classes = sum(len(np.unique(algo.ctx.dataset.train_y[algo.ctx.partition[int(c)]])) for c in clients)
        assert rows[(r, "client", "prototypes")] == classes * (d * 4 + 8) == 3 * 40  # one class each


def test_loop_and_vmap_agree():
    algos = [_algo({**_proto(), "backend": b}) for b in ("loop", "vmap")]
    for algo in algos:
        for r in range(3):
            algo.run_round(r)
    torch.testing.assert_close(algos[0].store["personal"], algos[1].store["personal"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(algos[0].protos, algos[1].protos, rtol=1e-5, atol=1e-6)


def test_resume_continues_identically(tmp_path):
    cfg = _proto(rounds=4)
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.store["personal"], full.algorithm.store["personal"])
    assert torch.equal(resumed.algorithm.protos, full.algorithm.protos)
    for key in ("test_accuracy", "test_loss", "test_accuracy_min", "test_accuracy_proto"):
        assert resumed.summary["final"][key] == full.summary["final"][key]


def test_a_model_without_features_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        fedweave.run(_proto(), model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(36, 4)), run_dir=tmp_path / "r")
    assert str(err.value).startswith("algorithm fedproto shares the representations of model.features(), but ")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"algorithm": {"name": "fedproto", "lam": -1.0}}, "algorithm.lam must be in [0, 3.40282e+38], got -1.0"),
        ({"algorithm": {"name": "fedproto", "server_lr": 0.5}}, "algorithm.server_lr: FedProto's server sets"),
        ({"aggregator": "median"}, "aggregator: median: algorithm 'fedproto'"),
        ({"privacy": {"mechanism": "central", "noise_multiplier": 1.0, "clip": 1.0}}, "privacy"),
        ({"compression": {"upload": {"name": "topk", "fraction": 0.1}}}, "compression.upload"),
    ],
)
def test_what_fedproto_does_not_handle_is_refused_in_one_line(change, words, tmp_path):
    with pytest.raises(ConfigError) as err:
        fedweave.run({**_proto(), **change}, run_dir=tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_only_the_clients_that_report_send_prototypes_and_train():
    algo = _algo({**_proto(), "faults": {"dropout": 0.5}})
    before = algo.store["personal"].clone()
    out = algo.run_round(0)
    got = [e for e in algo.ledger.entries() if e.sender == "client"]
    assert sum(e.count for e in got) == out["reported_clients"] < algo.hp.clients_per_round
    moved = (algo.store["personal"] != before).any(1)
    assert int(moved.sum()) == out["reported_clients"]  # a dropped client's model is as it was


if "_first_empty" not in PARTITIONERS._items:  # client 0 holds no sample (a dirichlet split with min_size: 0)

    @PARTITIONERS.register("_first_empty")
    def _first_empty(labels, num_clients, rng, *, users=None):
        return [np.arange(0), *np.array_split(np.arange(len(labels)), num_clients - 1)]


def test_a_client_without_training_samples_trains_nothing_and_sends_no_prototype():
    algo = _algo({**_proto(clients_per_round=8), "partition": {"name": "_first_empty", "num_clients": 8}})
    before = algo.store["personal"][0].clone()
    for r in range(2):
        algo.run_round(r)
        sent = {e.sender: e.bytes for e in algo.ledger.entries() if e.round == r}["client"]
        classes = sum(len(np.unique(algo.ctx.dataset.train_y[algo.ctx.partition[c]])) for c in range(1, 8))
        assert sent == classes * (algo.dim * 4 + 8)  # client 0's message holds no class
    assert torch.equal(algo.store["personal"][0], before)
    assert bool(algo.known.all())
