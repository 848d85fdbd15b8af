"""Local training of many clients with one semantics on every backend (DESIGN principle 4).

A *job* is one client's local work in a round: start parameters, the client's data, a number of SGD steps.
The batch sequence of a job comes from the named stream ``("batches", round, client, *key)`` and its
augmentation from ``("augment", round, client, *key)``, so the ``loop`` and ``vmap`` backends see exactly
the same samples in the same order.

Algorithms change the local update through a :class:`LocalRule`: it maps the current iterate and a gradient
oracle to the direction the optimizer applies (FedProx adds a proximal term, SCAFFOLD a control variate,
FedSAM evaluates the gradient at a perturbed point, ...). A rule is written once with broadcasting: it is
called with ``w`` of shape ``(P,)`` and ``jobs`` an int on the loop backend, and with ``w`` of shape
``(K, P)`` and ``jobs`` a ``LongTensor`` of job positions on the vmap backend.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedweave.config import ConfigError, LocalConfig, RayConfig
from fedweave.execution.params import ParamLayout
from fedweave.execution.placement import CPU, Placement
from fedweave.execution.state import StateStore
from fedweave.seeding import Seeds
from fedweave.tasks import Loss, cross_entropy  # noqa: F401  (cross_entropy: the default loss, re-exported)

log = logging.getLogger("fedweave")
GradFn = Callable[[torch.Tensor], torch.Tensor]
LR = float | Callable[[int], float]  # a constant, or the step size of local step t (t = 0, 1, ... per call)
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


class LocalRule:
    """The plain local SGD rule: the direction is the stochastic gradient. Subclass to change it."""

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


PLAIN = LocalRule()


def plain_rule(rule: LocalRule) -> bool:
    """True when ``rule`` changes neither the direction nor the projection (FedAvg's local step): it does
    not depend on the job, and the loop backend may take its fast paths."""
    cls = type(rule)
    return cls.direction is LocalRule.direction and cls.project is LocalRule.project


class Reindexed(LocalRule):
    """``rule`` seen from a call that runs some of its jobs: job k of this call is job ``positions[k]`` of
    the call the rule's per-job tensors were made for (a shard of a pool or Ray call; the clients of a round
    that did not drop out)."""

    def __init__(self, rule: LocalRule, positions: torch.Tensor) -> None:
        self.rule, self.positions = rule, positions

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


def reindexed(rule: LocalRule, positions: Sequence[int] | torch.Tensor) -> LocalRule:
    """``rule`` for a call of the jobs at ``positions`` of the original call; the rule itself when it does
    not depend on the job (so the plain-SGD fast path stays available)."""
    if plain_rule(rule):
        return rule
    return Reindexed(rule, torch.as_tensor(np.asarray(positions), dtype=torch.long, device="cpu"))


@dataclass
class LocalResult:
    """What a call returns, on the trainer's device."""

    params: torch.Tensor  #: (K, P) final local parameters
    steps: torch.Tensor  #: (K,) local steps taken
    loss: torch.Tensor  #: (K,) mean training loss over the steps


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
    ``StateStore`` in simulation (:meth:`LocalTrainer.train_with_state`), and for one job on the node that
    keeps the client's state in a deployment (``fedweave.deploy``), so the state never travels. Its
    attributes are what the server sends (tensors shared by the call's jobs, and scalars).
    """

    state: tuple[str, ...] = ()  #: the per-client state rows, each of the model's size, zero at the start

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


@dataclass
class Batches:
    """The batch plan of K jobs: per step, sample indices (into the training set) and a validity mask.
    Drawn on the CPU from the named streams (the same plan on every device), moved where it is used."""

    index: torch.Tensor  # (T, K, B) int64
    mask: torch.Tensor  # (T, K, B) bool
    steps: torch.Tensor  # (K,) int64, the number of real steps of each job


class LocalTrainer:
    """Runs local SGD for batches of jobs on the ``loop``, ``vmap``, ``ray`` or ``pool`` backend, on the
    device of its ``placement`` (the model must already be there): the training data are placed once
    (:meth:`Placement.data`), batches are gathered by index where the data live.

    ``model`` is the template the flat parameter vectors are loaded into; ``train_x``/``train_y`` the
    training set and ``parts`` each client's indices into it; ``local`` the ``local`` config section (steps,
    batch size, learning rate and its schedule, momentum, weight decay, clipping) and ``seeds`` the run's
    streams (batches and augmentation are drawn from them). ``augment`` transforms a batch, ``vmap_chunk``
    caps the jobs the vmap backend batches at once (default: what the placement's memory allows),
    ``rounds`` is the run's length (the cosine schedule), ``ray`` the Ray backend's cluster, ``loss_fn`` the
    task's loss. :func:`fedweave.algorithms.base.make_trainer` builds a run's trainer from its context.
    """

    def __init__(
        self,
        model: nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        parts: Sequence[np.ndarray],
        local: LocalConfig,
        seeds: Seeds,
        *,
        backend: str = "loop",
        augment: Augment | None = None,
        vmap_chunk: int | None = None,
        rounds: int | None = None,
        ray: RayConfig | None = None,
        loss_fn: Loss = cross_entropy,
        placement: Placement = CPU,
    ) -> None:
        if backend not in ("loop", "vmap", "ray", "pool"):
            raise ValueError(f"backend must be 'loop', 'vmap', 'ray' or 'pool' here, got {backend!r}")
        if backend == "pool" and not placement.on_cpu:
            raise ConfigError(
                f"backend: pool forks CPU worker processes and cannot compute on device {placement.device}; "
                "choose backend loop, vmap, ray or auto (or device: cpu)"
            )
        self.placement = placement
        self.layout = ParamLayout(model, placement)
        self.host_x, self.host_y = train_x, train_y  # as given (the ray backend's object store reads these)
        self.train_x, self.train_y = placement.data(train_x), placement.data(train_y)
        # sample indices stay on the CPU: the batch plans are drawn there (the same on every device)
        self.parts = [torch.as_tensor(np.asarray(p), dtype=torch.long, device="cpu") for p in parts]
        self.local = local
        self.seeds = seeds
        self.backend = backend
        self.augment = augment
        self.vmap_chunk = vmap_chunk if vmap_chunk is not None else placement.vmap_chunk()
        self.vmap_chunk_fixed = vmap_chunk is not None or placement.memory.vmap_chunk is not None
        self.rounds = rounds
        self.loss_fn = loss_fn  # the task's loss (fedweave.tasks): mean over a batch's valid samples
        self.ray = ray or RayConfig()  # the ray backend's cluster and workers
        small = [i for i, p in enumerate(self.parts) if 0 < len(p) < local.batch_size]
        if local.steps is not None and not local.full_batch and small:
            log.warning(
                "local.batch_size %d exceeds the data of %d client(s) (client %d has %d samples): their batches are "
                "cut from reshuffled epochs, so rows repeat unevenly; set local.full_batch: true for full-batch steps",
                local.batch_size, len(small), small[0], len(self.parts[small[0]]),
            )  # fmt: skip
        # Resources shared by shallow copies of this trainer (the ray backend's actors): a copy that only
        # changes ``local`` (e.g. a fine-tuning trainer) reuses them.
        self.shared: dict = {}

    # ---- batch plan ------------------------------------------------------------------------------
    def num_steps(self, client: int, steps: int | None = None) -> int:
        """The local steps ``client`` takes in a round: ``steps`` when given, else ``local.steps``, else
        ``local.epochs`` passes over its data in batches of ``local.batch_size`` (one step per epoch with
        ``local.full_batch``)."""
        if steps is not None:
            return steps
        if self.local.steps is not None:
            return self.local.steps
        if self.local.full_batch:
            return self.local.epochs
        n = len(self.parts[client])
        return self.local.epochs * math.ceil(n / self.local.batch_size)

    def client_batches(self, client: int, round: int, key: tuple[int, ...], steps: int | None) -> list[torch.Tensor]:
        """Indices (into the training set) of each local batch of ``client`` in ``round``."""
        idx = self.parts[client]
        n, bs = len(idx), self.local.batch_size
        if n == 0:
            return []
        fixed = steps if steps is not None else self.local.steps
        if self.local.full_batch:  # gradient descent: every step sees the client's whole data, in order
            return [idx] * (fixed if fixed is not None else self.local.epochs)
        g = self.seeds.torch("batches", round, client, *key)
        out: list[torch.Tensor] = []
        if fixed is None:  # epochs: reshuffle every epoch, keep the last partial batch
            for _ in range(self.local.epochs):
                perm = idx[torch.randperm(n, generator=g, device="cpu")]
                out.extend(perm.split(bs))
            return out
        # a fixed number of full batches drawn from a stream of reshuffled epochs
        stream: list[torch.Tensor] = []
        have = 0
        while have < fixed * bs:
            stream.append(idx[torch.randperm(n, generator=g, device="cpu")])
            have += n
        flat = torch.cat(stream)
        return list(flat[: fixed * bs].split(bs))

    def plan(self, clients: Sequence[int], round: int, key: tuple[int, ...], steps: int | None) -> Batches:
        """The batch plan of one call: the local batches of each of ``clients`` in ``round`` (drawn from the
        ``batches`` stream of the round, client and ``key``), padded to the longest job, as index and mask
        tensors of shape ``(T, K, B)``."""
        per_job = [self.client_batches(int(c), round, key, steps) for c in clients]
        T = max((len(b) for b in per_job), default=0)
        K, B = len(per_job), self.local.batch_size
        if self.local.full_batch:
            B = max((len(b[0]) for b in per_job if b), default=1)
        index = torch.zeros((T, K, B), dtype=torch.long, device="cpu")
        mask = torch.zeros((T, K, B), dtype=torch.bool, device="cpu")
        for k, batches in enumerate(per_job):
            for t, b in enumerate(batches):
                index[t, k, : len(b)] = b
                mask[t, k, : len(b)] = True
        return Batches(index, mask, torch.tensor([len(b) for b in per_job], dtype=torch.long, device="cpu"))

    def batch_data(
        self, index: torch.Tensor, client: int, round: int, key: tuple[int, ...], gens: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``index``, on the device, augmented from the client's own stream (its random
        choices are drawn on the CPU and applied where the batch is: the same on every device)."""
        x, y = self.placement.rows(self.train_x, index), self.placement.rows(self.train_y, index)
        if self.augment is not None:
            g = gens.get(client)
            if g is None:
                g = gens[client] = self.seeds.torch("augment", round, client, *key)
            x = self.augment(x, g)
        return x, y

    # ---- training --------------------------------------------------------------------------------
    def lr(self, round: int) -> float:
        """The local learning rate of ``round`` under ``local.lr_schedule``."""
        c = self.local
        if c.lr_schedule == "step":
            return c.lr * c.lr_decay ** (round // c.lr_step)
        if c.lr_schedule == "cosine":
            if self.rounds is None:
                raise ValueError("local.lr_schedule 'cosine' needs the number of rounds (LocalTrainer(rounds=...))")
            return c.lr_min + (c.lr - c.lr_min) * (1 + math.cos(math.pi * round / self.rounds)) / 2
        return c.lr * c.lr_decay**round

    @staticmethod
    def step_lr(lr: LR, t: int) -> float:
        """The step size of local step ``t`` under ``lr`` (a constant or a schedule)."""
        return float(lr(t)) if callable(lr) else lr

    def train(
        self,
        starts: torch.Tensor,
        clients: Sequence[int],
        round: int,
        *,
        rule: LocalRule = PLAIN,
        lr: LR | None = None,
        steps: int | None = None,
        key: tuple[int, ...] = (),
    ) -> LocalResult:
        """Train jobs ``k`` = client ``clients[k]`` from ``starts[k]``; returns the final parameters.

        ``key`` distinguishes several jobs of one client in one round (e.g. the two perturbed solves of
        ZO-HFL use the same key, hence the same batches). ``lr`` may be a function of the local step index
        ``t`` (restarting at 0 in every call), e.g. the decaying ``0.1 / (t + 1)`` of ZO-HFL's Algorithm 2.
        """
        starts = self.checked_starts(self.placement.to(starts), clients)
        dev = starts.device
        if len(clients) == 0:  # e.g. every sampled client dropped out: no backend needs to start
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return LocalResult(starts[:0].clone(), empty, torch.zeros(0, dtype=starts.dtype, device=dev))
        lr = self.lr(round) if lr is None else lr
        clients = list(map(int, clients))
        if self.placement.on_cpu:
            return self.run_jobs(starts, clients, round, rule, lr, steps, key)
        chunk = f", up to {self.vmap_chunk} at once" if self.backend == "vmap" else ""
        vmap = self.backend == "vmap"
        knob = "lower memory.vmap_chunk" if vmap else "choose backend: vmap with a small memory.vmap_chunk"
        with self.placement.out_of_memory(
            f"training {len(clients)} clients (clients {clients[0]}..{clients[-1]}) on backend {self.backend}{chunk}",
            f"{knob}, lower memory.data_fraction or memory.state_fraction, or local.batch_size",
        ):
            return self.run_jobs(starts, clients, round, rule, lr, steps, key)

    @staticmethod
    def checked_starts(starts: torch.Tensor, clients: Sequence[int]) -> torch.Tensor:
        """One start vector per job, ``(K, P)`` (a shared ``(P,)`` start is expanded)."""
        starts = starts if starts.dim() == 2 else starts.expand(len(clients), -1)
        if len(clients) != starts.shape[0]:
            raise ValueError(f"{len(clients)} clients but {starts.shape[0]} start vectors")
        return starts

    def train_with_state(
        self,
        starts: torch.Tensor,
        clients: Sequence[int],
        round: int,
        step: ClientStep,
        store: StateStore | None,
        *,
        lr: LR | None = None,
        steps: int | None = None,
        key: tuple[int, ...] = (),
    ) -> tuple[LocalResult, dict[str, torch.Tensor]]:
        """Train the jobs of a stateful algorithm's clients: each job's rule comes from its client's state
        rows in ``store``, and after training ``step`` computes each client's upload and new state, which is
        written back. Returns the local result and the uploads (rows in job order)."""
        assert store is not None, "the simulation keeps the clients' state in the algorithm's StateStore"
        state = {name: store.rows(name, clients) for name in step.state}  # only these rows move to the device
        result = self.train(starts, clients, round, rule=step.rule(state), lr=lr, steps=steps, key=key)
        upload, new = step.finish(state, self.placement.to(starts), result)
        for name, rows in new.items():
            store.set_rows(name, clients, rows)
        return result, upload

    def run_jobs(
        self,
        starts: torch.Tensor,
        clients: list[int],
        round: int,
        rule: LocalRule,
        lr: LR,
        steps: int | None,
        key: tuple[int, ...],
    ) -> LocalResult:
        """Run a checked, non-empty call on this trainer's backend (a deployment overrides this: its jobs
        run elsewhere)."""
        from fedweave.execution import loop, pool, ray, vmap  # the backends share this plan

        run = {"loop": loop.run, "vmap": vmap.run, "ray": ray.run, "pool": pool.run}[self.backend]
        return run(self, starts, clients, round, rule, lr, steps, key)

    def sgd_update(
        self,
        w: torch.Tensor,
        d: torch.Tensor,
        buf: torch.Tensor | None,
        lr: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One SGD step with weight decay, gradient clipping and heavy-ball momentum (torch.optim.SGD form)."""
        c = self.local
        if c.grad_clip is not None:  # clip the per-job gradient norm
            norm = d.norm(dim=-1, keepdim=True)
            d = d * (c.grad_clip / norm.clamp_min(c.grad_clip))
        if c.weight_decay:
            d = d + c.weight_decay * w
        if c.momentum:
            buf = d if buf is None else c.momentum * buf + d
            d = buf
        return w - lr * d, buf
