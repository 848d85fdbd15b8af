"""`fedweave sweep`'s bad input found before any run starts: a --metric its config's task never logs."""

from __future__ import annotations

import pytest
import yaml

from fedweave.cli import main as cli_main

DIGITS_RUN = {  # scikit-learn's digits (nothing to download), a fraction of a second a round
    "name": "base", "rounds": 1, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.05}, "output": {"progress": False, "plots": False},
}  # fmt: skip


@pytest.mark.parametrize("metric", ["test_acc", "test_mse", "accuracy"])
def test_a_metric_the_task_does_not_log_is_refused_before_any_run(metric, tmp_path, capsys):
    """``--metric test_acc`` was refused only once every run had run (and left them); a test column of a metric
    the config's task does not evaluate, or a bare metric name, is now one line before anything is written."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(DIGITS_RUN))
    out = tmp_path / "s"
    args = ["sweep", str(cfg), "--grid", "local.lr=0.05,0.1", "--out", str(out), "--no-progress"]
    assert cli_main([*args, "--metric", metric]) == 2
    err = capsys.readouterr().err.strip()
    want = (
        f"fedweave: error: --metric {metric!r} is not a column the config's task logs (task.metrics: accuracy); "
        "choose one of test_accuracy, test_loss, or another column of the runs (train_loss, bytes_total, ...)"
    )
    assert err == want
    assert not out.exists()


def test_a_metric_the_task_logs_or_an_algorithm_column_is_not_refused_up_front(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(DIGITS_RUN))
    for k, metric in enumerate(("test_loss", "train_loss")):
        out = tmp_path / f"s{k}"
        args = ["sweep", str(cfg), "--grid", "local.lr=0.05", "--out", str(out), "--no-progress", "--metric", metric]
        assert cli_main(args) == 0
        assert (out / "summary.csv").is_file()


def test_a_confederated_sweeps_metric_is_checked_against_its_runs_columns(tmp_path, capsys):
    """A confederated run logs no test column (its rows are opt_gap's): the up-front check advised test_accuracy,
    which then ran every point to be refused after; such a family's --metric is checked against its runs."""
    from pathlib import Path

    cfg = Path(__file__).resolve().parents[1] / "configs" / "confederated" / "cfl_saga.yaml"
    args = ["sweep", str(cfg), "--grid", "algorithm.rho=10", "rounds=1", "--out", str(tmp_path / "s"), "--no-progress"]
    assert cli_main([*args, "--metric", "test_acc"]) == 2
    err = capsys.readouterr().err
    assert "test_accuracy" not in err and "opt_gap" in err, err
