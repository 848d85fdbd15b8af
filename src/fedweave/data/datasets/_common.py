"""Shared pieces of the loaders: option checks that name the option, deterministic splits, scaling."""

from __future__ import annotations

import difflib
import gzip
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedweave.seeding import Seeds

#: A loader's ``root`` (a directory): its annotation, so that the config names ``dataset.root`` when it is given
#: another type (5 ended in Path's "expected str, bytes or os.PathLike object, not int", naming no key).
Root = str | os.PathLike | None


class OptionError(ValueError):
    """A dataset option has an unknown name or a bad value."""


def reject_unknown(dataset: str, unknown: Mapping[str, Any], loader: Callable[..., Any]) -> None:
    """Raise for options the loader does not take, listing the ones it does."""
    if not unknown:
        return
    allowed = [p for p in inspect.signature(loader).parameters if p not in ("unknown",)]
    bad = sorted(unknown)
    close = difflib.get_close_matches(bad[0], allowed, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise OptionError(
        f"dataset {dataset!r}: unknown option(s) {', '.join(map(repr, bad))}.{hint} Allowed: {', '.join(allowed)}"
    )


def reads_user_files(loader: Callable[..., Any] | None = None, *, when: Callable[..., bool] | None = None) -> Any:
    """Mark a built-in loader whose data come from the user's own files (not from a verified download): the run
    checks what it loaded as it checks a plug-in's data (samples in each split, finite numbers, labels within
    the classes), and a checkpoint records a SHA-256 of it, so that a resume after the files changed is refused.
    ``@reads_user_files(when=f)``: only when ``f(**options)`` holds (Shakespeare's LEAF JSON, not its plays)."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.reads_user_files = True if when is None else when  # type: ignore[attr-defined]
        return fn

    return mark if loader is None else mark(loader)


def loads_user_files(loader: Callable[..., Any], options: Mapping[str, Any] | None = None) -> bool:
    """A plug-in's loader (registered from outside fedweave), or a built-in one marked :func:`reads_user_files`
    (with ``when``: for these ``options``; without options, whether it may)."""
    if not getattr(loader, "__module__", "").startswith("fedweave."):
        return True
    mark = getattr(loader, "reads_user_files", False)
    if callable(mark):
        return True if options is None else bool(mark(**options))
    return bool(mark)


def set_options(loader: Callable[..., Any], **values: Any) -> list[str]:
    """The names among ``values`` given other than ``loader``'s default for them: options that a branch of the
    loader reads by nothing are refused when set (the defaults are read from its signature, not copied)."""
    params = inspect.signature(loader).parameters
    return [k for k, v in values.items() if v != params[k].default]


def opt_int(dataset: str, option: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        none = " or None" if allow_none else ""
        raise OptionError(
            f"dataset {dataset!r}: option {option!r} must be an integer >= {minimum}{none}, got {value!r}"
        )
    return int(value)


def opt_float(
    dataset: str,
    option: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = np.isfinite(v)
        if low is not None:
            ok = ok and (v > low if low_open else v >= low)
        if high is not None:
            ok = ok and (v < high if high_open else v <= high)
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        rng = f" in {lo or '(-inf'}, {hi or 'inf)'}"
        raise OptionError(f"dataset {dataset!r}: option {option!r} must be a number{rng}, got {value!r}")
    return float(value)


def opt_bool(dataset: str, option: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise OptionError(f"dataset {dataset!r}: option {option!r} must be true or false, got {value!r}")
    return bool(value)


def opt_choice(dataset: str, option: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise OptionError(
            f"dataset {dataset!r}: option {option!r} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        )
    return str(value)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/test indices: within each class, ``round(test_fraction * n_c)`` go to test.

    Depends only on the labels and ``seed`` (named stream ``"split"``), so every run sees the same split. A
    fraction that leaves either split empty is a ValueError naming ``dataset.test_fraction``.
    """
    rng = Seeds(seed).numpy("split")
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    train_idx, test_idx = np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
    for split, idx in (("test", test_idx), ("training", train_idx)):
        if not len(idx):  # an empty test split scored accuracy 0.0 and loss 0.0 every round, without a word
            raise ValueError(
                f"dataset.test_fraction {test_fraction:g} of the {len(y):,} samples leaves the {split} split empty "
                "(each class's share is rounded to whole samples); give a fraction that leaves both splits samples"
            )
    return train_idx, test_idx


def standardize(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale each feature to zero mean and unit variance with the TRAIN statistics (constant features: 0)."""
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)
    return ((train - mean) / std).astype(np.float32), ((test - mean) / std).astype(np.float32)


def head(x: np.ndarray, y: np.ndarray, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` rows (file order); a speed option, not a sampling scheme."""
    return (x, y) if n is None else (x[:n], y[:n])


def as_tensors(x: np.ndarray, y: np.ndarray, x_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.as_tensor(np.ascontiguousarray(x)).to(x_dtype), torch.as_tensor(np.asarray(y, dtype=np.int64))


def open_maybe_gz(path: Path, mode: str = "rb"):
    """Open a file that may be gzipped (``.gz`` suffix), in binary or text (``"rt"``) mode."""
    text = {"encoding": "utf-8", "newline": ""} if "t" in mode else {}
    if Path(path).suffix == ".gz":
        return gzip.open(path, mode, **text)
    return open(path, mode, **text)
