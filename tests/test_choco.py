"""CHOCO-SGD (Koloskova, Stich, Jaggi 2019, Alg. 2): the exact special case, CHOCO-Gossip's consensus with a
compressed Q and the preserved average, the ledger's encoded bytes, resume and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm, with_local
from fedweave.config import ConfigError, load
from fedweave.runner import run as run_config
from fedweave.topology.graph import gossip, metropolis_weights
from tests.test_decentralized import config


def _choco(compression: dict | None = None, **opts):
    cfg = config("choco_sgd", topology="ring", **opts)
    if compression is not None:
        cfg["compression"] = {"upload": compression}
    return build_algorithm(RunContext(load(cfg)))


def test_exact_messages_and_gamma_1_are_dfedavg_with_metropolis_mixing():
    """Q = identity: x̂ becomes x^{+}, and x^{+} + (W x̂ - x̂) = W x^{+}, DFedAvg's train-then-mix step."""
    choco = _choco()
    dfedavg = build_algorithm(RunContext(load(config("dfedavg", topology="ring", mixing="metropolis"))))
    for r in range(3):
        choco.run_round(r)
        dfedavg.run_round(r)
        torch.testing.assert_close(choco.W, dfedavg.W, rtol=1e-5, atol=1e-6)
    public = choco.store["public"]  # x̂ = the last x^{+}, so the models are its Metropolis mix
    torch.testing.assert_close(choco.W, gossip(public, metropolis_weights(choco.graph)), rtol=1e-5, atol=1e-6)
    assert choco.ledger.bytes(kind="model_delta") == dfedavg.ledger.bytes(kind="model")  # same messages, dense


def test_compressed_gossip_keeps_the_average_and_reaches_consensus():
    """No training (lr 0): CHOCO-Gossip on a ring with top-10% and gamma 0.2. The average of the models is kept
    (W doubly stochastic), and the distance to it shrinks by orders of magnitude (Koloskova et al., Thm. 2)."""
    algo = _choco({"name": "topk", "ratio": 0.1}, gamma=0.2)
    g = torch.Generator().manual_seed(0)
    start = torch.randn(algo.W.shape, generator=g, dtype=algo.W.dtype)
    algo.commit("model", start)
    algo.trainer = with_local(algo.trainer, lr=0.0)
    mean = start.mean(0)

    def spread() -> float:
        return float((algo.W - algo.W.mean(0)).norm())

    first = spread()
    for r in range(300):
        algo.run_round(r)
    torch.testing.assert_close(algo.W.mean(0), mean, rtol=0, atol=1e-5)
    assert spread() < 1e-3 * first


def test_the_ledger_bills_each_encoded_message_once_per_neighbour():
    algo = _choco({"name": "topk", "k": 5})
    algo.run_round(0)
    d = algo.layout.numel
    per_message = math.ceil(5 * (math.ceil(math.log2(d)) + 32) / 8)  # k indices of ceil(log2 d) bits, k floats
    ring_messages = 8 * 2
    assert algo.ledger.count(kind="model_delta") == ring_messages
    assert algo.ledger.bytes(kind="model_delta") == ring_messages * per_message


def test_efsign_and_unscaled_randk_train_and_resume_identically(tmp_path):
    for compression in ({"name": "efsign"}, {"name": "randk", "ratio": 0.2, "error_feedback": True}):
        cfg = {**config("choco_sgd", rounds=4, topology="ring", gamma=0.5), "compression": {"upload": compression}}
        full = fedweave.run(cfg, run_dir=tmp_path / f"{compression['name']}-full")
        part_cfg = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
        part = tmp_path / f"{compression['name']}-part"
        fedweave.run({**part_cfg, "rounds": 2}, run_dir=part)
        resumed = run_config(load(part_cfg), run_dir=part, resume=True)
        assert torch.equal(resumed.algorithm.W, full.algorithm.W)
        assert torch.equal(resumed.algorithm.store["public"], full.algorithm.store["public"])
        assert math.isfinite(full.final_accuracy)


@pytest.mark.parametrize(
    "compression, opts, faults, expect",
    [
        ({"name": "qsgd"}, {}, None, "choco_sgd needs a contraction for Q"),
        ({"name": "randk", "ratio": 0.2}, {}, None, "'randk' as configured is unbiased"),
        (None, {"gamma": 0.0}, None, "algorithm.gamma must be in (0, 1]"),
        (None, {"neighbours": 3}, None, "algorithm.neighbours: choco_sgd talks to every graph neighbour"),
        (None, {"dp_sigma": 1.0, "dp_mode": "exchange"}, None, "algorithm.dp_mode 'exchange': choco_sgd"),
        (None, {}, {"link_loss": 0.1}, "algorithm 'choco_sgd' does not handle this fault"),
    ],
)
def test_refusals_are_one_line(compression, opts, faults, expect, tmp_path):
    cfg = config("choco_sgd", topology="ring", **opts)
    if compression is not None:
        cfg["compression"] = {"upload": compression}
    if faults is not None:
        cfg["faults"] = faults
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert expect in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_a_lossless_q_is_exact_gossip_bit_for_bit():
    """Q = top-k with k = d sends every coordinate at its float bits, so q_i = x_i^{+} - x̂_i exactly and every
    public copy and model equals the run without a compressor bit for bit, for any gamma (Alg. 2 with Q the
    identity); only the bytes differ: k indices and k values per message instead of the dense row."""
    exact, full = _choco(gamma=0.5), _choco({"name": "topk", "ratio": 1.0}, gamma=0.5)
    for r in range(3):
        exact.run_round(r)
        full.run_round(r)
        assert torch.equal(exact.W, full.W)
        assert torch.equal(exact.store["public"], full.store["public"])
    d = full.layout.numel
    per_message = math.ceil(d * (math.ceil(math.log2(d)) + 32) / 8)
    assert full.ledger.bytes(kind="model_delta") == 3 * 8 * 2 * per_message  # 3 rounds, 8 nodes, 2 ring neighbours
