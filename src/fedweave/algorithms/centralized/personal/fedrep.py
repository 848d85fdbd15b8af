"""FedRep (Collins et al., ICML 2021): a shared representation, a personal head, trained in turn.

Client i, given the global representation ``phi^t`` (Alg. 1):
  (1) ``head_epochs`` epochs of SGD on its head ``h_i`` with the representation frozen (lines 6-8),
  (2) then the local steps (``local.epochs`` / ``local.steps``) on the representation with its new head
      frozen (lines 9-11),
and sends ``phi_i``; the server averages them, ``phi^{t+1} = sum_i p_i phi_i`` (line 14). The head is the
model's ``head_names()``; a model whose head is empty makes FedRep FedAvg bit for bit (no head phase, and
the representation phase is plain local SGD).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.base import with_local
from fedweave.algorithms.centralized.base import StarHparams
from fedweave.algorithms.centralized.personal.base import FreezeRule, PartialSharing, head_names, name_mask
from fedweave.config import MAX_LOCAL_EPOCHS, ConfigError
from fedweave.execution import LocalResult
from fedweave.registry import ALGORITHMS

HEAD_KEY = 1  # the head phase draws its batches from ("batches", round, client, 1)


@dataclass
class FedRepHparams(StarHparams):
    head_epochs: int = 10  # tau_h: the paper's local epochs of the head (Sec. 5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.head_epochs <= MAX_LOCAL_EPOCHS:  # bounded as local.epochs is: 1e300 would never end
            raise ConfigError(f"algorithm.head_epochs must be in [1, {MAX_LOCAL_EPOCHS:,}], got {self.head_epochs:.6g}")


@ALGORITHMS.register("fedrep")
class FedRep(PartialSharing):
    name = "fedrep"
    Hparams = FedRepHparams

    def __init__(self, ctx, hp: FedRepHparams) -> None:
        super().__init__(ctx, hp)
        self.head_trainer = with_local(self.trainer, epochs=hp.head_epochs, steps=None)

    def personal_mask(self) -> torch.Tensor:
        return name_mask(self.layout, head_names(self.layout.model, self.name))

    def personal_steps(self, client: int) -> int:
        """Lines 6-8: ``head_epochs`` of the client's batches on its head before the representation's steps (none
        without a head)."""
        return self.head_trainer.num_steps(client) if self.partial else 0

    def local_train(self, r: int, clients: np.ndarray, starts: torch.Tensor, lr: float) -> LocalResult:
        if not self.partial:  # no head: the representation phase alone, plain local SGD
            return self.trainer.train(starts, clients, r, lr=lr)
        starts = self.trainer.checked_starts(starts, clients)
        # lines 6-8: the head, the representation frozen at phi^t
        heads = self.head_trainer.train(
            starts, clients, r, rule=FreezeRule(self.shared, starts), lr=lr, key=(HEAD_KEY,)
        )
        # lines 9-11: the representation, the new head frozen
        return self.trainer.train(heads.params, clients, r, rule=FreezeRule(self.mask, heads.params), lr=lr)
