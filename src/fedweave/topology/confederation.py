"""Confederated learning: a connected graph of edge servers, each serving its own users.

Shared mechanics of the confederated family (spec `cfl-saga.md` §1-§2, §7):

- the server graph: Erdos-Renyi G(N, p) resampled until connected, ring, fully connected, or an edge list;
- the mixing matrix W = I - Laplacian/tau (paper §II-B) with tau = d_max + 1 (max-degree weights, spec §1.2,
  entrywise non-negative) or the "optimal constant" tau = (lambda_max + lambda_2)/2;
- the communication ledger with the roles of the paper's system: ``user -> edge`` uploads (the paper's cost,
  counted in vectors and bytes), ``edge -> user`` broadcasts and ``edge -> edge`` exchanges, kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.config import ConfigError
from fedweave.ledger import Ledger

GRAPHS = ("random", "ring", "full", "edges")
MIXING = ("max_degree", "optimal_constant")


# ---- graphs ------------------------------------------------------------------------------------------
def _reached(adj: np.ndarray) -> set[int]:
    """The servers reachable from server 0."""
    seen, stack = {0}, [0]
    while stack:
        for j in np.flatnonzero(adj[stack.pop()]):
            if j not in seen:
                seen.add(int(j))
                stack.append(int(j))
    return seen


def _connected(adj: np.ndarray) -> bool:
    return len(_reached(adj)) == len(adj)


def build_graph(
    kind: str,
    num_servers: int,
    rng: np.random.Generator | None = None,
    *,
    edge_prob: float = 0.2,
    edges: list[list[int]] | None = None,
    max_tries: int = 10_000,
) -> np.ndarray:
    """Symmetric boolean adjacency (no self-loops) of a connected server graph.

    ``random`` draws Erdos-Renyi G(N, p) from ``rng`` until it is connected (spec A6: p = 0.2).
    """
    n = num_servers
    if n < 1:
        raise ConfigError(f"algorithm.num_servers must be >= 1, got {n}")
    adj = np.zeros((n, n), dtype=bool)
    if kind == "full":
        adj[:] = True
    elif kind == "ring":
        idx = np.arange(n)
        if n > 1:
            adj[idx, (idx + 1) % n] = adj[(idx + 1) % n, idx] = True
    elif kind == "random":
        if not 0 < edge_prob <= 1:
            raise ConfigError(f"algorithm.edge_prob must be in (0, 1], got {edge_prob}")
        if rng is None:
            raise ValueError("a random server graph needs a random generator")
        iu = np.triu_indices(n, 1)
        for _ in range(max_tries):
            adj[:] = False
            keep = rng.random(len(iu[0])) < edge_prob
            adj[iu[0][keep], iu[1][keep]] = True
            adj |= adj.T
            if _connected(adj):
                break
        else:
            raise ConfigError(
                f"algorithm.edge_prob={edge_prob} gave no connected graph on {n} servers in {max_tries} draws"
            )
    elif kind == "edges":
        if not edges:
            raise ConfigError("algorithm.edges must list the server pairs [i, j] when algorithm.graph is 'edges'")
        for e in edges:
            if len(e) != 2 or not all(isinstance(v, int) and 0 <= v < n for v in e) or e[0] == e[1]:
                raise ConfigError(f"algorithm.edges: {e!r} is not a pair of distinct server indices in [0, {n})")
            adj[e[0], e[1]] = adj[e[1], e[0]] = True
    else:
        raise ConfigError(f"algorithm.graph must be one of {', '.join(GRAPHS)}; got {kind!r}")
    np.fill_diagonal(adj, False)
    if not _connected(adj):
        apart = sorted(set(range(n)) - _reached(adj))
        shown = ", ".join(map(str, apart[:10])) + (f" and {len(apart) - 10:,} more" if len(apart) > 10 else "")
        raise ConfigError(
            f"algorithm.graph: the server graph ({kind}) is not connected: server 0 cannot reach server(s) {shown}"
        )
    return adj


def mixing_matrix(adj: np.ndarray, rule: str = "max_degree") -> np.ndarray:
    """W = I - Laplacian/tau (paper §II-B), checked to be symmetric, doubly stochastic, with sigma < 1."""
    n = len(adj)
    lap = np.diag(adj.sum(1)).astype(np.float64) - adj.astype(np.float64)
    if n == 1:
        return np.ones((1, 1))
    if rule == "max_degree":
        tau = adj.sum(1).max() + 1.0  # tau = d_max + 1 > lambda_max/2 and W >= 0 entrywise (spec §1.2, A9)
    elif rule == "optimal_constant":
        ev = np.linalg.eigvalsh(lap)
        tau = (ev[-1] + ev[1]) / 2.0  # may give negative diagonal entries on irregular graphs
    else:
        raise ConfigError(f"algorithm.mixing must be one of {', '.join(MIXING)}; got {rule!r}")
    w = np.eye(n) - lap / tau
    assert np.allclose(w, w.T) and np.allclose(w.sum(1), 1.0), "mixing matrix must be symmetric and stochastic"
    s = spectral_sigma(w)
    if not s < 1 - 1e-12:
        raise ConfigError(f"algorithm.mixing={rule!r}: sigma = ||W - 11^T/N|| = {s:.6f} is not < 1")
    return w


def spectral_sigma(w: np.ndarray) -> float:
    """sigma = ||W - (1/N) 1 1^T||_2, the second-largest singular value of W (paper §II-B)."""
    n = len(w)
    return float(np.linalg.norm(w - np.full((n, n), 1.0 / n), 2))


# ---- the system -----------------------------------------------------------------------------------
@dataclass
class ConfederationHparams:
    """The server graph and the users of each server."""

    num_servers: int = 20
    users_per_server: int = 20
    graph: Literal["random", "ring", "full", "edges"] = "random"
    edge_prob: float = 0.2  # Erdos-Renyi edge probability (spec A6)
    edges: list[list[int]] | None = None  # for graph = "edges"
    graph_seed: int | None = None  # fixes the random graph across run seeds; null: the run's "server_graph" stream
    mixing: Literal["max_degree", "optimal_constant"] = "max_degree"

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ConfigError(f"algorithm.num_servers must be >= 1, got {self.num_servers}")
        if self.users_per_server < 1:
            raise ConfigError(f"algorithm.users_per_server must be >= 1, got {self.users_per_server}")
        if not 0 < self.edge_prob <= 1:
            raise ConfigError(f"algorithm.edge_prob must be in (0, 1], got {self.edge_prob}")
        if self.graph_seed is not None and self.graph_seed < 0:
            raise ConfigError(f"algorithm.graph_seed must be >= 0 or null, got {self.graph_seed}")
        # an option of one graph kind, set under another, was silently unused (graph: full with edge_prob 0.01);
        # graph_seed may be set for every graph of a grid (it fixes whichever graph is random)
        unread = {"edge_prob": (self.edge_prob != 0.2, "random"), "edges": (self.edges is not None, "edges")}
        for key, (given, reader) in unread.items():
            if given and self.graph != reader:
                raise ConfigError(
                    f"algorithm.{key}: graph {self.graph!r} does not read it (only graph {reader!r} does); set "
                    f"algorithm.graph or leave {key} out"
                )


class Confederation:
    """N edge servers on a graph with mixing matrix W, P users per server, and a ledger of their traffic."""

    def __init__(self, hp: ConfederationHparams, rng: np.random.Generator, ledger: Ledger) -> None:
        if hp.graph_seed is not None:
            rng = np.random.default_rng(hp.graph_seed)
        self.adjacency = build_graph(hp.graph, hp.num_servers, rng, edge_prob=hp.edge_prob, edges=hp.edges)
        w = mixing_matrix(self.adjacency, hp.mixing)
        self.sigma = spectral_sigma(w)
        self.W = torch.from_numpy(w)
        self.num_servers = hp.num_servers
        self.users_per_server = hp.users_per_server
        self.num_users = hp.num_servers * hp.users_per_server
        self.num_edges = int(self.adjacency.sum()) // 2
        self.ledger = ledger

    @property
    def edge_list(self) -> list[list[int]]:
        i, j = np.nonzero(np.triu(self.adjacency, 1))
        return [[int(a), int(b)] for a, b in zip(i, j)]

    def mix(self, z: torch.Tensor) -> torch.Tensor:
        """Sum_{i'} w_ii' z_i' for every server (rows of ``z`` are servers)."""
        return self.W.to(device=z.device, dtype=z.dtype) @ z

    # ---- ledger: who sends what to whom --------------------------------------------------------------
    def upload(self, r: int, kind: str, count: int, vector_bytes: int) -> None:
        """``count`` users each upload one vector of ``vector_bytes`` to their server (the paper's cost)."""
        self.ledger.record(r, "user", "edge", kind, count * vector_bytes, count)

    def broadcast(self, r: int, kind: str, count: int, message_bytes: int) -> None:
        """Servers send ``message_bytes`` to each of ``count`` users in total."""
        self.ledger.record(r, "edge", "user", kind, count * message_bytes, count)

    def exchange(self, r: int, kind: str, message_bytes: int) -> None:
        """Every server sends ``message_bytes`` to each neighbour: 2|E| directed messages."""
        n = 2 * self.num_edges
        self.ledger.record(r, "edge", "edge", kind, n * message_bytes, n)
