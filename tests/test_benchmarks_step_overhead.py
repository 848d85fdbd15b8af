"""benchmarks/step_overhead.py: fedweave's training rate and the matmul rate it is compared with count the same
FLOPs, those of the products a local step computes (no input gradient at the first layer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ``benchmarks`` importable
from benchmarks import step_overhead  # noqa: E402


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def test_step_flops_count_the_products_a_step_computes():
    # forward x W^T and weight gradient dz^T h at every layer, the input gradient dz W only above the first:
    # 2 FLOPs per multiply-add
    assert step_overhead.step_flops(_mlp()) == 2 * 784 * 64 * 2 + 2 * 64 * 10 * 3
    assert step_overhead.step_flops(torch.nn.Linear(784, 10)) == 2 * 784 * 10 * 2


def test_the_matmul_rate_counts_the_same_flops(monkeypatch):
    """The rate is the FLOPs of the products it timed over their time: with a clock that advances 1 s a reading,
    each timed run is 20 steps in 2 s, so the rate times 0.1 s is the FLOPs counted for one step of ``batch``
    rows (per job, or of every job at once for ``bmm``), which must be what the training rate counts for them."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(step_overhead.time, "perf_counter", lambda: float(next(ticks)))
    model, batch, jobs = _mlp(), 10, 3
    for batched in (False, True):
        rate = step_overhead.matmul_rate(model, batch, jobs, batched, seconds=1.5)
        rows = batch * (jobs if batched else 1)
        assert rate * 1e9 * 0.1 == pytest.approx(rows * step_overhead.step_flops(model), rel=1e-12)
