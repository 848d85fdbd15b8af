"""fedweave: federated learning across five topologies, faithful to the papers that define them."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "run", "resume", "Result", "sweep", "SweepResult", "Callback", "RunState"]


def __getattr__(name: str):  # lazy: `import fedweave` stays cheap, torch loads on first use
    if name in ("run", "resume", "Result", "sweep", "SweepResult"):
        from fedweave import api

        return getattr(api, name)
    if name in ("Callback", "RunState"):
        from fedweave import callbacks

        return getattr(callbacks, name)
    raise AttributeError(name)


def __dir__() -> list[str]:  # the lazy names too, for completion and help(fedweave)
    return sorted(set(globals()) | set(__all__))
