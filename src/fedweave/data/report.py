"""Partition report: ``partition.csv`` (client, n, count per class) and ``partition.png`` (label histogram).

For float targets (regression, multi-label) the "classes" are quantile bins of the first target column:
the columns are ``target_bin_<k>`` and the figure is a target histogram whose legend gives each bin's range."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedweave.data.partition import partition_stats
from fedweave.results import atomic_write

# Above these sizes a stacked bar chart is unreadable (and slow to draw): show a heat map instead.
_MAX_BAR_CLASSES = 20
_MAX_BAR_CLIENTS = 200


def _bin_ranges(edges: np.ndarray) -> list[str]:
    """``[lo, hi)`` of each target bin, the outer ones open-ended."""
    bounds = [-np.inf, *edges, np.inf]
    return [f"[{lo:.3g}, {hi:.3g})" for lo, hi in zip(bounds[:-1], bounds[1:])]


def _csv_bytes(hist: np.ndarray, column: str = "class") -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["client", "n", *[f"{column}_{k}" for k in range(hist.shape[1])]])
    for i, row in enumerate(hist):
        w.writerow([i, int(row.sum()), *map(int, row)])
    return buf.getvalue().encode()


def _png_bytes(hist: np.ndarray, bin_edges: np.ndarray | None = None) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, num_classes = hist.shape
    fig, ax = plt.subplots(figsize=(min(16.0, 4.0 + 0.12 * m), 4.5))
    try:
        if num_classes <= _MAX_BAR_CLASSES and m <= _MAX_BAR_CLIENTS:
            cmap = plt.get_cmap("tab20" if num_classes > 10 else "tab10")
            bottom = np.zeros(m)
            names = _bin_ranges(bin_edges) if bin_edges is not None else [str(k) for k in range(num_classes)]
            for k in range(num_classes):
                ax.bar(np.arange(m), hist[:, k], bottom=bottom, width=0.9, color=cmap(k), label=names[k])
                bottom += hist[:, k]
            ax.set_ylabel("samples")
            title = "target" if bin_edges is not None else "class"
            ax.legend(title=title, fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
            ax.set_xlim(-0.6, m - 0.4)
        else:
            im = ax.imshow(hist.T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
            fig.colorbar(im, ax=ax, label="samples")
            ax.set_ylabel("class" if bin_edges is None else "target quantile bin")
        ax.set_xlabel("client")
        what = "label histogram" if bin_edges is None else "target histogram (quantile bins)"
        ax.set_title(f"{what} per client ({m} clients, {int(hist.sum())} samples)")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    return buf.getvalue()


def write_partition_report(
    parts: Sequence[np.ndarray],
    labels: np.ndarray,
    num_classes: int,
    out_dir: str | os.PathLike[str],
    *,
    plot: bool = True,
    bin_edges: np.ndarray | None = None,
) -> dict[str, object]:
    """Write ``partition.csv`` (and ``partition.png`` if ``plot``) into ``out_dir`` atomically; return the stats.
    ``bin_edges``: the inner edges of the target quantile bins that ``labels`` index (float targets)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = partition_stats(parts, labels, num_classes)
    hist = stats["histogram"]
    assert isinstance(hist, np.ndarray)
    atomic_write(out / "partition.csv", _csv_bytes(hist, "class" if bin_edges is None else "target_bin"))
    if plot:
        atomic_write(out / "partition.png", _png_bytes(hist, bin_edges))
    return stats
