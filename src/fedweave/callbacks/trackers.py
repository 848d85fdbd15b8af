"""Experiment trackers (TensorBoard, MLflow, Weights & Biases), called by the run's :class:`TrackerCallback`.

Each tracker is started once, gets ``log_metrics`` for every metric row and ``finish`` with the summary and
the plots. Each tracker logs the resolved config, every row (stepped by round, and by total bytes), the ledger's
totals per transfer kind and the final summary. Everything stays local by default: MLflow writes a file store
and W&B an offline run, both inside the run directory. A run inside a sweep directory is grouped by that sweep.

A resumed run continues the same tracker runs (their ids are kept in the run directory's ``trackers.json``)
and the trackers end up holding exactly the rows of ``metrics.csv``: with checkpoints on, a row reaches the
trackers once a checkpoint holds it (rows after the last checkpoint are recomputed on resume), and a run that
ends otherwise than completed keeps its tracker runs open for the resume. A run that ended otherwise than
completed is never a success in any tracker (:func:`mlflow_status`, W&B's exit code 1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedweave.callbacks import Callback
from fedweave.config import ConfigError

_EXTRA = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # tracker -> its package, its extra


def _missing(name: str) -> str:
    package = _EXTRA[name]
    return f"output.trackers: {name} needs the {package} package; install it with pip install 'fedweave[{package}]'"


def check_installed(names: list[str]) -> None:
    """Refuse a tracker whose package is not installed, one :class:`ConfigError` line, without importing it: a run
    checks this before it writes anything (:func:`fedweave.runner.check_run`), a sweep for every point before
    its first run (the run directory held a failed run, and its first trackers' runs were left open)."""
    for name in names:
        try:
            found = importlib.util.find_spec(_EXTRA[name]) is not None
        except ValueError:  # imported already, without a spec (a module made in memory): present
            found = True
        if not found:
            raise ConfigError(_missing(name))


def mlflow_status(status: str) -> str:
    """The MLflow status of a run that ended with ``status``, with checkpoints or without: completed FINISHED,
    interrupted or stopped (from outside) KILLED, diverged or failed FAILED."""
    return "FINISHED" if status == "completed" else "KILLED" if status in ("interrupted", "stopped") else "FAILED"


def _numbers(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a nested dict, keys joined with '/'."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def sweep_group(run_dir: Path) -> str | None:
    """The sweep a run belongs to: the name of ``SWEEP/runs/<run>``'s SWEEP when it holds sweep.json."""
    sweep = run_dir.resolve().parent.parent
    return sweep.name if (sweep / "sweep.json").is_file() else None


class Tracker:
    """One tracker. ``start`` opens a new tracker run, or continues the one named ``run_id`` (a resumed run);
    ``run_id`` afterwards names the run to continue. ``close`` ends a run that may be resumed later (without
    the summary); ``finish`` ends a completed one."""

    run_id: str | None = None
    #: a continued run's (name, step) of every value it already holds, each taken off once as it comes again; None
    #: where the tracker cannot read its run back (then trackers.json's count of rows sent is trusted)
    held: Counter[tuple[str, int]] | None = None

    def new(self, name: str, step: int) -> bool:
        """Whether the value ``name`` at ``step`` is to be logged: not when the continued run holds it already."""
        if self.held is None or self.held[name, step] <= 0:
            return True
        self.held[name, step] -= 1
        return False

    def start(self, config: dict[str, Any], run_dir: Path, group: str | None, run_id: str | None = None) -> None: ...
    def log_metrics(self, row: dict[str, Any]) -> None: ...
    def close(self, status: str) -> None: ...
    def finish(self, summary: dict[str, Any], artifacts: list[Path]) -> None: ...


class TensorBoardTracker(Tracker):
    def start(self, config, run_dir, group, run_id=None):
        from torch.utils.tensorboard import SummaryWriter

        if run_id is not None:  # what the directory holds, read before this run's event file is added
            self.held = _tensorboard_scalars(run_dir / "tensorboard")
        # a resumed run adds an event file to the same directory: TensorBoard reads them as one run
        self.w = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.run_id = "tensorboard"
        if run_id is None:
            self.w.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")
            if group:
                self.w.add_text("sweep", group)

    def log_metrics(self, row):
        for k, v in _numbers(row).items():
            if self.new(k, int(row["round"])):
                self.w.add_scalar(k, v, global_step=int(row["round"]))
            if k != "bytes_total" and self.new(f"by_bytes/{k}", int(row["bytes_total"])):
                self.w.add_scalar(f"by_bytes/{k}", v, global_step=int(row["bytes_total"]))

    def finish(self, summary, artifacts):
        # at the run's last round: a completed run extended with --resume adds the totals of its new end, and the
        # totals of one end are held once
        step = _last_round(summary)
        for k, v in _numbers({"communication": summary["communication"]}).items():
            if self.new(k, step):
                self.w.add_scalar(k, v, global_step=step)
        self.w.add_text("summary", "```\n" + json.dumps(summary, indent=2, default=str) + "\n```", global_step=step)
        for p in artifacts:
            import numpy as np
            from PIL import Image

            self.w.add_image(p.stem, np.asarray(Image.open(p).convert("RGB")), dataformats="HWC")
        self.w.close()

    def close(self, status):
        self.w.close()


class MLflowTracker(Tracker):
    def start(self, config, run_dir, group, run_id=None):
        import os

        import mlflow

        # a plain directory store inside the run directory: nothing to set up, readable by `mlflow ui`; MLflow 3
        # only serves it after this opt-in
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        logged: dict[str, str] = {}
        if run_id is not None:  # a resumed run: continue its MLflow run
            from mlflow.exceptions import MlflowException

            try:
                self.run = self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
                logged = self.run.data.params
                self.held = Counter(
                    (k, m.step) for k in self.run.data.metrics for m in self.client.get_metric_history(run_id, k)
                )
            except MlflowException:  # the store was removed: start a new MLflow run
                run_id = None
        if run_id is None:
            exp = group or config.get("name") or "fedweave"
            found = self.client.get_experiment_by_name(exp)
            exp_id = found.experiment_id if found else self.client.create_experiment(exp)
            self.run = self.client.create_run(exp_id, run_name=run_dir.name, tags={"sweep": group or ""})
        self.id = self.run_id = self.run.info.run_id
        self.client.log_dict(self.id, config, "config.json")
        for k, v in _flat(config).items():
            if k not in logged:  # MLflow refuses to change a param: a resumed run's new rounds stay in config.json
                self.client.log_param(self.id, k, v)

    def log_metrics(self, row):
        for k, v in _numbers(row).items():
            if self.new(_mlflow_key(k), int(row["round"])):
                self.client.log_metric(self.id, _mlflow_key(k), v, step=int(row["round"]))
            if k != "bytes_total" and self.new(_mlflow_key(f"by_bytes.{k}"), int(row["bytes_total"])):
                self.client.log_metric(self.id, _mlflow_key(f"by_bytes.{k}"), v, step=int(row["bytes_total"]))

    def finish(self, summary, artifacts):
        step = _last_round(summary)  # as TensorBoard's
        for k, v in _numbers({"communication": summary["communication"]}).items():
            if self.new(_mlflow_key(k.replace("/", ".")), step):
                self.client.log_metric(self.id, _mlflow_key(k.replace("/", ".")), v, step=step)
        self.client.log_dict(self.id, summary, "summary.json")
        for p in artifacts:
            self.client.log_artifact(self.id, str(p))
        self.client.set_terminated(self.id, mlflow_status(summary["status"]))

    def close(self, status):
        self.client.set_terminated(self.id, mlflow_status(status))


class WandbTracker(Tracker):
    #: whether this run started the process's W&B service, and so ends it with the run
    owns_service = False

    def start(self, config, run_dir, group, run_id=None):
        import wandb
        from wandb.env import CACHE_DIR, SERVICE

        self.wandb = wandb
        # W&B logs through one service process per Python process, started by the first wandb.init; the service
        # writes its own logs (core-debug-*.log, symon-debug-*.log) to WANDB_CACHE_DIR/wandb/logs, by default
        # ~/.cache/wandb/logs. Unless the process already has a service (its own wandb.init, or a parent's named
        # by WANDB_SERVICE), the run starts one with WANDB_CACHE_DIR in its W&B directory and ends it with the
        # run, so that each run of a sweep (in this process or in a worker) has its own, and its logs stay in
        # that run's directory. WANDB_CACHE_DIR is set only while the service starts (it reads its environment
        # then), and only where the user has not set it.
        self.owns_service = not os.environ.get(SERVICE)
        scoped = {CACHE_DIR: str(run_dir.resolve() / "wandb" / "cache")} if self.owns_service else {}
        # a resumed run continues the W&B run of the same id (an offline run writes a second directory for it,
        # which `wandb sync --append` adds to the first)
        with _environ_default(scoped):
            self.run = wandb.init(
                project="fedweave", dir=str(run_dir), mode="offline", config=config, group=group,
                name=run_dir.name, reinit="create_new", id=run_id, resume="allow" if run_id else None,
            )  # fmt: skip
        self.run_id = self.run.id
        self.run.define_metric("bytes_total")
        if run_id is not None:  # what the earlier sessions' files hold (this session's holds no row yet)
            self.held = wandb_steps(run_dir / "wandb", run_id)

    def log_metrics(self, row):
        # a W&B row is one history record: held (as a row) or not
        if self.new(HISTORY, int(row["round"])):
            self.run.log(_numbers(row), step=int(row["round"]))

    def finish(self, summary, artifacts):
        self.run.summary.update(_numbers({"communication": summary["communication"]}))
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        images = {p.stem: self.wandb.Image(str(p)) for p in artifacts}
        if images:
            self.run.log(images)
        self.run.finish(exit_code=0 if summary["status"] == "completed" else 1)  # else W&B records a success
        self._end_service()

    def close(self, status):
        self.run.finish(exit_code=1)
        self._end_service()

    def _end_service(self) -> None:
        """End the service this run started: it holds its log files in this run's directory, and the next run
        (of a sweep) starts its own in its directory."""
        if self.owns_service:
            self.owns_service = False
            self.wandb.teardown()


def _last_round(summary: dict[str, Any]) -> int:
    """The round of the run's last row (0: none), the step of its summary's values."""
    return int(summary.get("rounds") or 0)


@contextlib.contextmanager
def _environ_default(values: dict[str, str]):
    """``os.environ`` with each of ``values`` that is not set already, restored as it was afterwards."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _tensorboard_scalars(logdir: Path) -> Counter[tuple[str, int]]:
    """(tag, step) of every scalar the event files in ``logdir`` hold, as many times as each was written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not logdir.is_dir():  # removed since: it holds nothing (the accumulator would raise)
        return Counter()
    # purge_orphaned_data off: a step written twice is counted twice, not hidden
    ev = EventAccumulator(str(logdir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    ev.Reload()
    return Counter((tag, e.step) for tag in ev.Tags()["scalars"] for e in ev.Scalars(tag))


HISTORY = "history"  # the name of a W&B run's rows in its tracker's ``held``


def wandb_steps(wandb_dir: Path, run_id: str) -> Counter[tuple[str, int]]:
    """(``HISTORY``, step) of every row the offline W&B run ``run_id`` holds in ``wandb_dir``'s session files: a
    process killed with SIGKILL lost the rows its W&B service had not written yet, which trackers.json counted
    as sent. Each record is decoded by W&B's own protobuf ``Record``; a torn last record ends the file."""
    from google.protobuf.message import DecodeError
    from wandb.proto.wandb_internal_pb2 import Record

    held: Counter[tuple[str, int]] = Counter()
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for data in wandb_records(path.read_bytes()):
            rec = Record()
            try:
                rec.ParseFromString(data)
            except DecodeError:
                break
            if rec.WhichOneof("record_type") == "history":
                # an item's name is its key, or its nested key's parts (how W&B 0.31 writes them)
                steps = [
                    json.loads(i.value_json) for i in rec.history.item if (i.key or "/".join(i.nested_key)) == "_step"
                ]
                held.update((HISTORY, int(s)) for s in steps)
    return held


def wandb_records(raw: bytes) -> Iterator[bytes]:
    """The records of a W&B run file (its transaction log): a 7-byte ``:W&B`` header, then LevelDB-style log
    blocks of 32 KiB whose records carry a 7-byte header (crc32c, little-endian length, type: 1 full, 2 first,
    3 middle, 4 last); a block's tail too short for a header is padding, and a record cut short ends the log."""
    if raw[:4] != b":W&B":
        return
    pos, part = 7, b""
    while pos + 7 <= len(raw):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if (length == 0 and kind == 0) or pos + 7 + length > len(raw):
            return
        part += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield part
            part = b""


def _mlflow_key(name: str) -> str:
    """``name`` as an MLflow metric name: MLflow takes only letters, digits, ``_ - . /`` and spaces (and ``:``
    but not on Windows), so a transfer's ``->`` becomes ``_to_`` and any other character (the ``+`` of
    ``model+control``) ``_``."""
    return re.sub(r"[^\w./\- ]", "_", name.replace("->", "_to_"))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_KINDS = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}


IDS = "trackers.json"  # in the run directory: each tracker's run id and how many rows it holds


class Trackers:
    """The trackers a run's ``output.trackers`` names, called together. ``resumed_rows``: a resumed run's rows
    from its checkpoint; each tracker then continues its run named in ``trackers.json`` and is sent the rows it
    has not yet got. With ``output.checkpoint_every`` rows are held back until :meth:`checkpointed`, so that
    no tracker holds a row that a resume recomputes."""

    def __init__(
        self,
        names: list[str],
        config: dict[str, Any],
        run_dir: Path,
        resumed_rows: list[dict[str, Any]] | None = None,
    ) -> None:
        self.items: dict[str, Tracker] = {}
        self.path = Path(run_dir) / IDS
        self.rows: list[dict[str, Any]] = list(resumed_rows or [])
        self.held_back = bool((config.get("output") or {}).get("checkpoint_every"))
        #: whether a checkpoint holds the run (a resumed run's, or one written since): else a run that ends
        #: otherwise than completed can never be resumed, and the rows held back would reach no tracker
        self.resumable = resumed_rows is not None
        saved = self._saved() if resumed_rows is not None else {}
        self.sent: dict[str, int] = {}
        try:
            for name in names:
                self.items[name] = self._started(name, config, Path(run_dir), saved.get(name, {}).get("run_id"))
        except BaseException as e:
            # a tracker that failed to start ends the run: those started before it are not left open (an MLflow
            # run RUNNING for ever), and say why it ended (Ctrl-C or SIGTERM while one starts: interrupted)
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            for t in self.items.values():
                with contextlib.suppress(Exception):
                    t.close(status)
            raise
        for name, t in self.items.items():
            # a tracker continuing its run holds its first rows already; one added on resume gets them all. A
            # tracker that reads its run back is sent every row and logs what it does not hold: a process killed
            # (or interrupted) while it sent a checkpoint's rows left some of them there but not in trackers.json,
            # and they came twice; TensorBoard's writer, killed, lost rows trackers.json counted
            rows = saved.get(name, {}).get("rows", 0)
            self.sent[name] = 0 if t.held is not None else min(rows, len(self.rows)) if isinstance(rows, int) else 0
        self._send(first=True)

    @staticmethod
    def _started(name: str, config: dict[str, Any], run_dir: Path, run_id: str | None) -> Tracker:
        """The tracker ``name``, its run started (or continued: ``run_id``)."""
        if name == "mlflow":
            # MLflow 3 sends usage telemetry by default, and importing it writes an installation id to
            # ~/.config/mlflow: the run stays local unless the user chose otherwise (read at import and call)
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:  # checked before the run (check_installed); an install that fails to import is found here
            __import__(_EXTRA[name])
        except ImportError as e:
            raise ConfigError(_missing(name)) from e
        t = _KINDS[name]()
        t.start(config, run_dir, sweep_group(run_dir), run_id)
        return t

    def _saved(self) -> dict[str, Any]:
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none (trackers added on resume), or unreadable: new tracker runs
            return {}
        return {k: v for k, v in saved.items() if isinstance(v, dict)} if isinstance(saved, dict) else {}

    def _send(self, first: bool = False) -> None:
        """Send every tracker the rows it has not got, and record the ids and counts in ``trackers.json``."""
        upto = len(self.rows)
        for name, t in self.items.items():
            for row in self.rows[self.sent[name] : upto]:
                t.log_metrics(row)
            self.sent[name] = max(self.sent[name], upto)
        if self.items and (self.held_back or first):  # without checkpoints the counts are never needed
            from fedweave.results import atomic_write

            ids = {name: {"run_id": t.run_id, "rows": self.sent[name]} for name, t in self.items.items()}
            atomic_write(self.path, json.dumps(ids, indent=2) + "\n")

    def log_metrics(self, row: dict[str, Any]) -> None:
        """A new metric row: sent at once, or at the next checkpoint when checkpoints are on."""
        self.rows.append(row)
        if not self.held_back:
            self._send()

    def checkpointed(self) -> None:
        """A checkpoint holding every row so far was written: send the rows held back."""
        self.resumable = True
        self._send()

    def finish(self, summary: dict[str, Any], artifacts: list[Path]) -> None:
        """End the tracker runs: a completed run, or one that cannot be resumed (no checkpoint: without them, or
        stopped before the first), with every row and the summary; otherwise with the rows its last checkpoint
        holds, open to a resume."""
        if summary["status"] == "completed" or not self.held_back or not self.resumable:
            self._send()
            for t in self.items.values():
                t.finish(summary, artifacts)
        else:
            for t in self.items.values():
                t.close(summary["status"])


class TrackerCallback(Callback):
    """The run's ``output.trackers``: started with the run (a resumed run continues its tracker runs with the
    checkpoint's rows), every recorded row logged (held back to the next checkpoint when checkpoints are on),
    finished with the summary and the plots."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.trackers: Trackers | None = None

    def on_start(self, run):
        config = run.config.recorded()
        self.trackers = Trackers(self.names, config, run.path, run.rows if run.resumed else None)

    def on_row(self, run, row):
        self.trackers.log_metrics(row)

    def on_checkpoint(self, run, next_round):
        self.trackers.checkpointed()

    def on_end(self, run, summary):
        if summary is not None and self.trackers is not None:
            self.trackers.finish(summary, sorted(run.path.glob("*.png")))
