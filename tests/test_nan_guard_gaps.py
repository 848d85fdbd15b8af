"""NaN or Inf that reached a run past the divergence guard (docs/reliability.md): an asynchronous method's jobs in
flight and a robust aggregator's center, which the freshly built state lacks; a node's own data file; FedExP's
step size of a NaN row."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedweave
from fedweave.algorithms.centralized.fedexp import fedexp_step_size
from fedweave.callbacks import Callback
from fedweave.checkpoints import CHECKPOINT, encode_checkpoint, floating_tensors, read_checkpoint
from fedweave.config import ConfigError, load
from fedweave.errors import CheckpointError
from fedweave.registry import ATTACKS
from fedweave.robust.attacks import Attack

OUT = {"progress": False, "plots": False, "checkpoint_every": 1}
ASYNC = {"fedasync": {}, "fedbuff": {"concurrency": 4, "buffer_size": 2}}
_NAN = {"on": False}


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, NaN in local training while ``_NAN`` says so (evaluation, without grad, stays finite)."""
    loss = F.cross_entropy(output, target, reduction="none")
    return loss * float("nan") if _NAN["on"] and torch.is_grad_enabled() else loss


class _NanLossIn(Callback):
    """The loss is NaN in the local training of round ``r`` (0-based) only."""

    def __init__(self, r: int) -> None:
        self.r = r

    def on_start(self, run):
        _NAN["on"] = run.start_round == self.r

    def after_round(self, run, r):
        _NAN["on"] = r + 1 == self.r

    def on_end(self, run, summary):
        _NAN["on"] = False


class _Poke(Callback):
    """After round ``r``'s training, a NaN in the first floating tensor of the state under ``prefix``."""

    def __init__(self, r: int, prefix: str) -> None:
        self.r, self.prefix = r, prefix

    def after_training(self, run, r, metrics):
        if r == self.r:
            path, t = next((p, t) for p, t in floating_tensors(run.algo.state_dict()) if p.startswith(self.prefix))
            t.view(-1)[0] = float("nan")
            self.path = path


def _async(toy_config: dict, name: str) -> dict:
    algorithm = {"name": name, "clients_per_round": 3, **ASYNC[name]}
    return {**toy_config, "backend": "loop", "algorithm": algorithm, "output": OUT}


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]


@pytest.mark.parametrize("name", list(ASYNC))
def test_an_asynchronous_clients_nan_result_ends_the_run_at_the_step_that_made_it(toy_config, tmp_path, name):
    cfg = _async(toy_config, name)
    res = fedweave.run(cfg, run_dir=tmp_path / "r", loss=_loss, callbacks=[_NanLossIn(3)], on_divergence="return")
    assert res.summary["status"] == "diverged", res.summary
    assert "round 4: the local training of client" in res.summary["error"]
    assert "is not finite" in res.summary["error"] and "checkpoint of round 3 is kept" in res.summary["error"]
    ckpt = read_checkpoint(tmp_path / "r" / CHECKPOINT)
    assert ckpt["next_round"] == 3 and ckpt["algorithm"]["ys"]
    assert all(bool(torch.isfinite(t).all()) for y, loss in ckpt["algorithm"]["ys"].values() for t in (y, loss))
    # the kept checkpoint is the last good state: continued, the run is the one that never met the NaN
    again = fedweave.resume(tmp_path / "r", loss=_loss)
    clean = fedweave.run(cfg, run_dir=tmp_path / "clean", loss=_loss)
    assert again.summary["status"] == "completed" and _strip(again.metrics) == _strip(clean.metrics)


CLIPPED = {"aggregator": {"name": "centered_clipping"}}


def _config(toy_config: dict, name: str, section: dict) -> dict:
    return {**(_async(toy_config, name) if name in ASYNC else {**toy_config, "output": OUT}), **section}


# tensors the freshly built state lacks: the jobs in flight (their start and result), the clipping center
@pytest.mark.parametrize(
    ("name", "section", "prefix"),
    [("fedasync", {}, "ys."), ("fedbuff", {}, "starts."), ("fedavg", CLIPPED, "robust.center")],
)
def test_a_state_gone_nan_where_the_built_algorithm_held_nothing_is_never_written(
    toy_config, tmp_path, name, section, prefix
):
    cfg = _config(toy_config, name, section)
    poke = _Poke(2, prefix)
    res = fedweave.run(cfg, run_dir=tmp_path / "r", callbacks=[poke], on_divergence="return")
    assert res.summary["status"] == "diverged"
    assert f"round 3: the algorithm state '{poke.path}' is not finite" in res.summary["error"]
    assert read_checkpoint(tmp_path / "r" / CHECKPOINT)["next_round"] == 2


@pytest.mark.parametrize(
    ("name", "section", "prefix"),
    [("fedbuff", {}, "ys."), ("fedavg", CLIPPED, "robust.center")],
)
def test_a_checkpoint_with_nan_where_the_built_algorithm_held_nothing_is_damaged(
    toy_config, tmp_path, name, section, prefix
):
    cfg = {**_config(toy_config, name, section), "rounds": 2}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    state = read_checkpoint(tmp_path / "r" / CHECKPOINT)
    path, t = next((p, t) for p, t in floating_tensors(state["algorithm"]) if p.startswith(prefix))
    t.view(-1)[0] = float("nan")
    (tmp_path / "r" / CHECKPOINT).write_bytes(encode_checkpoint(state))
    with pytest.raises(CheckpointError, match=f"is damaged: its algorithm state '{path}' holds NaN or Inf"):
        fedweave.resume(tmp_path / "r", ["rounds=4"])


def test_a_nan_marker_of_the_built_state_is_still_not_divergence(toy_config, tmp_path):
    # power-of-choice keeps NaN as 'loss not seen yet' for the clients it has not asked
    cfg = {**toy_config, "sampler": {"name": "power_of_choice"}, "output": OUT}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    last = read_checkpoint(tmp_path / "r" / CHECKPOINT)["algorithm"]["sampler_context"]["last_loss"]
    assert res.summary["status"] == "completed" and bool(last.isnan().any())
    assert fedweave.resume(tmp_path / "r", ["rounds=6"]).summary["status"] == "completed"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nodes_data_file_with_nan_or_inf_is_refused_naming_it(toy_config, tmp_path, bad):
    pytest.importorskip("flwr")
    from fedweave.deploy.client_app import _trainer

    x = np.random.default_rng(0).normal(size=(30, 2)).astype(np.float32)
    x[3, 1] = bad
    path = tmp_path / "client-0.npz"
    np.savez(path, x=x, y=np.arange(30) % 3)
    config = json.dumps(load(toy_config).to_dict())
    with pytest.raises(ConfigError, match=re.escape(f"node data {path}': its training features hold NaN or infinite")):
        _trainer(config, str(path), 0, 3)
    np.savez(path, x=np.nan_to_num(x, posinf=0.0), y=np.arange(30) % 4)
    with pytest.raises(ConfigError, match=r"train_y holds labels 0..3, but the Dataset declares num_classes 3"):
        _trainer(config, str(path), 0, 3)


def test_a_split_nodes_data_file_with_nan_is_refused_naming_it(toy_config, tmp_path):
    """A split-learning node built its dataset from the file as the other nodes did, unchecked."""
    pytest.importorskip("flwr")
    from fedweave.deploy.split import node_algorithm

    x = np.random.default_rng(0).normal(size=(30, 2)).astype(np.float32)
    x[3, 1] = float("nan")
    path = tmp_path / "client-0.npz"
    np.savez(path, x=x, y=np.arange(30) % 3)
    config = json.dumps(load({**toy_config, "algorithm": {"name": "fsl_mc"}, "model": {"name": "mlp"}}).to_dict())
    with pytest.raises(ConfigError, match=re.escape(f"node data {path}': its training features hold NaN or infinite")):
        node_algorithm(config, str(path), 0, 3)


def _step_size_before(updates, mean, eps, weights=None) -> float:
    """FedExP's step size as it was computed before: ``max(1, ratio)``, which is 1 for a NaN ratio."""
    if weights is None:
        return max(1.0, float(updates.pow(2).sum() / (2 * updates.shape[0] * (mean.pow(2).sum() + eps))))
    return max(1.0, float(weights @ updates.pow(2).sum(1) / (2 * (mean.pow(2).sum() + eps))))


def test_fedexp_step_size_of_a_nan_row_is_nan_and_of_finite_rows_the_same_bits():
    g = torch.Generator().manual_seed(0)
    rows, p = torch.randn(5, 7, generator=g), torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    got = []
    for mean, weights in ((rows.mean(0), None), (p @ rows, p), (rows.mean(0) * 40, None), (p @ rows * 40, p)):
        got.append(fedexp_step_size(rows, mean, 1e-3, weights))
        assert got[-1] == _step_size_before(rows, mean, 1e-3, weights)
        bad = rows.clone()
        bad[1, 2] = float("nan")
        assert np.isnan(fedexp_step_size(bad, mean, 1e-3, weights))
        assert _step_size_before(bad, mean, 1e-3, weights) == 1.0
        bad[1, 2] = float("inf")
        assert fedexp_step_size(bad, mean, 1e-3, weights) == float("inf")
    assert got[2] == got[3] == 1.0 and min(got[:2]) > 1.0  # both sides of max(1, ratio)


class _NanRows(Attack):
    """Each attacker sends NaN in its update's first entry."""

    name = "_nan_rows"

    def __call__(self, own, honest, info):
        out = own.clone()
        out[:, 0] = float("nan")
        return out


def test_fedexp_with_a_nan_row_the_median_leaves_out_diverges_instead_of_stepping_by_one(
    toy_config, tmp_path, monkeypatch
):
    # registered for this test only: the committed robustness tables list every registered attack
    monkeypatch.setitem(ATTACKS._items, "_nan_rows", _NanRows)
    cfg = {**toy_config, "algorithm": {"name": "fedexp", "clients_per_round": 6}, "aggregator": {"name": "median"}}
    cfg["faults"] = {"byzantine": {"clients": [0, 1, 2], "attack": "_nan_rows"}}
    res = fedweave.run(cfg, run_dir=tmp_path / "r", on_divergence="return")
    assert res.summary["status"] == "diverged", [r.get("server_step_size") for r in res.metrics]
    assert "server_step_size=nan" in res.summary["error"]
