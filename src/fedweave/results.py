"""Run directories (DESIGN principle 7): resolved config, per-round metrics, summary, plots; atomic writes."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

CORE_COLUMNS = ["round", "test_accuracy", "test_loss", "bytes_up", "bytes_down", "wall_seconds"]


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_run_dir(name: str, seed: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{name}-s{seed}-{stamp}"
    path, i = base, 1
    while path.exists():
        path, i = Path(f"{base}-{i}"), i + 1
    return path


def metrics_csv(rows: list[dict[str, Any]]) -> str:
    """CSV text with the core columns first, then algorithm-specific ones in first-seen order."""
    cols = [c for c in CORE_COLUMNS if any(c in r for r in rows)]
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


class RunDir:
    """Writes one run's files. Every file is replaced atomically, so a crash leaves no half-written file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def add_metrics(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.flush_metrics()

    def flush_metrics(self) -> None:
        atomic_write(self.path / "metrics.csv", metrics_csv(self.rows))
        atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self.rows))

    def write_json(self, name: str, data: Any) -> None:
        atomic_write(self.path / name, json.dumps(data, indent=2, default=_jsonable) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metrics rows of a run directory (from ``metrics.jsonl``)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a fedweave run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
