"""``precision: float64``: every algorithm of every family runs two rounds with float64 models, data, state
and aggregation, and its checkpointed state really is float64; the ledger counts 8 bytes per value."""

from __future__ import annotations

import pytest
import torch

import fedweave
import fedweave.algorithms  # noqa: F401  (registers the algorithms)
from fedweave.checkpoints import floating_tensors
from fedweave.registry import ALGORITHMS

DIGITS = {"name": "digits"}


def family_config(name: str) -> dict:
    """A tiny two-round config of ``name``'s family on real data (digits; CFL's synthetic logistic problem)."""
    family = ALGORITHMS.get(name).family
    base = {"name": f"f64-{name}", "seed": 1, "rounds": 2, "output": {"progress": False, "plots": False}}
    if family == "centralized":
        return {
            **base,
            "dataset": DIGITS,
            "partition": {"name": "iid", "num_clients": 6},
            "model": {"name": "logistic"},
            # proxskip and clustered_fl need every client in every round
            "algorithm": {"name": name, "clients_per_round": 6 if name in ("proxskip", "clustered_fl") else 3},
            "local": {"batch_size": 32, "lr": 0.05},
        }
    if family == "hierarchical":
        algo = {"name": name, "tau": 2, "participation": 0.5}
        if name == "zo_hfl":
            algo["server_batch_size"] = 16
        return {
            **base,
            "dataset": DIGITS,
            "partition": {"name": "iid", "num_clients": 6},
            "model": {"name": "logistic"},
            "algorithm": algo,
            "local": {"batch_size": 32, "lr": 0.05},
        }
    if family == "decentralized":
        return {
            **base,
            "dataset": DIGITS,
            "partition": {"name": "iid", "num_clients": 6},
            "model": {"name": "mlp", "hidden": [8]},
            # PENS keeps the m_top best of the 5 neighbours it samples here (m_top must be below that)
            "algorithm": {"name": name, **({"m_top": 2} if name == "pens" else {})},
            "local": {"batch_size": 32, "lr": 0.05},
        }
    if family == "split":
        return {
            **base,
            "dataset": {"name": "digits", "as_image": True},
            "partition": {"name": "iid", "num_clients": 4},
            "model": {"name": "split_small"},
            "algorithm": {"name": name, **({"h": 2} if name == "cse_fsl" else {})},
            "local": {"batch_size": 32, "lr": 0.05},
        }
    assert family == "confederated"
    return {
        **base,
        "dataset": {"name": "cfl_logreg", "num_samples": 300, "dim": 20, "seed": 1},
        "algorithm": {"name": name, "num_servers": 6, "users_per_server": 5, "batch_size": 2, "graph_seed": 3},
    }


@pytest.mark.parametrize("name", [n for n in ALGORITHMS.names() if not n.startswith("_")])  # not a test's own
def test_every_algorithm_runs_two_rounds_in_float64(name, tmp_path):
    cfg = {**family_config(name), "precision": "float64"}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert res.summary["status"] == "completed" and res.summary["rounds"] == 2
    floats = dict(floating_tensors(res.algorithm.state_dict()))
    assert floats, "the algorithm keeps floating state"
    wrong = {p: t.dtype for p, t in floats.items() if t.dtype != torch.float64}
    assert not wrong, wrong


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "gossip"])
def test_float64_bytes_are_twice_float32(name, tmp_path):
    b32 = fedweave.run(family_config(name), run_dir=tmp_path / "32").summary["communication"]["bytes_total"]
    cfg64 = {**family_config(name), "precision": "float64"}
    b64 = fedweave.run(cfg64, run_dir=tmp_path / "64").summary["communication"]["bytes_total"]
    assert b64 == 2 * b32
