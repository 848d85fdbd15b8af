"""The trackers at the edges of a run: how a run that did not complete ends in each tracker, a run stopped before
its first checkpoint, a tracker package missing, a sweep's worker processes, and a completed run extended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import fedweave
from fedweave.callbacks import Callback
from fedweave.callbacks.trackers import Trackers, WandbTracker, wandb_records
from fedweave.config import ConfigError
from fedweave.errors import DivergenceError


@pytest.fixture(autouse=True)
def _local(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _wandb_exit_code(run_dir) -> int | None:
    """The exit code of the W&B offline run in ``run_dir``, once the service has written its exit record."""
    from wandb.proto import wandb_internal_pb2

    (datafile,) = (run_dir / "wandb").glob("offline-run-*/*.wandb")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for data in wandb_records(datafile.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "exit":
                return rec.exit.exit_code
        time.sleep(0.2)
    return None


def _mlflow_run(run_dir, experiment):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


SUMMARY = {"communication": {"bytes_total": 100}, "rounds": 1}


@pytest.mark.parametrize(
    ("status", "every", "mlflow_status"),
    [
        ("diverged", 0, "FAILED"),
        ("failed", 0, "FAILED"),
        ("interrupted", 0, "KILLED"),
        ("interrupted", 1, "KILLED"),
        ("diverged", 1, "FAILED"),
    ],
)
def test_a_run_that_did_not_complete_is_no_success_in_any_tracker(tmp_path, status, every, mlflow_status):
    # without checkpoints W&B recorded exit code 0 (success) for a diverged, interrupted or failed run, and MLflow
    # said FAILED for an interrupted run that it called KILLED with checkpoints
    t = Trackers(["mlflow", "wandb"], {"name": "x", "output": {"checkpoint_every": every}}, tmp_path)
    t.log_metrics({"round": 1, "test_accuracy": 0.5, "bytes_total": 100})
    t.checkpointed()
    t.finish({**SUMMARY, "status": status}, [])
    assert _wandb_exit_code(tmp_path) == 1
    _, run = _mlflow_run(tmp_path, "x")
    assert run.info.status == mlflow_status


class _Boom(Callback):
    def __init__(self, exc: BaseException, at: int) -> None:
        self.exc, self.at = exc, at

    def after_round(self, run, r):
        if r == self.at:
            raise self.exc


def test_a_failed_run_without_checkpoints_ends_its_wandb_run_with_exit_code_1(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 2, "output": {"progress": False, "plots": False, "trackers": ["wandb"]}}
    with pytest.raises(RuntimeError, match="boom"):
        fedweave.run(cfg, run_dir=tmp_path / "r", callbacks=[_Boom(RuntimeError("boom"), 0)])
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "failed"
    assert _wandb_exit_code(tmp_path / "r") == 1


def test_a_run_stopped_before_its_first_checkpoint_sends_every_row_and_the_summary(toy_config, tmp_path):
    # checkpoint_every: 2 and diverged in round 2: no checkpoint to resume from, so no resume would ever send the
    # rows; they reached no tracker (trackers.json: rows 0)
    out = {"progress": False, "plots": False, "trackers": ["tensorboard", "mlflow"], "checkpoint_every": 2}
    cfg = {**toy_config, "output": out}
    res = fedweave.run(
        cfg, run_dir=tmp_path / "r", on_divergence="return", callbacks=[_Boom(DivergenceError("NaN"), 1)]
    )
    assert res.summary["status"] == "diverged" and not (res.run_dir / "checkpoint.pt").exists()
    assert [r["round"] for r in res.metrics] == [1, 2]
    client, run = _mlflow_run(res.run_dir, "toy")
    hist = client.get_metric_history(run.info.run_id, "test_accuracy")
    assert [(m.step, m.value) for m in hist] == [(r["round"], r["test_accuracy"]) for r in res.metrics]
    assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.info.status == "FAILED"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(res.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ev.Reload()
    assert [e.step for e in ev.Scalars("test_accuracy")] == [1, 2]
    assert json.loads((res.run_dir / "trackers.json").read_text())["mlflow"]["rows"] == 2


def test_a_missing_tracker_package_is_refused_before_anything_is_written(toy_config, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as when it is not installed
    cfg = {**toy_config, "output": {"progress": False, "trackers": ["tensorboard", "mlflow", "wandb"]}}
    with pytest.raises(ConfigError, match=r"output.trackers: wandb needs the wandb package.*fedweave\[wandb\]"):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match=r"output.trackers: wandb needs the wandb package"):
        fedweave.sweep(cfg, {"local.lr": [0.05, 0.1]}, out=tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_trackers_started_before_one_that_fails_to_start_are_closed(tmp_path, monkeypatch):
    # the MLflow run was left RUNNING for ever
    def fails(self, *a, **k):
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(WandbTracker, "start", fails)
    with pytest.raises(RuntimeError, match="no W&B today"):
        Trackers(["tensorboard", "mlflow", "wandb"], {"name": "x"}, tmp_path)
    _, run = _mlflow_run(tmp_path, "x")
    assert run.info.status == "FAILED"


def test_trackers_started_before_an_interrupt_in_another_s_start_are_closed_as_killed(tmp_path, monkeypatch):
    # Ctrl-C (or SIGTERM) while W&B starts: the run ends interrupted, as MLflow then says (it said FAILED)
    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(WandbTracker, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Trackers(["mlflow", "wandb"], {"name": "x"}, tmp_path)
    _, run = _mlflow_run(tmp_path, "x")
    assert run.info.status == "KILLED"


def test_an_extended_run_holds_the_communication_totals_once_per_end(tmp_path):
    # a completed run extended with --resume logged the totals again at step 0: the stale and the new ones both
    # held at one step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"round": r, "test_accuracy": r / 10, "bytes_total": 100 * r} for r in (1, 2, 3)]
    cfg = {"name": "x", "output": {"checkpoint_every": 1}}
    first = Trackers(["tensorboard", "mlflow"], cfg, tmp_path)
    for row in rows[:2]:
        first.log_metrics(row)
        first.checkpointed()
    first.finish({"status": "completed", "rounds": 2, "communication": {"bytes_total": 200}}, [])
    time.sleep(1.1)  # a TensorBoard event file is named by its start to the second
    extended = Trackers(["tensorboard", "mlflow"], cfg, tmp_path, resumed_rows=rows[:2])
    extended.log_metrics(rows[2])
    extended.checkpointed()
    extended.finish({"status": "completed", "rounds": 3, "communication": {"bytes_total": 300}}, [])

    ev = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    ev.Reload()
    assert [(e.step, e.value) for e in ev.Scalars("communication/bytes_total")] == [(2, 200.0), (3, 300.0)]
    assert [e.step for e in ev.Scalars("test_accuracy")] == [1, 2, 3]
    client, run = _mlflow_run(tmp_path, "x")
    hist = client.get_metric_history(run.info.run_id, "communication.bytes_total")
    assert sorted((m.step, m.value) for m in hist) == [(2, 200.0), (3, 300.0)]
    assert run.data.metrics["communication.bytes_total"] == 300.0


@pytest.mark.slow  # a fresh interpreter running a sweep on two worker processes with W&B: about 15 s of CPU
def test_a_sweeps_worker_processes_leave_nothing_in_the_temporary_directory(toy_config, tmp_path):
    """W&B makes its staging folders (tmp*wandb-media, tmp*wandb-artifacts) in the temporary directory when it is
    imported, and removes them when the process exits; a sweep's worker processes exit without Python's exit
    handlers, and left theirs. In a fresh process, which has not imported W&B before the workers start."""
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "WANDB", "XDG"))}
    env |= {"TMPDIR": str(tmp), "HOME": str(home), "WANDB_SILENT": "true"}
    cfg = {**toy_config, "rounds": 1, "output": {"progress": False, "plots": False, "trackers": ["wandb"]}}
    code = (  # the toy dataset is registered by the tests' conftest, imported from the tests' folder
        "import json, sys; sys.path.insert(0, sys.argv[3]); import conftest, fedweave\n"
        "res = fedweave.sweep(json.loads(sys.argv[1]), {'local.lr': [0.05, 0.1]}, out=sys.argv[2], workers=2,"
        " progress=False)\n"
        "assert all(r['status'] == 'completed' for r in res.records), res.records\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg), str(tmp_path / "s"), os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp.iterdir()) == []
    assert len(list((tmp_path / "s" / "runs").glob("*/wandb/offline-run-*"))) == 2


def test_a_sweep_worker_caches_shakespeare_from_the_plays_but_not_from_leaf_json(monkeypatch):
    # asked without the run's options, the conditional mark said "may read user files": never cached
    from fedweave.data.datasets._common import reads_user_files
    from fedweave.data.datasets.shakespeare import _reads_leaf
    from fedweave.experiments.jobs import cache_datasets
    from fedweave.registry import DATASETS

    DATASETS.names()  # the built-in loaders registered
    calls = []

    @reads_user_files(when=_reads_leaf)
    def load(root=None, *, source="auto"):
        calls.append(source)
        return object()

    load.__module__ = "fedweave.data.datasets.shakespeare"  # as the built-in one's
    monkeypatch.setattr(DATASETS, "_items", {**DATASETS._items, "shakespeare": load})
    cache_datasets()
    loader = DATASETS._items["shakespeare"]
    plays = [loader(source="plays") for _ in range(2)]
    leaf = [loader(source="leaf") for _ in range(2)]
    assert plays[0] is plays[1] and leaf[0] is not leaf[1]
    assert calls == ["plays", "leaf", "leaf"]
