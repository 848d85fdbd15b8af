"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): FedAvg on the MAML objective
F_i(w) = f_i(w - alpha grad f_i(w)), so that one local gradient step from the global model personalizes it.

Each local step of client i (Alg. 1), on the step's independent batches D, D' and (HF) D'' of the client's
data (the rule's ``draws``: the trainer draws each from a stream of its own, ``LocalRule.draws``):
  w~ <- w - alpha grad f_i(w; D)                                                  (line 6)
  FO: w <- w - beta grad f_i(w~; D')                                   (first-order, Sec. 5 "Per-FedAvg (FO)")
  HF: w <- w - beta (I - alpha d_i(w; D'')) grad f_i(w~; D'), with the Hessian-vector product
      d_i(w; D'') g = (grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')) / (2 delta)   (Hessian-free, Eq. 14)
with beta the local learning rate; the server averages as FedAvg. A client's personal model is the global
model after one local SGD step of size alpha on its own data (the paper's evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedweave.algorithms.base import with_local
from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.algorithms.centralized.personal.base import PersonalStar
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution.local import GradFn, LocalRule
from fedweave.registry import ALGORITHMS

ADAPT_KEY = 1  # the evaluation's adaptation step draws its batch from ("batches", round, client, 1)


def hessian_vector(grad: GradFn, w: torch.Tensor, v: torch.Tensor, delta: float) -> torch.Tensor:
    """``H(w) v`` by central differences of the gradient (Per-FedAvg's Hessian-free estimate, Eq. 14)."""
    return (grad(w + delta * v) - grad(w - delta * v)) / (2 * delta)


class PerFedAvgRule(LocalRule):
    """The MAML step's direction (lines 6-8): ``grad f(w - alpha grad f(w; D); D')``, times
    ``(I - alpha H(w; D''))`` for the Hessian-free variant; D, D', D'' the step's draws 0, 1, 2."""

    def __init__(self, alpha: float, variant: str = "fo", delta: float = 1e-3) -> None:
        self.alpha, self.variant, self.delta = float(alpha), variant, float(delta)
        self.draws = 3 if variant == "hf" else 2  # Alg. 1's independent batches: D, D' (and D'' for HF)

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        g = grad(w - self.alpha * grad(w, 0), 1)  # grad f(w~; D'), w~ = w - alpha grad f(w; D)
        if self.variant == "hf":
            g = g - self.alpha * hessian_vector(lambda v: grad(v, 2), w, g, self.delta)  # on D''
        return g


@dataclass
class PerFedAvgHparams(StarHparams):
    variant: Literal["fo", "hf"] = "fo"
    alpha: float = 0.01  # the personalization step (the paper's alpha)
    delta: float = 1e-3  # the Hessian-free difference step

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("alpha", "delta"):  # each scales a float32 step or difference, bounded as local.lr is
            if not 0 < getattr(self, key) <= MAX_LR:
                raise ConfigError(f"algorithm.{key} must be in (0, {MAX_LR:.6g}], got {getattr(self, key)}")
        if self.variant == "fo" and self.delta != PerFedAvgHparams.delta:  # accepted and never read before
            raise ConfigError(
                f"algorithm.delta ({self.delta:g}) is the Hessian-free variant's difference step; variant fo reads "
                "no Hessian: leave it out, or set variant: hf"
            )


@ALGORITHMS.register("perfedavg")
class PerFedAvg(PersonalStar):
    name = "perfedavg"
    Hparams = PerFedAvgHparams
    step_sizes = ("server_lr", "alpha")  # alpha: the personalization step of lines 6-8
    keeps_personal = False  # the personal model is one step from the global model, made when evaluated
    undeployable = "its evaluation adapts the global model on every client's data in the simulation"

    def __init__(self, ctx, hp: PerFedAvgHparams) -> None:
        super().__init__(ctx, hp)
        # the step the meta-objective trains for (line 6: w - alpha grad f(w; D)), the raw gradient as in the
        # rule's inner step: local.weight_decay and local.grad_clip shape the outer step only
        self.adapt_trainer = with_local(self.trainer, steps=1, momentum=0.0, weight_decay=0.0, grad_clip=None)

    def client_rule(self, lr: float) -> LocalRule:
        return PerFedAvgRule(self.hp.alpha, self.hp.variant, self.hp.delta)

    train_clients = StarAlgorithm.train_clients  # a rule without client state: the star's own

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # line 10: FedAvg's average

    def personal_models(self, r: int) -> torch.Tensor:
        """One local SGD step of size alpha from the global model on each client's data (on a copy)."""
        clients = range(self.ctx.num_clients)
        return self.adapt_trainer.train(self.x, clients, r, lr=self.hp.alpha, key=(ADAPT_KEY,)).params
