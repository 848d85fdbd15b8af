"""Large populations: memory-mapped client state is lazy, sparse and computes what RAM-held state computes."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch

from benchmarks.population import memory_mapped
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.centralized import scaffold
from fedweave.config import load
from fedweave.execution import StateStore


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def _rss_file() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


def test_a_new_memory_mapped_table_is_neither_written_nor_paged_in(tmp_path):
    store = StateStore(20_000, mmap_dir=tmp_path)
    before = _rss_file()
    c = store.create("c", 5_000, mmap=True)  # 400 MB of zeros
    assert store.nbytes("c") == 20_000 * 5_000 * 4
    assert _allocated(tmp_path / "c.npy") < 2**20  # a sparse file: no block written
    assert _rss_file() - before < 16 * 2**20  # and nothing paged in
    rows = torch.tensor([3, 19_999])
    assert float(c[rows].abs().sum()) == 0.0
    c[rows] = 1.5
    assert _allocated(tmp_path / "c.npy") < 2**20  # two rows written, two pages allocated
    assert torch.equal(c[rows], torch.full((2, 5_000), 1.5))


def test_memory_mapped_tables_still_take_a_nonzero_fill(tmp_path):
    store = StateStore(4, mmap_dir=tmp_path)
    row = torch.arange(3, dtype=torch.float32)
    assert torch.equal(store.create("a", 3, fill=row, mmap=True), row.expand(4, 3))
    assert torch.equal(store.create("b", 2, fill=2.0, mmap=True), torch.full((4, 2), 2.0))


def _scaffold(toy_config: dict, mmap_dir: Path | None):
    cfg = load({**toy_config, "algorithm": {"name": "scaffold", "clients_per_round": 4}, "rounds": 3})
    ctx = RunContext(cfg)
    if mmap_dir is None:
        return build_algorithm(ctx)
    with mock.patch.object(scaffold, "StateStore", memory_mapped(scaffold.StateStore, mmap_dir)):
        return build_algorithm(ctx)


def test_scaffold_with_memory_mapped_control_variates_equals_scaffold_in_ram(toy_config, tmp_path):
    ram, mapped = _scaffold(toy_config, None), _scaffold(toy_config, tmp_path)
    assert (tmp_path / "c.npy").is_file()
    sampled = set()
    for r in range(3):
        ram.run_round(r)
        mapped.run_round(r)
        sampled |= set(mapped.sample_clients(r).tolist())
    torch.testing.assert_close(mapped.store["c"], ram.store["c"], rtol=0, atol=0)
    torch.testing.assert_close(mapped.x, ram.x, rtol=0, atol=0)
    written = set((mapped.store["c"] != 0).any(1).nonzero().squeeze(1).tolist())
    assert written == sampled  # a round touches the state of its clients only
