"""Every bad input ends in one clear line, and no run is lost or overwritten (docs/reliability.md).

The table-driven test feeds broken configs and overrides through the real command-line entry point
in-process and asserts: exit code 2, exactly one line on stderr that names the key or file, no traceback, and
nothing written outside the run directory. The other tests cover the file system (read-only directories, a
file where a directory is expected, a full disk), damaged checkpoints, interrupts on a real subprocess, the
run directory's lifecycle and the dataset cache.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import stat
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch
import yaml

import fedweave
import fedweave.algorithms  # noqa: F401  (registers the algorithms)
from fedweave.checkpoints import CHECKPOINT, read_checkpoint
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError, load
from fedweave.errors import DivergenceError
from fedweave.registry import ALGORITHMS

BASE = {
    "name": "bad",
    "seed": 1,
    "rounds": 2,
    "dataset": {"name": "_toy"},
    "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 2},
    "local": {"batch_size": 32, "lr": 0.1},
    "output": {"progress": False, "plots": False},
}


def _float_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] in (float, float | None)]


def _cases() -> list[tuple[list[str], str]]:
    """(overrides, text the error line must contain)."""
    cases: list[tuple[list[str], str]] = []
    # every float option of every registered algorithm refuses NaN at config time, naming the key
    for name in ALGORITHMS.names():
        for key in _float_fields(ALGORITHMS.get(name).Hparams):
            cases.append(([f"algorithm={{name: {name}, {key}: .nan}}"], f"algorithm.{key}"))
    for key in ("lr", "lr_decay", "lr_min", "momentum", "weight_decay", "grad_clip"):
        cases.append(([f"local.{key}=.nan"], f"local.{key}"))
        cases.append(([f"local.{key}=.inf"], f"local.{key}"))
    for key in ("dropout", "link_loss", "server_miss", "deadline", "speed_sigma", "speed_jitter"):
        cases.append(([f"faults.{key}=.nan"], f"faults.{key}"))
    cases += [
        (["algorithm.server_lr=.nan"], "algorithm.server_lr"),
        (["algorithm={name: fedprox, mu: .inf}"], "algorithm.mu"),
        (["partition.name=dirichlet", "partition.alpha=.inf"], "partition.alpha"),
        (["partition.name=dirichlet", "partition.alpha=-1"], "alpha"),
        (["local.epochs=1000000000000"], "local.epochs"),
        (["local.steps=100000000000", "local.epochs=null"], "local.steps"),
        (["rounds=1e12"], "rounds"),
        (["rounds=0"], "rounds"),
        (["threads=100000"], "threads"),
        (["threads=0"], "threads"),
        (["name=../../escape"], "name"),
        (["name=a/b"], "name"),
        (["name=.."], "name"),
        (["name="], "name"),
        (["seed=-1"], "seed"),
        (["seed=1.5"], "seed"),
        (["backend=gpu"], "backend"),
        (["local.lr=fast"], "local.lr"),
        (["local.lr=-1e-3"], "local.lr"),
        (["local.lr=0"], "local.lr"),
        (["local.batch_size=0"], "local.batch_size"),
        (["local.epochs=2", "local.steps=3"], "local.epochs"),
        (["local.lr_schedule=linear"], "local.lr_schedule"),
        (["local.augment=[spin]"], "local.augment"),
        (["local.crop_size=24"], "local.crop_size"),
        # an augmentation that cannot apply to the data or whose output the model cannot read (before: a
        # traceback in round 1, after the run directory was written)
        (["dataset.name=digits", "local.augment=[flip]"], "local.augment"),
        (["local.augment=[crop]", "local.crop_size=20"], "local.augment"),
        (["local.augment=[crop]", "local.crop_size=4"], "local.augment"),
        (["local.augment=[normalize]"], "local.augment"),
        # a neighbour-selection option the chosen selection does not read (before: silently ignored)
        (["algorithm={name: gossip, tau: 0.9}"], "algorithm.tau: selection 'random' does not read it"),
        (["algorithm={name: ditto, boltzmann_T: 5}"], "algorithm.boltzmann_T: selection 'random'"),
        (["algorithm={name: fedavg_ft, proxy_layer: classifier}"], "algorithm.proxy_layer: selection 'random'"),
        (["algorithm={name: gossip, selection: topk, select_k: 2, tau: 0.9}"], "algorithm.tau: selection 'topk'"),
        (["algorithm={name: fomo, selection: afind, select_k: 2}"], "algorithm.select_k: selection 'afind' does not"),
        (["algorithm={name: fomo, selection: topk, select_k: 2, greedy: 0.9}"], "algorithm.greedy: selection 'topk'"),
        # an explicit confederated step size or penalty beside the scale it replaces (before: the scale unread)
        (["algorithm={name: gt_saga, step_size: 0.01, step_scale: 0.5}"], "algorithm.step_scale: algorithm.step_size"),
        (["algorithm={name: cfl_admm, c: 5.0, c_scale: 8.0}"], "algorithm.c_scale: algorithm.c sets the penalty"),
        # compressed messages in the decentralized family: choco_sgd is the method that sends them
        (["algorithm={name: gossip}", "compression.upload={name: topk, ratio: 0.1}"], "choco_sgd (compressed gossip)"),
        # an auxiliary-net option with a split method that trains none (before: silently not read)
        (["algorithm={name: fsl_mc}", "model={name: split_small, aux: cnn, aux_channels: 4}"], "model.aux"),
        (["algorithm={name: fsl_oc, aux_lr: 0.1}", "model.name=split_small"], "algorithm.aux_lr: algorithm 'fsl_oc'"),
        # a key of another lr schedule, or a schedule the family does not read (before: silently not read)
        (["local.lr_min=0.01"], "local.lr_min applies to local.lr_schedule: cosine, not exponential"),
        (["local.lr_step=5"], "local.lr_step applies to local.lr_schedule: step"),
        (["local.lr_schedule=cosine", "local.lr_decay=0.9"], "local.lr_decay applies to the exponential and step"),
        (["algorithm={name: hier_fedavg}", "local.lr_decay=0.9"], "local.lr_decay: the hierarchical family"),
        (["algorithm={name: zo_hfl}", "local.lr_schedule=cosine"], "local.lr_schedule: the hierarchical family"),
        (
            ["algorithm={name: cse_fsl}", "model.name=split_small", "local.lr_schedule=cosine"],
            "local.lr_schedule: the split",
        ),
        # per-client evaluation where the family evaluates only its global model (before: silently not read)
        (["algorithm={name: hier_fedavg}", "eval.personal_test=true"], "eval.personal_test: the hierarchical family"),
        (["algorithm.name=fsl_mc", "model.name=split_small", "eval.per_client=true"], "eval.per_client: the split"),
        (
            [
                "algorithm={name: gt_saga}",
                "partition={name: iid, num_clients: 10}",
                "local={}",
                "eval.personal_test=true",
            ],
            "eval.personal_test: the confederated family",
        ),
        # a config's sweep section given to a single run (before: "unknown key 'sweep'. Did you mean 'seed'?")
        (["sweep={grid: {local.lr: [0.1, 0.2]}}"], "sweep: a config's sweep section is read by 'fedweave sweep"),
        # an override of a section the file leaves out names no object (before: "sampler must be a mapping with
        # a 'name' key", which does not say why)
        (["sampler.redraw=false"], "sampler has options but no name ({'redraw': False}): give sampler.name too, e.g."),
        # a callback's options (before: a negative budget ended the run after its first round; a stop_at_target
        # on a column other than the main metric without a direction was a traceback after config.yaml was written)
        (["callbacks=[{name: budget, seconds: -5}]"], "callbacks[0] (budget): Budget: seconds must be"),
        (["callbacks=[{name: budget, rounds: 0}]"], "callbacks[0] (budget): Budget: rounds must be"),
        (["callbacks=[{name: stop_at_target, metric: test_acc, target: 0.5}]"], "'test_acc'"),
        # a section or key the family never reads (before: silently ignored, the run as without it)
        (["algorithm={name: hier_fedavg}", "local.epochs=3"], "local.epochs: the hierarchical family runs H_r"),
        # an override given twice, as a key given twice in a YAML file is refused (before: the last one won in silence)
        (["rounds=1", "rounds=2"], "override key 'rounds' is given twice ('rounds=1', then 'rounds=2')"),
        (["local.lr=0.1", "rounds=1", "local.lr=0.1"], "override key 'local.lr' is given twice"),
        (["algorithm={name: zo_hfl}", "local.steps=3", "local.epochs=null"], "local.steps: the hierarchical family"),
        (["algorithm={name: zo_hfl}", "local.augment=[flip]"], "local.augment: the hierarchical family"),
        (
            ["algorithm={name: cfl_saga}", "dataset={name: cfl_logreg, num_samples: 300, dim: 20}"],
            "partition.num_clients: the confederated family",
        ),
        (["algorithm={name: gt_saga}", "model.name=mlp"], "model.name: the confederated family"),
        (["algorithm={name: cfl_admm}", "partition={name: iid, num_clients: 10}"], "local.lr: the confederated family"),
        (["local.lrr=0.1"], "local.lrr"),
        (["eval.every=0"], "eval.every"),
        (["eval.batch_size=-3"], "eval.batch_size"),
        (["eval.explode_factor=1"], "eval.explode_factor"),
        (["eval.explode_factor=.nan"], "eval.explode_factor"),
        (["eval.holdout=1"], "eval.holdout"),
        (["eval.holdout=-0.1"], "eval.holdout"),
        (["algorithm={name: apfl, clients_per_round: 2}", "backend=pool"], "backend pool"),
        (["algorithm={name: pfedme, clients_per_round: 2}", "backend=ray"], "backend ray"),
        (["output.checkpoint_every=-1"], "output.checkpoint_every"),
        (["output.plots=maybe"], "output.plots"),
        (["output.colour=red"], "output.colour"),
        # a tracker named twice (before: two tracker runs of one run, the first never finished)
        (["output.trackers=[tensorboard, tensorboard]"], "output.trackers names 'tensorboard' twice"),
        (["faults.dropout=1.5"], "faults.dropout"),
        (["faults.outage_rounds=[0]"], "faults.outage_rounds"),
        (["faults.straggler_policy=wait"], "faults.straggler_policy"),
        (["ray.num_workers=0"], "ray.num_workers"),
        (["ray.object_store_memory_mb=1"], "ray.object_store_memory_mb"),
        # an address Ray cannot parse (before: its traceback at round 1's first training call, the run's files written)
        (["backend=ray", "ray.address=foo"], "ray.address must be 'auto', 'local', 'HOST:PORT' or 'ray://HOST:PORT'"),
        (["backend=ray", "ray.address='host:99999'"], "(a port from 1 to 65535), got 'host:99999'"),
        (["algorithm.name=nosuch"], "nosuch"),
        (["algorithm.clients_per_round=-2"], "clients_per_round"),
        (["algorithm.colour=red"], "algorithm.colour"),
        (["dataset.name=nosuch"], "nosuch"),
        (["dataset.bogus=1"], "dataset.bogus"),
        (["model.name=nosuch"], "nosuch"),
        (["model.depth=3"], "model.depth"),
        (["partition.name=nosuch"], "nosuch"),
        (["partition.num_clients=-4"], "partition.num_clients"),
        (["partition.num_clients=many"], "partition.num_clients"),
        (["partition.name=dirichlet", "partition.min_size=100000"], "partition"),
        (["model.name=char_lstm"], "char_lstm"),
        (["lr=0.1"], "lr"),
        (["local=3"], "local"),
        (["algorithm=[1, 2]"], "algorithm"),
        (["nokey"], "nokey"),
        (["=3"], "=3"),
        (["local..lr=3"], "local..lr"),
        (["local.lr=[1"], "local.lr"),
        (["rounds"], "rounds"),
        # the task, sampler, precision and plug-in keys
        (["task.loss=nosuch"], "task.loss"),
        (["task.loss=mse"], "task.loss 'mse' needs float targets"),
        (["task.loss=bce_with_logits"], "task.loss"),
        (["task.metrics=[nosuch]"], "task.metrics[0]"),
        (["task.metrics=accuracy"], "task.metrics"),
        (["task.main=auc"], "task.main"),
        (["task.loss_options.half=true"], "task.loss_options takes no options"),
        # a registered entry that takes no options is named
        (["partition={name: iid, num_clients: 10, alpha: 0.5}"], "partition 'iid' takes no options"),
        (["aggregator={name: median, foo: 1}"], "aggregator 'median' takes no options"),
        (["sampler={name: uniform, foo: 1}"], "sampler 'uniform' takes no options"),
        (["task={loss: mse, loss_options: {full: true}}"], "task.loss_options.full"),
        (["task.colour=red"], "task.colour"),
        (["task=mse"], "task"),
        (["precision=float16"], "precision"),
        (["sampler.name=nosuch"], "nosuch"),
        (["sampler={name: schedule, clients: [[0, 9]]}"], "sampler.clients[0]"),
        (["sampler={name: schedule, clients: []}"], "sampler.clients"),
        (["sampler={name: schedule, file: nofile.json}"], "sampler.file"),
        (["sampler={name: schedule, clients: [[0]], cycle: false}"], "schedule has 1 rounds"),
        (["sampler={name: fixed, clients: [0, 0]}"], "sampler.clients"),
        (["sampler={name: fixed, clients: 9}"], "sampler.clients"),
        (["sampler={name: uniform, k: 2}"], "sampler.k"),
        (["plugins=[nofile.py]"], "nofile.py"),
        (["plugins=[no_such_module_xyz]"], "no_such_module_xyz"),
        (["plugins=3"], "plugins"),
        (["eval.at_start=maybe"], "eval.at_start"),
        (["eval.personal_test=2"], "eval.personal_test"),
        (["model.init_from=nofile.pt"], "model.init_from"),
        (["local.full_batch=3"], "local.full_batch"),
        (["partition.bins=4"], "partition.bins"),
        (["partition={name: from_file, path: nofile.json, num_clients: 0}"], "partition.path"),
        (["algorithm={name: fedadam, v_init: -1}"], "algorithm.v_init"),
        (["algorithm={name: fedadam, v_init: .nan}"], "algorithm.v_init"),
        (["output.trackers=[nosuch]"], "output.trackers"),
        # values beyond what the computation can hold (before: a traceback from torch, at build or in round 1)
        (["local.batch_size=9223372036854775808"], "local.batch_size must be <= 2,147,483,647"),
        (["local.lr=1e41"], "local.lr must be a finite number in (0, 3.40282e+38]"),
        (["local.grad_clip=1e41"], "local.grad_clip"),
        (["model={name: mlp, hidden: [1000000000000]}"], "does not fit in memory"),
        (["algorithm.name=cse_fsl", "model={name: split_small, hidden: 1000000000000}"], "does not fit in memory"),
        (["algorithm.name=cse_fsl", "model={name: split_small, width: 2.5}"], "model.width must be an integer"),
        (["model.init_from=5"], "model.init_from must be the path"),
        (["local.lr=" + "[" * 20_000], "YAML nested deeper than 100 levels"),
        # the decentralized family's evaluation is its clients' models on their own test sets (before: accepted and
        # ignored, without a column or a word)
        (["algorithm={name: dfedavg}", "eval.per_client=true"], "eval.per_client: the decentralized family evaluates"),
        (
            ["algorithm={name: dfedavg, test_per_client: 5}", "eval.holdout=0.25"],
            "algorithm.test_per_client: under eval.holdout (0.25) each client is evaluated on its own held-out",
        ),
        # CSE-FSL's h beyond every client's batches of an epoch: no upload, a main server that never trained and a
        # run at chance, without a word (before)
        (["algorithm={name: cse_fsl, h: 1000}", "model.name=split_small"], "algorithm.h (1000) is more than the"),
        (
            ["algorithm={name: cse_fsl, h: 2}", "model.name=split_small", "local.full_batch=true"],
            "algorithm.h (2) is more than the 1 batch of the largest client's local epoch",
        ),
        # a built-in loader's split that rounds to no sample (before: accuracy 0.0 and loss 0.0 every round, or numpy's
        # warning and a line naming partition.num_clients)
        (
            ["dataset={name: digits, test_fraction: 0.002}"],
            "dataset.test_fraction 0.002 of the 1,797 samples leaves the test",
        ),
        (["dataset={name: digits, test_fraction: 0.998}"], "leaves the training split empty"),
        # every round's schedule entry is checked when the run is built (before: only when its round came)
        (["sampler={name: schedule, clients: [[0, 1], [2, 3], [0, 9]]}"], "sampler.clients[2]"),
    ]
    # privacy (docs/privacy.md): every float key refuses NaN, and what no proof covers is refused, naming privacy
    for key in ("clip", "noise_multiplier", "delta", "target_epsilon", "target_quantile", "clip_lr", "count_noise"):
        cases.append(([f"privacy.{key}=.nan"], f"privacy.{key}"))
    cases += [
        (["privacy.colour=red"], "privacy.colour"),
        (["privacy.accountant=gdp"], "privacy.accountant must be one of prv, rdp"),
        (["privacy.noise_multiplier=auto"], "privacy.noise_multiplier: auto calibrates sigma"),
        (["privacy.level=sample", "privacy.per_layer=true"], "privacy.per_layer applies to privacy.level: user"),
        (["privacy.noise_multiplier=1"], "privacy: sampler 'uniform' draws a fixed-size sample"),
        (
            ["privacy.clip=1", "sampler=bernoulli", "algorithm.name=scaffold"],
            "privacy: algorithm 'scaffold' is refused",
        ),
        (
            ["privacy.clip=1", "algorithm={name: cse_fsl, agg_every: 2}", "model.name=split_small"],
            "privacy: algorithm.agg_every (2) averages the same sampled clients' models several times a round",
        ),
        (["privacy.clip=1", "algorithm={name: cfl_admm}"], "privacy: the confederated family is not supported"),
        (["privacy.target_epsilon=1", "sampler=bernoulli"], "privacy.target_epsilon (1) is exceeded"),
        # below what the rdp accountant reports with any noise (0.103 at delta 1e-5): no noise would reach it
        (["privacy.target_epsilon=0.01", "sampler=bernoulli"], "privacy.target_epsilon (0.01) is below the least"),
    ]
    return cases


CASES = _cases()


def _ids(case):
    return " ".join(case[0])[:60]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A working directory holding only the config file: anything else found there afterwards was written
    by the command."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "c.yaml").write_text(yaml.safe_dump(BASE))
    return work


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _one_line_error(capsys, code: int, expect: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("fedweave: error: "), err
    assert expect in lines[0], (expect, lines[0])
    return lines[0]


def test_there_are_at_least_150_cases():
    assert len(CASES) >= 150


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_broken_config_gets_one_line_naming_the_key(case, in_tmp, capsys):
    overrides, expect = case
    code = cli_main(["run", "c.yaml", *overrides, "--out", "run", "--no-progress"])
    _one_line_error(capsys, code, expect)
    assert _files(in_tmp) == {"c.yaml"}  # nothing written: not even an empty run directory


# ---- config files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["1e-3", "1E-3", "1e+9", "1.0e9", "1e9", "-2.5e-2", ".5e-1", "5e-1"])
def test_scientific_notation_is_a_number_in_yaml_files_and_overrides(tmp_path, spelling):
    path = tmp_path / "c.yaml"
    path.write_text(f"local:\n  lr: {spelling}\n  weight_decay: {spelling.lstrip('-')}\n")
    want = float(spelling)
    if want > 0:
        assert load(path).local.lr == want
        assert load(BASE, [f"local.lr={spelling}"]).local.lr == want
    assert load(path, ["local.lr=0.1"]).local.weight_decay == abs(want)


@pytest.mark.parametrize(
    ("spelling", "want"), [("012", 12), ("007", 7), ("0o17", 15), ("0x1F", 31), ("1_000", 1000), ("0100", 100)]
)
def test_integers_are_read_by_yaml_1_2s_rule_in_files_and_overrides(tmp_path, spelling, want):
    # YAML 1.1 read seed: 012 as octal 10: another seed than the one written, with no word said
    path = tmp_path / "c.yaml"
    path.write_text(f"seed: {spelling}\n")
    assert load(path).seed == want
    assert load(BASE, [f"seed={spelling}"]).seed == want


def test_a_colon_number_is_not_read_in_base_60(tmp_path):
    (tmp_path / "c.yaml").write_text("seed: 1:30\n")  # YAML 1.1: 90
    with pytest.raises(ConfigError, match="seed must be an integer, got '1:30'"):
        load(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="seed must be an integer, got '1:30'"):
        load(BASE, ["seed=1:30"])


def test_booleans_are_read_by_yaml_1_2s_rule(tmp_path):
    """YAML 1.1 read yes/no/on/off as booleans: a run named ``no`` was refused as "got False", and
    ``output.plots: no`` passed for a boolean nobody wrote; 1.2 reads them as the strings they are."""
    (tmp_path / "c.yaml").write_text("name: no\noutput: {plots: false, progress: FALSE}\n")
    cfg = load(tmp_path / "c.yaml")
    assert (cfg.name, cfg.output.plots, cfg.output.progress) == ("no", False, False)
    assert load(BASE, ["name=off"]).name == "off" and load(BASE, ["output.plots=True"]).output.plots is True
    with pytest.raises(ConfigError, match="output.plots must be true or false, got 'no'"):
        load(BASE, ["output.plots=no"])


@pytest.mark.parametrize("unset", ["null", "", "~"])
@pytest.mark.parametrize("key", ["dataset", "partition", "model", "algorithm", "sampler", "aggregator"])
def test_a_named_section_set_to_null_is_the_section_left_out(tmp_path, key, unset):
    # before: "sampler must be a mapping with a 'name' key (or just the name), got None", so no override could
    # undo a file's section
    data = {**BASE, "model": {"name": "mlp", "hidden": [8]}, "sampler": {"name": "bernoulli", "p": 0.5}}
    data["aggregator"] = {"name": "median"}
    without = {k: v for k, v in data.items() if k != key}
    assert load(data, [f"{key}={unset}"]) == load(without) != load(data)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**data, key: None}))
    assert load(tmp_path / "c.yaml") == load(without)
    with pytest.raises(ConfigError, match=f"{key} has options but no name"):  # null, then an option: no name
        load(data, [f"{key}={unset}", f"{key}.x=1"])


def test_quoted_numbers_are_numbers_too():
    assert load(BASE, ["local.lr='1e-3'"]).local.lr == 1e-3


def test_infinity_is_kept_where_the_default_is_infinite():
    from fedweave.config import build_dataclass

    assert build_dataclass(ALGORITHMS.get("zo_hfl").Hparams, {"box_high": float("inf")}, "algorithm").box_high > 1e308
    with pytest.raises(ConfigError, match="algorithm.box_high must be a finite number, got nan"):
        build_dataclass(ALGORITHMS.get("zo_hfl").Hparams, {"box_high": float("nan")}, "algorithm")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_an_empty_config_file_is_refused_not_run_with_every_default(text, in_tmp, capsys):
    """Before: an empty file ran 100 rounds of the defaults without a word (a wrong file, most likely)."""
    (in_tmp / "e.yaml").write_text(text)
    _one_line_error(capsys, cli_main(["run", "e.yaml", "--out", "r"]), "e.yaml: the config file holds no key")
    assert not (in_tmp / "r").exists()


def test_duplicate_yaml_keys_are_an_error_naming_the_key(in_tmp, capsys):
    (in_tmp / "d.yaml").write_text("name: x\nlocal:\n  lr: 0.1\n  lr: 0.2\n")
    line = _one_line_error(capsys, cli_main(["run", "d.yaml"]), "duplicate key 'lr' at line 4")
    assert "d.yaml" in line


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda d: d / "missing.yaml", "does not exist"),
        (lambda d: d, "is a directory"),
        (lambda d: Path("/dev/null"), "not a regular file"),
    ],
)
def test_a_config_that_is_not_a_file_says_what_it_is(in_tmp, capsys, make, expect):
    _one_line_error(capsys, cli_main(["run", str(make(in_tmp))]), expect)


def test_a_nul_in_the_name_is_refused(in_tmp, capsys):
    (in_tmp / "n.yaml").write_text(yaml.safe_dump({**BASE, "name": "a\x00b"}))
    _one_line_error(capsys, cli_main(["run", "n.yaml"]), "name must not contain control characters")
    assert _files(in_tmp) == {"c.yaml", "n.yaml"}


def test_run_without_a_config_exits_2(capsys):
    _one_line_error(capsys, cli_main(["run"]), "needs a CONFIG")


# ---- other commands ----------------------------------------------------------------------------------
OTHER_COMMANDS = [
    (["run", "c.yaml", "--bogus"], "--bogus"),
    (["run", "c.yaml", "--resume", "somewhere", "rounds=3"], "not both"),  # CONFIG and --resume, overrides after
    (["run", "--resume", "nowhere"], "nowhere"),
    (["run", "--resume", "nowhere", "--out", "x"], "--out"),
    (["data"], "{fetch,verify}"),
    (["data", "fetch"], "NAME"),
    (["data", "verify", "NOSUCH"], "NOSUCH"),
    (["plot"], "run_dirs"),
    (["plot", "nowhere"], "nowhere"),
    (["report", "nowhere"], "nowhere"),
    (["sweep", "c.yaml", "--grid", "local.lr=0.1,fast", "--out", "sw"], "local.lr"),
    (["sweep", "c.yaml", "--grid", "nokey", "--out", "sw"], "nokey"),
    (["sweep", "c.yaml", "--grid", "local.lr=" + "[" * 20_000, "--out", "sw"], "--grid local.lr"),
    (["sweep", "c.yaml", "--workers"], "--workers"),
    (["sweep", "c.yaml", "--seeds", "0", "--out", "sw"], "--seeds: '0' is not a whole number >= 1"),
    (["sweep", "c.yaml", "--workers", "-1", "--out", "sw"], "--workers: '-1' is not a whole number >= 1"),
    (["sweep", "c.yaml", "--ray", "foo", "--out", "sw"], "--ray must be 'auto', 'local', 'HOST:PORT' or 'ray://HOST"),
    (["sweep", "c.yaml", "--ray", "", "--out", "sw"], "--ray must be 'auto', 'local', 'HOST:PORT' or 'ray://HOST:P"),
    (["reproduce", "nosuch"], "unknown reproduction 'nosuch'"),
    (["reproduce", "fedmim", "--bogus"], "unrecognized arguments: --bogus"),
    (["reproduce", "zo-hfl", "--scale", "nope"], "invalid choice: 'nope'"),
    (["reproduce", "zo-hfl", "--seeds", "0"], "--seeds: '0' is not a whole number >= 1"),
    (["reproduce", "afind", "--seeds", "0"], "--seeds: '0' is not a whole number >= 1"),
    (["reproduce", "afind", "--rounds", "-3"], "--rounds: '-3' is not a whole number >= 1"),
    (["reproduce", "cse-fsl", "--workers", "0"], "--workers: '0' is not a whole number >= 1"),
    (["reproduce", "cfl-saga", "--seeds", "two"], "--seeds: 'two' is not a whole number >= 1"),
    (["reproduce", "fedmim", "--seeds", "0"], "--seeds: '0' is not a whole number >= 1"),  # a count everywhere
    (["reproduce", "cse-fsl", "--seeds", "0", "1"], "--seeds: '0' is not a whole number >= 1"),
    (["flower-app", "c.yaml", "app", "--reply-timeout", "-5"], "--reply-timeout: '-5' is not a number of seconds > 0"),
    (["flower-app", "c.yaml", "app", "--node-wait", "nan"], "--node-wait: 'nan' is not a number of seconds > 0"),
    (["flower-app", "missing.yaml", "app"], "missing.yaml"),
    # setups the ServerApp cannot run are refused before anything is written
    (
        ["flower-app", "c.yaml", "app", "algorithm.name=afind_plus"],
        "algorithm 'afind_plus' (decentralized) cannot be deployed on Flower yet: each peer scores",
    ),
    (
        ["flower-app", "c.yaml", "app", "algorithm.name=dfedavg", "--on-error", "drop"],
        "on-error drop is not built for the decentralized family yet (algorithm 'dfedavg'); use on-error stop",
    ),
    (
        ["flower-app", "c.yaml", "app", "algorithm.name=dfedavg", "algorithm.dp_sigma=1", "algorithm.dp_mode=exchange"],
        "algorithm.dp_mode: exchange cannot be deployed on Flower: its noise would be added by the ServerApp",
    ),
    (
        ["flower-app", "c.yaml", "app", "algorithm.name=cse_fsl", "model.name=split_small", "--on-error", "drop"],
        "on-error drop is not built for the split family yet (algorithm 'cse_fsl'); use on-error stop",
    ),
    # an empty --out (an unset $OUT in a script) wrote into a default folder under ./runs/
    (["run", "c.yaml", "--out", ""], "--out '': an empty path; give a directory"),
    (["run", "c.yaml", "output.dir=''"], "output.dir must be a directory's path or null"),
    (["sweep", "c.yaml", "--grid", "local.lr=0.1,0.2", "--out", " "], "--out ' ': an empty path; give a directory"),
    (["report", "c.yaml", "--out", ""], "--out '': an empty path; give a file"),
    (["plot", "c.yaml", "--out", ""], "--out '': an empty path; give a directory"),
    (["reproduce", "fedmim", "--out", ""], "--out '': an empty path; give a directory"),
    # an option twice took the last without a word; an unknown option before any command said only that one is due
    (["run", "c.yaml", "--out", "a", "--out", "b"], "--out is given twice ('a', then 'b'); give it once"),
    (["sweep", "c.yaml", "--grid", "local.lr=0.1", "--out", "a", "--out", "b"], "--out is given twice"),
    (["--bogus"], "unrecognized arguments: --bogus; a command is required: one of run, list, data"),
    (["nosuch"], "nosuch"),
    ([], "command"),
]


@pytest.mark.parametrize("argv, expect", OTHER_COMMANDS, ids=lambda v: " ".join(v)[:80] if type(v) is list else None)
def test_other_commands_and_usage_errors_get_one_line(argv, expect, in_tmp, capsys):
    try:
        code = cli_main(argv)
    except SystemExit as e:  # argparse's own usage errors exit (with our one-line message)
        code = e.code
    _one_line_error(capsys, code, expect)
    assert _files(in_tmp) == {"c.yaml"}


@pytest.mark.parametrize("form, expect", [({"workers": 0}, "workers must be a whole number >= 1, got 0"),
                                          ({"seeds": 0}, "sweep.seeds must be a whole number >= 1")])  # fmt: skip
def test_a_sweep_section_with_a_bad_count_writes_nothing(form, expect, in_tmp, capsys):
    sweep = {"grid": {"local.lr": [0.1]}, "out": "sw", **form}
    (in_tmp / "s.yaml").write_text(yaml.safe_dump({**BASE, "sweep": sweep}))
    _one_line_error(capsys, cli_main(["sweep", "s.yaml"]), expect)
    assert _files(in_tmp) == {"c.yaml", "s.yaml"}


def test_overrides_after_the_options_are_overrides(in_tmp, capsys):
    assert cli_main(["run", "c.yaml", "--out", "r", "--no-progress", "rounds=1", "local.lr=0.2"]) == 0
    cfg = load(in_tmp / "r" / "config.yaml")
    assert (cfg.rounds, cfg.local.lr) == (1, 0.2)


def test_data_fetch_of_an_unknown_dataset(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path))
    _one_line_error(capsys, cli_main(["data", "fetch", "NOSUCH"]), "no download sources for dataset 'NOSUCH'")
    _one_line_error(capsys, cli_main(["data", "fetch", "mnistt"]), "'mnistt' (did you mean 'mnist'?)")


def test_data_fetch_with_a_missing_root_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path))
    _one_line_error(capsys, cli_main(["data", "fetch", "mnist", "--root", str(tmp_path / "no")]), "does not exist")


def test_data_fetch_of_several_datasets_with_one_root_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache"))
    out = cli_main(["data", "fetch", "mnist", "adult", "--root", str(tmp_path)])
    _one_line_error(capsys, out, "--root holds the files of one dataset; give one NAME, not 2")
    assert not (tmp_path / "cache").exists()


def test_plot_of_an_unknown_metric_lists_the_metrics(toy_config, tmp_path, capsys):
    fedweave.run(toy_config, run_dir=tmp_path / "r")
    line = _one_line_error(capsys, cli_main(["plot", str(tmp_path / "r"), "--metric", "NOSUCH"]), "'NOSUCH'")
    assert "test_accuracy" in line


def test_plot_of_a_sweep_with_a_run_that_wrote_no_rows(toy_config, tmp_path, capsys):
    """A run that diverged before its first evaluation holds no metrics.jsonl: it is a run all the same, drawn
    as no line, and the sweep's other runs are plotted (before: the whole plot failed, asking whether the
    run's directory was a run directory)."""
    fedweave.sweep(toy_config, {"local.lr": [0.1, 1e38]}, out=tmp_path / "s", progress=False)
    (diverged,) = (tmp_path / "s" / "runs").glob("local.lr=1*e*38,seed=3")
    assert (diverged / "summary.json").is_file() and not (diverged / "metrics.jsonl").exists()
    assert cli_main(["plot", str(tmp_path / "s"), "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "test_accuracy_vs_rounds.png").read_bytes()[:4] == b"\x89PNG"
    # nothing but runs without rows: one line saying so, not a question about the directories
    code = cli_main(["plot", str(diverged), "--out", str(tmp_path / "q")])
    line = _one_line_error(capsys, code, "no metrics row yet")
    assert "is a fedweave run directory?" not in line and not (tmp_path / "q").exists()


def test_plot_says_which_runs_it_does_not_draw(toy_config, tmp_path, caplog):
    """A run given to ``fedweave plot`` without a row of the metric (a non-private run against ``epsilon``) is
    named in one warning line (before: silently left out, and with one line left the figure had no legend)."""
    fedweave.run(toy_config, run_dir=tmp_path / "plain")
    private = {**toy_config, "sampler": "bernoulli", "privacy": {"clip": 0.5, "noise_multiplier": 1.0}}
    fedweave.run(private, run_dir=tmp_path / "dp")
    caplog.clear()
    out = str(tmp_path / "p")
    assert cli_main(["plot", str(tmp_path / "plain"), str(tmp_path / "dp"), "--metric", "epsilon", "--out", out]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "fedweave" and r.levelname == "WARNING"]
    assert said == [f"not drawn, no row with epsilon: {tmp_path / 'plain'}"]


def test_plot_and_report_out_naming_a_file(toy_config, tmp_path, capsys):
    """``--out`` that is a file, or lies under one, is one line naming --out (before: 'FILE: File exists' or
    'FILE/sub: Not a directory'), and the file is left as it was."""
    fedweave.run(toy_config, run_dir=tmp_path / "r")
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    run = str(tmp_path / "r")
    for args, expect in (
        (["plot", run, "--out", str(mine)], f"--out: {mine} is a file; give a folder"),
        (["plot", run, "--out", str(mine / "sub")], f"--out: {mine / 'sub'} lies under the file {mine}"),
        (["report", run, "--out", str(mine / "x.html")], f"--out: {mine / 'x.html'} lies under the file {mine}"),
    ):
        _one_line_error(capsys, cli_main(args), expect)
    assert mine.read_text() == "mine"


# ---- the run directory -------------------------------------------------------------------------------
def test_output_dir_that_is_a_file(in_tmp, capsys):
    (in_tmp / "taken").write_text("mine")
    _one_line_error(capsys, cli_main(["run", "c.yaml", "--out", "taken"]), "is a file")
    _one_line_error(capsys, cli_main(["run", "c.yaml", "--out", "taken/run"]), "is a file")
    assert (in_tmp / "taken").read_text() == "mine"


def test_the_refusal_of_a_taken_run_directory_offers_resume_only_where_a_checkpoint_is(in_tmp, capsys):
    """Without checkpoints (``output.checkpoint_every: 0``, the default) `--resume` cannot continue the run, so
    the line does not offer it (before: it did, and the suggested command failed with 'no checkpoint')."""
    assert cli_main(["run", "c.yaml", "--out", "r", "--no-progress"]) == 0
    capsys.readouterr()
    line = _one_line_error(capsys, cli_main(["run", "c.yaml", "--out", "r"]), "already holds a finished run")
    assert "--resume" not in line and "no checkpoint" in line and "--overwrite" in line
    assert cli_main(["run", "c.yaml", "output.checkpoint_every=1", "--out", "k", "--no-progress"]) == 0
    capsys.readouterr()
    line = _one_line_error(capsys, cli_main(["run", "c.yaml", "--out", "k"]), "already holds a finished run")
    assert "'fedweave run --resume k'" in line


def test_a_finished_run_is_never_overwritten_without_overwrite(in_tmp, capsys):
    assert cli_main(["run", "c.yaml", "--out", "r", "--no-progress"]) == 0
    capsys.readouterr()
    (in_tmp / "r" / "mine.txt").write_text("notes")
    before = {p.name: p.read_bytes() for p in (in_tmp / "r").iterdir()}
    code = cli_main(["run", "c.yaml", "local.lr=0.2", "--out", "r", "--no-progress"])
    _one_line_error(capsys, code, "already holds a finished run")
    assert {p.name: p.read_bytes() for p in (in_tmp / "r").iterdir()} == before
    # --overwrite never deletes a file no run wrote (docs/reliability.md): refused while mine.txt is there
    code = cli_main(["run", "c.yaml", "local.lr=0.2", "--out", "r", "--overwrite", "--no-progress"])
    _one_line_error(capsys, code, "not a fedweave run's (mine.txt)")
    assert {p.name: p.read_bytes() for p in (in_tmp / "r").iterdir()} == before
    (in_tmp / "r" / "mine.txt").unlink()
    assert cli_main(["run", "c.yaml", "local.lr=0.2", "--out", "r", "--overwrite", "--no-progress"]) == 0
    assert load(in_tmp / "r" / "config.yaml").local.lr == 0.2
    assert not list((in_tmp / "r").glob(".overwritten-*")) and not list(in_tmp.glob(".r.*"))


def test_a_kill_during_overwrite_leaves_no_mix_and_is_cleaned(tmp_path):
    from fedweave.results import LOCK, clear_run

    run = tmp_path / "r"
    fedweave.run({**BASE, "rounds": 1}, run_dir=run)
    aside = run / ".overwritten-abcd1234"  # what a kill between the moves and the removal leaves
    aside.mkdir()
    (aside / "summary.json").write_text("{}")
    clear_run(run)
    assert not aside.exists() and run.is_dir() and [p.name for p in run.iterdir()] == [LOCK]


def test_a_config_error_at_build_time_leaves_no_directory(tmp_path):
    with pytest.raises(ConfigError, match="char_lstm"):
        fedweave.run({**BASE, "model": {"name": "char_lstm"}}, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_outage_rounds_after_the_last_round_are_said_never_to_happen(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="fedweave"):
        res = fedweave.run({**BASE, "faults": {"outage_rounds": [1, 5]}}, run_dir=tmp_path / "r")
    assert "faults.outage_rounds [5] are after the last round (2) and never happen" in caplog.text
    assert res.summary["status"] == "completed" and res.summary.get("skipped_rounds") == [1]


def test_a_late_policy_without_a_deadline_is_said_never_to_apply(tmp_path, caplog):
    """Without a deadline nothing is late, so straggler_policy: late changes nothing: said, not refused (a
    sweep over the deadline may include null as its control)."""
    with caplog.at_level("WARNING", logger="fedweave"):
        res = fedweave.run({**BASE, "faults": {"straggler_policy": "late"}}, run_dir=tmp_path / "r")
    assert "faults.straggler_policy 'late' never applies: without faults.deadline no upload is late" in caplog.text
    assert res.summary["status"] == "completed"


def test_client_speeds_without_a_deadline_are_said_to_change_nothing_in_a_synchronous_round(tmp_path, caplog):
    """A synchronous round waits for every client, so their speeds matter only against a deadline; an
    asynchronous method's clock reads them always (no warning there)."""
    with caplog.at_level("WARNING", logger="fedweave"):
        fedweave.run({**BASE, "faults": {"speed_jitter": 0.3}}, run_dir=tmp_path / "r")
    assert f"faults.speed_sigma / speed_jitter change nothing in {BASE['algorithm']['name']} without" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedweave"):
        fedweave.run({**BASE, "faults": {"speed_jitter": 0.3, "deadline": 2.0}}, run_dir=tmp_path / "d")
        fedweave.run({**BASE, "faults": {"speed_sigma": 0.5}}, run_dir=tmp_path / "s")  # the default written out
    assert "speed_jitter change nothing" not in caplog.text


def test_run_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        fedweave.run(BASE, run_dir=tmp_path / "r")
    finally:
        os.umask(old)
    for name in ("config.yaml", "metrics.csv", "summary.json"):
        assert stat.S_IMODE((tmp_path / "r" / name).stat().st_mode) == 0o644, name


def test_stale_temporary_files_are_removed_when_a_run_resumes(tmp_path):
    cfg = {**BASE, "output": {**BASE["output"], "checkpoint_every": 1}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    stale = tmp_path / "r" / ".checkpoint.pt.abc123.tmp"  # left by a kill during a checkpoint write
    stale.write_bytes(b"\0" * 1024)
    assert cli_main(["run", "--resume", str(tmp_path / "r"), "--no-progress"]) == 0
    assert not stale.exists()


def test_a_resume_keeps_its_directory_and_its_progress_setting(tmp_path, capsys):
    """``output.dir=X`` on a resume was accepted: the run went on in RUN_DIR and its config.yaml named X. And a
    resume showed the progress bar whatever ``output.progress`` said (a new run follows it)."""
    cfg = {**BASE, "output": {**BASE["output"], "checkpoint_every": 1, "progress": False}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    capsys.readouterr()
    _one_line_error(
        capsys,
        cli_main(["run", "--resume", str(tmp_path / "r"), "rounds=3", "output.dir=elsewhere"]),
        f"output.dir does not apply to a resumed run: it continues in {tmp_path / 'r'}",
    )
    assert load(tmp_path / "r" / "config.yaml").output.dir is None and not (tmp_path / "elsewhere").exists()
    assert cli_main(["run", "--resume", str(tmp_path / "r"), "rounds=3"]) == 0
    assert "3/3" not in capsys.readouterr().err  # no bar
    assert cli_main(["run", "--resume", str(tmp_path / "r"), "rounds=4", "output.progress=true"]) == 0
    assert "4/4" in capsys.readouterr().err  # the override shows it


def _read_only_dir(path: Path):
    """A directory nobody can write: chmod for a normal user; for root (whom chmod does not stop) a
    read-only tmpfs, where the system allows mounting one."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("running as root and no read-only file system can be mounted here")
    return lambda: subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_output_directory(in_tmp, capsys):
    undo = _read_only_dir(in_tmp / "ro")
    try:
        code = cli_main(["run", "c.yaml", "--out", "ro/run", "--no-progress"])
        line = _one_line_error(capsys, code, "ro/run")
        assert "cannot write the run directory" in line
    finally:
        undo()


def test_a_read_only_data_cache(capsys, tmp_path, monkeypatch):
    undo = _read_only_dir(tmp_path / "cache")
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDWEAVE_OFFLINE", "1")
    try:
        code = cli_main(["data", "fetch", "mnist"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and err.startswith("fedweave: error: ")
        assert "mnist" in err
    finally:
        undo()


def _full_disk(path: Path, size: str, monkeypatch):
    """A small file system that fills up; where none can be mounted, ENOSPC injected at the write call."""
    path.mkdir()
    mounted = (
        os.geteuid() == 0
        and not subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
    )
    if mounted:
        return lambda: subprocess.run(["umount", str(path)], check=False)
    import fedweave.results as results

    real = results.atomic_write

    def full(target, data):
        if Path(target).name == CHECKPOINT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
        real(target, data)

    monkeypatch.setattr(results, "atomic_write", full)
    monkeypatch.setattr("fedweave.runner.atomic_write", full)
    return lambda: None


def test_disk_full_while_writing_a_checkpoint(in_tmp, capsys, monkeypatch):
    # SCAFFOLD keeps a control variate per client: its checkpoint is larger than the small file system
    (in_tmp / "big.yaml").write_text(
        yaml.safe_dump(
            {
                **BASE,
                "partition": {"name": "iid", "num_clients": 200},
                "model": {"name": "mlp", "hidden": [64]},
                "algorithm": {"name": "scaffold", "clients_per_round": 2},
                "output": {**BASE["output"], "checkpoint_every": 1},
            }
        )
    )
    undo = _full_disk(in_tmp / "small", "256k", monkeypatch)
    try:
        code = cli_main(["run", "big.yaml", "--out", "small/run", "--no-progress"])
        line = _one_line_error(capsys, code, "no space left on device")
        assert CHECKPOINT in line
        run = in_tmp / "small" / "run"
        assert (run / "config.yaml").is_file() and not list(run.glob(".*.tmp"))  # nothing half-written
    finally:
        undo()


# ---- damaged checkpoints -----------------------------------------------------------------------------
@pytest.fixture
def checkpointed(tmp_path):
    cfg = {**BASE, "output": {**BASE["output"], "checkpoint_every": 1}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    return tmp_path / "r"


def _damage(kind: str, path: Path) -> None:
    ck = path / CHECKPOINT
    good = read_checkpoint(ck)
    if kind == "truncated":
        ck.write_bytes(ck.read_bytes()[:100])
    elif kind == "empty":
        ck.write_bytes(b"")
    elif kind == "text":
        ck.write_text("not a checkpoint")
    elif kind == "list":
        torch.save([1, 2, 3], ck)
    elif kind == "missing key":
        del good["ledger"]
        torch.save(good, ck)
    elif kind == "negative round":
        torch.save({**good, "next_round": -5}, ck)
    elif kind == "round beyond the run":
        torch.save({**good, "next_round": 999}, ck)
    elif kind == "wrong shape":
        good["algorithm"]["x"] = torch.zeros(3)
        torch.save(good, ck)
    elif kind == "an object":
        torch.save({**good, "rows": Path("x")}, ck)


DAMAGE = {
    "truncated": "is damaged (its content does not match the sha256 digest",
    "empty": "not a readable fedweave checkpoint",
    "text": "not a readable fedweave checkpoint",
    "list": "not a fedweave checkpoint",
    "missing key": "missing ledger",
    "negative round": "next_round must be a round in [0, 2]",
    "round beyond the run": "next_round must be a round in [0, 2]",
    "wrong shape": "has shape [3]",
    "an object": "holds objects other than tensors",
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(checkpointed, kind, capsys):
    _damage(kind, checkpointed)
    line = _one_line_error(capsys, cli_main(["run", "--resume", str(checkpointed)]), DAMAGE[kind])
    assert str(checkpointed / CHECKPOINT) in line
    assert "weights_only=False" not in line


# ---- resume ------------------------------------------------------------------------------------------
def test_resume_with_fewer_rounds_than_the_checkpoint_names_rounds(checkpointed, capsys):
    # before: 'checkpoint.pt: next_round must be a round in [0, 1]', as if the intact checkpoint were damaged
    _one_line_error(
        capsys,
        cli_main(["run", "--resume", str(checkpointed), "rounds=1", "--no-progress"]),
        "rounds: 1 is below the round the checkpoint continues from (2); a resumed run may shorten the run down to "
        "that round, not below: give rounds >= 2",
    )


def _numbers(rows):
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]


@pytest.mark.parametrize("local", [{}, {"lr_decay": 0.8}], ids=["constant-lr", "decaying-lr"])
def test_resume_extends_a_finished_run_to_the_numbers_of_a_longer_run(tmp_path, capsys, local):
    # an exponential decay per round does not depend on the total, so the extension is exact
    cfg = {**BASE, "local": {**BASE["local"], **local}, "output": {**BASE["output"], "checkpoint_every": 1}}
    fedweave.run(cfg, run_dir=tmp_path / "short")
    assert cli_main(["run", "--resume", str(tmp_path / "short"), "rounds=5", "--no-progress"]) == 0
    long = fedweave.run({**cfg, "rounds": 5}, run_dir=tmp_path / "long")
    from fedweave.results import read_metrics

    assert _numbers(read_metrics(tmp_path / "short")) == _numbers(long.metrics)


def test_resume_refuses_a_config_and_a_changed_computation(checkpointed, capsys, in_tmp):
    line = _one_line_error(capsys, cli_main(["run", "c.yaml", "--resume", str(checkpointed)]), "not both")
    assert "c.yaml" in line
    _one_line_error(capsys, cli_main(["run", "--resume", str(checkpointed), "seed=4"]), "seed changed")


# schedules over the run's total rounds: an extension would change the rounds still to come (before: DisPFL's
# annealed prune rate was extended silently, to numbers no run of the new length gives)
TOTAL_ROUNDS = {
    "cosine": ({"local": {**BASE["local"], "lr_schedule": "cosine"}}, "local.lr_schedule is cosine"),
    "dispfl": ({"algorithm": {"name": "dispfl", "neighbours": 2}}, "(dispfl)"),
    # before: the extension ran with the sigma of the new total, stopped at once on the spent budget and
    # reported that sigma in summary.json, not the one its rounds were released with
    "privacy-auto": (
        {"sampler": {"name": "bernoulli"}, "privacy": {"noise_multiplier": "auto", "target_epsilon": 20.0}},
        "privacy.noise_multiplier is auto",
    ),
    # DP-FedAvg's denominator E is the mean entry length over the planned rounds (2.5 for 2 rounds, 2.75 for 4)
    "privacy-schedule": (
        {"sampler": {"name": "schedule", "clients": [[0, 1], [0, 1, 2], [0, 1, 2, 3]]}, "privacy": {"clip": 1.0}},
        "privacy's expected clients per round E",
    ),
}


@pytest.mark.parametrize("case", TOTAL_ROUNDS)
def test_resume_refuses_to_extend_a_schedule_over_the_total(tmp_path, capsys, case):
    changes, why = TOTAL_ROUNDS[case]
    cfg = {**BASE, **changes, "output": {**BASE["output"], "checkpoint_every": 1}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    line = _one_line_error(capsys, cli_main(["run", "--resume", str(tmp_path / "r"), "rounds=4"]), why)
    assert "schedule depends on the total" in line
    # the same total resumes: only the extension is refused
    assert cli_main(["run", "--resume", str(tmp_path / "r"), "--no-progress"]) == 0


# ---- divergence --------------------------------------------------------------------------------------
def test_an_exploding_loss_stops_the_run_and_says_what_is_kept(tmp_path):
    # this MLP's test loss goes 8.8e6, 3.8e13, 5.4e19, ... and reaches NaN at round 6: finite but useless
    cfg = {
        **BASE,
        "rounds": 15,
        "model": {"name": "mlp"},
        "local": {"batch_size": 8, "lr": 2.0},
        "output": {**BASE["output"], "checkpoint_every": 1},
    }
    with pytest.raises(DivergenceError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    msg = str(e.value)
    assert "round 2: train_loss" in msg and "exploded" in msg and "explode_factor" in msg
    assert "The checkpoint of round 1 is kept" in msg and "local.lr=SMALLER" in msg
    summary = yaml.safe_load((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["rounds"] == 1
    assert read_checkpoint(tmp_path / "r" / CHECKPOINT)["next_round"] == 1
    # and it resumes with a smaller learning rate
    res = fedweave.runner.resume(tmp_path / "r", ["local.lr=0.01"], progress=False)
    assert res.summary["status"] == "completed"


def test_a_blow_up_within_round_1_is_caught_against_the_initial_model(tmp_path):
    # a linear model with lr 1e9: its test loss is finite but enormous after one round, so the first reported
    # value is no reference; eval.at_start measures the initial model's loss, and round 1 is compared with it
    cfg = {**BASE, "local": {**BASE["local"], "lr": 1e9}}
    assert fedweave.run(cfg, run_dir=tmp_path / "a").summary["status"] == "completed"
    with pytest.raises(DivergenceError, match=r"round 1: test_loss = .* exploded .* its first value"):
        fedweave.run({**cfg, "eval": {"at_start": True}}, run_dir=tmp_path / "b")


def test_the_explosion_check_can_be_switched_off():
    from fedweave.callbacks.builtin import check_explosion as _check_explosion

    first: dict[str, float] = {}
    _check_explosion({"test_loss": 2.0}, first, 0, 10.0)
    _check_explosion({"test_loss": 19.0}, first, 1, 10.0)
    with pytest.raises(DivergenceError, match="test_loss = 21 exploded"):
        _check_explosion({"test_loss": 21.0}, first, 2, 10.0)
    _check_explosion({"test_loss": 1e30}, first, 3, None)


# ---- interrupts on a real process ---------------------------------------------------------------------
SUBPROCESS_CFG = {
    "name": "int",
    "seed": 2,
    "rounds": 3000,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 2},
    "local": {"steps": 1, "epochs": None, "batch_size": 8, "lr": 0.05},
    "backend": "loop",
    "threads": 1,
    "output": {"progress": False, "plots": False, "checkpoint_every": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_write_an_interrupted_summary_and_resume_identically(tmp_path, sig, code):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(SUBPROCESS_CFG))
    run = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedweave.cli", "run", str(tmp_path / "c.yaml"), "--out", str(run), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job inherits SIGINT ignored, and Python then keeps ignoring it: give the child
        # the default disposition, as a terminal would, so that this test also holds when run in the background
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        rows = (run / "metrics.jsonl").read_text().count("\n") if (run / "metrics.jsonl").exists() else 0
        if rows >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedweave: interrupted:") and "Traceback" not in err, err
    summary = yaml.safe_load((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "--resume" in summary["error"]
    done = read_checkpoint(run / CHECKPOINT)["next_round"]
    stop = done + 3
    assert cli_main(["run", "--resume", str(run), f"rounds={stop}", "--no-progress"]) == 0
    fresh = fedweave.run(load(tmp_path / "c.yaml", [f"rounds={stop}"]), run_dir=tmp_path / "fresh")
    from fedweave.results import read_metrics

    assert _numbers(read_metrics(run)) == _numbers(fresh.metrics)


# ---- the dataset cache -------------------------------------------------------------------------------
@pytest.fixture
def cached_mnist(tmp_path, monkeypatch):
    import hashlib

    import numpy as np

    from fedweave.data import sources

    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDWEAVE_OFFLINE", "1")
    rng = np.random.default_rng(0)
    root = tmp_path / "cache" / "mnist"
    root.mkdir(parents=True)
    table = {}
    for name in sources.SPECS["mnist"].files:
        blob = rng.integers(0, 256, 2000, dtype=np.uint8).tobytes()
        (root / name).write_bytes(blob)
        table[name] = "sha256:" + hashlib.sha256(blob).hexdigest()
    monkeypatch.setitem(sources.CHECKSUMS, "mnist", table)
    sources.fetch("mnist")  # verified once: the stamp is written
    return root


def _corrupt_in_place(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    with open(path, "r+b") as f:  # same inode, same size
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the timestamp restored


def test_a_same_size_corruption_with_its_timestamp_restored_is_caught(cached_mnist, capsys):
    from fedweave.data import sources

    name = sources.SPECS["mnist"].files[0]
    _corrupt_in_place(cached_mnist / name)
    with pytest.raises(sources.DataNotFoundError, match="sha256"):
        sources.resolve("mnist")  # the quick check sees the changed ctime and hashes again
    assert cli_main(["data", "verify", "mnist"]) == 2
    assert "sha256" in capsys.readouterr().err


def test_data_fetch_hashes_every_time(cached_mnist, capsys, monkeypatch):
    from fedweave.data import sources

    hashed = []
    real = sources.verify_file
    monkeypatch.setattr(sources, "verify_file", lambda p, *a, **k: (hashed.append(Path(p).name), real(p, *a, **k)))
    sources.resolve("mnist")
    assert hashed == []  # a run's quick check: identity unchanged, nothing hashed
    assert cli_main(["data", "fetch", "mnist"]) == 0
    assert sorted(hashed) == sorted(sources.SPECS["mnist"].files)
    hashed.clear()
    assert cli_main(["data", "fetch", "mnist", "mnist"]) == 0  # several names: each fetched once, in order
    assert sorted(hashed) == sorted(sources.SPECS["mnist"].files)
    assert capsys.readouterr().out.count("mnist: ") == 2
    assert cli_main(["data", "verify"]) == 0
    assert "mnist: OK" in capsys.readouterr().out


# ---- a kill during each kind of write ------------------------------------------------------------------
KILL_AT_WRITE = """
import os, sys
from fedweave.cli import main
name, nth = sys.argv[1], int(sys.argv[2])
real, seen = os.replace, [0]
def replace(src, dst):
    if os.path.basename(str(dst)) == name:
        seen[0] += 1
        if seen[0] == nth:  # the temporary file is written and synced: die before the rename
            os._exit(137)
    real(src, dst)
os.replace = replace
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, nth", [("checkpoint.pt", 3), ("metrics.csv", 3), ("metrics.jsonl", 3), ("summary.json", 1)]
)
def test_a_kill_during_any_write_leaves_the_old_file_and_resumes_identically(tmp_path, name, nth):
    cfg = {**SUBPROCESS_CFG, "rounds": 6}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "r"
    argv = ["run", str(tmp_path / "c.yaml"), "--out", str(run), "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", KILL_AT_WRITE, name, str(nth), *argv], capture_output=True, text=True)
    assert proc.returncode == 137, proc.stderr
    assert list(run.glob(f".{name}.*.tmp")), "the write was under way"
    if (run / name).exists() and name.endswith("json"):  # never half-written: the old version parses
        yaml.safe_load((run / name).read_text())
    assert cli_main(["run", "--resume", str(run), "--no-progress"]) == 0
    assert not list(run.glob(".*.tmp"))
    fresh = fedweave.run(load(tmp_path / "c.yaml"), run_dir=tmp_path / "fresh")
    from fedweave.results import read_metrics

    assert _numbers(read_metrics(run)) == _numbers(fresh.metrics)
