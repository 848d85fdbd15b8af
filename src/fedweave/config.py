"""The typed run configuration: YAML + ``key=value`` overrides, validated with errors that name the key.

Fixed sections (``local``, ``eval``, ``output``) are dataclasses. The sections that pick an object by name
(``dataset``, ``partition``, ``model``, ``algorithm``) hold ``name`` plus that object's own options, which
are checked against the object itself: an algorithm's ``Hparams`` dataclass, or a loader's keyword arguments.
The names it checks (losses, metrics, augmentations) are looked up in :mod:`fedweave.registry`, once the
plug-ins the config names (``plugins:``) are imported (:func:`load_plugins`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import types
import typing
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fedweave.registry import ACCOUNTANTS, AUGMENTATIONS, DATASETS, LOSSES, METRICS, UnknownNameError


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's float rule, refusal of duplicate keys, and bounds on nesting and
    on what aliases expand to.

    YAML 1.1 (PyYAML's default) reads ``1e-3`` as a string because its float rule wants a dot and a signed
    exponent; every spelling Python's ``float()`` accepts for a decimal number is a float here. A key given
    twice in one mapping is an error instead of the last one silently winning. Merge keys (``<<: *defaults``)
    work as in YAML 1.1: the mapping's own keys win over merged ones.

    The composer counts, for every collection, how many values it holds once its aliases are expanded: an
    alias "bomb" (each level aliasing the one before nine times) is a few hundred bytes of text that expands
    to billions of values in every later copy of the config, so the values added by aliases are bounded, as
    is the nesting depth (20,000 ``[`` would otherwise end in a RecursionError).
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}  # id(collection node) -> its values once its aliases are expanded
        self._aliased = 0  # values that aliases to collections have added so far

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            node = super().compose_node(parent, index)
            if isinstance(node, yaml.CollectionNode):
                size = self._sizes.get(id(node))
                if size is None:  # the anchored collection is still open: it would contain itself
                    raise ConfigError(f"the alias at line {line} refers to a collection that contains it")
                self._aliased += size
                if self._aliased > MAX_YAML_ALIASED:
                    raise ConfigError(
                        f"YAML aliases expand to more than {MAX_YAML_ALIASED:,} values (line {line}); "
                        "write the values out or alias less"
                    )
            return node
        if self._depth >= MAX_YAML_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise ConfigError(f"YAML nested deeper than {MAX_YAML_DEPTH} levels (line {line})")
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.CollectionNode):
            items = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
            self._sizes[id(node)] = 1 + sum(self._sizes.get(id(n), 1) for n in items)
        return node


MAX_YAML_DEPTH = 100  # levels of nesting in a config file or override (a real config has fewer than 10)
MAX_YAML_ALIASED = 100_000  # values that aliases may add to a config (a bomb adds billions)
_MERGE = "tag:yaml.org,2002:merge"


_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))

# YAML 1.2's integers: PyYAML's 1.1 rule reads a leading zero as octal (seed: 012 is 10) and colons as base 60
# (1:30 is 90), silently other numbers than the ones written; 1.2 reads 012 as 12, octal only as 0o12, and
# 1:30 as the string it looks like. Underscores stay allowed, as in the float rule above.
_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)$")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))

# YAML 1.2's booleans: PyYAML's 1.1 rule also reads yes/no/on/off (and y/n's cousins) as booleans, so a run named
# `no` was refused as "got False" and `topology: off` named a value nobody wrote; 1.2 reads them as strings
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))


def _int_1_2(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    base = {"0o": 8, "0x": 16, "0b": 2}.get(text[:2], 10)  # base 10 given: a leading zero is a decimal digit
    try:
        return int(text[2:] if base != 10 else text, base)
    except ValueError as e:  # an explicit !!int tag on other text
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer", node.start_mark) from e


_Loader.add_constructor("tag:yaml.org,2002:int", _int_1_2)


def _mapping_without_duplicates(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        # a merge key (``<<``) is no value of its own; given twice, it is a duplicate like any other key
        key = "<<" if key_node.tag == _MERGE else loader.construct_object(key_node, deep=True)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(f"duplicate key {key!r} at line {line}: give each key once")
        seen[key] = True
    return loader.construct_mapping(node, deep=True)  # SafeLoader's: merges the ``<<`` mappings first


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def yaml_load(text: str) -> Any:
    """Parse YAML config text (YAML 1.2 floats such as ``1e-3``, duplicate keys refused)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)


_CLOSER = {"[": "]", "{": "}"}


def split_values(text: str, after: str = "") -> list[str]:
    """``text`` cut at its top-level commas: those outside a ``[...]``/``{...}`` value and a quoted one, so
    ``[64],[128, 64]`` is two values and ``"a,b",c`` two. As in YAML, a bracket or a quote opens a value only
    where the value starts (after ``after``, e.g. ``=`` of ``KEY=VALUE`` pieces, when given, and spaces):
    ``a[1,2]`` is the plain texts ``a[1`` and ``2]``, as a cut at every comma gave. A value that opens a bracket
    or a quote and does not close it raises a one-line :class:`ConfigError` quoting it."""
    pieces: list[str] = []
    start, n = 0, len(text)
    while True:
        i = start
        if after:  # the value starts after the piece's first `after`; a piece without one has no value
            while i < n and text[i] not in (after, ","):
                i += 1
        if not after or (i < n and text[i] == after):
            i = _value_end(text, i + bool(after))
        comma = text.find(",", i)
        if comma < 0:
            return [*pieces, text[start:]]
        pieces.append(text[start:comma])
        start = comma + 1


def _value_end(text: str, i: int) -> int:
    """Where the bracketed or quoted value starting at ``i`` (after spaces) ends; ``i`` for a plain one."""
    while i < len(text) and text[i] in " \t":
        i += 1
    if i == len(text) or text[i] not in "[{'\"":
        return i
    if text[i] in "'\"":
        return _quote_end(text, i)
    stack: list[str] = []
    j = i
    while j < len(text):
        c = text[j]
        if c in "[{":
            stack.append(c)
        elif c in "]}":
            if _CLOSER[stack[-1]] != c:
                raise ConfigError(f"{text[i:]!r}: {c!r} at character {j - i + 1} does not close {stack[-1]!r}")
            stack.pop()
            if not stack:
                return j + 1
        elif c in "'\"" and text[j - 1] in "[{,:? \t":  # a quote inside starts a node only (it's, [a'b] are plain)
            j = _quote_end(text, j) - 1
        j += 1
    raise ConfigError(
        f"{text[i:]!r}: {stack[-1]!r} is not closed (a list or mapping value closes its brackets, e.g. [128, 64])"
    )


def _quote_end(text: str, i: int) -> int:
    """The index after the quoted scalar that opens at ``i`` (``''`` inside '...' and ``\\"`` inside "..."
    are the quote itself, as YAML reads them)."""
    q, j = text[i], i + 1
    while j < len(text):
        if q == '"' and text[j] == "\\":
            j += 2
            continue
        if text[j] == q:
            if q == "'" and text[j + 1 : j + 2] == "'":
                j += 2
                continue
            return j + 1
        j += 1
    raise ConfigError(f"{text[i:]!r}: the quote {q} is not closed")


class ConfigError(ValueError):
    """A configuration problem; the message names the key and what is allowed.

    The message is kept on one line (the command line prints it as one ``fedweave: error: ...`` line).
    """

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(line.strip() for line in str(message).splitlines() if line.strip()))


@dataclass
class Section:
    """A config section that selects a registered object by ``name`` and passes it ``options``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The section as written in a config: ``{"name": name, **options}``."""
        return {"name": self.name, **self.options}


@dataclass
class LocalConfig:
    """Local training of each client (shared by the families that train neural models)."""

    epochs: int | None = None  # default: 1 epoch when steps is not set either
    steps: int | None = None
    batch_size: int = 32
    # every local step on the client's whole data (full-batch gradient descent; batch_size is ignored): one
    # step per epoch, or local.steps steps
    full_batch: bool = False
    lr: float = 0.05
    lr_decay: float = 1.0  # multiplicative factor of the exponential and step schedules
    lr_schedule: Literal["exponential", "step", "cosine"] = "exponential"
    lr_step: int = 1  # step schedule: multiply by lr_decay every lr_step rounds
    # cosine schedule: lr_min + (lr - lr_min) (1 + cos(pi r / rounds)) / 2 in 0-based round r (PyTorch's
    # CosineAnnealingLR with T_max = rounds): lr_min is the value at r = rounds, one past the last round (which
    # takes lr_min + (lr - lr_min) (1 + cos(pi (rounds - 1) / rounds)) / 2)
    lr_min: float = 0.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    augment: list[str] = field(default_factory=list)
    # the "crop" augmentation: pad each side by crop_padding, then a random crop_size window (null: the
    # image size). CSE-FSL's CIFAR RandomCrop(24) is crop_size 24, crop_padding 0 (with model.crop: 24).
    crop_size: int | None = None
    crop_padding: int = 4

    def validate(self) -> None:
        """Check the ``local`` section (and set ``epochs`` to 1 when neither ``epochs`` nor ``steps`` is set);
        raise a :class:`ConfigError` naming the first bad key and what it allows."""
        if self.epochs is not None and self.steps is not None:
            raise ConfigError("set only one of local.epochs and local.steps (the other must be null)")
        if self.epochs is None and self.steps is None:
            self.epochs = 1
        for key in ("epochs", "steps", "batch_size"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"local.{key} must be >= 1, got {v}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise ConfigError(f"local.batch_size must be <= {MAX_BATCH_SIZE:,}, got {self.batch_size:,}")
        for key, most in (("epochs", MAX_LOCAL_EPOCHS), ("steps", MAX_LOCAL_STEPS)):
            v = getattr(self, key)
            if v is not None and v > most:
                raise ConfigError(f"local.{key} must be <= {most:,} (a larger value runs for days), got {v:,}")
        if not 0 < self.lr <= MAX_LR:  # the step is taken in float32 too, whose largest number this is
            raise ConfigError(f"local.lr must be a finite number in (0, {MAX_LR:.6g}], got {self.lr}")
        if not 0 < self.lr_decay <= 1:
            raise ConfigError(f"local.lr_decay must be in (0, 1], got {self.lr_decay}")
        if self.lr_step < 1:
            raise ConfigError(f"local.lr_step must be >= 1, got {self.lr_step}")
        if not 0 <= self.lr_min <= self.lr:
            raise ConfigError(f"local.lr_min must be in [0, local.lr], got {self.lr_min}")
        # a key of another schedule would be silently unread (LocalTrainer.lr reads only its schedule's keys)
        for key, default, schedules in (("lr_step", 1, ("step",)), ("lr_min", 0.0, ("cosine",))):
            if getattr(self, key) != default and self.lr_schedule not in schedules:
                raise ConfigError(
                    f"local.{key} applies to local.lr_schedule: {schedules[0]}, not {self.lr_schedule}; leave it out"
                )
        if self.lr_decay != 1 and self.lr_schedule == "cosine":
            raise ConfigError(
                "local.lr_decay applies to the exponential and step schedules; local.lr_schedule: cosine falls from "
                "local.lr to local.lr_min"
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"local.momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"local.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not 0 < self.grad_clip <= MAX_LR:
            raise ConfigError(f"local.grad_clip must be a number in (0, {MAX_LR:.6g}] or null, got {self.grad_clip}")
        if self.crop_size is not None and self.crop_size < 1:
            raise ConfigError(f"local.crop_size must be >= 1 or null, got {self.crop_size}")
        if self.crop_padding < 0:
            raise ConfigError(f"local.crop_padding must be >= 0, got {self.crop_padding}")
        if (self.crop_size is not None or self.crop_padding != 4) and "crop" not in self.augment:
            raise ConfigError(
                "local.crop_size and local.crop_padding apply to the 'crop' augmentation: add it to local.augment"
            )
        for i, name in enumerate(self.augment):
            if name not in AUGMENTATIONS:
                raise ConfigError(f"local.augment[{i}] must be one of {', '.join(AUGMENTATIONS.names())}, got {name!r}")


@dataclass
class TaskConfig:
    """What is predicted and how it is scored (fedweave.tasks; docs/tasks.md)."""

    loss: str = "cross_entropy"  # a registered loss: cross_entropy, nll, mse, bce_with_logits, or a plug-in's
    loss_options: dict[str, Any] = field(default_factory=dict)  # e.g. {half: true} for mse
    metrics: list[str] | None = None  # null: the loss's defaults (accuracy; mse/rmse/mae/r2; auc/f1)
    main: str | None = None  # the metric of final/best in summary.json; null: the first metric's

    def validate(self) -> None:
        """Check that the loss, its options and the metrics exist and fit together; raise a
        :class:`ConfigError` naming the first bad key and what it allows."""
        if self.loss == "python":  # a resumed run's loss passed from Python: checked with it when the run is built
            if self.metrics is not None:
                check_task(None, self.metrics, self.main)
            return
        try:
            cls = LOSSES.get(self.loss)
        except UnknownNameError as e:
            raise ConfigError(f"task.loss: {e}") from e
        # built as fedweave.tasks.build_task builds it for the run: a loss its options do not fit fails here
        check_task(cls(**check_options(cls, self.loss_options or {}, "task.loss_options")), self.metrics, self.main)


#: The metrics of a task whose ``task.metrics`` is null, by its loss's targets (``bce_with_logits``: auc and f1).
DEFAULT_METRICS = {"class": ["accuracy"], "float": ["mse", "rmse", "mae", "r2"]}


def check_task(loss: Any, metrics: list[str] | None, main: str | None) -> tuple[list[str], str, str]:
    """The metrics of a task whose loss is ``loss`` (a :class:`~fedweave.tasks.Loss`; its defaults when
    ``metrics`` is None), its main metric (the first metric's when ``main`` is None) and whether higher
    (``max``) or lower (``min``) is better in it, the metrics looked up in the registry. An unknown metric or
    main metric raises a :class:`ConfigError` naming ``task.metrics`` or ``task.main``."""
    if metrics is None:
        metrics = ["auc", "f1"] if loss.name == "bce_with_logits" else DEFAULT_METRICS[loss.targets]
    for i, m in enumerate(metrics):
        if m not in METRICS:
            raise ConfigError(f"task.metrics[{i}] must be one of {', '.join(METRICS.names())}, got {m!r}")
        if m in metrics[:i]:  # refused as a duplicate key is anywhere else (before: silently once)
            raise ConfigError(f"task.metrics names {m!r} twice; give each metric once")
    directions = {"loss": "min"}
    for m in metrics:
        directions.update(METRICS.get(m).keys)
    if main is None:
        main = next(iter(METRICS.get(metrics[0]).keys)) if metrics else "loss"
    if main not in directions:
        raise ConfigError(
            f"task.main must be one of {', '.join(sorted(directions))} (the task's metrics), got {main!r}"
        )
    return list(metrics), main, directions[main]


@dataclass
class EvalConfig:
    """When and how a run is evaluated, and when a growing loss stops it (the ``eval`` section)."""

    every: int = 1
    batch_size: int = 2048
    per_client: bool = False  # evaluate each client's model on its own test set (personalized methods)
    at_start: bool = False  # evaluate the initial model as round 0 (peer frameworks report it)
    # star family: test_accuracy = mean over clients of the global model's accuracy on each client's own
    # test set (drawn with its train label distribution, as the decentralized family; afind-plus A29)
    personal_test: bool = False
    # the fraction of each client's own samples held out as its test set (PFLlib's per-client 75/25 split:
    # 0.25), taken from its training data before training; 0: the per-client test sets are drawn from the
    # test split instead. Personal models, and the global model under personal_test, are evaluated on them
    holdout: float = 0.0
    # star family: the global model on each client's own test set (the personal_test sets), summarized as
    # client_test_<main>_mean / _worst10 (the mean of the worst 10 % of clients) / _std, and every client's
    # values of each evaluation in clients.jsonl in the run directory
    distribution: bool = False
    # a run stops as diverged when a loss it reports exceeds this multiple of its first value (null: only
    # NaN/Inf stop it): a loss of 1e27 is finite but the model is already useless
    explode_factor: float | None = 1.0e4

    def validate(self) -> None:
        """Check the ``eval`` section; raise a :class:`ConfigError` naming the first bad key and what it allows."""
        if self.every < 1:
            raise ConfigError(f"eval.every must be >= 1, got {self.every}")
        if self.explode_factor is not None and not 1 < self.explode_factor < math.inf:
            raise ConfigError(f"eval.explode_factor must be a finite number > 1 or null, got {self.explode_factor}")
        if not 0 <= self.holdout < 1:
            raise ConfigError(
                f"eval.holdout must be in [0, 1) (the held-out fraction of each client's samples), got {self.holdout}"
            )
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise ConfigError(f"eval.batch_size must be in [1, {MAX_BATCH_SIZE:,}], got {self.batch_size:,}")


@dataclass
class OutputConfig:
    """What a run writes besides its metrics and summary, and where (the ``output`` section)."""

    dir: str | None = None  # default: runs/<name>-s<seed>-<timestamp> (results.default_run_dir)
    checkpoint_every: int = 0  # rounds; 0 = never
    plots: bool = True
    progress: bool = True
    trackers: list[str] = field(default_factory=list)  # tensorboard, mlflow, wandb (fedweave.callbacks.trackers)

    def validate(self) -> None:
        """Check the ``output`` section; raise a :class:`ConfigError` naming the first bad key and what it allows."""
        if self.dir is not None and not self.dir.strip():  # an unset variable in a script wrote into ./runs/
            raise ConfigError(
                f"output.dir must be a directory's path or null (runs/<name>-s<seed>-<time>), got {self.dir!r}"
            )
        if self.checkpoint_every < 0:
            raise ConfigError(f"output.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        bad = [t for t in self.trackers if t not in ("tensorboard", "mlflow", "wandb")]
        if bad:
            raise ConfigError(f"output.trackers: unknown tracker {bad[0]!r} (allowed: tensorboard, mlflow, wandb)")
        twice = [t for i, t in enumerate(self.trackers) if t in self.trackers[:i]]
        if twice:  # each name is one tracker run: a second started another run and left the first unfinished
            raise ConfigError(f"output.trackers names {twice[0]!r} twice; give each tracker once")


@dataclass
class FaultsConfig:
    """Faults injected into a run (see docs/reliability.md); the defaults inject none.

    Every decision is a pure function of (seed, round, who), drawn by :class:`fedweave.faults.Faults`.
    """

    dropout: float = 0.0  # P(a participating client fails to report), per client and round
    outage_rounds: list[int] = field(default_factory=list)  # rounds (1-based, as in metrics) nobody reports
    deadline: float | None = None  # per-round deadline in simulated time; null = no stragglers
    speed_sigma: float = 0.5  # log-normal spread of the clients' compute times (median 1 per unit of work)
    speed_jitter: float = 0.0  # log-normal per-round jitter of each client's compute time
    straggler_policy: Literal["drop", "late"] = "drop"  # late clients are dropped, or arrive in a later round
    link_loss: float = 0.0  # P(a peer link is down), per link and round (decentralized)
    server_miss: float = 0.0  # P(an edge server misses a round), per server and round (confederated)
    # Byzantine clients (fedweave.robust, docs/robustness.md): {fraction: 0.2 | clients: [ids], attack: NAME,
    # ...the attack's options}; null = none
    byzantine: dict | None = None
    # the star family's synchronous rounds on the simulated clock of the asynchronous methods (the same latency
    # model: speed_sigma, speed_jitter, deadline): a round lasts until the server has heard from every sampled
    # client, at most the deadline, and each metrics row gets sim_time; the asynchronous methods always have it
    sim_time: bool = False
    # the unit of the clock (deadline, sim_time, arrival times): round = a mean client's round (a client's work is
    # its local steps over those of the run's mean client round); step = one local step of a median-speed client
    work_unit: Literal["round", "step"] = "round"

    def validate(self) -> None:
        """Check the ``faults`` section; raise a :class:`ConfigError` naming the first bad key and what it allows."""
        for key in ("dropout", "link_loss", "server_miss"):
            v = getattr(self, key)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"faults.{key} must be a probability in [0, 1], got {v}")
        for i, r in enumerate(self.outage_rounds):
            if r < 1:
                raise ConfigError(f"faults.outage_rounds[{i}] must be a round number >= 1, got {r}")
        if self.deadline is not None and not 0.0 < self.deadline < math.inf:
            raise ConfigError(f"faults.deadline must be a finite number > 0 or null, got {self.deadline}")
        for key in ("speed_sigma", "speed_jitter"):
            v = getattr(self, key)
            if not 0.0 <= v < math.inf:
                raise ConfigError(f"faults.{key} must be a finite number >= 0, got {v}")
        if self.speed_sigma + self.speed_jitter > MAX_SPEED_SPREAD:
            raise ConfigError(
                f"faults.speed_sigma + faults.speed_jitter must be at most {MAX_SPEED_SPREAD:g} (a client's time is "
                f"exp(speed_sigma z + speed_jitter z'), which overflows the simulated clock beyond it), got "
                f"{self.speed_sigma:g} + {self.speed_jitter:g}"
            )
        if self.byzantine is not None:
            _check_byzantine(self.byzantine)


def _check_byzantine(spec: dict[str, Any]) -> None:
    """``faults.byzantine``: exactly one of ``fraction`` (in [0, 1)) and ``clients`` (distinct ids >= 0, a whole
    float taken as its integer), and an ``attack`` name (checked with its options against the ATTACKS registry
    when the run is built)."""
    where = "faults.byzantine"
    for k in spec:
        if not isinstance(k, str):
            raise ConfigError(f"{where}: option names must be strings, got {k!r}")
    has_fraction, has_clients = spec.get("fraction") is not None, spec.get("clients") is not None
    if has_fraction == has_clients:
        raise ConfigError(f"{where}: give exactly one of fraction (a share of the clients) and clients (a list of ids)")
    if has_fraction:
        v = spec["fraction"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            raise ConfigError(f"{where}.fraction must be a number in [0, 1), got {v!r}")
    else:
        ids = spec["clients"]
        if not isinstance(ids, list):
            raise ConfigError(f"{where}.clients must be a list of client ids (integers >= 0), got {ids!r}")
        # each id as every other integer key takes it (coerce: 2.0 is 2, 1.5 and true are refused), written back
        # so that the run, its saved config and a resume see the same whole numbers
        ids = [coerce(c, int, f"{where}.clients[{i}]") for i, c in enumerate(ids)]
        seen: set[int] = set()
        for i, c in enumerate(ids):
            if c < 0:
                raise ConfigError(f"{where}.clients[{i}] must be a client id (an integer >= 0), got {c}")
            if c in seen:  # a repeat was dropped silently: a typo for another client went unnoticed
                raise ConfigError(
                    f"{where}.clients must hold distinct client ids, got {c} twice in {spec['clients']!r}"
                )
            seen.add(c)
        spec["clients"] = ids
    if not isinstance(spec.get("attack"), str):
        raise ConfigError(f"{where}.attack must be an attack's name (fedweave list), got {spec.get('attack')!r}")


@dataclass
class CompressionConfig:
    """Update compression (docs/compression.md); the default compresses nothing.

    ``upload`` names a registered compressor (:data:`fedweave.registry.COMPRESSORS`) as a name or a mapping
    ``{name: ..., options}``, applied to every reporting client's upload; ``download`` likewise, applied to
    what the server broadcasts (the difference of the model from what each client holds)."""

    upload: str | dict[str, Any] | None = None
    download: str | dict[str, Any] | None = None

    @property
    def upload_section(self) -> Section | None:
        """``upload`` as a :class:`Section` (None: uploads are sent dense)."""
        return None if self.upload is None else _section(self.upload, "compression.upload")

    @property
    def download_section(self) -> Section | None:
        """``download`` as a :class:`Section` (None: the server broadcasts dense)."""
        return None if self.download is None else _section(self.download, "compression.download")

    def validate(self) -> None:
        """Check the section's shape (the compressor's name and options are checked when the run is built)."""
        _ = self.upload_section, self.download_section


def is_host_port(address: str) -> bool:
    """Whether ``address`` is ``HOST:PORT``: a host and a port from 1 to 65535."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


def ray_address_error(address: Any) -> str | None:
    """What is wrong with a Ray cluster address (``ray.address``, ``sweep --ray``), or None: Ray takes ``auto``,
    ``local``, ``HOST:PORT`` or ``ray://HOST:PORT`` (a port from 1 to 65535) and raised ``Invalid address format``
    on anything else only once the first round trained, after the run directory was written."""
    allowed = "'auto', 'local', 'HOST:PORT' or 'ray://HOST:PORT'"
    if not isinstance(address, str) or not address.strip():
        return f"must be {allowed}, got {address!r}"
    if address in ("auto", "local"):
        return None
    if not is_host_port(address.removeprefix("ray://")):
        return f"must be {allowed} (a port from 1 to 65535), got {address!r}"
    return None


@dataclass
class RayConfig:
    """The ``ray`` backend: where its workers run (see docs/performance.md)."""

    address: str | None = None  # an existing cluster ("auto", "ray://host:10001", ...); null = start a local Ray
    num_workers: int | None = None  # actors, one CPU each; null = the cluster's CPUs
    object_store_memory_mb: int | None = None  # cap of a local Ray's object store; null = sized from the data
    # GPUs per actor under a cuda device; a fraction (0.25) lets several actors share one GPU; 0 = CPU actors
    num_gpus_per_worker: float = 0.0

    def validate(self) -> None:
        """Check the ``ray`` section; raise a :class:`ConfigError` naming the first bad key and what it allows."""
        if self.address is not None and (why := ray_address_error(self.address)):
            raise ConfigError(f"ray.address {why} (null: start a local Ray)")
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError(f"ray.num_workers must be >= 1 or null, got {self.num_workers}")
        if self.object_store_memory_mb is not None and self.object_store_memory_mb < 80:
            got = self.object_store_memory_mb
            raise ConfigError(f"ray.object_store_memory_mb must be >= 80 (Ray's minimum) or null, got {got}")
        if not 0 <= self.num_gpus_per_worker <= 64:
            got = self.num_gpus_per_worker
            raise ConfigError(f"ray.num_gpus_per_worker must be in [0, 64] (0.25: four actors share a GPU), got {got}")


@dataclass
class MemoryConfig:
    """Where data, per-client state and batched jobs live on an accelerator (docs/performance.md, GPUs)."""

    # the training and test tensors are moved to the device once when they fit in this fraction of its free
    # memory; otherwise they stay in pinned host memory and each batch is copied (non-blocking)
    data_fraction: float = 0.5
    # per-client state (control variates, personal models, ...) on the device when it fits in this fraction of
    # its free memory; otherwise in pinned host memory, and only the sampled clients' rows are moved
    state_fraction: float = 0.25
    # jobs per batched (vmap) computation; null: 64 on a CPU, on an accelerator as many as fit in half its
    # free memory (measured on the first chunk), at most 4096
    vmap_chunk: int | None = None

    def validate(self) -> None:
        """Check the ``memory`` section; raise a :class:`ConfigError` naming the first bad key and what it allows."""
        for key in ("data_fraction", "state_fraction"):
            v = getattr(self, key)
            if not 0 <= v <= 1:
                raise ConfigError(f"memory.{key} must be a fraction in [0, 1], got {v}")
        if self.vmap_chunk is not None and self.vmap_chunk < 1:
            raise ConfigError(f"memory.vmap_chunk must be >= 1 or null, got {self.vmap_chunk}")


# ---- privacy: differential privacy of the clients' updates (fedweave.privacy, docs/privacy.md) ----------------
@dataclass
class PrivacyConfig:
    """The ``privacy`` section: differential privacy with an accountant (docs/privacy.md). Absent: no DP."""

    # user: each client's whole update is what is protected (DP-FedAvg); sample: each training sample (DP-SGD
    # at every client, per-sample clipping and noise)
    level: Literal["user", "sample"] = "user"
    # user level: central (the server adds the noise to the sum), local (each client noises its own update) or
    # ftrl (DP-FTRL: the sums released as noised prefix sums by tree aggregation, no sampling amplification)
    mechanism: Literal["central", "local", "ftrl"] = "central"
    clip: float = 1.0  # C: the L2 bound of each client's update (level sample: of each sample's gradient)
    per_layer: bool = False  # clip each layer's part of the update to C / sqrt(layers) (still norm <= C)
    noise_multiplier: float | Literal["auto"] = 1.0  # sigma: noise std sigma * C; auto: from target_epsilon
    delta: float = 1.0e-5  # the delta at which epsilon is reported
    accountant: str = "rdp"  # rdp or prv (Opacus's accountants)
    target_epsilon: float | None = None  # stop before it is exceeded, or (noise_multiplier: auto) calibrate sigma
    # auto: Poisson sampling (sampler: bernoulli) is amplified with q = clients_per_round / N, fixed clients
    # or a schedule get q = 1, a fixed-size uniform sample is refused; none: q = 1 whatever the sampler. Level
    # sample: the local batches' rate, auto q_i = B / n_i (Poisson's number for shuffled batches), none q_i = 1
    amplification: Literal["auto", "none"] = "auto"
    adaptive: bool = False  # adaptive clipping (Andrew et al. 2021): C follows target_quantile of the norms
    target_quantile: float = 0.5  # gamma: the fraction of updates left unclipped
    clip_lr: float = 0.2  # eta_C of the geometric update C <- C exp(-eta_C (b - gamma))
    count_noise: float | None = None  # sigma_b: noise std of the clipped count; null: clients_per_round / 20
    restart_every: int | None = None  # ftrl: a new tree every this many releases (the paper's restart per epoch)
    momentum: float = 0.0  # ftrl: DP-FTRLM's server momentum gamma on the noised increments, reset with the tree

    def validate(self) -> None:
        """Check the ``privacy`` section; raise a :class:`ConfigError` naming the first bad key and what it allows."""
        if not 0 < self.clip <= MAX_LR:
            raise ConfigError(f"privacy.clip must be a number in (0, {MAX_LR:.6g}], got {self.clip}")
        # sigma is drawn in float32 (sigma * C) and squared by the accountants: bounded as clip is
        if self.noise_multiplier != "auto" and not 0 <= self.noise_multiplier <= MAX_LR:
            raise ConfigError(
                f"privacy.noise_multiplier must be a number in [0, {MAX_LR:.6g}] or auto, got {self.noise_multiplier}"
            )
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta must be in (0, 1), got {self.delta}")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(
                f"privacy.accountant must be one of {', '.join(ACCOUNTANTS.names())}, got {self.accountant!r}"
            )
        if self.target_epsilon is not None and not 0 < self.target_epsilon < math.inf:
            raise ConfigError(f"privacy.target_epsilon must be a finite number > 0 or null, got {self.target_epsilon}")
        if self.noise_multiplier == "auto" and self.target_epsilon is None:
            raise ConfigError("privacy.noise_multiplier: auto calibrates sigma to privacy.target_epsilon: set it")
        if not 0 < self.target_quantile < 1:
            raise ConfigError(f"privacy.target_quantile must be in (0, 1), got {self.target_quantile}")
        if not 0 < self.clip_lr < math.inf:
            raise ConfigError(f"privacy.clip_lr must be a finite number > 0, got {self.clip_lr}")
        if self.count_noise is not None and not 0 < self.count_noise < math.inf:
            raise ConfigError(f"privacy.count_noise must be a finite number > 0 or null, got {self.count_noise}")
        if self.level == "sample":
            for key, default in (("mechanism", "central"), ("per_layer", False), ("adaptive", False)):
                if getattr(self, key) != default:
                    raise ConfigError(
                        f"privacy.{key} applies to privacy.level: user; DP-SGD (level: sample) clips "
                        "each sample's gradient to privacy.clip and noises it at the client"
                    )
        if self.mechanism != "ftrl":
            for key, default in (("restart_every", None), ("momentum", 0.0)):
                if getattr(self, key) != default:
                    raise ConfigError(
                        f"privacy.{key} applies to privacy.mechanism: ftrl (DP-FTRL's tree), not to "
                        f"mechanism: {self.mechanism}"
                    )
        if not self.adaptive:  # read by adaptive clipping only: without it the clip stays privacy.clip
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for key in ("target_quantile", "clip_lr", "count_noise"):
                if getattr(self, key) != defaults[key]:
                    raise ConfigError(
                        f"privacy.{key} applies to privacy.adaptive: true (adaptive clipping, Andrew et al. 2021), "
                        "which is off: the clip stays privacy.clip; set privacy.adaptive: true or leave it out"
                    )
        if self.restart_every is not None and not (isinstance(self.restart_every, int) and self.restart_every >= 1):
            raise ConfigError(f"privacy.restart_every must be an integer >= 1 or null, got {self.restart_every}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"privacy.momentum must be in [0, 1), got {self.momentum}")
        if self.adaptive and self.mechanism == "ftrl":
            raise ConfigError(
                "privacy.adaptive needs privacy.mechanism: central (DP-FTRL's tree would have to release the clipped "
                "count too)"
            )
        if self.adaptive and self.mechanism == "local":
            raise ConfigError(
                "privacy.adaptive needs privacy.mechanism: central (the clipped count is noised at the server)"
            )


# ---- secure aggregation: the cost of SecAgg+ in simulation (fedweave.privacy.secagg, docs/privacy.md) ----------
@dataclass
class SecureAggregationConfig:
    """The ``secure_aggregation`` section: the ledger bills the SecAgg+ protocol's messages (Bell et al., CCS 2020,
    as Flower's ``SecAggPlusWorkflow`` runs it) around every round's uploads. Absent: none. The values the model
    sees are not changed (no quantization is simulated)."""

    protocol: Literal["secagg_plus"] = "secagg_plus"
    # Flower's meaning: an int > 2 is the number of shares of each client's secrets (its neighbours, itself
    # included); a float in (0, 1] the fraction of the round's sampled clients
    num_shares: int | float = 1.0
    # an int: the shares needed to reconstruct a secret; a float in (0, 1]: that fraction of num_shares
    reconstruction_threshold: int | float = 0.5
    modulus_range: int = 2**32  # the masked input's field Z_R (each element billed 8 bytes, as Flower sends it)
    quantization_range: int = 2**22  # Flower's quantization range (< modulus_range)
    clipping_range: float = 8.0  # Flower's clipping range before quantization (deployed; not simulated)
    max_weight: float = 1000.0  # Flower's bound on a client's weight (deployed; not simulated)

    def validate(self) -> None:
        """Check the section as Flower's ``SecAggPlusWorkflow`` checks its arguments; one line naming the key."""
        ns, t = self.num_shares, self.reconstruction_threshold
        if isinstance(ns, bool) or not isinstance(ns, (int, float)):
            raise ConfigError(f"secure_aggregation.num_shares must be an int > 2 or a fraction in (0, 1], got {ns!r}")
        if isinstance(ns, int) and ns != 1 and ns <= 2:
            raise ConfigError(f"secure_aggregation.num_shares as an integer must be greater than 2, got {ns}")
        if isinstance(ns, float) and not 0 < ns <= 1:
            raise ConfigError(f"secure_aggregation.num_shares as a fraction must be in (0, 1], got {ns}")
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ConfigError(
                f"secure_aggregation.reconstruction_threshold must be an int or a fraction in (0, 1], got {t!r}"
            )
        if isinstance(t, float) and not 0 < t <= 1:
            raise ConfigError(f"secure_aggregation.reconstruction_threshold as a fraction must be in (0, 1], got {t}")
        if isinstance(t, int) and t != 1 and isinstance(ns, int) and ns != 1 and t >= ns:
            raise ConfigError(f"secure_aggregation.reconstruction_threshold ({t}) must be less than num_shares ({ns})")
        if isinstance(t, int) and t < 1:
            raise ConfigError(f"secure_aggregation.reconstruction_threshold must be >= 1, got {t}")
        q, m = self.quantization_range, self.modulus_range
        if not isinstance(q, int) or q <= 0:
            raise ConfigError(f"secure_aggregation.quantization_range must be an integer > 0, got {q!r}")
        if not isinstance(m, int) or m <= q or m > 2**32 or bin(m).count("1") != 1:
            raise ConfigError(
                f"secure_aggregation.modulus_range must be a power of 2 greater than quantization_range ({q}) and "
                f"at most 2**32, got {m!r}"
            )
        if not 0 < self.clipping_range < math.inf:
            raise ConfigError(
                f"secure_aggregation.clipping_range must be a finite number > 0, got {self.clipping_range}"
            )
        if not 0 < self.max_weight < math.inf:
            raise ConfigError(f"secure_aggregation.max_weight must be a finite number > 0, got {self.max_weight}")


Backend = Literal["auto", "loop", "vmap", "ray", "pool"]
BACKENDS: tuple[str, ...] = typing.get_args(Backend)
DEVICE = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")
PRECISIONS = ("float32", "float64", "bf16-mixed")
# Upper bounds that catch a typo (1e12 rounds or epochs would run forever) long before they bind real work.
MAX_ROUNDS = 10_000_000
MAX_LOCAL_EPOCHS = 10_000
MAX_LOCAL_STEPS = 10_000_000
MAX_BATCH_SIZE = 2**31 - 1  # torch sizes and splits are 64-bit; far beyond any dataset
MAX_LR = 3.4028234663852886e38  # float32's largest finite number: a larger lr or clip overflows a float32 step
# faults.speed_sigma + speed_jitter: a client's time per unit of work is exp(speed_sigma z + speed_jitter z') with
# Box-Muller normals of |z| <= sqrt(2 * 53 ln 2) ~ 8.57 (fedweave.faults), so at most e^(50 * 8.57) ~ 1e186: the
# clock's times and sums stay finite in float64 (beyond about 83 one draw alone overflows to inf). A log-normal
# spread of 50 is far beyond any straggler model; a larger value is a typo.
MAX_SPEED_SPREAD = 50.0


def max_threads() -> int:
    """The most torch threads a run may ask for: 4x the CPUs (more only thrashes, and a huge value makes
    OpenMP fail to start its pool)."""
    return 4 * (os.cpu_count() or 1)


def check_run_name(name: str) -> None:
    """A run name becomes one path component of ``runs/``: no separators, no '..', no control characters."""
    bad = [c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    if bad:
        raise ConfigError(f"name must not contain control characters, got {name!r}")
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or name.startswith("-"):
        raise ConfigError(
            f"name must be one path component (letters, digits, '-', '_', '.'; no '/', '\\' or '..'), got {name!r}"
        )


@dataclass
class RunConfig:
    """One run's whole config: the top-level keys and one field per section, each with its default.

    :func:`load` builds and validates it from a YAML file, a dict or an example's name; :meth:`to_dict`
    gives it back as the plain dict written to the run directory's ``config.yaml``."""

    name: str = "run"
    seed: int = 0
    rounds: int = 100
    backend: Backend = "auto"
    threads: int | None = None  # torch intra-op threads; null = torch's default
    # where the run computes: auto (cuda if available, else mps, else cpu), cpu, cuda, cuda:N or mps
    device: str = "auto"
    # the floating dtype of models, data, state, aggregation and checkpoints (bytes in the ledger follow it);
    # bf16-mixed: float32 parameters, updates, aggregation and state, local training and evaluation
    # autocast to bfloat16
    precision: Literal["float32", "float64", "bf16-mixed"] = "float32"
    dataset: Section = field(default_factory=lambda: Section("mnist"))
    partition: Section = field(default_factory=lambda: Section("iid", {"num_clients": 10}))
    model: Section = field(default_factory=lambda: Section("logistic"))
    algorithm: Section = field(default_factory=lambda: Section("fedavg"))
    # who takes part in each round (fedweave.topology.samplers): uniform, bernoulli, fixed, schedule, ...
    sampler: Section = field(default_factory=lambda: Section("uniform"))
    # the server's reduction of the round's client updates (fedweave.robust): mean (the weighted mean), median,
    # trimmed_mean, krum, bulyan, geometric_median, centered_clipping, ...
    aggregator: Section = field(default_factory=lambda: Section("mean"))
    local: LocalConfig = field(default_factory=LocalConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)  # fedweave.compression
    # modules or .py files imported before the run is built: they register datasets, models, losses,
    # metrics, samplers or callbacks that the config names
    plugins: list[str] = field(default_factory=list)
    # differential privacy (fedweave.privacy, docs/privacy.md); null: none (and config.yaml leaves the key out)
    privacy: PrivacyConfig | None = None
    # secure aggregation's messages in the ledger (fedweave.privacy.secagg); null: none (config.yaml leaves it out)
    secure_aggregation: SecureAggregationConfig | None = None
    # registered run callbacks (fedweave.callbacks), each a name or {name: ..., options}: stop_at_target,
    # budget, or a plug-in's; called after the built-in ones
    callbacks: list[Section] = field(default_factory=list)

    def validate(self) -> None:
        """Check every top-level key and section (each section's own ``validate``); raise a
        :class:`ConfigError` naming the first bad key and what it allows."""
        check_run_name(self.name)
        if self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed}")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise ConfigError(f"rounds must be in [1, {MAX_ROUNDS:,}], got {self.rounds}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.threads is not None and not 1 <= self.threads <= max_threads():
            raise ConfigError(
                f"threads must be in [1, {max_threads()}] (this machine has {os.cpu_count()} CPUs) or null, "
                f"got {self.threads}"
            )
        if not isinstance(self.device, str) or not DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be one of auto, cpu, cuda, cuda:N or mps; got {self.device!r}")
        self.local.validate()
        self.eval.validate()
        self.output.validate()
        self.faults.validate()
        self.ray.validate()
        self.memory.validate()
        self.task.validate()
        self.compression.validate()
        if self.secure_aggregation is not None:
            self.secure_aggregation.validate()
        if self.privacy is not None:
            self.privacy.validate()
            # DP-FedAvg's sensitivity is that of the clipped sum, not of a median; DP-SGD (level: sample) privatizes
            # every local step at the client, and any reduction of its updates is post-processing
            if self.privacy.level == "user" and self.aggregator != Section("mean"):
                raise ConfigError(
                    f"aggregator: {self.aggregator.name} and privacy both decide how the server reduces the clients' "
                    "updates: DP-FedAvg's guarantee holds for the noised sum of clipped updates; leave one out"
                )
            if self.privacy.mechanism == "local" and self.faults.byzantine:
                # the attack stage replaces the decoded rows before the clipping-and-noise stage, which local DP runs
                # on each client's device: the attackers' messages would be held to a clip that they do not apply
                raise ConfigError(
                    "faults.byzantine: under privacy.mechanism: local each client clips and noises its own update, "
                    "which an attacker would not do, but the attack stage runs before the clipping and noise, so the "
                    "attackers' messages would be held to privacy.clip; use mechanism: central (the server clips "
                    "what every client sends) or leave faults.byzantine out"
                )

    @property
    def num_clients(self) -> int:
        """The ``num_clients`` option of the partition (0 when it is not set)."""
        return int(self.partition.options.get("num_clients", 0))

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict of plain values (what ``config.yaml`` holds and :func:`load` reads back)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Section):
                out[f.name] = v.to_dict()
            elif f.name == "callbacks":
                out[f.name] = [c.to_dict() for c in v]
            elif f.name in ("privacy", "secure_aggregation") and v is None:
                continue  # a run without privacy records the config it always has
            elif dataclasses.is_dataclass(v):
                out[f.name] = dataclasses.asdict(v)
                if f.name == "faults" and not v.sim_time:
                    # a run without the clock records the config it always has (and its checkpoints still resume)
                    del out[f.name]["sim_time"]
                if f.name == "faults" and v.work_unit == "round":  # the default unit: the same, for the same reason
                    del out[f.name]["work_unit"]
            else:
                out[f.name] = v
        return out

    def recorded(self) -> dict[str, Any]:
        """The config as a run records it (``config.yaml``, the checkpoint, a tracker's parameters): :meth:`to_dict`
        with each option that names an input file or data directory by its absolute path (:data:`FILE_OPTIONS`),
        so that ``fedweave run --resume RUN_DIR`` reads the same files from any working directory (a relative
        path means the directory the command ran in). The config itself keeps the paths as written, which its
        error messages name. Also what two configs are compared by where one of them was read back from a run."""
        out = self.to_dict()
        for section, names in FILE_OPTIONS.items():
            s = out[section]
            for option in names(s):
                value = s.get(option)
                if isinstance(value, str | os.PathLike) and str(value):  # (a bad value is validation's to name)
                    # as the readers take it ("~" expanded); absolute(), not resolve(): a link stays the link
                    s[option] = str(Path(value).expanduser().absolute())
        return out


def _dataset_files(s: dict[str, Any]) -> tuple[str, ...]:
    """The options of a built-in dataset that name files: ``root`` (a directory) and LIBSVM's ``path`` and
    ``test_path``, which are under root when it is given (then they stay as written, root carries the place). A
    plug-in's options mean what the plug-in says."""
    if s["name"] not in DATASETS or not getattr(DATASETS.get(s["name"]), "__module__", "").startswith("fedweave."):
        return ()
    return ("path", "test_path") if s["name"] == "libsvm" and s.get("root") is None else ("root",)


#: The options that name an input file, by section: a function of the section's recorded dict (name and
#: options) giving the keys to record by absolute path (:meth:`RunConfig.recorded`). ``plugins`` are recorded by
#: absolute path when the config is read (:func:`recorded`).
FILE_OPTIONS: dict[str, Callable[[dict[str, Any]], tuple[str, ...]]] = {
    "dataset": _dataset_files,
    "partition": lambda s: ("path",) if s["name"] == "from_file" else (),
    "model": lambda s: ("init_from",),  # read for every model (Algorithm.build_model)
    "algorithm": lambda s: ("edge_file",),  # the decentralized family's topology: edgelist
    "sampler": lambda s: ("file",) if s["name"] == "schedule" else (),
}


# ---- type checking --------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is typing.Literal:  # its values, which are what a user can write (not the type's name, Literal)
        return " or ".join(map(str, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; int->float and list->tuple are accepted."""
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None or isinstance(value, dict):
            return build_dataclass(tp, value, key)
        raise ConfigError(f"{key} must be a mapping of {tp.__name__} keys, got {value!r}")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and {int, float} <= set(typing.get_args(tp)):
            # a quoted number is the number its unquoted spelling is ("3" an int, "0.5" a float, as YAML reads
            # them): where an int and a float mean different things (secure_aggregation.num_shares: 3 shares,
            # 0.5 a fraction), the float branch made "3" a fraction 3.0
            with contextlib.suppress(ValueError):
                value = int(value)
        lists = []  # what a list value failed on as a list: the entry that is wrong, e.g. "algorithm.edges[0]"
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                if isinstance(value, (list, tuple)) and (typing.get_origin(arg) or arg) in (list, tuple):
                    lists.append(e)
        if len(lists) == 1:  # else "must be a list or null" would be said of a list
            raise lists[0]
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} must be null, got {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],)
        item_tp = args[0] if len(args) == 1 else Any
        items = [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # every spelling float() accepts, e.g. a quoted "1e-3"
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if typing.get_origin(tp) is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key} must be one of {list(typing.get_args(tp))}, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")


def _check_finite(value: Any, default: Any, key: str, infinite: int | None = None) -> Any:
    """NaN is never a setting, and +-inf only where the default is infinite, or, for a dataclass field whose
    metadata ``infinite`` is +1 or -1, that one infinity (a bound that may be left open: a box's ``box_low``
    -inf, ``box_high`` +inf): anything else would pass validation and surface later as a diverged run blamed
    on the learning rate."""
    if not isinstance(value, float) or math.isfinite(value):
        return value
    if math.isnan(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if infinite is not None:
        if value == infinite * math.inf:
            return value
        raise ConfigError(f"{key} must be a finite number or {'-' if infinite < 0 else ''}inf, got {value}")
    if not (isinstance(default, float) and math.isinf(default)):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    return value


def _unknown(key: str, bad: Any, allowed: list[str], name: str | None = None) -> ConfigError:
    close = difflib.get_close_matches(bad, allowed, n=1) if isinstance(bad, str) else []
    hint = f" Did you mean {close[0]!r}?" if close else ""
    prefix = f"{key}." if key else ""
    shown = repr(f"{prefix}{bad}")  # repr: a key with control characters stays visible and on one line
    if not allowed:
        owner = f"{key} {name!r}" if name else key or "the config"  # the chosen entry of a registry, when known
        return ConfigError(f"unknown key {shown}: {owner} takes no options")
    return ConfigError(f"unknown key {shown}.{hint} Allowed: {', '.join(sorted(map(str, allowed)))}")


def build_dataclass(cls: type, data: dict[str, Any] | None, key: str, name: str | None = None) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, checking names and types; errors name ``key.field`` (and
    ``name``, the registered object's name, where ``cls`` has no option at all).

    A subclass of a dataclass that declares fields but is not decorated itself (a plug-in's ``Hparams``) is a
    TypeError naming them: its fields would otherwise be unknown keys, and their defaults used silently."""
    undecorated = [n for n in inspect.get_annotations(cls) if "__dataclass_fields__" not in vars(cls)]
    if undecorated:
        raise TypeError(
            f"{cls.__qualname__} declares {', '.join(undecorated)} but is not a dataclass: decorate it with "
            "@dataclass (a subclass of a dataclass needs its own)"
        )
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for k in data:
        if k not in names:
            raise _unknown(key, k, names, name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        where = f"{key}.{k}" if key else k
        f = fields.get(k)
        default, infinite = (f.default, f.metadata.get("infinite")) if f is not None else (None, None)
        kwargs[k] = _check_finite(coerce(v, hints[k], where), default, where, infinite)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{key}: {e}") from e
    return obj


def check_options(
    fn: Any, options: dict[str, Any], key: str, skip: tuple[str, ...] = (), name: str | None = None
) -> dict[str, Any]:
    """Check ``options`` against the keyword parameters of callable ``fn`` (names and annotated types), leaving
    out the parameters in ``skip`` (those the caller passes itself); returns the options with their values
    coerced. A bad one raises a :class:`ConfigError` naming ``key.option`` and what is allowed (``name``: the
    registered name of ``fn``, which that line names where ``fn`` takes no options)."""
    sig = inspect.signature(fn)
    params = {
        n: p for n, p in sig.parameters.items() if n not in skip and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    try:
        # a class's options are its __init__ parameters: get_type_hints(cls) would give the class attributes'
        # annotations instead, and the options would go unchecked
        hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    out = {}
    for k, v in options.items():
        if k in skip and k != "self":
            # the caller passes it itself: through a builder's **options it would arrive twice, a bare TypeError
            owner = f"{key} {name!r}" if name else key
            raise ConfigError(f"{key}.{k} is not an option: the run passes it to {owner} itself; leave it out")
        if k not in params:
            if takes_any:
                out[k] = v
                continue
            raise _unknown(key, k, list(params), name)
        out[k] = _check_finite(coerce(v, hints.get(k, Any), f"{key}.{k}"), params[k].default, f"{key}.{k}")
    return out


def _section(data: Any, key: str) -> Section:
    if isinstance(data, str):
        return Section(data)
    if isinstance(data, dict) and data and "name" not in data:
        # typically a key=value override of a section the file leaves out: the override alone names nothing
        default = getattr(RunConfig(), key, None) if key in SECTION_KEYS else None
        eg = f", e.g. {key}.name={default.name} (the default when the section is left out)" if default else ""
        raise ConfigError(f"{key} has options but no name ({data!r}): give {key}.name too{eg}")
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(f"{key} must be a mapping with a 'name' key (or just the name), got {data!r}")
    opts = dict(data)
    for k in opts:
        if not isinstance(k, str):
            raise ConfigError(f"{key}: option names must be strings, got {k!r}")
    name = opts.pop("name")
    if not isinstance(name, str):
        raise ConfigError(f"{key}.name must be a string, got {name!r}")
    return Section(name, opts)


SECTION_KEYS = ("dataset", "partition", "model", "algorithm", "sampler", "aggregator")


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from plain data (e.g. parsed YAML)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(data).__name__}")
    data = dict(data)
    if "sweep" in data:  # `fedweave sweep` takes this section off before it builds each point's config
        raise ConfigError(
            "sweep: a config's sweep section is read by 'fedweave sweep CONFIG', which runs its grid; a single run "
            "('fedweave run', fedweave.run) takes the config without it"
        )
    # a section given as null (`sampler:` in a file, `sampler=null` or `sampler=` on the command line) is the
    # section left out, its default, as `local: null` and the other unnamed sections are: the command line's
    # one way to undo a file's section
    given = {k: data.pop(k) for k in SECTION_KEYS if k in data}
    sections = {k: _section(v, k) for k, v in given.items() if v is not None}
    callbacks = data.pop("callbacks", None) or []
    if not isinstance(callbacks, list):
        raise ConfigError(f"callbacks must be a list of callback names or {{name: ..., options}}, got {callbacks!r}")
    privacy = data.pop("privacy", None)
    secure = data.pop("secure_aggregation", None)
    cfg = build_dataclass(RunConfig, data, "")
    if secure is not None:  # built on its own, so that an error names its key (secure_aggregation.num_shares)
        cfg.secure_aggregation = coerce(secure, SecureAggregationConfig, "secure_aggregation")
    if privacy is not None:  # privacy: built on its own, so that an error names its key (privacy.clip)
        cfg.privacy = coerce(privacy, PrivacyConfig, "privacy")
    for k, s in sections.items():
        setattr(cfg, k, s)
    cfg.callbacks = [_section(c, f"callbacks[{i}]") for i, c in enumerate(callbacks)]
    if cfg.plugins:  # before validation: a plug-in may register the loss or metric the config names
        load_plugins(cfg.plugins)
        cfg.plugins = [recorded(p) for p in cfg.plugins]  # files by absolute path: resumable from anywhere
    cfg.validate()
    return cfg


# ---- plug-ins: modules or .py files that register datasets, models, losses, metrics, samplers or callbacks,
# so that a config (``plugins:``) and the command line (``fedweave run --plugin``) can name them ------------
_LOADED: dict[str, str] = {}  # a file's absolute path, or a module name -> the module name it was imported as


def load_plugin(spec: str) -> str:
    """Import ``spec``: a path to a ``.py`` file, or a module name on the path. Imported once per process."""
    is_file = spec.endswith(".py") or "/" in spec
    # a file is known by its absolute path: `plug.py` in another working directory is another plug-in
    key = str(Path(spec).expanduser().resolve()) if is_file else spec
    if key in _LOADED:
        return _LOADED[key]
    if is_file:
        path = Path(key)
        if not path.is_file():
            raise ConfigError(f"plugins: {spec!r} is not a file (give a .py file or an importable module name)")
        name = f"fedweave_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"plugins: {spec!r} cannot be imported as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # a plug-in's sys.exit() must not end the run without a word
            del sys.modules[name]
            raise ConfigError(f"plugins: importing {spec!r} failed ({_one_line(e)})") from e
    else:
        name = spec
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as e:
            if e.name is None or not spec.startswith(e.name):  # a module the plug-in itself imports is missing
                raise ConfigError(f"plugins: importing {spec!r} failed ({_one_line(e)})") from e
            raise ConfigError(f"plugins: no module {spec!r} ({e}); give a .py file or an importable module") from e
        except (Exception, SystemExit) as e:
            raise ConfigError(f"plugins: importing {spec!r} failed ({_one_line(e)})") from e
    _LOADED[key] = name
    return name


def _one_line(e: BaseException) -> str:
    """What a plug-in raised while importing, on one line (``SystemExit: 3``)."""
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_plugins(specs: list[str]) -> None:
    """Import each plug-in (see :func:`load_plugin`); a failing one is a ConfigError naming it."""
    for spec in specs:
        load_plugin(spec)


def recorded(spec: str) -> str:
    """How a run's config records a plug-in: a ``.py`` file by its absolute path (a relative path means the
    working directory of the command, which a resume from elsewhere would not share), a module by its name."""
    if spec.endswith(".py") or "/" in spec:
        return str(Path(spec).expanduser().resolve())
    return spec


def nearest_count(fraction: float, n: int) -> int:
    """``fraction * n`` to the nearest whole number, halves up: ``floor(fraction * n + 1/2)`` (Python's round
    takes halves to the even number: 0.25 of 10 clients 2, 0.35 of 10 clients 4). The 1e-9 keeps a half
    written in decimal a half (0.07 * 50 is 3.5000000000000004, 0.35 * 10 3.4999999999999996)."""
    return math.floor(fraction * n + 0.5 + 1e-9)


def positive_int(text: str) -> int:
    """An argparse type for a count given on a command line (seeds, workers, rounds): a whole number >= 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def positive_minutes(text: str) -> float:
    """An argparse type for a time budget in minutes: a finite number >= 0 (0: start no run)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes >= 0")
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split one ``key=value`` override (``"local.lr=0.1"``) into its dotted key path and its value, read
    as YAML (``1e-3`` a number, ``[1, 2]`` a list, an empty value None). A malformed one raises a
    :class:`ConfigError` that quotes it."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. local.lr=0.1)")
    key, raw = text.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    shown = repr(text) if len(text) <= 80 else repr(text[:60]) + f"... ({len(text):,} characters)"
    try:
        value = yaml_load(raw) if raw != "" else None
    except ConfigError as e:
        raise ConfigError(f"override {shown}: the value of {key}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"override {shown}: the value of {key} is not valid YAML ({_yaml_problem(e)})") from e
    return key.split("."), value


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


_NAMED_KEYS = (["compression", "upload"], ["compression", "download"])  # a name, or {name: ..., options}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML scalars/lists) to nested plain data."""
    if overrides and not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(data).__name__}")
    data = _deepcopy(data)
    given: dict[str, str] = {}  # each key's override: a second one is refused, as a key twice in a YAML file is
    for text in overrides:
        path, value = parse_override(text)
        key = ".".join(path)
        if key in given:
            raise ConfigError(
                f"override key {key!r} is given twice ({given[key]!r}, then {text!r}): give each key once"
            )
        given[key] = text
        node = data
        for i, p in enumerate(path[:-1]):
            cur = node.get(p)
            # `model: cnn` shorthand, and `compression: {upload: efsign}`'s, which a mapping with a name may replace
            if isinstance(cur, str) and (p in SECTION_KEYS or path[: i + 1] in _NAMED_KEYS):
                cur = node[p] = {"name": cur}
            if cur is None:
                cur = node[p] = {}
            if not isinstance(cur, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(path[: i + 1])}' is not a section")
            node = cur
        node[path[-1]] = value
    return data


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


EXAMPLES = Path(__file__).parent / "configs"  # the example configs, shipped inside the package
EXAMPLE_PREFIX = "example:"


def examples() -> list[str]:
    """Names of the bundled example configs, e.g. ``demo`` or ``centralized/fedmim`` (``example:NAME``)."""
    return sorted(str(p.relative_to(EXAMPLES).with_suffix("")) for p in EXAMPLES.rglob("*.yaml"))


def example_path(name: str) -> Path:
    """The file of a bundled example config (``example:demo``), or a ConfigError listing them."""
    path = EXAMPLES / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise ConfigError(f"no example config {name!r}; examples: {', '.join(examples())}")
    return path


def read_yaml_file(source: str | Path) -> Any:
    """The data of a YAML config file or a bundled example (``"example:demo"``), read with the config loader
    (duplicate keys, deep nesting and alias bombs refused); every problem is one ConfigError naming the file."""
    if isinstance(source, str) and source.startswith(EXAMPLE_PREFIX):
        source = example_path(source[len(EXAMPLE_PREFIX) :])
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} is not a regular file (a device or pipe); give a YAML file")
    try:
        return yaml_load(path.read_text(encoding="utf-8"))
    except PermissionError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from e
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from e


def load(source: str | Path | dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Load a config from a YAML file, a bundled example (``"example:demo"``) or plain data, apply
    overrides, validate.

    ``overrides`` are ``key=value`` strings (``"local.lr=0.1"``, :func:`parse_override`) applied on top of
    the source. Returns the validated :class:`RunConfig`; a missing or unreadable file, bad YAML, an unknown
    key or a bad value raises one :class:`ConfigError` whose one-line message names the file or key."""
    if not isinstance(source, str | Path | dict):
        raise ConfigError(f"a config is a YAML file's path, 'example:NAME' or a dict; got {type(source).__name__}")
    if overrides is not None and not isinstance(overrides, list | tuple):  # a string would be read letter by letter
        got = repr(overrides) if isinstance(overrides, str) else type(overrides).__name__
        raise ConfigError(f"overrides must be a list of key=value strings, e.g. ['local.lr=0.1']; got {got}")
    if isinstance(source, dict):
        data = source
    else:
        data = read_yaml_file(source)
        if data is None:  # an empty file (or comments only): the wrong file, not a request for every default
            raise ConfigError(f"{source}: the config file holds no key (it is empty); give a config's keys")
    return from_dict(apply_overrides(data, overrides or []))
