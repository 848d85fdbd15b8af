"""Sweeps: a grid crossed with seeds run on parallel workers, resumed after a kill, diverged points recorded."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

import fedweave
from fedweave.checkpoints import CHECKPOINT
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError, load
from fedweave.experiments import GridError, expand, parse_grid
from fedweave.experiments.aggregate import mean_std
from fedweave.experiments.baseline import CORRECTED, adjust, compare, levels, parse_baseline, resolve
from fedweave.experiments.jobs import RunFailed
from fedweave.experiments.tables import csv_text
from fedweave.plots import plot_runs
from fedweave.results import RunDirError
from fedweave.runner import Result
from fedweave.tasks import column_direction
from tests.conftest import TOY_CONFIG

# scikit-learn's bundled digits need no network, so a sweep in a subprocess can load them
DIGITS = {
    "name": "digits",
    "seed": 7,
    "rounds": 6,
    "backend": "loop",
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 10, "alpha": 0.5, "min_size": 20},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 5},
    "local": {"epochs": 1, "batch_size": 8, "lr": 0.02},
    "output": {"progress": False, "plots": False, "checkpoint_every": 1},
}


def _read(path) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in csv.DictReader(f)]


def test_grid_times_seeds_on_two_workers_equals_one_worker(toy_config, tmp_path):
    grid = parse_grid(["local.lr=0.05,0.2"])
    two = fedweave.sweep(toy_config, grid, seeds=2, workers=2, out=tmp_path / "w2", progress=False)
    one = fedweave.sweep(toy_config, grid, seeds=2, workers=1, out=tmp_path / "w1", progress=False)
    assert len(two.records) == 4 and [r["seed"] for r in two.records] == [3, 4, 3, 4]
    assert {r["local.lr"] for r in two.records} == {0.05, 0.2}
    assert _read(tmp_path / "w2" / "sweep.csv") == _read(tmp_path / "w1" / "sweep.csv")
    assert one.summary == two.summary  # same seeds, same numbers, however many workers
    for row in two.summary:  # mean +- std over the seeds of each point, from the runs' own summaries
        finals = [r["final_test_accuracy"] for r in two.records if r["point"] == row["point"]]
        assert (row["test_accuracy_mean"], row["test_accuracy_std"]) == pytest.approx(mean_std(finals))
        assert row["seeds"] == 2
    best = max(range(2), key=lambda i: two.summary[i]["test_accuracy_mean"])
    assert two.best == best and two.summary[best]["best"]
    md = (tmp_path / "w2" / "summary.md").read_text()
    assert md.count("**") == 2 * len(two.summary[0]) and "local.lr=0.2" in md
    assert (tmp_path / "w2" / "test_accuracy_vs_rounds.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "w2" / "test_accuracy_vs_bytes.png").is_file()
    # a second sweep into the same directory recognises every finished run and runs nothing
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "w2" / "runs").glob("*/summary.json")}
    fedweave.sweep(toy_config, grid, seeds=2, workers=2, out=tmp_path / "w2", progress=False)
    assert mtimes == {p: p.stat().st_mtime_ns for p in (tmp_path / "w2" / "runs").glob("*/summary.json")}


def test_zipped_keys_vary_together(toy_config):
    pts = expand(toy_config, {"rounds": [2, 3]}, zipped={"local.lr": [0.1, 0.2], "local.batch_size": [8, 16]})
    combos = [(p.config.rounds, p.config.local.lr, p.config.local.batch_size) for p in pts]
    assert combos == [(2, 0.1, 8), (2, 0.2, 16), (3, 0.1, 8), (3, 0.2, 16)]
    with pytest.raises(GridError, match="equally many"):
        expand(toy_config, zipped={"local.lr": [0.1, 0.2], "local.batch_size": [8]})


@pytest.mark.parametrize("grid, zipped", [({"output.dir": ["x", "y"]}, None), (None, {"output": [{"dir": "x"}]})])
def test_the_grid_may_not_place_the_runs(toy_config, grid, zipped):
    """A grid over output.dir made points that ran alike in the sweep's folder, each config.yaml naming a folder
    nothing was written to."""
    with pytest.raises(GridError, match=r"^the grid may not set 'output(\.dir)?': each point runs in the sweep's"):
        expand(toy_config, grid, zipped=zipped)


def test_grid_and_baseline_values_are_read_as_a_config_reads_them(toy_config):
    # YAML 1.2, as a config file and a key=value override: 012 is 12 (not octal 10), 1e3 a number, 1:30 a string
    grid = parse_grid(["local.batch_size=012,16", "rounds=1e0,2"])
    assert grid == {"local.batch_size": [12, 16], "rounds": [1.0, 2]}
    pts = expand(toy_config, grid)
    assert [(p.config.local.batch_size, p.config.rounds) for p in pts] == [(12, 1), (12, 2), (16, 1), (16, 2)]
    assert load(toy_config, ["local.batch_size=012"]).local.batch_size == 12  # the override it must agree with
    assert parse_grid(["name=1:30"]) == {"name": ["1:30"]}
    assert parse_baseline("local.batch_size=012,rounds=1e0") == {"local.batch_size": 12, "rounds": 1.0}
    assert resolve("012", [(("local.batch_size", 12),), (("local.batch_size", 16),)]) == "local.batch_size=12"


def test_a_list_or_mapping_is_one_grid_value(toy_config):
    # a cut at every comma read [128,64] as the values '[128' and '64]': "a value is not valid YAML"
    grid = parse_grid(["model.hidden=[64],[128,64]"])
    assert grid == {"model.hidden": [[64], [128, 64]]}
    toy_config["model"] = {"name": "mlp", "hidden": [8]}
    pts = expand(toy_config, grid, seeds=2)
    assert [(p.config.model.options["hidden"], p.seed) for p in pts] == [
        ([64], 3),
        ([64], 4),
        ([128, 64], 3),
        ([128, 64], 4),
    ]
    assert [p.label for p in pts[::2]] == ["model.hidden=[64]", "model.hidden=[128, 64]"]
    zipped = parse_grid(["model.hidden=[128, 64],[32]", "rounds=2,3"], "--zip")
    pts = expand(toy_config, zipped=zipped)
    assert [(p.config.model.options["hidden"], p.config.rounds) for p in pts] == [([128, 64], 2), ([32], 3)]
    assert parse_grid(["x={a: 1, b: [2, 3]},{c: 4}"]) == {"x": [{"a": 1, "b": [2, 3]}, {"c": 4}]}
    assert parse_grid(["""name="a,b",'c,''d',e"""]) == {"name": ["a,b", "c,'d", "e"]}
    # a bracket or a quote inside a plain value is text, as before: only a value's first character opens one
    assert parse_grid(["name=a[1,2],it's,x"]) == {"name": ["a[1", "2]", "it's", "x"]}
    assert parse_grid(["x=[a'b, c],1,,"]) == {"x": [["a'b", "c"], 1, None, None]}
    # the baseline names a point by the same values (resolve took the points as dict keys: unhashable list)
    assert parse_baseline("model.hidden=[128,64],rounds=2") == {"model.hidden": [128, 64], "rounds": 2}
    points = [(("model.hidden", [64]),), (("model.hidden", [128, 64]),)]
    assert resolve({"model.hidden": [128, 64]}, points) == "model.hidden=[128, 64]"
    assert resolve("[64]", points) == "model.hidden=[64]"


@pytest.mark.parametrize(
    "grid, words",
    [
        (["model.hidden=[64],[128,64"], ["--grid model.hidden", "'[128,64'", "'[' is not closed"]),
        (["model.hidden=[64],{a: [1}"], ["--grid model.hidden", "'}' at character 7 does not close '['"]),
        (["name='a,b"], ["--grid name", "quote ' is not closed"]),
        (["local.lrr=0.1,0.2"], ["lrr"]),
        (["local.lr=0.1,abc"], ["local.lr", "abc"]),
        (["local.lr"], ["--grid", "KEY=V1,V2"]),
        (["seed=1,2"], ["seed", "seeds"]),
        (["local.lr=0.1,0.10"], ["local.lr=0.1", "twice"]),  # one value twice: two runs of one directory
    ],
)
def test_a_bad_grid_is_one_clear_line_before_anything_runs(toy_config, tmp_path, capsys, grid, words):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(toy_config))
    args = [a for g in grid for a in ("--grid", g)]
    assert cli_main(["sweep", str(cfg), *args, "--out", str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"grid": {"local.lr": 0.1}}, ["grid", "'local.lr': 0.1", "non-empty list"]),  # was a TypeError
        ({"grid": {"local.lr": []}}, ["grid", "'local.lr': []"]),  # was an IndexError
        ({"grid": {"local.lr": [0.1]}, "zipped": {"rounds": 2}}, ["zipped", "'rounds': 2"]),
        ({"grid": ["local.lr=0.1,0.2"]}, ["grid", "non-empty list", "got list ['local.lr=0.1,0.2']"]),
        ({"grid": "local.lr=0.1,0.2"}, ["grid", "got str 'local.lr=0.1,0.2'"]),  # said "got None: ..."
        ({"grid": 0}, ["grid", "got int 0"]),  # a falsy grid ran the base config as a sweep of one point
        ({"grid": {"local.lr": [0.1]}, "zipped": []}, ["zipped", "got list []"]),
        ({"grid": {"local.lr": [0.1]}, "seeds": 2.0}, ["seeds", "whole number", "2.0"]),
    ],
)
def test_a_bad_grid_from_python_is_one_clear_line_before_anything_runs(toy_config, tmp_path, kwargs, words):
    with pytest.raises(GridError) as e:
        fedweave.sweep(toy_config, **kwargs, out=tmp_path / "s", progress=False)
    assert len(str(e.value).splitlines()) == 1 and all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "grid, point, words",
    [
        ("algorithm.name=fedavg,fedavgg,fedprox", "algorithm.name=fedavgg", ["unknown algorithm 'fedavgg'"]),
        ("dataset.name=_toy,_toyy,digits", "dataset.name=_toyy", ["unknown dataset '_toyy'"]),
        ("model.name=logistic,logistik,mlp", "model.name=logistik", ["unknown model 'logistik'"]),
        (
            "partition.name=dirichlet,dirichlett,dirichlet_balanced",
            "partition.name=dirichlett",
            ["unknown partitioner"],
        ),
        ("sampler.name=uniform,uniformm,bernoulli", "sampler.name=uniformm", ["unknown sampler 'uniformm'"]),
        ("algorithm.clients_per_round=4,0,2", "algorithm.clients_per_round=0", ["clients_per_round must be >= 1"]),
    ],
)
def test_a_point_the_run_would_refuse_is_refused_before_any_run_starts(
    toy_config, tmp_path, capsys, grid, point, words
):
    # the 2nd of 3 points names what no run accepts: the 1st point's run was made and run to its end first, and
    # only then did the sweep stop, at the run of the 2nd (in a parallel sweep, hours of runs before it)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(toy_config))
    args = ["sweep", str(cfg), "--grid", grid, "--out", str(tmp_path / "s"), "--no-progress", "--workers", "2"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"sweep point {point}:" in err and all(w in err for w in words), err
    assert not (tmp_path / "s").exists()  # no run directory, no sweep.json
    with pytest.raises(GridError, match=f"^sweep point {point}: "):
        fedweave.sweep(toy_config, parse_grid([grid]), out=tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()


def test_a_point_naming_a_plug_ins_model_is_checked_after_the_config_imports_it(toy_config, tmp_path, monkeypatch):
    # the config's plug-ins register before its points are checked, as before its runs
    from fedweave.registry import MODELS

    # the registry is the process's: the plug-in's name is registered for this test only (a later test of the
    # same worker listing the zoo's models would count it, its builder being fedweave's own)
    monkeypatch.setattr(MODELS, "_items", dict(MODELS._items))
    plugin = tmp_path / "my_models.py"
    plugin.write_text(
        "from fedweave.models.linear import build_logistic\n"
        "from fedweave.registry import MODELS\n"
        "MODELS.register('sweep_logistic')(build_logistic)\n"
    )
    cfg = {**toy_config, "rounds": 1, "plugins": [str(plugin)]}
    res = fedweave.sweep(cfg, {"model.name": ["logistic", "sweep_logistic"]}, out=tmp_path / "s", progress=False)
    assert [r["status"] for r in res.records] == ["completed", "completed"]
    assert res.records[0]["final_test_accuracy"] == res.records[1]["final_test_accuracy"]  # one model, two names
    with pytest.raises(GridError, match="^sweep point model.name=sweep_logistik: unknown model"):
        fedweave.sweep(cfg, {"model.name": ["sweep_logistik"]}, out=tmp_path / "t", progress=False)


@pytest.mark.parametrize("progress", ["no", None, 0])
def test_progress_that_is_not_a_boolean_is_one_line_before_anything_runs(toy_config, tmp_path, progress):
    # a string is truthy: progress="no" showed the bar and ran the sweep
    with pytest.raises(ConfigError, match=r"^progress must be True or False, got "):
        fedweave.sweep(toy_config, {"local.lr": [0.1]}, out=tmp_path / "s", progress=progress)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", ["sweep", "plot"])
@pytest.mark.parametrize("under", ["", "/s"])
def test_an_out_that_is_a_file_is_one_line_naming_out(toy_config, tmp_path, capsys, command, under):
    # mkdir's own error was all the line said: "f.txt: File exists" or "f.txt/s: Not a directory"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**toy_config, "rounds": 1}))
    (tmp_path / "f.txt").write_text("notes\n")
    if command == "sweep":
        args = ["sweep", str(cfg), "--grid", "local.lr=0.1", "--no-progress"]
    else:
        fedweave.run(str(cfg), run_dir=tmp_path / "r")
        args = ["plot", str(tmp_path / "r")]
    assert cli_main([*args, "--out", str(tmp_path / "f.txt") + under]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and ("is a file" in err or "lies under the file" in err), err
    assert (tmp_path / "f.txt").read_text() == "notes\n"


@pytest.mark.parametrize("target", ["nan", "inf", "-inf"])
def test_a_target_that_is_not_finite_is_one_line_before_anything_runs(toy_config, tmp_path, capsys, target):
    # --target nan was taken: no run ever "reached" it and the columns read '-' as if none had got there
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(toy_config))
    args = ["sweep", str(cfg), "--grid", "local.lr=0.1", f"--target={target}", "--out", str(tmp_path / "s")]
    assert cli_main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--target must be a finite number" in err, err
    assert not (tmp_path / "s").exists()


def test_a_metric_no_run_has_is_one_clear_line_and_the_runs_are_reused(toy_config, tmp_path, capsys):
    # a misspelt --metric used to tabulate nan for every point and exit 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**toy_config, "rounds": 1}))
    args = ["sweep", str(cfg), "--grid", "local.lr=0.1", "--out", str(tmp_path / "s"), "--no-progress"]
    # a test column the task does not log is refused before any run (tests/test_sweep_edges.py)
    assert cli_main([*args, "--metric", "test_acc"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--metric 'test_acc'" in err and "test_accuracy" in err, err
    assert not (tmp_path / "s").exists()
    # a column only the runs can tell (the algorithm's): refused once they have run, and they are reused
    assert cli_main([*args, "--metric", "train_los"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--metric 'train_los'" in err and "train_loss" in err, err
    assert not (tmp_path / "s" / "summary.csv").exists()
    run = next((tmp_path / "s" / "runs").glob("*/summary.json"))
    mtime = run.stat().st_mtime_ns
    # the refused sweep's sweep.json names the column a sweep without --metric tabulates, not the refused one
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["metric"] == "test_accuracy"
    assert cli_main([*args, "--metric", "test_loss"]) == 0
    assert run.stat().st_mtime_ns == mtime  # the finished run was reused
    assert _read(tmp_path / "s" / "summary.csv")[0]["test_loss_mean"] != "nan"
    # a typo after that leaves sweep.json as it was, beside the summary.csv it describes (before: the report
    # read the refused metric from it and showed every column of the finished sweep blank)
    spec = (tmp_path / "s" / "sweep.json").read_bytes()
    assert cli_main([*args, "--metric", "train_los"]) == 2
    assert (tmp_path / "s" / "sweep.json").read_bytes() == spec


def test_a_diverging_point_is_recorded_and_the_sweep_goes_on(toy_config, tmp_path):
    res = fedweave.sweep(toy_config, {"local.lr": [0.1, 1e38]}, out=tmp_path / "s", progress=False)
    status = {r["local.lr"]: r["status"] for r in res.records}
    assert status == {0.1: "completed", 1e38: "diverged"}
    assert res.summary[1]["diverged"] == 1 and res.best == 0


def test_a_sweep_written_as_yaml(toy_config, tmp_path, capsys):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({**toy_config, "sweep": {"grid": {"local.lr": [0.05, 0.1]}, "seeds": 2}}))
    assert cli_main(["sweep", str(cfg), "rounds=2", "--out", str(tmp_path / "s"), "--no-progress"]) == 0
    rows = _read(tmp_path / "s" / "sweep.csv")
    assert len(rows) == 4 and {r["rounds"] for r in rows} == {"2"}
    assert "local.lr=0.1" in capsys.readouterr().out
    # `fedweave plot` reads a sweep directory as all its runs
    assert cli_main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "test_accuracy_vs_rounds.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_of_a_sweep_draws_only_its_current_grid(toy_config, tmp_path, monkeypatch):
    """The runs of a sweep are those of its current grid (sweep.json / sweep.csv), as the report reads them: the
    run directories an earlier grid left in the same runs/ are not drawn (before: every directory in runs/)."""
    import fedweave.plots

    cfg = {**toy_config, "rounds": 2}
    out = tmp_path / "s"
    fedweave.sweep(cfg, {"local.lr": [0.05, 0.1]}, out=out, progress=False)
    res = fedweave.sweep(cfg, {"local.lr": [0.1, 0.3]}, out=out, progress=False)  # another grid, the same folder
    assert (out / "runs" / "local.lr=0.05,seed=3").is_dir()
    drawn, save = {}, fedweave.plots.save_png

    def keep(fig, path, dpi=120):  # the lines of each figure, then the figure written as before
        drawn[path.name] = [line.get_label() for line in fig.axes[0].get_lines()]
        return save(fig, path, dpi)

    monkeypatch.setattr(fedweave.plots, "save_png", keep)
    assert cli_main(["plot", str(out), "--out", str(tmp_path / "p")]) == 0
    current = [r["run_dir"].split("/")[-1] for r in res.records]
    assert drawn["test_accuracy_vs_rounds.png"] == drawn["test_accuracy_vs_bytes.png"] == current


def test_plot_labels_tell_runs_of_the_same_name_apart(toy_config, tmp_path, monkeypatch):
    """Runs whose directories share a name (the same grid point of two sweeps) are labelled by the last parts of
    their paths that tell them apart, as the report names them, and a run given as '.' by its directory's
    (before: two identical labels; an empty one; then whole paths, which a long folder wrapped)."""
    import fedweave.plots

    for where in ("a", "b"):
        fedweave.run({**toy_config, "rounds": 2}, run_dir=tmp_path / where / "r")
    drawn, save = [], fedweave.plots.save_png

    def keep(fig, path, dpi=120):
        drawn.append([line.get_label() for line in fig.axes[0].get_lines()])
        return save(fig, path, dpi)

    monkeypatch.setattr(fedweave.plots, "save_png", keep)
    fedweave.plots.plot_runs([tmp_path / "a" / "r", tmp_path / "b" / "r"], tmp_path / "p")
    assert drawn[0] == ["a/r", "b/r"]
    monkeypatch.chdir(tmp_path / "a" / "r")
    drawn.clear()
    fedweave.plots.plot_runs([".", tmp_path / "b" / "r"], tmp_path / "q")
    assert drawn[0] == ["a/r", "b/r"]


@pytest.mark.slow
def test_plot_of_a_sweep_directory_draws_its_current_grid_and_skips_a_run_without_rows(
    toy_config, tmp_path, monkeypatch
):
    # `fedweave plot SWEEP` drew every directory in runs/: an earlier grid's runs too, and a run just started
    # (no metrics.jsonl yet) ended the command in "metrics.jsonl not found"
    import fedweave.plots

    cfg = {**toy_config, "rounds": 1}
    fedweave.sweep(cfg, {"local.lr": [0.05]}, out=tmp_path / "s", progress=False)  # an earlier grid
    fedweave.sweep(cfg, {"local.lr": [0.2]}, seeds=2, out=tmp_path / "s", progress=False)
    started = tmp_path / "s" / "runs" / "local.lr=0.2,seed=4"  # as if its run had only just started
    for name in ("metrics.jsonl", "metrics.csv", "summary.json"):
        (started / name).unlink()
    drawn, plot_runs = [], fedweave.plots.plot_runs
    monkeypatch.setattr(
        fedweave.plots, "plot_runs", lambda runs, out, metric: drawn.extend(runs) or plot_runs(runs, out, metric)
    )
    assert cli_main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "p")]) == 0  # the run without rows: no line
    assert drawn == [tmp_path / "s" / "runs" / "local.lr=0.2,seed=3", started]  # the current grid's, in its order
    assert list((tmp_path / "p").glob("*.png"))


def test_plot_of_several_runs_without_out_does_not_replace_the_first_directorys_plots(toy_config, tmp_path, capsys):
    # the overlay went to the first directory by default, over the sweep's own plots (its bands over seeds)
    fedweave.sweep({**toy_config, "rounds": 2}, {"local.lr": [0.05, 0.2]}, out=tmp_path / "s", progress=False)
    own = {p.name: p.read_bytes() for p in (tmp_path / "s").glob("*.png")}
    run = next((tmp_path / "s" / "runs").iterdir())
    for dirs in ([tmp_path / "s"], [run, tmp_path / "s"]):
        assert cli_main(["plot", *map(str, dirs)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "needs --out" in err, err
    assert own and {p.name: p.read_bytes() for p in (tmp_path / "s").glob("*.png")} == own
    assert cli_main(["plot", str(run)]) == 0  # one run: its own plots, drawn again
    assert cli_main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "p")]) == 0
    # --out naming another run's directory: its own plots were replaced by these runs' curves, without a word
    other, mine = sorted((tmp_path / "s" / "runs").iterdir())
    plot_runs([mine], mine)  # (drawn, so that its plots are there to be replaced)
    kept = {p.name: p.read_bytes() for p in mine.glob("*.png")}
    for dirs in ([other], [other, mine]):
        assert cli_main(["plot", *map(str, dirs), "--out", str(mine)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{mine} holds a run, whose own plots" in err, err
    assert kept and {p.name: p.read_bytes() for p in mine.glob("*.png")} == kept
    # --out naming a sweep's folder: its own figures (bands over the seeds) were replaced by these curves
    assert cli_main(["plot", str(other), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {tmp_path / 's'} holds a sweep, whose own plots" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").glob("*.png")} == own


@pytest.mark.slow  # a sweep killed in a fresh process and run twice more: about 13 s of CPU
def test_killed_sweep_resumes_to_the_same_tables_as_an_uninterrupted_one(tmp_path):
    cfg = tmp_path / "digits.yaml"
    cfg.write_text(yaml.safe_dump(DIGITS))
    grid = ["--grid", "local.lr=0.02,0.05"]
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "fedweave.cli", "sweep", str(cfg), *grid, "--seeds", "2", "--out", str(killed)]
    proc = subprocess.Popen([*cmd, "--no-progress"], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    was_killed = False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            done = list(killed.glob("runs/*/summary.json"))
            mid = [p for p in killed.glob("runs/*/" + CHECKPOINT) if not (p.parent / "summary.json").exists()]
            if done and mid:  # one run finished and another one part-way
                proc.send_signal(signal.SIGKILL)
                was_killed = True
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None and not was_killed:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert was_killed, f"the sweep ended before it could be killed: {err.decode()[-2000:]}"
    assert not (killed / "sweep.csv").exists()

    assert cli_main(["sweep", str(cfg), *grid, "--seeds", "2", "--out", str(killed), "--no-progress"]) == 0
    full = tmp_path / "full"
    assert cli_main(["sweep", str(cfg), *grid, "--seeds", "2", "--out", str(full), "--no-progress"]) == 0
    assert _read(killed / "sweep.csv") == _read(full / "sweep.csv")
    assert _read(killed / "summary.csv") == _read(full / "summary.csv")


@pytest.mark.slow
def test_a_sweep_on_a_ray_cluster_equals_one_in_processes(tmp_path):
    ray = pytest.importorskip("ray")
    from fedweave.execution.ray import LOCAL_RAY_ENV

    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    cfg = {**DIGITS, "rounds": 3}
    grid = {"local.lr": [0.02, 0.05]}
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # stands for an existing cluster
    try:
        on_ray = fedweave.sweep(cfg, grid, out=tmp_path / "ray", ray_address="auto", progress=False)
    finally:
        ray.shutdown()
    local = fedweave.sweep(cfg, grid, workers=2, out=tmp_path / "pool", progress=False)
    assert _read(tmp_path / "ray" / "sweep.csv") == _read(tmp_path / "pool" / "sweep.csv")
    assert on_ray.summary == local.summary


def test_runs_killed_before_their_first_checkpoint_start_again_and_finished_ones_are_reused(toy_config, tmp_path):

    # three rounds: both files cut to their first two lines (metrics.jsonl has a line a round) are part-way
    toy_config = {**toy_config, "rounds": 3}
    grid = {"local.lr": [0.05, 0.2, 0.4]}
    full = fedweave.sweep(toy_config, grid, out=tmp_path / "full", progress=False)
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "full", killed)
    (killed / "sweep.csv").unlink()
    a, b, c = (killed / r["run_dir"] for r in full.records)
    # a: SIGKILLed part-way (no checkpoint: none is configured): config and the first rows, no summary
    (a / "summary.json").unlink()
    for name in ("metrics.jsonl", "metrics.csv"):
        lines = (a / name).read_text().splitlines(keepends=True)
        (a / name).write_text("".join(lines[:2]))
    # b: stopped by SIGTERM: its summary says interrupted
    summary = json.loads((b / "summary.json").read_text())
    (b / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    reused = (c / "summary.json").stat().st_mtime_ns
    again = fedweave.sweep(toy_config, grid, out=killed, progress=False)
    assert [r["status"] for r in again.records] == ["completed"] * 3
    assert (c / "summary.json").stat().st_mtime_ns == reused  # finished: not run again
    assert _read(killed / "sweep.csv") == _read(tmp_path / "full" / "sweep.csv")
    assert (a / "metrics.csv").read_text().count("\n") == toy_config["rounds"] + 1


def test_an_unfinished_run_of_another_config_is_not_replaced(toy_config, tmp_path):

    res = fedweave.sweep(toy_config, {"local.lr": [0.05]}, out=tmp_path / "s", progress=False)
    run_dir = tmp_path / "s" / res.records[0]["run_dir"]
    (run_dir / "summary.json").unlink()
    with pytest.raises(RunFailed, match="RunDirError: .* already holds an unfinished run") as e:
        fedweave.sweep({**toy_config, "rounds": 3}, {"local.lr": [0.05]}, out=tmp_path / "s", progress=False)
    assert isinstance(e.value.__cause__, RunDirError)


def test_a_sweep_refused_for_another_configs_run_leaves_the_sweep_directory_as_it_was(toy_config, tmp_path, capsys):
    # the refusal came from the worker that reached the point, after sweep.json had been rewritten for the new
    # sweep: the earlier sweep's baseline was gone and its report read its runs by the new grid
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**toy_config, "rounds": 1}))
    args = ["sweep", str(cfg), "--grid", "local.lr=0.05,0.1", "--out", str(tmp_path / "s"), "--no-progress"]
    assert cli_main([*args, "--baseline", "0.05"]) == 0
    before = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli_main([*args[:3], "local.lr=0.05,0.2", *args[4:], "rounds=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds a finished run of another config" in err, err
    assert "local.lr=0.05,seed=3" in err
    assert {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    ("override", "recorded"),
    [
        ("local.lr=0.3", lambda c: c.local.lr == 0.3),
        # before: the old runs relabelled too, their test_accuracy the global model's under personal_test: true
        ("eval.personal_test=true", lambda c: c.eval.personal_test),
        # before: the old runs' 4 rounds reported under a callback that would have stopped them earlier
        ("callbacks=[{name: stop_at_target, metric: test_accuracy, target: 0.1}]", lambda c: len(c.callbacks) == 1),
    ],
)
def test_a_sweep_run_again_with_another_local_lr_does_not_take_the_old_runs_as_its_own(
    toy_config, tmp_path, override, recorded
):
    # a resume may change local.lr (a diverged run continued more gently), eval and callbacks: each finished run,
    # checkpointed, was resumed with the new value, ran no round, wrote it into its config.yaml and was reported
    # under it
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 2}}
    grid = {"algorithm.clients_per_round": [3, 4]}
    fedweave.sweep(cfg, grid, out=tmp_path / "s", progress=False)
    before = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    with pytest.raises(RunFailed, match="RunDirError: .* already holds a finished run of another config") as e:
        fedweave.sweep(cfg, grid, out=tmp_path / "s", progress=False, overrides=[override])
    assert "algorithm.clients_per_round=3" in str(e.value)
    assert {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()} == before
    # what the sweep must give: runs made with the new value (a sweep of it elsewhere), not the old runs relabelled
    new = fedweave.sweep(cfg, grid, out=tmp_path / "t", progress=False, overrides=[override])
    assert all(recorded(load(tmp_path / "t" / r["run_dir"] / "config.yaml")) for r in new.records)
    # a killed run reached by a worker (no up-front refusal) is not continued with the new value either
    from fedweave.experiments.jobs import run_points

    points = expand(cfg, grid, overrides=[override])
    (tmp_path / "s" / "runs" / points[0].slug / "summary.json").unlink()
    with pytest.raises(RunFailed, match="already holds an unfinished run of another config"):
        run_points(points[:1], tmp_path / "s" / "runs", progress=False)
    assert not recorded(load(tmp_path / "s" / "runs" / points[0].slug / "config.yaml"))


def test_a_sweep_into_a_run_directory_or_over_a_users_tables_is_refused(toy_config, tmp_path):
    # the sweep's plots bear the names of a run's own (test_accuracy_vs_rounds.png): into a run directory they
    # replaced the run's, silently, and summary.md / summary.csv of the user's were replaced as well
    fedweave.run({**toy_config, "output": {"progress": False, "plots": True}}, run_dir=tmp_path / "r")
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "summary.md").write_text("my notes")
    for folder, why in (("r", "holds a run"), ("u", "holds summary.md, which the sweep would replace")):
        before = {p: p.read_bytes() for p in (tmp_path / folder).rglob("*") if p.is_file()}
        with pytest.raises(ConfigError, match=f"^--out: .*{folder} {why}"):
            fedweave.sweep(toy_config, {"local.lr": [0.05]}, out=tmp_path / folder, progress=False)
        assert {p: p.read_bytes() for p in (tmp_path / folder).rglob("*") if p.is_file()} == before
    # a sweep's own folder is continued, and a folder of other files takes a sweep
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("x")
    for folder in ("s", "s", "o"):
        fedweave.sweep(toy_config, {"local.lr": [0.05]}, out=tmp_path / folder, progress=False)


def test_a_grid_value_too_long_for_a_file_name_gets_a_short_distinct_run_directory(toy_config, tmp_path):
    # the run directory was the label as it is: a long list value (or many keys) made a name past the 255 bytes
    # a file name may have, and the sweep ended in an OSError traceback (File name too long) at its first run
    longs = [list(range(10, 130)), list(range(10, 131))]  # outages after the last round: no round is touched
    res = fedweave.sweep(toy_config, {"faults.outage_rounds": longs}, seeds=2, out=tmp_path / "s", progress=False)
    dirs = [r["run_dir"] for r in res.records]
    assert len(set(dirs)) == 4 and all(len(Path(d).name) <= 200 for d in dirs)
    assert [d.rsplit(",seed=", 1)[1] for d in dirs] == ["3", "4", "3", "4"]
    assert all(r["status"] == "completed" for r in res.records) and len(res.summary) == 2
    assert [load(tmp_path / "s" / d / "config.yaml").faults.outage_rounds for d in dirs[::2]] == longs


def test_a_sweep_with_fewer_rounds_than_its_checkpointed_runs_leaves_the_sweep_directory_as_it_was(
    toy_config, tmp_path
):
    # a completed run's checkpoint is of its last round, which a resume may not go below: its worker refused it,
    # but only after sweep.json had been rewritten for the new grid (the report then read the old runs by it)
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 2}}
    fedweave.sweep(cfg, {"local.lr": [0.05, 0.1]}, out=tmp_path / "s", progress=False)
    before = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    with pytest.raises(RunFailed, match="already holds a finished run of another config"):
        fedweave.sweep({**cfg, "rounds": 2}, {"local.lr": [0.05, 0.2]}, out=tmp_path / "s", progress=False)
    assert {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()} == before
    longer = fedweave.sweep({**cfg, "rounds": 5}, {"local.lr": [0.05, 0.1]}, out=tmp_path / "s", progress=False)
    assert [r["rounds"] for r in longer.records] == [5, 5]  # extended, as before


# ---- every point against a baseline point, paired by seed (--baseline) ----------------------------------------
ALGOS = ["--grid", "algorithm.name=fedavg,fedprox,scaffold", "--seeds", "3"]


@pytest.fixture(scope="module")
def algos(tmp_path_factory):
    """A 3-point x 3-seed sweep of 2 rounds, run once with --baseline fedavg: its directory and its printout."""

    d = tmp_path_factory.mktemp("algos")
    cfg = d / "c.yaml"
    cfg.write_text(yaml.safe_dump({**TOY_CONFIG, "rounds": 2}))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli_main(["sweep", str(cfg), *ALGOS, "--baseline", "algorithm.name=fedavg", "--out", str(d / "s"),
                       "--no-progress"])  # fmt: skip
    assert rc == 0
    return cfg, d / "s", printed.getvalue()


def _finals(out) -> dict[tuple[str, int], float]:
    """Each run's final test accuracy read from its own summary.json, by (algorithm, seed)."""

    got = {}
    for run in (out / "runs").iterdir():
        conf = yaml.safe_load((run / "config.yaml").read_text())
        got[(conf["algorithm"]["name"], conf["seed"])] = json.loads((run / "summary.json").read_text())["final"][
            "test_accuracy"
        ]
    return got


def test_points_against_a_baseline_equal_a_paired_t_interval_computed_from_the_runs(algos):

    _, out, printed = algos
    finals = _finals(out)
    summary = {r["point"]: r for r in _read(out / "summary.csv")}
    for algo in ("fedprox", "scaffold"):
        d = np.array([finals[(algo, s)] - finals[("fedavg", s)] for s in (3, 4, 5)])
        half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
        row = summary[f"algorithm.name={algo}"]
        got = [float(row[k]) for k in ("test_accuracy_diff", "test_accuracy_diff_low", "test_accuracy_diff_high")]
        assert got == pytest.approx([d.mean(), d.mean() - half, d.mean() + half], rel=1e-12, abs=1e-15)
        want = "better" if d.mean() - half > 0 else "worse" if d.mean() + half < 0 else "inconclusive"
        assert (row["pairs"], row["vs_baseline"], row["unpaired"]) == ("3", want, "")
        (line,) = [x for x in printed.splitlines() if f"algorithm.name={algo}" in x]
        assert want in line  # the printed table carries the columns
    base = summary["algorithm.name=fedavg"]
    assert (base["vs_baseline"], base["pairs"], base["test_accuracy_diff"]) == ("baseline", "", "")
    # sweep.csv: each run's final metric minus the baseline's at its seed
    for r in _read(out / "sweep.csv"):
        want = finals[(r["algorithm.name"], int(r["seed"]))] - finals[("fedavg", int(r["seed"]))]
        assert float(r["diff_final_test_accuracy"]) == pytest.approx(want, abs=1e-15)
    spec = json.loads((out / "sweep.json").read_text())
    assert spec["baseline"] == {"point": "algorithm.name=fedavg", "level": 0.95, "test": "t"}
    assert "vs_baseline" in printed and "test_accuracy_diff_low" in printed


def test_a_seed_pairs_the_partition_across_points_and_not_across_seeds(algos):
    # a seed fixes the partition (and the other streams) whatever the algorithm, so the points' runs pair
    _, out, _ = algos
    parts = {r.name: (r / "partition.csv").read_text() for r in (out / "runs").iterdir()}
    for s in (3, 4, 5):
        assert len({parts[f"algorithm.name={a},seed={s}"] for a in ("fedavg", "fedprox", "scaffold")}) == 1
    assert len({parts[f"algorithm.name=fedavg,seed={s}"] for s in (3, 4, 5)}) == 3


def _copy(out, tmp_path):
    """A copy of the shared sweep to run again (its runs reused), leaving the shared one as it was."""

    return shutil.copytree(out, tmp_path / "s")


def test_without_a_baseline_the_files_are_the_sweeps_without_its_columns(algos, tmp_path):

    cfg, done, _ = algos
    out = _copy(done, tmp_path)
    with_base = {n: (out / n).read_text() for n in ("sweep.csv", "summary.csv")}
    assert cli_main(["sweep", str(cfg), *ALGOS, "--out", str(out), "--no-progress"]) == 0  # the runs are reused
    added = {"diff_final_test_accuracy", "test_accuracy_diff", "test_accuracy_diff_low", "test_accuracy_diff_high",
             "pairs", "vs_baseline", "unpaired"}  # fmt: skip
    for name, text in with_base.items():
        rows = list(csv.DictReader(io.StringIO(text)))
        kept = [k for k in rows[0] if k not in added]
        assert (out / name).read_text() == csv_text(rows, kept), name
        assert not added & set(next(csv.reader(io.StringIO((out / name).read_text()))))
    assert "baseline" not in yaml.safe_load((out / "sweep.json").read_text())


def test_a_baseline_from_the_sweep_section_with_the_bootstrap(algos, tmp_path):

    cfg, done, _ = algos
    out = _copy(done, tmp_path)
    section = {"grid": {"algorithm.name": ["fedavg", "fedprox", "scaffold"]}, "seeds": 3}
    spec = {**yaml.safe_load(cfg.read_text()), "sweep": {**section, "baseline": "fedavg", "test": "bootstrap"}}
    cfg2 = tmp_path / "with_sweep.yaml"
    cfg2.write_text(yaml.safe_dump(spec))
    assert cli_main(["sweep", str(cfg2), "--out", str(out), "--no-progress", "--level", "0.9"]) == 0
    assert json.loads((out / "sweep.json").read_text())["baseline"] == {
        "point": "algorithm.name=fedavg",
        "level": 0.9,
        "test": "bootstrap",
    }
    runs = _read(out / "sweep.csv")
    for row in _read(out / "summary.csv")[1:]:  # a percentile interval of the mean lies within the differences
        d = [float(r["diff_final_test_accuracy"]) for r in runs if r["point"] == row["point"]]
        low, high = float(row["test_accuracy_diff_low"]), float(row["test_accuracy_diff_high"])
        assert min(d) <= low <= float(row["test_accuracy_diff"]) <= high <= max(d)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--baseline", "algorithm.name=fedsgd"], ["--baseline algorithm.name=fedsgd", "no point", "fedavg, fedprox"]),
        (["--baseline", "local.lr=0.1"], ["'local.lr'", "not a key", "allowed: algorithm.name"]),
        (["--grid", "local.lr=0.1,0.2", "--baseline", "fedavg"], ["must name its key", "algorithm.name, local.lr"]),
        (["--grid", "local.lr=0.1,0.2", "--baseline", "algorithm.name=fedavg"], ["names 2 points", "local.lr"]),
        (["--baseline", "fedavg", "--test", "z"], ["--test 'z'", "t, bootstrap"]),
        (["--baseline", "fedavg", "--level", "1.5"], ["--level 1.5", "(0, 1)"]),
        (["--level", "0.9"], ["--baseline"]),
        (["--baseline", "fedavg", "--correction", "sidak"], ["--correction 'sidak'", "none, holm, bonferroni"]),
        (["--correction", "holm"], ["--correction", "--baseline"]),
        (["--baseline", "[fedavg"], ["--baseline", "'[fedavg'", "not valid YAML"]),  # the one-key shorthand
        (["--baseline", "algorithm.name=[fedavg"], ["--baseline", "'[fedavg'", "'[' is not closed"]),
        (["--zip", "local.lr=[0.1,0.2"], ["--zip local.lr", "'[0.1,0.2'", "'[' is not closed"]),
    ],
)
def test_a_bad_baseline_is_one_clear_line_before_anything_runs(toy_config, tmp_path, capsys, extra, words):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(toy_config))
    args = ["sweep", str(cfg), "--grid", "algorithm.name=fedavg,fedprox", "--out", str(tmp_path / "s")]
    assert cli_main([*args, *extra, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "s").exists()


def test_a_diverged_run_is_not_paired_and_one_pair_is_n_below_2(toy_config, tmp_path):
    grid = {"local.lr": [0.1, 1e38]}
    res = fedweave.sweep({**toy_config, "rounds": 2}, grid, seeds=2, out=tmp_path / "s", progress=False,
                         baseline="local.lr=0.1")  # fmt: skip
    blown = res.summary[1]
    assert (blown["vs_baseline"], blown["pairs"], blown["test_accuracy_diff"]) == ("n < 2", 0, None)
    assert blown["unpaired"] == "seed 3 diverged; seed 4 diverged"  # not "3 diverged": a count beside the column
    assert [r["diff_final_test_accuracy"] for r in res.records[2:]] == [None, None]


def test_a_completed_run_that_ended_on_nan_is_named_not_paired():

    recs = [
        {"point": p, "seed": s, "status": "completed", "v": 0.5 + 0.1 * s * (p == "b")} for p in "ab" for s in (1, 2, 3)
    ]
    recs[4]["v"] = float("nan")  # b, seed 2
    got = compare(recs, "v", "a", "max")
    assert (got["b"].n, got["b"].unpaired) == (2, "seed 2 v nan")
    assert got["b"].diff == pytest.approx(0.2)  # seeds 1 and 3: +0.1 and +0.3
    only = compare(recs[:2] + recs[3:5], "v", "a", "max")  # seeds 1 and 2, seed 2 NaN: one pair
    assert (only["b"].outcome, only["b"].n, only["b"].low) == ("n < 2", 1, None)


@pytest.mark.parametrize("key, outcome", [("test_accuracy", "better"), ("test_loss", "worse"), ("opt_gap", "worse")])
def test_better_follows_the_metrics_direction(key, outcome):

    gains = {1: 0.10, 2: 0.12, 3: 0.11}  # b is higher than a at every seed, by about the same
    recs = [
        {"point": p, "seed": s, "status": "completed", key: 0.5 + g * (p == "b")}
        for p in "ab"
        for s, g in gains.items()
    ]
    got = compare(recs, key, "a", column_direction(key))["b"]
    assert (got.outcome, got.n) == (outcome, 3) and got.low > 0
    assert (
        compare(recs, key, "b", column_direction(key))["a"].outcome == {"better": "worse", "worse": "better"}[outcome]
    )


# ---- a family-wise correction of the comparisons with the baseline (--correction) ---------------------------
def test_holm_and_bonferroni_adjust_p_values_as_computed_by_hand():
    p = [0.01, 0.04, 0.03, 0.005]
    # Bonferroni: m p, m = 4
    assert adjust(p, "bonferroni") == pytest.approx([0.04, 0.16, 0.12, 0.02])
    # Holm: ranked 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running max 0.02, 0.03,
    # 0.06, 0.06
    assert adjust(p, "holm") == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert adjust(p, "none") == p
    # the levels at 95 %: 0.005 < 0.05/4 and 0.01 < 0.05/3 are called at 1 - 0.05/4 and 1 - 0.05/3; 0.03 is not
    # below 0.05/2, so the step-down stops there: 0.03 and 0.04 at 1 - 0.05/2
    assert levels(p, 0.95, "holm") == pytest.approx([1 - 0.05 / 3, 0.975, 0.975, 1 - 0.05 / 4])
    assert levels(p, 0.95, "bonferroni") == pytest.approx([0.9875] * 4)
    assert levels(p, 0.95, "none") == [0.95] * 4
    assert adjust([0.2, 0.01, 0.2], "holm") == pytest.approx([0.4, 0.03, 0.4])  # a tie keeps the step-down's value
    assert adjust([0.6, 0.7], "holm") == [1.0, 1.0] and adjust([], "holm") == []  # capped at 1


# each point's final accuracy minus the baseline's (local.lr=0.1) at seeds 3..7, and its paired t p-value
GAINS = {
    0.2: [0.10, 0.12, 0.11, 0.10, 0.12],  # p 1.6e-5: better, whatever the correction
    0.3: [0.02, 0.05, 0.01, 0.03, 0.04],  # p 0.0132: below 0.05/3 (Holm's 2nd rank), above 0.05/4 (Bonferroni)
    0.4: [0.01, 0.04, 0.00, 0.03, 0.05],  # p 0.0486: better alone, not below 0.05/2 at Holm's 3rd rank
    0.5: [-0.02, 0.03, 0.01, -0.01, 0.02],  # p 0.553
}


@pytest.fixture
def planted(monkeypatch, toy_config):
    """A sweep of 5 points x 5 seeds whose runs end on the accuracies of GAINS (the runs themselves are not run:
    ``run_points`` returns their summaries), and its grid."""

    base = {s: 0.5 + 0.01 * s for s in range(3, 8)}

    def run_points(points, runs_dir, **_):
        out = {}
        for p in points:
            lr, i = dict(p.values)["local.lr"], p.seed - 3
            acc = base[p.seed] + (GAINS[lr][i] if lr in GAINS else 0.0)
            summary = {"status": "completed", "rounds": 1, "final": {"test_accuracy": acc}, "wall_seconds": 0.0,
                       "main_metric": "test_accuracy", "communication": {"bytes_total": 0}}  # fmt: skip
            out[p.slug] = Result(runs_dir / p.slug, [], summary)
        return out

    # the module, not fedweave.experiments.sweep, which is its function
    monkeypatch.setattr(sys.modules["fedweave.experiments.sweep"], "run_points", run_points)
    return toy_config, {"local.lr": [0.1, *GAINS]}


def test_a_point_better_alone_is_inconclusive_under_holm_among_several(planted, tmp_path):
    config, grid = planted
    p = {lr: stats.ttest_1samp(g, 0.0).pvalue for lr, g in GAINS.items()}  # computed apart from the sweep
    runs = {}
    for correction in (None, "none", "holm", "bonferroni"):
        res = fedweave.sweep(config, grid, seeds=5, out=tmp_path / str(correction), progress=False,
                             baseline="local.lr=0.1", correction=correction)  # fmt: skip
        runs[correction] = {float(r["point"].split("=")[1]): r for r in res.summary}
        spec = json.loads((tmp_path / str(correction) / "sweep.json").read_text())["baseline"]
        header = (tmp_path / str(correction) / "summary.csv").read_text().splitlines()[0].split(",")
        if correction is None:  # not given: the files of a sweep run before the option
            assert "correction" not in spec and not set(CORRECTED) & set(header)
        else:  # given, none too: said in sweep.json, on every row of summary.csv and in summary.md
            assert spec["correction"] == correction and set(CORRECTED) <= set(header)
            assert all(r["correction"] == correction for r in res.summary)
            assert f"| {correction} |" in (tmp_path / str(correction) / "summary.md").read_text()
    outcome = {c: {lr: runs[c][lr]["vs_baseline"] for lr in GAINS} for c in runs}
    assert outcome[None] == outcome["none"] == {0.2: "better", 0.3: "better", 0.4: "better", 0.5: "inconclusive"}
    # Holm: 1.6e-5 < 0.05/4, 0.0132 < 0.05/3, 0.0486 >= 0.05/2: the step-down stops at 0.4
    assert outcome["holm"] == {0.2: "better", 0.3: "better", 0.4: "inconclusive", 0.5: "inconclusive"}
    # Bonferroni: only 1.6e-5 < 0.05/4
    assert outcome["bonferroni"] == {0.2: "better", 0.3: "inconclusive", 0.4: "inconclusive", 0.5: "inconclusive"}

    holm = runs["holm"]
    want_level = {0.2: 1 - 0.05 / 4, 0.3: 1 - 0.05 / 3, 0.4: 1 - 0.05 / 2, 0.5: 1 - 0.05 / 2}
    want_adj = {0.2: 4 * p[0.2], 0.3: 3 * p[0.3], 0.4: 2 * p[0.4], 0.5: p[0.5]}
    for lr, g in GAINS.items():
        r, d = holm[lr], np.array(g)
        assert r["p_value"] == pytest.approx(p[lr], rel=1e-9) and r["p_adjusted"] == pytest.approx(want_adj[lr])
        assert r["interval_level"] == pytest.approx(want_level[lr])
        half = stats.t.ppf((1 + want_level[lr]) / 2, 4) * d.std(ddof=1) / np.sqrt(5)
        got = [r["test_accuracy_diff_low"], r["test_accuracy_diff_high"]]
        assert got == pytest.approx([d.mean() - half, d.mean() + half], abs=1e-12)
        # uncorrected: the 95 % interval, as before the option
        assert runs[None][lr]["test_accuracy_diff_low"] == pytest.approx(
            d.mean() - stats.t.ppf(0.975, 4) * d.std(ddof=1) / np.sqrt(5), abs=1e-12
        )
    assert holm[0.4]["test_accuracy_diff_low"] < 0 < runs[None][0.4]["test_accuracy_diff_low"]
    base = holm[0.1]
    assert (base["vs_baseline"], base["p_value"], base["interval_level"]) == ("baseline", None, None)


def test_holm_with_the_bootstrap_calls_a_point_when_its_interval_leaves_zero(planted, tmp_path):
    # the bootstrap's p-values invert its percentile interval: each outcome is its interval's at the row's level
    config, grid = planted
    res = fedweave.sweep(config, grid, seeds=5, out=tmp_path / "s", progress=False, baseline="local.lr=0.1",
                         test="bootstrap", correction="holm")  # fmt: skip
    rows = res.summary[1:]
    assert sorted(r["interval_level"] for r in rows)[-1] == pytest.approx(1 - 0.05 / 4)
    for r in rows:
        off = r["test_accuracy_diff_low"] > 0 or r["test_accuracy_diff_high"] < 0
        assert (r["vs_baseline"] != "inconclusive") == off == (r["p_adjusted"] < 0.05), r


def test_the_correction_from_the_sweep_section_and_a_bad_one(algos, tmp_path, capsys):
    cfg, done, _ = algos
    out = _copy(done, tmp_path)
    section = {"grid": {"algorithm.name": ["fedavg", "fedprox", "scaffold"]}, "seeds": 3, "baseline": "fedavg"}
    spec = yaml.safe_load(cfg.read_text())
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({**spec, "sweep": {**section, "correction": "holm"}}))
    bad.write_text(yaml.safe_dump({**spec, "sweep": {**section, "correction": "fdr"}}))
    assert cli_main(["sweep", str(bad), "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sweep.correction 'fdr' unknown" in err and "none, holm, bonferroni" in err
    assert cli_main(["sweep", str(good), "--out", str(out), "--no-progress"]) == 0  # the runs are reused
    assert json.loads((out / "sweep.json").read_text())["baseline"]["correction"] == "holm"
    # the runs' own finals: Holm by hand over the 2 points compared
    finals, rows = _finals(out), {r["point"]: r for r in _read(out / "summary.csv")}
    algos_ = ("fedprox", "scaffold")
    diffs = {a: np.array([finals[(a, s)] - finals[("fedavg", s)] for s in (3, 4, 5)]) for a in algos_}
    p = {a: stats.ttest_rel(*[[finals[(x, s)] for s in (3, 4, 5)] for x in (a, "fedavg")]).pvalue for a in algos_}
    p = {a: 1.0 if np.all(diffs[a] == 0) else v for a, v in p.items()}  # no difference: scipy's nan
    first, second = sorted(algos_, key=p.get)
    called = p[first] < 0.025
    for a, m in ((first, 2), (second, 1 if called else 2)):
        row = rows[f"algorithm.name={a}"]
        assert float(row["interval_level"]) == pytest.approx(1 - 0.05 / m) and row["correction"] == "holm"
        assert float(row["p_value"]) == pytest.approx(p[a], rel=1e-9, abs=1e-15)
    assert float(rows[f"algorithm.name={first}"]["p_adjusted"]) == pytest.approx(min(1.0, 2 * p[first]))


@pytest.mark.parametrize("key, value", [("correction", "holm"), ("level", 0.9), ("test", "bootstrap")])
def test_a_sweep_section_comparison_key_without_a_baseline_is_named_as_the_file_spells_it(key, value, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    spec = {"name": "n", "rounds": 1, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 2},
            "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 2},
            "sweep": {"grid": {"algorithm.name": ["fedavg", "fedprox"]}, key: value}}  # fmt: skip
    cfg.write_text(yaml.safe_dump(spec))
    assert cli_main(["sweep", str(cfg), "--out", str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"sweep.{key} applies to a comparison" in err and "sweep.baseline" in err
    assert not (tmp_path / "s").exists()


def test_sweep_overrides_given_as_one_string_is_one_line_before_anything_is_written(toy_config, tmp_path):
    # before: the string was read letter by letter ("override 'r' must look like key=value"); fedweave.run says
    # what to pass for the same mistake
    with pytest.raises(GridError, match=r"^overrides must be a list of key=value strings, .*; got 'rounds=2'$"):
        fedweave.sweep(toy_config, {"local.lr": [0.1]}, overrides="rounds=2", out=tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("override", "grid_key"),
    [("local.lr=0.5", "local.lr"), ("local={lr: 0.5}", "local.lr"), ("local.lr=0.5", "local"), ("rounds=2", "rounds")],
)
def test_an_override_of_a_key_the_grid_sets_is_one_line_before_anything_is_written(
    toy_config, tmp_path, override, grid_key
):
    # before: the grid's values were set over the override, which was never used, without a word
    values = [{"lr": 0.1}, {"lr": 0.2}] if grid_key == "local" else [1, 2] if grid_key == "rounds" else [0.1, 0.2]
    key = override.partition("=")[0]
    want = f"^override '{re.escape(override)}' sets '{key}', and the sweep's grid sets '{grid_key}' for every point"
    for axes in ({"grid": {grid_key: values}}, {"zipped": {grid_key: values}}):
        with pytest.raises(GridError, match=want):
            fedweave.sweep(toy_config, **axes, overrides=[override], out=tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    # another key of the section, or one whose name only begins alike, is an override as before
    (point,) = expand(toy_config, {"local.lr": [0.1]}, overrides=["local.epochs=2", "local.lr_schedule=cosine"])
    assert point.config.local.epochs == 2 and point.config.local.lr == 0.1


def test_fedweave_sweep_of_a_config_with_a_sweep_section_says_what_reads_it(toy_config, tmp_path):
    # before: the single run's line ("a single run ('fedweave run', fedweave.run) takes the config without it")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**toy_config, "sweep": {"grid": {"local.lr": [0.1]}}}))
    with pytest.raises(GridError, match=r"^sweep: fedweave\.sweep takes the grid, .*'fedweave sweep CONFIG'"):
        fedweave.sweep(str(path), out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_point_with_one_completed_run_shows_no_spread(toy_config, tmp_path):
    """A sample std needs two runs: one seed's point has std NaN (``-`` in summary.md, empty of meaning as 0.0)."""
    out = fedweave.sweep(toy_config, parse_grid(["local.lr=0.05,0.2"]), seeds=1, out=tmp_path / "s", progress=False)
    for row in out.summary:
        assert row["seeds"] == 1 and math.isfinite(row["test_accuracy_mean"]) and math.isnan(row["test_accuracy_std"])
    lines = (tmp_path / "s" / "summary.md").read_text().splitlines()
    std = lines[0].split("|").index(" test_accuracy_std ")
    assert [line.split("|")[std].strip().strip("*") for line in lines[2:]] == ["-", "-"]
    rows = _read(tmp_path / "s" / "summary.csv")
    assert [r["test_accuracy_std"] for r in rows] == ["nan", "nan"]


TINY_DIGITS = {  # a smaller digits run than DIGITS, whose lr 3.6e36 diverges on 4 of 6 seeds
    "name": "tiny", "seed": 0, "rounds": 3, "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 6, "alpha": 0.5, "min_size": 20},
    "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 3},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.05}, "output": {"progress": False, "plots": False},
}  # fmt: skip


def test_a_point_whose_seeds_partly_diverged_is_drawn_and_marked_by_the_sweep_and_the_report(tmp_path, monkeypatch):
    """At lr 3.6e36 two of six seeds finish and four diverge, some before their first row: the sweep's own plots
    dropped the point (a seed without rows emptied its band) or drew it unmarked, and the report's legend counted
    only the runs with rows (``2 of 4 diverged`` for 4 of 6)."""
    from fedweave.experiments import plots

    drawn = []
    monkeypatch.setattr(plots, "plot_curves", lambda curves, *a, **k: drawn.append(list(curves)))
    res = fedweave.sweep(TINY_DIGITS, {"local.lr": [3.6e36]}, seeds=6, out=tmp_path / "s", progress=False)
    statuses = [r["status"] for r in res.records]
    assert statuses.count("diverged") == 4 and statuses.count("completed") == 2
    assert any(not (tmp_path / "s" / r["run_dir"] / "metrics.jsonl").is_file() for r in res.records)
    assert drawn[0] == ["local.lr=3.6e+36 (4 of 6 diverged)"]
    drawn.clear()
    from fedweave.experiments.report import build_report

    build_report([tmp_path / "s"])
    assert drawn[0] == ["local.lr=3.6e+36 (4 of 6 diverged)"]


def test_a_sweep_whose_every_run_diverged_before_a_row_tabulates_the_tasks_main_metric(tmp_path):
    """Every run diverged before its first evaluation: the sweep tabulated ``test_loss`` (the algorithm's plot
    column, which a summary without a main metric falls back to), not the task's ``test_accuracy``."""
    res = fedweave.sweep(TINY_DIGITS, {"local.lr": [1e38]}, seeds=2, out=tmp_path / "s", progress=False)
    assert [r["status"] for r in res.records] == ["diverged", "diverged"]
    assert "test_accuracy_mean" in res.summary[0] and "test_loss_mean" not in res.summary[0]
