"""Flower's SecAgg+ in deployment: the ``secure_aggregation`` section under ``fedweave flower-app``
(docs/deployment.md, docs/privacy.md).

The protocol is Flower's, unchanged: the ServerApp runs the four stages of ``flwr.server.workflow.
SecAggPlusWorkflow`` (its own stage methods: setup, share keys, collect masked vectors, unmask) and every node
wraps its ``train`` handler in ``flwr.client.mod.secaggplus_mod``. The workflow as a whole cannot carry
fedweave's messages: it asks a Flower ``Strategy`` for ``FitIns`` to send and hands the aggregate to the
strategy's ``aggregate_fit``, while fedweave's ServerApp speaks its own job messages on the Grid. So fedweave
calls the stages one by one and enters through the two seams the stages leave: after the setup stage each
sampled node's entry of the workflow state's ``nid_to_fitins`` is replaced by the node's fedweave job (which the
collect stage sends together with the forwarded key shares), and the unmasked aggregate is taken from the
``aggregate_fit`` call of a stand-in strategy that keeps it. The setup stage's strategy call is answered with
empty ``FitIns`` for the round's nodes.

On a node, the collect stage's message reaches fedweave's ``train`` through Flower's mod, which then masks the
reply: fedweave replies with the client's update ``y_i - x`` (float64) and its integer weight as a Flower
``FitRes``; the mod quantizes ``weight / max_weight * update``, masks it and clears the arrays. The reply keeps
fedweave's header (steps and loss, in the clear, as without secure aggregation). The server learns only
``sum_i w_i (y_i - x) / sum_i w_i``, the weighted mean, and gives the algorithm the local models ``x + mean``
for every client, so the round template runs unchanged and its mean is the securely aggregated one.

SecAgg+ quantizes (stochastic rounding to ``quantization_range`` levels of ``[-clipping_range,
clipping_range]``), so the deployed mean differs from the simulation's by at most :func:`error_bound` per
element (float rounding aside). An update that quantization would clip is refused on its node with one line.

A client lost in a round (no connected node, or a node silent within the protocol) is named to the ServerApp's
error policy: ``stop`` ends the run; ``drop`` computes the round again without it, and where SecAgg+ recovered
the others' sum, that computation takes it rather than run the protocol again: the server learns one secure sum a
round (two over sets that differ by one client would give that client's update).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

from fedweave.config import SecureAggregationConfig
from fedweave.deploy.jobs import encode_job
from fedweave.deploy.node_state import INITIAL
from fedweave.deploy.wire import to_records
from fedweave.errors import RunStopped
from fedweave.execution.job import ClientStep, LocalCall, LocalResult

WEIGHT = "fedweave.secagg"  # the job's config record under secure aggregation: the client's weight and the ranges
POLL = 0.25  # seconds between two looks for replies


def error_bound(cfg: SecureAggregationConfig, weights: np.ndarray) -> float:
    """The largest difference per element between the securely aggregated weighted mean of the updates and the
    exact one, from SecAgg+'s quantization as Flower's mod does it: client i sends ``dq_i u_i`` with
    ``dq_i = round(w_i / max_weight * R) / R``, each element stochastically rounded to a step ``2 c / R``
    (less than one step off), and the server divides the sum by ``sum_i dq_i``. Equal weights give equal
    ``dq_i``, so only the rounding counts: ``n (2 c / R) / sum_i dq_i``; unequal weights add the relative error of
    the ``dq_i`` (at most ``0.5 / R`` over ``dq_i`` each) times about twice the largest update element, which
    :func:`weighted_error` adds where it is known."""
    q = np.round(np.asarray(weights, dtype=np.float64) / cfg.max_weight * cfg.quantization_range)
    dq = q / cfg.quantization_range
    return len(dq) * (2 * cfg.clipping_range / cfg.quantization_range) / dq.sum()


def weighted_error(cfg: SecureAggregationConfig, weights: np.ndarray, largest: float) -> float:
    """What quantizing unequal weights adds to :func:`error_bound` when the updates' elements are at most
    ``largest`` in absolute value: with ``e = max_i |dq_i / (w_i / max_weight) - 1|`` the weights of the mean move
    by at most ``2 e / (1 - e)`` in sum, so the mean by ``largest`` times that (0 for equal weights)."""
    w = np.asarray(weights, dtype=np.float64)
    if np.all(w == w[0]):
        return 0.0
    ratio = w / cfg.max_weight
    dq = np.round(ratio * cfg.quantization_range) / cfg.quantization_range
    e = float(np.max(np.abs(dq / ratio - 1)))
    return largest * 2 * e / (1 - e)


# ---- the node ------------------------------------------------------------------------------------------------
def mod(msg: Message, context: Any, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round (those with its config record); fedweave's
    other messages go straight to the handler."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def is_secure(msg: Message) -> bool:
    """Whether a job came through a SecAgg+ round (its reply is then the update, for the mod to mask)."""
    return WEIGHT in msg.content.config_records


def update_of(step: ClientStep | None, sent: dict[str, torch.Tensor], start: torch.Tensor) -> torch.Tensor:
    """What a client of a SecAgg+ round masks, one float64 vector: its model's update ``params - start``, or its
    client step's upload (``step.uploads``: SCAFFOLD's ``dc`` and ``dy``) in the order of their names, by which the
    server splits the mean. An upload that is not what the step declares raises ValueError (one line): the server
    would split the mean wrongly, and nothing may travel beside the masked vector."""
    declared = sorted(getattr(step, "uploads", ())) or ["params"]
    if sorted(sent) != declared:
        raise ValueError(
            f"secure_aggregation: client step {type(step).__name__} uploads {sorted(sent)}, not what it declares in "
            f"uploads ({declared}), by which the server splits SecAgg+'s mean"
        )
    if declared == ["params"]:
        return sent["params"].reshape(-1).double() - start.reshape(-1).double()
    return torch.cat([sent[name].reshape(-1).double() for name in declared])


def masked_reply(msg: Message, header: dict[str, Any], update: torch.Tensor) -> Message:
    """The reply of a job of a SecAgg+ round, for Flower's mod to mask: the client's ``update`` (:func:`update_of`,
    float64) and its weight as a ``FitRes``, fedweave's header beside it. An update that SecAgg+'s quantization
    would clip, or one with a NaN or infinite element, raises ValueError (one line), never masked in silence."""
    rec = msg.content.config_records[WEIGHT]
    weight, max_weight = int(rec["weight"]), float(rec["max_weight"])
    clipping, levels = float(rec["clipping_range"]), int(rec["quantization_range"])
    update = update.reshape(-1).double().cpu().numpy()
    if not np.isfinite(update).all():  # Flower would quantize NaN to an arbitrary integer: a finite, wrong sum
        bad = update[~np.isfinite(update)][0]
        raise ValueError(
            f"secure_aggregation: client {rec['client']}'s update has a non-finite element ({bad}), which SecAgg+ "
            "cannot quantize: the client's training diverged (lower its step size)"
        )
    dq = round(weight / max_weight * levels) / levels  # what the mod multiplies the update by
    if dq == 0:  # the update would leave the weighted mean in silence
        raise ValueError(
            f"secure_aggregation: client {rec['client']}'s weight share ({weight} / {max_weight:g}) is below half of "
            f"one of quantization_range's {levels} levels, so SecAgg+ would weigh its update 0; lower max_weight or "
            "raise quantization_range"
        )
    largest = float(np.abs(update).max()) * dq if update.size else 0.0
    if largest > clipping:
        raise ValueError(
            f"secure_aggregation.clipping_range ({clipping:g}) is below what client {rec['client']} sends "
            f"({largest:.4g} = its largest update element times its weight share); raise clipping_range"
        )
    # fedweave's header (steps, loss) rides in the FitRes's metrics, which the workflow keeps for aggregate_fit
    fit = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([update]), weight, {"json": json.dumps(header)})
    return Message(compat.fitres_to_recorddict(fit, keep_input=True), reply_to=msg)


# ---- the server ----------------------------------------------------------------------------------------------
class _Grid:
    """The Grid call the workflow's stages make (``send_and_receive``), through fedweave's ``FlowerClients``, so
    that every message of the protocol is counted with the others (``summary.json``'s ``flower`` section)."""

    def __init__(self, clients: Any) -> None:
        self.clients = clients
        self.silent: set[int] = set()  # the nodes that did not answer a stage's message in time

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        ids = self.clients.push(messages)
        to = {i: m.metadata.dst_node_id for i, m in zip(ids, messages, strict=True)}
        pending, got = set(ids), []
        deadline = time.monotonic() + (timeout if timeout is not None else self.clients.reply_timeout)
        next_look = time.monotonic() + 1.0
        while pending and time.monotonic() < deadline:
            for reply in self.clients.pull(sorted(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
                got.append(reply)
            if pending and time.monotonic() > next_look:
                # as for plain jobs: a node that restarted joined under a new id, its old self never answers
                self.clients.refresh()
                next_look = time.monotonic() + 1.0
                restarted = {i for i in pending if to[i] not in self.clients.node_of.values()}
                self.silent.update(to[i] for i in restarted)
                pending -= restarted
            if pending:
                time.sleep(POLL)
        self.silent.update(to[i] for i in pending)
        return got


class Halted(RuntimeError):
    """A SecAgg+ round that halted (no sum came back) after ``silent`` nodes did not answer in time."""

    def __init__(self, silent: list[int], why: str) -> None:
        super().__init__(why)
        self.silent, self.why = silent, why


class _Keeper:
    """A stand-in for the Strategy the workflow's stages call: empty ``FitIns`` for the round's nodes at setup
    (fedweave's jobs replace them), and ``aggregate_fit`` keeps the unmasked aggregate and the clients'
    results instead of aggregating."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes, self.results = nodes, []

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return [(SimpleNamespace(node_id=n), FitIns(Parameters([], ""), {})) for n in self.nodes]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = results
        return None, {}


class SecureAggregation:
    """The ServerApp's side of SecAgg+ for an algorithm whose server needs only the weighted mean of the updates."""

    def __init__(self, algo: Any, clients: Any, lost: type[Exception]) -> None:
        self.algo, self.clients, self.cfg = algo, clients, algo.config.secure_aggregation
        self.weighting = getattr(algo.hp, "weighting", "uniform")
        self.lost = lost  # the ServerApp's ClientsLost(round, reasons, unsent): its error policy decides
        # round -> (the clients that delivered, what the round gives them): the mean SecAgg+ recovered without a
        # lost client, which the round computed again without it (on-error: drop) takes instead of a second sum
        self.recovered: dict[int, tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @classmethod
    def of(cls, algo: Any, clients: Any, lost: type[Exception]) -> SecureAggregation | None:
        """The run's SecAgg+ (None without a ``secure_aggregation`` section); ``lost``: the exception that names the
        clients a round lost (``ClientsLost``)."""
        return None if algo.config.secure_aggregation is None else cls(algo, clients, lost)

    def int_weights(self, clients: list[int]) -> np.ndarray:
        """Each client's weight as the integer Flower's mod takes (its samples, or 1 under ``weighting:
        uniform``), checked against the algorithm's own weights and ``max_weight``."""
        sizes = np.array([len(self.algo.ctx.partition[c]) for c in clients], dtype=np.int64)
        w = sizes if self.weighting == "samples" else np.ones(len(clients), dtype=np.int64)
        if w.max() > self.cfg.max_weight:
            raise RunStopped(
                f"secure_aggregation.max_weight ({self.cfg.max_weight:g}) is below client "
                f"{clients[int(w.argmax())]}'s weight ({w.max()}, its samples under algorithm.weighting: samples); "
                "raise max_weight"
            )
        want = self.algo.weights(np.asarray(clients)).double().cpu()
        if not torch.allclose(torch.as_tensor(w / w.sum(), dtype=torch.float64), want):
            raise RunStopped(f"secure_aggregation: algorithm {self.algo.name!r} weighs its clients in its own way")
        return w

    def run_jobs(self, trainer: Any, call: LocalCall) -> LocalResult:
        """The call's jobs through one SecAgg+ round: each client's job goes with the collect stage's message,
        and what comes back is the weighted mean of the updates; every client's local model is ``x + mean``."""
        mean, steps, loss = self._round(trainer, call, None)
        return LocalResult(call.starts + mean, steps, loss)

    def run_steps(self, trainer: Any, call: LocalCall, step: ClientStep) -> tuple[LocalResult, dict[str, torch.Tensor]]:
        """A stateful algorithm's jobs through one SecAgg+ round: each node runs ``step`` over its own state and
        masks what it uploads (its model's update, or the upload ``step.uploads`` names, in their order); returns
        every client's local model and upload as the mean gives them (each row the mean: the server learns no
        more), as ``train_with_state`` returns them."""
        mean, steps, loss = self._round(trainer, call, step)
        starts = call.starts
        if not step.uploads:  # the model's update
            return LocalResult(starts + mean, steps, loss), {}
        parts = mean.split(starts.shape[-1])  # each named upload has the model's size (ClientStep.uploads)
        if len(parts) != len(step.uploads):
            raise ValueError(f"client step {type(step).__name__}: a mean of {mean.numel()} values for its uploads "
                             f"{sorted(step.uploads)} of {starts.shape[-1]} each")  # fmt: skip
        upload = {name: part.expand(len(call), -1) for name, part in zip(sorted(step.uploads), parts)}
        return LocalResult(step.local_model(starts, upload), steps, loss), upload

    def _round(
        self, trainer: Any, call: LocalCall, step: ClientStep | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One SecAgg+ round of the call's jobs: the weighted mean of what its clients mask (in the starts' dtype),
        and each client's local steps and training loss. A client without a connected node, or one whose node is
        lost within the protocol, raises ``self.lost`` naming it; SecAgg+ recovers from the latter, and its mean
        of the others is what the round computed again without the lost clients gets (``recovered``): one secure
        sum a round, since two over sets that differ by one client would reveal that client's update."""
        clients = list(map(int, call.clients))
        if call.round in self.recovered:
            kept, result = self.recovered.pop(call.round)
            if kept != tuple(clients):  # never reached: the policy drops exactly the clients it was told of
                raise RunStopped(
                    f"round {call.round + 1}: SecAgg+ recovered the sum of clients {list(kept)}; a second secure sum "
                    f"over clients {clients} would reveal an update by difference"
                )
            return result
        weights = self.int_weights(clients)
        # each client's quantized values (its weight's factor among them) lie in [0, quantization_range] and SecAgg+
        # sums them modulo modulus_range: a sum that can reach the modulus wraps, and the unmasked mean is wrong
        levels, modulus = self.cfg.quantization_range, self.cfg.modulus_range
        if len(clients) * levels >= modulus:
            raise RunStopped(
                f"round {call.round + 1}: secure_aggregation.quantization_range ({levels}) times the round's "
                f"{len(clients)} clients reaches modulus_range ({modulus}), where SecAgg+'s sum of the quantized "
                f"values wraps; lower quantization_range below {-(-modulus // len(clients))} or raise modulus_range"
            )
        self.clients.refresh()  # as for plain jobs: a node that restarted since joins again under a new id
        online = set(self.clients.grid.get_node_ids())
        if away := [c for c in clients if self.clients.node_of.get(c) not in online]:  # before any message
            raise self.lost(call.round, dict.fromkeys(away, "no SuperNode holding it is connected"), set(away))
        node = {c: self.clients.node_of[c] for c in clients}
        jobs = {}
        for k, c in enumerate(clients):
            state_round = INITIAL if step is None else trainer.clients.accepted.get(c, INITIAL)
            header, tensors = encode_job(call, k, local=trainer.local, step=step, state_round=state_round,
                                         num_classes=trainer.num_classes)  # fmt: skip
            content = to_records(header, tensors)
            content.config_records[WEIGHT] = ConfigRecord({
                "client": c, "weight": int(weights[k]), "max_weight": float(self.cfg.max_weight),
                "clipping_range": float(self.cfg.clipping_range),
                "quantization_range": int(self.cfg.quantization_range),
            })  # fmt: skip
            jobs[node[c]] = content
        try:
            mean, results = self.aggregate(call.round, jobs)
        except Halted as e:  # halted after a node went silent (too few left to unmask): no sum was learned
            client = {n: c for c, n in node.items()}
            why = f"its node did not answer SecAgg+ within reply-timeout, and the protocol halted ({e.why})"
            raise self.lost(call.round, {client[n]: why for n in e.silent}) from None
        by_node = {proxy.node_id: fit for proxy, fit in results}
        delivered = [c for c in clients if node[c] in by_node]
        if step is not None:  # the state version each delivering node wrote for this round is the one used
            trainer.clients.accepted.update(dict.fromkeys(delivered, call.round))
        starts = call.starts
        heads = [json.loads(str(by_node[node[c]].metrics["json"])) for c in delivered]
        result = (
            torch.as_tensor(mean, dtype=starts.dtype, device=starts.device),
            torch.tensor([int(h["steps"]) for h in heads], dtype=torch.long, device=starts.device),
            torch.tensor([float(h["loss"]) for h in heads], dtype=starts.dtype, device=starts.device),
        )
        if lost := [c for c in clients if c not in delivered]:
            # SecAgg+ recovered from nodes lost within the protocol: the mean is the others' (a dropout's)
            self.recovered[call.round] = (tuple(delivered), result)
            why = "its node sent no masked update within reply-timeout (SecAgg+ unmasked the others' sum)"
            raise self.lost(call.round, dict.fromkeys(lost, why))
        return result

    def aggregate(self, round: int, jobs: dict[int, RecordDict]) -> tuple[np.ndarray, list]:
        """One SecAgg+ round over the nodes of ``jobs`` (node id -> the job's records): Flower's four stages;
        returns the unmasked weighted mean (float64) and the clients' results (their fedweave headers)."""
        cfg = self.cfg
        workflow = SecAggPlusWorkflow(
            num_shares=cfg.num_shares, reconstruction_threshold=cfg.reconstruction_threshold,
            max_weight=cfg.max_weight, clipping_range=cfg.clipping_range,
            quantization_range=cfg.quantization_range, modulus_range=cfg.modulus_range,
            timeout=self.clients.reply_timeout,
        )  # fmt: skip
        keeper = _Keeper(sorted(jobs))
        state = RecordDict()
        state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round + 1})
        state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(Parameters([], ""), True)
        context = SimpleNamespace(
            state=state, strategy=keeper, client_manager=SimpleNamespace(num_available=lambda: len(jobs))
        )
        grid, wf = _Grid(self.clients), WorkflowState()
        ok = workflow.setup_stage(grid, context, wf)
        if ok:
            wf.nid_to_fitins = dict(jobs)  # fedweave's jobs go with the collect stage's message
        ok = ok and workflow.share_keys_stage(grid, context, wf)
        if ok:
            # a node that did not share its keys (lost at setup or since) masks nothing and its neighbours hold no
            # share of its key: it is not one of the unmask stage's dead nodes, whose key shares the survivors send.
            # Flower 1.42 counts every sampled node there, and each survivor's mod then fails on the missing share
            wf.sampled_node_ids &= wf.active_node_ids
        for stage in (workflow.collect_masked_vectors_stage, workflow.unmask_stage):
            ok = ok and stage(grid, context, wf)
        if not ok or not keeper.results:
            # a node's error reply says why (Flower's runtime puts the exception's line in its reason)
            why = "; ".join(str(getattr(f.args[0], "reason", f)) for f in wf.failures if f.args)
            why = why or (
                f"{len(jobs)} clients took part; SecAgg+ needs at least 2, each with reconstruction_threshold "
                "neighbours that answer"
            )
            if silent := sorted(grid.silent & set(jobs)):  # lost nodes: no sum was learned, the others may go on
                raise Halted(silent, why)
            raise RunStopped(f"round {round + 1}: secure aggregation (SecAgg+) halted: {why}")
        params = keeper.results[0][1].parameters
        return np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(params)]), keeper.results
