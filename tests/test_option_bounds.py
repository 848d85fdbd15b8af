"""Numeric extremes of algorithm, aggregator and sampler options: one ConfigError naming the key and the
allowed range, never a torch overflow, a hang or a 300-digit number."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fedweave.algorithms.centralized.fedadam import FedOptHparams
from fedweave.algorithms.hierarchical.base import HierarchyHparams
from fedweave.compression.compressors import QSGD, RandK, TopK
from fedweave.config import ConfigError, build_dataclass
from fedweave.registry import ALGORITHMS
from fedweave.robust.aggregators import CenteredClipping, DnC, GeometricMedian
from fedweave.topology.samplers import fixed


def _digits(**sections) -> dict:
    """A one-round FedAvg run on the digits, 4 clients, 2 a round, with ``sections`` replaced or added."""
    return {
        "rounds": 1,
        "dataset": "digits",
        "partition": {"name": "iid", "num_clients": 4},
        "model": "logistic",
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "output": {"progress": False, "plots": False},
        **sections,
    }


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


def test_fedrep_head_epochs_is_bounded() -> None:
    # head_epochs = 1e300 was accepted and a 1-round toy run hung in the first head pass
    with pytest.raises(ConfigError, match=r"algorithm\.head_epochs must be in \[1, 10,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("fedrep").Hparams, {"head_epochs": 10**300}, "algorithm")


def test_fedbabu_finetune_epochs_is_bounded() -> None:
    # finetune_epochs = 1e300 was accepted and a 1-round toy run hung in the first personalized evaluation
    with pytest.raises(ConfigError, match=r"algorithm\.finetune_epochs must be in \[1, 10,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("fedbabu").Hparams, {"finetune_epochs": 10**300}, "algorithm")


@pytest.mark.parametrize("name", ["gossip", "dfedavg", "choco_sgd", "dispfl", "ditto", "fomo", "pens", "afind_plus"])
def test_decentralized_finetune_epochs_is_bounded(name: str) -> None:
    # finetune_epochs = 1e300 was accepted and a 1-round toy run hung in the first evaluation's fine-tuning
    with pytest.raises(ConfigError, match=r"algorithm\.finetune_epochs must be in \[0, 10,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get(name).Hparams, {"finetune_epochs": 10**300}, "algorithm")
    build_dataclass(ALGORITHMS.get(name).Hparams, {"finetune_epochs": 10_000}, "algorithm")


@pytest.mark.parametrize("name", ["dfedavg", "dispfl", "afind_plus"])
def test_decentralized_test_per_client_is_bounded(name: str) -> None:
    # test_per_client = 1e12 was accepted and a 1-round digits run died in numpy ("Unable to allocate 621. GiB")
    hp = ALGORITHMS.get(name).Hparams
    with pytest.raises(
        ConfigError, match=r"^algorithm\.test_per_client must be in \[1, 2,147,483,647\] or null, got 1e\+12$"
    ):
        build_dataclass(hp, {"test_per_client": 10**12}, "algorithm")
    with pytest.raises(ConfigError, match=r"got 0$"):
        build_dataclass(hp, {"test_per_client": 0}, "algorithm")
    assert build_dataclass(hp, {"test_per_client": 2**31 - 1}, "algorithm").test_per_client == 2**31 - 1


def test_decentralized_test_per_client_is_at_most_the_test_split(tmp_path) -> None:
    # any value up to 2**31 - 1 passed the bound above: 10**8 drew 10**8 test indices per client and evaluated
    # each client on them (a 4-client run: 3.2 GB of indices alone). A client's test set is drawn from the test
    # split, so more than it holds only repeats its samples
    import fedweave

    for per_client, ok in ((100_000, False), (359, True)):
        cfg = _digits(algorithm={"name": "dfedavg", "test_per_client": per_client}, local={"batch_size": 32})
        if ok:  # digits' test split: 359 of its 1,797 samples
            fedweave.run(cfg, run_dir=tmp_path / "ok")
            continue
        with pytest.raises(
            ConfigError,
            match=r"^algorithm\.test_per_client must be at most the test split's 359 samples .*, got 100,000$",
        ):
            fedweave.run(cfg, run_dir=tmp_path / "big")


def test_afind_plus_head_epochs_is_bounded() -> None:
    # head_epochs = 1e300 (personal: head) was accepted and a 1-round toy run hung in the first head pass
    with pytest.raises(ConfigError, match=r"algorithm\.head_epochs must be in \[1, 10,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("afind_plus").Hparams, {"head_epochs": 10**300}, "algorithm")


@pytest.mark.parametrize("name", ["cfl_saga", "cfl_admm", "gt_saga", "gt_sarah", "gt_svrg"])
def test_confederated_iterations_per_round_is_bounded(name: str) -> None:
    # iterations_per_round = 1e300 was accepted and a 1-round toy run never finished its round
    with pytest.raises(ConfigError, match=r"algorithm\.iterations_per_round must be in \[1, 10,000,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get(name).Hparams, {"iterations_per_round": 10**300}, "algorithm")


@pytest.mark.parametrize("name", ["hier_fedavg", "hier_fedprox", "hier_scaffold"])
def test_hierarchical_steps_factor_is_bounded(name: str) -> None:
    # steps_factor multiplies the local steps per round: 1e300 was accepted and a 1-round toy run hung
    with pytest.raises(ConfigError, match=r"algorithm\.steps_factor must be in \[1, 10,000,000\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get(name).Hparams, {"steps_factor": 10**300}, "algorithm")


@pytest.mark.parametrize("key", ["personal_lr", "lam", "beta"])
def test_pfedme_float_options_are_bounded(key: str) -> None:
    # personal_lr = 1e300 was accepted and the first round diverged (float32 inf) instead of being refused
    with pytest.raises(ConfigError, match=rf"algorithm\.{key} must be in \(0, 3\.40282e\+38\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("pfedme").Hparams, {key: 1e300}, "algorithm")


@pytest.mark.parametrize("key", ["alpha", "delta"])
def test_perfedavg_steps_are_bounded(key: str) -> None:
    # alpha = 1e300 was accepted and the first round diverged (float32 inf) instead of being refused
    with pytest.raises(ConfigError, match=rf"algorithm\.{key} must be in \(0, 3\.40282e\+38\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("perfedavg").Hparams, {key: 1e300}, "algorithm")


def test_afl_lambda_lr_is_bounded() -> None:
    # lambda_lr = 1e300 was accepted and the first round diverged instead of being refused
    with pytest.raises(ConfigError, match=r"algorithm\.lambda_lr must be in \[0, 3\.40282e\+38\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("afl").Hparams, {"lambda_lr": 1e300}, "algorithm")
    build_dataclass(ALGORITHMS.get("afl").Hparams, {"lambda_lr": 0.0}, "algorithm")  # 0: lambda stays uniform


@pytest.mark.parametrize("key", ["server_lr", "eta"])
def test_zo_hfl_steps_are_bounded(key: str) -> None:
    # server_lr or eta = 1e300 was accepted and the first round diverged instead of being refused
    with pytest.raises(ConfigError, match=rf"algorithm\.{key} must be in \(0, 3\.40282e\+38\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("zo_hfl").Hparams, {key: 1e300}, "algorithm")


@pytest.mark.parametrize("key", ["step_scale", "step_size"])
def test_confederated_step_is_bounded(key: str) -> None:
    # step_scale = 1e300 was accepted and a 3-round cfl_saga toy run diverged after its first round
    with pytest.raises(ConfigError, match=rf"algorithm\.{key} must be .*3\.40282e\+38.*, got 1e\+300"):
        build_dataclass(ALGORITHMS.get("cfl_saga").Hparams, {key: 1e300}, "algorithm")


def test_privacy_noise_multiplier_is_bounded() -> None:
    # noise_multiplier = 1e300 passed validation and the run died in the accountant on a bare OverflowError
    # (sigma ** 2); the noise std sigma * C is drawn in float32, as local.lr's step is taken
    from fedweave.config import load

    with pytest.raises(ConfigError, match=r"privacy\.noise_multiplier must be .*3\.40282e\+38.*, got 1e\+300"):
        load({"privacy": {"noise_multiplier": 1e300}})


def test_dnc_niters_is_bounded() -> None:
    # niters = 1e300 was accepted and a 1-round toy run never finished its first reduction
    with pytest.raises(ConfigError, match=r"aggregator\.niters must be in \[1, 10,000,000\], got 1e\+300"):
        DnC(niters=10**300)


@pytest.mark.parametrize(("clusters", "shown"), [(1e300, "1e+300"), (5, "5")])
def test_ifca_clusters_are_at_most_the_clients(tmp_path, clusters: float, shown: str) -> None:
    # clusters = 1e300 was accepted and a 1-round toy run hung building the cluster models, one by one
    import fedweave

    cfg = {
        "rounds": 1,
        "dataset": "digits",
        "partition": {"name": "iid", "num_clients": 4},
        "model": "logistic",
        "algorithm": {"name": "ifca", "clients_per_round": 2, "clusters": clusters},
        "output": {"progress": False, "plots": False},
    }
    with pytest.raises(
        ConfigError, match=rf"^algorithm\.clusters \({re.escape(shown)}\) exceeds partition\.num_clients \(4\)"
    ):
        fedweave.run(cfg, run_dir=tmp_path / "r")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("edge_prob", 2.5, r"algorithm\.edge_prob must be in \(0, 1\], got 2\.5"),
        ("edge_prob", -1.0, r"algorithm\.edge_prob must be in \(0, 1\], got -1\.0"),
        ("rewire_prob", 2.5, r"algorithm\.rewire_prob must be in \[0, 1\], got 2\.5"),
        ("rewire_prob", -1.0, r"algorithm\.rewire_prob must be in \[0, 1\], got -1\.0"),
        ("degree", -1, r"algorithm\.degree must be >= 1, got -1"),
        ("torus_rows", -1, r"algorithm\.torus_rows must be >= 0 \(0 = the most square factorization\), got -1"),
    ],
)
def test_graph_options_are_checked_whatever_the_topology(key: str, value: float, words: str) -> None:
    # each was checked only by the topology that reads it: with topology full, edge_prob = 2.5 ran
    with pytest.raises(ConfigError, match=words):
        build_dataclass(ALGORITHMS.get("gossip").Hparams, {"topology": "full", key: value}, "algorithm")


def test_clients_per_round_beyond_the_clients_is_shown_short(tmp_path) -> None:
    # clients_per_round = 1e300 was refused with its 301 digits in the line
    import fedweave

    cfg = _digits(algorithm={"name": "fedavg", "clients_per_round": 1e300})
    with pytest.raises(ConfigError, match=r"^algorithm\.clients_per_round \(1e\+300\) exceeds partition\.num_clients"):
        fedweave.run(cfg, run_dir=tmp_path / "r")


def test_confederated_batch_size_is_bounded() -> None:
    # batch_size = 1e300 was refused only by the data check, with a 300-digit product in the line
    with pytest.raises(ConfigError, match=r"algorithm\.batch_size must be in \[1, 2,147,483,647\], got 1e\+300"):
        build_dataclass(ALGORITHMS.get("cfl_saga").Hparams, {"batch_size": 10**300}, "algorithm")


@pytest.mark.parametrize("name", ["krum", "multi_krum"])
def test_krum_m_beyond_the_updates_is_shown_short(name: str) -> None:
    from fedweave.registry import AGGREGATORS

    # an m beyond the round's updates is refused naming m (lowering f cannot help), its value short
    with pytest.raises(ConfigError, match=r"aggregator\.m must be at most the 6 client updates .*, got 1e\+300$") as e:
        AGGREGATORS.get(name)(m=10**300).check(6, 0)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize(
    "extra, expect",
    [
        ({"sampler": {"name": "power_of_choice", "d": 10**300}}, r"^sampler\.d must be an integer in \[2, 4\] "),
        (
            {"faults": {"byzantine": {"clients": [0], "attack": "backdoor", "size": 10**300}}},
            r"^faults\.byzantine\.size must be at most \d+ for these samples, got 1e\+300$",
        ),
        (
            {"faults": {"byzantine": {"clients": [0], "attack": "backdoor", "target": 10**300}}},
            r"^faults\.byzantine\.target must be a class, 0\.\.9, got 1e\+300$",
        ),
    ],
)
def test_sampler_d_and_backdoor_options_beyond_range_are_shown_short(tmp_path, extra, expect) -> None:
    # each was refused with its 301 digits in the line
    import fedweave

    cfg = _digits(**extra)
    with pytest.raises(ConfigError, match=expect) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert "1e+300" in str(e.value) and len(str(e.value)) < 200


def test_an_outage_round_far_after_the_last_is_warned_short(tmp_path, caplog) -> None:
    import logging

    import fedweave

    cfg = _digits(faults={"outage_rounds": [10**300]})
    with caplog.at_level(logging.WARNING, logger="fedweave"):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert "faults.outage_rounds [1e+300] are after the last round (1) and never happen" in caplog.text


@pytest.mark.parametrize(
    ("name", "key", "low"),
    [
        ("fedprox", "mu", "["),
        ("hier_fedprox", "mu", "["),
        ("zo_hfl", "mu", "["),  # its lower level's proximal weight
        ("moon", "mu", "["),
        ("fedlc", "tau", "["),
        ("feddyn", "alpha", "("),
        ("fedproto", "lam", "["),
        ("ditto", "lam", "["),
        ("fedasync", "rho", "["),
        ("fedsam", "rho", "("),
        ("fedcm", "sam_rho", "["),
        ("mofedsam", "sam_rho", "["),
    ],
)
def test_loss_coefficients_beyond_float32_are_refused(name: str, key: str, low: str) -> None:
    # each was accepted at 1e300, became inf in float32, and the first round diverged (inf * 0 = NaN) with a line
    # that advised lowering the step sizes
    hp = ALGORITHMS.get(name).Hparams
    with pytest.raises(ConfigError, match=rf"^algorithm\.{key} must be in \{low}0, 3\.40282e\+38\], got 1e\+300$"):
        build_dataclass(hp, {key: 1e300}, "algorithm")
    build_dataclass(hp, {key: 3e38}, "algorithm")  # finite in float32: a strong pull, not a refusal


@pytest.mark.parametrize("make", [lambda: TopK(k=10**300).check(100), lambda: RandK(k=10**300).check(100),
                                  lambda: QSGD(levels=10**300)])  # fmt: skip
def test_compressor_counts_beyond_range_are_shown_short(make) -> None:
    # each was refused with its 301 digits in the line
    with pytest.raises(ConfigError, match=r"1e\+300") as e:
        make()
    assert len(str(e.value)) < 150


@pytest.mark.parametrize(
    "name,key,allowed,largest",
    [
        ("fedexp", "eps", r"\(0, 3\.40282e\+38\]", 3e38),
        ("moon", "tau", r"\(0, 3\.40282e\+38\]", 3e38),
        ("fedlc", "absent_count", r"\(0, 1\]", 1.0),
        ("qffl", "q", r"\[0, 3\.40282e\+38\]", 3e38),
        ("qffl", "lipschitz", r"\(0, 3\.40282e\+38\] \(or null: 1 / local\.lr\)", 3e38),
    ],
)
def test_method_options_that_undo_the_method_are_refused(name: str, key: str, allowed: str, largest: float) -> None:
    # each was accepted at 1e300: FedExP's eps, MOON's tau and FedLC's absent_count (every count lifted to it: equal
    # margins) ran FedAvg under the method's name; q-FFL's q or lipschitz made its first step NaN, and the line
    # advised lowering local.lr
    hp = ALGORITHMS.get(name).Hparams
    with pytest.raises(ConfigError, match=rf"^algorithm\.{key} must be in {allowed}, got 1e\+300$"):
        build_dataclass(hp, {key: 1e300}, "algorithm")
    build_dataclass(hp, {key: largest}, "algorithm")
