"""The gradient-tracking skeleton shared by the confederated methods (paper eq. 5-6 and 56).

    x^{k+1} = W x^k - alpha y^k                 (servers mix models, step along their trackers)
    g^{k+1} = the method's estimate of grad f_i(x_i^{k+1}), assembled from user uploads
    y^{k+1} = W y^k + g^{k+1} - g^k             (dynamic average consensus keeps mean(y) = mean(g), eq. 84)

with x^0 = y^0 = g^0 = 0 (Lemma 7). A subclass writes only ``estimate``. One round is
``iterations_per_round`` iterations (default 1: a round is an iteration, so metrics are per iteration).

Injected faults (docs/reliability.md), decided once per round: a server that misses the round keeps x_i, y_i,
g_i and skips its users; a lost server link or a missing server is removed from W by ``mixing_without`` (the
weight moves to the diagonal, so W_r stays symmetric and doubly stochastic and mean(y) = mean(g) still
holds); a user that drops out neither computes nor uploads. A round in which no user takes part is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

import fedweave.data.datasets.cfl_logreg  # noqa: F401  (registers the paper's synthetic data)
from fedweave.algorithms.base import Algorithm, RunContext
from fedweave.algorithms.confederated.problem import build_problem
from fedweave.byo import PYTHON, describe_dataset
from fedweave.config import MAX_BATCH_SIZE, MAX_LOCAL_STEPS, MAX_LR, ConfigError, check_options, nearest_count
from fedweave.faults import mixing_without
from fedweave.registry import SAMPLERS
from fedweave.topology.confederation import Confederation, ConfederationHparams
from fedweave.topology.samplers import SAMPLER_ARGS, check_every_round, check_signature, drawn, refuse_context


@dataclass
class ConfederatedHparams(ConfederationHparams):
    """The system (servers, users, graph), the problem (mini-batches, kappa) and the step size."""

    batch_size: int = 5  # samples per mini-batch f_ij,t (paper: 5, so S_ij = 10 at 50 samples per user)
    kappa: float = 0.05  # l2 weight per sample (eq. 48)
    feature_scaling: Literal["none", "unit_norm", "standardize"] = "none"
    intercept: bool = False
    step_size: float | None = None  # alpha; null: step_scale / L_f
    step_scale: float = 0.05  # alpha = step_scale / L_f when step_size is null (spec §3: best of the pilot grid)
    iterations_per_round: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size < 1:
            raise ConfigError(f"algorithm.batch_size must be >= 1, got {self.batch_size}")
        if self.batch_size > MAX_BATCH_SIZE:  # bounded as local.batch_size is
            raise ConfigError(f"algorithm.batch_size must be in [1, {MAX_BATCH_SIZE:,}], got {self.batch_size:.6g}")
        if self.kappa <= 0:
            raise ConfigError(f"algorithm.kappa must be > 0 (strong convexity), got {self.kappa}")
        # alpha, or its multiple of 1 / L_f: a step size, bounded as local.lr is (1e300 diverged at once)
        if self.step_size is not None and not 0 < self.step_size <= MAX_LR:
            raise ConfigError(f"algorithm.step_size must be in (0, {MAX_LR:.6g}] or null, got {self.step_size}")
        if not 0 < self.step_scale <= MAX_LR:
            raise ConfigError(f"algorithm.step_scale must be in (0, {MAX_LR:.6g}], got {self.step_scale}")
        if self.step_size is not None and self.step_scale != ConfederatedHparams.step_scale:
            raise ConfigError(
                "algorithm.step_scale: algorithm.step_size sets alpha directly and step_scale / L_f is unread; keep one"
            )
        if not 1 <= self.iterations_per_round <= MAX_LOCAL_STEPS:  # bounded as local.steps is: 1e300 never ends
            got = self.iterations_per_round
            raise ConfigError(f"algorithm.iterations_per_round must be in [1, {MAX_LOCAL_STEPS:,}], got {got:.6g}")


@contextmanager
def compute_threads(threads: int | None) -> Iterator[None]:
    """Run on one torch thread unless the config sets ``threads``: these iterations are many small tensor ops,
    and on a shared 2-core machine two threads were 13x slower than one (they wait for each other)."""
    if threads is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def users_per_iteration(sample_rate: float, users: int) -> int:
    """m_i = SR * P_i users selected per server and iteration (spec A13), to the nearest whole number with halves
    up (:func:`nearest_count`; Python's round took 0.5 of 5 users to 2), at least one."""
    return max(1, min(users, nearest_count(sample_rate, users)))


def check_rate(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"algorithm.{name} must be in (0, 1], got {value}")


_CACHE: dict[tuple, tuple] = {}


def _problem(ctx: RunContext, hp: ConfederatedHparams, rng: np.random.Generator) -> tuple:
    """(problem, x*, f*, L_f), memoized per data, distribution and problem options: sweeps over methods and
    hyper-parameters on one problem pay the Newton solve once (the problem is never modified in place). The
    data are told apart by the config's dataset section, and a dataset passed from Python by its contents."""
    cfg = ctx.config
    # a dataset passed from Python is named ``python`` whatever it holds: its data's hash tells two apart, and
    # its number of classes, which the hash leaves out and build_problem checks (float labels as arrays are 1)
    described = describe_dataset(ctx.dataset) if cfg.dataset.name == PYTHON else None
    data = (described["sha256"], described["outputs"]) if described else None
    key = (
        cfg.dataset.name, repr(sorted(cfg.dataset.options.items())), data, cfg.seed, hp.num_servers,
        hp.users_per_server, hp.batch_size, hp.kappa, hp.feature_scaling, hp.intercept,
    )  # fmt: skip
    if key not in _CACHE:
        with compute_threads(cfg.threads):
            pb = build_problem(
                ctx.dataset, hp.num_servers, hp.users_per_server, hp.batch_size, hp.kappa, rng,
                feature_scaling=hp.feature_scaling, intercept=hp.intercept,
            )  # fmt: skip
            x_star = pb.solve()
            value = (pb, x_star, pb.loss(x_star), pb.lipschitz())
        if len(_CACHE) >= 4:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = value
    return _CACHE[key]


class ConfederatedAlgorithm(Algorithm):
    """Base of the confederated family: edge servers on a graph, each with its own users, solving the
    paper's regularized logistic regression (eq. 48) together.

    The skeleton holds the server models ``X``, the trackers ``Y`` and the gradient estimates ``G`` (each
    (N, d), float64), the mixing matrix and the problem with its solution ``x_star``; it decides each round's
    faults, mixes, records every exchange, broadcast and upload in the ledger, and checkpoints ``X``, ``Y``,
    ``G``, the iteration count and the uploads (plus a subclass's ``_state``). A method implements
    :meth:`estimate`."""

    family = "confederated"
    fixed_task = "solves its paper's regularized logistic regression, eq. (48) (docs/algorithms/confederated.md)"
    plot_metric = "opt_gap"  # the paper's figures: the optimality gap against iterations and uploads
    unread_config = {  # the problem, its split and steps are the options (docs/algorithms/confederated.md)
        "model": "solves the linear model of eq. (48) on the data's features, not a model of the zoo",
        "partition": "spreads the samples over its servers and users itself (algorithm.num_servers, "
        "users_per_server, batch_size)",
        "local": "takes its steps from its own options (algorithm.step_size or step_scale, iterations_per_round)",
        "eval.personal_test": "evaluates the servers' average model on the test split; per-client evaluation is "
        "the centralized family's",
        "eval.per_client": "evaluates the servers' average model on the test split; per-client evaluation is "
        "the centralized family's",
        # before: accepted and silently not used (the summary recorded no backend)
        "backend": "runs its solver's iterations in its own loop, on no execution backend",
        "memory.vmap_chunk": "runs its solver's iterations in its own loop, on no execution backend",
    }
    Hparams = ConfederatedHparams
    handles_faults = ("dropout", "server_miss", "link_loss")
    state_fields = ("X", "Y", "G", "k", "uploads")  # the skeleton's; a method adds its own

    @property
    def compute_threads(self) -> int:
        """One unless the config sets ``threads`` (:func:`compute_threads`, around every iteration)."""
        return self.config.threads if self.config.threads is not None else 1

    def __init__(self, ctx: RunContext, hp: ConfederatedHparams) -> None:
        super().__init__(ctx, hp)
        ctx.placement.check_float64("the confederated family (its problems are float64 by design)")
        ctx.placement.computes_in = "float64"  # whatever the precision: summary.json says so
        if ctx.placement.precision == "bf16-mixed":  # its gradients are closed-form float64: nothing autocasts
            raise ConfigError(
                f"precision: bf16-mixed does not apply to {self.name}: the confederated family computes in float64 "
                "by design; use precision: float64 (or the default float32, which it also computes in float64)"
            )
        # built and solved on the CPU (cached per dataset and options), then moved where the run computes
        pb_host, x_star, self.f_star, self.L_f = _problem(ctx, hp, self.seeds.numpy("partition"))
        # the graph after the data: N x P x B samples must exist, so a mistyped num_servers is refused in one
        # line before the N x N adjacency and mixing matrix are allocated (1e6 servers asked for 1e12 bytes)
        self.net = Confederation(hp, self.seeds.numpy("server_graph"), self.ledger)
        dev = self.device = ctx.device
        self.problem, self.x_star = pb_host.to(dev), x_star.to(dev)
        self.alpha = hp.step_size if hp.step_size is not None else hp.step_scale / self.L_f
        pb = self.problem
        n, d = pb.N, pb.d
        if self.config.sampler.name != "uniform" or self.config.sampler.options:  # every iteration's, now
            if self.draws_users(hp) is not None:  # the section would be ignored: this method draws no users
                raise ConfigError(
                    f"sampler: {self.name} {self.draws_users(hp)}, so sampler {self.config.sampler.name} would be "
                    "ignored; leave the sampler section out"
                )
            fn = SAMPLERS.get(self.config.sampler.name)
            refuse_context(self.config.sampler.name, fn, self.family)
            opts = check_options(fn, self.config.sampler.options, "sampler", skip=SAMPLER_ARGS)
            check_signature(self.config.sampler.name, fn, opts)
            iterations = self.config.rounds * hp.iterations_per_round  # asked every iteration k, not every round
            check_every_round(
                fn, opts, pb.P, iterations, unit="iterations", note=" = rounds x algorithm.iterations_per_round"
            )
        self.X = torch.zeros(n, d, dtype=torch.float64, device=dev)  # server models x_i^k
        self.Y = torch.zeros(n, d, dtype=torch.float64, device=dev)  # trackers y_i^k
        self.G = torch.zeros(n, d, dtype=torch.float64, device=dev)  # estimates g_i^k
        self.k = 0  # iterations done
        self.uploads = 0  # user -> server vectors so far (the paper's metric)
        self.vector_bytes = d * self.X.element_size()
        self._all_users = torch.arange(pb.P, device=dev).expand(n, pb.P)
        self.hold_state()
        # this round's faults (set by ``apply_faults``); None without faults, so that path stays as it was
        self.server_on: torch.Tensor | None = None  # (N,) the servers that take part
        self.user_on: torch.Tensor | None = None  # (N, P) the users that take part (not dropped, server up)
        self.W_r = self.net.W.to(dev)
        self.adj_r = self.net.adjacency

    def hold_state(self) -> None:
        """Record in the ledger's storage what the method keeps between iterations, per edge server (role
        ``edge``) and per user (role ``user``): the skeleton's x_i, y_i and g_i at the server; a method adds its
        own state (or, without the skeleton's trackers, replaces it)."""
        self.ledger.store("edge", "x_y_g", 3 * self.vector_bytes)

    # ---- faults -------------------------------------------------------------------------------------
    def apply_faults(self, r: int) -> None:
        """Decide round r's faults: servers up, surviving links, W_r = mixing_without(W, links & up_i & up_j)."""
        pb, f = self.problem, self.faults
        idx = np.arange(pb.N)
        up = f.servers_up(r, idx)
        links = f.links_up(r, idx[:, None], idx[None, :]) & up[:, None] & up[None, :]
        self.adj_r = self.net.adjacency & links
        self.W_r = torch.from_numpy(mixing_without(self.net.W.numpy(), links)).to(self.device)
        dropped = f.dropped(r, np.arange(pb.N * pb.P)).reshape(pb.N, pb.P)  # user (i, j) is client i P + j
        self.server_on = torch.from_numpy(up).to(self.device)
        self.user_on = torch.from_numpy(~dropped & up[:, None]).to(self.device)

    def taking_part(self) -> int:
        """How many of this round's clients take part: users (servers, for a method without users)."""
        assert self.user_on is not None
        return int(self.user_on.sum())

    def mix(self, z: torch.Tensor) -> torch.Tensor:
        """Sum_{i'} w_ii' z_i' with the round's W_r (W without faults; the same product as ``net.mix``)."""
        return self.W_r.to(z.dtype) @ z  # W_r: W without faults, kept on the run's device

    def exchange(self, r: int, kind: str, message_bytes: int) -> None:
        """Each server -> each neighbour it can reach this round (2 messages per surviving link)."""
        if self.server_on is None:
            self.net.exchange(r, kind, message_bytes)
            return
        n = 2 * int(np.triu(self.adj_r, 1).sum())
        if n:
            self.ledger.record(r, "edge", "edge", kind, n * message_bytes, n)

    def broadcast(self, r: int, kind: str, users_per_server: int, message_bytes: int) -> None:
        """Each server that is up -> ``users_per_server`` of its users (a user that then drops received it)."""
        servers = self.problem.N if self.server_on is None else int(self.server_on.sum())
        if servers:
            self.net.broadcast(r, kind, servers * users_per_server, message_bytes)

    # ---- randomness: one stream per iteration and purpose -----------------------------------------
    def draw_batches(self, k: int) -> torch.Tensor:
        """t_ij^{k+1} ~ Unif{1..S} for every user (N, P); drawn for all users so that user selection does
        not shift the mini-batch draws (spec §9.1 item 4)."""
        pb = self.problem
        return torch.from_numpy(self.seeds.numpy("batches", k).integers(pb.S, size=(pb.N, pb.P))).to(self.device)

    def check_built(self) -> None:
        """A ``sampler`` section's users of iteration 0 drawn once now, for every server (their number is the
        method's m, known once it is built): a sampler picking another number failed at iteration 0, the run
        directory written."""
        if (self.config.sampler.name != "uniform" or self.config.sampler.options) and hasattr(self, "m"):
            self._sampled_users(0, self.m)

    def draws_users(self, hp: ConfederatedHparams) -> str | None:
        """None when the method draws m random users per server and iteration (:meth:`select_users`, where a
        ``sampler`` section applies), else why it draws none (the section is then refused)."""
        return None

    def select_users(self, k: int, m: int) -> torch.Tensor:
        """m users per server, uniformly without replacement (spec A13), sorted: (N, m). A ``sampler``
        section other than the default picks them instead (``_sampled_users``)."""
        pb = self.problem
        if self.config.sampler.name != "uniform" or self.config.sampler.options:
            return self._sampled_users(k, m)
        if m == pb.P:
            return self._all_users
        keys = self.seeds.numpy("user_selection", k).random((pb.N, pb.P))
        return torch.from_numpy(np.sort(np.argsort(keys, axis=1)[:, :m], axis=1)).to(self.device)

    def _sampled_users(self, k: int, m: int) -> torch.Tensor:
        """Each edge server i asks the run's sampler for its users at iteration k, on its own
        ``("user_selection", k, i)`` stream; the methods' estimators (e.g. eq. (11)'s P S / m) need m each."""
        pb, section = self.problem, self.config.sampler
        fn = SAMPLERS.get(section.name)
        refuse_context(section.name, fn, self.family)
        opts = check_options(fn, section.options, "sampler", skip=SAMPLER_ARGS)
        iterations = self.config.rounds * self.hp.iterations_per_round  # k runs over these, not over the rounds
        rows = []
        for i in range(pb.N):
            row = fn(pb.P, m, k, self.seeds.numpy("user_selection", k, i), rounds=iterations, **opts)
            row = drawn(row, pb.P, f"sampler {section.name!r} (edge server {i}, iteration {k})")
            if len(row) != m:
                raise ConfigError(
                    f"sampler {section.name!r} picked {len(row)} users of edge server {i} at iteration {k}; the "
                    f"confederated methods take exactly m = {m} per server (algorithm.sample_rate * users_per_server)"
                )
            rows.append(row)
        return torch.from_numpy(np.stack(rows).astype(np.int64)).to(self.device)

    def upload(self, r: int, kind: str, count: int) -> None:
        """``count`` users each upload one d-vector to their server in round ``r`` (counted in ``uploads``,
        the paper's metric, and recorded in the ledger as ``kind``)."""
        self.uploads += int(count)
        self.net.upload(r, kind, int(count), self.vector_bytes)

    # ---- the iteration ------------------------------------------------------------------------------
    def estimate(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        """g^{k+1} (N, d): the method's estimate of grad f_i(x_i^{k+1}); records its transfers."""
        # not abstract: a method may write its own step instead (CFL-ADMM)
        raise NotImplementedError(f"{type(self).__qualname__} defines neither estimate nor a step of its own")

    def step(self, r: int) -> None:
        """One iteration k -> k+1 of the gradient-tracking skeleton (eq. 56)."""
        mix, vb, on = self.mix, self.vector_bytes, self.server_on
        x_new = mix(self.X) - self.alpha * self.Y  # eq. (5)
        if on is not None:  # a server that misses the round keeps x_i (it neither mixes nor steps)
            x_new = torch.where(on[:, None], x_new, self.X)
        self.exchange(r, "model", vb)
        g_new = self.estimate(r, self.k, x_new, self.X)
        if on is not None:  # ... and g_i; W_r doubly stochastic keeps mean(y) = mean(g) (eq. 84)
            g_new = torch.where(on[:, None], g_new, self.G)
        y_new = mix(self.Y) + g_new - self.G  # eq. (6) with g in place of grad f_i
        # W_r's row i is e_i up to rounding (w_ii plus the moved weight), so freeze y_i exactly
        self.Y = y_new if on is None else torch.where(on[:, None], y_new, self.Y)
        self.exchange(r, "tracker", vb)
        self.X, self.G = x_new, g_new
        self.k += 1

    def run_round(self, r: int) -> dict[str, float]:
        before = self.uploads
        extra: dict[str, float] = {}
        if self.faulty:
            self.apply_faults(r)
            extra = {"reported_clients": float(self.taking_part()), "servers_up": float(self.server_on.sum())}
            if not extra["reported_clients"]:  # nobody takes part: the round is skipped, the state stays
                return {"iterations": self.k, "uploads": self.uploads, "uploads_per_iteration": 0.0, **extra}
        with compute_threads(self.config.threads):
            for _ in range(self.hp.iterations_per_round):
                self.step(r)
        n = self.hp.iterations_per_round
        out = {"iterations": self.k, "uploads": self.uploads, "uploads_per_iteration": (self.uploads - before) / n}
        # the paper's curve is opg per iteration: reported every round, so that it can be traced (RoundTrace)
        # and stopped on (StopAtTarget with each_round) without evaluating every round
        return {**out, "opt_gap": self.opt_gap(), **extra}

    # ---- metrics --------------------------------------------------------------------------------------
    def opt_gap(self) -> float:
        """opg^k = ||x^k - 1 (x) x*|| / sqrt(N) (paper §VIII-A)."""
        return math.sqrt(float(((self.X - self.x_star) ** 2).sum(1).mean()))

    def evaluate(self, r: int) -> dict[str, Any]:
        xbar = self.X.mean(0)
        out = {
            "opt_gap": self.opt_gap(),
            "objective_gap": self.problem.loss(xbar) - self.f_star,
            "consensus_error": math.sqrt(float(((self.X - xbar) ** 2).sum(1).mean())),
        }
        if self.problem.has_test:
            out.update(self.problem.test_metrics(xbar))
        if r < 0:  # the initial model's row also holds the run's constants: sigma of W, the step size alpha, the users
            out.update(sigma=self.net.sigma, step_size=self.alpha, num_users=self.net.num_users)
            if self.problem.has_test:  # and what the optimum every method approaches scores on the test set
                out["x_star_test_accuracy"] = self.problem.test_metrics(self.x_star)["test_accuracy"]
        return out
