"""The reproductions from partial folders and options: CFL-SAGA's page from a folder that lacks a part or whose
cells missed the target, CSE-FSL's claims judged without per-seed records."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from fedweave.config import ConfigError
from fedweave.experiments.study import judge
from fedweave.experiments.tables import read_csv
from fedweave.reproduce import cfl_saga, cse_fsl

PAGES = Path(__file__).resolve().parents[1] / "docs" / "reproductions"


def _cfl_folder(tmp_path: Path) -> Path:
    """A copy of the committed CFL-SAGA records beside its page (small preset, paper/), without the figures."""
    return Path(shutil.copytree(PAGES / "cfl-saga", tmp_path / "cfl-saga", ignore=shutil.ignore_patterns("*.png")))


def _edit_csv(path: Path, edit) -> None:
    """Rewrite the CSV ``path`` with ``edit(row)`` on each row (None drops it), its columns as they were."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns, rows = reader.fieldnames, [got for r in reader if (got := edit(r)) is not None]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def _without(folder: Path, case: str) -> None:
    """``folder`` as an invocation that left out one part would have written it."""
    if case == "alpha":  # the small preset without its --part alpha
        _edit_csv(folder / "summary.csv", lambda r: None if r["problem"] == cfl_saga.ALPHA else r)
    elif case == "real":  # the small preset run with --part synthetic only
        _edit_csv(folder / "summary.csv", lambda r: r if r["problem"].startswith("synthetic") else None)
    elif case == "ring":  # the paper scale's ring runs not run (a time budget)
        _edit_csv(folder / "paper" / "summary.csv", lambda r: None if r["topology"] == "ring" else r)
        raw = json.loads((folder / "paper" / "raw.json").read_text(encoding="utf-8"))
        (folder / "paper" / "raw.json").write_text(json.dumps([r for r in raw if r["topology"] != "ring"]))
    else:  # no paper scale at all
        shutil.rmtree(folder / "paper")


@pytest.mark.parametrize(
    ("case", "sub", "command"),
    [
        ("alpha", "", "--scale small --part alpha"),
        ("real", "", "--scale small --part real"),
        ("ring", "paper", "--scale paper --part synthetic"),
        ("paper", "paper", "--scale paper --part synthetic"),
    ],
)
def test_cfl_saga_page_from_a_folder_without_a_part_is_one_line_naming_it_and_its_command(tmp_path, case, sub, command):
    """The page's sections from a folder a partial invocation wrote are one line naming the missing part and the
    command that runs it into that folder (before: a TypeError in alpha_ratios, a KeyError, or, without the real
    data sets, an empty block on the page)."""
    folder = _cfl_folder(tmp_path)
    _without(folder, case)
    with pytest.raises(ConfigError) as got:
        cfl_saga.sections(folder)
    msg = str(got.value)
    assert "\n" not in msg and msg.startswith(f"{folder / sub}: the page's sections read the ")
    assert f"`fedweave reproduce cfl-saga {command} --out {folder / sub}`" in msg


def test_cfl_saga_page_from_cells_that_missed_the_target_renders_them_as_not_reached(tmp_path):
    """A folder with every part whose cells missed 1e-8 (the step-size grid's CFL-SAGA, the pilot's ring rho=1e4)
    or have no finished run (no time per iteration) renders those cells as not reached (before: TypeError in
    alpha_section's _it_up, alpha_ratios, pilot_section and runs_section, StatisticsError in runtime_section)."""
    folder, blank = _cfl_folder(tmp_path), dict.fromkeys((cfl_saga.IT, cfl_saga.DEEP), "")
    times = dict.fromkeys((cfl_saga.CPU, "ms_per_iteration_wall"), "")

    def small(r):
        if r["method"].startswith("CFL-SAGA") and r["problem"] == cfl_saga.ALPHA:
            return {**r, **blank}
        if (r["problem"], r["topology"], r["method"]) == ("synthetic", "ring", "CFL-SAGA rho=10000"):
            return {**r, **blank}
        return {**r, **times} if (r["topology"], r["method"]) == ("full", "GT-SAGA SR=0.05") else r

    _edit_csv(folder / "summary.csv", small)
    paper = ("synthetic", "random", "GT-SAGA SR=0.05")
    _edit_csv(folder / "paper" / "summary.csv", lambda r: {**r, **times} if tuple(r.values())[:3] == paper else r)
    got = cfl_saga.sections(folder)
    assert "| CFL-SAGA ρ=1e5 | – | – | – | – |" in got["alpha"]
    assert got["alpha-ratios"] == "- No CFL-SAGA setting of the step-size grid reached 1e-08.\n"
    assert "| ring, ρ = 1e4 | – | 1,529 / 16,078 |" in got["pilot"]
    assert "| GT-SAGA at SR 0.05 | – | – |" in got["runtime"]
    assert "× their CPU" in got["runs"]


def test_cse_fsl_claims_without_per_seed_records_are_untestable_not_left_out():
    """``judge(CLAIMS, table, preset)`` from Python without the per-seed records (``Preset.records``) shows each
    claim that reads them as untestable with the reason (before: C2, C6, C8 and C9 were left out); a non-IID
    claim on an IID preset is still left out."""
    for name, scale, dataset in cse_fsl.PAGE_TABLES:
        table, p = read_csv(PAGES / "cse-fsl" / f"table-{name}.csv"), cse_fsl.preset(scale, dataset)
        noniid, verdicts = p.noniid, {v.claim.split()[0]: v for v in judge(cse_fsl.CLAIMS, table, p)}
        seeded = {"C2", "C6", "C7", *(("C8", "C9") if noniid else ())}
        assert set(verdicts) == {"C1", "C3", "C5", *seeded}, name
        for c in seeded:
            assert verdicts[c].held is None and "no per-seed records" in verdicts[c].interval, (name, c)


@pytest.mark.parametrize(
    ("gone", "command"),
    [
        ("table-fashion_mnist-noniid.md", "--scale noniid --dataset fashion_mnist"),
        ("storage-digits.csv", "--scale storage --dataset digits"),
    ],
)
def test_cse_fsl_page_from_a_folder_without_a_table_is_one_line_naming_it_and_its_command(tmp_path, gone, command):
    """The page's sections from a folder without one of the reports they read (a copied table.md/table.csv or
    storage.csv) are one line naming the file and the command whose report it is (before: FileNotFoundError)."""
    folder = Path(shutil.copytree(PAGES / "cse-fsl", tmp_path / "cse-fsl", ignore=shutil.ignore_patterns("*.png")))
    (folder / gone).unlink()
    with pytest.raises(ConfigError) as got:
        cse_fsl.sections(folder)
    msg = str(got.value)
    assert "\n" not in msg and msg.startswith(f"{folder / gone} is missing: the page's sections read it")
    assert f"`fedweave reproduce cse-fsl {command}`" in msg
