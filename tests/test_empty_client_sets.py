"""Per-client figures average the clients that have a sample in the set they are scored on: a client without one
has no accuracy or loss, and counting it as 0 pulled the means down (a Dirichlet split with min_size 0 leaves
clients empty; a natural split leaves users without test samples)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import fedweave
from fedweave.config import ConfigError, load
from fedweave.execution import evaluate_clients, with_samples

EMPTY = {  # 7 of the 20 clients get no sample
    "name": "e", "seed": 0, "rounds": 2, "dataset": "digits",
    "partition": {"name": "dirichlet", "alpha": 0.01, "num_clients": 20, "min_size": 0},
    "model": {"name": "mlp", "hidden": [16]}, "algorithm": {"name": "fedavg", "clients_per_round": 5},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.1}, "eval": {"every": 1},
    "output": {"progress": False, "plots": False},
}  # fmt: skip


def _run(tmp_path, algorithm: dict, **eval_keys) -> fedweave.Result:
    cfg = copy.deepcopy(EMPTY)
    cfg["algorithm"] = algorithm
    cfg["eval"].update(eval_keys)
    return fedweave.run(load(cfg), run_dir=tmp_path / algorithm["name"])


def _with_data(res: fedweave.Result) -> list[int]:
    _, _, parts = res.algorithm.ctx.personal_test_set()
    return [i for i, p in enumerate(parts) if len(p)]


def test_with_samples_keeps_the_ids_object_when_no_client_is_empty():
    parts = [np.arange(3), np.arange(0), np.arange(2), np.arange(0)]
    assert with_samples(parts).tolist() == [0, 2]
    assert with_samples(parts, np.array([1, 2, 3])).tolist() == [2]
    ids = np.array([0, 2])
    assert with_samples(parts, ids) is ids and with_samples(parts[:1]) is None  # the usual case: as it was
    with pytest.raises(ConfigError, match="no evaluated client has a sample"):
        with_samples(parts, np.array([1, 3]))


def test_the_global_models_per_client_figures_leave_the_empty_clients_out(tmp_path):
    res = _run(tmp_path, {"name": "fedavg", "clients_per_round": 5}, personal_test=True, distribution=True)
    kept = _with_data(res)
    assert 0 < len(kept) < 20  # the split leaves some clients without a sample
    last = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()][-1]
    assert last["clients"] == kept
    row = res.metrics[-1]
    assert row["test_accuracy"] == pytest.approx(np.mean(last["accuracy"]), abs=1e-12)
    assert row["test_loss"] == pytest.approx(np.mean(last["loss"]), abs=1e-12)
    assert row["test_accuracy_min"] == min(last["accuracy"])


def test_a_method_without_a_global_model_lists_and_averages_its_clients_with_data(tmp_path):
    res = _run(tmp_path, {"name": "ifca", "clients_per_round": 5, "clusters": 2}, distribution=True)
    last = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()][-1]
    assert last["clients"] == _with_data(res)  # each value beside the client it is of
    assert res.metrics[-1]["test_accuracy"] == pytest.approx(np.mean(last["accuracy"]), abs=1e-12)


def test_a_personalized_methods_personal_mean_leaves_the_empty_clients_out(tmp_path):
    res = _run(tmp_path, {"name": "fedper", "clients_per_round": 5})
    algo = res.algorithm
    tx, ty, parts = algo.ctx.personal_test_set()
    kept = _with_data(res)
    models = algo.personal_models(1)[torch.as_tensor(kept)]
    accs, losses = evaluate_clients(algo.layout, models, tx, ty, [parts[i] for i in kept], 2048)
    assert res.metrics[-1]["test_accuracy_personal"] == float(accs.mean())
    assert res.metrics[-1]["test_loss_personal"] == float(losses.mean())


def test_the_decentralized_mean_leaves_the_empty_clients_out(tmp_path):
    res = _run(tmp_path, {"name": "dfedavg", "finetune_epochs": 0})
    algo = res.algorithm
    tx, ty, parts = algo.ctx.personal_test_set(algo.hp.test_per_client)
    kept = [i for i, p in enumerate(parts) if len(p)]
    assert 0 < len(kept) < 20
    models = algo.eval_models(1)[torch.as_tensor(kept)]
    accs, losses = evaluate_clients(algo.layout, models, tx, ty, [parts[i] for i in kept], 2048)
    assert res.metrics[-1]["test_accuracy"] == float(accs.mean())
    assert res.metrics[-1]["test_loss"] == float(losses.mean())


def test_a_round_of_only_clients_without_samples_is_logged_as_skipped_with_or_without_faults(tmp_path, caplog):
    # before: only under faults (reported_clients 0) was such a round logged and listed as skipped; without them
    # it passed silently
    cfg = copy.deepcopy(EMPTY)
    cfg.update(rounds=8, eval={"every": 8}, algorithm={"name": "fedavg", "clients_per_round": 1})
    plain = fedweave.run(load(cfg), run_dir=tmp_path / "plain")
    empty = [r + 1 for r in range(8) if not plain.algorithm.holds_data[plain.algorithm.sample_clients(r)].any()]
    assert empty  # the fixture: rounds that sample only a client without samples
    assert plain.summary["skipped_rounds"] == empty
    assert all(f"round {r}: no client reported" in caplog.text for r in empty)
    caplog.clear()
    faulty = fedweave.run(load({**cfg, "faults": {"outage_rounds": [99]}}), run_dir=tmp_path / "faulty")
    assert faulty.summary["skipped_rounds"] == empty
    assert all(f"round {r}: no client reported" in caplog.text for r in empty)


def test_train_loss_averages_the_clients_that_trained_under_uniform_weights():
    """A client without samples takes no step and reports a loss of 0; under ``weighting: uniform`` that 0 entered
    ``train_loss`` with a weight of 1/m and pulled it down. It is the mean over the clients that trained; with
    every client trained the weights are the same (no renormalisation)."""
    from fedweave.algorithms.base import RunContext, build_algorithm

    cfg = copy.deepcopy(EMPTY)
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 5, "weighting": "uniform"}
    algo = build_algorithm(RunContext(load(cfg)))
    sizes = algo.ctx.partition.sizes
    clients = np.concatenate([np.flatnonzero(sizes == 0)[:2], np.flatnonzero(sizes > 0)[:3]])
    res = algo.trainer.train(algo.x, clients, 0)
    assert res.steps.tolist()[:2] == [0, 0] and min(res.steps.tolist()[2:]) > 0
    got = algo.local_metrics(res, algo.weights(clients))["train_loss"]
    assert got == pytest.approx(float(res.loss[2:].mean()), rel=1e-6)
    full = np.flatnonzero(sizes > 0)[:5]
    res = algo.trainer.train(algo.x, full, 0)
    p = algo.weights(full)
    assert algo.local_metrics(res, p)["train_loss"] == float(p @ res.loss)


def test_the_decentralized_train_loss_averages_the_clients_that_trained(tmp_path):
    """The decentralized family's ``train_loss`` averaged every client's loss, an empty client's 0 among them."""
    from fedweave.execution import LocalTrainer

    seen = []
    train = LocalTrainer.train

    def spy(self, *args, **kwargs):
        seen.append(train(self, *args, **kwargs))
        return seen[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(LocalTrainer, "train", spy)
    try:
        res = _run(tmp_path, {"name": "dfedavg"})
    finally:
        mp.undo()
    first = seen[0]  # round 1's local training of every client (dfedavg trains once a round)
    assert (first.steps == 0).any() and (first.steps > 0).any()
    assert res.metrics[0]["train_loss"] == pytest.approx(float(first.loss[first.steps > 0].mean()), rel=1e-6)


def test_the_hierarchical_train_loss_averages_the_jobs_that_trained(tmp_path):
    """``hier_scaffold`` (a plain mean: no weights) averaged every job's loss, an empty client's 0 among them."""
    from fedweave.execution import LocalTrainer

    seen = []
    mp = pytest.MonkeyPatch()
    for name in ("train", "train_with_state"):
        original = getattr(LocalTrainer, name)

        def spy(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            seen.append(out[0] if isinstance(out, tuple) else out)
            return out

        mp.setattr(LocalTrainer, name, spy)
    cfg = copy.deepcopy(EMPTY)
    cfg["model"] = {"name": "logistic"}
    cfg["algorithm"] = {"name": "hier_scaffold", "participation": 1.0, "server_share": 0.3, "test_fraction": 0.1,
                        "tau": 3, "server_data": "none"}  # fmt: skip
    try:
        res = fedweave.run(load(cfg), run_dir=tmp_path / "h")
    finally:
        mp.undo()
    first = next(s for s in seen if len(s.steps) > 1)  # round 1's jobs
    assert (first.steps == 0).any() and (first.steps > 0).any()
    assert res.metrics[0]["train_loss"] == pytest.approx(float(first.loss[first.steps > 0].mean()), rel=1e-6)
