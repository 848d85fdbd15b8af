"""Shared test fixtures: a tiny learnable dataset and a linear model, registered under test-only names."""

from __future__ import annotations

import copy
import os
import signal
import threading
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from torch import nn

from fedweave.data.base import Dataset
from fedweave.registry import DATASETS, MODELS

# The optional extras some tests exercise: module -> the extra that installs it. `make test` installs them all
# and names them in FEDWEAVE_TEST_EXTRAS, so that a missing one fails the run instead of skipping its tests.
OPTIONAL_MODULES = {
    "ray": "ray",
    "flwr": "flower",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "sphinx": "docs",
    "opacus": "privacy",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    wanted = set(filter(None, os.environ.get("FEDWEAVE_TEST_EXTRAS", "").split(",")))
    missing = [f"{m} (fedweave[{x}])" for m, x in OPTIONAL_MODULES.items() if x in wanted and not find_spec(m)]
    if missing:
        raise pytest.UsageError(f"FEDWEAVE_TEST_EXTRAS asks for {', '.join(missing)}, not installed: run `make test`")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test that imports an optional extra which is not installed skips, naming the extra to install."""
    try:
        return (yield)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in OPTIONAL_MODULES:
            pytest.skip(f"{top} is not installed (pip install 'fedweave[{OPTIONAL_MODULES[top]}]')")
        raise


# Test workloads are tiny: one intra-op thread is as fast and avoids thread oversubscription when several
# processes share the cores.
torch.set_num_threads(1)
# The same for the processes the tests start (CLI runs, benchmarks, Flower's nodes and ServerApps): their torch
# reads this at start. Several OpenMP threads a process on a loaded 2-core machine spin-wait for each other: a
# benchmark script ran 5x slower with torch's default than with one thread. A value set outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one intra-op thread, whatever thread count an earlier run set."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _signal_handlers_put_back():
    """Every test leaves Ctrl-C's and SIGTERM's handlers as it found them, so that a handler one test (or a
    library it runs in-process) installs cannot change what a later test's signal does."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in sigs} if threading.current_thread() is threading.main_thread() else {}
    yield
    for s, handler in before.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


def make_toy(n_train: int = 1200, n_test: int = 300, side: int = 6, classes: int = 4, seed: int = 0) -> Dataset:
    """Linearly separable-ish images: labels are the argmax of a fixed random linear map (test fixture)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, 1, side, side, generator=g)
    w = torch.randn(side * side, classes, generator=g)
    y = (x.flatten(1) @ w).argmax(1)
    return Dataset("_toy", x[:n_train], y[:n_train], x[n_train:], y[n_train:], classes, (1, side, side))


if "_toy" not in DATASETS._items:
    DATASETS.register("_toy")(make_toy)


if "_toy_cnn" not in MODELS._items:

    @MODELS.register("_toy_cnn")
    def _toy_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 3) -> nn.Module:
        c, h, w = input_shape
        return nn.Sequential(
            nn.Conv2d(c, width, 3), nn.ReLU(), nn.Flatten(), nn.Linear(width * (h - 2) * (w - 2), num_classes)
        )


TOY_CONFIG = {  # a small FedAvg run on the toy data (a few seconds); copied for each use (toy_config)
    "name": "toy",
    "seed": 3,
    "rounds": 4,
    "dataset": {"name": "_toy"},
    "partition": {"name": "dirichlet", "num_clients": 12, "alpha": 0.5, "min_size": 20},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.1},
    "output": {"progress": False, "plots": False},
}


@pytest.fixture
def toy_config() -> dict:
    """A small FedAvg run on the toy data (a few seconds), a copy each test may change."""
    return copy.deepcopy(TOY_CONFIG)


@pytest.fixture
def uneven_parts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    perm = rng.permutation(1200)
    return [np.sort(p) for p in np.split(perm, [7, 40, 41, 200, 380, 700])]
