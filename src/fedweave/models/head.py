"""The representation and the head: the convention every registered classification model follows.

Methods that need more than a model's logits (MOON's contrastive term on the representations of the local,
global and previous models; FedProto's class prototypes; FedRep's and FedBABU's split of the body and the
head) read a model as two functions and one list:

- ``features(x)``: the representation, ``(B, D)``, that the classifier reads;
- ``head(z)``: the classifier, representation to logits ``(B, K)``; ``model(x)`` is ``head(features(x))``,
  bit for bit (the zoo's ``forward`` is that composition);
- ``head_names()``: the names of the head's parameters (those of the modules listed in ``classifier``), so
  that a method can keep the head personal or train it alone in a flat parameter vector.

Every registered model of the zoo subclasses :class:`HeadedModel`; a model passed from Python follows the
convention by defining the same three methods (:class:`HasHead`), and a registered model without a
classification head (a regression model, say) declares ``no_head = "why"`` instead. ``tests/test_models.py``
checks every registered model.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fedweave.models.build import layer_parameter_names


@runtime_checkable
class HasHead(Protocol):
    """A model that exposes its representation and its head (the convention above)."""

    def features(self, x: torch.Tensor) -> torch.Tensor: ...

    def head(self, z: torch.Tensor) -> torch.Tensor: ...

    def head_names(self) -> list[str]: ...


class HeadedModel(nn.Module):
    """Base of the zoo's classification models: ``forward(x) = head(features(x))``. A subclass writes
    ``features`` and ``head`` and names the head's modules in ``classifier``."""

    classifier: tuple[str, ...] = ()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The representation ``(B, D)`` of a batch, what the head reads."""
        raise NotImplementedError

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """The logits ``(B, K)`` of representations ``z``."""
        raise NotImplementedError

    def head_names(self) -> list[str]:
        """The names of the head's parameters (in ``named_parameters`` order)."""
        return layer_parameter_names(self, "classifier")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def has_head(model: nn.Module) -> bool:
    """True when ``model`` follows the convention (``features``, ``head``, ``head_names``) and does not
    declare ``no_head``."""
    return isinstance(model, HasHead) and not getattr(model, "no_head", None)
