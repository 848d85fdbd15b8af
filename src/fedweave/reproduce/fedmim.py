"""``fedweave reproduce fedmim``: FedMIM against its baselines (FedMIM paper, Table I; spec §9).

Runs every (dataset, split, method, seed) of a preset, each an ordinary fedweave run in
``OUT/runs/<dataset>-<split>-<method>-s<seed>`` (finished runs are reused, so an interrupted grid
continues), then writes ``OUT/results.csv`` (one row per run), ``OUT/table.csv`` and ``OUT/table.md``
(final test accuracy mean +- std over seeds beside the paper's Table I and ranking, and the checks of the
paper's claims), and ``OUT/curves-<dataset>.png`` (accuracy and local consistency per split).

Presets (``--scale``):
- ``smoke``: seconds; a handful of rounds on a tiny slice, for tests (``--datasets`` may name a fixture).
- ``small``: the scaled-down CPU grid of spec §9 on real Fashion-MNIST and MNIST (100 clients, 10 % per
  round, Dirichlet-0.1 and IID, ``cnn_small``, 3 seeds), in the spec's priority order (see GRIDS).
- ``long``: the small preset's Dir-0.1 Fashion-MNIST cell with FedMIM, FedAvg, FedCM and SCAFFOLD at
  T = 500 (3 seeds): tests whether FedMIM's gap closes or reverses over a longer horizon; also writes
  ``OUT/gaps.csv`` and ``OUT/gaps.md`` (accuracy and FedMIM's gaps at rounds 50, 150, 300 and 500).
- ``paper``: Table I's settings (CIFAR-10/100 files needed locally, ResNet-18-GN, E = 5, B = 50,
  T = 1000, lr 0.1 x 0.998^t, weight decay 1e-3); days of CPU time.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedweave.experiments.aggregate import mean_std
from fedweave.experiments.grid import Point
from fedweave.experiments.jobs import run_points
from fedweave.experiments.plots import band
from fedweave.experiments.tables import markdown_table, write_csv
from fedweave.plots import plt, save_png
from fedweave.results import atomic_write
from fedweave.runner import Result

# ---- the paper's numbers ------------------------------------------------------------------------------
METHODS = ("fedavg", "fedadam", "scaffold", "fedcm", "feddyn", "fedsam", "fedmim")
LABELS = {
    "fedavg": "FedAvg",
    "fedadam": "FedAdam",
    "scaffold": "SCAFFOLD",
    "fedcm": "FedCM",
    "feddyn": "FedDyn",
    "fedsam": "FedSAM",
    "fedmim": "FedMIM",
}
# Table I: test accuracy (%) after 1000 rounds; columns (dataset, split)
TABLE_I: dict[str, dict[tuple[str, str], float]] = {
    m: dict(zip([(d, s) for d in ("cifar10", "cifar100", "tiny") for s in ("iid", "dir0.3", "dir0.1")], row))
    for m, row in {
        "fedavg": (82.16, 80.19, 75.92, 42.77, 42.18, 40.88, 30.31, 28.61, 27.93),
        "fedadam": (83.19, 78.61, 71.75, 48.92, 44.58, 42.96, 37.04, 32.34, 29.44),
        "scaffold": (84.43, 82.39, 78.78, 49.11, 48.34, 46.93, 35.09, 34.68, 34.17),
        "fedcm": (85.62, 82.57, 77.31, 51.14, 49.27, 45.59, 34.35, 33.34, 32.34),
        "feddyn": (84.23, 81.44, 75.66, 46.87, 45.77, 43.93, 33.91, 31.97, 30.11),
        "fedsam": (84.98, 82.13, 77.65, 48.32, 46.24, 44.18, 35.04, 33.15, 32.86),
        "fedmim": (86.39, 84.39, 80.82, 52.83, 50.53, 49.20, 36.47, 35.17, 34.83),
    }.items()
}
SPLITS = {
    "iid": {"name": "iid"},
    "dir0.3": {"name": "dirichlet_balanced", "alpha": 0.3},
    "dir0.1": {"name": "dirichlet_balanced", "alpha": 0.1},
}
# paper defaults (spec §3): FedCM / FedDyn alpha 0.1, FedAdam eta_g 0.1, FedSAM rho 0.1, FedMIM Table III best
METHOD_OPTIONS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedadam": {"server_lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-2},
    "scaffold": {},
    "fedcm": {"alpha": 0.1},
    "feddyn": {"alpha": 0.1},
    "fedsam": {"rho": 0.1},
    "fedmim": {"alpha": [0.6, 0.3], "beta": [0.9, 0.1]},
}


@dataclass
class Preset:
    grid: list[tuple[str, str, tuple[str, ...]]]  # (dataset, split, methods), in priority order
    seeds: tuple[int, ...]
    rounds: int
    num_clients: int
    clients_per_round: int
    model: str
    local: dict[str, Any]
    dataset_options: dict[str, Any] = field(default_factory=dict)
    eval_every: int = 5
    note: str = ""
    extension: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # run with --extend
    report_rounds: tuple[int, ...] = ()  # also write OUT/gaps.{csv,md}: accuracy and gaps at these rounds


ALL = METHODS
MAIN = ("fedavg", "fedmim")  # the main claim, spec §9.1
SECOND = ("fedcm", "scaffold")  # FedMIM's J = 1 special case; the paper's strongest baseline at DIR.1
CORE = MAIN + SECOND
REST = ("fedadam", "feddyn", "fedsam")
PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        grid=[("mnist", "dir0.1", ("fedavg", "fedmim")), ("mnist", "iid", ("fedavg", "fedmim"))],
        seeds=(0,),
        rounds=3,
        num_clients=10,
        clients_per_round=3,
        model="logistic",
        local={"steps": 2, "batch_size": 16, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3},
        dataset_options={"max_train": 600, "max_test": 200},
        eval_every=1,
        note="smoke preset: a few rounds on a tiny slice; checks the pipeline, not the paper",
    ),
    # Spec §9 priority: (1) FedMIM vs FedAvg at Dir-0.1 and the IID control, (2) FedCM (FedMIM's J = 1
    # special case) and SCAFFOLD (the paper's strongest baseline at DIR.1) on Fashion-MNIST, (3) the main
    # claim again on MNIST: 36 runs, about 12 min on 2 idle cores (measured 40 CPU-s per run).
    # --extend adds the other baselines on Fashion-MNIST and FedCM/SCAFFOLD on MNIST (30 more runs).
    "small": Preset(
        grid=[
            ("fashion_mnist", "dir0.1", MAIN),
            ("fashion_mnist", "iid", MAIN),
            ("fashion_mnist", "dir0.1", SECOND),
            ("fashion_mnist", "iid", SECOND),
            ("mnist", "dir0.1", MAIN),
            ("mnist", "iid", MAIN),
        ],
        extension=[
            ("fashion_mnist", "dir0.1", REST),
            ("fashion_mnist", "iid", REST),
            ("mnist", "dir0.1", SECOND),
            ("mnist", "iid", SECOND),
        ],
        seeds=(0, 1, 2),
        rounds=50,
        num_clients=100,
        clients_per_round=10,
        model="cnn_small",
        local={"epochs": 1, "batch_size": 20, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3, "grad_clip": 10.0},
        dataset_options={"max_train": 20000},
        eval_every=5,
        note="small preset: Fashion-MNIST/MNIST, 20k training images (200 per client), E = 1 epoch of B = 20 "
        "(K = 10), T = 50",
    ),
    # Issue check of the page's explanation "the gain comes from the learning-rate ramp-up": the small
    # preset's Dir-0.1 Fashion-MNIST cell with the four core methods, run ten times longer (T = 500);
    # evaluated every 10 rounds so the gap can be read at rounds 50, 150, 300 and 500.
    "long": Preset(
        grid=[("fashion_mnist", "dir0.1", CORE)],
        seeds=(0, 1, 2),
        rounds=500,
        num_clients=100,
        clients_per_round=10,
        model="cnn_small",
        local={"epochs": 1, "batch_size": 20, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3, "grad_clip": 10.0},
        dataset_options={"max_train": 20000},
        eval_every=10,
        note="long preset: the small preset's Dir-0.1 Fashion-MNIST cell (FedMIM, FedAvg, FedCM, SCAFFOLD) at T = 500",
        report_rounds=(50, 150, 300, 500),
    ),
    "paper": Preset(
        grid=[(d, s, ALL) for d in ("cifar10", "cifar100") for s in ("iid", "dir0.3", "dir0.1")],
        seeds=(0,),
        rounds=1000,
        num_clients=100,
        clients_per_round=10,
        model="resnet18_gn",
        local={
            "epochs": 5,
            "batch_size": 50,
            "lr": 0.1,
            "lr_decay": 0.998,
            "weight_decay": 1e-3,
            "grad_clip": 10.0,
            "augment": ["crop", "flip"],
        },
        eval_every=10,
        note="paper preset: Table I settings (spec §9.4); needs the CIFAR files and a fast machine",
    ),
}


# ---- the grid ----------------------------------------------------------------------------------------
def run_config(p: Preset, dataset: str, split: str, method: str, seed: int, run_dir: Path) -> dict[str, Any]:
    return {
        "name": f"fedmim-{dataset}-{split}-{method}",
        "seed": seed,
        "rounds": p.rounds,
        "backend": "loop",
        "threads": 1,
        "dataset": {"name": dataset, **p.dataset_options},
        "partition": {**SPLITS[split], "num_clients": p.num_clients},
        "model": {"name": p.model},
        "algorithm": {
            "name": method,
            "clients_per_round": p.clients_per_round,
            "weighting": "uniform",  # P-line 16, spec A22
            "consistency": True,
            **METHOD_OPTIONS[method],
        },
        "local": dict(p.local),
        "eval": {"every": p.eval_every},
        "output": {"dir": str(run_dir), "progress": False, "plots": False},
    }


def plan(
    p: Preset,
    out: Path,
    seeds: tuple[int, ...],
    datasets: list[str] | None,
    methods: list[str] | None,
    extend: bool = False,
) -> list[Point]:
    """The runs of a preset in priority order (grid entry, then seed, then method), each in
    ``OUT/runs/<dataset>-<split>-<method>-s<seed>``."""
    grid = p.grid + (p.extension if extend else [])
    names = list(dict.fromkeys(d for d, _, _ in grid))
    rename = dict(zip(names, datasets)) if datasets else {d: d for d in names}  # unmatched ones are dropped
    points = []
    for preset_dataset, split, group in grid:
        if preset_dataset not in rename:
            continue
        dataset = rename[preset_dataset]
        for seed in seeds:
            for method in group:
                if methods is not None and method not in methods:
                    continue
                name = f"{dataset}-{split}-{method}-s{seed}"
                cfg = run_config(p, dataset, split, method, seed, out / "runs" / name)
                points.append(Point.of(cfg, name, dataset=dataset, split=split, method=method))
    return points


def record(point: Point, res: Result) -> dict[str, Any]:
    """One run's row of results.csv; a diverged run (NaN/Inf) is kept as such, with no final accuracy."""
    rows, summary = res.metrics, res.summary
    if summary.get("status") == "diverged" or not rows:  # counted as chance-level failure, flagged
        rows = rows or [{"round": 0, "test_accuracy": float("nan")}]
    last = rows[-1]["round"]
    tail = [r for r in rows if r["round"] > last - 20 and r.get("local_consistency") is not None]
    accs = [100 * r["test_accuracy"] for r in rows]
    if summary.get("status") == "diverged":  # no final model: the run is reported as diverged
        accs = [*accs, float("nan")]
    return {
        **dict(point.values),
        "seed": point.seed,
        "final_acc": accs[-1],
        "best_acc": max((a for a in accs if a == a), default=float("nan")),
        "last3_acc": sum(accs[-3:]) / len(accs[-3:]),
        "consistency_last20": sum(r["local_consistency"] for r in tail) / len(tail) if tail else float("nan"),
        "wall_seconds": summary.get("wall_seconds"),
        "cpu_seconds": summary.get("cpu_seconds"),
        "status": summary.get("status", "completed"),
        "rounds_done": last,
        "_rows": res.metrics,
    }


# ---- tables and plots -----------------------------------------------------------------------------
def _ranks(values: dict[str, float]) -> dict[str, int]:
    order = sorted(values, key=lambda k: -values[k])
    return {k: i + 1 for i, k in enumerate(order)}


def summarize(records: list[dict]) -> tuple[list[dict], dict]:
    """Per (dataset, split, method): mean/std of final accuracy and consistency; plus the claim checks."""
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        cells.setdefault((r["dataset"], r["split"], r["method"]), []).append(r)
    table = []
    for (d, s, m), all_rs in cells.items():
        rs = [r for r in all_rs if math.isfinite(r["final_acc"])] or all_rs
        acc_m, acc_sd = mean_std([r["final_acc"] for r in rs])
        best_m, _ = mean_std([r["best_acc"] for r in rs])
        cons_m, _ = mean_std([r["consistency_last20"] for r in rs])
        table.append(
            {
                "dataset": d,
                "split": s,
                "method": m,
                "seeds": len(all_rs),
                "diverged": sum(not math.isfinite(r["final_acc"]) for r in all_rs),
                "final_acc_mean": acc_m,
                "final_acc_std": acc_sd,
                "best_acc_mean": best_m,
                "consistency_last20": cons_m,
                "paper_cifar10": TABLE_I[m].get(("cifar10", s)),
            }
        )
    for d, s in {(t["dataset"], t["split"]) for t in table}:
        col = [t for t in table if (t["dataset"], t["split"]) == (d, s)]
        ours = _ranks({t["method"]: t["final_acc_mean"] for t in col})
        paper = _ranks(
            {t["method"]: TABLE_I[t["method"]][("cifar10", s)] for t in col if ("cifar10", s) in TABLE_I[t["method"]]}
        )
        for t in col:
            t["rank"], t["paper_rank"] = ours[t["method"]], paper.get(t["method"])
    claims = {}
    for d in sorted({t["dataset"] for t in table}):
        claims[d] = _claims(records, d)
    return table, claims


def _claims(records: list[dict], dataset: str) -> dict[str, Any]:
    """Spec §9.2 pass criteria for FedMIM vs FedAvg on one dataset."""
    by = {(r["split"], r["method"], r["seed"]): r for r in records if r["dataset"] == dataset}
    out: dict[str, Any] = {}
    for split in ("dir0.1", "iid"):
        seeds = sorted(k[2] for k in by if k[0] == split and k[1] == "fedmim" and (split, "fedavg", k[2]) in by)
        if not seeds:
            continue
        gaps = [by[(split, "fedmim", s)]["final_acc"] - by[(split, "fedavg", s)]["final_acc"] for s in seeds]
        cons = [
            by[(split, "fedmim", s)]["consistency_last20"] / by[(split, "fedavg", s)]["consistency_last20"]
            for s in seeds
        ]
        out[split] = {
            "gap_mean": sum(gaps) / len(gaps),
            "wins": sum(g > 0 for g in gaps),
            "seeds": len(seeds),
            "consistency_ratio": sum(cons) / len(cons),
        }
    if "dir0.1" in out:
        g = out["dir0.1"]
        out["claim_accuracy"] = g["gap_mean"] >= 1.0 and g["wins"] >= min(2, g["seeds"])
        out["claim_consistency"] = g["consistency_ratio"] < 0.5
        if "iid" in out:  # "the advantage shrinks without heterogeneity" needs an advantage: None = untestable
            out["claim_iid_smaller"] = out["iid"]["gap_mean"] < g["gap_mean"] if g["gap_mean"] > 0 else None
    return out


def markdown(
    table: list[dict], claims: dict, preset_name: str, p: Preset, wall: float, cpu: float | None = None
) -> str:
    # runs share the machine: the summed CPU time of the runs says what the preset costs on idle cores
    cpu_note = f"; CPU time of the runs {cpu / 60:.1f} min (one thread each)" if cpu else ""
    lines = [
        f"# FedMIM reproduction, preset `{preset_name}`",
        "",
        f"{p.note}. {p.num_clients} clients, {p.clients_per_round} per round, model `{p.model}`, "
        f"local {p.local}, T = {p.rounds}. Wall time {wall / 60:.1f} min{cpu_note}.",
        "",
        "Final test accuracy (%) of the global model, mean ± std over seeds. `rank` is our ranking in the "
        "column (among the methods run there, as is `paper rank`); the paper has no MNIST/Fashion-MNIST "
        "column, so its CIFAR-10 number and rank for the same split (Table I) are shown beside ours. "
        "`cons.` is the local consistency (1/S)Σ‖x_i − x̄‖² averaged "
        "over the evaluations of the last 20 rounds (Fig. 2b; lower is more consistent).",
        "",
    ]
    for d in sorted({t["dataset"] for t in table}):
        splits = [s for s in ("iid", "dir0.3", "dir0.1") if any(t["dataset"] == d and t["split"] == s for t in table)]
        header = ["method"] + [h for s in splits for h in (f"{s}: ours", "rank", "cons.", "paper C10", "paper rank")]
        body = []
        for m in METHODS:
            cells: list[str] = []
            for s in splits:
                t = next((t for t in table if (t["dataset"], t["split"], t["method"]) == (d, s, m)), None)
                if t is None:
                    cells += ["–"] * 5
                    continue
                paper = f"{t['paper_cifar10']:.2f}" if t["paper_cifar10"] is not None else "–"
                div = f" ({t['diverged']}/{t['seeds']} diverged)" if t["diverged"] else ""
                cells += [f"{t['final_acc_mean']:.2f} ± {t['final_acc_std']:.2f}{div}", t["rank"],
                          f"{t['consistency_last20']:.3g}", paper, t["paper_rank"] or "–"]  # fmt: skip
            if any(c != "–" for c in cells):
                body.append([LABELS[m], *cells])
        lines += [f"## {d}", "", markdown_table(header, body).rstrip("\n"), ""]
        c = claims.get(d, {})
        if c:
            lines.append("Claims (spec §9.2):")
            for s in ("dir0.1", "iid"):
                if s in c:
                    g = c[s]
                    lines.append(
                        f"- {s}: FedMIM − FedAvg = {g['gap_mean']:+.2f} points, FedMIM ahead on "
                        f"{g['wins']}/{g['seeds']} seeds; consistency FedMIM/FedAvg = {g['consistency_ratio']:.3f}"
                    )
            for key, text in (
                ("claim_accuracy", "Dir-0.1: FedMIM ≥ FedAvg + 1.0 point on average and ahead on ≥ 2 seeds"),
                ("claim_consistency", "Dir-0.1: FedMIM's local dispersion < 0.5 × FedAvg's"),
                (
                    "claim_iid_smaller",
                    "the IID gap is smaller than the Dir-0.1 gap (informative; untestable without a Dir-0.1 gain)",
                ),
            ):
                if key in c:
                    verdict = "untestable" if c[key] is None else "held" if c[key] else "did not hold"
                    lines.append(f"- {text}: **{verdict}**")
            lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], out: Path) -> list[Path]:
    """``OUT/curves-<dataset>.png``: test accuracy (top) and local consistency (bottom) against rounds per
    split, the mean over seeds with a band."""
    paths = []
    for d in sorted({r["dataset"] for r in records}):
        splits = [s for s in ("iid", "dir0.3", "dir0.1") if any(r["dataset"] == d and r["split"] == s for r in records)]
        fig, axes = plt.subplots(2, len(splits), figsize=(5 * len(splits), 7), squeeze=False)
        for j, s in enumerate(splits):
            for m in METHODS:
                runs = [r["_rows"] for r in records if (r["dataset"], r["split"], r["method"]) == (d, s, m)]
                if runs:
                    lw = 2.2 if m == "fedmim" else 1.2
                    band(axes[0, j], runs, "round", "test_accuracy", label=LABELS[m], yscale=100, lw=lw)
                    band(axes[1, j], runs, "round", "local_consistency", label=LABELS[m], lw=lw)
            axes[0, j].set_title(f"{d}, {s} (mean over seeds)")
            axes[0, j].set_ylabel("test accuracy (%)")
            axes[1, j].set_ylabel("local consistency")
            axes[1, j].set_yscale("log")
            axes[1, j].set_xlabel("round")
            axes[0, j].legend(fontsize=8)
        fig.tight_layout()
        paths.append(save_png(fig, out / f"curves-{d}.png", dpi=110))
    return paths


def gaps(out: Path, p: Preset, seeds: tuple[int, ...]) -> tuple[str, str]:
    """Test accuracy of every run at ``p.report_rounds`` and FedMIM's gap to each other method, per seed
    (CSV) and as mean ± std over the seeds that have the round (markdown); read from the run directories."""
    acc: dict[tuple[str, str, str, int], dict[int, float]] = {}
    for dataset, split, methods in p.grid:
        for m in methods:
            for seed in seeds:
                path = out / "runs" / f"{dataset}-{split}-{m}-s{seed}" / "metrics.csv"
                if path.is_file():
                    with path.open() as f:
                        rows = {int(r["round"]): 100 * float(r["test_accuracy"]) for r in csv.DictReader(f)}
                    acc[(dataset, split, m, seed)] = {t: rows[t] for t in p.report_rounds if t in rows}
    lines = ["dataset,split,method,seed,round,accuracy,fedmim_minus_method"]
    md = [f"# FedMIM's gap over a longer horizon (preset rounds {p.rounds})", ""]
    md += ["Test accuracy (%) at each round, mean ± std over the seeds that reached it (sample std), "
           "and FedMIM − method, per seed.", ""]  # fmt: skip
    for dataset, split, methods in p.grid:
        header = ["round", *(LABELS[m] for m in methods)]
        header += [f"FedMIM − {LABELS[m]} (per seed)" for m in methods if m != "fedmim"]
        body = []
        for t in p.report_rounds:
            cells, gap_cells = [], []
            for m in methods:
                vals = [acc[(dataset, split, m, s)][t] for s in seeds if t in acc.get((dataset, split, m, s), {})]
                mean, std = mean_std(vals)
                cells.append(f"{mean:.2f} ± {std:.2f} ({len(vals)})" if vals else "–")
            for m in methods:
                if m == "fedmim":
                    continue
                g = []
                for s in seeds:
                    a, b = acc.get((dataset, split, "fedmim", s), {}), acc.get((dataset, split, m, s), {})
                    if t in a and t in b:
                        g.append(a[t] - b[t])
                        lines.append(f"{dataset},{split},{m},{s},{t},{b[t]:.2f},{a[t] - b[t]:.2f}")
                gap_cells.append(f"{sum(g) / len(g):+.2f} ({', '.join(f'{x:+.2f}' for x in g)})" if g else "–")
            for s in seeds:
                a = acc.get((dataset, split, "fedmim", s), {})
                if t in a:
                    lines.append(f"{dataset},{split},fedmim,{s},{t},{a[t]:.2f},0.00")
            body.append([t, *cells, *gap_cells])
        md += [f"## {dataset} {split}", "", markdown_table(header, body)]
    return "\n".join(lines) + "\n", "\n".join(md)


# ---- entry point ----------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fedweave reproduce fedmim", description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(PRESETS), default="small")
    ap.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the preset's)")
    ap.add_argument("--out", default="runs/reproduce-fedmim", help="output directory")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="parallel runs")
    ap.add_argument("--datasets", nargs="+", help="replace the preset's datasets, in order (e.g. a test fixture)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, help="only these methods")
    ap.add_argument("--budget-minutes", type=float, help="start no new run after this many minutes")
    ap.add_argument("--extend", action="store_true", help="also run the preset's lower-priority cells")
    args = ap.parse_args(argv)
    p = PRESETS[args.scale]
    seeds = tuple(args.seeds) if args.seeds else p.seeds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    points = plan(p, out, seeds, args.datasets, args.methods, args.extend)
    budget = args.budget_minutes * 60 if args.budget_minutes is not None else None
    done = run_points(points, out / "runs", workers=max(1, args.workers), overwrite=True, budget_s=budget)
    records = [record(pt, done[pt.slug]) for pt in points if pt.slug in done]
    skipped = [pt for pt in points if pt.slug not in done]
    wall = time.perf_counter() - t0
    table, claims = summarize(records)
    keys = ["dataset", "split", "method", "seed", "final_acc", "best_acc", "last3_acc", "consistency_last20"]
    keys += ["status", "rounds_done", "wall_seconds", "cpu_seconds"]
    write_csv(out / "results.csv", records, keys, float_format=".6g")
    tkeys = ["dataset", "split", "method", "seeds", "diverged", "final_acc_mean", "final_acc_std", "best_acc_mean"]
    tkeys += ["consistency_last20", "rank", "paper_cifar10", "paper_rank"]
    write_csv(out / "table.csv", table, tkeys, float_format=".6g")
    cpus = [r["cpu_seconds"] for r in records if r.get("cpu_seconds") is not None]
    md = markdown(table, claims, args.scale, p, wall, sum(cpus) if len(cpus) == len(records) else None)
    if skipped:
        names = ("-".join(map(str, [*dict(pt.values).values(), pt.seed])) for pt in skipped)
        md += "\nNot run (time budget reached): " + ", ".join(names) + "\n"
    atomic_write(out / "table.md", md)
    atomic_write(out / "claims.json", json.dumps(claims, indent=2))
    plot(records, out)
    if p.report_rounds:
        gap_csv, gap_md = gaps(out, p, seeds)
        atomic_write(out / "gaps.csv", gap_csv)
        atomic_write(out / "gaps.md", gap_md)
    print(md)
    return 0
