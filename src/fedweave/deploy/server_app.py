"""The Flower ``ServerApp``: fedweave's runner drives the algorithm; every client job is a Flower
``Message`` to the SuperNode that holds the client's data (docs/deployment.md).

Run config keys of the app (``[tool.flwr.app.config]``, written by ``fedweave flower-app``):
``fedweave-config`` (the run config as JSON), ``run-dir`` (the results directory; empty: the config's),
``reply-timeout`` (seconds a round waits for its replies), ``node-wait`` (seconds to wait for the
SuperNodes holding the run's clients to connect) and ``on-error`` (``stop`` or ``drop``: what a client's
error reply, or a reply that does not come, does to the run).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.common import log as flwr_log
from flwr.serverapp import Grid, ServerApp

from fedweave.algorithms.base import Algorithm
from fedweave.callbacks import Callback, RunState
from fedweave.config import ConfigError, RunConfig
from fedweave.config import load as load_config
from fedweave.deploy import compressed, secure, split, support
from fedweave.deploy.jobs import encode_job
from fedweave.deploy.node_state import INITIAL
from fedweave.deploy.wire import from_records, payload_bytes, pushed_bytes, to_records, tree_bytes, wire_bytes
from fedweave.errors import RunStopped
from fedweave.execution.dpsgd import DPSGD, PrivateTrainer
from fedweave.execution.job import LR, PLAIN, ClientStep, LocalCall, LocalResult, reindexed
from fedweave.execution.local import LocalTrainer
from fedweave.execution.state import StateStore
from fedweave.results import RunDirError, atomic_write

log = logging.getLogger("fedweave")
POLL = 0.25  # seconds between two looks for replies


class DeploymentError(RuntimeError):
    """The federation cannot run: no SuperNode holds a client, or a node answers the start-up query badly."""


class RunFailed(RuntimeError):
    """What the ServerApp raises when fedweave stopped or refused the run: Flower then records the run as
    failed (``flwr list``: ``finished:failed``, this message as its status details) and logs it."""


class ClientsLost(RuntimeError):
    """Some jobs of a call got an error reply or no reply in time: ``reasons[client]`` says why; ``unsent``:
    the clients whose job was never sent (no node holding them was connected)."""

    def __init__(self, round: int, reasons: dict[int, str], unsent: set[int] = frozenset()) -> None:
        self.round, self.reasons, self.unsent = round, reasons, set(unsent)
        first = ", ".join(f"client {c}: {why}" for c, why in sorted(reasons.items()))
        super().__init__(f"round {round + 1}: {first}")


def _without(clients, gone: set[int] | None) -> np.ndarray:
    """``clients`` (order kept) without those of ``gone`` (a round's lost or unsent clients; None: none)."""
    clients = np.asarray(clients)
    return clients[~np.isin(clients, sorted(gone))] if gone else clients


def _digest(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class FlowerClients(Callback):
    """The run's clients as SuperNodes: which node holds which client, the replies of the round, the
    version of each client's state the server accepted, and the bytes exchanged."""

    def __init__(self, grid: Grid, *, reply_timeout: float, node_wait: float, on_error: str = "stop") -> None:
        if on_error not in support.POLICIES:
            raise ConfigError(f"on-error must be one of {', '.join(support.POLICIES)}, got {on_error!r}")
        self.grid, self.reply_timeout, self.node_wait, self.on_error = grid, reply_timeout, node_wait, on_error
        self.node_of: dict[int, int] = {}  # client -> node id
        self.asked: dict[str, int] = {}  # start-up queries waiting for their reply: message id -> node id
        self.queried: set[int] = set()  # nodes asked once
        self.query_errors: dict[int, str] = {}  # node id -> why it did not answer the query
        self.num_clients = 0  # the run's clients, which ``discover`` sets before any answer is taken
        self.samples: dict[int, int] = {}  # client -> sample count of a node that holds its own data
        self.accepted: dict[int, int] = {}  # client -> round of its state version the server used
        self.replies: dict[str, Message] = {}  # this round's good replies, by job digest
        self.replies_round = -1
        self.dropped: dict[int, set[int]] = {}  # round -> clients the run went on without
        self.unsent: dict[int, set[int]] = {}  # round -> dropped clients whose job was never sent
        self.bytes_sent = self.bytes_received = self.payload_sent = self.payload_received = self.messages = 0
        self.tree_sent = self.tree_received = self.bytes_pushed = 0  # tree_bytes: before Flower's deduplication
        self.jobs = 0  # train messages sent (the start-up queries and the replies are in ``messages`` only)

    # ---- which node holds which client -----------------------------------------------------------
    def _ask_new_nodes(self) -> None:
        new = [n for n in self.grid.get_node_ids() if n not in self.queried]
        msgs = [Message(to_records({}, {}), dst_node_id=n, message_type="query") for n in new]
        for msg_id, m in zip(self.push(msgs), msgs, strict=True):
            self.asked[msg_id] = m.metadata.dst_node_id
        self.queried.update(new)

    def _collect_answers(self) -> None:
        if not self.asked:
            return
        for reply in self.pull(list(self.asked)):
            node = self.asked.pop(reply.metadata.reply_to_message_id)
            if reply.has_error():  # e.g. a node without partition-id, or one that died before answering
                self.query_errors[node] = reply.error.reason
                log.warning("SuperNode %d did not say which client it holds: %s", node, reply.error.reason)
                continue
            header, _ = from_records(reply.content)
            answer = json.loads(header)
            client = int(answer["partition"])
            if self.num_clients and not 0 <= client < self.num_clients:  # a typo: name it beside the missing client
                why = f"partition-id {client} is not a client of the run (0 .. {self.num_clients - 1})"
                self.query_errors[node] = why
                log.warning("SuperNode %d holds no client of the run: %s", node, why)
                continue
            if "samples" in answer:
                self.samples[client] = int(answer["samples"])
            if client in self.node_of and self.node_of[client] != node:
                log.info("client %d is now held by SuperNode %d (was %d)", client, node, self.node_of[client])
            self.node_of[client] = node

    def discover(self, num_clients: int) -> None:
        """Ask every connected node which client it holds, until all ``num_clients`` are held."""
        self.num_clients = num_clients
        deadline = time.monotonic() + self.node_wait
        while True:
            self._ask_new_nodes()
            self._collect_answers()
            missing = sorted(set(range(num_clients)) - set(self.node_of))
            if not missing:
                return
            if time.monotonic() > deadline:
                errors = "".join(f"; node {n}: {why}" for n, why in self.query_errors.items())
                raise DeploymentError(
                    f"no SuperNode holds clients {missing} after waiting {self.node_wait:.0f} s{errors}"
                )
            time.sleep(POLL)

    def release(self) -> None:
        """At the run's end, a query ``{"release": true}`` to every connected node that holds a client, which
        removes every file the run wrote on the node (``client_app.query``: its client's state versions, split
        turns, a trial's samples, error-feedback residuals); without it they built up, run after run, in a
        long-lived node's state directory. Waits for the answers up to ``node_wait`` (or ``reply_timeout``, if
        shorter) seconds; a node that does not answer keeps its files, with a warning. The wait is not cut
        shorter: a node runs one message at a time, so a healthy node answers only once it has finished the job
        it is running (one this run stopped waiting for, or another run's), and it ignores the release once the
        run has ended."""
        online = set(self.grid.get_node_ids())
        nodes = sorted({n for n in self.node_of.values() if n in online})
        gone = sorted(c for c, n in self.node_of.items() if n not in online)
        if gone:  # not asked: their nodes keep this run's files, which the user may want to remove
            log.warning("the SuperNodes of clients %s are not connected at the run's end; they keep the files of "
                        "this run in their state directories", gone)  # fmt: skip
        msgs = [Message(to_records({"release": True}, {}), dst_node_id=n, message_type="query") for n in nodes]
        pending = set(self.push(msgs))
        deadline = time.monotonic() + min(self.node_wait, self.reply_timeout)
        while pending and time.monotonic() < deadline:
            for reply in self.pull(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    log.warning("a SuperNode kept files of this run: %s", reply.error.reason)
            if pending:
                time.sleep(POLL)
        if pending:
            log.warning("%d SuperNode(s) did not answer the release at the run's end; they keep the files of this "
                        "run in their state directories", len(pending))  # fmt: skip

    def refresh(self) -> None:
        """Between calls: ask nodes that connected since (a restarted node rejoins under a new id) without
        waiting for them, and take the answers that came in."""
        self._ask_new_nodes()
        self._collect_answers()

    # ---- messages --------------------------------------------------------------------------------
    def push(self, msgs: list[Message]) -> list[str]:
        if not msgs:
            return []
        self.bytes_sent += sum(wire_bytes(m) for m in msgs)
        self.tree_sent += sum(tree_bytes(m) for m in msgs)
        self.bytes_pushed += pushed_bytes(msgs)
        self.payload_sent += sum(payload_bytes(m) for m in msgs)
        self.messages += len(msgs)
        self.jobs += sum(m.metadata.message_type == "train" for m in msgs)
        return list(self.grid.push_messages(msgs))

    def pull(self, ids: list[str]) -> list[Message]:
        replies = list(self.grid.pull_messages(ids))
        self.bytes_received += sum(wire_bytes(m) for m in replies)
        self.tree_received += sum(tree_bytes(m) for m in replies)
        self.payload_received += sum(payload_bytes(m) for m in replies)
        self.messages += len(replies)
        return replies

    def run_jobs(self, round: int, jobs: list[tuple[int, dict, dict[str, torch.Tensor]]]) -> list[Message]:
        """Each ``(client, header, tensors)`` job as one ``train`` message to its client's node; returns the
        replies in job order, or raises :class:`ClientsLost` naming the jobs without a good reply. A job
        already answered in this round (the round is computed again without a lost client) is not sent."""
        if round != self.replies_round:
            self.replies, self.replies_round = {}, round
        self.refresh()
        online = set(self.grid.get_node_ids())
        keys = [_digest(h, t) for _, h, t in jobs]
        lost: dict[int, str] = {}
        unsent: set[int] = set()
        sent: dict[str, int] = {}
        msgs = []
        for k, (c, header, tensors) in enumerate(jobs):
            if keys[k] in self.replies:
                continue
            node = self.node_of.get(c)
            if node is None or node not in online:
                lost[c] = "no SuperNode holding it is connected"
                unsent.add(c)
                continue
            msgs.append(Message(to_records(header, tensors), dst_node_id=node, message_type="train"))
            sent[keys[k]] = c
        pending = dict(zip(self.push(msgs), sent, strict=True))  # message id -> job digest
        node_was = {key: self.node_of[c] for key, c in sent.items()}
        deadline = time.monotonic() + self.reply_timeout
        next_look = time.monotonic() + 1.0
        while pending and time.monotonic() < deadline:
            for reply in self.pull(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is None:
                    continue
                if reply.has_error():
                    lost[sent[key]] = f"error {reply.error.code}: {reply.error.reason}"
                else:
                    self.replies[key] = reply
            if pending and time.monotonic() > next_look:
                # a node that restarted joins under a new id: the job sent to its old self is lost
                self.refresh()
                next_look = time.monotonic() + 1.0
                for msg_id, key in list(pending.items()):
                    if self.node_of.get(sent[key]) != node_was[key]:
                        lost[sent[key]] = "its SuperNode restarted (it joined again under a new id)"
                        del pending[msg_id]
            if pending:
                time.sleep(POLL)
        for key in pending.values():
            lost[sent[key]] = f"no reply in {self.reply_timeout:g} s"
        if lost:
            raise ClientsLost(round, lost, unsent)
        return [self.replies[k] for k in keys]

    # ---- the algorithm ---------------------------------------------------------------------------
    def on_build(self, run: RunState) -> None:
        """The run's callback: attach its algorithm before anything is written."""
        self.attach(run.algo)

    def attach(self, algo: Algorithm) -> None:
        """Make ``algo``'s local trainer send its jobs to the nodes and apply the error policy to its rounds."""
        why = support.unsupported(algo.name, algo.family, self.on_error) or support.undeployable_parts(algo.config)
        if why is not None:  # fedweave flower-app refuses these already; --run-config may change on-error
            raise DeploymentError(why)
        _log_progress(algo)
        if algo.family == "split":  # the clients' side of each method on their nodes
            split.attach(self, algo)
            self._apply_policy(algo)
            self.discover(algo.ctx.num_clients)
            self.check_samples([len(p) for p in algo.ctx.partition])
            return
        trainer = getattr(algo, "trainer", None)
        if trainer is None:
            raise DeploymentError(f"algorithm {algo.name!r} ({algo.family}) has no local trainer to deploy")
        remote = self.remote(trainer, algo)
        remote.secure = secure.SecureAggregation.of(algo, self, ClientsLost)  # Flower's SecAgg+ (None: no section)
        num_clients = len(trainer.parts)
        if algo.family == "hierarchical":  # the server's own share trains here (its job m), not on a node
            num_clients = algo.m
            remote.server_jobs = {algo.server_job}
        elif algo.family == "decentralized":
            # the ServerApp relays the gossip: it keeps each peer's model between rounds (what the peer sent its
            # neighbours) and mixes; the peers train on their nodes, also for the fine-tuning before evaluation
            algo.ft_trainer = self.remote(algo.ft_trainer, algo)
        elif getattr(algo, "store", None) is not None:
            algo.store = None  # the clients' own state lives on their nodes, not in the server
        remote.start_loss = getattr(algo, "uploads_start_loss", False)  # AFL, q-FFL: each node's loss of its start
        algo.trainer = remote
        compressed.attach(self, algo, ClientsLost)  # compression.upload: the nodes encode, the server decodes
        self._apply_policy(algo)
        self.discover(num_clients)
        self.check_samples([len(p) for p in trainer.parts[:num_clients]])

    def remote(self, trainer: LocalTrainer, algo: Algorithm) -> FlowerTrainer:
        """``trainer`` with its jobs sent to the nodes (its settings travel in each job). A DP-SGD trainer
        (privacy.level sample, its accounting) stays one: its ``train`` wraps each call's rule in DP-SGD, whose
        ``(clip, sigma)`` the jobs carry, and counts the steps the nodes report."""
        cls = type(trainer)
        if cls is not LocalTrainer and not issubclass(cls, PrivateTrainer):  # its own code would not travel
            raise DeploymentError(f"algorithm {algo.name!r}: its {cls.__name__} cannot be deployed yet")
        cls = FlowerTrainer if cls is LocalTrainer else _on_flower(cls)
        remote = cls.__new__(cls)
        remote.__dict__.update(trainer.__dict__)
        remote.backend, remote.clients, remote.here, remote.server_jobs = "flower", self, trainer, set()
        remote.num_classes = algo.ctx.dataset.num_classes  # what a node with its own data builds its model for
        dp = getattr(algo, "privacy", None)
        if getattr(dp, "trainer", None) is trainer:  # the accountant reads the steps this trainer counts
            dp.trainer = remote
        return remote

    def check_samples(self, sizes: list[int]) -> None:
        """The server weighs clients (and counts their local steps) by its partition: a node with its own
        data must hold as many samples as the partition gives its client."""
        for c, n in sorted(self.samples.items()):
            if n != sizes[c]:
                raise DeploymentError(
                    f"the SuperNode of client {c} holds {n} samples in its data file, but the run's partition gives "
                    f"client {c} {sizes[c]}; the server weighs clients by its partition, so they must agree "
                    "(docs/deployment.md, 'Node data from a path')"
                )

    def _apply_policy(self, algo: Algorithm) -> None:
        """``stop``: a lost client ends the run (``RunStopped``, one line). ``drop``: the round is computed
        again without the lost clients, exactly as a dropout of ``faults.dropout`` in simulation (they
        deliver nothing; aggregation re-weights over those that reported); answered jobs are not sent again."""
        run_round, reporting, fault_metrics = algo.run_round, algo.reporting, algo.fault_metrics
        send = getattr(algo, "send", None)  # the centralized and hierarchical families' downloads
        ledger = algo.ledger
        can_drop = "dropout" in algo.handles_faults

        def run_round_under_policy(r: int) -> dict[str, float]:
            dropping = self.on_error == "drop" and can_drop
            before = copy.deepcopy((algo.state_dict(), ledger.state_dict())) if dropping else None
            while True:
                try:
                    return run_round(r)
                except ClientsLost as e:
                    if self.on_error == "stop":
                        raise RunStopped(f"{e} (deployment on-error: stop)") from None
                    if not dropping:
                        raise RunStopped(f"{e}; algorithm {algo.name!r} has no dropout semantics") from None
                    for c, why in sorted(e.reasons.items()):
                        log.warning("round %d: client %d: %s; the round goes on without it (on-error: drop)",
                                    r + 1, c, why)  # fmt: skip
                    self.dropped.setdefault(r, set()).update(e.reasons)
                    self.unsent.setdefault(r, set()).update(e.unsent)
                    state, ledger_state = copy.deepcopy(before)
                    algo.load_state_dict(state)
                    ledger.load_state_dict(ledger_state)

        def reporting_without_lost(r: int, clients: np.ndarray) -> np.ndarray:
            return _without(reporting(r, clients), self.dropped.get(r))

        def fault_metrics_with_reports(reported: int | np.ndarray) -> dict[str, float]:
            n = reported if isinstance(reported, int) else len(reported)
            return {**fault_metrics(reported), "reported_clients": float(n)}

        def send_to_reached(r: int, clients, *args, **kwargs) -> None:
            # the ledger counts a download only where one left: a job whose node was not connected was never
            # sent (a dropout in simulation did receive its download)
            return send(r, _without(clients, self.unsent.get(r)), *args, **kwargs)

        secagg = getattr(algo, "secagg", None)  # SecAgg+'s messages in the ledger (fedweave.privacy.secagg)
        record_secagg = secagg.record if secagg is not None else None

        def secagg_among_reached(r: int, ledger, sampled, delivered, elements: int) -> None:
            # SecAgg+ ran among the clients whose node was connected: one that was sent nothing is billed nothing
            return record_secagg(r, ledger, _without(sampled, self.unsent.get(r)), delivered, elements)

        evaluate = algo.evaluate

        def evaluate_or_stop(r: int) -> dict[str, float]:
            try:
                return evaluate(r)
            except ClientsLost as e:  # a node lost in an evaluation's jobs (the gossip family's fine-tuning)
                raise RunStopped(f"{e} (deployment: a node lost while the run evaluates ends it)") from None

        algo.run_round, algo.evaluate = run_round_under_policy, evaluate_or_stop
        if self.on_error == "drop" and can_drop:
            algo.reporting = reporting_without_lost
            algo.fault_metrics = fault_metrics_with_reports
            algo.send = send_to_reached
            if secagg is not None:
                secagg.record = secagg_among_reached

    def summary(self, ledger_total: int) -> dict:
        """summary.json's ``flower`` section: Flower's bytes beside the ledger's (docs/deployment.md, 'Byte
        counts'). ``bytes_* = payload_* + framing_* - deduplicated_*`` in each direction."""
        return {
            "messages": self.messages,
            "jobs": self.jobs,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "payload_sent": self.payload_sent,
            "payload_received": self.payload_received,
            # what Flower adds: message and record metadata, array headers, the JSON job header, the queries
            "framing_sent": self.tree_sent - self.payload_sent,
            "framing_received": self.tree_received - self.payload_received,
            # what Flower saves: an array (or 5 MB chunk) identical to another of the same record travels once
            "deduplicated_sent": self.tree_sent - self.bytes_sent,
            "deduplicated_received": self.tree_received - self.bytes_received,
            # the ServerApp's uploads to the SuperLink: an object shared by the messages of one push goes once
            "bytes_pushed": self.bytes_pushed,
            # Flower's serialised messages minus the ledger's bytes: framing, less what deduplication saves,
            # less what the messages carry in fewer bytes than the ledger counts (FedMIM with J > 2); may be < 0
            "overhead_bytes": self.bytes_sent + self.bytes_received - ledger_total,
            "dropped": {str(r + 1): sorted(cs) for r, cs in sorted(self.dropped.items())},
            # those of them whose job never left (their node was not connected): no download in the ledger
            "unsent": {str(r + 1): sorted(cs) for r, cs in sorted(self.unsent.items()) if cs},
        }


def _numbers(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))


def _log_progress(algo: Algorithm) -> None:
    """A line per round trained and per evaluation (the simulation's progress bar; ``flwr run --stream``
    shows them)."""
    run_round, evaluate, rounds = algo.run_round, algo.evaluate, algo.ctx.config.rounds

    def run_round_logged(r: int) -> dict[str, float]:
        metrics = run_round(r)
        log.info("fedweave round %d/%d trained: %s", r + 1, rounds, _numbers(metrics))
        return metrics

    def evaluate_logged(r: int) -> dict[str, float]:
        metrics = evaluate(r)
        log.info("fedweave round %d/%d evaluated: %s (ledger %.3f MiB so far)", r + 1, rounds, _numbers(metrics),
                 algo.ledger.bytes(upto_round=r) / 2**20)  # fmt: skip
        return metrics

    algo.run_round, algo.evaluate = run_round_logged, evaluate_logged


class _ToFlower(logging.Handler):
    """fedweave's log records into Flower's logger, whose output the ServerApp's process forwards to the
    SuperLink (``flwr run --stream``, ``flwr log``)."""

    def emit(self, record: logging.LogRecord) -> None:
        flwr_log(record.levelno, "%s", record.getMessage())


@contextmanager
def _logs_to_flower() -> Iterator[None]:
    """While the ServerApp runs: fedweave's INFO lines (progress, completion) and warnings through Flower."""
    logger, handler = logging.getLogger("fedweave"), _ToFlower()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # once, through Flower's logger (which propagates as Flower configures it)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


class FlowerTrainer(LocalTrainer):
    """A ``LocalTrainer`` whose jobs run on the SuperNodes; same arguments, same results. Jobs of
    ``server_jobs`` (the hierarchical family's job on the server's own data) run here, on ``here``, the
    algorithm's own trainer."""

    clients: FlowerClients
    num_classes: int
    here: LocalTrainer
    server_jobs: set[int]
    secure: secure.SecureAggregation | None = None
    start_loss: bool = False  # each job also asks its node for the client's loss of the start model (AFL, q-FFL)

    def _split(self, clients: list[int]) -> tuple[list[int], list[int]]:
        """Positions of the jobs that go to the nodes and of those that run here."""
        remote = [k for k, c in enumerate(clients) if c not in self.server_jobs]
        return remote, [k for k, c in enumerate(clients) if c in self.server_jobs]

    def run_jobs(self, call: LocalCall) -> LocalResult:
        """The call's jobs as one Message each to the SuperNode holding that client's data."""
        if self.secure is not None:  # secure aggregation: one SecAgg+ round, only the weighted mean comes back
            return self.secure.run_jobs(self, call)
        starts, clients, round, rule, lr, steps, key = (
            call.starts, call.clients, call.round, call.rule, call.lr, call.steps, call.key
        )  # fmt: skip
        remote, here = self._split(clients)
        parts = []
        if remote:
            dp = None
            if isinstance(rule, DPSGD):  # each node runs DP-SGD around the rule it rebuilds (the job's dp_sgd)
                dp, rule = (rule.clip, rule.sigma), rule.base
            mine = rule if len(remote) == len(clients) else reindexed(rule, remote)
            to_nodes = LocalCall(starts[remote], [clients[k] for k in remote], round, mine, lr, steps, key)
            replies = self._send(to_nodes, dp=dp)
            out = [from_records(r.content, starts.device) for r in replies]
            params = torch.stack([t["params"].reshape(-1) for _, t in out])
            result = _result(params, [json.loads(h) for h, _ in out])
            if self.start_loss:
                result.start_loss = torch.cat([t["start_loss"].reshape(-1) for _, t in out])
            parts.append((remote, result))
        if here:
            own = [clients[k] for k in here]
            own_call = LocalCall(starts[here], own, round, reindexed(call.rule, here), lr, steps, key)
            parts.append((here, self.here.run_jobs(own_call)))
        return _merged(parts, len(clients))

    def train_with_state(
        self,
        starts: torch.Tensor,
        clients,
        round: int,
        step: ClientStep,
        store: StateStore | None,
        *,
        lr: LR | None = None,
        steps: int | None = None,
        key: tuple[int, ...] = (),
    ) -> tuple[LocalResult, dict[str, torch.Tensor]]:
        """A stateful algorithm's jobs: each node starts from its own copy of its client's state and
        replies with what the client uploads in the paper; the server keeps only, per client, the round of
        the state version it used (``store`` stays unused: there is none on the server)."""
        if isinstance(self, PrivateTrainer):  # a node runs DP-SGD around a rule it rebuilds, never around a step's
            raise DeploymentError(
                f"privacy.level: sample: client step {type(step).__name__} (clients with state of their own) is "
                "not deployed under DP-SGD; use privacy.level: user"
            )
        clients = list(map(int, clients))
        starts = self.checked_starts(starts, clients)
        lr = self.lr(round) if lr is None else lr
        if not clients:
            return LocalResult(starts[:0].clone(), torch.zeros(0, dtype=torch.long), torch.zeros(0)), {}
        if self.secure is not None:  # one SecAgg+ round; each node keeps its state, what it uploads is masked
            return self.secure.run_steps(self, LocalCall(starts, clients, round, PLAIN, lr, steps, key), step)
        remote, here = self._split(clients)
        parts, uploads = [], []
        if remote:
            call = LocalCall(starts[remote], [clients[k] for k in remote], round, PLAIN, lr, steps, key)
            replies = self._send(call, step=step)
            out = [from_records(r.content, starts.device) for r in replies]
            names = sorted(out[0][1])
            upload = {n: torch.stack([t[n].reshape(-1) for _, t in out]) for n in names if n != "params"}
            params = torch.stack([t["params"].reshape(-1) for _, t in out]) if "params" in names else None
            if params is None:
                params = step.local_model(starts[remote], upload)
            for k in remote:
                self.clients.accepted[clients[k]] = round
            parts.append((remote, _result(params, [json.loads(h) for h, _ in out])))
            uploads.append((remote, upload))
        if here:  # the server's own job, over the algorithm's store (which holds only its row)
            res, upload = self.here.train_with_state(starts[here], [clients[k] for k in here], round, step, store,
                                                     lr=lr, steps=steps, key=key)  # fmt: skip
            parts.append((here, res))
            uploads.append((here, upload))
        names = set(uploads[0][1])
        upload = {n: _rows([(pos, u[n]) for pos, u in uploads], len(clients)) for n in names}
        return _merged(parts, len(clients)), upload

    def _send(
        self, call: LocalCall, *, step: ClientStep | None = None, dp: tuple[float, float] | None = None
    ) -> list[Message]:
        """Each job of ``call`` as one Message to its client's node (with ``step``: a stateful algorithm's;
        ``dp``: DP-SGD's clip and sigma)."""
        jobs = []
        for k, c in enumerate(call.clients):
            header, tensors = encode_job(
                call, k, local=self.local, step=step, state_round=self.clients.accepted.get(c, INITIAL),
                num_classes=self.num_classes, dp=dp, start_loss=self.start_loss and step is None,
            )  # fmt: skip
            jobs.append((c, header, tensors))
        return self.clients.run_jobs(call.round, jobs)


@functools.cache
def _on_flower(cls: type[LocalTrainer]) -> type[FlowerTrainer]:
    """``cls`` (a trainer that wraps or counts around ``train``) with its jobs run by :class:`FlowerTrainer`."""
    return type(f"Flower{cls.__name__}", (cls, FlowerTrainer), {})


def _rows(parts: list[tuple[list[int], torch.Tensor]], n: int) -> torch.Tensor:
    """Rows given at positions, in job order."""
    first = parts[0][1]
    out = first.new_empty((n, *first.shape[1:]))
    for pos, rows in parts:
        out[pos] = rows
    return out


def _merged(parts: list[tuple[list[int], LocalResult]], n: int) -> LocalResult:
    """The results of the jobs that ran on the nodes and here, in job order."""
    if len(parts) == 1:
        return parts[0][1]
    return LocalResult(*(_rows([(pos, getattr(r, f)) for pos, r in parts], n) for f in ("params", "steps", "loss")))


def _result(params: torch.Tensor, headers: list[dict]) -> LocalResult:
    """The nodes' replies as the simulation's result: steps and losses beside ``params``, the losses in the
    run's dtype as the trainer stores them."""
    return LocalResult(
        params,
        torch.tensor([int(h["steps"]) for h in headers], dtype=torch.long, device=params.device),
        torch.tensor([float(h["loss"]) for h in headers], dtype=params.dtype, device=params.device),
    )


def _release(clients: FlowerClients) -> None:
    """:meth:`FlowerClients.release`, whose failure (the Grid gone with the run) is a warning, not the run's error."""
    try:
        clients.release()
    except Exception as e:  # a run that failed keeps its own error, a finished one its results
        log.warning("the release of the nodes' files at the run's end failed: %s: %s", type(e).__name__, e)


def _app_settings(rc: dict) -> tuple[float, float, str]:
    """The app config's ``reply-timeout``, ``node-wait`` and ``on-error``, checked here because ``flwr run
    --run-config`` sets them past ``fedweave flower-app``'s checks (to any TOML value): a bad one is a
    :class:`DeploymentError` naming the key and what is allowed."""
    seconds = []
    for key in ("reply-timeout", "node-wait"):
        value = rc.get(key)
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
        if not 0 < number < float("inf"):
            raise DeploymentError(f"app config {key} must be a number of seconds > 0, got {value!r}")
        seconds.append(float(number))
    on_error = rc.get("on-error", "stop")
    if on_error not in support.POLICIES:
        raise DeploymentError(f"app config on-error must be one of {', '.join(support.POLICIES)}, got {on_error!r}")
    return seconds[0], seconds[1], on_error


def _app_run_config(rc: dict) -> RunConfig:
    """The app config's ``fedweave-config``, the run config as JSON (``--run-config`` can replace it too): one
    that is not JSON, not a mapping, or not a valid config is a :class:`DeploymentError` or :class:`ConfigError`
    in one line."""
    text = rc.get("fedweave-config")
    if not isinstance(text, str):
        raise DeploymentError(f"app config fedweave-config must be the run config as a JSON string, got {text!r}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DeploymentError(f"app config fedweave-config is not the run config as JSON ({e})") from None
    if not isinstance(data, dict):
        raise DeploymentError(
            f"app config fedweave-config must be a mapping of the config's sections, got {type(data).__name__}"
        )
    return load_config(data)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the app's fedweave config on the SuperNodes. A run that fedweave refuses, stops or finds diverged
    raises :class:`RunFailed` once its results are written, so that Flower records it as failed."""
    with _logs_to_flower():
        _main(grid, context)


def _main(grid: Grid, context: Context) -> None:
    from fedweave import runner

    rc = context.run_config
    try:
        config = _app_run_config(rc)
        reply_timeout, node_wait, on_error = _app_settings(rc)
        run_dir = rc.get("run-dir", "")
        if not isinstance(run_dir, str):  # Flower parses run-dir=5 or run-dir=true as a number or a bool
            raise DeploymentError(f"app config run-dir must be a path as a string ('': the config's), got {run_dir!r}")
    except (DeploymentError, ConfigError) as e:
        raise RunFailed(f"fedweave run not started: {e}") from None
    clients = FlowerClients(grid, reply_timeout=reply_timeout, node_wait=node_wait, on_error=on_error)
    run_dir = run_dir or None
    failed = None
    try:
        result = runner.run(config, run_dir=run_dir, callbacks=[clients], progress=False, on_divergence="return")
        out = Path(result.run_dir)
        if result.summary["status"] == "diverged":  # results so far and the flower section, then one line
            failed = RunFailed(f"fedweave run diverged: {result.summary['error']} Results so far are in {out}")
    except (DeploymentError, ConfigError) as e:  # before the first round: nothing was written
        # a ConfigError is what building the run finds (an option only the partitioner or model checks), past
        # fedweave flower-app's checks of the config's form and of what the deployment carries
        raise RunFailed(f"fedweave run not started: {e}") from None
    except RunDirError as e:  # the results directory cannot take the run (it holds a finished one, say)
        example = "flwr run ... --run-config \"run-dir='DIR'\""
        if e.held:  # a run it holds: only another run-dir helps (a deployed run has no --out, --overwrite or --resume)
            raise RunFailed(f"fedweave run not started: {e.held}; give another run-dir, e.g. {example}") from None
        raise RunFailed(f"fedweave run not started: {e} (deployed: give another run-dir, e.g. {example})") from None
    except RunStopped as e:
        failed = RunFailed(f"fedweave run stopped: {e}")
        if e.run_dir is None:
            raise failed from None
        out = Path(e.run_dir)
    finally:  # however the run ended, the nodes drop the files they wrote for it (counted in the summary below)
        _release(clients)
    summary = json.loads((out / "summary.json").read_text())
    summary["flower"] = clients.summary(summary["communication"]["bytes_total"])
    summary["execution"]["backend"] = "flower"  # the split family's clients too, which have no local trainer
    atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    if failed is not None:
        raise failed from None
    log.info("fedweave run in %s: %s", out, summary["status"])
