"""Which runs the Flower deployment carries, checked where ``fedweave flower-app`` validates an app's settings
(before it writes anything) and again when the ServerApp starts a run (``flwr run --run-config`` may change
``on-error``). Importing this module does not import ``flwr``."""

from __future__ import annotations

from fedweave.config import ConfigError, RunConfig
from fedweave.registry import ALGORITHMS

POLICIES = ("stop", "drop")  # the app config's on-error
FAMILIES = ("centralized", "split", "hierarchical")  # the families a deployment can run
DROP_FAMILIES = ("centralized", "hierarchical")  # ... and those that can go on without a lost client


def unsupported(algorithm: str, family: str, on_error: str) -> str | None:
    """Why a run of ``algorithm`` (of ``family``) under ``on-error: on_error`` cannot be deployed, or None."""
    if on_error not in POLICIES:
        return f"on-error must be one of {', '.join(POLICIES)}, got {on_error!r}"
    if family not in FAMILIES:
        return (
            f"algorithm {algorithm!r} ({family}) cannot be deployed on Flower yet: the "
            f"{', '.join(FAMILIES)} families can (docs/deployment.md, 'What remains')"
        )
    why = getattr(ALGORITHMS.get(algorithm), "undeployable", None) if algorithm in ALGORITHMS.names() else None
    if why:  # a method whose clients keep state the deployment does not carry yet
        return f"algorithm {algorithm!r} ({family}) cannot be deployed on Flower yet: {why}"
    if on_error == "drop" and family not in DROP_FAMILIES:
        return f"on-error drop is not built for the {family} family yet (algorithm {algorithm!r}); use on-error stop"
    return None


def undeployable_parts(config: RunConfig) -> str | None:
    """Why a part of ``config`` beside the algorithm's family cannot be deployed yet, or None."""
    if getattr(ALGORITHMS.get(config.algorithm.name), "asynchronous", False):
        return (
            f"algorithm {config.algorithm.name!r} runs its asynchrony on the simulated clock and cannot be deployed "
            "on Flower yet; deploy a synchronous method (fedavg, fedadam, ...)"
        )
    if config.secure_aggregation is not None:  # simulation only: Flower's SecAgg+ is not wired into the app yet
        return (
            "secure_aggregation: only its cost is simulated (the ledger); fedweave flower-app does not run Flower's "
            "SecAgg+ yet, so the deployed run would not be what the config says; remove the section to deploy"
        )
    if config.compression.download is not None:  # the nodes would need the model replica the server keeps for them
        return (
            "compression.download: compressed downloads cannot be deployed on Flower yet (the jobs carry the dense "
            "model); remove compression.download to deploy this run (compressed uploads deploy)"
        )
    return None


def check_deployable(config: RunConfig, on_error: str) -> None:
    """Raise :class:`ConfigError` (one line) when the run of ``config`` cannot be deployed under ``on_error``."""
    name = config.algorithm.name
    why = unsupported(name, ALGORITHMS.get(name).family, on_error) or undeployable_parts(config)
    if why is not None:
        raise ConfigError(why)
