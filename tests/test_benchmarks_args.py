"""The benchmark scripts refuse a bad command line in one line (argparse's usage, then ``error: --FLAG ...``) before
they measure anything: a count of 0 or below used to end in a traceback (``min() arg is an empty sequence``, an
``UnboundLocalError``, ``set_num_threads expects a positive integer``) or, for ``gpu.py --rounds 0``, silently ran
the default."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("batch_plans.py", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("batch_plans.py", ["--threads", "0"], "--threads must be at least 1, got 0"),
    ("batch_plans.py", ["--per-round", "60", "--clients", "50"], "--per-round must be at most --clients (50), got 60"),
    ("engine.py", ["--rounds", "-3"], "--rounds must be at least 1, got -3"),
    ("engine.py", ["--threads", "0"], "--threads must be at least 1, got 0"),
    ("population.py", ["--threads", "0"], "--threads must be at least 1, got 0"),
    ("population.py", ["--rounds", "1"], "--rounds must be at least 2 (the median is of rounds 2..R), got 1"),
    (
        "population.py",
        ["--curve", "1000", "0"],
        "--curve populations must be at least 10 (the clients of a round), got 0",
    ),
    ("population.py", ["--clients", "5"], "--clients must be at least 10 (the clients of a round), got 5"),
    ("population.py", ["--small", "9"], "--small must be at least 10 (the clients of a round), got 9"),
    (
        "population.py",
        ["--curve", "1000", "5"],
        "--curve populations must be at least 10 (the clients of a round), got 5",
    ),
    ("precision.py", ["--reps", "0"], "--reps must be at least 1, got 0"),
    ("precision.py", ["--clients", "0"], "--clients must be in [1, 100] (the clients of the partition), got 0"),
    ("precision.py", ["--model", "nope"], "--model must be one of "),
    ("precision.py", ["--device", "nonsense"], "--device nonsense: device: 'nonsense' is not available"),
    ("step_overhead.py", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("step_overhead.py", ["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    ("split_dropout_eval.py", ["--draws", "0"], "--draws must be at least 1, got 0"),
    ("split_dropout_eval.py", ["--seeds", "0", "-1"], "--seeds must be at least 0 (a run's seed), got -1"),
    ("compression_digits.py", ["--seeds", "0", "--out", "/nonexistent"], "--seeds must be at least 1, got 0"),
    ("compression_digits.py", ["--out", "README.md/o"], "--out README.md/o: cannot make this folder (Not a directory)"),
    ("paper_scale_cost.py", ["--repeats", "0"], "--repeats must be at least 1, got 0"),
    ("paper_scale_cost.py", ["--device", "nonsense"], "--device must be cpu, cuda or cuda:N, got 'nonsense'"),
    ("privacy.py", ["run", "--workers", "0"], "--workers must be at least 1, got 0"),
    ("privacy.py", ["run", "--only", "nothing"], "--only 'nothing' begins no point's label; the labels begin with: "),
    ("peers.py", ["--repeat", "0", "--only", "fedweave"], "--repeat must be at least 1, got 0"),
    ("peers.py", ["--rounds", "0", "--only", "fedweave"], "--rounds must be at least 1, got 0"),
    ("peers.py", ["--json", "/nonexistent/m.json", "--only", "fedweave"], "--json /nonexistent/m.json: its folder"),
    ("gpu.py", ["--rounds", "0", "--device", "cpu", "--quick"], "--rounds must be at least 1, got 0"),
    # limits found only after the measurement, or in a child's traceback
    ("peers.py", ["--json", "benchmarks", "--only", "fedweave"], "--json benchmarks is a folder; give the path of a"),
    ("paper_scale_cost.py", ["--out", "benchmarks"], "--out benchmarks is a folder; give the path of a CSV file"),
    # an existing file was replaced by the new sitting's measurements without a word
    ("peers.py", ["--json", "README.md", "--only", "fedweave"], "--json README.md exists; give a new file"),
    ("paper_scale_cost.py", ["--out", "README.md"], "--out README.md exists; give a new file"),
    ("population.py", ["--clients", "70000"], "--clients must be at most 60000 (MNIST's training samples, one a"),
    ("batch_plans.py", ["--clients", "7000"], "--clients must be at most 6000 (10 of MNIST's 60,000 samples each)"),
    ("precision.py", ["--model", "char_lstm"], "--model char_lstm: model 'char_lstm': input_shape must be"),
    ("deploy_overhead.py", ["--keep", "README.md/x"], "--keep README.md/x: README.md is a file, not a folder"),
    ("accounting.py", ["--clients", "0"], "--clients must be at least 1, got 0"),
    ("accounting.py", ["--rounds", "-1"], "--rounds must be at least 1, got -1"),
]


@pytest.mark.parametrize(("script", "args", "message"), CASES, ids=[f"{s} {' '.join(a)}" for s, a, _ in CASES])
def test_bad_counts_get_one_error_line(script, args, message, capsys, monkeypatch):
    """``python benchmarks/SCRIPT ARGS`` as the interpreter runs it (the file as ``__main__``, its folder first on
    the path, from the checkout), in this process: a fresh interpreter per case spent its time importing torch."""
    path = ROOT / "benchmarks" / script
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    monkeypatch.chdir(ROOT)
    environ = dict(os.environ)  # a script may set its libraries' variables (telemetry off) as it starts
    try:
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    out = capsys.readouterr()
    assert exited.value.code == 2, out.err[-2000:]
    assert "Traceback" not in out.err
    last = out.err.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") or last.startswith(f"{script} run: error: ")
    assert message in last
    assert out.out == ""


@pytest.mark.slow  # a fresh interpreter running the benchmark: about 6 s of CPU
def test_privacy_without_opacus_is_one_line_and_keeps_the_records(tmp_path):
    """The run's ConfigError (Opacus missing) came back from the worker pool as a traceback."""
    records = ROOT / "benchmarks" / "privacy" / "records.json"
    before = records.read_bytes()
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["opacus"] = None  # as if not installed\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"), str(ROOT)])}
    args = ["run", "--only", "DP-FedAvg, C = 0.5, sigma = 0.8", "--out", str(tmp_path / "out")]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "privacy.py"), *args], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        "privacy.py: error: privacy: the accountants need Opacus, an optional dependency; install it with pip install "
        "'fedweave[privacy]'\n"
    )
    assert records.read_bytes() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_a_gpu_peer_without_cuda_is_one_line(capsys, monkeypatch):
    """``peers.py --only flower-gpu-4x0.25`` without a GPU: Flower's actors never started and the simulation waited
    for them until killed."""
    test_bad_counts_get_one_error_line(
        "peers.py", ["--only", "flower-gpu-4x0.25", "--rounds", "1"],
        "--only flower-gpu-4x0.25 needs a CUDA GPU, and torch sees none here", capsys, monkeypatch,
    )  # fmt: skip
