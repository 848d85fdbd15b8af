"""The hierarchical protocol: a server with its own data above personalized clients (the family's base; ZO-HFL,
spec zo-hfl).

The training set is split once, from named streams, into the server's share (30% in the paper, uniformly
at random) and the clients' pool, which the configured partitioner (Dirichlet in the paper) spreads over
the clients; optionally train and test are first pooled and re-split (the paper's 90/10, spec §4.1).
Each round a fraction ``participation`` (beta) of the clients is sampled without replacement (spec A20).
Every message (the model x and direction v_i down, the two lower-level solutions up) goes through the
ledger with its exact size.

Also here: the mechanics the family shares -- the lower-level rule of Algorithm 2 (proximal term and
projection onto Y_i(x)), the local-step and step-size schedules, unit directions on the sphere and the
two-point randomized-smoothing estimator of Lemma 7(i) -- and the round skeleton: every method reaches its
clients through :meth:`HierarchicalAlgorithm.call_clients` (sample, send, keep those whose upload arrives),
and the model-averaging methods fill in :class:`AveragingAlgorithm`'s round template (their client rule and
server update; the server step's aggregate is its one ``aggregate`` seam).
"""

from __future__ import annotations

import math
import weakref
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from fedweave import robust
from fedweave.algorithms.base import Algorithm, RunContext, aggregation_weights
from fedweave.compression import upload_compression
from fedweave.config import MAX_LOCAL_STEPS, ConfigError, nearest_count
from fedweave.execution import (
    LocalRule,
    LocalTrainer,
    ParamLayout,
    StateStore,
    check_seeded,
    choose_backend,
    evaluate_task,
)
from fedweave.execution.local import LR, PLAIN, ClientStep, GradFn, LocalResult
from fedweave.ledger import nbytes
from fedweave.privacy import make_privacy
from fedweave.registry import LR_SCHEDULES, RULE_PARTS, RULES
from fedweave.seeding import Seeds
from fedweave.topology.samplers import make_sampler, weighting_under

# ---- schedules -----------------------------------------------------------------------------------------


def local_steps(tau: float, r: int, power: float = 0.5) -> int:
    """H_{i,r} = floor(tau (r+1)^q), at least 1 (Thm 1(ii): q = 1/2; Remark 3: q >= 1/2; spec A7)."""
    return max(1, int(np.floor(tau * (r + 1) ** power + 1e-9)))


@LR_SCHEDULES.register("decaying")
class Decaying:
    """The step size schedule t -> c / (t + offset) (client: gamma~_{i,t} = gamma~_i / (t + Gamma), Prop. 1).

    A schedule is data (its two numbers), not a closure, so that a deployment sends it to the node by name
    (``fedweave.registry.LR_SCHEDULES``)."""

    def __init__(self, c: float, offset: float = 1.0) -> None:
        self.c, self.offset = c, offset

    def __call__(self, t: int) -> float:
        return self.c / (t + self.offset)


def decaying(c: float, offset: float = 1.0) -> Callable[[int], float]:
    """The schedule t -> c / (t + offset) (:class:`Decaying`)."""
    return Decaying(c, offset)


# ---- the lower-level problem (Algorithm 2) -------------------------------------------------------------


@RULE_PARTS.register("projection")
class Projection:
    """Euclidean projection onto Y_i(x); ``centre`` is the lower level's input point x (spec A17)."""

    def __call__(self, w: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        return w


@RULE_PARTS.register("ball")
class BallProjection(Projection):
    """Y_i(x) = {y : ||y - x|| <= radius}: Pi(z) = x + (z - x) min(1, radius / ||z - x||) (spec §2.3)."""

    def __init__(self, radius: float) -> None:
        self.radius = float(radius)

    def __call__(self, w: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        z = w - centre
        norm = z.norm(dim=-1, keepdim=True)
        return centre + z * (self.radius / norm.clamp_min(self.radius))


@RULE_PARTS.register("box")
class BoxProjection(Projection):
    """Y = [low, high]^n (coordinate-wise clipping); ``low=0, high=inf`` is the orthant of example (3)."""

    def __init__(self, low: float, high: float) -> None:
        if low > high:
            raise ValueError(f"box projection needs low <= high, got {low} > {high}")
        self.low, self.high = float(low), float(high)

    def __call__(self, w: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        return w.clamp(self.low, self.high)


def make_projection(kind: str, radius: float = 1.0, low: float = 0.0, high: float = float("inf")) -> Projection:
    if kind == "none":
        return Projection()
    if kind == "ball":
        return BallProjection(radius)
    if kind == "box":
        return BoxProjection(low, high)
    raise ConfigError(f"algorithm.constraint must be one of none, ball, box; got {kind!r}")


@RULES.register("lower_level")
class LowerLevelRule(LocalRule):
    """Algorithm 2, line 4: y <- Pi_{Y_i(x)}[y - gamma~_t (grad L~_i(y, zeta) + mu (y - x))].

    ``anchors`` holds the input point x of every job, ``(K, P)`` in the job order of ``LocalTrainer.train``
    (ZO-HFL: x^_r + eta v_i and x^_r - eta v_i), or ``(P,)`` shared by all jobs.
    """

    def __init__(self, mu: float, anchors: torch.Tensor, projection: Projection | None = None) -> None:
        if mu < 0:
            raise ValueError(f"LowerLevelRule: mu must be >= 0, got {mu}")
        self.mu, self.anchors = float(mu), anchors
        self.projection = projection or Projection()

    def _anchor(self, jobs: int | torch.Tensor) -> torch.Tensor:
        if self.anchors.dim() == 1:
            return self.anchors
        k = len(self.anchors)
        # every job, in order: no gather of a (K, P) table per step (checked on a CPU only: on a device the
        # check would wait for it every step, and the gather gives the same numbers)
        on_cpu = isinstance(jobs, torch.Tensor) and jobs.device.type == "cpu" and jobs.numel() == k
        if on_cpu and bool((jobs == torch.arange(k, device="cpu")).all()):
            return self.anchors
        return self.anchors[jobs]

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        # grad_y h~_i(x, y, zeta) = grad L~_i(y, zeta) + mu (y - x)   (spec §2.3, x = the perturbed input)
        return grad(w) + self.mu * (w - self._anchor(jobs))

    def project(self, w: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
        return self.projection(w, self._anchor(jobs))


# ---- randomized smoothing (Lemma 7) --------------------------------------------------------------------


def unit_directions(
    seeds: Seeds,
    r: int,
    clients: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """v_{i,r} ~ Unif(S^{d-1}) for every client i (Alg. 1 line 3; spec A28), as z/||z||, z ~ N(0, I_d),
    each from its own stream ``("zo_direction", r, i)``, drawn in float64 on the CPU (the same directions
    on every device), then moved to ``device``; shape ``(clients, dim)``, ``dtype``."""
    out = torch.empty(clients, dim, dtype=dtype, device="cpu")
    for i in range(clients):
        z = torch.randn(dim, generator=seeds.torch("zo_direction", r, i), dtype=torch.float64, device="cpu")
        out[i] = (z / z.norm()).to(dtype)
    return out.to(device)


def zo_gradient(f_plus: torch.Tensor, f_minus: torch.Tensor, v: torch.Tensor, eta: float) -> torch.Tensor:
    """The two-point estimate (n / (2 eta)) (f(x + eta v) - f(x - eta v)) v of grad f^eta(x) (Lemma 7(i),
    Alg. 1 line 7); ``f_plus``/``f_minus`` of shape ``(K,)``, ``v`` of shape ``(K, n)``; returns ``(K, n)``."""
    n = v.shape[-1]
    return (n / (2.0 * eta)) * (f_plus - f_minus).unsqueeze(-1) * v


# ---- the data split ------------------------------------------------------------------------------------


@dataclass
class HierarchyData:
    """Training/test tensors of a hierarchical run and who holds which training sample."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    server: torch.Tensor  # training-set indices held by the server
    parts: list[np.ndarray]  # per client, training-set indices
    validation: torch.Tensor | None = None  # training-set indices held out for tuning (nobody trains on them)

    @property
    def num_train(self) -> int:
        """N_tr: the training samples held by the server or a client (the validation set excluded)."""
        return len(self.train_y) - (0 if self.validation is None else len(self.validation))


# (id of the dataset, root seed, test fraction) -> the pooled train/test re-split; a few entries, each dropped
# when its dataset is freed. Many runs of one process (a reproduction's worker) share a dataset and seed, and
# pooling copies the whole dataset (about 1 s for MNIST).
_POOLED: OrderedDict[tuple[int, int, float], tuple[torch.Tensor, ...]] = OrderedDict()
_POOLED_MAX = 2


def _pooled_split(ctx: RunContext, test_fraction: float) -> tuple[torch.Tensor, ...]:
    """(train_x, train_y, test_x, test_y): the official splits pooled and re-split from ``test_split``."""
    ds = ctx.dataset
    key = (id(ds), ctx.config.seed, test_fraction)
    if key in _POOLED:
        _POOLED.move_to_end(key)
        return _POOLED[key]
    x, y = torch.cat([ds.train_x, ds.test_x]), torch.cat([ds.train_y, ds.test_y])
    perm = torch.as_tensor(ctx.seeds.numpy("test_split").permutation(len(y)), device="cpu")  # host data
    n_test = int(round(test_fraction * len(y)))
    if n_test == 0:  # an empty test set scores accuracy 0 and loss 0 every round, a result nobody could tell apart
        raise ConfigError(
            f"algorithm.test_fraction {test_fraction:.6g} of the {len(y):,} pooled samples is no test sample; raise it "
            "(the paper's 0.1) or set null (the dataset's own test set)"
        )
    out = (x[perm[n_test:]], y[perm[n_test:]], x[perm[:n_test]], y[perm[:n_test]])
    _POOLED[key] = out
    weakref.finalize(ds, _POOLED.pop, key, None)  # the id may be reused once the dataset is gone
    while len(_POOLED) > _POOLED_MAX:
        _POOLED.popitem(last=False)
    return out


def split_hierarchy(
    ctx: RunContext, server_share: float, test_fraction: float | None, validation: float = 0.0
) -> HierarchyData:
    """Server share, client partition and (optionally) a pooled train/test re-split (spec §4.1, A15).

    ``validation`` > 0 first holds out that fraction of the training set (stream ``validation_split``) for
    tuning hyper-parameters without looking at the test set (spec A1); the rest is split as usual.
    Streams: ``test_split`` (the pooled re-split), ``server_split`` (the server's uniform share),
    ``partition`` (the configured partitioner over the clients' pool).
    """
    ds = ctx.dataset
    if ds.train_users is not None:
        raise ConfigError(
            f"dataset {ds.name!r} is naturally federated (per-user samples); the hierarchical family splits "
            "an unowned training set between server and clients"
        )
    train_x, train_y, test_x, test_y = ds.train_x, ds.train_y, ds.test_x, ds.test_y
    if test_fraction is not None:  # pool the official splits and re-split (the paper's 90/10)
        train_x, train_y, test_x, test_y = _pooled_split(ctx, test_fraction)
    held = np.arange(len(train_y))  # the samples the server and the clients share out
    val = None
    if validation > 0:
        vperm = ctx.seeds.numpy("validation_split").permutation(len(held))
        n_val = int(round(validation * len(held)))
        if n_val == 0:  # as an empty test set: val_accuracy and val_loss 0 every round
            raise ConfigError(
                f"algorithm.validation {validation:.6g} of the {len(held):,} training samples is no sample; raise it "
                "or set 0 (no hold-out)"
            )
        val, held = torch.as_tensor(np.sort(vperm[:n_val]), device="cpu"), np.sort(vperm[n_val:])
    n = len(held)
    perm = held[ctx.seeds.numpy("server_split").permutation(n)]
    n_server = int(round(server_share * n))
    server, pool = np.sort(perm[:n_server]), np.sort(perm[n_server:])
    if len(pool) == 0:  # the partitioner would say "use at most 0 clients", which no setting satisfies
        raise ConfigError(
            f"algorithm.server_share {server_share:.6g} of the {n:,} training samples leaves the clients none; lower it"
        )

    if ctx.config.num_clients < 1:
        raise ConfigError(f"partition.num_clients must be a positive integer, got {ctx.config.num_clients!r}")
    try:
        local = ctx.partition_of(train_y[torch.as_tensor(pool, device="cpu")].numpy())
    except ConfigError as e:
        raise ConfigError(f"partition (of the clients' {len(pool)} samples): {e}") from e
    parts = [pool[np.asarray(p, dtype=np.int64)] for p in local]
    server_idx = torch.as_tensor(server, dtype=torch.long, device="cpu")  # indices of the host data
    return HierarchyData(train_x, train_y, test_x, test_y, server_idx, parts, val)


# ---- the family's base class ---------------------------------------------------------------------------


@dataclass
class HierarchyHparams:
    """What every method of the family shares: data split, participation and the local-step schedule."""

    server_share: float = 0.3  # fraction of the training set held by the server (paper §IV)
    participation: float = 0.9  # beta: fraction of clients sampled per round, k = max(1, round(beta m)), halves up
    test_fraction: float | None = None  # null: the dataset's own test set; 0.1: pool and re-split 90/10
    tau: float = 20.0  # H_{i,r} = floor(tau (r+1)^q) local steps (Table I: tau = 20)
    steps_power: float = 0.5  # q
    local_schedule: Literal["decaying", "constant"] = "decaying"  # local.lr/(t+Gamma) or local.lr
    local_offset: float = 1.0  # Gamma in gamma~_t = local.lr / (t + Gamma)
    eval_train_loss: bool = False  # also log the cross-entropy of x on the whole training set (A13(c))
    # > 0: hold out this fraction of the training set and evaluate on it (val_*) instead of the test set (A1)
    validation: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.server_share < 1:
            raise ConfigError(f"algorithm.server_share must be in [0, 1), got {self.server_share}")
        if not 0 < self.participation <= 1:
            raise ConfigError(f"algorithm.participation must be in (0, 1], got {self.participation}")
        if self.test_fraction is not None and not 0 < self.test_fraction < 1:
            raise ConfigError(f"algorithm.test_fraction must be in (0, 1) or null, got {self.test_fraction}")
        if not 0 < self.tau <= MAX_LOCAL_STEPS:  # local steps per round, bounded as local.steps is
            raise ConfigError(f"algorithm.tau must be in (0, {MAX_LOCAL_STEPS:,}], got {self.tau:.6g}")
        if self.steps_power < 0:
            raise ConfigError(f"algorithm.steps_power must be >= 0, got {self.steps_power}")
        if self.local_offset <= 0:
            raise ConfigError(f"algorithm.local_offset must be > 0, got {self.local_offset}")
        if self.local_schedule == "constant" and self.local_offset != HierarchyHparams.local_offset:
            raise ConfigError(
                "algorithm.local_offset: local_schedule 'constant' steps with local.lr and does not read it (Gamma of "
                "local.lr / (t + Gamma) belongs to local_schedule 'decaying'); leave it out"
            )
        if not 0 <= self.validation < 1:
            raise ConfigError(f"algorithm.validation must be in [0, 1), got {self.validation}")


# why a family that scores only its global model refuses eval.personal_test and eval.per_client
GLOBAL_EVAL_ONLY = "evaluates the global model on the test split; per-client evaluation is the centralized family's"


class HierarchicalAlgorithm(Algorithm):
    """Shared mechanics: the split, sampling, schedules, ledger messages and global-model evaluation.

    ``jobs_per_client`` is the number of local jobs each participant runs per round (ZO-HFL: 2), so the
    backend choice (``backend: auto``) sees the real batch width. Faults use ``Algorithm.reporting``: a
    client's work is its local steps of the round (:meth:`client_steps`, the method's count), so under
    ``faults.work_unit: step`` a deadline is in local steps; under ``round`` every client of a round runs the
    same steps, so its work is exactly 1 and only its speed decides whether it is late (docs/reliability.md).
    """

    family = "hierarchical"
    Hparams = HierarchyHparams
    unread_config = {  # docs/algorithms/hierarchical.md, "Local steps"
        # steps first: local.steps given with local.epochs null names the key that was set
        "local.steps": "runs H_r = floor(algorithm.tau (r+1)^algorithm.steps_power) local steps a round",
        "local.epochs": "runs H_r = floor(algorithm.tau (r+1)^algorithm.steps_power) local steps a round",
        "local.augment": "trains on its clients' batches as they are (no augmentation)",
        "local.lr_schedule": "takes local.lr in every round (or, with algorithm.local_schedule: decaying, local.lr / "
        "(t + local_offset) within each call)",
        "eval.personal_test": GLOBAL_EVAL_ONLY,
        "eval.per_client": GLOBAL_EVAL_ONLY,
        "local.lr_decay": "takes local.lr in every round (or, with algorithm.local_schedule: decaying, local.lr / "
        "(t + local_offset) within each call)",
    }
    jobs_per_client = 1
    counts_steps = True  # a client's work is its local steps of the round (faults.work_unit: step applies)
    state_fields = ("x",)  # the global model x^_r
    # privacy: why the ``privacy`` section refuses this method (None: DP-FedAvg's proof covers its round)
    dp_refusal: ClassVar[str | None] = "its messages and server state have not been checked against DP-FedAvg's proof"

    def __init__(self, ctx: RunContext, hp: HierarchyHparams) -> None:
        super().__init__(ctx, hp)
        self.check_local_steps(ctx.config.rounds)
        ctx.placement.check_float64("the hierarchical family (its weights and ZO-HFL's estimator)")
        self.data = split_hierarchy(ctx, hp.server_share, hp.test_fraction, hp.validation)
        self.m = len(self.data.parts)
        self.k = max(1, nearest_count(hp.participation, self.m))  # spec A20: k = max(1, round(beta m)), halves up
        cfg = ctx.config
        check_seeded(ctx.model, ctx.dataset.train_x[:2].to(ctx.device))
        backend = choose_backend(cfg.backend, ctx.model, self.jobs_per_client * self.k, device=ctx.device)
        d = self.data
        # trainer data index m is the server's own share (a baseline control trains on it as a client)
        jobs = [*d.parts, d.server.numpy()]
        self.server_job = self.m
        self.sampler = make_sampler(ctx, self.k, self.m, family=self.family)
        weighting_under(ctx, self.sampler, None, self.family)  # it weighs by size: a draw by size is refused
        # a data-poisoning attack's clients train on its samples (robustness); otherwise d's own
        train_x, train_y = robust.poisoned_data(cfg, ctx.seeds, d.train_x, d.train_y, d.parts, ctx.dataset.num_classes)
        self.trainer = LocalTrainer(
            ctx.model, train_x, train_y, jobs, cfg.local, ctx.seeds, backend=backend, ray=cfg.ray,
            loss_fn=ctx.task.loss, placement=ctx.placement,
        )  # fmt: skip
        self.layout: ParamLayout = self.trainer.layout
        self.x = self.layout.flatten()  # the global model x^_r
        self.job_sizes = torch.tensor([len(p) for p in jobs], dtype=torch.float64, device=ctx.device)
        self.sizes = self.job_sizes[: self.m]
        self.rho = self.sizes / d.num_train  # rho_i = N_i / N_tr (paper §IV; sums to 1 - server_share)
        # the server's share, placed once (on the device when it fits)
        pl = ctx.placement
        self.server_x, self.server_y = pl.data(d.train_x[d.server]), pl.data(d.train_y[d.server])
        self.ledger.store("server", "server_data", nbytes(self.server_x, self.server_y))
        # privacy: DP-FedAvg on the clients' displacements (None without a privacy section)
        self.privacy = make_privacy(self, self.k, self.m)

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.privacy is not None:  # privacy: the accountant's releases and the (adaptive) clip
            out["privacy"] = self.privacy.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        private = state.pop("privacy", None)
        if private is not None and self.privacy is not None:  # privacy
            self.privacy.load_state_dict(private)
        super().load_state_dict(state)

    @property
    def dim(self) -> int:
        """The number of model parameters (the length of the flat vector ``x``)."""
        return self.layout.numel

    @property
    def backend(self) -> str:
        """The execution backend the clients' local steps run on (``loop``, ``vmap``, ``pool`` or ``ray``)."""
        return self.trainer.backend

    def sample_clients(self, r: int) -> np.ndarray:
        """S_r: k clients from the run's sampler (uniformly without replacement by default)."""
        return self.sampler(r)

    def steps(self, r: int) -> int:
        """The local steps of round ``r``: H_r = floor(tau (r+1)^q), at least 1 (``local_steps``)."""
        return local_steps(self.hp.tau, r, self.hp.steps_power)

    def round_steps(self, r: int) -> int:
        """The local steps of each local solve (training job) in round ``r``: H_r (:meth:`steps`)."""
        return self.steps(r)

    def check_local_steps(self, rounds: int) -> None:
        """H_r = floor(tau (r+1)^q) grows with r (q >= 0), so a solve's most local steps are the last round's:
        bounded as local.steps is. Each of tau and steps_factor is, but not the schedule: steps_power 15 over 3
        rounds asked for 3e7 steps in round 3 (a run that does not end), 1000 overflowed a float mid-run."""
        try:
            most = self.round_steps(rounds - 1)
        except OverflowError:  # tau (r+1)^q past the float range
            most = math.inf
        if most > MAX_LOCAL_STEPS:
            hp, factor = self.hp, getattr(self.hp, "steps_factor", 1)
            times = f"algorithm.steps_factor {factor} x " if factor != 1 else ""
            lower = ", algorithm.steps_factor" if factor != 1 else ""
            raise ConfigError(
                f"algorithm.steps_power {hp.steps_power:.6g} with algorithm.tau {hp.tau:.6g} asks for {most:.3g} local "
                f"steps per solve in round {rounds} ({times}H_r = floor(tau (r+1)^steps_power)); at most "
                f"{MAX_LOCAL_STEPS:,}, as local.steps: lower algorithm.steps_power, algorithm.tau{lower} or rounds"
            )

    def client_round_steps(self, r: int) -> int:
        """The local steps one participating client takes in round ``r`` (each method's count; the same for
        every client of the round, since H_{i,r} = H_r here)."""
        raise NotImplementedError(f"{type(self).__name__} defines no local steps per client")

    def client_steps(self, r: int, clients: np.ndarray) -> np.ndarray:
        """Every client of the round takes the method's :meth:`client_round_steps`, whatever its data."""
        return np.full(len(clients), float(self.client_round_steps(r)))

    def relative_work(self, steps: np.ndarray) -> np.ndarray:
        """The unit ``round``: every client of a round takes the same steps, the mean client's round, so each
        one's work is exactly 1 (as the family has always passed; ``steps / steps`` would be too, spelled out
        here so that no rounding can enter)."""
        return np.ones_like(np.asarray(steps, dtype=np.float64))

    def local_lr(self) -> LR:
        """The clients' step size: ``local.lr``, or the schedule ``local.lr / (t + local_offset)`` when the
        algorithm's ``local_schedule`` is ``decaying``."""
        lr = self.config.local.lr
        return decaying(lr, self.hp.local_offset) if self.hp.local_schedule == "decaying" else lr

    def call_clients(self, r: int, kind: str, per_client_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The round's reach to its clients: sample S_r, send each sampled client one message of
        ``per_client_bytes`` (``kind``), and return (S_r, the clients of S_r whose upload arrives). Injected
        dropouts and stragglers past the deadline deliver nothing (``reporting``, with each client's work
        :meth:`client_steps` in the clock's unit: under ``round`` exactly 1, as every client of a round runs the
        same steps and only its speed decides whether it is late; under ``step`` those steps)."""
        sampled = self.sample_clients(r)
        self.send(r, sampled, kind, per_client_bytes)
        return sampled, self.reporting(r, sampled)

    def call_metrics(self, sampled: np.ndarray, clients: np.ndarray) -> dict[str, float]:
        """``participants`` (the sampled clients) and, under faults, ``reported_clients``."""
        return {"participants": float(len(sampled)), **self.fault_metrics(clients)}

    def send(self, r: int, clients: np.ndarray, kind: str, per_client_bytes: int) -> None:
        """Server -> each client of ``clients``: one message of ``per_client_bytes``."""
        self.ledger.record(r, "server", "client", kind, len(clients) * per_client_bytes, len(clients))

    def receive(self, r: int, clients: np.ndarray, kind: str, per_client_bytes: int) -> None:
        """Each client of ``clients`` -> server: one message of ``per_client_bytes``."""
        self.ledger.record(r, "client", "server", kind, len(clients) * per_client_bytes, len(clients))

    def server_batch(self, r: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """xi_r: a mini-batch of the server's data from the ``("server_batches", r)`` stream."""
        n = len(self.server_y)
        idx = torch.as_tensor(
            self.seeds.numpy("server_batches", r).choice(n, min(size, n), replace=False), device="cpu"
        )
        rows = self.ctx.placement.rows
        return rows(self.server_x, idx), rows(self.server_y, idx)

    def server_gradient(self, r: int, size: int) -> tuple[torch.Tensor, float]:
        """grad f~1(x^_r, xi_r) and the batch loss (the server's "pre-training" loss, eq. (1)); zero without
        server data (``server_share: 0``, f1 = 0)."""
        if len(self.server_y) == 0:
            return torch.zeros_like(self.x), 0.0
        xb, yb = self.server_batch(r, size)
        w = self.x.detach().clone().requires_grad_(True)
        with self.ctx.placement.autocast():
            out = self.layout.functional(w, xb)
        loss = self.trainer.loss_fn(out.to(w.dtype), yb)
        (g,) = torch.autograd.grad(loss, w)
        return g, float(loss.detach())

    def client_samples(self) -> tuple[list[np.ndarray], torch.Tensor]:
        """The clients' shares of the pool (the server's share and a validation hold-out are no client's)."""
        return self.data.parts, self.data.train_y

    def evaluate(self, r: int) -> dict[str, float]:
        bs, task = self.config.eval.batch_size, self.ctx.task
        d = self.data

        def scores(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
            return evaluate_task(self.layout, self.x, x, y, task, bs)

        if d.validation is None:
            out = {f"test_{k}": v for k, v in scores(d.test_x, d.test_y).items()}
        else:  # tuning: the test set is not looked at
            val = scores(d.train_x[d.validation], d.train_y[d.validation])
            out = {f"val_{k}": v for k, v in val.items()}
        if len(self.server_y):
            out["server_loss"] = scores(self.server_x, self.server_y)["loss"]  # f1(x^_r)
        if self.hp.eval_train_loss:
            out["train_loss_all"] = self.train_loss_at(self.x)
        return out

    def train_loss_at(self, params: torch.Tensor) -> float:
        """A13(c): the cross-entropy of ``params`` on the N_tr samples of the server and the clients, the
        validation hold-out left out."""
        d = self.data
        x, y = d.train_x, d.train_y
        if d.validation is not None:
            held = torch.cat([d.server, *(torch.as_tensor(p, device="cpu") for p in d.parts)])
            x, y = x[held], y[held]
        return evaluate_task(self.layout, params, x, y, self.ctx.task, self.config.eval.batch_size)["loss"]


@dataclass
class AveragingHparams(HierarchyHparams):
    """The model-averaging round's options: what the server's share does, and the compute-matched variant."""

    server_data: Literal["none", "client"] = "none"  # the server's share: unused, or an always-on client (A12)
    steps_factor: int = 1  # local steps per round = steps_factor * H_{i,r} (2: compute-matched with ZO-HFL)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.steps_factor <= MAX_LOCAL_STEPS:  # a factor of the local steps, bounded as tau is
            raise ConfigError(
                f"algorithm.steps_factor must be in [1, {MAX_LOCAL_STEPS:,}], got {self.steps_factor:.6g}"
            )


@dataclass
class Collected:
    """What the server holds once a round's uploads are in."""

    round: int
    clients: np.ndarray  # the clients whose upload arrived
    jobs: np.ndarray  # the round's training jobs: those clients, and the server's own job under server_data
    local: LocalResult  # the jobs' local models, steps and losses
    upload: dict[str, torch.Tensor]  # a ClientStep's upload, one row per job; empty: each sent its model
    weights: torch.Tensor | None  # aggregation weights over ``jobs`` summing to one; None: the plain mean
    sent: torch.Tensor | None = None  # the decoded y_i - x of a compressed model upload (fedweave.compression)


class AveragingAlgorithm(HierarchicalAlgorithm):
    """The family's model-averaging round template (its server step), shared by the baselines:

    call the clients (sample, send, keep those that report), train the round's jobs for
    ``steps_factor * H_{i,r}`` steps under the family's local schedule and :meth:`client_rule`, receive the
    uploads, reduce the client updates to one (:meth:`aggregate`, the server step's seam), and apply the
    method's :meth:`server_update`. A round with no job leaves every state as it was (``reported_clients``
    0, the runner logs the skip). The server's own job (``server_data: client``) trains without traffic and
    never drops.
    """

    Hparams = AveragingHparams
    handles_faults = ("dropout", "deadline", "byzantine")  # byzantine: the attack stage at the edge (robustness)
    # True where client_updates are the local models (an attack acts on their displacement y_i - x)
    updates_are_models: ClassVar[bool] = True
    robust_aggregation: ClassVar[bool] = True  # the aggregator section applies to the server step (robustness)
    downlink: ClassVar[tuple[str, int]] = ("model", 1)  # ledger kind, and models' worth of bytes per message
    uplink: ClassVar[tuple[str, int]] = ("model", 1)
    compresses_uploads: ClassVar[bool] = True  # the clients' uploads pass the compression stage

    def __init__(self, ctx: RunContext, hp: AveragingHparams) -> None:
        super().__init__(ctx, hp)
        # per-client state of a method whose ``client_rule`` is a ``ClientStep`` (one row per job), created by that
        # method; saved in the checkpoint with the rest
        self.store: StateStore | None = None
        if hp.server_data == "client" and len(self.data.server) == 0:
            # an empty job trains nothing, yet it would count in a plain mean, in train_loss and in the step counters
            raise ConfigError(
                f"algorithm.server_data: 'client' trains the server's share as a client, but that share has no samples "
                f"(algorithm.server_share {hp.server_share} of {self.data.num_train}); raise server_share or use "
                "server_data 'none'"
            )
        self.compression = upload_compression(ctx, self.dim, self.m)  # None unless compression.upload is set
        # a robust aggregator; None: the mean
        # checked against every count of clients the sampler gives in a round (a fixed or schedule sampler's own)
        sizes = [len(self.jobs_of(np.arange(n))) for n in self.sampler.sizes()]
        self.robust = robust.build(ctx.config, ctx.seeds, self.m, sizes)

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.store is not None:  # the clients' own state (before: not saved, so a resume restarted it)
            out["client_state"] = self.store.state_dict()
        if self.compression is not None:  # the clients' error-feedback residuals
            out["compression"] = self.compression.state_dict()
        if self.robust is not None and self.robust.stateful:  # a stateful aggregator's state (robustness)
            out["robust"] = self.robust.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        clients = state.pop("client_state", None)
        if clients is not None and self.store is not None:
            self.store.load_state_dict(clients)
        residuals, robust_state = state.pop("compression", None), state.pop("robust", None)
        super().load_state_dict(state)
        if residuals is not None and self.compression is not None:
            self.compression.load_state_dict(residuals)
        if robust_state is not None and self.robust is not None:
            self.robust.load_state_dict(robust_state)

    def evaluate(self, r: int) -> dict[str, float]:
        """The family's evaluation and, under a backdoor attack at the edge (robustness), the global model's
        ``test_backdoor_success`` on the family's own test set, as the star methods report it; not while
        tuning, which never looks at the test set."""
        out = super().evaluate(r)
        if self.robust is None or self.data.validation is not None:
            return out
        return {**out, **self.robust.backdoor_metrics(self.layout, self.x, self.data, self.config.eval.batch_size)}

    def run_round(self, r: int) -> dict[str, float]:
        kind, size = self.downlink
        sampled, clients = self.call_clients(r, kind, size * nbytes(self.x))
        jobs = self.jobs_of(clients)
        if len(jobs) == 0:
            if self.privacy is not None and self.privacy.releases_empty_rounds:  # privacy: the noise alone, released
                none = self.x.new_zeros(0, len(self.x))
                nobody = Collected(r, clients, jobs, LocalResult(none, none[:, 0], none[:, 0]), {}, none[:, 0])
                self.server_update(self.aggregate(none, nobody.weights), nobody)
            return self.fault_metrics(clients)  # nobody reported: all state stays, the runner logs the skip
        got = self.train_jobs(r, clients, jobs)
        kind, size = self.uplink
        if self.compression is None:
            self.receive(r, clients, kind, size * nbytes(self.x))
        else:  # stage 2 of the server step (fedweave.compression): the ledger bills the encoded uploads
            got, sent = self.compression.upload(r, clients, self.x, got)
            self.ledger.record(r, "client", "server", kind, sent, len(clients))
        updates = self.client_updates(got)
        if self.robust is not None:  # robustness: Byzantine clients replace their (decoded) updates
            updates = self.robust.attack(r, got.jobs, updates, self.x if self.updates_are_models else None)
        self.server_update(self.aggregate(updates, got.weights), got)
        train_loss = got.local.trained_loss(got.weights)  # over the jobs that trained
        out = {"train_loss": train_loss, **self.counters(r, jobs), **self.fault_metrics(clients)}
        return {**out, **self.robust.metrics()} if self.robust is not None else out

    def participants(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(the round's sampled clients, the training jobs: those clients plus the server's job if any)."""
        clients = self.sample_clients(r)
        return clients, self.jobs_of(clients)

    def jobs_of(self, clients: np.ndarray) -> np.ndarray:
        """The training jobs of a round: ``clients`` plus the server's own job under ``server_data: client``."""
        return np.append(clients, self.server_job) if self.hp.server_data == "client" else clients

    def round_steps(self, r: int) -> int:
        """The local steps of each job in round ``r``: ``steps_factor`` times H_r
        (:meth:`~HierarchicalAlgorithm.steps`)."""
        return self.hp.steps_factor * self.steps(r)

    def client_round_steps(self, r: int) -> int:
        """A client's local steps: its one training job's ``steps_factor * H_r`` (:meth:`round_steps`)."""
        return self.round_steps(r)

    def step_sizes_sum(self, r: int) -> float:
        """The sum of the local step sizes over round ``r``'s local steps (under
        :meth:`~HierarchicalAlgorithm.local_lr`)."""
        lr, H = self.local_lr(), self.round_steps(r)
        return sum(self.trainer.step_lr(lr, t) for t in range(H))

    def counters(self, r: int, jobs: np.ndarray) -> dict[str, float]:
        """The round's step counters: ``local_steps`` (per job) and ``client_sgd_steps`` (over the round's
        ``jobs``)."""
        H = self.round_steps(r)
        return {"local_steps": float(H), "client_sgd_steps": float(H * len(jobs))}

    def sample_weights(self, jobs: np.ndarray) -> torch.Tensor:
        """N_i / sum_j N_j over the jobs; equal weights when none of them holds a sample (they take no step,
        y_i = x: their mean keeps x, not 0 / 0 = NaN)."""
        sizes = self.job_sizes.to(self.x.dtype)
        return aggregation_weights(sizes, torch.as_tensor(jobs, device=sizes.device), "samples")

    def client_rule(self, r: int) -> LocalRule | ClientStep:
        """The jobs' local rule, or a ``ClientStep`` for clients with state of their own (over ``self.store``);
        plain SGD by default."""
        return PLAIN

    def weights(self, jobs: np.ndarray) -> torch.Tensor | None:
        """Aggregation weights over the jobs (by sample count, re-weighted over those that delivered);
        None for the plain mean."""
        return self.sample_weights(jobs)

    def train_jobs(self, r: int, clients: np.ndarray, jobs: np.ndarray) -> Collected:
        """Local training of the round's jobs from x under :meth:`client_rule`."""
        rule, lr, steps = self.client_rule(r), self.local_lr(), self.round_steps(r)
        if isinstance(rule, ClientStep):
            local, upload = self.trainer.train_with_state(self.x, jobs, r, rule, self.store, lr=lr, steps=steps)
        else:
            local, upload = self.trainer.train(self.x, jobs, r, rule=rule, lr=lr, steps=steps), {}
        return Collected(r, clients, jobs, local, upload, self.weights(jobs))

    def client_updates(self, got: Collected) -> torch.Tensor:
        """Each job's update, one row per job: by default its local model y_i (the server averages models)."""
        return got.local.params

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The server step's reduction of the collected updates to one: the weighted mean, or the plain mean.
        The one place where DP clipping, robust aggregation and DP noise plug in."""
        if self.privacy is not None:  # privacy: DP-FedAvg on the displacements y_i - x, weights 1/E, noise on the sum
            moved, w = self.privacy.clip(updates - self.x, weights)
            return self.x + self.privacy.noise(w @ moved)
        # the robust aggregator (robustness); with the default one (an attack only), the family's own reduction
        if self.robust is not None and not self.robust.plain:
            n = len(updates)
            w = weights if weights is not None else torch.full((n,), 1 / n, dtype=updates.dtype, device=updates.device)
            return self.robust.aggregate(updates, w, self.x if self.updates_are_models else None)
        return weights @ updates if weights is not None else updates.mean(0)

    @abstractmethod
    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        """The method's server step from ``mean``, the aggregate of the updates."""
