"""LG-FedAvg (Liang et al., 2020): local representations, a global head.

Each client keeps its own representation layers (the local part ``theta^l_m``, Alg. 1) and shares the top
layers ``theta^g`` (the model's ``head_names()``): it trains its whole model from its own representation
and the global head, sends back the head, and the server averages the heads (Alg. 1's global update,
FedAvg on ``theta^g``). The opposite split of FedPer's.
"""

from __future__ import annotations

import torch

from fedweave.algorithms.centralized.personal.base import PartialSharing, head_names, name_mask
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("lg_fedavg")
class LGFedAvg(PartialSharing):
    name = "lg_fedavg"

    def personal_mask(self) -> torch.Tensor:
        return ~name_mask(self.layout, head_names(self.layout.model, self.name))  # theta^l: all but the head
