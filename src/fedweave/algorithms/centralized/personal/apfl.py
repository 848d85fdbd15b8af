"""APFL (Deng, Kamani, Mahdavi, 2020): each client mixes a local model with the global one, with an adaptive
mixing weight.

Client i keeps a local model v_i and a weight alpha_i; its personal model is
``vbar_i = alpha_i v_i + (1 - alpha_i) w``. Sampled in a round and given the global model w (Alg. 1):
  w_i     <- local SGD on f_i from w                                   (line 5; what it sends)
  v_i     <- v_i - eta grad_v f_i(vbar_i) = v_i - eta alpha_i grad f_i(vbar_i)          (line 6, per step)
  alpha_i <- alpha_i - eta_alpha <v_i - w_i, grad f_i(vbar_i)>, kept in [0, 1]          (Eq. 10, per step)
and the server averages the w_i (line 9). The v steps run after the w steps, on the same number of local
steps with their own batches, each mixing v_i with the client's local model w_i of the round (the paper
interleaves the two; the global model does not depend on v_i or alpha_i either way). ``adaptive: false``
keeps alpha_i at ``alpha``; ``alpha: 0`` then is FedAvg, the personal model the global one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.centralized.base import Collected, StarHparams, per_job
from fedweave.algorithms.centralized.personal.base import PersonalStar
from fedweave.config import ConfigError
from fedweave.execution.local import GradFn, LocalRule
from fedweave.registry import ALGORITHMS

PERSONAL_KEY = 1  # the v steps draw their batches from ("batches", round, client, 1)


class APFLRule(LocalRule):
    """Direction ``alpha_k grad f(alpha_k v + (1 - alpha_k) w_k)`` on the local model v (line 6), and, when
    ``alpha_lr`` is given, the step of alpha_k of Eq. 10, written into ``alpha`` (``(K, 1)``, one row per
    job) in place: the rule carries the jobs' alpha, so it runs only on the in-process backends.

    Args:
        alpha: ``(K, 1)`` mixing weights, updated in place when adaptive.
        w: ``(K, P)`` the jobs' local models w_k of the round.
        alpha_lr: eta_alpha of Eq. 10, or None to keep alpha fixed.
    """

    def __init__(self, alpha: torch.Tensor, w: torch.Tensor, alpha_lr: float | None) -> None:
        self.alpha, self.w, self.alpha_lr = alpha, w, alpha_lr

    def direction(self, v: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        a, w = per_job(self.alpha, jobs), per_job(self.w, jobs)
        g = grad(a * v + (1 - a) * w)  # grad f_i(vbar)
        d = a * g  # before alpha's step: `a` may be a view of the row it writes
        if self.alpha_lr is not None:  # Eq. 10: d vbar / d alpha = v - w
            step = ((v - w) * g).sum(-1, keepdim=True)
            self.alpha[jobs] = (a - self.alpha_lr * step).clamp(0.0, 1.0)
        return d


@dataclass
class APFLHparams(StarHparams):
    alpha: float = 0.25  # the initial mixing weight alpha_i (0.25: one of the values the paper tries)
    adaptive: bool = True  # update alpha_i by Eq. 10
    alpha_lr: float | None = None  # eta_alpha; null: the local learning rate of the round

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"algorithm.alpha must be in [0, 1], got {self.alpha}")
        if self.alpha_lr is not None and self.alpha_lr <= 0:
            raise ConfigError(f"algorithm.alpha_lr must be > 0 or null, got {self.alpha_lr}")
        if self.alpha_lr is not None and not self.adaptive:  # Eq. 10 is off: the step size would go unread
            raise ConfigError(
                f"algorithm.alpha_lr is the step size of alpha's update (Eq. 10), which adaptive: false turns off; "
                f"leave it out or set adaptive: true, got {self.alpha_lr}"
            )


@ALGORITHMS.register("apfl")
class APFL(PersonalStar):
    name = "apfl"
    Hparams = APFLHparams

    @classmethod
    def in_process(cls, hp: APFLHparams) -> bool:
        return hp.adaptive  # alpha_i is updated inside the local steps (Eq. 10)

    def __init__(self, ctx, hp: APFLHparams) -> None:
        super().__init__(ctx, hp)
        if hp.adaptive and self.trainer.backend in ("pool", "ray"):
            raise ConfigError(
                f"algorithm apfl with adaptive: true updates alpha inside the local steps, which backend "
                f"{self.trainer.backend} runs in other processes; choose backend loop or vmap (or adaptive: false)"
            )
        self.store.create("alpha", 1, fill=hp.alpha)  # alpha_i

    def personal_steps(self, client: int) -> int:
        """Line 6: the personal model's pass, as many steps as the global model's (the trainer's)."""
        return self.trainer.num_steps(client)

    def train_clients(self, r: int, clients) -> Collected:
        got = super().train_clients(r, clients)  # line 5: plain local SGD from w (FedAvg's client)
        alpha = self.store.rows("alpha", clients)
        rule = APFLRule(alpha, got.local.params, (self.hp.alpha_lr or got.lr) if self.hp.adaptive else None)
        v = self.trainer.train(
            self.store.rows("personal", clients), clients, r, rule=rule, lr=got.lr, key=(PERSONAL_KEY,)
        )
        self.store.set_rows("personal", clients, v.params)  # line 6
        self.store.set_rows("alpha", clients, rule.alpha)  # Eq. 10
        return got

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # line 9

    def personal_models(self, r: int) -> torch.Tensor:
        a = self.store["alpha"].to(self.x.device)
        return a * self.store["personal"].to(self.x.device) + (1 - a) * self.x  # vbar_i with the global model
