"""The runner: rounds, evaluation, divergence checks, checkpoints and the run directory."""

from __future__ import annotations

import io
import json
import logging
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from fedweave import __version__
from fedweave.algorithms.base import Algorithm, RunContext, build_algorithm
from fedweave.config import ConfigError, RunConfig
from fedweave.config import load as load_config
from fedweave.faults import Faults
from fedweave.memory import cpu_seconds
from fedweave.registry import ALGORITHMS
from fedweave.results import RunDir, atomic_write, default_run_dir, read_metrics
from fedweave.seeding import Seeds

log = logging.getLogger("fedweave")


class DivergenceError(RuntimeError):
    """Training produced NaN or Inf; the run stopped and kept its last good results."""


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


CHECKPOINT = "checkpoint.pt"
# Config keys a resumed run may change: how long it runs, how it reports, which backend; not what it computes.
RESUMABLE_CHANGES = ("rounds", "output", "threads", "eval", "backend")


def _tensors(obj: Any, path: str = ""):
    """(path, tensor) for every floating tensor nested in dicts and lists of ``obj``."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield path or "state", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _tensors(v, f"{path}.{k}" if path else str(k))


def finite_tensors(state: Any) -> set[str]:
    """Paths of the floating tensors of ``state`` that hold no NaN or Inf.

    Taken from the freshly built algorithm, it separates the tensors that must stay finite (models,
    momenta, control variates) from those that use NaN/Inf as a marker (e.g. 'no loss tracked yet').
    """
    return {p for p, t in _tensors(state) if bool(torch.isfinite(t).all())}


def _diverged(state: Any, must_be_finite: set[str] | None) -> str | None:
    for p, t in _tensors(state):
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
        "algorithm": algo_state,
        "ledger": algo.ledger.state_dict(),
        "rows": run.rows,
        **(extra or {}),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    if verify:
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # an object torch's safe loader refuses (e.g. a numpy array or a class)
            raise TypeError(
                f"algorithm '{algo.name}': its state_dict() holds an object torch.load(weights_only=True) "
                f"refuses, so the run could not be resumed; keep tensors, numbers, strings, lists and dicts "
                f"only ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
    atomic_write(run.path / CHECKPOINT, data)


def _check_resumable(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    changed = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if changed:
        raise ConfigError(
            f"{path / 'config.yaml'}: {', '.join(changed)} changed since the checkpoint was written; a resumed "
            f"run may change only {', '.join(RESUMABLE_CHANGES)}. Start a new run instead"
        )


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
    prepare: Callable[[Algorithm], None] | None = None,
) -> Result:
    """Run an experiment described by ``config``; write and return its results.

    A run that meets NaN or Inf stops; its results so far are written with ``status: diverged``. Then
    ``on_divergence="raise"`` raises :class:`DivergenceError` (one experiment: an error), ``"return"`` returns
    that Result (a sweep, where a diverged run is a result to report). ``prepare`` is called with the built
    algorithm before its first round (the Flower deployment points its trainer at the SuperNodes)."""
    if on_divergence not in ("raise", "return"):
        raise ValueError(f"on_divergence must be 'raise' or 'return', got {on_divergence!r}")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    path = Path(run_dir) if run_dir else Path(config.output.dir) if config.output.dir else None
    path = path or default_run_dir(config.name, config.seed)
    # injected faults an algorithm does not handle are an error, never silently ignored
    Faults(config.faults, Seeds(config.seed)).require_handled(
        config.algorithm.name, getattr(ALGORITHMS.get(config.algorithm.name), "handles_faults", ())
    )
    out = RunDir(path)
    ctx = RunContext(config)
    algo = build_algorithm(ctx)
    if prepare is not None:
        prepare(algo)
    finite_at_start = finite_tensors(algo.state_dict()) if config.output.checkpoint_every else set()
    start_round, wall_before, cpu_before, skipped = 0, 0.0, 0.0, []
    if resume:
        ckpt = torch.load(out.path / CHECKPOINT, weights_only=True)
        if "config" in ckpt:
            # re-resolved, so keys added to the config schema since then (with their defaults) are no change
            _check_resumable(load_config(ckpt["config"]).to_dict(), config.to_dict(), out.path)
        algo.load_state_dict(ckpt["algorithm"])
        ctx.ledger.load_state_dict(ckpt["ledger"])
        out.rows = list(ckpt["rows"])
        out.flush_metrics()
        start_round, wall_before = ckpt["next_round"], ckpt["wall_seconds"]
        cpu_before = float(ckpt.get("cpu_seconds", 0.0))
        skipped = list(ckpt.get("skipped_rounds", []))
    else:
        # a checkpoint left by an earlier run in this directory must not be resumed into this one
        (out.path / CHECKPOINT).unlink(missing_ok=True)
    out.write_config(config.to_dict())
    if "partition" in ctx.__dict__ and not resume:  # the family partitioned a dataset: report it
        from fedweave.data.report import write_partition_report

        ds = ctx.dataset
        write_partition_report(ctx.partition, ds.train_y.numpy(), ds.num_classes, out.path, plot=config.output.plots)

    show = config.output.progress if progress is None else progress
    bar = _progress(show, config.rounds, start_round)
    t0 = time.perf_counter() - wall_before
    cpu0 = cpu_seconds() - cpu_before  # all threads and worker processes: what a loaded machine inflates least
    status, error = "completed", None
    ledger = ctx.ledger
    verified = False
    try:
        for r in range(start_round, config.rounds):
            round_metrics = algo.run_round(r)
            _check_finite(round_metrics, r, "a training metric")
            if round_metrics.get("reported_clients", 1) == 0:
                skipped.append(r + 1)
                log.warning("round %d: no client reported; the round was skipped (no client update used)", r + 1)
            last = r == config.rounds - 1
            if (r + 1) % config.eval.every == 0 or last:
                ev = algo.evaluate(r)
                _check_finite(ev, r, "an evaluation metric")
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
                if bar is not None:
                    post = {"acc": f"{ev['test_accuracy']:.4f}"} if "test_accuracy" in ev else {}
                    post["sent"] = f"{row['bytes_total'] / 2**20:.1f}MiB"
                    bar.set_postfix(post, refresh=False)
            every = config.output.checkpoint_every
            if every and ((r + 1) % every == 0 or last):
                extra = {"config": config.to_dict(), "skipped_rounds": skipped}
                extra["cpu_seconds"] = cpu_seconds() - cpu0
                save_checkpoint(
                    out,
                    algo,
                    r + 1,
                    time.perf_counter() - t0,
                    extra=extra,
                    verify=not verified,
                    must_be_finite=finite_at_start,
                )
                verified = True
            if bar is not None:
                bar.update(1)
    except DivergenceError as e:
        status, error = "diverged", str(e)
    finally:
        if bar is not None:
            bar.close()
    summary = _summary(config, out.rows, ledger.summary(), time.perf_counter() - t0, status, error)
    summary["cpu_seconds"] = round(cpu_seconds() - cpu0, 3)
    trainer = getattr(algo, "trainer", None)
    summary["execution"] = {  # what `backend: auto` resolved to, and the threads it ran with
        "backend": trainer.backend if trainer is not None else config.backend,
        "threads": torch.get_num_threads(),
    }
    if skipped or config.faults != type(config.faults)():
        summary["skipped_rounds"] = skipped
    out.write_json("summary.json", summary)
    if config.output.plots and out.rows:
        from fedweave.plots import plot_runs

        metric = (
            "test_accuracy"
            if "test_accuracy" in out.rows[-1]
            else next((k for k in out.rows[-1] if k not in ("round",)), "test_accuracy")
        )
        plot_runs([out.path], out.path, metric=metric)
    if error and on_divergence == "raise":
        raise DivergenceError(f"{error} Results so far are in {out.path}")
    return Result(out.path, out.rows, summary, algo)


def _summary(config: RunConfig, rows, ledger_summary, wall: float, status: str, error: str | None) -> dict:
    accs = [r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None]
    best = max(range(len(accs)), key=accs.__getitem__) if accs else None
    return {
        "status": status,
        "error": error,
        "name": config.name,
        "algorithm": config.algorithm.name,
        "seed": config.seed,
        "rounds": rows[-1]["round"] if rows else 0,
        "final_test_accuracy": accs[-1] if accs else None,
        "best_test_accuracy": accs[best] if accs else None,
        "best_round": rows[best]["round"] if best is not None else None,
        "final": rows[-1] if rows else None,
        "wall_seconds": round(wall, 3),
        "communication": ledger_summary,
        "versions": {
            "fedweave": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def resume(run_dir: str | Path, *, progress: bool | None = None) -> Result:
    """Continue the run in ``run_dir`` from its last checkpoint."""
    path = Path(run_dir)
    if not (path / CHECKPOINT).is_file():
        raise FileNotFoundError(f"{path / CHECKPOINT} not found: the run has no checkpoint to resume from")
    return run(load_config(path / "config.yaml"), run_dir=path, progress=progress, resume=True)


def run_config(source: str | Path | dict | RunConfig, overrides: list[str] | None = None, **kw: Any) -> Result:
    cfg = source if isinstance(source, RunConfig) else load_config(source, overrides)
    return run(cfg, **kw)
