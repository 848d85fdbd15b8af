"""Batched augmentation: shapes, determinism, known answers."""

from __future__ import annotations

import pytest
import torch

from fedweave.data.augment import (
    build_augment,
    client_color_factors,
    client_color_perturbation,
    horizontal_flip,
    normalize,
    random_crop,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


X = torch.rand(16, 3, 8, 8, generator=gen(99))


def test_crop_padding_zero_is_identity():
    assert torch.equal(random_crop(X, 0, gen()), X)


def test_crop_matches_manual_slices():
    pad = 2
    out = random_crop(X, pad, gen(5))
    padded = torch.nn.functional.pad(X, (pad, pad, pad, pad))
    # Recover each sample's offsets by brute force: exactly one window of the padded image matches.
    offsets = set()
    for b in range(len(X)):
        hits = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(out[b], padded[b, :, dy : dy + 8, dx : dx + 8])
        ]
        assert len(hits) == 1
        offsets.add(hits[0])
    assert len(offsets) > 3  # offsets differ per sample


def test_crop_offsets_from_the_generator():
    # random_crop draws dy then dx with torch.randint: replay them and slice by hand.
    pad, size = 3, 5
    out = random_crop(X, pad, gen(7), size=size)
    g = gen(7)
    dy = torch.randint(0, 8 + 2 * pad - size + 1, (len(X),), generator=g)
    dx = torch.randint(0, 8 + 2 * pad - size + 1, (len(X),), generator=g)
    padded = torch.nn.functional.pad(X, (pad, pad, pad, pad))
    for b in range(len(X)):
        assert torch.equal(out[b], padded[b, :, dy[b] : dy[b] + size, dx[b] : dx[b] + size])


def test_crop_fill_per_channel_and_probability():
    x = torch.ones(64, 2, 4, 4)
    out = random_crop(x, 2, gen(), fill=[-1.0, -2.0])
    assert set(out[:, 0].unique().tolist()) <= {1.0, -1.0} and set(out[:, 1].unique().tolist()) <= {1.0, -2.0}
    assert (out[:, 0] == -1).any()
    assert torch.equal(random_crop(x, 2, gen(), p=0.0), x)  # never cropped: the centred window
    half = random_crop(x, 2, gen(), p=0.5)
    moved = (half != 1).flatten(1).any(1).float().mean().item()
    assert 0.2 < moved < 0.8


def test_flip_twice_is_identity_and_flips_the_chosen():
    once = horizontal_flip(X, gen(3))
    flipped = torch.tensor([not torch.equal(once[b], X[b]) for b in range(len(X))])
    assert 0 < flipped.sum() < len(X)
    assert torch.equal(once[flipped], X[flipped].flip(-1))
    assert torch.equal(horizontal_flip(once, gen(3)), X)  # same generator state: same samples flip back
    assert torch.equal(horizontal_flip(X, gen(), p=1.0), X.flip(-1))
    assert torch.equal(horizontal_flip(X, gen(), p=0.0), X)


def test_normalize_known_answer():
    x = torch.ones(2, 3, 2, 2)
    out = normalize(x, [0.5, 0.0, 1.0], [0.5, 2.0, 1.0])
    assert torch.allclose(out[:, 0], torch.tensor(1.0)) and torch.allclose(out[:, 1], torch.tensor(0.5))
    assert torch.allclose(out[:, 2], torch.tensor(0.0))
    with pytest.raises(ValueError, match="2 values but the images have 3 channels"):
        normalize(x, [0.5, 0.5], [1.0, 1.0])
    with pytest.raises(ValueError, match="std must be > 0"):
        normalize(x, 0.0, 0.0)


def test_color_factors_fixed_per_client_and_in_range():
    b, s = client_color_factors(50, gen(1))
    b2, s2 = client_color_factors(50, gen(1))
    assert torch.equal(b, b2) and torch.equal(s, s2) and b.shape == (50,)
    assert float(b.min()) >= 0.7 and float(b.max()) <= 1.3 and float(s.min()) >= 0.7 and float(s.max()) <= 1.3
    assert not torch.equal(b, s)


def test_color_perturbation_known_answers():
    x = torch.tensor([0.2, 0.4, 0.8]).reshape(1, 3, 1, 1).expand(2, 3, 2, 2)
    assert torch.allclose(client_color_perturbation(x, 1.0, 1.0), x)
    gray = 0.299 * 0.2 + 0.587 * 0.4 + 0.114 * 0.8
    assert torch.allclose(client_color_perturbation(x, 1.0, 0.0), torch.full_like(x, gray))
    # brightness 1.5 then saturation 0.5: clamp(1.5 x) = (0.3, 0.6, 1.0), then halfway to its gray
    bright = torch.tensor([0.3, 0.6, 1.0])
    g2 = 0.299 * 0.3 + 0.587 * 0.6 + 0.114 * 1.0
    want = (0.5 * bright + 0.5 * g2).reshape(1, 3, 1, 1).expand_as(x)
    assert torch.allclose(client_color_perturbation(x, 1.5, 0.5), want)
    # per-sample factors (a batch mixing clients) equal per-client calls
    per_sample = client_color_perturbation(x, torch.tensor([1.5, 0.8]), torch.tensor([0.5, 1.2]))
    assert torch.allclose(per_sample[1:], client_color_perturbation(x[1:], 0.8, 1.2))
    # already-normalized input: shift in [0, 1] space, then re-normalize
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    via_norm = client_color_perturbation(normalize(x, mean, std), 1.5, 0.5, mean=mean, std=std)
    assert torch.allclose(via_norm, normalize(want, mean, std), atol=1e-6)


def test_color_perturbation_gray_images_only_brightness():
    x = torch.full((1, 1, 2, 2), 0.5)
    assert torch.allclose(client_color_perturbation(x, 1.2, 0.3), torch.full_like(x, 0.6))
    assert torch.allclose(client_color_perturbation(x, 3.0, 1.0), torch.ones_like(x))  # clamped


def test_build_augment_order_determinism_and_errors():
    aug = build_augment(["crop", "flip", "normalize"], padding=2, mean=0.5, std=0.25)
    a, b = aug(X, gen(11)), aug(X, gen(11))
    assert a.shape == X.shape and torch.equal(a, b)
    assert not torch.equal(a, aug(X, gen(12)))
    g = gen(11)
    manual = normalize(horizontal_flip(random_crop(X, 2, g), g), 0.5, 0.25)
    assert torch.equal(a, manual)
    assert torch.equal(build_augment([])(X, gen()), X)
    with pytest.raises(ValueError, match=r"unknown augmentation 'rotate'; allowed: crop, flip, normalize"):
        build_augment(["crop", "rotate"])
    with pytest.raises(ValueError, match="needs mean and std"):
        build_augment(["normalize"])


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        random_crop(torch.zeros(3, 8, 8), 2, gen())
    with pytest.raises(ValueError, match="does not fit"):
        random_crop(X, 0, gen(), size=9)
