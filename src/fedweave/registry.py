"""Name -> object registries for algorithms, datasets, models, partitioners, samplers, losses, metrics,
augmentations and what a local-training job carries (DESIGN principle 8)."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable
from typing import Any


class UnknownNameError(KeyError):
    """A name that no object is registered under; its message names the closest registered name and
    lists the allowed ones."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def _named(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


class Registry:
    """Registered objects of one kind (``algorithm``, ``dataset``, ``model``, ...) by name.

    The built-in ones register when their modules are imported, which a look-up does on demand; a plug-in
    registers its own with :meth:`register`. ``kind`` names the registry in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        """A decorator that registers the decorated object under ``name`` and returns it unchanged.
        Registering another object under a taken name raises ValueError, a built-in's name too (a registration
        from outside fedweave loads the built-ins first), and so does a name that a config could not give (not a
        non-empty string)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} is registered under a non-empty string, its config name; got {name!r}")

        # a plug-in's registration (from outside fedweave): the built-ins register first, so that a plug-in taking a
        # built-in's name is refused here, not later in the built-in module's import (which failed every later run)
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))
        plugin = caller != "fedweave" and not caller.startswith("fedweave.")  # (a fedweave_ext package is a plug-in)

        def deco(obj: Any) -> Any:
            if plugin:
                _load_builtins()
            if name in self._items and self._items[name] is not obj:
                raise ValueError(
                    f"{self.kind} {name!r} is registered twice: {_named(self._items[name])} and {_named(obj)}"
                )
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        """The object registered under ``name``, importing the built-in modules until it is found; an unknown
        name raises :class:`UnknownNameError`."""
        _load_builtins(until=lambda: name in self._items)
        if name not in self._items:
            close = difflib.get_close_matches(str(name), self._items, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(f"unknown {self.kind} {name!r}.{hint} Allowed: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        """Every registered name, sorted (all built-in modules imported first)."""
        _load_builtins()
        return sorted(self._items)

    def name_of(self, obj: Any) -> str | None:
        """The name ``obj`` is registered under (None if it is not): an object being used has been imported,
        so its registration has run."""
        return next((name for name, item in self._items.items() if item is obj), None)

    def __contains__(self, name: str) -> bool:
        _load_builtins(until=lambda: name in self._items)
        return name in self._items


#: The algorithms a config's ``algorithm.name`` selects (each an :class:`~fedweave.algorithms.base.Algorithm`).
ALGORITHMS = Registry("algorithm")
#: The datasets of ``dataset.name`` (docs/data.md).
DATASETS = Registry("dataset")
#: The model builders of ``model.name`` (docs/models.md).
MODELS = Registry("model")
#: The partitioners of ``partition.name`` (docs/partitioning.md).
PARTITIONERS = Registry("partitioner")
#: The client samplers of ``sampler.name`` (:mod:`fedweave.topology.samplers`).
SAMPLERS = Registry("sampler")
#: The run callbacks a config's ``callbacks`` list names (:mod:`fedweave.callbacks` registers its own at their
#: definition, as plug-ins do).
CALLBACKS = Registry("callback")
#: The losses a config's ``task.loss`` names (each a :class:`~fedweave.tasks.Loss` subclass, registered at its
#: definition in :mod:`fedweave.tasks` or by a plug-in).
LOSSES = Registry("loss")
#: The metrics of ``task.metrics`` (each a :class:`~fedweave.tasks.Metric` subclass).
METRICS = Registry("metric")
#: The augmentations of ``local.augment`` (:mod:`fedweave.data.augment`): each builds one step ``(x, g) -> x`` of
#: a training batch's augmentation from the keyword options of :func:`~fedweave.data.augment.build_augment`.
AUGMENTATIONS = Registry("augmentation")
# What a local-training job carries by name (fedweave.execution.job), registered at their definition: the
# deployment rebuilds each from its name and the tensors and scalars that travel (no code travels).
RULES = Registry("local rule")  # LocalRule classes
CLIENT_STEPS = Registry("client step")  # ClientStep classes (clients with state of their own)
RULE_PARTS = Registry("rule part")  # objects a rule holds besides tensors and scalars (a projection)
LR_SCHEDULES = Registry("learning-rate schedule")  # a local learning rate that is a function of the step
# ---- robustness (fedweave.robust, docs/robustness.md) ----
#: The server reductions of the ``aggregator`` section (each a :class:`~fedweave.robust.aggregators.Aggregator`).
AGGREGATORS = Registry("aggregator")
#: The Byzantine attacks of ``faults.byzantine.attack`` (each a :class:`~fedweave.robust.attacks.Attack`).
ATTACKS = Registry("attack")
# ---- end robustness ----

# ---- compression (fedweave.compression) ----
#: The upload compressors of ``compression.upload.name`` (docs/compression.md): each a
#: :class:`~fedweave.compression.Compressor` dataclass of its options.
COMPRESSORS = Registry("compressor")

# Differential privacy (fedweave.privacy): the accountants of ``privacy.accountant`` (each builds an Opacus
# accountant) and the mechanisms a ``privacy`` section can select (listed by ``fedweave list``).
ACCOUNTANTS = Registry("accountant")
PRIVACY_MECHANISMS = Registry("privacy mechanism")

# The algorithm families, each a subpackage of fedweave.algorithms whose ``__init__`` imports every method
# module of its family (which registers itself at its definition): the registry knows the families, the
# families know their methods. Named, not imported, so that this foundation module never imports the layer
# above it; tests/test_core_basics.py checks the list against the subpackages and every method file against
# the registry.
ALGORITHM_FAMILIES = ("centralized", "confederated", "decentralized", "hierarchical", "split")
# the built-in modules whose decorators fill the registries, in the order they are imported
BUILTIN_MODULES = (
    "fedweave.tasks",
    "fedweave.data",
    "fedweave.data.augment",
    "fedweave.models",
    "fedweave.topology.samplers",
    "fedweave.compression",
    "fedweave.robust",
    "fedweave.privacy",
    *(f"fedweave.algorithms.{family}" for family in ALGORITHM_FAMILIES),
)
_pending: list[str] | None = None  # the built-in modules not imported yet


def _load_builtins(until: Callable[[], bool] | None = None) -> None:
    """Import the modules whose decorators fill the registries, in order, stopping once ``until()`` holds:
    looking up ``fedavg`` imports the tasks, the data layer, the models and the centralized family only, not the
    families that need networkx (0.3 s of start-up). Without ``until`` everything is imported."""
    global _pending
    if _pending is None:
        _pending = list(BUILTIN_MODULES)
    while _pending and not (until is not None and until()):
        importlib.import_module(_pending.pop(0))
