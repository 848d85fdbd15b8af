"""``fedweave sweep``: expand, run, aggregate over seeds, and write sweep.csv, summary.csv/.md and plots."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedweave.config import ConfigError, ray_address_error
from fedweave.experiments import baseline as paired
from fedweave.experiments.aggregate import best_point, best_trained, if_all, mean_std, to_target
from fedweave.experiments.grid import expand
from fedweave.experiments.jobs import check_points, check_reusable, check_workers, run_points
from fedweave.experiments.tables import markdown, write_csv
from fedweave.results import atomic_write, file_in_the_way, holds_run, locked_sweep_dir, read_metrics


@dataclass
class SweepResult:
    """What ``fedweave.sweep`` returns: one record per run, one per point (over seeds), the best point."""

    out_dir: Path  #: the sweep's directory (``out``)
    records: list[dict[str, Any]]  #: one per run: its point, values, seed, status, final and best metric, bytes
    summary: list[dict[str, Any]]  #: one per point: the metric's mean and std over the seeds, ``best`` marked
    best: int | None  #: the index in ``summary`` of the best point among those whose every run completed (or None)

    def table(self) -> str:
        """The summary as a markdown table, the best point in bold."""
        return markdown(self.summary, self.best)


def sweep(
    config: str | Path | dict[str, Any],
    grid: dict[str, list[Any]] | None = None,
    *,
    zipped: dict[str, list[Any]] | None = None,
    seeds: int = 1,
    workers: int = 1,
    out: str | Path = "runs/sweep",
    overrides: list[str] | None = None,
    metric: str | None = None,
    target: float | None = None,
    progress: bool = True,
    ray_address: str | None = None,
    baseline: str | Mapping[str, Any] | None = None,
    level: float | None = None,
    test: str | None = None,
    correction: str | None = None,
) -> SweepResult:
    """Run ``config`` over the ``grid`` (product), ``zipped`` keys (together) and ``seeds`` seeds into ``out``.
    Runs already finished there are reused and killed ones resume, so re-running a sweep continues it.
    ``metric``: the column to tabulate (default: the task's main metric, ``test_accuracy`` for classification);
    best values, the best point and ``target`` follow its direction (lower is better for a loss or an error).

    ``overrides`` (``key=value`` strings) apply to every point's config; ``workers`` processes run at once,
    or with ``ray_address`` the runs are Ray tasks on that cluster (:func:`~fedweave.experiments.jobs.run_points`);
    ``progress`` shows a bar. ``target`` adds the rounds and bytes each run took to reach it. Writes
    ``sweep.json`` (the spec), ``runs/<point>``, ``sweep.csv`` (a row per run), ``summary.csv`` and
    ``summary.md`` (a row per point: mean and std over seeds) and the plots into ``out``, and returns them as
    a :class:`SweepResult`.

    ``baseline`` (``"KEY=VALUE[,KEY=VALUE]"``, a mapping, or a bare value when the grid varies one key) names
    one grid point: every other point's final metric is then compared with it, paired by seed, by the
    ``level`` (0.95) interval of the ``test`` (``"t"`` or ``"bootstrap"``) of
    :mod:`fedweave.experiments.baseline`; its columns are added to summary.csv (and the per-seed difference
    to sweep.csv), and ``sweep.json`` records the baseline, level and test. Without it the files are as
    before. ``correction`` (``"holm"``, ``"bonferroni"`` or ``"none"``) corrects those comparisons for their
    number (:mod:`fedweave.experiments.baseline`); not given, none is made and the files are those of a sweep
    run before the option existed; given (``"none"`` too), summary.csv gains the interval's level, the p-value,
    the adjusted p-value and the correction, and ``sweep.json`` records it."""
    from fedweave.results import run_metric
    from fedweave.tasks import column_direction

    check_workers(workers)  # like the grid, before anything is written
    if ray_address is not None and (why := ray_address_error(ray_address)):
        raise ConfigError(f"--ray {why}")
    if not isinstance(progress, bool):  # a string is truthy: progress="no" showed the bar
        raise ConfigError(f"progress must be True or False, got {progress!r}")
    if target is not None and (
        isinstance(target, bool) or not isinstance(target, int | float) or not math.isfinite(target)
    ):
        # NaN is never reached (every comparison with it is false): the columns read '-' as if no run got there
        raise ConfigError(f"--target must be a finite number (a value of the metric to reach), got {target!r}")
    if baseline is None and (level is not None or test is not None or correction is not None):
        raise ConfigError(
            "--level, --test and --correction apply to a comparison with a --baseline point; give --baseline"
        )
    points = expand(config, grid, zipped=zipped, seeds=seeds, overrides=overrides)
    check_points(points)  # every point as its run will check it, before the first run starts
    base = None
    if baseline is not None:  # checked before anything runs, like the grid
        level, test = paired.check_test(0.95 if level is None else level, "t" if test is None else test)
        if correction is not None:
            correction = paired.check_correction(correction)
        base = paired.resolve(paired.parse_baseline(baseline), [p.values for p in points])
    defaulted = metric is None
    if metric is not None and (why := _unlogged(metric, points)):  # before a run: it would be refused after all
        raise ConfigError(why)
    metric = metric or _main_column(points[0].config)
    out = Path(out)
    if what := file_in_the_way(out):
        raise ConfigError(f"--out: {out} {what}; give a folder (made if missing)")
    if what := _not_a_sweep(out):
        raise ConfigError(f"--out: {out} {what}; give another folder (a new one, or an earlier sweep's)")
    # for its whole life, before anything is written: two sweeps of different grids on one --out at once left
    # it mixed (sweep.json the second's, the tables the first's), and the report then mislabelled them
    with locked_sweep_dir(out):
        check_reusable(points, out / "runs")  # before sweep.json is rewritten: a refused sweep leaves it as it was
        spec = {"grid": grid or {}, "zipped": zipped or {}, "seeds": seeds, "metric": metric, "target": target}
        # the base config's seed and every run's directory and point, so that a report of a running or killed
        # sweep reads its runs from here rather than expanding the grid again
        spec["base_seed"] = points[0].seed
        spec["runs"] = [{"run_dir": f"runs/{p.slug}", "point": p.label} for p in points]
        if base is not None:  # only then, so that a sweep without one writes the sweep.json it always did
            spec["baseline"] = {"point": base, "level": level, "test": test}
            if correction is not None:  # only when given, so a sweep without it writes the sweep.json it did
                spec["baseline"]["correction"] = correction
        earlier = (out / "sweep.json").read_bytes() if (out / "sweep.json").is_file() else None
        atomic_write(out / "sweep.json", json.dumps(spec, indent=2, default=str))
        results = run_points(points, out / "runs", workers=workers, progress=progress, ray_address=ray_address)
        # no run's rows hold the task's main metric (the confederated family's synthetic problem has no test set):
        # tabulate the column the runs' own plots show, as `fedweave plot` and the report do
        # (a run that wrote no rows, diverged before its first evaluation, says nothing of its columns)
        own, wrote = None, [p for p in points if (out / "runs" / p.slug / "metrics.jsonl").is_file()]
        if wrote and not any(results[p.slug].summary.get("main_metric") for p in points):
            own = next((m for p in wrote if (m := run_metric(results[p.slug].summary))), None)
        if defaulted and own is not None:
            metric = own
            spec["metric"] = metric
            atomic_write(out / "sweep.json", json.dumps(spec, indent=2, default=str))

        records, by_point, curves, statuses = [], {}, {}, {}
        for p in points:
            s = results[p.slug].summary
            rows = read_metrics(out / "runs" / p.slug) if (out / "runs" / p.slug / "metrics.jsonl").is_file() else []
            final = s.get("final") or {}
            rec = {
                "point": p.label,
                **dict(p.values),
                "seed": p.seed,
                "status": s["status"],
                "rounds": s["rounds"],
                f"final_{metric}": final.get(metric),
                f"best_{metric}": best_trained(rows, metric, column_direction(metric)),
                "bytes_total": s["communication"]["bytes_total"],
                "wall_seconds": s["wall_seconds"],
                "run_dir": f"runs/{p.slug}",
            }
            if target is not None:
                rec["rounds_to_target"] = to_target(rows, metric, target, "round", column_direction(metric))
                rec["bytes_to_target"] = to_target(rows, metric, target, "bytes_total", column_direction(metric))
            records.append(rec)
            by_point.setdefault(p.label, []).append(rec)
            statuses.setdefault(p.label, []).append(s["status"])
            if rows:  # a run diverged before its first row draws nothing (it would empty its point's band)
                curves.setdefault(p.label, []).append(rows)

        written = [(k, v) for rows in curves.values() for rs in rows for r in rs for k, v in r.items() if v is not None]
        if not defaulted and written and metric not in {k for k, _ in written}:
            # a misspelt --metric used to give a table of nan; the runs stay, so running again with the right
            # column reuses them (runs that wrote no rows at all prove nothing either way); the columns offered are
            # the measured ones (floats, as `fedweave plot` lists them), not the counts
            known = sorted({k for k, v in written if isinstance(v, float)})
            # sweep.json as it was (or, new, with the column a sweep without --metric tabulates): a report reads its
            # metric, and it named the refused one beside the earlier summary.csv, every column of its tables blank
            spec["metric"] = own or _main_column(points[0].config)
            atomic_write(out / "sweep.json", earlier or json.dumps(spec, indent=2, default=str))
            raise ConfigError(
                f"--metric {metric!r} is not a column of the sweep's runs in {out / 'runs'}; choose one of "
                f"{', '.join(known)} (run the sweep again with it: its finished runs are reused)"
            )

        compared = {}
        if base is not None:  # each point against the baseline, paired by seed, on the final metric
            diffs = paired.per_seed(records, f"final_{metric}", base)
            for rec in records:  # the run's final metric minus the baseline's at its seed (empty: not paired)
                rec[f"diff_final_{metric}"] = diffs.get((rec["point"], rec["seed"]))
            compared = paired.compare(
                records, f"final_{metric}", base, column_direction(metric), level, test, correction or "none"
            )

        summary = []
        for label, recs in by_point.items():
            done = [r[f"final_{metric}"] for r in recs if r["status"] == "completed"]
            m, sd = mean_std(done)
            row = {"point": label, "seeds": len(recs), "diverged": sum(r["status"] == "diverged" for r in recs)}
            # one completed run has no spread to show (a sample std needs two): NaN, "-" in summary.md, not 0.0
            row[f"{metric}_mean"], row[f"{metric}_std"] = m, sd if len(done) > 1 else math.nan
            if target is not None:
                for x in ("rounds_to_target", "bytes_to_target"):
                    row[f"{x}_mean"] = if_all([r[x] for r in recs], lambda v: mean_std(v)[0])  # all seeds reached it
            if base is not None:
                row.update(paired.row(compared[label], metric, correction))
            summary.append(row)
        whole = [all(r["status"] == "completed" for r in by_point[row["point"]]) for row in summary]
        best = best_point([row[f"{metric}_mean"] for row in summary], whole, column_direction(metric))
        for i, r in enumerate(summary):
            r["best"] = i == best

        write_csv(out / "sweep.csv", records)
        write_csv(out / "summary.csv", summary)
        atomic_write(out / "summary.md", markdown(summary, best))
        from fedweave.experiments.plots import diverged_mark, plot_sweep

        plot_sweep({label + diverged_mark(statuses[label]): rows for label, rows in curves.items()}, out, metric)
        return SweepResult(out, records, summary, best)


def _not_a_sweep(out: Path) -> str | None:
    """Why the existing folder ``out``, holding no ``sweep.json``, cannot take a sweep: it holds a run, or files
    the sweep writes (its tables and plots would replace them: a run's own ``test_accuracy_vs_rounds.png`` was
    replaced by the sweep's, silently); None when it can (a new or an earlier sweep's folder, or another one)."""
    if not out.is_dir() or (out / "sweep.json").is_file():
        return None
    if holds_run(out):
        return "holds a run (its config.yaml, metrics or summary), not a sweep, whose plots the sweep's would replace"
    ours = [n for n in ("sweep.csv", "summary.csv", "summary.md") if (out / n).exists()]
    ours += sorted(p.name for p in (*out.glob("*_vs_rounds.png"), *out.glob("*_vs_bytes.png")))
    if ours:
        return f"holds {', '.join(ours[:3])}, which the sweep would replace, and no sweep.json (no sweep's folder)"
    return None


def _unlogged(metric: str, points: list) -> str | None:
    """Why ``--metric`` is no column any point's run can log, where the config says so before a run: a test
    column (``test_<key>``, with a suffix such as ``_min``, ``_personal``; per client ``client_test_...``) of a
    key no metric of its task gives, or a bare metric name (``accuracy``); None where it may be one (any other
    column is the algorithm's, known once a run has written it; a plug-in algorithm's own columns too)."""
    from fedweave.registry import ALGORITHMS, METRICS
    from fedweave.tasks import build_task

    first = None
    for p in points:
        algorithm = ALGORITHMS.get(p.config.algorithm.name)
        if not algorithm.__module__.startswith("fedweave.") or not algorithm.plot_metric.startswith("test_"):
            return None  # a plug-in's columns, or a family whose rows are not the task's (confederated: opt_gap)
        t = p.config.task
        task = build_task(t.loss, t.loss_options, t.metrics, t.main)
        keys = [k for m in task.metrics for k in METRICS.get(m).keys] + ["loss"]
        column = metric.removeprefix("client_")
        logged = column == "test_backdoor_success" or any(column == f"test_{k}" or column.startswith(f"test_{k}_")
                                                          for k in keys)  # fmt: skip
        if logged or not (column.startswith("test_") or metric in keys):
            return None
        first = first or (task.metrics, [f"test_{k}" for k in keys])
    metrics, columns = first
    return (
        f"--metric {metric!r} is not a column the config's task logs (task.metrics: {', '.join(metrics)}); choose "
        f"one of {', '.join(columns)}, or another column of the runs (train_loss, bytes_total, ...)"
    )


def _main_column(config) -> str:
    """``test_<main>``: the column of the task's main metric (the config's ``task`` section)."""
    from fedweave.tasks import build_task

    t = config.task
    return build_task(t.loss, t.loss_options, t.metrics, t.main).main_key
