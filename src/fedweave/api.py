"""The Python entry point: ``fedweave.run(config) -> Result``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedweave.config import RunConfig
from fedweave.runner import Result, run_config

__all__ = ["Result", "run"]


def run(
    config: str | Path | dict[str, Any] | RunConfig,
    overrides: list[str] | None = None,
    *,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
) -> Result:
    """Run one experiment. ``config`` is a YAML path, a dict, or a :class:`RunConfig`;
    ``overrides`` are ``key=value`` strings such as ``"local.lr=0.1"``."""
    return run_config(config, overrides, run_dir=run_dir, progress=progress)
