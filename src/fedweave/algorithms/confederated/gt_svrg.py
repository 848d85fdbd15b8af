"""GT-SVRG (Xin, Khan, Kar, IEEE TSP 2020) adapted to CFL as in the CFL-SAGA paper (§VIII-C, spec B2).

Every ``inner_loop`` (T) iterations, at k = 0, T, 2T, ... (spec §7), the server takes its model as the anchor
tau_i, all its users upload their full local gradients grad f_ij(tau_i), and mu_i = sum_j grad f_ij(tau_i) is
both the estimate of that iteration and the control variate of the next ones. In between, m = SR * P_i
selected users each upload grad f_ij,t(x_i^{k+1}) - grad f_ij,t(tau_i) for one mini-batch t, and
g_i^{k+1} = (S~_i / m) sum_selected (...) + mu_i. The snapshot iteration does the full upload only (spec A19).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.confederated.base import (
    ConfederatedAlgorithm,
    ConfederatedHparams,
    check_rate,
    users_per_iteration,
)
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class GTSVRGHparams(ConfederatedHparams):
    sample_rate: float = 0.15  # SR (paper: 0.15)
    inner_loop: int = 100  # T, not given by the paper (spec A19: tune in {20, 50, 100, 200})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rate("sample_rate", self.sample_rate)
        if self.inner_loop < 1:
            raise ConfigError(f"algorithm.inner_loop must be >= 1, got {self.inner_loop}")


@ALGORITHMS.register("gt_svrg")
class GTSVRG(ConfederatedAlgorithm):
    name = "gt_svrg"
    Hparams = GTSVRGHparams
    _state = ("anchor", "mu")

    def __init__(self, ctx: RunContext, hp: GTSVRGHparams) -> None:
        super().__init__(ctx, hp)
        pb = self.problem
        self.m = users_per_iteration(hp.sample_rate, pb.P)
        self.anchor = torch.zeros(pb.N, pb.d, dtype=torch.float64)  # tau_i
        self.mu = torch.zeros(pb.N, pb.d, dtype=torch.float64)  # sum_j grad f_ij(tau_i)

    def snapshot(self, r: int, x_new: torch.Tensor) -> torch.Tensor:
        """All users upload grad f_ij(x_i^{k+1}); returns g_i^{k+1} = sum_j grad f_ij(x_i^{k+1})."""
        pb = self.problem
        self.net.broadcast(r, "model", pb.N * pb.P, self.vector_bytes)
        self.upload(r, "full_gradient", pb.N * pb.P)
        return self.problem.server_grad(x_new)

    def estimate(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        if k % self.hp.inner_loop == 0:
            self.anchor, self.mu = x_new.clone(), self.snapshot(r, x_new)
            return self.mu
        pb = self.problem
        users = self.select_users(k, self.m)
        idx = pb.batch_index(users, self.draw_batches(k).gather(1, users))
        self.net.broadcast(r, "model", pb.N * self.m, self.vector_bytes)  # the users kept tau_i from the snapshot
        diff = pb.batch_grad(x_new, idx) - pb.batch_grad(self.anchor, idx)
        self.upload(r, "svrg_difference", pb.N * self.m)
        return (pb.P * pb.S / self.m) * diff.sum(1) + self.mu
