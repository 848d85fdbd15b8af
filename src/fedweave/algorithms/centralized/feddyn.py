"""FedDyn (Acar et al., ICLR 2021): dynamic regularization (Alg. 1; FedMIM spec §5).

Client i approximately minimizes ``f_i(theta) - <grad L_i, theta> + (alpha/2)||theta - x_t||^2`` with its
K local SGD steps (Eq. 1 of FedDyn's Alg. 1), then ``grad L_i <- grad L_i - alpha (theta_i - x_t)``.
Server: ``h <- h - alpha (1/N) sum_{i in S} (theta_i - x_t)`` and ``x_{t+1} = mean_S theta_i - h / alpha``.
The ``grad L_i`` are the client's own (:class:`FedDynStep`: in the client state store in simulation, on the
client's node when deployed); messages are one model each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, per_job
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import StateStore
from fedweave.execution.local import ClientStep, GradFn, LocalResult, LocalRule
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, CLIENT_STEPS, RULES


@RULES.register("feddyn")
class FedDynRule(ProxRule):
    """Direction ``grad f_i(w) - grad L_i + alpha (w - x_t)``: FedProx's rule plus the linear term."""

    def __init__(self, alpha: float, anchor: torch.Tensor, lin: torch.Tensor) -> None:
        super().__init__(alpha, anchor)
        self.lin = lin  # (K, P): grad L_i of each job

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        return super().direction(w, grad, jobs) - per_job(self.lin, jobs)


@CLIENT_STEPS.register("feddyn")
class FedDynStep(ClientStep):
    """FedDyn's client: local steps on its dynamically regularized objective, then
    ``grad L_i <- grad L_i - alpha (theta_i - x_t)``; it uploads its model ``theta_i``."""

    state = ("grad_L",)

    def __init__(self, alpha: float, anchor: torch.Tensor) -> None:
        self.alpha, self.anchor = float(alpha), anchor

    def rule(self, state: dict[str, torch.Tensor]) -> LocalRule:
        return FedDynRule(self.alpha, self.anchor, state["grad_L"])

    def finish(self, state, start: torch.Tensor, result: LocalResult):
        return {}, {"grad_L": state["grad_L"] - self.alpha * (result.params - start)}


@dataclass
class FedDynHparams(StarHparams):
    alpha: float = 0.1  # the "prox-weight" of FedMIM Sec. V-A

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.alpha <= MAX_LR:  # a larger one is inf in float32: the first step's alpha * 0 is NaN
            raise ConfigError(f"algorithm.alpha must be in (0, {MAX_LR:.6g}], got {self.alpha}")
        if self.server_lr != 1.0:  # Alg. 1's server sets theta^t outright: a step size would go unread
            raise ConfigError(
                f"algorithm.server_lr: FedDyn's server model is mean_S theta_i - h / alpha and takes no step size, "
                f"got {self.server_lr}"
            )


@ALGORITHMS.register("feddyn")
class FedDyn(StarAlgorithm):
    name = "feddyn"
    # privacy: h sums the clients' raw displacements, and the clients send their models (not updates)
    dp_refusal = "its server state h sums the clients' unclipped model displacements, outside the noised mean"
    Hparams = FedDynHparams
    step_sizes = ()  # server_lr must stay 1: the server sets its model outright
    state_fields = (*StarAlgorithm.state_fields, "h")
    updates_are_models = True  # the server averages the local models (an attack acts on theta_i - x_t)
    sums_unweighted = "state h sums the clients' models"  # secure aggregation: h needs sum_S theta_i (Alg. 1)

    def __init__(self, ctx, hp: FedDynHparams) -> None:
        super().__init__(ctx, hp)
        self.h = torch.zeros_like(self.x)
        self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("grad_L", self.num_params)
        self.ledger.store("server", "h", nbytes(self.h))
        self.ledger.store("client", "grad_L", nbytes(self.h))  # per client

    def client_rule(self, lr: float) -> FedDynStep:
        return FedDynStep(self.hp.alpha, self.x)

    def client_updates(self, got: Collected) -> torch.Tensor:
        return got.local.params  # the server averages the models themselves

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        a = self.hp.alpha
        moved = got.local.params - self.x
        self.h = self.h - a * moved.sum(0) / self.ctx.num_clients  # h <- h - alpha (1/N) sum_S (theta_i - x_t)
        self.x = mean - self.h / a  # x_{t+1} = mean_S theta_i - h / alpha
