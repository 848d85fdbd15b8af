"""The Python entry point: ``fedweave.run(config) -> Result``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from fedweave.config import RunConfig
from fedweave.experiments import SweepResult, sweep
from fedweave.runner import Result, run_config

__all__ = ["Result", "SweepResult", "run", "sweep"]


def run(
    config: str | Path | dict[str, Any] | RunConfig,
    overrides: list[str] | None = None,
    *,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    on_divergence: Literal["raise", "return"] = "raise",
) -> Result:
    """Run one experiment. ``config`` is a YAML path, a dict, or a :class:`RunConfig`;
    ``overrides`` are ``key=value`` strings such as ``"local.lr=0.1"``. A run that meets NaN or Inf stops
    with ``status: diverged`` in its summary and raises ``DivergenceError``, or with
    ``on_divergence="return"`` returns its Result (for sweeps)."""
    return run_config(config, overrides, run_dir=run_dir, progress=progress, on_divergence=on_divergence)
