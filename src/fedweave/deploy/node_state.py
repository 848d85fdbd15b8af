"""The per-client state a SuperNode keeps for the clients it holds (SCAFFOLD's ``c_i``, FedDyn's local
gradient), in files under its state directory, so that it survives rounds and restarts of the node.

Every round a client trains writes a new version, ``<dir>/run-<run id>/client-<c>/round-<r>.npz``; the
server names in each job the version it accepted (the round of the last reply it used from that client),
and the node starts from that one and forgets the others. So a reply that never reached the server (the
node died, the reply timed out, the round went on without the client) leaves no trace in the client's
state: exactly what a dropout does in simulation.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

INITIAL = -1  # the state_round of a client that has not reported yet: every row starts at zero


class StateMissingError(RuntimeError):
    """The version of a client's state that the server accepted is not on this node."""


class NodeState:
    """Versions of the state rows of the clients this node holds, for one Flower run."""

    def __init__(self, root: str | Path, run_id: int) -> None:
        self.dir = Path(root).expanduser() / f"run-{int(run_id)}"

    def _file(self, client: int, round: int) -> Path:
        return self.dir / f"client-{int(client)}" / f"round-{int(round)}.npz"

    def load(self, client: int, round: int, names: tuple[str, ...], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state rows ``(1, P)`` of ``client`` as of ``round`` (zeros like ``like`` when INITIAL)."""
        if round == INITIAL:
            return {n: torch.zeros_like(like).reshape(1, -1) for n in names}
        file = self._file(client, round)
        if not file.is_file():
            raise StateMissingError(
                f"the state of client {client} from round {round + 1} is not in {file.parent} (was the node "
                "restarted with another state-dir?)"
            )
        with np.load(file, allow_pickle=False) as z:
            missing = [n for n in names if n not in z.files]
            if missing:
                raise StateMissingError(f"{file} lacks the client state {missing}")
            return {n: torch.from_numpy(z[n].copy()).reshape(1, -1) for n in names}

    def save(self, client: int, round: int, state: dict[str, torch.Tensor], accepted: int) -> None:
        """Write the version of ``round`` atomically; keep only it and the ``accepted`` one it came from."""
        folder = self._file(client, round).parent
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **{n: t.detach().cpu().numpy() for n, t in state.items()})
            os.replace(tmp, self._file(client, round))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        keep = {self._file(client, round).name, self._file(client, accepted).name}
        for old in folder.glob("round-*.npz"):
            if old.name not in keep:
                old.unlink(missing_ok=True)
