"""Local training of many clients with one semantics on every backend (DESIGN principle 4).

A *job* is one client's local work in a round: start parameters, the client's data, a number of SGD steps.
The batch sequence of a job comes from the named stream ``("batches", round, client, *key)`` and its
augmentation from ``("augment", round, client, *key)``, so the ``loop`` and ``vmap`` backends see exactly
the same samples in the same order. A rule whose step draws independent batches (``LocalRule.draws``,
Per-FedAvg's D, D', D'') gets its further draw ``j`` from ``("batches/j", ...)`` and ``("augment/j", ...)``.

Algorithms change the local update through a :class:`LocalRule` (``fedweave.execution.job``): it maps the
current iterate and a gradient oracle to the direction the optimizer applies (FedProx adds a proximal term,
SCAFFOLD a control variate, FedSAM evaluates the gradient at a perturbed point, ...). A call of
:meth:`LocalTrainer.train` becomes one :class:`LocalCall` record, which the trainer's backend runs.
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
from fedweave.data.partition import Partition
from fedweave.execution.job import (  # noqa: F401  (re-exported: the rule interface algorithms import from here)
    BACKENDS,
    LR,
    PLAIN,
    ClientStep,
    GradFn,
    LocalCall,
    LocalResult,
    LocalRule,
    Reindexed,
    StepGradient,
    backend_run,
    draw_stream,
    plain_rule,
    reindexed,
    summed_losses,
)
from fedweave.execution.params import ParamLayout
from fedweave.execution.placement import CPU, Placement
from fedweave.execution.state import StateStore
from fedweave.seeding import Seeds
from fedweave.tasks import Loss, cross_entropy  # noqa: F401  (cross_entropy: the default loss, re-exported)

log = logging.getLogger("fedweave")
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


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
        if backend not in BACKENDS:
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
        # sample indices stay on the CPU: the batch plans are drawn there (the same on every device); one index
        # tensor and offsets (a Partition), not a tensor per client: 16 bytes a client at any population
        self.parts = Partition.of(parts).as_torch()
        self.local = local
        self.seeds = seeds
        self.backend = backend
        self.augment = augment
        self.vmap_chunk = vmap_chunk if vmap_chunk is not None else placement.vmap_chunk()
        self.vmap_chunk_fixed = vmap_chunk is not None or placement.memory.vmap_chunk is not None
        self.rounds = rounds
        self.loss_fn = loss_fn  # the task's loss (fedweave.tasks): mean over a batch's valid samples
        self.ray = ray or RayConfig()  # the ray backend's cluster and workers
        sizes = self.parts.sizes
        small = np.flatnonzero((sizes > 0) & (sizes < local.batch_size))
        if local.steps is not None and not local.full_batch and len(small):
            log.warning(
                "local.batch_size %d exceeds the data of %d client(s) (client %d has %d samples): their batches are "
                "cut from reshuffled epochs, so rows repeat unevenly; set local.full_batch: true for full-batch steps",
                local.batch_size, len(small), small[0], sizes[small[0]],
            )  # fmt: skip
        # Resources shared by shallow copies of this trainer (the ray backend's actors): a copy that only
        # changes ``local`` (e.g. a fine-tuning trainer) reuses them.
        self.shared: dict = {}

    # ---- batch plan ------------------------------------------------------------------------------
    def num_steps(self, client: int, steps: int | None = None) -> int:
        """The local steps ``client`` takes in a round: ``steps`` when given, else ``local.steps``, else
        ``local.epochs`` passes over its data in batches of ``local.batch_size`` (one step per epoch with
        ``local.full_batch``); 0 for a client without samples, which has no batch to step on (the steps
        :meth:`plan` gives it and a call's ``LocalResult.steps`` report)."""
        n = len(self.parts[client])
        if n == 0:
            return 0
        if steps is not None:
            return steps
        if self.local.steps is not None:
            return self.local.steps
        if self.local.full_batch:
            return self.local.epochs
        return self.local.epochs * math.ceil(n / self.local.batch_size)

    def client_batches(
        self, client: int, round: int, key: tuple[int, ...], steps: int | None, draw: int = 0
    ) -> list[torch.Tensor]:
        """Indices (into the training set) of each local batch of ``client`` in ``round`` (of the steps' draw
        ``draw``: :attr:`LocalRule.draws`)."""
        flat, sizes = self.flat_batches(client, round, key, steps, draw=draw)
        return list(flat.split(sizes)) if sizes else []

    def batch_streams(
        self, clients: Sequence[int], round: int, key: tuple[int, ...], draw: int = 0
    ) -> list[torch.Generator]:
        """The ``batches`` streams of ``clients`` in ``round`` (``batches/j`` for the steps' draw ``j``:
        ``job.draw_stream``), their seeds derived all at once (``Seeds.torches``)."""
        return self.seeds.torches(draw_stream("batches", draw), [(round, int(c), *key) for c in clients])

    def flat_batches(
        self,
        client: int,
        round: int,
        key: tuple[int, ...],
        steps: int | None,
        stream: torch.Generator | None = None,
        draw: int = 0,
    ) -> tuple[torch.Tensor, list[int]]:
        """The batches of :meth:`client_batches` one after another in one index tensor, and their sizes (one
        tensor a job instead of one a batch: the loop backend gathers the rows of many jobs at once).
        ``stream``: the client's ``batches`` stream of the round, fresh, where the caller made it already
        (:meth:`batch_streams`); ``draw``: the steps' draw whose batches these are (:attr:`LocalRule.draws`)."""
        idx = self.parts[client]
        n, bs = len(idx), self.local.batch_size
        if n == 0:
            return idx[:0], []
        fixed = steps if steps is not None else self.local.steps
        if self.local.full_batch:  # gradient descent: every step sees the client's whole data, in order
            k = fixed if fixed is not None else self.local.epochs
            return idx.repeat(k), [n] * k
        g = stream if stream is not None else self.seeds.torch(draw_stream("batches", draw), round, client, *key)
        # epochs: reshuffle every epoch, keep the last partial batch; a fixed number of full batches: drawn from
        # a stream of reshuffled epochs, as many as they need
        draws = self.local.epochs if fixed is None else -(-fixed * bs // n)
        perms = [torch.randperm(n, generator=g, device="cpu") for _ in range(draws)]
        order = perms[0] if draws == 1 else torch.cat(perms)
        if fixed is None:
            whole, rest = divmod(n, bs)
            return idx[order], ([bs] * whole + ([rest] if rest else [])) * draws
        return idx[order[: fixed * bs]], [bs] * fixed

    def plan(
        self, clients: Sequence[int], round: int, key: tuple[int, ...], steps: int | None, draw: int = 0
    ) -> Batches:
        """The batch plan of one call: the local batches of each of ``clients`` in ``round`` (drawn from the
        ``batches`` stream of the round, client and ``key``; ``batches/j`` for the steps' draw ``j``), padded
        to the longest job, as index and mask tensors of shape ``(T, K, B)``. Every draw of a call has the
        same shape, steps and masks: only the samples differ.

        The same batches as :meth:`client_batches` gives job by job, built for the whole call at once: the
        only loop over the jobs draws each client's permutations from its own stream (one ``randperm`` per
        epoch, as there: every stream is a generator of its own); cutting them into batches, padding and
        gathering the sample indices are index arithmetic on ``(T, K, B)`` tensors, with no loop over steps."""
        K, bs, c = len(clients), self.local.batch_size, np.asarray(clients, dtype=np.int64).reshape(-1)
        if K == 0:
            B = 1 if self.local.full_batch else bs
            empty = torch.zeros(0, dtype=torch.long, device="cpu")  # a batch plan lives on the host
            none = (
                torch.zeros((0, 0, B), dtype=torch.long, device="cpu"),
                torch.zeros((0, 0, B), dtype=torch.bool, device="cpu"),
            )
            return Batches(*none, empty)
        # index arithmetic in numpy: these arrays are small, where a numpy operation costs a fraction of a torch one
        lo = self.parts.offsets[c]  # where each client's indices start in parts.indices
        n = self.parts.offsets[c + 1] - lo  # (K,) samples of each job's client
        fixed = steps if steps is not None else self.local.steps
        if self.local.full_batch:  # every step sees the client's whole data, in order (no randomness)
            count = np.where(n > 0, fixed if fixed is not None else self.local.epochs, 0).astype(np.int64)
            B = int(n[count > 0].max()) if (count > 0).any() else 1
            t, b = np.arange(int(count.max()))[:, None, None], np.arange(B)
            valid = (t < count[:, None]) & (b < n[:, None])
            source = lo[:, None] + b  # (K, B) positions in parts.indices
        else:
            draws, lengths = [], np.zeros(K, dtype=np.int64)
            drawn = np.flatnonzero(n > 0)
            for k, g in zip(drawn, self.batch_streams(c[drawn].tolist(), round, key, draw)):  # one stream per client
                nk = int(n[k])
                perms = self.local.epochs if fixed is None else -(-fixed * bs // nk)  # epochs, or enough for fixed
                draws.extend(torch.randperm(nk, generator=g, device="cpu") for _ in range(perms))
                lengths[k] = perms * nk
            stream = torch.cat(draws).numpy() if draws else np.zeros(0, dtype=np.int64)  # each job's permutations
            start = np.cumsum(lengths) - lengths  # of job k in ``stream``
            if fixed is None:  # epochs: an epoch is ceil(n / bs) batches, the last one partial
                per_epoch = -(-n // bs)
                count = self.local.epochs * per_epoch
            else:  # fixed full batches cut from the stream of reshuffled epochs
                per_epoch, count = None, np.where(n > 0, fixed, 0).astype(np.int64)
            T = int(count.max())
            t, b = np.arange(T)[:, None, None], np.arange(bs)
            if per_epoch is None:
                at = t * bs + b  # (T, 1, B) position in the job's stream
                valid = np.broadcast_to(t < count[:, None], (T, K, bs))
            else:
                e, j = np.divmod(t, np.maximum(per_epoch, 1)[:, None])
                pos = j * bs + b  # (T, K, B) position in epoch e's permutation
                valid = (t < count[:, None]) & (pos < n[:, None])
                at = e * n[:, None] + pos
            at = np.where(valid, start[:, None] + at, 0)
            source = lo[:, None] + (stream[at] if len(stream) else np.zeros_like(at))
        valid = np.broadcast_to(valid, np.broadcast_shapes(valid.shape, np.shape(source))).copy()  # writable
        index = self.parts.indices[torch.from_numpy(np.where(valid, source, 0))]
        index[~torch.from_numpy(valid)] = 0
        return Batches(index, torch.from_numpy(valid), torch.from_numpy(count.astype(np.int64)))

    def batch_data(
        self, index: torch.Tensor, client: int, round: int, key: tuple[int, ...], gens: dict, draw: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``index``, on the device, augmented from the client's own stream (its random
        choices are drawn on the CPU and applied where the batch is: the same on every device); a step's
        draw ``j`` from a stream of its own, ``augment/j``."""
        x, y = self.placement.rows(self.train_x, index), self.placement.rows(self.train_y, index)
        if self.augment is not None:
            at = client if draw == 0 else (client, draw)
            g = gens.get(at)
            if g is None:
                g = gens[at] = self.seeds.torch(draw_stream("augment", draw), round, client, *key)
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
        """Train jobs ``k`` = client ``clients[k]`` from ``starts[k]``; returns their :class:`LocalResult` (the
        final parameters, the steps taken and the mean training losses, one row per job).

        ``key`` distinguishes several jobs of one client in one round (e.g. the two perturbed solves of
        ZO-HFL use the same key, hence the same batches). ``lr`` may be a function of the local step index
        ``t`` (restarting at 0 in every call), e.g. the decaying ``0.1 / (t + 1)`` of ZO-HFL's Algorithm 2.
        """
        if not isinstance(rule, LocalRule):  # e.g. an algorithm's client_rule that returned something else
            raise TypeError(
                f"the local rule must be a LocalRule (what an algorithm's client_rule returns, or a ClientStep's "
                f"rule(state)), got {rule!r}"
            )
        starts = self.checked_starts(self.placement.to(starts), clients)
        dev = starts.device
        if len(clients) == 0:  # e.g. every sampled client dropped out: no backend needs to start
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return LocalResult(starts[:0].clone(), empty, torch.zeros(0, dtype=starts.dtype, device=dev))
        lr = self.lr(round) if lr is None else lr
        clients = list(map(int, clients))
        call = LocalCall(starts, clients, round, rule, lr, steps, key)
        if self.placement.on_cpu:
            return self.run_jobs(call)
        chunk = f", up to {self.vmap_chunk} at once" if self.backend == "vmap" else ""
        vmap = self.backend == "vmap"
        knob = "lower memory.vmap_chunk" if vmap else "choose backend: vmap with a small memory.vmap_chunk"
        with self.placement.out_of_memory(
            f"training {len(clients)} clients (clients {clients[0]}..{clients[-1]}) on backend {self.backend}{chunk}",
            f"{knob}, lower memory.data_fraction or memory.state_fraction, or local.batch_size",
        ):
            return self.run_jobs(call)

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
        if store is None:
            raise TypeError(
                f"{type(step).__name__} keeps client state {list(step.state)}, but the algorithm has no StateStore: "
                "make one when it is built (self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, "
                "placement=ctx.placement), then self.store.create(name, size) for each)"
            )
        state = {name: store.rows(name, clients) for name in step.state}  # only these rows move to the device
        result = self.train(starts, clients, round, rule=step.rule(state), lr=lr, steps=steps, key=key)
        upload, new = step.finish(state, self.placement.to(starts), result)
        for name, rows in new.items():
            store.set_rows(name, clients, rows)
        return result, upload

    def run_jobs(self, call: LocalCall) -> LocalResult:
        """Run a checked, non-empty call on this trainer's backend (a deployment overrides this: its jobs
        run elsewhere)."""
        return backend_run(self.backend)(self, call)

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
