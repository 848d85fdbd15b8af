"""MNIST and Fashion-MNIST from IDX files (raw or ``.gz``), parsed with ``numpy.frombuffer``."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from fedweave.data import sources
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import Root, as_tensors, head, opt_bool, opt_int, reject_unknown
from fedweave.registry import DATASETS

# IDX type byte -> numpy dtype (big-endian, as the format defines).
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

# Mean and std of the training pixels scaled to [0, 1].
_STATS = {"mnist": (0.1307, 0.3081), "fashion_mnist": (0.2860, 0.3530)}

_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


class IDXFormatError(ValueError):
    """An IDX file's header or size is inconsistent."""


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file: 2 zero bytes, a type byte, a rank byte, rank big-endian uint32 sizes, the data."""
    path = Path(path)
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise IDXFormatError(f"{path}: not an IDX file (magic bytes {data[:4].hex() or 'missing'})")
    ndim = data[3]
    start = 4 + 4 * ndim
    if len(data) < start:
        raise IDXFormatError(f"{path}: header is truncated")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", ndim, 4))
    dtype = np.dtype(_IDX_TYPES[data[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(data) - start != expected:
        raise IDXFormatError(
            f"{path}: header says {dims} ({expected} data bytes) but the file has {len(data) - start}; "
            "the file is truncated or altered"
        )
    return np.frombuffer(data, dtype, offset=start).reshape(dims)


def _load_idx(name: str, root, normalize, max_train, max_test) -> Dataset:
    normalize = opt_bool(name, "normalize", normalize)
    max_train = opt_int(name, "max_train", max_train, allow_none=True)
    max_test = opt_int(name, "max_test", max_test, allow_none=True)
    files = sources.resolve(name, root).files
    arrays = {k: read_idx(files[rel]) for k, rel in _FILES.items()}
    out = {}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or x.shape[1:] != (28, 28) or y.ndim != 1 or len(x) != len(y):
            raise IDXFormatError(
                f"{name}: {split} images have shape {x.shape} and labels {y.shape}; expected (N, 28, 28) and (N,)"
            )
        if y.size and (y.min() < 0 or y.max() > 9):
            raise IDXFormatError(f"{name}: {split} labels outside 0..9")
        x, y = head(x, y, max_train if split == "train" else max_test)
        # One affine map in place: (x / 255 - mean) / std, without full-size temporaries.
        mean, std = _STATS[name] if normalize else (0.0, 1.0)
        xf = x.astype(np.float32)
        xf *= np.float32(1.0 / (255.0 * std))
        xf -= np.float32(mean / std)
        out[split] = as_tensors(xf[:, None], y)
    return Dataset(name, *out["train"], *out["test"], num_classes=10, input_shape=(1, 28, 28))


@DATASETS.register("mnist")
def load_mnist(
    root: Root = None, *, normalize: bool = True, max_train: int | None = None, max_test: int | None = None, **unknown
) -> Dataset:
    """MNIST: 60,000 + 10,000 images, float32 (N, 1, 28, 28), standardized with mean 0.1307 and std 0.3081.

    Options: ``normalize`` (False keeps pixels in [0, 1]); ``max_train`` / ``max_test`` keep the first rows
    (for quick runs). Files come from :func:`fedweave.data.sources.resolve` (root=, cache, npm, URL).
    """
    reject_unknown("mnist", unknown, load_mnist)
    return _load_idx("mnist", root, normalize, max_train, max_test)


@DATASETS.register("fashion_mnist")
def load_fashion_mnist(
    root: Root = None, *, normalize: bool = True, max_train: int | None = None, max_test: int | None = None, **unknown
) -> Dataset:
    """Fashion-MNIST: 60,000 + 10,000 images, float32 (N, 1, 28, 28), standardized (mean 0.2860, std 0.3530).

    Options as for ``mnist``. Files: root=, cache, installed or downloaded Debian package, URL.
    """
    reject_unknown("fashion_mnist", unknown, load_fashion_mnist)
    return _load_idx("fashion_mnist", root, normalize, max_train, max_test)
