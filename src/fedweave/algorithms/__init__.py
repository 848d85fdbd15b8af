"""Algorithm families. Each family is a subpackage (``centralized``, ``decentralized``, ``split``,
``hierarchical``, ``confederated``) whose ``__init__`` imports its algorithm modules, which register
themselves by name. The registries call :func:`load_families` on first use, so importing a topology or an
algorithm module directly never imports the other families (and never cycles back to itself)."""

import importlib
import pkgutil


def load_families() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
