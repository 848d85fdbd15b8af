"""A sweep's tables: one row per run (sweep.csv) and one per point over its seeds (summary.csv, summary.md)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from fedweave.results import atomic_write


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4f}"
    return "-" if v is None else str(v)


def markdown(rows: list[dict[str, Any]], best: int | None = None) -> str:
    """A markdown table of ``rows``; the row at index ``best`` is marked in bold."""
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, r in enumerate(rows):
        cells = [_fmt(r.get(c)) for c in cols]
        if i == best:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
