"""`fedweave report`: a self-contained HTML page (rendered by real headless Chromium where it is installed) for
finished, running and killed sweeps and runs."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser

import numpy as np
import pytest
import yaml
from PIL import Image

import fedweave
from fedweave.checkpoints import CHECKPOINT
from fedweave.cli import main as cli_main
from fedweave.experiments.report import _num, build_report

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium (Debian package chromium) is absent")


class _Dom(HTMLParser):
    """Tables (by class: their rows of cell texts, and which rows are marked best) and image sources."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[str]], list[int]]] = []
        self.images: list[str] = []
        self.titles: list[str | None] = []  # the exact value of a shortened cell
        self.folded: list[bool] = []  # per table: inside a closed <details> element
        self.notes: list[str] = []
        self.pres = 0
        self._cell: list[str] | None = None
        self._details: list[bool] = []  # the open <details> elements around here: whether each is open
        self._note: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "details":
            self._details.append("open" in a)
        elif tag == "pre":
            self.pres += 1
        elif tag == "p" and a.get("class") == "note":
            self._note = []
        if tag == "table":
            self.folded.append(any(not is_open for is_open in self._details))
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
        if self._note is not None:
            self._note.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "details":
            self._details.pop()
        elif tag == "p" and self._note is not None:
            self.notes.append("".join(self._note))
            self._note = None

    def table(self, cls: str) -> list[list[str]]:
        (rows,) = [rows for c, rows, _ in self.tables if c == cls]
        return rows


def _dom(page: str) -> _Dom:
    dom = _Dom()
    dom.feed(page)
    return dom


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, timeout=120, check=True)


@needs_chromium
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
    runs = dom.table("runs")  # the config keys that differ are its columns
    assert runs[0][:3] == ["run", "local.lr", "status"]
    assert [r[:3] for r in runs[1:]] == [
        [r["run_dir"].split("/")[-1], str(r["local.lr"]), "completed"] for r in res.records
    ]
    assert [t for t in dom.tables if t[0] == "comm"]
    names = {"partition.png", "test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"}
    assert len(dom.images) == 2 + 2 * len(names)  # the report's two plots, each run's three figures
    for src in dom.images:
        assert src.startswith("data:image/png;base64,")
        Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).verify()

    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    with Image.open(shot) as im:
        lo, hi = im.convert("L").getextrema()
        assert im.size == (1200, 900) and hi - lo > 100  # something was drawn


# ---- a sweep still running, killed, or re-run with another grid --------------------------------------------

# scikit-learn's bundled digits need no network, so a sweep in a subprocess can load them
DIGITS = {
    "name": "digits",
    "seed": 7,
    "rounds": 2,
    "backend": "loop",
    "threads": 1,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 2},
    "local": {"steps": 1, "epochs": None, "batch_size": 8, "lr": 0.05},
    "output": {"progress": False, "plots": False, "checkpoint_every": 1},
}


def _runs_by_name(page: str) -> dict[str, dict[str, str]]:
    rows = _dom(page).table("runs")
    return {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}


@pytest.mark.slow
def test_report_of_a_running_then_killed_sweep_marks_each_unfinished_run(tmp_path):
    cfg = tmp_path / "digits.yaml"
    cfg.write_text(yaml.safe_dump(DIGITS))
    out = tmp_path / "sweep"  # the long point runs second, the last one never starts
    cmd = [sys.executable, "-m", "fedweave.cli", "sweep", str(cfg), "--grid", "rounds=2,3000,3", "--out", str(out)]
    proc = subprocess.Popen([*cmd, "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    long_run = out / "runs" / "rounds=3000,seed=7"
    pages = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not (long_run / CHECKPOINT).is_file():
            time.sleep(0.01)
        assert proc.poll() is None, f"the sweep ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        pages.append(build_report([out]))  # while it runs
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        pages.append(build_report([out]))  # killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
    assert not (out / "summary.csv").exists()  # the sweep's own tables are written at its end

    for page in pages:
        runs = _runs_by_name(page)
        unfinished = runs["rounds=3000,seed=7"]
        assert list(runs) == ["rounds=2,seed=7", "rounds=3000,seed=7", "rounds=3,seed=7"]
        assert runs["rounds=2,seed=7"]["status"] == "completed" and runs["rounds=2,seed=7"]["rounds"] == "2"
        assert unfinished["status"] == "unfinished (running or killed) (resumes from checkpoint.pt)"
        reached, planned = unfinished["rounds"].split(" of ")
        assert 1 <= int(reached) < 3000 and planned == "3000"
        assert runs["rounds=3,seed=7"]["status"] == "not started"
        dom = _dom(page)
        assert "1 of 3 runs finished; 1 unfinished (running or killed), 1 not started." in dom.notes
        summary = {r[0]: r[1] for r in dom.table("summary")[1:]}
        assert summary == {"rounds=2": "1/1", "rounds=3000": "0/1, 1 unfinished", "rounds=3": "0/1, 1 not started"}
    # the unfinished run's rows reached the report as they were when it was read
    final = _runs_by_name(pages[1])["rounds=3000,seed=7"]["final test_accuracy"]
    rows = fedweave.results.read_metrics(long_run)
    assert final == f"{rows[-1]['test_accuracy']:.4g}" and unfinished["rounds"] == f"{rows[-1]['round']} of 3000"


def _sweep(cfg: dict, grid: dict, out, seeds: int = 1):
    return fedweave.sweep(cfg, grid, seeds=seeds, out=out, progress=False)


def test_report_leaves_out_the_runs_of_an_earlier_grid_in_the_same_folder(toy_config, tmp_path, caplog):
    cfg = {**toy_config, "rounds": 2}
    out = tmp_path / "sweep"
    _sweep(cfg, {"local.lr": [0.05, 0.1]}, out, seeds=2)
    res = _sweep(cfg, {"local.lr": [0.1, 0.3]}, out)  # the same folder, another grid and fewer seeds
    current = [r["run_dir"].split("/")[-1] for r in res.records]
    assert current == ["local.lr=0.1,seed=3", "local.lr=0.3,seed=3"]
    stale = ["local.lr=0.05,seed=3", "local.lr=0.05,seed=4", "local.lr=0.1,seed=4"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(current + stale)

    page = build_report([out])
    assert sum(cls == "metrics" for cls, _, _ in _dom(page).tables) == 2  # one per run of the current grid
    assert list(_runs_by_name(page)) == current
    assert [r[0] for r in _dom(page).table("summary")[1:]] == ["local.lr=0.1", "local.lr=0.3"]
    (note,) = [n for n in _dom(page).notes if n.startswith("Left out")]
    assert note.startswith("Left out: 3 run directories in runs/ not in this sweep's grid (sweep.json)") and all(
        s in note for s in stale
    )
    assert f"{out}: {note}" in caplog.messages  # said on the command line too
    # the same sweep started again (sweep.json rewritten, sweep.csv not yet): its points come from sweep.json
    later = (out / "sweep.csv").stat().st_mtime + 60
    os.utime(out / "sweep.json", (later, later))
    assert list(_runs_by_name(build_report([out]))) == current


def test_a_sweep_over_rounds_shows_one_rounds_column(toy_config, tmp_path):
    # the grid's key and the runs' own column were both headed "rounds", side by side
    out = tmp_path / "sweep"
    _sweep({**toy_config, "rounds": 1}, {"rounds": [1, 2]}, out)
    rows = _dom(build_report([out])).table("runs")
    assert rows[0].count("rounds") == 1
    assert [dict(zip(rows[0], r))["rounds"] for r in rows[1:]] == ["1", "2"]


@pytest.mark.parametrize("what", ["empty", "file", "missing"])
def test_report_of_a_folder_that_is_not_a_run_or_a_sweep_is_refused(tmp_path, capsys, what):
    target = tmp_path / "x"
    if what == "empty":
        target.mkdir()
    elif what == "file":
        target.write_text("not a run\n")
    assert cli_main(["report", str(target), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedweave: error: {target} ")
    assert "sweep.json" in err[0] and "config.yaml" in err[0]  # what is allowed
    assert not (tmp_path / "r.html").exists()


def test_the_points_read_from_sweep_json_are_the_sweeps_own(toy_config, tmp_path):
    """A running sweep's runs are expanded from sweep.json (grid, zipped keys, seeds); they must be the runs, in
    the order, that the finished sweep lists in sweep.csv."""
    from fedweave.experiments.report import _current_points

    zipped = {"local.lr": [0.1, 0.2], "local.batch_size": [8, 16]}
    res = fedweave.sweep({**toy_config, "rounds": 1}, {"algorithm.clients_per_round": [2, 3]}, zipped=zipped,
                         seeds=2, out=tmp_path / "s", progress=False)  # fmt: skip
    spec = json.loads((res.out_dir / "sweep.json").read_text())
    finished = _current_points(res.out_dir, spec)
    assert finished == [(r["run_dir"].split("/")[-1], r["point"]) for r in res.records] and len(finished) == 8
    later = (res.out_dir / "sweep.csv").stat().st_mtime + 60
    os.utime(res.out_dir / "sweep.json", (later, later))  # as when the sweep starts again
    assert _current_points(res.out_dir, spec) == finished
    assert spec["base_seed"] == toy_config.get("seed", 0)  # sweep.json records the seed the runs start from
    # a sweep.json written before it listed its runs: the points are expanded from the grid, as the runs
    old = {k: v for k, v in spec.items() if k not in ("runs", "base_seed")}
    assert _current_points(res.out_dir, old) == finished


def test_report_counts_an_interrupted_run_as_not_finished(toy_config, tmp_path):
    res = _sweep({**toy_config, "rounds": 2}, {"local.lr": [0.1, 0.2]}, tmp_path / "sweep")
    run = res.out_dir / "runs" / "local.lr=0.2,seed=3"
    # what Ctrl-C in round 2 leaves (docs/results.md): the rows so far, summary.json with status interrupted
    summary = json.loads((run / "summary.json").read_text())
    rows = fedweave.results.read_metrics(run)[:1]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary.update(status="interrupted", rounds=1, final=rows[-1], error="stopped by SIGINT.")
    (run / "summary.json").write_text(json.dumps(summary))
    later = (res.out_dir / "sweep.csv").stat().st_mtime + 60
    os.utime(res.out_dir / "sweep.json", (later, later))  # started again: sweep.csv is the earlier sweep's

    dom = _dom(build_report([res.out_dir]))
    runs = {r[0]: r for r in dom.table("runs")[1:]}
    assert runs["local.lr=0.2,seed=3"][2:4] == ["interrupted", "1 of 2"]
    assert "1 of 2 runs finished; 1 interrupted." in dom.notes
    assert [r[:2] for r in dom.table("summary")[1:]] == [
        ["local.lr=0.1", "1/1"],
        ["local.lr=0.2", "0/1, 1 interrupted"],
    ]


def test_report_of_a_single_run_still_running(toy_config, tmp_path):
    run = fedweave.run(fedweave.config.load({**toy_config, "rounds": 3}), run_dir=tmp_path / "r")
    (run.run_dir / "summary.json").unlink()  # a running run has none yet
    page = build_report([run.run_dir])
    runs = _runs_by_name(page)
    assert runs["r"]["status"] == "unfinished (running or killed)" and runs["r"]["rounds"] == "3"
    assert runs["r"]["final test_accuracy"] == f"{run.metrics[-1]['test_accuracy']:.4g}"  # from the config's task
    assert 'alt="test_accuracy_vs_rounds.png"' in page


@pytest.mark.parametrize("damaged", ["sweep.json", "runs/local.lr=0.1,seed=3/summary.json"])
def test_report_of_a_damaged_file_names_it(toy_config, tmp_path, capsys, damaged):
    res = _sweep({**toy_config, "rounds": 1}, {"local.lr": [0.1]}, tmp_path / "sweep")
    (res.out_dir / damaged).write_text('{"status": ')  # cut short by hand
    assert cli_main(["report", str(res.out_dir), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedweave: error: {res.out_dir / damaged} cannot be read")


RUN = "runs/local.lr=0.1,seed=3"


@pytest.mark.parametrize(
    "damaged, text",
    [
        (f"{RUN}/summary.json", "[1, 2]"),
        (f"{RUN}/summary.json", "{}"),
        (f"{RUN}/metrics.jsonl", '"str"'),
        (f"{RUN}/metrics.jsonl", '{"round": "x"}'),
        (f"{RUN}/config.yaml", "- a list"),
        ("sweep.json", "[1]"),
        ("sweep.json", '{"grid": 5}'),
        ("sweep.csv", "point,run_dir\ngarbage,\n"),
    ],
)
def test_report_and_plot_of_a_file_of_the_wrong_shape_name_it(toy_config, tmp_path, capsys, damaged, text):
    """Files that parse but hold other than what a run or sweep writes: a TypeError, KeyError or AttributeError
    traceback, some with status 0."""
    res = _sweep({**toy_config, "rounds": 1}, {"local.lr": [0.1]}, tmp_path / "sweep")
    capsys.readouterr()
    (res.out_dir / damaged).write_text(text)
    for cmd in (["report", str(res.out_dir), "--out", str(tmp_path / "r.html")], ["plot", str(res.out_dir / RUN)]):
        if cmd[0] == "plot" and not damaged.endswith("metrics.jsonl"):
            continue  # a plot reads a run's rows
        assert cli_main([*cmd, "--out", str(tmp_path / "p")] if cmd[0] == "plot" else cmd) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"fedweave: error: {res.out_dir / damaged} cannot be read"), err


# ---- a report that reads well ------------------------------------------------------------------------------

PM = re.compile(r"^(\d+\.\d+) ± (\d+\.\d+)$")


@needs_chromium
def test_a_12_run_sweep_reads_in_a_few_screens_with_means_and_stds(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 3}  # no per-run figures: they are folded away like the tables
    res = _sweep(cfg, {"local.lr": [0.05, 0.1, 0.2, 0.4]}, tmp_path / "sweep", seeds=3)
    page = tmp_path / "report.html"
    assert cli_main(["report", str(res.out_dir), "--out", str(page)]) == 0
    dom = _dom(page.read_text())

    # one summary table: mean ± std to the std's second significant digit, the exact values in the title
    summary = dom.table("summary")
    assert [r[0] for r in summary[1:]] == [s["point"] for s in res.summary]
    column = summary[0].index("test_accuracy (mean ± std)")
    for row, s in zip(summary[1:], res.summary):
        mean, std = PM.match(row[column]).groups()
        decimals = len(std.split(".")[1])
        assert 10 <= round(float(std) * 10**decimals) <= 100  # two significant digits of the std: 0.013, not 0.0134
        assert mean == f"{s['test_accuracy_mean']:.{decimals}f}" and std == f"{s['test_accuracy_std']:.{decimals}f}"
        assert f"mean {s['test_accuracy_mean']!r}, std {s['test_accuracy_std']!r}" in "".join(filter(None, dom.titles))
    # only the keys that differ; the shared config once; each run's detail folded away
    assert dom.table("runs")[0][:4] == ["run", "local.lr", "seed", "status"] and len(dom.table("runs")) == 13
    assert dom.pres == 1
    per_run = [folded for (cls, _, _), folded in zip(dom.tables, dom.folded) if cls in ("metrics", "comm")]
    assert len(per_run) == 24 and all(per_run)

    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,4000", "--hide-scrollbars", page.as_uri())
    with Image.open(shot) as im:
        ink = np.asarray(im.convert("L")) < 250
    height = np.nonzero(ink.any(1))[0].max()
    assert height < 3 * 900, f"the page is {height / 900:.1f} screens long"


def _colours(png: bytes) -> dict[str, int]:
    """How many pixels of a figure are drawn in each of matplotlib's first seven line colours."""
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    tab = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    return {c: int((rgb == [int(c[i : i + 2], 16) for i in (1, 3, 5)]).all(1).sum()) for c in tab}


def test_report_overlays_the_sweeps_and_runs_given_on_one_plot(toy_config, tmp_path):
    cfg = {**toy_config, "rounds": 3}
    a = _sweep(cfg, {"local.lr": [0.05, 0.2]}, tmp_path / "a", seeds=2)
    b = _sweep({**cfg, "algorithm": {"name": "fedprox", "clients_per_round": 4}}, {"local.lr": [0.1]}, tmp_path / "b")
    run = fedweave.run(fedweave.config.load({**cfg, "local": {**cfg["local"], "lr": 0.4}}), run_dir=tmp_path / "c")
    page = tmp_path / "r.html"
    assert cli_main(["report", str(a.out_dir), str(b.out_dir), str(run.run_dir), "--out", str(page)]) == 0
    text = page.read_text()
    (overlay,) = re.findall(r'<section class="overlay">(.*?)</section>', text)
    figures = dict(re.findall(r'alt="([^"]+)" src="data:image/png;base64,([^"]+)"', overlay))
    assert sorted(figures) == ["test_accuracy_vs_bytes.png", "test_accuracy_vs_rounds.png"]
    drawn = _colours(base64.b64decode(figures["test_accuracy_vs_rounds.png"]))
    lines = [c for c, n in drawn.items() if n > 30]
    assert len(lines) == 4, drawn  # a's two points, b's one, the run: each its own line on one figure
    # the config keys that differ across all of them are the runs tables' columns
    heads = [rows[0][:4] for cls, rows, _ in _dom(text).tables if cls == "runs"]
    assert heads == [["run", "algorithm.name", "local.lr", "seed"]] * 3


def test_report_draws_a_sweep_on_the_simulated_clock_against_simulated_time(toy_config, tmp_path):
    """Synchronous and buffered asynchronous FedAvg on one clock (faults.sim_time): the overlay has the figure
    against simulated time a run's own plots have; a sweep without the clock does not (the overlay test above)."""
    cfg = {**toy_config, "rounds": 3, "faults": {"speed_sigma": 0.5, "sim_time": True}}
    res = _sweep(cfg, {"algorithm.name": ["fedavg", "fedbuff"]}, tmp_path / "s")
    overlay = re.findall(r'<section class="overlay">(.*?)</section>', build_report([res.out_dir]))[0]
    figures = dict(re.findall(r'alt="([^"]+)" src="data:image/png;base64,([^"]+)"', overlay))
    assert sorted(figures) == [
        "test_accuracy_vs_bytes.png",
        "test_accuracy_vs_rounds.png",
        "test_accuracy_vs_sim_time.png",
    ]
    drawn = _colours(base64.b64decode(figures["test_accuracy_vs_sim_time.png"]))
    assert len([c for c, n in drawn.items() if n > 30]) == 2, drawn  # a line for each method


def test_report_replaces_an_earlier_report_but_no_other_file(tmp_path, capsys):
    cfg = {"name": "r", "rounds": 1, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4},
           "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 2},
           "output": {"progress": False, "plots": False}}  # fmt: skip
    fedweave.run(cfg, run_dir=tmp_path / "run")
    mine = tmp_path / "notes.html"
    mine.write_text("<html>my notes</html>")
    assert cli_main(["report", str(tmp_path / "run"), "--out", str(mine)]) == 2
    assert "exists and is not a fedweave report" in capsys.readouterr().err
    assert mine.read_text() == "<html>my notes</html>"
    out = tmp_path / "report.html"
    assert cli_main(["report", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert cli_main(["report", str(tmp_path / "run"), "--out", str(out)]) == 0  # its own earlier report: replaced


def test_plot_replaces_an_earlier_plot_but_no_other_file(tmp_path, capsys):
    """``fedweave plot --out DIR`` wrote over a file of the user's that had a plot's name (before: in silence);
    it now replaces only a PNG it wrote (marked in a text chunk), in a run directory its own plots as before."""
    from fedweave.plots import is_plot

    cfg = {"name": "r", "rounds": 1, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4},
           "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 2},
           "output": {"progress": False, "plots": True}}  # fmt: skip
    fedweave.run(cfg, run_dir=tmp_path / "run")
    assert is_plot(tmp_path / "run" / "test_accuracy_vs_rounds.png")
    folder = tmp_path / "figures"
    folder.mkdir()
    mine = folder / "test_accuracy_vs_bytes.png"
    mine.write_bytes(b"\x89PNG my own figure")
    assert cli_main(["plot", str(tmp_path / "run"), "--out", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    said = "exists and is not a fedweave plot; give another folder (an earlier plot is replaced)"
    assert err == f"fedweave: error: {mine} {said}"
    assert mine.read_bytes() == b"\x89PNG my own figure" and not (folder / "test_accuracy_vs_rounds.png").exists()
    mine.unlink()
    for _ in range(2):  # its own earlier plots: replaced
        assert cli_main(["plot", str(tmp_path / "run"), "--out", str(folder)]) == 0
    assert is_plot(mine) and not is_plot(tmp_path / "run" / "config.yaml")
    assert cli_main(["plot", str(tmp_path / "run")]) == 0  # the run's own plots, in its directory


def test_report_renders_a_sweeps_comparison_with_its_baseline_from_the_runs_files(toy_config, tmp_path):
    import html as _html

    from scipy import stats

    res = fedweave.sweep({**toy_config, "rounds": 2}, {"algorithm.name": ["fedavg", "fedprox"]}, seeds=3,
                         out=tmp_path / "s", progress=False, baseline="fedavg")  # fmt: skip
    page = build_report([res.out_dir])
    head, base, other = _dom(page).table("summary")
    cols = {h: i for i, h in enumerate(head)}
    assert {"test_accuracy − baseline", "95 % paired t interval", "pairs", "vs baseline", "unpaired"} <= set(cols)
    assert "against the baseline algorithm.name=fedavg, paired by seed (t interval)" in page
    assert "; no correction for multiple comparisons" in page  # --correction not given: none, said so
    assert not {"interval level", "p", "p adjusted"} & set(cols)
    assert base[cols["vs baseline"]] == "baseline"
    row = {r["point"]: r for r in res.summary}["algorithm.name=fedprox"]
    diff, low, high = (row[f"test_accuracy_diff{k}"] for k in ("", "_low", "_high"))
    assert other[cols["test_accuracy − baseline"]] == f"{diff:.4g}"
    assert other[cols["95 % paired t interval"]] == f"[{low:.4g}, {high:.4g}]"
    assert (other[cols["pairs"]], other[cols["vs baseline"]]) == ("3", row["vs_baseline"])
    assert f'title="{_html.escape(f"{low!r}, {high!r}")}"' in page  # the exact values summary.csv holds

    # a seed that has not finished (killed): the report pairs the seeds that have, and names it
    finals = {(r["point"], r["seed"]): r["final_test_accuracy"] for r in res.records}
    (res.out_dir / "runs" / "algorithm.name=fedprox,seed=5" / "summary.json").unlink()
    head, _, other = _dom(build_report([res.out_dir])).table("summary")
    d = np.array([finals[("algorithm.name=fedprox", s)] - finals[("algorithm.name=fedavg", s)] for s in (3, 4)])
    half = stats.t.ppf(0.975, 1) * d.std(ddof=1) / np.sqrt(2)
    assert other[cols["test_accuracy − baseline"]] == f"{d.mean():.4g}"
    assert other[cols["95 % paired t interval"]] == f"[{d.mean() - half:.4g}, {d.mean() + half:.4g}]"
    assert (other[cols["pairs"]], other[cols["unpaired"]]) == ("2", "seed 5 unfinished")


def test_report_renders_a_holm_corrected_comparison_as_summary_csv_holds_it(toy_config, tmp_path):
    grid = {"algorithm.name": ["fedavg", "fedprox", "scaffold"]}
    # two seeds: the two pairs a point's interval needs
    res = fedweave.sweep({**toy_config, "rounds": 2}, grid, seeds=2, out=tmp_path / "s", progress=False,
                         baseline="fedavg", correction="holm")  # fmt: skip
    page = build_report([res.out_dir])
    head, *rows = _dom(page).table("summary")
    cols = {h: i for i, h in enumerate(head)}
    interval = "paired t interval, Holm over 2 at 95 % family-wise"
    assert {interval, "interval level", "p", "p adjusted", "vs baseline"} <= set(cols)
    assert "paired by seed (t interval); Holm correction over the points compared, 95 % family-wise" in page
    want = {r["point"]: r for r in res.summary}
    for cells in rows:
        row = want[cells[cols["point"]]]
        assert cells[cols["vs baseline"]] == row["vs_baseline"]
        if row["vs_baseline"] == "baseline":
            assert [cells[cols[k]] for k in ("interval level", "p", "p adjusted")] == ["-", "-", "-"]
            continue
        low, high = row["test_accuracy_diff_low"], row["test_accuracy_diff_high"]
        assert cells[cols[interval]] == f"[{low:.4g}, {high:.4g}]"
        for col, key in (("interval level", "interval_level"), ("p", "p_value"), ("p adjusted", "p_adjusted")):
            assert cells[cols[col]] == f"{row[key]:.4g}"


def test_a_corrected_comparison_with_no_point_of_two_pairs_says_so_in_its_head(toy_config, tmp_path):
    """One seed per point: no point has the 2 pairs an interval needs, so the Holm family is empty; the interval
    column's head says that no point can be compared yet, not "Holm over 0"."""
    res = fedweave.sweep({**toy_config, "rounds": 1}, {"algorithm.name": ["fedavg", "fedprox"]}, seeds=1,
                         out=tmp_path / "s", progress=False, baseline="fedavg", correction="holm")  # fmt: skip
    page = build_report([res.out_dir])
    head, *rows = _dom(page).table("summary")
    interval = "paired t interval, Holm: no point has 2 or more pairs to compare yet"
    assert interval in head and "over 0" not in page
    assert [cells[head.index(interval)] for cells in rows] == ["-", "-"]  # the baseline, and fedprox's one pair


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"point": "algorithm.name=fedavg"}, "baseline lacks level, test"),
        ({"point": "algorithm.name=fedsgd", "level": 0.95, "test": "t"}, "baseline.point 'algorithm.name=fedsgd'"),
        ({"point": "algorithm.name=fedavg", "level": "high", "test": "t"}, "baseline.level must be a number in (0, 1)"),
        ({"point": "algorithm.name=fedavg", "level": 0.95, "test": "z"}, "baseline.test must be one of t, bootstrap"),
        ("fedavg", "baseline must be a mapping with point, level and test"),
        (
            {"point": "algorithm.name=fedavg", "level": 0.95, "test": "t", "correction": "fdr"},
            "baseline.correction must be one of none, holm, bonferroni, got 'fdr'",
        ),
    ],
)
def test_report_of_a_hand_edited_sweep_baseline_is_one_line(toy_config, tmp_path, capsys, edit, said):
    res = fedweave.sweep({**toy_config, "rounds": 1}, {"algorithm.name": ["fedavg", "fedprox"]}, seeds=1,
                         out=tmp_path / "s", progress=False, baseline="fedavg")  # fmt: skip
    spec = json.loads((res.out_dir / "sweep.json").read_text())
    (res.out_dir / "sweep.json").write_text(json.dumps({**spec, "baseline": edit}))
    assert cli_main(["report", str(res.out_dir), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and "sweep.json" in err


@pytest.mark.parametrize(
    "mean, std, text",
    [
        (0.8435, 0.0441, "0.844 ± 0.044"),
        (85.3, 0.25, "85.30 ± 0.25"),
        # a std that rounds up to the next power of ten keeps two significant digits: 0.0996 is 0.10, not 0.100
        (0.8, 0.0996, "0.80 ± 0.10"),
        (0.81, 0.00996, "0.810 ± 0.010"),
        (85.3, 9.97, "85 ± 10"),
        # a std of 100 or more: two significant digits are tens (or coarser), the mean rounded to the same place
        (807.3, 123.4, "810 ± 120"),
        (12346.0, 678.0, "12350 ± 680"),
    ],
)
def test_the_summary_cell_gives_the_std_to_two_significant_digits(mean, std, text):
    from fedweave.experiments.report import _pm

    assert _pm(mean, std, 3) == text


def test_best_of_a_run_counts_the_rounds_trained_not_the_initial_model(toy_config, tmp_path):
    """With eval.at_start, row 0 is the untrained model: here (lr 5, the loss grows) the best test loss of
    the rows is round 0's, but a run's best is over the rounds trained, in sweep.csv and the report's runs
    table as in summary.json."""
    cfg = {**toy_config, "rounds": 2, "eval": {"at_start": True}}
    res = fedweave.sweep(cfg, {"local.lr": [5.0]}, out=tmp_path / "s", progress=False, metric="test_loss")
    rows = fedweave.results.read_metrics(tmp_path / "s" / res.records[0]["run_dir"])
    assert rows[0]["round"] == 0 and rows[0]["test_loss"] < min(r["test_loss"] for r in rows[1:])  # the premise
    trained = min(r["test_loss"] for r in rows[1:])
    assert res.records[0]["best_test_loss"] == trained
    (run,) = _runs_by_name(build_report([res.out_dir])).values()
    assert run["best test_loss"] == _num(trained)


def test_a_point_with_a_diverged_seed_is_not_the_best_in_the_sweep_or_the_report(toy_config, tmp_path):
    """The best point is chosen among the points whose every run completed: the mean over the seeds that did not
    diverge made a point with one good seed of several the sweep's and the report's best."""
    out = tmp_path / "s"
    grid = {"local.lr": [0.05, 0.2]}
    first = fedweave.sweep({**toy_config, "rounds": 2}, grid, seeds=2, out=out, progress=False)
    best = first.summary[first.best]["point"]
    # one seed of the best point diverged (as a run that met NaN writes it); its other seed keeps the best mean
    run = next(r for r in first.records if r["point"] == best and r["seed"] == first.records[0]["seed"])
    summary = json.loads((out / run["run_dir"] / "summary.json").read_text())
    (out / run["run_dir"] / "summary.json").write_text(json.dumps({**summary, "status": "diverged"}))
    again = fedweave.sweep({**toy_config, "rounds": 2}, grid, seeds=2, out=out, progress=False)
    other = next(r["point"] for r in again.summary if r["point"] != best)
    assert again.summary[again.best]["point"] == other
    dom = _dom(build_report([out]))
    [(_, rows, marked)] = [t for t in dom.tables if t[0] == "summary"]
    assert [rows[i][0] for i in marked] == [other]


DIGITS_RUN = {  # scikit-learn's digits (nothing to download), a fraction of a second a round
    "name": "base", "rounds": 3, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.05}, "output": {"progress": False, "plots": False},
}  # fmt: skip


class _RaiseAt(fedweave.Callback):
    """Raises ``error`` in training round ``at`` (0-based): a divergence or a Ctrl-C mid-round, the round's
    transfers already in the ledger but its row never written."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at, self.error = at, error

    def after_training(self, run, r, metrics):
        if r == self.at:
            raise self.error


def _all_runs(page: str) -> dict[str, dict[str, str]]:
    """The rows of every runs table of the page (one per directory given), by run name."""
    out = {}
    for cls, rows, _ in _dom(page).tables:
        if cls == "runs":
            out.update({r[0]: dict(zip(rows[0], r)) for r in rows[1:]})
    return out


def test_report_bytes_total_is_the_summarys_for_a_diverged_or_interrupted_run(tmp_path):
    """The runs table's bytes total is summary.json's communication total, as sweep.csv's: it counts the round a
    run diverged or was interrupted in (before: the last metrics row's total, a round short, and ``-`` for a run
    that diverged before its first row)."""
    from fedweave.errors import DivergenceError
    from fedweave.experiments.report import _size

    res = fedweave.sweep(DIGITS_RUN, {"local.lr": [0.05, 1e38]}, out=tmp_path / "s", progress=False)
    diverged = tmp_path / "d"
    fedweave.run(DIGITS_RUN, run_dir=diverged, callbacks=[_RaiseAt(2, DivergenceError("boom"))], on_divergence="return")
    interrupted = tmp_path / "i"
    with pytest.raises(KeyboardInterrupt):
        fedweave.run(DIGITS_RUN, run_dir=interrupted, callbacks=[_RaiseAt(2, KeyboardInterrupt())])
    runs = _all_runs(build_report([res.out_dir, diverged, interrupted]))
    with open(res.out_dir / "sweep.csv", newline="") as f:
        for rec in csv.DictReader(f):
            assert runs[rec["run_dir"].split("/")[-1]]["bytes total"] == _size(rec["bytes_total"]), rec
    assert runs["local.lr=1.0e_38,seed=0"]["bytes total"] != "-"  # diverged in round 1, no row
    for d in (diverged, interrupted):
        summary = json.loads((d / "summary.json").read_text())
        rows = fedweave.results.read_metrics(d)
        assert summary["communication"]["bytes_total"] > rows[-1]["bytes_total"]  # the premise: round 3 sent
        assert runs[d.name]["bytes total"] == _size(summary["communication"]["bytes_total"])


def test_report_says_why_a_run_stopped_early(tmp_path):
    """A run a callback ended (a target reached, the privacy budget) says why beside its status and in its
    detail, as summary.json's ``stopped_early`` (before: ``completed`` and ``3 of 10`` with no reason), the
    reason escaped as all the page's text is."""
    from fedweave.callbacks import StopAtTarget

    fedweave.run({**DIGITS_RUN, "rounds": 10}, run_dir=tmp_path / "t", callbacks=[StopAtTarget("test_accuracy", 0.5)])

    class Enough(fedweave.Callback):
        def after_round(self, run, r):
            return "loss < 1 & <b>enough</b>" if r == 1 else None

    fedweave.run({**DIGITS_RUN, "rounds": 10}, run_dir=tmp_path / "e", callbacks=[Enough()])
    fedweave.run(DIGITS_RUN, run_dir=tmp_path / "full")
    page = build_report([tmp_path / "t", tmp_path / "e", tmp_path / "full"])
    runs = _all_runs(page)
    reason = json.loads((tmp_path / "t" / "summary.json").read_text())["stopped_early"]
    assert reason.startswith("test_accuracy reached 0.5 at round ")
    assert runs["t"]["status"] == f"completed, stopped early: {reason}"
    assert runs["e"]["status"] == "completed, stopped early: loss < 1 & <b>enough</b>"
    assert runs["e"]["rounds"] == "2 of 10" and runs["full"]["status"] == "completed"
    assert "<b>enough</b>" not in page and "loss &lt; 1 &amp; &lt;b&gt;enough&lt;/b&gt;" in page
    details = re.findall(r"<p>status: (.*?)</p>", page)
    assert details[0].startswith(f"completed, stopped early: {reason}, rounds: ")
    assert details[1].startswith("completed, stopped early: loss &lt; 1 &amp; &lt;b&gt;enough&lt;/b&gt;, rounds: 2")
    assert details[2].startswith("completed, rounds: 3")


@pytest.fixture
def overlay(monkeypatch) -> dict[str, dict]:
    """Each figure of the report's overlay, by file name: its lines' labels, point counts and markers and its
    legend's texts; then it is drawn as before."""
    import fedweave.experiments.plots

    drawn: dict[str, dict] = {}
    save = fedweave.experiments.plots.save_png

    def keep(fig, path, dpi=120):
        ax = fig.axes[0]
        drawn[path.name] = {
            "lines": [(line.get_label(), len(line.get_xdata()), line.get_marker()) for line in ax.get_lines()],
            "legend": [t.get_text() for t in ax.get_legend().get_texts()],
        }
        return save(fig, path, dpi)

    monkeypatch.setattr(fedweave.experiments.plots, "save_png", keep)
    return drawn


def test_report_overlay_marks_a_run_of_one_row(tmp_path, overlay):
    """A run (or a sweep point) with one metrics row is a marker on the overlay (before: a line of one point, not
    drawn: only its legend entry); a run of several rows keeps its plain line."""
    fedweave.run({**DIGITS_RUN, "rounds": 1}, run_dir=tmp_path / "one")
    res = fedweave.sweep({**DIGITS_RUN, "rounds": 1}, {"local.lr": [0.05, 0.1]}, seeds=2, out=tmp_path / "s",
                         progress=False)  # fmt: skip
    fedweave.run(DIGITS_RUN, run_dir=tmp_path / "three")
    page = build_report([tmp_path / "one", res.out_dir, tmp_path / "three"])
    (section,) = re.findall(r'<section class="overlay">(.*?)</section>', page)
    figures = dict(re.findall(r'alt="([^"]+)" src="data:image/png;base64,([^"]+)"', section))
    for name in ("test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"):
        drawn = _colours(base64.b64decode(figures[name]))
        assert all(drawn[c] > 60 for c in ("#1f77b4", "#ff7f0e", "#2ca02c")), (name, drawn)  # over a legend handle
        *short, three = overlay[name]["lines"]
        assert [(label, n) for label, n, _ in short] == [("one", 1), ("s: local.lr=0.05", 1), ("s: local.lr=0.1", 1)]
        assert all(marker not in ("None", "", " ", None) for *_, marker in short)
        assert three == ("three", 3, "None")


def test_report_overlay_labels_a_diverged_run(tmp_path, overlay):
    """A diverged run is ``(diverged)`` in the overlay's legend, as an unfinished one is ``(unfinished)``; a sweep
    point of which some seeds diverged says how many (before: both as a completed run)."""
    from fedweave.errors import DivergenceError

    def boom() -> list:
        return [_RaiseAt(2, DivergenceError("boom"))]

    fedweave.run(DIGITS_RUN, run_dir=tmp_path / "ok")
    fedweave.run(DIGITS_RUN, run_dir=tmp_path / "bad", callbacks=boom(), on_divergence="return")
    page = build_report([tmp_path / "ok", tmp_path / "bad"])
    assert 'alt="test_accuracy_vs_rounds.png"' in page
    for name in ("test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"):
        assert overlay[name]["legend"] == ["ok", "bad (diverged)"], name

    res = fedweave.sweep(DIGITS_RUN, {"local.lr": [0.05, 0.1]}, seeds=2, out=tmp_path / "s", progress=False)
    one = res.out_dir / res.records[-1]["run_dir"]  # the second seed of local.lr=0.1
    summary = json.loads((one / "summary.json").read_text())
    (one / "summary.json").write_text(json.dumps({**summary, "status": "diverged"}))
    overlay.clear()
    build_report([res.out_dir])
    assert overlay["test_accuracy_vs_rounds.png"]["legend"] == ["local.lr=0.05", "local.lr=0.1 (1 of 2 diverged)"]


def test_the_report_of_one_run_says_so_and_hovers_over_values_only(toy_config, tmp_path):
    """One run's page said "Config shared by all 1 runs", and a cell without a value hovered "None"; a sweep point
    of one completed run hovered "std 0.0" where summary.csv has none."""
    from fedweave.experiments.report import write_report

    fedweave.run({**toy_config, "rounds": 2}, run_dir=tmp_path / "r")
    page = write_report([tmp_path / "r"], tmp_path / "one.html").read_text()
    assert "Config of the run (" in page and "shared by all 1 runs" not in page
    assert 'title="None"' not in page
    fedweave.sweep({**toy_config, "rounds": 2}, {"local.lr": [0.05, 0.1]}, out=tmp_path / "s", progress=False)
    page = write_report([tmp_path / "s"], tmp_path / "s.html").read_text()
    assert "over 1 completed run" in page and "std 0.0" not in page and 'title="None"' not in page
