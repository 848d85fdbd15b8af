"""FedSAM (Qu et al., ICML 2022): local sharpness-aware minimization, FedAvg aggregation (FedMIM spec §5).

Client step with one minibatch: ``g = g_i(y)``, ``eps = rho g / ||g||``, ``y <- y - eta_l g_i(y + eps)``.
Two gradient evaluations per step. MoFedSAM is FedCM with this gradient (``fedcm.py``, ``mofedsam``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule
from fedweave.execution.local import GradFn
from fedweave.registry import ALGORITHMS, RULES


def sam_gradient(grad: GradFn, rho: float) -> GradFn:
    """``v -> grad(v + rho grad(v) / ||grad(v)||)``, the SAM gradient on the same minibatch (per job)."""

    def g(v: torch.Tensor) -> torch.Tensor:
        g0 = grad(v)
        eps = rho * g0 / g0.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return grad(v + eps)

    return g


@RULES.register("fedsam")
class SAMRule(LocalRule):
    """Direction: the SAM gradient with radius ``rho`` (> 0)."""

    def __init__(self, rho: float) -> None:
        self.rho = float(rho)

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        return sam_gradient(grad, self.rho)(w)


@dataclass
class FedSAMHparams(StarHparams):
    rho: float = 0.1  # SAM radius; unspecified in FedMIM, FL-Simulator default

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.rho <= MAX_LR:  # a larger radius is inf in float32: the perturbed weights are NaN
            raise ConfigError(f"algorithm.rho must be in (0, {MAX_LR:.6g}], got {self.rho}")


@ALGORITHMS.register("fedsam")
class FedSAM(StarAlgorithm):
    name = "fedsam"
    compresses_downloads = True  # compression.download: its clients read the model only as their start
    dp_refusal = None  # privacy: one model update per client; server state from the noised mean only
    Hparams = FedSAMHparams

    def client_rule(self, lr: float) -> LocalRule:
        return SAMRule(self.hp.rho)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # FedAvg's aggregation
