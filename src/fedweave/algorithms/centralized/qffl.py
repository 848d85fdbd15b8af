"""q-FFL / q-FedAvg (Li, Sanjabi, Beirami and Smith, ICLR 2020): fair resource allocation.

q-FFL minimizes ``f_q(w) = sum_k p_k F_k^{q+1}(w) / (q + 1)`` (Eq. 2): q > 0 weights the clients with a
high loss more, and q = 0 is FedAvg's objective. q-FedAvg solves it with FedAvg's local SGD and a server step
that takes ``L = 1/eta`` (the local step size) as the Lipschitz constant of the clients' gradients and
``h_k`` below as the resulting bound on the Lipschitz constant of the gradient of ``F_k^{q+1} / (q + 1)``:

    Delta w_k = L (w^t - wbar_k^{t+1})                                  wbar: client k's local model
    Delta_k   = F_k^q(w^t) Delta w_k
    h_k       = q F_k^{q-1}(w^t) ||Delta w_k||^2 + L F_k^q(w^t)
    w^{t+1}   = w^t - sum_k Delta_k / sum_k h_k                          (the server)

``F_k(w^t)`` is client k's loss of the global model on its training data, computed before it trains; it
sends Delta_k and h_k (a model's size and one number). The paper samples clients proportionally to their
sizes and sums uniformly over the sample; the sampler here is the run's (uniform by default). The update
sums over the round's clients, so ``weighting`` does not enter it. With ``q = 0`` the step is
``w^t - sum_k L (w^t - wbar_k) / (m L)``, the plain mean of the local models: FedAvg with ``weighting:
uniform``, equal up to the rounding of the products with L and 1/L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.config import MAX_LR, ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class QFFLHparams(StarHparams):
    q: float = 1.0  # the fairness exponent; the paper's q in {0.001, 0.01, 0.1, 1, 2, 5, 10, 15}
    lipschitz: float | None = None  # L; null: 1 / the round's local step size (the paper's estimate)

    def __post_init__(self) -> None:
        super().__post_init__()
        # a larger q or L is inf in float32: F^q or L (w - wbar_k) is inf and the first step is NaN, whatever local.lr
        if not 0 <= self.q <= MAX_LR:
            raise ConfigError(f"algorithm.q must be in [0, {MAX_LR:.6g}], got {self.q}")
        if self.server_lr != 1.0:
            raise ConfigError(
                f"algorithm.server_lr: q-FedAvg's server step is sum Delta_k / sum h_k and takes no step size, "
                f"got {self.server_lr}"
            )
        if self.lipschitz is not None and not 0 < self.lipschitz <= MAX_LR:
            raise ConfigError(
                f"algorithm.lipschitz must be in (0, {MAX_LR:.6g}] (or null: 1 / local.lr), got {self.lipschitz}"
            )


def qffl_client(
    x: torch.Tensor, local: torch.Tensor, loss: torch.Tensor, q: float, lipschitz: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's ``(Delta_k, h_k)`` (q-FedAvg) from the global model ``x`` ``(P,)``, the local models
    ``local`` ``(m, P)`` and the clients' losses ``loss`` ``(m,)`` of ``x`` before training."""
    dw = lipschitz * (x - local)  # Delta w_k = L (w^t - wbar_k)
    # F_k^{q-1} is infinite at F_k = 0 for q < 1 (a cross-entropy that underflows to 0): h_k would be inf (the round
    # steps nowhere) or NaN (with Delta w_k = 0). The authors' code takes the powers of F_k + 1e-10; a floor at 1e-10
    # does the same there and leaves every loss above it as it is (a negative loss, outside q-FFL's objective, is not
    # hidden by the floor)
    loss = torch.where(loss >= 0, loss.clamp_min(1e-10), loss)
    fq = loss.pow(q)
    slope = q * loss.pow(q - 1) * dw.pow(2).sum(1) if q else torch.zeros_like(loss)  # q F^{q-1} ||Delta w_k||^2
    return fq.unsqueeze(1) * dw, slope + lipschitz * fq  # Delta_k = F^q Delta w_k;  h_k = slope + L F^q


def qffl_step(x: torch.Tensor, delta: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The server's ``w^{t+1} = w^t - sum_k Delta_k / sum_k h_k`` (q-FedAvg)."""
    return x - delta.sum(0) / h.sum()


@ALGORITHMS.register("qffl")
@ALGORITHMS.register("qfedavg")
class QFedAvg(StarAlgorithm):
    name = "qfedavg"
    uploads_start_loss = True  # F_k(w^t): deployed, each node computes it on its data, in the training job
    Hparams = QFFLHparams
    step_sizes = ()  # server_lr must stay 1: the step is sum Delta_k / sum h_k, h_k from algorithm.lipschitz
    # F_k^q overflows float32 (3.4e38) once q is large, whatever the step size: q = 200 at a loss of 1.6
    divergence_hint = (
        "q-FedAvg weights each client's update by F_k^q, its loss to the power algorithm.q, which is infinite in "
        "float32 (above 3.4e38) once q is large: lower algorithm.q (or use precision: float64)."
    )
    uplink = "update+h"  # Delta_k and h_k
    # its server step is sum Delta_k / sum h_k, not a reduction of the updates to one: an aggregator, a
    # Byzantine attack on the updates or a compressor of the (Delta_k, h_k) pair would be silently bypassed
    robust_aggregation = False
    handles_faults = ("dropout", "deadline")
    compresses_uploads = False

    def lipschitz(self, lr: float) -> float:
        """L: ``algorithm.lipschitz``, else 1 / the round's local step size (the paper's estimate)."""
        return self.hp.lipschitz if self.hp.lipschitz is not None else 1.0 / lr

    def train_clients(self, r: int, clients) -> Collected:
        got = super().train_clients(r, clients)
        loss = self.start_losses(got)  # F_k(w^t), each client's on its own data
        delta, h = qffl_client(self.x, got.local.params, loss, self.hp.q, self.lipschitz(got.lr))
        got.upload = {"delta": delta, "h": h.unsqueeze(1)}  # what each client sends
        return got

    def client_updates(self, got: Collected) -> torch.Tensor:
        return got.upload["delta"]

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = qffl_step(self.x, got.upload["delta"], got.upload["h"].squeeze(1))
