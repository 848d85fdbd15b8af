"""FedPer (Arivazhagan et al., 2019): a shared body ("base layers") and a personal head.

Every client trains its whole model with local SGD, starting from the global base layers and from its own
personalization (head) layers (Sec. 3: ``W_B`` shared, ``W_{P_j}`` kept by client j); it sends back only the
base layers, which the server averages as FedAvg does (Alg. 1). The head is the model's ``head_names()``
(``fedweave.models.head``); a model whose head is empty makes FedPer FedAvg bit for bit.
"""

from __future__ import annotations

import torch

from fedweave.algorithms.centralized.personal.base import PartialSharing, head_names, name_mask
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("fedper")
class FedPer(PartialSharing):
    name = "fedper"

    def personal_mask(self) -> torch.Tensor:
        return name_mask(self.layout, head_names(self.layout.model, self.name))  # W_P: the head
