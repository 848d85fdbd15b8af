"""docs/robustness.md's picture: final test accuracy against the fraction of Byzantine clients, for each
aggregator and attack, from the records of ``fedweave sweep`` runs (the first without attackers).

``python -m fedweave.robust.report CLEAN_SWEEP ATTACKED_SWEEP... --out docs/robustness`` gathers the
sweeps' ``sweep.csv`` into ``records.csv`` (a row per run) and writes ``table.md`` and ``accuracy.png`` from
it; ``python -m fedweave.robust.report --records docs/robustness/records.csv --out docs/robustness`` rebuilds
the table and the plot from committed records alone.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
from pathlib import Path

from fedweave.results import atomic_write

FIELDS = ("aggregator", "attack", "fraction", "seed", "status", "final_test_accuracy", "final_backdoor_success")
CLEAN = "none"  # the attack column of the runs without attackers
CAPTION = "Final test accuracy (%), mean ± std"  # how table.md begins
BACKDOOR = "backdoor"  # the attack whose runs also record their final test_backdoor_success


def gather(clean: Path, *attacked: Path) -> list[dict[str, str]]:
    """The runs of the sweep directories as records (``FIELDS``), sorted; the clean runs (the first sweep)
    have attack ``none`` and fraction 0. A backdoor run's success rate comes from its ``summary.json``."""
    rows = []
    for path, is_clean in ((clean, True), *((a, False) for a in attacked)):
        with open(Path(path) / "sweep.csv", newline="") as f:
            for r in csv.DictReader(f):
                rows.append(
                    {
                        "aggregator": r["aggregator.name"],
                        "attack": CLEAN if is_clean else r["faults.byzantine.attack"],
                        "fraction": "0.0" if is_clean else r["faults.byzantine.fraction"],
                        "seed": r["seed"],
                        "status": r["status"],
                        "final_test_accuracy": r["final_test_accuracy"],
                        "final_backdoor_success": _backdoor(Path(path), r) if not is_clean else "",
                    }
                )
    return sorted(rows, key=lambda r: (r["aggregator"], r["attack"], float(r["fraction"]), int(r["seed"])))


def _backdoor(sweep: Path, row: dict[str, str]) -> str:
    """A backdoor run's final ``test_backdoor_success`` (empty for another attack or a run without it)."""
    if row["faults.byzantine.attack"] != BACKDOOR:
        return ""
    final = json.loads((sweep / row["run_dir"] / "summary.json").read_text()).get("final") or {}
    return repr(final["test_backdoor_success"]) if "test_backdoor_success" in final else ""


def records_text(rows: list[dict[str, str]]) -> str:
    """The records as CSV text (the committed ``records.csv``)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def read_records(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _order(rows: list[dict[str, str]], key: str) -> list[str]:
    return list(dict.fromkeys(r[key] for r in rows))


def cells(rows: list[dict[str, str]], key: str = "final_test_accuracy") -> dict[tuple[str, str, float], list[float]]:
    """(aggregator, attack, fraction) -> the final values of ``key`` over seeds (NaN for a diverged run)."""
    out: dict[tuple[str, str, float], list[float]] = {}
    for r in rows:
        value = float(r[key]) if r["status"] == "completed" and r.get(key) else math.nan
        out.setdefault((r["aggregator"], r["attack"], float(r["fraction"])), []).append(value)
    return out


def _cell(values: list[float]) -> str:
    if any(math.isnan(v) for v in values):
        bad = sum(math.isnan(v) for v in values)
        return f"diverged ({bad}/{len(values)})"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.1f} ± {100 * sd:.1f}"


def table(rows: list[dict[str, str]]) -> str:
    """One markdown table per attack: a row per aggregator, a column per fraction of attackers (0: the clean
    runs), each cell the final test accuracy in %, mean ± std over seeds."""
    by = cells(rows)
    aggs = _order(rows, "aggregator")
    attacks = [a for a in _order(rows, "attack") if a != CLEAN]
    fractions = sorted({float(r["fraction"]) for r in rows if r["attack"] != CLEAN})
    seeds = len({r["seed"] for r in rows})
    out = [
        f"{CAPTION} over {seeds} seeds; column: the fraction of Byzantine clients "
        "(0: no attacker); -: not run (the aggregator's bound fails there: Bulyan's n >= 4f + 3, Krum's n >= 2f + 3).\n"
    ]
    for attack in attacks:
        out.append(f"\n**{attack}**\n\n")
        out.append("| aggregator | " + " | ".join(f"{f:g}" for f in [0.0, *fractions]) + " |\n")
        out.append("|---|" + "---|" * (1 + len(fractions)) + "\n")
        for agg in aggs:
            row = [_cell(by[(agg, CLEAN, 0.0)]) if (agg, CLEAN, 0.0) in by else "-"]
            row += [_cell(by[(agg, attack, f)]) if (agg, attack, f) in by else "-" for f in fractions]
            out.append(f"| {agg} | " + " | ".join(row) + " |\n")
    success = cells([r for r in rows if r["attack"] == BACKDOOR], "final_backdoor_success")
    if success:  # the backdoor's own measure: how often the trigger makes the model say the target
        out.append(
            f"\n**{BACKDOOR}: attack success rate** (%): the share of the test samples of other classes that the final "
            "model, with the trigger stamped on, classifies as the target (`test_backdoor_success`), mean ± std over "
            f"{seeds} seeds.\n\n"
        )
        out.append("| aggregator | " + " | ".join(f"{f:g}" for f in fractions) + " |\n")
        out.append("|---|" + "---|" * len(fractions) + "\n")
        for agg in aggs:
            row = [_cell(success[(agg, BACKDOOR, f)]) if (agg, BACKDOOR, f) in success else "-" for f in fractions]
            out.append(f"| {agg} | " + " | ".join(row) + " |\n")
    return "".join(out)


def plot(rows: list[dict[str, str]], path: Path) -> None:
    """A panel per attack: accuracy against the fraction of attackers, a line per aggregator."""
    from fedweave.plots import plt, save_png

    by = cells(rows)
    aggs = _order(rows, "aggregator")
    attacks = [a for a in _order(rows, "attack") if a != CLEAN]
    fractions = sorted({float(r["fraction"]) for r in rows if r["attack"] != CLEAN})
    means = [statistics.fmean(v) for v in by.values() if not any(math.isnan(x) for x in v)]
    bottom = 10 * math.floor(10 * min(means)) if means else 0  # the lowest mean's tens, in %
    cols = 4
    nrows = math.ceil(len(attacks) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), sharey=True, squeeze=False)
    for ax, attack in zip(axes.flat, attacks, strict=False):
        for agg in aggs:
            xs = [0.0, *fractions]
            vals = [by.get((agg, CLEAN, 0.0), [math.nan])] + [by.get((agg, attack, f), [math.nan]) for f in fractions]
            ys = [100 * statistics.fmean(v) for v in vals]  # NaN where not run or a seed diverged: a gap
            ax.plot(xs, ys, marker="o", markersize=3, label=agg)
        ax.set_title(attack)
        ax.set_xlabel("fraction of Byzantine clients")
        ax.set_ylim(bottom, 100)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    for ax in list(axes.flat)[len(attacks) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", bbox_to_anchor=(0.98, 0.08), fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


def ours(out: Path) -> bool:
    """Whether ``out`` is new, empty, or an earlier report's folder (its ``records.csv`` has this module's columns,
    or its ``table.md`` this module's caption): elsewhere the report's files could replace files of the user's."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    records, caption = out / "records.csv", out / "table.md"
    if records.is_file():
        with open(records, newline="") as f:
            return tuple(next(csv.reader(f), ())) == FIELDS
    if caption.is_file():
        with open(caption, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(CAPTION)
    return not any(out.iterdir())


def main(argv: list[str] | None = None) -> int:
    """The command line of the module docstring."""
    p = argparse.ArgumentParser(prog="python -m fedweave.robust.report", description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="*", help="the clean sweep directory, then the attacked ones")
    p.add_argument("--records", help="rebuild from this records.csv instead of sweep directories")
    p.add_argument("--out", required=True, help="where records.csv, table.md and accuracy.png go")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not ours(out):
        p.error(
            f"--out: {out} is neither empty nor an earlier report's (no records.csv or table.md of its own); "
            "give a new folder"
        )
    if args.records:
        rows = read_records(Path(args.records))
    elif len(args.sweeps) >= 2:
        rows = gather(*map(Path, args.sweeps))
        atomic_write(out / "records.csv", records_text(rows).encode())
    else:
        p.error("give the clean sweep directory and the attacked ones, or --records")
    atomic_write(out / "table.md", table(rows).encode())
    plot(rows, out / "accuracy.png")
    print(out / "table.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
