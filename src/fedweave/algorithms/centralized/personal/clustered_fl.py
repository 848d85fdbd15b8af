"""Clustered Federated Learning, CFL (Sattler, Müller, Samek, IEEE TNNLS 2021, Alg. 1): FedAvg that splits a
cluster of clients in two when they have reached a stationary point of their joint objective but not of their
own ones.

Every client takes part in every round and trains from its cluster's model. For each cluster c, from its
clients' updates Delta_i:
  mean_norm = || sum_{i in c} p_i Delta_i ||  and  max_norm = max_{i in c} || Delta_i ||
  if mean_norm < eps1 and max_norm > eps2 and |c| > 2 and the round is past ``warmup`` (the authors' 20):
      split c in two by the cosine similarities alpha_ij = <Delta_i, Delta_j> / (||Delta_i|| ||Delta_j||):
      the complete-linkage bipartition (scikit-learn's agglomerative clustering on -alpha, as the authors' code
      computes the paper's optimal bipartition); both halves start from c's model
then every cluster moves by FedAvg's step over its clients (``weighting`` within the cluster). eps1 and eps2 are
the authors' MNIST values (0.4, 1.6); they scale with the model and the learning rate, so a new setting needs
its own. There is no global model: a client's model is its cluster's, scored on its own test set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from sklearn.cluster import AgglomerativeClustering

from fedweave.algorithms.base import aggregation_weights
from fedweave.algorithms.centralized.base import Collected, StarHparams
from fedweave.algorithms.centralized.personal.base import PersonalStar
from fedweave.config import ConfigError
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS


def bipartition(similarity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two groups (positions, sorted) of the complete-linkage agglomerative clustering of ``-similarity``
    into 2 clusters (CFL's split); the group of position 0 first."""
    labels = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete").fit(-similarity).labels_
    first = labels == labels[0]
    return np.flatnonzero(first), np.flatnonzero(~first)


@dataclass
class ClusteredFLHparams(StarHparams):
    eps1: float = 0.4  # split when the cluster's mean update is shorter than this ...
    eps2: float = 1.6  # ... and some client's update is longer than this
    warmup: int = 20  # no split before this many rounds (the authors' code)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.eps1 >= 0 or not self.eps2 >= 0:
            raise ConfigError(f"algorithm.eps1 and eps2 must be >= 0, got {self.eps1}, {self.eps2}")
        if self.warmup < 0:
            raise ConfigError(f"algorithm.warmup must be >= 0, got {self.warmup}")


@ALGORITHMS.register("clustered_fl")
class ClusteredFL(PersonalStar):
    name = "clustered_fl"
    Hparams = ClusteredFLHparams
    state_fields = ("models", "assignment")  # each cluster's model and each client's cluster
    growing_state = ("models",)  # one row per cluster: a checkpoint written after a split has more rows
    undeployable: ClassVar[str] = "its server keeps a model per cluster and splits clusters in the simulation"
    keeps_personal = False  # a client's model is its cluster's
    global_model = False
    handles_faults: tuple[str, ...] = ()  # a split reads every client's update of the round
    robust_aggregation = False
    compresses_uploads = False
    dp_refusal = "its server splits clusters by the similarity of the clients' individual updates"
    every_client = "splits by every client's update each round"

    def __init__(self, ctx, hp: ClusteredFLHparams) -> None:
        super().__init__(ctx, hp)
        self.models = self.x.unsqueeze(0).clone()  # one cluster at the start, the run's model
        del self.x  # no single global model
        self.assignment = torch.zeros(ctx.num_clients, dtype=torch.long, device="cpu")  # client -> cluster (host)
        self.round_index, self.splits = 0, 0  # the round being aggregated, and its splits (a metric)
        self.store_clusters()

    def store_clusters(self) -> None:
        """The server's state in the ledger's storage: a model per cluster (its peak: after the last split) and
        each client's cluster."""
        self.ledger.store("server", "cluster_models", nbytes(self.models))
        self.ledger.store("server", "cluster_assignment", nbytes(self.assignment))

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return {"model": (self.models[0],)}  # one model per client: its cluster's (all the same size)

    def client_starts(self, clients: np.ndarray) -> torch.Tensor:
        return self.models[self.assignment[torch.as_tensor(clients, device="cpu")].to(self.models.device)]

    def aggregate(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: np.ndarray | None = None
    ) -> torch.Tensor:
        """Split the clusters that meet the criterion, then each cluster's mean update, ``(clusters, P)``."""
        cluster = self.assignment[torch.as_tensor(clients, device="cpu")].numpy().copy()
        self.splits = 0
        for c in range(len(self.models)):
            mine = np.flatnonzero(cluster == c)
            if len(mine) <= 2 or self.round_index < self.hp.warmup:
                continue
            rows = updates[torch.as_tensor(mine, device=updates.device)]
            p = aggregation_weights(self.sizes, clients[mine], self.hp.weighting)
            mean_norm, max_norm = float((p @ rows).norm()), float(rows.norm(dim=1).max())
            if mean_norm < self.hp.eps1 and max_norm > self.hp.eps2:
                unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)
                _, second = bipartition((unit @ unit.T).double().cpu().numpy())
                cluster[mine[second]] = len(self.models)  # the second group: a new cluster from c's model
                self.models = torch.cat([self.models, self.models[c : c + 1]])
                self.splits += 1
        self.assignment[torch.as_tensor(clients, device="cpu")] = torch.as_tensor(cluster, device="cpu")
        if self.splits:
            self.store_clusters()
        means = torch.zeros_like(self.models)
        for c in np.unique(cluster):
            mine = np.flatnonzero(cluster == c)
            p = aggregation_weights(self.sizes, clients[mine], self.hp.weighting)
            means[c] = p @ updates[torch.as_tensor(mine, device=updates.device)]
        return means

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.models = self.models + self.hp.server_lr * mean  # every cluster has clients: every one moves

    def run_round(self, r: int) -> dict[str, float]:
        self.round_index = r
        out = super().run_round(r)
        return {**out, "clusters": float(len(self.models)), "splits": float(self.splits)}

    def personal_models(self, r: int) -> torch.Tensor:
        """Each client's cluster model, ``(N, P)``."""
        return self.models[self.assignment.to(self.models.device)]
