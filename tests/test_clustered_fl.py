"""CFL (Sattler et al. 2021): FedAvg until the split criterion holds, the bipartition by cosine similarity, the
planted clustering recovered, resume across a split, refusals."""

from __future__ import annotations

import pytest
import torch

import fedweave
from fedweave.algorithms.centralized.personal.clustered_fl import bipartition
from fedweave.config import ConfigError, load
from fedweave.runner import run as run_config
from tests.test_centralized import _algo, _cfg
from tests.test_ifca import CLUSTERED, _clustered_cfg, _label_swapped


def _cfl(rounds: int = 10, **opts) -> dict:
    cfg = _clustered_cfg("clustered_fl")
    cfg["rounds"] = rounds
    cfg["algorithm"] = {"name": "clustered_fl", "clients_per_round": CLUSTERED, "warmup": 3, **opts}
    return cfg


def test_without_a_split_it_is_fedavg_bit_for_bit():
    fedavg = _algo({**_cfg("fedavg", clients_per_round=8, weighting="uniform"), "eval": {"personal_test": True}})
    cfl = _algo(_cfg("clustered_fl", clients_per_round=8, warmup=100))
    for r in range(4):
        assert fedavg.run_round(r)["train_loss"] == cfl.run_round(r)["train_loss"]
        assert torch.equal(cfl.models[0], fedavg.x) and len(cfl.models) == 1
    a, b = fedavg.evaluate(4), cfl.evaluate(4)
    assert all(a[k] == b[k] for k in ("test_accuracy", "test_loss", "test_accuracy_min"))


def test_the_bipartition_separates_two_directions_and_lists_position_0_first():
    g = torch.Generator().manual_seed(0)
    u = torch.cat([torch.tensor([1.0, 0.0]) + 0.1 * torch.randn(3, 2, generator=g), torch.tensor([-1.0, 0.2])
                   + 0.1 * torch.randn(4, 2, generator=g)])  # fmt: skip
    u = u[[4, 0, 5, 1, 6, 2, 3]]  # interleaved: positions 1, 3, 5 are the first direction
    unit = u / u.norm(dim=1, keepdim=True)
    first, second = bipartition((unit @ unit.T).numpy())
    assert first.tolist() == [0, 2, 4, 6] and second.tolist() == [1, 3, 5]


def test_cfl_splits_the_planted_clustering_once_past_its_warmup(tmp_path):
    res = fedweave.run(_cfl(eps1=0.2, eps2=1.0), dataset=_label_swapped(), run_dir=tmp_path / "r")
    splits = [m["splits"] for m in res.metrics]
    assert splits == [0, 0, 0, 1, *[0] * 6]  # round 4 is the first past the warmup of 3
    half = CLUSTERED // 2
    assignment = res.algorithm.assignment.numpy()
    assert len(set(assignment[:half])) == 1 and len(set(assignment[half:])) == 1 and assignment[0] != assignment[-1]
    assert res.metrics[2]["test_accuracy"] < 0.6 and res.metrics[-1]["test_accuracy"] > 0.95


def test_no_split_while_no_update_is_longer_than_eps2(tmp_path):
    res = fedweave.run(_cfl(eps1=0.2, eps2=2.0), dataset=_label_swapped(), run_dir=tmp_path / "r")
    assert all(m["clusters"] == 1 for m in res.metrics)


def test_resume_across_splits_continues_identically(tmp_path):
    # eps1 huge, eps2 0: every cluster of more than 2 clients splits each round past the warmup
    cfg = {**_cfg("clustered_fl", rounds=6, clients_per_round=8, warmup=2, eps1=1e9, eps2=0.0)}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    assert [m["clusters"] for m in full.metrics][:4] == [1, 1, 2, 4]
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.models, full.algorithm.models)
    assert torch.equal(resumed.algorithm.assignment, full.algorithm.assignment)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"algorithm": {"name": "clustered_fl", "clients_per_round": 3}}, "splits by every client's update"),
        ({"algorithm": {"name": "clustered_fl", "clients_per_round": 8, "eps1": -1}}, "eps1 and eps2 must be >= 0"),
        ({"faults": {"dropout": 0.2}}, "algorithm 'clustered_fl' does not handle this fault (it handles: none)"),
        ({"privacy": {"mechanism": "central", "noise_multiplier": 1.0, "clip": 1.0}}, "privacy"),
    ],
)
def test_what_cfl_needs_is_checked_in_one_line(change, words, tmp_path):
    cfg = {**_cfg("clustered_fl", clients_per_round=8), **change}
    with pytest.raises(ConfigError) as err:
        fedweave.run(cfg, run_dir=tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_loop_and_vmap_agree_across_splits():
    cfg = _cfg("clustered_fl", rounds=5, clients_per_round=8, warmup=2, eps1=1e9, eps2=0.0)
    algos = [_algo({**cfg, "backend": b}) for b in ("loop", "vmap")]
    for algo in algos:
        for r in range(5):
            algo.run_round(r)
    assert torch.equal(algos[0].assignment, algos[1].assignment) and len(algos[0].models) > 2
    torch.testing.assert_close(algos[0].models, algos[1].models, rtol=1e-5, atol=1e-6)


def test_resume_from_a_checkpoint_written_after_splits_continues_identically(tmp_path):
    # the checkpoint of round 4 holds 4 cluster models where a freshly built run has 1
    cfg = {**_cfg("clustered_fl", rounds=6, clients_per_round=8, warmup=2, eps1=1e9, eps2=0.0)}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 1}}
    part = fedweave.run({**cfg2, "rounds": 4}, run_dir=tmp_path / "part")
    assert len(part.algorithm.models) == 4
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.models, full.algorithm.models)
    assert torch.equal(resumed.algorithm.assignment, full.algorithm.assignment)
    same = [k for k in full.summary["final"] if "seconds" not in k]
    assert [resumed.summary["final"][k] for k in same] == [full.summary["final"][k] for k in same]
