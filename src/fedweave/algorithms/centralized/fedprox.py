"""FedProx (Li et al., MLSys 2020): local SGD on f_k(w) + (mu/2)||w - w^t||^2, FedAvg aggregation.

Optional baseline of FedMIM (spec §5, related work); also the local rule of ZO-HFL's FedProx baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, per_job
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule
from fedweave.execution.local import PLAIN, GradFn
from fedweave.registry import ALGORITHMS, RULES


@RULES.register("fedprox")
class ProxRule(LocalRule):
    """Direction ``grad f_k(w) + mu (w - anchor)`` (FedProx Eq. 2's objective, its gradient).

    Args:
        mu: proximal weight, >= 0 (``mu = 0`` is plain local SGD).
        anchor: the proximal centre, ``(P,)`` shared by every job (FedProx: the global model w^t) or
            ``(K, P)`` with one row per job, in the job order of ``LocalTrainer.train``.
    """

    def __init__(self, mu: float, anchor: torch.Tensor) -> None:
        if mu < 0:
            raise ValueError(f"ProxRule: mu must be >= 0, got {mu}")
        self.mu, self.anchor = float(mu), anchor

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        return grad(w) + self.mu * (w - per_job(self.anchor, jobs))


@dataclass
class FedProxHparams(StarHparams):
    mu: float = 0.01  # proximal weight; the paper searches {0.001, 0.01, 0.1, 1}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mu <= MAX_LR:  # a larger one is inf in float32: the first step's mu * 0 is NaN
            raise ConfigError(f"algorithm.mu must be in [0, {MAX_LR:.6g}], got {self.mu}")


@ALGORITHMS.register("fedprox")
class FedProx(StarAlgorithm):
    name = "fedprox"
    dp_refusal = None  # privacy: one model update per client; server state from the noised mean only
    Hparams = FedProxHparams

    def client_rule(self, lr: float) -> LocalRule:
        if self.hp.mu == 0:  # no proximal term: FedAvg's clients, on the backends' plain-SGD path (bit for bit)
            return PLAIN
        return ProxRule(self.hp.mu, self.x)  # Eq. 2: local SGD on f_k(w) + (mu/2)||w - w^t||^2

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # FedAvg's aggregation
