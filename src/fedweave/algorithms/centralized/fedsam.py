"""FedSAM (Qu et al., ICML 2022): local sharpness-aware minimization, FedAvg aggregation (FedMIM spec §5).

Client step with one minibatch: ``g = g_i(y)``, ``eps = rho g / ||g||``, ``y <- y - eta_l g_i(y + eps)``.
Two gradient evaluations per step. MoFedSAM is FedCM with this gradient (``fedcm.py``, ``mofedsam``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import StarAlgorithm, StarHparams
from fedweave.config import ConfigError
from fedweave.execution import LocalRule
from fedweave.execution.local import GradFn
from fedweave.registry import ALGORITHMS


def sam_gradient(grad: GradFn, rho: float) -> GradFn:
    """``v -> grad(v + rho grad(v) / ||grad(v)||)``, the SAM gradient on the same minibatch (per job)."""

    def g(v: torch.Tensor) -> torch.Tensor:
        g0 = grad(v)
        eps = rho * g0 / g0.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return grad(v + eps)

    return g


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
        if self.rho <= 0:
            raise ConfigError(f"algorithm.rho must be > 0, got {self.rho}")


@ALGORITHMS.register("fedsam")
class FedSAM(StarAlgorithm):
    name = "fedsam"
    handles_faults = ("dropout", "deadline")
    Hparams = FedSAMHparams

    def run_round(self, r: int) -> dict[str, float]:
        clients = self.sample_clients(r)
        self.send(r, clients, "model", self.x)
        clients = self.reporting(r, clients)  # dropouts and stragglers deliver nothing
        if len(clients) == 0:
            return self.fault_metrics(clients)  # skipped round: all state stays as it was
        local = self.trainer.train(self.x, clients, r, rule=SAMRule(self.hp.rho))
        self.receive(r, clients, "model", local.params)
        p = self.weights(clients)
        self.x = self.x + self.hp.server_lr * (p @ (local.params - self.x))
        return {**self.local_metrics(local, p), **self.fault_metrics(clients)}
