"""Peer-to-peer graphs: who *can* talk in the decentralized family, and how models mix over a graph.

Graphs from networkx: fully connected, the random "half" graph of AFIND+'s Table 3, Erdos-Renyi, ring,
torus, random regular, small world, or an edge-list file. Which neighbours a client talks to in a round is
sampled per round by the protocol (``fedweave.algorithms.decentralized.base``), not by the graph.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import networkx as nx
import numpy as np
import torch

from fedweave.config import ConfigError

TOPOLOGIES = ("full", "half", "erdos_renyi", "ring", "torus", "random_regular", "small_world", "edgelist")
Topology = Literal["full", "half", "erdos_renyi", "ring", "torus", "random_regular", "small_world", "edgelist"]
# the one topology option each topology reads (the others' are not read: set, they are refused)
READ_BY = {
    "edge_prob": ("erdos_renyi",),
    "degree": ("random_regular", "small_world"),
    "rewire_prob": ("small_world",),
    "torus_rows": ("torus",),
    "edge_file": ("edgelist",),
}


# ---------------------------------------------------------------------------------------------- graphs
def _factor_rows(n: int) -> int:
    """The largest divisor of ``n`` not above sqrt(n) (a near-square torus)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


def read_edge_list(path: str | Path, num_clients: int) -> nx.Graph:
    """An undirected graph from a text file of ``u v`` lines (0-based client ids; ``#`` comments)."""
    p = Path(path).expanduser()  # "~" as for every other file option (model.init_from, partition.path, ...)
    shown = str(path)  # the file as written, which the messages name
    if not p.is_file():
        raise ConfigError(f"algorithm.edge_file {shown!r} does not exist")
    g = nx.Graph()
    g.add_nodes_from(range(num_clients))
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:  # exactly two ids: a third field (a weighted edge list's weight) would be dropped without a word
            if len(parts) != 2:
                raise ValueError
            u, v = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError(
                f"algorithm.edge_file {shown!r} line {lineno}: expected 'u v' (two client ids, no weight), got {line!r}"
            ) from None
        for x in (u, v):
            if not 0 <= x < num_clients:
                raise ConfigError(
                    f"algorithm.edge_file {shown!r} line {lineno}: client {x} is outside [0, {num_clients})"
                )
        if u != v:
            g.add_edge(u, v)
    return g


def build_graph(
    topology: str,
    num_clients: int,
    seed: int,
    *,
    edge_prob: float = 0.5,
    degree: int = 4,
    rewire_prob: float = 0.1,
    torus_rows: int = 0,
    edge_file: str | None = None,
) -> nx.Graph:
    """The communication graph G = (N, V) of afind-plus §1.2 over clients ``0..num_clients-1``."""
    m = num_clients
    if topology == "full":
        g = nx.complete_graph(m)
    elif topology == "half":
        # Table 3: "each client randomly connects to half of the other clients" -> a random
        # floor((m-1)/2)-regular graph (A26); one less when m*d is odd (no such regular graph exists).
        d = (m - 1) // 2
        d -= (m * d) % 2
        g = nx.random_regular_graph(d, m, seed=seed) if d > 0 else nx.empty_graph(m)
    elif topology == "erdos_renyi":
        if not 0 < edge_prob <= 1:
            raise ConfigError(f"algorithm.edge_prob must be in (0, 1], got {edge_prob}")
        g = nx.gnp_random_graph(m, edge_prob, seed=seed)
    elif topology == "ring":
        g = nx.cycle_graph(m) if m > 2 else nx.complete_graph(m)
    elif topology == "torus":
        if torus_rows < 0:
            raise ConfigError(
                f"algorithm.torus_rows must be >= 0 (0 = the most square factorization), got {torus_rows}"
            )
        rows = torus_rows or _factor_rows(m)
        if rows < 1 or m % rows:
            raise ConfigError(f"algorithm.torus_rows ({rows}) must divide partition.num_clients ({m})")
        # C_r x C_c is the 4-regular torus only for r, c >= 3: a side of 1 is a ring, a side of 2 a degree-3
        # ladder (its two wrap-around edges coincide), either of which would be built without a word
        if min(rows, m // rows) < 3:
            fits = [d for d in range(3, m // 3 + 1) if m % d == 0]
            hint = f"algorithm.torus_rows one of {', '.join(map(str, fits))}" if fits else ""
            hint = hint or f"topology 'ring' ({m} clients have no such grid)"
            raise ConfigError(
                f"algorithm.torus_rows: a torus needs at least 3 rows and 3 columns (each client 4 neighbours); "
                f"{rows} x {m // rows} for {m} clients is not one; use {hint}"
            )
        g = nx.convert_node_labels_to_integers(nx.grid_2d_graph(rows, m // rows, periodic=True), ordering="sorted")
    elif topology == "random_regular":
        if not 0 < degree < m or (m * degree) % 2:
            raise ConfigError(
                f"algorithm.degree must be in [1, {m - 1}] with num_clients*degree even, got {degree} for {m} clients"
            )
        g = nx.random_regular_graph(degree, m, seed=seed)
    elif topology == "small_world":
        # Watts-Strogatz joins each node to degree // 2 ring neighbours on either side: an odd degree would
        # silently build a graph of degree - 1
        if not 2 <= degree < m or degree % 2:
            raise ConfigError(f"algorithm.degree must be even and in [2, {m - 1}] for small_world, got {degree}")
        if not 0 <= rewire_prob <= 1:
            raise ConfigError(f"algorithm.rewire_prob must be in [0, 1], got {rewire_prob}")
        g = nx.connected_watts_strogatz_graph(m, degree, rewire_prob, tries=1000, seed=seed)
    elif topology == "edgelist":
        if not edge_file:
            raise ConfigError("algorithm.topology 'edgelist' needs algorithm.edge_file (a file of 'u v' lines)")
        g = read_edge_list(edge_file, m)
    else:
        raise ConfigError(f"algorithm.topology must be one of {', '.join(TOPOLOGIES)}; got {topology!r}")
    lonely = [i for i in range(m) if g.degree(i) == 0]
    if m > 1 and lonely:
        remedy = {  # only these can leave a client alone; the hint names what the topology reads
            "erdos_renyi": f"use a larger algorithm.edge_prob (got {edge_prob})",
            "half": f"'half' needs at least 4 clients (a floor((m-1)/2)-regular graph; m = {m})",
            "edgelist": "give them an edge in algorithm.edge_file",
        }.get(topology, "use a denser graph")
        raise ConfigError(f"algorithm.topology {topology!r} left client(s) {lonely[:5]} without neighbours; {remedy}")
    return g


def neighbour_lists(g: nx.Graph) -> list[np.ndarray]:
    """S_i = {j : w_ij = 1} of every client, sorted."""
    return [np.array(sorted(g.neighbors(i)), dtype=np.int64) for i in range(g.number_of_nodes())]


def metropolis_weights(g: nx.Graph) -> torch.Tensor:
    """The Metropolis-Hastings mixing matrix: symmetric and doubly stochastic on any undirected graph.

    w_ij = 1 / (1 + max(d_i, d_j)) on edges, w_ii = 1 - sum_j w_ij (Xiao & Boyd, 2004).
    """
    m = g.number_of_nodes()
    M = torch.zeros(m, m, dtype=torch.float64, device="cpu")  # host bookkeeping (moved where it mixes)
    deg = dict(g.degree())
    for u, v in g.edges():
        M[u, v] = M[v, u] = 1.0 / (1 + max(deg[u], deg[v]))
    M += torch.diag(1.0 - M.sum(1))
    return M


def gossip(W: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """One synchronous gossip step x_i <- sum_j M_ij x_j, from the round-start rows only (a new tensor)."""
    return (M.to(device=W.device, dtype=W.dtype) @ W).contiguous()
