"""FedAvg (McMahan et al., 2017, Alg. 1): local SGD on sampled clients, weighted averaging of their models.

The client rule is plain local SGD (the template's default) and the clients send their models; the server
moves by the weighted mean of the local updates, ``x_{t+1} = x_t + eta_g sum_i p_i (y_i - x_t)`` (with
``eta_g = 1`` the weighted average of the local models, Alg. 1's ``w_{t+1} = sum_k n_k/n w^k_{t+1}``).
"""

from __future__ import annotations

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("fedavg")
class FedAvg(StarAlgorithm):
    name = "fedavg"
    compresses_downloads = True  # compression.download: its clients read the model only as their start
    dp_refusal = None  # privacy: one model update per client; server state from the noised mean only

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean
