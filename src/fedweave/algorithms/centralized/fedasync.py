"""FedAsync (Xie, Koyejo, Gupta 2019, Alg. 1): every arrival is a server step on the simulated clock.

The server mixes each arriving model into its own: ``x <- (1 - alpha_t) x + alpha_t y_i`` with
``alpha_t = alpha s(t - tau)``, ``s`` the staleness weighting (Sec. 5.2). Its clients ("Worker") run local SGD
on the regularized ``g_{x_tau}(y) = f_i(y) + (rho/2) ||y - x_tau||^2`` about the model they were sent (``rho``
0: plain local SGD). The clock, the dispatching and the staleness functions are the protocol's
(``async_base.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.centralized.async_base import AsyncHparams, AsyncStar
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution.local import PLAIN, LocalRule
from fedweave.registry import ALGORITHMS


@dataclass
class FedAsyncHparams(AsyncHparams):
    alpha: float = 0.6  # the mixing weight alpha (Xie et al. 2019)
    rho: float = 0.0  # the Worker's proximal weight rho (Alg. 1); 0: plain local SGD

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"algorithm.alpha must be in (0, 1], got {self.alpha}")
        if not 0 <= self.rho <= MAX_LR:  # a larger one is inf in float32: the first step's rho * 0 is NaN
            raise ConfigError(f"algorithm.rho must be in [0, {MAX_LR:.6g}], got {self.rho}")
        if self.weighting != "samples":  # never read: a step mixes one arrival, whose weight is 1
            raise ConfigError(
                "algorithm.weighting: fedasync steps on one arrival at a time, nothing to weight; leave it out"
            )
        if self.server_lr != 1.0:
            raise ConfigError("algorithm.server_lr: fedasync's server step is its mixing weight alpha; set alpha")


@ALGORITHMS.register("fedasync")
class FedAsync(AsyncStar):
    name = "fedasync"
    Hparams = FedAsyncHparams
    step_sizes = ()  # server_lr must stay 1; the mixing weight alpha in (0, 1] is a convex combination
    robust_aggregation = False  # one arrival per server step: nothing to reduce, so no aggregator applies
    # privacy: noise on every single arrival drowns it; FedBuff's buffer shares one noise among K updates
    dp_refusal = (
        "every arrival is its own server step, so each single clipped update would be released with the whole "
        "noise sigma C, shared by no buffer of updates (fedbuff with buffer_size 1 is that mechanism, accounted); "
        "use fedbuff"
    )

    def client_rule(self, lr: float) -> LocalRule:
        # Alg. 1, Worker: SGD on g_{x_tau}(y) = f(y) + (rho/2) ||y - x_tau||^2, x_tau the model sent at dispatch
        return ProxRule(self.hp.rho, self.x) if self.hp.rho > 0 else PLAIN

    def apply(
        self, deltas: torch.Tensor, models: torch.Tensor, weights: torch.Tensor, s: torch.Tensor, clients: np.ndarray
    ) -> None:
        alpha = self.hp.alpha * float(s[0])  # alpha_t = alpha s(t - tau)
        self.x = (1 - alpha) * self.x + alpha * models[0]  # Alg. 1, Updater
