"""Run directories (DESIGN principle 7): resolved config, per-round metrics, summary, plots; atomic writes."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import fnmatch
import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CORE_COLUMNS = ["round", "test_accuracy", "test_loss", "bytes_up", "bytes_down", "wall_seconds"]


class RunDirError(OSError):
    """A run directory that cannot be used (it holds a finished run, is a file, is not writable, the disk is
    full); the message is one line naming the path and what to do. ``held``: for a directory that holds a run,
    that part alone (``'DIR' already holds a finished run``), for a caller whose ways out differ (a deployed run
    has neither ``--out`` nor ``--overwrite``)."""

    held: str | None = None


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
LOCK = ".fedweave.lock"  # held (flock) by the run writing the directory; created before anything else
# Everything a run writes into its directory (names and fnmatch patterns): all that --overwrite may remove.
RUN_OUTPUTS = (
    *RUN_FILES,
    "objects.json",
    "partition.csv",
    "partition.png",
    "*_vs_rounds.png",
    "*_vs_bytes.png",
    "trackers.json",  # the ids of the tracker runs (fedweave.callbacks.trackers)
    "clients.jsonl",  # eval.distribution: each evaluation's per-client values (fedweave.callbacks.ClientRecord)
    "trace.csv",  # the round_trace callback's per-round curve (fedweave.callbacks.RoundTrace)
    "events.csv",  # an asynchronous method's events in the order they happened (Algorithm.run_files)
    "*_vs_sim_time.png",
)
RUN_OUTPUT_DIRS = ("tensorboard", "mlruns", "wandb")  # the trackers' stores
# the temporary names atomic_write gives the run's own files, and the write probe's
TEMP_FILES = (*(f".{name}.*.tmp" for name in RUN_OUTPUTS), ".write-probe-*.tmp")
ASIDE = ".overwritten-"  # prefix of the folder an overwrite moves the old run into before removing it
_OWNED = (*RUN_OUTPUTS, *RUN_OUTPUT_DIRS, *TEMP_FILES, LOCK, f"{ASIDE}*")


# what only a run writes (its lock first of all): a folder without any is no run's, whatever its files are named
RUN_MARKS = (LOCK, "summary.json", "metrics.jsonl", "checkpoint.pt")


def is_run_dir(path: Path) -> bool:
    """Whether directory ``path`` is (or was) a run's: it holds the lock a run takes before writing anything, or
    a run's results. A folder of the user's with files named as a run's (their own ``partition.png`` or
    ``metrics.csv``) is not."""
    return any((path / f).exists() for f in RUN_MARKS)


def first_names(names: list[str], k: int = 3) -> str:
    """The first ``k`` of ``names`` for a one-line message: ``a, b, c and 4 more``."""
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def unreadable(path: Path, e: Exception) -> str:
    """The one line for a file of a run or sweep that does not read as what they write (edited or damaged by hand:
    they write their files atomically)."""
    return f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})"


def holds_run(path: Path) -> bool:
    """Whether directory ``path`` holds a run: it is a run's (:func:`is_run_dir`) and holds any of a run's files
    (config, summary, metrics or checkpoint)."""
    return is_run_dir(path) and any((path / f).exists() for f in RUN_FILES)


REPORT = "report.html"  # `fedweave report RUN` writes its page into the run directory by default


def foreign_entries(path: Path) -> list[str]:
    """The names in ``path`` that no fedweave run wrote (a user's files): --overwrite never removes them, and a run
    never writes among them. In a folder that is no run's (:func:`is_run_dir`) that is every name, run files'
    names too (a run replaced a user's own ``partition.png``); in a run's, the names no run writes. The page
    ``fedweave report`` leaves there by default is the run's (a report.html of the user's own is not)."""
    if not is_run_dir(path):
        return sorted(e.name for e in path.iterdir())
    return sorted(e.name for e in path.iterdir() if not _owned(e))


GENERATOR = "<meta name='generator' content='fedweave report'>"  # marks a page `fedweave report` wrote


def is_report(path: Path) -> bool:
    """Whether ``path`` is a page ``fedweave report`` wrote (it carries :data:`GENERATOR`)."""
    try:
        with open(path, "rb") as f:
            return GENERATOR.encode() in f.read(4096)
    except OSError:  # a directory, or unreadable: not a report
        return False


def _owned(entry: Path) -> bool:
    if any(fnmatch.fnmatchcase(entry.name, p) for p in _OWNED):
        return True
    if entry.name != REPORT or entry.is_symlink():
        return False
    return entry.is_file() and is_report(entry)  # the page marks itself as the report's


def _overwrite_refusal(path: Path) -> str | None:
    """Why ``--overwrite`` may not replace ``path``, or None: only an empty directory or a run directory (one
    that holds nothing but a fedweave run's files) may be replaced."""
    foreign = foreign_entries(path)
    if not foreign:
        return None
    shown = first_names(foreign)
    return (
        f"{str(path)!r} holds files that are not a fedweave run's ({shown}); --overwrite replaces only a run "
        "directory (one that holds nothing but a fedweave run's files) and deleted nothing: move those files out or "
        "give a new --out / output.dir"
    )


def file_in_the_way(path: str | Path, *, folder: bool = True) -> str | None:
    """What keeps ``path`` from being made (a folder where ``folder``, else a file in one): ``'is a file'`` or
    ``'lies under the file F'``; None when nothing does. mkdir's own error names only the path ('File exists',
    'Not a directory'), so callers say this in their one line, naming their option."""
    path = Path(path)
    there = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if there is None or not there.is_file() or (there == path and not folder):
        return None
    return "is a file" if there == path else f"lies under the file {there}"


def folder_refusal(path: str | Path) -> str | None:
    """Why a folder cannot be made or written at ``path``: :func:`file_in_the_way`'s reason, ``'cannot be
    written'`` or ``'cannot be made in P'`` (the nearest existing folder is not writable); None when it can."""
    if what := file_in_the_way(path):
        return what
    path = Path(path)
    there = next(p for p in (path, *path.absolute().parents) if p.exists())  # the folder it is, or is made in
    if not os.access(there, os.W_OK | os.X_OK):
        return "cannot be written" if there == path else f"cannot be made in {there}"
    return None


def _held_run(summary: Path) -> str:
    """How a refusal names the run a directory holds: by how it ended (a run that failed or diverged is no
    finished run), or as unfinished where no summary was written."""
    if not summary.is_file():
        return "an unfinished run"
    try:
        status = json.loads(summary.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if status in ("failed", "diverged", "interrupted", "stopped"):
        return f"{'an' if status == 'interrupted' else 'a'} {status} run"
    return "a finished run"


OBJECTS_FILE = "objects.json"  # what a run took from Python in place of registered names (fedweave.byo)


def check_run_dir(path: Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before anything is written, a run directory that cannot take this run: raise a
    :class:`RunDirError` naming the path when it (or a parent) is a file, when it holds anything but a run's
    files (a user's files are never written among or replaced), or when it already holds a run (unless
    ``resume``, which continues that run, or ``overwrite``, which replaces it)."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            what = "the run directory" if parent == path else f"a parent of the run directory {str(path)!r}"
            raise RunDirError(f"{str(parent)!r} is a file, not a directory; it cannot be {what}")
    if resume or not path.is_dir():
        return
    if overwrite:
        refusal = _overwrite_refusal(path)
        if refusal:
            raise RunDirError(refusal)
        return
    if holds_run(path):
        what = _held_run(path / "summary.json")
        # the command line's and Python's ways each (the same check refuses both); --resume offered only where it
        # can continue (a run without checkpoint.pt has nothing to resume from), and a run of objects passed from
        # Python resumes from Python only
        elsewhere = "give another --out / output.dir (run_dir=)"
        replace = "replace it with --overwrite (overwrite=True)"
        if not (path / "checkpoint.pt").is_file():
            ways = f"it has no checkpoint to resume from; {elsewhere}, or {replace}"
        elif (path / OBJECTS_FILE).is_file():
            ways = f"{elsewhere}, resume it from Python with fedweave.resume({str(path)!r}, ...), or {replace}"
        else:
            ways = f"{elsewhere}, resume it with 'fedweave run --resume {path}' (fedweave.resume), or {replace}"
        err = RunDirError(f"{str(path)!r} already holds {what}; {ways}")
        err.held = f"{str(path)!r} already holds {what}"
        raise err
    foreign = foreign_entries(path)
    if foreign:  # a user's folder: the run's files would land among (and over same-named) files of theirs
        shown = first_names(foreign)
        raise RunDirError(
            f"{str(path)!r} holds files that are not a fedweave run's ({shown}); a run writes into a new or empty "
            "directory or its own run directory: give another --out / output.dir"
        )


def clean_temp_files(path: Path) -> list[Path]:
    """Remove the temporary files of the run's own files that a write killed half-way left behind
    (``.config.yaml.*.tmp`` and the like; plain files only, never what a link points to)."""
    stale = sorted({p for pattern in TEMP_FILES for p in path.glob(pattern) if p.is_file() and not p.is_symlink()})
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def clear_run(path: Path) -> None:
    """Remove a previous run's files from ``path`` (``--overwrite``), refusing a directory that holds anything
    else. The files are first moved into a folder inside ``path`` (the checkpoint first, so a kill never
    leaves a checkpoint beside a partial run) which is then removed; a folder left by a kill goes the same
    way the next time. The lock file stays: the run that holds it is the one clearing."""
    if not path.is_dir():
        return
    refusal = _overwrite_refusal(path)
    if refusal:
        raise RunDirError(refusal)
    old = sorted((e for e in path.iterdir() if e.name != LOCK), key=lambda e: e.name != "checkpoint.pt")
    if not old:
        return
    aside = Path(tempfile.mkdtemp(dir=path, prefix=ASIDE))
    for e in old:
        os.replace(e, aside / e.name)
    shutil.rmtree(aside, ignore_errors=True)


_HELD: set[int] = set()  # descriptors of the run locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child (a backend's worker, a sweep's worker): close the parent's lock descriptors, so that
    a child outliving the run cannot keep the directory locked (flock locks are shared across fork)."""
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


@contextlib.contextmanager
def locked_run_dir(path: Path) -> Iterator[None]:
    """Hold ``path``'s run lock (an flock on ``path/.fedweave.lock``) for the life of a run: a second run into
    the directory is refused with a :class:`RunDirError` naming it. The system drops the lock when its
    process ends, however it ends, so a killed run leaves no stale lock."""
    make_run_dir(path)
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise RunDirError(f"cannot lock the run directory {str(path)!r}: {e.strerror or e}") from e
    yield from _held(fd, f"{str(path)!r} is in use by another fedweave run{{who}}; wait for it to end or give "
                         "another --out / output.dir")  # fmt: skip


def _held(fd: int, busy: str) -> Iterator[None]:
    """Hold the flock of the open lock file ``fd``, its holder's pid written inside, until the caller's block ends;
    one held by another process is a :class:`RunDirError` of ``busy`` (``{who}``: `` (process N)``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise RunDirError(busy.replace("{who}", f" (process {holder})" if holder.isdigit() else "")) from None
    _HELD.add(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the refusal above
        yield
    finally:
        _HELD.discard(fd)
        os.close(fd)


SWEEP_LOCK = ".fedweave-sweep.lock"  # held (flock) by the sweep writing the directory (not a run's mark)


@contextlib.contextmanager
def locked_sweep_dir(out: Path) -> Iterator[None]:
    """Make ``out`` and hold its sweep lock (an flock on ``out/.fedweave-sweep.lock``) for the life of a sweep, as
    :func:`locked_run_dir` a run's: a second sweep into it is refused with a :class:`RunDirError` naming the
    process holding it (two of different grids left it mixed: sweep.json the second's, the tables the first's)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / SWEEP_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    yield from _held(fd, f"--out: {out} is in use by another fedweave sweep{{who}}; wait for it to end or give "
                         "another --out")  # fmt: skip


def make_run_dir(path: Path) -> None:
    """Create the run directory, with a one-line error when the file system refuses."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe-", suffix=".tmp")  # O_EXCL: follows no link
        os.close(fd)
        os.unlink(probe)
    except PermissionError as e:
        raise RunDirError(f"cannot write the run directory {str(path)!r}: permission denied") from e
    except OSError as e:
        raise RunDirError(f"cannot write the run directory {str(path)!r}: {e.strerror or e}") from e


def default_run_dir(name: str, seed: int) -> Path:
    """The run directory of a config without ``output.dir``, claimed: ``runs/<name>-s<seed>-<timestamp>``, with
    ``-1``, ``-2``, ... appended when that exists already, created (empty) here. The name is taken by creating
    it, which succeeds for one caller only: runs started in the same second each get their own (before, they
    all picked the same free name and the second was refused as in use)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{name}-s{seed}-{stamp}"
    path, i = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except OSError as e:
            if not isinstance(e, FileExistsError) or not os.path.lexists(path):  # not a name taken: no retry
                check_run_dir(path)  # a parent that is a file: the line that names it
                raise RunDirError(f"cannot create the run directory {str(path)!r}: {e.strerror or e}") from e
            path, i = Path(f"{base}-{i}"), i + 1


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
        """Write ``config.yaml`` from the plain config dict (:meth:`fedweave.config.RunConfig.to_dict`)."""
        atomic_write(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def add_metrics(self, row: dict[str, Any]) -> None:
        """Append one metrics row and rewrite ``metrics.csv`` and ``metrics.jsonl`` with it."""
        self.rows.append(row)
        self.flush_metrics()

    def flush_metrics(self) -> None:
        """Rewrite ``metrics.csv`` and ``metrics.jsonl`` from ``rows`` (each atomically)."""
        atomic_write(self.path / "metrics.csv", metrics_csv(self.rows))
        atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self.rows))

    def write_json(self, name: str, data: Any) -> None:
        """Write ``data`` as indented JSON to the file ``name`` of the run directory (numpy and torch values
        become plain numbers and lists)."""
        atomic_write(self.path / name, json.dumps(data, indent=2, default=_jsonable) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metrics rows of a run directory (from ``metrics.jsonl``); a file that holds other than rows is one
    ValueError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a fedweave run directory?")
    try:
        return metrics_rows(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(unreadable(path, e)) from e


def metrics_rows(text: str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` text: each line a JSON object with an integer ``round``; anything else (a
    file edited or damaged by hand: the run writes it atomically) is a ValueError naming the line."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        r = row.get("round") if isinstance(row, dict) else None
        if not isinstance(r, int) or isinstance(r, bool):
            raise ValueError(f"line {n} is not a metrics row (a JSON object with an integer round): {line[:60]!r}")
        rows.append(row)
    return rows


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def run_metric(summary: dict | None) -> str | None:
    """The column a finished run is plotted and tabulated by (here, not in :mod:`fedweave.plots`: reading it loads
    no plotting library, which writes its caches as it is imported), from its ``summary.json``: the task's main metric,
    or where its rows have none (the confederated family's synthetic problem has no test set) the column its
    own plots show, its algorithm's ``plot_metric`` (``opt_gap``); None for a summary that says neither."""
    from fedweave.registry import ALGORITHMS

    if not summary:
        return None
    if summary.get("main_metric"):
        return str(summary["main_metric"])
    name = summary.get("algorithm")
    return ALGORITHMS.get(name).plot_metric if isinstance(name, str) and name in ALGORITHMS else None
