"""FedNova (Wang, Liu, Liang, Joshi and Poor, NeurIPS 2020): normalized averaging for unequal local work.

When client i takes tau_i local SGD steps, FedAvg's ``sum_i p_i Delta_i`` weights each client by how far it
walked as well as by p_i, so it minimizes the surrogate ``sum_i (p_i tau_i / sum_j p_j tau_j) F_i``, not
``sum_i p_i F_i`` (the objective inconsistency the paper analyses). FedNova normalizes each update by the
client's work before averaging and rescales by the effective number of steps (Sec. 4, the generalized update
rule, and Sec. 5, FedNova; plain local SGD, so the paper's ``a_i`` is the all-ones vector and
``||a_i||_1 = tau_i``):

    d_i     = -Delta_i / (eta tau_i)                    the client's normalized gradient G_i a_i / ||a_i||_1
    tau_eff = sum_i p_i tau_i                            the effective number of local steps
    x+      = x - eta_g tau_eff eta sum_i p_i d_i = x + eta_g sum_i p_i (tau_eff / tau_i) Delta_i

``tau_i`` is the number of local steps the trainer reports for each client (``LocalResult.steps``): with
``local.epochs`` it is ``E ceil(n_i / B)``, so clients with more data take more steps. The client sends its
model as in FedAvg, and its step count with it, as every client's reply does (``LocalResult.steps``,
in simulation and from a deployment's nodes). Local momentum
changes ``a_i`` (the paper's Sec. 5 gives its norm); this file implements the plain-SGD version and refuses
``local.momentum``.

A client without samples (``partition.min_size: 0``) takes no step: ``tau_i = 0``, so it adds nothing to
``tau_eff = sum_i p_i tau_i``, and it has no normalized gradient (``G_i a_i / ||a_i||_1`` is 0 / 0). The
generalized update (Sec. 4) is ``x+ = x - tau_eff eta sum_i w_i d_i`` with weights ``w_i`` summing to one
over the clients' ``d_i``, FedNova's ``w_i = p_i`` (Sec. 5): the clients that stepped get the weights
``p_i / sum_{j: tau_j > 0} p_j`` and the one that did not gets 0. ``tau_eff`` stays FedAvg's own, with the
empty client's zero steps in it (under ``weighting: samples`` its ``p_i`` is 0 and nothing changes), so
with equal steps among the clients that stepped FedNova is still FedAvg under the same weighting.
"""

from __future__ import annotations

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


def nova_scale(p: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The coefficients ``tau_eff / (tau_i sum_{j: tau_j > 0} p_j)`` of each client's update,
    ``tau_eff = sum_j p_j tau_j``; 0 for a client that took no step (it has no normalized gradient).

    Computed in float64 as ``sum_j p_j tau_j / (tau_i sum_{j: tau_j > 0} p_j)``: the p_j sum to one, and
    dividing by their computed sum makes every coefficient exactly 1 when all tau_i are equal (the products
    and sums of float32 weights and step counts are exact in float64), so FedNova is then FedAvg bit for bit.
    """
    p64 = p.to(torch.float64)
    tau = steps.to(torch.float64)
    stepped = tau > 0
    # tau_eff counts an empty client's 0 steps; its weight leaves the normalized direction (module docstring)
    coef = (p64 @ tau) / (tau.clamp_min(1) * torch.where(stepped, p64, 0.0).sum())
    return torch.where(stepped, coef, 0.0).to(p.dtype)


@ALGORITHMS.register("fednova")
class FedNova(StarAlgorithm):
    name = "fednova"

    def __init__(self, ctx, hp) -> None:
        if ctx.config.local.momentum:
            raise ConfigError(
                f"algorithm fednova implements the plain-SGD normalization (a_i = ones); local.momentum must be 0, "
                f"got {ctx.config.local.momentum}"
            )
        super().__init__(ctx, hp)

    def client_updates(self, got: Collected) -> torch.Tensor:
        # (tau_eff / tau_i) Delta_i: each update normalized by its client's steps, rescaled by tau_eff, so that
        # the template's weighted mean sum_i p_i (.) is FedNova's direction (Sec. 5). Delta_i is the template's:
        # under compression.upload the decoded displacement itself, not (x + decoded) - x, which rounds it
        delta = super().client_updates(got)
        return nova_scale(got.weights, got.local.steps).unsqueeze(1) * delta

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # x+ = x + eta_g sum_i p_i (tau_eff / tau_i) Delta_i
