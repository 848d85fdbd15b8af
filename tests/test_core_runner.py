"""FedAvg through the runner: ledger formula, determinism, run-directory files, errors, divergence, resume."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch
import yaml

import fedweave
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError, load
from fedweave.runner import DivergenceError, resume, run


def test_fedavg_bytes_match_the_formula(toy_config, tmp_path):
    res = fedweave.run(toy_config, run_dir=tmp_path / "r")
    params = 36 * 4 + 4  # logistic on 1x6x6 inputs, 4 classes
    expected = toy_config["rounds"] * toy_config["algorithm"]["clients_per_round"] * params * 4
    comm = res.summary["communication"]
    assert comm["bytes_up"] == expected and comm["bytes_down"] == expected
    assert res.metrics[-1]["bytes_up"] == expected
    assert res.metrics[0]["bytes_up"] == expected // toy_config["rounds"]  # cumulative per round


def test_same_seed_same_metrics_and_other_seed_differs(toy_config, tmp_path):
    a = fedweave.run(toy_config, run_dir=tmp_path / "a")
    b = fedweave.run(toy_config, run_dir=tmp_path / "b")
    strip = [{k: v for k, v in r.items() if k != "wall_seconds"} for r in a.metrics]
    assert strip == [{k: v for k, v in r.items() if k != "wall_seconds"} for r in b.metrics]
    c = fedweave.run({**toy_config, "seed": 4}, run_dir=tmp_path / "c")
    assert c.metrics[-1]["test_loss"] != a.metrics[-1]["test_loss"]


def test_fedavg_learns_the_toy_problem(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 15, "eval": {"every": 5}}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert [r["round"] for r in res.metrics] == [5, 10, 15]
    assert res.final_accuracy > 0.8  # chance is 0.25


def test_loop_and_vmap_runs_agree(toy_config, tmp_path):
    out = {}
    for backend in ("loop", "vmap"):
        out[backend] = fedweave.run({**toy_config, "backend": backend}, run_dir=tmp_path / backend)
    for ra, rb in zip(out["loop"].metrics, out["vmap"].metrics):
        assert ra["test_loss"] == pytest.approx(rb["test_loss"], rel=1e-5)


def test_run_directory_contents(toy_config, tmp_path):
    cfg = {**toy_config, "output": {"progress": False, "plots": True}}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    d = res.run_dir
    assert {p.name for p in d.iterdir()} >= {
        "config.yaml",
        "metrics.csv",
        "metrics.jsonl",
        "summary.json",
        "test_accuracy_vs_rounds.png",
        "test_accuracy_vs_bytes.png",
        "partition.csv",
        "partition.png",
    }
    header = next(csv.reader((d / "metrics.csv").open()))
    assert header[:6] == ["round", "test_accuracy", "test_loss", "bytes_up", "bytes_down", "wall_seconds"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["seed"] == 3
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["cpu_seconds"] > 0 and summary["wall_seconds"] > 0  # CPU time of the run, next to wall time
    assert summary["execution"] == {"backend": "loop", "threads": 1}  # what `auto` resolved to
    resolved = yaml.safe_load((d / "config.yaml").read_text())
    assert load(resolved).to_dict() == resolved  # the resolved config reloads to itself
    assert not list(d.glob(".*.tmp"))  # no temp files left behind


def test_misspelled_key_is_named(tmp_path, toy_config, capsys):
    bad = {**toy_config, "local": {"lrr": 0.1}}
    with pytest.raises(ConfigError, match=r"unknown key 'local\.lrr'.*Did you mean 'lr'"):
        load(bad)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert cli_main(["run", str(path), "--no-progress"]) == 2
    assert "local.lrr" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("rounds=zero", "rounds must be an integer"),
        ("algorithm.clients_per_round=100", "exceeds partition.num_clients"),
        ("algorithm.weighting=size", "algorithm.weighting must be one of"),
        ("algorithm.name=fedavgg", "unknown algorithm 'fedavgg'. Did you mean 'fedavg'"),
        ("model.depth=3", "model.depth"),
        ("backend=gpu", "backend must be one of"),
        ("backend=null", r"backend must be one of \['auto', 'loop'"),  # said "must be a string", without the names
        ("partition.alpha=-1", "partition.alpha"),
        # set by the run from the dataset: through the builder's **options they used to arrive twice (TypeError)
        ("model.num_classes=1", r"model\.num_classes is not an option: the run passes it to model 'logistic'"),
        ("model.input_shape=[4]", r"model\.input_shape is not an option"),
        ("local.epochs=2", None),
    ],
)
def test_bad_values_get_clear_errors(toy_config, tmp_path, override, message):
    if message is None:
        load(toy_config, [override])
        return
    with pytest.raises((ConfigError, KeyError), match=message):
        run(load(toy_config, [override]), run_dir=tmp_path / "r")


def test_divergence_stops_with_a_clear_error_and_keeps_results(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 30, "local": {"lr": 1e38, "batch_size": 16}}
    with pytest.raises(DivergenceError, match="not finite"):
        run(load(cfg), run_dir=tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "diverged" and "not finite" in summary["error"]
    res = run(load(cfg), run_dir=tmp_path / "r2", on_divergence="return")  # for sweeps: a result
    assert res.summary["status"] == "diverged" and res.summary == json.loads((tmp_path / "r2/summary.json").read_text())
    with pytest.raises(ValueError, match="on_divergence"):
        run(load(cfg), run_dir=tmp_path / "r3", on_divergence="ignore")


@pytest.mark.parametrize("server_lr, how", [(1e10, "exploded"), (1e38, "not finite")])
def test_a_divergence_names_the_step_sizes_the_algorithm_reads(toy_config, tmp_path, server_lr, how):
    # a server step blows the run up while local.lr is modest: the line names algorithm.server_lr too
    cfg = {**toy_config, "algorithm": {"name": "fedavg", "clients_per_round": 4, "server_lr": server_lr}}
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    with pytest.raises(DivergenceError, match=how) as e:
        run(load(cfg), run_dir=tmp_path / "r")
    msg = str(e.value)
    assert "\n" not in msg and "Lower one of its step sizes (local.lr, algorithm.server_lr)" in msg
    if how == "exploded":  # round 1 was good: the resume hint, and that server_lr needs a new run
        assert (
            f"continue with 'fedweave run --resume {tmp_path / 'r'} local.lr=SMALLER' (or with "
            "local.grad_clip=MAX_NORM), or start a new run with a smaller algorithm.server_lr (a resumed run may not "
            "change an algorithm option)."
        ) in msg


def test_a_divergence_under_an_attack_names_the_attack_before_the_step_sizes(toy_config, tmp_path):
    """An attacker may upload anything: a NaN model under faults.byzantine is as likely the attack's as a step
    size's (before, the line advised lowering the step sizes alone); without attackers the advice is unchanged."""
    from fedweave.registry import ALGORITHMS
    from fedweave.runner import divergence_advice

    cfg = {**toy_config, "aggregator": {"name": "mean"}}  # (the length-measuring ones drop a row of no length)
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 12}
    cfg["faults"] = {"byzantine": {"fraction": 0.25, "attack": "gaussian", "std": 1e38}}
    with pytest.raises(DivergenceError, match="not finite") as e:
        run(load(cfg), run_dir=tmp_path / "r")
    msg = str(e.value)
    assert "The attackers of faults.byzantine (attack 'gaussian') may be the cause" in msg and "\n" not in msg
    assert "Otherwise: lower one of its step sizes (local.lr, algorithm.server_lr)" in msg
    fedavg = ALGORITHMS.get("fedavg")
    no_attacker = {"fraction": 0.0, "attack": "gaussian"}
    assert divergence_advice(fedavg, no_attacker) == divergence_advice(fedavg)


def test_a_q_ffl_divergence_names_algorithm_q_before_the_step_size(toy_config, tmp_path):
    """q = 200 makes F_k^q inf in float32 (the first round's model NaN) whatever the step size; before, the line
    advised only "Lower local.lr or enable local.grad_clip", which cannot help."""
    toy_config["algorithm"] = {"name": "qffl", "clients_per_round": 4, "q": 200.0}
    with pytest.raises(DivergenceError, match="not finite") as e:
        run(load(toy_config), run_dir=tmp_path / "r")
    msg = str(e.value)
    assert "lower algorithm.q" in msg and "Otherwise: lower local.lr or enable local.grad_clip." in msg
    assert msg.index("algorithm.q") < msg.index("local.lr") and "\n" not in msg


def test_the_step_sizes_named_after_a_divergence_are_the_algorithms_own():
    from fedweave.algorithms.base import step_size_keys
    from fedweave.registry import ALGORITHMS
    from fedweave.runner import _kept, divergence_advice

    keys = {name: step_size_keys(ALGORITHMS.get(name)) for name in ALGORITHMS.names()}
    assert keys["fedadam"] == keys["fedexp"] == ["local.lr", "algorithm.server_lr"]
    assert keys["zo_hfl"] == ["local.lr", "algorithm.server_lr"]  # not eta, its smoothing radius
    assert keys["cse_fsl"] == ["local.lr", "algorithm.client_lr", "algorithm.aux_lr", "algorithm.server_lr"]
    assert keys["hier_fedavg"] == keys["gossip"] == ["local.lr"]
    # a server_lr the method refuses unless 1 is not offered
    assert keys["proxskip"] == keys["feddyn"] == keys["qffl"] == keys["fedasync"] == ["local.lr"]
    # the confederated family reads no local key: neither local.lr nor local.grad_clip is suggested
    saga = ALGORITHMS.get("cfl_saga")
    assert keys["cfl_saga"] == ["algorithm.step_size", "algorithm.step_scale"]
    assert divergence_advice(saga) == "Lower one of its step sizes (algorithm.step_size, algorithm.step_scale)."
    assert _kept("runs/a", 3, saga) == (
        "The checkpoint of round 3 is kept, but a resumed run may not change an algorithm option: start a new run "
        "with a smaller algorithm.step_size or algorithm.step_scale."
    )
    assert divergence_advice(ALGORITHMS.get("gossip")) == "Lower local.lr or enable local.grad_clip."
    assert _kept("runs/a", 3, ALGORITHMS.get("gossip")).endswith(
        "--resume runs/a local.lr=SMALLER' (or with local.grad_clip=MAX_NORM)."
    )
    # local.lr may be lowered on resume, FedAdam's server_lr only in a new run: the line offers both, each named
    assert _kept("runs/a", 3, ALGORITHMS.get("fedadam")) == (
        "The checkpoint of round 3 is kept; continue with 'fedweave run --resume runs/a local.lr=SMALLER' (or with "
        "local.grad_clip=MAX_NORM), or start a new run with a smaller algorithm.server_lr (a resumed run may not "
        "change an algorithm option)."
    )
    assert _kept("runs/a", 3, ALGORITHMS.get("cse_fsl")).endswith(
        "or start a new run with a smaller algorithm.client_lr, algorithm.aux_lr or algorithm.server_lr (a resumed "
        "run may not change an algorithm option)."
    )

    class ServerStepOnly(ALGORITHMS.get("fedavg")):  # a method whose only step size is an algorithm option
        unread_config = {"local.lr": "takes no local step"}
        step_sizes = ("server_lr",)

    assert step_size_keys(ServerStepOnly) == ["algorithm.server_lr"]
    assert _kept("runs/a", 3, ServerStepOnly) == (
        "The checkpoint of round 3 is kept, but a resumed run may not change an algorithm option: start a new run "
        "with a smaller algorithm.server_lr."
    )
    assert "--resume" not in _kept("runs/a", 3, ServerStepOnly)
    # every key named is one a config may set
    for name, named in keys.items():
        fields = {f.name for f in dataclasses.fields(ALGORITHMS.get(name).Hparams)}
        assert {k.removeprefix("algorithm.") for k in named if k.startswith("algorithm.")} <= fields, name


def test_resume_continues_identically(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 6, "output": {"progress": False, "plots": False, "checkpoint_every": 2}}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    part = {**cfg, "rounds": 4}
    fedweave.run(part, run_dir=tmp_path / "part")
    # continue the 4-round run to 6 rounds from its checkpoint
    conf = yaml.safe_load((tmp_path / "part" / "config.yaml").read_text())
    conf["rounds"] = 6
    (tmp_path / "part" / "config.yaml").write_text(yaml.safe_dump(conf))
    cont = resume(tmp_path / "part", progress=False)
    key = [("round", "test_loss", "bytes_up")]
    assert [[r[k] for k in key[0]] for r in cont.metrics] == [[r[k] for k in key[0]] for r in full.metrics]


def test_cli_list_shows_registries(capsys):
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "dirichlet" in out and "logistic" in out
    # the split family's models, which its algorithms require (before: listed nowhere)
    assert "split models: split_cifar, split_femnist, split_small" in out


def test_finished_run_is_recognised_even_when_the_schema_gained_keys(toy_config, tmp_path):
    from fedweave.runner import finished_run

    d = tmp_path / "r"
    res = fedweave.run(toy_config, run_dir=d)
    assert finished_run(d, toy_config).metrics == res.metrics
    assert finished_run(d, {**toy_config, "seed": toy_config["seed"] + 1}) is None  # another run
    assert finished_run(tmp_path / "nothing", toy_config) is None
    saved = yaml.safe_load((d / "config.yaml").read_text())
    del saved["eval"]["every"]  # as written by a version before this key existed (its default applies)
    (d / "config.yaml").write_text(yaml.safe_dump(saved))
    assert finished_run(d, toy_config) is not None
