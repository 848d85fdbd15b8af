"""The synthetic logistic-regression data of the CFL-SAGA paper (Wang et al., 2024, §VIII-A, eq. 47-48).

The paper says only that features omega in R^200 and labels y in {0, 1} are "randomly generated"; the spec
(`cfl-saga.md` A7) resolves this as omega ~ N(0, I_d / d) (||omega|| ~ 1) and y ~ Bernoulli(1/2) independent
of omega. Options: omega ~ N(0, I_d) (``features="normal"``) and planted labels y ~ Bernoulli(sig(omega^T x_true))
(``labels="planted"``). Features are float64: the optimality gap is measured down to 1e-10.

Synthetic data: for the paper's synthetic experiments and for speed/shape tests, never a stand-in for real data.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from fedweave.config import ConfigError
from fedweave.data.base import Dataset
from fedweave.registry import DATASETS


@DATASETS.register("cfl_logreg")
def cfl_logreg(
    num_samples: int = 20_000,
    dim: int = 200,
    features: Literal["normal_scaled", "normal"] = "normal_scaled",
    labels: Literal["bernoulli", "planted"] = "bernoulli",
    num_test: int = 0,
    seed: int = 0,
) -> Dataset:
    """``num_samples`` training and ``num_test`` test samples (the paper: 20,000 x 200, no test set)."""
    for key, v, lo in (("num_samples", num_samples, 1), ("dim", dim, 1), ("num_test", num_test, 0), ("seed", seed, 0)):
        if v < lo:
            raise ConfigError(f"dataset.{key} must be >= {lo}, got {v}")
    if features not in ("normal_scaled", "normal"):
        raise ConfigError(f"dataset.features must be 'normal_scaled' or 'normal', got {features!r}")
    if labels not in ("bernoulli", "planted"):
        raise ConfigError(f"dataset.labels must be 'bernoulli' or 'planted', got {labels!r}")
    rng = np.random.default_rng(seed)
    n = num_samples + num_test
    scale = 1.0 / np.sqrt(dim) if features == "normal_scaled" else 1.0
    omega = rng.standard_normal((n, dim)) * scale
    if labels == "bernoulli":
        y = (rng.random(n) < 0.5).astype(np.int64)
    else:
        x_true = rng.standard_normal(dim) / scale / np.sqrt(dim)  # omega^T x_true ~ N(0, 1)
        y = (rng.random(n) < 1.0 / (1.0 + np.exp(-omega @ x_true))).astype(np.int64)
    x, yt = torch.from_numpy(omega), torch.from_numpy(y)
    return Dataset(
        name="cfl_logreg",
        train_x=x[:num_samples],
        train_y=yt[:num_samples],
        test_x=x[num_samples:],
        test_y=yt[num_samples:],
        num_classes=2,
        input_shape=(dim,),
    )
