"""benchmarks/peers.py's pfl-research peer: an interpreter that cannot run pfl is refused in one line, and (where an
environment with pfl is given, ``PFL_PYTHON``) pfl trains what fedweave trains."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers.py"
PFL_PYTHON = os.environ.get("PFL_PYTHON") or (sys.executable if importlib.util.find_spec("pfl") else None)


def _peers(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run([python, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)


def test_a_missing_pfl_python_is_refused_in_one_line():
    out = _peers("--workload", "logistic", "--only", "pfl", "--pfl-python", "/nonexistent/python")
    assert out.returncode == 2
    assert out.stderr.startswith("peers.py: error: --pfl-python /nonexistent/python: cannot run it (")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_a_missing_flower_is_refused_in_one_line_before_anything_runs(tmp_path):
    """Without the bench extra, a Flower configuration used to fail in its child with a traceback, after the
    fedweave configurations before it had run."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["flwr"] = None  # as if not installed\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"), str(ROOT)])}
    args = ["--workload", "logistic", "--rounds", "1", "--only", "fedweave-1t", "flower-2x1"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2
    assert out.stderr == (
        "peers.py: error: flwr is not installed, and flower-2x1 needs it: pip install 'fedweave[bench]', or choose "
        "other configurations with --only\n"
    )
    assert out.stdout == ""


def test_the_summary_names_the_peer_release_each_configuration_measured(monkeypatch):
    sys.path.insert(0, str(ROOT))
    from benchmarks import peers

    assert peers.release("pytest") == f"pytest {pytest.__version__}"  # the installed release, as imported
    run = {"train": [1.0, 1.0], "eval": [0.1, 0.1], "cpu": [1.0], "accuracy": [0.9], "partition": "p0",
           "startup": 1.0, "load": 0.1, "processes": 1, "peak_rss": 0, "peak_pss": 0, "peak_anon": 0,
           "peak_shmem": 0}  # fmt: skip
    results = {
        "fedweave-1t": [dict(run)],
        "flower-2x1": [{**run, "release": "flwr 1.42.0"}, {**run, "release": "flwr 1.42.0"}],
    }
    assert peers.releases(results) == "flower-2x1: flwr 1.42.0"
    monkeypatch.setattr(peers, "train_flops_per_round", lambda workload, rounds: [1e9, 1e9])
    monkeypatch.setattr(peers, "matmul_gflops", lambda threads: 10.0)
    text = peers.summarize("logistic", 2, results, threads=2)
    assert "Peer releases measured: flower-2x1: flwr 1.42.0." in text.splitlines()
    assert "One round only" not in text
    # one round: the times are round 1's, warm-up included, and the table says so (before: labelled a median
    # of rounds 2..R)
    one = {n: [{**r, "train": r["train"][:1], "eval": r["eval"][:1]} for r in runs] for n, runs in results.items()}
    monkeypatch.setattr(peers, "train_flops_per_round", lambda workload, rounds: [1e9])
    assert "One round only: per round, train / eval and CPU per round are round 1's, warm-up included" in (
        peers.summarize("logistic", 1, one, threads=2)
    )


@pytest.mark.skipif(importlib.util.find_spec("pfl") is not None, reason="this environment has pfl")
def test_a_python_without_pfl_is_refused_in_one_line():
    out = _peers("--workload", "mlp", "--only", "fedweave-1t", "pfl-1t", "--pfl-python", sys.executable)
    assert out.returncode == 2
    assert out.stderr.startswith(
        f"peers.py: error: --pfl-python {sys.executable}: cannot import pfl, torch and fedweave"
    )
    assert "No module named 'pfl'" in out.stderr and out.stderr.count("\n") == 1


def _child(name: str, python: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    args = [
        "--child",
        name,
        "--workload",
        "logistic",
        "--rounds",
        "2",
        "--out",
        str(out),
        "--launched",
        repr(time.time()),
    ]
    done = _peers(*args, python=python)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(PFL_PYTHON is None, reason="no environment with pfl-research (set PFL_PYTHON to its python)")
def test_pfl_trains_what_fedweave_trains(tmp_path):
    """Same partition, initial weights, sampled clients and batches: the global model's accuracy after each round
    equals fedweave's but for float rounding (a few of the 10,000 test images)."""
    pfl = _child("pfl-1t", PFL_PYTHON, tmp_path)
    fw = _child("fedweave-1t", sys.executable, tmp_path)
    assert pfl["partition"] == fw["partition"]
    assert len(pfl["accuracy"]) == len(fw["accuracy"]) == 2
    assert pfl["accuracy"] == pytest.approx(fw["accuracy"], abs=5e-4)
