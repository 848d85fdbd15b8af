"""What the figures of a run and of ``fedweave plot`` show: a run of one evaluated round is drawn (a line of one
point was invisible), and a diverged run is named as such in the legend."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedweave
import fedweave.callbacks
import fedweave.plots
from fedweave.cli import main as cli_main
from fedweave.errors import DivergenceError

BLUE = "#1f77b4"  # matplotlib's first line colour: the first run drawn


@pytest.fixture
def digits() -> dict:
    """A FedAvg run on scikit-learn's digits, a fraction of a second a round."""
    return {
        "name": "base", "rounds": 3, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4},
        "model": {"name": "logistic"}, "algorithm": {"name": "fedavg", "clients_per_round": 4},
        "local": {"epochs": 1, "batch_size": 16, "lr": 0.05}, "output": {"progress": False, "plots": False},
    }  # fmt: skip


class _DivergeAt(fedweave.callbacks.Callback):
    """Ends the run as diverged in training round ``at`` (0-based), as a NaN loss would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def after_training(self, run, r, metrics):
        if r == self.at:
            raise DivergenceError(f"round {r + 1}: train_loss is not finite")


def _ink(png: Path, colour: str) -> int:
    """How many pixels of the figure ``png`` are drawn in ``colour`` (a line's, its markers' and its legend
    handle's)."""
    rgb = np.asarray(Image.open(io.BytesIO(png.read_bytes())).convert("RGB")).reshape(-1, 3)
    return int((rgb == [int(colour[i : i + 2], 16) for i in (1, 3, 5)]).all(1).sum())


# a legend handle alone is about 24 pixels of its colour; a marker beside it is well over this
SEEN = 60


@pytest.fixture
def figures(monkeypatch) -> dict[str, dict]:
    """Each figure ``fedweave.plots`` writes, by file name: its lines' labels, point counts and markers, and its
    legend's texts (None: no legend); then it is written as before."""
    drawn: dict[str, dict] = {}
    save = fedweave.plots.save_png

    def keep(fig, path, dpi=120):
        ax = fig.axes[0]
        legend = ax.get_legend()
        drawn[path.name] = {
            "lines": [(line.get_label(), len(line.get_xdata()), line.get_marker()) for line in ax.get_lines()],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else None,
        }
        return save(fig, path, dpi)

    monkeypatch.setattr(fedweave.plots, "save_png", keep)
    return drawn


def test_a_run_of_one_round_is_seen_in_its_own_plots(digits, tmp_path):
    """``rounds=1``: one metrics row, a line of one point (before: an empty figure, no pixel of the line's colour)."""
    fedweave.run({**digits, "rounds": 1, "output": {"progress": False, "plots": True}}, run_dir=tmp_path / "r")
    for name in ("test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"):
        assert _ink(tmp_path / "r" / name, BLUE) > SEEN, name


def test_plot_marks_a_run_of_one_row_beside_longer_runs(digits, tmp_path, figures):
    """``fedweave plot`` of a run of one row and one of three: the short run has a marker (before: only its legend
    entry), the other keeps its plain line (its figure unchanged)."""
    fedweave.run({**digits, "rounds": 1}, run_dir=tmp_path / "one")
    fedweave.run(digits, run_dir=tmp_path / "three")
    out = tmp_path / "p"
    assert cli_main(["plot", str(tmp_path / "one"), str(tmp_path / "three"), "--out", str(out)]) == 0
    for name in ("test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"):
        assert _ink(out / name, BLUE) > SEEN, name
        one, three = figures[name]["lines"]
        assert one[:2] == ("one", 1) and one[2] not in ("None", "", " ", None)
        assert three == ("three", 3, "None")  # a line of two points or more is drawn as it always was


def test_plot_labels_a_diverged_run_as_diverged(digits, tmp_path, figures):
    """A run whose summary.json says ``diverged`` is ``(diverged)`` in the legend of ``fedweave plot`` (before: as
    a completed run), also when it is plotted alone (its own figures then have a legend to say so)."""
    fedweave.run(digits, run_dir=tmp_path / "ok")
    fedweave.run(digits, run_dir=tmp_path / "bad", callbacks=[_DivergeAt(2)], on_divergence="return")
    out = tmp_path / "p"
    assert cli_main(["plot", str(tmp_path / "ok"), str(tmp_path / "bad"), "--out", str(out)]) == 0
    for name in ("test_accuracy_vs_rounds.png", "test_accuracy_vs_bytes.png"):
        assert figures[name]["legend"] == ["ok", "bad (diverged)"], name
    figures.clear()
    assert cli_main(["plot", str(tmp_path / "bad"), "--out", str(tmp_path / "q")]) == 0
    assert figures["test_accuracy_vs_rounds.png"]["legend"] == ["bad (diverged)"]
    figures.clear()
    assert cli_main(["plot", str(tmp_path / "ok"), "--out", str(tmp_path / "r")]) == 0
    assert figures["test_accuracy_vs_rounds.png"]["legend"] is None  # one completed run: no legend, as before


def test_a_round_axis_has_whole_numbers_only(digits, tmp_path):
    """A short run's round axis read 1.25, 2.5."""
    from fedweave.plots import plot_runs

    fedweave.run(digits, run_dir=tmp_path / "r")
    fig_ticks = []
    real_save = fedweave.plots.save_png

    def keep_ticks(fig, path, dpi=120):
        fig_ticks.append(
            [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
        )
        return real_save(fig, path, dpi)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(fedweave.plots, "save_png", keep_ticks)
    try:
        plot_runs([tmp_path / "r"], tmp_path / "p")
    finally:
        monkeypatch.undo()
    assert fig_ticks[0] and all(float(t).is_integer() for t in fig_ticks[0]), fig_ticks[0]
