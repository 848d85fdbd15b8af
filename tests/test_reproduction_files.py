"""The committed result tables of docs/reproductions/ are what the reproductions' report code makes of the
committed records, byte for byte (the run directories themselves are not committed)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

PAGES = Path(__file__).parents[1] / "docs" / "reproductions"
TABLE_FILES = {
    "table1.csv": "1",
    "table2.csv": "2",
    "table3.csv": "3",
    "tau.csv": "tau",
    "dp.csv": "dp",
    "fig5.csv": "fig5",
    "dpx.csv": "dpx",
    "fig5b.csv": "fig5b",
}


def _typed(v: str):
    if v == "":
        return None
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return v


def _rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [{k: _typed(v) for k, v in r.items()} for r in csv.DictReader(f)]


@pytest.mark.parametrize("sub", ["afind", "afind/table3-dp", "afind/fig5", "afind/dp-exchange", "afind/fig5b"])
def test_afind_results_are_rebuilt_from_results_json(sub, tmp_path):
    from fedweave.reproduce import afind_plus as af

    d = PAGES / sub
    head = (d / "results.md").read_text(encoding="utf-8").splitlines()
    scale = re.match(r"# AFIND\+ reproduction \((\w+) scale", head[0]).group(1)
    n_runs, seeds, wall = re.match(r"(\d+) runs, (\d+) seed\(s\), (\d+) s wall", head[2]).groups()
    p = af.preset(scale)
    _, rows = af.plan(p, int(seeds), {t for f, t in TABLE_FILES.items() if (d / f).is_file()})
    records = json.loads((d / "results.json").read_text(encoding="utf-8"))
    af.write_results(tmp_path, records, rows, p, scale, int(n_runs), int(seeds), float(wall))
    for f in [*TABLE_FILES, "results.md", "results.json", "selection_simulation.csv"]:
        if (d / f).is_file():
            assert (tmp_path / f).read_text(encoding="utf-8") == (d / f).read_text(encoding="utf-8"), f


@pytest.mark.parametrize("sub, scale", [("zo-hfl", "small"), ("zo-hfl/adult", "adult"), ("zo-hfl/long", "long")])
def test_zo_hfl_report_is_rebuilt_from_its_records(sub, scale, tmp_path):
    """table.md, table.csv and claims.json from the committed per-seed records, Table I's cells and the meta."""
    from fedweave.reproduce import zo_hfl

    zo_hfl.rebuild(PAGES / sub, scale).write(tmp_path, show=False)
    for f in ("table.md", "table.csv", "claims.json"):
        assert (tmp_path / f).read_text(encoding="utf-8") == (PAGES / sub / f).read_text(encoding="utf-8"), f


def test_cfl_saga_small_report_is_rebuilt_from_the_summary():
    """The small preset commits its medians (summary.csv) and its commands (summary.md), no per-seed records:
    its summary.md and claims.csv are what the report makes of them (its claims untestable by their rules)."""
    from fedweave.experiments.tables import csv_text, read_csv
    from fedweave.reproduce import cfl_saga

    committed = PAGES / "cfl-saga"
    summary = (committed / "summary.md").read_text(encoding="utf-8")
    commands = cfl_saga.COMMANDS.findall(summary)  # each command, its wall time and its note of reused runs
    runs = [{"argv": c.split()[3:], "wall_seconds": 60 * float(t), "reused": r} for c, t, r in commands]
    meta = {"scale": "small", "seeds": [0, 1, 2], "runs": runs}
    aggs = read_csv(committed / "summary.csv")
    assert cfl_saga.summary_md(aggs, None, meta) == summary
    claims = csv_text(cfl_saga.claims(aggs, None), cfl_saga.CLAIM_COLUMNS)
    assert claims == (committed / "claims.csv").read_text(encoding="utf-8")
    assert claims.count("untestable by a declared rule: no per-seed records") == len(claims.splitlines()) - 1


def test_cfl_saga_report_only_rebuilds_the_committed_paper_report_from_raw_json(tmp_path):
    """``--report-only`` on a copy of the committed raw.json and meta.json (no curves.npz: no figures)."""
    import shutil

    from fedweave.reproduce import cfl_saga

    committed = PAGES / "cfl-saga" / "paper"
    for f in ("raw.json", "meta.json"):
        shutil.copy(committed / f, tmp_path / f)
    assert cfl_saga.main(["--scale", "paper", "--out", str(tmp_path), "--report-only"]) == 0
    for f in ("claims.csv", "summary.csv", "summary.md"):
        assert (tmp_path / f).read_text(encoding="utf-8") == (committed / f).read_text(encoding="utf-8"), f


@pytest.mark.parametrize("name", ["", "long", "ablation", "epochs", "participation"])
def test_fedmim_reports_are_rebuilt_from_their_records(name, tmp_path):
    """Every text file of a committed FedMIM report is what ``report_files`` makes of its committed records: the
    per-seed results.csv, the per-cell table.csv / NAME.csv (their mean accuracy over the rounds needs the runs'
    metrics, not committed) and the long preset's gaps.csv; the wall time is the committed report's."""
    from fedweave.experiments.study import Report
    from fedweave.experiments.tables import read_csv
    from fedweave.reproduce import fedmim

    d, p = PAGES / "fedmim" / name, fedmim.PRESETS[name or "small"]
    report, cells = (f"{name}.md", f"{name}.csv") if p.variants else ("table.md", "table.csv")
    wall = 60 * float(re.search(r"Wall time ([\d.]+) min", (d / report).read_text(encoding="utf-8"))[1])
    rows = [{**r, "paper_c10": ""} if r.get("paper_c10", 0) is None else r for r in read_csv(d / cells)]
    gaps = read_csv(d / "gaps.csv") if p.report_rounds else None
    files = fedmim.report_files(read_csv(d / "results.csv"), rows, name or "small", p, wall, (), gaps)
    Report(files).write(tmp_path, show=False)
    assert sorted(files) == sorted(f.name for f in d.iterdir() if f.is_file() and f.suffix != ".png")
    for f in files:
        assert (tmp_path / f).read_text(encoding="utf-8") == (d / f).read_text(encoding="utf-8"), f
