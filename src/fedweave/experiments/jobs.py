"""Run a sweep's points: in parallel processes with the cores divided, skipping finished runs, resuming
killed ones from their checkpoints, and recording a diverged run as a result. ``parallel_map`` runs jobs
that are not runner runs (a reproduction's own solver loops) on workers of the same kind."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from fedweave.experiments.grid import Point
from fedweave.runner import Result, finished_run


class RunFailed(RuntimeError):
    """A run of a sweep failed; the message is one line naming its directory and point, and what went wrong
    (the worker's own exception and traceback are its ``__cause__``)."""


def _run_one(config: dict[str, Any], run_dir: str, threads: int, overwrite: bool = False, label: str = "") -> Result:
    """Run (or resume) one point; returns its Result without the algorithm object (results cross processes).
    Runs in a worker process. A failure is one :class:`RunFailed` line naming the run (``label``: its point)."""
    try:
        return _run_point(config, run_dir, threads, overwrite)
    except Exception as e:
        what = " ".join(str(e).split()) or "no message"
        raise RunFailed(f"run {run_dir} ({label}) failed: {type(e).__name__}: {what}") from e


def _run_point(config: dict[str, Any], run_dir: str, threads: int, overwrite: bool) -> Result:
    import torch

    from fedweave.config import ConfigError, load
    from fedweave.results import RunDirError
    from fedweave.runner import CHECKPOINT, run

    cfg = load(config)
    if cfg.threads is None:
        torch.set_num_threads(threads)
    if (Path(run_dir) / CHECKPOINT).is_file() and same_numbers(run_dir, cfg):
        try:
            res = run(cfg, run_dir=run_dir, progress=False, resume=True, on_divergence="return")
            return Result(res.run_dir, res.metrics, res.summary)
        except ConfigError:  # a checkpoint of another config: start this point again
            pass
    elif unfinished_run(run_dir, cfg):  # this point's run, killed before its first checkpoint: start it again
        overwrite = True
    try:
        res = run(cfg, run_dir=run_dir, progress=False, on_divergence="return", overwrite=overwrite)
    except RunDirError as e:
        # the runner's line offers --resume and --overwrite, which a sweep has not: say what a sweep user can do
        if overwrite or "already holds" not in str(e):
            raise
        what = "a finished run" if (Path(run_dir) / "summary.json").is_file() else "an unfinished run"
        raise RunDirError(
            f"{run_dir!r} already holds {what} of another config than this point's; a sweep never replaces it: "
            "give the sweep another --out, or move that directory away"
        ) from e
    return Result(res.run_dir, res.metrics, res.summary)


def same_numbers(run_dir: str | Path, config: Any) -> bool:
    """Whether the run in ``run_dir`` trains, measures and stops as ``config`` (a RunConfig) does: the same
    ``local``, ``eval`` and ``callbacks`` sections, as its ``config.yaml`` says (unreadable: True, its resume
    decides). A resume may change ``local.lr`` and ``local.grad_clip`` (checkpoints.RESUMABLE_LOCAL: a diverged
    run continued more gently) and ``eval`` and ``callbacks`` (checkpoints.RESUMABLE_REPORTING), which change the
    numbers from the resumed round on, so a checkpointed run of other values is not this point's run: a sweep run
    again with another ``local.lr`` (or ``eval.personal_test``, or a ``stop_at_target`` callback) took each
    finished run as its own, ran no round, wrote the new value into its config.yaml and reported the old numbers
    under it."""
    from fedweave.checkpoints import RESUMABLE_REPORTING
    from fedweave.config import ConfigError, load

    try:
        was, now = load(Path(run_dir) / "config.yaml").to_dict(), config.to_dict()
    except (ConfigError, OSError):
        return True
    return all(was[k] == now[k] for k in ("local", *RESUMABLE_REPORTING))


def unfinished_run(run_dir: str | Path, config: Any) -> bool:
    """Whether ``run_dir`` holds an unfinished run (killed, interrupted or stopped: no ``summary.json`` or one
    whose status is neither completed nor diverged) of exactly ``config`` (a RunConfig): a sweep restarts it
    from scratch when it has no checkpoint to resume from. A run of another config is never replaced here."""
    import json

    from fedweave.config import ConfigError, load

    path = Path(run_dir)
    if not (path / "config.yaml").is_file():
        return False
    try:
        if load(path / "config.yaml").recorded() != config.recorded():  # file options as runs record them
            return False
        status = (
            json.loads((path / "summary.json").read_text()).get("status") if (path / "summary.json").is_file() else None
        )
    except (ConfigError, OSError, ValueError):  # unreadable: not recognisably this point's run
        return False
    return status not in ("completed", "diverged")


def check_reusable(points: Iterable[Point], runs_dir: str | Path) -> None:
    """Refuse, before anything is written, a point whose directory holds a run of another config that the sweep
    would refuse once it reached it (one without a checkpoint, checkpointed with another ``local``, ``eval`` or
    ``callbacks`` section, :func:`same_numbers`, or completed with more rounds than the point's: any other run with
    one is left to its worker, which resumes it where the changes are those a resumed run may make, as ``rounds``
    extended). A refused sweep rewrote the sweep directory's ``sweep.json`` first, and a report then read the
    earlier sweep's runs by the new grid."""
    from fedweave.results import RunDirError, holds_run
    from fedweave.runner import CHECKPOINT

    for p in points:
        path = Path(runs_dir) / p.slug
        resumable = (path / CHECKPOINT).is_file() and same_numbers(path, p.config) and not _longer(path, p.config)
        if not path.is_dir() or not holds_run(path) or resumable:
            continue
        if finished_run(path, p.config) is None and not unfinished_run(path, p.config):
            what = "a finished run" if (path / "summary.json").is_file() else "an unfinished run"
            e = RunDirError(
                f"{str(path)!r} already holds {what} of another config than this point's; a sweep never replaces "
                "it: give the sweep another --out, or move that directory away"
            )  # the line its worker gave, and the same exception
            raise RunFailed(f"run {path} (point {p.label}, seed {p.seed}) failed: RunDirError: {e}") from e


def check_points(points: Iterable[Point], what: str = "sweep point") -> None:
    """Refuse, before any run starts or anything is written, a point whose config its run would refuse before
    training: a name no algorithm, dataset, model, partitioner or sampler is registered under (the config's
    plug-ins imported by its loader), an option out of its bounds, keys that exclude each other. These are the
    runner's own checks (:func:`fedweave.runner.check_run`), which need no data; without this a parallel sweep
    met the bad point only when its run started, after the runs before it had run. The refusal is one
    :class:`~fedweave.experiments.grid.GridError` line: ``what``, the point's label and the run's own message."""
    import logging

    from fedweave.config import ConfigError
    from fedweave.experiments.grid import GridError
    from fedweave.runner import check_run

    log = logging.getLogger("fedweave")
    level = log.level
    log.setLevel(logging.ERROR)  # a run's start-up warnings are its own, given when it starts: not twice
    try:
        for p in points:
            try:
                check_run(p.config)
            except (ConfigError, KeyError, ValueError, TypeError) as e:  # KeyError: a registry's UnknownNameError
                # a reproduction's point is named by its run directory, and may set no grid values at all
                who = p.label if p.name is None else p.name if not p.values else f"{p.name} ({p.label})"
                raise GridError(f"{what} {who}: {' '.join(str(e).split()) or type(e).__name__}") from e
    finally:
        log.setLevel(level)


def _longer(path: Path, config: Any) -> bool:
    """Whether ``path`` holds a completed run of more rounds than ``config`` (a RunConfig) has: its checkpoint is
    of its last round, which a resume may not go below, so its worker would refuse it after sweep.json had been
    rewritten (a run killed part-way has a checkpoint of an earlier round and is left to its worker)."""
    import json

    try:
        summary = json.loads((path / "summary.json").read_text())
        return summary.get("status") == "completed" and int(summary.get("rounds") or 0) > config.rounds
    except (OSError, ValueError, TypeError, AttributeError):  # none (killed), or unreadable: the worker decides
        return False


def check_workers(workers: object) -> None:
    """Refuse a worker count that is not a whole number >= 1, before anything runs or is written."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        from fedweave.config import ConfigError

        raise ConfigError(f"workers must be a whole number >= 1, got {workers!r}")


def threads_per_worker(workers: int) -> int:
    """The cores this process may run on divided among the workers (at least one thread each)."""
    return max(1, _cores() // max(1, workers))


def _cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one (a batch scheduler's or
    ``taskset``'s share of the machine; ``os.cpu_count()`` counts every core of the machine, so 2 workers on 4
    cores of a 128-core node ran 64 threads each), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def finished(points: Iterable[Point], runs_dir: str | Path) -> dict[str, Result]:
    """The points whose run directory already holds their finished (completed or diverged) run."""
    out = {}
    for p in points:
        done = finished_run(Path(runs_dir) / p.slug, p.config)
        if done is not None:
            out[p.slug] = done
    return out


def _die_with(parent: int) -> None:
    """End this worker process when ``parent`` (the sweep's process) dies, however it dies (SIGKILL too):
    on Linux the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a thread watches the parent pid.
    Its run's files are written atomically, so the next sweep resumes or restarts that run."""
    import ctypes
    import signal
    import threading

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = sys.platform.startswith("linux") and libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="fedweave-parent-watch", daemon=True).start()


def _worker_start(parent: int, threads: int, initializer: Callable[[], None] | None, scratch: str) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # first: a signal from now on interrupts the worker's first call
        if callable(handler := signal.getsignal(sig)):  # the sweep's (the command line's: SIGTERM raises too)
            _RAISES[sig] = handler
            signal.signal(sig, _worker_signal)
    import torch

    _die_with(parent)
    # a worker ends through os._exit, without Python's exit handlers, which remove what libraries leave in the
    # temporary directory (W&B's staging folders, made as it is imported): its temporary files go to the pool's
    # own folder, which the sweep's process removes once the workers are done (its subprocesses too: TMPDIR), or
    # the next sweep when this one is killed (_scratch)
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    torch.set_num_threads(threads)
    if initializer is not None:
        initializer()


_RAISES: dict[int, Callable[..., Any]] = {}  # in a worker: the handler it inherited for each signal it passes on
_busy = False  # in a worker: a call is running
_signalled = 0  # in a worker: the signal that interrupted it (0: none yet)


def _worker_signal(signum: int, frame: Any) -> None:
    """A worker's Ctrl-C or SIGTERM, from its sweep's process or the whole process group (both, for Ctrl-C in a
    terminal: they are one interrupt): the call in progress is interrupted as the sweep's process would be (a
    run ends ``interrupted``, resumable from its checkpoint); an idle worker's next call is."""
    global _signalled
    if _signalled:
        return
    _signalled = signum
    if _busy:  # not while idle: raised in the pool's own loop, it would end the worker and break the pool
        _RAISES[signum](signum, frame)


def _in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker, interruptible by :func:`_worker_signal`."""
    global _busy
    _busy = True
    try:
        if _signalled:  # interrupted before the call started: it does not
            _RAISES[_signalled](_signalled, None)
        return fn(*args)
    finally:
        _busy = False


def _signal_workers(pool: ProcessPoolExecutor, interrupt: KeyboardInterrupt) -> None:
    """Pass the signal that interrupted the sweep's process on to its workers: a signal to that process alone
    (``kill PID``, a scheduler, ``docker stop``) reached none of them, and their runs went on to their end."""
    sig = signal.SIGTERM if getattr(interrupt, "signal_name", "SIGINT") == "SIGTERM" else signal.SIGINT
    for pid in list(getattr(pool, "_processes", None) or {}):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _close(pool: ProcessPoolExecutor, interrupt: KeyboardInterrupt | None) -> None:
    """Shut ``pool`` down once its calls have ended. ``interrupt``: this process was interrupted, and so are the
    calls in progress, which end as an interrupted run does. A signal meanwhile is the first (it interrupts them)
    or the second, which ends the workers at once with SIGKILL, leaving their runs as a killed sweep does
    (resumable; before, the pool's shutdown then waited for good on an idle worker)."""
    if interrupt is not None:
        _signal_workers(pool, interrupt)
    try:
        pool.shutdown(wait=True, cancel_futures=True)
    except KeyboardInterrupt as e:
        if interrupt is None:
            _close(pool, e)
            raise
        for p in list((getattr(pool, "_processes", None) or {}).values()):
            p.kill()
        pool.shutdown(wait=True)  # dead workers: at once
        raise


SCRATCH = "fedweave-workers-"  # the workers' temporary folder in the system's: SCRATCH<pid>-<random>


def _scratch() -> tuple[str, int]:
    """A new temporary folder for the workers, and a descriptor holding its lock (flock) while this process or a
    worker of it lives; then the folders that sweeps killed with SIGKILL left (their own clean-up never ran) are
    removed: those of the same form whose lock no process holds. A folder is locked before it takes that form, so
    a sweep starting meanwhile never takes another's new folder for a stale one."""
    import fcntl

    new = tempfile.mkdtemp(prefix=f".{SCRATCH}{os.getpid()}-")
    fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    head, tail = os.path.split(new)
    path = os.path.join(head, tail.removeprefix("."))
    os.rename(new, path)
    for old in Path(head).glob(f"{SCRATCH}*-*"):  # an earlier release's folders (no pid) were never locked
        _remove_stale(old, fcntl)
    return path, fd


def _remove_stale(path: Path, fcntl: Any) -> None:
    """Remove ``path``, a workers' folder, if no process holds its lock (and it is this user's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, a link, not a folder
        return
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its sweep (or a worker of it) still runs
        return
    else:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)


def _schedule(
    fn: Callable[..., Any],
    calls: list[tuple],
    workers: int,
    *,
    initializer: Callable[[], None] | None = None,
    budget_s: float | None = None,
    on_done: Callable[[int, Any], None] | None = None,
) -> dict[int, Any]:
    """``fn(*calls[i])`` for every i, at most ``workers`` at a time in forked processes, each with its share
    of the cores (one worker: in this process, whose threads are left as they are). No call starts after
    ``budget_s`` seconds; returns ``{i: result}`` of the calls that ran. ``initializer`` runs once in each
    worker process (with one worker, in this process). Ctrl-C or SIGTERM to this process, alone or with its
    group, interrupts the calls in progress with that signal, waits for them and is raised; a second one kills
    the workers and is raised at once."""
    t0 = time.perf_counter()
    over = lambda: budget_s is not None and time.perf_counter() - t0 > budget_s  # noqa: E731
    out: dict[int, Any] = {}
    if workers <= 1:
        if initializer is not None and calls:
            initializer()
        for i, args in enumerate(calls):
            if over():
                break
            out[i] = fn(*args)
            if on_done is not None:
                on_done(i, out[i])
        return out
    scratch, held = _scratch()  # the workers' temporary directory (_worker_start)
    try:
        # fork: the workers see what this process registered (datasets, models, algorithms)
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=mp.get_context("fork"),
            initializer=_worker_start,
            initargs=(os.getpid(), threads_per_worker(workers), initializer, scratch),
        )
        try:
            queue = iter(enumerate(calls))
            running: dict[Any, int] = {}
            while True:
                while len(running) < workers and not over() and (nxt := next(queue, None)) is not None:
                    running[pool.submit(_in_worker, fn, *nxt[1])] = nxt[0]
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    i = running.pop(f)
                    out[i] = f.result()
                    if on_done is not None:
                        on_done(i, out[i])
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM, to this process alone or to its whole group
            _close(pool, e)
            raise
        except BaseException:  # a run failed: the others run to their end, as before
            _close(pool, None)
            raise
        _close(pool, None)
    finally:  # once every worker has ended
        shutil.rmtree(scratch, ignore_errors=True)
        os.close(held)
    return out


def _last_round(run_dir: Path) -> int:
    """The round of the last metric row in ``run_dir/metrics.jsonl`` (0 when none): a running run's progress,
    read from the file it replaces atomically after each evaluation."""
    import json

    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            last = f.read().rstrip().rsplit(b"\n", 1)[-1]
        return int(json.loads(last)["round"])
    except (OSError, ValueError, KeyError, TypeError):  # not started, or a row too long for the tail read
        return 0


class _Progress:
    """The sweep's bar in rounds: all rounds of the finished runs plus the rounds done so far by the running
    ones (read from their metrics files once a second by a thread), the finished runs counted beside it."""

    def __init__(self, points: list[Point], runs_dir: Path, finished: set[str]) -> None:
        import threading

        from tqdm.auto import tqdm

        self.points, self.runs_dir, self.finished = points, runs_dir, set(finished)
        total = sum(p.config.rounds for p in points)
        self.bar = tqdm(total=total, unit="round", dynamic_ncols=True, file=sys.stderr, desc="sweep")
        self.bar.set_postfix_str(f"{len(self.finished)}/{len(points)} runs finished", refresh=False)
        self.refresh()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="fedweave-sweep-progress", daemon=True)
        self.thread.start()

    def rounds_done(self) -> int:
        return sum(
            p.config.rounds if p.slug in self.finished else min(p.config.rounds, _last_round(self.runs_dir / p.slug))
            for p in self.points
        )

    def refresh(self) -> None:
        n = self.rounds_done()
        if n != self.bar.n:  # redrawn on a change only: a log file gets no line a second
            self.bar.update(n - self.bar.n)

    def done(self, slug: str) -> None:
        self.finished.add(slug)
        self.refresh()
        self.bar.set_postfix_str(f"{len(self.finished)}/{len(self.points)} runs finished")

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            self.refresh()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.refresh()
        self.bar.close()


def run_points(
    points: list[Point],
    runs_dir: str | Path,
    *,
    workers: int = 1,
    progress: bool = True,
    ray_address: str | None = None,
    overwrite: bool = False,
    budget_s: float | None = None,
    initializer: Callable[[], None] | None = None,
) -> dict[str, Result]:
    """Run every point into ``runs_dir/<point.slug>``; returns ``{slug: Result}`` (metrics and summary; a
    diverged run is a result too). A point whose directory holds its finished run is not run again, and a
    killed one resumes from its checkpoint. ``workers`` processes run at once, each with its share of the
    cores; with ``ray_address`` the points are Ray tasks on that existing cluster instead (one CPU each;
    ``runs_dir`` must be on storage its nodes share).

    ``overwrite``: a directory holding a run of another config is replaced (a reproduction's directories
    belong to it) rather than refused. ``budget_s``: no run starts after this many seconds (finished runs
    are used whatever the budget); the points not run are missing from the result. ``initializer`` runs
    once in each worker process (one worker: in this process), e.g. to cache datasets its runs share."""
    check_workers(workers)
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    out = finished(points, runs_dir)
    todo = [p for p in points if p.slug not in out]
    threads = threads_per_worker(workers)
    calls = [
        (p.config.to_dict(), str(runs_dir / p.slug), threads, overwrite, f"point {p.label}, seed {p.seed}")
        for p in todo
    ]
    bar = _Progress(points, runs_dir, set(out)) if progress else None
    done = (lambda i, res: bar.done(todo[i].slug)) if bar is not None else None
    try:
        if ray_address is not None:
            results = _on_ray(calls, ray_address, done)
        else:
            results = _schedule(_run_one, calls, workers, initializer=initializer, budget_s=budget_s, on_done=done)
    finally:
        if bar is not None:
            bar.close()
    out.update({todo[i].slug: res for i, res in results.items()})
    return {p.slug: out[p.slug] for p in points if p.slug in out}


def parallel_map(
    fn: Callable[[Any], Any],
    items: list[Any],
    *,
    workers: int = 1,
    initializer: Callable[[], None] | None = None,
    on_result: Callable[[int, Any], None] | None = None,
    budget_s: float | None = None,
) -> list[Any]:
    """``[fn(item) for item in items]`` on ``workers`` forked processes with the cores divided among them,
    for jobs that are not runner runs. ``on_result(i, result)`` is called as each finishes (in any order);
    the list is in the order of ``items``. ``fn`` must be a module-level function. ``budget_s``: no item
    starts after this many seconds; an item not run is None in the list."""
    check_workers(workers)
    calls = [(x,) for x in items]
    results = _schedule(fn, calls, workers, initializer=initializer, budget_s=budget_s, on_done=on_result)
    return [results.get(i) for i in range(len(items))]


def _on_ray(calls: list[tuple], address: str, done: Callable[[int, Any], None] | None) -> dict[int, Result]:
    import ray

    from fedweave.execution.ray import LOCAL_RAY_ENV

    if not ray.is_initialized():
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(address=address)
    task = ray.remote(num_cpus=1)(_run_one)
    pending = {task.remote(cfg, run_dir, 1, *rest): i for i, (cfg, run_dir, _, *rest) in enumerate(calls)}
    out: dict[int, Result] = {}
    while pending:
        finished_refs, _ = ray.wait(list(pending), num_returns=1)
        for ref in finished_refs:
            i = pending.pop(ref)
            out[i] = ray.get(ref)
            if done is not None:
                done(i, out[i])
    return out


def cache_datasets() -> None:
    """A worker initializer: memoize the dataset loaders (per process, per option set), so that the dozens of
    runs a worker takes share their data. Not what is read from the user's own files (``libsvm``, ``leaf``,
    ``shakespeare`` from LEAF JSON, a plug-in's): memoized in the process that runs the points (one worker), a
    file edited later in that process was never read again, and a resume refused the checkpoint of the file as
    it is. A loader that reads them only for some options (Shakespeare's plays are a verified download) is
    asked at each call, with that call's options."""
    import functools

    from fedweave.data.datasets._common import loads_user_files
    from fedweave.registry import DATASETS

    for name in DATASETS.names():
        loader = DATASETS._items[name]
        if not loads_user_files(loader):  # for no options
            DATASETS._items[name] = functools.lru_cache(maxsize=2)(loader)
        elif callable(getattr(loader, "reads_user_files", None)):  # for some: asked with each call's
            DATASETS._items[name] = _memoized(loader)


def _memoized(loader: Callable[..., Any]) -> Callable[..., Any]:
    """``loader`` memoized for the options that read no user file (its ``reads_user_files`` condition)."""
    import functools

    from fedweave.data.datasets._common import loads_user_files

    memo = functools.lru_cache(maxsize=2)(loader)

    @functools.wraps(loader)  # its name, module, signature (the options checked) and mark
    def load(*args: Any, **options: Any) -> Any:
        if args:  # called by position (the runner passes options by name): not memoized
            return loader(*args, **options)
        return loader(**options) if loads_user_files(loader, options) else memo(**options)

    return load


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages as a report prints them ("n/a" where unknown)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"
