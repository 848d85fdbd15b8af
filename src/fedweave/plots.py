"""Plots of run directories: a metric (the task's main one by default) against rounds and against bytes."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedweave.results import atomic_write, holds_run, read_metrics, run_metric  # noqa: E402

log = logging.getLogger("fedweave")

# the simulated clock's axis label per faults.work_unit (docs/reliability.md): round keeps the label it always had
CLOCK_LABELS = {"round": "simulated time", "step": "simulated time (local steps of a median-speed client)"}


# a text chunk of every PNG written here: a later plot may replace such a file, never one without it
PNG_MARK = {"fedweave": "plot"}


def save_png(fig, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG (marked as fedweave's: :func:`is_plot`), atomically, and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata=PNG_MARK)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
    return Path(path)


def lone_marker(points: int, style: dict[str, Any] | None = None) -> dict[str, Any]:
    """The line style ``style`` of a curve of ``points`` points, with a marker where it has fewer than 2 (a run of
    one evaluated round): a line needs two points, so one alone would draw nothing but its legend entry. A curve
    of two points or more, or one whose style names its own marker, is drawn as styled."""
    style = dict(style or {})
    if points < 2:
        style.setdefault("marker", "o")
    return style


CYCLE = 10  # matplotlib's default colours, after which its cycle repeats them
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("s", "^", "D", "v", "P", "X", "*")  # not "o", a lone point's own (lone_marker)
LEGEND_WIDTH = 40  # characters of a legend line: a longer label is wrapped


def curve_style(k: int, lone: bool = False) -> dict[str, Any]:
    """The style of the ``k``-th curve drawn on one figure: the first :data:`CYCLE` as matplotlib draws them (its
    colours in turn, solid), then each further ten again in those colours with the next line style, so that no
    two of ``CYCLE * len(LINE_STYLES)`` curves look alike, and past those with a marker as well. A ``lone`` curve
    (one point: a marker, no line to style) past the first ten has the next marker instead."""
    if k < CYCLE:
        return {}
    turn = k // CYCLE
    style = {"color": plt.rcParams["axes.prop_cycle"].by_key()["color"][k % CYCLE]}
    if lone:
        return {**style, "marker": MARKERS[(turn - 1) % len(MARKERS)]}
    style["linestyle"] = LINE_STYLES[turn % len(LINE_STYLES)]
    if turn >= len(LINE_STYLES):
        style["marker"] = MARKERS[(turn - len(LINE_STYLES)) % len(MARKERS)]
    return style


def wrap_label(label: str, width: int = LEGEND_WIDTH) -> str:
    """``label`` in lines of at most ``width`` characters, broken after a comma where one is (a sweep point's
    ``key=value,...``), else cut: a long run name no longer widens the figure; the whole name is kept."""
    lines, line = [], ""
    for piece in re.findall(r"[^,]*,|[^,]+", label):
        while len(piece) > width:  # a part without a comma to break at
            room = width - len(line)
            lines.append(line + piece[:room])
            line, piece = "", piece[room:]
        if len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
    return "\n".join([*lines, line]) if lines else label


def place_legend(ax, labels: list[str]) -> None:
    """The legend of ``ax``'s curves, labelled ``labels`` (as :func:`wrap_label` gives them): inside the axes, as
    matplotlib places it, for up to :data:`CYCLE` one-line labels; else below the axes, which it would cover, in
    as many columns as the figure's width holds."""
    if len(labels) <= CYCLE and all("\n" not in lb for lb in labels):
        ax.legend(fontsize=7)
        return
    widest = max(len(line) for lb in labels for line in lb.splitlines())
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=max(1, 96 // (widest + 8)))


def is_plot(path: str | Path) -> bool:
    """Whether ``path`` is a PNG that :func:`save_png` wrote (its text chunk says so)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and all(image.text.get(k) == v for k, v in PNG_MARK.items())
    except (OSError, UnidentifiedImageError):
        return False


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path, metric: str | None = None) -> list[Path]:
    """``metric`` vs rounds and vs total bytes (up + down + lateral) for one or more runs; by default the
    main metric of the first run's task (its ``summary.json``), or for a run whose rows have none (a
    confederated run on its synthetic problem) the column its own plots show (``opt_gap``), as ``fedweave
    plot`` does; ``test_accuracy`` when no run has a readable summary. ``run_dirs`` is a
    list even for one run: a single path is a TypeError (it was read as one run per character). A run of one
    row is a marker (:func:`lone_marker`); a diverged run is labelled ``(diverged)`` (:func:`_status_mark`), in a
    legend even when it is drawn alone."""
    if isinstance(run_dirs, str | Path):
        raise TypeError(f"run_dirs must be a list of run directories, e.g. [{str(run_dirs)!r}]; got one path")
    if not run_dirs:
        raise ValueError("run_dirs is empty: give at least one run directory to plot")
    resolved = [Path(d).resolve() for d in run_dirs]
    if twice := next((d for d, p in zip(run_dirs, resolved) if resolved.count(p) > 1), None):
        raise ValueError(f"{twice} is given twice; give each run directory once")  # two curves of one run
    out_dir = Path(out_dir)
    metric = metric or _main_metric(run_dirs)
    every = [(d, _rows(d)) for d in run_dirs]
    if not any(rows for _, rows in every):
        given = ", ".join(map(str, run_dirs))
        raise ValueError(f"{given}: no metrics row yet (metrics.jsonl): no run has evaluated a round to plot")
    series, left, drawn, marked = [], [], [], False
    for (d, all_rows), label in zip(every, distinct_names(run_dirs)):
        rows = [r for r in all_rows if r.get(metric) is not None]
        if rows:
            mark = _status_mark(d)
            marked |= bool(mark)
            series.append((label + mark, rows))
            drawn.append(d)
        else:
            left.append(str(d))
    if not series:
        known = sorted({k for _, rows in every for r in rows for k, v in r.items() if isinstance(v, float)})
        raise ValueError(
            f"--metric {metric!r} is not a metric of {', '.join(map(str, run_dirs))}; choose one of {', '.join(known)}"
        )
    if left:  # a run asked for is never left out unsaid
        log.warning("not drawn, no row with %s: %s", metric, ", ".join(left))
    written = []
    axes = [
        ("round", "communication round", f"{metric}_vs_rounds.png"),
        ("bytes_total", "bytes communicated (MiB)", f"{metric}_vs_bytes.png"),
    ]
    if all(r.get("sim_time") is not None for _, rows in series for r in rows):  # a simulated clock
        label = clock_label(drawn)
        if label is not None:
            axes.append(("sim_time", label, f"{metric}_vs_sim_time.png"))
    # a run directory's plots are its own: redrawn from its own rows only, never replaced by other runs' curves
    if holds_run(out_dir) and [Path(d).resolve() for d in run_dirs] != [out_dir.resolve()]:
        raise ValueError(
            f"{out_dir} holds a run, whose own plots ({axes[0][2]}, ...) these curves would replace; give another "
            "folder"
        )
    # outside a run directory a file that is not a fedweave plot is never replaced
    mine = [] if holds_run(out_dir) else [f for *_, f in axes if (out_dir / f).exists() and not is_plot(out_dir / f)]
    if mine:
        raise ValueError(
            f"{out_dir / mine[0]} exists and is not a fedweave plot; give another folder (an earlier plot is replaced)"
        )
    for xkey, xlabel, fname in axes:
        fig, ax = plt.subplots(figsize=(6, 4))
        for k, (label, rows) in enumerate(series):
            xs = [r.get(xkey, r.get("bytes_up", 0) + r.get("bytes_down", 0)) for r in rows]
            if xkey == "bytes_total":
                xs = [x / 2**20 for x in xs]
            style = lone_marker(len(rows), curve_style(k, len(rows) < 2))
            ax.plot(xs, [r[metric] for r in rows], label=wrap_label(label), **style)
        ax.set_xlabel(xlabel)
        if xkey == "round":  # rounds are whole numbers (a short run's axis read 1.25, 2.5)
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
        # one run needs no legend to tell its line, but a diverged one needs it to say so
        if len(series) > 1 or marked:
            place_legend(ax, [wrap_label(label) for label, _ in series])
        save_png(fig, out_dir / fname)
        written.append(out_dir / fname)
    return written


DIVERGED_MARK = " (diverged)"  # after a diverged run's legend label: its curve ends where it blew up


def _status_mark(run_dir: str | Path) -> str:
    """:data:`DIVERGED_MARK` for a run whose ``summary.json`` says ``diverged``, else nothing (a completed run, one
    without a readable summary)."""
    try:
        status = json.loads((Path(run_dir) / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return ""
    return DIVERGED_MARK if status == "diverged" else ""


def distinct_names(paths: list[str | Path]) -> list[str]:
    """Each directory's name as a legend or a page shows it: its own ('.' resolved), or where others given share
    it (``a/ok``, ``b/ok``: a grid's point in two sweeps) its last parts as far as they tell it apart from those."""
    parts = [Path(p).resolve().parts for p in paths]
    out = []
    for ps in parts:
        k = 1
        while k < len(ps) and sum(q[-k:] == ps[-k:] for q in parts) > 1:
            k += 1
        out.append(str(Path(*ps[-k:])))
    return out


def _rows(run_dir: str | Path) -> list[dict]:
    """A run's metric rows: none for a run directory without ``metrics.jsonl`` (a run that diverged before its
    first evaluation, or one that has not finished it yet), as a sweep records such a run; a directory that
    is not a run's is :func:`read_metrics`' error."""
    d = Path(run_dir)
    if not (d / "metrics.jsonl").is_file() and any((d / f).is_file() for f in ("config.yaml", "summary.json")):
        return []
    return read_metrics(d)


def _main_metric(run_dirs: list[str | Path]) -> str:
    """The first run's own column (:func:`run_metric`), else ``test_accuracy``."""
    for d in run_dirs:
        try:
            key = run_metric(json.loads((Path(d) / "summary.json").read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if key:
            return key
    return "test_accuracy"


def work_unit(run_dir: str | Path) -> str:
    """The unit of a run's simulated clock, ``faults.work_unit`` of its ``config.yaml`` (``round`` when the key is
    left out, as ``config.yaml`` leaves out the default, or the file is unreadable)."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "round"
    faults = cfg.get("faults") if isinstance(cfg, dict) else None
    return str((faults or {}).get("work_unit", "round"))


def clock_label(run_dirs: list[str | Path]) -> str | None:
    """The simulated-time axis label of runs on one clock unit, or None (with a warning) when their units differ:
    a mean client's round and a local step are not one axis, so the plot against simulated time is not drawn."""
    units = {work_unit(d) for d in run_dirs}
    if len(units) > 1:
        log.warning(
            "no plot against simulated time: the runs' clocks have different units (faults.work_unit: %s)",
            ", ".join(sorted(units)),
        )
        return None
    return CLOCK_LABELS.get(units.pop() if units else "round", "simulated time")
