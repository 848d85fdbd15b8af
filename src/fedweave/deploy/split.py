"""CSE-FSL deployed: each client's local epoch runs on its node, one message per client and round segment.

A CSE-FSL client never waits for the server: it trains its client-side model and auxiliary net on its local
loss and sends one smashed batch (and its labels) every h batches (Alg. 1). So the round's job carries the
fed server's ``x_c`` and ``a_c`` down, and the reply carries the client's updated ``x_c`` and ``a_c`` and its
smashed uploads up; the main server then drains its queue and the fed server aggregates, as in simulation
(``CSEFSL.client_epoch`` is the one implementation of the client's side, run by the node).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedweave.algorithms.split.cse_fsl import CSEFSL, ClientEpoch
from fedweave.deploy.wire import from_records

if TYPE_CHECKING:
    from fedweave.deploy.server_app import FlowerClients

KIND = "cse_fsl_epoch"  # the ``kind`` of a split job's header


def remote_epochs(clients: FlowerClients, algo: CSEFSL):
    """``algo.client_epochs`` with every client's epoch on its node."""

    def client_epochs(r, chosen, xc, xa, lrs, start, period, seg) -> list[ClientEpoch]:
        jobs = []
        for k, c in enumerate(map(int, chosen)):
            header = {"kind": KIND, "client": c, "round": int(r), "lrs": [float(v) for v in lrs],
                      "start": int(start), "period": int(period), "seg": int(seg),
                      "num_classes": algo.ctx.dataset.num_classes}  # fmt: skip
            jobs.append((c, header, {"xc": xc[k].reshape(1, -1), "xa": xa[k].reshape(1, -1)}))
        out = []
        for reply in clients.run_jobs(int(r), jobs):
            header, tensors = from_records(reply.content)
            out.append(decode_epoch(json.loads(header), tensors))
        return out

    return client_epochs


def encode_epoch(ep: ClientEpoch) -> tuple[dict, dict[str, torch.Tensor]]:
    header = {
        "windows": [w for w, _, _, _ in ep.uploads],
        "batches_sent": [m for _, m, _, _ in ep.uploads],
        "losses": ep.losses,
        "batches": ep.batches,
    }
    tensors = {"xc": ep.xc.reshape(1, -1), "xa": ep.xa.reshape(1, -1)}
    for j, (_, _, a, y) in enumerate(ep.uploads):
        tensors[f"smashed.{j}"], tensors[f"labels.{j}"] = a, y
    return header, tensors


def decode_epoch(h: dict, t: dict[str, torch.Tensor]) -> ClientEpoch:
    uploads = [(int(w), int(m), t[f"smashed.{j}"], t[f"labels.{j}"])
               for j, (w, m) in enumerate(zip(h["windows"], h["batches_sent"], strict=True))]  # fmt: skip
    return ClientEpoch(t["xc"].reshape(-1), t["xa"].reshape(-1), uploads, [float(v) for v in h["losses"]],
                       int(h["batches"]))  # fmt: skip


@lru_cache(maxsize=2)
def node_algorithm(config_json: str, data: str | None, client: int, num_classes: int) -> CSEFSL:
    """The run's CSE-FSL on the node: its client-side model, auxiliary net and the client's batches."""
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.byo import RunObjects
    from fedweave.config import load as load_config
    from fedweave.data.base import Dataset
    from fedweave.deploy.node_data import load_node_data

    config = load_config(json.loads(config_json))
    if config.algorithm.name != "cse_fsl":
        raise ValueError(f"this node runs split epochs of cse_fsl only, not of {config.algorithm.name!r}")
    if data is None:  # a trial: the configured dataset's partition
        return build_algorithm(RunContext(config))
    x, y = load_node_data(data)
    ds = Dataset(f"node data {data}", x, y, x[:0], y[:0], num_classes, tuple(x.shape[1:]))
    ctx = RunContext(config, RunObjects(dataset=ds))
    # the node's file is its client's data: the client's partition is all of it
    ctx.partition = [np.zeros(0, dtype=np.int64)] * client + [np.arange(len(x))]
    return build_algorithm(ctx)


def run_epoch(h: dict, t: dict[str, torch.Tensor], config_json: str, data: str | None, client: int):
    """The node's side of a split job: the client's epoch from the fed server's models."""
    algo = node_algorithm(config_json, data, client, int(h["num_classes"]))
    lrs = tuple(float(v) for v in h["lrs"])
    ep = algo.client_epoch(int(h["round"]), client, t["xc"].reshape(-1), t["xa"].reshape(-1), lrs,
                           int(h["start"]), int(h["period"]), int(h["seg"]))  # fmt: skip
    return encode_epoch(ep)
