"""Partition report: ``partition.csv`` (client, n, count per class) and ``partition.png`` (label histogram)."""

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


def _csv_bytes(hist: np.ndarray) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["client", "n", *[f"class_{k}" for k in range(hist.shape[1])]])
    for i, row in enumerate(hist):
        w.writerow([i, int(row.sum()), *map(int, row)])
    return buf.getvalue().encode()


def _png_bytes(hist: np.ndarray) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, num_classes = hist.shape
    fig, ax = plt.subplots(figsize=(min(16.0, 4.0 + 0.12 * m), 4.5))
    try:
        if num_classes <= _MAX_BAR_CLASSES and m <= _MAX_BAR_CLIENTS:
            cmap = plt.get_cmap("tab20" if num_classes > 10 else "tab10")
            bottom = np.zeros(m)
            for k in range(num_classes):
                ax.bar(np.arange(m), hist[:, k], bottom=bottom, width=0.9, color=cmap(k), label=str(k))
                bottom += hist[:, k]
            ax.set_ylabel("samples")
            ax.legend(title="class", fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
            ax.set_xlim(-0.6, m - 0.4)
        else:
            im = ax.imshow(hist.T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
            fig.colorbar(im, ax=ax, label="samples")
            ax.set_ylabel("class")
        ax.set_xlabel("client")
        ax.set_title(f"label histogram per client ({m} clients, {int(hist.sum())} samples)")
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
) -> dict[str, object]:
    """Write ``partition.csv`` (and ``partition.png`` if ``plot``) into ``out_dir`` atomically; return the stats."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = partition_stats(parts, labels, num_classes)
    hist = stats["histogram"]
    assert isinstance(hist, np.ndarray)
    atomic_write(out / "partition.csv", _csv_bytes(hist))
    if plot:
        atomic_write(out / "partition.png", _png_bytes(hist))
    return stats
