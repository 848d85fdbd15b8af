"""The Flower ``ClientApp``: runs fedweave's own local training for the jobs of the client this SuperNode
holds and replies with what the client sends in the paper (docs/deployment.md).

Node config (``flower-supernode --node-config``): ``partition-id`` (the fedweave client index this node
holds), ``data`` (optional: an ``.npz`` of the client's own samples, ``fedweave.deploy.node_data``) and
``state-dir`` (where the node keeps its clients' own state; default ``$FLWR_HOME/fedweave-state``).
Without ``data`` the node derives its client's samples from the run's fedweave config (a trial: the same root
seed gives the same client data as in simulation), once per run, into a file in its state directory; with
it the node reads only its file. Batches and augmentation come from the run's seed streams either way;
training runs on the ``loop`` backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import torch
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from fedweave.algorithms.base import RunContext
from fedweave.byo import RunObjects
from fedweave.config import ConfigError
from fedweave.config import load as load_config
from fedweave.data.augment import augment_for
from fedweave.deploy import compressed, secure, split
from fedweave.deploy.jobs import Job, MalformedJobError, UnknownRuleError, check_tensors, decode_job, whole
from fedweave.deploy.node_data import NodeDataError, load_node_data, node_dataset, own_parts, trial_parts, write_samples
from fedweave.deploy.node_state import NodeState, StateMissingError
from fedweave.deploy.wire import from_records, to_records
from fedweave.execution.dpsgd import DPSGD
from fedweave.execution.evaluate import evaluate_clients_task
from fedweave.execution.job import LocalCall, LocalResult, backend_run
from fedweave.execution.local import LocalTrainer
from fedweave.execution.placement import move_tensors
from fedweave.tasks import Task, build_task

# Error codes of the replies (Flower reserves codes below 100 for itself)
UNKNOWN_RULE, MALFORMED, WRONG_NODE, STATE_MISSING, STATE_UNWRITABLE, NODE_DATA = 101, 102, 103, 104, 105, 106
NODE_CONFIG = 107  # the node's --node-config names no partition-id, or one that is not a whole number >= 0

app = ClientApp()


def partition_id(context: Context) -> int:
    """The fedweave client this node holds, from its ``--node-config``; a ``ConfigError`` naming the key when it
    is missing or not a whole number >= 0 (Flower parses ``1.5``, ``'x'`` and ``true`` as such, and ``int``
    would take ``1.5`` and ``true`` for client 1)."""
    value = context.node_config.get("partition-id")
    if value is None:
        raise ConfigError("SuperNode --node-config must name 'partition-id=N' (the fedweave client it holds)")
    if isinstance(value, str) and value.isdecimal():  # partition-id='2', quoted
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"SuperNode --node-config partition-id must be a whole number >= 0, got {value!r}")
    return value


def state_dir(context: Context) -> Path:
    value = context.node_config.get("state-dir")
    if value:
        return Path(str(value))
    return Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr")) / "fedweave-state"


def node_data(context: Context) -> str | None:
    value = context.node_config.get("data")
    return str(value) if value else None


def derived_samples(context: Context, client: int) -> Path:
    """Where a trial node keeps the samples it derived for ``client`` in this run:
    ``<state-dir>/run-<run id>/client-<c>/samples.npz``, one file per client and run."""
    return NodeState(state_dir(context), context.run_id).samples(client)


def samples_file(context: Context, config_json: str, client: int) -> str:
    """The file of the client's training samples: the node's own (``data``), or, in a trial, the client's
    part of the configured dataset, derived on the run's first job into the state directory, so that the
    run's later jobs (each a new ClientApp process) read that file instead of building the dataset again
    (the ServerApp's release at the run's end removes it with the run's other files: :func:`query`)."""
    own = node_data(context)
    if own is not None:
        return own
    file = derived_samples(context, client)
    if not file.is_file():
        train_x, train_y, parts = trial_parts(load_config(json.loads(config_json)))
        if not 0 <= client < len(parts):
            raise ConfigError(f"partition-id {client} is not a client of the run (0 .. {len(parts) - 1})")
        idx = torch.as_tensor(parts[client], dtype=torch.long)
        write_samples(file, train_x[idx], train_y[idx])
    return str(file)


@lru_cache(maxsize=2)
def _threads(config_json: str) -> int | None:
    return load_config(json.loads(config_json)).threads


def use_run_threads(config_json: str) -> None:
    """Compute with the run's ``threads``, as the simulation's runner does (``torch.set_num_threads``): a product's
    summation order follows the thread count, so a node on torch's default trained a ``threads: 1`` run to other
    bits (its losses apart in the 8th digit). Set for every job: a warm executor may serve runs of other settings."""
    threads = _threads(config_json)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@lru_cache(maxsize=2)
def _trainer(config_json: str, data: str, client: int, num_classes: int | None) -> LocalTrainer:
    """The node's trainer over its client's samples (built once per run config and data file); only the
    model's outputs come from the server."""
    config = load_config(json.loads(config_json))
    if num_classes is None:
        raise MalformedJobError("the job does not name the model's num_classes, which the node builds its model for")
    ds = node_dataset(data, num_classes, f"node data {Path(data).name}")
    ctx = RunContext(config, RunObjects(dataset=ds))
    x, y = ctx.dataset.train_x, ctx.dataset.train_y  # in the run's precision
    return LocalTrainer(
        ctx.model, x, y, own_parts(client, len(x), config.num_clients), config.local, ctx.seeds,
        backend="loop", augment=augment_for(config.local), rounds=config.rounds, loss_fn=ctx.task.loss,
        placement=ctx.placement,  # the run's device (this node's, under `auto`), dtype and autocast
    )  # fmt: skip


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Which client this node holds (and, with its own data, how many samples it has). The ServerApp's query
    at the run's end (a header ``{"release": true}``) also removes every file this run wrote for the client in
    the node's state directory (``NodeState.release``: its state versions, its split turns, a trial's samples,
    its error-feedback residuals); before, they built up on a long-lived node, run after run. Files the run did
    not write stay, and so does the node's own ``data`` file; the answer counts the files removed."""
    try:
        answer = {"partition": partition_id(context)}
    except ConfigError as e:
        return _error(msg, NODE_CONFIG, str(e))
    if _asks_release(msg):
        own = node_data(context)
        store = NodeState(state_dir(context), context.run_id)
        removed, failed = store.release(answer["partition"], keep=(own,) if own is not None else ())
        if failed:
            return _error(msg, STATE_UNWRITABLE, f"cannot remove the run's files: {'; '.join(failed)}")
        answer["released"] = len(removed)
        return Message(to_records(answer, {}), reply_to=msg)
    data = node_data(context)
    if data is not None:
        try:
            answer["samples"] = len(load_node_data(data)[1])
        except NodeDataError as e:
            return _error(msg, NODE_DATA, str(e))
    return Message(to_records(answer, {}), reply_to=msg)


def _asks_release(msg: Message) -> bool:
    """Whether a query is the ServerApp's release at the run's end (the start-up query's header is ``{}``)."""
    try:
        header = json.loads(from_records(msg.content)[0])
    except (ValueError, KeyError, TypeError):  # records without a fedweave header: not the release
        return False
    return isinstance(header, dict) and header.get("release") is True


def _error(msg: Message, code: int, reason: str) -> Message:
    return Message(Error(code, reason), reply_to=msg)


@app.train(mods=[secure.mod])  # secure aggregation: Flower's SecAgg+ mod on a SecAgg+ round's messages
def train(msg: Message, context: Context) -> Message:
    try:
        header, tensors = from_records(msg.content)
        h = json.loads(header)
        if isinstance(h, dict) and h.get("kind") in split.KINDS:
            return _split_job(msg, context, h, tensors)
        job = decode_job(header, tensors)
    except UnknownRuleError as e:
        return _error(msg, UNKNOWN_RULE, str(e))
    except MalformedJobError as e:  # its message says so already
        return _error(msg, MALFORMED, str(e))
    except (ValueError, KeyError, TypeError) as e:  # a header that is not JSON, records that are not a job, ...
        return _error(msg, MALFORMED, f"malformed fedweave job message: {type(e).__name__}: {e}")
    mine = partition_id(context)
    if job.client != mine:
        return _error(msg, WRONG_NODE, f"job for client {job.client} sent to the node holding {mine}")
    config_json = str(context.run_config["fedweave-config"])
    try:
        use_run_threads(config_json)
        tr = _trainer(config_json, samples_file(context, config_json, mine), mine, job.num_classes)
    except MalformedJobError as e:
        return _error(msg, MALFORMED, str(e))
    except (ValueError, ConfigError) as e:  # the node's data file, or data that do not fit the model
        return _error(msg, NODE_DATA, str(e))
    except OSError as e:
        return _error(msg, STATE_UNWRITABLE, f"cannot keep the client's samples in {state_dir(context)}: {e}")
    if tr.layout.numel != job.start.numel():
        return _error(msg, NODE_DATA, f"the node's model has {tr.layout.numel} parameters, the job's start vector "
                      f"{job.start.numel()}: does the node's data have the dataset's input shape?")  # fmt: skip
    try:  # what arrived is what the run computes with: the model's vectors in the run's dtype
        check_tensors(tensors, tr.layout.numel, tr.placement.dtype)
    except MalformedJobError as e:
        return _error(msg, MALFORMED, f"malformed fedweave job message: {e}")
    tr.local = job.local
    if tr.placement.device.type != "cpu":  # the wire carries host tensors; the node computes on its device
        job = move_tensors(job, tr.placement.device)
    if job.step is None and job.call.rule.client_derived:  # derived from the client's own data (FedLC's margins)
        own_y = tr.train_y[torch.as_tensor(tr.parts[job.client], device=tr.train_y.device)]
        job = replace(job, call=replace(job.call, rule=job.call.rule.at_client(own_y, job.num_classes)))
    if job.dp is not None:  # privacy.level sample: DP-SGD in every step, its noise from the job's own stream
        c = job.call
        rule = DPSGD(tr.layout, *job.dp, tr.seeds, c.round, c.clients, c.key, base=c.rule, loss_fn=tr.loss_fn)
        job = replace(job, call=replace(c, rule=rule))
    if job.step is None:
        res = _run(tr, job.call)
        out, sent = res, {"params": res.params}
    else:
        try:
            out, sent = _run_step(tr, job, NodeState(state_dir(context), context.run_id))
        except StateMissingError as e:
            return _error(msg, STATE_MISSING, str(e))
        except OSError as e:
            return _error(msg, STATE_UNWRITABLE, f"cannot read or write the client state in {state_dir(context)}: {e}")
    header = {"steps": int(out.steps[0]), "loss": float(out.loss[0])}
    if job.start_loss:  # the client's loss of the model it received, on all its data (AFL, q-FFL)
        sent = {**sent, "start_loss": _start_loss(tr, config_json, job)}
    if secure.is_secure(msg):  # secure aggregation: the update, for Flower's SecAgg+ mod to mask (deploy/secure.py)
        # a refusal raises, as masked_reply's do: Flower's mod answers the exception with an error reply
        return secure.masked_reply(msg, header, secure.update_of(job.step, sent, job.call.starts))
    compressor = compressed.run_compressor(config_json)
    if compressor is not None:  # compression.upload: the encoded messages travel, not the dense ones
        root = state_dir(context)
        try:
            header[compressed.ORDER], sent = compressed.encode_reply(
                compressor, h, job.start, sent, tr.seeds, root, context.run_id
            )
        except (KeyError, ConfigError) as e:
            return _error(msg, MALFORMED, f"malformed fedweave job message: {type(e).__name__}: {e}")
        except StateMissingError as e:
            return _error(msg, STATE_MISSING, str(e))
        except OSError as e:
            return _error(msg, STATE_UNWRITABLE, f"cannot read or write the client's residuals in {root}: {e}")
    return Message(to_records(header, sent), reply_to=msg)


def _split_job(msg: Message, context: Context, h: dict, tensors: dict[str, torch.Tensor]) -> Message:
    """A split-learning client's epoch (CSE-FSL, FSL_AN) or exchange (FSL_MC, FSL_OC): ``fedweave.deploy.split``."""
    mine = partition_id(context)
    try:
        client = whole(h, "client", 0)
    except KeyError:
        return _error(msg, MALFORMED, "malformed fedweave split job message: it names no 'client'")
    except ConfigError as e:
        return _error(msg, MALFORMED, f"malformed fedweave split job message: the job's {e}")
    if client != mine:
        return _error(msg, WRONG_NODE, f"job for client {client} sent to the node holding {mine}")
    config_json = str(context.run_config["fedweave-config"])
    try:
        use_run_threads(config_json)
        data = samples_file(context, config_json, mine)
        if h["kind"] == split.EPOCH:
            header, out = split.run_epoch(h, tensors, config_json, data, mine)
        else:
            store = NodeState(state_dir(context), context.run_id)
            header, out = split.run_turn(h, tensors, config_json, data, mine, store)
    except MalformedJobError as e:
        return _error(msg, MALFORMED, f"malformed fedweave split job message: {e}")
    except (KeyError, TypeError) as e:
        return _error(msg, MALFORMED, f"malformed fedweave split job message: {type(e).__name__}: {e}")
    except StateMissingError as e:
        return _error(msg, STATE_MISSING, str(e))
    except OSError as e:
        return _error(msg, STATE_UNWRITABLE, f"cannot read or write the client state in {state_dir(context)}: {e}")
    except (ValueError, ConfigError) as e:  # the node's data, or a run that is not of the split family
        return _error(msg, NODE_DATA, str(e))
    return Message(to_records(header, out), reply_to=msg)


@lru_cache(maxsize=2)
def _evaluation(config_json: str) -> tuple[Task, int]:
    """The run's task and evaluation batch size (read once per run config)."""
    config = load_config(json.loads(config_json))
    t = config.task
    return build_task(t.loss, t.loss_options, t.metrics, t.main), config.eval.batch_size


def _start_loss(tr: LocalTrainer, config_json: str, job: Job) -> torch.Tensor:
    """The task's loss of the job's start model on every sample of the node's client, as the simulation's server
    computes it for the client (``StarAlgorithm.client_losses``: the evaluation's batches), in the run's dtype (as
    the ledger bills it)."""
    task, batch_size = _evaluation(config_json)
    parts = [tr.parts[job.client]]
    loss = evaluate_clients_task(tr.layout, job.start.reshape(-1), tr.train_x, tr.train_y, parts, task, batch_size)
    return torch.as_tensor(loss["loss"], dtype=job.start.dtype)


def _run(tr: LocalTrainer, call: LocalCall) -> LocalResult:
    """A job's one-job call, on the node's loop backend."""
    return backend_run("loop")(tr, call)


def _run_step(tr: LocalTrainer, job: Job, store: NodeState) -> tuple[LocalResult, dict[str, torch.Tensor]]:
    """A stateful client's job: its state from the node's files (the version the server accepted), its
    local training, then what it uploads; its new state is written before the reply leaves."""
    step = job.step
    state = store.load(job.client, job.state_round, step.state, job.start)
    state = {n: t.to(job.start) for n, t in state.items()}  # the start's dtype and device
    res = _run(tr, replace(job.call, rule=step.rule(state)))
    upload, new = step.finish(state, job.start, res)
    store.save(job.client, job.call.round, new, accepted=job.state_round)
    return res, (upload or {"params": res.params})
