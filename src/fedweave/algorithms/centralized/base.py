"""The star protocol: one server, many clients, partial participation (the centralized family's base).

:meth:`StarAlgorithm.run_round` is the round template every centralized method shares: the server samples
``clients_per_round`` clients (the ``("client_sampling", round)`` stream, or the configured sampler), sends
them what the method says, keeps the uploads that arrive (injected dropouts and stragglers deliver nothing),
reduces the client updates to one aggregate and hands it to the method's server update. Every transfer is
recorded in the ledger with its exact size. A method fills in only what its paper says:

- ``client_rule(lr)``: its clients' local rule (a ``LocalRule``), or a ``ClientStep`` for clients that keep
  state of their own; plain local SGD by default;
- ``server_update(mean, got)``: its server step from the aggregate of the client updates;
- where its paper differs from FedAvg's messages: ``downlink()`` (what the server sends), ``uplink`` (the
  ledger kind of the upload), ``client_updates(got)`` (what each client's update is) and ``recipients``;
- where its clients do not start from the global model (their own models, their cluster's): ``client_starts``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal

import numpy as np
import torch

from fedweave import robust
from fedweave.algorithms.base import Algorithm, RunContext, aggregation_weights, make_trainer
from fedweave.compression import upload_compression
from fedweave.compression.download import download_compression
from fedweave.config import MAX_LR, ConfigError, RunConfig, Section
from fedweave.data.partition import client_sizes, clients_with_data
from fedweave.execution import (
    LocalResult,
    ParamLayout,
    StateStore,
    client_means,
    client_spread,
    evaluate,
    evaluate_clients,
    evaluate_clients_task,
    evaluate_task,
    with_samples,
)
from fedweave.execution.local import PLAIN, ClientStep, GradFn, LocalRule
from fedweave.privacy import make_privacy
from fedweave.privacy.secagg import make_secagg
from fedweave.topology.samplers import ClientHistory, make_sampler, weighting_under


@dataclass
class StarHparams:
    clients_per_round: int = 10
    # aggregation weights over the round's clients; uniform under a sampler that draws by size (weighting_under)
    weighting: Literal["samples", "uniform"] = "samples"
    server_lr: float = 1.0
    consistency: bool = False  # log the local-consistency metric every round (FedMIM Fig. 2b)
    # fixed: the sampler section decides (uniform by default: clients_per_round clients without replacement);
    # bernoulli: another name for `sampler: bernoulli` (each client independently with probability
    # clients_per_round / N, redrawn if none is active; fedmim spec A6), refused beside another sampler
    sampling: Literal["fixed", "bernoulli"] = "fixed"

    def __post_init__(self) -> None:
        if self.clients_per_round < 1:
            raise ConfigError(f"algorithm.clients_per_round must be >= 1, got {self.clients_per_round}")
        if not 0 < self.server_lr <= MAX_LR:  # the server's step is taken in float32 too, as local.lr's is
            raise ConfigError(f"algorithm.server_lr must be in (0, {MAX_LR:.6g}], got {self.server_lr}")


def _aliased_sampler(config: RunConfig, hp: StarHparams) -> str:
    """The sampler that ``algorithm.sampling`` names: ``bernoulli`` (fedmim spec A6) is another name for
    ``sampler: bernoulli``, and a sampler section that names another one is refused (one knob decides who
    takes part); ``fixed``, the default, leaves the choice to the section. The default section (``uniform``,
    no options) counts as none: it is what every run's resolved config records, so a run resumes."""
    if getattr(hp, "sampling", "fixed") != "bernoulli":
        return "uniform"
    section = config.sampler
    if section.name != "bernoulli" and section != Section("uniform"):
        raise ConfigError(
            f"algorithm.sampling: bernoulli and sampler: {section.name} both choose the round's clients; keep one "
            "(algorithm.sampling: bernoulli is sampler: bernoulli)"
        )
    return "bernoulli"


def regularized(grad: GradFn, weight_decay: float, grad_clip: float | None) -> GradFn:
    """The gradient of f_i including its L2 term, ``clip(grad CE(v)) + wd * v``, evaluated at any point v.

    The same arithmetic as the trainer's SGD step, so a rule that regularizes inside reproduces the
    trainer's plain step bit for bit when it evaluates at the iterate (fedmim spec A7).
    """

    def g(v: torch.Tensor) -> torch.Tensor:
        d = grad(v)
        if grad_clip is not None:
            d = d * (grad_clip / d.norm(dim=-1, keepdim=True).clamp_min(grad_clip))
        if weight_decay:
            d = d + weight_decay * v
        return d

    return g


def per_job(t: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
    """Inside a ``LocalRule``: a tensor shared by all jobs ``(P,)`` as is, a per-job table ``(K, P)`` at ``jobs``
    (an int, a tensor of positions, or one job's 0-d position under ``torch.func.vmap``, as
    ``LocalRule.extra_loss`` gets it)."""
    if t.dim() == 1:
        return t
    if isinstance(jobs, torch.Tensor) and jobs.dim() == 0:  # under vmap `t[jobs]` would read the value
        return t.index_select(0, jobs.reshape(1)).squeeze(0)
    return t[jobs]


def local_consistency(params: torch.Tensor) -> float:
    """(1/S) sum_i ||x_i - xbar||^2 with xbar the plain mean of the S local models (FedMIM Sec. V-C3)."""
    return float((params - params.mean(0)).pow(2).sum(1).mean())


@dataclass
class Collected:
    """What the server holds once a round's uploads are in: who reported and what they sent."""

    round: int
    clients: np.ndarray  # the clients whose upload arrived, in job order
    lr: float  # the round's local step size eta_l
    local: LocalResult  # their local models (rebuilt from the upload where it is not the model), steps, losses
    upload: dict[str, torch.Tensor]  # a ClientStep's upload, one row per client; empty: each sent its model
    weights: torch.Tensor  # aggregation weights over ``clients``, summing to one
    # the decoded displacements y_i - x_t of a compressed model upload (fedweave.compression); None: not one
    sent: torch.Tensor | None = None
    # compressed downloads (fedweave.compression): the models the clients started from; None: x_t itself
    start: torch.Tensor | None = None
    # the client updates as the server's reduction gets them (decoded, after the attack): what a server step
    # that reads the rows themselves (FedExP's step size) reads; None until the round template has them
    received: torch.Tensor | None = None


class StarAlgorithm(Algorithm):
    """The star round template and its mechanics: sampling, messages, weights, global evaluation.

    A method subclasses it and fills in :meth:`client_rule` and :meth:`server_update` (and, where its
    messages differ from FedAvg's, :meth:`downlink`, ``uplink`` and :meth:`client_updates`); sampling, the
    ledger, injected faults and the aggregation run here, the same for every method.
    """

    family = "centralized"
    Hparams = StarHparams
    # True: the local rule applies weight decay and clipping to the loss gradient (see ``regularized``)
    regularize_in_rule: ClassVar[bool] = False
    # True: the local rule keeps state of the method's own inside the local steps (APFL's adaptive alpha, pFedMe's
    # personalized models), which a worker process would keep to itself: ``backend: auto`` then never picks the pool
    trains_in_process: ClassVar[bool] = False
    # Injected faults (fedweave.faults) the round template handles; the runner refuses the others. A
    # subclass that writes its own run_round declares what that handles.
    handles_faults: ClassVar[tuple[str, ...]] = ("dropout", "deadline", "byzantine")
    robust_aggregation: ClassVar[bool] = True  # the aggregator section applies (fedweave.robust)
    # True where client_updates are the local models, not their displacement (an attack acts on y_i - x_t)
    updates_are_models: ClassVar[bool] = False
    uplink: ClassVar[str] = "model"  # the ledger kind of each reporting client's upload
    uploads_start_loss: ClassVar[bool] = False  # its clients also send their loss of the model they received
    compresses_uploads: ClassVar[bool] = True  # the template runs the compression stage (fedweave.compression)
    # compression.download applies: the first tensor of the first downlink message is the model x_t, and the
    # clients' rule and update read the model only as where they start (fedweave.compression.download)
    compresses_downloads: ClassVar[bool] = False
    state_fields = ("x",)  # the global model; a method adds its server state
    # privacy: why the ``privacy`` section refuses this method (None: its messages are one model update per
    # client and its server state a function of the noised mean only, so DP-FedAvg's proof covers it)
    dp_refusal: ClassVar[str | None] = "its messages and server state have not been checked against DP-FedAvg's proof"
    # why a method needs every client in every round (clients_per_round = the run's clients); None: it samples
    every_client: ClassVar[str | None] = None
    # True where the server runs its own event clock (fedweave.algorithms.centralized.async_base); the round
    # template's synchronous clock (faults.sim_time) is then not its
    asynchronous: ClassVar[bool] = False
    sim_clock: ClassVar[bool] = True  # faults.sim_time applies (round_time)
    counts_steps: ClassVar[bool] = True  # a client's work is its local steps (faults.work_unit: step applies)
    global_model: ClassVar[bool] = True  # False where the method keeps no single global model x_t (IFCA, CFL, ...)
    # secure aggregation: what the server sums unweighted over the round's clients (FedDyn's h, SCAFFOLD's c), which
    # is |S| times the mean SecAgg+ gives under equal weights; None: its server needs the mean only (dp_refusal)
    sums_unweighted: ClassVar[str | None] = None

    @classmethod
    def secure_refusal(cls, weighting: str) -> str | None:
        """Why secure aggregation, whose server learns only the weighted mean of the updates (weighted by
        ``weighting``), cannot serve this method, or None: ``dp_refusal``'s criterion (one model update per client
        and the server state a function of their mean), or, for a method whose server sums an upload
        (``sums_unweighted``), equal weights."""
        if cls.sums_unweighted is None:
            return cls.dp_refusal
        if weighting == "uniform":
            return None
        return (
            f"its server {cls.sums_unweighted} unweighted, which the weighted mean gives only under "
            "algorithm.weighting: uniform (Alg. 1's average)"
        )

    @classmethod
    def check_sampler(cls, config: RunConfig, hp: StarHparams) -> None:
        """``algorithm.sampling`` against the sampler section first, as the run makes its sampler."""
        _aliased_sampler(config, hp)
        super().check_sampler(config, hp)

    @classmethod
    def in_process(cls, hp: StarHparams) -> bool:
        """Whether the local rule must run in this process (:attr:`trains_in_process`; a method whose rule keeps
        such state only under some options says which)."""
        return cls.trains_in_process

    def __init__(self, ctx: RunContext, hp: StarHparams) -> None:
        super().__init__(ctx, hp)
        n = ctx.num_clients
        if hp.clients_per_round > n:
            raise ConfigError(
                f"algorithm.clients_per_round ({hp.clients_per_round:.6g}) exceeds partition.num_clients ({n})"
            )
        if self.every_client and hp.clients_per_round != n:
            raise ConfigError(
                f"algorithm.clients_per_round: {self.name} {self.every_client} ({n}), got {hp.clients_per_round}; "
                "set it to partition.num_clients"
            )
        if self.every_client and (ctx.config.sampler != Section("uniform") or hp.sampling != "fixed"):
            name = ctx.config.sampler.name if hp.sampling == "fixed" else hp.sampling
            raise ConfigError(  # a sampler would hand the method a subset of the clients
                f"sampler: {self.name} {self.every_client}, but sampler {name} chooses the round's clients; leave "
                "the sampler section and algorithm.sampling out"
            )
        self.trainer = make_trainer(
            ctx, hp.clients_per_round, regularize_in_rule=self.regularize_in_rule, in_process=self.in_process(hp)
        )
        self.layout: ParamLayout = self.trainer.layout
        self.x = self.layout.flatten()  # the global model x_t
        sizes = client_sizes(ctx.partition)
        self.sizes = torch.from_numpy(sizes).to(dtype=self.x.dtype, device=self.x.device)
        self.holds_data = sizes > 0  # (N,) bool, on the host: run_round reads it every round without a device sync
        # what a sampler that reads the clients' context sees: sizes, last reported losses and rounds, and the
        # candidates' losses of x_t on request (candidate_losses: power_of_choice's pow-d and cpow-d)
        self.client_history = ClientHistory(sizes, self.candidate_losses)
        self.probes = False  # the sampler had candidates evaluate x_t in its check draw (make_sampler's round 0)
        # the last probe: (round, the candidates sent the model, the model as sent), so that the round's own
        # message does not bill x_t again to a candidate that holds it (send); None before any
        self.probed: tuple[int, np.ndarray, torch.Tensor] | None = None
        self.sampler_built = False  # until then a probe is that check draw, not a round's: not billed
        self.sampler = make_sampler(
            ctx, hp.clients_per_round, default=_aliased_sampler(ctx.config, hp), context=self.client_history.context
        )
        self.sampler_built = True
        if self.probes and not self.global_model:
            raise ConfigError(
                f"sampler {self.sampler.name!r} has its candidates evaluate the global model, and {self.name} keeps "
                "none (one model per cluster or client); use power_of_choice's variant: rpow-d or another sampler"
            )
        if self.sampler.reads_context:  # the server keeps each client's last loss and round for it
            h = self.client_history
            self.ledger.store("server", "client_history", h.last_loss.nbytes + h.last_round.nbytes)
        # a sampler that draws by size gets equal weights: every reader of hp.weighting (weights(), AFL's lambda_0,
        # the clustered methods, the deployment's secure aggregation) then follows the draw's analysis
        hp.weighting = weighting_under(ctx, self.sampler, hp.weighting)
        self.store: StateStore | None = None  # per-client state, created by the algorithms that keep some
        # robustness: Byzantine attack and robust aggregator (None without either: the plain template)
        self.robust = robust.build(ctx.config, ctx.seeds, n, self.reduced_per_round())
        self.client_values: dict | None = None  # eval.distribution: the last evaluation's per-client values
        self.compression = upload_compression(ctx, self.num_params, n)  # None unless compression.upload is set
        self.download = download_compression(self)  # None unless compression.download is set (compression)
        if self.probes and self.download is not None:
            raise ConfigError(
                f"sampler {self.sampler.name!r} sends the global model to its candidates, a download that "
                "compression.download does not encode (its clients' replicas would drift from what they were sent); "
                "use power_of_choice's variant: rpow-d, or leave compression.download out"
            )
        self.privacy = make_privacy(self)  # privacy: the DP stages of the round (None without a privacy section)
        self.secagg = make_secagg(self)  # secure aggregation: SecAgg+'s messages in the ledger (None: not billed)
        # faults.sim_time: the synchronous rounds on the simulated clock (round_time); an asynchronous method's
        # clock is its own and always on
        self.clocked = ctx.config.faults.sim_time and not self.asynchronous
        self.now = 0.0  # the simulated time at the end of the last round

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.store is not None:
            out["client_state"] = self.store.state_dict()
        if self.sampler.reads_context:  # only then: the other runs' checkpoints keep their keys
            out["sampler_context"] = self.client_history.state_dict()
        if self.compression is not None:  # the clients' error-feedback residuals
            out["compression"] = self.compression.state_dict()
        if self.download is not None:  # the models the clients hold (compressed downloads)
            out["download"] = self.download.state_dict()
        if self.robust is not None and self.robust.stateful:  # a stateful aggregator's state (robustness)
            out["robust"] = self.robust.state_dict()
        if self.privacy is not None:  # privacy: the accountant's releases and the (adaptive) clip
            out["privacy"] = self.privacy.state_dict()
        if self.clocked:  # only then (the asynchronous methods' clock is in their state record)
            out["now"] = self.now
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        clients = state.pop("client_state", None)
        history = state.pop("sampler_context", None)
        robust_state, residuals = state.pop("robust", None), state.pop("compression", None)
        replicas = state.pop("download", None)
        if replicas is not None and self.download is not None:
            self.download.load_state_dict(replicas)
        private = state.pop("privacy", None)
        if private is not None and self.privacy is not None:  # privacy
            self.privacy.load_state_dict(private)
        if self.clocked:  # the synchronous clock (a checkpoint of a run with the clock always has it)
            self.now = float(state.pop("now"))
        super().load_state_dict(state)
        if robust_state is not None and self.robust is not None:
            self.robust.load_state_dict(robust_state)
        if residuals is not None and self.compression is not None:
            self.compression.load_state_dict(residuals)
        if history is not None:
            self.client_history.load_state_dict(history)
        if clients is not None and self.store is not None:
            self.store.load_state_dict(clients)

    def reduced_per_round(self) -> tuple[int, ...]:
        """The counts of client updates a server step reduces when every client reports: the round's clients,
        every count the sampler gives in a round (a ``fixed`` or ``schedule`` sampler's own, else
        ``clients_per_round``): what a robust aggregator's bound is checked against when the run is built."""
        return self.sampler.sizes()

    @property
    def num_params(self) -> int:
        """The number of the global model's parameters (the length of its flat vector)."""
        return self.layout.numel

    # ---- the round template ----------------------------------------------------------------------
    def run_round(self, r: int) -> dict[str, float]:
        """One star round: sample, send, keep what arrives, train, collect, aggregate, server update.

        The order of the steps (and so of the seed streams, ledger records and float operations) is fixed
        here for every method. Clients that drop out or miss the deadline (``reporting``: simulated arrival
        times from ``client_work``) were sent the round's message but deliver nothing; the weights re-weight
        over those that reported. A round nobody reports leaves every state as it was, and the runner logs
        it as skipped (:attr:`nobody_reported`; under faults its ``reported_clients`` is 0 too). A round whose
        reporting clients all hold no sample (``partition.min_size: 0``) is one nobody reports: they take no
        step and have no update to send. Under ``faults.sim_time`` the round advances the simulated clock by
        :meth:`round_time` and its metrics carry ``sim_time``.
        """
        clients = self.sample_clients(r)
        if self.download is None:
            for kind, tensors in self.downlink().items():
                self.send(r, self.recipients(clients), kind, *tensors)
        else:  # compressed downloads: the model billed at its encoded size, the rest of its message dense
            recipients = self.recipients(clients)
            for i, (kind, tensors) in enumerate(self.downlink().items()):
                dense = tensors[1:] if i == 0 else tensors  # the first message's first tensor is x_t
                nbytes = len(recipients) * _size(dense) + (
                    self.download.broadcast(r, recipients, self.x) if i == 0 else 0
                )
                self.ledger.record(r, "server", "client", kind, nbytes, len(recipients))
        sampled, clients = clients, self.reporting(r, clients)  # dropouts and stragglers deliver nothing
        if len(clients) and not self.holds_data[clients].any():
            # only clients without samples: there is no update, and a server step on the aggregate 0 would still
            # move FedAvgM's, FedAdam's or FedDyn's model (momentum, h) and zero FedCM's momentum. As a round
            # nobody reports, it leaves every state as it was
            clients = clients[:0]
        if self.clocked:
            self.now += self.round_time(r, sampled)
        self.nobody_reported = len(clients) == 0  # logged as skipped without faults too (no reported_clients)
        if len(clients) == 0:
            if self.secagg is not None:  # secure aggregation: its first stages ran before anybody dropped
                self.secagg.record(r, self.ledger, sampled, clients, 0)
            if self.privacy is not None and self.privacy.releases_empty_rounds:  # privacy: the noise alone, released
                none, lr = self.x.new_zeros(0, len(self.x)), self.trainer.lr(r)
                nobody = Collected(r, clients, lr, LocalResult(none, none[:, 0], none[:, 0]), {}, none[:, 0])
                self.server_update(self.aggregate(none, nobody.weights, clients), nobody)
            # nobody reported: all state stays as it was (privacy: see above); the clock still ran
            return {**self.fault_metrics(clients), **self.clock_metrics()}
        got = self.train_clients(r, clients)
        got = self.transmit_uploads(r, got)  # 2. compression: what the clients send, billed encoded
        if self.secagg is not None:  # secure aggregation: SecAgg+'s messages, the masked inputs among them
            self.secagg.record(r, self.ledger, sampled, got.clients, _elements(got))
        updates = self.client_updates(got)
        if self.robust is not None:  # 1. attack: Byzantine clients replace their (decoded) updates (robustness)
            center = self.x if self.updates_are_models else None
            updates = self.robust.attack(r, got.clients, updates, center, unsent=self.unsent())
        got.received = updates
        self.server_update(self.aggregate(updates, got.weights, got.clients), got)
        out = {**self.local_metrics(got.local, got.weights), **self.fault_metrics(clients)}
        out = {**out, **self.robust.metrics()} if self.robust is not None else out
        return {**out, **self.clock_metrics()}

    def round_time(self, r: int, sampled: np.ndarray) -> float:
        """How long synchronous round ``r`` lasts on the simulated clock: until the server has heard from every
        sampled client, under the asynchronous methods' latency model (:meth:`fedweave.faults.Faults.outcomes`,
        the same work units: :meth:`client_work`). A client that reports counts when its upload arrives, one
        that drops out when it would have reported (its connection closes), and the server waits at most
        ``faults.deadline``: the slowest of these ends the round. No sampled client (a sampler may give none):
        the round takes no time."""
        if len(sampled) == 0:
            return 0.0
        times, _ = self.faults.outcomes(r, sampled, self.client_work(r, sampled))
        return float(times.max())

    def clock_metrics(self) -> dict[str, float]:
        """``sim_time``, the simulated time at the end of the round, when the synchronous clock is on; else
        nothing (the rows stay as they were without it)."""
        return {"sim_time": self.now} if self.clocked else {}

    def start_metrics(self) -> dict[str, float]:
        """The initial model's row (``eval.at_start``) is at time 0 of the clock: every row has ``sim_time``, so
        the run keeps its plot against simulated time."""
        return self.clock_metrics()

    def transmit_uploads(self, r: int, got: Collected) -> Collected:
        """The reporting clients' uploads reach the server, recorded in the ledger: dense, or (stage 2 of the
        server pipeline, fedweave.compression) encoded, billed at their encoded size and decoded."""
        if self.secagg is not None:  # the masked inputs replace the dense uploads (billed by the SecAgg+ stage)
            return got
        if self.compression is None:
            self.receive(r, got.clients, self.uplink, *(tuple(got.upload.values()) or (got.local.params,)))
            return got
        got, nbytes = self.compression.upload(r, got.clients, self.x if got.start is None else got.start, got)
        self.ledger.record(r, "client", "server", self.uplink, nbytes, len(got.clients))
        return got

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """What the server sends each recipient this round: ledger kind -> tensors (one message each, in
        this order). FedAvg's: the global model."""
        return {"model": (self.x,)}

    def recipients(self, clients: np.ndarray) -> np.ndarray:
        """Who receives the round's messages: the sampled clients."""
        return clients

    def unsent(self) -> torch.Tensor | None:
        """The model's coordinates that no client's upload carries, ``(P,)`` bool (a personal part, a fixed head);
        None: the upload carries them all. An attacker sends what every client sends, so its row keeps its own
        values there (robustness)."""
        return None

    def client_rule(self, lr: float) -> LocalRule | ClientStep:
        """The local rule of the round's clients (their paper's client step), or a ``ClientStep`` for clients
        that keep state of their own (trained over ``self.store``). Plain local SGD by default (FedAvg)."""
        return PLAIN

    def client_starts(self, clients: np.ndarray) -> torch.Tensor | None:
        """Where each reporting client's local training starts, ``(n, P)``; None: from the global model x_t.
        Compressed downloads: the models the clients hold (compression). A method whose clients start elsewhere
        (their own models, their cluster's) overrides it."""
        return None if self.download is None else self.download.held(clients)

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        """Local training of the clients that report, from :meth:`client_starts` under :meth:`client_rule`."""
        lr = self.trainer.lr(r)
        rule = self.client_rule(lr)
        starts = self.client_starts(clients)
        start = self.x if starts is None else starts
        if isinstance(rule, ClientStep):
            local, upload = self.trainer.train_with_state(start, clients, r, rule, self.store, lr=lr)
        else:
            local, upload = self.trainer.train(start, clients, r, rule=rule, lr=lr), {}
        self.report_losses(r, clients, local.loss)
        return Collected(r, clients, lr, local, upload, self.weights(clients), start=starts)

    def report_losses(self, r: int, clients: np.ndarray, loss: torch.Tensor) -> None:
        """Under a sampler that reads the clients' context (``power_of_choice``, ``oort``): each reporting client's
        mean training loss reaches the server's :class:`ClientHistory`, which later rounds select by. The loss is
        protocol traffic then, one float of the run's width per reporting client, sent with its upload: billed as
        ``client->server:train_loss`` with no message of its own (count 0). The papers' candidates report a loss
        too (Cho et al. 2022: each of the d candidates its loss of x_t, a round trip that power_of_choice's
        ``pow-d`` and ``cpow-d`` take, :meth:`candidate_losses`); its default ``rpow-d`` ranks by the last one
        reported, as ``oort`` does. Under any other sampler the loss is the run's metric only, not billed."""
        if not self.sampler.reads_context:
            return
        self.client_history.record(r, clients, loss)  # a copy to the host: no trained number changes
        self.ledger.record(r, "client", "server", "train_loss", len(clients) * self.ctx.float_bytes, 0)

    def candidate_losses(self, candidates: np.ndarray, r: int, batch: int | None = None) -> np.ndarray:
        """The sampler context's ``loss_at_model``: each candidate's mean training loss of the global model x_t,
        power-of-choice's probe (Cho et al. 2022, Algorithm 1: the server sends w^(t) to the d candidates, each
        computes F_k(w^(t)) and sends it back). On the candidate's whole training data (pow-d), or on ``batch`` of
        its samples drawn without replacement from the ``("candidate_batch", r, client)`` stream (cpow-d; all
        of them where it holds fewer). Computed where each candidate would compute it (:meth:`client_losses`'s
        evaluation, the same on every backend) and returned as the float of the run's width it sends.

        Billed as the protocol moves it: x_t down to each candidate (``server->client:candidate_model``, one
        message each) and one loss float up each that answers (``client->server:candidate_loss``, a message of its
        own: the probe is a round trip before training). The selected candidates then train from the x_t they
        hold (Algorithm 1, line 5): the round's message still reaches them, without x_t (:meth:`send`). Like
        the other evaluations a client makes (AFL's and q-FFL's start losses, IFCA's cluster losses), the
        forward passes are not local steps: the clock's work units do not count them.

        Faults (docs/reliability.md): a candidate that drops out of round ``r`` (``faults.dropout``,
        ``faults.outage_rounds``) is unavailable for the whole round, the probe included: it was sent x_t and
        sends no loss back, NaN here, and the sampler selects among the candidates that answered. The probe takes
        no time on the clock (no local step), so ``faults.deadline`` does not cut it: a straggler answers, and if
        selected misses the deadline with its update as under any sampler.
        The sampler's check draw when the run is built (round 0, drawn once) is not a round: evaluated, not billed.
        """
        candidates = np.asarray(candidates)
        answers = ~self.faults.dropped(r, candidates) if self.faulty else np.ones(len(candidates), dtype=bool)
        asked = candidates[answers]  # a dropped candidate computes nothing
        parts = [self.ctx.partition[int(c)] for c in asked]
        if batch is not None:  # cpow-d: a mini-batch of b samples, keyed on (round, client) as the batches are
            rngs = [self.seeds.numpy("candidate_batch", r, int(c)) for c in asked]
            parts = [p if len(p) <= batch else p[g.choice(len(p), batch, replace=False)] for g, p in zip(rngs, parts)]
        tr, ev = self.trainer, self.config.eval
        out = np.full(len(candidates), np.nan)  # NaN: no answer
        if len(asked):
            task = self.ctx.task
            loss = evaluate_clients_task(self.layout, self.x, tr.train_x, tr.train_y, parts, task, ev.batch_size)
            sent = torch.as_tensor(loss["loss"], dtype=self.x.dtype, device="cpu")  # one float of the run's width
            # a loss that is not a number (a diverged model) is an answer all the same: -inf, so that NaN means only
            # "no answer"; it still ranks last, where the sort puts a NaN
            out[answers] = np.nan_to_num(sent.to(torch.float64).numpy(), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
        if self.sampler_built:
            n, k = len(candidates), len(asked)
            self.ledger.record(r, "server", "client", "candidate_model", n * _size((self.x,)), n)
            self.ledger.record(r, "client", "server", "candidate_loss", k * self.ctx.float_bytes, k)
            if self.probed is not None and self.probed[0] == r and torch.equal(self.probed[2], self.x):
                candidates = np.union1d(self.probed[1], candidates)  # a second probe of the round, same model
            self.probed = (r, candidates, self.x.clone())
        else:  # the check draw of make_sampler, before the run: the run is built knowing the sampler probes
            self.probes = True
        return out

    def client_updates(self, got: Collected) -> torch.Tensor:
        """Each reporting client's update, one row per client: what the server pipeline reduces.
        By default the local model's displacement ``y_i - x_t`` (as decoded, when the upload was compressed;
        from the model the client held, when the download was)."""
        if got.sent is not None:
            return got.sent
        return got.local.params - (self.x if got.start is None else got.start)

    def aggregate(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: np.ndarray | None = None
    ) -> torch.Tensor:
        """The server pipeline's reduction of the client updates to one: their weighted mean.

        The one place where the collected updates become the aggregate, so that the stages between them
        (DP clipping, robust aggregation, DP noise) plug in here, for every method at once. ``clients``: the ids
        of the updates' clients (DP-FTRL's accounting counts who took part in each leaf of its tree).
        """
        # privacy, stage 3: each client's update clipped; weights 1/E (DP-FedAvg). Level sample has no server stage
        # (its clients privatized every step), so a robust aggregator reduces the updates as without privacy
        if self.privacy is not None and self.config.privacy.level == "user":
            updates, weights = self.privacy.clip(updates, weights, clients)
            # privacy, stage 5: Gaussian noise on the sum, over E (DP-FTRL: the tree's increment); one release
            return self.privacy.noise(weights @ updates)
        if self.robust is not None:  # 4. reduction: the robust aggregator (robustness)
            return self.robust.aggregate(updates, weights, self.x if self.updates_are_models else None)
        return weights @ updates

    @abstractmethod
    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        """The method's server step from ``mean``, the aggregate of the client updates (``got``: the
        round's reporting clients and what they sent)."""

    def sample_clients(self, r: int) -> np.ndarray:
        """The sorted ids of round ``r``'s clients, from the run's sampler (the ``sampler`` section)."""
        return self.sampler(r)

    def client_losses(self, params: torch.Tensor, clients: np.ndarray | range) -> np.ndarray:
        """The task's loss of ``params`` (one vector, or a row per client) on each of ``clients``' whole training
        data, in float64: computed in simulation where each client would compute it on its own data (the data it
        trains on: a data-poisoning attacker's as poisoned, as its deployed node holds them)."""
        tr, ev = self.trainer, self.config.eval
        parts = [self.ctx.partition[int(c)] for c in clients]
        return evaluate_clients_task(self.layout, params, tr.train_x, tr.train_y, parts, self.ctx.task, ev.batch_size)[
            "loss"
        ]

    def start_losses(self, got: Collected) -> torch.Tensor:
        """Each reporting client's loss of the model it received (AFL's L_k(w_t), q-FFL's F_k(w^t)), in the run's
        dtype: as its node computed it on its data when deployed (``uploads_start_loss``), else here."""
        if got.local.start_loss is not None:
            return got.local.start_loss.to(dtype=self.sizes.dtype, device=self.sizes.device)
        return self.losses_at(self.x, got.clients)

    def losses_at(self, params: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """:meth:`client_losses` in the run's dtype, ``(len(clients),)`` (q-FFL's F_k(w^t), AFL's L_k(w))."""
        return torch.as_tensor(self.client_losses(params, clients), dtype=self.sizes.dtype, device=self.sizes.device)

    def client_steps(self, r: int, clients: np.ndarray) -> np.ndarray:
        """A client's local steps in a round: the trainer's (``local.steps``, or its epochs' batches; clients with
        more data are slower) and the method's other local SGD passes of the round (:meth:`personal_steps`)."""
        return np.array([self.trainer.num_steps(int(c)) + self.personal_steps(int(c)) for c in clients], np.float64)

    def personal_steps(self, client: int) -> int:
        """The local SGD steps ``client`` takes in a round besides the trainer's, on its personal model or head
        (Ditto's ``personal_epochs``, FedRep's ``head_epochs``, APFL's personal pass): 0 for a method with none.
        They are local work like the others, so the clock (``faults.work_unit``) times them too."""
        return 0

    def relative_work(self, steps: np.ndarray) -> np.ndarray:
        """Steps over the mean client's round (:attr:`mean_round_steps`)."""
        return steps / self.mean_round_steps

    @cached_property
    def mean_round_steps(self) -> int:
        """The unit ``round``'s reference: the rounded mean over the clients that hold training samples of their
        local steps and, for a method with :meth:`personal_steps`, those too, as :meth:`reference_steps` (the
        papers' K) counts them. A client without samples takes no step and is never dispatched by the
        asynchronous clock (``async_base``): its 0 would only shrink the mean client's round, the unit, and
        stretch every other client's time in it. Counted once over the population: a client's steps depend on
        its data and the config only, and the asynchronous clock asks at every dispatch."""
        ks = [
            self.trainer.num_steps(c) + self.personal_steps(c) for c in clients_with_data(self.ctx.partition).tolist()
        ]
        return max(1, round(sum(ks) / len(ks)))

    def weights(self, clients: np.ndarray) -> torch.Tensor:
        """Aggregation weights of the round's clients, summing to one."""
        return aggregation_weights(self.sizes, clients, self.hp.weighting)

    def send(self, r: int, clients: np.ndarray, kind: str, *per_client: torch.Tensor) -> None:
        """Server -> each client of ``clients``: the given tensors (their size is per client). A tensor equal to
        the model that round ``r``'s probe sent (power-of-choice's pow-d and cpow-d, :meth:`candidate_losses`) is
        not sent again to the candidates that hold it (Cho et al. 2022, Algorithm 1: the selected candidates
        train from the w^(t) they evaluated); they still get the message, with the rest of it. A model changed
        since the probe is another tensor: sent and billed again."""
        nbytes = len(clients) * _size(per_client)
        if self.probed is not None and self.probed[0] == r:
            _, holders, model = self.probed
            held = tuple(t for t in per_client if _same(t, model))
            nbytes -= int(np.isin(clients, holders).sum()) * _size(held)
        self.ledger.record(r, "server", "client", kind, nbytes, len(clients))

    def receive(self, r: int, clients: np.ndarray, kind: str, *per_client: torch.Tensor) -> None:
        """Each client of ``clients`` -> server: the given tensors (their size is per client)."""
        self.ledger.record(r, "client", "server", kind, len(clients) * _size(per_client), len(clients))

    def reference_steps(self) -> int:
        """K of the papers that normalize by it: local.steps, else E*ceil(n_i/B), the same for every client
        of a balanced split; for unbalanced splits the rounded mean over the clients that hold data (fedmim
        spec A5). K is the number of local steps an active client runs (FedCM Alg. 1's ``eta_l K`` of
        ``Delta_{t+1}``; the spec's §1): a client without samples (``partition.min_size: 0``) runs none, and its 0
        steps would only shrink K and inflate FedCM's momentum ``-Delta / (eta_l K)`` and FedMIM's deltas."""
        ks = [self.trainer.num_steps(c) for c in clients_with_data(self.ctx.partition).tolist()]
        return max(1, round(sum(ks) / len(ks)))

    def local_metrics(self, local: LocalResult, p: torch.Tensor) -> dict[str, float]:
        """Per-round metrics of the local results: the train loss weighted over the clients that trained
        (:meth:`~fedweave.execution.LocalResult.trained_loss`), optionally local consistency."""
        out = {"train_loss": local.trained_loss(p)}
        if self.hp.consistency:
            out["local_consistency"] = local_consistency(local.params)
        return out

    def evaluate(self, r: int) -> dict[str, float]:
        ds, ev, task = self.ctx.dataset, self.config.eval, self.ctx.task
        if not task.is_default:
            return self.evaluate_task(r)
        acc, loss = evaluate(self.layout, self.x, ds.test_x, ds.test_y, ev.batch_size)
        out = {"test_accuracy": acc, "test_loss": loss}
        if ev.personal_test or ev.distribution:  # the global model on each (evaluated) client's own test set
            tx, ty, parts = self.ctx.personal_test_set()
            parts, ids = self.evaluated(parts)
            accs, losses = evaluate_clients(self.layout, self.x, tx, ty, parts, ev.batch_size)
            if ev.personal_test:  # averaged over clients
                out = {
                    "test_accuracy": float(accs.mean()),
                    "test_loss": float(losses.mean()),
                    "test_accuracy_min": float(accs.min()),
                    "test_accuracy_global": acc,
                    "test_loss_global": loss,
                }
            if ev.distribution:
                out.update(self.client_distribution(r, {"accuracy": accs, "loss": losses}, ids))
        if ev.per_client:
            parts, _ = self.evaluated(self.ctx.partition)
            accs, _ = evaluate_clients(self.layout, self.x, ds.train_x, ds.train_y, parts, ev.batch_size)
            out["client_train_accuracy_mean"] = float(accs.mean())
        return {**out, **self.backdoor_metrics()}

    def backdoor_metrics(self) -> dict[str, float]:
        """Under a backdoor attack (robustness), the global model's ``test_backdoor_success``; else nothing."""
        if self.robust is None:
            return {}
        return self.robust.backdoor_metrics(self.layout, self.x, self.ctx.dataset, self.config.eval.batch_size)

    def evaluate_task(self, r: int) -> dict[str, float]:
        """Evaluation under any task: ``test_<metric>`` for each of the task's values, the loss included;
        with ``eval.personal_test`` their means over the clients' own test sets (and the worst client's
        main metric), with ``eval.per_client`` the mean of each client's main metric on its training data,
        with ``eval.distribution`` the spread of the main metric over the clients' own test sets."""
        ds, ev, task = self.ctx.dataset, self.config.eval, self.ctx.task
        glob = evaluate_task(self.layout, self.x, ds.test_x, ds.test_y, task, ev.batch_size)
        out = {f"test_{k}": v for k, v in glob.items()}
        if ev.personal_test or ev.distribution:
            tx, ty, parts = self.ctx.personal_test_set()
            parts, ids = self.evaluated(parts)
            per = evaluate_clients_task(self.layout, self.x, tx, ty, parts, task, ev.batch_size)
            if ev.personal_test:
                means, worst = client_means(per, task.main, task.direction)
                out = {f"test_{k}": v for k, v in means.items()}
                out[f"test_{task.main}_worst"] = worst
                out.update({f"test_{k}_global": v for k, v in glob.items()})
            if ev.distribution:
                out.update(self.client_distribution(r, per, ids))
        if ev.per_client:
            parts, _ = self.evaluated(self.ctx.partition)
            per = evaluate_clients_task(self.layout, self.x, ds.train_x, ds.train_y, parts, task, ev.batch_size)
            out[f"client_train_{task.main}_mean"] = client_means(per, task.main, task.direction)[0][task.main]
        return {**out, **self.backdoor_metrics()}

    def evaluated_ids(self) -> np.ndarray | None:
        """The clients whose per-client figures an evaluation averages (``eval.personal_test``,
        ``eval.distribution``, ``eval.per_client``, a personalized method's own models): every client (None) or,
        when the run has attackers, the honest ones, as Ditto reports accuracy on the benign devices (Li, Hu,
        Beirami & Smith 2021, Sec. 5) and the gossip family averages its honest peers."""
        return None if self.robust is None else self.robust.evaluated()

    def evaluated(self, parts: Sequence[np.ndarray]) -> tuple[Sequence[np.ndarray], np.ndarray | None]:
        """Of ``parts`` (one entry per client), the :meth:`evaluated_ids` clients' that hold a sample there
        (``parts`` itself when that is every client), and their ids."""
        ids = with_samples(parts, self.evaluated_ids())
        return (parts, None) if ids is None else ([parts[int(i)] for i in ids], ids)

    def client_distribution(
        self, r: int, per: dict[str, np.ndarray], ids: np.ndarray | None = None
    ) -> dict[str, float]:
        """``eval.distribution``: the spread over the clients (``ids``; None: all, in order) of the task's main
        metric on their own test sets (``client_test_<main>_mean``, ``_worst10``, ``_std``); every client's values
        are kept in :attr:`client_values` for the run directory's ``clients.jsonl``."""
        task = self.ctx.task
        self.client_values = {
            "round": r + 1,
            "metric": task.main,
            "direction": task.direction,
            "clients": list(range(len(per[task.main]))) if ids is None else [int(i) for i in ids],
            **{k: [float(x) for x in v] for k, v in per.items()},
        }
        spread = client_spread(per[task.main], task.direction, metric=task.main)
        return {f"client_test_{task.main}_{k}": v for k, v in spread.items()}


def _elements(got: Collected) -> int:
    # the values of one client's upload (what SecAgg+ masks): its upload's rows, else its model
    return sum(t[0].numel() if t.dim() == 2 else t.numel() for t in (tuple(got.upload.values()) or (got.local.params,)))


def _same(t: torch.Tensor, model: torch.Tensor) -> bool:
    # the same values as ``model`` (a client holding ``model`` holds ``t``)
    return t.shape == model.shape and t.dtype == model.dtype and t.device == model.device and torch.equal(t, model)


def _size(tensors: tuple[torch.Tensor, ...]) -> int:
    # one client's message; a tensor with a leading client axis counts one row
    return sum((t[0] if t.dim() == 2 else t).numel() * t.element_size() for t in tensors)
