"""The communication ledger (DESIGN principle 5): every transfer is a recorded entry.

An entry is (round, sender role, receiver role, kind, bytes, count). Roles are free strings; the ones
fedweave uses are ``client``, ``server`` (the star's server, a split-learning server, a hierarchy's top),
``fed_server`` (split learning's server that averages the client-side models), ``peer`` (decentralized
clients), ``user`` and ``edge`` (confederated learning). ``up`` is traffic from a
client-like role to a server-like role, ``down`` the reverse, ``lateral`` everything else (peer-to-peer,
server-to-server). Storage held by each role is recorded separately as a high-water mark (a
decentralized peer's under ``client``, per peer, as a star client's; a confederated server's and user's under
``edge`` and ``user``, per server and per user).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

CLIENT_ROLES = frozenset({"client", "user"})
SERVER_ROLES = frozenset({"server", "edge", "fed_server"})


def direction(sender: str, receiver: str) -> str:
    if sender in CLIENT_ROLES and receiver in SERVER_ROLES:
        return "up"
    if sender in SERVER_ROLES and receiver in CLIENT_ROLES:
        return "down"
    return "lateral"


def nbytes(*tensors: torch.Tensor) -> int:
    """Bytes of the given tensors as they would be sent (dense, in their dtype)."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Entry:
    round: int
    sender: str
    receiver: str
    kind: str
    bytes: int
    count: int


class Ledger:
    """Records transfers; aggregates by round, direction, role pair and kind."""

    def __init__(self) -> None:
        self._totals: dict[tuple[int, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        self._storage: dict[tuple[str, str], int] = {}

    def record(self, round: int, sender: str, receiver: str, kind: str, nbytes: int, count: int = 1) -> None:
        """Record ``count`` messages totalling ``nbytes`` bytes from ``sender`` to ``receiver``."""
        if nbytes < 0 or count < 0:
            raise ValueError(f"ledger: bytes and count must be >= 0, got {nbytes}, {count}")
        cell = self._totals[(int(round), sender, receiver, kind)]
        cell[0] += int(nbytes)
        cell[1] += int(count)

    def store(self, role: str, what: str, nbytes: int) -> None:
        """Record that ``role`` holds ``nbytes`` of ``what``; keeps the peak."""
        key = (role, what)
        self._storage[key] = max(self._storage.get(key, 0), int(nbytes))

    # ---- queries ---------------------------------------------------------------------------------
    def entries(self) -> Iterable[Entry]:
        for (r, s, t, k), (b, c) in sorted(self._totals.items()):
            yield Entry(r, s, t, k, b, c)

    def bytes(
        self,
        direction_: str | None = None,
        *,
        upto_round: int | None = None,
        round: int | None = None,
        kind: str | None = None,
        sender: str | None = None,
        receiver: str | None = None,
    ) -> int:
        total = 0
        for (r, s, t, k), (b, _) in self._totals.items():
            if upto_round is not None and r > upto_round:
                continue
            if round is not None and r != round:
                continue
            if kind is not None and k != kind:
                continue
            if sender is not None and s != sender:
                continue
            if receiver is not None and t != receiver:
                continue
            if direction_ is not None and direction(s, t) != direction_:
                continue
            total += b
        return total

    def count(self, *, kind: str | None = None, sender: str | None = None, receiver: str | None = None) -> int:
        return sum(
            c
            for (_, s, t, k), (_, c) in self._totals.items()
            if (kind is None or k == kind) and (sender is None or s == sender) and (receiver is None or t == receiver)
        )

    def summary(self) -> dict:
        """Totals by direction and by (sender->receiver, kind), plus peak storage per role."""
        by_kind: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "count": 0})
        by_dir = {"up": 0, "down": 0, "lateral": 0}
        for (_, s, t, k), (b, c) in self._totals.items():
            key = f"{s}->{t}:{k}"
            by_kind[key]["bytes"] += b
            by_kind[key]["count"] += c
            by_dir[direction(s, t)] += b
        storage: dict[str, dict[str, int]] = defaultdict(dict)
        for (role, what), b in self._storage.items():
            storage[role][what] = b
        return {
            "bytes_up": by_dir["up"],
            "bytes_down": by_dir["down"],
            "bytes_lateral": by_dir["lateral"],
            "bytes_total": sum(by_dir.values()),
            "by_transfer": dict(sorted(by_kind.items())),
            "storage_peak_bytes": dict(storage),
        }

    # ---- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "totals": [[*k, *v] for k, v in self._totals.items()],
            "storage": [[*k, v] for k, v in self._storage.items()],
        }

    def load_state_dict(self, state: dict, *, keep_storage: bool = False) -> None:
        """Replace the ledger by ``state`` (exactly: a round computed again starts from the state before it).

        With ``keep_storage`` a storage entry ``state`` lacks keeps this ledger's figure: a resumed run's ledger
        holds what its algorithm declared when it was built, and a checkpoint written before the algorithm
        declared an entry does not hold it. For the entries it holds, the checkpoint's figures (peaks reached
        before it was written) replace this ledger's."""
        self._totals.clear()
        if not keep_storage:
            self._storage.clear()
        for r, s, t, k, b, c in state["totals"]:
            self._totals[(int(r), s, t, k)] = [int(b), int(c)]
        for role, what, b in state["storage"]:
            self._storage[(role, what)] = int(b)
