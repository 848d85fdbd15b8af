"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020), on the star.

The server keeps k cluster models theta_1..theta_k. Round t (Alg. 1, option II, model averaging):
  the server sends every theta_j^t to the sampled clients M_t                                 (line 3)
  client i estimates its cluster, j^ = argmin_j F_i(theta_j^t), its loss on its own data       (line 6)
  and trains theta~_i = LocalUpdate(theta_j^^t), sending back theta~_i and its identity s_i     (lines 7, 9)
  theta_j^{t+1} = sum_i s_ij theta~_i / sum_i s_ij for every cluster that a client picked      (line 13)
A cluster nobody picked keeps its model. The average is written as FedAvg's server step on each cluster,
``theta_j + server_lr * sum_{i in j} p_i (theta~_i - theta_j)`` with ``p`` the ``weighting`` over the
cluster's clients (``uniform``, the default, is line 13's average; ``samples`` weighs by data), so that one
cluster is FedAvg bit for bit. Cluster j > 0 starts from its own initialization (the ``("model_init", j)``
stream), cluster 0 from the run's model. With ``share_body`` (the paper's weight sharing, Sec. 5) the cluster
models differ only in their heads (``head_names()``): one body, which every reporting client's update moves
(FedAvg over all of them, the same ``weighting``), and k heads, each averaged over its cluster's clients; the
server sends the body once and the k heads.

A client's model is the cluster model it picks, so IFCA's test metrics are those of its paper: each client's
pick, by its loss on its training data, evaluated on its own test set (``eval.personal_test``'s sets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from fedweave.algorithms.base import aggregation_weights
from fedweave.algorithms.centralized.base import Collected, StarHparams
from fedweave.algorithms.centralized.personal.base import PersonalStar, head_names, name_mask
from fedweave.config import ConfigError
from fedweave.execution import ParamLayout
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS


@dataclass
class IFCAHparams(StarHparams):
    clusters: int = 2  # k
    share_body: bool = False  # weight sharing: one body for every cluster, a head per cluster
    weighting: Literal["samples", "uniform"] = "uniform"  # line 13: the plain average over a cluster's clients

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clusters < 1:
            raise ConfigError(f"algorithm.clusters must be >= 1, got {self.clusters}")


@ALGORITHMS.register("ifca")
class IFCA(PersonalStar):
    name = "ifca"
    Hparams = IFCAHparams
    state_fields = ("models",)  # the k cluster models; there is no single global model
    undeployable: ClassVar[str] = "its clients pick one of several server models (the deployment sends one)"
    keeps_personal = False  # a client's model is its pick of the cluster models, made when evaluated
    global_model = False
    handles_faults = ("dropout", "deadline")  # an attack and a robust aggregator act on one aggregate
    robust_aggregation = False
    compresses_uploads = False
    dp_refusal = "its server keeps one model per cluster, each from the updates of the clients that picked it"

    def __init__(self, ctx, hp: IFCAHparams) -> None:
        if hp.clusters > 1 and "init_from" in ctx.config.model.options:
            raise ConfigError(
                "algorithm ifca: model.init_from would start every cluster model from the same weights, so every "
                "client would pick cluster 0; leave model.init_from out"
            )
        if hp.clusters > ctx.num_clients:  # k disjoint groups of the clients (Sec. 2): 1e300 built models forever
            raise ConfigError(
                f"algorithm.clusters ({hp.clusters:.6g}) exceeds partition.num_clients ({ctx.num_clients}): IFCA's "
                "clusters are disjoint groups of the clients"
            )
        super().__init__(ctx, hp)
        others = [ParamLayout(ctx.build_model(key=(j,)), ctx.placement).flatten() for j in range(1, hp.clusters)]
        # the coordinates every cluster model shares (the body, with share_body), else none
        head = name_mask(self.layout, head_names(self.layout.model, self.name)) if hp.share_body else None
        self.shared = ~head if head is not None else torch.zeros_like(self.x, dtype=torch.bool)
        others = [torch.where(self.shared, self.x, m) for m in others]  # one body: cluster 0's
        self.models = torch.stack([self.x, *others])  # (k, P): theta_1..theta_k
        apart = ~self.shared  # where the cluster models may differ (all of it without share_body)
        if any(torch.equal(m[apart], self.x[apart]) for m in others):  # a deterministic init (model.init: zeros)
            init = ctx.config.model.options.get("init")
            key = f"model.init: {init}" if init is not None else f"model {ctx.config.model.name}'s initialization"
            raise ConfigError(
                f"algorithm ifca: {key} would start every cluster model from the same weights, so every client "
                "would pick cluster 0; use a random initialization (leave model.init out)"
            )
        del self.x  # no single global model: what reads one fails loudly instead of reading a stale copy
        # the server keeps the k cluster models in place of one global model (with share_body the body once and
        # the k heads): what its downlink sends, billed as it is
        self.ledger.store("server", "cluster_models", nbytes(*self.downlink()["model"]))
        self.picked: np.ndarray = np.zeros(0, dtype=np.int64)  # this round's clusters, in job order

    def cluster_losses(self, clients: np.ndarray | range) -> np.ndarray:
        """F_i(theta_j) for every cluster model j and client i of ``clients``: the task's loss on the client's
        training data, ``(k, len(clients))`` (each client computes its own row in the paper)."""
        return np.stack([self.client_losses(m, clients) for m in self.models])

    def pick(self, clients: np.ndarray | range) -> np.ndarray:
        """Each client's cluster estimate, argmin_j F_i(theta_j) (line 6; a tie goes to the lowest j)."""
        return self.cluster_losses(clients).argmin(axis=0)

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        if self.hp.share_body:  # the body once, then each cluster's head
            return {"model": (self.models[0][self.shared], *(m[~self.shared] for m in self.models))}
        return {"model": tuple(self.models)}  # line 3: all k models, to every sampled client

    def client_starts(self, clients: np.ndarray) -> torch.Tensor:
        self.picked = self.pick(clients)  # line 6
        return self.models[torch.as_tensor(self.picked, device=self.models.device)]  # (n, P): theta_j^

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        got = super().train_clients(r, clients)  # line 7: LocalUpdate from the picked model
        identity = torch.as_tensor(self.picked, device=got.start.device).unsqueeze(1)  # s_i, sent as its index
        got.upload = {"model": got.local.params, "cluster": identity}  # what the ledger counts
        return got

    def aggregate(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: np.ndarray | None = None
    ) -> torch.Tensor:
        """One mean update per cluster, ``(k, P)`` (zero for a cluster nobody picked): FedAvg's reduction over
        the clients that picked it, their ``weighting`` renormalized within the cluster."""
        means = torch.zeros_like(self.models)
        for j in np.unique(self.picked):
            mine = np.flatnonzero(self.picked == j)
            p = aggregation_weights(self.sizes, clients[mine], self.hp.weighting)
            means[j] = p @ updates[torch.as_tensor(mine, device=updates.device)]
        if self.hp.share_body:  # the shared body: FedAvg's reduction over every reporting client
            means[:, self.shared] = (weights @ updates[:, self.shared]).unsqueeze(0)
        return means

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        picked = torch.zeros(len(self.models), dtype=torch.bool, device=self.models.device)
        picked[torch.as_tensor(np.unique(self.picked), device=picked.device)] = True
        moved = self.models + self.hp.server_lr * mean  # line 13, for the clusters a client picked
        moves = picked.unsqueeze(1) | self.shared.unsqueeze(0)  # and the shared body of every cluster
        self.models = torch.where(moves, moved, self.models)

    def run_round(self, r: int) -> dict[str, float]:
        self.picked = np.zeros(0, dtype=np.int64)
        out = super().run_round(r)
        out["clusters_picked"] = float(len(np.unique(self.picked)))  # distinct clusters among the reports
        return out

    def personal_models(self, r: int) -> torch.Tensor:
        """Each client's pick (by its loss on its training data) of the cluster models, ``(N, P)``."""
        picks = self.pick(range(self.ctx.num_clients))
        self.used = len(np.unique(picks))  # for evaluate's clusters_used
        return self.models[torch.as_tensor(picks, device=self.models.device)]

    def evaluate(self, r: int) -> dict[str, float]:
        """The clients' picks on their own test sets (``PersonalStar``'s metrics under the plain names) and how
        many clusters the clients pick (``clusters_used``)."""
        return {**super().evaluate(r), "clusters_used": float(self.used)}
