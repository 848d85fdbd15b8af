"""Reproductions of the five papers: ``fedweave reproduce NAME`` runs ``fedweave.reproduce.<module>.main``."""

from __future__ import annotations

import importlib

PRESETS = {
    "fedmim": "fedweave.reproduce.fedmim",
    "zo-hfl": "fedweave.reproduce.zo_hfl",
    "afind": "fedweave.reproduce.afind_plus",
    "cse-fsl": "fedweave.reproduce.cse_fsl",
    "cfl-saga": "fedweave.reproduce.cfl_saga",
}


def available() -> list[str]:
    return [name for name, mod in PRESETS.items() if importlib.util.find_spec(mod) is not None]


def main(name: str, argv: list[str]) -> int:
    if name not in available():
        from fedweave.config import ConfigError

        raise ConfigError(f"unknown reproduction {name!r}; available: {', '.join(available()) or 'none'}")
    return int(importlib.import_module(PRESETS[name]).main(argv) or 0)
