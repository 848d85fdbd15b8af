"""benchmarks/gpu.py: without a GPU it says so and exits 0; with ``--device cpu --quick`` it runs end to end."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from fedweave.execution.placement import available_devices

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)


def _run_here(capsys, monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """The script run as ``__main__`` in this interpreter (what it prints and its exit status, as ``_run``'s),
    without a fresh interpreter's seconds of importing torch: where its output, not its start, is tested."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr()
    return subprocess.CompletedProcess([str(SCRIPT), *args], done.value.code, out.out, out.err)


@pytest.mark.skipif(any(d.startswith("cuda") for d in available_devices()), reason="this machine has a CUDA GPU")
def test_without_a_gpu_it_says_so_and_exits_0(capsys, monkeypatch):
    out = _run_here(capsys, monkeypatch)
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU on this machine (available: cpu" in out.stdout
    assert "nothing measured" in out.stdout


@pytest.mark.slow
def test_it_runs_end_to_end_on_the_cpu():
    """The resnet workload (synthetic CIFAR-shaped data: no download) at float32 and bf16-mixed, and the FedMIM
    projection, tiny (one round: a row's time is round 1's alone, and the table says so)."""
    out = _run("--device", "cpu", "--quick", "--workload", "resnet", "--rounds", "1", "--fedmim-rounds", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "SYNTHETIC, of CIFAR-10's shape (timing only" in text
    rows = (
        "fedweave loop",
        "fedweave vmap",
        "fedweave loop bf16-mixed",
        "fedweave vmap bf16-mixed",
        "hand-written loop",
    )
    for row in rows:
        assert f"| {row} |" in text
    diff = float(re.search(r"after round 1: relative difference ([0-9.e+-]+)", text).group(1))
    assert diff < 1e-4  # the hand-written loop computes what fedweave computes
    assert re.search(r"FedMIM, CIFAR-10 setting .* s a round, .* 1000 rounds \+ 100 evaluations = [0-9.]+ h", text)


def test_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch):
    if "mps" in available_devices():
        pytest.skip("this machine has MPS")
    out = _run_here(capsys, monkeypatch, "--device", "mps", "--quick")
    assert out.returncode == 2
    assert out.stdout.strip().splitlines() == [
        "benchmarks/gpu.py: device: 'mps' is not available on this machine (available: "
        f"{', '.join(available_devices())}); set device: auto or one of those"
    ]


@pytest.mark.parametrize(
    "precision, hand", [("bf16-mixed", "hand-written loop bf16-mixed"), ("float32", "hand-written loop")]
)
def test_the_hand_written_row_names_the_precision_it_ran_in(precision, hand, capsys, monkeypatch):
    """The hand-written loop autocasts as fedweave's first precision does: ``--precision bf16-mixed`` alone
    compares like with like, and its row says so."""
    from fedweave.data.sources import DataNotFoundError, resolve

    try:
        resolve("mnist", offline=True)
    except DataNotFoundError:
        pytest.skip("mnist is not in the data cache (fedweave data fetch mnist)")
    args = ("--device", "cpu", "--quick", "--workload", "mlp", "--rounds", "1", "--no-flower", "--no-projection")
    out = _run_here(capsys, monkeypatch, *args, "--precision", precision)
    assert out.returncode == 0, out.stderr
    assert "One round only: a time per round below is round 1's, warm-up included" in out.stdout  # --rounds 1
    assert (
        f"| {hand} |" in out.stdout
        and f"| fedweave loop{'' if precision == 'float32' else ' ' + precision} |" in out.stdout
    )
