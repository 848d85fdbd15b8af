"""The split family deployed: the clients' side of each method runs on the client's node, the main and fed
servers stay in the ServerApp, and the messages carry what the method sends (docs/deployment.md).

- **CSE-FSL, FSL_AN** (an auxiliary net, no gradients down): one message per client and round segment. The
  job carries the fed server's ``x_c`` and ``a_c`` down; the reply carries the client's updated ``x_c`` and
  ``a_c`` and its smashed uploads (every h-th batch; FSL_AN: every batch) and their labels up. The node runs
  ``SplitAlgorithm.client_epoch``, the simulation's one implementation of the client's epoch.
- **FSL_MC, FSL_OC** (the server's gradient back after every batch): one message per batch. The first
  carries ``x_c`` down and its reply the first smashed batch and labels; each next one carries the server's
  gradient of the last batch and its reply the next smashed batch, or, after the last batch, the client's
  model. The node runs ``SplitAlgorithm.client_turn`` and keeps the client between messages in its state
  directory (``NodeState.save_turn``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from fedweave.algorithms.split.base import BackpropClient, ClientEpoch, SplitAlgorithm
from fedweave.config import ConfigError
from fedweave.deploy.jobs import MalformedJobError, check_tensors, decode_lr, whole
from fedweave.deploy.wire import from_records, on_device

if TYPE_CHECKING:
    from flwr.app import Message

    from fedweave.deploy.node_state import NodeState

EPOCH, TURN = "split_epoch", "split_turn"  # the ``kind`` of a split job's header
KINDS = (EPOCH, TURN)


class RemoteClients(Protocol):
    """What the split family needs of the server's clients: ``fedweave.deploy.server_app.FlowerClients``, which
    attaches this module to a split algorithm (a protocol, so that the import goes one way)."""

    def run_jobs(self, round: int, jobs: list[tuple[int, dict, dict[str, torch.Tensor]]]) -> list[Message]:
        """Each ``(client, header, tensors)`` job as one message to its client's node; the replies in job
        order."""
        ...


def attach(clients: RemoteClients, algo: SplitAlgorithm) -> None:
    """Run the clients' side of ``algo`` on their nodes."""
    algo.client_epochs = remote_epochs(clients, algo)
    algo.backprop_session = lambda r, chosen, xc_rows, lr: RemoteSession(clients, algo, r, chosen, xc_rows, lr)


def remote_epochs(clients: RemoteClients, algo: SplitAlgorithm):
    """``algo.client_epochs`` with every client's epoch on its node."""

    def client_epochs(r, chosen, xc, xa, lrs, start, period, seg) -> list[ClientEpoch]:
        jobs = []
        for k, c in enumerate(map(int, chosen)):
            header = {"kind": EPOCH, "client": c, "round": int(r), "lrs": [float(v) for v in lrs],
                      "start": int(start), "period": int(period), "seg": int(seg),
                      "num_classes": algo.ctx.dataset.num_classes}  # fmt: skip
            jobs.append((c, header, {"xc": xc[k].reshape(1, -1), "xa": xa[k].reshape(1, -1)}))
        out = []
        for reply in clients.run_jobs(int(r), jobs):
            header, tensors = from_records(reply.content, algo.ctx.device)
            out.append(decode_epoch(json.loads(header), tensors))
        return out

    return client_epochs


class RemoteSession:
    """``BackpropSession`` with every client on its node: each exchange is one message to it, the exchanges
    with several clients go out at once. The first exchange of every client of the round (``x_c`` down, its
    first smashed batch up) does not depend on the server model, so all of them go out with the first."""

    parallel = True

    def __init__(self, clients: RemoteClients, algo: SplitAlgorithm, r: int, chosen: np.ndarray,
                 xc_rows: torch.Tensor, lr: float) -> None:  # fmt: skip
        self.fl, self.algo, self.r, self.lr = clients, algo, int(r), float(lr)
        self.chosen, self.xc_rows = [int(i) for i in chosen], xc_rows
        self.batch = dict.fromkeys(range(len(self.chosen)), 0)  # the next batch each client sends
        self.first: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.final: dict[int, torch.Tensor] = {}

    def _exchange(self, grads: dict[int, torch.Tensor | None]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        jobs = []
        for k, g in grads.items():
            header = {"kind": TURN, "client": self.chosen[k], "round": self.r, "batch": self.batch[k], "lr": self.lr,
                      "num_classes": self.algo.ctx.dataset.num_classes}  # fmt: skip
            tensors = {"xc": self.xc_rows[k].reshape(1, -1)} if g is None else {"grad": g}
            jobs.append((self.chosen[k], header, tensors))
        out = {}
        for k, reply in zip(grads, self.fl.run_jobs(self.r, jobs), strict=True):
            _, t = from_records(reply.content, self.algo.ctx.device)
            if "xc" in t:  # its batches are done: its model
                self.final[k] = t["xc"].reshape(-1)
            else:
                out[k] = (t["smashed"], t["labels"])
                self.batch[k] += 1
        return out

    def start(self, ks: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        if self.first is None:
            self.first = self._exchange(dict.fromkeys(range(len(self.chosen))))
        return {k: self.first[k] for k in ks if k in self.first}

    def turn(self, grads: dict[int, torch.Tensor | None]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return self._exchange(grads)

    def models(self) -> torch.Tensor:
        return torch.stack([self.final.get(k, self.xc_rows[k]) for k in range(len(self.chosen))])


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
def node_algorithm(config_json: str, data: str | None, client: int, num_classes: int) -> SplitAlgorithm:
    """The run's split algorithm on the node: its client-side model, auxiliary net and the client's batches."""
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.byo import RunObjects
    from fedweave.config import load as load_config
    from fedweave.deploy.node_data import node_dataset, own_parts
    from fedweave.registry import ALGORITHMS

    config = load_config(json.loads(config_json))
    if ALGORITHMS.get(config.algorithm.name).family != "split":
        raise ValueError(f"this node runs split-learning clients only, not {config.algorithm.name!r}")
    if data is None:  # the configured dataset's partition, in memory
        return build_algorithm(RunContext(config))
    ds = node_dataset(data, num_classes, f"node data {data}")
    ctx = RunContext(config, RunObjects(dataset=ds))
    # the node's file is its client's data: the client's partition is all of it
    ctx.partition = own_parts(client, len(ds.train_x), config.num_clients)
    return build_algorithm(ctx)


def _checked(h: dict, t: dict[str, torch.Tensor], algo: SplitAlgorithm, counts: dict[str, int]) -> None:
    """A split job's settings (``counts``: whole numbers and their least values; its learning rates) and its
    models (``x_c``, ``a_c``: the run's client-side model and auxiliary net, in the run's dtype)."""
    try:
        for key, least in counts.items():
            whole(h, key, least)
        for lr in h["lrs"] if "lrs" in h else [h["lr"]]:
            decode_lr(lr)
    except ConfigError as e:
        raise MalformedJobError(f"the job's {e}") from e
    for name, model in (("xc", algo.xc), ("xa", algo.xa)):
        if name in t:
            check_tensors({name: t[name]}, model.numel(), model.dtype)
    if "grad" in t and t["grad"].dtype not in (algo.xc.dtype, torch.bfloat16):  # bf16: a bf16-mixed run
        raise MalformedJobError(f"job tensor 'grad' is {t['grad'].dtype}; the run's parameters are {algo.xc.dtype}")


def run_epoch(h: dict, t: dict[str, torch.Tensor], config_json: str, data: str | None, client: int):
    """The node's side of a CSE-FSL or FSL_AN job: the client's epoch from the fed server's models."""
    algo = node_algorithm(config_json, data, client, int(h["num_classes"]))
    _checked(h, t, algo, {"round": 0, "start": 0, "period": 1, "seg": 0})
    t = on_device(t, algo.ctx.device)
    lrs = tuple(float(v) for v in h["lrs"])
    ep = algo.client_epoch(int(h["round"]), client, t["xc"].reshape(-1), t["xa"].reshape(-1), lrs,
                           int(h["start"]), int(h["period"]), int(h["seg"]))  # fmt: skip
    return encode_epoch(ep)


def run_turn(h: dict, t: dict[str, torch.Tensor], config_json: str, data: str | None, client: int,
             store: NodeState) -> tuple[dict, dict[str, torch.Tensor]]:  # fmt: skip
    """The node's side of one FSL_MC or FSL_OC exchange: the client (from ``x_c``, or as it was after its last
    exchange) takes the server's gradient and sends its next smashed batch, or its model when done."""
    algo = node_algorithm(config_json, data, client, int(h["num_classes"]))
    _checked(h, t, algo, {"round": 0, "batch": 0})
    r, batch = int(h["round"]), int(h["batch"])
    t = on_device(t, algo.ctx.device)
    if "grad" in t:
        kept = store.load_turn(client, r)
        c = BackpropClient(client, r, kept["xc"].to(algo.ctx.device), kept["rng"], int(kept["batch"]), sent=True)
        if c.batch + 1 != batch:
            raise MalformedJobError(
                f"the server's gradient is of batch {batch - 1}, but client {client} sent batch {c.batch}"
            )
        grad = t["grad"]
    else:
        c, grad = algo.backprop_client(r, client, t["xc"].reshape(-1)), None
    up = algo.client_turn(c, algo.local_batches(r, client), grad, float(h["lr"]))
    store.save_turn(client, r, {"xc": c.xc, "rng": c.rng, "batch": torch.tensor(c.batch)})
    if up is None:
        return {"batch": c.batch, "done": True}, {"xc": c.xc.reshape(1, -1)}
    return {"batch": c.batch, "done": False}, {"smashed": up[0], "labels": up[1]}
