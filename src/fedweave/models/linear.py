"""Softmax (multinomial logistic) regression and the multilayer perceptron."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedweave.models.head import HeadedModel
from fedweave.models.options import (
    Opt,
    boolean,
    check_classes,
    check_shape,
    choice,
    finalize,
    parse_options,
    pos_int_list,
)
from fedweave.registry import MODELS


class Logistic(HeadedModel):
    """Flatten, then one Linear layer to the logits.

    ZO-HFL's x ∈ R^{n×C} (spec zo-hfl §4.3) is ``fc.weight`` transposed; with ``bias=False`` the model
    has exactly n·C parameters.
    """

    classifier = ("fc",)
    featurizer = ("fc",)  # no hidden layer: the only layer plays both roles

    def __init__(self, in_features: int, num_classes: int, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes, bias=bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)  # no hidden layer: the representation is the flattened input

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


class MLP(HeadedModel):
    """Flatten, then Linear + ReLU for each hidden size, then Linear to the logits."""

    classifier = ("out",)

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int, bias: bool) -> None:
        super().__init__()
        sizes = (in_features, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:]))
        self.out = nn.Linear(sizes[-1], num_classes, bias=bias)
        # AFIND+ §9.1: the proxy layer ϕ is the (last) hidden layer.
        self.featurizer = (f"hidden.{len(hidden) - 1}",) if hidden else ("out",)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], -1)
        for layer in self.hidden:
            h = F.relu(layer(h))
        return h

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(z)


def _normal_fan_in_(layer: nn.Linear, gain: float) -> None:
    # W ~ N(0, gain / fan_in), zero bias (fedmim §9.2: gain 2 for hidden layers, 1 for the output layer).
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(gain / layer.in_features))
        if layer.bias is not None:
            layer.bias.zero_()


_LOGISTIC_OPTS = {
    "bias": Opt(True, boolean, "true or false"),
    "init": Opt("torch", choice("torch", "zeros"), "'torch' (PyTorch default) or 'zeros' (zo-hfl x̂_0 = 0)"),
}


@MODELS.register("logistic")
def build_logistic(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    """Softmax regression on the flattened input; options ``bias`` (default true) and ``init``."""
    shape = check_shape("logistic", input_shape)
    num_classes = check_classes("logistic", num_classes)
    opts = parse_options("logistic", options, _LOGISTIC_OPTS)
    model = Logistic(math.prod(shape), num_classes, opts["bias"])
    if opts["init"] == "zeros":
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return finalize(model)


_MLP_OPTS = {
    "hidden": Opt((64,), pos_int_list, "a positive int or a list of positive ints, e.g. [64] or [256, 128]"),
    "bias": Opt(True, boolean, "true or false"),
    "init": Opt(
        "torch",
        choice("torch", "normal_fan_in"),
        "'torch' (PyTorch default) or 'normal_fan_in' (W ~ N(0, 2/fan_in) for hidden layers, "
        "N(0, 1/fan_in) for the output layer, zero biases; fedmim §9.2)",
    ),
}


@MODELS.register("mlp")
def build_mlp(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    """ReLU MLP on the flattened input; options ``hidden`` (default [64]), ``bias``, ``init``."""
    shape = check_shape("mlp", input_shape)
    num_classes = check_classes("mlp", num_classes)
    opts = parse_options("mlp", options, _MLP_OPTS)
    model = MLP(math.prod(shape), opts["hidden"], num_classes, opts["bias"])
    if opts["init"] == "normal_fan_in":
        for layer in model.hidden:
            _normal_fan_in_(layer, 2.0)
        _normal_fan_in_(model.out, 1.0)
    return finalize(model)
