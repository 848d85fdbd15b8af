"""One pipeline for every paper reproduction (a study).

A study declares what is its paper's: its presets (``plan``: the grid of points of a scale, with seeds and
variants), how a finished run becomes a record (``record``), and how the records become the paper's tables,
figures and claims (``report``). The pipeline does the rest alike for every paper: it runs the points through
the sweep runner (``run_points``: a finished run of the same config is reused, a killed one resumes, at most
``--workers`` at a time, no run starts after ``--budget-minutes``), turns every finished run into its record
and hands the records to the report, whose files (``Report``: CSV ``Rows``, ``Json``, text, then its figures)
it writes; a study summarizes its seeds with ``aggregate.per_cell`` and lays its tables out with ``tables``.
``fedweave reproduce NAME`` is its one front end (``fedweave.cli``); the common options are ``--scale --seeds
--workers --out --budget-minutes``, a study adds its own as ``Option``.

A claim is a ``Claim``: its text and a rule that computes its verdict from the study's table, so the verdicts
of a page are computed, never written by hand (``judge``).

A claim may also declare its statistical verdict rule (``Claim.declared``, a ``verdicts.Paired`` or
``verdicts.Threshold``: the statistic, the pairing by seed, the test, its level and the minimum effect). Its
verdict is then the rule's: held, did not hold or inconclusive (``Verdict.outcome``; ``held`` is None when
inconclusive), and ``Verdict.interval`` is the rule's one line (``+0.42 points [0.11, 0.73], 95 % paired t,
n=5: held``), which ``verdict_table`` shows in the verdict's column. A claim without a declared rule gives the
verdict and the table it always gave.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedweave.config import ConfigError, positive_int, positive_minutes
from fedweave.experiments import pages
from fedweave.experiments.grid import Point
from fedweave.experiments.jobs import check_points, finished, parallel_map, run_points
from fedweave.experiments.tables import csv_text, markdown_table
from fedweave.experiments.verdicts import Rule
from fedweave.results import atomic_write, first_names, folder_refusal
from fedweave.runner import Result


@dataclass(frozen=True)
class Option:
    """A command-line option of one study, beside the common ones: argparse's flags and keywords; ``count``
    makes its type a whole number >= 1 (the front end's own type)."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    count: bool = False


def option(*flags: str, count: bool = False, **kwargs: Any) -> Option:
    """``Option(flags, kwargs, count)`` written as ``add_argument`` is called."""
    return Option(flags, kwargs, count)


@dataclass(frozen=True)
class Verdict:
    """A claim's verdict: the claim, what was measured, and whether it held (None: untestable)."""

    claim: str
    measured: str
    held: bool | None
    word: str | None = None  # the verdict's own words where a paper's page says more than held / did not hold
    # ---- set only by a claim's declared rule (``Claim.declared``) ----
    outcome: str | None = None  # held, did not hold or inconclusive
    interval: str | None = None  # the rule's one line: estimate, interval, test, n, outcome

    def __iter__(self):  # a verdict unpacks as (claim, measured, held)
        return iter((self.claim, self.measured, self.held))

    def __getitem__(self, i: int) -> Any:
        return (self.claim, self.measured, self.held)[i]


@dataclass(frozen=True)
class Claim:
    """A paper's claim and its verdict rule. ``rule(table, ctx)`` returns ``(measured, held)`` with ``held``
    True, False or None (untestable), or None when the records cannot test the claim at all (the claim is
    left out, e.g. a variant the preset does not run); ``text`` is the claim, or a function of
    ``(table, ctx)`` that writes it (a claim that names the preset's target or the largest noise run). A rule
    may add a third item, the verdict's own words (``Verdict.word``, e.g. "partly (uploads fall with rho)")."""

    text: str | Callable[[Any, Any], str]
    rule: Callable[[Any, Any], tuple[str, bool | None] | None] | None
    # ---- a declared verdict rule (module docstring): it decides the verdict; ``rule``, when given, still says
    # what was measured (or leaves the claim out). ``records(table, ctx)`` gives the records the declared rule
    # reads (by default the table itself, a list of records). A declared rule may be a function of
    # ``(table, ctx)`` that returns the rule: one whose sides are chosen from the table (the best row by mean).
    declared: Rule | Callable[[Any, Any], Rule] | None = field(default=None, kw_only=True)
    records: Callable[[Any, Any], Sequence[Any]] | None = field(default=None, kw_only=True)
    paper: str = field(default="", kw_only=True)  # the paper's own statement, where a page shows it beside the claim

    def __post_init__(self) -> None:
        if self.rule is None and self.declared is None:
            raise ConfigError(f"claim {self.text!r}: no rule; give a rule, a declared rule or both")

    def verdict(self, table: Any, ctx: Any = None) -> Verdict | None:
        got = self.rule(table, ctx) if self.rule is not None else ("", None)
        if got is None:
            return None
        text = self.text(table, ctx) if callable(self.text) else self.text
        measured, held, *word = got
        if self.declared is None:
            return Verdict(text, measured, None if held is None else bool(held), *word)
        declared = self.declared if hasattr(self.declared, "judge") else self.declared(table, ctx)
        decision = declared.judge(self.records(table, ctx) if self.records else table)
        if decision is None:  # the records hold no A or no B: the claim is left out, as a rule's None
            return None
        return Verdict(
            text, measured or decision.detail, decision.held, outcome=decision.outcome, interval=decision.text
        )


def judge(claims: Sequence[Claim], table: Any, ctx: Any = None) -> list[Verdict]:
    """The verdicts of ``claims`` on ``table``, in their order, without the claims the table cannot test."""
    return [v for c in claims if (v := c.verdict(table, ctx)) is not None]


HELD = {True: "held", False: "did not hold", None: "untestable"}  # a verdict's word on a page
YES_NO = {True: "yes", False: "no", None: "untestable"}


def verdict_table(
    verdicts: Sequence[Verdict], header: Sequence[str] = ("claim", "measured", "held"), words: dict = YES_NO
) -> str:
    """The verdicts as a markdown table: the claim first, then what was measured and the verdict's word
    (``words[held]``) in the order of ``header``, whose column named ``measured`` holds the measurement."""
    measured_first = list(header).index("measured") == 1
    # a declared rule's verdict shows its one line (interval, test, n, outcome) in the verdict's column
    rows = []
    for v in verdicts:
        c, m, h = v
        w = getattr(v, "interval", None) or words[h]
        rows.append([c, m, w] if measured_first else [c, w, m])
    return markdown_table(header, rows)


def reading(
    text: str | Callable[[Any, Any], str], read: Callable, records: Callable | None = None, paper: str = ""
) -> Claim:
    """A ``Claim`` from one function of its table and context, ``read(table, ctx) -> (measured, declared rule)``:
    None, or ``measured`` None, leaves the claim out (the records cannot test it); the rule reads
    ``records(table, ctx)`` (by default the table); ``paper``: the paper's statement of the claim."""

    def measured(t: Any, ctx: Any) -> tuple[str, None] | None:
        return None if (got := read(t, ctx)) is None or got[0] is None else (got[0], None)

    return Claim(text, measured, declared=lambda t, ctx: read(t, ctx)[1], records=records, paper=paper)


@dataclass
class Plan:
    """What a study runs for one invocation: its points, what its records and report need of the preset
    (``context``) and an ``initializer`` run once per worker (e.g. a dataset cache)."""

    points: list[Point]
    context: Any = None
    initializer: Callable[[], None] | None = None
    # a study whose runs are not runner runs (a solver loop to a target): ``solve(point) -> record`` runs one
    # point, which has a ``slug`` and is a dataclass (its fields are the run's identity); see ``Study.records``
    solve: Callable[[Any], dict[str, Any]] | None = None
    progress: Callable[[dict[str, Any]], str] | None = None  # a finished solve's line of progress
    # the report is rebuilt from an earlier invocation's records in --out (which the plan checked): --out is that
    # invocation's folder, not a user's (users_folder)
    rebuilds_out: bool = False
    reused: set[str] = field(default_factory=set)  # the points an earlier invocation ran (set by the pipeline)
    skipped: list[Point] = field(default_factory=list)  # the points not run: the time budget ran out (idem)

    def reused_note(self) -> str:
        """What a report says beside this invocation's wall time where it reused runs (``K of N runs reused from
        an earlier invocation, not in this time``), so that a rerun's seconds are not read as the runs' cost;
        "" where it ran every run."""
        if not self.reused:
            return ""
        return f" ({len(self.reused)} of {len(self.points)} runs reused from an earlier invocation, not in this time)"


class _Parser(argparse.ArgumentParser):
    """argparse for Python callers of ``Study.main``: a usage error is a ``ConfigError`` (one line)."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {' '.join(message.split())}")


@dataclass
class Study:
    """One paper's reproduction: its name (``fedweave reproduce NAME``), scales and options, and the three
    functions that are its paper's own. ``plan(opts) -> Plan``; ``record(point, result, plan) -> record``
    (a finished run as a row); ``report(records, plan, opts, wall)`` -> a ``Report`` (the records, tables and
    claims as files the pipeline writes into ``opts.out``) or an exit status (a report that writes its files)."""

    name: str
    description: str
    scales: tuple[str, ...]
    plan: Callable[[argparse.Namespace], Plan]
    record: Callable[[Point, Result, Plan], Any]
    report: Callable[[list[Any], Plan, argparse.Namespace, float], int | Report]
    default_scale: str = "small"
    scale_help: str | None = None
    seeds_help: str = "number of seeds, 0..N-1 (default: the preset's)"
    options: tuple[Option, ...] = ()
    # the page's generated sections (fedweave.experiments.pages), by block name, rendered from the records
    # folder beside the page (docs/reproductions/<paper>/ for docs/reproductions/<paper>.md)
    sections: Callable[[Path], dict[str, str]] | None = None

    def add_arguments(self, parser: argparse.ArgumentParser, count: Callable[[str], int]) -> None:
        """The front end's options on ``parser``: the common ones, then the study's; ``count`` is the type of
        a whole number >= 1."""
        parser.add_argument("--scale", choices=self.scales, default=self.default_scale, help=self.scale_help)
        parser.add_argument("--seeds", type=count, default=None, help=self.seeds_help)
        parser.add_argument("--workers", type=count, default=min(2, os.cpu_count() or 1), help="parallel runs")
        parser.add_argument(
            "--out",
            default=None,
            help=f"output directory (default: runs/reproduce-{self.name}, or runs/reproduce-{self.name}-SCALE for a "
            f"scale other than {self.default_scale}: scales share run names)",
        )
        parser.add_argument(
            "--budget-minutes", type=positive_minutes, default=None, help="start no new run after this many minutes"
        )
        for o in self.options:
            parser.add_argument(*o.flags, **({"type": count} if o.count else {}), **o.kwargs)
        if self.sections is not None:
            what = "after the report, rewrite this page's generated sections from the records beside it"
            parser.add_argument("--page", default=None, help=what + " (in the folder PAGE without .md)")

    def main(self, argv: list[str] | None = None) -> int:
        """Parse ``argv`` (the study's options) and run the study: for Python callers; ``fedweave reproduce``
        parses with the CLI's parser and calls ``execute``."""
        parser = _Parser(prog=f"fedweave reproduce {self.name}", description=self.description)
        self.add_arguments(parser, positive_int)
        argv = list(argv or [])
        return self.execute(parser.parse_args(argv), argv)

    def execute(self, opts: argparse.Namespace, argv: list[str] | None = None) -> int:
        """Plan, run the points (resumable, parallel, within the budget), record every finished run, report.
        ``argv``, the command line's options, is kept as ``opts.argv`` (a report may name its command)."""
        opts.argv = list(argv or [])
        if opts.out is not None and not opts.out.strip():  # an unset $OUT: "." and its files
            raise ConfigError(f"--out {opts.out!r}: an empty path; give a directory")
        if opts.out is None:  # each scale its own folder: scales share run names, whose runs would be replaced
            opts.out = f"runs/reproduce-{self.name}" + ("" if opts.scale == self.default_scale else f"-{opts.scale}")
        page = Path(opts.page) if getattr(opts, "page", None) else None
        if page is not None and not page.is_file():
            raise ConfigError(
                f"--page: {page} is not a file (the study's page: docs/reproductions/<paper>.md, docs/benchmarks.md)"
            )
        if page is not None and self.sections is not None:
            self._check_page(page, Path(opts.out))
        results_folder(opts.out, self.name, opts.scale)  # a bad --out is one line before any work
        t0 = time.perf_counter()
        plan = self.plan(opts)
        if not plan.rebuilds_out:
            users_folder(opts.out)
        Path(opts.out).mkdir(parents=True, exist_ok=True)  # marked as a reproduction's folder (users_folder)
        atomic_write(Path(opts.out) / OWNER, json.dumps({"study": self.name, "scale": opts.scale}) + "\n")
        budget = None if opts.budget_minutes is None else 60 * opts.budget_minutes
        records = self.records(plan, opts.out, workers=opts.workers, budget_s=budget, scale=opts.scale)
        if plan.skipped:
            print(f"{len(plan.skipped)} of {len(plan.points)} runs not started: the time budget ran out", flush=True)
        got = self.report(records, plan, opts, time.perf_counter() - t0)
        status = got.write(opts.out) if isinstance(got, Report) else int(got or 0)
        # a block the study does not render, or the reverse, is one ConfigError line
        # (a study without ``sections`` that takes --page writes its page itself, in its report)
        if page is not None and self.sections is not None and pages.update(page, self.sections(page.with_suffix(""))):
            print(f"rewrote the generated sections of {page}")
        return status

    def _check_page(self, page: Path, out: Path) -> None:
        """``--page`` rendered from the records beside it before any run: another study's page (its folder holds
        other records, its blocks other names) is one ``ConfigError`` naming --page, not a traceback after the
        runs. Not where ``--out`` is that folder (the runs write the records the sections read)."""
        folder = page.with_suffix("")
        if out.resolve() == folder.resolve():
            return
        try:
            pages.fill(page.read_text(encoding="utf-8"), self.sections(folder), str(page))
        except Exception as e:  # the study's renderer on records that are not its own: any error says so
            raise ConfigError(
                f"--page: {page} is not a page that '{self.name}' renders from the records in {folder} "
                f"({type(e).__name__}: {e}); give its own page, docs/reproductions/<paper>.md"
            ) from None

    def records(
        self, plan: Plan, out: str | Path, workers: int = 1, budget_s: float | None = None, scale: str = ""
    ) -> list[Any]:
        """Run the plan's points into ``out/runs`` (``run_points``: a finished run of the same config is reused
        and marked in ``plan.reused``, a killed one resumes; no run starts after ``budget_s``) and return the
        record of every finished run, in the plan's order."""
        if plan.solve is None:  # runner runs: each point as its run will check it, before anything is written
            check_points(plan.points, "reproduction point")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        print(f"{self.name} reproduction, scale {scale}: {len(plan.points)} runs, {workers} worker(s) -> {out}",
              flush=True)  # fmt: skip
        if not plan.points:  # e.g. a report rebuilt from its records: nothing to run, no runs/ made
            return []
        atomic_write(out / "runs" / OWNER, json.dumps({"study": self.name, "scale": scale}) + "\n")
        if plan.solve is not None:
            solved = _solved(plan, out / "runs", workers, budget_s)
            return [self.record(pt, solved[pt.slug], plan) for pt in plan.points if pt.slug in solved]
        plan.reused = set(finished(plan.points, out / "runs"))
        runs = run_points(
            plan.points, out / "runs", workers=workers, overwrite=True, budget_s=budget_s, initializer=plan.initializer
        )
        plan.skipped = [pt for pt in plan.points if pt.slug not in runs]
        return [self.record(pt, runs[pt.slug], plan) for pt in plan.points if pt.slug in runs]


OWNER = ".reproduction"  # in OUT/runs: the study and scale whose runs the folder holds


def results_folder(out: str | Path, name: str, scale: str) -> Path:
    """``--out`` checked before any run, nothing made yet: a folder this process can write (or can make), whose
    ``runs/`` holds no other study's or scale's runs (``OWNER``). Two scales share run names (fedmim's ``small``
    and ``long`` both name ``fashion_mnist-dir0.1-fedavg-s0``) and a run directory of another config is
    replaced, so one scale's runs would silently replace the other's. Else a ``ConfigError`` of one line naming
    --out."""
    out = Path(out)
    if what := folder_refusal(out):
        raise ConfigError(f"--out: {out} {what}; give a folder this user can write (made if missing)")
    try:
        owner = json.loads((out / "runs" / OWNER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return out  # no runs yet, or runs made before the owner was kept
    if owner != {"study": name, "scale": scale}:
        theirs = f"{owner.get('study')} --scale {owner.get('scale')}" if isinstance(owner, dict) else str(owner)
        raise ConfigError(
            f"--out: {out} holds the runs of 'fedweave reproduce {theirs}', which '{name} --scale {scale}' would "
            "replace; give another folder for it"
        )
    return out


def users_folder(out: str | Path) -> None:
    """A ``ConfigError`` of one line when ``--out`` is a folder with files but without the mark ``.reproduction``
    that each invocation writes (in it and in its ``runs/``): such a folder is the user's, among which the report's
    files (``table.md``, ``results.csv``, ...) would land and replace theirs. A ``runs/`` of its own does not make it
    a reproduction's: ``fedweave run`` and ``sweep`` write ``runs/`` by default. Not asked of a plan that
    ``rebuilds_out`` (``cfl-saga --report-only`` reads an earlier invocation's records there)."""
    out = Path(out)
    ours = (out / OWNER).is_file() or (out / "runs" / OWNER).is_file()
    if out.is_dir() and not ours and (entries := sorted(p.name for p in out.iterdir())):
        shown = first_names(entries)
        raise ConfigError(
            f"--out: {out} holds files but no reproduction's mark {OWNER} ({shown}), which its report could replace; "
            "give a new or empty folder, or an earlier reproduction's"
        )


def choices(value: str | None, allowed: Sequence[str], flag: str) -> list[str] | None:
    """An option's comma list (None when not given), each item one of ``allowed``: else a ``ConfigError`` of one
    line naming the flag, the unknown items and what is allowed."""
    if value is None:
        return None
    items = [s.strip() for s in value.split(",") if s.strip()]
    if (bad := [s for s in items if s not in allowed]) or not items:
        raise ConfigError(f"{flag}: unknown {bad or [value]}; allowed {', '.join(allowed)}")
    return items


def known_datasets(names: Sequence[str], flag: str) -> None:
    """Every name of ``names`` a registered dataset: else a ``ConfigError`` of one line naming the flag, the
    unknown name and what is allowed, before any run (a run would fail on it only once the sweep had started)."""
    from fedweave.registry import DATASETS

    for name in names:
        if name not in DATASETS:
            raise ConfigError(f"{flag}: unknown dataset {name!r}; allowed {', '.join(DATASETS.names())}")


def not_run(skipped: Sequence[Point]) -> str:
    """A report's line naming the points the time budget left unrun (each by its values and seed, or by its run's
    name when it has no values), or ""."""
    if not skipped:
        return ""

    # a point labelled by no values (a run config written out in full, named by its run) is named by its run; a
    # flag among the values by its key where it is set (cfl-saga's ``curve``), not as "True" or "False"
    def words(pt: Point) -> list[Any]:
        return [k if v is True else v for k, v in dict(pt.values).items() if v is not False]

    names = ("-".join(map(str, [*words(pt), pt.seed])) if pt.values else pt.slug for pt in skipped)
    return "\nNot run (time budget reached): " + ", ".join(names) + "\n"


@dataclass(frozen=True)
class Rows:
    """A CSV file of a report: ``rows`` under ``columns`` (``tables.csv_text``: by default every key)."""

    rows: Sequence[Any]
    columns: Sequence[str] | None = None
    float_format: str | None = None


@dataclass(frozen=True)
class Json:
    """A JSON file of a report: ``json.dumps(data, indent=indent, ensure_ascii=ensure_ascii) + end``."""

    data: Any
    indent: int | None = 2
    ensure_ascii: bool = True
    end: str = ""


@dataclass
class Report:
    """What a study's report writes into ``--out``, declared: ``files`` by name, in order (text as it is, a
    ``Rows`` as CSV, a ``Json`` as JSON), the figures drawn after them (``figures(out)``: a failing plot
    loses no record), the file printed after (``show``), and the exit status."""

    files: dict[str, str | Rows | Json]
    show: str | None = None
    status: int = 0
    say: str | None = None  # a line printed after the files are written (e.g. where the report is)
    figures: Callable[[Path], Any] | None = None

    def write(self, out: str | Path, show: bool = True) -> int:
        """Write every file into ``out``, each atomically; print the one named ``show`` and ``say`` (unless
        ``show`` is False); the exit status."""
        for name, content in self.files.items():
            if isinstance(content, Rows):
                content = csv_text(content.rows, list(content.columns or []) or None, content.float_format)
            elif isinstance(content, Json):
                content = (
                    json.dumps(content.data, indent=content.indent, ensure_ascii=content.ensure_ascii) + content.end
                )
            atomic_write(Path(out) / name, content)
        if self.figures is not None:
            self.figures(Path(out))
        if show and self.show is not None:
            print(self.files[self.show])
        if show and self.say is not None:
            print(self.say)
        return self.status


def save_records(path: Path, arrays_path: Path, records: list[dict[str, Any]], key: str, parts: str) -> None:
    """A report's records, so that it can be rebuilt without running: ``path`` holds them as JSON without their
    ``key`` (a tuple of arrays, e.g. a run's traces), ``arrays_path`` those arrays as ``<record>_<part>``, one
    letter of ``parts`` per array; both written atomically."""
    plain = [{k: v for k, v in r.items() if k != key} for r in records]
    atomic_write(path, json.dumps(plain, indent=1) + "\n")
    arrays = {f"{i}_{n}": a for i, r in enumerate(records) if key in r for n, a in zip(parts, r[key])}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write(arrays_path, buf.getvalue())


def load_records(path: Path, arrays_path: Path, key: str, parts: str) -> list[dict[str, Any]]:
    """The records ``save_records`` wrote, with their arrays under ``key`` when ``arrays_path`` is there."""
    records = json.loads(path.read_text())
    if not arrays_path.is_file():
        return records
    with np.load(arrays_path) as z:
        for i, r in enumerate(records):
            if f"{i}_{parts[0]}" in z:
                r[key] = tuple(z[f"{i}_{n}"] for n in parts)
    return records


# ---- runs that are not runner runs: solved records, kept per point ----------------------------------------
def _spec(point: Any) -> dict[str, Any]:
    """A point's identity as JSON would give it back (what a kept record is compared with)."""
    return json.loads(json.dumps(dataclasses.asdict(point)))


def _save_solved(run_dir: Path, point: Any, record: dict[str, Any]) -> None:
    """``record.json`` (the point and its record; arrays left out) and ``arrays.npz`` (a record's values that
    are arrays, or tuples of arrays, as ``<key>.<i>``), each written atomically, ``record.json`` last."""
    arrays = {k: v for k, v in record.items() if isinstance(v, np.ndarray | tuple)}
    flat = {f"{k}.{i}": a for k, v in arrays.items() for i, a in enumerate(v if isinstance(v, tuple) else (v,))}
    buf = io.BytesIO()
    np.savez_compressed(buf, **flat)
    atomic_write(run_dir / "arrays.npz", buf.getvalue())
    plain = {k: v for k, v in record.items() if k not in arrays}
    kinds = {k: "tuple" if isinstance(v, tuple) else "array" for k, v in arrays.items()}
    atomic_write(run_dir / "record.json", json.dumps({"point": _spec(point), "record": plain, "arrays": kinds}) + "\n")


def _load_solved(run_dir: Path, point: Any) -> dict[str, Any] | None:
    """The kept record of ``point`` in ``run_dir``, or None when there is none or it is another point's."""
    try:
        kept = json.loads((run_dir / "record.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if kept.get("point") != _spec(point):
        return None
    record = kept["record"]
    with np.load(run_dir / "arrays.npz") as z:
        for key, kind in kept["arrays"].items():
            parts = [z[n] for n in sorted((n for n in z.files if n.rsplit(".", 1)[0] == key), key=_index)]
            record[key] = tuple(parts) if kind == "tuple" else parts[0]
    return record


def _index(name: str) -> int:
    return int(name.rsplit(".", 1)[1])


def _solved(plan: Plan, runs_dir: Path, workers: int, budget_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Per point's slug, its record: kept from an earlier call when its directory holds the same point's
    record, else solved on ``workers`` forked processes (``parallel_map``) and kept in ``runs_dir/<slug>``.
    No point starts after ``budget_s``; those are in ``plan.skipped`` and have no record."""
    kept = {p.slug: r for p in plan.points if (r := _load_solved(runs_dir / p.slug, p)) is not None}
    plan.reused = set(kept)
    todo = [p for p in plan.points if p.slug not in kept]
    t0, done = time.perf_counter(), iter(range(1, len(todo) + 1))

    def finished_one(i: int, record: dict[str, Any]) -> None:
        _save_solved(runs_dir / todo[i].slug, todo[i], record)
        line = plan.progress(record) if plan.progress else todo[i].slug
        print(f"[{next(done)}/{len(todo)} {time.perf_counter() - t0:6.0f}s] {line}", flush=True)

    new = parallel_map(plan.solve, todo, workers=workers, on_result=finished_one, budget_s=budget_s)
    kept.update((p.slug, r) for p, r in zip(todo, new) if r is not None)
    plan.skipped = [p for p in plan.points if p.slug not in kept]
    return kept
