"""Smoke test of ``fedweave reproduce cse-fsl`` on SYNTHETIC data (pipeline and exact accounting only)."""

from __future__ import annotations

import csv

import torch

from fedweave.data.base import Dataset
from fedweave.registry import DATASETS
from fedweave.reproduce.cse_fsl import main, preset

if "_toy_split_tiny" not in DATASETS._items:

    @DATASETS.register("_toy_split_tiny")
    def _toy_split_tiny() -> Dataset:
        """Synthetic 1×8×8 class-mean images, 150 train / 50 test (for counting only)."""
        g = torch.Generator().manual_seed(1)
        mu = torch.randn(10, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (200,), generator=g)
        x = mu[y] + 0.5 * torch.randn(200, 1, 8, 8, generator=g)
        return Dataset("_toy_split_tiny", x[:150], y[:150], x[150:], y[150:], 10, (1, 8, 8))


def test_presets():
    small = preset("small", "fashion_mnist")
    assert small.seeds == 3 and small.clients == 5 and len(small.hs) >= 3
    digits = preset("small", "digits")
    assert digits.hs == [1, 2, 4, 7, 14] and digits.batch_size == 10 and digits.rounds == 30
    paper = preset("paper", "cifar10")
    assert (paper.batch_size, paper.lr, paper.rounds, paper.hs) == (50, 0.15, 200, [5, 10, 25, 50])


def test_smoke_writes_table_and_plots(tmp_path):
    torch.set_num_threads(1)
    rc = main(["--scale", "smoke", "--dataset", "_toy_split_tiny", "--workers", "1", "--out", str(tmp_path)])
    assert rc == 0  # 0 means every method's measured load equals the closed form
    for name in ("table.md", "table.csv", "fig9_accuracy_vs_load.png", "accuracy_vs_rounds.png",
                 "accuracy_vs_uploads.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name
    rows = {r["method"]: r for r in csv.DictReader((tmp_path / "table.csv").open())}
    assert set(rows) == {"fsl_mc", "fsl_oc", "fsl_an", "cse_fsl h=1", "cse_fsl h=4", "cse_fsl h=4 random"}
    assert all(r["load_exact"] == "True" for r in rows.values())
    assert [rows[m]["server_copies"] for m in ("fsl_mc", "fsl_an", "fsl_oc", "cse_fsl h=4")] == ["5", "5", "1", "1"]
    assert float(rows["cse_fsl h=1"]["load_gib"]) == float(rows["fsl_an"]["load_gib"])
    assert "Claims" in (tmp_path / "table.md").read_text()


def test_noniid_preset_deals_label_shards_and_checks_table_v_noniid_column(tmp_path):
    from fedweave.experiments.study import judge
    from fedweave.reproduce.cse_fsl import CLAIMS, jobs

    p = preset("noniid", "fashion_mnist")
    small = preset("small", "fashion_mnist")
    assert (p.rounds, p.hs, p.seeds, p.batch_size) == (small.rounds, small.hs, small.seeds, small.batch_size)
    parts = {pt.config.partition.name for pt in jobs(p, [0], tmp_path)}
    assert parts == {"shards"} and p.noniid and not small.noniid

    def verdicts(cse5: float, preset_) -> dict:
        """The declared verdicts on per-seed accuracies spread by seed (C8's and C9's paired tests)."""
        base = {"load_exact": True, "load_to_target_gib": 1.0, "storage_m": 1.0, "server_copies": 1}
        accs = {"fsl_mc": 60.0, "fsl_an": 55.0, "fsl_oc": 50.0, "cse_fsl h=1": 52.0, "cse_fsl h=5": cse5}
        accs["cse_fsl h=5 random"] = cse5
        preset_.records = [{"method": m, "seed": s, "accuracy": a + s * (1 + (m == "fsl_mc") / 10)}
                           for m, a in accs.items() for s in range(3)]  # fmt: skip
        table = [{**base, "method": m, "accuracy": a} for m, a in accs.items()]
        return {v.claim[:2]: v for v in judge(CLAIMS, table, preset_)}

    got = verdicts(42.0, p)  # 18 pp below FSL_MC on every seed, and the order MC > AN > OC > CSE on every seed
    assert got["C8"].outcome == "held" and got["C8"].interval.startswith("-18.10 pp [") and got["C9"].outcome == "held"
    got = verdicts(58.0, p)
    assert got["C8"].outcome == "did not hold" and got["C9"].outcome == "did not hold"
    assert "C8" not in verdicts(42.0, small) and "C9" not in verdicts(42.0, small)  # IID: no non-IID claims


def test_c1_checks_the_load_of_every_round_not_only_the_total(monkeypatch):
    """C1 claims the measured bytes equal the closed form at every round: a run whose total is the closed form's
    but whose first round is not is off (before: only the last row was compared)."""
    from fedweave.reproduce import cse_fsl

    monkeypatch.setattr(cse_fsl, "round_bytes", lambda *a, **k: {"load": 10})
    monkeypatch.setattr(cse_fsl, "storage_params", lambda *a, **k: 1)

    def run(loads: list[int]) -> dict:
        rows = [{"round": i + 1, "load_bytes": b, "test_accuracy": 0.5, "storage_params": 1, "server_copies": 1,
                 "smashed_uploads_per_client": 1.0} for i, b in enumerate(loads)]  # fmt: skip
        return {"key": "fsl_mc", "method": "fsl_mc", "h": 1, "sizes": None, "samples": [1], "status": "completed",
                "rows": rows}  # fmt: skip

    p = preset("smoke", "fashion_mnist")
    assert cse_fsl.summarize([run([10, 20, 30])], p)[0]["load_exact"]
    [row] = cse_fsl.summarize([run([5, 25, 30])], p)  # the right total, the wrong rounds
    assert not row["load_exact"] and row["load_formula_gib"] * cse_fsl.GIB == 30


def test_a_time_budget_that_leaves_runs_unrun_is_one_line_not_a_traceback():
    """``--budget-minutes`` that leaves FSL_MC unrun (or every run, at 0): Table V's load ratios need it, so the
    report is one line naming the runs not started (before: StopIteration in summarize)."""
    from types import SimpleNamespace

    import pytest

    from fedweave.config import ConfigError
    from fedweave.experiments.study import Plan
    from fedweave.reproduce import cse_fsl

    p = preset("smoke", "fashion_mnist")
    plan = Plan([], context=(p, [0], {}), skipped=[SimpleNamespace(values={"key": "fsl_mc"}, seed=0)])
    with pytest.raises(ConfigError, match=r"Table V needs every run; Not run \(time budget reached\): fsl_mc-0"):
        cse_fsl.report([], plan, SimpleNamespace(scale="smoke"), 0.0)
