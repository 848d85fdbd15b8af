"""Plots of experiments: a metric against rounds or bytes (or any per-round column), the mean over seeds with
a +-1 std band, one line per grid point. A sweep draws two; the reproductions draw these curves into their
own figures and panels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedweave.experiments.aggregate import group
from fedweave.plots import curve_style, lone_marker, place_legend, plt, save_png, wrap_label


def band(
    ax: Any,
    runs: list[list[dict[str, Any]]],
    x: str,
    y: str,
    *,
    label: str,
    xscale: float = 1.0,
    yscale: float = 1.0,
    **line: Any,
) -> bool:
    """Draw ``y`` against ``x`` for one grid point on ``ax``: the mean over its seeds' metric rows and a +-1
    std band (sample std; none for one seed). Rows without ``y`` are left out and the seeds are cut to the
    shortest; x is the seeds' mean (bytes differ between seeds). A curve of one point is a marker
    (:func:`lone_marker`). False when there is nothing to draw."""
    runs = [[r for r in rows if r.get(y) is not None] for rows in runs]
    n = min((len(r) for r in runs), default=0)
    if n == 0:
        return False
    line = lone_marker(n, line)
    xs = np.array([[r[x] for r in rows[:n]] for rows in runs], dtype=float).mean(0) * xscale
    ys = np.array([[r[y] for r in rows[:n]] for rows in runs], dtype=float) * yscale
    m, sd = ys.mean(0), ys.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
    (drawn,) = ax.plot(xs, m, label=label, **line)
    if len(runs) > 1:
        ax.fill_between(xs, m - sd, m + sd, alpha=0.2, color=drawn.get_color())
    return True


def plot_curves(
    curves: dict[str, list[list[dict[str, Any]]]],
    path: str | Path,
    *,
    x: str,
    y: str,
    xlabel: str,
    ylabel: str | None = None,
    xscale: float = 1.0,
    yscale: float = 1.0,
    logx: bool = False,
    title: str | None = None,
    styles: dict[str, dict[str, Any]] | None = None,
    dpi: int = 120,
) -> Path | None:
    """One figure of ``y`` against ``x``, a :func:`band` per label of ``curves`` (label -> its seeds' metric
    rows); ``styles`` gives a label its own line style. None (and no file) when nothing could be drawn."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn: list[bool] = []
    for lb, runs in curves.items():
        points = min((sum(r.get(y) is not None for r in rows) for rows in runs), default=0)
        style = {**curve_style(sum(drawn), points < 2), **(styles or {}).get(lb, {})}  # a label's own style wins
        drawn.append(band(ax, runs, x, y, label=wrap_label(lb), xscale=xscale, yscale=yscale, **style))
    if not any(drawn):
        plt.close(fig)
        return None
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    place_legend(ax, [wrap_label(lb) for lb, d in zip(curves, drawn) if d])
    return save_png(fig, path, dpi)


def diverged_mark(statuses: list[str]) -> str:
    """What a curve's legend label says of the diverged runs among the ``statuses`` of every run of its point:
    `` (diverged)`` when all are (as ``fedweave plot`` labels one), `` (K of N diverged)`` for some seeds (their
    band ends with the shortest of them), nothing when none is."""
    from fedweave.plots import DIVERGED_MARK

    k = statuses.count("diverged")
    if k == 0:
        return ""
    return DIVERGED_MARK if k == len(statuses) else f" ({k} of {len(statuses)} diverged)"


def plot_sweep(curves: dict[str, list[list[dict[str, Any]]]], out_dir: str | Path, metric: str) -> list[Path]:
    """``metric`` against rounds and against bytes, ``curves`` mapping a point's label to its seeds' rows."""
    out_dir = Path(out_dir)
    rounds = plot_curves(curves, out_dir / f"{metric}_vs_rounds.png", x="round", y=metric, xlabel="communication round")
    mib = 2.0**-20
    by_bytes = plot_curves(curves, out_dir / f"{metric}_vs_bytes.png", x="bytes_total", y=metric, xscale=mib,
                           xlabel="bytes communicated (MiB)")  # fmt: skip
    return [p for p in (rounds, by_bytes) if p is not None]


@dataclass
class Panel:
    """One panel of a figure: its lines, each ``(label, its seeds' metric rows, line style)`` drawn as a
    :func:`band` of ``y`` (times ``yscale``) against ``x``; its title, axis labels, a log y axis, and the
    legend's keywords (None: no legend)."""

    lines: list[tuple[str, list[list[dict[str, Any]]], dict[str, Any]]]
    y: str
    x: str = "round"
    yscale: float = 1.0
    title: str | None = None
    xlabel: str | None = None
    ylabel: str | None = None
    logy: bool = False
    legend: dict[str, Any] | None = field(default_factory=dict)


def plot_panels(
    grid: list[list[Panel]], path: str | Path, *, panel_size: tuple[float, float], sharey: bool = False, dpi: int = 120
) -> Path:
    """One figure of panels, ``grid[row][column]``, each ``panel_size`` inches; written as ``path``."""
    rows, cols = len(grid), len(grid[0])
    size = (panel_size[0] * cols, panel_size[1] * rows)
    fig, axes = plt.subplots(rows, cols, figsize=size, sharey=sharey, squeeze=False)
    for i, row in enumerate(grid):
        for j, panel in enumerate(row):
            ax = axes[i, j]
            for label, runs, style in panel.lines:
                band(ax, runs, panel.x, panel.y, label=label, yscale=panel.yscale, **style)
            if panel.title:
                ax.set_title(panel.title)
            if panel.xlabel:
                ax.set_xlabel(panel.xlabel)
            if panel.ylabel:
                ax.set_ylabel(panel.ylabel)
            if panel.logy:
                ax.set_yscale("log")
            if panel.legend is not None and ax.get_legend_handles_labels()[0]:  # a panel whose runs have no rows
                ax.legend(**panel.legend)
    fig.tight_layout()
    return save_png(fig, path, dpi=dpi)


@dataclass
class Lines:
    """One panel of plain lines (a run's trace, no seeds to band): ``lines`` as (x, y, label); ``draw`` the
    axes' method (``plot``, ``semilogy``, ``loglog``); a legend at ``legend`` font size when set."""

    lines: list[tuple[Any, Any, str]]
    draw: str = "plot"
    xlabel: str = ""
    ylabel: str = ""
    legend: float | None = None


def plot_lines(panels: list[Lines], path: str | Path, figsize: tuple[float, float], title: str | None = None,
               dpi: int = 110) -> Path:  # fmt: skip
    """The panels side by side in one figure (a light grid on each), written as a PNG."""
    fig, axes = plt.subplots(1, len(panels), figsize=figsize)
    for ax, panel in zip(np.atleast_1d(axes), panels):
        for x, y, label in panel.lines:
            getattr(ax, panel.draw)(x, y, label=label, lw=1)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if panel.legend is not None:
            ax.legend(fontsize=panel.legend)
    if title is not None:
        fig.suptitle(title)
    return save_png(fig, path, dpi=dpi)


def seed_lines(
    records: list[dict[str, Any]],
    key: str,
    order: Sequence[Any] | None = None,
    label: Callable[[Any], str] = str,
    style: Callable[[Any], dict[str, Any]] | None = None,
    rows: str = "_rows",
) -> list[tuple[str, list[list[dict[str, Any]]], dict[str, Any]]]:
    """A ``Panel``'s lines declared by a key of the records: one line per value of ``key`` (those of ``order``
    that ran, else in order of first appearance), the metric ``rows`` of its records (its seeds: the band),
    labelled ``label(value)`` and styled ``style(value)``."""
    by = group(records, lambda r: r[key])
    keys = [k for k in order if k in by] if order is not None else list(by)
    return [(label(k), [r[rows] for r in by[k]], style(k) if style else {}) for k in keys]
