"""Compressed uploads on Flower (``compression.upload``, docs/compression.md): the node encodes what its client
sends, the server decodes it.

A node whose run config compresses its uploads replies with each message's encoded bytes (one ``uint8`` array,
``compressed.<message>``: the packed fields of :class:`fedweave.compression.Encoded`, exactly the bytes the
ledger bills) and, in the header, the message names in the order they were encoded (their seed streams'
index); it never sends the dense tensors. The node draws from the same ``("compression", round, client,
message)`` streams as the simulation and keeps its client's error-feedback residuals in versioned files beside
the other client state (:class:`fedweave.deploy.node_state.NodeState` under ``<state-dir>/run-<id>/residuals``,
removed with the run's other files at its end): the
server names in each job the round of the residual version it accepted (``residual_round``), so a reply that
never reached the server leaves no trace, as a dropout does in simulation.

The server decodes each reply as it arrives (random-k's coordinates regenerated from the client's stream) and
hands the round's compression stage, :class:`RemoteCompression`, the decoded rows and their encoded sizes in
place of encoding them itself. So a deployed run computes every number the simulation does, bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from fedweave.compression import Compressor, UploadCompression, build_compressor, received
from fedweave.compression.stage import UPDATE
from fedweave.config import load as load_config
from fedweave.deploy.jobs import whole
from fedweave.deploy.node_state import INITIAL, RESIDUALS, NodeState
from fedweave.deploy.wire import from_records, to_records
from fedweave.seeding import Seeds

PREFIX = "compressed."  # the reply's array of each encoded message
ORDER = "compressed"  # the reply header's list of the encoded messages, in their streams' order
RESIDUAL_ROUND = "residual_round"  # the job header's round of the residual version the server accepted


@lru_cache(maxsize=2)
def run_compressor(config_json: str) -> Compressor | None:
    """The upload compressor of the run config ``config_json`` (None: its uploads travel dense)."""
    section = load_config(json.loads(config_json)).compression.upload_section
    return None if section is None else build_compressor(section)


# ---- the node ------------------------------------------------------------------------------------------------
def encode_reply(
    compressor: Compressor,
    h: dict[str, Any],
    start: torch.Tensor,
    sent: dict[str, torch.Tensor],
    seeds: Seeds,
    root: str | Path,
    run_id: int,
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """What a node sends for the job of header ``h`` (start row ``start``) in place of the dense ``sent``: the
    message names in order and each message's encoded bytes. A model upload travels as ``y_i - x`` (message
    ``update``), a stateful client's upload message by message, as in the simulation's stage. With error
    feedback the residuals of version ``h['residual_round']`` are added before encoding and the new ones
    written (version of the job's round) before the reply leaves."""
    client, round = whole(h, "client", 0), whole(h, "round", 0)
    accepted = whole(h, RESIDUAL_ROUND, INITIAL)
    messages = {UPDATE: sent["params"] - start} if list(sent) == ["params"] else sent
    names = tuple(f"residual_{n}" for n in messages)
    store = NodeState(root, run_id, RESIDUALS)
    ef = compressor.error_feedback
    residuals = store.load(client, accepted, names, start) if ef else {}
    tensors, new = {}, {}
    for index, (name, v) in enumerate(messages.items()):
        v = v.reshape(1, -1)
        p = v + residuals[f"residual_{name}"].to(v) if ef else v  # p_i = v_i + e_i
        rng = seeds.torch("compression", round, client, index) if compressor.random else None
        encoded = compressor.encode(p[0].detach().to("cpu"), rng)
        tensors[PREFIX + name] = torch.frombuffer(bytearray(encoded.to_bytes()), dtype=torch.uint8)
        if ef:
            new[f"residual_{name}"] = p - compressor.decode(encoded).to(p.device).reshape(1, -1)  # e_i <- p_i - C(p_i)
    if ef:
        store.save(client, round, new, accepted=accepted)
    return list(messages), tensors


# ---- the server ----------------------------------------------------------------------------------------------
@dataclass
class Opened:
    """A reply with its encoded messages decoded: what the deployment's trainer reads (``content``)."""

    content: Any


class RemoteCompression(UploadCompression):
    """The compression stage of a deployed run: the nodes encoded the uploads and keep the residuals; the server
    takes the rows it decoded from the replies (:meth:`open`) and bills their encoded bytes."""

    def __init__(self, stage: UploadCompression) -> None:  # the simulated stage's settings; no residual table here
        self.compressor, self.size, self.ctx = stage.compressor, stage.size, stage.ctx
        self.arrived: dict[tuple[int, int, str], tuple[torch.Tensor, int]] = {}

    def open(self, round: int, client: int, start: torch.Tensor, reply: Any) -> Opened:
        """Decode the encoded messages of ``client``'s reply in ``round`` (its job's start row ``start``): a model
        upload becomes ``params = start + decoded``, a stateful upload's messages their decoded rows. Raises
        ValueError (or KeyError) for a reply that does not carry the run's encoded upload."""
        header, tensors = from_records(reply.content)
        h = json.loads(header)
        dense = {k: t for k, t in tensors.items() if not k.startswith(PREFIX)}
        c, start = self.compressor, start.reshape(-1)
        for index, name in enumerate(h.pop(ORDER)):
            data = tensors[PREFIX + name].numpy().tobytes()
            rng = self.ctx.seeds.torch("compression", round, client, index) if c.random else None
            encoded = received(c, data, start.numel(), start.dtype, rng)
            row = c.decode(encoded).to(start.device)
            self.arrived[(round, client, name)] = (row, encoded.nbytes)
            dense["params" if name == UPDATE else name] = (start + row if name == UPDATE else row).reshape(1, -1)
        return Opened(to_records(h, dense))

    def transmit(self, key: int, clients, index: int, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The rows the server decoded from the clients' replies for message ``name`` of round ``key``, and
        their encoded bytes (``rows``, what the server rebuilt, is not sent again)."""
        out, total = torch.empty_like(rows), 0
        for j, client in enumerate(map(int, clients)):
            if (key, client, name) not in self.arrived:  # a method whose uploads are not its trainer's replies
                raise RuntimeError(f"round {key + 1}: no encoded {name!r} from client {client} arrived")
            row, nbytes = self.arrived.pop((key, client, name))
            out[j], total = row.to(out.device), total + nbytes
        return out, total

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Nothing: the residuals are on the nodes."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore on the server (the nodes keep the residuals)."""


def attach(clients: Any, algo: Any, lost_error: type[Exception]) -> None:
    """Make a deployed ``algo`` whose uploads are compressed read them encoded: each job names the residual
    version its client's node starts from, each reply is decoded as it arrives, and the round's compression
    stage takes the decoded rows; a reply that is not the encoded upload raises ``lost_error(round, reasons)``
    (the ServerApp's ``ClientsLost``: the error policy decides). No-op for a run without
    ``compression.upload``."""
    stage = getattr(algo, "compression", None)
    if stage is None:
        return
    remote = RemoteCompression(stage)
    algo.compression = remote
    run_jobs = clients.run_jobs

    def run_encoded_jobs(round: int, jobs: list[tuple[int, dict, dict[str, torch.Tensor]]]) -> list[Any]:
        jobs = [(c, {**h, RESIDUAL_ROUND: clients.accepted.get(c, INITIAL)}, t) for c, h, t in jobs]
        replies = run_jobs(round, jobs)
        out, lost = [], {}
        for (c, _, t), reply in zip(jobs, replies, strict=True):
            try:
                out.append(remote.open(round, c, t["start"], reply))
            except (KeyError, ValueError, TypeError) as e:
                lost[c] = f"its reply is not the run's encoded upload ({type(e).__name__}: {e})"
        if lost:
            raise lost_error(round, lost)
        for c, _, _ in jobs:
            clients.accepted[c] = round  # the residual version each node wrote for this round is the one used
        return out

    clients.run_jobs = run_encoded_jobs
