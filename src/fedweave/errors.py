"""How a run can end other than by completing: the exceptions the runner, its callbacks and the command line
share (the command line turns each into one line and an exit status)."""

from __future__ import annotations

from pathlib import Path


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


class WorkerLost(RuntimeError):
    """A worker process of the run's execution (a ``pool`` backend worker) died while the run needed it (killed
    from outside, e.g. by the out-of-memory killer); the message names the worker and how it ended. The run's
    files so far are kept, as after any error mid-way."""

    @classmethod
    def of(cls, backend: str, who: str, fewer: str) -> WorkerLost:
        """The one line for ``backend``'s worker ``who`` (its name and how it ended); ``fewer`` is the setting
        to lower on resume."""
        return cls(
            f"backend {backend}: {who}; the run cannot go on without it (its files so far are kept: resume it with "
            f"fedweave run --resume RUN_DIR, with fewer {fewer} or backend: loop)"
        )
