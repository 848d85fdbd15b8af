"""Run directories (DESIGN principle 7): resolved config, per-round metrics, summary, plots; atomic writes."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

CORE_COLUMNS = ["round", "test_accuracy", "test_loss", "bytes_up", "bytes_down", "wall_seconds"]


class RunDirError(OSError):
    """A run directory that cannot be used (it holds a finished run, is a file, is not writable, the disk is
    full); the message is one line naming the path and what to do."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _umask()  # read once: os.umask can only be read by setting it


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and an atomic rename.

    The file gets the user's usual permissions (mkstemp would leave it 0600). A failed write (disk full,
    say) removes its temporary file and leaves the previous version of ``path`` in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # a failed write names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


RUN_FILES = ("config.yaml", "summary.json", "metrics.csv", "metrics.jsonl", "checkpoint.pt")


def holds_run(path: Path) -> bool:
    return any((path / f).exists() for f in RUN_FILES)


def check_run_dir(path: Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before anything is written, a run directory that cannot take this run."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            what = "the run directory" if parent == path else f"a parent of the run directory {str(path)!r}"
            raise RunDirError(f"{str(parent)!r} is a file, not a directory; it cannot be {what}")
    if resume or overwrite or not path.is_dir():
        return
    if holds_run(path):
        summary = path / "summary.json"
        what = "a finished run" if summary.is_file() else "an unfinished run"
        raise RunDirError(
            f"{str(path)!r} already holds {what}; give another --out / output.dir, resume it with "
            f"'fedweave run --resume {path}', or replace it with --overwrite"
        )


def clean_temp_files(path: Path) -> list[Path]:
    """Remove the temporary files that a write killed half-way left behind (``.NAME.*.tmp``)."""
    stale = [p for p in path.glob(".*.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def clear_run(path: Path) -> None:
    """Remove a previous run's files from ``path`` (``--overwrite``): the directory is first renamed aside,
    so a kill leaves either the old run or an empty directory for the new one, never a mix of the two."""
    for old in path.parent.glob(f".{path.name}.overwritten-*"):  # left by a kill during an earlier overwrite
        shutil.rmtree(old, ignore_errors=True)
    if not path.is_dir():
        return
    aside = path.with_name(f".{path.name}.overwritten-{os.getpid()}")
    os.replace(path, aside)
    path.mkdir()
    shutil.rmtree(aside, ignore_errors=True)


def make_run_dir(path: Path) -> None:
    """Create the run directory, with a one-line error when the file system refuses."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except PermissionError as e:
        raise RunDirError(f"cannot write the run directory {str(path)!r}: permission denied") from e
    except OSError as e:
        raise RunDirError(f"cannot write the run directory {str(path)!r}: {e.strerror or e}") from e


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
        make_run_dir(self.path)
        clean_temp_files(self.path)
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
