"""Algorithm families. Each family is a subpackage (``centralized``, ``decentralized``, ``split``,
``hierarchical``, ``confederated``) whose ``__init__`` imports its algorithm modules, which register
themselves by name. The registries import the families on first use, one at a time until the name looked up
is found, so importing a topology or an algorithm module directly never imports the other families (and
never cycles back to itself)."""

import pkgutil


def family_modules() -> list[str]:
    """The families' module names, in a fixed (alphabetical) order."""
    return sorted(f"{__name__}.{info.name}" for info in pkgutil.iter_modules(__path__) if info.ispkg)
