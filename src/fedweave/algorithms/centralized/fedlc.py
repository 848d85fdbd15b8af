"""FedLC (Zhang, Li, Tao, Yang and Yang, ICML 2022): logit calibration for label distribution skew.

Under label skew a client's local training pushes down the logits of the classes it rarely sees. FedLC
subtracts from each logit a class-wise margin that grows as the client's count of that class shrinks, and
trains on the cross-entropy of the calibrated logits (the paper's calibrated loss):

    f_y^cal(x) = f_y(x) - tau n_{i,y}^{-1/4}                                 (the calibrated logit)
    L_cal      = -log( exp(f_y^cal(x)) / sum_{y'} exp(f_{y'}^cal(x)) )        (the calibrated cross-entropy)

with ``n_{i,y}`` client i's number of training samples of class y (counted from the labels it trains on when the
run is built; a deployed node counts its own) and ``tau`` the calibration strength. A class the client does not
hold counts ``absent_count`` (default 1e-8: its logit is lowered by ``100 tau`` and drops out of the client's
softmax). The server is FedAvg's. ``tau: 0`` is FedAvg. Classification with cross-entropy only (the
calibration is of logits).

The rule's loss replaces the task's cross-entropy (``LocalRule.loss``): the local gradient is that of ``L_cal``
alone on every backend (an absent class's, about ``exp(-100 tau)`` times the input, is computed, not left as
the rounding residue of two cancelling gradients, whose sign a sign compressor would send at full size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, per_job
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule
from fedweave.registry import ALGORITHMS, RULES


def calibration(counts: torch.Tensor, tau: float, absent_count: float) -> torch.Tensor:
    """The margins ``tau n_{i,y}^{-1/4}`` of each row of class counts (absent classes count ``absent_count``)."""
    n = counts.to(torch.float64).clamp_min(absent_count)
    return tau * n.pow(-0.25)


def calibrated_loss(logits: torch.Tensor, y: torch.Tensor, margins: torch.Tensor) -> torch.Tensor:
    """Each sample's ``L_cal``: the cross-entropy of the logits less the client's margins."""
    return F.cross_entropy(logits - margins.to(logits.dtype), y, reduction="none")


@RULES.register("fedlc")
class LogitCalibration(LocalRule):
    """Trains each job on FedLC's ``L_cal`` in place of the task's cross-entropy.

    Args:
        margins: ``(K, C)``, each job's class margins ``tau n_{i,y}^{-1/4}``.
        tau, absent_count: the calibration's, with which a client derives its own margins (:meth:`at_client`).
    """

    client_derived = ("margins",)  # a client counts its own labels: deployed, nothing is sent

    def __init__(self, margins: torch.Tensor, tau: float, absent_count: float) -> None:
        self.margins, self.tau, self.absent_count = margins, float(tau), float(absent_count)

    def at_client(self, y: torch.Tensor, num_classes: int) -> LogitCalibration:
        counts = torch.bincount(y.to("cpu", torch.long), minlength=num_classes).unsqueeze(0)
        margins = calibration(counts, self.tau, self.absent_count).to(device=y.device)
        return LogitCalibration(margins, self.tau, self.absent_count)

    def loss(self, w, x, y, jobs, model):
        return calibrated_loss(model.functional(w, x), y, per_job(self.margins, jobs))


@dataclass
class FedLCHparams(StarHparams):
    tau: float = 1.0  # the calibration strength; the paper tunes it per dataset
    absent_count: float = 1e-8  # the count of a class the client does not hold

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.tau <= MAX_LR:  # a larger one is inf in float32: every calibrated logit is -inf
            raise ConfigError(f"algorithm.tau must be in [0, {MAX_LR:.6g}], got {self.tau}")
        # a class the client holds counts at least 1: an absent one counting more would lift the counts below it
        # to absent_count (calibration's clamp), and beyond every count all margins are equal: no calibration
        if not 0 < self.absent_count <= 1:
            raise ConfigError(f"algorithm.absent_count must be in (0, 1], got {self.absent_count}")


@ALGORITHMS.register("fedlc")
class FedLC(StarAlgorithm):
    name = "fedlc"
    Hparams = FedLCHparams
    # privacy: one model update per client, FedAvg's server step on the noised mean; the margins are each client's
    # own label counts, used in its local training only (user level: the whole update is clipped whatever made it)
    dp_refusal = None

    def __init__(self, ctx, hp: FedLCHparams) -> None:
        if not ctx.task.is_default:
            raise ConfigError(
                f"algorithm fedlc calibrates the logits of a classifier; it needs the classification task with "
                f"cross-entropy, got task.loss {ctx.config.task.loss!r}"
            )
        super().__init__(ctx, hp)
        ys = self.trainer.train_y.cpu().numpy()  # the labels each client trains on (a label-flipper's as flipped)
        c = ctx.dataset.num_classes
        counts = np.stack([np.bincount(ys[np.asarray(p, dtype=np.int64)], minlength=c) for p in ctx.partition])
        # n_{i,y}, the client's own label counts (each client knows its own; nothing is sent)
        margins = calibration(torch.as_tensor(counts, device="cpu"), hp.tau, hp.absent_count).to(ctx.dtype)
        self.margins = ctx.placement.to(margins)  # (N, C): tau n_{i,y}^{-1/4} of every client
        self.round_clients = np.zeros(0, dtype=np.int64)

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        self.round_clients = clients  # the rule's rows are the reporting clients', in job order
        return super().train_clients(r, clients)

    def client_rule(self, lr: float) -> LocalRule:
        rows = torch.as_tensor(self.round_clients, dtype=torch.long, device=self.margins.device)
        return LogitCalibration(self.margins.index_select(0, rows), self.hp.tau, self.hp.absent_count)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # FedAvg's
