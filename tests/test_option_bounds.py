"""Numeric extremes of algorithm, aggregator and sampler options: one ConfigError naming the key and the
allowed range, never a torch overflow, a hang or a 300-digit number."""

from __future__ import annotations

import numpy as np
import pytest

from fedweave.algorithms.centralized.fedadam import FedOptHparams
from fedweave.algorithms.hierarchical.base import HierarchyHparams
from fedweave.config import ConfigError, build_dataclass
from fedweave.registry import ALGORITHMS
from fedweave.robust.aggregators import CenteredClipping, GeometricMedian
from fedweave.topology.samplers import fixed


@pytest.mark.parametrize("key", ["v_init", "tau"])
def test_fedopt_state_options_beyond_float32_are_refused(key: str) -> None:
    # v_init = 1e300 filled a float32 tensor (RuntimeError: overflow); tau = 1e300 became inf: no step at all
    with pytest.raises(ConfigError, match=rf"algorithm\.{key} must be in .*3\.40282e\+38"):
        FedOptHparams(**{key: 1e300})
    FedOptHparams(**{key: 0.5})


def test_geometric_median_bounds() -> None:
    with pytest.raises(ConfigError, match=r"aggregator\.nu must be in \(0, 3\.40282e\+38\]"):
        GeometricMedian(nu=1e300)
    with pytest.raises(ConfigError, match=r"aggregator\.iters must be in \[1, 10,000,000\], got 1e\+300"):
        GeometricMedian(iters=10**300)
    with pytest.raises(ConfigError, match=r"aggregator\.tol must be >= 0"):
        GeometricMedian(tol=-1.0)


def test_centered_clipping_iters_is_bounded() -> None:
    # 1e300 iterations ran forever instead of being refused as local.steps is
    with pytest.raises(ConfigError, match=r"aggregator\.iters must be in \[1, 10,000,000\], got 1e\+300"):
        CenteredClipping(iters=10**300)


def test_hierarchical_tau_is_bounded() -> None:
    # tau is the local steps per round (floor(tau (r+1)^q)): 1e300 ran forever
    with pytest.raises(ConfigError, match=r"algorithm\.tau must be in \(0, 10,000,000\], got 1e\+300"):
        HierarchyHparams(tau=1e300)


def test_fixed_sampler_clients_message_is_short() -> None:
    with pytest.raises(ConfigError) as e:
        fixed(10, 2, 0, np.random.default_rng(0), rounds=1, clients=10**300)
    assert "got 1e+300" in str(e.value) and len(str(e.value)) < 120


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "fedavgm", "fedbuff", "afl"])
def test_star_server_lr_is_bounded(name: str) -> None:
    # server_lr = 1e300 was accepted and the first round diverged (test_loss=nan) instead of being refused
    with pytest.raises(ConfigError, match=r"algorithm\.server_lr must be in \(0, 3\.40282e\+38\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get(name).Hparams, {"server_lr": 1e300}, "algorithm")


def test_pfedme_inner_steps_is_bounded() -> None:
    # inner_steps = 1e300 was accepted and the first local step never ended
    with pytest.raises(ConfigError, match=r"algorithm\.inner_steps must be in \[1, 10,000,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("pfedme").Hparams, {"inner_steps": 10**300}, "algorithm")


@pytest.mark.parametrize("name", ["ditto", "ditto_star"])
def test_ditto_personal_epochs_is_bounded(name: str) -> None:
    # personal_epochs = 1e300 was accepted and the run hung in the first personal pass
    with pytest.raises(ConfigError, match=r"algorithm\.personal_epochs must be in \[1, 10,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get(name).Hparams, {"personal_epochs": 10**300}, "algorithm")


@pytest.mark.parametrize("name", ["gossip", "dfedavg", "choco_sgd", "dispfl", "ditto", "fomo", "pens", "afind_plus"])
def test_decentralized_finetune_epochs_is_bounded(name: str) -> None:
    # finetune_epochs = 1e9 was accepted and the run hung in the fine-tuning before its first evaluation
    with pytest.raises(ConfigError, match=r"algorithm\.finetune_epochs must be in \[0, 10,000\], got 1e\+09"):
        build_dataclass(ALGORITHMS.get(name).Hparams, {"finetune_epochs": 10**9}, "algorithm")
    build_dataclass(ALGORITHMS.get(name).Hparams, {"finetune_epochs": 10_000}, "algorithm")


def test_afind_plus_head_epochs_is_bounded() -> None:
    # head_epochs = 1e9 (personal: head) was accepted and the first local update never ended
    with pytest.raises(ConfigError, match=r"algorithm\.head_epochs must be in \[1, 10,000\], got 1e\+09"):
        build_dataclass(ALGORITHMS.get("afind_plus").Hparams, {"head_epochs": 10**9}, "algorithm")
