"""Seeding streams, the ledger, the state store and the registration of the built-in algorithms."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedweave.execution import StateStore
from fedweave.ledger import Ledger, direction, nbytes
from fedweave.seeding import Seeds

SRC = Path(__file__).resolve().parents[1] / "src"


def test_streams_depend_only_on_identity_not_on_draw_order():
    a, b = Seeds(7), Seeds(7)
    first = a.numpy("batches", 3, 5).random(4)
    b.numpy("client_sampling", 1).random(100)  # drawing another stream first changes nothing
    assert np.array_equal(b.numpy("batches", 3, 5).random(4), first)
    assert not np.array_equal(a.numpy("batches", 3, 6).random(4), first)
    assert not np.array_equal(Seeds(8).numpy("batches", 3, 5).random(4), first)
    t1 = torch.randn(3, generator=a.torch("x", 1))
    assert torch.equal(t1, torch.randn(3, generator=b.torch("x", 1)))


def test_seeds_of_many_keys_at_once_are_numpys_seed_sequence():
    """``Seeds.int_seeds`` hashes the keys of a call on arrays: the same seeds, and generators, as one
    ``SeedSequence`` a key, for roots and keys of every word length, negative keys, repeated and mixed keys."""
    rng = np.random.default_rng(1)
    values = [-2, -1, 0, 1, 5, 2**32 - 1, 2**32, 2**33 + 3, 2**63 - 1]
    for trial in range(200):
        root = int(rng.choice([0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**200 + 3, int(rng.integers(0, 2**62))]))
        seeds = Seeds(root)
        width = int(rng.integers(0, 4))
        if trial % 2:  # a call's keys: (round, client, *key), only the client differing
            keys = [(3, int(c), *([7] * width)) for c in rng.integers(0, 10**6, size=int(rng.integers(1, 60)))]
        else:
            keys = [tuple(int(v) for v in rng.choice(values, size=width)) for _ in range(int(rng.integers(0, 9)))]
        got = seeds.int_seeds("batches", keys)
        assert got == [seeds.int_seed("batches", *k) for k in keys]
    gens = Seeds(7).torches("batches", [(2, c) for c in range(5)] + [(2, 4)])
    for g, c in zip(gens, [0, 1, 2, 3, 4, 4]):
        one = Seeds(7).torch("batches", 2, c)
        assert torch.equal(torch.randperm(50, generator=g), torch.randperm(50, generator=one))


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


@pytest.mark.slow  # a fresh interpreter per family: about 6 s of CPU
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


# Run in a fresh interpreter on the package under sys.argv[1]: look every algorithm up as the runner does
# (ALGORITHMS.names(), which imports the families the registry knows), then walk every module file under
# fedweave/algorithms/ and report each Algorithm subclass with a name of its own that the look-up did not
# register, each module file it did not import, and the family subpackages the registry does not know.
REGISTRATION_CHECK = """
import importlib, inspect, json, pkgutil, sys
sys.path.insert(0, sys.argv[1])
from fedweave.registry import ALGORITHM_FAMILIES, ALGORITHMS
registered = {name: ALGORITHMS.get(name) for name in ALGORITHMS.names()}
loaded = set(sys.modules)
import fedweave.algorithms as pkg
from fedweave.algorithms.base import Algorithm
problems = []
families = sorted(i.name for i in pkgutil.iter_modules(pkg.__path__) if i.ispkg)
if families != sorted(ALGORITHM_FAMILIES):
    problems.append(f"families on disk {families}, in fedweave.registry {sorted(ALGORITHM_FAMILIES)}")
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if info.name not in loaded:
        problems.append(f"{info.name} is not imported by its family")
    for cls in vars(importlib.import_module(info.name)).values():
        own = inspect.isclass(cls) and issubclass(cls, Algorithm) and cls.__module__ == info.name
        if own and vars(cls).get("name") and registered.get(cls.name) is not cls:
            problems.append(f"{info.name}.{cls.__name__} ({cls.name!r}) is not registered")
print(json.dumps(problems))
"""


def registration_problems(src: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", REGISTRATION_CHECK, str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_algorithm_module_is_imported_by_its_family_and_registered():
    assert registration_problems(SRC) == []


@pytest.mark.slow  # a copy of the package checked in fresh interpreters: about 6 s of CPU
def test_a_method_file_nobody_imports_fails_the_registration_check(tmp_path):
    shutil.copytree(SRC / "fedweave", tmp_path / "fedweave", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "fedweave" / "algorithms" / "centralized" / "fednew.py").write_text(
        "from fedweave.algorithms.centralized.base import StarAlgorithm\n"
        "from fedweave.registry import ALGORITHMS\n\n\n"
        "@ALGORITHMS.register('fednew')\nclass FedNew(StarAlgorithm):\n    name = 'fednew'\n"
    )
    (tmp_path / "fedweave" / "algorithms" / "newfamily").mkdir()
    (tmp_path / "fedweave" / "algorithms" / "newfamily" / "__init__.py").write_text("")
    assert registration_problems(tmp_path) == [
        "families on disk ['centralized', 'confederated', 'decentralized', 'hierarchical', 'newfamily', 'split'], "
        "in fedweave.registry ['centralized', 'confederated', 'decentralized', 'hierarchical', 'split']",
        "fedweave.algorithms.centralized.fednew is not imported by its family",
        "fedweave.algorithms.centralized.fednew.FedNew ('fednew') is not registered",
        "fedweave.algorithms.newfamily is not imported by its family",
    ]


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


def test_cpu_seconds_counts_what_a_live_worker_has_reaped():
    # a live descendant's finished children (a Ray raylet's exited workers) are in its cutime/cstime: once the
    # worker reaps them, their CPU must not drop out of the total while the worker lives on
    from fedweave.memory import cpu_seconds

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    parent = f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}])\nprint(1, flush=True)\n"
    parent += "time.sleep(60)"
    own0, before = time.process_time(), cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"  # the grandchild burned its CPU and was waited for
        assert cpu_seconds() - before - (time.process_time() - own0) >= 0.45
    finally:
        child.kill()
        child.wait()
