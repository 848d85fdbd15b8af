"""One client job of a ``LocalTrainer`` call as plain data: tensors and scalars, no code.

The server describes job ``k`` of a call (its start vector, round, steps, learning rate, local settings
and either the ``LocalRule`` or, for an algorithm whose clients keep state, the ``ClientStep``) as named
tensors plus a JSON header; the node rebuilds the rule or step from its *registered name*
(``fedweave.registry.RULES`` and ``CLIENT_STEPS``) and those tensors (DESIGN: no pickled code travels). So do
the objects a rule holds (the lower level's projection: ``RULE_PARTS``) and a learning rate that is a schedule
of the local step (``LR_SCHEDULES``): their name and scalars travel. A
name the node does not know is refused with :class:`UnknownRuleError`. A rule tensor equal to the job's start
vector travels once, as the start (FedProx's anchor; the lower level's input point).

A step's per-client state (SCAFFOLD's ``c_i``, FedDyn's local gradient) does not travel: the node keeps it
(``fedweave.deploy.node_state``) and the header names the round of the state version the server accepted
(``state_round``, -1 before the client's first round).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from fedweave.config import ConfigError, LocalConfig, build_dataclass, coerce
from fedweave.execution.job import LR, PLAIN, ClientStep, LocalCall, LocalRule, Reindexed
from fedweave.registry import CLIENT_STEPS, LR_SCHEDULES, RULE_PARTS, RULES, Registry

# The rules, client steps, the objects a rule holds (a projection) and local learning-rate schedules a node
# can rebuild are those registered by name at their definition (fedweave.registry). Their state is their
# attributes: tensors (sent as arrays) and JSON scalars; one with any other attribute (a function) cannot be
# deployed.
SCALARS = (bool, int, float, str, type(None))


class UnknownRuleError(ValueError):
    """A job names a rule or step this node cannot rebuild (not registered in ``fedweave.registry``)."""


class MalformedJobError(ValueError):
    """A job message lacks a field or has one of the wrong kind."""


def _attributes(obj: object, name: str, k: int, jobs: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Scalar attributes and tensors of a rule or step as seen by job ``k`` of ``jobs``: a per-job table
    ``(K, P)`` travels as its row ``k`` (shape ``(1, P)``, read by the node's job 0)."""
    scalars: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    derived = getattr(obj, "client_derived", ())  # the node derives these from its own data (LocalRule.at_client)
    for attr, v in vars(obj).items():
        if attr in derived:
            continue
        if isinstance(v, torch.Tensor):
            per_job = v.dim() == 2 and (jobs < 0 or v.shape[0] == jobs)
            tensors[attr] = v[k : k + 1].contiguous() if per_job else v.contiguous()
        elif isinstance(v, SCALARS):
            scalars[attr] = v
        elif RULE_PARTS.name_of(type(v)) is not None:
            part = RULE_PARTS.name_of(type(v))
            scalars[attr] = {"part": part, "scalars": _scalars(v, f"{name!r}: attribute {attr!r}")}
        else:
            raise UnknownRuleError(f"{name!r}: attribute {attr!r} ({type(v).__name__}) cannot travel")
    return scalars, tensors


def _scalars(obj: object, what: str) -> dict[str, Any]:
    """The attributes of a part or schedule, all JSON scalars."""
    out = vars(obj)
    bad = [a for a, v in out.items() if not isinstance(v, SCALARS)]
    if bad:
        raise UnknownRuleError(f"{what} ({type(obj).__name__}): attributes {bad} are not scalars and cannot travel")
    return dict(out)


def _registered(registry: Registry, what: str, name: Any) -> type:
    """The class registered as ``name``, or :class:`UnknownRuleError` naming those this node knows."""
    if not isinstance(name, str) or name not in registry:
        raise UnknownRuleError(f"unknown {what} {name!r}; this node knows: {', '.join(registry.names())}")
    return registry.get(name)


def _instance(registry: Registry, what: str, name: Any, scalars: Any) -> Any:
    """An object of a registered class from its scalar attributes (its code is the node's own)."""
    cls = _registered(registry, what, name)
    if not isinstance(scalars, dict) or not all(isinstance(v, SCALARS) for v in scalars.values()):
        raise MalformedJobError(f"the {what} {name!r} needs a mapping of scalars, got {scalars!r}")
    obj = cls.__new__(cls)
    obj.__dict__.update(scalars)
    return obj


def encode_lr(lr: LR) -> float | dict[str, Any]:
    """A constant local learning rate, or a registered schedule as its name and scalars."""
    if not callable(lr):
        return float(lr)
    name = LR_SCHEDULES.name_of(type(lr))
    if name is None:
        raise ValueError(
            f"the flower deployment sends a constant local learning rate or a registered schedule "
            f"({', '.join(LR_SCHEDULES.names())}), not {type(lr).__name__}"
        )
    return {"schedule": name, "scalars": _scalars(lr, f"schedule {name!r}")}


def decode_lr(value: Any) -> LR:
    if isinstance(value, dict):
        return _instance(LR_SCHEDULES, "learning-rate schedule", value.get("schedule"), value.get("scalars"))
    lr = coerce(value, float, "lr")
    if not 0 <= lr < float("inf"):  # 0: a decay that underflowed, or a schedule of its own that reaches 0
        raise ConfigError(f"lr must be a finite number >= 0, got {lr}")
    return lr


def whole(h: dict[str, Any], key: str, least: int, *, optional: bool = False) -> int | None:
    """Header field ``key`` as a whole number >= ``least`` (or None where ``optional``)."""
    if optional and h.get(key) is None:
        return None
    value = coerce(h[key], int, key)
    if value < least:
        raise ConfigError(f"{key} must be >= {least}, got {value}")
    return value


def check_tensors(tensors: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> None:
    """Every tensor of a job is one vector of the model's ``numel`` parameters (shape ``(numel,)`` or
    ``(1, numel)``: the start, a rule's vector, a table's row) in the run's ``dtype``; raises
    :class:`MalformedJobError` naming the first one that is not."""
    for name, t in sorted(tensors.items()):
        if t.dtype != dtype:
            raise MalformedJobError(f"job tensor {name!r} is {t.dtype}; the run's parameters are {dtype}")
        if t.shape not in ((numel,), (1, numel)):
            raise MalformedJobError(
                f"job tensor {name!r} has shape {tuple(t.shape)}; the run's model has {numel} parameters, so a "
                f"job's tensors are ({numel},) or (1, {numel})"
            )


def _job_rule(rule: LocalRule, k: int, jobs: int) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    if isinstance(rule, Reindexed):  # a call of some jobs of another call: the table row is positions[k]
        return _job_rule(rule.rule, int(rule.positions[k]), -1)  # -1: every (K, P) table is per job
    name = RULES.name_of(type(rule))
    if name is None:
        raise UnknownRuleError(
            f"local rule {type(rule).__name__} is not registered for deployment; registered: {', '.join(RULES.names())}"
        )
    return (name, *_attributes(rule, f"local rule {name}", k, jobs))


def _job_step(step: ClientStep) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    name = CLIENT_STEPS.name_of(type(step))
    if name is None:
        raise UnknownRuleError(
            f"client step {type(step).__name__} is not registered for deployment; "
            f"registered: {', '.join(CLIENT_STEPS.names())}"
        )
    scalars, tensors = _attributes(step, f"client step {name}", 0, 0)  # a step's tensors are the server's
    return name, scalars, tensors


def encode_job(
    call: LocalCall,
    k: int,
    *,
    local: LocalConfig,
    step: ClientStep | None = None,
    state_round: int = -1,
    num_classes: int | None = None,
    dp: tuple[float, float] | None = None,
    start_loss: bool = False,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Job ``k`` of ``call`` as ``(header, tensors)``: its start row, client, batch plan and learning rate,
    and the call's rule (its per-job tensors as row ``k``) or, for a stateful algorithm, the client ``step``
    in its place (the call's rule is then unused). ``dp``: DP-SGD's ``(clip, sigma)``, which the node runs
    around the rule (the noise from the run's stream of the job: the same as in simulation). ``start_loss``: the
    node also reports its client's task loss of the start model on all its data (AFL's and q-FFL's)."""
    start, client, round, lr, steps, key = call.starts[k], call.clients[k], call.round, call.lr, call.steps, call.key
    rule = call.rule if step is None else None
    header: dict[str, Any] = {
        "client": int(client),
        "round": int(round),
        "lr": encode_lr(lr),
        "steps": steps,
        "key": [int(x) for x in key],
        "local": dataclasses.asdict(local),
        "num_classes": num_classes,  # the model's outputs, for a node that holds its own data
    }
    if dp is not None:
        if step is not None:
            raise ValueError("DP-SGD around a stateful client step is not deployed")
        header["dp_sgd"] = {"clip": float(dp[0]), "sigma": float(dp[1])}
    if start_loss:
        header["start_loss"] = True
    tensors = {"start": start.detach().reshape(1, -1).contiguous()}
    if rule is not None:
        name, scalars, extra = _job_rule(rule, k, len(call))
        header.update(rule=name, rule_scalars=scalars)
        tensors.update({f"rule.{a}": t for a, t in extra.items()})
    else:
        name, scalars, extra = _job_step(step)
        header.update(step=name, step_scalars=scalars, state_round=int(state_round))
        tensors.update({f"step.{a}": t for a, t in extra.items()})
    # a rule's tensor that is the job's start vector (FedProx's anchor, the lower level's input point)
    # travels once, as the start
    same = {n: list(t.shape) for n, t in tensors.items() if n != "start" and _is(t, tensors["start"])}
    if same:
        header["same_as_start"] = same
        tensors = {n: t for n, t in tensors.items() if n not in same}
    return header, tensors


def _is(t: torch.Tensor, start: torch.Tensor) -> bool:
    return t.dtype == start.dtype and t.numel() == start.numel() and torch.equal(t.reshape(-1), start.reshape(-1))


@dataclasses.dataclass
class Job:
    """A job as the node rebuilds it: one client's local-training call (one job, from its start row) with
    the settings it runs under and, for a stateful algorithm, its client step and the state version to start
    from (the call's rule is then the plain one, replaced by the step's rule over the client's state)."""

    call: LocalCall
    local: LocalConfig
    step: ClientStep | None = None
    state_round: int = -1  # the round of the client state version the server accepted (-1: initial)
    num_classes: int | None = None
    dp: tuple[float, float] | None = None  # DP-SGD's (clip, sigma) around the rule: privacy.level sample
    start_loss: bool = False  # also report the task loss of the start model on the client's whole data

    @property
    def client(self) -> int:
        return self.call.clients[0]

    @property
    def start(self) -> torch.Tensor:
        """The start row, ``(1, P)``."""
        return self.call.starts


def _rebuild(registry: Registry, what: str, name: Any, scalars: dict, tensors: dict[str, torch.Tensor]):
    cls = _registered(registry, what, name)
    obj = cls.__new__(cls)  # state only: the class's code is the node's own
    parts = {a: _instance(RULE_PARTS, "part", v.get("part"), v.get("scalars")) for a, v in scalars.items()
             if isinstance(v, dict)}  # fmt: skip
    obj.__dict__.update({**scalars, **parts})
    prefix = f"{what.split()[-1]}."
    obj.__dict__.update({a[len(prefix) :]: t for a, t in tensors.items() if a.startswith(prefix)})
    return obj


def decode_job(header_json: str, tensors: dict[str, torch.Tensor]) -> Job:
    """Rebuild a job on the node; raises :class:`UnknownRuleError` or :class:`MalformedJobError`."""
    try:
        h = json.loads(header_json)
        for name, shape in h.get("same_as_start", {}).items():
            tensors = {**tensors, name: tensors["start"].reshape(shape).clone()}
        if "step" in h:
            step = _rebuild(CLIENT_STEPS, "client step", h["step"], h["step_scalars"], tensors)
            rule, state_round = PLAIN, whole(h, "state_round", -1)  # -1: the client's initial state
        else:
            rule = _rebuild(RULES, "local rule", h["rule"], h["rule_scalars"], tensors)
            step, state_round = None, -1
        local = build_dataclass(LocalConfig, h["local"], "local")
        local.validate()
        call = LocalCall(
            starts=tensors["start"],
            clients=[whole(h, "client", 0)],
            round=whole(h, "round", 0),
            rule=rule,
            lr=decode_lr(h["lr"]),
            steps=whole(h, "steps", 0, optional=True),
            key=tuple(coerce(h["key"], tuple[int, ...], "key")),
        )
        return Job(
            call=call,
            local=local,
            step=step,
            state_round=state_round,
            num_classes=whole(h, "num_classes", 1, optional=True),
            dp=_dp(h, step),
            start_loss=coerce(h.get("start_loss", False), bool, "start_loss"),
        )
    except UnknownRuleError:
        raise
    except ConfigError as e:  # a setting of the wrong kind or out of its range
        raise MalformedJobError(f"malformed fedweave job message: the job's {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError, json.JSONDecodeError) as e:
        raise MalformedJobError(f"malformed fedweave job message: {type(e).__name__}: {e}") from e


def _dp(h: dict[str, Any], step: ClientStep | None) -> tuple[float, float] | None:
    """The job's DP-SGD ``(clip, sigma)``: clip a finite number > 0, sigma one >= 0; only around a rule."""
    if "dp_sgd" not in h:
        return None
    if step is not None:
        raise ConfigError("dp_sgd goes around a rule, and this job has a client step")
    dp = h["dp_sgd"] if isinstance(h["dp_sgd"], dict) else {}
    clip, sigma = (coerce(dp.get(k), float, f"dp_sgd.{k}") for k in ("clip", "sigma"))
    if not (0 < clip < float("inf") and 0 <= sigma < float("inf")):
        raise ConfigError(f"dp_sgd must have a finite clip > 0 and sigma >= 0, got clip {clip}, sigma {sigma}")
    return clip, sigma


def encode_header(header: dict[str, Any]) -> str:
    return json.dumps(header)
