"""UCI Mushroom (the source of LIBSVM's ``mushrooms``) from ``Mushroom.rda`` of the R package cba.

All 22 attributes are R factors; each is one-hot encoded over its factor levels (116 columns; a missing
``stalk-root`` sets no bit). Label 1 means poisonous. The file has no train/test split, so one is drawn
per class with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedweave.data import sources
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import Root, as_tensors, opt_float, opt_int, reject_unknown, stratified_split
from fedweave.registry import DATASETS


def read_mushroom_rda(path: Path):
    """The ``Mushroom`` data frame (pandas, categorical columns) of an R data file."""
    import rdata

    try:
        objects = rdata.read_rda(str(path))
    except Exception as e:  # noqa: BLE001  (any parse failure means the file is not what we expect)
        raise ValueError(f"{path}: cannot be read as an R data file ({e})") from e
    if "Mushroom" not in objects:
        raise ValueError(f"{path}: no object named 'Mushroom' (found {sorted(objects)})")
    return objects["Mushroom"]


def one_hot_frame(df, label_column: str = "class", positive: str = "poisonous") -> tuple[np.ndarray, np.ndarray, list]:
    """One-hot over each categorical column's levels; NA sets no bit. Returns float32 X, int64 y, names."""
    if label_column not in df.columns:
        raise ValueError(f"no {label_column!r} column (columns: {list(df.columns)})")
    labels = df[label_column].astype(str).to_numpy()
    if positive not in set(labels):
        raise ValueError(f"column {label_column!r} has no {positive!r} rows")
    blocks, names = [], []
    for col in df.columns:
        if col == label_column:
            continue
        s = df[col]
        if not hasattr(s, "cat"):
            raise ValueError(f"column {col!r} is not categorical (dtype {s.dtype})")
        codes = s.cat.codes.to_numpy()  # -1 for NA
        block = np.zeros((len(df), len(s.cat.categories)), np.float32)
        ok = codes >= 0
        block[np.flatnonzero(ok), codes[ok]] = 1.0
        blocks.append(block)
        names += [f"{col}={c}" for c in s.cat.categories]
    return np.hstack(blocks), (labels == positive).astype(np.int64), names


@DATASETS.register("mushroom")
def load_mushroom(root: Root = None, *, test_fraction: float = 0.2, split_seed: int = 0, **unknown) -> Dataset:
    """UCI Mushroom: 8,124 rows, 116 binary float32 features, labels {0 edible, 1 poisonous}.

    Options: ``test_fraction`` (stratified, default 0.2) and ``split_seed`` (default 0) fix the split.
    """
    reject_unknown("mushroom", unknown, load_mushroom)
    test_fraction = opt_float("mushroom", "test_fraction", test_fraction, low=0, high=1, low_open=True, high_open=True)
    split_seed = opt_int("mushroom", "split_seed", split_seed, minimum=0)
    path = sources.resolve("mushroom", root).files["Mushroom.rda"]
    x, y, names = one_hot_frame(read_mushroom_rda(path))
    tr, te = stratified_split(y, test_fraction, split_seed)
    return Dataset(
        "mushroom", *as_tensors(x[tr], y[tr]), *as_tensors(x[te], y[te]), num_classes=2, input_shape=(len(names),)
    )
