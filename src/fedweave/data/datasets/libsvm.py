"""Any classification file in the LIBSVM / svmlight text format (``label idx:value ...`` per line).

LIBSVM files (a9a, w8a, covtype, ijcnn1, ...) are not on a package registry; pass the file path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedweave.data.base import Dataset
from fedweave.data.datasets._common import (
    OptionError,
    Root,
    as_tensors,
    opt_bool,
    opt_float,
    opt_int,
    reads_user_files,
    reject_unknown,
    set_options,
    stratified_split,
)
from fedweave.data.datasets._common import standardize as standardize_features
from fedweave.registry import DATASETS


def _path(root, value, option: str) -> Path:
    p = Path(value).expanduser()
    if not p.is_absolute() and root is not None:
        p = Path(root).expanduser() / p
    if not p.is_file():
        raise FileNotFoundError(f"dataset 'libsvm': option {option!r} names {p}, which is not a file")
    return p


def map_labels(*label_arrays: np.ndarray, files: tuple[Path, ...] = ()) -> tuple[list[np.ndarray], np.ndarray]:
    """Map the distinct labels of all arrays, sorted, to 0..C-1 (e.g. {-1, +1} -> {0, 1}). ``files`` name the
    file of each array, for the message when one holds a label that is not an integer."""
    for i, a in enumerate(label_arrays):
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            where = f"dataset 'libsvm': {files[i]}: " if i < len(files) else ""
            raise ValueError(
                f"{where}libsvm labels must be integers (classification); regression files are not supported"
            )
    classes = np.unique(np.concatenate(label_arrays))
    return [np.searchsorted(classes, a).astype(np.int64) for a in label_arrays], classes


# what the svmlight parser raises on a file it cannot read: OverflowError for an index or a count beyond its
# integers (an index of 99999999999 ended in a traceback)
_PARSE_ERRORS = (ValueError, OverflowError)


def _failing(train_file: Path, test_file: Path, n_features: int | None) -> str:
    """The file of the two that fails to parse on its own (both, when each parses alone)."""
    from sklearn.datasets import load_svmlight_file

    for f in (train_file, test_file):
        try:
            load_svmlight_file(str(f), n_features=n_features)
        except _PARSE_ERRORS:
            return str(f)
    return f"{train_file} and {test_file}"


def _not_empty(file: Path, y: np.ndarray) -> None:
    """A file without a sample line: its split would be empty (an empty test split was scored 0.0 each round)."""
    if len(y) == 0:
        raise ValueError(f"dataset 'libsvm': {file} holds no samples; give a file with at least one line")


def _dense(file: Path, x) -> np.ndarray:
    """The sparse rows of ``file`` as the dense matrix training reads, refused in one line where it would not fit
    in half of this machine's memory (one mistyped index of 2e9 asked numpy for 894 GiB, a traceback)."""
    need = x.shape[0] * x.shape[1] * 8  # float64, as scipy densifies
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory // 2:
        raise ValueError(
            f"dataset 'libsvm': {file}: feature indices up to {x.shape[1]:,} make a dense matrix of {x.shape[0]:,} x "
            f"{x.shape[1]:,} ({need / 2**30:,.1f} GiB), more than half of this machine's memory "
            f"({memory / 2**30:,.1f} GiB); fedweave trains on dense features: check the file for a mistyped index"
        )
    return x.toarray()


@DATASETS.register("libsvm")
@reads_user_files
def load_libsvm(
    root: Root = None,
    *,
    path: str | None = None,
    test_path: str | None = None,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    n_features: int | None = None,
    standardize: bool = False,
    **unknown,
) -> Dataset:
    """A svmlight/LIBSVM file as dense float32 features (N, d) and labels mapped to 0..C-1.

    Options: ``path`` (required; relative paths are taken under root=), ``test_path`` (a separate test
    file; otherwise a stratified ``test_fraction`` split fixed by ``split_seed``), ``n_features`` (pad to
    this width; default: the widest of the files), ``standardize`` (False; LIBSVM files are usually
    already scaled).
    """
    from sklearn.datasets import load_svmlight_file, load_svmlight_files

    reject_unknown("libsvm", unknown, load_libsvm)
    if path is None:
        raise OptionError("dataset 'libsvm' needs option 'path' (a file in svmlight / LIBSVM text format)")
    n_features = opt_int("libsvm", "n_features", n_features, allow_none=True)
    do_standardize = opt_bool("libsvm", "standardize", standardize)
    train_file = _path(root, path, "path")
    if test_path is not None:
        # the test file is the split: a test_fraction or split_seed beside it would be read by nothing
        unread = set_options(load_libsvm, test_fraction=test_fraction, split_seed=split_seed)
        if unread:
            raise OptionError(
                f"dataset 'libsvm': option(s) {', '.join(map(repr, unread))} split the one file of 'path'; with "
                "'test_path' the test split is that file: leave them out"
            )
        test_file = _path(root, test_path, "test_path")
        # read together, so that both files get one width and one index base (zero_based="auto")
        try:
            xtr, ytr, xte, yte = load_svmlight_files([str(train_file), str(test_file)], n_features=n_features)
        except _PARSE_ERRORS as e:  # name the file that fails on its own, not always the training file
            failing = _failing(train_file, test_file, n_features)
            raise ValueError(f"dataset 'libsvm': cannot parse {failing}: {e}") from e
        for file, y in ((train_file, ytr), (test_file, yte)):
            _not_empty(file, y)
        (ytr, yte), classes = map_labels(ytr, yte, files=(train_file, test_file))
        # both files take the width of the larger index: the line names the file that holds it
        wide = max((train_file, xtr), (test_file, xte), key=lambda fx: fx[1].indices.max(initial=-1))[0]
        xtr, xte = _dense(wide, xtr), _dense(wide, xte)
    else:
        # checked before the file is read: a bad value is the option's error, not "cannot parse" the file
        test_fraction = opt_float(
            "libsvm", "test_fraction", test_fraction, low=0, high=1, low_open=True, high_open=True
        )
        split_seed = opt_int("libsvm", "split_seed", split_seed, minimum=0)
        try:
            x, y = load_svmlight_file(str(train_file), n_features=n_features)
        except _PARSE_ERRORS as e:
            raise ValueError(f"dataset 'libsvm': cannot parse {train_file}: {e}") from e
        _not_empty(train_file, y)
        (y,), classes = map_labels(y, files=(train_file,))
        tr, te = stratified_split(y, test_fraction, split_seed)
        x = _dense(train_file, x)
        xtr, ytr, xte, yte = x[tr], y[tr], x[te], y[te]
    if len(classes) < 2:
        raise ValueError(f"dataset 'libsvm': {train_file} has a single label {classes.tolist()}")
    xtr, xte = xtr.astype(np.float32), xte.astype(np.float32)
    if do_standardize:
        xtr, xte = standardize_features(xtr, xte)
    return Dataset(
        "libsvm", *as_tensors(xtr, ytr), *as_tensors(xte, yte), num_classes=len(classes), input_shape=(xtr.shape[1],)
    )
