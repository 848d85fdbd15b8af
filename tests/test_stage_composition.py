"""Where a server-pipeline stage (an attack, a robust aggregator, a compressor) would be bypassed by a method's
own server step or messages, the method refuses the stage with one line instead of running without it."""

from __future__ import annotations

import pytest
import torch

import fedweave
from fedweave.config import ConfigError

ATTACK = {"faults": {"byzantine": {"fraction": 0.25, "attack": "sign_flip"}}}
MEDIAN = {"aggregator": "median"}
TOPK = {"compression": {"upload": {"name": "topk", "ratio": 0.5}}}


@pytest.mark.parametrize(
    "algorithm, stage, says",
    [
        ("qfedavg", MEDIAN, "aggregator: median: algorithm 'qfedavg'"),  # sum Delta / sum h: no reduction
        ("qfedavg", ATTACK, "faults.byzantine"),  # the attack would act on rows its server step does not read
        ("qfedavg", TOPK, "compression.upload: algorithm 'qfedavg'"),  # (Delta_k, h_k) pairs
        ("afl", TOPK, "compression.upload: algorithm 'afl'"),  # would quantize the losses lambda's step reads
        ("fedper", TOPK, "compression.upload: algorithm 'fedper'"),  # sends the shared part only
        ("fedasync", MEDIAN, "aggregator: median: algorithm 'fedasync'"),  # one arrival per step
    ],
)
def test_a_stage_the_method_would_bypass_is_refused_with_one_line(toy_config, tmp_path, algorithm, stage, says):
    cfg = {**toy_config, "algorithm": {"name": algorithm, "clients_per_round": 4}, **stage}
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_privacy_and_a_robust_aggregator_together_are_refused_with_one_line(toy_config, tmp_path):
    pytest.importorskip("opacus")
    cfg = {
        **toy_config,
        "algorithm": {"name": "fedavg", "clients_per_round": 4},
        "sampler": "bernoulli",
        "privacy": {"clip": 1.0, "noise_multiplier": 1.0},
        **MEDIAN,
    }
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert "aggregator: median and privacy" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("algorithm", ["proxskip", "clustered_fl"])
@pytest.mark.parametrize(
    "sampling",
    [
        {"sampler": {"name": "schedule", "clients": [[0, 1], [2, 3]]}},
        {"sampler": {"name": "fixed", "clients": [0, 1, 2]}},
        {"sampler": "bernoulli"},
        {"sampler": "power_of_choice"},
    ],
)
def test_a_method_that_needs_every_client_refuses_a_sampler_with_one_line(toy_config, tmp_path, algorithm, sampling):
    """ProxSkip (the zero sum of the h_i) and clustered FL (a split reads every client's update) need all clients
    every round; a sampler section would hand them a subset: refused (before: the run left clients out)."""
    n = toy_config["partition"]["num_clients"]
    cfg = {**toy_config, "algorithm": {"name": algorithm, "clients_per_round": n}, **sampling}
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert str(e.value).startswith(f"sampler: {algorithm} ") and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("sampler", [{"name": "schedule", "clients": [[0, 1], [2, 3]]}, "bernoulli", "power_of_choice"])
def test_the_decentralized_family_refuses_a_sampler_with_one_line(toy_config, tmp_path, sampler):
    """Every peer trains every round (the graph and the method choose whom it hears from): a sampler section
    would be ignored, so it is refused (before: the run went on without it)."""
    algo = {"name": "dfedavg", "topology": "random_regular", "degree": 3, "neighbours": 3}
    with pytest.raises(ConfigError) as e:
        fedweave.run({**toy_config, "algorithm": algo, "sampler": sampler}, run_dir=tmp_path / "r")
    assert str(e.value).startswith("sampler: the decentralized family") and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_sample_level_dp_and_a_robust_aggregator_compose_in_the_star(toy_config):
    """DP-SGD (privacy.level: sample) privatizes every local step at the client, so whatever the server makes of
    the updates is post-processing: the median of the DP-SGD updates is what the server steps with (before: the
    pair was refused as if DP-FedAvg's noised sum were the reduction, Guerraoui et al. 2021's combination)."""
    pytest.importorskip("opacus")
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load
    from fedweave.privacy.sample import AccountedTrainer
    from fedweave.robust.aggregators import Median

    cfg = {**toy_config, "aggregator": "median", "privacy": {"level": "sample", "clip": 1.0, "noise_multiplier": 1.0}}
    algo = build_algorithm(RunContext(load(cfg)))
    assert isinstance(algo.trainer, AccountedTrainer)  # the clients run DP-SGD
    seen = []
    server_update = algo.server_update
    algo.server_update = lambda mean, got: (seen.append((mean.clone(), got.received.clone())), server_update(mean, got))
    for r in range(2):
        algo.run_round(r)
    for mean, updates in seen:
        assert torch.equal(mean, Median()(updates, torch.full((len(updates),), 1 / len(updates)), 0))
    assert algo.privacy.epsilon() > 0


def test_sample_level_dp_and_a_robust_aggregator_compose_in_gossip(toy_config, tmp_path):
    """In the decentralized family DP-SGD is the only level and each peer reduces what it receives: a robust
    aggregator there is the peer's reduction of DP-SGD-trained models (before: refused, naming a server and
    DP-FedAvg's noised sum that the family does not have). Without noise and with a clip no gradient reaches,
    DP-SGD is plain SGD, so the run is the robust gossip run without privacy, to float rounding."""
    pytest.importorskip("opacus")
    algo = {"name": "dfedavg", "neighbours": 3}
    base = {**toy_config, "algorithm": algo, "aggregator": "median"}
    plain = fedweave.run(base, run_dir=tmp_path / "plain").summary["final"]
    dp = {"level": "sample", "clip": 1e6, "noise_multiplier": 0.0}
    private = fedweave.run({**base, "privacy": dp}, run_dir=tmp_path / "dp").summary["final"]
    mean = fedweave.run({**toy_config, "algorithm": algo}, run_dir=tmp_path / "mean").summary["final"]
    assert private["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-5)
    assert abs(mean["test_loss"] - plain["test_loss"]) > 1e-3  # the median is what made the difference
