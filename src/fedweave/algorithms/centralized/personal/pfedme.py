"""pFedMe (T. Dinh, Tran, Nguyen, NeurIPS 2020): personalized models as Moreau envelopes of the clients'
losses.

Client i minimises F_i(w) = min_theta f_i(theta) + (lambda/2)||theta - w||^2 (Eq. 2-3). Given the global
model w^t, each of its R local steps, on the step's batch D:
  theta~ <- K steps of theta <- theta - personal_lr (grad f_i(theta; D) + lambda (theta - w))
            from theta = w: an approximate solution of Eq. 7's inner problem                  (Alg. 1 line 7)
  w      <- w - eta lambda (w - theta~)       (line 8: the gradient of the envelope, Eq. 8)
it sends w_{i,R}; the server mixes, w^{t+1} = (1 - beta) w^t + beta sum_i p_i w_{i,R} (Alg. 1's server update; times
algorithm.server_lr). A client's personal model is its theta~ of its last local step.

Alg. 1 sends w^t to every client (line 3) and has every client take the R local steps, the sample S^t, drawn after
them, only choosing whose w_{i,R} are sent and averaged (Alg. 1's server step); the authors' code likewise "do[es]
update for all users not only selected users". By default only the sampled clients train, as in every star method,
so an unsampled client keeps the theta~ of the last round it took part in. ``algorithm.train_all: true`` runs Alg. 1
as written: every client receives w^t and takes the R local steps from it (every personal model moves each round),
and only the round's sampled clients, the ones the default draws, send their w_{i,R}, which the server averages as
before. The local steps start from w^t (line 7's theta~ too), so the sampled clients' w_{i,R}, and with them the
global model, are the default's (bit for bit in the tests, on the loop and vmap backends); only the personal models
of the clients outside the sample differ. The cost is N clients' local training a round instead of
clients_per_round, and the ledger bills the download of w^t to all N (line 3) beside the sampled clients' uploads.
As in the rest of the family, ``train_loss`` is the mean over the clients that report and ``faults.sim_time``'s
round lasts until their uploads arrive (the others train beside them). A round whose sample is empty (a sampler may
give none) is skipped as by default: nobody is sent w^t, nobody trains. Injected faults (``faults.dropout``,
``outage_rounds``, ``deadline``, ``byzantine``) are refused beside it: whether a client that drops out or is late
still took its steps, and what an attacker outside the sample does, Alg. 1 does not say.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.centralized.base import Collected, StarHparams
from fedweave.algorithms.centralized.personal.base import PersonalStar
from fedweave.config import MAX_LOCAL_STEPS, MAX_LR, ConfigError
from fedweave.execution import LocalResult
from fedweave.execution.local import GradFn, LocalRule
from fedweave.registry import ALGORITHMS


class PFedMeRule(LocalRule):
    """Direction ``lambda (w - theta~(w))`` with theta~ from ``inner_steps`` gradient steps on the step's
    batch (Alg. 1 lines 7-8); each job's last theta~ is written into ``theta`` (``(K, P)``) in place, so the
    rule runs only on the in-process backends.

    Args:
        lam: lambda of Eq. 2, > 0.
        inner_steps: K, the inner solver's steps.
        personal_lr: the inner solver's step size.
        theta: ``(K, P)``, the jobs' personalized models, written at every step.
    """

    def __init__(self, lam: float, inner_steps: int, personal_lr: float, theta: torch.Tensor) -> None:
        self.lam, self.inner_steps, self.personal_lr, self.theta = float(lam), int(inner_steps), personal_lr, theta

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        theta = w
        for _ in range(self.inner_steps):  # line 7: min_theta f_i(theta; D) + (lambda/2)||theta - w||^2
            theta = theta - self.personal_lr * (grad(theta) + self.lam * (theta - w))
        self.theta[jobs] = theta
        return self.lam * (w - theta)  # line 8 (the trainer takes w - eta * this)


@dataclass
class PFedMeHparams(StarHparams):
    lam: float = 15.0  # lambda (the paper's MNIST setting)
    inner_steps: int = 5  # K
    personal_lr: float = 0.01  # the inner solver's step size
    beta: float = 1.0  # the server's mixing; 1 is FedAvg's average
    # Alg. 1 as written: every client takes the local steps each round, the sampled ones report (module docstring)
    train_all: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.inner_steps <= MAX_LOCAL_STEPS:  # bounded as local.steps is: 1e300 would never end
            raise ConfigError(f"algorithm.inner_steps must be in [1, {MAX_LOCAL_STEPS:,}], got {self.inner_steps:.6g}")
        for key in ("lam", "personal_lr", "beta"):  # each multiplies a float32 step, as local.lr does: bounded as it is
            if not 0 < getattr(self, key) <= MAX_LR:
                raise ConfigError(f"algorithm.{key} must be in (0, {MAX_LR:.6g}], got {getattr(self, key)}")


@ALGORITHMS.register("pfedme")
class PFedMe(PersonalStar):
    name = "pfedme"
    Hparams = PFedMeHparams
    trains_in_process = True  # each client's personalized model theta_i is kept from inside the local steps

    def __init__(self, ctx, hp: PFedMeHparams) -> None:
        super().__init__(ctx, hp)
        if self.trainer.backend in ("pool", "ray"):
            raise ConfigError(
                f"algorithm pfedme keeps each client's personalized model from inside the local steps, which "
                f"backend {self.trainer.backend} runs in other processes; choose backend loop or vmap"
            )
        if hp.train_all and self.faulty:
            kinds = ", ".join(sorted(self.faults.active()))
            raise ConfigError(
                f"algorithm.train_all: true has every client take its local steps each round, but the run injects "
                f"faults ({kinds}), whose meaning for clients outside the sample Alg. 1 does not give; leave one out"
            )

    def recipients(self, clients: np.ndarray) -> np.ndarray:
        # train_all: w^t goes to every client (Alg. 1 line 3); a round with no sampled client is skipped as by default
        if self.hp.train_all and len(clients):
            return np.arange(self.ctx.num_clients)
        return clients

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        lr = self.trainer.lr(r)
        hp = self.hp
        # Alg. 1: every client (train_all; job c is client c) or the sampled ones
        trained = np.arange(self.ctx.num_clients) if hp.train_all else clients
        theta = self.store.rows("personal", trained)
        rule = PFedMeRule(hp.lam, hp.inner_steps, hp.personal_lr, theta)
        local = self.trainer.train(self.x, trained, r, rule=rule, lr=lr)  # the R local steps, lines 7-8 each
        self.store.set_rows("personal", trained, rule.theta)
        if hp.train_all:  # Alg. 1's S^t: only the sampled clients send their w_{i,R}
            at = torch.as_tensor(clients, dtype=torch.long, device=local.params.device)
            local = LocalResult(local.params[at], local.steps[at], local.loss[at])
        self.report_losses(r, clients, local.loss)  # what the sampled clients reported: the default's context
        return Collected(r, clients, lr, local, {}, self.weights(clients))

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        # Alg. 1's server update: (1 - beta) w + beta mean(w_i)
        self.x = self.x + (self.hp.server_lr * self.hp.beta) * mean
