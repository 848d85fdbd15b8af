"""Callbacks: everything that happens around a run's rounds (DESIGN principle 14).

The runner is a short loop: train a round, evaluate it when due, record the row. Everything else (the
progress bar, the divergence guard, checkpoints, the partition report, plots, trackers, stopping at a target
or a budget, the deployment's preparation) is a :class:`Callback`, and your own callbacks use the same hooks::

    class PrintBest(fedweave.Callback):
        def on_row(self, run, row):
            print(row["round"], row.get("test_accuracy"))

    fedweave.run("configs/demo.yaml", callbacks=[PrintBest(), fedweave.callbacks.StopAtTarget("test_accuracy", 0.9)])

Hooks are called in list order, the built-in callbacks first. Within one round they come in this order:
``after_training`` (the round's training metrics), then, in a round that is evaluated, ``on_evaluation``
(the metrics before they are recorded) and ``on_row`` (the recorded row), then ``after_round`` (which may
ask to stop), then ``on_round_end`` (the round is over: the built-in checkpointer writes ``checkpoint.pt``
there first and announces it with ``on_checkpoint``, so your callbacks hear of the checkpoint before the
round's end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fedweave.algorithms.base import Algorithm, RunContext
    from fedweave.config import RunConfig
    from fedweave.results import RunDir


@dataclass
class RunState:
    """What a callback sees of the run: its config and context, the algorithm, the run directory and the
    run's bookkeeping. ``out`` is None in :meth:`Callback.on_build` (nothing is written yet)."""

    config: RunConfig
    ctx: RunContext
    algo: Algorithm
    resumed: bool = False
    out: RunDir | None = None
    start_round: int = 0  #: the first round this process runs (0, or the checkpoint's next round)
    t0: float = 0.0  #: time.perf_counter() at round 0: the wall clock continues across a resume
    cpu0: float = 0.0  #: fedweave.memory.cpu_seconds() at round 0, likewise
    skipped: list[int] = field(default_factory=list)  #: rounds in which no client reported (1-based)
    #: the first positive value of each loss (the divergence guard's explosion reference), kept in the checkpoint:
    #: a loss of a round that was not evaluated (round 1's ``train_loss`` under ``eval.every: 3``) is in no row
    loss_reference: dict[str, float] = field(default_factory=dict)
    last_checkpoint: int | None = None  #: the round the checkpoint on disk holds
    final_round: int | None = None  #: set when the run ends early: the last round it ran (0-based)
    stop_reason: str | None = None
    callbacks: CallbackList | None = None  #: every callback of the run, to announce events (on_checkpoint)

    @property
    def path(self) -> Path:
        """The run directory (from :meth:`Callback.on_start` on)."""
        assert self.out is not None, "the run directory exists from on_start on"
        return self.out.path

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The metric rows recorded so far (a resumed run's earlier rows included)."""
        return self.out.rows if self.out is not None else []

    def wall(self) -> float:
        """Wall seconds of the run so far (continued across resumes)."""
        return time.perf_counter() - self.t0

    def is_last(self, r: int) -> bool:
        """Whether round ``r`` (0-based) is the run's last: the configured last one or where it stops early."""
        return r == self.config.rounds - 1 or r == self.final_round


class Callback:
    """A run's callback: override the hooks you need; each default does nothing.

    A hook may raise to end the run: :class:`~fedweave.errors.DivergenceError` ends it as ``diverged``
    (results so far kept), any other exception as an error. Only ``after_round`` asks to stop, by returning
    a reason (a non-empty string) or True.
    """

    def on_build(self, run: RunState) -> None:
        """The algorithm is built and nothing is written yet (the deployment points its trainer at the
        SuperNodes here, so a failure leaves no file)."""

    def on_start(self, run: RunState) -> None:
        """The run directory holds the config (and a resumed run's rows, ``run.rows``: restore from them what
        ``after_round`` needs); the first round comes next. Setting ``run.stop_reason`` here ends the run before
        it."""

    def after_training(self, run: RunState, r: int, metrics: dict[str, Any]) -> None:
        """Round ``r`` (0-based) trained; ``metrics`` are its training metrics, before any evaluation: a copy,
        so changing it changes nothing recorded (values are added in :meth:`on_evaluation`)."""

    def on_evaluation(self, run: RunState, r: int, values: dict[str, Any]) -> None:
        """The evaluation of round ``r`` (``-1``: the initial model) before it is recorded; raising here
        keeps it out of the metrics."""

    def on_row(self, run: RunState, row: dict[str, Any]) -> None:
        """A metrics row was recorded (``metrics.csv`` and ``metrics.jsonl`` hold it). ``row`` is a copy:
        changing it changes nothing recorded (values are added in :meth:`on_evaluation`)."""

    def after_round(self, run: RunState, r: int) -> str | bool | None:
        """Round ``r`` is trained and, when due, evaluated: return a reason (or True) to end the run after it
        (after the configured last round the run ends anyway, and no early stop is recorded). The runner then
        evaluates the round if it was not, and checkpoints it. A resumed run asks once more,
        after ``on_start``, about the checkpoint's round (``r = run.start_round - 1``), so that it ends where the
        uninterrupted run ended (a target already reached, a budget already spent) instead of running on."""

    def on_round_end(self, run: RunState, r: int) -> None:
        """Round ``r`` is over (``run.is_last(r)`` says whether it was the last)."""

    def on_checkpoint(self, run: RunState, next_round: int) -> None:
        """``checkpoint.pt`` now holds the state after round ``next_round - 1``."""

    def on_end(self, run: RunState, summary: dict[str, Any] | None) -> None:
        """The run ended and ``summary.json`` is written. A run that raised an error mid-way ends with
        ``status: failed`` (the error raised right after); ``summary`` is None only when even that summary
        could not be written, or the process is exiting (``SystemExit``): release what you hold."""


class CallbackList(Callback):
    """Several callbacks called as one, in order."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_build(self, run):
        for c in self.callbacks:
            c.on_build(run)

    def on_start(self, run):
        for c in self.callbacks:
            c.on_start(run)

    def after_training(self, run, r, metrics):
        for c in self.callbacks:  # each its own copy: a NaN or an array put there went unchecked into the row
            c.after_training(run, r, dict(metrics))

    def on_evaluation(self, run, r, values):
        for c in self.callbacks:
            c.on_evaluation(run, r, values)

    def on_row(self, run, row):
        for c in self.callbacks:  # each its own copy: the recorded row (metrics files, Result, summary) stays as is
            c.on_row(run, dict(row))

    def after_round(self, run, r):
        reasons = [c.after_round(run, r) for c in self.callbacks]  # every callback hears of every round
        for c, why in zip(self.callbacks, reasons):
            # only a reason or True asks to stop (``{"stop": False}`` or 0.5 ended the run, a tensor raised)
            if not (why is None or isinstance(why, bool | str | np.bool_)):  # np.bool_: ``return acc >= 0.9``
                raise TypeError(
                    f"{type(c).__name__}.after_round returned {why!r:.80}; return a reason (a non-empty string) or "
                    "True to end the run, None or False to go on"
                )
        asked = [
            str(why) if isinstance(why, str) else type(c).__name__ for c, why in zip(self.callbacks, reasons) if why
        ]
        return "; ".join(asked) or None

    def on_round_end(self, run, r):
        for c in self.callbacks:
            c.on_round_end(run, r)

    def on_checkpoint(self, run, next_round):
        for c in self.callbacks:
            c.on_checkpoint(run, next_round)

    def on_end(self, run, summary):
        errors = []
        for c in self.callbacks:  # every callback releases what it holds, even after another one failed
            try:
                c.on_end(run, summary)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


from fedweave.callbacks.builtin import (  # noqa: E402
    Budget,
    Checkpointer,
    ClientRecord,
    DivergenceGuard,
    PartitionReport,
    Plots,
    ProgressBar,
    RoundTrace,
    StopAtTarget,
    default_callbacks,
)

__all__ = [
    "Budget",
    "Callback",
    "CallbackList",
    "Checkpointer",
    "ClientRecord",
    "DivergenceGuard",
    "PartitionReport",
    "Plots",
    "ProgressBar",
    "RoundTrace",
    "RunState",
    "StopAtTarget",
    "default_callbacks",
]
