"""``fedweave report``: one self-contained static HTML page (images inline, no network) for runs and sweeps.

It shows, per run: the metric table (metrics.csv; long floats to 6 significant digits, the exact value in
the cell's title), the plots and the partition figure, and the communication broken down by transfer kind;
across runs, the config keys that differ; per sweep, the summary table with the best point marked and the
sweep's plots.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path
from typing import Any

import yaml

from fedweave.results import atomic_write


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _cell(value: Any) -> str:
    """A table cell: a float (as read from a CSV or not) shown to 6 significant digits, its exact value in the
    cell's title; anything else as it is."""
    text = str(value)
    try:
        x = float(text)
    except ValueError:
        return f"<td>{html.escape(text)}</td>"
    short = f"{x:.6g}"
    if short == text or "." not in text and "e" not in text.lower():  # integers and short values stay as written
        return f"<td>{html.escape(text)}</td>"
    return f'<td title="{html.escape(text)}">{html.escape(short)}</td>'


def _table(rows: list[dict[str, Any]], cls: str, best: int | None = None) -> str:
    if not rows:
        return "<p>(no rows)</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = []
    for i, r in enumerate(rows):
        mark = ' class="best"' if i == best else ""
        cells = "".join(_cell(r.get(c, "")) for c in cols)
        body.append(f"<tr{mark}>{cells}</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _images(d: Path) -> str:
    out = []
    for p in sorted(d.glob("*.png")):
        data = base64.b64encode(p.read_bytes()).decode()
        out.append(f'<figure><img alt="{html.escape(p.name)}" src="data:image/png;base64,{data}">'
                   f"<figcaption>{html.escape(p.name)}</figcaption></figure>")  # fmt: skip
    return "".join(out)


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _run_section(d: Path, title: str) -> str:
    parts = [f'<section class="run"><h2>{html.escape(title)}</h2>']
    if (d / "summary.json").is_file():
        s = json.loads((d / "summary.json").read_text())
        parts.append(f"<p>status: {html.escape(str(s['status']))}, rounds: {s['rounds']}, "
                     f"wall {s['wall_seconds']} s</p>")  # fmt: skip
        kinds = s["communication"].get("by_transfer", {})
        rows = [{"transfer": k, "count": v["count"], "bytes": v["bytes"]} for k, v in kinds.items()]
        parts.append("<h3>Communication by transfer kind</h3>" + _table(rows, "comm"))
    if (d / "metrics.csv").is_file():
        parts.append("<h3>Metrics</h3>" + _table(_csv(d / "metrics.csv"), "metrics"))
    parts.append(_images(d) + "</section>")
    return "".join(parts)


def _runs_of(d: Path) -> list[Path]:
    return sorted(p for p in (d / "runs").iterdir() if p.is_dir()) if (d / "sweep.json").is_file() else [d]


def build_report(dirs: list[str | Path]) -> str:
    """The HTML page for run and sweep directories."""
    sections, runs = [], []
    for d in map(Path, dirs):
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a run or sweep directory")
        if (d / "sweep.json").is_file():
            summary = _csv(d / "summary.csv")
            best = next((i for i, r in enumerate(summary) if r.get("best") == "True"), None)
            sections.append(f'<section class="sweep"><h2>Sweep {html.escape(d.name)}</h2>'
                            + _table(summary, "summary", best) + _images(d) + "</section>")  # fmt: skip
        runs += _runs_of(d)
    configs = {p: _flat(yaml.safe_load((p / "config.yaml").read_text())) for p in runs if (p / "config.yaml").is_file()}
    keys = sorted({k for c in configs.values() for k in c})
    differ = [k for k in keys if len({json.dumps(c.get(k), default=str) for c in configs.values()}) > 1]
    if len(configs) > 1:
        rows = [{"run": p.name, **{k: c.get(k) for k in differ}} for p, c in configs.items()]
        sections.append("<section><h2>Config differences</h2>" + _table(rows, "config-diff") + "</section>")
    for p, c in configs.items():
        common = {k: v for k, v in c.items() if k not in differ}
        sections.append(f"<details><summary>config {html.escape(p.name)}</summary><pre>"
                        f"{html.escape(yaml.safe_dump(common, sort_keys=True))}</pre></details>")  # fmt: skip
    sections += [_run_section(p, p.name) for p in runs]
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:.5em 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}tr.best{font-weight:bold;"
             "background:#dfd}img{max-width:600px}figure{display:inline-block}")  # fmt: skip
    head = f"<head><meta charset='utf-8'><title>fedweave report</title><style>{style}</style></head>"
    return f"<!DOCTYPE html><html>{head}<body><h1>fedweave report</h1>{''.join(sections)}</body></html>"


def write_report(dirs: list[str | Path], out: str | Path) -> Path:
    out = Path(out)
    atomic_write(out, build_report(dirs))
    return out
