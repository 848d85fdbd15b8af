"""What a run writes outside its run directory, and the run directory fedweave picks itself.

A run without ``output.dir`` claims its own directory, whatever other runs start beside it; bad input writes
nothing anywhere (no plotting library is imported before the config is checked); the Ray session fedweave
starts keeps its files in a folder of its own that goes with the session, and leaves no process behind; node
data files get the user's usual permissions.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from fedweave.config import load
from fedweave.deploy.node_data import export_clients
from fedweave.results import UMASK, default_run_dir
from fedweave.runner import run

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _same_second() -> None:
    """Wait for the start of the next second, so that what follows falls within one second (one timestamp)."""
    time.sleep(1.0 - time.time() % 1.0)


def test_default_run_dirs_claimed_at_once_are_all_distinct(tmp_path, monkeypatch):
    """Default directories picked in the same second by several runs: each picked the first free name without
    claiming it, so all got the same one (the second run was then refused as 'in use by another fedweave run').
    Each name is now claimed (created) as it is picked."""
    monkeypatch.chdir(tmp_path)
    picked: list[Path] = []
    start = threading.Barrier(4)

    def pick() -> None:
        start.wait()
        picked.append(default_run_dir("tiny", 0))

    threads = [threading.Thread(target=pick) for _ in range(4)]
    _same_second()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(picked)) == 4, picked
    assert all(p.is_dir() and not any(p.iterdir()) for p in picked)
    assert all(re.fullmatch(r"runs/tiny-s0-\d{8}-\d{6}(-[123])?", str(p)) for p in picked), picked


def test_two_runs_without_output_dir_started_together_both_run(toy_config, tmp_path, monkeypatch):
    """Two runs of one config without ``output.dir``, started in the same second from one folder: the second was
    refused (`'runs/toy-s3-...' is in use by another fedweave run`), though fedweave chose the directory itself.
    Each now gets its own, with the same results."""
    monkeypatch.chdir(tmp_path)
    cfg = load({**toy_config, "rounds": 1})
    results, errors = [], []

    def one() -> None:
        try:
            results.append(run(cfg))
        except Exception as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    _same_second()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    dirs = sorted(Path(r.run_dir) for r in results)
    assert len(set(dirs)) == 2, dirs
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [d.name for d in dirs]
    assert all((d / "summary.json").is_file() for d in dirs)
    assert results[0].summary["final_test_accuracy"] == results[1].summary["final_test_accuracy"]


def test_a_config_error_leaves_no_default_run_dir(toy_config, tmp_path, monkeypatch):
    """The default directory is claimed only once the run is built: a config refused before it starts leaves none."""
    monkeypatch.chdir(tmp_path)
    cfg = load({**toy_config, "model": {"name": "logistic", "nosuch": 1}})
    with pytest.raises(Exception, match="nosuch"):
        run(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "argv",
    [["run", "c.yaml", "nosuch.key=1", "--no-progress"], ["sweep", "c.yaml", "nosuch.key=1", "--grid", "local.lr=0.1"],
     ["report", "nosuch"]],
    ids=["run", "sweep", "report"],
)  # fmt: skip
def test_bad_input_writes_no_plotting_cache_or_config(tmp_path, argv):
    """`fedweave run tiny.yaml nosuch.key=1` (and `fedweave sweep`, `fedweave report` of no directory) wrote
    matplotlib's font cache and an empty ~/.config/matplotlib before the input was refused: the command imported
    the plotting first. Bad input writes nothing."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"name": "tiny", "dataset": {"name": "digits"}}))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in ENV.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    done = subprocess.run(
        [sys.executable, "-m", "fedweave.cli", *argv],
        capture_output=True, text=True, env={**env, "HOME": str(home)}, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("fedweave: error:") and "nosuch" in done.stderr, done.stderr
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "home"]


def test_node_data_files_follow_the_umask(toy_config, tmp_path):
    """`fedweave flower-app ... --node-data DIR` wrote each client-N.npz with mode 0600 (a temporary file renamed
    into place); the run's files follow the user's umask, and so do these."""
    paths = export_clients(load(toy_config), tmp_path / "nodes", [0, 1])
    assert [p.stat().st_mode & 0o777 for p in paths] == [0o666 & ~UMASK] * 2
    assert sorted(p.name for p in (tmp_path / "nodes").iterdir()) == ["client-0.npz", "client-1.npz"]


# ---- the Ray session fedweave starts ----------------------------------------------------------------------
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")

# Two runs in one process on the local Ray fedweave starts: 1 worker, then 2 (the session is started again).
# Prints the first session's folder, whether it was still there after the restart, and the second's.
RAY_RUNS = """
import json, sys
import ray
from tests.conftest import TOY_CONFIG
from fedweave.config import load
from fedweave.runner import run

out, seen = sys.argv[1], []
for i, n in enumerate((1, 2)):
    cfg = load({**TOY_CONFIG, "rounds": 1, "backend": "ray", "ray": {"num_workers": n}})
    run(cfg, run_dir=f"{out}/run{i}")
    seen.append(ray._private.worker._global_node.get_session_dir_path())
print(json.dumps({"sessions": seen, "first_left": __import__("os").path.exists(seen[0])}), flush=True)
"""


def _processes_with(env_entry: bytes) -> list[int]:
    """The processes whose environment holds ``env_entry`` (``NAME=value``): this run's Ray processes."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if env_entry in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:  # ended meanwhile, or another user's
                continue
    return found


@pytest.mark.slow  # two local Ray sessions started in a fresh process: about 30 s on two busy cores
@needs_ray
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_local_ray_fedweave_starts_leaves_no_files_or_processes(tmp_path):
    """A run on the local Ray fedweave starts left `$TMPDIR/ray/session_*` (about 120 files: logs, sockets,
    port files) and, once the process had ended, Ray's DashboardAgent and RuntimeEnvAgent for about a minute
    (at exit a trainer's clean-up call started a second Ray session). The session's files are now in a folder
    of fedweave's own, removed when the session is shut down (started again for a larger run, or at exit), and
    no Ray process outlives the run's."""
    import json

    # a short TMPDIR of the test's own: Ray's socket paths under it stay within AF_UNIX's 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="fwr", dir="/tmp"))
    try:
        env = {k: v for k, v in ENV.items() if k != "RAY_TMPDIR"}
        done = subprocess.run(
            [sys.executable, "-c", RAY_RUNS, str(tmp_path)],
            capture_output=True, text=True, env={**env, "TMPDIR": str(tmp)}, cwd=ROOT, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.splitlines()[-1])
        first, second = map(Path, out["sessions"])
        assert first != second and first.is_relative_to(tmp) and second.is_relative_to(tmp), out
        assert not out["first_left"], "the first session's folder outlived its session"
        assert [str(p.relative_to(tmp)) for p in tmp.rglob("*")] == []
        deadline = time.monotonic() + 30  # the session's processes end as it shuts down; give a busy machine time
        while (left := _processes_with(f"TMPDIR={tmp}".encode())) and time.monotonic() < deadline:
            time.sleep(1)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left if Path(f"/proc/{p}").exists()]
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
