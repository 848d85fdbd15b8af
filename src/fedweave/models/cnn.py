"""Small two-conv CNNs: conv → ReLU → maxpool(2), twice, then fully connected layers.

All share one class; the registered builders fix the widths from the papers and specs:

| name          | convs (kernel 5)   | padding | fc layers              | source                                   |
|---------------|--------------------|---------|------------------------|------------------------------------------|
| cnn_mnist     | C→32, 32→64        | 0 (opt) | flat→512→K             | FedAvg CNN (McMahan et al. 2017)         |
| cnn_small     | C→16, 16→32        | 0       | flat→64→K              | fast CPU runs (fedmim A12 "a small CNN") |
| cnn_fmnist    | C→16, 16→32        | 2       | flat→K                 | afind-plus §4.3 FMNIST 2-layer CNN       |
| cnn_cifar     | C→32, 32→64        | 0       | flat→512→K             | afind-plus §4.3 CIFAR-10 4-layer CNN     |
| cnn_femnist   | C→32, 32→64        | 2       | flat→2048→K            | afind-plus §4.3 LEAF FEMNIST CNN         |

"flat" is computed from the input shape at build time, so any channel count and spatial size that
survives the two conv+pool stages works. Option ``norm: batch`` puts a BatchNorm2d after each convolution
(FedBN's models) that normalizes with the batch's statistics in training and evaluation alike
(``track_running_stats=False``: the zoo's models keep no buffers, so the flat parameter vector stays the
whole model state); the default ``norm: none`` builds the same layers, and draws the same weights, as
before the option existed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedweave.models.head import HeadedModel
from fedweave.models.options import (
    Opt,
    check_classes,
    check_shape,
    choice,
    conv_out,
    finalize,
    parse_options,
)
from fedweave.registry import MODELS

KERNEL = 5


def _after_stages(model: str, size: int, padding: int) -> int:
    """The length of one spatial axis after conv (stride 1) then maxpool 2×2 stride 2 (floor mode), twice."""
    for _ in range(2):
        size = conv_out(model, conv_out(model, size, KERNEL, 1, padding), 2, 2)
    return size


def _fits(model: str, size: int, padding: int) -> bool:
    try:
        return _after_stages(model, size, padding) >= 1
    except ValueError:
        return False


class TwoConvCNN(HeadedModel):
    """conv1 → ReLU → pool → conv2 → ReLU → pool → flatten → (fc_i → ReLU)* → last fc (logits), computed
    with each ReLU after its pool (the same function)."""

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, int, int],
        channels: tuple[int, int],
        padding: int,
        hidden: tuple[int, ...],
        num_classes: int,
        norm: str = "none",
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, channels[0], KERNEL, padding=padding)
        self.conv2 = nn.Conv2d(channels[0], channels[1], KERNEL, padding=padding)
        if norm == "batch":  # made after the convolutions: their initial weights are drawn as without norm
            self.bn1 = nn.BatchNorm2d(channels[0], track_running_stats=False)
            self.bn2 = nn.BatchNorm2d(channels[1], track_running_stats=False)
        else:
            self.bn1 = self.bn2 = nn.Identity()
        try:
            h, w = _after_stages(model, h, padding), _after_stages(model, w, padding)
        except ValueError:  # name the input and the least size, not the size reached after the first stage
            least = next(n for n in range(1, 100) if _fits(model, n, padding))  # 16 (padding 0), 4 (padding 2)
            raise ValueError(
                f"model {model!r}: input_shape {input_shape} is too small: its two {KERNEL}×{KERNEL} convs "
                f"(padding {padding}), each followed by a 2×2 max-pool, need at least {least}×{least} pixels"
            ) from None
        self.flat_features = channels[1] * h * w
        sizes = (self.flat_features, *hidden, num_classes)
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        last = len(self.fcs) - 1
        self.classifier = (f"fcs.{last}",)
        # The "output layer of the featurizer" (afind-plus A4): the last layer before the classifier; under
        # norm: batch conv2's output passes bn2, whose affine weights end that layer (as ResNet's norm2 does)
        conv2 = ("conv2", "bn2") if norm == "batch" else ("conv2",)
        self.featurizer = (f"fcs.{last - 1}",) if hidden else conv2

    def features(self, x: torch.Tensor) -> torch.Tensor:
        # ReLU after the pool: relu(maxpool(z)) == maxpool(relu(z)) exactly, values and gradients (ReLU is
        # monotone), on a quarter of the elements. MNIST CNN evaluation: 29 vs 50-66 ms per 256 images.
        x = F.relu(F.max_pool2d(self.bn1(self.conv1(x)), 2))
        x = F.relu(F.max_pool2d(self.bn2(self.conv2(x)), 2))
        x = x.reshape(x.shape[0], -1)
        for fc in self.fcs[:-1]:
            x = F.relu(fc(x))
        return x

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fcs[-1](z)


def _builder(name: str, channels: tuple[int, int], padding: int, hidden: tuple[int, ...], doc: str) -> None:
    opts_spec = {
        "norm": Opt("none", choice("none", "batch"), "none, or batch: BatchNorm2d after each conv (batch statistics)")
    }
    if name == "cnn_mnist":
        opts_spec["padding"] = Opt(
            padding,
            choice(0, 2),
            "0 (28×28 → 64·4·4 = 1024 features) or 2 ('same', as in McMahan et al.: 64·7·7 = 3136)",
        )

    def build(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
        shape = check_shape(name, input_shape, ndim=3)
        k = check_classes(name, num_classes)
        opts = parse_options(name, options, opts_spec)
        pad = opts.get("padding", padding)
        cnn = TwoConvCNN(name, shape, channels, pad, hidden, k, norm=opts.get("norm", "none"))  # type: ignore[arg-type]
        return finalize(cnn)

    build.__name__ = f"build_{name}"
    build.__doc__ = doc
    MODELS.register(name)(build)


_builder(
    "cnn_mnist",
    (32, 64),
    0,
    (512,),
    "FedAvg CNN: conv 1-32-5, pool, conv 32-64-5, pool, fc 1024-512, fc 512-K (582,026 params on MNIST).",
)
_builder(
    "cnn_small",
    (16, 32),
    0,
    (64,),
    "Small CNN for fast CPU runs: conv C-16-5, pool, conv 16-32-5, pool, fc 512-64-K (46,730 on MNIST).",
)
_builder(
    "cnn_fmnist",
    (16, 32),
    2,
    (),
    "afind-plus §4.3 FMNIST 2-layer CNN: conv 1-16-5 p2, pool, conv 16-32-5 p2, pool, fc 1568-K (28,938).",
)
_builder(
    "cnn_cifar",
    (32, 64),
    0,
    (512,),
    "afind-plus §4.3 CIFAR-10 4-layer CNN: conv 3-32-5, pool, conv 32-64-5, pool, fc 1600-512-K (878,538).",
)
_builder(
    "cnn_femnist",
    (32, 64),
    2,
    (2048,),
    "afind-plus §4.3 LEAF FEMNIST CNN: conv 1-32-5 p2, pool, conv 32-64-5 p2, pool, fc 3136-2048-K "
    "(6,603,710 for K = 62).",
)
