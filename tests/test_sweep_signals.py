"""A sweep's signals (to its own process or its whole group, once or twice), its directory's lock, and its workers'
temporary folder: each run left consistent and resumable, the sweep's line and status those of an interrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from fedweave.cli import main as cli_main
from fedweave.experiments.jobs import parallel_map
from tests.test_experiments_jobs import _alive, _children, _cmdline
from tests.test_experiments_sweep import DIGITS, _read

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads a process's children from /proc")

GRID = ["--grid", "local.lr=0.02,0.05", "--workers", "2"]
ROUNDS = 400  # a run of about 6 s alone: far from its end when it is interrupted after its first rows


def _config(tmp_path: Path, rounds: int = ROUNDS) -> Path:
    cfg = tmp_path / "digits.yaml"
    output = {"progress": False, "plots": False, "checkpoint_every": 5}
    cfg.write_text(yaml.safe_dump({**DIGITS, "rounds": rounds, "output": output}))
    return cfg


def _start(cfg: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedweave.cli", "sweep", str(cfg), *GRID, "--out", str(out), "--no-progress"]
    tmp = cfg.parent / "tmp"  # a sweep killed here leaves its workers' folder in it, not in the system's
    tmp.mkdir(exist_ok=True)
    # its own process group, so that a signal to "the group" reaches the sweep and its workers and nothing else
    return subprocess.Popen(cmd, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip


def _rows(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_bytes().splitlines())
    except OSError:
        return 0


def _workers(proc: subprocess.Popen) -> list[int]:
    own = _cmdline(proc.pid)  # the pool's workers are forks of the sweep's process
    return [c for c in _children(proc.pid) if _cmdline(c) == own]


def _both_running(proc: subprocess.Popen, out: Path, rows: int = 10) -> list[int]:
    """Wait until both runs are part-way (``rows`` rows each, a checkpoint written); the sweep's workers."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        runs = [r for r in out.glob("runs/*") if (r / "checkpoint.pt").is_file()]
        workers = _workers(proc)
        if len(runs) == 2 and min(map(_rows, runs)) >= rows and len(workers) == 2:
            return workers
        time.sleep(0.05)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    pytest.fail(f"the sweep never had two runs going: {err.decode()[-2000:]}")


def _ended(proc: subprocess.Popen, workers: list[int], within: float, what: str) -> str:
    """The sweep's stderr once it ended within ``within`` s, its workers gone with it."""
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=60)
        pytest.fail(f"the sweep did not end within {within:.0f} s of {what}")
    finally:
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [w for w in workers if _alive(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived the sweep"
    return err.decode()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("uninterrupted")
    assert cli_main(["sweep", str(_config(d)), *GRID, "--out", str(d / "s"), "--no-progress"]) == 0
    return d / "s"


def _resumes_to(out: Path, cfg: Path, uninterrupted: Path) -> None:
    assert cli_main(["sweep", str(cfg), *GRID, "--out", str(out), "--no-progress"]) == 0
    assert _read(out / "sweep.csv") == _read(uninterrupted / "sweep.csv")
    assert _read(out / "summary.csv") == _read(uninterrupted / "summary.csv")


@pytest.mark.slow  # two sweeps of two 400-round runs on 2 workers, one interrupted: about 20 s
@pytest.mark.parametrize(
    ("sig", "to"),
    [
        (signal.SIGTERM, "process"),  # `kill PID`, a scheduler, `docker stop`: before, the runs went to their end
        (signal.SIGINT, "process"),
        (signal.SIGINT, "group"),  # Ctrl-C in a terminal: the workers get it too, and once only
    ],
)
def test_a_signal_interrupts_the_runs_in_progress_and_the_rerun_equals_an_uninterrupted_sweep(
    sig, to, tmp_path, uninterrupted
):
    cfg, out = _config(tmp_path), tmp_path / "s"
    proc = _start(cfg, out)
    workers = _both_running(proc, out)
    if to == "group":
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    err = _ended(proc, workers, 60, f"its {sig.name}")
    status = 143 if sig == signal.SIGTERM else 130
    assert proc.returncode == status, err
    assert err.strip().splitlines() == [f"fedweave: interrupted{': terminated' if status == 143 else ''}"], err
    for run in out.glob("runs/*"):
        summary = json.loads((run / "summary.json").read_text())
        # the round in progress abandoned, the run's directory as a single run's interrupt leaves it
        assert summary["status"] == "interrupted", (run.name, summary["status"], summary["rounds"])
        assert f"stopped by {sig.name}" in summary["error"] and summary["rounds"] < ROUNDS
        assert summary["rounds"] == _rows(run)
    assert not (out / "sweep.csv").exists()
    _resumes_to(out, cfg, uninterrupted)


@pytest.mark.slow  # as above, with a second SIGTERM
def test_a_second_sigterm_while_the_sweep_shuts_down_ends_it_at_once(tmp_path, uninterrupted):
    # before: the second signal left the process waiting for good on an idle worker in the pool's shutdown
    cfg, out = _config(tmp_path), tmp_path / "s"
    proc = _start(cfg, out)
    workers = _both_running(proc, out)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)  # (before, the runs went on meanwhile: the second came while the pool shut down)
    proc.send_signal(signal.SIGTERM)
    err = _ended(proc, workers, 60, "its second SIGTERM")
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["fedweave: interrupted: terminated"], err
    assert not (out / "sweep.csv").exists()
    _resumes_to(out, cfg, uninterrupted)  # the runs, interrupted or killed part-way, resume


SLOW_TO_STOP = """
import sys, time
from fedweave.experiments.jobs import parallel_map

def work(x):
    try:
        time.sleep(600)
    except KeyboardInterrupt:  # a job whose interruption takes long (a tracker's upload, say)
        print("interrupted", flush=True)
        time.sleep(600)

print("started", flush=True)
parallel_map(work, [1, 2], workers=2)
"""


def _lines(proc: subprocess.Popen, n: int, within: float) -> list[str]:
    """Up to ``n`` lines of ``proc``'s stdout, as many as came within ``within`` s."""
    import selectors

    got, buf, deadline = [], b"", time.monotonic() + within
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(got) < n and (left := deadline - time.monotonic()) > 0:
            if not sel.select(left) or not (chunk := os.read(proc.stdout.fileno(), 4096)):
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            got += [line.decode() for line in lines]
    return got


def test_a_second_signal_ends_jobs_slow_to_stop_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TO_STOP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).parents[1], start_new_session=True)  # fmt: skip
    workers: list[int] = []
    try:
        assert _lines(proc, 1, 120) == ["started"]
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = _workers(proc)
            time.sleep(0.05)
        assert len(workers) == 2, "the pool never had two workers"
        time.sleep(0.5)  # both jobs started (a worker interrupted before its job starts does not start it)
        proc.send_signal(signal.SIGINT)  # to this process alone: each job hears of it
        assert _lines(proc, 2, 30) == ["interrupted"] * 2, "the jobs never heard of the signal"
        proc.send_signal(signal.SIGINT)
        err = _ended(proc, workers, 30, "its second SIGINT")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err


@pytest.mark.slow  # a sweep held running while another is refused
def test_a_second_sweep_on_the_same_out_is_refused_before_it_writes_anything(tmp_path, capsys):
    # before: a sweep of another grid ran beside the first, its sweep.json over the first's, the tables mixed
    out = tmp_path / "s"
    proc = _start(_config(tmp_path, rounds=100_000), out)
    try:
        workers = _both_running(proc, out, rows=1)
        before = {p: p.read_bytes() for p in out.iterdir() if p.is_file()}
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump({**DIGITS, "rounds": 2}))
        capsys.readouterr()
        assert cli_main(["sweep", str(other), "--grid", "local.lr=0.1", "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [
            f"fedweave: error: --out: {out} is in use by another fedweave sweep (process {proc.pid}); wait for it "
            "to end or give another --out"
        ], err
        assert {p: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
        assert sorted(p.name for p in out.glob("runs/*")) == ["local.lr=0.02,seed=7", "local.lr=0.05,seed=7"]
    finally:
        proc.kill()
    _ended(proc, workers, 60, "its SIGKILL")


def _square(x: int) -> int:
    return x * x


@pytest.mark.slow  # a sweep killed with SIGKILL while another one runs
def test_a_killed_sweeps_worker_folder_is_removed_by_the_next_and_a_running_ones_kept(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"  # the sweeps' temporary directory (_start)
    running = _start(_config(tmp_path, rounds=100_000), tmp_path / "a")
    killed = None
    try:
        workers = _both_running(running, tmp_path / "a", rows=1)
        (kept,) = tmp.glob("fedweave-workers-*")
        killed = _start(_config(tmp_path, rounds=100_000), tmp_path / "b")
        gone = _both_running(killed, tmp_path / "b", rows=1)
        (stale,) = set(tmp.glob("fedweave-workers-*")) - {kept}
        killed.kill()
        _ended(killed, gone, 60, "its SIGKILL")
        assert stale.is_dir()  # SIGKILL runs no clean-up of its own
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        assert parallel_map(_square, [1, 2, 3], workers=2) == [1, 4, 9]
        # the killed sweep's folder went, the running one's stayed (and this one's own went as it ended)
        assert sorted(tmp.glob("fedweave-workers-*")) == [kept] and running.poll() is None
        assert all(map(_alive, workers))
    finally:
        running.kill()
        if killed is not None and killed.poll() is None:
            killed.kill()
    _ended(running, workers, 60, "its SIGKILL")
