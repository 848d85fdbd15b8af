"""One client job of a ``LocalTrainer.train`` call as plain data: tensors and scalars, no code.

The server describes job ``k`` of a call (its start vector, round, steps, learning rate, local settings
and the ``LocalRule``) as named tensors plus a JSON header; the node rebuilds the rule from its
*registered name* and those tensors (DESIGN: no pickled code travels). A name the node does not know is
refused with :class:`UnknownRuleError`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from fedweave.algorithms.centralized.fedcm import FedCMRule
from fedweave.algorithms.centralized.feddyn import FedDynRule
from fedweave.algorithms.centralized.fedmim import MIMRule
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.fedsam import SAMRule
from fedweave.algorithms.centralized.scaffold import ScaffoldRule
from fedweave.config import LocalConfig
from fedweave.execution.local import LocalRule, Reindexed

# The rules a node can rebuild, by the name that travels. A rule's state is its attributes: tensors
# (sent as arrays) and JSON scalars; a rule with any other attribute (a function) cannot be deployed.
RULES: dict[str, type[LocalRule]] = {
    "plain": LocalRule,
    "scaffold": ScaffoldRule,
    "fedprox": ProxRule,
    "feddyn": FedDynRule,
    "fedsam": SAMRule,
    "fedcm": FedCMRule,
    "fedmim": MIMRule,
}
RULE_NAMES = {cls: name for name, cls in RULES.items()}
SCALARS = (bool, int, float, str, type(None))


class UnknownRuleError(ValueError):
    """A job names a rule this node cannot rebuild (not registered in ``fedweave.deploy.jobs.RULES``)."""


class MalformedJobError(ValueError):
    """A job message lacks a field or has one of the wrong kind."""


def _job_rule(rule: LocalRule, k: int, jobs: int) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """The registered name, scalar attributes and tensors of ``rule`` as seen by job ``k`` of ``jobs``:
    a per-job table ``(K, P)`` travels as its row ``k`` (shape ``(1, P)``, read by the node's job 0)."""
    if isinstance(rule, Reindexed):  # a call of some jobs of another call: the table row is positions[k]
        return _job_rule(rule.rule, int(rule.positions[k]), -1)  # -1: every (K, P) table is per job
    name = RULE_NAMES.get(type(rule))
    if name is None:
        raise UnknownRuleError(
            f"local rule {type(rule).__name__} is not registered for deployment; registered: {', '.join(RULES)}"
        )
    scalars: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for attr, v in vars(rule).items():
        if isinstance(v, torch.Tensor):
            per_job = v.dim() == 2 and (jobs < 0 or v.shape[0] == jobs)
            tensors[attr] = v[k : k + 1].contiguous() if per_job else v.contiguous()
        elif isinstance(v, SCALARS):
            scalars[attr] = v
        else:
            raise UnknownRuleError(f"local rule {name!r}: attribute {attr!r} ({type(v).__name__}) cannot travel")
    return name, scalars, tensors


def encode_job(
    *,
    start: torch.Tensor,
    client: int,
    round: int,
    rule: LocalRule,
    k: int,
    jobs: int,
    lr: float,
    steps: int | None,
    key: tuple[int, ...],
    local: LocalConfig,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Job ``k`` of a call of ``jobs`` jobs as ``(header, tensors)``."""
    if callable(lr):
        raise ValueError("the flower deployment sends a constant local learning rate per call, not a schedule")
    name, scalars, rule_tensors = _job_rule(rule, k, jobs)
    header = {
        "client": int(client),
        "round": int(round),
        "lr": float(lr),
        "steps": steps,
        "key": [int(x) for x in key],
        "local": dataclasses.asdict(local),
        "rule": name,
        "rule_scalars": scalars,
    }
    tensors = {"start": start.detach().reshape(1, -1).contiguous()}
    tensors.update({f"rule.{a}": t for a, t in rule_tensors.items()})
    return header, tensors


@dataclasses.dataclass
class Job:
    client: int
    round: int
    lr: float
    steps: int | None
    key: tuple[int, ...]
    local: LocalConfig
    rule: LocalRule
    start: torch.Tensor  # (1, P)


def decode_job(header_json: str, tensors: dict[str, torch.Tensor]) -> Job:
    """Rebuild a job on the node; raises :class:`UnknownRuleError` or :class:`MalformedJobError`."""
    try:
        h = json.loads(header_json)
        name = h["rule"]
        cls = RULES.get(name)
        if cls is None:
            raise UnknownRuleError(f"unknown local rule {name!r}; this node knows: {', '.join(RULES)}")
        rule = cls.__new__(cls)  # state only: the class's code is the node's own
        rule.__dict__.update(h["rule_scalars"])
        rule.__dict__.update({a[len("rule.") :]: t for a, t in tensors.items() if a.startswith("rule.")})
        steps = h["steps"]
        return Job(
            client=int(h["client"]),
            round=int(h["round"]),
            lr=float(h["lr"]),
            steps=None if steps is None else int(steps),
            key=tuple(int(x) for x in h["key"]),
            local=LocalConfig(**h["local"]),
            rule=rule,
            start=tensors["start"],
        )
    except UnknownRuleError:
        raise
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise MalformedJobError(f"malformed fedweave job message: {type(e).__name__}: {e}") from e


def encode_header(header: dict[str, Any]) -> str:
    return json.dumps(header)
