"""Agnostic Federated Learning (Mohri, Sivek and Suresh, ICML 2019): a good model for every mixture.

AFL minimizes the loss of the worst mixture of the clients' distributions (the agnostic loss),

    min_w max_{lambda in Delta_N} L(w, lambda) = sum_k lambda_k L_k(w)

with ``L_k`` client k's loss and ``Delta_N`` the probability simplex, by stochastic gradient descent on w
and projected gradient ascent on lambda (the paper's Stochastic-AFL):

    w_{t+1}      = w_t - gamma_w grad_w L(w_t, lambda_t)
    lambda_{t+1} = Proj_Delta(lambda_t + gamma_lambda grad_lambda L(w_t, lambda_t)),  grad_lambda L = (L_k(w_t))_k

Here w's step is a FedAvg round whose aggregation weights are lambda over the round's clients (renormalized
to sum to one; with full participation exactly lambda), and lambda's gradient is estimated from the round's
reporting clients S: ``g_k = (N/|S|) L_k(w_t)`` for k in S and 0 otherwise (unbiased under uniform sampling,
exact with full participation), with ``L_k(w_t)`` each client's loss of the global model on its own data
before training (one number it sends). lambda starts at the ``weighting`` of the clients (n_k/n, or 1/N) and
is kept on the server (checkpointed). A round whose clients all have lambda_k = 0 leaves w unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.base import aggregation_weights
from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.config import MAX_LR, ConfigError
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of ``v`` onto the probability simplex (Duchi, Shalev-Shwartz, Singer and
    Chandra, ICML 2008, Fig. 1): ``max(v - theta, 0)`` with theta chosen so that the result sums to one. A
    ``v`` with an infinite or NaN entry (a diverged model's loss) has no projection: all NaN, which the run's
    divergence check reports."""
    if not bool(torch.isfinite(v).all()):
        return torch.full_like(v, float("nan"))
    u = torch.sort(v, descending=True).values
    css = torch.cumsum(u, 0) - 1
    j = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    rho = int(torch.nonzero(u - css / j > 0).max())  # the last index where u_j > (sum_{i<=j} u_i - 1) / j
    theta = css[rho] / (rho + 1)
    return (v - theta).clamp_min(0)


@dataclass
class AFLHparams(StarHparams):
    lambda_lr: float = 0.01  # gamma_lambda, the step size of lambda's ascent

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lambda_lr <= MAX_LR:  # a step size, bounded as local.lr is
            raise ConfigError(f"algorithm.lambda_lr must be in [0, {MAX_LR:.6g}], got {self.lambda_lr}")


@ALGORITHMS.register("afl")
class AFL(StarAlgorithm):
    name = "afl"
    uploads_start_loss = True  # L_k(w_t): deployed, each node computes it on its data, in the training job
    Hparams = AFLHparams
    uplink = "model+loss"  # the local model and L_k(w_t)
    compresses_uploads = False  # the compressor would also quantize L_k, which lambda's step reads
    state_fields = (*StarAlgorithm.state_fields, "lam")

    def __init__(self, ctx, hp: AFLHparams) -> None:
        super().__init__(ctx, hp)
        everyone = np.arange(ctx.num_clients)
        self.lam = aggregation_weights(self.sizes, everyone, hp.weighting)  # lambda_0 in the simplex
        self.ledger.store("server", "mixture_weights", nbytes(self.lam))  # lambda, one per client, kept by the server

    def weights(self, clients: np.ndarray) -> torch.Tensor:
        lam = self.lam[torch.as_tensor(clients, dtype=torch.long, device=self.lam.device)]
        total = lam.sum()
        return lam / total if total > 0 else lam  # lambda over the round's clients; all zero: no step

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        got = super().train_clients(r, clients)
        loss = self.start_losses(got)  # L_k(w_t), of the model each client received
        got.upload = {"model": got.local.params, "loss": loss.unsqueeze(1)}  # what each client sends
        return got

    def client_updates(self, got: Collected) -> torch.Tensor:
        return got.upload["model"] - self.x

    def aggregate(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: np.ndarray | None = None
    ) -> torch.Tensor:
        if not bool(weights.any()):  # every client of the round has lambda_k = 0: no step, whatever the aggregator
            return torch.zeros_like(self.x)
        return super().aggregate(updates, weights, clients)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # w's step: sum_k lambda_k Delta_k over the round
        self.lam = lambda_step(self.lam, got.clients, got.upload["loss"].squeeze(1), self.hp.lambda_lr)

    def local_metrics(self, local, p) -> dict[str, float]:
        # the round's metrics (after its server step): how far the mixture has moved from the start. train_loss is
        # the lambda-weighted mean of the round's losses; where every lambda_k of the round is 0, their plain mean
        p = p if bool(p.any()) else torch.full_like(p, 1 / len(p))
        return {**super().local_metrics(local, p), "lambda_max": float(self.lam.max())}


def lambda_step(lam: torch.Tensor, clients: np.ndarray, loss: torch.Tensor, lr: float) -> torch.Tensor:
    """``Proj_Delta(lambda + gamma_lambda g)`` with ``g_k = (N/|S|) L_k`` for the clients S that reported."""
    g = torch.zeros_like(lam)
    g[torch.as_tensor(clients, dtype=torch.long, device=lam.device)] = loss * (len(lam) / len(clients))
    return project_simplex(lam + lr * g)
