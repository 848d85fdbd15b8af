"""Batched image augmentation on tensors ``(B, C, H, W)``, without torchvision.

Every random choice comes from the ``torch.Generator`` passed in, so a batch is augmented identically on
every execution backend given the same named stream. Nothing loops over samples in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedweave.registry import AUGMENTATIONS

if TYPE_CHECKING:
    from fedweave.config import LocalConfig

# ITU-R BT.601 luma weights, as PIL's convert("L"), which torchvision's ColorJitter uses on PIL images
# (torchvision's tensor rgb_to_grayscale has 0.2989 for red instead).
_LUMA = (0.299, 0.587, 0.114)


def _check_images(x: Tensor, what: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{what} expects images of shape (B, C, H, W), got {tuple(x.shape)}")


def _channel_vector(v: float | Sequence[float] | Tensor, x: Tensor, what: str) -> Tensor:
    """A per-channel value broadcastable against (B, C, H, W)."""
    t = torch.as_tensor(v, dtype=x.dtype, device=x.device).reshape(-1)
    if t.numel() not in (1, x.shape[1]):
        raise ValueError(f"{what} has {t.numel()} values but the images have {x.shape[1]} channels")
    return t.reshape(1, -1, 1, 1)


def _sample_vector(v: float | Tensor, x: Tensor, what: str) -> Tensor:
    """A scalar or per-sample value broadcastable against (B, C, H, W)."""
    t = torch.as_tensor(v, dtype=x.dtype, device=x.device).reshape(-1)
    if t.numel() not in (1, x.shape[0]):
        raise ValueError(f"{what} has {t.numel()} values for a batch of {x.shape[0]} images")
    return t.reshape(-1, 1, 1, 1)


def random_crop(
    x: Tensor,
    padding: int,
    g: torch.Generator,
    *,
    size: int | tuple[int, int] | None = None,
    p: float = 1.0,
    fill: float | Sequence[float] | Tensor = 0.0,
) -> Tensor:
    """RandomCrop(size, padding): pad each side with ``fill``, then cut a window at a random offset.

    ``size`` defaults to the input size. With probability 1 - ``p`` a sample keeps the centred window
    (FL-Sim crops with p = 0.5; torchvision's RandomCrop is p = 1). ``fill`` may be per channel: on
    already-normalized images, pass -mean/std to pad with black as torchvision does before normalizing.
    """
    _check_images(x, "random_crop")
    if padding < 0:
        raise ValueError(f"crop padding must be >= 0, got {padding}")
    b, c, h, w = x.shape
    oh, ow = (h, w) if size is None else ((size, size) if isinstance(size, int) else tuple(size))
    hp, wp = h + 2 * padding, w + 2 * padding
    if not (0 < oh <= hp and 0 < ow <= wp):
        raise ValueError(f"crop size {(oh, ow)} does not fit in the padded image {(hp, wp)}")
    padded = x.new_empty(b, c, hp, wp)
    padded[:] = _channel_vector(fill, x, "crop fill")
    padded[:, :, padding : padding + h, padding : padding + w] = x
    dy = torch.randint(0, hp - oh + 1, (b,), generator=g)
    dx = torch.randint(0, wp - ow + 1, (b,), generator=g)
    if p < 1.0:
        keep = torch.rand(b, generator=g) >= p
        dy = torch.where(keep, (hp - oh) // 2, dy)
        dx = torch.where(keep, (wp - ow) // 2, dx)
    # One gather on the flattened images: index of (b, ch, r, col) = ch*hp*wp + (dy_b + r)*wp + dx_b + col.
    dev = x.device
    window = torch.arange(oh, device=dev)[:, None] * wp + torch.arange(ow, device=dev)  # (oh, ow)
    idx = (dy * wp + dx).to(dev)[:, None, None, None] + window + (torch.arange(c, device=dev) * hp * wp)[:, None, None]
    return padded.reshape(b, -1).gather(1, idx.reshape(b, -1)).reshape(b, c, oh, ow)


def center_crop(x: Tensor, size: int) -> Tensor:
    """CenterCrop(size) of a batch (B, C, H, W), at torchvision's offsets ``round((H - size) / 2)``."""
    _check_images(x, "center_crop")
    h, w = x.shape[-2:]
    if not (0 < size <= h and size <= w):
        raise ValueError(f"center crop size {size} does not fit in images of {h}x{w}")
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[..., top : top + size, left : left + size]


def horizontal_flip(x: Tensor, g: torch.Generator, p: float = 0.5) -> Tensor:
    """Mirror each image left-right with probability ``p``."""
    _check_images(x, "horizontal_flip")
    flip = (torch.rand(x.shape[0], generator=g) < p).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def normalize(x: Tensor, mean: float | Sequence[float] | Tensor, std: float | Sequence[float] | Tensor) -> Tensor:
    """(x - mean) / std per channel."""
    _check_images(x, "normalize")
    s = _channel_vector(std, x, "normalize std")
    if bool((s <= 0).any()):
        raise ValueError(f"normalize std must be > 0, got {std}")
    return (x - _channel_vector(mean, x, "normalize mean")) / s


def client_color_factors(
    num_clients: int, g: torch.Generator, low: float = 0.7, high: float = 1.3
) -> tuple[Tensor, Tensor]:
    """Per-client brightness b_i and saturation s_i ~ U[low, high], drawn once (fedmim spec 4.2, A13).

    These are the client's fixed factors for the whole run, not per batch: the shift is "strongly
    correlated to the local clients".
    """
    if not 0 <= low <= high:
        raise ValueError(f"color perturbation range must satisfy 0 <= low <= high, got [{low}, {high}]")
    u = torch.rand(2, num_clients, generator=g, dtype=torch.float64)
    b, s = (low + (high - low) * u).float()
    return b, s


def client_color_perturbation(
    x: Tensor,
    brightness: float | Tensor,
    saturation: float | Tensor,
    *,
    mean: float | Sequence[float] | Tensor | None = None,
    std: float | Sequence[float] | Tensor | None = None,
) -> Tensor:
    """FedMIM's client colour shift (fedmim spec 4.2): in [0, 1] space,
    img <- clamp(b * img), then img <- clamp(s * img + (1 - s) * gray(img)).

    ``brightness``/``saturation`` are the client's fixed factors (scalars), or one per sample when a batch
    mixes clients. Apply to training images only, before normalization; if ``x`` is already normalized,
    pass its ``mean``/``std`` and the shift is applied in [0, 1] space and the result re-normalized.
    Deterministic: apply it once to a client's data, or on every batch, with the same result.
    Single-channel images have no saturation (gray(img) = img).
    """
    _check_images(x, "client_color_perturbation")
    if (mean is None) != (std is None):
        raise ValueError("client_color_perturbation needs both mean and std, or neither")
    img = x if mean is None else x * _channel_vector(std, x, "std") + _channel_vector(mean, x, "mean")
    img = (_sample_vector(brightness, x, "brightness") * img).clamp(0.0, 1.0)
    if img.shape[1] == 3:
        luma = torch.tensor(_LUMA, dtype=img.dtype, device=img.device).reshape(1, 3, 1, 1)
        gray = (img * luma).sum(dim=1, keepdim=True)
        s = _sample_vector(saturation, x, "saturation")
        img = (s * img + (1 - s) * gray).clamp(0.0, 1.0)
    elif img.shape[1] != 1:
        raise ValueError(f"client_color_perturbation expects 1 or 3 channels, got {img.shape[1]}")
    return img if mean is None else normalize(img, mean, std)


# The steps of ``local.augment``, registered by name: each builds its step from build_augment's options.
@AUGMENTATIONS.register("crop")
def _crop(*, padding, crop_size, crop_p, fill, **_) -> Callable[[Tensor, torch.Generator], Tensor]:
    return lambda x, g: random_crop(x, padding, g, size=crop_size, p=crop_p, fill=fill)


@AUGMENTATIONS.register("flip")
def _flip(*, flip_p, **_) -> Callable[[Tensor, torch.Generator], Tensor]:
    return lambda x, g: horizontal_flip(x, g, p=flip_p)


@AUGMENTATIONS.register("normalize")
def _normalize(*, mean, std, **_) -> Callable[[Tensor, torch.Generator], Tensor]:
    if mean is None or std is None:
        raise ValueError("augmentation 'normalize' needs mean and std")
    return lambda x, g: normalize(x, mean, std)


def build_augment(
    names: Sequence[str],
    *,
    padding: int = 4,
    crop_size: int | tuple[int, int] | None = None,
    crop_p: float = 1.0,
    fill: float | Sequence[float] | Tensor = 0.0,
    flip_p: float = 0.5,
    mean: float | Sequence[float] | Tensor | None = None,
    std: float | Sequence[float] | Tensor | None = None,
) -> Callable[[Tensor, torch.Generator], Tensor]:
    """Compose augmentations named in the config, applied in the order given.

    ``crop``: random_crop(padding, crop_size, crop_p, fill); ``flip``: horizontal_flip(flip_p);
    ``normalize``: normalize(mean, std). The client colour shift is not here: it is a fixed per-client
    transform (see client_color_perturbation), not a random per-batch one.
    """
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in AUGMENTATIONS]
    if unknown:
        raise ValueError(f"unknown augmentation {unknown[0]!r}; allowed: {', '.join(AUGMENTATIONS.names())}")
    options = {"padding": padding, "crop_size": crop_size, "crop_p": crop_p, "fill": fill, "flip_p": flip_p,
               "mean": mean, "std": std}  # fmt: skip
    steps = [AUGMENTATIONS.get(n)(**options) for n in names]

    def augment(x: Tensor, g: torch.Generator) -> Tensor:
        for step in steps:
            x = step(x, g)
        return x

    return augment


def augment_for(local: LocalConfig) -> Callable[[Tensor, torch.Generator], Tensor] | None:
    """The training augmentation of a run's ``local`` config section (``augment``, ``crop_size``,
    ``crop_padding``), or None without one."""
    if not local.augment:
        return None
    return build_augment(list(local.augment), padding=local.crop_padding, crop_size=local.crop_size)
