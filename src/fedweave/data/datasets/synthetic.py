"""Synthetic(alpha, beta) of FedProx (Li et al., MLSys 2020, Sec. 5.1), naturally federated by user.

This is generated data. It serves speed and shape tests and the synthetic experiments that papers define
this way; it is never a stand-in for a real dataset, and no loader falls back to it.

For user k (following the paper and its public generator):
  u_k ~ N(0, alpha^2),  W_k[i, j] ~ N(u_k, 1),  b_k[j] ~ N(u_k, 1)         (local model)
  B_k ~ N(0, beta^2),   v_k[j] ~ N(B_k, 1),     x ~ N(v_k, Sigma),  Sigma = diag(j^-1.2)
  y = argmax softmax(W_k^T x + b_k)
with 60 features and 10 classes; user sizes are lognormal(4, 2) + 50. The paper writes N(0, alpha) but
the generator draws with standard deviation alpha (``np.random.normal(0, alpha)``); we follow the
generator. ``iid=True`` gives Synthetic-IID: one shared (W, b) ~ N(0, 1) and v_k = 0.
Each user's first ``floor(train_fraction * n_k)`` samples train (0.9 as in FedProx), the rest test.
"""

from __future__ import annotations

import os

import numpy as np

from fedweave.data.base import Dataset
from fedweave.data.datasets._common import OptionError, as_tensors, opt_bool, opt_float, opt_int, reject_unknown
from fedweave.registry import DATASETS
from fedweave.seeding import Seeds


def generate(
    *,
    alpha: float,
    beta: float,
    iid: bool,
    num_users: int,
    num_features: int,
    num_classes: int,
    seed: int,
    size_mean: float,
    size_sigma: float,
    min_size: int,
    max_size: int | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-user ``(x, y)``. User k's data depend only on (seed, k), not on ``num_users``."""
    seeds = Seeds(seed)
    sigma_sqrt = np.arange(1, num_features + 1, dtype=np.float64) ** -0.6  # sqrt of j^-1.2
    shared = seeds.numpy("synthetic-iid-model")
    w_iid, b_iid = shared.normal(0, 1, (num_features, num_classes)), shared.normal(0, 1, num_classes)
    users = []
    for k in range(num_users):
        rng = seeds.numpy("synthetic-user", k)
        raw = rng.lognormal(size_mean, size_sigma)
        if max_size is not None and raw >= max_size:  # capped (an infinite draw too, which int() refused)
            n = max_size
        else:
            _check_size(k, raw, num_features, size_mean, size_sigma)
            n = int(raw) + min_size
            if max_size is not None:
                n = min(n, max_size)
        u_k, big_b_k = rng.normal(0, alpha), rng.normal(0, beta)
        if iid:
            w, b, v = w_iid, b_iid, np.zeros(num_features)
        else:
            w = rng.normal(u_k, 1, (num_features, num_classes))
            b = rng.normal(u_k, 1, num_classes)
            v = rng.normal(big_b_k, 1, num_features)
        x = v + sigma_sqrt * rng.standard_normal((n, num_features))
        y = np.argmax(x @ w + b, axis=1)  # argmax of softmax = argmax of the logits
        users.append((x.astype(np.float32), y.astype(np.int64)))
    return users


def _check_size(k: int, raw: float, num_features: int, size_mean: float, size_sigma: float) -> None:
    """User ``k``'s drawn size ``raw`` must leave its features within half of this machine's memory: one line
    otherwise (a size_mean of 22 asked numpy for 2.35 TiB, one of 1000 overflowed int(): tracebacks)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not raw * num_features * 8 <= memory // 2:
        raise OptionError(
            f"dataset 'synthetic': user {k} draws {raw:.3g} samples (lognormal with size_mean {size_mean:g}, "
            f"size_sigma {size_sigma:g}), whose features would not fit in half of this machine's memory "
            f"({memory / 2**30:,.1f} GiB); lower size_mean or size_sigma, or set max_size"
        )


@DATASETS.register("synthetic")
def load_synthetic(
    root=None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    num_users: int = 30,
    num_features: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    train_fraction: float = 0.9,
    size_mean: float = 4.0,
    size_sigma: float = 2.0,
    min_size: int = 50,
    max_size: int | None = None,
    **unknown,
) -> Dataset:
    """FedProx Synthetic(alpha, beta) (generated; for speed/shape tests and synthetic experiments only).

    Options: ``alpha``, ``beta`` (>= 0; heterogeneity of models and of features), ``iid``, ``num_users``
    (30), ``num_features`` (60), ``num_classes`` (10), ``seed``, ``train_fraction`` (0.9 per user),
    ``size_mean`` / ``size_sigma`` (lognormal user sizes, 4 and 2), ``min_size`` (50), ``max_size`` (cap).
    ``train_users`` / ``test_users`` hold each sample's user, for the natural partitioner.
    """
    n = "synthetic"
    reject_unknown(n, unknown, load_synthetic)
    users = generate(
        alpha=opt_float(n, "alpha", alpha, low=0),
        beta=opt_float(n, "beta", beta, low=0),
        iid=opt_bool(n, "iid", iid),
        num_users=opt_int(n, "num_users", num_users),
        num_features=opt_int(n, "num_features", num_features),
        num_classes=opt_int(n, "num_classes", num_classes, minimum=2),
        seed=opt_int(n, "seed", seed, minimum=0),
        size_mean=opt_float(n, "size_mean", size_mean),
        size_sigma=opt_float(n, "size_sigma", size_sigma, low=0),
        min_size=opt_int(n, "min_size", min_size, minimum=2),
        max_size=opt_int(n, "max_size", max_size, minimum=2, allow_none=True),
    )
    frac = opt_float(n, "train_fraction", train_fraction, low=0, high=1, low_open=True, high_open=True)
    parts: dict[str, list] = {"train": [], "test": []}
    for k, (x, y) in enumerate(users):
        cut = min(max(1, int(frac * len(y))), len(y) - 1)  # at least one sample on each side
        for split, sl in (("train", slice(0, cut)), ("test", slice(cut, None))):
            parts[split].append((x[sl], y[sl], np.full(len(y[sl]), k, np.int64)))
    out = {}
    for split, chunks in parts.items():
        x, y, u = (np.concatenate(c) for c in zip(*chunks))
        out[split] = (*as_tensors(x, y), u)
    (tx, ty, tu), (vx, vy, vu) = out["train"], out["test"]
    return Dataset(
        n, tx, ty, vx, vy, num_classes=num_classes, input_shape=(num_features,), train_users=tu, test_users=vu
    )
