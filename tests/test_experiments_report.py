"""`fedweave report`: a self-contained HTML page, rendered by real headless Chromium."""

from __future__ import annotations

import base64
import csv
import io
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from PIL import Image

import fedweave
from fedweave.cli import main as cli_main

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium (Debian package chromium) is absent")


class _Dom(HTMLParser):
    """Tables (by class: their rows of cell texts, and which rows are marked best) and image sources."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[str]], list[int]]] = []
        self.images: list[str] = []
        self.titles: list[str | None] = []  # the exact value of a shortened cell
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables.append((a.get("class", ""), [], []))
        elif tag == "tr" and self.tables:
            if a.get("class") == "best":
                self.tables[-1][2].append(len(self.tables[-1][1]))
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = []
            self.titles.append(a.get("title"))
        elif tag == "img":
            self.images.append(a["src"])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append("".join(self._cell))
            self._cell = None


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, timeout=120, check=True)


def test_report_of_a_sweep_renders_in_chromium_with_its_tables_and_images(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 3, "output": {"progress": False, "plots": True}}
    res = fedweave.sweep(cfg, {"local.lr": [0.05, 0.2]}, out=tmp_path / "sweep", progress=False)
    page = tmp_path / "report.html"
    assert cli_main(["report", str(res.out_dir), "--out", str(page)]) == 0
    assert "http" not in page.read_text().replace("http-equiv", "")  # nothing fetched from a network

    dom = _Dom()
    dom.feed(_chromium(tmp_path, "--dump-dom", page.as_uri()).stdout.decode())
    metrics = [t for t in dom.tables if t[0] == "metrics"]
    assert len(metrics) == 2
    for rec, (_, rows, _) in zip(res.records, metrics):
        with open(res.out_dir / rec["run_dir"] / "metrics.csv", newline="") as f:
            written = [list(r) for r in csv.reader(f)]
        assert rows[0] == written[0] and len(rows) == len(written)
        for shown, value in zip((c for r in rows[1:] for c in r), (c for r in written[1:] for c in r)):
            assert shown == value or float(shown) == float(f"{float(value):.6g}"), (shown, value)
    assert any(t and "." in t and len(t) > 8 for t in dom.titles)  # long floats keep their exact value
    ((_, summary, best),) = [t for t in dom.tables if t[0] == "summary"]
    assert best == [1 + res.best] and summary[1 + res.best][0] == res.summary[res.best]["point"]
    (diff,) = [t for t in dom.tables if t[0] == "config-diff"]
    assert diff[1] == [["run", "local.lr"], *[[r["run_dir"].split("/")[-1], str(r["local.lr"])] for r in res.records]]
    assert [t for t in dom.tables if t[0] == "comm"]
    names = {"partition.png", "test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"}
    assert len(dom.images) == 2 + 2 * len(names)  # the sweep's two plots, each run's three figures
    for src in dom.images:
        assert src.startswith("data:image/png;base64,")
        Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).verify()

    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    with Image.open(shot) as im:
        lo, hi = im.convert("L").getextrema()
        assert im.size == (1200, 900) and hi - lo > 100  # something was drawn
