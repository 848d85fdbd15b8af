"""CIFAR-10 / CIFAR-100 from the standard python pickles, read with a restricted unpickler.

A pickle can run any callable it names, so ``pickle.load`` on a downloaded file is code execution.
:class:`RestrictedUnpickler` resolves only the few numpy names that array reconstruction needs; every
other global (``os.system``, ``builtins.eval``, ...) is refused before it is looked up.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from fedweave.data import sources
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import (
    OptionError,
    Root,
    as_tensors,
    head,
    open_maybe_gz,
    opt_bool,
    opt_choice,
    opt_int,
    reject_unknown,
)
from fedweave.registry import DATASETS

try:  # numpy >= 2 moved the core modules; the old names still appear inside pickles
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover  (numpy 1.x)
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]

_ALLOWED: dict[tuple[str, str], Any] = {}
for _mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED[(_mod, "_reconstruct")] = _multiarray._reconstruct  # ndarray.__reduce__ (protocol <= 4)
    _ALLOWED[(_mod, "scalar")] = _multiarray.scalar  # numpy scalars
for _mod in ("numpy.core.numeric", "numpy._core.numeric"):
    _ALLOWED[(_mod, "_frombuffer")] = _numeric._frombuffer  # ndarray.__reduce_ex__ (protocol 5)
_ALLOWED[("numpy", "ndarray")] = np.ndarray
_ALLOWED[("numpy", "dtype")] = np.dtype


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 writes bytes in protocol-2 pickles as _codecs.encode(str, "latin1"); allow that codec only.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"_codecs.encode is only allowed as a latin-1 bytes literal, got codec {encoding!r}")
    return text.encode("latin-1")


_ALLOWED[("_codecs", "encode")] = _latin1_bytes


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle asked for a global that CIFAR files never need."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes, str, numbers and numpy arrays; refuses every other global."""

    def __init__(self, file, *, source: str = "<pickle>", **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self.source}: refusing to load global {module}.{name}. CIFAR pickles contain only dicts, "
                "lists, bytes, numbers and numpy arrays; this file is not a genuine CIFAR batch."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.source}: persistent ids are not allowed")


def restricted_load(path: str | Path) -> Any:
    """Load one pickle file with :class:`RestrictedUnpickler` (``encoding='bytes'`` for Python 2 pickles)."""
    with open_maybe_gz(Path(path), "rb") as f:
        return RestrictedUnpickler(f, source=str(path), encoding="bytes").load()


def _field(batch: Any, key: str, path: Path) -> Any:
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a dict, got {type(batch).__name__}")
    for k in (key.encode(), key):  # Python 2 pickles have bytes keys; re-saved ones may have str keys
        if k in batch:
            return batch[k]
    raise ValueError(f"{path}: no {key!r} entry (keys: {sorted(map(str, batch))})")


def read_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch: uint8 images (N, 3, 32, 32) (rows are channel-major 3x1024) and int64 labels (N,)."""
    batch = restricted_load(path)
    data = np.asarray(_field(batch, "data", path))
    labels = np.asarray(_field(batch, label_key, path), dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise ValueError(
            f"{path}: 'data' is {data.dtype} {data.shape} with {len(labels)} labels; expected uint8 (N, 3072)"
        )
    return data.reshape(-1, 3, 32, 32), labels


# Per-channel mean / std of the training images in [0, 1] (the values FedMIM's spec lists, §4.2).
_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
}


# ``stats: half``: mean 0.5 / std 0.5 per channel, the CSE-FSL authors' Normalize((.5,.5,.5), (.5,.5,.5))
_HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
STATS_CHOICES = ("dataset", "half")


def _finish(
    name: str,
    parts: dict[str, tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    normalize: bool,
    stats: str = "dataset",
) -> Dataset:
    mean, std = (np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in (_HALF if stats == "half" else _STATS[name]))
    out = {}
    for split, (x, y) in parts.items():
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{name}: {split} labels outside 0..{num_classes - 1}")
        xf = x.astype(np.float32)
        if normalize:  # (x / 255 - mean) / std as one in-place affine map per channel
            xf *= 1.0 / (255.0 * std)
            xf -= mean / std
        else:
            xf *= np.float32(1.0 / 255.0)
        out[split] = as_tensors(xf, y)
    return Dataset(name, *out["train"], *out["test"], num_classes=num_classes, input_shape=(3, 32, 32))


def _limits(name: str, normalize, max_train, max_test, stats) -> tuple[bool, int | None, int | None, str]:
    out = (
        opt_bool(name, "normalize", normalize),
        opt_int(name, "max_train", max_train, allow_none=True),
        opt_int(name, "max_test", max_test, allow_none=True),
        opt_choice(name, "stats", stats, STATS_CHOICES),
    )
    if not out[0] and out[3] != "dataset":  # normalize: false keeps [0, 1]: stats would be read by nothing
        raise OptionError(
            f"dataset {name!r}: option 'stats' ({out[3]!r}) is the mean/std of normalize, which is false; "
            "leave stats out or set normalize: true"
        )
    return out


@DATASETS.register("cifar10")
def load_cifar10(
    root: Root = None,
    *,
    normalize: bool = True,
    stats: str = "dataset",
    max_train: int | None = None,
    max_test: int | None = None,
    **unknown,
) -> Dataset:
    """CIFAR-10: 50,000 + 10,000 images, float32 (N, 3, 32, 32), per-channel standardized; 10 classes.

    Reads ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch`` (root= may be that directory or its
    parent). Options: ``normalize``; ``stats`` = ``"dataset"`` (the training set's per-channel mean/std) or
    ``"half"`` (mean 0.5, std 0.5: the CSE-FSL authors' code); ``max_train``, ``max_test`` (first rows).
    """
    reject_unknown("cifar10", unknown, load_cifar10)
    normalize, max_train, max_test, stats = _limits("cifar10", normalize, max_train, max_test, stats)
    files = sources.resolve("cifar10", root).files
    d = "cifar-10-batches-py/"
    train = [read_batch(files[f"{d}data_batch_{i}"], "labels") for i in range(1, 6)]
    x, y = np.concatenate([b[0] for b in train]), np.concatenate([b[1] for b in train])
    tx, ty = read_batch(files[f"{d}test_batch"], "labels")
    parts = {"train": head(x, y, max_train), "test": head(tx, ty, max_test)}
    return _finish("cifar10", parts, 10, normalize, stats)


@DATASETS.register("cifar100")
def load_cifar100(
    root: Root = None,
    *,
    labels: str = "fine",
    normalize: bool = True,
    stats: str = "dataset",
    max_train: int | None = None,
    max_test: int | None = None,
    **unknown,
) -> Dataset:
    """CIFAR-100: 50,000 + 10,000 images, float32 (N, 3, 32, 32), per-channel standardized.

    Reads ``cifar-100-python/train`` and ``test``. Options: ``labels`` = ``"fine"`` (100 classes) or
    ``"coarse"`` (20 superclasses); ``normalize``, ``stats``, ``max_train``, ``max_test`` (as CIFAR-10).
    """
    reject_unknown("cifar100", unknown, load_cifar100)
    labels = opt_choice("cifar100", "labels", labels, ("fine", "coarse"))
    normalize, max_train, max_test, stats = _limits("cifar100", normalize, max_train, max_test, stats)
    files = sources.resolve("cifar100", root).files
    key = f"{labels}_labels"
    x, y = read_batch(files["cifar-100-python/train"], key)
    tx, ty = read_batch(files["cifar-100-python/test"], key)
    parts = {"train": head(x, y, max_train), "test": head(tx, ty, max_test)}
    return _finish("cifar100", parts, 100 if labels == "fine" else 20, normalize, stats)
