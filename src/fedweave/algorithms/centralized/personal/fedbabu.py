"""FedBABU (Oh, Kim, Yun, ICLR 2022): federated training of the body only, the head fixed at its random start;
personalization by fine-tuning at evaluation.

During federated training (Alg. 1) the clients update only the body: the head (the model's ``head_names()``)
keeps its random initialization for the whole run, the same on every client, so the clients send, and the
server averages as FedAvg does, the body alone. A client's personalized model is the global model fine-tuned
on its own training data for ``finetune_epochs`` (tau, 5) epochs of local SGD (its own batches), the whole model
(``finetune: full``, the paper's default) or the head only (``finetune: head``), made at evaluation on a copy.
The global model's metrics (``test_accuracy``, with the untrained head) are FedBABU's "global" numbers, the
fine-tuned models' (``test_accuracy_personal``) its personalized ones. A model whose head is empty makes FedBABU's
training FedAvg's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.base import with_local
from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.algorithms.centralized.personal.base import (
    FreezeRule,
    PersonalStar,
    head_names,
    name_mask,
    warn_if_nothing_shared,
)
from fedweave.config import MAX_LOCAL_EPOCHS, ConfigError
from fedweave.execution.local import PLAIN, LocalRule
from fedweave.registry import ALGORITHMS

FINETUNE_KEY = 1  # the evaluation's fine-tuning draws its batches from ("batches", round, client, 1)


@dataclass
class FedBABUHparams(StarHparams):
    finetune_epochs: int = 5  # tau: the fine-tuning epochs of the personalized evaluation
    finetune: Literal["full", "head"] = "full"  # what the fine-tuning updates

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.finetune_epochs <= MAX_LOCAL_EPOCHS:  # bounded as local.epochs is: 1e300 would never end
            raise ConfigError(
                f"algorithm.finetune_epochs must be in [1, {MAX_LOCAL_EPOCHS:,}], got {self.finetune_epochs:.6g}"
            )


@ALGORITHMS.register("fedbabu")
class FedBABU(PersonalStar):
    name = "fedbabu"
    Hparams = FedBABUHparams
    keeps_personal = False  # the personalized models are fine-tuned from the global one when evaluated
    undeployable = "its evaluation fine-tunes the global model on every client's data in the simulation"
    compresses_uploads = False  # the compression stage encodes whole models, not the body

    def __init__(self, ctx, hp: FedBABUHparams) -> None:
        super().__init__(ctx, hp)
        self.head = name_mask(self.layout, head_names(self.layout.model, self.name))  # fixed at its start
        self.body = ~self.head
        warn_if_nothing_shared(
            self.head, self.name, self.layout.model, "nothing trains in the rounds: each client fine-tunes the start"
        )
        self.tuner = with_local(self.trainer, epochs=hp.finetune_epochs, steps=None)

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return {"model": (self.x[self.body],)}  # the body: every client holds the same fixed head

    def client_rule(self, lr: float) -> LocalRule:
        return FreezeRule(self.head, self.x)  # body update: the head stays at its random start

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        got = StarAlgorithm.train_clients(self, r, clients)
        got.upload = {"body": got.local.params[:, self.body]}  # what the ledger counts: the body alone
        return got

    def unsent(self) -> torch.Tensor:
        return self.head  # the clients send the body alone

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # FedAvg on the body; the head's mean update is exactly 0

    def personal_models(self, r: int) -> torch.Tensor:
        """The global model fine-tuned on each client's data (on a copy): all of it, or the head alone."""
        rule = PLAIN if self.hp.finetune == "full" else FreezeRule(self.body, self.x)
        clients = range(self.ctx.num_clients)
        return self.tuner.train(self.x, clients, r, rule=rule, key=(FINETUNE_KEY,)).params
