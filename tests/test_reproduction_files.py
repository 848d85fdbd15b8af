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
def test_zo_hfl_table_is_rebuilt_from_its_rows_and_claims(sub, scale, tmp_path):
    from fedweave.reproduce import zo_hfl

    rows = _rows(PAGES / sub / "table.csv")
    for r in rows:
        r["paper_acc"] = "" if r["paper_acc"] is None else r["paper_acc"]
    saved = json.loads((PAGES / sub / "claims.json").read_text(encoding="utf-8"))
    zo_hfl.write_table(zo_hfl.PRESETS[scale], rows, saved["claims"], tmp_path, saved["meta"])
    for f in ("table.md", "table.csv"):
        assert (tmp_path / f).read_text(encoding="utf-8") == (PAGES / sub / f).read_text(encoding="utf-8"), f


def test_cfl_saga_claims_are_rebuilt_from_the_summary(tmp_path):
    from fedweave.experiments.tables import write_csv
    from fedweave.reproduce import cfl_saga

    aggs = _rows(PAGES / "cfl-saga" / "summary.csv")
    for a in aggs:  # an IQR cell is text even where it looks like a number
        a.update({k: "" if v is None else str(v) for k, v in a.items() if k.endswith("_iqr")})
    write_csv(tmp_path / "claims.csv", cfl_saga.claims(aggs), ["claim", "paper", "measured", "verdict"])
    summary = (PAGES / "cfl-saga" / "summary.md").read_text(encoding="utf-8")
    assert (tmp_path / "claims.csv").read_text() == (PAGES / "cfl-saga" / "claims.csv").read_text(encoding="utf-8")
    for problem in {a["problem"] for a in aggs}:
        assert cfl_saga.table_md(aggs, problem) in summary, problem


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
