"""FedMIM (Liu et al., "Enhance Local Consistency in Federated Learning: A Multi-Step Inertial Momentum
Approach"), Algorithm 1, as resolved in the FedMIM spec.

From the last J global displacements ``delta_{t-j} = (x_{t-j-1} - x_{t-j}) / K`` (P-line 6), constant
during round t, every local step is (P-lines 8-12)

    y1 = x_k - sum_j alpha_j delta_{t-j}                (inertial shift, m_alpha)
    y2 = x_k - sum_j beta_j  delta_{t-j}                (look-ahead point, m_beta)
    x_{k+1} = y1 - A eta_l grad f_i(y2; xi),   A = 1 - sum_j alpha_j

and the server averages the local models (P-line 16, global lr 1). The server keeps the last J+1 global
models and the clients receive the deltas (spec A3). Special cases (spec 2.3): alpha = beta = 0 (or J = 0)
is FedAvg; J = 1, beta = 0 is FedCM with client-momentum weight 1 - alpha_1 (constant lr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, regularized
from fedweave.config import ConfigError
from fedweave.execution import LocalRule
from fedweave.execution.local import GradFn
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, RULES


@RULES.register("fedmim")
class MIMRule(LocalRule):
    """FedMIM's local step (P-line 12) as ``x_{k+1} = x_k - eta_l d`` with
    ``d = m_alpha / eta_l + A * g(x_k - m_beta)``.

    g is the gradient of f_i including its L2 term evaluated at the look-ahead point (spec A7,
    ``wd_at="lookahead"``) or at the iterate (``"iterate"``); clipping acts on the loss gradient only.
    Use with a trainer that does not add weight decay or clipping itself (``regularize_in_rule``).
    """

    def __init__(
        self,
        m_alpha: torch.Tensor,
        m_beta: torch.Tensor,
        A: float,
        lr: float,
        *,
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
        wd_at: str = "lookahead",
    ) -> None:
        self.m_alpha, self.m_beta, self.A, self.lr = m_alpha, m_beta, float(A), float(lr)
        self.weight_decay, self.grad_clip, self.wd_at = weight_decay, grad_clip, wd_at

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        y2 = w - self.m_beta  # P-line 9
        if self.wd_at == "lookahead":
            g = regularized(grad, self.weight_decay, self.grad_clip)(y2)  # P-line 11
        else:
            g = regularized(grad, 0.0, self.grad_clip)(y2) + self.weight_decay * w
        return self.m_alpha / self.lr + self.A * g  # P-lines 8 and 12


@dataclass
class FedMIMHparams(StarHparams):
    # Table III's best row (spec A9); alpha[j], beta[j] weigh delta_{t-j}, J = len(alpha) (spec A1)
    alpha: list[float] = field(default_factory=lambda: [0.6, 0.3])
    beta: list[float] = field(default_factory=lambda: [0.9, 0.1])
    K_ref: int | None = None  # local steps normalizing delta; null: E*ceil(n_i/B) (spec A5)
    wd_at: Literal["lookahead", "iterate"] = "lookahead"  # where the L2 term of g is evaluated (spec A7)
    downlink: Literal["deltas", "broadcast"] = "deltas"  # how clients get the history (spec A3, §7)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.alpha) != len(self.beta):
            raise ConfigError(
                f"algorithm.alpha and algorithm.beta must have the same length J, got {len(self.alpha)} "
                f"and {len(self.beta)}"
            )
        for j, a in enumerate(self.alpha):
            if not 0 <= a < 1:
                raise ConfigError(f"algorithm.alpha[{j}] must be in [0, 1), got {a}")
        if sum(self.alpha) >= 1:
            raise ConfigError(f"algorithm.alpha must sum to < 1 (A = 1 - sum(alpha) > 0), got {sum(self.alpha)}")
        for j, b in enumerate(self.beta):
            if not (math.isfinite(b) and b >= 0):  # rho is free (spec A23), but NaN or inf is no weight
                raise ConfigError(f"algorithm.beta[{j}] must be a finite number >= 0, got {b}")
        if self.K_ref is not None and self.K_ref < 1:
            raise ConfigError(f"algorithm.K_ref must be >= 1 or null, got {self.K_ref}")

    @property
    def J(self) -> int:
        return len(self.alpha)

    @property
    def A(self) -> float:
        return 1.0 - sum(self.alpha)


@ALGORITHMS.register("fedmim")
class FedMIM(StarAlgorithm):
    name = "fedmim"
    dp_refusal = None  # privacy: the history and its deltas are past global models (post-processing)
    Hparams = FedMIMHparams
    state_fields = (*StarAlgorithm.state_fields, "history")
    regularize_in_rule = True

    def __init__(self, ctx, hp: FedMIMHparams) -> None:
        super().__init__(ctx, hp)
        # history[j] = x_{t-j}, j = 0..J; x_{-j} = x_0 so that delta_0 = ... = 0 (spec A2)
        self.history = self.x.expand(hp.J + 1, -1).clone()
        self.K = hp.K_ref or self.reference_steps()
        self.ledger.store("server", "global_history", nbytes(self.history))
        self.used = [j for j in range(hp.J) if hp.alpha[j] or hp.beta[j]]  # the deltas a client needs
        if hp.downlink == "broadcast":  # every client keeps J past global models (P-line 2)
            self.ledger.store("client", "global_history", nbytes(self.history[1:]))

    def deltas(self) -> torch.Tensor:
        """``delta_{t-j} = (x_{t-j-1} - x_{t-j}) / K`` for j = 0..J-1, shape (J, P) (P-line 6)."""
        return (self.history[1:] - self.history[:-1]) / self.K

    def momenta(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``m_alpha = sum_j alpha_j delta_{t-j}``, ``m_beta = sum_j beta_j delta_{t-j}``."""
        d = self.deltas()
        a = torch.tensor(self.hp.alpha, dtype=d.dtype, device=d.device)
        b = torch.tensor(self.hp.beta, dtype=d.dtype, device=d.device)
        return a @ d, b @ d

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        if self.hp.downlink == "broadcast" or not self.used:  # x_t (broadcast: the clients keep the history)
            return {"model": (self.x,)}
        return {"model": (self.x,), "deltas": (self.deltas()[self.used].reshape(-1),)}  # x_t and the deltas used

    def recipients(self, clients: np.ndarray) -> np.ndarray:
        if self.hp.downlink == "broadcast":  # every client receives every x_t (P-line 2)
            return np.arange(self.ctx.num_clients)
        return clients

    def client_rule(self, lr: float) -> MIMRule:  # P-lines 8-12
        hp, c = self.hp, self.config.local
        m_alpha, m_beta = self.momenta()
        return MIMRule(m_alpha, m_beta, hp.A, lr, weight_decay=c.weight_decay, grad_clip=c.grad_clip, wd_at=hp.wd_at)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # P-line 16 (the local models arrive on P-line 14)
        self.history = torch.cat([self.x.unsqueeze(0), self.history[:-1]])
