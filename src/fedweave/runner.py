"""The runner: rounds, evaluation, divergence checks, checkpoints and the run directory."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fedweave import __version__, robust
from fedweave.algorithms.base import (
    Algorithm,
    RunContext,
    build_algorithm,
    check_config,
    reads_local,
    step_size_keys,
)
from fedweave.byo import OBJECTS_FILE, RunObjects, check_resumed_objects, check_same_objects
from fedweave.callbacks import Callback, CallbackList, RunState, default_callbacks
from fedweave.callbacks.builtin import check_finite, defined
from fedweave.callbacks.trackers import check_installed
from fedweave.checkpoints import CHECKPOINT, RESUMABLE_LOCAL, restore_checkpoint, signals_held
from fedweave.config import ConfigError, FaultsConfig, RunConfig
from fedweave.config import load as load_config
from fedweave.errors import CheckpointError, DivergenceError, RunInterrupted, RunStopped
from fedweave.execution.ray import check_session
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

__all__ = [
    "CheckpointError",
    "DivergenceError",
    "Result",
    "RunInterrupted",
    "RunStopped",
    "finished_run",
    "main_metric",
    "resume",
    "run",
]

log = logging.getLogger("fedweave")


@dataclass
class Result:
    """What ``fedweave.run`` returns: the run directory, its metric rows and its summary."""

    run_dir: Path  #: the run directory
    metrics: list[dict[str, Any]]  #: the rows of ``metrics.jsonl``, one per evaluated round
    summary: dict[str, Any]  #: the content of ``summary.json`` (status, final and best values, bytes, times)
    #: the trained algorithm (None for a run read back from disk or run in another process)
    algorithm: Algorithm | None = field(default=None, repr=False)

    @property
    def final_accuracy(self) -> float | None:
        """The test accuracy of the last evaluation that reported one (``final_test_accuracy``), or None
        when none did."""
        return self.summary.get("final_test_accuracy")

    @property
    def best_accuracy(self) -> float | None:
        """The best test accuracy over the evaluated rounds (``best_test_accuracy``), or None when no evaluation
        reported one."""
        return self.summary.get("best_test_accuracy")


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
    # as recorded (config.yaml holds file options by absolute path; a config may name them relative), wherever
    # the run's directory lies now
    same = placeless(saved.recorded()) == placeless(want.recorded())
    if not same or summary.get("status") not in ("completed", "diverged"):
        return None
    rows = read_metrics(path) if (path / "metrics.jsonl").is_file() else []  # diverged before any evaluation
    return Result(path, rows, summary, None)


def placeless(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (:meth:`RunConfig.recorded`) without ``output.dir``, the directory its run writes into:
    where a run lies is no part of what it computed, so a finished run is the same run after its folder was
    moved (a reproduction names each run's directory by its absolute path, and a moved ``--out`` ran every run
    again). Every other key still counts."""
    return {**recorded, "output": {k: v for k, v in recorded.get("output", {}).items() if k != "dir"}}


def run(
    config: RunConfig,
    *,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    resume: bool = False,
    on_divergence: Literal["raise", "return"] = "raise",
    overwrite: bool = False,
    objects: RunObjects | None = None,
    callbacks: Sequence[Callback] = (),
) -> Result:
    """Run an experiment described by ``config``; write and return its results. ``objects``: a model
    factory, data or a loss passed from Python in place of the registered ones (see :mod:`fedweave.byo`);
    ``callbacks`` are called after the config's own (:mod:`fedweave.callbacks`).

    ``run_dir`` is where the run writes (default: ``output.dir``, else :func:`~fedweave.results.default_run_dir`);
    ``progress`` shows or hides the progress bar (None: ``output.progress``); ``resume`` continues the run
    in ``run_dir`` from its checkpoint (:func:`resume` is the way to ask for it).

    A run that meets NaN or Inf, or whose loss explodes, stops with ``status: diverged`` and its results so
    far; then ``on_divergence="raise"`` raises :class:`DivergenceError`, ``"return"`` returns the Result (a
    sweep). A directory that holds a run is refused unless ``overwrite`` (which removes the old run first).
    Ctrl-C or SIGTERM ends the run with ``status: interrupted`` and raises :class:`RunInterrupted`."""
    if on_divergence not in ("raise", "return"):
        raise ConfigError(f"on_divergence must be 'raise' or 'return', got {on_divergence!r}")
    # checked here, not left to truthiness: progress="no" showed the bar, overwrite="no" removed the old run
    if progress is not None and not isinstance(progress, bool):
        raise ConfigError(f"progress must be True, False or None, got {progress!r}")
    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite must be True or False, got {overwrite!r}")
    if run_dir is not None and not isinstance(run_dir, str | os.PathLike):
        raise ConfigError(f"run_dir must be a directory's path (str or Path), got {type(run_dir).__name__}")
    callbacks = _checked(callbacks)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    given = run_dir or config.output.dir
    path = Path(given) if given else None
    if path is not None:
        check_run_dir(path, resume=resume, overwrite=overwrite)
    check_run(config, objects)
    ctx = RunContext(config, objects)
    # a config problem found while building ends here, before anything is written
    state = RunState(config, ctx, build_algorithm(ctx), resumed=resume)
    # the same model and data as before
    if resume and objects is not None and path is not None and (path / OBJECTS_FILE).is_file():
        check_same_objects(json.loads((path / OBJECTS_FILE).read_text()), objects)
    state.callbacks = cbs = CallbackList([*default_callbacks(config, progress), *callbacks])
    cbs.on_build(state)
    if path is None:  # claimed (created) only now: a config refused while building leaves no empty directory
        path = default_run_dir(config.name, config.seed)
    with locked_run_dir(path):  # held until the run's last file is written (a second run here is refused)
        # again, under the lock: a run into the same directory may have ended while this one was being built
        check_run_dir(path, resume=resume, overwrite=overwrite)
        return _run_locked(state, path, overwrite=overwrite, objects=objects, on_divergence=on_divergence)


def check_run(config: RunConfig, objects: RunObjects | None = None) -> None:
    """The checks :func:`run` makes of ``config`` before it builds anything, none of which needs the data, a
    device or a round: the faults and the robustness stage against the algorithm, a Ray session already up,
    the packages of ``output.trackers``, and every name the config gives with its options and the rules between
    keys (:func:`~fedweave.algorithms.base.check_config`). A sweep makes them for every point before its first run."""
    _check_faults(config)
    check_installed(config.output.trackers)  # else found as the trackers start, the run directory written
    if config.backend == "ray":  # against a Ray session already up; one not yet started is checked as it starts
        check_session(config.ray)
    check_config(config, objects)


def _checked(callbacks: Sequence[Callback]) -> list[Callback]:
    """The caller's callbacks, each a :class:`Callback` object; anything else is one line saying what to pass
    (before: an AttributeError or a missing ``run`` argument from inside the first hook)."""
    if isinstance(callbacks, Callback | str) or not isinstance(callbacks, Iterable):
        raise ConfigError(f"callbacks must be a list of fedweave.Callback objects, got {type(callbacks).__name__}")
    callbacks = list(callbacks)
    for i, c in enumerate(callbacks):
        if isinstance(c, type) and issubclass(c, Callback):
            raise ConfigError(f"callbacks[{i}] is the class {c.__name__}, not an object of it: pass {c.__name__}()")
        if not isinstance(c, Callback):
            raise ConfigError(f"callbacks[{i}] must be a fedweave.Callback object (a subclass's), got {c!r}")
        if any(c is d for d in callbacks[:i]):  # every hook ran twice (a RoundTrace wrote each round twice)
            raise ConfigError(f"callbacks[{i}] is the object callbacks[{callbacks.index(c)}] again; pass it once")
    return callbacks


def _run_locked(
    state: RunState, path: Path, *, overwrite: bool, objects: RunObjects | None, on_divergence: str
) -> Result:
    """The rounds of :func:`run`, in the locked run directory ``path``: restore a resumed run, write the
    config, then train, evaluate and record round after round, the callbacks around it."""
    config, cbs = state.config, state.callbacks
    ckpt = restore_checkpoint(path, state.algo, state.ctx) if state.resumed else None
    if overwrite and not state.resumed:
        clear_run(path)
    state.out = out = RunDir(path)
    wall_before, cpu_before = _continue(state, ckpt)
    out.write_config(config.recorded())  # file options by absolute path: resumable from anywhere
    if objects is not None and objects.describe():
        out.write_json(OBJECTS_FILE, objects.describe())  # what was passed from Python in place of names
    state.t0 = time.perf_counter() - wall_before
    state.cpu0 = cpu_seconds() - cpu_before  # all threads and worker processes: what a loaded machine inflates least
    status, error, raised = "completed", None, None
    try:
        cbs.on_start(state)
        if state.resumed and 0 < state.start_round < config.rounds and not state.stop_reason:
            # asked first what the uninterrupted run asked after the checkpoint's round, a resumed run ends where
            # that one ended: a target reached, a privacy or time budget spent (a run that ran all its rounds
            # never asked)
            state.stop_reason = cbs.after_round(state, state.start_round - 1)
            state.final_round = state.start_round - 1 if state.stop_reason else None
        if config.eval.at_start and state.start_round == 0:  # the initial model, as round 0 (peers report it)
            _evaluate(state, -1, state.algo.start_metrics())
        for r in range(state.start_round if not state.stop_reason else config.rounds, config.rounds):
            metrics = state.algo.run_round(r)
            cbs.after_training(state, r, metrics)
            if metrics.get("reported_clients", 1) == 0 or state.algo.nobody_reported:
                state.skipped.append(r + 1)
                log.warning("round %d: no client reported; the round was skipped (no client update used)", r + 1)
            evaluated = (r + 1) % config.eval.every == 0 or r == config.rounds - 1
            if evaluated:
                _evaluate(state, r, metrics)
            stop = cbs.after_round(state, r)  # every callback hears of every round, the last one too
            state.stop_reason = stop if r < config.rounds - 1 else None  # the last round ends the run, not early
            if state.stop_reason:  # a callback ends the run here: the round is its last, evaluated and saved
                state.final_round = r
                if not evaluated:
                    _evaluate(state, r, metrics)
            cbs.on_round_end(state, r)
            if state.stop_reason:
                break
    except DivergenceError as e:
        advice = divergence_advice(type(state.algo), config.faults.byzantine)
        parts = (str(e), advice, _kept(path, state.last_checkpoint, type(state.algo)))
        status, error = "diverged", " ".join(p for p in parts if p)
    except RunStopped as e:
        status, error, raised = "stopped", str(e), e
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM turned into one by the command line
        raised, signal_name = e, getattr(e, "signal_name", "SIGINT")
        status, error = "interrupted", f"stopped by {signal_name}. " + _kept(path, state.last_checkpoint)
    except Exception as e:  # a bug or a problem only a round can show (a plug-in, an aggregator's bound)
        _end_after(state, e, _failed(state, e))
        raise
    except BaseException as e:  # the process is exiting (a plug-in's sys.exit): nothing more is written
        _end_after(state, e, None)
        raise
    try:
        summary = _summary(state, status, error)
        _write_run_files(state)
        out.write_json("summary.json", summary)
    except Exception as e:  # a plug-in algorithm's run_files(), say: failed, as a run that raised mid-way
        _end_after(state, e, _failed(state, e))
        raise
    try:
        cbs.on_end(state, summary)
    except Exception as end:
        # a diverged, interrupted or stopped run still raises what says so (the command line's line and status),
        # the callback's failure a note on it; a run with nothing of its own to raise raises that failure
        try:
            _outcome(state, summary, raised, on_divergence)
        except BaseException as e:
            e.add_note(_end_note(end))
            raise
        raise
    return _outcome(state, summary, raised, on_divergence)


def _end_after(state: RunState, e: BaseException, summary: dict[str, Any] | None) -> None:
    """End the callbacks of a run that raised ``e``: a callback whose ``on_end`` fails as well is a note on ``e``,
    never raised in its place, so that the caller sees the error that ended the run (the one summary.json names)."""
    try:
        state.callbacks.on_end(state, summary)
    except Exception as end:  # noqa: BLE001 - the run's own error matters more
        e.add_note(_end_note(end))


def _end_note(end: Exception) -> str:
    """The note added to how a run ended when a callback's ``on_end`` raised ``end`` as well; logged too, since the
    command line's one line shows the run's error without its notes."""
    note = f"While the run ended, a callback's on_end raised as well: {type(end).__name__}: {end}"
    log.warning("%s", note)
    return note


def _write_run_files(state: RunState) -> None:
    """The algorithm's own files of the run (e.g. an asynchronous method's ``events.csv``), beside its results."""
    for name, text in state.algo.run_files().items():
        atomic_write(state.out.path / name, text)


def _failed(state: RunState, e: Exception) -> dict[str, Any] | None:
    """Write ``summary.json`` with ``status: failed`` and the error of a run that raised ``e`` mid-way, so that
    its results so far are read as a failed run, not as one still going or killed; None where even that fails
    (then the original error is what the caller sees)."""
    try:
        summary = _summary(state, "failed", f"{type(e).__name__}: {e}")
        state.out.write_json("summary.json", summary)
    except Exception:  # noqa: BLE001 - the run's own error matters more than the summary's
        log.debug("summary.json of the failed run could not be written", exc_info=True)
        return None
    try:  # what happened up to the error (an asynchronous run's events) is its evidence
        _write_run_files(state)
    except Exception:  # noqa: BLE001 - e.g. the run files themselves were what failed
        log.debug("the failed run's own files could not be written", exc_info=True)
    return summary


def _check_faults(config: RunConfig) -> None:
    """Injected faults an algorithm does not handle are an error, never silently ignored."""
    Faults(config.faults, Seeds(config.seed)).require_handled(
        config.algorithm.name, getattr(ALGORITHMS.get(config.algorithm.name), "handles_faults", ())
    )
    robust.check(config, ALGORITHMS.get(config.algorithm.name))  # the attack and the aggregator (robustness)
    late = [f"{r:.6g}" for r in config.faults.outage_rounds if r > config.rounds]
    if late:  # allowed (a fault switched on that hits nobody), but rarely meant
        shown = ", ".join(late)
        log.warning("faults.outage_rounds [%s] are after the last round (%d) and never happen", shown, config.rounds)
    f, name = config.faults, config.algorithm.name
    cls = ALGORITHMS.get(name)
    if f.sim_time and not getattr(cls, "sim_clock", False):
        raise ConfigError(
            f"faults.sim_time: algorithm '{name}' ({getattr(cls, 'family', 'a plug-in')} family) has no simulated "
            "clock; it is the star family's (centralized: fedavg, fedprox, scaffold, ..., fedasync, fedbuff); "
            "leave it out"
        )
    if f.work_unit == "step" and not getattr(cls, "counts_steps", False):
        # a family whose clients' work is not a count of local steps has no step to time (each client's work
        # is one round), so the unit would be a silent alias of ``round``
        raise ConfigError(
            f"faults.work_unit: step: algorithm '{name}' ({getattr(cls, 'family', 'a plug-in')} family) counts no "
            "local steps per client; the unit step is the star, split and hierarchical families'; use round (the "
            "default) or leave it out"
        )
    if f.work_unit == "step" and f.deadline is None and not f.sim_time and not getattr(cls, "asynchronous", False):
        # name only the keys that would give it effect: a family without the star's clock refuses faults.sim_time
        keys = "faults.deadline or faults.sim_time" if getattr(cls, "sim_clock", False) else "faults.deadline"
        log.warning("faults.work_unit changes nothing in %s without %s", name, keys)
    if f.straggler_policy == "late" and f.deadline is None:  # allowed, as above
        log.warning("faults.straggler_policy 'late' never applies: without faults.deadline no upload is late")
    spread = f.speed_jitter > 0 or f.speed_sigma != FaultsConfig.speed_sigma
    if spread and f.deadline is None and not f.sim_time and not getattr(cls, "asynchronous", False):
        # a synchronous round waits for everyone: the speeds decide nothing until a deadline makes some late (or
        # the clock measures the rounds)
        log.warning("faults.speed_sigma / speed_jitter change nothing in %s without faults.deadline", name)


def _continue(state: RunState, ckpt: dict[str, Any] | None) -> tuple[float, float]:
    """Take a resumed run's rows and bookkeeping from its checkpoint (a new run removes a stale one); the
    wall and CPU seconds spent before."""
    if ckpt is None:
        # a checkpoint left by an earlier run in this directory must not be resumed into this one
        (state.path / CHECKPOINT).unlink(missing_ok=True)
        return 0.0, 0.0
    state.out.rows = list(ckpt["rows"])
    state.out.flush_metrics()
    state.start_round = state.last_checkpoint = ckpt["next_round"]
    state.skipped = list(ckpt.get("skipped_rounds", []))
    state.loss_reference = dict(ckpt.get("loss_reference", {}))  # the divergence guard's first losses
    return ckpt["wall_seconds"], float(ckpt.get("cpu_seconds", 0.0))


def _evaluate(state: RunState, r: int, metrics: dict[str, Any]) -> None:
    """Evaluate round ``r`` (``-1``: the initial model, recorded as round 0), record its row and tell the
    callbacks. The bytes are the ledger's totals up to that round."""
    ev = state.algo.evaluate(r)
    own = dict(ev)
    state.callbacks.on_evaluation(state, r, ev)
    _check_added(ev, own, metrics, r)
    ev = _recordable(ev, r)
    ledger = state.ctx.ledger
    row = {
        "round": r + 1,
        **ev,
        "bytes_up": ledger.bytes("up", upto_round=r) if r >= 0 else 0,
        "bytes_down": ledger.bytes("down", upto_round=r) if r >= 0 else 0,
        "bytes_lateral": ledger.bytes("lateral", upto_round=r) if r >= 0 else 0,
        "bytes_total": ledger.bytes(upto_round=r) if r >= 0 else 0,
        "wall_seconds": round(state.wall(), 4),
        **metrics,
    }
    if "reported_clients" in metrics:
        row["skipped_rounds"] = len(state.skipped)  # cumulative: rounds without eval are counted too
    with signals_held():  # a Ctrl-C or SIGTERM between the two files left them, and summary.json, a row apart
        state.out.add_metrics(row)
    state.callbacks.on_row(state, row)


# what a metrics row records itself, beside the evaluation's values
ROW_KEYS = ("round", "bytes_up", "bytes_down", "bytes_lateral", "bytes_total", "wall_seconds", "skipped_rounds")


def _check_added(values: dict[str, Any], own: dict[str, Any], metrics: dict[str, Any], r: int) -> None:
    """What the callbacks' ``on_evaluation`` set in ``values`` (the evaluation's ``own`` values before them): a key
    the row records itself, or a training metric, is one error naming it (``round`` set to 99 made every row round
    99, a ``train_loss`` was silently replaced by the round's own)."""
    for k, v in values.items():
        if (k in ROW_KEYS or k in metrics) and not (k in own and v is own[k]):
            raise ValueError(
                f"round {r + 1}: a callback's on_evaluation set {k!r}, which the metrics row records itself; add "
                "a value under a name of its own"
            )


def _recordable(values: dict[str, Any], r: int) -> dict[str, Any]:
    """The evaluation's values as a metrics row records them, callbacks' additions included: a numpy number or a
    one-element tensor as the Python number it holds; any other kind one error naming its key (it failed in the
    JSON writer, the row half-written); a NaN or Inf the divergence it is (the guard saw the values before the
    callbacks after it added theirs), but for a metric undefined on its set (``defined``)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, np.generic) or (isinstance(v, torch.Tensor) and v.numel() == 1):
            v = v.item()
        if not isinstance(v, int | float | str | None):
            raise TypeError(
                f"round {r + 1}: the evaluation's value {k!r} is a {type(v).__name__}; a metrics row holds numbers "
                "or text (a callback's on_evaluation adds float(...))"
            )
        out[k] = v
    check_finite(defined(out), r, "an evaluation metric")
    return out


def _outcome(state: RunState, summary: dict[str, Any], raised: BaseException | None, on_divergence: str) -> Result:
    """The Result, or the exception that tells the caller how the run ended."""
    error, path = summary["error"], state.path
    if isinstance(raised, KeyboardInterrupt):
        raise RunInterrupted(error or "interrupted", getattr(raised, "signal_name", "SIGINT")) from None
    if isinstance(raised, RunStopped):
        err = RunStopped(f"{error} Results so far are in {path}")
        err.run_dir = path
        raise err from None
    if error and on_divergence == "raise":
        raise DivergenceError(f"{error} Results so far are in {path}")
    return Result(path, state.rows, summary, state.algo)


def divergence_advice(cls: type[Algorithm], byzantine: dict[str, Any] | None = None) -> str:
    """What to change after a divergence, for the one line that reports it: the step sizes the algorithm
    ``cls`` reads (:func:`~fedweave.algorithms.base.step_size_keys`: a server's ``algorithm.server_lr`` diverges
    a run as well as ``local.lr``, and the confederated family reads no ``local`` key), and ``local.grad_clip``
    where the algorithm reads it, after the method's own :attr:`~fedweave.algorithms.base.Algorithm.divergence_hint`.
    Under ``faults.byzantine`` (``byzantine``) the attack is named first: an
    attacker's upload may be anything, so a divergence there is as likely the attack's as a step size's."""
    keys = step_size_keys(cls)
    clip = " or enable local.grad_clip" if reads_local(cls, "grad_clip") else ""
    if not keys:
        advice = f"Enable {clip.removeprefix(' or enable ')}." if clip else ""
    else:
        which = keys[0] if len(keys) == 1 else f"one of its step sizes ({', '.join(keys)})"
        advice = f"Lower {which}{clip}."
    if cls.divergence_hint:  # a cause of the method's own, which no step size cures (q-FFL's F_k^q)
        advice = f"{cls.divergence_hint} Otherwise: {advice[0].lower()}{advice[1:]}" if advice else cls.divergence_hint
    if not byzantine or not (byzantine.get("fraction") or byzantine.get("clients")):  # fraction 0: no attacker
        return advice
    attack = (
        f"The attackers of faults.byzantine (attack {byzantine.get('attack')!r}) may be the cause: an aggregator "
        "that bounds them (aggregator; docs/robustness.md) or a weaker attack keeps the model finite."
    )
    return f"{attack} Otherwise: {advice[0].lower()}{advice[1:]}" if advice else attack


def _kept(path: Path, checkpoint_round: int | None, diverged: type[Algorithm] | None = None) -> str:
    """What is left to continue from, for the one line that reports a stopped run; after a divergence of the
    algorithm ``diverged``, how to continue with a smaller step: a resumed run may lower ``local.lr`` or set
    ``local.grad_clip`` where the algorithm reads them (checkpoints.RESUMABLE_LOCAL), while a step size that is
    an ``algorithm`` option (FedAdam's ``algorithm.server_lr``) is named with the new run it needs."""
    if not checkpoint_round:
        return "No checkpoint was written (output.checkpoint_every is 0 or no checkpoint round was reached)."
    kept = f"The checkpoint of round {checkpoint_round} is kept"
    if diverged is None:
        return f"{kept}; continue with 'fedweave run --resume {path}'."
    keys = step_size_keys(diverged)
    # the step sizes a resume may lower (local.lr: checkpoints.RESUMABLE_LOCAL), and those that only a new run
    # may: the algorithm's own options, which the checkpoint's config holds fixed
    resumable = [k for k in keys if k.removeprefix("local.") in RESUMABLE_LOCAL and k.startswith("local.")]
    fixed = [k for k in keys if k not in resumable]
    new_run = f"{', '.join(fixed[:-1])} or {fixed[-1]}" if len(fixed) > 1 else "".join(fixed)
    if not keys:  # no step size to lower (divergence_advice says what else to change)
        return f"{kept}; continue with 'fedweave run --resume {path}'."
    if not resumable:
        return (
            f"{kept}, but a resumed run may not change an algorithm option: start a new run with a smaller {new_run}."
        )
    offer = f"{kept}; continue with 'fedweave run --resume {path} {' '.join(f'{k}=SMALLER' for k in resumable)}'"
    if reads_local(diverged, "grad_clip"):  # a resume may also bound the step (RESUMABLE_LOCAL)
        offer += " (or with local.grad_clip=MAX_NORM)"
    if not fixed:
        return f"{offer}."
    # a resume that lowers local.lr leaves the algorithm's own step sizes as they were: they are named, with
    # the new run they need, so that a divergence through FedAdam's server_lr is not sent to local.lr alone
    return f"{offer}, or start a new run with a smaller {new_run} (a resumed run may not change an algorithm option)."


def main_metric(task: Task, rows: list[dict[str, Any]]) -> str | None:
    """The metrics column of the task's main metric: ``test_<main>``, or ``val_<main>`` in a tuning run."""
    for key in (task.main_key, f"val_{task.main}"):
        if any(r.get(key) is not None for r in rows):
            return key
    return None


def _summary(state: RunState, status: str, error: str | None) -> dict[str, Any]:
    config, task, rows = state.config, state.ctx.task, state.rows
    key = main_metric(task, rows)
    scored = [r for r in rows if key is not None and r.get(key) is not None and r["round"] > 0]
    best = None
    for r in scored:  # the first round that reached the best value; NaN (a metric undefined on its set) is none
        if r[key] != r[key]:
            continue
        if best is None or task.better(r[key], best[key]):
            best = r
    accs = [r for r in rows if r.get("test_accuracy") is not None and r["round"] > 0]
    best_acc = max(accs, key=lambda r: r["test_accuracy"]) if accs else None
    trainer = getattr(state.algo, "trainer", None)
    summary = {
        "status": status,
        "error": error,
        "name": config.name,
        "algorithm": config.algorithm.name,
        "seed": config.seed,
        "rounds": rows[-1]["round"] if rows else 0,
        "main_metric": key,
        "direction": task.direction if key is not None else None,  # of the main metric: none, no direction
        "final_main": scored[-1][key] if scored else None,
        "best_main": best[key] if best else None,
        "best_round": best["round"] if best else None,
        "final_test_accuracy": accs[-1]["test_accuracy"] if accs else None,
        "best_test_accuracy": best_acc["test_accuracy"] if best_acc else None,
        "final": rows[-1] if rows else None,
        "wall_seconds": round(state.wall(), 3),
        "communication": state.ctx.ledger.summary(),
        "versions": {
            "fedweave": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "cpu_seconds": round(cpu_seconds() - state.cpu0, 3),
        "execution": {  # what `backend: auto` resolved to, and the threads it ran with; null for a family with
            # its own loop (split, confederated), which reads no `backend` (it recorded the configured one)
            "backend": trainer.backend if trainer is not None else None,
            "threads": state.algo.compute_threads,  # what the rounds computed on (a family may use fewer)
        },
        "placement": state.ctx.placement.summary(),  # what `device: auto` resolved to, its name, the precision
    }
    if state.skipped or config.faults != type(config.faults)():
        summary["skipped_rounds"] = state.skipped
    if state.stop_reason:
        summary["stopped_early"] = state.stop_reason  # a callback ended the run before config.rounds
    if getattr(state.algo, "privacy", None) is not None:  # privacy: epsilon, delta, accountant, sigma, q, releases
        summary["privacy"] = state.algo.privacy.summary()
    return summary


def _no_checkpoint(path: Path) -> str:
    """Why the directory ``path`` has no checkpoint, and what to do: a sweep's runs are resumed by the sweep; a
    run that checkpoints stopped before its first checkpoint (telling it to set output.checkpoint_every, which
    it had, sent its user looking for a setting that was there)."""
    if (path / "sweep.json").is_file():
        return "it is a sweep directory; run the sweep again (same --out) to resume its runs"
    try:
        every = load_config(path / "config.yaml").output.checkpoint_every
    except (ConfigError, OSError):  # no readable config: say what a run needs in general
        every = 0
    if every:
        return (
            f"the run stopped before its first checkpoint (output.checkpoint_every: {every}); start it again with "
            f"'fedweave run {path / 'config.yaml'} --out {path} --overwrite'"
        )
    return "the run has no checkpoint to resume from (set output.checkpoint_every)"


def resume(
    run_dir: str | Path,
    overrides: list[str] | None = None,
    *,
    progress: bool | None = None,
    objects: RunObjects | None = None,
    callbacks: Sequence[Callback] = (),
    on_divergence: Literal["raise", "return"] = "raise",
) -> Result:
    """Continue the run in ``run_dir`` from its last checkpoint. ``overrides`` may change only what a resumed
    run can change (:data:`RESUMABLE_CHANGES`, e.g. ``rounds=200`` to extend a finished run, which then gives
    the numbers of a run started with 200 rounds; or a smaller ``local.lr`` after a divergence).

    ``objects``: those the run was made with, when it was made with objects passed from Python (its config
    records ``python``; checked against its ``objects.json``, :func:`fedweave.resume`); ``callbacks``,
    ``progress`` and ``on_divergence`` as in :func:`run`."""
    if not isinstance(run_dir, str | os.PathLike):
        raise ConfigError(f"run_dir must be a directory's path (str or Path), got {type(run_dir).__name__}")
    path = Path(run_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a run directory")
    if not (path / CHECKPOINT).is_file():
        raise CheckpointError(f"{path / CHECKPOINT} not found: {_no_checkpoint(path)}")
    config = load_config(path / "config.yaml", overrides)
    if overrides and config.output.dir != load_config(path / "config.yaml").output.dir:
        # accepted before: the run went on in run_dir and its config.yaml named the other folder
        raise ConfigError(f"output.dir does not apply to a resumed run: it continues in {path}")
    check_resumed_objects(config, objects)
    return run(
        config,
        run_dir=path,
        progress=progress,
        resume=True,
        on_divergence=on_divergence,
        objects=objects,
        callbacks=callbacks,
    )
