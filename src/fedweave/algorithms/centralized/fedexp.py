"""FedExP (Jhunjhunwala, Wang and Joshi, ICLR 2023): FedAvg's clients, an extrapolated server step size.

The server step size adapts to the round's updates like a projection onto convex sets is extrapolated
(POCS): with ``Delta_i = y_i - x_t`` the M reporting clients' updates and ``Delta = mean_i Delta_i``,

    eta_g = max(1, sum_i ||Delta_i||^2 / (2 M (||Delta||^2 + eps)))        (FedExP's step size)
    x_{t+1} = x_t + eta_g Delta

``eta_g`` is large when the clients' updates disagree (their mean is short beside them) and 1 (FedAvg) when
they agree. ``eps`` keeps it finite when the updates cancel (the paper takes 1e-3). The paper averages the
updates with equal weights, so ``weighting`` defaults to ``uniform`` here. With ``samples`` Delta is the
weighted mean ``sum_i p_i Delta_i`` and the step size its weighted analogue

    eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||sum_i p_i Delta_i||^2 + eps)))

which is the paper's at p_i = 1/M. The extrapolated parallel projection method FedExP builds on (Pierra;
Combettes) takes this ratio with any convex weights, and by Jensen ``sum_i p_i ||Delta_i||^2 >=
||sum_i p_i Delta_i||^2``, so eta_g still grows with the updates' disagreement and is 1 when they agree. The
plain count M beside weighted rows mixed two means: a client with few samples raised eta_g as much as one with
many. ``extrapolate: false`` fixes eta_g at 1 (FedAvg bit for bit); ``server_lr`` (default 1, the paper's)
multiplies eta_g. The paper evaluates the average of the last two iterates to damp the oscillation of the
extrapolated steps; this file evaluates x_t itself.
docs/extending.md shows this method written as a plug-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.config import MAX_LR, ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class FedExPHparams(StarHparams):
    weighting: Literal["samples", "uniform"] = "uniform"  # the paper's plain mean of the updates
    eps: float = 1e-3  # the paper's epsilon
    extrapolate: bool = True  # false: eta_g = 1, FedAvg

    def __post_init__(self) -> None:
        super().__post_init__()
        # a larger eps is inf in float32: the step size is 1 whatever the updates, FedAvg under FedExP's name
        if not 0 < self.eps <= MAX_LR:
            raise ConfigError(f"algorithm.eps must be in (0, {MAX_LR:.6g}], got {self.eps}")


def fedexp_step_size(
    updates: torch.Tensor, mean: torch.Tensor, eps: float, weights: torch.Tensor | None = None
) -> float:
    """``max(1, sum_i ||Delta_i||^2 / (2 M (||Delta||^2 + eps)))`` for the M rows of ``updates`` and their
    aggregate ``mean`` (FedExP's server step size); with ``weights`` p (summing to one, the aggregate's), its
    weighted form ``max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps)))``, the same at p_i = 1/M. A ratio
    that is NaN (a row holding NaN) stays NaN, as an infinite one stays infinite: the step diverges the run."""
    if weights is None:
        m = updates.shape[0]
        ratio = float(updates.pow(2).sum() / (2 * m * (mean.pow(2).sum() + eps)))
    else:
        ratio = float(weights @ updates.pow(2).sum(1) / (2 * (mean.pow(2).sum() + eps)))
    return 1.0 if ratio <= 1.0 else ratio  # not max(1.0, ratio), which is 1.0 for a NaN ratio


@ALGORITHMS.register("fedexp")
class FedExP(StarAlgorithm):
    name = "fedexp"
    Hparams = FedExPHparams
    last_step_size = 1.0  # eta_g of the round's server step (logged as server_step_size)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        # the rows the server received (an attacker's in place of its own update), else as the clients computed them
        rows = got.received if got.received is not None else self.client_updates(got)
        # weighting uniform: the paper's formula as printed; samples: its weighted form with the aggregate's p_i
        p = got.weights if self.hp.weighting == "samples" else None
        eta = fedexp_step_size(rows, mean, self.hp.eps, p) if self.hp.extrapolate else 1.0
        self.last_step_size = eta
        self.x = self.x + self.hp.server_lr * eta * mean  # x_{t+1} = x_t + eta_g Delta (server_lr 1: the paper's)

    def local_metrics(self, local, p) -> dict[str, float]:
        # the round's metrics (after its server step): the step size it took
        return {**super().local_metrics(local, p), "server_step_size": self.last_step_size}
