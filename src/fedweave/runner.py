"""The runner: rounds, evaluation, divergence checks, checkpoints and the run directory."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from fedweave import __version__
from fedweave.algorithms.base import Algorithm, RunContext, build_algorithm
from fedweave.byo import RunObjects
from fedweave.config import ConfigError, RunConfig
from fedweave.config import load as load_config
from fedweave.execution.placement import move_tensors
from fedweave.faults import Faults
from fedweave.memory import cpu_seconds
from fedweave.registry import ALGORITHMS
from fedweave.results import (
    RunDir,
    atomic_write,
    check_run_dir,
    clear_run,
    default_run_dir,
    locked_run_dir,
    read_metrics,
)
from fedweave.seeding import Seeds
from fedweave.tasks import Task

log = logging.getLogger("fedweave")


class DivergenceError(RuntimeError):
    """Training produced NaN or Inf, or its loss exploded; the run stopped and kept its last good results."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the run; ``summary.json`` says ``status: interrupted``."""

    def __init__(self, message: str, signal_name: str = "SIGINT") -> None:
        super().__init__(message)
        self.signal_name = signal_name


class RunStopped(RuntimeError):
    """The run's execution ended it early for a reason outside the algorithm (a deployed client failed under
    the deployment's ``stop`` policy): the results so far are written with ``status: stopped`` into
    ``run_dir`` (set when the runner re-raises it)."""

    run_dir: Path | None = None


class CheckpointError(ValueError):
    """A checkpoint that is damaged or not this run's; the message names the file and what is wrong."""


@dataclass
class Result:
    """What ``fedweave.run`` returns: the run directory, its metric rows and its summary."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    algorithm: Algorithm | None = field(default=None, repr=False)

    @property
    def final_accuracy(self) -> float | None:
        return self.summary.get("final_test_accuracy")

    @property
    def best_accuracy(self) -> float | None:
        return self.summary.get("best_test_accuracy")


def _check_finite(values: dict[str, float], r: int, what: str) -> None:
    bad = {k: v for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise DivergenceError(
            f"round {r + 1}: {what} is not finite ({', '.join(f'{k}={v}' for k, v in bad.items())}); "
            "the run stopped. Lower local.lr or enable local.grad_clip."
        )


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="round", dynamic_ncols=True, file=sys.stderr)


def _check_explosion(values: dict[str, float], first: dict[str, float], r: int, factor: float | None) -> None:
    """A loss far above its first value means the run has blown up, long before it overflows to Inf."""
    if factor is None:
        return
    for key, v in values.items():
        if not key.endswith("loss") or not isinstance(v, float):
            continue
        if v > 0:
            first.setdefault(key, v)  # the first positive value (a round nobody reported may give 0)
        base = first.get(key)
        if base is not None and v > factor * base:
            raise DivergenceError(
                f"round {r + 1}: {key} = {v:.4g} exploded (over eval.explode_factor = {factor:g} times its first "
                f"value {base:.4g}); the run stopped."
            )


CHECKPOINT = "checkpoint.pt"
# Config keys a resumed run may change: how long it runs, how it reports, which backend and device (the
# checkpoint is device-independent); not what it computes.
RESUMABLE_CHANGES = ("rounds", "output", "threads", "eval", "backend", "device", "memory")
# ...and these change what it computes from the resumed round on (a smaller lr after a divergence, say).
RESUMABLE_LOCAL = ("lr", "grad_clip")


def floating_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every floating tensor nested in dicts and lists of ``obj``."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield path or "state", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from floating_tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from floating_tensors(v, f"{path}.{k}" if path else str(k))


def finite_tensors(state: Any) -> set[str]:
    """Paths of the floating tensors of ``state`` that hold no NaN or Inf.

    Taken from the freshly built algorithm, it separates the tensors that must stay finite (models,
    momenta, control variates) from those that use NaN/Inf as a marker (e.g. 'no loss tracked yet').
    """
    return {p for p, t in floating_tensors(state) if bool(torch.isfinite(t).all())}


def _diverged(state: Any, must_be_finite: set[str] | None) -> str | None:
    for p, t in floating_tensors(state):
        if (must_be_finite is None or p in must_be_finite) and not bool(torch.isfinite(t).all()):
            return p
    return None


def save_checkpoint(
    run: RunDir,
    algo: Algorithm,
    next_round: int,
    wall: float,
    *,
    extra: dict[str, Any] | None = None,
    verify: bool = False,
    must_be_finite: set[str] | None = None,
) -> None:
    """Write the state after round ``next_round - 1`` atomically (temp file + rename).

    A state whose tensors ``must_be_finite`` (paths; default: all) hold NaN/Inf is never written (it
    raises :class:`DivergenceError`), so the checkpoint on disk is always the last good one. With
    ``verify`` the bytes are read back with ``weights_only=True`` first, so a state that could not be
    resumed fails now rather than at resume time.
    """
    algo_state = algo.state_dict()
    bad = _diverged(algo_state, must_be_finite)
    if bad:
        raise DivergenceError(
            f"round {next_round}: the algorithm state '{bad}' is not finite; the run stopped before "
            "checkpointing it. Lower local.lr or enable local.grad_clip."
        )
    state = {
        "next_round": next_round,
        "wall_seconds": wall,
        "algorithm": move_tensors(algo_state, torch.device("cpu")),  # device-independent: host tensors only
        "ledger": algo.ledger.state_dict(),
        "rows": run.rows,
        **(extra or {}),
    }
    data = encode_checkpoint(state)
    if verify:
        try:
            read_checkpoint(io.BytesIO(data))
        except Exception as e:  # an object torch's safe loader refuses (e.g. a numpy array or a class)
            raise TypeError(
                f"algorithm '{algo.name}': its state_dict() holds an object torch.load(weights_only=True) "
                f"refuses, so the run could not be resumed; keep tensors, numbers, strings, lists and dicts "
                f"only ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
    atomic_write(run.path / CHECKPOINT, data)


# A checkpoint file is this line, then the torch.save bytes of the state; the digest is theirs.
DIGEST_LINE = b"fedweave checkpoint sha256:"


def encode_checkpoint(state: dict[str, Any]) -> bytes:
    """The bytes of a checkpoint file holding ``state``: a line with the sha256 digest of the serialized state,
    then the state as ``torch.save`` writes it. The digest is checked on load, so a flipped bit is refused."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return DIGEST_LINE + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def read_checkpoint(file: Path | io.BytesIO, device: torch.device | str = "cpu") -> Any:
    """What the checkpoint ``file`` holds (read with ``weights_only=True``, tensors mapped to ``device``), its
    digest checked first: a damaged file is a :class:`CheckpointError`. A checkpoint written before
    checkpoints carried a digest is loaded with a warning that its content cannot be checked."""
    raw = file.getvalue() if isinstance(file, io.BytesIO) else file.read_bytes()
    if raw.startswith(DIGEST_LINE):
        head, _, payload = raw.partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != head[len(DIGEST_LINE) :]:
            raise CheckpointError(
                f"{file} is damaged (its content does not match the sha256 digest written with it) and was not "
                "loaded; resume from an intact copy or start the run again"
            )
    else:
        payload = raw
        if raw:
            log.warning("%s carries no digest (an earlier fedweave wrote it): its content cannot be checked", file)
    return torch.load(io.BytesIO(payload), weights_only=True, map_location=device)


def _check_resumable(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    def local(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.get("local", {}).items() if k not in RESUMABLE_LOCAL}

    changed = sorted(
        k
        for k in set(saved) | set(now)
        if k not in RESUMABLE_CHANGES and (local(saved) != local(now) if k == "local" else saved.get(k) != now.get(k))
    )
    if changed:
        allowed = ", ".join([*RESUMABLE_CHANGES, *(f"local.{k}" for k in RESUMABLE_LOCAL)])
        raise ConfigError(
            f"{path / 'config.yaml'}: {', '.join(changed)} changed since the checkpoint was written; a resumed "
            f"run may change only {allowed}. Start a new run instead"
        )


def _shapes(state: Any) -> dict[str, tuple[int, ...]]:
    return {p: tuple(t.shape) for p, t in floating_tensors(state)}


def load_checkpoint(
    path: Path, algo: Algorithm, config: RunConfig, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Read and check ``path/checkpoint.pt`` against the freshly built ``algo``, its tensors mapped to
    ``device`` (the run's, whichever device wrote it): every problem is one :class:`CheckpointError`
    naming the file, never a traceback from deep inside torch."""
    file = path / CHECKPOINT
    if not file.is_file():
        raise CheckpointError(f"{file} not found: the run has no checkpoint to resume from")
    try:
        ckpt = read_checkpoint(file, device)
    except CheckpointError:
        raise
    except Exception as e:  # truncated, empty, not a torch file, or objects the safe loader refuses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            first = "it holds objects other than tensors and plain data"
        raise CheckpointError(f"{file} is not a readable fedweave checkpoint and was not loaded ({first[:200]})") from e
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{file} is not a fedweave checkpoint (it holds a {type(ckpt).__name__}, not a mapping)")
    missing = [k for k in ("next_round", "wall_seconds", "algorithm", "ledger", "rows") if k not in ckpt]
    if missing:
        raise CheckpointError(f"{file} is not a complete fedweave checkpoint (missing {', '.join(missing)})")
    nxt = ckpt["next_round"]
    if not isinstance(nxt, int) or isinstance(nxt, bool) or not 0 <= nxt <= config.rounds:
        raise CheckpointError(
            f"{file}: next_round must be a round in [0, {config.rounds}] (the config's rounds), got {nxt!r}"
        )
    if not isinstance(ckpt["rows"], list) or not isinstance(ckpt["algorithm"], dict):
        raise CheckpointError(f"{file} is damaged: 'rows' must be a list and 'algorithm' a mapping")
    want, got = _shapes(algo.state_dict()), _shapes(ckpt["algorithm"])
    for p, shape in want.items():
        if p in got and got[p] != shape:
            raise CheckpointError(
                f"{file}: the algorithm state '{p}' has shape {list(got[p])} but this run's is {list(shape)}; "
                "it was written by a different model or population"
            )
    absent = [k for k in algo.state_dict() if k not in ckpt["algorithm"]]
    if absent:
        raise CheckpointError(f"{file}: the algorithm state lacks {', '.join(map(repr, absent))}")
    # a checkpoint is never written with NaN/Inf where the run needs finite tensors (save_checkpoint refuses):
    # one that holds them is damaged, not a reason to lower the learning rate
    bad = _diverged(ckpt["algorithm"], finite_tensors(algo.state_dict()))
    if bad:
        raise CheckpointError(
            f"{file} is damaged: its algorithm state '{bad}' holds NaN or Inf, which no checkpoint is written "
            "with; it was not loaded"
        )
    return ckpt


def finished_run(run_dir: str | Path, config: RunConfig | dict[str, Any]) -> Result | None:
    """The finished (completed or diverged) run of exactly ``config`` in ``run_dir``, else None.

    The saved config is re-resolved by the current loader, so a run is still recognised after keys with
    defaults were added to the config schema. Reproductions use this to continue an interrupted grid.
    """
    path = Path(run_dir)
    if not (path / "summary.json").is_file() or not (path / "config.yaml").is_file():
        return None
    want = config if isinstance(config, RunConfig) else load_config(config)
    try:
        saved = load_config(path / "config.yaml")
    except ConfigError:  # written by a version whose keys no longer exist: not this run
        return None
    summary = json.loads((path / "summary.json").read_text())
    if saved.to_dict() != want.to_dict() or summary.get("status") not in ("completed", "diverged"):
        return None
    rows = read_metrics(path) if (path / "metrics.jsonl").is_file() else []  # diverged before any evaluation
    return Result(path, rows, summary, None)


def run(
    config: RunConfig,
    *,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    resume: bool = False,
    on_divergence: Literal["raise", "return"] = "raise",
    overwrite: bool = False,
    objects: RunObjects | None = None,
    prepare: Callable[[Algorithm], None] | None = None,
) -> Result:
    """Run an experiment described by ``config``; write and return its results. ``objects``: a model
    factory, data or a loss passed from Python in place of the registered ones (see :mod:`fedweave.byo`).
    ``prepare`` is called with the built algorithm before its first round (the Flower deployment points its
    trainer at the SuperNodes).

    A run that meets NaN or Inf, or whose loss explodes, stops; its results so far are written with
    ``status: diverged``. Then ``on_divergence="raise"`` raises :class:`DivergenceError` (one experiment: an
    error), ``"return"`` returns that Result (a sweep, where a diverged run is a result to report).
    A directory that already holds a run is refused unless ``overwrite`` (which removes the old run first, and
    refuses a directory holding anything a run does not write); a directory another run is writing (it holds
    the directory's lock, :func:`fedweave.results.locked_run_dir`) is refused.
    Ctrl-C or SIGTERM ends the run with ``status: interrupted`` and raises :class:`RunInterrupted`."""
    if on_divergence not in ("raise", "return"):
        raise ValueError(f"on_divergence must be 'raise' or 'return', got {on_divergence!r}")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    path = Path(run_dir) if run_dir else Path(config.output.dir) if config.output.dir else None
    path = path or default_run_dir(config.name, config.seed)
    check_run_dir(path, resume=resume, overwrite=overwrite)
    # injected faults an algorithm does not handle are an error, never silently ignored
    Faults(config.faults, Seeds(config.seed)).require_handled(
        config.algorithm.name, getattr(ALGORITHMS.get(config.algorithm.name), "handles_faults", ())
    )
    late = [r for r in config.faults.outage_rounds if r > config.rounds]
    if late:  # allowed (a fault switched on that hits nobody), but rarely meant
        log.warning("faults.outage_rounds %s are after the last round (%d) and never happen", late, config.rounds)
    ctx = RunContext(config, objects)
    algo = build_algorithm(ctx)  # a config problem found while building ends here, before anything is written
    if prepare is not None:  # e.g. the Flower deployment points the algorithm's trainer at the SuperNodes
        prepare(algo)
    with locked_run_dir(path):  # held until the run's last file is written (a second run here is refused)
        # again, under the lock: a run into the same directory may have ended while this one was being built
        check_run_dir(path, resume=resume, overwrite=overwrite)
        return _run_locked(config, ctx, algo, path, resume, overwrite, objects, progress, on_divergence)


def _run_locked(
    config: RunConfig,
    ctx: RunContext,
    algo: Algorithm,
    path: Path,
    resume: bool,
    overwrite: bool,
    objects: RunObjects | None,
    progress: bool | None,
    on_divergence: str,
) -> Result:
    """The body of :func:`run`, in the locked run directory ``path``."""
    finite_at_start = finite_tensors(algo.state_dict()) if config.output.checkpoint_every else set()
    start_round, wall_before, cpu_before, skipped = 0, 0.0, 0.0, []
    ckpt = None
    if resume:
        ckpt = load_checkpoint(path, algo, config, ctx.device)
        if "config" in ckpt:
            # re-resolved, so keys added to the config schema since then (with their defaults) are no change
            saved = load_config(ckpt["config"])
            _check_resumable(saved.to_dict(), config.to_dict(), path)
            if config.rounds != saved.rounds and (
                config.local.lr_schedule == "cosine" or getattr(algo, "uses_total_rounds", False)
            ):
                why = "local.lr_schedule is cosine" if config.local.lr_schedule == "cosine" else algo.name
                raise ConfigError(
                    f"rounds: cannot change from {saved.rounds} to {config.rounds} on resume because the "
                    f"schedule depends on the total ({why}); start a new run with rounds={config.rounds}"
                )
        try:
            algo.load_state_dict(ckpt["algorithm"])
            ctx.ledger.load_state_dict(ckpt["ledger"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path / CHECKPOINT} does not fit this run ({type(e).__name__}: {e})") from e
    elif overwrite:
        clear_run(path)
    out = RunDir(path)
    if ckpt is not None:
        out.rows = list(ckpt["rows"])
        out.flush_metrics()
        start_round, wall_before = ckpt["next_round"], ckpt["wall_seconds"]
        cpu_before = float(ckpt.get("cpu_seconds", 0.0))
        skipped = list(ckpt.get("skipped_rounds", []))
    else:
        # a checkpoint left by an earlier run in this directory must not be resumed into this one
        (out.path / CHECKPOINT).unlink(missing_ok=True)
    out.write_config(config.to_dict())
    if objects is not None and objects.describe():
        out.write_json("objects.json", objects.describe())  # what was passed from Python in place of names
    trackers = None
    if config.output.trackers:  # TensorBoard / MLflow / W&B callbacks (fedweave.experiments.trackers)
        from fedweave.experiments.trackers import Trackers

        # a resumed run continues its tracker runs, which are sent the checkpoint's rows they lack
        trackers = Trackers(config.output.trackers, config.to_dict(), out.path, out.rows if resume else None)
    if "partition" in ctx.__dict__ and not resume:  # the family partitioned a dataset: report it
        from fedweave.data.report import write_partition_report

        ds = ctx.dataset
        labels = ctx.label_view(ds.train_y.numpy())  # float targets: their quantile bins
        floats = ds.train_y.is_floating_point()
        edges = ctx.target_bin_edges() if floats else None
        classes = len(edges) + 1 if floats else ds.num_classes
        write_partition_report(ctx.partition, labels, classes, out.path, plot=config.output.plots, bin_edges=edges)

    show = config.output.progress if progress is None else progress
    bar = _progress(show, config.rounds, start_round)
    t0 = time.perf_counter() - wall_before
    cpu0 = cpu_seconds() - cpu_before  # all threads and worker processes: what a loaded machine inflates least
    status, error = "completed", None
    ledger = ctx.ledger
    verified = False
    interrupted: BaseException | None = None
    stopped: RunStopped | None = None
    last_checkpoint = start_round if resume else None
    if config.eval.at_start and start_round == 0:  # the initial model, as round 0 (peer frameworks report it)
        ev = algo.evaluate(-1)
        _check_finite(ev, -1, "an evaluation metric of the initial model")
        zero = {"bytes_up": 0, "bytes_down": 0, "bytes_lateral": 0, "bytes_total": 0}
        out.add_metrics({"round": 0, **ev, **zero, "wall_seconds": round(time.perf_counter() - t0, 4)})
        if trackers is not None:
            trackers.log_metrics(out.rows[-1])
    first_losses = _first_losses(out.rows)  # the explosion check's reference: the first losses reported
    try:
        for r in range(start_round, config.rounds):
            round_metrics = algo.run_round(r)
            _check_finite(round_metrics, r, "a training metric")
            _check_explosion(round_metrics, first_losses, r, config.eval.explode_factor)
            if round_metrics.get("reported_clients", 1) == 0:
                skipped.append(r + 1)
                log.warning("round %d: no client reported; the round was skipped (no client update used)", r + 1)
            last = r == config.rounds - 1
            if (r + 1) % config.eval.every == 0 or last:
                ev = algo.evaluate(r)
                _check_finite(ev, r, "an evaluation metric")
                _check_explosion(ev, first_losses, r, config.eval.explode_factor)
                row = {
                    "round": r + 1,
                    **ev,
                    "bytes_up": ledger.bytes("up", upto_round=r),
                    "bytes_down": ledger.bytes("down", upto_round=r),
                    "bytes_lateral": ledger.bytes("lateral", upto_round=r),
                    "bytes_total": ledger.bytes(upto_round=r),
                    "wall_seconds": round(time.perf_counter() - t0, 4),
                    **round_metrics,
                }
                if "reported_clients" in round_metrics:
                    row["skipped_rounds"] = len(skipped)  # cumulative: rounds without eval are counted too
                out.add_metrics(row)
                if trackers is not None:
                    trackers.log_metrics(row)
                if bar is not None:
                    main = ctx.task.main_key
                    post = {main.removeprefix("test_"): f"{ev[main]:.4g}"} if main in ev else {}
                    post["sent"] = f"{row['bytes_total'] / 2**20:.1f}MiB"
                    bar.set_postfix(post, refresh=False)
            every = config.output.checkpoint_every
            if every and ((r + 1) % every == 0 or last):
                extra = {"config": config.to_dict(), "skipped_rounds": skipped}
                extra["cpu_seconds"] = cpu_seconds() - cpu0
                # a signal between the checkpoint's rename and the line below would make summary.json name the
                # previous round: held until both are done
                with _signals_held():
                    save_checkpoint(
                        out,
                        algo,
                        r + 1,
                        time.perf_counter() - t0,
                        extra=extra,
                        verify=not verified,
                        must_be_finite=finite_at_start,
                    )
                    last_checkpoint = r + 1
                verified = True
                if trackers is not None:
                    trackers.checkpointed()
            if bar is not None:
                bar.update(1)
    except DivergenceError as e:
        status, error = "diverged", f"{e} {_kept(out.path, last_checkpoint)}"
    except RunStopped as e:
        status, error, stopped = "stopped", str(e), e
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM turned into one by the command line
        interrupted = e
        status, error = (
            "interrupted",
            f"stopped by {getattr(e, 'signal_name', 'SIGINT')}. " + _kept(out.path, last_checkpoint, smaller_lr=False),
        )
    finally:
        if bar is not None:
            bar.close()
    summary = _summary(config, ctx.task, out.rows, ledger.summary(), time.perf_counter() - t0, status, error)
    summary["cpu_seconds"] = round(cpu_seconds() - cpu0, 3)
    trainer = getattr(algo, "trainer", None)
    summary["execution"] = {  # what `backend: auto` resolved to, and the threads it ran with
        "backend": trainer.backend if trainer is not None else config.backend,
        "threads": torch.get_num_threads(),
    }
    summary["placement"] = ctx.placement.summary()  # what `device: auto` resolved to, its name, the precision
    if skipped or config.faults != type(config.faults)():
        summary["skipped_rounds"] = skipped
    out.write_json("summary.json", summary)
    if config.output.plots and out.rows:
        from fedweave.plots import plot_runs

        plot_runs([out.path], out.path, metric=summary["main_metric"] or "test_loss")
    if trackers is not None:
        trackers.finish(summary, sorted(out.path.glob("*.png")))
    if interrupted is not None:
        raise RunInterrupted(error or "interrupted", getattr(interrupted, "signal_name", "SIGINT")) from None
    if stopped is not None:
        err = RunStopped(f"{error} Results so far are in {out.path}")
        err.run_dir = out.path
        raise err from None
    if error and on_divergence == "raise":
        raise DivergenceError(f"{error} Results so far are in {out.path}")
    return Result(out.path, out.rows, summary, algo)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then deliver the first one that came (to the handlers in
    place before), so that a few steps that must happen together (a checkpoint and its record) do. Python
    runs signal handlers in the main thread only: elsewhere there is nothing to hold."""
    held = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, held):
        yield  # (a handler not set from Python cannot be put back)
        return
    came: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if came:
            signal.raise_signal(came[0])


def _first_losses(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The first value of every loss column (the explosion check's reference), from a resumed run's rows."""
    first: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if k.endswith("loss") and isinstance(v, float) and v > 0:
                first.setdefault(k, v)
    return first


def _kept(path: Path, checkpoint_round: int | None, smaller_lr: bool = True) -> str:
    """What is left to continue from, for the one line that reports a stopped run."""
    if not checkpoint_round:
        return "No checkpoint was written (output.checkpoint_every is 0 or no checkpoint round was reached)."
    lr = " local.lr=SMALLER" if smaller_lr else ""
    return f"The checkpoint of round {checkpoint_round} is kept; continue with 'fedweave run --resume {path}{lr}'."


def main_metric(task: Task, rows: list[dict[str, Any]]) -> str | None:
    """The metrics column of the task's main metric: ``test_<main>``, or ``val_<main>`` in a tuning run."""
    for key in (task.main_key, f"val_{task.main}"):
        if any(r.get(key) is not None for r in rows):
            return key
    return None


def _summary(config: RunConfig, task: Task, rows, ledger_summary, wall: float, status: str, error: str | None) -> dict:
    key = main_metric(task, rows)
    scored = [r for r in rows if key is not None and r.get(key) is not None and r["round"] > 0]
    best = None
    for r in scored:  # the first round that reached the best value
        if best is None or task.better(r[key], best[key]):
            best = r
    accs = [r for r in rows if r.get("test_accuracy") is not None and r["round"] > 0]
    best_acc = max(accs, key=lambda r: r["test_accuracy"]) if accs else None
    return {
        "status": status,
        "error": error,
        "name": config.name,
        "algorithm": config.algorithm.name,
        "seed": config.seed,
        "rounds": rows[-1]["round"] if rows else 0,
        "main_metric": key,
        "direction": task.direction,
        "final_main": scored[-1][key] if scored else None,
        "best_main": best[key] if best else None,
        "best_round": best["round"] if best else None,
        "final_test_accuracy": accs[-1]["test_accuracy"] if accs else None,
        "best_test_accuracy": best_acc["test_accuracy"] if best_acc else None,
        "final": rows[-1] if rows else None,
        "wall_seconds": round(wall, 3),
        "communication": ledger_summary,
        "versions": {
            "fedweave": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def resume(run_dir: str | Path, overrides: list[str] | None = None, *, progress: bool | None = None) -> Result:
    """Continue the run in ``run_dir`` from its last checkpoint. ``overrides`` may change only what a resumed
    run can change (:data:`RESUMABLE_CHANGES`, e.g. ``rounds=200`` to extend a finished run, which then gives
    the numbers of a run started with 200 rounds; or a smaller ``local.lr`` after a divergence)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a run directory")
    if not (path / CHECKPOINT).is_file():
        raise CheckpointError(
            f"{path / CHECKPOINT} not found: the run has no checkpoint to resume from (set output.checkpoint_every)"
        )
    return run(load_config(path / "config.yaml", overrides), run_dir=path, progress=progress, resume=True)
