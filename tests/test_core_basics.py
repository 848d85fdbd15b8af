"""Seeding streams, the ledger and the state store."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fedweave.execution import StateStore
from fedweave.ledger import Ledger, direction, nbytes
from fedweave.seeding import Seeds


def test_streams_depend_only_on_identity_not_on_draw_order():
    a, b = Seeds(7), Seeds(7)
    first = a.numpy("batches", 3, 5).random(4)
    b.numpy("client_sampling", 1).random(100)  # drawing another stream first changes nothing
    assert np.array_equal(b.numpy("batches", 3, 5).random(4), first)
    assert not np.array_equal(a.numpy("batches", 3, 6).random(4), first)
    assert not np.array_equal(Seeds(8).numpy("batches", 3, 5).random(4), first)
    t1 = torch.randn(3, generator=a.torch("x", 1))
    assert torch.equal(t1, torch.randn(3, generator=b.torch("x", 1)))


def test_seed_must_be_non_negative_int():
    with pytest.raises(ValueError, match="non-negative"):
        Seeds(-1)


def test_ledger_directions_totals_and_roundtrip():
    led = Ledger()
    led.record(0, "server", "client", "model", 400, 10)
    led.record(0, "client", "server", "model", 400, 10)
    led.record(1, "client", "server", "control", 100, 10)
    led.record(1, "peer", "peer", "model", 50, 2)
    led.record(1, "edge", "edge", "tracker", 30)
    led.store("server", "model", 40)
    led.store("server", "model", 20)
    assert direction("user", "edge") == "up" and direction("edge", "user") == "down"
    assert led.bytes("up") == 500 and led.bytes("down") == 400 and led.bytes("lateral") == 80
    assert led.bytes("up", upto_round=0) == 400
    assert led.bytes(kind="control") == 100 and led.count(kind="model", sender="client") == 10
    s = led.summary()
    assert s["bytes_total"] == 980
    assert s["storage_peak_bytes"]["server"]["model"] == 40
    assert s["by_transfer"]["client->server:control"] == {"bytes": 100, "count": 10}
    copy = Ledger()
    copy.load_state_dict(led.state_dict())
    assert copy.summary() == s
    with pytest.raises(ValueError):
        led.record(0, "a", "b", "c", -1)


def test_nbytes_counts_dtype_sizes():
    assert nbytes(torch.zeros(10), torch.zeros(3, dtype=torch.float64)) == 10 * 4 + 3 * 8


def test_state_store_rows_fill_and_mmap(tmp_path):
    store = StateStore(5, mmap_dir=tmp_path)
    c = store.create("c", 3)
    c[2] += 1.0
    assert store["c"][2].tolist() == [1.0, 1.0, 1.0] and store["c"][1].sum() == 0
    row = torch.arange(4.0)
    m = store.create("momentum", 4, fill=row, mmap=True)
    assert (tmp_path / "momentum.npy").exists() and torch.equal(m[4], row)
    assert store.nbytes() == 5 * 3 * 4 + 5 * 4 * 4
    with pytest.raises(ValueError, match="already exists"):
        store.create("c", 3)
    with pytest.raises(KeyError, match="no client state"):
        store["missing"]


def test_looking_up_an_algorithm_imports_only_the_families_up_to_its_own():
    code = (
        "import sys; from fedweave.registry import ALGORITHMS; ALGORITHMS.get('fedavg'); "
        "print(sorted(m for m in sys.modules if m.count('.') == 2 and m.startswith('fedweave.algorithms.')), "
        "'networkx' in sys.modules); print(len(ALGORITHMS.names()), 'networkx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "['fedweave.algorithms.base', 'fedweave.algorithms.centralized'] False"
    n, networkx = out[1].split()
    assert int(n) > 30 and networkx == "True"  # names() imports every family


def test_cpu_seconds_counts_live_worker_processes():
    from fedweave.memory import cpu_seconds

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)"
    own0, before = time.process_time(), cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.time() + 30
        while cpu_seconds() - before - (time.process_time() - own0) < 0.45 and time.time() < deadline:
            time.sleep(0.05)
        assert cpu_seconds() - before - (time.process_time() - own0) >= 0.45  # the child's CPU, while it lives
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds() - before - (time.process_time() - own0) >= 0.45  # and once it has been waited for
