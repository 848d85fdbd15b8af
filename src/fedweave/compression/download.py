"""Compressed downloads (``compression.download``, docs/compression.md): what the server broadcasts, encoded.

The server keeps, for every client, the model that client holds (its replica ``x_hat_i``, the same ``x_0`` for
every client at the start: each builds the initial model from the run's seed) and sends each recipient the
difference of the current model from it, compressed: ``C(x_t - x_hat_i)``; both ends then add the decoded
difference, ``x_hat_i <- x_hat_i + C(x_t - x_hat_i)``, and the client trains from ``x_hat_i``. What the
compression dropped stays in ``x_t - x_hat_i`` and is sent in a later round: the server-side error feedback of
the bidirectional-compression literature (Tang et al. 2019, DoubleSqueeze; Philippenko & Dieuleveut 2021, MCM,
whose "model that the clients hold" this is), per client, so a client that missed rounds catches up. The
clients' updates are then measured from what they started from, ``y_i - x_hat_i``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedweave.compression.compressors import KEY as UPLOAD_KEY
from fedweave.compression.compressors import Compressor
from fedweave.compression.stage import build_compressor
from fedweave.config import ConfigError
from fedweave.execution import StateStore

KEY = "compression.download"
REPLICA = "replica"


class DownloadCompression:
    """The server's compressed broadcast of one run: ``compressor``, each client's replica (rows by client id,
    ``x0`` at the start) and ``ctx`` (the run's seeds: the ``("compression_download", round, client)`` streams;
    its ledger and placement)."""

    def __init__(self, compressor: Compressor, x0: torch.Tensor, num_clients: int, ctx: Any) -> None:
        try:
            compressor.check(len(x0))
        except ConfigError as e:  # the compressors' checks name the upload key
            raise ConfigError(str(e).replace(UPLOAD_KEY, KEY)) from None
        self.compressor, self.ctx = compressor, ctx
        self.store = StateStore(num_clients, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create(REPLICA, len(x0), fill=x0.detach())
        self.ctx.ledger.store("server", "client_replicas", num_clients * len(x0) * ctx.float_bytes)

    def broadcast(self, key: int, clients: np.ndarray, x: torch.Tensor) -> int:
        """Send ``x`` to each of ``clients`` in round ``key``: their replicas move by the decoded difference;
        returns the bytes sent (what the ledger bills)."""
        c, clients = self.compressor, np.asarray(clients)
        held = self.store.rows(REPLICA, clients)
        diff = x - held
        out, total = torch.empty_like(diff), 0
        for j, client in enumerate(clients.tolist()):
            rng = self.ctx.seeds.torch("compression_download", key, client) if c.random else None
            encoded = c.encode(diff[j].detach().to("cpu"), rng)
            out[j] = c.decode(encoded).to(out.device)
            total += encoded.nbytes
        self.store.set_rows(REPLICA, clients, held + out)  # x_hat_i <- x_hat_i + C(x_t - x_hat_i)
        return total

    def held(self, clients: np.ndarray) -> torch.Tensor:
        """The models ``clients`` hold (their replicas), one row each: where they start training from."""
        return self.store.rows(REPLICA, np.asarray(clients))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The replicas (for the algorithm's checkpoint)."""
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the replicas of :meth:`state_dict` (a resumed run)."""
        self.store.load_state_dict(state)


def download_compression(algo: Any) -> DownloadCompression | None:
    """The run's compressed downloads (``compression.download``) for the star method ``algo``, or None when the
    server broadcasts dense (``build_algorithm`` refused it already for a method that does not compress its
    downloads)."""
    section = algo.ctx.config.compression.download_section
    if section is None:
        return None
    compressor = build_compressor(section, KEY)
    return DownloadCompression(compressor, algo.x, algo.ctx.num_clients, algo.ctx)
