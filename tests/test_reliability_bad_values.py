"""Bad values in files and odd moments (docs/reliability.md, "What each bad input gets"): YAML that nests,
aliases or merges, sweep files, partition and weight files, plug-ins that exit, precisions a family cannot
honour, and Ctrl-C or SIGTERM before, during and after a run. Each ends in one line naming the key or file,
status 2 (an interrupt: 130 or 143), no traceback and nothing written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_reliability_bad_input import BASE as SHARED_BASE

from fedweave.cli import main as cli_main
from fedweave.config import load

BASE = SHARED_BASE  # the reliability tests' tiny FedAvg run
SRC = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's source, first on the children's path


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A working directory holding only the config file: anything else found there afterwards was written
    by the command."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "c.yaml").write_text(yaml.safe_dump(BASE))
    return work


@pytest.fixture
def wall_clock():
    """Fail (rather than hang) a test that takes more than 30 s of wall-clock time."""

    def alarm(signum, frame):
        raise TimeoutError("took more than 30 s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _one_line_error(capsys, code: int, *expect: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("fedweave: error: "), err
    for text in expect:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def _write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return path.name


# ---- YAML: nesting, aliases, merge keys, duplicate keys -------------------------------------------------
def test_deep_nesting_in_a_config_file_is_one_line(in_tmp, capsys):
    (in_tmp / "n.yaml").write_text(yaml.safe_dump(BASE) + "extra: " + "[" * 20_000 + "\n")
    _one_line_error(capsys, cli_main(["run", "n.yaml"]), "n.yaml", "YAML nested deeper than 100 levels")
    assert _files(in_tmp) == {"c.yaml", "n.yaml"}


BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{b}'] * 9)}]\n" for b, a in zip("abcdefgh", "bcdefghi"))


def test_an_alias_bomb_is_refused_at_once(in_tmp, capsys, wall_clock):
    """Nine levels of nine aliases: 400 bytes that expand to 9**9 values (before: the loader's copy of them
    ran for minutes and filled memory)."""
    lols = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    (in_tmp / "bomb.yaml").write_text(yaml.safe_dump(BASE) + lols + BOMB)
    t0 = time.perf_counter()
    _one_line_error(capsys, cli_main(["run", "bomb.yaml"]), "bomb.yaml", "YAML aliases expand to more than 100,000")
    assert time.perf_counter() - t0 < 5
    assert _files(in_tmp) == {"c.yaml", "bomb.yaml"}


def test_an_alias_that_contains_itself_is_refused(in_tmp, capsys):
    (in_tmp / "r.yaml").write_text(yaml.safe_dump(BASE) + "x: &x [1, *x]\n")
    _one_line_error(capsys, cli_main(["run", "r.yaml"]), "r.yaml", "refers to a collection that contains it")


def test_small_aliases_and_merge_keys_work():
    """``<<: *defaults`` merges a mapping, the mapping's own keys winning (before: "not valid YAML")."""
    from fedweave.config import yaml_load

    data = yaml_load(
        textwrap.dedent(
            """
            defaults: &local {batch_size: 16, lr: 0.5, momentum: 0.9}
            dataset: {name: _toy}
            local:
              <<: *local
              lr: 0.25
            """
        )
    )
    assert data["local"] == {"batch_size": 16, "lr": 0.25, "momentum": 0.9}
    cfg = load({k: v for k, v in data.items() if k != "defaults"})
    assert (cfg.local.batch_size, cfg.local.lr, cfg.local.momentum) == (16, 0.25, 0.9)


def test_two_merge_keys_in_one_mapping_are_a_duplicate_key(in_tmp, capsys):
    name = _write(in_tmp / "m.yaml", "local: {<<: {lr: 0.1}, <<: {lr: 0.2}}\n")
    _one_line_error(capsys, cli_main(["run", name]), "m.yaml", "duplicate key '<<'")


# ---- sweep files ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sweep, expect",
    [
        ("sweep: [1, 2]", "sweep must be a mapping"),
        ("sweep: {grid: [1]}", "sweep.grid must be a mapping of keys to non-empty lists"),
        ("sweep: {grid: {local.lr: 0.1}}", "sweep.grid must be a mapping of keys to non-empty lists"),
        ("sweep: {zip: 3}", "sweep.zip must be a mapping"),
        ("sweep: {grid: {local.lr: [0.1]}, seeds: two}", "sweep.seeds must be a whole number >= 1, got 'two'"),
        ("sweep: {grid: {local.lr: [0.1]}, out: 5}", "sweep.out must be a directory path"),
        ("sweep: {grid: {local.lr: [0.1]}, colour: red}", "unknown key 'colour'"),
        ("sweep: {grid: {local.lr: [0.1]}, grid: {local.lr: [0.2]}}", "duplicate key 'grid'"),
        ("sweep: {grid: {local.lr: [0.1]}", "is not valid YAML"),
    ],
)
def test_a_malformed_sweep_file_is_one_line_naming_it(sweep, expect, in_tmp, capsys):
    (in_tmp / "s.yaml").write_text(yaml.safe_dump(BASE) + sweep + "\n")
    _one_line_error(capsys, cli_main(["sweep", "s.yaml", "--no-progress"]), "s.yaml", expect)
    assert _files(in_tmp) == {"c.yaml", "s.yaml"}


def test_a_duplicate_key_in_a_sweep_base_config_is_refused(in_tmp, capsys):
    (in_tmp / "d.yaml").write_text(yaml.safe_dump(BASE) + "rounds: 3\n")
    _one_line_error(capsys, cli_main(["sweep", "d.yaml", "--grid", "local.lr=0.1", "--out", "sw"]), "duplicate key")
    assert _files(in_tmp) == {"c.yaml", "d.yaml"}


# ---- data and weight files --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "parts, expect",
    [
        ([[0, 1, 2], [3, 2**70]], "client 1: index 1180591620717411303424 is not a whole number"),
        ([[0, 1, 2.5], [3, 4]], "client 0: index 2.5 is not a whole number"),
        ([[0, 1, True], [3, 4]], "client 0: index True"),
        ([[0, 1], 7], "client 1 must be a list of sample indices"),
    ],
)
def test_a_partition_file_index_that_is_not_a_sample_is_refused(parts, expect, in_tmp, capsys):
    (in_tmp / "parts.json").write_text(json.dumps(parts))
    args = ["run", "c.yaml", "partition={name: from_file, path: parts.json, num_clients: 0}", "--out", "r"]
    _one_line_error(capsys, cli_main(args), "partition.path 'parts.json'", expect)
    assert _files(in_tmp) == {"c.yaml", "parts.json"}


def test_a_float_index_array_in_an_npz_partition_is_refused(in_tmp, capsys):
    import numpy as np

    np.savez(in_tmp / "parts.npz", client_0=np.array([0.0, 1.5]), client_1=np.array([2, 3]))
    args = ["run", "c.yaml", "partition={name: from_file, path: parts.npz, num_clients: 0}", "--out", "r"]
    _one_line_error(capsys, cli_main(args), "client 0 holds float64 indices")


def test_nan_weights_in_an_init_from_file_are_refused_naming_the_file(in_tmp, capsys):
    """Before: accepted, and the run stopped in round 1 blaming local.lr."""
    torch.save({"fc.weight": torch.full((4, 36), float("nan")), "fc.bias": torch.zeros(4)}, in_tmp / "w.pt")
    line = _one_line_error(capsys, cli_main(["run", "c.yaml", "model.init_from=w.pt", "--out", "r"]), "'w.pt'")
    assert "NaN or infinite values in 'fc.weight'" in line and "local.lr" not in line
    assert _files(in_tmp) == {"c.yaml", "w.pt"}


# ---- samplers -----------------------------------------------------------------------------------------
def test_a_bad_schedule_entry_of_a_later_round_is_refused_when_a_confederated_run_is_built():
    """The edge servers ask the sampler per iteration; every entry is checked when the algorithm is built
    (the star family's case is in test_reliability_bad_input.py)."""
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import ConfigError

    cfg = {
        "rounds": 1,
        "dataset": {"name": "cfl_logreg", "num_samples": 300, "dim": 20, "seed": 1},
        "algorithm": {"name": "gt_saga", "num_servers": 6, "users_per_server": 5, "batch_size": 2, "sample_rate": 0.4},
        "sampler": {"name": "schedule", "clients": [[0, 4], [1, 2], [3, 9]]},
    }
    with pytest.raises(ConfigError, match=r"sampler.clients\[2\] must hold distinct client ids in \[0, 4\]"):
        build_algorithm(RunContext(load(cfg)))


# ---- plug-ins -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "code, expect",
    [
        ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
        ("raise SystemExit\n", "(SystemExit)"),
        ("raise KeyError('x')\n", "KeyError: 'x'"),
    ],
)
def test_a_plug_in_that_exits_or_raises_while_loading_is_one_line_naming_it(code, expect, in_tmp, capsys):
    (in_tmp / "failing_plugin.py").write_text(code)
    _one_line_error(
        capsys, cli_main(["run", "c.yaml", "plugins=[failing_plugin.py]", "--out", "r"]), "'failing_plugin.py'", expect
    )
    _one_line_error(
        capsys,
        cli_main(["run", "c.yaml", "--plugin", "failing_plugin.py", "--out", "r"]),
        "'failing_plugin.py'",
        expect,
    )
    assert _files(in_tmp) == {"c.yaml", "failing_plugin.py"}


def test_a_plug_in_module_that_exits_is_one_line_naming_it(in_tmp, capsys, monkeypatch):
    (in_tmp / "exiting_plugin_mod.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(in_tmp))
    args = ["run", "c.yaml", "plugins=[exiting_plugin_mod]", "--out", "r"]
    _one_line_error(capsys, cli_main(args), "'exiting_plugin_mod'", "SystemExit: 3")


def test_a_plug_in_file_of_the_same_name_in_another_directory_is_imported(tmp_path, monkeypatch):
    """Plug-ins are imported once per process; a file is known by its absolute path, not by the name it was
    given (before: the second directory's ``same_name_plugin.py`` was silently taken as already imported)."""
    from fedweave.config import load_plugin

    for d in ("one", "two"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "same_name_plugin.py").write_text(f"import os\nos.environ['FEDWEAVE_TEST_PLUGIN'] = '{d}'\n")
    monkeypatch.setenv("FEDWEAVE_TEST_PLUGIN", "")
    for d in ("one", "two"):
        monkeypatch.chdir(tmp_path / d)
        load_plugin("same_name_plugin.py")
        assert os.environ["FEDWEAVE_TEST_PLUGIN"] == d


# ---- precision ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cfl_admm", "cfl_saga", "gt_saga"])
def test_the_confederated_family_refuses_bf16_mixed(name, in_tmp, capsys):
    """The family computes in float64 by design: bf16-mixed was silently ignored."""
    cfg = {
        "name": "c",
        "rounds": 1,
        "precision": "bf16-mixed",
        "dataset": {"name": "cfl_logreg", "num_samples": 400, "dim": 5},
        "algorithm": {"name": name, "num_servers": 2, "users_per_server": 2},
        "output": {"progress": False, "plots": False},
    }
    (in_tmp / "f.yaml").write_text(yaml.safe_dump(cfg))
    _one_line_error(capsys, cli_main(["run", "f.yaml", "--out", "r"]), f"bf16-mixed does not apply to {name}")
    assert _files(in_tmp) == {"c.yaml", "f.yaml"}


# ---- interrupts at any moment, on real processes ------------------------------------------------------
# The command runs as the program (``main()`` with no arguments, as the console script calls it); an import
# hook marks the moment torch starts loading, and an exit handler marks the interpreter's shutdown, so that
# a signal can be sent at exactly those moments.
PROGRAM = """
import atexit, builtins, os, sys, time
marks = os.environ["MARKS"]
real_import = builtins.__import__

def slow_shutdown():
    open(os.path.join(marks, "shutdown"), "w").close()
    time.sleep(60)

def hook(name, *args, **kwargs):
    if name == "torch" and not os.path.exists(os.path.join(marks, "importing")):
        if os.environ.get("SLOW_SHUTDOWN"):
            atexit.register(slow_shutdown)  # after the program's own exit handler: runs before it
        open(os.path.join(marks, "importing"), "w").close()
        time.sleep(60)
    return real_import(name, *args, **kwargs)

builtins.__import__ = hook
sys.argv = ["fedweave", *sys.argv[1:]]
from fedweave.cli import main
sys.exit(main())
"""


def _program(tmp_path: Path, *args: str, slow_shutdown: bool = False) -> subprocess.Popen:
    marks = tmp_path / "marks"
    marks.mkdir()
    return subprocess.Popen(
        [sys.executable, "-c", PROGRAM, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MARKS": str(marks), "PYTHONPATH": SRC, "SLOW_SHUTDOWN": "1" if slow_shutdown else ""},
        cwd=tmp_path,
        start_new_session=True,  # a group of its own, as a terminal's Ctrl-C reaches a whole job
        # a shell's background job inherits SIGINT ignored, and Python keeps ignoring it: give the child the
        # default disposition, as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
        time.sleep(0.02)


def _one_interrupt_line(proc: subprocess.Popen, code: int) -> str:
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == code, err
    assert len(lines) == 1 and lines[0].startswith("fedweave: interrupted") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_importing_ends_in_one_line(tmp_path, sig, code):
    """Before: a KeyboardInterrupt traceback from inside torch's import (status -2), or a silent -15."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**BASE, "dataset": {"name": "digits"}}))
    proc = _program(tmp_path, "run", "c.yaml", "--out", "r", "--no-progress")
    _wait_for(tmp_path / "marks" / "importing", proc)
    os.killpg(proc.pid, sig)
    _one_interrupt_line(proc, code)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_shutdown_ends_at_once_with_no_second_line(tmp_path, second):
    """The first Ctrl-C is reported; a second signal while the interpreter shuts down (here an exit handler
    that would wait a minute) ends the process at once with the signal's status and nothing more (before:
    "Exception ignored in atexit callback" and a KeyboardInterrupt traceback)."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**BASE, "dataset": {"name": "digits"}}))
    proc = _program(tmp_path, "run", "c.yaml", "--out", "r", "--no-progress", slow_shutdown=True)
    _wait_for(tmp_path / "marks" / "importing", proc)
    os.killpg(proc.pid, signal.SIGINT)
    _wait_for(tmp_path / "marks" / "shutdown", proc)
    t0 = time.time()
    os.killpg(proc.pid, second)
    _one_interrupt_line(proc, 128 + second)
    assert time.time() - t0 < 30


@pytest.mark.slow
def test_ctrl_c_on_the_pool_backend_prints_no_worker_tracebacks(tmp_path):
    """Ctrl-C reaches the whole process group, the pool's forked workers too; the driver alone reports it
    (before: each worker printed a KeyboardInterrupt traceback)."""
    cfg = {
        **BASE,
        "rounds": 3000,
        "dataset": {"name": "digits"},
        "local": {"steps": 1, "epochs": None, "batch_size": 8, "lr": 0.05},
        "backend": "pool",
        "threads": 2,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedweave.cli", "run", "c.yaml", "--out", "r", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
        cwd=tmp_path,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 60
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    line = _one_interrupt_line(proc, 130)
    assert "stopped by SIGINT" in line
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "interrupted"
