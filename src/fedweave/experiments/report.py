"""``fedweave report``: one self-contained static HTML page (images inline, no network) for runs and sweeps.

The page reads what the directories hold, finished or not. At the top, the main metric of everything given
against rounds and against bytes, one line (a band over seeds) per sweep point or run. Per sweep: its summary
table (the final metric as mean ± std over seeds, the best point marked) and a table of its runs with their
status (an unfinished run says so and the round it reached; a point of the grid without a run directory is
"not started"). Only the runs of the sweep's current grid (``sweep.json``) are shown; run directories of an
earlier grid in the same ``runs/`` are left out and named in one line. The config keys that differ between
runs are columns of the runs tables, the shared config is shown once (collapsed), and each run's detail (its
metric table, long floats to 6 significant digits with the exact value in the cell's title, its figures, the
communication by transfer kind) is in a collapsed ``<details>`` element.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import itertools
import json
import logging
import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fedweave.experiments.aggregate import best_point, best_trained, if_all, mean_std, to_target
from fedweave.experiments.baseline import BASELINE, CORRECTIONS
from fedweave.experiments.grid import Point
from fedweave.experiments.verdicts import TESTS
from fedweave.results import GENERATOR, RunDirError, atomic_write, is_report, metrics_rows, unreadable

log = logging.getLogger("fedweave")

# a run directory holds at least one of these from its start (config.yaml is written before round 1)
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
NAMES = {"holm": "Holm", "bonferroni": "Bonferroni"}  # a --correction as the page names it
UNFINISHED = "unfinished"  # no summary.json: the run is still going, or its process was killed
NOT_STARTED = "not started"  # a point of the sweep's grid without a run directory yet
FINISHED = ("completed", "diverged")  # what a sweep does not run again (an interrupted run resumes)


@dataclass
class _Run:
    """One run as its directory shows it now."""

    path: Path
    name: str
    label: str  # its sweep point (what its seeds share), or its name
    status: str  # summary.json's status, UNFINISHED or NOT_STARTED
    config: dict[str, Any] = field(default_factory=dict)  # flattened: "local.lr" -> 0.1
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def planned(self) -> Any:
        return self.config.get("rounds")

    @property
    def reached(self) -> int:
        return int(self.rows[-1]["round"]) if self.rows else 0


@dataclass
class _Source:
    """A directory given to the report: a sweep (its current runs) or one run."""

    path: Path
    metric: str
    runs: list[_Run]
    spec: dict[str, Any] | None = None  # sweep.json, for a sweep
    stale: list[str] = field(default_factory=list)  # run directories of an earlier grid, left out
    shown: str | None = None  # its name on the page where another directory given has its name (distinct_names)

    @property
    def name(self) -> str:
        return self.shown or self.path.resolve().name


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d and prefix:  # a leaf, or an empty section kept as one
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _load(path: Path, parse: Any, default: Any = None) -> Any:
    """``parse(text)`` of a file (``default`` when it is absent); a file that does not parse is one line naming
    it (a run's own files are written atomically, so this is a file edited or damaged by hand)."""
    if not path.is_file():
        return default
    try:
        return parse(path.read_text())
    except (ValueError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise RunDirError(unreadable(path, e)) from e


def _mapping(parse: Any, *keys: str) -> Any:
    """``parse``, and then its result must be a mapping holding ``keys`` (None, an empty file, stands for none)."""

    def checked(text: str) -> Any:
        value = parse(text)
        if value is None and not keys:
            return {}
        if not isinstance(value, dict) or any(k not in value for k in keys):
            what = f"a mapping with {', '.join(keys)}" if keys else "a mapping"
            raise ValueError(f"not {what}: {text.strip()[:60]!r}")
        return value

    return checked


def _read_run(path: Path, label: str | None = None) -> _Run:
    if not path.is_dir():
        return _Run(path, path.name, label or path.name, NOT_STARTED)
    raw = _load(path / "config.yaml", _mapping(yaml.safe_load), {})
    rows = _load(path / "metrics.jsonl", metrics_rows, [])
    summary = _load(path / "summary.json", _mapping(json.loads, "status"))
    status = str(summary["status"]) if summary is not None else UNFINISHED
    return _Run(path, path.name, label or path.name, status, _flat(_with_defaults(raw or {})), rows, summary)


# keys config.yaml leaves out at their default (RunConfig.to_dict), so that runs written before they existed keep
# their files: a table of runs shows the default there, not the "-" of a key the run does not have
OMITTED_DEFAULTS = {"faults": {"sim_time": False, "work_unit": "round"}}


def _with_defaults(raw: Any) -> Any:
    """A run's ``config.yaml`` with the keys it leaves out at their default (:data:`OMITTED_DEFAULTS`) put back."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for section, defaults in OMITTED_DEFAULTS.items():
        if isinstance(out.get(section), dict):
            out[section] = {**defaults, **out[section]}
    return out


def _main_metric(runs: list[_Run]) -> str:
    """The task's main metric column: a finished run's summary names it (or, where its rows have none, the
    column its own plots show: :func:`fedweave.results.run_metric`), else the config's task section. A run without
    rows (diverged before its first evaluation) names no column."""
    from fedweave.results import run_metric
    from fedweave.tasks import build_task

    for r in runs:
        if r.summary is not None and r.rows and run_metric(r.summary):
            return str(run_metric(r.summary))
    for r in runs:
        t = r.config
        try:
            return build_task(
                t["task.loss"], t.get("task.loss_options"), t.get("task.metrics"), t.get("task.main")
            ).main_key
        except (KeyError, ValueError):  # no task section, or a loss of a plug-in not loaded here
            continue
    return "test_accuracy"


def _current_points(d: Path, spec: dict[str, Any]) -> list[tuple[str, str]]:
    """``(run directory name, point label)`` of every run of the sweep's current grid, in the sweep's order.

    A finished sweep wrote sweep.csv after sweep.json: its ``run_dir`` column is the exact list. A running or
    killed one has not (a sweep.csv there is an earlier sweep's): its sweep.json lists the runs (``runs``).
    A sweep.json written before it did is expanded as ``expand`` does, and the first seed is the lowest seed
    found among the run directories of those points (such a sweep.json holds no base seed)."""
    table, record = d / "sweep.csv", d / "sweep.json"
    if table.is_file() and table.stat().st_mtime_ns >= record.stat().st_mtime_ns:
        return _load(table, _sweep_table)
    if isinstance(spec.get("runs"), list):  # written by this release: the runs themselves
        return [(str(r["run_dir"]).removeprefix("runs/"), str(r["point"])) for r in spec["runs"]]
    grid, zipped = spec.get("grid") or {}, spec.get("zipped") or {}
    zip_rows = [tuple(zip(zipped, vs)) for vs in zip(*zipped.values())] or [()]
    values = [g + z for g in (tuple(zip(grid, vs)) for vs in itertools.product(*grid.values())) for z in zip_rows]
    # a Point's label and directory name depend only on its values and seed, not on its config
    points = [Point(v, 0, None) for v in values]  # type: ignore[arg-type]
    prefixes = {p.slug.rsplit(",seed=", 1)[0] for p in points}
    present = [p.name.rsplit(",seed=", 1) for p in (d / "runs").iterdir()] if (d / "runs").is_dir() else []
    seeds = [int(rest[0]) for name, *rest in present if name in prefixes and rest and rest[0].lstrip("-").isdigit()]
    if not seeds:
        return []  # no run of this grid has started: its seeds are not known yet
    first, n = min(seeds), int(spec.get("seeds") or 1)
    return [(replace(p, seed=first + i).slug, p.label) for p in points for i in range(n)]


def sweep_runs(d: str | Path) -> list[Path]:
    """The run directories of the sweep directory ``d`` that belong to its current grid and exist, in the
    sweep's order (:func:`_current_points`): what ``fedweave plot`` draws of a sweep, as the report does; the
    directories an earlier grid left in ``runs/`` are not the sweep's."""
    d = Path(d)
    points = _current_points(d, _load(d / "sweep.json", _sweep_spec))
    return [d / "runs" / name for name, _ in points if (d / "runs" / name).is_dir()]


def _sweep_spec(text: str) -> dict[str, Any]:
    """A ``sweep.json``: a mapping whose ``grid`` and ``zipped`` are mappings of lists and ``runs`` a list of
    ``{run_dir, point}`` (else a ValueError: the file was edited or damaged by hand)."""
    spec = _mapping(json.loads)(text)
    for key in ("grid", "zipped"):
        axes = spec.get(key) or {}
        if not isinstance(axes, dict) or not all(isinstance(v, list) for v in axes.values()):
            raise ValueError(f"its {key} is not a mapping of value lists: {axes!r:.60}")
    runs = spec.get("runs")
    if runs is not None and not (
        isinstance(runs, list) and all(isinstance(r, dict) and {"run_dir", "point"} <= set(r) for r in runs)
    ):
        raise ValueError("its runs are not a list of {run_dir, point}")
    return spec


def _sweep_table(text: str) -> list[tuple[str, str]]:
    """``(run directory name, point label)`` of each row of a ``sweep.csv`` (its ``run_dir`` and ``point``
    columns; a row without them is a ValueError)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    for n, r in enumerate(rows, 2):
        if not (isinstance(r.get("run_dir"), str) and r["run_dir"] and isinstance(r.get("point"), str)):
            raise ValueError(f"line {n} has no run_dir and point")
    if not rows:
        raise ValueError("it has no run's row")
    return [(r["run_dir"].removeprefix("runs/"), r["point"]) for r in rows]


def _check_baseline(path: Path, baseline: Any, labels: set[str]) -> None:
    """A sweep.json's ``baseline`` (``fedweave sweep --baseline`` writes ``{"point", "level", "test"}``, and
    ``"correction"`` when ``--correction`` was given) as the
    report reads it, or one line naming the file and the key: such a file was edited or damaged by hand. A
    point that names no run of the grid is refused too (every other point would silently pair with nothing);
    ``labels`` empty (no run started yet) checks nothing of it."""
    if not baseline:
        return
    key = f"{path}: baseline"
    if not isinstance(baseline, dict):
        raise RunDirError(f"{key} must be a mapping with point, level and test, got {baseline!r}")
    missing = [k for k in ("point", "level", "test") if k not in baseline]
    if missing:
        raise RunDirError(f"{key} lacks {', '.join(missing)}; fedweave sweep --baseline writes point, level and test")
    point, level, test = baseline["point"], baseline["level"], baseline["test"]
    if not isinstance(point, str) or (labels and point not in labels):
        points = ", ".join(sorted(labels))
        raise RunDirError(f"{key}.point {point!r} names no point of the sweep; its points are {points}")
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0 < level < 1:
        raise RunDirError(f"{key}.level must be a number in (0, 1), got {level!r}")
    if test not in TESTS:
        raise RunDirError(f"{key}.test must be one of {', '.join(TESTS)}, got {test!r}")
    if baseline.get("correction", "none") not in CORRECTIONS:
        raise RunDirError(f"{key}.correction must be one of {', '.join(CORRECTIONS)}, got {baseline['correction']!r}")


def _read_source(d: Path) -> _Source:
    if not d.is_dir():
        what = "is a file" if d.exists() else "does not exist"
        raise RunDirError(f"{d} {what}: give run directories (with {_or(RUN_FILES)}) or sweep directories (with "
                          "sweep.json)")  # fmt: skip
    if (d / "sweep.json").is_file():
        spec = _load(d / "sweep.json", _sweep_spec)
        points = _current_points(d, spec)
        _check_baseline(d / "sweep.json", spec.get("baseline"), {label for _, label in points})
        runs = [_read_run(d / "runs" / name, label) for name, label in points]
        wanted = {name for name, _ in points}
        present = sorted(p.name for p in (d / "runs").iterdir() if p.is_dir()) if (d / "runs").is_dir() else []
        stale = [n for n in present if n not in wanted]
        return _Source(d, spec.get("metric") or _main_metric(runs), runs, spec, stale)
    if not any((d / f).is_file() for f in RUN_FILES):
        raise RunDirError(f"{d} is neither a run directory (with {_or(RUN_FILES)}) nor a sweep directory (with "
                          "sweep.json)")  # fmt: skip
    run = _read_run(d)
    return _Source(d, _main_metric([run]), [run])


def _or(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}"


# ---- formatting --------------------------------------------------------------------------------------------


def _td(text: Any, title: str | None = None, cls: str | None = None) -> str:
    """A table cell; ``title``: what a reader sees on hovering over it (the exact value of a rounded one);
    ``cls``: its class in the page's style."""
    attrs = f' title="{html.escape(title)}"' if title and title != "None" else ""  # no value: nothing to show
    attrs += f' class="{html.escape(cls)}"' if cls else ""
    return f"<td{attrs}>{html.escape(str(text))}</td>"


def _cell(value: Any) -> str:
    """A metrics table cell: a float (as read from a CSV or not) shown to 6 significant digits, its exact value
    in the cell's title; anything else as it is."""
    text = str(value)
    try:
        x = float(text)
    except ValueError:
        return _td(text)
    short = f"{x:.6g}"
    if short == text or "." not in text and "e" not in text.lower():  # integers and short values stay as written
        return _td(text)
    return _td(short, text)


def _pm(mean: float, std: float, n: int) -> str:
    """``mean ± std`` to the precision the std allows (two significant digits of the std), e.g. 0.807 ± 0.013;
    one value: the mean to 4 significant digits; none: ``-``."""
    if n == 0 or math.isnan(mean):
        return "-"
    if n == 1:
        return f"{mean:.4g}"
    if std == 0 or math.isnan(std):
        return f"{mean:.4g} ± 0"
    # the decimals of the std rounded to two significant digits: 0.0996 rounds to 0.10 (2 decimals), not 0.100
    decimals = 1 - math.floor(math.log10(abs(float(f"{std:.2g}"))))
    if decimals < 0:  # a std of 100 or more: its second significant digit is the tens (or coarser)
        return f"{round(mean, decimals):.0f} ± {round(std, decimals):.0f}"
    return f"{mean:.{decimals}f} ± {std:.{decimals}f}"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def _size(n: Any) -> str:
    """Bytes as B / KiB / MiB / GiB to 3 significant digits."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return "-"


def _table(head: list[str], rows: list[str], cls: str) -> str:
    """A table of cells already rendered (``<td>``s, one string a row, optionally ``(row class, cells)``)."""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(f"<tr class={html.escape(r[0])!r}>{r[1]}</tr>" if isinstance(r, tuple) else f"<tr>{r}</tr>"
                   for r in rows)  # fmt: skip
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _img(name: str, data: bytes) -> str:
    src = base64.b64encode(data).decode()
    return (f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{src}">'
            f"<figcaption>{html.escape(name)}</figcaption></figure>")  # fmt: skip


# ---- sections ----------------------------------------------------------------------------------------------


_STATUS_WORDS = {UNFINISHED: "unfinished (running or killed)"}


def _left(runs: list[_Run]) -> list[tuple[str, int]]:
    """``(status, count)`` of the runs not finished, in the order their statuses first appear."""
    counts: dict[str, int] = {}
    for r in runs:
        if not r.finished:
            counts[r.status] = counts.get(r.status, 0) + 1
    return list(counts.items())


def _status_text(r: _Run) -> str:
    """A run's status as its row and detail say it: an unfinished run whether it can resume, a run that a
    callback ended before its rounds (a target reached, the privacy budget) why (:func:`_early`)."""
    if r.status == UNFINISHED:
        resumable = " (resumes from checkpoint.pt)" if (r.path / "checkpoint.pt").is_file() else ""
        return _STATUS_WORDS[UNFINISHED] + resumable
    return r.status + _early(r)


def _early(r: _Run) -> str:
    """``, stopped early: REASON`` for a run whose summary.json has ``stopped_early``, else nothing: such a run is
    ``completed`` with fewer rounds than planned, and the reason is what tells it from one cut short."""
    reason = (r.summary or {}).get("stopped_early")
    return f", stopped early: {reason}" if reason else ""


def _rounds_text(r: _Run) -> str:
    if r.status == NOT_STARTED:
        return "-"
    return f"{r.reached} of {r.planned}" if r.planned is not None and r.reached != r.planned else str(r.reached)


def _point_summary(src: _Source) -> tuple[list[str], list[Any]]:
    """The sweep's summary over seeds, computed from its runs as ``fedweave sweep`` computes summary.csv (the
    final metric of the completed runs), so a sweep still running has one too."""
    from fedweave.tasks import column_direction

    metric, target = src.metric, (src.spec or {}).get("target")
    direction = column_direction(metric)
    by_point: dict[str, list[_Run]] = {}
    for r in src.runs:
        by_point.setdefault(r.label, []).append(r)
    head = ["point", "runs", "diverged", f"{metric} (mean ± std)"]
    private = _private(src.runs)
    if private:  # privacy: the epsilon spent, beside the metric it bought
        head.append("epsilon (mean ± std)")
    if target is not None:
        head += [f"rounds to {target:g}", f"bytes to {target:g}"]
    spec = src.spec or {}
    compared = _compared(src) if spec.get("baseline") else {}
    correction = spec["baseline"].get("correction") if compared else None  # None: --correction not given
    if compared:
        level, test = spec["baseline"]["level"], spec["baseline"]["test"]
        head += [f"{metric} − baseline", _interval_head(level, test, correction, compared)]
        head += ["interval level", "p", "p adjusted"] if correction is not None else []
        head += ["pairs", "vs baseline", "unpaired"]
    rows, means = [], []
    for label, runs in by_point.items():
        finals = [(r.summary.get("final") or {}).get(metric) for r in runs if r.status == "completed" and r.summary]
        m, sd = mean_std(finals)
        means.append(m)
        n = sum(f is not None for f in finals)
        state = f"{sum(r.finished for r in runs)}/{len(runs)}" + "".join(f", {c} {k}" for k, c in _left(runs))
        cells = _td(label) + _td(state) + _td(sum(r.status == "diverged" for r in runs))
        # one run has no spread: summary.csv's std is NaN there, and the cell shows the mean alone
        spread = f", std {sd!r}" if n > 1 else ""
        cells += _td(_pm(m, sd, n), f"mean {m!r}{spread} over {n} completed run{'s' * (n != 1)}")
        if private:
            eps = [_epsilon(r) for r in runs if r.status == "completed" and r.summary]
            em, esd = mean_std(eps)
            cells += _td(_pm(em, esd, sum(e is not None for e in eps)), f"mean {em!r}, std {esd!r}")
        if target is not None:
            for x, fmt in (("round", _num), ("bytes_total", _size)):
                reach = [to_target(r.rows, metric, target, x, direction) for r in runs]
                v = if_all(reach, lambda v: mean_std(v)[0])  # all seeds reached it
                cells += _td(fmt(v), None if v is None else repr(v))
        if compared:
            c = compared[label]
            cells += _td(_num(c.diff), repr(c.diff))
            if c.low is None:  # fewer than 2 pairs: no interval
                cells += _td("-")
            else:
                cells += _td(f"[{_num(c.low)}, {_num(c.high)}]", f"{c.low!r}, {c.high!r}")
            if correction is not None:
                for x in (c.level, c.p, c.p_adjusted):
                    cells += _td("-") if x is None else _td(_num(x), repr(x))
            cells += _td("-" if c.outcome == BASELINE else c.n) + _td(c.outcome) + _td(c.unpaired or "-")
        rows.append(cells)
    whole = [all(r.status == "completed" for r in runs) for runs in by_point.values()]
    best = best_point(means, whole, direction)
    if best is not None:
        rows[best] = ("best", rows[best])
    return head, rows


def _interval_head(level: float, test: str, correction: str | None, compared: dict[str, Any]) -> str:
    """The interval column's head: its level and test, and the correction when ``--correction`` was given
    (``holm``/``bonferroni``: the family's size and level, each row's own level in its column). A family of
    no point (none has 2 or more pairs yet: a sweep of one seed, or one still running) is said as such, not
    as a correction "over 0"."""
    if correction is None:
        return f"{100 * level:g} % {TESTS[test]} interval"
    if correction == "none":
        return f"{100 * level:g} % {TESTS[test]} interval, no correction"
    m = sum(c.p is not None for c in compared.values())
    if m == 0:
        return f"{TESTS[test]} interval, {NAMES[correction]}: no point has 2 or more pairs to compare yet"
    return f"{TESTS[test]} interval, {NAMES[correction]} over {m} at {100 * level:g} % family-wise"


def _compared(src: _Source) -> dict[str, Any]:
    """Each point against the baseline ``sweep.json`` names (its level and test), by the function
    ``fedweave sweep`` writes summary.csv's comparison with (:func:`fedweave.experiments.baseline.compare`), on
    the final metric of each run's summary.json; a run not finished is named as unpaired."""
    from fedweave.experiments.baseline import compare
    from fedweave.tasks import column_direction

    b, key = (src.spec or {})["baseline"], f"final_{src.metric}"
    records = []
    for r in src.runs:
        seed, tail = r.config.get("seed"), r.name.rsplit(",seed=", 1)[-1]
        if seed is None and tail.isdigit():  # a run not started yet has no config: its name holds its seed
            seed = int(tail)
        final = (r.summary or {}).get("final") or {}
        records.append({"point": r.label, "seed": seed, "status": r.status, key: final.get(src.metric)})
    direction = column_direction(src.metric)
    return compare(records, key, b["point"], direction, b["level"], b["test"], b.get("correction", "none"))


def _private(runs: list[_Run]) -> bool:
    """Whether any of the runs has a ``privacy`` section (then the tables show epsilon)."""
    return any("privacy.level" in r.config for r in runs)


def _epsilon(r: _Run) -> float | None:
    """The epsilon a run spent: its summary's, else its last row's (a run still going)."""
    if r.summary and r.summary.get("privacy"):
        return r.summary["privacy"].get("epsilon")
    return next((x["epsilon"] for x in reversed(r.rows) if x.get("epsilon") is not None), None)


def _runs_table(src: _Source, differ: list[str]) -> str:
    """One row per run: the config keys in ``differ``, its status (and why it stopped early, when a callback
    ended it) and rounds, the final and best metric (as in sweep.csv and summary.json: the best over its
    evaluated rounds after training began, so an ``eval.at_start`` row 0 is not a result), the bytes sent (as in
    sweep.csv: :func:`_bytes_total`) and its wall time."""
    from fedweave.tasks import column_direction

    metric = src.metric
    direction = column_direction(metric)
    differ = [k for k in differ if k != "rounds"]  # its own column shows them (reached, "of" the planned when short)
    head = ["run", *differ, "status", "rounds", f"final {metric}", f"best {metric}", "bytes total", "wall s"]
    private = _private(src.runs)
    if private:  # privacy: the epsilon spent at the run's delta
        head += ["epsilon", "delta"]
    rows = []
    for r in src.runs:
        s = r.summary or {}
        vals = [x[metric] for x in r.rows if x.get(metric) is not None]
        best = best_trained(r.rows, metric, direction)
        final = (s.get("final") or {}).get(metric) if s else (vals[-1] if vals else None)
        last = r.rows[-1] if r.rows else {}
        name = html.escape(r.name).replace(",", ",<wbr>")  # a long run name breaks after a comma
        cells = f"<td>{name}</td>" + "".join(_td(_config_text(r.config.get(k))) for k in differ)
        # a reason for stopping early (a privacy budget's is a sentence) wraps rather than widening the table
        cells += _td(_status_text(r), cls="why" if _early(r) else None) + _td(_rounds_text(r))
        cells += _td(_num(final), repr(final)) + _td(_num(best), repr(best))
        cells += _td(_size(_bytes_total(r))) + _td(_num(s.get("wall_seconds", last.get("wall_seconds"))))
        if private:
            eps = _epsilon(r)
            cells += _td(_num(eps), repr(eps)) + _td(_num((s.get("privacy") or {}).get("delta")))
        rows.append(cells if r.status == "completed" else (r.status.replace(" ", "-"), cells))  # others stand out
    return _table(head, rows, "runs")


def _bytes_total(r: _Run) -> Any:
    """The bytes a run sent: its summary's communication total, as sweep.csv's, else (a run still going) its last
    row's. A run that diverged or was interrupted sent the transfers of the round it stopped in, which has no row:
    the last row's total is a round short, and a run stopped in its first round has none."""
    total = ((r.summary or {}).get("communication") or {}).get("bytes_total")
    if total is not None:
        return total
    return r.rows[-1].get("bytes_total") if r.rows else None


def _config_text(v: Any) -> str:
    return "-" if v is None else json.dumps(v) if isinstance(v, (list, dict, bool)) else str(v)


def _run_detail(r: _Run) -> str:
    """A run's detail, collapsed: its status, the communication by transfer kind, the metric table, figures."""
    if r.status == NOT_STARTED:
        return ""
    head = f"{r.name}: {_status_text(r)}, round {_rounds_text(r)}"
    parts = [f'<details class="run"><summary>{html.escape(head)}</summary>']
    if r.summary is not None:
        s = r.summary
        status = html.escape(str(s["status"]) + _early(r))
        parts.append(f"<p>status: {status}, rounds: {s['rounds']}, wall {s['wall_seconds']} s"
                     + (f"<br>{html.escape(str(s['error']))}" if s.get("error") else "") + "</p>")  # fmt: skip
        kinds = s["communication"].get("by_transfer", {})
        rows = [_td(k) + _td(v["count"]) + _td(v["bytes"], _size(v["bytes"])) for k, v in kinds.items()]
        parts.append("<h4>Communication by transfer kind</h4>" + _table(["transfer", "count", "bytes"], rows, "comm"))
    if (r.path / "metrics.csv").is_file():
        with open(r.path / "metrics.csv", newline="") as f:
            table = list(csv.reader(f))
        if table:
            body = ["".join(_cell(c) for c in row) for row in table[1:]]
            parts.append("<h4>Metrics</h4>" + _table(table[0], body, "metrics"))
    parts.append(_clients_section(r.path / "clients.jsonl"))
    parts.append("".join(_img(p.name, p.read_bytes()) for p in sorted(r.path.glob("*.png"))))
    return "".join(parts) + "</details>"


CLIENT_ROUNDS = 20  # the per-client table shows the last this many evaluations


def _clients_section(path: Path) -> str:
    """``eval.distribution``'s record (``clients.jsonl``): the main metric's spread over the clients at each
    evaluation (mean, worst 10 %, std, min, max; the last CLIENT_ROUNDS evaluations), and every client's value
    at the last one. A line cut short when the run stopped is left out."""
    from fedweave.execution import client_spread

    if not path.is_file():
        return ""
    entries = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and isinstance(e.get(e.get("metric")), list) and e[e["metric"]]:
            entries.append(e)
    if not entries:
        return ""
    metric = entries[-1]["metric"]
    rows = []
    for e in entries[-CLIENT_ROUNDS:]:
        v = e[e["metric"]]
        sp = client_spread(v, e.get("direction", "max"), metric=e["metric"])
        cells = [e["round"], len(v), sp["mean"], sp["worst10"], sp["std"], min(v), max(v)]
        rows.append("".join(_cell(c) for c in cells))
    head = ["round", "clients", "mean", "worst 10 %", "std", "min", "max"]
    shown = f" (the last {CLIENT_ROUNDS} of {len(entries)} evaluations)" if len(entries) > CLIENT_ROUNDS else ""
    last = entries[-1]
    return (
        f"<h4>Per-client test {html.escape(metric)} (each client's own test set){html.escape(shown)}</h4>"
        + _table(head, rows, "clients")
        + f"<details><summary>Each client's test {html.escape(metric)} at round {last['round']}</summary>"
        + _table(["client", metric], _pairs(last, metric), "per-client")
        + "</details>"
    )


def _pairs(entry: dict[str, Any], metric: str) -> list[str]:
    """One row per client: its id and its value."""
    ids = entry.get("clients") or list(range(len(entry[metric])))
    return [_td(c) + _cell(x) for c, x in zip(ids, entry[metric])]


def _overlay(sources: list[_Source]) -> str:
    """The main metric against rounds and bytes (and, for private runs, against epsilon, and epsilon against
    rounds): one line per sweep point (a band over its seeds) or run,
    every directory given on one figure. A point's curve uses its finished runs (an unfinished seed would cut
    the band short), or its unfinished ones while none has finished (``(unfinished)``); its diverged runs are
    said in its label (:func:`fedweave.experiments.plots.diverged_mark`, counting those without rows), and a
    curve of one point is a marker."""
    from fedweave.experiments.plots import diverged_mark, plot_curves
    from fedweave.plots import clock_label

    by_metric: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    for src in sources:
        prefix = f"{src.name}: " if len(sources) > 1 and src.spec is not None else ""
        points: dict[str, list[_Run]] = {}
        everyone: dict[str, list[_Run]] = {}  # a point's runs, those diverged before their first row too
        for r in src.runs:
            everyone.setdefault(r.label, []).append(r)
            if r.rows:
                points.setdefault(r.label, []).append(r)
        curves = by_metric.setdefault(src.metric, {})
        for label, runs in points.items():
            done = [r for r in runs if r.finished]
            ended = [r.status for r in everyone[label] if r.finished]
            name = prefix + label + ("" if done else " (unfinished)") + diverged_mark(ended)
            while name in curves:  # a run directory named as another curve (e.g. "s: lr=0.1"); never replaced
                name += "'"
            curves[name] = [r.rows for r in done or runs]
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for metric, curves in by_metric.items():
            axes = [("round", "communication round", 1.0), ("bytes_total", "bytes communicated (MiB)", 2.0**-20)]
            if all(r.get("sim_time") is not None for runs in curves.values() for rows in runs for r in rows):
                # every run on a simulated clock, as a run's plots, and all in one unit (faults.work_unit)
                label = clock_label([r.path for src in sources if src.metric == metric for r in src.runs if r.rows])
                if label is not None:
                    axes.append(("sim_time", label, 1.0))
            for x, xlabel, xscale in axes:
                name = f"{metric}_vs_{ {'round': 'rounds', 'bytes_total': 'bytes'}.get(x, x) }.png"
                path = plot_curves(curves, Path(tmp) / name, x=x, y=metric, xlabel=xlabel, xscale=xscale)
                if path is not None:
                    figures.append(_img(name, path.read_bytes()))
            # privacy: the metric against the epsilon spent, and epsilon against rounds (the private runs' rows)
            private = {
                k: [[r for r in rows if r.get("epsilon") is not None] for rows in runs] for k, runs in curves.items()
            }
            private = {k: runs for k, runs in private.items() if all(runs)}
            for x, y, xlabel in (("epsilon", metric, "epsilon spent (at the run's delta)"),
                                 ("round", "epsilon", "communication round")):  # fmt: skip
                name = f"{metric}_vs_epsilon.png" if x == "epsilon" else "epsilon_vs_rounds.png"
                path = plot_curves(private, Path(tmp) / name, x=x, y=y, xlabel=xlabel) if private else None
                if path is not None:
                    figures.append(_img(name, path.read_bytes()))
    return f'<section class="overlay">{"".join(figures)}</section>' if figures else ""


def _notes(src: _Source) -> list[str]:
    """One line each: how far a sweep is, and the run directories of an earlier grid that were left out."""
    notes = []
    done = sum(r.finished for r in src.runs)
    if not src.runs:
        notes.append("No run of this grid has started yet.")
    elif done < len(src.runs):
        left = ", ".join(f"{c} {_STATUS_WORDS.get(k, k)}" for k, c in _left(src.runs))
        notes.append(f"{done} of {len(src.runs)} runs finished; {left}.")
    if src.stale:
        one = len(src.stale) == 1
        shown = ", ".join(src.stale[:3]) + (", ..." if len(src.stale) > 3 else "")
        dirs = f"{len(src.stale)} run director{'y' if one else 'ies'}"
        notes.append(f"Left out: {dirs} in runs/ not in this sweep's grid (sweep.json), from an earlier grid: {shown}")
    return notes


def _source_section(src: _Source, differ: list[str]) -> str:
    title = f"Sweep {src.name}" if src.spec is not None else f"Run {src.name}"
    parts = [f'<section class="source"><h2>{html.escape(title)}</h2>']
    if src.spec is not None:
        spec = src.spec
        axes = {**(spec.get("grid") or {}), **(spec.get("zipped") or {})}
        desc = "; ".join(f"{k} = {', '.join(map(_config_text, v))}" for k, v in axes.items()) or "no grid"
        if spec.get("baseline"):  # fedweave sweep --baseline: every point against it, paired by seed
            b = spec["baseline"]
            desc += f"; every point against the baseline {b['point']}, paired by seed ({b['test']} interval)"
            # the correction for the number of points, said even for a sweep run without --correction (none)
            corr = b.get("correction", "none")
            desc += (
                "; no correction for multiple comparisons"
                if corr == "none"
                else f"; {NAMES[corr]} correction over the points compared, {100 * b['level']:g} % family-wise"
            )
        parts.append(f"<p>{html.escape(desc)}; {spec.get('seeds', 1)} seed(s); metric {html.escape(src.metric)}</p>")
        for note in _notes(src):  # on the page, and said where the report is made (stderr, by default)
            log.warning("%s: %s", src.path, note)
            parts.append(f'<p class="note">{html.escape(note)}</p>')
        if src.runs:
            head, rows = _point_summary(src)
            parts.append("<h3>Summary over seeds</h3>" + _table(head, rows, "summary"))
    if src.runs:
        parts.append("<h3>Runs</h3>" + _runs_table(src, differ))
        parts += [_run_detail(r) for r in src.runs]
    return "".join(parts) + "</section>"


STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:1300px}"
    "h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.5em}h3{margin:1em 0 .3em}"
    "table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;"
    "text-align:left;white-space:nowrap}th{background:#f2f2f2}td[title]{cursor:help}tr.best{font-weight:bold;background:#dfd}"
    "tr.unfinished,tr.not-started,tr.interrupted,tr.stopped{background:#fff3cd}tr.diverged,tr.failed{background:#f8d7da}"
    "table.runs td:first-child{white-space:normal;min-width:14em}td.why{white-space:normal;min-width:18em}"
    ".note{background:#fff3cd;padding:.3em .6em;border-left:4px solid #e0a800}"
    "img{max-width:540px}figure{display:inline-block;margin:.3em}figcaption{font-size:12px;color:#666}"
    "details{margin:.2em 0}summary{cursor:pointer}details.run>summary{font-size:13px}"
    "details[open]{border-left:3px solid #ccc;padding-left:.6em}pre{font-size:12px}"
)


def build_report(dirs: list[str | Path]) -> str:
    """The HTML page for run and sweep directories (finished or not). Raises :class:`RunDirError` for a path
    that is neither."""
    seen: set[Path] = set()
    for d in map(Path, dirs):  # one directory twice drew two identical curves and tabulated its runs twice
        if d.resolve() in seen:
            raise RunDirError(f"{d} is given twice; give each directory once")
        seen.add(d.resolve())
    sources = [_read_source(Path(d)) for d in dirs]
    from fedweave.plots import distinct_names  # after the directories are read: bad input loads no plotting

    for src, shown in zip(sources, distinct_names([s.path for s in sources])):
        src.shown = shown
        if src.spec is None:  # a run given itself: its legend label, its row and its detail
            src.runs[0].name = src.runs[0].label = shown
    runs = [r for s in sources for r in s.runs if r.config]
    keys = sorted({k for r in runs for k in r.config})
    differ = [k for k in keys if len({json.dumps(r.config.get(k), default=str) for r in runs}) > 1]
    shared = {k: v for k, v in (runs[0].config if runs else {}).items() if k not in differ}
    shared_yaml = yaml.safe_dump(_nest(shared), sort_keys=False)
    body = [_overlay(sources)]
    if runs:
        what = (
            f"Config shared by all {len(runs)} runs ({len(shared)} keys; those that differ are columns below)"
            if len(runs) > 1
            else f"Config of the run ({len(shared)} keys)"  # "shared by all 1 runs"
        )
        body.append(f"<details><summary>{what}</summary><pre>{html.escape(shared_yaml)}</pre></details>")
    body += [_source_section(s, differ) for s in sources]
    given = ", ".join(html.escape(s.name) for s in sources)
    head = (
        f"<head><meta charset='utf-8'>{GENERATOR}<title>fedweave report: {given}</title><style>{STYLE}</style></head>"
    )
    return f"<!DOCTYPE html><html>{head}<body><h1>fedweave report: {given}</h1>{''.join(body)}</body></html>"


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened config back into sections, for showing it as YAML."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        *parents, leaf = k.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def write_report(dirs: list[str | Path], out: str | Path) -> Path:
    """Write :func:`build_report`'s page to ``out`` (atomically) and return its path. An existing ``out``
    is replaced only when it is a report written here (a :class:`RunDirError` otherwise: nothing of the
    user's is overwritten)."""
    out = Path(out)
    if out.exists() and not is_report(out):
        raise RunDirError(
            f"{str(out)!r} exists and is not a fedweave report; give another --out (an earlier report is replaced)"
        )
    atomic_write(out, build_report(dirs))
    return out
