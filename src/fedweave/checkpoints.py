"""Checkpoints: the state after a round, written atomically and read back safely (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fedweave.algorithms.base import Algorithm, RunContext
from fedweave.config import ConfigError, RunConfig
from fedweave.config import load as load_config
from fedweave.errors import CheckpointError, DivergenceError
from fedweave.execution.placement import move_tensors
from fedweave.results import RunDir, atomic_write
from fedweave.topology.samplers import Sampler

log = logging.getLogger("fedweave")

CHECKPOINT = "checkpoint.pt"
# Config keys a resumed run may change: how long it runs, how it reports, which backend and device (the
# checkpoint is device-independent), when it stops; not what it computes.
RESUMABLE_CHANGES = ("rounds", "output", "threads", "eval", "backend", "device", "memory", "callbacks")
# ...and these change what it computes from the resumed round on (a smaller lr after a divergence, say).
RESUMABLE_LOCAL = ("lr", "grad_clip")
# ...and these change what is measured or when the run stops, from the resumed round on: a finished run has no
# round left to take them
RESUMABLE_REPORTING = ("eval", "callbacks")
# ...but not these keys of a resumable section: eval.holdout takes each client's test samples out of its training
# data, so a changed one trained the resumed rounds on other samples (a run of neither holdout, labelled the new)
FIXED_KEYS = ("eval.holdout",)


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


def nan_markers(state: Any) -> frozenset[str]:
    """Paths of the floating tensors of ``state`` that hold NaN or Inf.

    Taken from the freshly built algorithm: a tensor a method builds with NaN uses it as a marker ('no loss
    tracked yet'), which a state may keep. Every other floating tensor of a state must stay finite, those the
    state gains later included (an asynchronous method's jobs in flight, a robust aggregator's center).
    """
    return frozenset(p for p, t in floating_tensors(state) if not bool(torch.isfinite(t).all()))


def _diverged(state: Any, markers: frozenset[str]) -> str | None:
    """The first floating tensor of ``state`` outside ``markers`` that holds NaN or Inf, or None (one pass)."""
    for p, t in floating_tensors(state):
        if p not in markers and not bool(torch.isfinite(t).all()):
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
    markers: frozenset[str] = frozenset(),
) -> None:
    """Write the state after round ``next_round - 1`` atomically (temp file + rename).

    A state with NaN/Inf in a floating tensor other than the ``markers`` (paths, :func:`nan_markers`; default:
    none) is never written (it raises :class:`DivergenceError`), so the checkpoint on disk is always the last
    good one. With ``verify`` the bytes are read back with ``weights_only=True`` first, so a state that could
    not be resumed fails now rather than at resume time.
    """
    algo_state = algo.state_dict()
    bad = _diverged(algo_state, markers)
    if bad:
        raise DivergenceError(
            f"round {next_round}: the algorithm state '{bad}' is not finite; the run stopped before checkpointing it."
        )  # the runner adds which step sizes to lower (fedweave.runner.divergence_advice)
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


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
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


def _check_resumable(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    def local(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.get("local", {}).items() if k not in RESUMABLE_LOCAL}

    changed = sorted(
        k
        for k in set(saved) | set(now)
        if k not in RESUMABLE_CHANGES and (local(saved) != local(now) if k == "local" else saved.get(k) != now.get(k))
    )

    def at(d: dict[str, Any], dotted: str) -> Any:
        section, key = dotted.split(".")
        return d.get(section, {}).get(key)

    changed += [k for k in FIXED_KEYS if at(saved, k) != at(now, k)]
    if changed:
        allowed = ", ".join([*RESUMABLE_CHANGES, *(f"local.{k}" for k in RESUMABLE_LOCAL)])
        allowed += f" (not {', '.join(FIXED_KEYS)})"
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
    saved = ckpt.get("config")
    if (
        isinstance(nxt, int)
        and isinstance(saved, dict)
        and isinstance(saved.get("rounds"), int)
        and config.rounds < nxt <= saved["rounds"]
    ):  # an intact checkpoint, and a resume that asks for fewer rounds than it has run: the key is rounds
        raise ConfigError(
            f"rounds: {config.rounds} is below the round the checkpoint continues from ({nxt}); a resumed run may "
            f"shorten the run down to that round, not below: give rounds >= {nxt}"
        )
    if not isinstance(nxt, int) or isinstance(nxt, bool) or not 0 <= nxt <= config.rounds:
        raise CheckpointError(
            f"{file}: next_round must be a round in [0, {config.rounds}] (the config's rounds), got {nxt!r}"
        )
    if not isinstance(ckpt["rows"], list) or not isinstance(ckpt["algorithm"], dict):
        raise CheckpointError(f"{file} is damaged: 'rows' must be a list and 'algorithm' a mapping")
    if "config" in ckpt:
        # before the state: a config changed where a resume may not change it (faults.sim_time switched on, a
        # compression section added) also changes the state's keys, and the key is what the line must name
        # (re-resolved, so keys added to the config schema since then, with their defaults, are no change; as
        # recorded, so a file option an older run recorded relative is its absolute form here, in its directory)
        _check_resumable(load_config(ckpt["config"]).recorded(), config.recorded(), path)
    want, got = _shapes(algo.state_dict()), _shapes(ckpt["algorithm"])
    for p, shape in want.items():
        if p in got and got[p] != shape and not (p in algo.growing_state and got[p][1:] == shape[1:]):
            raise CheckpointError(
                f"{file}: the algorithm state '{p}' has shape {list(got[p])} but this run's is {list(shape)}; "
                "it was written by a different model or population"
            )
    absent = [k for k in algo.state_dict() if k not in ckpt["algorithm"]]
    if absent:
        raise CheckpointError(f"{file}: the algorithm state lacks {', '.join(map(repr, absent))}")
    # a checkpoint is never written with NaN/Inf outside the markers the fresh algorithm holds (save_checkpoint
    # refuses): one that holds them is damaged, not a reason to lower the learning rate
    bad = _diverged(ckpt["algorithm"], nan_markers(algo.state_dict()))
    if bad:
        raise CheckpointError(
            f"{file} is damaged: its algorithm state '{bad}' holds NaN or Inf, which no checkpoint is written "
            "with; it was not loaded"
        )
    return ckpt


def _over_the_total(config: RunConfig, algo: Algorithm, saved_rounds: int) -> str | None:
    """Why the rounds still to come depend on the run's total ``rounds`` (so a resumed run may not change it
    from the checkpoint's ``saved_rounds``), or None."""
    if config.local.lr_schedule == "cosine":
        return "local.lr_schedule is cosine"
    if algo.uses_total_rounds:
        return algo.name
    if config.privacy is not None and config.privacy.noise_multiplier == "auto":
        # sigma is calibrated to spend target_epsilon in the planned rounds: the rounds already released used
        # the old total's sigma, so an extension would stop at once on the spent budget
        return "privacy.noise_multiplier is auto, calibrated to the planned rounds"
    sampler = getattr(algo, "sampler", None)
    if (
        config.privacy is not None
        and config.privacy.level == "user"
        and isinstance(sampler, Sampler)
        and sampler.expected(saved_rounds) != sampler.expected()
    ):
        # user-level DP-FedAvg divides the noised sum by E, the mean entry length of a schedule over the planned rounds
        return "privacy's expected clients per round E, the mean of the sampler schedule's entries over the rounds"
    return None


def _check_user_files(saved: Any, ctx: RunContext) -> None:
    """What the run read from the user's own files (``RunContext.user_files``) is what its checkpoint recorded:
    the config names files by path only, so a data or partition file edited since would silently train the
    rounds still to come on other samples; one line instead. A checkpoint without the record is not checked."""
    if not isinstance(saved, dict):
        return
    what = {
        "dataset": (f"dataset {ctx.config.dataset.name!r}", "the data it loaded"),
        "partition": ("partition.path", "the from_file partition"),
        "sampler": ("sampler.file", "the schedule"),
    }
    for key, now in ctx.user_files.items():
        was = saved.get(key)
        if was and was != now:
            name, thing = what[key]
            raise ConfigError(
                f"{name}: {thing} changed since the checkpoint (SHA-256 {now[:12]}..., the run was made with "
                f"{was[:12]}...); a resumed run continues on the files it started with: restore them, or start a "
                "new run"
            )


def restore_checkpoint(path: Path, algo: Algorithm, ctx: RunContext) -> dict[str, Any]:
    """Load ``path``'s checkpoint into the freshly built ``algo`` and the run's ledger, after checking that
    it belongs to this run (:func:`load_checkpoint`) and that the config changed only where a resumed run may
    change it; the checkpoint's contents are returned (rows, next round, bookkeeping)."""
    config = ctx.config
    ckpt = load_checkpoint(path, algo, config, ctx.device)
    if "config" in ckpt:  # (what a resume may change was checked by load_checkpoint)
        saved = load_config(ckpt["config"])
        why = _over_the_total(config, algo, saved.rounds) if config.rounds != saved.rounds else None
        if why:
            raise ConfigError(
                f"rounds: cannot change from {saved.rounds} to {config.rounds} on resume because the "
                f"schedule depends on the total ({why}); start a new run with rounds={config.rounds}"
            )
        changed = [f"local.{k}" for k in RESUMABLE_LOCAL if getattr(saved.local, k) != getattr(config.local, k)]
        was, now = saved.to_dict(), config.to_dict()
        changed += [k for k in RESUMABLE_REPORTING if was[k] != now[k]]
        if changed and ckpt["next_round"] >= config.rounds:
            # no round is left to take the new value: the resume only wrote it into config.yaml, beside the
            # numbers of the old one (another eval's columns, a stop the run never made)
            raise ConfigError(
                f"{changed[0]}: the checkpoint holds all {config.rounds} rounds of the run, so no round would run "
                f"with the new value; give more rounds (rounds=N) to continue with it, or start a new run"
            )
    _check_user_files(ckpt.get("user_files"), ctx)
    try:
        algo.load_state_dict(ckpt["algorithm"])
        ctx.ledger.load_state_dict(ckpt["ledger"], keep_storage=True)  # the storage declared at start-up too
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path / CHECKPOINT} does not fit this run ({type(e).__name__}: {e})") from e
    return ckpt
