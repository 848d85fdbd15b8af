"""Split models for federated split learning: a client-side part, a server-side part, an auxiliary head.

The full model is ``server(client(x))``; the cut-layer output of ``client`` (flattened) is the smashed data.
The auxiliary network maps the smashed data to class logits so that clients can train on a local loss
(CSE-FSL, FSL_AN). Architectures and parameter counts (cse-fsl spec §4.2–4.3, the paper's Tables III/IV):

| name          | input     | client (cut)                                   | q     | client  | server    |
|---------------|-----------|------------------------------------------------|-------|---------|-----------|
| split_cifar   | 3×24×24   | conv5 64, pool, LRN, conv5 64, LRN, pool       | 2304  | 107,328 | 960,970   |
| split_femnist | 1×28×28   | conv3 32, conv3 64, maxpool 2, dropout .25     | 9216  | 18,816  | 1,187,774 |
| split_small   | C×8×8     | conv3 32, pool 2, conv3 32 (digits-mini)       | 512   | 9,568   | 66,954    |
| split_small   | 1×28×28   | the same plus a final pool 2                   | 1568  | 9,568   | 202,122   |

Auxiliary heads (``aux``): ``mlp`` = Linear(q, K) (CIFAR 23,050; F-EMNIST 571,454), ``cnn`` = 1×1 conv to
``aux_channels`` channels, ReLU, Linear (CIFAR 425c+10, F-EMNIST 8993c+62). These are not in ``MODELS``
(their builders return three modules); they live in ``SPLIT_MODELS`` with the signature
``build(input_shape, num_classes, **options) -> SplitModel``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.config import check_options
from fedweave.data.augment import center_crop
from fedweave.registry import Registry

SPLIT_MODELS = Registry("split model")

INIT_STD = 0.05  # the authors' code: every parameter ~ N(0, 0.05²) (spec A28)
# Spec A28: the paper's two models (split_cifar, split_femnist) default to that init ("normal"); "default"
# keeps PyTorch's. split_small is fedweave's own CPU-scale model, not the authors', and keeps PyTorch's init
# by default (the measured reproductions use it; the N(0, 0.05²) choice was tuned for the paper's models).


@dataclass
class SplitModel:
    """The three template modules of a split model and the shape of the cut-layer output."""

    client: nn.Module
    server: nn.Module
    aux: nn.Module
    cut_shape: tuple[int, int, int]  # (C, H, W) of the cut layer; smashed data is its flattening

    @property
    def smashed_floats(self) -> int:
        """q: floats of smashed data per sample."""
        c, h, w = self.cut_shape
        return c * h * w


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _aux(kind: str, aux_channels: int | None, cut: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = cut
    if kind == "mlp" and aux_channels is not None:  # the MLP head has no channels: the value would go unread
        raise ValueError(f"model.aux_channels applies to model.aux: cnn, not mlp (got {aux_channels!r}); leave it out")
    if kind == "mlp":  # Tables III/IV "MLP": one linear layer on the flattened smashed data
        return nn.Sequential(nn.Linear(c * h * w, num_classes))
    if kind == "cnn":  # Tables III/IV "CNN+MLP": 1×1 conv to aux_channels, ReLU (spec §4.3 resolution), linear
        if aux_channels is None or aux_channels < 1:
            raise ValueError(f"model.aux_channels must be a positive integer for aux='cnn', got {aux_channels!r}")
        return nn.Sequential(
            nn.Unflatten(1, cut),
            nn.Conv2d(c, aux_channels, 1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(aux_channels * h * w, num_classes),
        )
    raise ValueError(f"model.aux must be 'mlp' or 'cnn', got {kind!r}")


def _cut_shape(client: nn.Module, input_shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    too_small = f"model {name!r}: input shape {input_shape} is too small for its client layers"
    with torch.no_grad():
        try:
            out = client[:-1](torch.zeros(1, *input_shape))  # every client ends with Flatten
        except RuntimeError as e:  # a conv or pool whose output would be empty (not an allocation failure)
            if "allocate" in str(e):
                raise
            raise ValueError(too_small) from e
    if out.dim() != 4 or min(out.shape[2:]) < 1:
        raise ValueError(too_small)
    return tuple(out.shape[1:])  # type: ignore[return-value]


def _init(parts: tuple[nn.Module, ...], init: str) -> None:
    if init == "normal":
        with torch.no_grad():
            for m in parts:
                for p in m.parameters():
                    p.normal_(0.0, INIT_STD)
    elif init != "default":
        raise ValueError(f"model.init must be 'default' (PyTorch) or 'normal' (N(0, 0.05²)), got {init!r}")


def _finish(
    name: str,
    client: nn.Sequential,
    make_server,
    input_shape: tuple[int, ...],
    num_classes: int,
    aux: str,
    aux_channels: int | None,
    init: str,
) -> SplitModel:
    cut = _cut_shape(client, input_shape, name)
    q = cut[0] * cut[1] * cut[2]
    server = make_server(q)
    head = _aux(aux, aux_channels, cut, num_classes)
    _init((client, server, head), init)
    return SplitModel(client, server, head, cut)


def _check_image(name: str, input_shape: tuple[int, ...], num_classes: int) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"model {name!r} needs image inputs (C, H, W), got input_shape {input_shape}")
    if num_classes < 1:  # outputs: classes, or the columns of a float target
        raise ValueError(f"model {name!r} needs at least one output (num_classes >= 1), got {num_classes}")
    return input_shape  # type: ignore[return-value]


class CenterCrop(nn.Module):
    """A centre crop to ``size`` x ``size`` of inputs that are larger, no-op otherwise: training batches
    arrive already cut to that size by the random ``crop`` augmentation, evaluation images whole (the
    paper's CIFAR pipeline: RandomCrop(24) to train, CenterCrop(24) to test)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.shape[-2:] == (self.size, self.size) else center_crop(x, self.size)


@SPLIT_MODELS.register("split_cifar")
def split_cifar(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    aux: str = "mlp",
    aux_channels: int | None = None,
    init: str = "normal",
    pool: str = "max3",
    crop: int | None = None,
) -> SplitModel:
    """The paper's CIFAR-10 model (TF tutorial CNN), cut after the two conv blocks (spec §4.2, A9).

    ``pool='max3'``: MaxPool 3×3 stride 2 pad 1 as in the authors' code; ``'max2'``: the text's 2×2 pool.
    Both give 64×6×6 on 24×24 crops (q = 2304). ``crop=24``: the model takes 24×24 inputs and its client
    part starts with a centre crop of larger ones (spec §3: train on random 24×24 crops, set ``local.augment:
    [crop, ...]``, ``local.crop_size: 24``, ``local.crop_padding: 0``; test on the centre crop).
    """
    c, h, w = _check_image("split_cifar", tuple(input_shape), num_classes)
    if pool not in ("max3", "max2"):
        raise ValueError(f"model.pool must be 'max3' or 'max2', got {pool!r}")
    if crop is not None and not 0 < crop <= min(h, w):
        raise ValueError(f"model.crop must be between 1 and the image size {min(h, w)}, got {crop}")
    front = [CenterCrop(crop)] if crop is not None else []
    input_shape = (c, crop, crop) if crop is not None else tuple(input_shape)

    def mp() -> nn.Module:
        return nn.MaxPool2d(3, 2, 1) if pool == "max3" else nn.MaxPool2d(2, 2)

    def lrn() -> nn.Module:
        return nn.LocalResponseNorm(4, alpha=0.001 / 9.0, beta=0.75, k=1.0)

    client = nn.Sequential(
        *front,
        nn.Conv2d(c, 64, 5, padding=2), nn.ReLU(), mp(), lrn(),
        nn.Conv2d(64, 64, 5, padding=2), nn.ReLU(), lrn(), mp(),  # LRN before the pool in block 2 (code)
        nn.Flatten(),
    )  # fmt: skip

    def server(q: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(q, 384), nn.ReLU(), nn.Linear(384, 192), nn.ReLU(), nn.Linear(192, num_classes)
        )  # fmt: skip

    return _finish("split_cifar", client, server, tuple(input_shape), num_classes, aux, aux_channels, init)


@SPLIT_MODELS.register("split_femnist")
def split_femnist(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    aux: str = "mlp",
    aux_channels: int | None = None,
    init: str = "normal",
    client_relu: bool = True,
) -> SplitModel:
    """The F-EMNIST CNN of Reddi et al., cut after the pool and dropout (spec §4.2; ``client_relu`` A10)."""
    c, _, _ = _check_image("split_femnist", tuple(input_shape), num_classes)
    act = nn.ReLU if client_relu else nn.Identity
    client = nn.Sequential(
        nn.Conv2d(c, 32, 3), act(), nn.Conv2d(32, 64, 3), act(), nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten()
    )

    def server(q: int) -> nn.Module:
        return nn.Sequential(nn.Linear(q, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes))

    return _finish("split_femnist", client, server, tuple(input_shape), num_classes, aux, aux_channels, init)


@SPLIT_MODELS.register("split_small")
def split_small(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    aux: str = "mlp",
    aux_channels: int | None = None,
    init: str = "default",
    width: int = 32,
    hidden: int = 128,
) -> SplitModel:
    """A small conv client and MLP server for MNIST-sized data and the 8×8 digits (spec §9.3 "digits-mini").

    Client: conv3(C→w) ReLU maxpool2 conv3(w→w) ReLU, plus a second maxpool2 when the map is still
    >= 8 pixels high after the first (28×28 → 32×7×7; its height decides, whatever its width), so the cut
    layer stays large relative to the client model as in the paper's CIFAR model. Server: Linear(q, hidden)
    ReLU Linear(hidden, K).
    """
    c, h, _ = _check_image("split_small", tuple(input_shape), num_classes)
    if width < 1 or hidden < 1:
        raise ValueError(f"model.width and model.hidden must be >= 1, got {width}, {hidden}")
    layers: list[nn.Module] = [
        nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
    ]  # fmt: skip
    if h // 2 >= 8:
        layers.append(nn.MaxPool2d(2))
    client = nn.Sequential(*layers, nn.Flatten())

    def server(q: int) -> nn.Module:
        return nn.Sequential(nn.Linear(q, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    return _finish("split_small", client, server, tuple(input_shape), num_classes, aux, aux_channels, init)


def build_split_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, options: Mapping[str, Any] | None = None
) -> SplitModel:
    """Build split model ``name``; unknown names and options raise errors naming ``model.<key>``."""
    builder, options = split_builder(name, options)
    return builder(tuple(input_shape), num_classes, **options)


def split_builder(name: str, options: Mapping[str, Any] | None = None) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The builder of split model ``name`` and its checked ``options`` (no model built); unknown names and
    options raise errors naming ``model.<key>``."""
    import inspect

    builder = SPLIT_MODELS.get(name) if name in SPLIT_MODELS._items else None
    if builder is None:
        raise ValueError(
            f"model.name {name!r} is not a split model; split algorithms need one of: "
            f"{', '.join(sorted(SPLIT_MODELS._items))}"
        )
    options = dict(options or {})
    allowed = [p for p in inspect.signature(builder).parameters if p not in ("input_shape", "num_classes")]
    for k in options:
        if k not in allowed:
            raise ValueError(f"unknown option model.{k} for split model {name!r}; allowed: {', '.join(allowed)}")
    # the values against the builder's annotations, one line naming the key: a float width or crop would fail in
    # torch without naming it, and a string such as "no" would be taken as true
    return builder, check_options(builder, options, "model", skip=("input_shape", "num_classes"), name=name)
