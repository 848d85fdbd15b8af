"""Crash and resume: SIGKILL a real run mid-way, resume it, get the uninterrupted run bit for bit; divergence."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml

import fedweave
from fedweave.algorithms.base import Algorithm, RunContext, build_algorithm
from fedweave.algorithms.centralized.base import StarAlgorithm
from fedweave.algorithms.centralized.fedavg import FedAvg
from fedweave.checkpoints import CHECKPOINT, encode_checkpoint, read_checkpoint, save_checkpoint
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError, from_dict
from fedweave.registry import ALGORITHMS
from fedweave.results import read_metrics
from fedweave.runner import DivergenceError, resume

# A real dataset that needs no network (scikit-learn's bundled digits), so a subprocess can load it.
DIGITS = {
    "name": "digits",
    "seed": 7,
    "rounds": 12,
    "backend": "loop",
    "threads": 1,
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 10, "alpha": 0.5, "min_size": 20},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 5},
    "local": {"epochs": 1, "batch_size": 8, "lr": 0.02, "momentum": 0.5},
    "output": {"progress": False, "plots": False, "checkpoint_every": 1},
}


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]


def _checkpoint(path) -> dict:
    return read_checkpoint(path / CHECKPOINT)


def test_sigkill_mid_run_then_resume_equals_an_uninterrupted_run(tmp_path):
    cfg_path = tmp_path / "digits.yaml"
    cfg_path.write_text(yaml.safe_dump(DIGITS))
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedweave.cli", "run", str(cfg_path), "--out", str(run_dir), "--no-progress"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    killed_at = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / CHECKPOINT).is_file():
                nxt = _checkpoint(run_dir)["next_round"]
                if nxt >= 2:
                    proc.send_signal(signal.SIGKILL)
                    killed_at = nxt
                    break
            time.sleep(0.01)
    finally:
        if proc.poll() is None and killed_at is None:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert killed_at is not None, f"the run ended before it could be killed: {err.decode()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()  # it really died mid-way
    ckpt = _checkpoint(run_dir)
    assert ckpt["next_round"] < DIGITS["rounds"]

    assert cli_main(["run", "--resume", str(run_dir), "--no-progress"]) == 0
    full = fedweave.run(DIGITS, run_dir=tmp_path / "full")
    resumed = read_metrics(run_dir)
    assert [r["round"] for r in resumed] == list(range(1, DIGITS["rounds"] + 1))
    assert _strip(resumed) == _strip(full.metrics)  # bit for bit: every loss, accuracy and byte count
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["communication"] == full.summary["communication"]
    a, b = _checkpoint(run_dir)["algorithm"]["x"], _checkpoint(tmp_path / "full")["algorithm"]["x"]
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("method", "role", "what"), [("afl", "server", "mixture_weights"), ("scaffold", "client", "control_variate")]
)
def test_resume_keeps_the_storage_the_algorithm_declares_that_the_checkpoint_lacks(
    toy_config, tmp_path, method, role, what
):
    # an algorithm declares its storage when it is built (AFL's lambda, SCAFFOLD's control variates); a checkpoint
    # written before it declared an entry (here: the entry deleted from a saved one) lacks it, and the resumed
    # run's storage is still the uninterrupted run's: the checkpoint's figures and the declarations it lacks
    cfg = {
        **toy_config,
        "algorithm": {"name": method, "clients_per_round": 4},
        "output": {"progress": False, "plots": False, "checkpoint_every": 1},
    }
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "r")  # as if killed after round 2
    ck = tmp_path / "r" / CHECKPOINT
    state = read_checkpoint(ck)
    storage = state["ledger"]["storage"]
    assert [role, what] in [e[:2] for e in storage]
    state["ledger"]["storage"] = [e for e in storage if e[:2] != [role, what]]
    ck.write_bytes(encode_checkpoint(state))
    res = resume(tmp_path / "r", ["rounds=4"], progress=False)
    assert _strip(res.metrics) == _strip(full.metrics)
    assert res.summary["communication"]["storage_peak_bytes"] == full.summary["communication"]["storage_peak_bytes"]
    assert res.summary["communication"] == full.summary["communication"]
    assert what in res.summary["communication"]["storage_peak_bytes"][role]


def test_checkpoint_is_safe_to_load_and_holds_what_resume_needs(toy_config, tmp_path):
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 2}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    ckpt = _checkpoint(tmp_path / "r")  # weights_only=True: no code runs on load
    assert set(ckpt) >= {"next_round", "algorithm", "ledger", "rows", "config", "skipped_rounds"}
    assert ckpt["next_round"] == 4 and len(ckpt["rows"]) == 4 and ckpt["config"]["seed"] == toy_config["seed"]
    assert not list((tmp_path / "r").glob(".*.tmp"))


def test_resume_refuses_a_changed_config_but_may_extend_rounds(toy_config, tmp_path):
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 1}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    path = tmp_path / "r" / "config.yaml"
    conf = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**conf, "local": {**conf["local"], "batch_size": 7}}))
    with pytest.raises(ConfigError, match="local changed since the checkpoint"):
        resume(tmp_path / "r", progress=False)
    path.write_text(yaml.safe_dump({**conf, "rounds": 5}))
    assert resume(tmp_path / "r", progress=False).metrics[-1]["round"] == 5


def test_resume_refuses_another_holdout_though_it_may_change_the_rest_of_eval(toy_config, tmp_path):
    """eval.holdout takes each client's test samples out of its training data: a resume that changed it trained
    its rounds on other samples and relabelled the whole run (and a sweep run again with it reused the run)."""
    cfg = {**toy_config, "rounds": 3, "output": {"progress": False, "plots": False, "checkpoint_every": 1}}
    cfg["eval"] = {"personal_test": True}  # the global model on each client's own test set: what holdout draws
    fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match=r"eval\.holdout changed since the checkpoint .* \(not eval\.holdout\)"):
        resume(tmp_path / "r", ["rounds=3", "eval.holdout=0.5"], progress=False)
    assert resume(tmp_path / "r", ["rounds=3", "eval.every=2"], progress=False).metrics[-1]["round"] == 3
    grid = {"local.lr": [0.1]}
    fedweave.sweep(cfg, grid, workers=1, out=tmp_path / "s", progress=False)
    with pytest.raises(Exception, match=r"already holds a finished run of another config"):
        fedweave.sweep(
            {**cfg, "eval": {"personal_test": True, "holdout": 0.5}},
            grid,
            workers=1,
            out=tmp_path / "s",
            progress=False,
        )


def test_a_finished_run_resumed_with_another_lr_and_no_round_left_is_refused(toy_config, tmp_path):
    # no round was left to train with it: the resume wrote local.lr=0.9 into config.yaml beside the numbers of
    # local.lr=0.1, and a reader (or `fedweave run config.yaml`) took them for lr 0.9's
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 1}}
    first = fedweave.run(cfg, run_dir=tmp_path / "r")
    before = {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir() if p.is_file()}
    # eval and callbacks too: a finished run has no round left to measure or stop by them (before: relabelled)
    stop = "callbacks=[{name: stop_at_target, metric: test_accuracy, target: 0.1}]"
    changes = {"local.lr=0.9": "local.lr", "local.grad_clip=1.0": "local.grad_clip", "eval.every=2": "eval"}
    for change, named in {**changes, stop: "callbacks"}.items():
        with pytest.raises(ConfigError, match=f"^{named}: the checkpoint holds all 4 rounds"):
            resume(tmp_path / "r", [change], progress=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir() if p.is_file()} == before
    # with rounds to train, the new value trains them (a diverged run continued more gently)
    res = resume(tmp_path / "r", ["local.lr=0.9", "rounds=5"], progress=False)
    assert res.metrics[:4] == first.metrics and [r["round"] for r in res.metrics] == [1, 2, 3, 4, 5]


def test_resume_without_a_checkpoint_is_a_clear_cli_error(toy_config, tmp_path, capsys):
    fedweave.run(toy_config, run_dir=tmp_path / "r")  # checkpoint_every = 0
    assert cli_main(["run", "--resume", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.pt not found" in err and len(err.strip().splitlines()) == 1


def test_resume_without_a_checkpoint_says_why_where_the_run_checkpoints_or_is_a_sweep(toy_config, tmp_path, capsys):
    # both were told to set output.checkpoint_every: a run that had it, killed before its first checkpoint, and
    # a sweep directory, whose runs the sweep resumes
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 3}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    (tmp_path / "r" / CHECKPOINT).unlink()  # as a run killed in round 1 or 2
    (tmp_path / "r" / "summary.json").unlink()
    fedweave.sweep(toy_config, {"local.lr": [0.05]}, out=tmp_path / "s", progress=False)
    for d, want in (
        ("r", "the run stopped before its first checkpoint (output.checkpoint_every: 3); start it again with "
              f"'fedweave run {tmp_path / 'r' / 'config.yaml'} --out {tmp_path / 'r'} --overwrite'"),
        ("s", "it is a sweep directory; run the sweep again (same --out) to resume its runs"),
    ):  # fmt: skip
        assert cli_main(["run", "--resume", str(tmp_path / d), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.endswith(want) and "set output.checkpoint_every" not in err, err
    assert cli_main(["run", str(tmp_path / "r" / "config.yaml"), "--out", str(tmp_path / "r"), "--overwrite"]) == 0


def test_a_fresh_run_removes_a_stale_checkpoint(toy_config, tmp_path):
    cfg = {**toy_config, "output": {"progress": False, "plots": False, "checkpoint_every": 1}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    with pytest.raises(OSError, match="already holds a finished run"):  # never replaced by accident
        fedweave.run(toy_config, run_dir=tmp_path / "r")
    assert (tmp_path / "r" / CHECKPOINT).exists()
    fedweave.run(toy_config, run_dir=tmp_path / "r", overwrite=True)  # same directory, no checkpoints this time
    assert not (tmp_path / "r" / CHECKPOINT).exists()


def test_a_state_torch_cannot_load_safely_fails_at_the_first_checkpoint(toy_config, tmp_path):
    import numpy as np

    algo = fedweave.run(toy_config, run_dir=tmp_path / "r").algorithm
    algo.bad = np.zeros(3)  # a numpy array: refused by weights_only=True
    algo.state_fields = ("x", "bad")  # its state record, on this instance only
    from fedweave.results import RunDir

    with pytest.raises(TypeError, match="weights_only=True"):
        save_checkpoint(RunDir(tmp_path / "s"), algo, 1, 0.0, verify=True)
    assert not (tmp_path / "s" / CHECKPOINT).exists()


# ---- divergence -------------------------------------------------------------------------------------
def test_huge_learning_rate_exits_non_zero_with_one_clear_line(toy_config, tmp_path, capsys):
    cfg = {**toy_config, "local": {"lr": 1e38, "batch_size": 16}, "output": {"progress": False, "plots": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**cfg, "output": {**cfg["output"], "checkpoint_every": 1}}))
    assert cli_main(["run", str(path), "--out", str(tmp_path / "r"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not finite" in err and "local.lr" in err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["rounds"] == 0
    assert not (tmp_path / "r" / CHECKPOINT).exists()  # nothing good to keep, and nothing bad written


class _BlowsUp(FedAvg):
    """FedAvg whose model overflows in round ``blow_up`` while its reported training loss stays finite:
    only the state check before checkpointing can notice (what a huge lr does a few rounds in)."""

    def run_round(self, r: int) -> dict[str, float]:
        out = super().run_round(r)
        if r + 1 >= 4:
            self.x = self.x * 1e38 * 1e38  # -> inf
        return out


if "_fedavg_blows_up" not in ALGORITHMS._items:
    ALGORITHMS.register("_fedavg_blows_up")(_BlowsUp)


@pytest.mark.parametrize("every", [1, 3])
def test_divergence_keeps_the_last_good_checkpoint_and_metrics(toy_config, tmp_path, every):
    out = {"progress": False, "plots": False, "checkpoint_every": 1}
    base = {**toy_config, "rounds": 8, "output": out, "backend": "loop"}
    cfg = {**base, "algorithm": {**toy_config["algorithm"], "name": "_fedavg_blows_up"}, "eval": {"every": every}}
    with pytest.raises(DivergenceError, match="not finite"):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    ckpt = _checkpoint(tmp_path / "r")
    assert ckpt["next_round"] == 3 and bool(torch.isfinite(ckpt["algorithm"]["x"]).all())
    good = fedweave.run({**base, "rounds": 3}, run_dir=tmp_path / "good")  # plain FedAvg, 3 rounds
    assert torch.equal(ckpt["algorithm"]["x"], good.algorithm.x)
    rows = read_metrics(tmp_path / "r")
    assert [r["round"] for r in rows] == [r for r in range(1, 4) if r % every == 0]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "diverged" and "round 4" in summary["error"]


class _WithMarker(FedAvg):
    """FedAvg holding a tensor that uses NaN as 'not seen yet' (as peer-loss trackers do)."""

    state_fields = (*StarAlgorithm.state_fields, "seen")

    def __init__(self, ctx, hp):
        super().__init__(ctx, hp)
        self.seen = torch.full((ctx.num_clients,), float("nan"))

    def run_round(self, r: int) -> dict[str, float]:
        out = super().run_round(r)
        self.seen[self.sample_clients(r)] = float(r)
        return out


if "_fedavg_with_marker" not in ALGORITHMS._items:
    ALGORITHMS.register("_fedavg_with_marker")(_WithMarker)


def test_nan_used_as_a_marker_from_the_start_is_not_divergence(toy_config, tmp_path):
    out = {"progress": False, "plots": False, "checkpoint_every": 1}
    cfg = {**toy_config, "algorithm": {**toy_config["algorithm"], "name": "_fedavg_with_marker"}, "output": out}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert res.summary["status"] == "completed"
    seen = _checkpoint(tmp_path / "r")["algorithm"]["seen"]
    assert bool(seen.isnan().any()) and not bool(seen.isnan().all())


# The state record of every built-in algorithm: the default ``state_dict()`` saves these attributes under their
# names (a family or method adds its client state, selector or uploads in flight), so they are keys of every
# checkpoint written so far, which a resumed run reads back: a change here makes old checkpoints unreadable.
STATE_RECORDS = {
    **dict.fromkeys(["fedavg", "fedprox", "fedsam", "fednova", "fedexp", "moon", "fedlc", "qfedavg", "qffl"], ("x",)),
    "proxskip": ("x",),  # the clients' control variates are the store's client state
    "afl": ("x", "lam"),
    # the star's personalized methods: their personal models (and APFL's alpha) are the store's client state
    **dict.fromkeys(["fedper", "fedrep", "lg_fedavg", "fedbn", "apfl", "ditto_star", "pfedme", "perfedavg"], ("x",)),
    "fedbabu": ("x",),  # the fine-tuned models are made at evaluation
    "ifca": ("models",),  # one model per cluster, no global one
    "clustered_fl": ("models", "assignment"),  # a model per cluster, a cluster per client
    "fedproto": ("protos", "known"),  # the global prototypes; each client's own model is the store's
    # the asynchronous methods' jobs lost to injected faults: keys added later, which an older checkpoint lacks (a
    # run without faults loses none, so such a checkpoint resumes with the fresh, empty values)
    **dict.fromkeys(
        ["fedasync", "fedbuff"],
        ("x", "now", "dispatches", "jobs", "events", "in_flight", "starts", "ys", "lost", "lost_in_a_row"),
    ),
    **dict.fromkeys(["fedadam", "fedopt", "fedyogi", "fedadagrad", "fedavgm"], ("x", "m", "v")),
    "fedcm": ("x", "momentum"),
    "mofedsam": ("x", "momentum"),
    "feddyn": ("x", "h"),
    "fedmim": ("x", "history"),
    "scaffold": ("x", "c"),
    **dict.fromkeys(["hier_fedavg", "hier_fedprox", "hier_scaffold", "zo_hfl"], ("x",)),
    **dict.fromkeys(["cse_fsl", "fsl_an", "fsl_mc", "fsl_oc"], ("xc", "xs", "xa")),
    **dict.fromkeys(["afind", "afind_plus", "local", "choco_sgd"], ()),
    # the neighbour selection's state (AFIND's thresholds), saved and restored by the selector itself
    **dict.fromkeys(["dfedavg", "dfedavgm", "dispfl", "ditto", "fedavg_ft", "gossip"], ("selector",)),
    "federico": ("pi", "tracked"),
    "fomo": ("affinity", "selector"),
    "pens": ("counts",),
    "cfl_admm": ("X", "Y", "G", "k", "uploads", "xu", "lam", "msg", "gamma"),
    "cfl_saga": ("X", "Y", "G", "k", "uploads", "table", "table_sum", "held", "ref"),
    "gt_saga": ("X", "Y", "G", "k", "uploads", "table", "table_sum"),
    "gt_sarah": ("X", "Y", "G", "k", "uploads", "due", "anchored"),
    "gt_svrg": ("X", "Y", "G", "k", "uploads", "anchor", "mu", "due", "anchored"),
}


def test_every_built_in_algorithm_keeps_its_state_record():
    builtin = {n: ALGORITHMS.get(n) for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedweave.")}
    assert {n: cls.state_fields for n, cls in builtin.items()} == STATE_RECORDS


def test_a_state_field_the_algorithm_does_not_set_fails_when_it_is_built(toy_config):
    class Misspelt(FedAvg):
        state_fields = (*StarAlgorithm.state_fields, "momentun")

        def __init__(self, ctx, hp):
            super().__init__(ctx, hp)
            self.momentum = torch.zeros_like(self.x)

    ctx = RunContext(from_dict(toy_config))
    with pytest.raises(TypeError, match=r"Misspelt.state_fields names \['momentun'\], which Misspelt does not set"):
        Misspelt(ctx, build_algorithm(ctx).hp)


@pytest.mark.parametrize("fields", ["x", ("x", "x"), ("x", "not a name")])
def test_a_state_record_must_be_a_tuple_of_distinct_attribute_names(fields):
    with pytest.raises(TypeError, match="state_fields"):
        type("Bad", (FedAvg,), {"state_fields": fields})
    assert Algorithm.state_fields == ()


# ---- file options: recorded by absolute path, so that a resume from anywhere reads the same files -------------
def _files_run(toy_config: dict, rounds: int) -> dict:
    """The toy run with its initial weights, partition and client schedule read from files named relative to the
    working directory, as a user writes them."""
    return {
        **toy_config,
        "rounds": rounds,
        "partition": {"name": "from_file", "path": "parts.json", "num_clients": 0},
        "model": {"name": "logistic", "init_from": "w.pt"},
        "sampler": {"name": "schedule", "file": "plan.json"},
        "output": {"progress": False, "plots": False, "checkpoint_every": 1},
    }


def _write_files(where, toy_config: dict, seed: int) -> None:
    """``w.pt``, ``parts.json`` and ``plan.json`` in ``where``, drawn from ``seed`` (another seed: other files of
    the same names, which a resume from that directory must not read)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    parts = np.array_split(rng.permutation(1200), 6)
    (where / "parts.json").write_text(json.dumps([sorted(p.tolist()) for p in parts]))
    (where / "plan.json").write_text(json.dumps([sorted(rng.choice(6, 3, replace=False).tolist()) for _ in range(4)]))
    model = RunContext(from_dict({**toy_config, "partition": {"name": "iid", "num_clients": 6}})).build_model()
    torch.manual_seed(seed)
    torch.save({k: torch.randn_like(v) for k, v in model.state_dict().items()}, where / "w.pt")


def test_file_options_are_recorded_by_absolute_path_and_a_resume_from_elsewhere_reads_the_same_files(
    toy_config, tmp_path, monkeypatch
):
    """Before: config.yaml and the checkpoint recorded 'parts.json', 'w.pt' and 'plan.json' as written, so a
    resume from another directory read that directory's files of those names (another partition, another
    schedule: other numbers, silently) or failed on a file it did not hold."""
    launch, elsewhere = tmp_path / "launch", tmp_path / "elsewhere"
    launch.mkdir(), elsewhere.mkdir()
    _write_files(launch, toy_config, seed=1)
    _write_files(elsewhere, toy_config, seed=2)  # the worst case: files of the same names, other contents
    monkeypatch.chdir(launch)
    full = fedweave.run(_files_run(toy_config, 4), run_dir=tmp_path / "full")
    fedweave.run(_files_run(toy_config, 2), run_dir=tmp_path / "r")
    recorded = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    in_checkpoint = _checkpoint(tmp_path / "r")["config"]
    for conf in (recorded, in_checkpoint):
        assert conf["partition"]["path"] == str(launch / "parts.json")
        assert conf["model"]["init_from"] == str(launch / "w.pt")
        assert conf["sampler"]["file"] == str(launch / "plan.json")
    monkeypatch.chdir(elsewhere)
    assert cli_main(["run", "--resume", str(tmp_path / "r"), "rounds=4", "--no-progress"]) == 0
    assert _strip(read_metrics(tmp_path / "r")) == _strip(full.metrics)


@pytest.mark.parametrize("config_yaml", ["relative", "absolute"])
def test_a_checkpoint_that_records_file_options_relative_still_resumes_from_its_directory(
    toy_config, tmp_path, monkeypatch, config_yaml
):
    """A checkpoint written before file options were recorded by absolute path holds them as written: resumed
    from the directory it was launched in, it is the same run (its config.yaml relative too, or already
    rewritten absolute by a resume that was killed before its next checkpoint)."""
    monkeypatch.chdir(tmp_path)
    _write_files(tmp_path, toy_config, seed=1)
    full = fedweave.run(_files_run(toy_config, 4), run_dir=tmp_path / "full")
    fedweave.run(_files_run(toy_config, 2), run_dir=tmp_path / "r")
    as_written = {k: v for k, v in _files_run(toy_config, 2).items() if k in ("partition", "model", "sampler")}
    ck = tmp_path / "r" / CHECKPOINT
    state = read_checkpoint(ck)
    state["config"] = {**state["config"], **as_written}
    ck.write_bytes(encode_checkpoint(state))
    if config_yaml == "relative":
        path = tmp_path / "r" / "config.yaml"
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **as_written}, sort_keys=False))
    res = resume(tmp_path / "r", ["rounds=4"], progress=False)
    assert _strip(res.metrics) == _strip(full.metrics)
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["model"]["init_from"] == str(tmp_path / "w.pt")


@pytest.mark.parametrize("changed", ["partition", "sampler", "dataset"])
def test_a_resume_refuses_user_files_that_changed_since_the_checkpoint(toy_config, tmp_path, monkeypatch, changed):
    """The config names the user's files by path only: a from_file partition, a schedule file or a libsvm data
    file edited between a checkpoint and the resume trained the rounds to come on other clients' samples or
    other samples, silently (rc 0). The checkpoint records a SHA-256 of what the run read; a resume on other
    contents is one line naming the key, and on the same contents (a file merely rewritten) it is the same run."""
    monkeypatch.chdir(tmp_path)
    _write_files(tmp_path, toy_config, seed=1)
    rng = np.random.default_rng(0)
    rows = [f"{y % 3} " + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(rng.normal(size=4))) for y in range(240)]
    (tmp_path / "d.svm").write_text("\n".join(rows) + "\n")
    cfg = {**_files_run(toy_config, 2), "model": {"name": "logistic"}}
    if changed == "dataset":
        cfg["dataset"] = {"name": "libsvm", "path": "d.svm", "test_fraction": 0.25}
        cfg["partition"] = {"name": "iid", "num_clients": 6}
    full = fedweave.run({**cfg, "rounds": 4}, run_dir=tmp_path / "full")
    fedweave.run(cfg, run_dir=tmp_path / "r")
    file = tmp_path / {"partition": "parts.json", "sampler": "plan.json", "dataset": "d.svm"}[changed]
    kept = file.read_text()
    if changed == "partition":  # two clients trade a sample
        parts = json.loads(kept)
        parts[0][0], parts[1][0] = parts[1][0], parts[0][0]
        file.write_text(json.dumps(parts))
    elif changed == "sampler":  # other clients in round 3
        plan = json.loads(kept)
        plan[2] = [c for c in range(6) if c not in plan[2]][:3]
        file.write_text(json.dumps(plan))
    else:  # one feature of one sample
        first, rest = kept.split("\n", 1)
        file.write_text(first.replace(" 1:", " 1:9", 1) + "\n" + rest)
    key = {"partition": "partition.path", "sampler": "sampler.file", "dataset": "dataset 'libsvm'"}[changed]
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .* changed since the checkpoint \(SHA-256 "):
        resume(tmp_path / "r", ["rounds=4"], progress=False)
    file.write_text(kept if changed == "dataset" else json.dumps(json.loads(kept), indent=2))  # the same contents
    res = resume(tmp_path / "r", ["rounds=4"], progress=False)
    assert _strip(res.metrics) == _strip(full.metrics)


def test_a_finished_run_with_relative_file_options_is_recognised_by_its_config(toy_config, tmp_path, monkeypatch):
    """A sweep or a reproduction takes a finished run for its point when the run's config.yaml is the point's
    config: recorded absolute, it is still the config that names the files relative."""
    from fedweave.experiments.jobs import unfinished_run
    from fedweave.runner import finished_run

    monkeypatch.chdir(tmp_path)
    _write_files(tmp_path, toy_config, seed=1)
    cfg = {**_files_run(toy_config, 2), "output": {"progress": False, "plots": False}}
    fedweave.run(cfg, run_dir=tmp_path / "r")
    assert finished_run(tmp_path / "r", cfg) is not None
    (tmp_path / "r" / "summary.json").unlink()  # killed before its end: the point's run, started again
    assert unfinished_run(tmp_path / "r", from_dict(cfg))


def test_an_error_about_a_file_option_names_the_file_as_written(toy_config, tmp_path, monkeypatch):
    """Only what a run records is absolute: the config keeps what the user wrote, which its errors name."""
    monkeypatch.chdir(tmp_path)
    cfg = {**toy_config, "model": {"name": "logistic", "init_from": "nofile.pt"}}
    with pytest.raises(ConfigError, match=r"^model.init_from: 'nofile.pt' is not a file$"):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert from_dict(cfg).model.options["init_from"] == "nofile.pt"


def test_the_recorded_config_holds_every_file_option_by_absolute_path(tmp_path, monkeypatch):
    """Each option that names an input file or a data directory, as its reader takes it (relative to the working
    directory, "~" expanded); LIBSVM's files under a root= stay relative to it, and a plug-in's options (the
    test data set's) mean what the plug-in says, so they stay as written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = from_dict(
        {
            "dataset": {"name": "libsvm", "path": "a9a.txt", "test_path": "~/a9a.t"},
            "partition": {"name": "from_file", "path": "sub/parts.npz", "num_clients": 0},
            "model": {"name": "logistic", "init_from": "../w.pt"},
            "algorithm": {"name": "dsgd", "topology": "edgelist", "edge_file": "~/edges.txt"},
            "sampler": {"name": "schedule", "file": str(tmp_path / "plan.json")},
        }
    )
    rec = cfg.recorded()
    assert rec["dataset"]["path"] == str(tmp_path / "a9a.txt")
    assert rec["dataset"]["test_path"] == f"{tmp_path}/home/a9a.t"
    assert rec["partition"]["path"] == str(tmp_path / "sub" / "parts.npz")
    assert rec["model"]["init_from"] == f"{tmp_path}/../w.pt"
    assert rec["algorithm"]["edge_file"] == f"{tmp_path}/home/edges.txt"
    assert rec["sampler"]["file"] == str(tmp_path / "plan.json")
    assert from_dict(rec).recorded() == rec  # read back from a run and recorded again: the same
    assert cfg.to_dict()["model"]["init_from"] == "../w.pt"  # the config keeps what was written
    under_root = from_dict({"dataset": {"name": "libsvm", "root": "data", "path": "a9a.txt"}}).recorded()["dataset"]
    assert under_root == {"name": "libsvm", "root": str(tmp_path / "data"), "path": "a9a.txt"}
    mnist = from_dict({"dataset": {"name": "mnist", "root": "~/d"}})
    assert mnist.recorded()["dataset"]["root"] == f"{tmp_path}/home/d"
    assert from_dict({"dataset": {"name": "_toy", "root": "d"}}).recorded()["dataset"]["root"] == "d"
