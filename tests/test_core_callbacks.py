"""The run's callbacks: the order of their hooks, stopping at a target or a budget, errors inside a hook,
and the built-in callbacks being what a config asks for."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch

import fedweave
from fedweave.callbacks import Budget, Callback, Checkpointer, DivergenceGuard, ProgressBar, RoundTrace, StopAtTarget
from fedweave.callbacks import default_callbacks as defaults
from fedweave.checkpoints import read_checkpoint
from fedweave.config import ConfigError, load
from fedweave.errors import DivergenceError
from fedweave.results import read_metrics
from fedweave.runner import resume


class Recorder(Callback):
    """Writes down every hook it hears, with the round or row."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_build(self, run):
        self.events.append(("build", run.out is None))

    def on_start(self, run):
        self.events.append(("start", run.start_round))

    def after_training(self, run, r, metrics):
        self.events.append(("trained", r))

    def on_evaluation(self, run, r, values):
        self.events.append(("evaluation", r))

    def on_row(self, run, row):
        self.events.append(("row", row["round"]))

    def after_round(self, run, r):
        self.events.append(("after", r))

    def on_round_end(self, run, r):
        self.events.append(("end of round", r, run.is_last(r)))

    def on_checkpoint(self, run, next_round):
        self.events.append(("checkpoint", next_round))

    def on_end(self, run, summary):
        self.events.append(("end", None if summary is None else summary["status"]))


@pytest.fixture
def cfg(toy_config):
    return {**toy_config, "rounds": 4, "eval": {"every": 3, "at_start": True}, "output": {
        **toy_config["output"], "checkpoint_every": 2}}  # fmt: skip


def test_hooks_come_in_the_documented_order(cfg, tmp_path):
    rec = Recorder()
    fedweave.run(cfg, run_dir=tmp_path / "a", callbacks=[rec])
    assert rec.events == [
        ("build", True),
        ("start", 0),
        ("evaluation", -1), ("row", 0),
        ("trained", 0), ("after", 0), ("end of round", 0, False),
        ("trained", 1), ("after", 1), ("checkpoint", 2), ("end of round", 1, False),
        ("trained", 2), ("evaluation", 2), ("row", 3), ("after", 2), ("end of round", 2, False),
        ("trained", 3), ("evaluation", 3), ("row", 4), ("after", 3), ("checkpoint", 4), ("end of round", 3, True),
        ("end", "completed"),
    ]  # fmt: skip


def test_a_users_callbacks_change_no_number(cfg, tmp_path):
    plain = fedweave.run(cfg, run_dir=tmp_path / "plain")
    watched = fedweave.run(cfg, run_dir=tmp_path / "watched", callbacks=[Recorder()])
    strip = [{k: v for k, v in r.items() if k != "wall_seconds"} for r in plain.metrics]
    assert [{k: v for k, v in r.items() if k != "wall_seconds"} for r in watched.metrics] == strip


def test_stop_at_target_ends_after_the_round_that_reached_it_evaluated_and_checkpointed(cfg, tmp_path):
    cfg = {**cfg, "rounds": 8, "eval": {"every": 1}, "output": {**cfg["output"], "checkpoint_every": 5}}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    accs = [r["test_accuracy"] for r in full.metrics]
    target = sorted(accs)[len(accs) // 2]  # reached part of the way, not in round 1 and not only at the end
    first = next(i for i, a in enumerate(accs) if a >= target)
    assert 0 < first < len(accs) - 1
    res = fedweave.run(cfg, run_dir=tmp_path / "stop", callbacks=[StopAtTarget("test_accuracy", target)])
    assert res.summary["status"] == "completed" and res.summary["rounds"] == first + 1
    assert "test_accuracy reached" in res.summary["stopped_early"]
    assert [r["test_accuracy"] for r in res.metrics] == accs[: first + 1]
    ckpt = read_checkpoint(res.run_dir / "checkpoint.pt")
    assert ckpt["next_round"] == first + 1  # the last round is saved, though 5 does not divide it


def test_a_run_stopped_at_its_target_resumes_to_where_it_stopped(cfg, tmp_path):
    """Resumed with the same callbacks, a run that reached its target runs no further round (it ran one more per
    resume before: StopAtTarget had forgotten the rows before the checkpoint); without them it goes on."""
    cfg = {**cfg, "rounds": 8, "eval": {"every": 1}, "output": {**cfg["output"], "checkpoint_every": 1}}
    accs = [r["test_accuracy"] for r in fedweave.run(cfg, run_dir=tmp_path / "full").metrics]
    target = sorted(accs)[len(accs) // 2]
    first = next(i for i, a in enumerate(accs) if a >= target)
    stop = {**cfg, "callbacks": [{"name": "stop_at_target", "metric": "test_accuracy", "target": target}]}
    res = fedweave.run(stop, run_dir=tmp_path / "s")
    again = resume(tmp_path / "s", ["rounds=10"])
    assert again.summary["rounds"] == res.summary["rounds"] == first + 1
    assert again.summary["stopped_early"] == res.summary["stopped_early"]
    assert [r["test_accuracy"] for r in again.metrics] == accs[: first + 1]
    assert read_checkpoint(tmp_path / "s" / "checkpoint.pt")["next_round"] == first + 1
    assert resume(tmp_path / "s", ["callbacks=[]"]).summary["rounds"] == 10  # the rounds of the last resume


def test_a_stopping_round_is_evaluated_and_the_run_resumes_to_the_full_one(cfg, tmp_path):
    cfg = {**cfg, "rounds": 6, "eval": {"every": 3}, "output": {**cfg["output"], "checkpoint_every": 3}}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    res = fedweave.run(cfg, run_dir=tmp_path / "b", callbacks=[Budget(rounds=2)])
    assert [r["round"] for r in res.metrics] == [2]  # not an evaluation round: evaluated because it is the last
    assert "budget of 2 rounds" in res.summary["stopped_early"]
    one = fedweave.run(
        {**cfg, "output": {**cfg["output"], "checkpoint_every": 0}},
        run_dir=tmp_path / "one",
        callbacks=[Budget(rounds=1)],
    )
    assert one.summary["stopped_early"] == "the budget of 1 round is spent"
    done = resume(tmp_path / "b")
    assert done.summary["status"] == "completed" and "stopped_early" not in done.summary
    final = {k: v for k, v in done.metrics[-1].items() if k != "wall_seconds"}
    assert final == {k: v for k, v in full.metrics[-1].items() if k != "wall_seconds"}


def test_a_stop_asked_in_the_last_round_is_no_early_stop(cfg, tmp_path):
    """A run that ran all its rounds did not stop early, though a callback asked it to stop after its last one
    (before: summary.json said ``stopped_early: the budget of 4 rounds is spent`` for a 4-round run); every
    callback still hears of the last round."""
    rec = Recorder()
    res = fedweave.run(cfg, run_dir=tmp_path / "b", callbacks=[Budget(rounds=4), rec])
    assert res.summary["rounds"] == 4 and "stopped_early" not in res.summary
    assert ("after", 3) in rec.events


def test_a_time_budget_stops_the_run(cfg, tmp_path):
    res = fedweave.run({**cfg, "rounds": 50}, run_dir=tmp_path / "t", callbacks=[Budget(seconds=0.0)])
    assert res.summary["rounds"] == 1 and "time budget" in res.summary["stopped_early"]


def test_a_budget_of_true_seconds_is_refused_from_python_as_from_a_config():
    # a config's `seconds: true` is refused by its type; from Python True passed as 1 second
    with pytest.raises(ValueError, match=r"Budget: seconds must be a number >= 0 \(wall seconds\), got True"):
        Budget(seconds=True)


def test_a_divergence_raised_by_a_callback_keeps_the_row_out(cfg, tmp_path):
    class Refuse(Callback):
        def on_evaluation(self, run, r, values):
            if r == 3:
                raise DivergenceError("round 4: refused by the test")

    res = fedweave.run(cfg, run_dir=tmp_path / "d", callbacks=[Refuse()], on_divergence="return")
    assert res.summary["status"] == "diverged" and "refused by the test" in res.summary["error"]
    assert [r["round"] for r in res.metrics] == [0, 3]
    rows = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 3]


class Adds(Callback):
    """Adds ``value`` to the evaluation of round 4 (0-based 3) as ``extra``."""

    def __init__(self, value) -> None:
        self.value = value

    def on_evaluation(self, run, r, values):
        if r == 3:
            values["extra"] = self.value


def test_a_nan_a_callback_adds_is_a_divergence_and_its_row_stays_out(cfg, tmp_path):
    """The guard checks the values before the callbacks after it add theirs: a NaN added there was recorded and
    the run ended completed."""
    res = fedweave.run(cfg, run_dir=tmp_path / "d", callbacks=[Adds(float("nan"))], on_divergence="return")
    assert res.summary["status"] == "diverged" and "extra=nan" in res.summary["error"]
    assert [r["round"] for r in read_metrics(tmp_path / "d")] == [0, 3]


@pytest.mark.parametrize("value", [np.float32(0.5), np.int64(2), torch.tensor(0.5), torch.tensor([2])])
def test_numpy_and_torch_numbers_a_callback_adds_are_recorded_as_numbers(value, cfg, tmp_path):
    res = fedweave.run(cfg, run_dir=tmp_path / "n", callbacks=[Adds(value)])
    (row,) = [r for r in read_metrics(tmp_path / "n") if "extra" in r]
    assert row["extra"] == value.item() and type(row["extra"]) is type(value.item())
    assert res.metrics[-1]["extra"] == value.item()


def test_a_value_no_row_can_hold_is_one_error_naming_it_and_no_half_written_row(cfg, tmp_path):
    """An array added in on_evaluation failed in the JSON writer: metrics.csv had the row, metrics.jsonl not."""
    with pytest.raises(TypeError, match=r"^round 4: the evaluation's value 'extra' is a ndarray; a metrics row holds"):
        fedweave.run(cfg, run_dir=tmp_path / "a", callbacks=[Adds(np.zeros(3))])
    assert [r["round"] for r in read_metrics(tmp_path / "a")] == [0, 3]
    assert (tmp_path / "a" / "metrics.csv").read_text().count("\n") == 1 + 2  # the header and the two rows
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["status"] == "failed"


class Meddles(Callback):
    """Writes ``key`` into the training metrics (``after_training``) or the evaluation (``on_evaluation``)."""

    def __init__(self, hook: str, key: str, value) -> None:
        self.hook, self.key, self.value = hook, key, value

    def after_training(self, run, r, metrics):
        if self.hook == "after_training":
            metrics[self.key] = self.value

    def on_evaluation(self, run, r, values):
        if self.hook == "on_evaluation":
            values[self.key] = self.value


@pytest.mark.parametrize("value", [float("nan"), np.zeros(3), 99])
def test_the_training_metrics_a_callback_sees_are_its_own_copy(value, cfg, tmp_path):
    """``after_training`` handed the live metrics: a NaN put there was recorded in a completed run, an array ended it
    without a summary, and ``round`` replaced the round's number."""
    key = "round" if isinstance(value, int) else "mine"
    res = fedweave.run(cfg, run_dir=tmp_path / "c", callbacks=[Meddles("after_training", key, value)])
    assert res.summary["status"] == "completed" and [r["round"] for r in res.metrics] == [0, 3, 4]
    assert all("mine" not in r for r in res.metrics)


@pytest.mark.parametrize("key", ["round", "wall_seconds", "bytes_up", "train_loss"])
def test_an_evaluation_value_the_row_records_itself_is_one_error(key, cfg, tmp_path):
    """``round`` set in on_evaluation made every row round 99; ``train_loss`` or ``wall_seconds`` were replaced by
    the row's own without a word."""
    with pytest.raises(ValueError, match=rf"^round 3: a callback's on_evaluation set '{key}', which the metrics row"):
        fedweave.run(
            {**cfg, "eval": {"every": 3}}, run_dir=tmp_path / "e", callbacks=[Meddles("on_evaluation", key, 99)]
        )


class Returns(Callback):
    def __init__(self, value) -> None:
        self.value = value

    def after_round(self, run, r):
        return self.value


@pytest.mark.parametrize("value", [{"stop": False}, 0.5, [1], torch.tensor([False, False])])
def test_after_round_returns_a_reason_true_or_nothing(value, cfg, tmp_path):
    """``{"stop": False}`` or 0.5 ended the run (``stopped_early: "{'stop': False}"``); a tensor of two raised
    torch's "ambiguous" error, naming no callback."""
    with pytest.raises(TypeError, match=r"^Returns\.after_round returned .*; return a reason \(a non-empty string\)"):
        fedweave.run(cfg, run_dir=tmp_path / "s", callbacks=[Returns(value)])
    for fine in (None, False, ""):
        assert fedweave.run(cfg, run_dir=tmp_path / f"f{fine!r}", callbacks=[Returns(fine)]).summary["rounds"] == 4
    # a numpy comparison (``return acc >= 0.9``) stops the run as True does
    stopped = fedweave.run(cfg, run_dir=tmp_path / "np", callbacks=[Returns(np.True_)]).summary
    assert stopped["rounds"] == 1 and stopped["stopped_early"] == "Returns"


def test_the_same_callback_object_twice_is_refused(cfg, tmp_path):
    """Every hook ran twice: a RoundTrace wrote each round twice."""
    trace = RoundTrace(["train_loss"])
    with pytest.raises(ConfigError, match=r"^callbacks\[1\] is the object callbacks\[0\] again; pass it once"):
        fedweave.run(cfg, run_dir=tmp_path / "t", callbacks=[trace, trace])
    assert not (tmp_path / "t").exists()


def test_an_unexpected_error_in_a_hook_still_ends_every_callback(cfg, tmp_path):
    class Broken(Callback):
        def after_training(self, run, r, metrics):
            if r == 1:
                raise RuntimeError("broken callback")

    rec = Recorder()
    with pytest.raises(RuntimeError, match="broken callback"):
        fedweave.run(cfg, run_dir=tmp_path / "e", callbacks=[rec, Broken()])
    # the run is recorded as failed, with its error and the rows before it: not as one still going or killed
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: broken callback"
    assert rec.events[-1] == ("end", "failed")
    assert summary["rounds"] == [r["round"] for r in read_metrics(tmp_path / "e")][-1]


def test_a_failing_on_end_does_not_hide_the_error_that_ended_the_run(cfg, tmp_path):
    """The caller sees the run's own error, as summary.json names it; a callback whose on_end then fails too is
    a note on it (before: the on_end error was raised in its place)."""

    class Broken(Callback):
        def after_training(self, run, r, metrics):
            raise RuntimeError("broken callback")

    class CannotClose(Callback):
        def on_end(self, run, summary):
            raise OSError("cannot close")

    rec = Recorder()
    with pytest.raises(RuntimeError, match="broken callback") as info:
        fedweave.run(cfg, run_dir=tmp_path / "e", callbacks=[Broken(), CannotClose(), rec])
    assert "OSError: cannot close" in "".join(getattr(info.value, "__notes__", []))
    assert rec.events[-1] == ("end", "failed")  # every callback still ends
    assert json.loads((tmp_path / "e" / "summary.json").read_text())["error"] == "RuntimeError: broken callback"
    with pytest.raises(SystemExit):  # likewise when the process is exiting

        class Exit(Callback):
            def after_training(self, run, r, metrics):
                raise SystemExit(3)

        fedweave.run(cfg, run_dir=tmp_path / "x", callbacks=[Exit(), CannotClose()])


def test_a_failing_on_end_does_not_hide_how_the_run_ended(cfg, tmp_path):
    """A diverged or interrupted run raises DivergenceError or RunInterrupted (the command line's one line and
    status) even when a callback's on_end fails then: that failure is a note on it (before: raised in its place)."""
    from fedweave.errors import RunInterrupted

    class CannotClose(Callback):
        def on_end(self, run, summary):
            raise OSError("cannot close")

    class Interrupt(Callback):
        def after_training(self, run, r, metrics):
            raise KeyboardInterrupt

    diverging = {**cfg, "local": {**cfg["local"], "lr": 1e38}}
    with pytest.raises(DivergenceError, match="not finite") as info:
        fedweave.run(diverging, run_dir=tmp_path / "d", callbacks=[CannotClose()])
    assert "OSError: cannot close" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(OSError, match="cannot close"):  # returned, the run has no error of its own to raise
        fedweave.run(diverging, run_dir=tmp_path / "r", callbacks=[CannotClose()], on_divergence="return")
    with pytest.raises(RunInterrupted) as info:
        fedweave.run(cfg, run_dir=tmp_path / "i", callbacks=[Interrupt(), CannotClose()])
    assert "OSError: cannot close" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(OSError, match="cannot close"):  # a completed run: the failure is the error
        fedweave.run(cfg, run_dir=tmp_path / "c", callbacks=[CannotClose()])
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["status"] == "completed"


def test_an_error_while_the_run_writes_its_files_ends_it_as_failed(cfg, tmp_path, monkeypatch):
    """An algorithm whose run_files() raises after the last round: the run is failed, with its summary, and every
    callback ends (before: no summary.json, as if the run were still going or killed, and no on_end)."""
    from fedweave.registry import ALGORITHMS

    def broken(self):
        raise RuntimeError("broken run_files")

    monkeypatch.setattr(ALGORITHMS.get("fedavg"), "run_files", broken)
    rec = Recorder()
    with pytest.raises(RuntimeError, match="broken run_files"):
        fedweave.run(cfg, run_dir=tmp_path / "f", callbacks=[rec])
    summary = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: broken run_files"
    assert rec.events[-1] == ("end", "failed")


def test_a_plug_in_that_exits_the_process_writes_no_summary(cfg, tmp_path):
    class Exit(Callback):
        def after_training(self, run, r, metrics):
            raise SystemExit(3)

    rec = Recorder()
    with pytest.raises(SystemExit):
        fedweave.run(cfg, run_dir=tmp_path / "x", callbacks=[rec, Exit()])
    assert rec.events[-1] == ("end", None)
    assert not (tmp_path / "x" / "summary.json").exists()


def test_the_config_decides_the_built_in_callbacks(cfg):
    kinds = [type(c) for c in defaults(load(cfg))]
    assert kinds[0] is DivergenceGuard and Checkpointer in kinds and ProgressBar not in kinds
    on = load({**cfg, "output": {**cfg["output"], "progress": True, "checkpoint_every": 0}})
    assert ProgressBar in [type(c) for c in defaults(on)] and Checkpointer not in [type(c) for c in defaults(on)]


def test_stop_at_target_on_a_column_the_run_never_writes_is_a_warning(cfg, tmp_path, caplog):
    """A misspelled metric can never stop the run: it says so once, naming the run's columns (before: silence,
    and the run went on to its last round)."""
    with caplog.at_level(logging.WARNING, logger="fedweave"):
        res = fedweave.run(cfg, run_dir=tmp_path / "x", callbacks=[StopAtTarget("test_acc", 0.1, direction="max")])
    assert res.summary["rounds"] == 4 and "stopped_early" not in res.summary
    warned = [r.getMessage() for r in caplog.records if "stop_at_target" in r.getMessage()]
    assert len(warned) == 1 and "'test_acc'" in warned[0] and "test_accuracy" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedweave"):
        fedweave.run(cfg, run_dir=tmp_path / "y", callbacks=[StopAtTarget("test_accuracy", 2.0)])
    assert not [r for r in caplog.records if "stop_at_target" in r.getMessage()]


def test_stop_at_target_needs_a_direction_only_where_the_columns_name_says_none(cfg, tmp_path):
    """A loss, a gap or an error is lower-is-better by its name (fedweave.tasks.column_direction, as sweeps and the
    report read it): test_loss and the confederated opt_gap need no direction (before, every column but the main
    one was refused without it); a name that says neither still is, and the one given is never overwritten."""
    with pytest.raises(ValueError, match="give direction='max' or 'min' for 'test_foo' \\(its name says neither"):
        fedweave.run(cfg, run_dir=tmp_path / "x", callbacks=[StopAtTarget("test_foo", 0.1)])
    stop = StopAtTarget("test_loss", 1e9)
    res = fedweave.run(cfg, run_dir=tmp_path / "y", callbacks=[stop])
    assert res.summary["rounds"] == 3  # the first evaluated round (eval.every = 3) is at most 1e9
    assert stop.direction is None  # resolved for that run only: the object may serve a run of another task
    res = fedweave.run(cfg, run_dir=tmp_path / "z", callbacks=[StopAtTarget("test_loss", 1e9, direction="max")])
    assert "stopped_early" not in res.summary  # no loss is at least 1e9: the direction given is the one used


def test_a_config_names_its_callbacks_and_a_resume_may_change_them(cfg, tmp_path):
    stop = {**cfg, "rounds": 6, "callbacks": [{"name": "budget", "rounds": 2}]}
    res = fedweave.run(stop, run_dir=tmp_path / "c")
    assert res.summary["rounds"] == 2 and "budget of 2 rounds" in res.summary["stopped_early"]
    assert load(tmp_path / "c" / "config.yaml").callbacks[0].options == {"rounds": 2}
    done = resume(tmp_path / "c", ["callbacks=[]"])
    assert done.summary["rounds"] == 6 and "stopped_early" not in done.summary


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("nope", "unknown callback 'nope'"),
        ({"name": "budget", "minutes": 3}, "unknown key 'callbacks[0].minutes'"),
        ({"name": "budget", "rounds": "many"}, "callbacks[0].rounds"),
        ({"name": "budget"}, "callbacks[0] (budget): Budget: give seconds, rounds or both"),
    ],
)
def test_a_bad_callback_entry_is_one_line_before_anything_is_written(cfg, tmp_path, entry, message):
    from fedweave.config import ConfigError
    from fedweave.registry import UnknownNameError

    with pytest.raises((ConfigError, UnknownNameError), match=re.escape(message)):
        fedweave.run({**cfg, "callbacks": [entry]}, run_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_registered_callback_that_is_no_callback_is_one_line_before_anything_is_written(cfg, tmp_path, monkeypatch):
    """A plug-in's class registered as a callback without subclassing fedweave.Callback: one line naming the
    entry (before: an AttributeError from inside the first hook, as for such an object passed from Python)."""
    from fedweave.config import ConfigError
    from fedweave.registry import CALLBACKS

    class PrintRows:  # hooks of its own, but not a Callback
        def on_row(self, run, row):
            print(row["round"])

    monkeypatch.setitem(CALLBACKS._items, "_print_rows", PrintRows)
    message = "callbacks[0] (_print_rows): the registered callback made a PrintRows, not a fedweave.Callback"
    with pytest.raises(ConfigError, match=re.escape(message)):
        fedweave.run({**cfg, "callbacks": ["_print_rows"]}, run_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_family_with_its_own_metrics_is_plotted_by_them(tmp_path):
    # the confederated family records no test_loss (its rows hold opt_gap ...): its plots were a traceback
    from fedweave.cli import main as cli_main

    code = cli_main(["run", "example:confederated/gt_saga", "rounds=2", "dataset.num_samples=2000", "dataset.dim=20",
                     "output.plots=true", "--out", str(tmp_path / "c"), "--no-progress"])  # fmt: skip
    assert code == 0
    assert (tmp_path / "c" / "opt_gap_vs_rounds.png").is_file()


def test_a_solver_run_stops_on_a_metric_of_every_round_and_keeps_its_trace(tmp_path):
    # the confederated methods report opt_gap every round: StopAtTarget(each_round) stops on it without an
    # evaluation each round, and round_trace keeps the per-round curve (CFL-SAGA's reproduction needs both)
    # the uninterrupted run's gaps up to the target's round 60 are all the checks read (the stopped run has 400)
    cfg = load("example:confederated/gt_saga", ["dataset.num_samples=2000", "dataset.dim=20", "rounds=60"])
    base = fedweave.run(cfg, run_dir=tmp_path / "full", progress=False)
    gaps = [r["opt_gap"] for r in base.metrics]
    cfg = load(
        "example:confederated/gt_saga",
        ["dataset.num_samples=2000", "dataset.dim=20", "rounds=400", "eval.every=400", "eval.at_start=true"],
    )
    stop = StopAtTarget("opt_gap", gaps[59], direction="min", each_round=True)
    res = fedweave.run(cfg, run_dir=tmp_path / "stop", progress=False, callbacks=[stop, RoundTrace(["opt_gap"])])
    first = next(i for i, g in enumerate(gaps) if g <= gaps[59]) + 1
    assert res.summary["rounds"] == first and [r["round"] for r in res.metrics] == [0, first]
    trace = (tmp_path / "stop" / "trace.csv").read_text().splitlines()
    assert trace[0] == "round,opt_gap,wall_seconds" and len(trace) == first + 2  # rounds 0..first
    assert [float(line.split(",")[1]) for line in trace[2:]] == gaps[:first]  # the same numbers as evaluated


class _ExitAfter(Callback):
    """Ends the process's run after round ``n`` (0-based), as a kill does: no summary, no on_end files."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_round_end(self, run, r):
        if r == self.n:
            raise SystemExit(1)


def test_a_resumed_run_keeps_the_round_trace_up_to_its_checkpoint(toy_config, tmp_path):
    # trace.csv was written only at the run's end and restarted empty on resume: a run killed at round 3 and
    # resumed had a trace of rounds 4..6 only
    toy_config.update(rounds=6, callbacks=[{"name": "round_trace", "keys": ["train_loss"]}])
    toy_config["output"]["checkpoint_every"] = 1
    fedweave.run(load(toy_config), run_dir=tmp_path / "full", progress=False)
    with pytest.raises(SystemExit):
        fedweave.run(load(toy_config), run_dir=tmp_path / "killed", progress=False, callbacks=[_ExitAfter(2)])
    resume(tmp_path / "killed")

    def trace(name):  # without the wall seconds
        return [line.rsplit(",", 1)[0] for line in (tmp_path / name / "trace.csv").read_text().splitlines()]

    assert len(trace("full")) == 7 and trace("killed") == trace("full")


class _KillAtCheckpoint(Callback):
    """Ends the process's run as soon as the checkpoint after round ``n`` (1-based) is on disk, before any later
    callback hears of it: the window of a SIGKILL between the checkpoint's rename and the next write."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_checkpoint(self, run, next_round):
        if next_round == self.n:
            raise SystemExit(1)


def test_a_kill_right_after_a_checkpoint_leaves_the_round_trace_up_to_it(toy_config, tmp_path):
    # the trace was written only when the checkpoint was announced: a kill in between left it at the checkpoint
    # before (rounds 1-2 of a run checkpointed at 4), and the resumed run's trace lacked rounds 3 and 4
    toy_config.update(rounds=6)
    toy_config["output"]["checkpoint_every"] = 2
    fedweave.run(load(toy_config), run_dir=tmp_path / "full", progress=False, callbacks=[RoundTrace(["train_loss"])])
    with pytest.raises(SystemExit):
        killer = [_KillAtCheckpoint(4), RoundTrace(["train_loss"])]
        fedweave.run(load(toy_config), run_dir=tmp_path / "killed", progress=False, callbacks=killer)
    resume(tmp_path / "killed", callbacks=[RoundTrace(["train_loss"])])

    def trace(name):  # without the wall seconds
        return [line.rsplit(",", 1)[0] for line in (tmp_path / name / "trace.csv").read_text().splitlines()]

    assert len(trace("full")) == 7 and trace("killed") == trace("full")


def test_a_resumed_run_measures_an_explosion_against_the_same_first_loss(toy_config, tmp_path):
    """The explosion check compares a loss with its first positive value: a run killed and resumed compares with
    the same one. Before, a resumed run took it from the recorded rows, so with ``eval.every: 3`` round 3's
    training loss replaced round 1's, and a run that completes uninterrupted stopped as diverged once resumed."""
    toy_config.update(rounds=8, eval={"every": 1, "explode_factor": None})
    plain = fedweave.run(toy_config, run_dir=tmp_path / "plain").metrics
    train, test = [r["train_loss"] for r in plain], [r["test_loss"] for r in plain]
    factor = (1 + max(train[3:]) / train[2]) / 2  # above round 3's training loss by less than a later one's rise
    assert factor > 1 and max(train[3:]) <= factor * train[0] and max(test[3:]) <= factor * test[2]
    toy_config.update(eval={"every": 3, "explode_factor": factor})
    toy_config["output"]["checkpoint_every"] = 3
    full = fedweave.run(toy_config, run_dir=tmp_path / "full")
    assert full.summary["status"] == "completed"
    with pytest.raises(SystemExit):
        fedweave.run(toy_config, run_dir=tmp_path / "killed", callbacks=[_ExitAfter(4)])  # round 3 checkpointed
    again = resume(tmp_path / "killed", on_divergence="return")
    assert again.summary["status"] == "completed", again.summary["error"]

    def numbers(rows):
        return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]

    assert numbers(again.metrics) == numbers(full.metrics)


def test_an_interrupt_between_the_metrics_files_leaves_them_and_the_summary_one_row_apart_no_more(cfg, tmp_path):
    """A SIGTERM or Ctrl-C landing after metrics.csv and before metrics.jsonl was written left summary.json at round
    126, metrics.csv at 126 and metrics.jsonl at 125: the signal now waits until both files hold the row."""
    import signal

    from fedweave import results
    from fedweave.errors import RunInterrupted

    write, calls = results.atomic_write, []

    def interrupted_between(path, data):
        write(path, data)
        calls.append(path.name)
        if path.name == "metrics.csv" and calls.count("metrics.csv") == 2:  # the second row, between the two files
            signal.raise_signal(signal.SIGINT)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(results, "atomic_write", interrupted_between)
    try:
        with pytest.raises(RunInterrupted):
            fedweave.run(cfg, run_dir=tmp_path / "i")
    finally:
        monkeypatch.undo()
    summary = json.loads((tmp_path / "i" / "summary.json").read_text())
    csv_rounds = [int(line.split(",")[0]) for line in (tmp_path / "i" / "metrics.csv").read_text().splitlines()[1:]]
    assert [r["round"] for r in read_metrics(tmp_path / "i")] == csv_rounds == [0, 3]
    assert summary["status"] == "interrupted" and summary["final"]["round"] == 3
