"""Build a registered model by name, count its parameters, and find its named layer groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from fedweave.registry import MODELS


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    generator: torch.Generator | None = None,
    **options: Any,
) -> nn.Module:
    """Build model ``name`` for inputs of shape ``(B, *input_shape)`` and ``num_classes`` logits.

    Initialisation draws from torch's global RNG (seed it with ``torch.manual_seed``), or, when
    ``generator`` is given, from a seed drawn from that generator without touching the global RNG.
    Unknown names raise with the allowed names; bad options raise ``ValueError`` naming ``model.<option>``.
    """
    builder = MODELS.get(name)
    shape = tuple(input_shape)
    if generator is None:
        return builder(shape, num_classes, **options)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(shape, num_classes, **options)


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters (every zoo parameter is trainable)."""
    return sum(p.numel() for p in model.parameters())


def layer_parameter_names(model: nn.Module, role: Literal["featurizer", "classifier"]) -> list[str]:
    """Names of the parameters of the model's ``featurizer`` output layer or its ``classifier``.

    The featurizer layer is the last parameterised layer before the classifier; AFIND+ computes its
    gradient as the "feature proxy" ϕ (afind-plus §2.3, A4).
    """
    if role not in ("featurizer", "classifier"):
        raise ValueError(f"role must be 'featurizer' or 'classifier', got {role!r}")
    prefixes = getattr(model, role, None)
    if not prefixes:
        raise ValueError(f"{type(model).__name__} does not declare its {role} layer")
    return [n for n, _ in model.named_parameters() if any(n.startswith(p + ".") for p in prefixes)]
