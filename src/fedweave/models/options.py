"""Validation of model options and input shapes, with errors that name ``model.<option>``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Opt:
    """One model option: its default, a checker that returns the normalised value, and what is allowed."""

    default: Any
    check: Callable[[Any], Any]
    allowed: str


class _Bad(Exception):
    """Raised by a checker; turned into a ValueError naming the option."""


def parse_options(model: str, options: Mapping[str, Any], spec: Mapping[str, Opt]) -> dict[str, Any]:
    """Fill defaults, reject unknown options, and validate every value against ``spec``."""
    unknown = sorted(set(options) - set(spec))
    if unknown:
        allowed = ", ".join(f"model.{k}" for k in sorted(spec)) or "none"
        raise ValueError(f"unknown option model.{unknown[0]} for model {model!r}; allowed options: {allowed}")
    out: dict[str, Any] = {}
    for key, opt in spec.items():
        value = options.get(key, opt.default)
        try:
            out[key] = opt.check(value)
        except _Bad:
            raise ValueError(
                f"model.{key} = {value!r} is not valid for model {model!r}; allowed: {opt.allowed}"
            ) from None
    return out


def _is_int(v: Any) -> bool:
    # NumPy integers count (a dataset's y.max() + 1), booleans do not (True would be 1)
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad
    return v


def pos_int(v: Any) -> int:
    if not _is_int(v) or v < 1:
        raise _Bad
    return int(v)


def number(v: Any) -> float:
    """A finite int or float (a NaN or infinite constant would make every output NaN or saturate a gate)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad
    return float(v)


def choice(*values: Any) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        # the type must match too: 2.0 == 2 and True == 1, but torch refuses a float or bool padding or group
        # count later, in an error that names no option
        if not any(type(v) is type(a) and v == a for a in values):
            raise _Bad
        return v

    return check


def pos_int_list(v: Any) -> tuple[int, ...]:
    """A single positive int or a (possibly empty) sequence of them (lists from YAML/OmegaConf too)."""
    if _is_int(v):
        v = [v]
    if isinstance(v, (str, bytes, Mapping)):
        raise _Bad
    try:
        items = list(v)
    except TypeError:
        raise _Bad from None
    if not all(_is_int(i) and i >= 1 for i in items):
        raise _Bad
    return tuple(int(i) for i in items)


def check_shape(model: str, input_shape: Any, ndim: int | None = None) -> tuple[int, ...]:
    """``input_shape`` as a tuple of positive ints; ``ndim`` fixes its length (3 for (C, H, W) images)."""
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = ()
    if not shape or not all(_is_int(s) and s >= 1 for s in shape):
        raise ValueError(
            f"model {model!r}: input_shape must be a non-empty tuple of positive ints, got {input_shape!r}"
        )
    shape = tuple(int(s) for s in shape)
    if ndim is not None and len(shape) != ndim:
        want = "(channels, height, width)" if ndim == 3 else f"{ndim} dimensions"
        raise ValueError(f"model {model!r}: input_shape must be {want}, got {shape}")
    return shape


def check_classes(model: str, num_classes: Any) -> int:
    if not _is_int(num_classes) or num_classes < 1:
        raise ValueError(f"model {model!r}: num_classes must be a positive int, got {num_classes!r}")
    return int(num_classes)


def conv_out(model: str, size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Output length of a conv/pool along one spatial axis (floor mode), refusing sizes below 1."""
    out = (size + 2 * padding - kernel) // stride + 1
    if out < 1:
        raise ValueError(
            f"model {model!r}: spatial size {size} is too small for kernel {kernel} "
            f"(stride {stride}, padding {padding})"
        )
    return out


def finalize(model: nn.Module) -> nn.Module:
    """Every zoo model is float32 and has no buffers (so a flat parameter vector is the whole state)."""
    model = model.to(torch.float32)
    if any(True for _ in model.buffers()):
        raise AssertionError(f"{type(model).__name__} has buffers; zoo models must be buffer-free")
    return model
