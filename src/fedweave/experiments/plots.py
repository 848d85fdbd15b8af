"""Sweep plots: a metric against rounds and against bytes, the mean over seeds with a +-1 std band per point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedweave.plots import _save, plt


def plot_sweep(curves: dict[str, list[list[dict[str, Any]]]], out_dir: str | Path, metric: str) -> list[Path]:
    """``curves`` maps a point's label to its seeds' metric rows. Seeds are cut to the shortest run."""
    out_dir = Path(out_dir)
    written = []
    for xkey, xlabel, scale, fname in (
        ("round", "communication round", 1.0, f"{metric}_vs_rounds.png"),
        ("bytes_total", "bytes communicated (MiB)", 2.0**-20, f"{metric}_vs_bytes.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for label, runs in curves.items():
            runs = [[r for r in rows if r.get(metric) is not None] for rows in runs]
            n = min((len(r) for r in runs), default=0)
            if n == 0:
                continue
            xs = np.array([[r[xkey] for r in rows[:n]] for rows in runs], dtype=float).mean(0) * scale
            ys = np.array([[r[metric] for r in rows[:n]] for rows in runs], dtype=float)
            m, sd = ys.mean(0), ys.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
            ax.plot(xs, m, label=label)
            ax.fill_between(xs, m - sd, m + sd, alpha=0.2)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _save(fig, out_dir / fname)
        written.append(out_dir / fname)
    return written
