"""Name -> object registries for algorithms, datasets, models and partitioners (DESIGN principle 8)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any


class UnknownNameError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


class Registry:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        def deco(obj: Any) -> Any:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        _load_builtins()
        if name not in self._items:
            close = difflib.get_close_matches(str(name), self._items, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(f"unknown {self.kind} {name!r}.{hint} Allowed: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        _load_builtins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        _load_builtins()
        return name in self._items


ALGORITHMS = Registry("algorithm")
DATASETS = Registry("dataset")
MODELS = Registry("model")
PARTITIONERS = Registry("partitioner")

_loaded = False


def _load_builtins() -> None:
    """Import the modules whose decorators fill the registries (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import fedweave.data  # noqa: F401
    import fedweave.models  # noqa: F401
    from fedweave.algorithms import load_families

    load_families()
