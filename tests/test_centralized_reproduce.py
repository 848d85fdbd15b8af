"""``fedweave reproduce fedmim`` end to end on a tiny test fixture (not real data), and its table logic."""

from __future__ import annotations

import csv
import re

import pytest

from fedweave.config import ConfigError
from fedweave.experiments.jobs import run_points
from fedweave.experiments.study import Report
from fedweave.registry import DATASETS
from fedweave.reproduce import fedmim as repro
from tests.conftest import make_toy


def _toy_repro(max_train: int | None = None, max_test: int | None = None):
    """Test fixture standing in for MNIST (synthetic, 4 classes)."""
    return make_toy(n_train=max_train or 480, n_test=max_test or 120, seed=9)


if "_toy_repro" not in DATASETS._items:
    DATASETS.register("_toy_repro")(_toy_repro)


def test_smoke_preset_writes_table_csv_and_plots(tmp_path):
    out = tmp_path / "rep"
    assert repro.main(["--scale", "smoke", "--out", str(out), "--workers", "1", "--datasets", "_toy_repro"]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {(r["split"], r["method"]) for r in rows} == {
        (s, m) for s in ("dir0.1", "iid") for m in ("fedavg", "fedmim")
    }
    md = (out / "table.md").read_text()
    assert "| FedMIM |" in md and "86.39" in md  # the paper's CIFAR-10 IID number sits beside ours
    assert (out / "curves-_toy_repro.png").stat().st_size > 1000
    # a second call reuses the finished runs, even with no time budget left; a new seed is skipped
    before = (out / "runs" / "_toy_repro-iid-fedavg-s0" / "summary.json").stat().st_mtime
    argv = ["--scale", "smoke", "--out", str(out), "--workers", "1", "--datasets", "_toy_repro"]
    repro.main([*argv, "--budget-minutes", "0", "--seeds", "2"])
    assert (out / "runs" / "_toy_repro-iid-fedavg-s0" / "summary.json").stat().st_mtime == before
    md = (out / "table.md").read_text()
    assert "Not run (time budget reached): _toy_repro-dir0.1-fedavg-1" in md
    assert len(list(csv.DictReader((out / "results.csv").open()))) == 4


def _rec(split, method, seed, acc, cons):
    return {
        "dataset": "d",
        "split": split,
        "method": method,
        "seed": seed,
        "final_acc": acc,
        "best_acc": acc,
        "consistency_last20": cons,
    }


def test_claims_and_ranks_follow_the_declared_rules():
    recs = [
        _rec("dir0.1", "fedavg", 0, 70.0, 1.0),
        _rec("dir0.1", "fedmim", 0, 73.0, 0.1),
        _rec("dir0.1", "fedavg", 1, 72.0, 1.0),
        _rec("dir0.1", "fedmim", 1, 71.5, 0.1),
        _rec("dir0.1", "fedavg", 2, 70.0, 1.0),
        _rec("dir0.1", "fedmim", 2, 72.0, 0.1),
        _rec("iid", "fedavg", 0, 80.0, 1.0),
        _rec("iid", "fedmim", 0, 80.5, 0.8),
    ]
    table, verdicts = repro.summarize(recs)
    # one IID seed: the IID claim has no pairs, and says so (before: left out without a word)
    accuracy, consistency, iid = verdicts
    assert iid.outcome == "untestable" and iid.measured == "fewer than 2 seeds finished every run it compares"
    # +1.50 on average, ahead on 2 of 3 seeds, but the seeds' 95 % interval includes the +1.0 bound
    assert accuracy.measured == "FedMIM - FedAvg +1.50 points, ahead on 2/3 seeds"
    assert accuracy.outcome == "inconclusive" and accuracy.interval.startswith("+1.50 points [-2.98, 5.98]")
    assert consistency.outcome == "held" and consistency.measured == "FedMIM / FedAvg 0.100"
    cell = next(t for t in table if (t["split"], t["method"]) == ("dir0.1", "fedmim"))
    assert cell["rank"] == 1 and cell["paper_rank"] == 1 and cell["paper_cifar10"] == 80.82
    assert cell["final_acc_std"] == pytest.approx(0.7637626, rel=1e-6)


def test_a_claim_whose_seeds_diverged_is_untestable_not_dropped():
    """Two of three FedAvg IID runs diverged (NaN final accuracy): the IID claim has one pair left. It is shown as
    untestable, as the declared rule's own n < 2 says; it was left out of the claims without a word. A claim on
    cells the preset did not run at all stays out."""
    nan = float("nan")
    recs = [
        _rec(split, method, seed, nan if (split, method) == ("iid", "fedavg") and seed else 70.0 + seed + 3 * (
            method == "fedmim"), 1.0 if method == "fedmim" else 3.0)
        for split in ("dir0.1", "iid") for method in repro.MAIN for seed in range(3)
    ]  # fmt: skip
    got = {v.claim.split(": ", 1)[1][:20]: v for v in repro.claim_verdicts(recs)}
    assert [v.outcome for v in got.values()] == ["held", "held", "untestable"]
    assert got["FedMIM's gain over F"].interval == (
        "untestable: 1 seed with both sides run (iid, fedavg: 2 of 3 diverged); a paired t test needs 2"
    )
    only_dir = [r for r in recs if r["split"] == "dir0.1"]  # no IID cell run: the IID claim is left out
    assert [v.outcome for v in repro.claim_verdicts(only_dir)] == ["held", "held"]


@pytest.mark.parametrize("scale", sorted(repro.PRESETS))
def test_every_preset_plans_valid_configs(scale, tmp_path):
    from fedweave.config import build_dataclass
    from fedweave.registry import ALGORITHMS

    p = repro.PRESETS[scale]
    points = repro.plan(p, tmp_path, p.seeds, None, None, extend=True)
    variants = max(1, len(p.variants))
    assert len(points) == len(p.seeds) * sum(len(g) for _, _, g in p.grid + p.extension) * variants
    assert len({pt.slug for pt in points}) == len(points)  # one directory per run
    assert dict(points[0].values)["method"] == p.grid[0][2][0]  # priority order: the first cell comes first
    for pt in points:
        c = pt.config
        c.validate()
        assert c.output.dir == str(tmp_path / "runs" / pt.slug)  # the run directories users already have
        build_dataclass(ALGORITHMS.get(c.algorithm.name).Hparams, c.algorithm.options, "algorithm")


def test_a_diverged_run_is_recorded_not_fatal(tmp_path):
    from fedweave.experiments.grid import Point
    from fedweave.experiments.jobs import run_points

    p = repro.PRESETS["smoke"]
    cfg = repro.run_config(p, "_toy_repro", "iid", "fedavg", 0, tmp_path / "run")
    cfg["local"] = {**cfg["local"], "lr": 1e12}
    cfg["dataset"] = {"name": "_toy_repro"}
    pt = Point.of(cfg, "run", dataset="_toy_repro", split="iid", method="fedavg")
    rec = repro.record(pt, run_points([pt], tmp_path, progress=False, overwrite=True)["run"])
    assert rec["status"] == "diverged" and rec["final_acc"] != rec["final_acc"]  # NaN
    table, _ = repro.summarize([rec, {**rec, "seed": 1, "final_acc": 50.0, "status": "completed"}])
    assert table[0]["diverged"] == 1 and table[0]["final_acc_mean"] == 50.0
    mtime = (tmp_path / "run" / "summary.json").stat().st_mtime_ns
    assert run_points([pt], tmp_path, progress=False, overwrite=True)["run"].summary["status"] == "diverged"
    assert (tmp_path / "run" / "summary.json").stat().st_mtime_ns == mtime  # reused from disk, not rerun


# ---- Table II / III / Fig. 2a presets (variants of one cell) -------------------------------------------
def _tiny(name: str):
    import dataclasses

    p = repro.PRESETS[name]
    return dataclasses.replace(p, rounds=2, num_clients=24, model="logistic", dataset_options={}, eval_every=1)


def test_variant_preset_applies_its_overrides_and_writes_its_table(tmp_path):
    p = _tiny("participation")
    points = repro.plan(p, tmp_path, (0,), ["_toy_repro"], ["fedavg", "fedmim"])
    assert [dict(pt.values)["variant"] for pt in points] == ["5%", "5%", "20%", "20%"]
    assert [pt.config.algorithm.options["clients_per_round"] for pt in points] == [5, 5, 20, 20]
    abl = {dict(pt.values)["variant"]: pt.config for pt in repro.plan(_tiny("ablation"), tmp_path, (0,), None, None)}
    assert abl["J=0 a=- b=-"].algorithm.options["alpha"] == [] and len(abl) == 9
    assert abl["J=1 a=0.9 b=-"].algorithm.options["beta"] == [0.0]
    ep = {
        dict(pt.values)["variant"]: pt.config.local.epochs
        for pt in repro.plan(_tiny("epochs"), tmp_path, (0,), None, None)
    }
    assert ep == {"E=1": 1, "E=5": 5, "E=10": 10}

    done = run_points(points, tmp_path / "runs", progress=False, overwrite=True)
    records = [repro.record(pt, done[pt.slug]) for pt in points]
    files = repro.report_files(records, repro.variant_summary(records, p), "participation", p, 1.0)
    figures = lambda out: repro.plot(records, p, "participation", out)  # noqa: E731
    assert Report(files, figures=figures).write(tmp_path, show=False) == 0
    assert (tmp_path / "curves-participation.png").stat().st_size > 1000
    md = (tmp_path / "participation.md").read_text()
    assert "| method | 5 % | mean over rounds | 20 % | mean over rounds | change 5 % → 20 % |" in md
    assert "| the paper's readings | `results.csv` | untestable | no claim testable" in md  # one seed: no pairs
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["variant"] for r in rows] == ["5%", "5%", "20%", "20%"]
    # finished runs are recognised: nothing is rerun
    before = (tmp_path / "runs" / "_toy_repro-dir0.1-fedavg-5-s0" / "summary.json").stat().st_mtime_ns
    assert len(run_points(points, tmp_path / "runs", progress=False, overwrite=True, budget_s=0.0)) == 4
    assert (tmp_path / "runs" / "_toy_repro-dir0.1-fedavg-5-s0" / "summary.json").stat().st_mtime_ns == before


def _verdicts(accs: dict[tuple[str, str], float], p, auc=lambda v, a: a) -> list:
    """The declared verdicts of a variant preset on three seeds per (variant, method) around the given mean
    accuracy (offsets that differ by cell, so that the paired differences vary, and sum to 0 over the seeds), each
    run's mean accuracy over the rounds ``auc(variant, accuracy)``."""
    records = []
    for i, ((v, m), a) in enumerate(accs.items()):
        for s in range(3):
            x = a + 0.05 * ((s + i) % 3 - 1)
            rows = [{"test_accuracy": auc(v, x) / 100}]
            records.append(
                {"variant": v, "method": m, "seed": s, "final_acc": x, "consistency_last20": 0.1, "_rows": rows}
            )
    return repro.variant_verdicts(repro.variant_summary(records, p), p, records)


def test_epochs_claims_read_table_ii():
    p = repro.PRESETS["epochs"]
    accs = {("E=1", "fedavg"): 80, ("E=5", "fedavg"): 78, ("E=10", "fedavg"): 77}
    accs |= {("E=1", "fedmim"): 81, ("E=5", "fedmim"): 79, ("E=10", "fedmim"): 79.5}
    best, falls = _verdicts(accs, p)
    assert best.outcome == "held" and falls.outcome == "did not hold"  # FedMIM rises from E = 5 to 10
    assert "FedMIM 81.00 / 79.00 / 79.50 (not falling)" in falls.measured
    checks = _verdicts({k: a for k, a in accs.items() if k != ("E=10", "fedmim")}, p)  # FedMIM at E = 10 missing
    assert [v.held for v in checks] == [None]


def test_ablation_claims_read_table_iii():
    p = repro.PRESETS["ablation"]
    labels = [v for v, _ in p.variants]
    paper = {(v, "fedmim"): acc for v, (_, _, acc) in zip(labels, repro.TABLE_III)}
    assert [v.outcome for v in _verdicts(paper, p)] == ["held"] * 5  # the paper's own numbers pass every reading
    swapped = {**paper, (labels[0], "fedmim"): 86.0}  # FedAvg (J = 0) best
    outcomes = [v.outcome for v in _verdicts(swapped, p)]
    assert outcomes == ["did not hold", "held", "did not hold", "held", "held"]


def test_participation_claims_read_fig_2a():
    p = repro.PRESETS["participation"]
    acc = {"fedavg": (70, 74), "fedadam": (60, 75), "scaffold": (71, 78), "fedcm": (65, 72), "feddyn": (66, 76),
           "fedmim": (72, 73)}  # fmt: skip
    accs = {(v, m): a[i] for i, v in enumerate(("5%", "20%")) for m, a in acc.items()}
    slow, sensitive, scaffold, stable = _verdicts(accs, p, auc=lambda v, a: a - 5 if v == "5%" else a)
    assert slow.outcome == "untestable" and slow.measured.startswith("5%: lowest FedAdam 55.00")  # not FedAvg
    assert sensitive.outcome == scaffold.outcome == stable.outcome == "held"


SMALL_SETTING = "(fedweave reproduce fedmim's small setting)"


def _options(algorithm: dict):
    """An algorithm section as its hyper-parameters, defaults filled in (``server_opt: adam`` is the default);
    the consistency metric is only logged, so it is left out."""
    from fedweave.config import build_dataclass
    from fedweave.registry import ALGORITHMS

    opts = {k: v for k, v in algorithm.items() if k not in ("name", "consistency")}
    return algorithm["name"], build_dataclass(ALGORITHMS.get(algorithm["name"]).Hparams, opts, "algorithm")


def test_example_configs_that_name_the_small_setting_are_it(tmp_path):
    """An example config whose comment says it is the small preset's setting trains as that preset's
    Dir-0.1 Fashion-MNIST run of seed 0 does (data, split, model, local step, rounds, evaluation and, for the
    preset's methods, the algorithm's options), so running it gives that run's committed numbers."""
    from importlib.resources import files

    from fedweave.config import read_yaml_file

    folder = files("fedweave") / "configs" / "centralized"
    named = [f for f in folder.iterdir() if f.name.endswith(".yaml") and SMALL_SETTING in f.read_text()]
    assert len(named) >= 7
    for f in named:
        cfg = read_yaml_file(str(f))
        method = cfg["algorithm"]["name"]
        of = method if method in repro.METHODS else "fedavg"  # FedProx, not in the preset: its setting only
        ref = repro.run_config(repro.PRESETS["small"], "fashion_mnist", "dir0.1", of, 0, tmp_path, "")
        for key in ("seed", "rounds", "backend", "threads", "dataset", "partition", "model", "local", "eval"):
            assert cfg.get(key) == ref[key], (f.name, key)
        if method in repro.METHODS:
            assert _options(cfg["algorithm"]) == _options(ref["algorithm"]), f.name


def test_a_budget_that_lets_no_run_finish_says_no_claim_is_testable(tmp_path):
    """With no run finished (``--budget-minutes 0`` on a new folder) claims.json was ``[]`` and the claims table a
    header without rows, where too few seeds give an untestable row."""
    import json

    assert repro.main(["--scale", "smoke", "--out", str(tmp_path), "--workers", "1", "--budget-minutes", "0"]) == 0
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert claims == [{"claim": "spec §9.2", "verdict": "untestable", "measured": "no claim testable: no run finished"}]


def test_the_iid_claim_is_left_out_when_the_iid_control_did_not_run_beside_a_diverged_run():
    """A Dir-0.1 run that diverged and no IID run (a time budget, or ``--datasets``/``--methods`` leaving it
    out) ended FedMIM's report with ``ConfigError: verdict rule final_acc: final_acc at seed 0 is nan``."""
    from fedweave.reproduce import fedmim as fm

    def run(method: str, seed: int, acc: float) -> dict:
        return {"dataset": "d", "split": "dir0.1", "method": method, "seed": seed, "final_acc": acc}

    recs = [run("fedavg", 0, float("nan")), run("fedavg", 1, 50.0), run("fedmim", 0, 55.0), run("fedmim", 1, 56.0)]
    recs = [{**r, "consistency_last20": 0.5} for r in recs]
    assert fm.TABLE_I_CLAIMS["claim_iid_smaller"].verdict(recs, "d") is None
    assert fm.TABLE_I_CLAIMS["claim_accuracy"].verdict(recs, "d").outcome == "untestable"


def _variant_records(table: str, diverged_seeds: tuple[int, ...]) -> tuple[list[dict], object]:
    """A variant preset's records as ``record`` writes them, FedMIM's first variant diverged on ``diverged_seeds``
    (after 4 evaluations)."""
    import random
    from pathlib import Path

    from fedweave.runner import Result

    p, rng, records = repro.PRESETS[table], random.Random(0), []
    for pt in repro.plan(p, Path("unused"), (0, 1, 2), None, None):
        rows = [{"round": r, "test_accuracy": 0.6 + r / 200 + rng.uniform(0, 0.05)} for r in range(5, 55, 5)]
        v, status = dict(pt.values), "completed"
        if v["variant"] == p.variants[0][0] and v["method"] == "fedmim" and pt.seed in diverged_seeds:
            rows, status = rows[:4], "diverged"
        summary = {"status": status, "wall_seconds": 1.0, "cpu_seconds": 1.0}
        records.append(repro.record(pt, Result(Path("unused"), rows, summary)))
    return records, p


@pytest.mark.parametrize("table", ["ablation", "epochs", "participation"])
def test_a_variant_cell_whose_every_run_diverged_is_named_not_printed_as_nan(table):
    """Every run of one cell diverged: the tables printed ``nan ± nan`` and ``nan`` per seed and over the rounds,
    and the readings said ``not every cell ran`` although every cell ran."""
    records, p = _variant_records(table, (0, 1, 2))
    md = repro.report_files(records, repro.variant_summary(records, p), table, p, 1.0)[f"{table}.md"]
    assert "nan" not in md and "diverged (3/3)" in md
    assert "not every cell ran" not in md and f"every run of {p.variants[0][0]} FedMIM diverged (see the table)" in md
    one, _ = _variant_records(table, (1,))
    rows = repro.variant_summary(one, p)
    assert next(r for r in rows if r["method"] == "fedmim")["final_acc_per_seed"].split(" / ")[1] == "diverged"


def test_a_table_i_cell_whose_every_run_diverged_shows_no_mean_and_no_consistency():
    """Table I printed ``nan ± nan (3/3 diverged)`` beside a consistency averaged over the diverged runs."""
    nan = float("nan")
    records = [
        {"dataset": "d", "split": split, "method": m, "seed": s, "final_acc": nan if m == "fedavg" else 60.0 + s,
         "best_acc": 61.0, "consistency_last20": 0.5}
        for split in ("dir0.1", "iid") for m in ("fedavg", "fedmim") for s in range(3)
    ]  # fmt: skip
    table, _ = repro.summarize(records)
    line = next(x for x in repro.table_i(table, "d", repro.MAIN).splitlines() if x.startswith("| FedAvg"))
    assert "nan" not in line and line.count("diverged (3/3)") == 2 and "0.5" not in line


def test_a_rerun_that_reuses_its_runs_says_so_beside_its_wall_time(tmp_path):
    """A second identical invocation reused every run and wrote ``Wall time 0.0 min`` as if that were the preset's
    runtime, which the page's prose then read; it now says how many runs it reused, and the page's line says it."""
    out = tmp_path / "o"
    argv = ["--scale", "smoke", "--out", str(out), "--workers", "1"]
    assert repro.main(argv) == 0
    first = (out / "table.md").read_text(encoding="utf-8")
    assert "reused" not in first
    assert repro.main(argv) == 0
    again = (out / "table.md").read_text(encoding="utf-8")
    runs = len(list((out / "runs").glob("*/summary.json")))
    note = f" ({runs} of {runs} runs reused from an earlier invocation, not in this time)"
    assert f" min{note}" in again
    results = [{"dataset": "mnist", "cpu_seconds": 10.0}]
    line = repro._small_cost(out, results).splitlines()[0]
    assert re.fullmatch(r"Runtime: [\d.]+ min wall \(`table.md`\)" + re.escape(note) + " on the 2-core .*", line)


def test_extend_on_a_preset_without_lower_priority_cells_is_one_line(tmp_path):
    """``--extend`` on a preset with no extension (smoke, ablation, long, paper) was ignored without a word."""
    with pytest.raises(
        ConfigError, match=r"^--extend: preset 'smoke' has no lower-priority cells; presets with some: "
    ):
        repro.main(["--scale", "smoke", "--extend", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_the_pages_per_seed_line_names_a_diverged_run():
    """The page's per-seed line printed ``72.56 → nan`` for a FedMIM run that diverged."""
    nan = float("nan")
    rows = [
        {"dataset": "fashion_mnist", "split": "dir0.1", "method": m, "seed": s,
         "final_acc": nan if (m, s) == ("fedmim", 1) else 70.0 + s, "best_acc": 71.0 + s}
        for m in ("fedavg", "fedmim") for s in range(3)
    ]  # fmt: skip
    line = repro._page_per_seed(rows).splitlines()[0]
    assert line.endswith("(final accuracy, FedAvg → FedMIM): 70.00 → 70.00, 71.00 → diverged, 72.00 → 72.00.")
