"""Tables of experiments, as CSV and markdown: a sweep's sweep.csv and summary.csv/.md, and every table of
the paper reproductions."""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedweave.experiments.aggregate import finite, mean_std
from fedweave.results import atomic_write


def write_csv(
    path: str | Path,
    rows: Sequence[dict[str, Any]] | Sequence[Sequence[Any]],
    columns: list[str] | None = None,
    float_format: str | None = None,
) -> None:
    """Write ``rows`` atomically as CSV (:func:`csv_text`)."""
    atomic_write(path, csv_text(rows, columns, float_format))


def csv_text(
    rows: Sequence[dict[str, Any]] | Sequence[Sequence[Any]],
    columns: list[str] | None = None,
    float_format: str | None = None,
) -> str:
    """``rows`` as CSV text with ``\\n`` line ends. Dict rows: under ``columns`` (other keys ignored), by
    default every key in order of first appearance except private ``_keys``. List rows: under the header
    ``columns``. ``float_format`` (e.g. ``".6g"``) formats the floats; by default they are written in full."""
    if rows and not isinstance(rows[0], dict):
        rows = [dict(zip(columns or [], r)) for r in rows]
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns and not k.startswith("_")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: format(v, float_format) if float_format and isinstance(v, float) else v for k, v in r.items()})
    return buf.getvalue()


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a CSV file :func:`write_csv` wrote, typed back: an empty cell is None, ``True``/``False``
    a bool, a number an int or float (as written), anything else text."""
    with open(path, encoding="utf-8", newline="") as f:
        return [{k: _typed(v) for k, v in r.items()} for r in csv.DictReader(f)]


# A number as csv_text writes one: an int's str, a float's repr or its float_format (e, f, g; E, F, G). int() and
# float() read more (1_000, " 7", "007", "+1", "Infinity", other scripts' digits), which would take a text cell
# such as a label "1_000" for the number 1000.
_INT_CELL = re.compile(r"-?(?:0|[1-9][0-9]*)")
_FLOAT_CELL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-][0-9]+)?|-?(?:inf|INF)|nan|NAN")


def _typed(v: str) -> Any:
    if v in ("", "True", "False"):
        return None if v == "" else v == "True"
    if _INT_CELL.fullmatch(v):
        return int(v)
    if _FLOAT_CELL.fullmatch(v):
        return float(v)
    return v


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table of cells as given (already formatted), one line a row, ending in a newline."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def grouped_table(
    first: str,
    keys: Sequence[Any],
    groups: Sequence[Any],
    columns: Sequence[str],
    cells: Callable[[Any, Any], Sequence[Any] | None],
    label: Callable[[Any], str] = str,
    group_label: Callable[[Any], str] = str,
    missing: str = "–",
    drop_empty: bool = False,
) -> tuple[list[str], list[list[Any]]]:
    """A paper's table layout: one row per key (its first cell ``label(key)``), and per group (a split, a
    setting, a variant) the ``columns``, headed ``<group>: <first column>, <other columns>...`` (a single
    unnamed column is headed by the group alone). ``cells(key, group)`` gives a group's cells, or None where
    that cell did not run (``missing`` in each column); ``drop_empty`` leaves out a row with no cell at all.
    Returns ``(header, body)`` for :func:`markdown_table`."""
    header = [first]
    for g in groups:
        name = group_label(g)
        header += [(f"{name}: {c}" if c else name) if i == 0 else c for i, c in enumerate(columns)]
    body = []
    for k in keys:
        row: list[Any] = []
        for g in groups:
            got = cells(k, g)
            row += [missing] * len(columns) if got is None else list(got)
        if not drop_empty or any(c != missing for c in row):
            body.append([label(k), *row])
    return header, body


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        # four decimals, or four significant digits below 0.01, where decimals would read an opt_gap of 1e-5 as 0
        return f"{v:.4g}" if 0 < abs(v) < 0.01 else f"{v:.4f}"
    return "-" if v is None else str(v)


def markdown(rows: list[dict[str, Any]], best: int | None = None) -> str:
    """A markdown table of ``rows`` (floats to 4 decimals, 4 significant digits below 0.01); the row at index
    ``best`` is marked in bold."""
    if not rows:
        return ""
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    if best is not None:
        cells[best] = [f"**{c}**" for c in cells[best]]
    return markdown_table(cols, cells)


def pm(mean: float, std: float, sep: str = " ± ", nd: int = 2) -> str:
    """A mean and its standard deviation as one cell, ``mean<sep>std`` at ``nd`` decimals."""
    return f"{mean:.{nd}f}{sep}{std:.{nd}f}"


def mean_std_cell(
    values: Sequence[float], scale: float = 1.0, ddof: int = 1, sep: str = " ± ", nd: int = 2, empty: str = "-"
) -> str:
    """``mean<sep>std`` of ``values`` times ``scale`` at ``nd`` decimals, over the finite ones (the mean alone when
    one is finite: one value has no spread, and ``± 0.00`` would say it had none); the runs that
    diverged (a NaN or infinite value) are counted, ``(k/n diverged)``, and none finite is ``diverged (n/n)``;
    no values at all is ``empty``."""
    if not values:
        return empty
    ok, bad = finite([v * scale for v in values])
    if not ok:
        return f"diverged ({bad}/{bad})"
    m, sd = mean_std(ok, ddof=ddof)
    cell = f"{m:.{nd}f}" if len(ok) == 1 else pm(m, sd, sep, nd)  # one value has no spread to show
    return cell if not bad else f"{cell} ({bad}/{len(values)} diverged)"


def pm_of(key: str, **fmt: Any) -> Callable[[Sequence[Mapping[str, Any]]], str]:
    """A cell's statistic: ``mean_std_cell`` of ``key`` over its records (a diverged run counted, never dropped);
    ``fmt``: its ``scale``, ``ddof``, ``sep``, ``nd``."""
    return lambda rs: mean_std_cell([r[key] for r in rs], **fmt)


def bold_best(cells: Sequence[str], values: Sequence[float], best: Callable = max) -> list[str]:
    """``cells`` with the one of the best value (``best``: the largest by default, the first of equal ones)
    in bold; a NaN value (a cell whose every seed diverged) is never the best, and none is bold when all are."""
    # a NaN compares false with everything, so max/min would keep one that came first
    scored = [i for i, v in enumerate(values) if not (isinstance(v, float) and math.isnan(v))]
    top = best(scored, key=values.__getitem__) if scored else None
    return [f"**{c}**" if i == top else c for i, c in enumerate(cells)]


def signed(x: float, nd: int = 2) -> str:
    """A signed number at ``nd`` decimals with a typographic minus: ``+1.20``, ``−0.35``."""
    return f"{x:+.{nd}f}".replace("-", "−")


def indent(table: str, prefix: str = "  ") -> str:
    """A markdown table set inside a list item: every line after ``prefix``, and ``prefix`` after the last."""
    return "".join(f"{prefix}{line}\n" for line in table.splitlines()) + prefix


@dataclass(frozen=True)
class Col:
    """A column of a table declared as data: its header and, per row, its value (a key of the row or a
    function of it) formatted by ``fmt`` (a format spec); a value None, or NaN (a statistic of no finished run),
    is ``none``."""

    header: str
    value: str | Callable[[Any], Any]
    fmt: str = ""
    none: str = "—"

    def cell(self, row: Any) -> str:
        v = row[self.value] if isinstance(self.value, str) else self.value(row)
        return self.none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, self.fmt)


def layout(cols: Sequence[Col], rows: Sequence[Any]) -> str:
    """The markdown table of ``rows`` under the declared ``cols``."""
    return markdown_table([c.header for c in cols], [[c.cell(r) for c in cols] for r in rows])


@dataclass(frozen=True)
class Grid:
    """A table declared as data and rendered from records: one row per key of ``labels`` (a record's
    ``row`` value -> the row's label, in the table's order) that some record has, one column per value of
    ``col(record)`` in order of first appearance, headed ``head(value)``, and in each cell ``cell(record)`` of
    the record at that row and column (``missing`` where none); ``first`` heads the labels' column."""

    first: str
    row: str
    labels: Mapping[Any, str]
    col: Callable[[Any], Any]
    head: Callable[[Any], str]
    cell: Callable[[Any], str]
    missing: str = "–"

    def render(self, records: Sequence[Any]) -> str:
        """The markdown table of ``records`` (later records of one row and column replace earlier ones)."""
        at = {(r[self.row], self.col(r)): r for r in records}
        cols = list(dict.fromkeys(self.col(r) for r in records))
        ran = {r[self.row] for r in records}
        body = [
            [label, *(self.cell(at[(k, c)]) if (k, c) in at else self.missing for c in cols)]
            for k, label in self.labels.items()
            if k in ran
        ]
        return markdown_table([self.first, *map(self.head, cols)], body)


@dataclass(frozen=True)
class Best(Col):
    """A ``Col`` whose best cell is in bold (``bold_layout``): the row of the largest ``key`` (a key of the row
    or a function of it; by default the column's own value), or of the smallest with ``best=min``; the first
    of equal ones (``bold_best``)."""

    key: str | Callable[[Any], float] | None = None
    best: Callable = max


def bold_layout(cols: Sequence[Col], rows: Sequence[Any]) -> str:
    """``layout``: the markdown table of ``rows`` under the declared ``cols``, each ``Best`` column's best cell
    in bold."""
    columns = []
    for c in cols:
        cells = [c.cell(r) for r in rows]
        if isinstance(c, Best):
            key = c.value if c.key is None else c.key
            cells = bold_best(cells, [r[key] if isinstance(key, str) else key(r) for r in rows], c.best)
        columns.append(cells)
    return markdown_table([c.header for c in cols], [list(row) for row in zip(*columns)])


def parse_csv(text: str) -> list[dict[str, Any]]:
    """The rows of CSV text (``csv_text``'s) typed back as ``read_csv`` types a file's: what a reader of the
    written file gets (e.g. floats at the precision ``float_format`` wrote)."""
    return [{k: _typed(v) for k, v in r.items()} for r in csv.DictReader(io.StringIO(text))]


def lookup(by: Mapping[Any, Any], value: str | Callable[[Any], Any], missing: Any = None) -> Callable[[Any], Any]:
    """A ``Col`` value for rows that are keys of ``by``: the key ``value`` of ``by[k]``, or ``value(by[k])``
    (``missing`` where ``by`` has no ``k``)."""
    return lambda k: missing if k not in by else by[k][value] if isinstance(value, str) else value(by[k])


def pm_cell(row: Mapping[str, Any], key: str) -> str:
    """A per-cell row's ``<key>_mean ± <key>_std`` (the mean alone when one seed completed: one value has no
    spread to show) and, when some of its ``seeds`` ran diverged, how many; ``diverged (n/n)`` when all did."""
    if row["diverged"] and row["diverged"] == row["seeds"]:  # no finished run: no mean to show
        return f"diverged ({row['diverged']}/{row['seeds']})"
    failed = f" ({row['diverged']}/{row['seeds']} diverged)" if row["diverged"] else ""
    if row["seeds"] - row["diverged"] == 1:
        return f"{row[f'{key}_mean']:.2f}{failed}"
    return pm(row[f"{key}_mean"], row[f"{key}_std"]) + failed
