"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) behind one small callback interface.

The runner calls ``start`` once, ``log_metrics`` for every metric row and ``finish`` with the summary and the
plots. Each tracker logs the resolved config, every row (stepped by round, and by total bytes), the ledger's
totals per transfer kind and the final summary. Everything stays local by default: MLflow writes a file store
and W&B an offline run, both inside the run directory. A run inside a sweep directory is grouped by that sweep.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fedweave.config import ConfigError

_EXTRA = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


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
    def start(self, config: dict[str, Any], run_dir: Path, group: str | None) -> None: ...
    def log_metrics(self, row: dict[str, Any]) -> None: ...
    def finish(self, summary: dict[str, Any], artifacts: list[Path]) -> None: ...


class TensorBoardTracker(Tracker):
    def start(self, config, run_dir, group):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.w.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")
        if group:
            self.w.add_text("sweep", group)

    def log_metrics(self, row):
        for k, v in _numbers(row).items():
            self.w.add_scalar(k, v, global_step=int(row["round"]))
            if k != "bytes_total":
                self.w.add_scalar(f"by_bytes/{k}", v, global_step=int(row["bytes_total"]))

    def finish(self, summary, artifacts):
        for k, v in _numbers({"communication": summary["communication"]}).items():
            self.w.add_scalar(k, v, global_step=0)
        self.w.add_text("summary", "```\n" + json.dumps(summary, indent=2, default=str) + "\n```")
        for p in artifacts:
            import numpy as np
            from PIL import Image

            self.w.add_image(p.stem, np.asarray(Image.open(p).convert("RGB")), dataformats="HWC")
        self.w.close()


class MLflowTracker(Tracker):
    def start(self, config, run_dir, group):
        import os

        import mlflow

        # a plain directory store inside the run directory: nothing to set up, readable by `mlflow ui`; MLflow 3
        # only serves it after this opt-in
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        exp = group or config.get("name") or "fedweave"
        found = self.client.get_experiment_by_name(exp)
        exp_id = found.experiment_id if found else self.client.create_experiment(exp)
        self.run = self.client.create_run(exp_id, run_name=run_dir.name, tags={"sweep": group or ""})
        self.id = self.run.info.run_id
        self.client.log_dict(self.id, config, "config.json")
        for k, v in _flat(config).items():
            self.client.log_param(self.id, k, v)

    def log_metrics(self, row):
        for k, v in _numbers(row).items():
            self.client.log_metric(self.id, _mlflow_key(k), v, step=int(row["round"]))
            if k != "bytes_total":
                self.client.log_metric(self.id, _mlflow_key(f"by_bytes.{k}"), v, step=int(row["bytes_total"]))

    def finish(self, summary, artifacts):
        for k, v in _numbers({"communication": summary["communication"]}).items():
            self.client.log_metric(self.id, _mlflow_key(k.replace("/", ".")), v)
        self.client.log_dict(self.id, summary, "summary.json")
        for p in artifacts:
            self.client.log_artifact(self.id, str(p))
        self.client.set_terminated(self.id, "FINISHED" if summary["status"] == "completed" else "FAILED")


class WandbTracker(Tracker):
    def start(self, config, run_dir, group):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project="fedweave", dir=str(run_dir), mode="offline", config=config, group=group,
            name=run_dir.name, reinit="create_new",
        )  # fmt: skip
        self.run.define_metric("bytes_total")

    def log_metrics(self, row):
        self.run.log(_numbers(row), step=int(row["round"]))

    def finish(self, summary, artifacts):
        self.run.summary.update(_numbers({"communication": summary["communication"]}))
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        images = {p.stem: self.wandb.Image(str(p)) for p in artifacts}
        if images:
            self.run.log(images)
        self.run.finish()


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


class Trackers:
    """The trackers a run's ``output.trackers`` names, called together."""

    def __init__(self, names: list[str], config: dict[str, Any], run_dir: Path) -> None:
        self.items: list[Tracker] = []
        for name in names:
            module = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}[name]
            try:
                __import__(module)
            except ImportError as e:
                raise ConfigError(
                    f"output.trackers: {name} needs the {module} package; install it with "
                    f"pip install 'fedweave[{_EXTRA[name]}]'"
                ) from e
            t = _KINDS[name]()
            t.start(config, Path(run_dir), sweep_group(Path(run_dir)))
            self.items.append(t)

    def log_metrics(self, row: dict[str, Any]) -> None:
        for t in self.items:
            t.log_metrics(row)

    def finish(self, summary: dict[str, Any], artifacts: list[Path]) -> None:
        for t in self.items:
            t.finish(summary, artifacts)
