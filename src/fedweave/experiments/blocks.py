"""Blocks of a reproduction page that every paper writes alike: its claims' table, what its committed runs cost,
whether the runs that several presets share give the same numbers, and one method's gap to the others round by
round."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedweave.experiments.aggregate import group, mean_std
from fedweave.experiments.study import HELD, Verdict
from fedweave.experiments.tables import markdown_table, pm, signed


def verdict_cell(v: Verdict) -> str:
    """A verdict's cell: its declared rule's line (estimate, interval, test, n, outcome), else its word."""
    return v.interval or HELD[v.held]


def claim_table(judged: Sequence[tuple[str, Verdict]]) -> str:
    """The claims' table of a page: per (records file, verdict), the claim, the file, the verdict
    (``verdict_cell``) and what was measured."""
    rows = [[v.claim, f"`{src}`", verdict_cell(v), v.measured] for src, v in judged]
    return markdown_table(["claim", "source", "verdict", "measured"], rows)


def cost_line(rows: Sequence[Mapping[str, Any]], source: str, by: str | None = None, label: Callable = str) -> str:
    """What committed runs cost: their number and summed ``cpu_seconds`` (one torch thread each), the span per
    run, per value of ``by`` (``label``-led) where it changes the work per run; the wall time of a shared machine
    is not a cost, so it is left out. ``source`` names the records file."""
    cpu = [r["cpu_seconds"] for r in rows]
    groups = group(list(rows), lambda r: r[by]) if by else {"": rows}
    spans = ", ".join(
        f"{min(c):.0f}–{max(c):.0f} s" + (f" at {label(v)}" if v else " each")
        for v, c in ((v, [r["cpu_seconds"] for r in rs]) for v, rs in groups.items())
    )
    return (
        f"Cost: {len(rows)} runs, {sum(cpu):,.0f} CPU-seconds in total ({spans}; `cpu_seconds` of\n"
        f"`{source}`, one torch thread per run).\n"
    )


def run_values(rows: Sequence[Mapping[str, Any]], value: str, keep: Callable, method: Callable | None = None) -> dict:
    """Per (method, seed) of the ``rows`` that ``keep`` keeps, its ``value``: one preset's side of
    ``same_runs_table``; ``method(row)`` names a row's method (by default its ``method``)."""
    return {(method(r) if method else r["method"], r["seed"]): r[value] for r in rows if keep(r)}


def same_runs_table(runs: Mapping[str, Mapping[tuple, float]], order: Callable, label: Callable[[Any], str]) -> str:
    """For every two presets of ``runs`` (a name -> its value per (method, seed) run): the methods (``label``) of
    their common runs (in ``order``), how many of those give the same value and the largest difference."""
    names, body = list(runs), []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if not (common := sorted(set(runs[a]) & set(runs[b]), key=order)):
                continue
            diffs = [abs(runs[a][k] - runs[b][k]) for k in common]
            methods = ", ".join(label(m) for m in dict.fromkeys(m for m, _ in common))
            body.append([a, b, methods, f"{sum(d == 0 for d in diffs)} of {len(diffs)}", f"{max(diffs):.2f}"])
    return markdown_table(["runs", "against", "methods", "runs equal", "largest difference (points)"], body)


def gap_table(rows: Sequence[Mapping[str, Any]], methods: Sequence[str], ref: str, label: Callable) -> str:
    """Per ``round`` of ``rows`` (a method's ``accuracy`` at a round and seed), each method's accuracy (mean ± std
    over the seeds that reached it) and ``ref`` minus each other method, the mean and per seed."""
    acc = {(r["method"], r["round"], r["seed"]): r["accuracy"] for r in sorted(rows, key=lambda r: r["seed"])}
    others, body = [m for m in methods if m != ref], []
    for t in sorted({r["round"] for r in rows}):
        a = {m: {s: x for (n, u, s), x in acc.items() if (n, u) == (m, t)} for m in methods}
        cells = [pm(*mean_std([*a[m].values()])) if a[m] else "–" for m in methods]
        for m in others:
            g = [a[ref][s] - x for s, x in a[m].items() if s in a[ref]]
            cells.append(f"{signed(sum(g) / len(g))} ({', '.join(map(signed, g))})" if g else "–")
        body.append([t, *cells])
    return markdown_table(["round", *map(label, methods), *(f"{label(ref)} − {label(m)}" for m in others)], body)
