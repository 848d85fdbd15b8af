"""The experiments layer's pieces that the reproductions use: named run directories, replacing another
config's run, a time budget, worker initialisers, a parallel map, mean/std and the table writers."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from fedweave.algorithms.centralized.fedavg import FedAvg
from fedweave.experiments.aggregate import finite, if_all, mean_std, to_target
from fedweave.experiments.grid import Point
from fedweave.experiments.jobs import RunFailed, _Progress, finished, parallel_map, run_points, threads_per_worker
from fedweave.experiments.tables import markdown, markdown_table, write_csv
from fedweave.registry import ALGORITHMS


def _points(toy_config, lrs=(0.05, 0.2)) -> list[Point]:
    return [
        Point.of({**toy_config, "rounds": 2, "local": {**toy_config["local"], "lr": lr}}, f"lr{lr}/s3", lr=lr)
        for lr in lrs
    ]


def test_named_points_run_in_their_own_directories_and_are_reused(toy_config, tmp_path):
    pts = _points(toy_config)
    assert [p.slug for p in pts] == ["lr0.05/s3", "lr0.2/s3"] and pts[0].label == "lr=0.05"
    res = run_points(pts, tmp_path, workers=2, progress=False)
    assert list(res) == ["lr0.05/s3", "lr0.2/s3"]
    assert all(r.summary["status"] == "completed" and len(r.metrics) == 2 for r in res.values())
    assert set(finished(pts, tmp_path)) == set(res)
    mtime = (tmp_path / "lr0.2/s3/summary.json").stat().st_mtime_ns
    again = run_points(pts, tmp_path, workers=2, progress=False)
    assert (tmp_path / "lr0.2/s3/summary.json").stat().st_mtime_ns == mtime  # recognised, not rerun
    assert [r.metrics for r in again.values()] == [r.metrics for r in res.values()]


def test_another_configs_run_is_refused_unless_overwrite(toy_config, tmp_path):
    from fedweave.results import RunDirError

    run_points(_points(toy_config, (0.05,)), tmp_path, progress=False)
    other = [Point.of({**toy_config, "rounds": 3}, "lr0.05/s3")]
    with pytest.raises(RunFailed, match="RunDirError: .* already holds a finished run") as e:
        run_points(other, tmp_path, progress=False)
    assert isinstance(e.value.__cause__, RunDirError)
    # what a sweep's user can do: neither --resume nor --overwrite, which `fedweave sweep` does not have
    assert "a sweep never replaces it" in str(e.value) and "--overwrite" not in str(e.value)
    res = run_points(other, tmp_path, progress=False, overwrite=True)
    assert res["lr0.05/s3"].summary["rounds"] == 3


def test_a_moved_folders_finished_runs_are_reused_and_only_they(toy_config, tmp_path):
    # a reproduction names each run's directory in its config (output.dir, by absolute path): after its --out was
    # moved, every finished run was taken for another config's and ran again
    def placed(runs_dir, lr=0.05):
        (pt,) = _points(toy_config, (lr,))
        return Point.of({**pt.config.to_dict(), "output": {"dir": str(runs_dir / pt.slug)}}, pt.slug, lr=lr)

    old, new = tmp_path / "a" / "runs", tmp_path / "b" / "runs"
    first = run_points([placed(old)], old, progress=False)
    (tmp_path / "a").rename(tmp_path / "b")
    mtime = (new / "lr0.05/s3/summary.json").stat().st_mtime_ns
    assert set(finished([placed(new)], new)) == {"lr0.05/s3"}
    again = run_points([placed(new)], new, progress=False, overwrite=True)
    assert (new / "lr0.05/s3/summary.json").stat().st_mtime_ns == mtime  # reused, not rerun
    assert again["lr0.05/s3"].metrics == first["lr0.05/s3"].metrics and again["lr0.05/s3"].run_dir == new / "lr0.05/s3"
    # anything else that differs is still another run: another lr in that directory, or more rounds
    assert finished([Point.of(placed(new, 0.2).config.to_dict(), "lr0.05/s3")], new) == {}
    assert finished([Point.of({**placed(new).config.to_dict(), "rounds": 3}, "lr0.05/s3")], new) == {}


def test_no_run_starts_after_the_budget_but_finished_runs_count(toy_config, tmp_path):
    pts = _points(toy_config)
    run_points(pts[:1], tmp_path, progress=False)
    res = run_points(pts, tmp_path, progress=False, budget_s=0.0)
    assert list(res) == ["lr0.05/s3"] and not (tmp_path / "lr0.2").exists()


def _mark() -> None:
    os.environ["FEDWEAVE_TEST_INITIALISED"] = str(os.getpid())


def _square(x: int) -> tuple[int, str | None, int]:
    import torch

    return x * x, os.environ.get("FEDWEAVE_TEST_INITIALISED"), torch.get_num_threads()


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_a_worker_count_below_one_or_not_whole_is_refused_before_anything_runs(workers, tmp_path):
    from fedweave.config import ConfigError

    ran = []
    with pytest.raises(ConfigError, match=r"workers must be a whole number >= 1"):
        parallel_map(ran.append, [1, 2], workers=workers)
    with pytest.raises(ConfigError, match=r"workers must be a whole number >= 1"):
        run_points([], tmp_path / "runs", workers=workers)
    assert ran == [] and not (tmp_path / "runs").exists()


def test_parallel_map_keeps_the_order_and_initialises_each_worker(monkeypatch):
    monkeypatch.setenv("FEDWEAVE_TEST_INITIALISED", "no")  # restored after the test
    seen = []
    out = parallel_map(_square, list(range(7)), workers=2, initializer=_mark, on_result=lambda i, r: seen.append(i))
    assert [r[0] for r in out] == [x * x for x in range(7)] and sorted(seen) == list(range(7))
    assert all(r[1] not in ("no", str(os.getpid())) for r in out)  # set in the workers, not here
    assert {r[2] for r in out} == {threads_per_worker(2)}
    one = parallel_map(_square, [3], workers=1, initializer=_mark)
    assert one[0][:2] == (9, str(os.getpid()))  # one worker: in this process


def test_mean_std_and_seed_statistics():
    xs = [71.3, 70.1, 72.9]
    assert mean_std(xs) == (float(np.mean(xs)), float(np.std(xs, ddof=1)))
    assert mean_std(xs, ddof=0) == (float(np.mean(xs)), float(np.std(xs)))
    assert mean_std([5.0]) == (5.0, 0.0) and all(math.isnan(v) for v in mean_std([]))
    assert mean_std([1.0, None, 3.0]) == (2.0, math.sqrt(2.0))
    assert finite([1.0, math.nan, math.inf, 2.0]) == ([1.0, 2.0], 2)
    assert if_all([3, 5], max) == 5 and if_all([3, None], max) is None and if_all([], max) is None
    rows = [{"round": 1, "acc": 0.5, "bytes": 10}, {"round": 2, "acc": 0.8, "bytes": 20}]
    assert to_target(rows, "acc", 0.7) == 2 and to_target(rows, "acc", 0.7, "bytes") == 20
    assert to_target(rows, "acc", 0.9) is None


def test_table_writers(tmp_path):
    write_csv(tmp_path / "a.csv", [{"a": 1, "b": 0.123456789, "_curve": [1]}, {"a": 2, "c": "x"}])
    assert (tmp_path / "a.csv").read_text() == "a,b,c\n1,0.123456789,\n2,,x\n"
    write_csv(tmp_path / "b.csv", [{"a": 1, "b": 0.123456789}], columns=["b"], float_format=".3g")
    assert (tmp_path / "b.csv").read_text() == "b\n0.123\n"
    write_csv(tmp_path / "c.csv", [["x", "1.00±0.10"]], columns=["method", "acc"])
    assert (tmp_path / "c.csv").read_text() == "method,acc\nx,1.00±0.10\n"
    assert markdown_table(["m", "acc"], [["x", "1.00"]]) == "| m | acc |\n|---|---|\n| x | 1.00 |\n"
    assert markdown([{"p": "a", "v": 0.5}, {"p": "b", "v": math.nan}], best=0) == (
        "| p | v |\n|---|---|\n| **a** | **0.5000** |\n| b | - |\n"
    )
    # an optimality gap of 1e-5 or a std of 3.2e-3 keeps its digits; a zero std stays 0.0000
    gaps = [{"opt_gap": 1.234567e-5, "std": 0.0032109}, {"opt_gap": -0.05, "std": 0.0}]
    assert markdown(gaps) == "| opt_gap | std |\n|---|---|\n| 1.235e-05 | 0.003211 |\n| -0.0500 | 0.0000 |\n"


def _children(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> bytes:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:  # a zombie waiting to be reaped by init is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads a process's children from /proc")
def test_the_workers_die_with_a_sweep_killed_by_sigkill(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from tests.test_experiments_sweep import DIGITS

    cfg = tmp_path / "digits.yaml"
    cfg.write_text(yaml.safe_dump({**DIGITS, "rounds": 400, "output": {"progress": False, "plots": False}}))
    cmd = [sys.executable, "-m", "fedweave.cli", "sweep", str(cfg), "--grid", "local.lr=0.02,0.05", "--workers", "2"]
    proc = subprocess.Popen([*cmd, "--out", str(tmp_path / "s"), "--no-progress"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            running = len(list((tmp_path / "s").glob("runs/*/metrics.jsonl")))
            own = _cmdline(proc.pid)  # the pool's workers are forks of the sweep's process
            workers = [c for c in _children(proc.pid) if _cmdline(c) == own]
            if running == 2 and len(workers) == 2:  # both workers are part-way through a run
                break
            time.sleep(0.05)
        assert proc.poll() is None and len(workers) == 2, "the sweep never had two runs going"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), f"workers {[w for w in workers if _alive(w)]} outlived the sweep"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_the_progress_bar_counts_the_rounds_of_running_runs(toy_config, tmp_path, capsys):
    import json

    pts = _points(toy_config)  # 2 runs of 2 rounds
    (tmp_path / "lr0.2/s3").mkdir(parents=True)
    (tmp_path / "lr0.2/s3/metrics.jsonl").write_text(json.dumps({"round": 1, "test_accuracy": 0.5}) + "\n")
    bar = _Progress(pts, tmp_path, {"lr0.05/s3"})
    try:  # one run finished (2 rounds), one part-way (1 round)
        assert (bar.bar.n, bar.bar.total) == (3, 4)
    finally:
        bar.close()
    run_points(pts, tmp_path / "again", progress=True)
    err = capsys.readouterr().err
    assert "4/4" in err and "2/2 runs finished" in err


class _FailsAtRound2(FedAvg):
    """FedAvg that fails in round 2 when its lr is 0.2 (a bug in an algorithm, a lost device)."""

    def run_round(self, r: int) -> dict[str, float]:
        if r == 1 and self.ctx.config.local.lr == 0.2:
            raise RuntimeError("the device\nfell over")
        return super().run_round(r)


if "_fedavg_fails" not in ALGORITHMS._items:
    ALGORITHMS.register("_fedavg_fails")(_FailsAtRound2)


def test_a_failing_worker_is_one_line_naming_its_run(toy_config, tmp_path, capsys):
    import yaml

    from fedweave.cli import main as cli_main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**toy_config, "rounds": 3, "algorithm": {"name": "_fedavg_fails"}}))
    argv = ["sweep", str(cfg), "--grid", "local.lr=0.05,0.2", "--workers", "2", "--out", str(tmp_path / "s")]
    assert cli_main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(tmp_path / "s" / "runs" / "local.lr=0.2,seed=3") in err and "point local.lr=0.2, seed 3" in err
    assert "RuntimeError: the device fell over" in err


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc"), reason="forks and reads /proc")
def test_without_prctl_a_worker_watches_its_parent_and_dies_with_it():
    import subprocess
    import sys
    import time

    script = """
import ctypes, os, signal, time
from fedweave.experiments.jobs import _die_with
parent = os.getpid()
armed, tell = os.pipe()
child = os.fork()
if child == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the test waits for the end of the parent's output, not the child's
    os.dup2(null, 2)
    def no_libc(*a, **k):
        raise OSError("no prctl here")
    ctypes.CDLL = no_libc  # as on a system without prctl: the parent-pid watch must do it
    _die_with(parent)
    os.write(tell, b"x")
    time.sleep(60)
    os._exit(0)
os.close(tell)
print(child, os.read(armed, 1) == b"x", flush=True)  # the child's watch is running
os.kill(parent, signal.SIGKILL)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child, armed = out.stdout.split()
    child = int(child)
    assert armed == "True", out.stderr
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, 9)
    assert not alive, "the worker outlived its parent"


def test_workers_divide_the_cores_this_process_may_run_on(monkeypatch):
    # os.cpu_count() counts the whole machine: on 4 cores a batch scheduler gave of 128, 2 workers got 64
    # threads each; the share is the process's CPU affinity
    import fedweave.experiments.jobs as jobs

    monkeypatch.setattr(jobs.os, "cpu_count", lambda: 128)
    monkeypatch.setattr(jobs.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [threads_per_worker(w) for w in (1, 2, 3, 8)] == [4, 2, 1, 1]
    monkeypatch.delattr(jobs.os, "sched_getaffinity")  # a platform without affinity: the machine's cores
    assert threads_per_worker(2) == 64


def test_the_dataset_cache_of_a_worker_never_memoizes_a_loader_of_the_users_files(monkeypatch, tmp_path):
    """``cache_datasets`` memoizes the loaders of a process that runs many points (one worker: the caller's own):
    a libsvm file edited afterwards was never read again in that process, so a resume was refused against the
    checkpoint of the file as it then was (and a new run trained on the old contents). The loaders of the
    user's own files read them every run; the verified downloads' loaders are memoized as before."""
    from fedweave.experiments.jobs import cache_datasets
    from fedweave.registry import DATASETS

    monkeypatch.setattr(DATASETS, "_items", dict(DATASETS._items))  # this process's registry, restored after
    cache_datasets()
    assert not hasattr(DATASETS.get("libsvm"), "cache_info") and not hasattr(DATASETS.get("leaf"), "cache_info")
    assert hasattr(DATASETS.get("digits"), "cache_info") and hasattr(DATASETS.get("mnist"), "cache_info")
    (tmp_path / "a.svm").write_text("".join(f"{i % 2} 1:{i}\n" for i in range(10)))
    first = DATASETS.get("libsvm")(path=str(tmp_path / "a.svm"))
    (tmp_path / "a.svm").write_text("".join(f"{i % 2} 1:{2 * i}\n" for i in range(10)))
    assert not torch.equal(DATASETS.get("libsvm")(path=str(tmp_path / "a.svm")).train_x, first.train_x)
