"""Which runs the Flower deployment carries, checked where ``fedweave flower-app`` validates an app's settings
(before it writes anything) and again when the ServerApp starts a run (``flwr run --run-config`` may change
``on-error``). Importing this module does not import ``flwr``."""

from __future__ import annotations

from fedweave.config import ConfigError, RunConfig
from fedweave.registry import ALGORITHMS, SAMPLERS
from fedweave.topology.samplers import draws_by_size

POLICIES = ("stop", "drop")  # the app config's on-error
FAMILIES = ("centralized", "split", "hierarchical", "decentralized")  # the families a deployment can run
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
    if config.eval.per_client or config.eval.holdout:  # evaluations on the clients' own samples, in the ServerApp
        key = "eval.per_client" if config.eval.per_client else "eval.holdout"
        return (
            f"{key} evaluates on the clients' own training samples, which the ServerApp does not hold (the nodes "
            "do); deploy without it (eval.personal_test draws each client's test set from the test split)"
        )
    family = ALGORITHMS.get(config.algorithm.name).family
    why = _decentralized_refusal(config) if family == "decentralized" else None
    if why is not None:
        return why
    if config.secure_aggregation is not None:  # Flower's SecAgg+ (deploy/secure.py): the server sees only the mean
        why = secure_refusal(config)
        if why is not None:
            return why
    if config.compression.download is not None:  # the nodes would need the model replica the server keeps for them
        return (
            "compression.download: compressed downloads cannot be deployed on Flower yet (the jobs carry the dense "
            "model); remove compression.download to deploy this run (compressed uploads deploy)"
        )
    return None


def _decentralized_refusal(config: RunConfig) -> str | None:
    """Why a gossip run's options need more than the relay (peers train on their nodes, the ServerApp keeps
    their models and mixes) can give, or None."""
    options = config.algorithm.options
    if options.get("selection", "random") != "random":  # topk / afind score models on each peer's own data
        return (
            f"algorithm.selection: {options['selection']!r} scores the neighbours' models on each peer's own data, "
            "which the ServerApp that relays the gossip does not hold; deploy with selection: random"
        )
    if options.get("dp_sigma", 0.0) and options.get("dp_mode", "sgd") == "exchange":
        return (
            "algorithm.dp_mode: exchange cannot be deployed on Flower: its noise would be added by the ServerApp that "
            "relays the gossip, after it saw each peer's model; deploy with dp_mode: sgd (DP-SGD on the nodes)"
        )
    return None


def check_deployable(config: RunConfig, on_error: str) -> None:
    """Raise :class:`ConfigError` (one line) when the run of ``config`` cannot be deployed under ``on_error``."""
    name = config.algorithm.name
    why = unsupported(name, ALGORITHMS.get(name).family, on_error) or undeployable_parts(config)
    if why is not None:
        raise ConfigError(why)


def secure_refusal(config: RunConfig) -> str | None:
    """Why a run with ``secure_aggregation`` cannot run Flower's SecAgg+ deployed, or None (the rest of the
    simulation's own refusals come when the algorithm is built)."""
    cls = ALGORITHMS.get(config.algorithm.name)
    # the weighting the run will use: equal weights under a sampler that draws by size (weighting_under)
    by_size = draws_by_size(SAMPLERS.get(config.sampler.name))
    weighting = config.algorithm.options.get("weighting", "uniform" if by_size else "samples")
    if cls.family == "centralized":  # make_secagg's criterion, before any app
        why = cls.secure_refusal(weighting)
    else:
        why = f"the {cls.family} family is not supported yet"
    if why:
        return (
            f"secure_aggregation: algorithm {config.algorithm.name!r} cannot run Flower's SecAgg+, whose server learns "
            f"only the weighted mean of the updates ({why})"
        )
    if config.privacy is not None:
        return (
            "secure_aggregation with privacy cannot be deployed yet: DP-FedAvg's server clips each client's update, "
            "which SecAgg+ hides from it; remove one of the two sections to deploy"
        )
    if config.faults != type(config.faults)():  # the ledger bills SecAgg+'s first stages to an injected dropout
        return (
            "secure_aggregation with faults cannot be deployed yet: the ledger bills SecAgg+'s first stages to the "
            "clients an injected fault drops, which a deployed round never contacts; remove the faults section"
        )
    return None
