"""The Flower ``ClientApp``: runs fedweave's own local training for the jobs of the client this SuperNode
holds and replies with what the client sends in the paper (docs/deployment.md).

Node config (``flower-supernode --node-config``): ``partition-id`` (the fedweave client index this node
holds) and ``state-dir`` (where the node keeps its clients' own state; default ``$FLWR_HOME/fedweave-state``).
The node rebuilds the dataset, partition and model from the run's fedweave config (the same root seed, so
the same client data, batches and augmentation as in simulation) and trains on the ``loop`` backend.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from fedweave.algorithms.base import RunContext
from fedweave.config import ConfigError
from fedweave.config import load as load_config
from fedweave.data.augment import augment_for
from fedweave.deploy.jobs import Job, MalformedJobError, UnknownRuleError, decode_job
from fedweave.deploy.node_state import NodeState, StateMissingError
from fedweave.deploy.wire import from_records, to_records
from fedweave.execution import loop
from fedweave.execution.local import LocalResult, LocalTrainer

# Error codes of the replies (Flower reserves codes below 100 for itself)
UNKNOWN_RULE, MALFORMED, WRONG_NODE, STATE_MISSING = 101, 102, 103, 104

app = ClientApp()


def partition_id(context: Context) -> int:
    value = context.node_config.get("partition-id")
    if value is None:
        raise ConfigError("SuperNode --node-config must name 'partition-id=N' (the fedweave client it holds)")
    return int(value)


def state_dir(context: Context) -> Path:
    value = context.node_config.get("state-dir")
    if value:
        return Path(str(value))
    return Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr")) / "fedweave-state"


@lru_cache(maxsize=2)
def _trainer(config_json: str) -> LocalTrainer:
    """The node's trainer over the run's data (built once per run config)."""
    config = load_config(json.loads(config_json))
    ctx = RunContext(config)
    ds = ctx.dataset
    return LocalTrainer(
        ctx.model, ds.train_x, ds.train_y, ctx.partition, config.local, ctx.seeds,
        backend="loop", augment=augment_for(config.local), rounds=config.rounds, loss_fn=ctx.task.loss,
    )  # fmt: skip


@app.query()
def query(msg: Message, context: Context) -> Message:
    return Message(to_records({"partition": partition_id(context)}, {}), reply_to=msg)


def _error(msg: Message, code: int, reason: str) -> Message:
    return Message(Error(code, reason), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    try:
        header, tensors = from_records(msg.content)
        job = decode_job(header, tensors)
    except UnknownRuleError as e:
        return _error(msg, UNKNOWN_RULE, str(e))
    except (MalformedJobError, KeyError, TypeError) as e:
        return _error(msg, MALFORMED, f"malformed fedweave job message: {e}")
    mine = partition_id(context)
    if job.client != mine:
        return _error(msg, WRONG_NODE, f"job for client {job.client} sent to the node holding {mine}")
    tr = _trainer(str(context.run_config["fedweave-config"]))
    tr.local = job.local
    if job.step is None:
        res = _run(tr, job, job.rule)
        out, sent = res, {"params": res.params}
    else:
        try:
            out, sent = _run_step(tr, job, NodeState(state_dir(context), context.run_id))
        except StateMissingError as e:
            return _error(msg, STATE_MISSING, str(e))
    header = {"steps": int(out.steps[0]), "loss": float(out.loss[0])}
    return Message(to_records(header, sent), reply_to=msg)


def _run(tr: LocalTrainer, job: Job, rule) -> LocalResult:
    return loop.run(tr, job.start, [job.client], job.round, rule, job.lr, job.steps, job.key)


def _run_step(tr: LocalTrainer, job: Job, store: NodeState) -> tuple[LocalResult, dict[str, torch.Tensor]]:
    """A stateful client's job: its state from the node's files (the version the server accepted), its
    local training, then what it uploads; its new state is written before the reply leaves."""
    step = job.step
    state = store.load(job.client, job.state_round, step.state, job.start)
    state = {n: t.to(job.start.dtype) for n, t in state.items()}
    res = _run(tr, job, step.rule(state))
    upload, new = step.finish(state, job.start, res)
    store.save(job.client, job.round, new, accepted=job.state_round)
    return res, (upload or {"params": res.params})
