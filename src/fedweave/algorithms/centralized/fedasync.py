"""FedAsync (Xie, Koyejo, Gupta 2019, Alg. 1): every arrival is a server step on the simulated clock.

The server mixes each arriving model into its own: ``x <- (1 - alpha_t) x + alpha_t y_i`` with
``alpha_t = alpha s(t - tau)``, ``s`` the staleness weighting (Sec. 5.2). The clock, the dispatching and the
staleness functions are the protocol's (``async_base.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.async_base import AsyncHparams, AsyncStar
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class FedAsyncHparams(AsyncHparams):
    alpha: float = 0.6  # the mixing weight alpha (Xie et al. 2019)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"algorithm.alpha must be in (0, 1], got {self.alpha}")
        if self.server_lr != 1.0:
            raise ConfigError("algorithm.server_lr: fedasync's server step is its mixing weight alpha; set alpha")


@ALGORITHMS.register("fedasync")
class FedAsync(AsyncStar):
    name = "fedasync"
    Hparams = FedAsyncHparams
    robust_aggregation = False  # one arrival per server step: nothing to reduce, so no aggregator applies

    def apply(self, deltas: torch.Tensor, models: torch.Tensor, weights: torch.Tensor, s: torch.Tensor) -> None:
        alpha = self.hp.alpha * float(s[0])  # alpha_t = alpha s(t - tau)
        self.x = (1 - alpha) * self.x + alpha * models[0]  # Alg. 1, Updater
