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

Everything a run writes on a node lies in that run's directory ``<dir>/run-<run id>``: besides the files
above, a trial node's samples of its client (``client-<c>/samples.npz``, ``fedweave.deploy.client_app``) and
the error-feedback residuals of compressed uploads (``residuals/client-<c>/round-<r>.npz``,
``fedweave.deploy.compressed``). At the run's end :meth:`NodeState.release` removes them by name, and only
them: nothing the run did not write, nothing outside its directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

INITIAL = -1  # the state_round of a client that has not reported yet: every row starts at zero
RESIDUALS = "residuals"  # the run directory's part that holds the error-feedback residuals (compressed uploads)
SAMPLES = "samples.npz"  # a trial node's samples of its client, in the client's directory of the run
# The names of the files a run writes in a client's directory (of the run, or of its residuals), and of the
# temporary files of their atomic writes (``_write``: ``.<name>.<random>.tmp``), which a node killed mid-write
# leaves behind; nothing else there is the run's.
_NAME = rf"(?:{re.escape(SAMPLES)}|(?:turn-)?round-\d+\.npz)"
RUN_FILE = re.compile(rf"{_NAME}|\.{_NAME}\.[a-z0-9_]+\.tmp")


class StateMissingError(RuntimeError):
    """The version of a client's state that the server accepted is not on this node."""


class NodeState:
    """Versions of the state rows of the clients this node holds, for one Flower run."""

    def __init__(self, root: str | Path, run_id: int, part: str | None = None) -> None:
        """The versions under ``<root>/run-<run_id>`` (``part``: under that subdirectory of it instead, e.g.
        :data:`RESIDUALS`)."""
        self.run_dir = Path(root).expanduser() / f"run-{int(run_id)}"
        self.dir = self.run_dir if part is None else self.run_dir / part

    def client_dir(self, client: int) -> Path:
        """The directory of ``client``'s files."""
        return self.dir / f"client-{int(client)}"

    def samples(self, client: int) -> Path:
        """Where a trial node keeps the samples it derived for ``client`` in this run."""
        return self.client_dir(client) / SAMPLES

    def _file(self, client: int, round: int) -> Path:
        return self.client_dir(client) / f"round-{int(round)}.npz"

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
        return self.client_dir(client) / f"turn-round-{int(round)}.npz"

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

    # ---- the run's end ---------------------------------------------------------------------------------
    def release(self, client: int, keep: tuple[str | Path, ...] = ()) -> tuple[list[Path], list[str]]:
        """Remove every file this run wrote for ``client`` on this node (its state versions, its split turns,
        its samples, its error-feedback residuals, a write's leftover temporary file), then the directories of
        the run that this leaves empty. Only files named as the run names them (:data:`RUN_FILE`) go, and only
        plain files in the run's own directories: a file someone else put there, a link, a directory that is a
        link (it leads out of the run's directory), other clients' and other runs' files stay, and so do the
        files ``keep`` names (a node's own ``data`` file, wherever it lies). Returns the files removed and,
        for each one that could not be removed, why."""
        removed: list[Path] = []
        failed: list[str] = []
        dirs = [self.run_dir / f"client-{int(client)}", self.run_dir / RESIDUALS / f"client-{int(client)}"]
        for d in dirs:
            if not _own_dir(d, self.run_dir):
                continue
            try:
                files = sorted(d.iterdir())
            except OSError as e:
                failed.append(f"{d}: {e}")
                continue
            for f in files:
                if RUN_FILE.fullmatch(f.name) and f.is_file() and not f.is_symlink() and not _is_any(f, keep):
                    try:
                        f.unlink()
                        removed.append(f)
                    except FileNotFoundError:  # a second release of the same files (another node's, say)
                        pass
                    except OSError as e:
                        failed.append(f"{f}: {e}")
        for d in (*dirs, self.run_dir / RESIDUALS, self.run_dir):  # innermost first; a directory in use stays
            if _own_dir(d, self.run_dir):
                # not empty (another client's files, or a file the run did not write), or gone: it stays
                with contextlib.suppress(OSError):
                    d.rmdir()
        return removed, failed


def _own_dir(d: Path, run_dir: Path) -> bool:
    """Whether ``d`` is a real directory of the run: it and every directory between it and the run's directory
    exist and none is a link."""
    while d != d.parent:
        if d.is_symlink() or not d.is_dir():
            return False
        if d == run_dir:
            return True
        d = d.parent
    return False


def _is_any(file: Path, paths: tuple[str | Path, ...]) -> bool:
    """Whether ``file`` is one of ``paths`` (the same file, under whatever name)."""
    for p in paths:
        try:
            if os.path.samefile(file, p):
                return True
        except OSError:  # that path does not exist: it is not this file
            continue
    return False


def _write(file: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as an ``.npz`` at ``file``, written atomically (a reader sees the old file or the new one)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{n: t.detach().cpu().numpy() for n, t in state.items()})
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
