"""Trackers read back with their own libraries: TensorBoard events, the MLflow file store, W&B offline runs."""

from __future__ import annotations

import json
import os
import time

import pytest

import fedweave
from fedweave.callbacks.trackers import HISTORY, Trackers, wandb_records, wandb_steps
from fedweave.config import ConfigError


def _same(pairs, rows):
    """(step, value) pairs equal the rows' (round, test_accuracy); TensorBoard keeps values as float32."""
    assert [p[0] for p in pairs] == [r["round"] for r in rows]
    assert [p[1] for p in pairs] == pytest.approx([r["test_accuracy"] for r in rows], rel=1e-6)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _run(toy_config, tmp_path, trackers, name="r"):
    cfg = {**toy_config, "output": {"progress": False, "plots": True, "trackers": trackers}}
    return fedweave.run(cfg, run_dir=tmp_path / name)


def test_tensorboard_events_hold_every_metric_row_and_the_plots(toy_config, tmp_path):
    res = _run(toy_config, tmp_path, ["tensorboard"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(res.run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    ev.Reload()
    acc = ev.Scalars("test_accuracy")
    _same([(e.step, e.value) for e in acc], res.metrics)
    by_bytes = ev.Scalars("by_bytes/test_accuracy")
    assert [e.step for e in by_bytes] == [r["bytes_total"] for r in res.metrics]
    assert ev.Scalars("communication/bytes_total")[0].value == res.summary["communication"]["bytes_total"]
    assert "test_accuracy_vs_rounds" in ev.Tags()["images"]
    assert "config" in " ".join(ev.Tags()["tensors"])


def test_mlflow_file_store_holds_params_metrics_and_artifacts(toy_config, tmp_path, monkeypatch):
    res = _run(toy_config, tmp_path, ["mlflow"])
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=(res.run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert run.data.params["local.lr"] == str(toy_config["local"]["lr"])
    hist = client.get_metric_history(run.info.run_id, "test_accuracy")
    _same([(m.step, m.value) for m in hist], res.metrics)
    assert run.data.metrics["communication.bytes_up"] == res.summary["communication"]["bytes_up"]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "summary.json", "test_accuracy_vs_rounds.png"} <= names
    assert run.info.status == "FINISHED"


def _wandb_read(datafile):
    """The records of an offline W&B run file, once it holds the run's exit record."""
    from wandb.proto import wandb_internal_pb2

    # the W&B service process may still be writing the file when finish() returns: read it once it holds the
    # run's exit record
    deadline = time.monotonic() + 30
    while True:
        records = []
        for data in wandb_records(datafile.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_wandb_offline_run_directory_holds_the_history(toy_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    res = _run(toy_config, tmp_path, ["wandb"])
    (offline,) = (res.run_dir / "wandb").glob("offline-run-*")
    (datafile,) = offline.glob("*.wandb")
    records = _wandb_read(datafile)
    history, config = [], None
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif rec.WhichOneof("record_type") == "run":
            config = {_key(i): json.loads(i.value_json) for i in rec.run.config.update}
    accs = [(h["_step"], h["test_accuracy"]) for h in history if "test_accuracy" in h]
    _same(accs, res.metrics)
    assert config["local"]["lr"] == toy_config["local"]["lr"]


def test_an_unknown_tracker_is_one_clear_line(toy_config):
    with pytest.raises(ConfigError, match="output.trackers: unknown tracker 'neptune'"):
        fedweave.run({**toy_config, "output": {"trackers": ["neptune"]}})


def test_a_missing_extra_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mlflow(name, *a, **k):
        if name == "mlflow":
            raise ImportError("no module named mlflow")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(ConfigError, match=r"pip install 'fedweave\[mlflow\]'"):
        Trackers(["mlflow"], {}, tmp_path)


def test_a_sweep_groups_its_runs(toy_config, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow

    cfg = {**toy_config, "rounds": 2, "output": {"progress": False, "plots": False, "trackers": ["mlflow"]}}
    res = fedweave.sweep(cfg, {"local.lr": [0.05, 0.1]}, out=tmp_path / "lr-sweep", progress=False)
    for rec in res.records:
        client = mlflow.MlflowClient(tracking_uri=(res.out_dir / rec["run_dir"] / "mlruns").resolve().as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("lr-sweep").experiment_id])
        assert run.data.tags["sweep"] == "lr-sweep" and run.data.params["local.lr"] == str(rec["local.lr"])


def test_mlflow_takes_the_transfer_names_of_scaffold(toy_config, tmp_path, monkeypatch):
    # SCAFFOLD's transfers are named like "client->server:update+control_delta"; MLflow refuses '+' in a name
    cfg = {**toy_config, "rounds": 2, "algorithm": {"name": "scaffold", "clients_per_round": 4}}
    res = _run(cfg, tmp_path, ["mlflow"])
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=(res.run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    by_transfer = res.summary["communication"]["by_transfer"]
    assert any("+" in name for name in by_transfer)
    for name, kind in by_transfer.items():
        key = "communication.by_transfer." + name.replace("->", "_to_").replace(":", "_").replace("+", "_") + ".bytes"
        assert run.data.metrics[key] == kind["bytes"]
    hist = client.get_metric_history(run.info.run_id, "test_accuracy")
    _same([(m.step, m.value) for m in hist], res.metrics)
    assert run.info.status == "FINISHED"


def test_a_resumed_run_continues_each_tracker_run_which_holds_exactly_metrics_csv(toy_config, tmp_path, monkeypatch):
    """Stopped after its round-3 checkpoint, when rows 4-5 had been written, then resumed: one tracker run each
    (one W&B id, one MLflow run, one TensorBoard directory), holding every column of every row of
    metrics.csv once, with the values of metrics.csv."""
    import csv

    import numpy as np

    import fedweave.checkpoints as checkpoints
    from fedweave.errors import RunInterrupted
    from fedweave.runner import resume

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trackers = ["tensorboard", "mlflow", "wandb"]
    cfg = {**toy_config, "rounds": 6, "output": {"progress": False, "plots": False, "trackers": trackers,
                                                 "checkpoint_every": 3}}  # fmt: skip
    save = checkpoints.save_checkpoint

    def stop_at_six(run, algo, next_round, *a, **k):
        if next_round == 6:  # as Ctrl-C after round 6's row, before its checkpoint
            raise KeyboardInterrupt
        save(run, algo, next_round, *a, **k)

    monkeypatch.setattr(checkpoints, "save_checkpoint", stop_at_six)
    with pytest.raises(RunInterrupted):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    monkeypatch.setattr(checkpoints, "save_checkpoint", save)
    res = resume(tmp_path / "r")
    with open(res.run_dir / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows == [
        {k: float(v) for k, v in r.items()} for r in res.metrics
    ]
    want = {k: [(int(r["round"]), r[k]) for r in rows if k in r] for k in rows[0]}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(res.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ev.Reload()
    for k, pairs in want.items():  # TensorBoard keeps float32
        assert [(e.step, e.value) for e in ev.Scalars(k)] == [(s, float(np.float32(v))) for s, v in pairs], k

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(res.run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    for k, pairs in want.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] == pairs, k
    assert run.info.status == "FINISHED"

    runs = sorted((res.run_dir / "wandb").glob("offline-run-*"))  # one per session, in time order
    history, ids = [], set()
    for d in runs:
        (datafile,) = d.glob("*.wandb")
        for rec in _wandb_read(datafile):
            if rec.WhichOneof("record_type") == "history":
                history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
            elif rec.WhichOneof("record_type") == "run":
                ids.add(rec.run.run_id)
    assert len(runs) == 2 and len(ids) == 1  # two sessions of one W&B run
    for k, pairs in want.items():
        assert [(h["_step"], h[k]) for h in history if k in h] == pairs, k


def test_a_resumed_runs_tensorboard_directory_removed_since_is_written_again_in_full(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"round": r, "test_accuracy": r / 10, "bytes_total": 100 * r} for r in (1, 2, 3)]
    (tmp_path / "trackers.json").write_text(json.dumps({"tensorboard": {"run_id": "tensorboard", "rows": 2}}))
    t = Trackers(["tensorboard"], {"name": "x", "output": {"checkpoint_every": 1}}, tmp_path, resumed_rows=rows)
    t.finish({"status": "completed", "communication": {"bytes_total": 300}}, [])
    ev = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    ev.Reload()
    assert [e.step for e in ev.Scalars("test_accuracy")] == [1, 2, 3]


def test_a_resumed_wandb_run_gets_the_rows_its_killed_session_never_wrote(tmp_path, monkeypatch):
    # W&B's service writes the offline run file on its own time: a process killed with SIGKILL lost rows that
    # trackers.json counted as sent, and the resume sent only the rows after the count (a run killed at its
    # 19th row held rounds 19 to 30 only). The resume now reads the earlier sessions' files back.
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [{"round": r, "test_accuracy": r / 10, "bytes_total": 100 * r} for r in (1, 2, 3)]
    cfg = {"name": "x", "output": {"checkpoint_every": 1}}
    first = Trackers(["wandb"], cfg, tmp_path)
    first.log_metrics(rows[0])
    first.checkpointed()
    first.finish({"status": "interrupted"}, [])
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]["run_id"]
    (session,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    _wandb_read(session / f"run-{run_id}.wandb")  # (once W&B has written it)
    assert wandb_steps(tmp_path / "wandb", run_id) == {(HISTORY, 1): 1}
    # as after a kill: rows 2 and 3 counted as sent, never written
    (tmp_path / "trackers.json").write_text(json.dumps({"wandb": {"run_id": run_id, "rows": 3}}))
    time.sleep(1.1)  # a session's directory is named by its start to the second: a resume's own one
    resumed = Trackers(["wandb"], cfg, tmp_path, resumed_rows=rows)
    resumed.finish({"status": "completed", "communication": {"bytes_total": 300}}, [])
    sessions = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    history = []
    for d in sessions:
        for rec in _wandb_read(d / f"run-{run_id}.wandb"):
            if rec.WhichOneof("record_type") == "history":
                history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
    assert len(sessions) == 2 and [(h["_step"], h["test_accuracy"]) for h in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]


@pytest.mark.slow  # a fresh interpreter with MLflow: about 5 s of CPU
def test_mlflow_sends_no_telemetry_and_writes_nothing_outside_the_run_directory(tmp_path):
    """MLflow 3 records usage telemetry by default (an installation id in ~/.config/mlflow, events sent to its
    servers): a run's MLflow store must stay local, so the tracker turns it off unless the user chose.
    In a fresh process without pytest's variables, which MLflow itself reads as 'testing: no telemetry'."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "MLFLOW", "DO_NOT_TRACK"))}
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    code = (
        "import sys; from pathlib import Path; from fedweave.callbacks.trackers import Trackers\n"
        "t = Trackers(['mlflow'], {'name': 'x'}, Path(sys.argv[1]))\n"
        "from mlflow.telemetry.utils import is_telemetry_disabled\n"
        "print(is_telemetry_disabled())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
    assert not list((home / ".config").rglob("*")), "MLflow wrote outside the run directory"


def test_a_run_stopped_while_it_sent_a_checkpoints_rows_resumes_with_each_row_once(toy_config, tmp_path, monkeypatch):
    """Ctrl-C (or SIGKILL) while the trackers were sent the rows 4-6 of the round-6 checkpoint: TensorBoard had
    them all and MLflow row 4, but trackers.json still counted 3 rows; the resume sent rows 4-6 again, so
    TensorBoard held them twice and MLflow row 4. Each tracker that reads its run back logs what it lacks."""
    import numpy as np

    from fedweave.callbacks.trackers import MLflowTracker
    from fedweave.errors import RunInterrupted
    from fedweave.runner import resume

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = {"progress": False, "plots": False, "trackers": ["tensorboard", "mlflow"], "checkpoint_every": 3}
    cfg = {**toy_config, "rounds": 9, "output": out}
    log = MLflowTracker.log_metrics

    def stop_after_row_4(self, row):
        log(self, row)
        if row["round"] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(MLflowTracker, "log_metrics", stop_after_row_4)
    with pytest.raises(RunInterrupted):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert json.loads((tmp_path / "r" / "trackers.json").read_text())["mlflow"]["rows"] == 3
    monkeypatch.setattr(MLflowTracker, "log_metrics", log)
    res = resume(tmp_path / "r")
    assert [r["round"] for r in res.metrics] == list(range(1, 10))
    want = {k: [(r["round"], float(r[k])) for r in res.metrics if r.get(k) is not None] for k in res.metrics[0]}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(res.run_dir / "tensorboard"), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    ev.Reload()
    for k, pairs in want.items():  # TensorBoard keeps float32
        assert [(e.step, e.value) for e in ev.Scalars(k)] == [(s, float(np.float32(v))) for s, v in pairs], k
    assert [e.step for e in ev.Scalars("by_bytes/test_accuracy")] == [r["bytes_total"] for r in res.metrics]

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(res.run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    for k, pairs in want.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] == pairs, k
    by_bytes = client.get_metric_history(run.info.run_id, "by_bytes.test_accuracy")
    assert [m.step for m in by_bytes] == [r["bytes_total"] for r in res.metrics]
    assert run.info.status == "FINISHED"


@pytest.mark.slow  # runs and a sweep with every tracker: about 6 s of CPU
def test_runs_and_a_sweeps_runs_write_nothing_outside_their_run_directories(toy_config, tmp_path, monkeypatch):
    """W&B logs through one service process per Python process, which wrote its own logs to
    ~/.cache/wandb/logs. With every tracker, a run and each run of a sweep (in this process, and in worker
    processes) write nothing to an empty home, and leave nothing in an empty temporary directory; each run
    directory holds its W&B offline run and the logs of the service that wrote it. (Worker processes of a
    process that has not imported W&B yet: tests/test_trackers_edges.py.)"""
    import tempfile

    import matplotlib.font_manager  # noqa: F401
    import wandb  # noqa: F401

    from fedweave.results import read_metrics

    # matplotlib finds its config and font cache directories (in the home) once, at import, and W&B makes its
    # staging folders in the temporary directory at import, removed when this process exits: imported first,
    # they stay where they were; what the trackers write is the question here
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # read once, at the first use
    for var, sub in [("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache"),
                     ("XDG_DATA_HOME", ".local/share"), ("XDG_STATE_HOME", ".local/state")]:  # fmt: skip
        monkeypatch.setenv(var, str(home / sub))
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trackers = ["tensorboard", "mlflow", "wandb"]
    cfg = {**toy_config, "rounds": 2, "output": {"progress": False, "plots": True, "trackers": trackers}}
    run_dirs = [fedweave.run(cfg, run_dir=tmp_path / "one").run_dir]
    for workers in (1, 2):
        res = fedweave.sweep(
            cfg, {"local.lr": [0.05, 0.1]}, out=tmp_path / f"sweep-{workers}", workers=workers, progress=False
        )
        run_dirs += [res.out_dir / rec["run_dir"] for rec in res.records]
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert not written, f"written outside the run directories: {written}"
    left = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))
    assert not left, f"left in the temporary directory: {left}"
    assert "WANDB_CACHE_DIR" not in os.environ  # the caller's environment, as it was
    for run_dir in run_dirs:
        (offline,) = (run_dir / "wandb").glob("offline-run-*")
        (datafile,) = offline.glob("*.wandb")
        history = [
            {_key(i): json.loads(i.value_json) for i in rec.history.item}
            for rec in _wandb_read(datafile)
            if rec.WhichOneof("record_type") == "history"
        ]
        _same([(h["_step"], h["test_accuracy"]) for h in history if "test_accuracy" in h], read_metrics(run_dir))
        logs = sorted(p.name.split("-")[0] for p in (run_dir / "wandb" / "cache").rglob("*-debug-*.log"))
        # this run's own service (one core), ended with the run; W&B's system monitor may start again within
        # the service under load (a second, empty symon log a second later), which is W&B's own
        assert logs.count("core") == 1 and set(logs) == {"core", "symon"}, (run_dir, logs)
