"""The Python entry point: ``fedweave.run(config) -> Result``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from torch import nn

from fedweave.byo import PYTHON, RunObjects, as_dataset
from fedweave.callbacks import Callback
from fedweave.config import ConfigError, RunConfig, Section
from fedweave.config import load as load_config
from fedweave.experiments import SweepResult, sweep
from fedweave.runner import Result
from fedweave.runner import resume as resume_resolved
from fedweave.runner import run as run_resolved

__all__ = ["Result", "SweepResult", "resume", "run", "sweep"]


def run(
    config: str | Path | dict[str, Any] | RunConfig,
    overrides: list[str] | None = None,
    *,
    model: Callable[[], nn.Module] | None = None,
    dataset: Any = None,
    loss: Callable | None = None,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    on_divergence: Literal["raise", "return"] = "raise",
    overwrite: bool = False,
    callbacks: Sequence[Callback] = (),
) -> Result:
    """Run one experiment. ``config`` is a YAML path (or ``"example:NAME"``), a dict, or a
    :class:`RunConfig`; ``overrides`` a list of ``key=value`` strings such as ``["local.lr=0.1"]``, applied
    to any of them.

    Your own objects, without registering them: ``model`` a function returning a fresh ``nn.Module``
    (called under the run's ``model_init`` seed, once per model the method initializes: IFCA's clusters
    each), ``dataset`` a fedweave ``Dataset``, arrays or tensors
    ``(train_x, train_y, test_x, test_y[, train_users, test_users])`` or in-memory torch Datasets
    ``(train, test)``, ``loss`` a function ``(output, target) -> per-sample losses``. The config then records
    ``python`` for each, and ``objects.json`` in the run directory what was passed (docs/tasks.md). A config,
    overrides, model, loss, callbacks, progress, overwrite, on_divergence or run_dir of another kind (a module
    instead of a factory, a loss's name, a callback class, ``progress="no"``) is one
    :class:`~fedweave.config.ConfigError` saying what to pass, before anything runs.

    A run that meets NaN or Inf stops with ``status: diverged`` in its summary and raises ``DivergenceError``,
    or with ``on_divergence="return"`` returns its Result (for sweeps). A run directory that already holds a
    run is refused unless ``overwrite=True``. ``callbacks``: your own :class:`fedweave.Callback` objects,
    called after the run's own (progress, divergence guard, checkpoints, ...; see :mod:`fedweave.callbacks`)."""
    if isinstance(config, RunConfig):  # the overrides apply to it as to any other config
        cfg = copy.deepcopy(config) if overrides is None else load_config(config.to_dict(), overrides)
    elif isinstance(config, str | Path | dict):
        cfg = load_config(config, overrides)
    else:
        raise ConfigError(
            f"config is a YAML file's path, 'example:NAME', a dict or a RunConfig; got {type(config).__name__}"
        )
    objects = _objects(model, dataset, loss)
    if objects is not None:
        if model is not None:
            cfg.model = Section(PYTHON)
        if dataset is not None:
            cfg.dataset = Section(PYTHON)
        if loss is not None:
            cfg.task.loss = PYTHON
    return run_resolved(
        cfg,
        run_dir=run_dir,
        progress=progress,
        on_divergence=on_divergence,
        overwrite=overwrite,
        objects=objects,
        callbacks=callbacks,
    )


def resume(
    run_dir: str | Path,
    overrides: list[str] | None = None,
    *,
    model: Callable[[], nn.Module] | None = None,
    dataset: Any = None,
    loss: Callable | None = None,
    progress: bool | None = None,
    on_divergence: Literal["raise", "return"] = "raise",
    callbacks: Sequence[Callback] = (),
) -> Result:
    """Continue the run in ``run_dir`` from its last checkpoint, as ``fedweave run --resume RUN_DIR`` does;
    ``overrides`` may change only what a resumed run can change (e.g. ``["rounds=200"]`` to extend it,
    :func:`fedweave.runner.resume`).

    A run made with a ``model``, ``dataset`` or ``loss`` passed from Python (its config records ``python``)
    resumes only with the same objects passed again, checked against the digests of its ``objects.json``; a
    missing or different one is one :class:`~fedweave.config.ConfigError` line. ``callbacks``: yours, as given
    to :func:`run` (a run a callback stopped early ends where it ended when it is resumed with the same ones).
    ``progress`` and ``on_divergence`` as in :func:`run`."""
    objects = _objects(model, dataset, loss)
    return resume_resolved(
        run_dir, overrides, progress=progress, objects=objects, callbacks=callbacks, on_divergence=on_divergence
    )


def _objects(model: Any, dataset: Any, loss: Any) -> RunObjects | None:
    """The objects passed from Python (None when none was), checked."""
    _check_objects(model, loss)
    if model is None and dataset is None and loss is None:
        return None
    return RunObjects(model=model, dataset=as_dataset(dataset) if dataset is not None else None, loss=loss)


def _check_objects(model: Any, loss: Any) -> None:
    """A model or loss passed in a form the run cannot use is one line saying what to pass, before anything runs
    (a module instance would be called with no input, a loss's name as a function)."""
    if model is not None and (isinstance(model, nn.Module) or not callable(model)):
        got = f"a {type(model).__name__} instance" if isinstance(model, nn.Module) else repr(model)
        raise ConfigError(
            f"model must be a function or class returning a fresh nn.Module (model=lambda: MyNet()), got {got}; "
            "to use a registered model, name it in the config's model section"
        )
    if loss is not None and not callable(loss):
        raise ConfigError(
            f"loss must be a function (output, target) -> per-sample losses or a fedweave.tasks.Loss, got "
            f"{loss!r}; to use a registered loss, name it in the config's task.loss"
        )
