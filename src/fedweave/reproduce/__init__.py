"""Reproductions of the five papers: ``fedweave reproduce NAME`` runs the study ``fedweave.reproduce.<module>.STUDY``
(``fedweave.experiments.study``) with the CLI's front end."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedweave.experiments.study import Study

PRESETS = {
    "fedmim": "fedweave.reproduce.fedmim",
    "zo-hfl": "fedweave.reproduce.zo_hfl",
    "afind": "fedweave.reproduce.afind_plus",
    "cse-fsl": "fedweave.reproduce.cse_fsl",
    "cfl-saga": "fedweave.reproduce.cfl_saga",
    "baselines": "fedweave.reproduce.baselines",
}


def available() -> list[str]:
    return [name for name, mod in PRESETS.items() if importlib.util.find_spec(mod) is not None]


def study(name: str) -> Study:
    """The reproduction's ``Study``; an unknown name is a ConfigError that lists the known ones."""
    if name not in available():
        from fedweave.config import ConfigError

        raise ConfigError(f"unknown reproduction {name!r}; available: {', '.join(available()) or 'none'}")
    return importlib.import_module(PRESETS[name]).STUDY
