"""Datasets bundled in the scikit-learn wheel (always offline): digits, breast cancer and diabetes (regression).

Features are standardized with the training statistics; the train/test split is stratified and fixed by
``split_seed``.
"""

from __future__ import annotations

import numpy as np
import torch

from fedweave.data.base import Dataset
from fedweave.data.datasets._common import (
    as_tensors,
    opt_bool,
    opt_float,
    opt_int,
    reject_unknown,
    stratified_split,
)
from fedweave.data.datasets._common import standardize as standardize_features
from fedweave.registry import DATASETS


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction, split_seed, do_standardize):
    test_fraction = opt_float(name, "test_fraction", test_fraction, low=0, high=1, low_open=True, high_open=True)
    split_seed = opt_int(name, "split_seed", split_seed, minimum=0)
    do_standardize = opt_bool(name, "standardize", do_standardize)
    tr, te = stratified_split(y, test_fraction, split_seed)
    xtr, xte = x[tr].astype(np.float32), x[te].astype(np.float32)
    if do_standardize:
        xtr, xte = standardize_features(xtr, xte)
    return (xtr, y[tr]), (xte, y[te])


@DATASETS.register("digits")
def load_digits(
    root=None,
    *,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    standardize: bool = True,
    as_image: bool = False,
    **unknown,
) -> Dataset:
    """scikit-learn digits: 1,797 8x8 images, 10 classes; features (64,) or, with ``as_image``, (1, 8, 8).

    Options: ``test_fraction`` (0.2), ``split_seed`` (0), ``standardize`` (True), ``as_image`` (False).
    ``root`` is ignored (the data ship with scikit-learn).
    """
    from sklearn.datasets import load_digits as sk_digits

    reject_unknown("digits", unknown, load_digits)
    as_image = opt_bool("digits", "as_image", as_image)
    d = sk_digits()
    (xtr, ytr), (xte, yte) = _split("digits", d.data, d.target.astype(np.int64), test_fraction, split_seed, standardize)
    shape = (1, 8, 8) if as_image else (64,)
    tr = as_tensors(xtr.reshape(-1, *shape), ytr)
    te = as_tensors(xte.reshape(-1, *shape), yte)
    return Dataset("digits", *tr, *te, num_classes=10, input_shape=shape)


@DATASETS.register("breast_cancer")
def load_breast_cancer(
    root=None, *, test_fraction: float = 0.2, split_seed: int = 0, standardize: bool = True, **unknown
) -> Dataset:
    """scikit-learn breast cancer (Wisconsin diagnostic): 569 x 30 features, labels {0 malignant, 1 benign}.

    Options: ``test_fraction`` (0.2), ``split_seed`` (0), ``standardize`` (True). ``root`` is ignored.
    """
    from sklearn.datasets import load_breast_cancer as sk_bc

    reject_unknown("breast_cancer", unknown, load_breast_cancer)
    d = sk_bc()
    (xtr, ytr), (xte, yte) = _split(
        "breast_cancer", d.data, d.target.astype(np.int64), test_fraction, split_seed, standardize
    )
    return Dataset("breast_cancer", *as_tensors(xtr, ytr), *as_tensors(xte, yte), num_classes=2, input_shape=(30,))


@DATASETS.register("diabetes")
def load_diabetes(
    root=None,
    *,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    standardize: bool = True,
    standardize_target: bool = True,
    **unknown,
) -> Dataset:
    """scikit-learn diabetes (Efron et al. 2004): 442 patients x 10 baseline variables, the target a
    quantitative measure of disease progression one year later (a float; regression, ``task.loss: mse``).

    Options: ``test_fraction`` (0.2), ``split_seed`` (0; a random, not stratified, split), ``standardize``
    (features, with the training statistics; True), ``standardize_target`` (the target likewise, so losses
    are in units of its spread; True). ``root`` is ignored (the data ship with scikit-learn).
    """
    from sklearn.datasets import load_diabetes as sk_diabetes

    reject_unknown("diabetes", unknown, load_diabetes)
    test_fraction = opt_float("diabetes", "test_fraction", test_fraction, low=0, high=1, low_open=True, high_open=True)
    split_seed = opt_int("diabetes", "split_seed", split_seed, minimum=0)
    d = sk_diabetes(scaled=False)
    x, y = d.data.astype(np.float32), d.target.astype(np.float32)
    perm = np.random.default_rng(split_seed).permutation(len(y))
    cut = len(y) - max(1, round(test_fraction * len(y)))
    tr, te = np.sort(perm[:cut]), np.sort(perm[cut:])
    xtr, xte, ytr, yte = x[tr], x[te], y[tr], y[te]
    if opt_bool("diabetes", "standardize", standardize):
        xtr, xte = standardize_features(xtr, xte)
    if opt_bool("diabetes", "standardize_target", standardize_target):
        mu, sd = ytr.mean(), ytr.std()
        ytr, yte = (ytr - mu) / sd, (yte - mu) / sd
    t = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in (xtr, ytr, xte, yte)]
    return Dataset("diabetes", *t, num_classes=1, input_shape=(10,))
