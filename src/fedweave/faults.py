"""Injected faults: deterministic decisions of who fails, from named seed streams.

Every decision is a pure function of (root seed, fault kind, round, who): it does not depend on which other
clients were sampled, on the order of the calls, on the backend, or on whether the run was resumed. So a
family may ask about one client or a whole vector of them, in any order, and get the same answers.

What a family does with the answers (docs/reliability.md):

- a client that drops out or misses the deadline (policy ``drop``) delivers nothing: its upload is not
  recorded in the ledger, and aggregation re-weights over the clients that reported;
- a round in which nobody reports uses no client update (a star model stays as it was; a server with data
  of its own still takes its step); the family returns ``reported_clients = 0`` and the runner logs the
  round as skipped;
- with policy ``late`` a straggler's update arrives ``delay_rounds`` rounds later (CSE-FSL with
  ``server_order: event``, the one method that declares ``late``; FedAsync and FedBuff refuse it: on their
  clock a slow upload is not late but arrives with its staleness);
- a lost peer link carries nothing in either direction for the round; a server that misses a round neither
  sends nor receives and keeps its state.

Randomness: one 64-bit seed per (kind, round) from :class:`fedweave.seeding.Seeds`, mixed with the keys
(client, link end points, server) by the SplitMix64 finalizer, vectorized over numpy arrays.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from fedweave.config import ConfigError, FaultsConfig
from fedweave.seeding import Seeds

# The kinds a family can declare it handles (``handles_faults`` on the algorithm class).
KINDS = ("dropout", "deadline", "late", "link_loss", "server_miss", "byzantine")
# The config keys that switch each kind on (named in errors).
KEYS = {
    "dropout": "faults.dropout / faults.outage_rounds",
    "deadline": "faults.deadline (straggler_policy: drop)",
    "late": "faults.deadline (straggler_policy: late)",
    "link_loss": "faults.link_loss",
    "server_miss": "faults.server_miss",
    "byzantine": "faults.byzantine",  # attackers and their attack: fedweave.robust
}

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64: a bijective 64-bit mixer with good avalanche (wrapping uint64 arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Faults:
    """The fault decisions of one run (built from ``config.faults`` and the run's seeds)."""

    def __init__(self, config: FaultsConfig, seeds: Seeds) -> None:
        self.config = config
        self.seeds = seeds
        self._outages = frozenset(int(r) - 1 for r in config.outage_rounds)  # 0-based like run_round(r)

    # ---- which faults are on ---------------------------------------------------------------------
    def active(self) -> set[str]:
        """The fault kinds this configuration injects (a subset of :data:`KINDS`)."""
        c = self.config
        out = set()
        if c.dropout > 0 or self._outages:
            out.add("dropout")
        if c.deadline is not None:
            out.add("deadline" if c.straggler_policy == "drop" else "late")
        if c.link_loss > 0:
            out.add("link_loss")
        if c.server_miss > 0:
            out.add("server_miss")
        if c.byzantine:
            out.add("byzantine")
        return out

    def require_handled(self, algorithm: str, handles: Iterable[str]) -> None:
        """Refuse a configuration that injects faults the algorithm does not handle (never ignore them)."""
        missing = sorted(self.active() - set(handles))
        if missing:
            what = "; ".join(KEYS[k] for k in missing)
            have = ", ".join(sorted(handles)) or "none"
            raise ConfigError(
                f"{what}: algorithm '{algorithm}' does not handle this fault (it handles: {have}); "
                "remove the key or choose another algorithm"
            )

    # ---- uniform and normal draws ----------------------------------------------------------------
    def uniform(self, kind: str, r: int, *keys: np.ndarray | int) -> np.ndarray:
        """U[0, 1) per element of the broadcast ``keys``, a pure function of (seed, kind, r, keys)."""
        shape = np.broadcast_shapes(*(np.shape(k) for k in keys))
        # flat 1-d arrays: uint64 arithmetic on arrays wraps silently (numpy scalars would warn)
        h = np.full(int(np.prod(shape)), self.seeds.int_seed(f"fault_{kind}", r), dtype=np.uint64)
        for k in keys:
            k = np.broadcast_to(np.asarray(k, dtype=np.int64), shape).reshape(-1).astype(np.uint64)
            h = _mix(h ^ _mix(k))
        return ((h >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(shape)

    def normal(self, kind: str, r: int, *keys: np.ndarray | int) -> np.ndarray:
        """N(0, 1) per element (Box-Muller on two independent uniforms)."""
        u1 = 1.0 - self.uniform(kind, r, *keys, 0)  # in (0, 1]
        u2 = self.uniform(kind, r, *keys, 1)
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)

    # ---- clients ---------------------------------------------------------------------------------
    def dropped(self, r: int, clients: np.ndarray | Iterable[int]) -> np.ndarray:
        """Boolean mask over ``clients``: True where the client fails to report in round ``r`` (0-based)."""
        clients = np.asarray(list(clients) if not isinstance(clients, np.ndarray) else clients, dtype=np.int64)
        if r in self._outages:
            return np.ones(clients.shape, dtype=bool)
        if self.config.dropout <= 0:
            return np.zeros(clients.shape, dtype=bool)
        return self.uniform("dropout", r, clients) < self.config.dropout

    def arrival_times(self, r: int, clients: np.ndarray | Iterable[int], work: np.ndarray | float = 1.0) -> np.ndarray:
        """Simulated time at which each client's upload reaches the server in round ``r``.

        ``work`` is the client's amount of local work in the clock's unit (``faults.work_unit``, applied by the
        family's ``client_work``): relative to a reference round (``round``: e.g. its local steps over the
        mean of the clients that hold data), or its local steps (``step``), so a client with twice the data takes
        twice as long. A client's time per unit of work is ``exp(speed_sigma * z_i + speed_jitter * z_{i,r})``
        with z standard normal: a fixed speed per client (median 1) and an optional per-round jitter.
        """
        clients = np.asarray(list(clients) if not isinstance(clients, np.ndarray) else clients, dtype=np.int64)
        c = self.config
        log_t = c.speed_sigma * self.normal("speed", 0, clients)  # round key 0: the speed is per client
        if c.speed_jitter > 0:
            log_t = log_t + c.speed_jitter * self.normal("speed_jitter", r, clients)
        return np.asarray(work, dtype=np.float64) * np.exp(log_t)

    def outcomes(
        self, r: int, clients: np.ndarray | Iterable[int], work: np.ndarray | float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """When the server learns how each client's job of round ``r`` ended, counted from its start, and how.

        The one latency rule of the simulated clocks (the asynchronous star's dispatches, the synchronous star's
        rounds under ``faults.sim_time``): a client's upload arrives at :meth:`arrival_times`; a client that
        drops out delivers nothing, and the server learns it when the client would have reported (its connection
        closes); with ``faults.deadline`` the server stops waiting at the deadline, so no job keeps it longer.
        Returns ``(times, lost)``: float64 times and, per client, ``""`` (the upload arrives), ``"drop"`` or,
        past the deadline, ``"timeout"`` (policy ``drop``) or ``"late"`` (policy ``late``: the upload reaches
        the server in a later round, :meth:`delay_rounds`, and holds none of them up).
        """
        clients = np.asarray(list(clients) if not isinstance(clients, np.ndarray) else clients, dtype=np.int64)
        times = self.arrival_times(r, clients, work)
        lost = np.where(self.dropped(r, clients), "drop", "")
        deadline = self.config.deadline
        if deadline is not None:
            past = "timeout" if self.config.straggler_policy == "drop" else "late"
            lost = np.where((lost == "") & (times > deadline), past, lost)
            times = np.minimum(times, deadline)
        return times, lost

    def late(self, r: int, clients: np.ndarray | Iterable[int], work: np.ndarray | float = 1.0) -> np.ndarray:
        """Boolean mask: True where the client's upload arrives after the round's deadline."""
        clients = np.asarray(list(clients) if not isinstance(clients, np.ndarray) else clients, dtype=np.int64)
        if self.config.deadline is None:
            return np.zeros(clients.shape, dtype=bool)
        return self.arrival_times(r, clients, work) > self.config.deadline

    def delay_rounds(self, r: int, clients: np.ndarray | Iterable[int], work: np.ndarray | float = 1.0) -> np.ndarray:
        """Rounds by which each upload is late (0 = on time): ``ceil(arrival / deadline) - 1``.

        With policy ``late`` an update computed in round r is applied in round ``r + delay``.
        """
        clients = np.asarray(list(clients) if not isinstance(clients, np.ndarray) else clients, dtype=np.int64)
        if self.config.deadline is None:
            return np.zeros(clients.shape, dtype=np.int64)
        t = self.arrival_times(r, clients, work) / self.config.deadline
        return np.maximum(np.ceil(t) - 1, 0).astype(np.int64)

    def reporting(self, r: int, clients: np.ndarray, work: np.ndarray | float = 1.0) -> np.ndarray:
        """The clients of ``clients`` whose upload the server uses in round ``r`` (order kept).

        Drops the clients that fail, and those past the deadline under policy ``drop``. Under policy
        ``late`` a straggler is not in this round's set either: the family delivers it later
        (see :meth:`delay_rounds`).
        """
        clients = np.asarray(clients)
        ok = ~self.dropped(r, clients) & ~self.late(r, clients, work)
        return clients[ok]

    # ---- peers and servers -----------------------------------------------------------------------
    def links_up(self, r: int, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        """Whether the undirected link {i, j} carries messages in round ``r`` (both directions alike)."""
        i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
        if self.config.link_loss <= 0:
            return np.ones(np.broadcast_shapes(i.shape, j.shape), dtype=bool)
        return self.uniform("link", r, np.minimum(i, j), np.maximum(i, j)) >= self.config.link_loss

    def link_up(self, r: int, i: int, j: int) -> bool:
        return bool(self.links_up(r, i, j))

    def surviving_links(self, r: int, adjacency: np.ndarray) -> np.ndarray:
        """``adjacency`` (n x n, bool or weights) with the links lost in round ``r`` zeroed, symmetric."""
        adjacency = np.asarray(adjacency)
        n = adjacency.shape[0]
        idx = np.arange(n)
        up = self.links_up(r, idx[:, None], idx[None, :])
        np.fill_diagonal(up, True)  # a node always hears itself
        return np.where(up, adjacency, np.zeros((), dtype=adjacency.dtype))

    def servers_up(self, r: int, servers: np.ndarray | Iterable[int]) -> np.ndarray:
        """Boolean mask over ``servers``: True where the edge server takes part in round ``r``."""
        servers = np.asarray(list(servers) if not isinstance(servers, np.ndarray) else servers, dtype=np.int64)
        if self.config.server_miss <= 0:
            return np.ones(servers.shape, dtype=bool)
        return self.uniform("server", r, servers) >= self.config.server_miss

    def server_up(self, r: int, s: int) -> bool:
        return bool(self.servers_up(r, [s])[0])


def mixing_without(w: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Mixing matrix ``w`` (n x n) with the links where ``up`` is False removed, their weight moved to the
    diagonal: each node keeps its own value in place of the message it did not get. A symmetric doubly
    stochastic ``w`` stays so (for a symmetric ``up``), which gossip and gradient-tracking methods need.
    Pass ``up = links_up & servers_up[:, None] & servers_up[None, :]`` for servers that miss the round.
    """
    w = np.asarray(w, dtype=np.float64)
    up = np.asarray(up, dtype=bool) | np.eye(len(w), dtype=bool)
    out = np.where(up, w, 0.0)
    out[np.diag_indices_from(out)] += np.where(up, 0.0, w).sum(axis=1)
    return out


def reweighted(weights: np.ndarray, delivered: np.ndarray) -> np.ndarray:
    """Aggregation weights renormalized over the delivered entries (zeros elsewhere); all zero if none."""
    w = np.where(delivered, np.asarray(weights, dtype=np.float64), 0.0)
    total = w.sum()
    return w / total if total > 0 else w
