"""The run directory and the checkpoint, attacked from outside through the released commands: --overwrite of a
directory that is not a run, two runs into one directory, planted links and a user's temporary files, a
signal just after a checkpoint, a damaged checkpoint, and the Flower app project's directory
(docs/reliability.md, "What each bad input gets")."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tomllib

import pytest
import torch
import yaml
from test_reliability_bad_input import BASE as SHARED_BASE

import fedweave
import fedweave.algorithms  # noqa: F401  (registers the algorithms)
from fedweave.checkpoints import CHECKPOINT, encode_checkpoint, floating_tensors, read_checkpoint
from fedweave.cli import main as cli_main
from fedweave.config import load
from fedweave.errors import RunInterrupted
from fedweave.results import locked_run_dir
from fedweave.runner import resume

BASE = {**SHARED_BASE, "name": "rundir"}  # the reliability tests' tiny FedAvg run
CKPT = {**BASE, "output": {**BASE["output"], "checkpoint_every": 1}}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A working directory holding only the config files c.yaml and ck.yaml (checkpoint every round)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "c.yaml").write_text(yaml.safe_dump(BASE))
    (work / "ck.yaml").write_text(yaml.safe_dump(CKPT))
    return work


def _one_line_error(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fedweave: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


# ---- 1. --overwrite replaces a run directory only -----------------------------------------------------
def test_overwrite_refuses_a_directory_of_user_files_with_a_config(in_tmp, capsys):
    d = in_tmp / "project"
    d.mkdir()
    (d / "config.yaml").write_text("my: own config\n")  # a run's file name, but not a run
    (d / "notes.txt").write_text("precious")
    (d / ".bashrc").write_text("export X=1")
    before = _files(d)
    code = cli_main(["run", "c.yaml", "--out", "project", "--overwrite", "--no-progress"])
    _one_line_error(
        capsys, code, "'project'", ".bashrc, config.yaml, notes.txt", "--overwrite replaces only a run direc"
    )
    assert _files(d) == before and sorted(p.name for p in d.iterdir()) == sorted(before)


def test_overwrite_refuses_a_directory_holding_only_a_users_config(in_tmp, capsys):
    d = in_tmp / "exp"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(BASE))
    code = cli_main(["run", "exp/config.yaml", "--out", "exp", "--overwrite", "--no-progress"])
    _one_line_error(capsys, code, "'exp' holds files that are not a fedweave run's (config.yaml)")
    assert (d / "config.yaml").read_text() == yaml.safe_dump(BASE) and len(list(d.iterdir())) == 1


@pytest.mark.parametrize("name", ["partition.png", "test_accuracy_vs_rounds.png", "metrics.csv", "events.csv"])
def test_a_users_file_named_as_a_runs_is_never_written_over(name, in_tmp, capsys):
    """A folder of the user's is no run's, whatever its files are called: a plain run replaced their own
    partition.png (the names alone made the folder look empty), and with notes.txt beside their metrics.csv it
    was told the folder held an unfinished run, to be replaced with --overwrite, which then refused."""
    d = in_tmp / "mine"
    d.mkdir()
    (d / name).write_bytes(b"the user's own")
    for extra in ([], ["--overwrite"]):
        code = cli_main(["run", "c.yaml", "output.plots=true", "--out", "mine", "--no-progress", *extra])
        _one_line_error(capsys, code, f"'mine' holds files that are not a fedweave run's ({name})")
        assert [p.name for p in d.iterdir()] == [name] and (d / name).read_bytes() == b"the user's own"


def test_overwrite_of_the_working_directory(in_tmp, capsys, monkeypatch):
    # '.' holding the user's config: refused, one line, nothing deleted
    code = cli_main(["run", "c.yaml", "--out", ".", "--overwrite", "--no-progress"])
    _one_line_error(capsys, code, "'.' holds files that are not a fedweave run's (c.yaml, ck.yaml)")
    assert sorted(p.name for p in in_tmp.iterdir()) == ["c.yaml", "ck.yaml"]
    # '.' that is a run directory: replaced in place (it cannot be renamed aside: it is the working directory)
    (in_tmp / "w").mkdir()
    monkeypatch.chdir(in_tmp / "w")
    assert cli_main(["run", "../c.yaml", "--out", ".", "--no-progress"]) == 0
    assert cli_main(["run", "../c.yaml", "local.lr=0.2", "--out", ".", "--overwrite", "--no-progress"]) == 0
    assert load(in_tmp / "w" / "config.yaml").local.lr == 0.2
    assert (in_tmp / "w" / "summary.json").is_file() and not list(in_tmp.glob(".w*"))


def test_overwrite_of_a_run_holding_its_report(in_tmp, capsys):
    """``fedweave report RUN`` writes report.html into the run directory by default: a page fedweave wrote, not
    a user's file, so --overwrite replaces the run with it (before: refused, 'holds files that are not a
    fedweave run's (report.html)'); a report.html of the user's own is still never removed."""
    assert cli_main(["run", "c.yaml", "--out", "r", "--no-progress"]) == 0
    assert cli_main(["report", "r"]) == 0 and (in_tmp / "r" / "report.html").is_file()
    assert cli_main(["run", "c.yaml", "local.lr=0.2", "--out", "r", "--overwrite", "--no-progress"]) == 0
    assert load(in_tmp / "r" / "config.yaml").local.lr == 0.2 and not (in_tmp / "r" / "report.html").exists()
    capsys.readouterr()
    (in_tmp / "r" / "report.html").write_text("<html>my own notes</html>")
    code = cli_main(["run", "c.yaml", "--out", "r", "--overwrite", "--no-progress"])
    _one_line_error(capsys, code, "holds files that are not a fedweave run's (report.html)")
    assert (in_tmp / "r" / "report.html").read_text() == "<html>my own notes</html>"


# ---- 2. one run at a time in a run directory ----------------------------------------------------------
def test_a_second_run_into_a_directory_in_use_is_refused(in_tmp, capsys, monkeypatch):
    from fedweave.results import RunDir

    real, second = RunDir.write_config, []

    def write_config(self, config):  # the first run holds the directory and has written nothing yet
        if not second:
            second.append(cli_main(["run", "c.yaml", "local.lr=0.3", "--out", "r", "--no-progress"]))
            second.append(capsys.readouterr().err)
        real(self, config)

    monkeypatch.setattr(RunDir, "write_config", write_config)
    assert cli_main(["run", "c.yaml", "--out", "r", "--no-progress"]) == 0
    code, err = second
    assert code == 2 and err.count("\n") == 1, err
    assert f"'r' is in use by another fedweave run (process {os.getpid()})" in err
    assert load(in_tmp / "r" / "config.yaml").local.lr == 0.1  # the first run's, whole


def test_a_run_that_ended_while_another_was_built_is_not_replaced(tmp_path):
    # both checked the empty directory; the second to lock it finds the first one's finished run there
    class Meanwhile(fedweave.Callback):
        def on_build(self, run):  # after the first check of the directory, before its lock
            fedweave.run({**BASE, "local": {**BASE["local"], "lr": 0.3}}, run_dir=tmp_path / "r")

    with pytest.raises(fedweave.results.RunDirError, match="already holds a finished run"):
        fedweave.run(BASE, run_dir=tmp_path / "r", callbacks=[Meanwhile()])
    assert load(tmp_path / "r" / "config.yaml").local.lr == 0.3


def test_a_lock_held_by_another_process_refuses_and_a_killed_ones_does_not(in_tmp, capsys):
    assert cli_main(["run", "ck.yaml", "rounds=1", "--out", "r", "--no-progress"]) == 0
    capsys.readouterr()
    holder = subprocess.Popen(  # another process in the directory: it holds the lock the way a run does
        [sys.executable, "-c", "from pathlib import Path; import sys, time; from fedweave.results import "
         "locked_run_dir\nwith locked_run_dir(Path('r')):\n    print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (["--resume", "r", "rounds=2"], ["ck.yaml", "--out", "r", "--overwrite"]):
            code = cli_main(["run", *args, "--no-progress"])
            _one_line_error(capsys, code, f"'r' is in use by another fedweave run (process {holder.pid})")
        assert read_checkpoint(in_tmp / "r" / CHECKPOINT)["next_round"] == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the killed process's lock went with it: the run resumes
    assert cli_main(["run", "--resume", "r", "rounds=2", "--no-progress"]) == 0
    assert read_checkpoint(in_tmp / "r" / CHECKPOINT)["next_round"] == 2


def _ready_then_pause(ready) -> None:
    ready.set()  # the fork hooks (which drop the run locks) have run by the time the target starts
    signal.pause()


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    # the pool backend and sweeps fork workers while a run holds its directory; they may outlive the run
    fork = mp.get_context("fork")
    ready = fork.Event()
    with locked_run_dir(tmp_path / "r"):
        child = fork.Process(target=_ready_then_pause, args=(ready,), daemon=True)
        child.start()
        assert ready.wait(60)
    try:
        assert child.is_alive()
        with locked_run_dir(tmp_path / "r"):
            pass
    finally:
        child.kill()
        child.join()


def test_a_run_on_the_pool_backend_then_an_overwrite_in_the_same_process(tmp_path):
    cfg = {**BASE, "backend": "pool", "threads": 2}
    first = fedweave.run(cfg, run_dir=tmp_path / "r")  # its pool's workers live while the result does
    again = fedweave.run(cfg, run_dir=tmp_path / "r", overwrite=True)
    assert again.summary["status"] == "completed"
    assert [r["test_accuracy"] for r in again.metrics] == [r["test_accuracy"] for r in first.metrics]


# ---- 3. probes and temporary files: created exclusively, only the run's own removed ----------------------
def test_a_planted_probe_link_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "r"
    run.mkdir()
    (run / fedweave.results.LOCK).touch()  # a run's directory (in a folder that is no run's, the link is refused)
    (run / f".write-probe-{os.getpid()}.tmp").symlink_to(victim)
    fedweave.run(BASE, run_dir=run)
    assert victim.read_text() == "precious"


@pytest.fixture
def python_ctrl_c():
    """Ctrl-C as a terminal's foreground program meets it: Python's own handler (KeyboardInterrupt), whatever
    the process inherited or an earlier test left."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_users_temporary_files_in_the_run_directory_are_kept(tmp_path, python_ctrl_c):
    # a run stopped by Ctrl-C after round 1; the user then leaves files of theirs in its directory and resumes
    class CtrlC(fedweave.callbacks.Callback):
        def on_round_end(self, run, r):
            if r == 1 and not run.resumed:
                os.kill(os.getpid(), signal.SIGINT)

    run = tmp_path / "r"
    with pytest.raises(RunInterrupted):
        fedweave.run(load(CKPT), run_dir=run, callbacks=[CtrlC()])
    mine = {".notes.tmp": b"draft", ".config.yaml.tmp": b"mine too", ".report.md.ab12cd34.tmp": b"and this"}
    for name, data in mine.items():
        (run / name).write_bytes(data)
    stale = run / ".metrics.csv.ab12cd34.tmp"  # fedweave's own pattern: left by a kill during a write
    stale.write_bytes(b"half")
    assert resume(run).summary["status"] == "completed"
    assert {name: (run / name).read_bytes() for name in mine} == mine
    assert not stale.exists()


def test_a_plain_run_into_a_users_folder_is_refused_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "partition.png").write_bytes(b"my own figure")  # a name a run writes: it would be replaced
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(BASE))
    assert cli_main(["run", str(tmp_path / "c.yaml"), "--out", str(folder), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(folder) in err[0] and "notes.txt" in err[0] and "not a fedweave run's" in err[0]
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "partition.png"]
    assert (folder / "partition.png").read_bytes() == b"my own figure"


# ---- 4. the round named after a signal is the checkpoint on disk -------------------------------------------
def test_a_signal_just_after_a_checkpoint_names_that_checkpoint(tmp_path, monkeypatch, python_ctrl_c):
    import fedweave.checkpoints as checkpoints

    real, written = checkpoints.atomic_write, []

    def atomic_write(path, data):
        real(path, data)
        if path.name == CHECKPOINT:
            written.append(path)
            if len(written) == 2:  # Ctrl-C right after the rename of round 2's checkpoint
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(checkpoints, "atomic_write", atomic_write)
    with pytest.raises(RunInterrupted) as e:
        fedweave.run({**CKPT, "rounds": 3}, run_dir=tmp_path / "r")
    assert read_checkpoint(tmp_path / "r" / CHECKPOINT)["next_round"] == 2
    summary = yaml.safe_load((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert "The checkpoint of round 2 is kept" in summary["error"] and "round 2 is kept" in str(e.value)


# ---- 5. damaged checkpoints ---------------------------------------------------------------------------
@pytest.fixture
def checkpointed(in_tmp):
    assert cli_main(["run", "ck.yaml", "rounds=1", "--out", "r", "--no-progress"]) == 0
    return in_tmp / "r"


def test_a_flipped_byte_in_a_checkpoint_is_refused(checkpointed, capsys):
    ck = checkpointed / CHECKPOINT
    data = bytearray(ck.read_bytes())
    data[-len(data) // 3] ^= 0x01  # inside the tensors' bytes
    ck.write_bytes(bytes(data))
    capsys.readouterr()
    code = cli_main(["run", "--resume", "r", "rounds=2", "--no-progress"])
    _one_line_error(capsys, code, "checkpoint.pt is damaged", "sha256")
    assert ck.read_bytes() == bytes(data) and yaml.safe_load((checkpointed / "summary.json").read_text())["rounds"] == 1


def test_a_checkpoint_holding_nan_is_damaged_not_divergence(checkpointed, capsys):
    ck = checkpointed / CHECKPOINT
    state = read_checkpoint(ck)
    key, weights = max(floating_tensors(state["algorithm"]), key=lambda kt: kt[1].numel())  # the model's
    weights.fill_(float("nan"))
    ck.write_bytes(encode_checkpoint(state))  # a valid digest: the content is what it claims, yet not finite
    capsys.readouterr()
    code = cli_main(["run", "--resume", "r", "rounds=2", "--no-progress"])
    line = _one_line_error(capsys, code, "checkpoint.pt is damaged", f"'{key}' holds NaN or Inf")
    assert "local.lr" not in line and "--resume" not in line


def test_a_checkpoint_without_a_digest_is_loaded_with_a_warning(checkpointed, caplog):
    ck = checkpointed / CHECKPOINT
    torch.save(read_checkpoint(ck), ck)  # as fedweave wrote checkpoints before they carried a digest
    with caplog.at_level("WARNING", logger="fedweave"):
        res = fedweave.runner.resume(checkpointed, ["rounds=2"], progress=False)
    assert res.summary["status"] == "completed" and "carries no digest" in caplog.text
    assert read_checkpoint(ck)["next_round"] == 2  # and the new one carries one


# ---- 6. fedweave flower-app ----------------------------------------------------------------------------
def test_flower_app_refuses_a_directory_that_is_not_empty(in_tmp, capsys):
    app = in_tmp / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    (app / "fedweave_app.py").write_text("# mine\n")
    (app / "README.md").write_text("mine")
    before = _files(app)
    _one_line_error(capsys, cli_main(["flower-app", "c.yaml", "app"]), "'app' is not empty", "--overwrite")
    assert _files(app) == before
    assert cli_main(["flower-app", "c.yaml", "app", "--overwrite"]) == 0
    assert (app / "README.md").read_text() == "mine"  # only the project's two files are replaced
    assert tomllib.loads((app / "pyproject.toml").read_text())["project"]["name"] == "fedweave-app"


def test_flower_app_writes_valid_toml_for_any_run_name(in_tmp):
    name = "say \"hi\" and 'bye'"
    assert cli_main(["flower-app", "c.yaml", "app", f"name={name}"]) == 0
    data = tomllib.loads((in_tmp / "app" / "pyproject.toml").read_text())
    assert data["project"]["description"] == f"fedweave run {name} on Flower's deployment engine"
    app = data["tool"]["flwr"]["app"]
    assert load(json.loads(app["config"]["fedweave-config"])).name == name
    assert app["components"] == {"serverapp": "fedweave_app:serverapp", "clientapp": "fedweave_app:clientapp"}


def test_a_directory_holding_a_diverged_run_is_refused_naming_how_it_ended(tmp_path):
    # the line called it "a finished run", as it did a failed one
    diverging = {**BASE, "algorithm": {**BASE["algorithm"], "server_lr": 1e38}}
    assert fedweave.run(diverging, run_dir=tmp_path / "r", on_divergence="return").summary["status"] == "diverged"
    with pytest.raises(fedweave.results.RunDirError, match=r"already holds a diverged run; it has no checkpoint"):
        fedweave.run(BASE, run_dir=tmp_path / "r")
