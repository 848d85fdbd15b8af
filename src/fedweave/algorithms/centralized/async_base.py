"""The asynchronous star protocol: an event-driven server on the simulated clock, the base of FedAsync
(``fedasync.py``, Xie et al. 2019) and FedBuff (``fedbuff.py``, Nguyen et al. 2022).

The server keeps ``concurrency`` clients training at once. A client dispatched at simulated time ``s`` with
the server's model ``x_tau`` (server step ``tau``) reports at ``s + d``, where ``d`` is the latency model of
injected faults (:meth:`fedweave.faults.Faults.arrival_times`: its local work in the clock's unit, relative to
the mean round of the clients that hold data or, under ``faults.work_unit: step``, its local steps, times
``exp(speed_sigma z_i + speed_jitter z_{i,b})``). Events are processed in the order (time, dispatch order):
at each instant the arrivals come first, each one updating the server as its method says; once the instant's
arrivals are in, the free slots are filled with clients drawn uniformly from the idle ones with data (the
``("client_sampling", b)`` stream of the ``b``-th dispatch), which train from the current model. One call of
``run_round`` is one server step; its metrics carry ``sim_time`` (the simulated time of the step) and the
staleness ``t - tau`` of the updates it used. Updates staler than ``max_staleness`` are discarded on
arrival: they were sent, so the ledger counts them and a compressing client's residual advances as for any other.

Staleness weighting ``s(t - tau)`` (FedAsync Sec. 5.2): ``constant`` 1; ``polynomial`` ``(1 + t - tau)^-a``;
``hinge`` 1 if ``t - tau <= b`` else ``1 / (a (t - tau - b) + 1)``.

Injected faults (docs/reliability.md), drawn per dispatch instant ``b`` and client: a client that drops out
(``faults.dropout``) received the model and delivers nothing; the server learns it when the client would have
reported (its connection closes), and the slot is free again from then. With ``faults.deadline`` (policy
``drop``) the server abandons a job still out ``deadline`` after its dispatch and frees its slot then; its
upload is never received. Neither kind trains: a lost job's result could not reach the server. Both are
events of the log (``drop``, ``timeout``), and a server step waits for ``buffer_size`` uploads that arrive.

- FedAsync (Alg. 1, "Updater"): every arrival is a server step ``x <- (1 - alpha_t) x + alpha_t y_i`` with
  ``alpha_t = alpha s(t - tau)``; its clients ("Worker") minimize ``f_i(y) + (rho/2) ||y - x_tau||^2``.
- FedBuff (Alg. 1): arrivals ``Delta_i = y_i - x_tau`` fill a buffer of ``buffer_size``; when it is full,
  ``x <- x + eta_g sum_i p_i s(t - tau_i) Delta_i`` with ``p_i`` the aggregation weights over the buffer
  (``weighting``: samples or uniform, the paper's 1/K). With buffer = concurrency = clients_per_round, equal
  latencies and constant weighting this is synchronous FedAvg, draw for draw.

The order of events is recorded and written to ``events.csv`` in the run directory.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, fields
from itertools import islice
from types import SimpleNamespace
from typing import ClassVar, Literal

import numpy as np
import torch

from fedweave.algorithms.centralized.base import StarAlgorithm, StarHparams
from fedweave.config import ConfigError, Section
from fedweave.errors import DivergenceError

EVENTS_FILE = "events.csv"
EVENT_COLUMNS = ("time", "event", "client", "job", "version", "server_step")
# dispatches in a row that deliver nothing (dropped or past the deadline) before a run stops: the faults leave
# no client that reports, and the simulated clock would run forever
MAX_LOST_IN_A_ROW = 10_000
# the state of the schedule, which :meth:`AsyncStar.schedule` advances: the simulated time, the dispatch instants
# and jobs so far, the jobs in flight and those of them that deliver nothing, the jobs lost in a row
CLOCK_FIELDS = ("now", "dispatches", "jobs", "in_flight", "lost", "lost_in_a_row")


def check_results(r: int, clients: np.ndarray, params: torch.Tensor, loss: torch.Tensor) -> None:
    """Raise :class:`DivergenceError` naming server step ``r`` (0-based) when a job's local model (a row of
    ``params``) or loss holds NaN or Inf. Such a result would sit in flight until it arrives, possibly after the
    run's last step, and in every checkpoint until then; it ends the run at the step that made it instead, as a
    synchronous round's does."""
    finite = torch.isfinite(params).all(1) & torch.isfinite(loss).to(params.device)
    if not bool(finite.all()):
        bad = clients[~finite.cpu().numpy()].tolist()
        raise DivergenceError(
            f"round {r + 1}: the local training of client{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} "
            "(dispatched in this server step) is not finite (NaN or Inf in its model or loss); the run stopped."
        )  # the runner adds which step sizes to lower (fedweave.runner.divergence_advice)


def staleness_weight(kind: str, tau: int, a: float, b: int) -> float:
    """``s(tau)`` of FedAsync Sec. 5.2: constant, polynomial ``(1 + tau)^-a`` or hinge (1 up to ``b``)."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + tau) ** -a)
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


@dataclass
class AsyncHparams(StarHparams):
    concurrency: int | None = None  # clients training at once; null: clients_per_round
    max_staleness: int | None = None  # updates staler than this many server steps are discarded; null: none
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    staleness_a: float = 0.5  # the exponent a (polynomial) or slope a (hinge)
    staleness_b: int = 4  # the hinge's b: no discount up to b steps

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"algorithm.concurrency must be >= 1 or null, got {self.concurrency}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"algorithm.max_staleness must be >= 0 or null, got {self.max_staleness}")
        if self.staleness_a < 0:
            raise ConfigError(f"algorithm.staleness_a must be >= 0, got {self.staleness_a}")
        if self.staleness_b < 0:
            raise ConfigError(f"algorithm.staleness_b must be >= 0, got {self.staleness_b}")
        # an option the chosen s(t - tau) does not read is refused unless left at its default, never ignored
        unread = {"constant": ("staleness_a", "staleness_b"), "polynomial": ("staleness_b",)}.get(self.staleness, ())
        for key in unread:
            if getattr(self, key) != _DEFAULTS[key]:
                raise ConfigError(
                    f"algorithm.{key}: staleness '{self.staleness}' does not read it (polynomial reads staleness_a, "
                    "hinge staleness_a and staleness_b); leave it out or choose that staleness"
                )


_DEFAULTS = {f.name: f.default for f in fields(AsyncHparams)}


class AsyncStar(StarAlgorithm):
    """The event-driven server of the asynchronous methods; a method fills in :meth:`apply`."""

    Hparams = AsyncHparams
    # its clients' latencies are the simulation itself; a straggler that arrives late is the normal case (its
    # staleness), so only a deadline that drops it is a fault
    handles_faults: ClassVar[tuple[str, ...]] = ("dropout", "deadline")
    asynchronous: ClassVar[bool] = True  # the deployment refuses it (fedweave.deploy.support)
    buffer_size: int = 1
    state_fields = (*StarAlgorithm.state_fields, "now", "dispatches", "jobs", "events", "in_flight", "starts", "ys")
    state_fields += ("lost", "lost_in_a_row")

    def __init__(self, ctx, hp: AsyncHparams) -> None:
        if hp.concurrency is not None:
            if hp.concurrency > ctx.num_clients:
                raise ConfigError(
                    f"algorithm.concurrency ({hp.concurrency}) exceeds partition.num_clients ({ctx.num_clients})"
                )
            if hp.clients_per_round > ctx.num_clients:
                # no round samples clients here: clients_per_round is only the default of concurrency, so its
                # default (10) must not refuse a run of fewer clients that sets concurrency; a training call
                # holds at most concurrency jobs
                hp.clients_per_round = hp.concurrency
        super().__init__(ctx, hp)
        if ctx.config.sampler != Section("uniform") or hp.sampling != "fixed":
            raise ConfigError(
                f"sampler: {self.name} dispatches each free slot to a client drawn uniformly from the idle ones; "
                "leave the sampler section and algorithm.sampling out"
            )
        if hp.consistency:
            raise ConfigError(
                f"algorithm.consistency: {self.name} has no round of local models to compare; leave it out"
            )
        faults = ctx.config.faults
        if faults.outage_rounds:
            waits = "buffer_size uploads" if hasattr(hp, "buffer_size") else "one upload"  # fedasync has no buffer
            raise ConfigError(
                f"faults.outage_rounds: {self.name} has no round that every client misses (a server step waits for "
                f"{waits}); inject faults.dropout or faults.deadline instead"
            )
        if faults.dropout >= 1.0:
            raise ConfigError(
                f"faults.dropout must be < 1 for {self.name}: with 1 no client ever reports, and a server step "
                "waits for its uploads"
            )
        self.concurrency = hp.concurrency or hp.clients_per_round
        # only a client with training samples is dispatched: one without would arrive at once with the model it
        # was sent, and its null upload would take a server step (pulling a stale start back into the model)
        self.holders = np.flatnonzero(self.sizes.cpu().numpy() > 0)
        if self.concurrency > len(self.holders):
            key = "concurrency" if hp.concurrency is not None else "clients_per_round"
            raise ConfigError(
                f"algorithm.{key} ({self.concurrency}) exceeds the {len(self.holders)} clients with training samples "
                f"({ctx.num_clients - len(self.holders)} of partition.num_clients = {ctx.num_clients} hold none): "
                f"lower it or raise partition.min_size"
            )
        self.now = 0.0  # the simulated clock
        self.dispatches = 0  # dispatch instants so far (the key of their streams and batches)
        self.jobs = 0  # clients dispatched so far (a job's id)
        self.events: list[list] = []  # the event log, rows of EVENT_COLUMNS
        # the jobs in flight, [arrival, job, client, version]: a heap, so the next arrival is first
        self.in_flight: list[list] = []
        # each job's start model x_tau and local result y_i (and its loss), by job id
        self.starts: dict[int, torch.Tensor] = {}
        self.ys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lost: dict[int, str] = {}  # the jobs in flight that deliver nothing: job id -> "drop" or "timeout"
        self.lost_in_a_row = 0  # jobs lost since the last upload that arrived
        # what the protocol keeps on the server: per client in flight the version tau of the model it was sent,
        # which its upload's staleness t - tau reads (an int64 each; FedAsync Alg. 1's "Updater" and FedBuff
        # Alg. 1 keep no more per client: the upload carries the model or the displacement, so the server does
        # not hold x_tau). ``starts`` and ``ys`` are the simulation's stand-in for the clients' own memory.
        self.ledger.store("server", "in_flight_versions", self.concurrency * np.dtype(np.int64).itemsize)

    def reduced_per_round(self) -> tuple[int, ...]:
        return (1,)  # a server step takes one arrival (FedBuff's: one buffer of them)

    # ---- the simulated clock ---------------------------------------------------------------------
    def dispatch(self, r: int) -> None:
        """Fill the free slots at the current time (:meth:`launch`); the clients that will deliver train from the
        current model, in one training call for the instant."""
        if (launched := self.launch(r, self)) is None:
            return
        b, clients, lost, jobs = launched
        self.send(r, clients, "model", self.x)
        kept = lost == ""
        lr = self.trainer.lr(r)
        local = self.trainer.train(self.x, clients[kept], b, rule=self.client_rule(lr), lr=lr) if kept.any() else None
        if local is not None:
            check_results(r, clients[kept], local.params, local.loss)
        row = np.cumsum(kept) - 1  # each kept client's row of the training call
        for j, (c, job) in enumerate(zip(clients.tolist(), jobs)):
            if kept[j]:
                self.starts[job] = self.x
                self.ys[job] = (local.params[row[j]], local.loss[row[j]])
            self.events.append([self.now, "dispatch", c, job, r, r])

    def launch(self, r: int, clock: AsyncStar | SimpleNamespace) -> tuple[int, np.ndarray, np.ndarray, range] | None:
        """Fill the free slots of ``clock`` at its time with clients drawn uniformly from the idle ones holding
        training samples, as jobs in flight that end as the latency model and the faults say: ``(b, clients, lost,
        jobs)`` of dispatch instant ``b``, or None when no slot is free. A function of the seed, the jobs in flight
        and the clients' work only, never of the model or the data's values, so that a copy of the clock can run
        ahead of the training."""
        busy = {job[2] for job in clock.in_flight}
        free = self.concurrency - len(busy)
        if free <= 0:
            return None
        b = clock.dispatches
        idle = np.array([c for c in self.holders.tolist() if c not in busy])
        clients = np.sort(self.seeds.numpy("client_sampling", b).choice(idle, free, replace=False))
        # the faults of this dispatch instant (docs/reliability.md): a dropped client is lost when it would have
        # reported, one past the deadline when the deadline passes; only the others train
        durations, lost = self.faults.outcomes(b, clients, self.client_work(b, clients))
        jobs = range(clock.jobs, clock.jobs + len(clients))
        for job, c, d, why in zip(jobs, clients.tolist(), durations.tolist(), lost.tolist()):
            heapq.heappush(clock.in_flight, [clock.now + d, job, c, r])
            if why:
                clock.lost[job] = why
        clock.dispatches += 1
        clock.jobs += len(clients)
        return b, clients, lost, jobs

    def schedule(self, r: int, clock: AsyncStar | SimpleNamespace) -> Iterator[tuple[str, list]]:
        """The jobs that end during server step ``r`` in the order of events, each ``[arrival, job, client,
        version]`` with how it ended: ``drop`` or ``timeout`` (nothing arrives; its slot is free from then),
        ``discard`` (staler than ``max_staleness``) or ``arrive``; it ends after ``MAX_LOST_IN_A_ROW`` lost in a
        row. It advances ``clock`` (its ``CLOCK_FIELDS``): the run's, the algorithm itself, whose free slots
        :meth:`dispatch` fills and trains, or a copy that looks ahead, whose slots :meth:`launch` alone fills."""
        while clock.lost_in_a_row < MAX_LOST_IN_A_ROW:
            if not clock.in_flight or clock.in_flight[0][0] > clock.now:  # the instant's arrivals are all in
                if clock is self:
                    self.dispatch(r)
                else:
                    self.launch(r, clock)
            job = heapq.heappop(clock.in_flight)  # [arrival, job id, client, version]
            clock.now = job[0]
            if job[1] in clock.lost:
                clock.lost_in_a_row += 1
                yield clock.lost.pop(job[1]), job
            else:
                clock.lost_in_a_row = 0
                stale = self.hp.max_staleness is not None and r - job[3] > self.hp.max_staleness
                yield ("discard" if stale else "arrive"), job

    def upcoming_clients(self, r: int) -> np.ndarray:
        """The clients whose uploads server step ``r`` (the next one) will use, one entry per upload: the
        :meth:`schedule` of :meth:`next_arrival` on a copy of the clock, training no one (DP-FedBuff's budget looks
        ahead with it); fewer where it meets ``MAX_LOST_IN_A_ROW`` lost jobs, at which the run itself stops."""
        ahead = SimpleNamespace(**{k: copy.deepcopy(getattr(self, k)) for k in CLOCK_FIELDS})
        arrivals = (client for how, (_, _, client, _) in self.schedule(r, ahead) if how == "arrive")
        return np.array(list(islice(arrivals, self.buffer_size)), dtype=np.int64)

    def next_arrival(self, r: int) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next upload to arrive (dispatching first when the current instant's arrivals are all in): its
        client, staleness, displacement ``y_i - x_tau`` and model ``y_i`` as the server decodes them, and the
        local loss."""
        for how, (_, job, client, version) in self.schedule(r, self):
            self.events.append([self.now, how, client, job, version, r])
            if how in ("drop", "timeout"):  # nothing arrives: the slot is free from now
                continue
            start, (y, loss) = self.starts.pop(job), self.ys.pop(job)
            # a discarded upload crossed the link too, before the server read its staleness: it is billed, and under
            # error feedback the client's residual advances, whether the server keeps it or not (the client cannot know)
            delta = y - start  # the client's displacement from the model it started from
            if self.compression is None:
                self.receive(r, np.array([client]), self.uplink, y)
            else:  # stage 2 of the server pipeline: the displacement travels; the job id keys its draws
                sent, nbytes = self.compression.transmit(job, np.array([client]), 0, "update", delta.unsqueeze(0))
                self.ledger.record(r, "client", "server", self.uplink, nbytes, 1)
                delta, y = sent[0], start + sent[0]
            if how == "arrive":
                return client, r - version, delta, y, loss
        f = self.faults.config
        raise ConfigError(
            f"faults: {self.lost_in_a_row:,} dispatches in a row delivered nothing (faults.dropout = {f.dropout}, "
            f"faults.deadline = {f.deadline}): no client reports; lower the dropout or raise the deadline"
        )

    def run_round(self, r: int) -> dict[str, float]:
        """One server step: the next ``buffer_size`` fresh-enough uploads, in the order they arrive."""
        got = [self.next_arrival(r) for _ in range(self.buffer_size)]
        clients = np.array([g[0] for g in got])
        taus = [g[1] for g in got]
        hp = self.hp
        s = torch.tensor(
            [staleness_weight(hp.staleness, t, hp.staleness_a, hp.staleness_b) for t in taus],
            dtype=self.x.dtype,
            device=self.x.device,
        )
        weights = self.weights(clients)
        losses = torch.stack([g[4] for g in got])
        if self.robust is not None:  # a robust aggregator's bucketing draws from this server step's stream
            self.robust.at_round(r)
        self.apply(torch.stack([g[2] for g in got]), torch.stack([g[3] for g in got]), weights, s, clients)
        self.events.append([self.now, "update", -1, -1, r + 1, r])  # version: the model the step makes
        return {
            "train_loss": float(weights @ losses.to(weights.dtype)),
            "sim_time": self.now,
            "staleness_mean": float(np.mean(taus)),
            "staleness_max": float(max(taus)),
        }

    def evaluate(self, r: int) -> dict[str, float]:
        """The star's evaluation; the initial model's (``eval.at_start``, ``r = -1``) is at time 0 of the clock,
        so its row has ``sim_time`` like every other and the run keeps its plot against simulated time."""
        out = super().evaluate(r)
        if r < 0:
            out["sim_time"] = self.now
        return out

    def apply(
        self, deltas: torch.Tensor, models: torch.Tensor, weights: torch.Tensor, s: torch.Tensor, clients: np.ndarray
    ) -> None:
        """The method's server step from the uploads (rows: ``y_i - x_tau`` and ``y_i``), their aggregation
        weights and staleness weights; ``clients``: whose upload each row is (DP-FedBuff's accounting counts
        them)."""
        raise NotImplementedError

    def server_update(self, mean, got) -> None:  # the step is :meth:`apply`, per buffer of arrivals
        raise NotImplementedError

    def run_files(self) -> dict[str, str]:
        """``events.csv``: every dispatch, arrival, discard and server update, in the order they happened."""
        lines = [",".join(EVENT_COLUMNS)]
        lines += [f"{t!r},{e},{c},{j},{v},{s}" for t, e, c, j, v, s in self.events]
        return {EVENTS_FILE: "\n".join(lines) + "\n"}
