"""ResNet-18 with GroupNorm in place of every BatchNorm (fedmim §4.4, afind-plus §4.3).

GroupNorm keeps no running statistics, so the flat parameter vector is the whole model state: averaging it
is a complete aggregation (fedmim §4.4) and the model works under ``functional_call``/``vmap``.

Two stems:
- ``resnet18_gn``: torchvision's stem (conv 7×7 s2 p3 → GN → ReLU → maxpool 3×3 s2 p1), GroupNorm(2)
  everywhere and fc → K, as the FedMIM group's FL-Simulator builds it (fedmim §4.4, A12). 11,181,642
  parameters for K = 10.
- ``resnet18_gn_cifarstem``: conv 3×3 s1 p1 → GN → ReLU, no max-pool (the CIFAR variant; afind-plus §4.3
  uses it with GroupNorm(32) on CIFAR-100). 11,173,962 parameters for K = 10.
Both end in global average pooling and Linear(512 → K); for 32×32 inputs with the CIFAR stem the last
feature map is 4×4, so this equals afind-plus's "avg-pool 4".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedweave.models.head import HeadedModel
from fedweave.models.options import Opt, check_classes, check_shape, choice, finalize, parse_options
from fedweave.registry import MODELS

WIDTHS = (64, 128, 256, 512)
GROUP_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # must divide every width (64 … 512)


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """conv3×3 → GN → ReLU → conv3×3 → GN, plus the (projected) input, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = _conv3x3(cout, cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.GroupNorm(groups, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)  # out-of-place: no in-place ops under vmap


class ResNet18GN(HeadedModel):
    classifier = ("fc",)
    # afind-plus §4.3: ϕ = layer4[-1] (its conv2 + GroupNorm affine).
    featurizer = ("layer4.1.conv2", "layer4.1.norm2")

    def __init__(self, in_channels: int, num_classes: int, groups: int, stem: str) -> None:
        super().__init__()
        self.stem_kind = stem
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = _conv3x3(in_channels, 64)
        self.norm1 = nn.GroupNorm(groups, 64)
        cin = 64
        for i, cout in enumerate(WIDTHS, start=1):
            stride = 1 if i == 1 else 2
            layer = nn.Sequential(BasicBlock(cin, cout, stride, groups), BasicBlock(cout, cout, 1, groups))
            self.add_module(f"layer{i}", layer)
            cin = cout
        self.fc = nn.Linear(512, num_classes)
        # torchvision's init, which FL-Simulator inherits: He-normal (fan_out) convs, unit/zero GN affine.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        if self.stem_kind == "imagenet":  # fixed at build time, not data-dependent
            x = F.max_pool2d(x, 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return x.mean(dim=(-2, -1))  # global average pooling

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


def _register(name: str, default_stem: str, doc: str) -> None:
    spec = {
        "groups": Opt(2, choice(*GROUP_CHOICES), f"one of {list(GROUP_CHOICES)} (divides 64)"),
        "stem": Opt(
            default_stem,
            choice("imagenet", "cifar"),
            "'imagenet' (7×7 s2 conv + max-pool, torchvision) or 'cifar' (3×3 s1 conv, no max-pool)",
        ),
    }

    def build(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
        shape = check_shape(name, input_shape, ndim=3)
        k = check_classes(name, num_classes)
        opts = parse_options(name, options, spec)
        return finalize(ResNet18GN(shape[0], k, opts["groups"], opts["stem"]))

    build.__name__ = f"build_{name}"
    build.__doc__ = doc
    MODELS.register(name)(build)


_register(
    "resnet18_gn",
    "imagenet",
    "ResNet-18-GN as in fedmim §4.4: torchvision stem, GroupNorm(groups=2), fc → K.",
)
_register(
    "resnet18_gn_cifarstem",
    "cifar",
    "ResNet-18-GN with the CIFAR stem (3×3 s1, no max-pool); afind-plus §4.3 uses groups=32.",
)
