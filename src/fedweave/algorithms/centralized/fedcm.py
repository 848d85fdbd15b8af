"""FedCM (Xu et al., 2021): client-level momentum (FedMIM spec §5); MoFedSAM (Qu et al., 2022) as an option.

The server sends x_t and the momentum Delta_t (Delta_0 = 0). Client step
``y <- y - eta_l (alpha g_i(y) + (1 - alpha) Delta_t)``; server ``Delta_{t+1} = -mean(Delta y) / (eta_l K)``
and ``x_{t+1} = x_t - eta_g eta_l K Delta_{t+1}`` (FedCM Alg. 1). With ``sam_rho > 0`` g is the SAM
gradient (MoFedSAM, registered as ``mofedsam``). Weight decay and clipping belong to g (fedmim spec A7),
so FedMIM with J = 1, beta = 0, alpha_1 = 1 - alpha is this method exactly (spec 2.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, regularized
from fedweave.algorithms.centralized.fedsam import sam_gradient
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule
from fedweave.execution.local import PLAIN, GradFn
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, RULES


@RULES.register("fedcm")
class FedCMRule(LocalRule):
    """Direction ``alpha g(w) + (1 - alpha) Delta``, g the regularized (optionally SAM) gradient of f_i.

    Use with a trainer that does not add weight decay or clipping itself (``regularize_in_rule``).
    """

    def __init__(
        self,
        alpha: float,
        momentum: torch.Tensor,
        *,
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
        sam_rho: float = 0.0,
    ) -> None:
        self.alpha, self.momentum = float(alpha), momentum
        self.weight_decay, self.grad_clip, self.sam_rho = weight_decay, grad_clip, sam_rho

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        g = sam_gradient(grad, self.sam_rho) if self.sam_rho > 0 else grad
        g = regularized(g, self.weight_decay, self.grad_clip)
        return self.alpha * g(w) + (1 - self.alpha) * self.momentum


@dataclass
class FedCMHparams(StarHparams):
    alpha: float = 0.1  # weight of the local gradient (FedMIM Sec. V-A)
    sam_rho: float = 0.0  # > 0: MoFedSAM with this SAM radius
    K_ref: int | None = None  # local steps normalizing Delta; null: E*ceil(n_i/B) (fedmim spec A5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"algorithm.alpha must be in (0, 1], got {self.alpha}")
        if not 0 <= self.sam_rho <= MAX_LR:  # as FedSAM's rho: inf in float32, the perturbed weights are NaN
            raise ConfigError(f"algorithm.sam_rho must be in [0, {MAX_LR:.6g}], got {self.sam_rho}")
        if self.K_ref is not None and self.K_ref < 1:
            raise ConfigError(f"algorithm.K_ref must be >= 1 or null, got {self.K_ref}")


@ALGORITHMS.register("fedcm")
class FedCM(StarAlgorithm):
    name = "fedcm"
    compresses_downloads = True  # compression.download: x_t compressed, the rest of its message dense
    dp_refusal = None  # privacy: the momentum sent is -mean / (eta_l K) of the noised mean (post-processing)
    Hparams = FedCMHparams
    state_fields = (*StarAlgorithm.state_fields, "momentum")
    regularize_in_rule = True

    def __init__(self, ctx, hp: FedCMHparams) -> None:
        # alpha = 1 without SAM is FedAvg's client: its trainer regularizes and it trains plain local SGD
        # (client_rule), so that it takes FedAvg's own path on every backend and is FedAvg bit for bit
        self.regularize_in_rule = not self.plain(hp)
        super().__init__(ctx, hp)
        self.momentum = torch.zeros_like(self.x)  # Delta_t
        self.K = hp.K_ref or self.reference_steps()
        self.ledger.store("server", "momentum", nbytes(self.momentum))

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return {"model+momentum": (self.x, self.momentum)}  # x_t and Delta_t

    @staticmethod
    def plain(hp: FedCMHparams) -> bool:
        """True where the client step is plain local SGD: no momentum share (alpha = 1) and no SAM."""
        return hp.alpha == 1 and hp.sam_rho == 0

    def client_rule(self, lr: float) -> LocalRule:
        if self.plain(self.hp):
            return PLAIN
        hp, c = self.hp, self.config.local  # g carries weight decay and clipping (fedmim spec A7)
        return FedCMRule(
            hp.alpha, self.momentum, weight_decay=c.weight_decay, grad_clip=c.grad_clip, sam_rho=hp.sam_rho
        )

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.momentum = -mean / (got.lr * self.K)  # Delta_{t+1}
        self.x = self.x + self.hp.server_lr * mean  # = x_t - eta_g eta_l K Delta_{t+1}


@dataclass
class MoFedSAMHparams(FedCMHparams):
    sam_rho: float = 0.1


@ALGORITHMS.register("mofedsam")
class MoFedSAM(FedCM):
    """FedCM's client momentum with the SAM gradient (Qu et al. 2022, Alg. 2)."""

    name = "mofedsam"
    Hparams = MoFedSAMHparams
