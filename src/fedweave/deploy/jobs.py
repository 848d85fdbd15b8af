"""One client job of a ``LocalTrainer`` call as plain data: tensors and scalars, no code.

The server describes job ``k`` of a call (its start vector, round, steps, learning rate, local settings
and either the ``LocalRule`` or, for an algorithm whose clients keep state, the ``ClientStep``) as named
tensors plus a JSON header; the node rebuilds the rule or step from its *registered name* and those tensors
(DESIGN: no pickled code travels). A name the node does not know is refused with :class:`UnknownRuleError`.

A step's per-client state (SCAFFOLD's ``c_i``, FedDyn's local gradient) does not travel: the node keeps it
(``fedweave.deploy.node_state``) and the header names the round of the state version the server accepted
(``state_round``, -1 before the client's first round).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from fedweave.algorithms.centralized.fedcm import FedCMRule
from fedweave.algorithms.centralized.feddyn import FedDynRule, FedDynStep
from fedweave.algorithms.centralized.fedmim import MIMRule
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.fedsam import SAMRule
from fedweave.algorithms.centralized.scaffold import ScaffoldRule, ScaffoldStep
from fedweave.config import LocalConfig
from fedweave.execution.local import ClientStep, LocalRule, Reindexed

# The rules and client steps a node can rebuild, by the name that travels. Their state is their attributes:
# tensors (sent as arrays) and JSON scalars; one with any other attribute (a function) cannot be deployed.
RULES: dict[str, type[LocalRule]] = {
    "plain": LocalRule,
    "scaffold": ScaffoldRule,
    "fedprox": ProxRule,
    "feddyn": FedDynRule,
    "fedsam": SAMRule,
    "fedcm": FedCMRule,
    "fedmim": MIMRule,
}
STEPS: dict[str, type[ClientStep]] = {"scaffold": ScaffoldStep, "feddyn": FedDynStep}
RULE_NAMES = {cls: name for name, cls in RULES.items()}
STEP_NAMES = {cls: name for name, cls in STEPS.items()}
SCALARS = (bool, int, float, str, type(None))


class UnknownRuleError(ValueError):
    """A job names a rule or step this node cannot rebuild (not registered in ``fedweave.deploy.jobs``)."""


class MalformedJobError(ValueError):
    """A job message lacks a field or has one of the wrong kind."""


def _attributes(obj: object, name: str, k: int, jobs: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Scalar attributes and tensors of a rule or step as seen by job ``k`` of ``jobs``: a per-job table
    ``(K, P)`` travels as its row ``k`` (shape ``(1, P)``, read by the node's job 0)."""
    scalars: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for attr, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            per_job = v.dim() == 2 and (jobs < 0 or v.shape[0] == jobs)
            tensors[attr] = v[k : k + 1].contiguous() if per_job else v.contiguous()
        elif isinstance(v, SCALARS):
            scalars[attr] = v
        else:
            raise UnknownRuleError(f"{name!r}: attribute {attr!r} ({type(v).__name__}) cannot travel")
    return scalars, tensors


def _job_rule(rule: LocalRule, k: int, jobs: int) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    if isinstance(rule, Reindexed):  # a call of some jobs of another call: the table row is positions[k]
        return _job_rule(rule.rule, int(rule.positions[k]), -1)  # -1: every (K, P) table is per job
    name = RULE_NAMES.get(type(rule))
    if name is None:
        raise UnknownRuleError(
            f"local rule {type(rule).__name__} is not registered for deployment; registered: {', '.join(RULES)}"
        )
    return (name, *_attributes(rule, f"local rule {name}", k, jobs))


def _job_step(step: ClientStep) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    name = STEP_NAMES.get(type(step))
    if name is None:
        raise UnknownRuleError(
            f"client step {type(step).__name__} is not registered for deployment; registered: {', '.join(STEPS)}"
        )
    scalars, tensors = _attributes(step, f"client step {name}", 0, 0)  # a step's tensors are the server's
    return name, scalars, tensors


def encode_job(
    *,
    start: torch.Tensor,
    client: int,
    round: int,
    k: int,
    jobs: int,
    lr: float,
    steps: int | None,
    key: tuple[int, ...],
    local: LocalConfig,
    rule: LocalRule | None = None,
    step: ClientStep | None = None,
    state_round: int = -1,
    num_classes: int | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Job ``k`` of a call of ``jobs`` jobs, with its ``rule`` or its client ``step``, as ``(header, tensors)``."""
    if callable(lr):
        raise ValueError("the flower deployment sends a constant local learning rate per call, not a schedule")
    if (rule is None) == (step is None):
        raise ValueError("a job has either a local rule or a client step")
    header: dict[str, Any] = {
        "client": int(client),
        "round": int(round),
        "lr": float(lr),
        "steps": steps,
        "key": [int(x) for x in key],
        "local": dataclasses.asdict(local),
        "num_classes": num_classes,  # the model's outputs, for a node that holds its own data
    }
    tensors = {"start": start.detach().reshape(1, -1).contiguous()}
    if rule is not None:
        name, scalars, extra = _job_rule(rule, k, jobs)
        header.update(rule=name, rule_scalars=scalars)
        tensors.update({f"rule.{a}": t for a, t in extra.items()})
    else:
        name, scalars, extra = _job_step(step)
        header.update(step=name, step_scalars=scalars, state_round=int(state_round))
        tensors.update({f"step.{a}": t for a, t in extra.items()})
    return header, tensors


@dataclasses.dataclass
class Job:
    client: int
    round: int
    lr: float
    steps: int | None
    key: tuple[int, ...]
    local: LocalConfig
    start: torch.Tensor  # (1, P)
    rule: LocalRule | None = None
    step: ClientStep | None = None
    state_round: int = -1  # the round of the client state version the server accepted (-1: initial)
    num_classes: int | None = None


def _rebuild(registry: dict[str, type], what: str, name: Any, scalars: dict, tensors: dict[str, torch.Tensor]):
    cls = registry.get(name)
    if cls is None:
        raise UnknownRuleError(f"unknown {what} {name!r}; this node knows: {', '.join(registry)}")
    obj = cls.__new__(cls)  # state only: the class's code is the node's own
    obj.__dict__.update(scalars)
    prefix = f"{what.split()[-1]}."
    obj.__dict__.update({a[len(prefix) :]: t for a, t in tensors.items() if a.startswith(prefix)})
    return obj


def decode_job(header_json: str, tensors: dict[str, torch.Tensor]) -> Job:
    """Rebuild a job on the node; raises :class:`UnknownRuleError` or :class:`MalformedJobError`."""
    try:
        h = json.loads(header_json)
        if "step" in h:
            step = _rebuild(STEPS, "client step", h["step"], h["step_scalars"], tensors)
            rule, state_round = None, int(h["state_round"])
        else:
            rule = _rebuild(RULES, "local rule", h["rule"], h["rule_scalars"], tensors)
            step, state_round = None, -1
        steps = h["steps"]
        return Job(
            client=int(h["client"]),
            round=int(h["round"]),
            lr=float(h["lr"]),
            steps=None if steps is None else int(steps),
            key=tuple(int(x) for x in h["key"]),
            local=LocalConfig(**h["local"]),
            start=tensors["start"],
            rule=rule,
            step=step,
            state_round=state_round,
            num_classes=None if h.get("num_classes") is None else int(h["num_classes"]),
        )
    except UnknownRuleError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, json.JSONDecodeError) as e:
        raise MalformedJobError(f"malformed fedweave job message: {type(e).__name__}: {e}") from e


def encode_header(header: dict[str, Any]) -> str:
    return json.dumps(header)
