"""Large populations: memory-mapped client state is lazy, sparse and computes what RAM-held state computes; a
partition is one index array and offsets, with the index sets the per-client lists had."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from benchmarks.population import memory_mapped
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.centralized import scaffold
from fedweave.config import LocalConfig, load
from fedweave.data.partition import Partition, iid, shards
from fedweave.execution import LocalTrainer, StateStore
from fedweave.registry import PARTITIONERS
from fedweave.seeding import Seeds


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


# ---- compact partitions: one index array and offsets, the same index sets as the per-client lists before ----

NUM_CLASSES = 10
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(NUM_CLASSES), 200 + 10 * np.arange(10)))
USERS = np.random.default_rng(7).integers(0, 60, len(LABELS))
DIGEST_CASES = {
    "iid": {},
    "dirichlet": {"alpha": 0.3},
    "dirichlet_balanced": {"alpha": 0.3},
    "pathological": {"classes_per_client": 3},
    "shards": {"shards_per_client": 2},
    "quantity_skew": {"alpha": 0.5},
    "quantity_skew_sigma": {"sigma": 1.0},
    "natural": {"select": "random"},
    "dirichlet_repair": {"alpha": 0.05, "min_size": 40, "max_attempts": 2},
}


def _digest(parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        p = np.asarray(p)
        assert p.dtype == np.int64
        h.update(len(p).to_bytes(8, "little"))
        h.update(p.tobytes())
    return h.hexdigest()


def test_every_partitioner_gives_the_index_sets_of_the_per_client_lists_before():
    """tests/data/partition_digests.json holds, per partitioner, seed and number of clients, a digest of the
    per-client index arrays computed by the list-returning partitioners (commit b3c5d48, before Partition)."""
    expected = json.loads((Path(__file__).parent / "data" / "partition_digests.json").read_text())
    got = {}
    for case, opts in DIGEST_CASES.items():
        name = case.split("_sigma")[0].split("_repair")[0]
        for seed in (0, 1, 2):
            for m in (7, 20, 50):
                parts = PARTITIONERS.get(name)(LABELS, m, np.random.default_rng(seed), users=USERS, **opts)
                assert isinstance(parts, Partition)
                got[f"{case} seed={seed} m={m}"] = _digest(parts)
    assert got == expected


# The list-building code these partitioners had before (kept here to compare against, on many seeds).
def _old_iid(labels, m, rng):
    return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(len(labels)), m)]


def _old_shards(labels, m, rng, s):
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    pieces = np.array_split(order, m * s)
    deal = rng.permutation(m * s).reshape(m, s)
    return [np.sort(np.concatenate([pieces[k] for k in row])).astype(np.int64) for row in deal]


@pytest.mark.parametrize("seed", range(12))
def test_iid_and_shards_equal_the_old_per_client_lists(seed):
    g = np.random.default_rng(seed)
    n = int(g.integers(50, 3000))
    labels = g.integers(0, int(g.integers(1, 12)), n)
    m = int(g.integers(1, n // 4 + 1))
    for new, old in (
        (iid(labels, m, np.random.default_rng(seed)), _old_iid(labels, m, np.random.default_rng(seed))),
        (shards(labels, m, np.random.default_rng(seed)), _old_shards(labels, m, np.random.default_rng(seed), 2)),
    ):
        assert len(new) == len(old)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(new, old, strict=True))


def test_a_partition_behaves_like_the_list_of_index_arrays():
    arrays = [np.array([4, 9]), np.array([], dtype=np.int64), np.array([0, 1, 7]), np.array([3])]
    p = Partition.of(arrays)
    assert len(p) == 4 and p.sizes.tolist() == [2, 0, 3, 1]
    assert all(np.array_equal(a, b) for a, b in zip(p, arrays, strict=True))
    assert np.array_equal(p[-1], [3]) and np.array_equal(p[2], [0, 1, 7]) and p[1].dtype == np.int64
    with pytest.raises(IndexError):
        p[4]
    assert [x.tolist() for x in p[1:3]] == [[], [0, 1, 7]] and len(p[3:1]) == 0
    assert [x.tolist() for x in p[::2]] == [[4, 9], [0, 1, 7]]
    assert len(p + [np.array([5])]) == 5 and Partition.of(p) is p
    t = p.as_torch()
    assert isinstance(t[2], torch.Tensor) and t[2].tolist() == [0, 1, 7]
    assert t.indices.data_ptr() == p.indices.ctypes.data  # no copy
    assert np.array_equal(t.as_numpy()[0], [4, 9])


def test_a_large_partition_costs_8_bytes_a_client_and_8_a_sample_in_the_partitioner_and_the_trainer():
    n, m = 400_000, 200_000
    labels = np.zeros(n, dtype=np.int64)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    parts = iid(labels, m, np.random.default_rng(0))
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert kept <= 8 * (n + m + 1) + 4096, f"{kept / m:.0f} bytes a client"  # the lists took ~140 a client
    assert sorted(parts[m - 1].tolist()) == parts[m - 1].tolist() and len(np.concatenate(list(parts[:10]))) == 20
    x, y = torch.zeros(n, 2), torch.zeros(n, dtype=torch.long)
    trainer = LocalTrainer(torch.nn.Linear(2, 2), x, y, parts, LocalConfig(steps=1, batch_size=2), Seeds(0))
    assert isinstance(trainer.parts.indices, torch.Tensor)
    assert trainer.parts.indices.data_ptr() == parts.indices.ctypes.data  # the trainer shares the partition's


def test_peak_memory_sees_a_transient_allocation_of_the_process_tree():
    from fedweave.memory import PeakMemory

    with PeakMemory(interval=0.01) as mem:
        base = mem.peak["rss"]
        block = torch.ones(96 * 2**20 // 4)  # 96 MB, written (so resident), then freed before the peak is read
        time.sleep(0.1)
        del block
    assert mem.peak["rss"] - base >= 80 * 2**20 and mem.peak["pss"] >= mem.peak["anon"] > 0 and mem.processes >= 1


def test_peak_memory_keeps_each_processs_own_peak():
    """Per process, so that a regression shows where it lives: a child's transient allocation raises the child's
    peak, not this process's."""
    import subprocess
    import sys

    from fedweave.memory import PeakMemory

    child = "import time; b = b'x' * (64 * 2**20); time.sleep(0.6)"  # 64 MB written, so resident
    with PeakMemory(interval=0.02) as mem:
        subprocess.run([sys.executable, "-c", child], check=True)
    me, *others = mem.per_process
    assert me == os.getpid() and others
    child_peak = max(mem.per_process[p]["rss"] for p in others)
    assert child_peak >= 60 * 2**20 and mem.per_process[me]["rss"] > 0
    assert mem.peak["rss"] > child_peak  # the tree's sum holds both


def test_the_flatness_ratio_divides_the_two_runs_even_for_equal_populations(monkeypatch, capsys):
    """benchmarks/population.py (b): with ``--small`` equal to ``--clients`` the two runs' medians were kept under
    one key, so the second overwrote the first and the ratio printed 1.000 whatever they measured."""
    from benchmarks import population

    mem = {"VmRSS": 2**30, "RssAnon": 2**29, "RssFile": 2**29, "VmHWM": 2**30}
    times = iter([[9.0, 1.0, 1.0], [9.0, 3.0, 3.0]])  # (b)'s two runs: medians of rounds 2..R 1.0 and 3.0

    def launch(kind, clients, rounds, threads):
        if kind == "scaffold-mmap":
            return {"clients": clients, "params": 10, "store_bytes": 0, "disk_bytes": 0, "rows_written": 0,
                    "before": mem, "built": mem, "after": mem, "round_times": [1.0, 1.0]}  # fmt: skip
        return {"after": mem, "round_times": next(times)}

    monkeypatch.setattr(population, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["population.py", "--rounds", "3", "--clients", "10", "--small", "10"])
    population.main()
    assert "ratio 10 / 10 clients: 3.000" in capsys.readouterr().out
