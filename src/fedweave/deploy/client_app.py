"""The Flower ``ClientApp``: runs fedweave's own local training for the jobs of the partition this
SuperNode holds (node config ``partition-id``) and replies with the simulation's fields.

The node rebuilds the dataset, partition and model from the run's fedweave config (the same root seed, so
the same client data, batches and augmentation as in simulation) and trains on the ``loop`` backend.
"""

from __future__ import annotations

import json
from functools import lru_cache

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from fedweave.algorithms.base import RunContext
from fedweave.config import ConfigError
from fedweave.config import load as load_config
from fedweave.data.augment import augment_for
from fedweave.deploy.jobs import MalformedJobError, UnknownRuleError, decode_job
from fedweave.deploy.wire import from_records, to_records
from fedweave.execution import loop
from fedweave.execution.local import LocalTrainer

# Error codes of the replies (Flower reserves codes below 100 for itself)
UNKNOWN_RULE, MALFORMED, WRONG_NODE = 101, 102, 103

app = ClientApp()


def partition_id(context: Context) -> int:
    value = context.node_config.get("partition-id")
    if value is None:
        raise ConfigError("SuperNode --node-config must name 'partition-id=N' (the fedweave client it holds)")
    return int(value)


@lru_cache(maxsize=2)
def _trainer(config_json: str) -> LocalTrainer:
    """The node's trainer over the run's data (built once per run config)."""
    config = load_config(json.loads(config_json))
    ctx = RunContext(config)
    ds = ctx.dataset
    return LocalTrainer(
        ctx.model, ds.train_x, ds.train_y, ctx.partition, config.local, ctx.seeds,
        backend="loop", augment=augment_for(config.local), rounds=config.rounds,
    )  # fmt: skip


@app.query()
def query(msg: Message, context: Context) -> Message:
    return Message(to_records({"partition": partition_id(context)}, {}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    try:
        header, tensors = from_records(msg.content)
        job = decode_job(header, tensors)
    except UnknownRuleError as e:
        return Message(Error(UNKNOWN_RULE, str(e)), reply_to=msg)
    except (MalformedJobError, KeyError, TypeError) as e:
        return Message(Error(MALFORMED, f"malformed fedweave job message: {e}"), reply_to=msg)
    mine = partition_id(context)
    if job.client != mine:
        return Message(Error(WRONG_NODE, f"job for client {job.client} sent to the node holding {mine}"), reply_to=msg)
    tr = _trainer(str(context.run_config["fedweave-config"]))
    tr.local = job.local
    res = loop.run(tr, job.start, [job.client], job.round, job.rule, job.lr, job.steps, job.key)
    out = {"steps": int(res.steps[0]), "loss": float(res.loss[0])}
    return Message(to_records(out, {"params": res.params[0]}), reply_to=msg)
