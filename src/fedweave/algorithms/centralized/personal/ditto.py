"""Ditto (Li, Hu, Beirami, Smith, ICML 2021) on the star: a global model by FedAvg and a personal model per
client, pulled towards the global one.

Client k, sampled in round t and given the global model w^t (Alg. 1):
  w_k   <- local SGD on F_k from w^t                                (lines 4-5, the global objective's solver)
  v_k   <- ``personal_epochs`` of SGD on F_k(v) + (lambda/2)||v - w^t||^2 from v_k           (lines 6-7, Eq. 2)
and sends w_k; the server averages, w^{t+1} = w^t + sum_k p_k (w_k - w^t) (line 9). The personal step is
the decentralized family's Ditto rule (``ProximalRule``, kept in ``fedweave.algorithms.base`` for both
families), anchored here at the global model of the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.algorithms.base import ProximalRule, check_ditto, with_local
from fedweave.algorithms.centralized.base import Collected, StarHparams
from fedweave.algorithms.centralized.personal.base import PersonalStar
from fedweave.registry import ALGORITHMS

PERSONAL_KEY = 1  # the personal solve draws its batches from ("batches", round, client, 1)


@dataclass
class StarDittoHparams(StarHparams):
    lam: float = 0.5  # lambda of Eq. 2 (the decentralized Ditto's default)
    personal_epochs: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ditto(self.lam, self.personal_epochs)


@ALGORITHMS.register("ditto_star")
class StarDitto(PersonalStar):
    name = "ditto_star"
    Hparams = StarDittoHparams

    def __init__(self, ctx, hp: StarDittoHparams) -> None:
        super().__init__(ctx, hp)
        self.personal_trainer = with_local(self.trainer, epochs=hp.personal_epochs, steps=None)

    def personal_steps(self, client: int) -> int:
        """Lines 6-7: ``personal_epochs`` of the client's batches on its personal model, every round it takes part."""
        return self.personal_trainer.num_steps(client)

    def train_clients(self, r: int, clients) -> Collected:
        got = super().train_clients(r, clients)  # lines 4-5: plain local SGD from w^t (FedAvg's client)
        anchor = self.x.expand(len(clients), -1)  # w^t for every job
        personal = self.personal_trainer.train(
            self.store.rows("personal", clients),
            clients,
            r,
            rule=ProximalRule(self.hp.lam, anchor),
            key=(PERSONAL_KEY,),
        )  # lines 6-7
        self.store.set_rows("personal", clients, personal.params)
        return got

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # line 9
