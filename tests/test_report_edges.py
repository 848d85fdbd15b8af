"""The report's and a sweep's figures past their common case: many curves, long labels, two run directories of
one name, one directory given twice. Figures are checked on their matplotlib objects and the files written."""

from __future__ import annotations

import re

import pytest
from matplotlib import rcParams
from matplotlib.colors import to_hex
from PIL import Image

import fedweave
from fedweave.cli import main as cli_main
from fedweave.experiments.plots import plot_curves
from fedweave.experiments.report import build_report

DIGITS_RUN = {  # scikit-learn's digits (nothing to download), a fraction of a second a round
    "name": "base", "rounds": 2, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "local": {"epochs": 1, "batch_size": 16, "lr": 0.05}, "output": {"progress": False, "plots": False},
}  # fmt: skip
TAB10 = [to_hex(c) for c in rcParams["axes.prop_cycle"].by_key()["color"]]


@pytest.fixture
def figures(monkeypatch) -> dict[str, dict]:
    """Each figure that :func:`plot_curves` saves, by file name: its lines' labels, colours and styles, its
    legend's texts and whether the legend overlaps the axes; then it is written as before."""
    import fedweave.experiments.plots

    drawn: dict[str, dict] = {}
    save = fedweave.experiments.plots.save_png

    def keep(fig, path, dpi=120):
        ax = fig.axes[0]
        fig.canvas.draw()
        legend = ax.get_legend()
        box, inner = legend.get_window_extent(), ax.get_window_extent()
        drawn[path.name] = {
            "lines": [
                (ln.get_label(), to_hex(ln.get_color()), ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()
            ],
            "legend": [t.get_text() for t in legend.get_texts()],
            "covers": box.overlaps(inner),
        }
        return save(fig, path, dpi)

    monkeypatch.setattr(fedweave.experiments.plots, "save_png", keep)
    return drawn


def _rows(k: int, n: int = 3) -> list[list[dict]]:
    return [[{"round": r, "bytes_total": 1000 * r, "test_accuracy": 0.1 * k + 0.01 * r} for r in range(1, n + 1)]]


def test_more_than_ten_curves_differ_in_colour_or_line_style(tmp_path, figures):
    """Past ten curves matplotlib's colour cycle repeats: the 11th was drawn as the 1st. Each curve now has its
    own (colour, line style); the first ten are drawn as before (the default colours, solid)."""
    curves = {f"p{k}": _rows(k) for k in range(25)}
    assert plot_curves(curves, tmp_path / "f.png", x="round", y="test_accuracy", xlabel="round") is not None
    lines = figures["f.png"]["lines"]
    assert [lb for lb, *_ in lines] == list(curves)
    styles = [(colour, style) for _, colour, style, _ in lines]
    assert len(set(styles)) == 25, styles
    assert styles[:10] == [(c, "-") for c in TAB10]
    assert styles[10][1] != "-" and styles[20][1] not in ("-", styles[10][1])
    again = dict(figures)
    plot_curves(curves, tmp_path / "f.png", x="round", y="test_accuracy", xlabel="round")
    assert figures["f.png"] == again["f.png"]  # deterministic

    # one-point curves (markers, no line to style) past ten differ in their marker
    curves = {f"p{k}": _rows(k, n=1) for k in range(12)}
    plot_curves(curves, tmp_path / "g.png", x="round", y="test_accuracy", xlabel="round")
    marks = [(colour, marker) for _, colour, _, marker in figures["g.png"]["lines"]]
    assert len(set(marks)) == 12, marks


def test_a_long_label_keeps_the_legend_off_the_axes_and_the_figure_its_width(tmp_path, figures):
    """A run of a 150-character name: its legend entry widened the figure and the legend covered the curves. Its
    label is now wrapped (the whole name kept) and the legend sits below the axes."""
    name = "algorithm.name=fedavg,local.lr=0.05," + ",".join(f"model.option_{k}=value_{k}" for k in range(5))
    name += "x" * (150 - len(name))
    plot_curves({name: _rows(1), "short": _rows(2)}, tmp_path / "long.png", x="round", y="test_accuracy",
                xlabel="round")  # fmt: skip
    plot_curves({"a": _rows(1), "short": _rows(2)}, tmp_path / "plain.png", x="round", y="test_accuracy",
                xlabel="round")  # fmt: skip
    got = figures["long.png"]
    assert not got["covers"]
    assert got["legend"][0].replace("\n", "") == name  # the whole name, wrapped
    assert max(len(line) for line in got["legend"][0].splitlines()) <= 40
    with Image.open(tmp_path / "long.png") as long, Image.open(tmp_path / "plain.png") as plain:
        assert long.width <= plain.width * 1.05, (long.width, plain.width)
    assert figures["plain.png"]["legend"] == ["a", "short"]  # short labels: the legend as before


def test_two_runs_of_one_name_are_labelled_by_the_path_part_that_tells_them_apart(tmp_path, figures):
    """Two run directories ``a/ok`` and ``b/ok`` were ``ok`` and ``ok'`` in the legend, said nowhere; they are now
    labelled ``a/ok`` and ``b/ok``, in the legend and in their sections' titles."""
    for parent in ("a", "b"):
        fedweave.run(DIGITS_RUN, run_dir=tmp_path / parent / "ok")
    page = build_report([tmp_path / "a" / "ok", tmp_path / "b" / "ok"])
    assert figures["test_accuracy_vs_rounds.png"]["legend"] == ["a/ok", "b/ok"]
    assert re.findall(r"<h2>(Run [^<]*)</h2>", page) == ["Run a/ok", "Run b/ok"]


def test_one_directory_given_twice_is_one_line(tmp_path, capsys):
    """The same run given twice drew two identical curves (``ok`` and ``ok'``) and tabulated it twice."""
    fedweave.run(DIGITS_RUN, run_dir=tmp_path / "ok")
    out = tmp_path / "r.html"
    assert cli_main(["report", str(tmp_path / "ok"), str(tmp_path / "." / "ok"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fedweave: error: {tmp_path / 'ok'} is given twice; give each directory once"
    assert not out.exists()


def test_fedweave_plot_of_many_runs_tells_each_apart_and_wraps_a_long_name(tmp_path, monkeypatch):
    """``fedweave plot`` overlaying more than ten runs drew the 11th as the 1st (matplotlib's cycle) and put a long
    run name's legend over the axes: it styles and places its legend as the report does."""
    import fedweave.plots

    drawn = {}
    save = fedweave.plots.save_png

    def keep(fig, path, dpi=120):
        ax = fig.axes[0]
        fig.canvas.draw()
        lines = {(to_hex(ln.get_color()), ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()}
        drawn[path.name] = (len(ax.get_lines()), len(lines), ax.get_legend().get_window_extent().overlaps(
            ax.get_window_extent()), [t.get_text() for t in ax.get_legend().get_texts()])  # fmt: skip
        return save(fig, path, dpi)

    monkeypatch.setattr(fedweave.plots, "save_png", keep)
    long = "a-run-whose-name-is-much-longer-than-a-legend-line-holds"
    runs = []
    for k in range(12):
        name = long if k == 0 else f"r{k}"  # a run's label is its directory's name
        res = fedweave.run({**DIGITS_RUN, "seed": k, "output": {**DIGITS_RUN["output"], "dir": str(tmp_path / name)}})
        runs.append(res.run_dir)
    assert cli_main(["plot", *map(str, runs), "--out", str(tmp_path / "plots")]) == 0
    n, distinct, covers, texts = drawn["test_accuracy_vs_rounds.png"]
    assert (n, distinct, covers) == (12, 12, False)
    assert "\n" in texts[0] and texts[0].replace("\n", "") == long


def test_fedweave_plot_of_one_run_given_twice_is_one_line(tmp_path, capsys):
    """Two identical curves under one label, as the report drew them before it refused a directory given twice."""
    res = fedweave.run({**DIGITS_RUN, "output": {**DIGITS_RUN["output"], "dir": str(tmp_path / "r")}})
    assert cli_main(["plot", str(res.run_dir), str(tmp_path / "." / "r"), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fedweave: error: {tmp_path / 'r'} is given twice; give each run directory once"
    assert not (tmp_path / "p").exists()
