"""FedMIM's and ZO-HFL's pages from folders a partial invocation wrote: a preset not run, a report without the
file the page reads, a smoke scale's or another preset's files, a folder without a cell the page reads."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from fedweave.config import ConfigError
from fedweave.reproduce import fedmim, zo_hfl

PAGES = Path(__file__).resolve().parents[1] / "docs" / "reproductions"


def _copy(tmp_path: Path, paper: str) -> Path:
    """A copy of the committed records beside ``paper``'s page, without the figures."""
    return Path(shutil.copytree(PAGES / paper, tmp_path / paper, ignore=shutil.ignore_patterns("*.png")))


def _edit_csv(path: Path, edit, header=lambda c: c) -> None:
    """Rewrite the CSV ``path`` with ``edit(row)`` on each row (None drops it), its columns renamed by ``header``."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns, rows = reader.fieldnames, [got for r in reader if (got := edit(r)) is not None]
    names = {c: header(c) for c in columns}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, list(names.values()), lineterminator="\n")
        writer.writeheader()
        writer.writerows({names[k]: v for k, v in r.items()} for r in rows)


def _refused(sections, folder: Path, sub: str, what: str, command: str) -> None:
    """``sections(folder)`` is one ConfigError line naming the folder ``sub``, what it lacks and the command."""
    with pytest.raises(ConfigError) as got:
        sections(folder)
    msg, d = str(got.value), folder / sub
    assert "\n" not in msg and msg.startswith(f"{d}: the page's sections read the "), msg
    assert what in msg and f"`fedweave reproduce {command} --out {d}`" in msg, msg


def _fedmim_without(folder: Path, case: str) -> None:
    if case == "participation":  # the preset not run
        shutil.rmtree(folder / "participation")
    elif case == "epochs.csv":  # its report without the table the page reads
        (folder / "epochs" / "epochs.csv").unlink()
    elif case == "gaps.csv":
        (folder / "long" / "gaps.csv").unlink()
    else:  # the small preset's MNIST runs only: a smoke scale's folder, or --datasets mnist
        for f in ("results.csv", "table.csv"):
            _edit_csv(folder / f, lambda r: r if r["dataset"] == "mnist" else None)


@pytest.mark.parametrize(
    ("case", "sub", "what", "command"),
    [
        ("participation", "participation", "no results.csv", "--scale participation"),
        ("epochs.csv", "epochs", "no epochs.csv", "--scale epochs"),
        ("gaps.csv", "long", "no gaps.csv", "--scale long"),
        ("mnist", "", "8 of its 12 cells: fashion_mnist, dir0.1, fedavg", "--scale small"),
    ],
)
def test_fedmim_page_from_a_partial_folder_is_one_line_naming_it_and_its_command(tmp_path, case, sub, what, command):
    """The page's sections from a folder without a preset's report, a file of it or the cells the page reads are
    one line naming the folder, what it lacks and the command that runs it there (before: FileNotFoundError, or
    an IndexError in _round50 without the small preset's Dir-0.1 Fashion-MNIST runs)."""
    folder = _copy(tmp_path, "fedmim")
    _fedmim_without(folder, case)
    _refused(fedmim.sections, folder, sub, what, f"fedmim {command}")


def _zo_without(folder: Path, case: str) -> None:
    if case == "tune":  # --scale small without its --tune
        (folder / "tune.csv").unlink()
        (folder / "tune.md").unlink()
    elif case == "adult":
        shutil.rmtree(folder / "adult")
    elif case == "long":  # its table.md, whose cost line the page reads
        (folder / "long" / "table.md").unlink()
    elif case == "smoke":  # the smoke scale's Table I: digits, its meta's scale
        for f in ("results.csv", "table.csv"):
            _edit_csv(folder / f, lambda r: {**r, "dataset": "digits"} if r["dataset"] == "mnist" else r)
        saved = json.loads((folder / "claims.json").read_text(encoding="utf-8"))
        saved["meta"]["scale"] = "smoke"
        (folder / "claims.json").write_text(json.dumps(saved), encoding="utf-8")
    elif case == "smoke-tune":  # the smoke scale's --tune grid: digits columns
        _edit_csv(folder / "tune.csv", lambda r: r, lambda c: c.replace("fashion_mnist", "digits"))
    else:  # the small preset's --tune grid in adult/
        shutil.copy(folder / "tune.csv", folder / "adult" / "tune.csv")


@pytest.mark.parametrize(
    ("case", "sub", "what", "command"),
    [
        ("tune", "", "no tune.csv", "--scale small --tune"),
        ("adult", "adult", "no claims.json", "--scale adult"),
        ("long", "long", "no table.md", "--scale long"),
        ("smoke", "", "its claims.json is the smoke scale's", "--scale small"),
        ("smoke-tune", "", "no column 'fashion_mnist a=1000, b=90%'", "--scale small --tune"),
        ("adult-tune", "adult", "no column 'adult a=1000, b=90%'", "--scale adult --tune"),
    ],
)
def test_zo_hfl_page_from_a_partial_folder_is_one_line_naming_it_and_its_command(tmp_path, case, sub, what, command):
    """The page's sections from a preset's folder without a file they read, or with another scale's report or
    grid, are one line naming the folder, what it lacks and the command that writes it there (before:
    FileNotFoundError, KeyError 'digits' in sensitivity, KeyError in tune_section, IndexError in
    adult_tune_section)."""
    folder = _copy(tmp_path, "zo-hfl")
    _zo_without(folder, case)
    _refused(zo_hfl.sections, folder, sub, what, f"zo-hfl {command}")


def test_fedmim_and_zo_hfl_pages_from_one_seed_or_a_diverged_cell_render(tmp_path):
    """A folder that holds every cell the page reads renders where it has one seed or a cell whose every seed
    diverged; ZO-HFL's also where a time budget left Table I runs unrun (the tables show what ran)."""
    folder = _copy(tmp_path, "fedmim")
    gone = {"final_acc": "nan", "best_acc": "nan", "status": "diverged"}
    _edit_csv(
        folder / "results.csv", lambda r: None if r["seed"] != "0" else {**r, **gone} if r["method"] == "fedmim" else r
    )
    _edit_csv(folder / "participation" / "results.csv", lambda r: r if r["seed"] == "0" else None)
    assert (
        "Per seed at Dir-0.1 (final accuracy, FedAvg → FedMIM): 75.71 → diverged."
        in fedmim.sections(folder)["per-seed"]
    )
    folder = _copy(tmp_path, "zo-hfl")
    extreme = lambda r: r["method"] == "zo_hfl" and float(r["alpha"]) == 0.1  # noqa: E731
    _edit_csv(folder / "results.csv", lambda r: {**r, "acc": "nan", "status": "diverged"} if extreme(r) else r)
    _edit_csv(folder / "table.csv", lambda r: None if r["method"] == "scaffold" else r)
    assert "SCAFFOLD" not in zo_hfl.sections(folder)["table1-mnist"]
