"""One local-training call as a typed record, the rules that change its update, and the backends that run
it (DESIGN principle 19: client code sees a job, not a closure).

A :class:`LocalCall` is what every backend's ``run(trainer, call)`` takes and what the ``pool`` and ``ray``
backends and the deployment send: the jobs' start rows and clients, the batch plan's coordinates (round,
steps, key: the named seed streams ``("batches", round, client, *key)`` give each job's batches), the local
rule with its per-job state, and the learning rate. A :class:`LocalRule` sees one local step through a
:class:`StepGradient`, whose batch is declared, not attached to a closure.

This module imports no backend: each backend registers its ``run`` here with :func:`backend`, and
:func:`backend_run` imports a backend's module by name on first use, so the backends, the trainer
(``execution.local``) and the shards of a call form no import cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedweave.registry import RULES

if TYPE_CHECKING:
    from fedweave.execution.params import ParamLayout

# grad(w): the gradient of the step's batch loss at w; grad(w, j): of its draw j (LocalRule.draws)
GradFn = Callable[..., torch.Tensor]
LR = float | Callable[[int], float]  # a constant, or the step size of local step t (t = 0, 1, ... per call)
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # features, labels, validity mask (None: all)


class StepGradient:
    """The gradient oracle of one local step, as a rule's :meth:`LocalRule.direction` receives it: call it
    with parameters ``w`` for the gradient of the step's batch loss at ``w``, and with ``(w, j)`` for the
    gradient on the step's independent draw ``j`` (``j < rule.draws``; draw 0 is the step's batch). Rules
    that need the samples themselves (per-sample gradients, DP-SGD) read :attr:`batch` (features, labels
    and, on the vmap backend, the validity mask of padded rows; :attr:`batches` holds one per draw) and pass
    the mean loss they computed to :meth:`report`, in place of calling the oracle."""

    __slots__ = ("fn", "batches", "report")

    def __init__(
        self, fn: Callable[[torch.Tensor, int], torch.Tensor], batches: Sequence[Batch], report: Callable[..., Any]
    ) -> None:
        self.fn, self.batches, self.report = fn, tuple(batches), report

    @property
    def batch(self) -> Batch:
        """The step's batch (draw 0)."""
        return self.batches[0]

    def __call__(self, w: torch.Tensor, draw: int = 0) -> torch.Tensor:
        if not 0 <= draw < len(self.batches):
            raise ValueError(
                f"a local rule asked for the gradient on draw {draw} of a step that drew {len(self.batches)} "
                f"batch(es): set the rule's draws to the independent batches its step uses (LocalRule.draws)"
            )
        return self.fn(w, draw)


def draw_stream(name: str, draw: int) -> str:
    """The name of the stream of a step's draw ``draw``: ``name`` itself for draw 0 (the batches every rule
    sees, the same as before rules could draw more), ``name/j`` for further draw ``j``, under the same keys
    ``(round, client, *key)``: a stream of its own, so no draw shares a stream with any call's batches."""
    return name if draw == 0 else f"{name}/{draw}"


@RULES.register("plain")
class LocalRule:
    """The plain local SGD rule: the direction is the stochastic gradient. Subclass to change it.

    A rule is written once with broadcasting: it is called with ``w`` of shape ``(P,)`` and ``jobs`` an int
    on the loop backend, and with ``w`` of shape ``(K, P)`` and ``jobs`` a ``LongTensor`` of job positions
    on the vmap backend. A rule that a deployment sends is registered by name at its definition
    (``@fedweave.registry.RULES.register(name)``); its state is its attributes (tensors and scalars)."""

    #: the independent batches each local step draws: the step's oracle ``grad(w, j)`` is the gradient on
    #: draw ``j`` (``j < draws``), ``grad(w)`` on draw 0, the step's batch. Draw ``j`` is a batch plan of its
    #: own, cut as draw 0's (same steps and sizes) from the stream ``("batches/j", round, client, *key)``
    #: (:func:`draw_stream`), augmented from ``("augment/j", ...)``; draw 0 and its streams are every rule's.
    #: Per-FedAvg's MAML step uses 2 (Alg. 1's D and D') or 3 (and D'' for the Hessian-vector product).
    draws: int = 1

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        """The step direction at parameters ``w``: ``grad(w)``, the stochastic gradient of the step's batch.

        ``jobs``: the position in the call of the job ``w`` belongs to (an int on the loop backend), or of each
        row of ``w`` (a tensor, when jobs are batched), so that a subclass can index per-job tensors (SCAFFOLD's
        control variates). The trainer's optimizer step (:meth:`LocalTrainer.sgd_update`) follows it, then
        :meth:`project`."""
        return grad(w)

    def project(self, w: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
        """Projection onto a constraint set after each step (identity by default)."""
        return w

    def extra_loss(
        self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, jobs: int | torch.Tensor, model: ParamLayout
    ) -> torch.Tensor | None:
        """A term added to each sample's task loss, ``(B,)``, at the parameters ``w`` ``(P,)`` of one job on
        its step's batch ``x`` ``(B, ...)``, ``y`` ``(B,)``; None (the default): the loss is the task's alone.

        Unlike :meth:`direction`, it is written for one job: the loop backend calls it per job (``jobs`` an
        int), the vmap backend under ``torch.func.vmap`` over the jobs (``jobs`` a 0-d tensor), so
        ``per_job(table, jobs)`` gives the job's row of a ``(K, P)`` table either way. ``model`` computes
        the run's model as functions of a flat vector: ``model.features(v, x)``, ``model.head(v, z)``,
        ``model.functional(v, x)``, for ``w`` and for any other vector the rule holds (the global model, the
        client's previous one). The trainer adds the gradient of the term's mean over the batch's real rows
        to the task gradient that :meth:`direction`'s oracle returns (and its mean to the reported loss), the
        term computed in the parameters' dtype (not autocast under ``precision: bf16-mixed``); a rule that
        does not override this method keeps every backend's usual path, fast kernels included."""
        return None

    def loss(
        self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, jobs: int | torch.Tensor, model: ParamLayout
    ) -> torch.Tensor | None:
        """Each sample's loss, ``(B,)``, in place of the task's (FedLC's calibrated cross-entropy); None (the
        default): the task's. Written and called as :meth:`extra_loss` (one job; under ``torch.func.vmap`` on the
        vmap backend), but computed as the task's loss is: autocast under ``precision: bf16-mixed`` (the
        forward passes in bfloat16), then reduced in the parameters' dtype. The task loss is then not computed
        at all, and :meth:`extra_loss`'s term, if any, is added to this one.

        A loss that differs from the task's in some terms belongs here rather than in an :meth:`extra_loss` that
        subtracts the task's: the gradients of the task loss and of that term cancel only to rounding where
        their true sum is 0 (FedLC's classes a client does not hold), and what is left is noise whose sign
        depends on the backend's order of operations, which a sign compressor turns into full-size steps."""
        return None

    #: attributes each client derives from its own data (FedLC's label margins): a deployment does not send
    #: them, and the node derives them with :meth:`at_client`
    client_derived: tuple[str, ...] = ()

    def at_client(self, y: torch.Tensor, num_classes: int) -> LocalRule:
        """The rule of a one-job call with its :attr:`client_derived` attributes derived from the client's own
        training targets ``y`` (a deployed node's, where the data are); the rule itself by default."""
        return self


PLAIN = LocalRule()


def plain_rule(rule: LocalRule) -> bool:
    """True when ``rule`` changes neither the direction, the projection nor the loss and draws one batch a
    step (FedAvg's local step): it does not depend on the job, and the loop backend may take its fast paths."""
    cls = type(rule)
    return (
        cls.direction is LocalRule.direction
        and cls.project is LocalRule.project
        and cls.extra_loss is LocalRule.extra_loss
        and cls.loss is LocalRule.loss
        and rule.draws == 1
    )


def _unwrapped(rule: LocalRule) -> type:
    while isinstance(rule, Reindexed):
        rule = rule.rule
    return type(rule)


def uses_loss(rule: LocalRule) -> bool:
    """True when ``rule`` (or the rule a :class:`Reindexed` wraps) adds a term to the loss
    (:meth:`LocalRule.extra_loss`): the backends then add its gradient to the task gradient."""
    return _unwrapped(rule).extra_loss is not LocalRule.extra_loss


def own_loss(rule: LocalRule) -> bool:
    """True when ``rule`` (or the rule a :class:`Reindexed` wraps) trains on a loss of its own in place of the
    task's (:meth:`LocalRule.loss`): the backends then take its gradient and never compute the task's."""
    return _unwrapped(rule).loss is not LocalRule.loss


def _valid_mean(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over the real rows, as ``fedweave.tasks.Loss`` reduces the task loss."""
    if mask is None:
        return losses.mean()
    m = mask.to(losses.dtype)
    return (losses * m).sum() / m.sum().clamp_min(1.0)


def rule_loss_grad(
    rule: LocalRule,
    model: ParamLayout,
    w: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    jobs: int | torch.Tensor,
    hook: str = "extra_loss",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient and value of the mean of ``rule``'s per-sample loss ``hook`` (:meth:`~LocalRule.extra_loss`,
    or :meth:`~LocalRule.loss` plus its extra term if it has one) over a step's real rows: for one job (``w``
    ``(P,)``, ``jobs`` an int, ``mask`` None) or, batched with ``torch.func.vmap``, for the jobs of rows ``w``
    ``(K, P)`` with batches ``x`` ``(K, B, ...)``, masks ``(K, B)`` and positions ``jobs`` ``(K,)``."""
    while isinstance(rule, Reindexed):  # map the positions here, outside the vmap
        jobs, rule = rule._map(jobs), rule.rule
    hooks = [hook] + (["extra_loss"] if hook == "loss" and uses_loss(rule) else [])

    def one_term(name, v, xb, yb, job):
        if name == "loss":  # in place of the task's loss: computed as that is (autocast under bf16-mixed)
            with model.placement.autocast():
                term = rule.loss(v, xb, yb, job, model)
        else:
            term = rule.extra_loss(v, xb, yb, job, model)
        if not isinstance(term, torch.Tensor) or term.shape != xb.shape[:1]:
            # a scalar or a (B, D) term would be averaged otherwise on one backend and fail on the other
            got = f"shape {tuple(term.shape)}" if isinstance(term, torch.Tensor) else type(term).__name__
            raise ValueError(
                f"{type(rule).__name__}.{name} must return one term per sample, shape ({xb.shape[0]},), got {got}"
            )
        return term.to(v.dtype)

    def mean_term(v, xb, yb, mb, job):
        terms = [one_term(name, v, xb, yb, job) for name in hooks]
        return _valid_mean(terms[0] if len(terms) == 1 else terms[0] + terms[1], mb)

    one = torch.func.grad_and_value(mean_term)
    if w.dim() == 1:
        return one(w, x, y, mask, jobs)
    return torch.func.vmap(one)(w, x, y, mask, jobs)


class Reindexed(LocalRule):
    """``rule`` seen from a call that runs some of its jobs: job k of this call is job ``positions[k]`` of
    the call the rule's per-job tensors were made for (a shard of a pool or Ray call; the clients of a round
    that did not drop out)."""

    def __init__(self, rule: LocalRule, positions: torch.Tensor) -> None:
        self.rule, self.positions = rule, positions

    @property
    def draws(self) -> int:  # the wrapped rule's: its steps draw the batches it asks for
        return self.rule.draws

    def _map(self, jobs: int | torch.Tensor) -> int | torch.Tensor:
        if isinstance(jobs, int):
            return int(self.positions[jobs])  # a host tensor: no device round trip
        if self.positions.device != jobs.device:  # batched jobs index per-job tables where those live
            self.device_positions = getattr(self, "device_positions", None)
            if self.device_positions is None or self.device_positions.device != jobs.device:
                self.device_positions = self.positions.to(jobs.device)
            return self.device_positions[jobs]
        return self.positions[jobs]

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        return self.rule.direction(w, grad, self._map(jobs))

    def project(self, w: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
        return self.rule.project(w, self._map(jobs))

    def extra_loss(self, w, x, y, jobs, model):
        return self.rule.extra_loss(w, x, y, self._map(jobs), model)

    def loss(self, w, x, y, jobs, model):
        return self.rule.loss(w, x, y, self._map(jobs), model)


def reindexed(rule: LocalRule, positions: Sequence[int] | torch.Tensor) -> LocalRule:
    """``rule`` for a call of the jobs at ``positions`` of the original call; the rule itself when it does
    not depend on the job (so the plain-SGD fast path stays available)."""
    if plain_rule(rule):
        return rule
    return Reindexed(rule, torch.as_tensor(np.asarray(positions), dtype=torch.long, device="cpu"))


@dataclass
class LocalCall:
    """One local-training call: job ``k`` trains client ``clients[k]`` from ``starts[k]`` with ``rule``.

    ``starts`` is ``(K, P)``, or one ``(P,)`` row shared by every job of a shard sent to a worker. The
    batch plan of a job is drawn from the named streams of ``(round, client, *key)`` with ``steps`` local
    steps (``None``: the configured epochs or steps), so any process that holds the training data draws the
    same batches. ``offset`` is the position of job 0 in the call the rule's per-job tensors were made for
    (non-zero for a shard of a pool or Ray call)."""

    starts: torch.Tensor
    clients: list[int]
    round: int
    rule: LocalRule
    lr: LR
    steps: int | None
    key: tuple[int, ...]
    offset: int = 0

    def __len__(self) -> int:
        return len(self.clients)

    def shard(self, lo: int, hi: int) -> LocalCall:
        """Jobs ``lo .. hi - 1`` of this call; a shared start (an expanded tensor) stays one row, so a
        worker is sent only that row."""
        shared = self.starts.dim() == 2 and self.starts.stride(0) == 0
        starts = self.starts[lo] if shared else self.starts[lo:hi]
        return replace(self, starts=starts, clients=self.clients[lo:hi], offset=self.offset + lo)


@dataclass
class LocalResult:
    """What a call returns, on the trainer's device."""

    params: torch.Tensor  #: (K, P) final local parameters
    steps: torch.Tensor  #: (K,) local steps taken
    loss: torch.Tensor  #: (K,) mean training loss over the steps
    #: (K,) each job's task loss of its start model on its client's whole data (the run's dtype), where the
    #: client computed it (a deployed node asked for it: AFL's L_k(w_t), q-FFL's F_k(w^t)); None: not asked for
    start_loss: torch.Tensor | None = None

    def trained_loss(self, weights: torch.Tensor | None = None) -> float:
        """The round's ``train_loss``: the jobs' losses averaged (with ``weights``, else plainly) over those that
        trained. A client without samples (``partition.min_size: 0``) takes no step and reports 0, which would
        only shrink the mean (``clients_with_data``); a dropped one has none. Where every job trained (or none
        did) the mean is taken as it always was: the same bits."""
        idle = self.steps == 0
        some = bool(idle.any()) and not bool(idle.all())
        if weights is None:
            return float((self.loss[~idle] if some else self.loss).mean())
        if some and bool((weights[idle] != 0).any()):
            weights = torch.where(idle, torch.zeros_like(weights), weights)
            weights = weights / weights.sum()
        return float(weights @ self.loss)


def summed_losses(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of a job's per-step losses (0-d tensors) in float64, added one after another (a cumulative
    sum: the same bits as adding them up as Python floats), without a round trip to the host."""
    wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    if not losses:
        return torch.zeros((), dtype=wide, device=device)
    return torch.stack(losses).to(wide).cumsum(0)[-1]


class ClientStep:
    """The client's side of a round of an algorithm whose clients keep state of their own (SCAFFOLD's
    ``c_i``, FedDyn's local gradient): from the client's state rows and what the server sent, the local
    rule; after local training, what the client uploads and its new state.

    Written once per algorithm with a leading job axis, it runs for a whole call at once over the run's
    ``StateStore`` in simulation (``LocalTrainer.train_with_state``), and for one job on the node that
    keeps the client's state in a deployment (``fedweave.deploy``), so the state never travels. Its
    attributes are what the server sends (tensors shared by the call's jobs, and scalars); a step that a
    deployment sends is registered by name (``@fedweave.registry.CLIENT_STEPS.register(name)``).
    """

    state: tuple[str, ...] = ()  #: the per-client state rows, each of the model's size, zero at the start
    #: the names of its upload, each of the model's size (empty: it sends its model); under secure aggregation
    #: a node masks them as one vector and the server splits their mean by these names
    uploads: tuple[str, ...] = ()

    def rule(self, state: dict[str, torch.Tensor]) -> LocalRule:
        """The local rule of jobs whose state rows are ``state[name]`` (shape ``(K, P)``)."""
        raise NotImplementedError

    def finish(
        self, state: dict[str, torch.Tensor], start: torch.Tensor, result: LocalResult
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(upload, new_state)`` of the jobs, each tensor ``(K, ...)``, from their state, start vector(s)
        and local result. An empty ``upload`` means the client sends its local model."""
        raise NotImplementedError

    def local_model(self, start: torch.Tensor, upload: dict[str, torch.Tensor]) -> torch.Tensor:
        """The local models as the server can rebuild them from an upload that is not the model (for
        metrics only)."""
        raise NotImplementedError


# ---- backends ------------------------------------------------------------------------------------------
Run = Callable[[Any, LocalCall], LocalResult]  # (LocalTrainer, call) -> result
BACKENDS = ("loop", "vmap", "ray", "pool")  # each is the module fedweave.execution.<name>
_RUNS: dict[str, Run] = {}


def backend(name: str) -> Callable[[Run], Run]:
    """Register a backend's ``run(trainer, call)`` under ``name`` (at its definition)."""

    def deco(run: Run) -> Run:
        _RUNS[name] = run
        return run

    return deco


def backend_run(name: str) -> Run:
    """The registered ``run`` of backend ``name``, importing its module on first use (by name, so this
    module and the trainer import no backend)."""
    if name not in _RUNS:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; allowed: {', '.join(BACKENDS)}")
        importlib.import_module(f"fedweave.execution.{name}")
    return _RUNS[name]
