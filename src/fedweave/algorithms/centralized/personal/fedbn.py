"""FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021): the batch-normalization layers stay local.

FedAvg for every parameter but those of the batch-norm layers (Alg. 1: the server averages the weights of
all layers except the BN layers', each client keeps its own BN affine parameters gamma, beta). Running
statistics are not parameters: the zoo's batch-norm model (``cnn_*`` with ``norm: batch``) keeps none
(it normalizes with each batch's statistics), and a model that keeps buffers (running means and variances)
is refused, since the flat parameter vector that the backends train and the server averages does not
carry them. A model without batch-norm layers makes FedBN FedAvg bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from fedweave.algorithms.centralized.personal.base import PartialSharing, name_mask
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@ALGORITHMS.register("fedbn")
class FedBN(PartialSharing):
    name = "fedbn"

    def personal_mask(self) -> torch.Tensor:
        model = self.layout.model
        buffers = [n for n, _ in model.named_buffers()]
        if buffers:
            some = ", ".join(buffers[:3]) + (", ..." if len(buffers) > 3 else "")
            raise ConfigError(
                f"algorithm fedbn: the model keeps buffers ({some}) "
                "that local training does not carry; use batch norm without running statistics "
                "(track_running_stats=False; the cnn models' norm: batch)"
            )
        local = [
            f"{m}.{p}" if m else p
            for m, mod in model.named_modules()
            if isinstance(mod, BATCH_NORMS)
            for p, _ in mod.named_parameters(recurse=False)
        ]
        return name_mask(self.layout, local)
