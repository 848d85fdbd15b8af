"""The per-client state a SuperNode keeps for the clients it holds (SCAFFOLD's ``c_i``, FedDyn's local
gradient), in files under its state directory, so that it survives rounds and restarts of the node.

Every round a client trains writes a new version, ``<dir>/run-<run id>/client-<c>/round-<r>.npz``; the
server names in each job the version it accepted (the round of the last reply it used from that client),
and the node starts from that one and forgets the others. So a reply that never reached the server (the
node died, the reply timed out, the round went on without the client) leaves no trace in the client's
state: exactly what a dropout does in simulation.

A client of FSL_MC or FSL_OC exchanges several messages with the server in one round (a smashed batch up,
its gradient down); between two of them it keeps its client-side model, its dropout stream and its batch in
``<dir>/run-<run id>/client-<c>/turn-round-<r>.npz``, written before each reply leaves.
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
        file = self._file(client, round)
        _write(file, state)
        keep = {file.name, self._file(client, accepted).name}
        for old in file.parent.glob("round-*.npz"):
            if old.name not in keep:
                old.unlink(missing_ok=True)

    # ---- a split-learning client between two exchanges of a round (FSL_MC, FSL_OC) ----------------------
    def _turn_file(self, client: int, round: int) -> Path:
        return self.dir / f"client-{int(client)}" / f"turn-round-{int(round)}.npz"

    def save_turn(self, client: int, round: int, state: dict[str, torch.Tensor]) -> None:
        """Keep what ``client`` needs for its next exchange of ``round`` (its model, its dropout stream, its
        batch); the files of earlier rounds go."""
        file = self._turn_file(client, round)
        _write(file, state)
        for old in file.parent.glob("turn-round-*.npz"):
            if old.name != file.name:
                old.unlink(missing_ok=True)

    def load_turn(self, client: int, round: int) -> dict[str, torch.Tensor]:
        file = self._turn_file(client, round)
        if not file.is_file():
            raise StateMissingError(
                f"client {client} has no exchange of round {round + 1} in progress in {file.parent} (the server's "
                "gradient came to a node that did not send the smashed data, or that was restarted with another "
                "state-dir)"
            )
        with np.load(file, allow_pickle=False) as z:
            return {n: torch.from_numpy(z[n].copy()) for n in z.files}


def _write(file: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as an ``.npz`` at ``file``, written atomically (a reader sees the old file or the new one)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{n: t.detach().cpu().numpy() for n, t in state.items()})
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
