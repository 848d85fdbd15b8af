"""The compression stage of the star round (DESIGN principle 17, stage 2): encode each reporting client's
upload, bill the encoded bytes, decode on the server, keep each client's error-feedback residual.

What is compressed is what the method transmits: the update ``y_i - x_t`` of a method whose clients send
their model (the server knows ``x_t``, so sending the displacement is the same message), and each tensor of a
stateful client's upload as it is (SCAFFOLD's ``Delta y_i`` and ``Delta c_i``, each encoded on its own with its own
residual, in the one upload the client sends, as its dense upload is one message). The residuals are client
state (one table per tensor, rows by client id), saved in the algorithm's checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from fedweave.compression.compressors import KEY, Compressor
from fedweave.config import ConfigError, Section, build_dataclass
from fedweave.execution import StateStore
from fedweave.registry import COMPRESSORS, UnknownNameError

UPDATE = "update"  # the message name of a model upload's displacement y_i - x_t


def build_compressor(section: Section, key: str = KEY) -> Compressor:
    """The registered compressor a ``compression.upload`` (or ``key``: ``compression.download``) section names,
    with its options checked."""
    try:
        cls = COMPRESSORS.get(section.name)
    except UnknownNameError as e:
        raise ConfigError(f"{key}.name: {e}") from None
    try:
        return build_dataclass(cls, section.options, key)
    except ConfigError as e:  # the compressors' own checks name the upload key: name the section given
        raise ConfigError(str(e).replace(KEY, key)) from None


class UploadCompression:
    """Compresses the uploads of a run's clients (one instance per run, built by the star template).

    ``compressor`` encodes and decodes each message; ``size`` is the length of every message (the model's
    parameter count); ``num_clients`` the clients that may send (ids 0 .. num_clients - 1); ``ctx`` is the
    run's context: its seeds (the ``("compression", round, client, message)`` streams), ledger (the
    residuals' storage) and placement (where the residual tables live).
    """

    def __init__(self, compressor: Compressor, size: int, num_clients: int, ctx: Any) -> None:
        compressor.check(size)
        self.compressor, self.size, self.ctx = compressor, size, ctx
        self.store = StateStore(num_clients, dtype=ctx.dtype, placement=ctx.placement)

    def transmit(
        self, key: int, clients: np.ndarray, index: int, name: str, rows: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Send message ``name`` (the ``index``-th of the upload) from each client of ``clients`` (one row of
        ``rows`` each) under stream key ``key`` (the round): the rows the server decodes, and the bytes sent."""
        c, ef = self.compressor, self.compressor.error_feedback
        if ef and name not in self.store:
            self.store.create(name, self.size)  # e_i = 0 (Karimireddy et al. 2019, Alg. 2)
            self.ctx.ledger.store("client", f"residual_{name}", self.size * self.ctx.float_bytes)  # per client
        held = self.store.rows(name, clients) if ef else None
        sent = rows + held if ef else rows  # p_i = v_i + e_i
        out, total = torch.empty_like(sent), 0
        for j, client in enumerate(np.asarray(clients).tolist()):
            rng = self.ctx.seeds.torch("compression", key, client, index) if c.random else None
            encoded = c.encode(sent[j].detach().to("cpu"), rng)
            out[j] = c.decode(encoded).to(out.device)
            total += encoded.nbytes
        if ef:  # e_i <- p_i - C(p_i); a non-finite message (a client whose training gave NaN) still goes to the
            # server, where a robust aggregator drops it or the run stops, but is not folded into e_i: a NaN
            # residual would make every later upload of that client NaN, a client lost for the rest of the run
            new = sent - out
            self.store.set_rows(name, clients, torch.where(torch.isfinite(new).all(1, keepdim=True), new, held))
        return out, total

    def upload(self, key: int, clients: np.ndarray, x: torch.Tensor, got: Any) -> tuple[Any, int]:
        """The round's collected uploads (a ``Collected`` whose first rows are those of ``clients``) as the
        server decodes them, and the bytes sent. Rows after the clients' (a hierarchical server's own job)
        travel nowhere and stay as they are.

        A model upload travels as ``y_i - x`` and the server rebuilds ``y_i`` as ``x + decoded``; it keeps
        the decoded displacements in ``got.sent`` (what the default client update reads, so that a lossless
        compressor leaves every number as it was). A stateful client's upload is decoded message by message.
        """
        n = len(clients)

        def joined(rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
            return rows if len(kept) == n else torch.cat([rows, kept[n:]])

        if got.upload:
            decoded, total = {}, 0
            for index, (name, rows) in enumerate(got.upload.items()):
                sent, nbytes = self.transmit(key, clients, index, name, rows[:n])
                decoded[name], total = joined(sent, rows), total + nbytes
            return dataclasses.replace(got, upload=decoded), total
        moved = got.local.params - x
        delta, total = self.transmit(key, clients, 0, UPDATE, moved[:n])
        local = dataclasses.replace(got.local, params=joined(x + delta, got.local.params))
        return dataclasses.replace(got, local=local, sent=joined(delta, moved)), total

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The clients' residuals, by message name (for the algorithm's checkpoint)."""
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the residuals of :meth:`state_dict` (a resumed run)."""
        self.store.load_state_dict(state)


def upload_compression(ctx: Any, size: int, num_clients: int) -> UploadCompression | None:
    """The run's upload compression (``compression.upload``) of messages of ``size`` values from
    ``num_clients`` clients, or None when the run sends its uploads dense."""
    section = ctx.config.compression.upload_section
    if section is None:
        return None
    return UploadCompression(build_compressor(section), size, num_clients, ctx)
