"""Bad input end to end: altered or truncated dataset files, code-executing pickles, impossible partitions.

The unit tests of each piece are elsewhere (tests/test_data_sources.py: checksum mismatches in root, cache
and mirrors, truncated gzip; tests/test_datasets.py: the restricted unpickler through the CIFAR loader,
truncated IDX; tests/test_partition.py: each partitioner's limits). These go through ``fedweave.run`` and
the command line, and bound the CPU time of every refusal.
"""

from __future__ import annotations

import gzip
import hashlib
import pickle
import signal
import struct
import time
from contextlib import contextmanager

import numpy as np
import pytest
import yaml

import fedweave
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError
from fedweave.data import sources
from fedweave.data.datasets import cifar

MNIST = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


@contextmanager
def quickly(cpu_seconds: float = 2.0, wall_seconds: int = 60):
    """Fail if the block loops: an alarm after ``wall_seconds``, and a CPU-time bound (load-independent)."""

    def alarm(*_):
        raise TimeoutError(f"still running after {wall_seconds} s: an endless loop?")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(wall_seconds)
    t0 = time.process_time()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.process_time() - t0 < cpu_seconds


@pytest.fixture(autouse=True)
def no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDWEAVE_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise sources.SourceFailed("no network in tests")

    monkeypatch.setattr(sources, "run_command", refuse)
    monkeypatch.setattr(sources, "download", refuse)


def _idx(a: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(np.uint8).tobytes()


@pytest.fixture
def mnist_root(tmp_path, monkeypatch):
    """A small MNIST in the real IDX format (60 train, 20 test images), its digests pinned."""
    rng = np.random.default_rng(0)
    blobs = {
        "train-images-idx3-ubyte": _idx(rng.integers(0, 256, (60, 28, 28))),
        "train-labels-idx1-ubyte": _idx(np.arange(60) % 10),
        "t10k-images-idx3-ubyte": _idx(rng.integers(0, 256, (20, 28, 28))),
        "t10k-labels-idx1-ubyte": _idx(np.arange(20) % 10),
    }
    root = tmp_path / "mnist"
    root.mkdir()
    for name, b in blobs.items():
        (root / name).write_bytes(b)
    table = {n: "sha256:" + hashlib.sha256(b).hexdigest() for n, b in blobs.items()}
    monkeypatch.setitem(sources.CHECKSUMS, "mnist", table)
    return root


def _mnist_config(root, tmp_path, **kw) -> dict:
    return {
        "name": "m",
        "rounds": 1,
        "dataset": {"name": "mnist", "root": str(root)},
        "partition": {"name": "iid", "num_clients": 4},
        "model": {"name": "logistic"},
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "output": {"progress": False, "plots": False, "dir": str(tmp_path / "run")},
        **kw,
    }


def test_the_fixture_itself_runs(mnist_root, tmp_path):
    res = fedweave.run(_mnist_config(mnist_root, tmp_path))
    assert res.summary["status"] == "completed"


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "append"])
def test_a_damaged_dataset_file_fails_its_checksum_naming_the_file_and_the_fix(mnist_root, tmp_path, damage, capsys):
    bad = mnist_root / "train-images-idx3-ubyte"
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_a_byte":
        data[100] ^= 0xFF
    else:
        data += b"\0"
    bad.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="ignoring root="), pytest.raises(sources.DataNotFoundError) as e:
        fedweave.run(_mnist_config(mnist_root, tmp_path))
    msg = str(e.value)
    assert f"checksum mismatch for {bad}" in msg  # which file
    assert hashlib.sha256(bytes(data)).hexdigest() in msg  # what it holds
    assert "fedweave data fetch mnist" in msg  # what to do
    # the command line: exit 2, no traceback
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_mnist_config(mnist_root, tmp_path)))
    with pytest.warns(UserWarning):
        assert cli_main(["run", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedweave: error: ") and str(bad) in err and "Traceback" not in err


# ---- code-executing pickles -------------------------------------------------------------------------
class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _payloads(marker) -> dict[str, bytes]:
    import importlib
    import os
    import subprocess

    cmd = f"touch {marker}"
    return {
        "os.system protocol 2": pickle.dumps({b"data": _Reduce(os.system, cmd)}, protocol=2),
        "subprocess protocol 5": pickle.dumps([_Reduce(subprocess.call, ["touch", str(marker)])], protocol=5),
        "builtins.exec protocol 4": pickle.dumps(_Reduce(exec, f"open({str(marker)!r}, 'w')"), protocol=4),
        "GLOBAL opcode, protocol 0": f"cos\nsystem\n(S'{cmd}'\ntR.".encode(),
        "INST opcode, protocol 0": f"(S'{cmd}'\nios\nsystem\n.".encode(),
        "getattr chain": pickle.dumps(_Reduce(getattr, _Reduce(importlib.import_module, "os"), "system"), protocol=2),
        "numpy.load": pickle.dumps(_Reduce(np.load, str(marker)), protocol=2),
        "gzipped os.system": gzip.compress(pickle.dumps(_Reduce(os.system, cmd), protocol=2)),
    }


@pytest.mark.parametrize("kind", list(_payloads("x")))
def test_crafted_pickles_are_refused_before_any_code_runs(tmp_path, kind):
    marker = tmp_path / "pwned"
    path = tmp_path / ("batch.gz" if kind.startswith("gzipped") else "batch")
    path.write_bytes(_payloads(marker)[kind])
    with quickly(), pytest.raises(cifar.UnsafePickleError, match=f"{path.name}: refusing to load global"):
        cifar.restricted_load(path)
    assert not marker.exists()


def test_a_genuine_batch_layout_still_loads(tmp_path):
    path = tmp_path / "data_batch_1"
    batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 4], b"batch_label": b"x"}
    path.write_bytes(pickle.dumps(batch, protocol=2))
    x, y = cifar.read_batch(path, "labels")
    assert x.shape == (2, 3, 32, 32) and y.tolist() == [3, 4]


# ---- impossible partitions --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "partition, match",
    [
        ({"name": "iid", "num_clients": 61}, r"partition\.num_clients \(61\) exceeds the 60 training samples"),
        ({"name": "dirichlet", "num_clients": 61, "alpha": 0.1}, r"partition\.num_clients \(61\) exceeds"),
        ({"name": "shards", "num_clients": 100}, r"partition\.num_clients"),
        ({"name": "pathological", "num_clients": 100, "classes_per_client": 2}, r"partition\.num_clients"),
        ({"name": "quantity_skew", "num_clients": 100, "alpha": 0.5}, r"partition\.num_clients"),
        ({"name": "dirichlet", "num_clients": 10, "alpha": 0.01, "min_size": 7}, r"partition\.min_size"),
        ({"name": "dirichlet_balanced", "num_clients": 61, "alpha": 0.1}, r"partition\.num_clients"),
        ({"name": "iid", "num_clients": -3}, r"partition\.num_clients must be a positive integer, got -3$"),
        ({"name": "natural", "num_clients": -3}, r"must be a non-negative integer \(0 = one client per natural user\)"),
        ({"name": "iid", "num_clients": "many"}, r"partition\.num_clients"),
        # from_file takes 0 for every client of its file: the message must not ask for a positive integer
        (
            {"name": "from_file", "path": "p.json", "num_clients": -1},
            r"non-negative integer \(0 = every client of partition\.path\)",
        ),
        # left out, it takes every client of the file (as 0 does): the file is what is read next
        ({"name": "from_file", "path": "p.json"}, r"partition\.path must name a JSON or \.npz file"),
        ({"name": "iid", "num_clients": 10.5}, r"partition\.num_clients must be a positive integer, got 10\.5"),
        ({"name": "dirichlet", "num_clients": 5, "alpha": 1, "min_size": 2.5}, r"partition\.min_size .*got 2\.5"),
    ],
)
def test_impossible_partitions_fail_fast_and_clearly(mnist_root, tmp_path, partition, match):
    cfg = _mnist_config(mnist_root, tmp_path, partition=partition)
    with quickly(), pytest.raises(ConfigError, match=match):
        fedweave.run(cfg)


def test_a_whole_number_written_as_a_float_is_an_integer_in_the_partition_too(mnist_root, tmp_path):
    """``rounds: 2.0`` is read as 2 (every integer key of the config); so are the partition's integer options."""
    part = {"name": "dirichlet", "num_clients": 4.0, "alpha": 1, "min_size": 2.0}
    with quickly():
        res = fedweave.run(_mnist_config(mnist_root, tmp_path, partition=part))
    assert res.summary["status"] == "completed" and res.algorithm.ctx.num_clients == 4


def test_dirichlet_at_the_exact_limit_terminates(mnist_root, tmp_path):
    """min_size * num_clients == N with a tiny alpha: the hardest feasible case still ends (by repair)."""
    part = {"name": "dirichlet", "num_clients": 10, "alpha": 0.001, "min_size": 6}
    with quickly(cpu_seconds=10):
        res = fedweave.run(_mnist_config(mnist_root, tmp_path, partition=part))
    assert res.summary["status"] == "completed"
