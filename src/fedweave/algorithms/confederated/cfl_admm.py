"""CFL-ADMM (Wang, Fang, Li, Yuan, Ling, IEEE TSP 2023), as RECONSTRUCTED by the spec (B4): unverified.

The CFL-SAGA paper only says CFL-ADMM is a stochastic ADMM whose servers randomly select users to upload
their local variables (SR = 0.3). The updates below are the spec's reconstruction on the consensus split
x_ij = z_i (user-server) and z_i = z_i' (server-server), not the algorithm of the original paper:

  selected user:  h_ij = S_ij grad f_ij,t(x_ij);  x_ij <- z_i - (lambda_ij + h_ij)/beta;
                  lambda_ij <- lambda_ij + beta (x_ij - z_i);  upload beta x_ij + lambda_ij (one vector)
  server:         z_i <- [sum_j (beta x_ij + lambda_ij) - gamma_i + c sum_{i' in N(i)} (z_i + z_i')]
                         / (P_i beta + 2 c |N(i)|)
                  gamma_i <- gamma_i + c sum_{i' in N(i)} (z_i - z_i')      (decentralized ADMM, Shi et al. 2014)

Unselected users' last uploads are reused. ``local_gradient="full"`` (an option beyond the spec) lets a selected
user use its exact local gradient grad f_ij instead of one scaled mini-batch gradient. The model of server i
is z_i (the optimality gap uses it).

Under faults: a selected user that drops out keeps x_ij, lambda_ij and its last upload (as an unselected one);
a server that misses the round keeps z_i and gamma_i; the server-server terms use only the links that are up
this round (adjacency A_r, degrees d_r), which keeps sum_i gamma_i = 0 since A_r is symmetric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
class CFLADMMHparams(ConfederatedHparams):
    sample_rate: float = 0.3  # SR (paper: 0.3)
    beta: float | None = None  # user-server penalty (1/beta is the users' step); null: beta_scale * L_f
    beta_scale: float = 20.0
    c: float | None = None  # server-server penalty; null: c_scale * L_f
    c_scale: float = 2.0
    local_gradient: Literal["minibatch", "full"] = "minibatch"  # h_ij: S grad f_ij,t (spec) or grad f_ij (option)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rate("sample_rate", self.sample_rate)
        for key in ("step_size", "step_scale"):  # the gradient-tracking skeleton's alpha, which ADMM never takes
            if getattr(self, key) != getattr(ConfederatedHparams, key):
                raise ConfigError(
                    f"algorithm.{key}: cfl_admm takes no step size alpha (its users step by 1/beta, its servers by "
                    "the penalty c: algorithm.beta or beta_scale, c or c_scale); leave it out"
                )
        if self.mixing != ConfederatedHparams.mixing:  # its servers weigh neighbours by c, not by W
            raise ConfigError(
                "algorithm.mixing: cfl_admm mixes with no W (its servers use the graph's links and degrees with the "
                "penalty c); leave it out"
            )
        for key in ("beta", "beta_scale", "c", "c_scale"):
            v = getattr(self, key)
            if v is not None and v <= 0:
                raise ConfigError(f"algorithm.{key} must be > 0, got {v}")
        for key in ("beta", "c"):  # an explicit penalty replaces its scale * L_f
            scale = f"{key}_scale"
            if getattr(self, key) is not None and getattr(self, scale) != getattr(CFLADMMHparams, scale):
                raise ConfigError(
                    f"algorithm.{scale}: algorithm.{key} sets the penalty directly, {scale} * L_f is unread; keep one"
                )


@ALGORITHMS.register("cfl_admm")
class CFLADMM(ConfederatedAlgorithm):
    name = "cfl_admm"
    Hparams = CFLADMMHparams
    step_sizes = ()  # no alpha; a larger beta or c takes smaller steps, so a divergence names no step to lower
    state_fields = (*ConfederatedAlgorithm.state_fields, "xu", "lam", "msg", "gamma")

    def __init__(self, ctx: RunContext, hp: CFLADMMHparams) -> None:
        super().__init__(ctx, hp)
        pb = self.problem
        self.m = users_per_iteration(hp.sample_rate, pb.P)
        z = torch.zeros(pb.N, pb.P, pb.d, dtype=torch.float64, device=self.device)
        self.xu, self.lam, self.msg = z.clone(), z.clone(), z.clone()  # x_ij, lambda_ij, beta x_ij + lambda_ij
        self.gamma = torch.zeros(pb.N, pb.d, dtype=torch.float64, device=self.device)  # server-server dual
        adj = torch.from_numpy(self.net.adjacency.astype("float64")).to(self.device)
        self.adj, self.deg = adj, adj.sum(1, keepdim=True)
        self.beta = hp.beta if hp.beta is not None else hp.beta_scale * self.L_f
        self.c = hp.c if hp.c is not None else hp.c_scale * self.L_f

    def step(self, r: int) -> None:
        pb, beta, c = self.problem, self.beta, self.c
        rows = torch.arange(pb.N, device=self.device)[:, None]
        users = self.select_users(self.k, self.m)
        idx = pb.batch_index(users, self.draw_batches(self.k).gather(1, users))
        z = self.X
        self.broadcast(r, "model", self.m, self.vector_bytes)
        x, lam = self.xu[rows, users], self.lam[rows, users]
        if self.hp.local_gradient == "minibatch":
            h = pb.S * pb.batch_grad(x, idx)  # unbiased estimate of grad f_ij(x_ij)
        else:
            h = sum(pb.batch_grad(x, pb.batch_index(users, torch.full_like(users, t))) for t in range(pb.S))
        x_new = z[:, None] - (lam + h) / beta  # linearized primal step
        lam_new = lam + beta * (x_new - z[:, None])
        if self.user_on is None:
            adj, deg, sent = self.adj, self.deg, pb.N * self.m
        else:  # only the users that take part update and upload
            on = self.user_on.gather(1, users)[..., None]
            x_new, lam_new = torch.where(on, x_new, x), torch.where(on, lam_new, lam)
            adj = torch.from_numpy(self.adj_r.astype("float64")).to(self.device)
            deg, sent = adj.sum(1, keepdim=True), int(on.sum())
        self.xu[rows, users], self.lam[rows, users] = x_new, lam_new
        self.msg[rows, users] = beta * x_new + lam_new
        self.upload(r, "admm_primal_dual", sent)
        num = self.msg.sum(1) - self.gamma + c * (deg * z + adj @ z)
        z_new = num / (pb.P * beta + 2 * c * deg)
        if self.server_on is not None:  # a server that misses the round keeps z_i (and gamma_i: its row of A_r is 0)
            z_new = torch.where(self.server_on[:, None], z_new, z)
        self.exchange(r, "model", self.vector_bytes)
        self.gamma = self.gamma + c * (deg * z_new - adj @ z_new)
        self.X = z_new
        self.k += 1
