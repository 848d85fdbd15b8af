"""The comparison page (docs/benchmarks.md): its generated block is rebuilt from the committed records byte for
byte, and the study that writes it runs end to end at a smoke scale on synthetic data."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from fedweave.config import ConfigError
from fedweave.data.base import Dataset
from fedweave.experiments.pages import blocks
from fedweave.experiments.tables import read_csv
from fedweave.registry import DATASETS
from fedweave.reproduce.baselines import METHODS, NAME, main

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = f"<!-- generated: {NAME} -->", "<!-- end generated -->"  # the page's block
PAGE = ROOT / "docs" / "benchmarks.md"
RECORDS = ROOT / "docs" / "benchmarks" / "baselines-small.csv"
# the committed grid, as the page's command runs it
COMMITTED = ["--scale", "small"]

if "_toy_bench" not in DATASETS._items:

    @DATASETS.register("_toy_bench")
    def _toy_bench() -> Dataset:
        """Synthetic 1×16×16 class-mean images, 400 train / 100 test."""
        g = torch.Generator().manual_seed(3)
        mu = torch.randn(10, 1, 16, 16, generator=g)
        y = torch.arange(500) % 10
        x = mu[y] + 0.5 * torch.randn(500, 1, 16, 16, generator=g)
        return Dataset("_toy_bench", x[:400], y[:400], x[400:], y[400:], 10, (1, 16, 16))


def _rebuild(tmp_path: Path, records: Path, text: str | None = None) -> str:
    """The page (or ``text`` as the page) after ``--from-records RECORDS --page`` on a copy of it."""
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE.read_text(encoding="utf-8") if text is None else text, encoding="utf-8")
    assert main([*COMMITTED, "--from-records", str(records), "--out", str(tmp_path / "out"), "--page", str(page)]) == 0
    return page.read_text(encoding="utf-8")


def test_the_page_is_rebuilt_from_its_committed_records_byte_for_byte(tmp_path):
    committed = PAGE.read_text(encoding="utf-8")
    assert committed.count(BEGIN) == 1 and list(blocks(committed)) == [NAME]
    assert _rebuild(tmp_path, RECORDS) == committed
    records = read_csv(RECORDS)
    assert {r["method"] for r in records} <= {m.key for m in METHODS}


def test_an_edited_number_fails_the_rebuild(tmp_path):
    committed = PAGE.read_text(encoding="utf-8")
    rows = list(csv.DictReader(RECORDS.open(encoding="utf-8")))
    rows[0]["client_acc"] = str(float(rows[0]["client_acc"]) + 1.0)  # one seed's accuracy, one point higher
    edited = tmp_path / "edited.csv"
    with edited.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    assert _rebuild(tmp_path, edited) != committed
    # and a number edited on the page instead of in the records
    line = next(t for t in committed.splitlines() if t.startswith("| fedavg | global |"))
    cell = line.split(" | ")[3]  # FedAvg's global accuracy, "mean ± std"
    mean, rest = cell.split(" ", 1)
    page_edited = committed.replace(line, line.replace(cell, f"{float(mean) + 0.01:.2f} {rest}"), 1)
    assert page_edited != committed and _rebuild(tmp_path, RECORDS, page_edited) != page_edited


def test_smoke_runs_the_study_writes_records_tables_and_the_page(tmp_path):
    torch.set_num_threads(1)
    page = tmp_path / "page.md"
    page.write_text(f"# prose above\n\n{BEGIN}\nold\n{END}\nprose below\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--scale", "smoke", "--datasets", "_toy_bench", "--methods", "fedavg,fedper,fedbn", "--workers", "1"]
    assert main([*argv, "--out", str(out), "--page", str(page)]) == 0
    records = read_csv(out / "records.csv")
    assert len(records) == 2 * 3  # 2 splits x 3 methods x 1 seed
    assert all(r["status"] == "completed" and r["rounds"] == 2 for r in records)
    for r in records:
        assert 0 <= r["worst_client_acc"] <= r["client_acc"] <= 100
        assert r["spread"] == pytest.approx(r["client_acc"] - r["worst_client_acc"])
        assert r["mib_total"] > 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# prose above\n\n") and text.endswith(f"{END}\nprose below\n") and "old" not in text
    assert "### _toy_bench, Dirichlet α = 0.1" in text and "| fedbn | personal | 1 |" in text
    assert "Not run" not in text
    # rebuilt from its records without running: the same section
    again = tmp_path / "again.md"
    again.write_text(text, encoding="utf-8")
    assert main([*argv, "--out", str(tmp_path / "o2"), "--from-records", str(out / "records.csv"),
                 "--page", str(again)]) == 0  # fmt: skip
    assert again.read_text(encoding="utf-8") == text
    # a grid with a record missing names the missing run on the page, as what the records file lacks (before: "the
    # time budget ran out", though no budget was given)
    records = out / "records.csv"
    assert main([*argv, "--seeds", "2", "--out", str(tmp_path / "o3"), "--from-records", str(records),
                 "--page", str(again)]) == 0  # fmt: skip
    rebuilt = again.read_text(encoding="utf-8")
    assert f"No record in {records} (--from-records) of _toy_bench/dir0.1/fedavg/1," in rebuilt
    assert "time budget" not in rebuilt


def test_bad_options_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"--methods: unknown \['fedfoo'\]; allowed fedavg, fedprox"):
        main(["--methods", "fedavg,fedfoo", "--out", "unused"])
    with pytest.raises(ConfigError, match=r"--datasets: unknown \['cifar10'\]; allowed mnist, fashion_mnist"):
        main(["--datasets", "cifar10", "--out", "unused"])
    page = tmp_path / "page.md"
    page.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"--page {page} has no block '{BEGIN}'")):  # before anything runs
        main(["--page", str(page), "--out", str(tmp_path / "out")])
    assert page.read_text(encoding="utf-8") == "no markers here\n" and not (tmp_path / "out").exists()
    page.write_text(f"{END}\n{BEGIN}\n", encoding="utf-8")  # the markers the wrong way round
    with pytest.raises(ConfigError, match=re.escape(f"--page {page} has no block '{BEGIN}'")):
        main(["--page", str(page), "--out", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="--from-records: .*nothing.csv is not a file"):
        main(["--from-records", str(tmp_path / "nothing.csv"), "--out", str(tmp_path / "out")])


def test_a_scale_without_a_target_says_so_rather_than_not_reached():
    from fedweave.reproduce.baselines import BY_KEY, PRESETS, section

    rec = {"dataset": "_toy_bench", "split": "dir0.1", "method": "fedavg", "seed": 0, "status": "completed"}
    rec |= {"rounds": 2, "global_acc": 50.0, "client_acc": 50.0, "worst_client_acc": 40.0, "spread": 10.0}
    rec |= {"mib_to_target": None, "mib_total": 1.0}
    context = {"preset": PRESETS["smoke"], "datasets": ["_toy_bench"], "methods": [BY_KEY["fedavg"]], "seeds": [0]}
    row = next(line for line in section([rec], context).splitlines() if line.startswith("| fedavg"))
    assert "no target at this scale" in row and "not reached" not in row


def test_an_unknown_smoke_dataset_is_one_line_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"--datasets: unknown \['cifar11'\]; allowed .*_toy_bench"):
        main(["--scale", "smoke", "--datasets", "_toy_bench,cifar11", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_records_of_another_study_and_a_dataset_without_images_are_one_line(tmp_path):
    """``--from-records`` given another study's CSV ended in ``KeyError: 'global_acc'`` after ``--out`` was made; a
    smoke dataset of flat samples failed in its first run on the CNN, not naming ``--datasets``."""
    other = tmp_path / "results.csv"
    other.write_text("dataset,split,method,seed,final_acc\nmnist,iid,fedavg,0,50.0\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^--from-records: .*results.csv is not a records.csv of this study \(no "
                       r"column 'status'\)"):  # fmt: skip
        main(["--from-records", str(other), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"^--datasets: 'synthetic' holds samples of shape \(60,\), not images"):
        main(["--scale", "smoke", "--datasets", "synthetic", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
