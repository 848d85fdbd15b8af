"""``fedweave reproduce fedmim``: FedMIM against its baselines (FedMIM paper, Table I; spec §9).

The presets (Table I's grid; ``long``; the variant presets ``epochs`` (Table II), ``ablation`` (Table III) and
``participation`` (Fig. 2a)), the paper's numbers, the table layouts and the claims of spec §9.2; what each
preset runs and which files it writes is on the page, docs/reproductions/fedmim.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedweave.experiments.aggregate import diverged, group, mean_of, mean_std, per_cell, per_seed, ranks, std_of
from fedweave.experiments.grid import Point
from fedweave.experiments.plots import Panel, plot_panels, seed_lines
from fedweave.experiments.study import HELD, Claim, Json, Plan, Report, Rows, Study, Verdict, judge, not_run, option
from fedweave.experiments.tables import (
    bold_best,
    csv_text,
    grouped_table,
    indent,
    markdown_table,
    pm,
    read_csv,
    signed,
)
from fedweave.experiments.verdicts import All, Paired, Select, Untestable, cell
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
    # Table II / III / Fig. 2a presets: every grid cell runs once per (label, overrides) variant; overrides
    # may set "local" (merged into local), "clients_per_round", or "options" (FedMIM's alpha/beta)
    variants: tuple[tuple[str, dict[str, Any]], ...] = ()
    table: str = ""  # the variant table this preset writes: "epochs", "ablation" or "participation"


ALL = METHODS
MAIN = ("fedavg", "fedmim")  # the main claim, spec §9.1
SECOND = ("fedcm", "scaffold")  # FedMIM's J = 1 special case; the paper's strongest baseline at DIR.1
CORE = MAIN + SECOND
REST = ("fedadam", "feddyn", "fedsam")
SMALL_LOCAL = {"epochs": 1, "batch_size": 20, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3, "grad_clip": 10.0}
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
        local=SMALL_LOCAL,
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
        local=SMALL_LOCAL,
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


# ---- Table II, Table III and Fig. 2a: the small preset's Dir-0.1 Fashion-MNIST cell under several settings
# Table II (CIFAR-10 columns): test accuracy (%) at local epochs E = 1, 5, 10 (spec §6.2)
TABLE_II_C10: dict[str, tuple[float, float, float]] = {
    "fedavg": (82.76, 81.84, 81.06),
    "fedadam": (83.56, 81.42, 80.21),
    "scaffold": (85.03, 84.12, 83.54),
    "fedcm": (86.33, 84.89, 82.83),
    "feddyn": (85.45, 83.96, 78.12),
    "fedsam": (84.48, 84.17, 82.97),
    "fedmim": (86.68, 85.18, 84.13),
}
# Table III (spec §3.1): (alpha, beta) of FedMIM with J = len(alpha), "-" terms are 0, and the accuracy (%)
TABLE_III: tuple[tuple[tuple[float, ...], tuple[float, ...], float], ...] = (
    ((), (), 81.61),  # J = 0: FedAvg
    ((0.9,), (0.0,), 84.14),  # J = 1, beta = 0: FedCM with alpha_FedCM = 0.1
    ((0.5,), (0.0,), 83.53),
    ((0.8, 0.1), (0.0, 0.0), 84.29),
    ((0.6, 0.3), (0.0, 0.0), 84.67),
    ((0.3, 0.6), (0.0, 0.0), 83.86),
    ((0.6, 0.3), (0.9, 0.1), 84.98),  # the best row, FedMIM's default here (spec A9)
    ((0.6, 0.3), (0.5, 0.5), 84.42),
    ((0.6, 0.3), (0.1, 0.9), 84.04),
)


def ablation_label(alpha: tuple[float, ...], beta: tuple[float, ...]) -> str:
    """A Table III row as ``J=2 a=0.6,0.3 b=0.9,0.1`` (``b=-`` when beta is all zero)."""
    a = ",".join(f"{x:g}" for x in alpha) or "-"
    b = ",".join(f"{x:g}" for x in beta) if any(beta) else "-"
    return f"J={len(alpha)} a={a} b={b}"


_SMALL = PRESETS["small"]
_CELL = ("fashion_mnist", "dir0.1")
PRESETS.update(
    {
        # Table II: E = 1 is the small preset's cell (K = 10 local steps); E = 5 and 10 give K = 50 and 100,
        # the paper's K at E = 5 and 10 on CIFAR (10 batches of 50 per epoch). --extend adds FedCM, SCAFFOLD.
        "epochs": dataclasses.replace(
            _SMALL,
            grid=[(*_CELL, MAIN)],
            extension=[(*_CELL, SECOND)],
            variants=tuple((f"E={e}", {"local": {"epochs": e}}) for e in (1, 5, 10)),
            table="epochs",
            note="epochs preset (Table II): the small preset's Dir-0.1 Fashion-MNIST cell at E = 1, 5 and 10 "
            "local epochs of B = 20 (K = 10, 50, 100), T = 50",
        ),
        # Table III: every row is FedMIM with that (alpha, beta); J = 0 is FedAvg, J = 1 with beta = 0 FedCM
        "ablation": dataclasses.replace(
            _SMALL,
            grid=[(*_CELL, ("fedmim",))],
            extension=[],
            variants=tuple(
                (ablation_label(a, b), {"options": {"alpha": list(a), "beta": list(b)}}) for a, b, _ in TABLE_III
            ),
            table="ablation",
            note="ablation preset (Table III): FedMIM's alpha/beta/J rows on the small preset's Dir-0.1 "
            "Fashion-MNIST cell, E = 1 (K = 10), T = 50",
        ),
        # Fig. 2a: 5 % and 20 % of the 100 clients per round (the small preset's 10 % is its Table I cell);
        # the methods its claims name, FedSAM with --extend
        "participation": dataclasses.replace(
            _SMALL,
            grid=[(*_CELL, ("fedavg", "fedadam", "scaffold", "fedcm", "feddyn", "fedmim"))],
            extension=[(*_CELL, ("fedsam",))],
            variants=(("5%", {"clients_per_round": 5}), ("20%", {"clients_per_round": 20})),
            table="participation",
            note="participation preset (Fig. 2a): the small preset's Dir-0.1 Fashion-MNIST cell with 5 % and "
            "20 % of the clients per round, E = 1 (K = 10), T = 50",
        ),
    }
)


# ---- the grid ----------------------------------------------------------------------------------------
def run_config(
    p: Preset, dataset: str, split: str, method: str, seed: int, run_dir: Path, variant: str = ""
) -> dict[str, Any]:
    over = dict(p.variants).get(variant, {}) if variant else {}
    options = over["options"] if "options" in over and method == "fedmim" else METHOD_OPTIONS[method]
    # weighting: P-line 16, spec A22
    algorithm = {
        "name": method,
        "clients_per_round": over.get("clients_per_round", p.clients_per_round),
        "weighting": "uniform",
        "consistency": True,
        **options,
    }
    return {
        "name": f"fedmim-{dataset}-{split}-{method}" + (f"-{variant}" if variant else ""),
        "seed": seed,
        "rounds": p.rounds,
        "backend": "loop",
        "threads": 1,
        "dataset": {"name": dataset, **p.dataset_options},
        "partition": {**SPLITS[split], "num_clients": p.num_clients},
        "model": {"name": p.model},
        "algorithm": algorithm,
        "local": {**p.local, **over.get("local", {})},
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
    ``OUT/runs/<dataset>-<split>-<method>-s<seed>``; in a variant preset seed, then grid entry, variant and
    method (a time budget leaves whole seeds), each in ``OUT/runs/<dataset>-<split>-<method>-<variant>-s<seed>``."""
    grid = p.grid + (p.extension if extend else [])
    names = list(dict.fromkeys(d for d, _, _ in grid))
    rename = dict(zip(names, datasets)) if datasets else {d: d for d in names}  # unmatched ones are dropped
    variants = [v for v, _ in p.variants] or [""]
    if p.variants:
        runs = [(seed, entry, v, m) for seed in seeds for entry in grid for v in variants for m in entry[2]]
    else:
        runs = [(seed, entry, v, m) for entry in grid for seed in seeds for v in variants for m in entry[2]]
    runs = [(seed, d, split, v, m) for seed, (d, split, _), v, m in runs if methods is None or m in methods]
    return [_point(p, out, rename[d], split, m, seed, v) for seed, d, split, v, m in runs if d in rename]


def _point(p: Preset, out: Path, dataset: str, split: str, method: str, seed: int, variant: str) -> Point:
    """One run of the grid, in ``OUT/runs/<name>``: named by its cell, variant (made filesystem-safe) and seed."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", variant).strip("_")
    name = "-".join(x for x in (dataset, split, method, slug, f"s{seed}") if x)
    cfg = run_config(p, dataset, split, method, seed, out / "runs" / name, variant)
    return Point.of(cfg, name, dataset=dataset, split=split, method=method, **({"variant": variant} if variant else {}))


def record(point: Point, res: Result, plan: Plan | None = None) -> dict[str, Any]:
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
def _finished(rs: list[dict]) -> list[dict]:
    """A cell's runs that did not diverge (all of them when none finished: the cell then reads NaN)."""
    return [r for r in rs if math.isfinite(r["final_acc"])] or rs


TABLE_STATS = {
    "seeds": len,
    "diverged": diverged("final_acc"),
    "final_acc_mean": mean_of("final_acc", _finished),
    "final_acc_std": std_of("final_acc", _finished),
    "best_acc_mean": mean_of("best_acc", _finished),
    "consistency_last20": mean_of("consistency_last20", _finished),
}


def summarize(records: list[dict]) -> tuple[list[dict], dict]:
    """Per (dataset, split, method): mean/std of final accuracy and consistency, the ranks in the column and
    the paper's CIFAR-10 number and rank beside them; plus the claim checks."""
    table = per_cell(records, ("dataset", "split", "method"), TABLE_STATS)
    for (_, s), col in group(table, lambda t: (t["dataset"], t["split"])).items():
        paper = {
            t["method"]: TABLE_I[t["method"]][("cifar10", s)] for t in col if ("cifar10", s) in TABLE_I[t["method"]]
        }
        ours, paper_ranks = ranks({t["method"]: t["final_acc_mean"] for t in col}), ranks(paper)
        for t in col:
            t.update(
                paper_cifar10=paper.get(t["method"]), rank=ours[t["method"]], paper_rank=paper_ranks.get(t["method"])
            )
    return table, {d: _claims(records, d) for d in sorted({t["dataset"] for t in table})}


def _claims(records: list[dict], dataset: str) -> dict[str, Any]:
    """Spec §9.2 pass criteria for FedMIM vs FedAvg on one dataset, as a preset's ``claims.json`` and
    ``table.md`` state them: the seed gaps' summary (``dir0.1`` / ``iid``) and each claim's spec criterion on
    the seed means (its ``rule``). A page judges the same claims by their declared rules (``claim_verdicts``)."""
    c = _gap_summary(records, dataset)
    for key, claim in TABLE_I_CLAIMS.items():
        if (v := claim.criterion(c, dataset)) is not None:
            c[key] = v.held
    return c


def _gap_summary(records: list[dict], dataset: str) -> dict[str, Any]:
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
    return out


def _seeded(records: list[dict]) -> list[dict]:
    """The finished runs of ``records`` (a diverged run has no final accuracy to pair; the verdict's n says how
    many seeds were paired) when they hold 2 seeds or more, else none: one seed cannot test a paired claim,
    which is then left out (a smoke preset)."""
    ok = [r for r in records if math.isfinite(r.get("final_acc", r.get("change", math.nan)))]
    return ok if len({r["seed"] for r in ok}) >= 2 else []


def _of(c: dict[str, Any], dataset: str) -> list[dict]:
    """One dataset's per-seed records, each with ``log_cons`` (the log of its local dispersion)."""
    rs = [{**r, "log_cons": math.log(r["consistency_last20"])} for r in c["_records"] if r["dataset"] == dataset]
    return _seeded(rs)


def _gap(split: str) -> Select:
    """Per seed, FedMIM's final accuracy minus FedAvg's on ``split`` (the same seed: the same partition)."""
    return cell(split=split, method="fedmim") - cell(split=split, method="fedavg")


def _accuracy(c: dict[str, Any], _):
    if (g := c.get("dir0.1")) is None:
        return None
    return (
        f"FedMIM - FedAvg {g['gap_mean']:+.2f} points, ahead on {g['wins']}/{g['seeds']} seeds",
        g["gap_mean"] >= 1.0 and g["wins"] >= min(2, g["seeds"]),
    )


def _dispersion(c: dict[str, Any], _):
    if (g := c.get("dir0.1")) is None:
        return None
    return f"FedMIM / FedAvg {g['consistency_ratio']:.3f}", g["consistency_ratio"] < 0.5


def _iid_smaller(c: dict[str, Any], _):
    g, iid = c.get("dir0.1"), c.get("iid")
    if g is None or iid is None:
        return None
    # "the advantage shrinks without heterogeneity" needs an advantage: None = untestable
    return (
        f"FedMIM - FedAvg: IID {iid['gap_mean']:+.2f}, Dir-0.1 {g['gap_mean']:+.2f} points",
        iid["gap_mean"] < g["gap_mean"] if g["gap_mean"] > 0 else None,
    )


DIR = {"split": "dir0.1"}
# spec §9.2 on one dataset, by key; each verdict by its declared rule on the per-seed records (95 % paired t
# over the seeds: 3 to 5 of them, too few for a percentile bootstrap)
TABLE_I_CLAIMS = {
    # min effect 1.0 point: spec §9.2's bar; a smaller gain is within what another partition moves at this scale
    "claim_accuracy": Claim(
        lambda c, d: f"{d}: Dir-0.1 FedMIM beats FedAvg by more than 1.0 point (final accuracy, paired by seed)",
        _accuracy,
        declared=Paired("final_acc", {**DIR, "method": "fedmim"}, {**DIR, "method": "fedavg"}, min_effect=1.0),
        records=_of,
    ),
    # the ratio is tested on its log, paired by seed; min effect ln 2: the spec's "less than half"
    "claim_consistency": Claim(
        lambda c, d: f"{d}: Dir-0.1 FedMIM's local dispersion < 0.5 x FedAvg's (log of the ratio, paired by seed)",
        _dispersion,
        declared=Paired(
            "log_cons", {**DIR, "method": "fedmim"}, {**DIR, "method": "fedavg"}, "less", math.log(2), unit="ln ratio"
        ),
        records=_of,
    ),
    # the paper: the advantage shrinks without heterogeneity; any shrinking counts (min effect 0), per seed
    "claim_iid_smaller": Claim(
        lambda c, d: f"{d}: FedMIM's gain over FedAvg is larger on Dir-0.1 than on IID (difference of the seed gaps)",
        _iid_smaller,
        declared=Paired("final_acc", _gap("dir0.1"), _gap("iid"), "greater", 0.0),
        records=_of,
    ),
}


def claim_verdicts(records: list[dict]) -> list:
    """The Table I checks (spec §9.2) on the per-seed records (a ``results.csv``), per dataset: ``Verdict``s."""
    out = []
    for d in sorted({r["dataset"] for r in records}):
        out += judge(list(TABLE_I_CLAIMS.values()), {**_gap_summary(records, d), "_records": records}, d)
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
        by = {(t["split"], t["method"]): t for t in table if t["dataset"] == d}

        def cells(m: str, s: str, by=by) -> list | None:
            if (t := by.get((s, m))) is None:
                return None
            paper = f"{t['paper_cifar10']:.2f}" if t["paper_cifar10"] is not None else "–"
            div = f" ({t['diverged']}/{t['seeds']} diverged)" if t["diverged"] else ""
            return [
                _acc(t) + div,
                t["rank"],
                f"{t['consistency_last20']:.3g}",
                paper,
                t["paper_rank"] or "–",
            ]

        columns = ["ours", "rank", "cons.", "paper C10", "paper rank"]
        header, body = grouped_table("method", METHODS, splits, columns, cells, LABELS.get, drop_empty=True)
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


def _width(method: str) -> dict[str, float]:
    """FedMIM's line drawn wider than the others."""
    return {"lw": 2.2 if method == "fedmim" else 1.2}


def plot(records: list[dict], out: Path) -> list[Path]:
    """``OUT/curves-<dataset>.png``: test accuracy (top) and local consistency (bottom) against rounds per
    split, the mean over seeds with a band."""
    paths = []
    for d in sorted({r["dataset"] for r in records}):
        splits = [s for s in ("iid", "dir0.3", "dir0.1") if any(r["dataset"] == d and r["split"] == s for r in records)]
        cells = {s: [r for r in records if (r["dataset"], r["split"]) == (d, s)] for s in splits}
        lines = {s: seed_lines(cells[s], "method", METHODS, LABELS.get, _width) for s in splits}
        acc = [
            Panel(
                lines[s],
                "test_accuracy",
                yscale=100,
                title=f"{d}, {s} (mean over seeds)",
                ylabel="test accuracy (%)",
                legend={"fontsize": 8},
            )
            for s in splits
        ]
        cons = [
            Panel(lines[s], "local_consistency", xlabel="round", ylabel="local consistency", logy=True, legend=None)
            for s in splits
        ]
        paths.append(plot_panels([acc, cons], out / f"curves-{d}.png", panel_size=(5, 3.5), dpi=110))
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
                    rows = {int(r["round"]): 100 * float(r["test_accuracy"]) for r in read_csv(path)}
                    acc[(dataset, split, m, seed)] = {t: rows[t] for t in p.report_rounds if t in rows}
    lines: list[list[Any]] = []  # per (method, seed, round): accuracy and FedMIM's gap
    md = [f"# FedMIM's gap over a longer horizon (preset rounds {p.rounds})", ""]
    md += [
        "Test accuracy (%) at each round, mean ± std over the seeds that reached it (sample std), "
        "and FedMIM − method, per seed.",
        "",
    ]
    for dataset, split, methods in p.grid:
        others = [m for m in methods if m != "fedmim"]
        header = ["round", *(LABELS[m] for m in methods), *(f"FedMIM − {LABELS[m]} (per seed)" for m in others)]
        body = []
        for t in p.report_rounds:
            at = {m: {s: a[t] for s in seeds if t in (a := acc.get((dataset, split, m, s), {}))} for m in methods}
            cells = [pm(*mean_std(list(at[m].values()))) + f" ({len(at[m])})" if at[m] else "–" for m in methods]
            for m in others:
                g = {s: at["fedmim"][s] - b for s, b in at[m].items() if s in at["fedmim"]}
                lines += [[dataset, split, m, s, t, f"{at[m][s]:.2f}", f"{x:.2f}"] for s, x in g.items()]
                per = ", ".join(f"{x:+.2f}" for x in g.values())
                cells.append(f"{sum(g.values()) / len(g):+.2f} ({per})" if g else "–")
            lines += [[dataset, split, "fedmim", s, t, f"{a:.2f}", "0.00"] for s, a in at["fedmim"].items()]
            body.append([t, *cells])
        md += [f"## {dataset} {split}", "", markdown_table(header, body)]
    header = ["dataset", "split", "method", "seed", "round", "accuracy", "fedmim_minus_method"]
    return csv_text(lines, header), "\n".join(md)


# ---- the variant presets' tables: Table II, Table III, Fig. 2a ------------------------------------------
def _ok(rs: list[dict]) -> list[dict]:
    """A cell's runs that did not diverge, in seed order."""
    return sorted((r for r in rs if math.isfinite(r["final_acc"])), key=lambda r: r["seed"])


def _auc(rs: list[dict]) -> float:
    """The mean over the finished runs of their mean test accuracy (%) over the evaluated rounds."""
    return mean_std([100 * sum(x["test_accuracy"] for x in r["_rows"]) / len(r["_rows"]) for r in _ok(rs)])[0]


VARIANT_STATS = {
    "seeds": len,
    "diverged": diverged("final_acc"),
    "final_acc_mean": lambda rs: round(mean_of("final_acc", _ok)(rs), 2),
    "final_acc_std": lambda rs: round(std_of("final_acc", _ok)(rs), 2),
    "mean_acc_over_rounds": lambda rs: round(_auc(rs), 2),
    "consistency_last20": lambda rs: round(mean_of("consistency_last20", _ok)(rs), 4),
    "final_acc_per_seed": per_seed("final_acc"),
}


def variant_summary(records: list[dict], p: Preset) -> list[dict]:
    """Per (variant, method), in the preset's order: final accuracy mean ± std over seeds (diverged runs
    counted apart), the mean accuracy over the evaluated rounds (how fast it converges), the local
    consistency of the last 20 rounds, the per-seed finals, and the paper's number where it has one."""
    methods = list(dict.fromkeys(m for _, _, group in p.grid + p.extension for m in group))
    cells = {(c["variant"], c["method"]): c for c in per_cell(records, ("variant", "method"), VARIANT_STATS)}
    paper = {"epochs": lambda i, m: TABLE_II_C10[m][i], "ablation": lambda i, m: TABLE_III[i][2]}.get(p.table)
    rows = [(i, v, m) for i, (v, _) in enumerate(p.variants) for m in methods if (v, m) in cells]
    return [cells[(v, m)] | {"paper_c10": paper(i, m) if paper else ""} for i, v, m in rows]


def variant_claims(rows: list[dict], p: Preset) -> list[tuple[str, bool | None, str]]:
    """The paper's readings of Table II, Table III or Fig. 2a, checked on the seed means of ``rows`` as a
    preset's files state them (each claim's ``rule``): (claim, True / False / None = untestable because a cell
    is missing, what was measured). A page judges them by their declared rules (``variant_verdicts``)."""
    if (cells := _cells(rows, p)) is None:
        return [("every cell of the preset ran", None, "not every cell ran (see the table)")]
    return [(v.claim, v.held, v.measured) for c in VARIANT_CLAIMS[p.table] if (v := c.criterion(cells))]


def variant_verdicts(rows: list[dict], p: Preset, records: list[dict]) -> list[Verdict]:
    """The same readings, each verdict by its declared rule on the per-seed ``records`` (a ``results.csv``),
    what was measured from the seed means of ``rows``."""
    if (cells := _cells(rows, p, records)) is None:
        return [Verdict("every cell of the preset ran", "not every cell ran (see the table)", None)]
    return judge(VARIANT_CLAIMS[p.table], cells)


def _cells(rows: list[dict], p: Preset, records: list[dict] = ()) -> Cells | None:
    """The seed means of ``rows`` (and the per-seed ``records``), or None when a cell did not run."""
    acc = {(r["variant"], r["method"]): r["final_acc_mean"] for r in rows if r["diverged"] < r["seeds"]}
    labels = [v for v, _ in p.variants]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    if not all((v, m) in acc for v in labels for m in methods) or "fedmim" not in methods:
        return None
    auc = {(r["variant"], r["method"]): r["mean_acc_over_rounds"] for r in rows}
    return Cells(acc, auc, labels, methods, list(records))


@dataclass
class Cells:
    """A variant preset's seed means (final accuracy and mean accuracy over the rounds per (variant, method))
    and its per-seed records, which the declared rules read."""

    acc: dict[tuple[str, str], float]
    auc: dict[tuple[str, str], float]
    labels: list[str]  # the variants, in the preset's order
    methods: list[str]
    records: list[dict] = field(default_factory=list)

    def fedmim(self) -> dict[str, float]:
        return {v: self.acc[(v, "fedmim")] for v in self.labels}

    def change(self, m: str) -> float:
        """How much ``m``'s accuracy changes between the first and the last variant."""
        return abs(self.acc[(self.labels[-1], m)] - self.acc[(self.labels[0], m)])

    def changes(self, *_) -> list[dict]:
        """Per method and seed, how much its final accuracy changes between the first and the last variant."""
        by = {(r["variant"], r["method"], r["seed"]): r["final_acc"] for r in self.records}
        lo, hi = self.labels[0], self.labels[-1]
        return _seeded(
            [
                {"method": m, "seed": k, "change": abs(by[(hi, m, k)] - a)}
                for (v, m, k), a in by.items()
                if v == lo and (hi, m, k) in by
            ]
        )


def _cell(v: str, m: str = "fedmim") -> dict[str, str]:
    return {"variant": v, "method": m}


def _gt(a: dict, b: dict, metric: str = "final_acc", direction: str = "greater") -> Paired:
    """A beats B on ``metric`` paired by seed, 95 % paired t (3 seeds: too few for a percentile bootstrap).
    Min effect 0: the paper states orders, not sizes, so any difference in the claimed direction counts and the
    interval decides whether the seeds see it."""
    return Paired(metric, a, b, direction)


def _all(parts) -> All:
    return All(tuple(parts))


def _beta(v: str) -> str:
    return "b=" + v.split("b=")[1]


def _records(c: Cells, _) -> list[dict]:
    return _seeded(c.records)


def _second(c: Cells, but: str) -> str:
    """The second most accurate method at the last variant other than ``but`` (by seed means)."""
    hi = c.labels[-1]
    return sorted((m for m in c.methods if m != but), key=lambda m: -c.acc[(hi, m)])[1]


def _e_best(c: Cells, _):
    best = {v: max(c.methods, key=lambda m: c.acc[(v, m)]) for v in c.labels}
    where = [
        f"{v}: FedMIM {c.acc[(v, 'fedmim')]:.2f}, best {LABELS[best[v]]} {c.acc[(v, best[v])]:.2f}" for v in c.labels
    ]
    return "; ".join(where), len(c.methods) > 1 and all(b == "fedmim" for b in best.values())


def _e_falls(c: Cells, _):
    falls = {m: all(c.acc[(a, m)] > c.acc[(b, m)] for a, b in zip(c.labels, c.labels[1:])) for m in c.methods}
    trend = [
        f"{LABELS[m]} " + " / ".join(f"{c.acc[(v, m)]:.2f}" for v in c.labels) + ("" if falls[m] else " (not falling)")
        for m in c.methods
    ]
    return "; ".join(trend), all(falls.values())


# Table III's rows in TABLE_III's order: 0 J = 0 (FedAvg); 1-2 J = 1; 3-5 J = 2 without beta; 6-8 J = 2 with beta
def _a_inertial(c: Cells, _):
    a, lb = c.fedmim(), c.labels
    rest = [a[v] for v in lb[1:]]
    return f"J = 0: {a[lb[0]]:.2f}; J >= 1: {min(rest):.2f} to {max(rest):.2f}", min(rest) > a[lb[0]]


def _a_j2(c: Cells, _):
    a = c.fedmim()
    j1, j2 = max(c.labels[1:3], key=a.get), max(c.labels[3:], key=a.get)
    return f"best J = 2 ({j2}) {a[j2]:.2f} vs best J = 1 ({j1}) {a[j1]:.2f}", a[j2] > a[j1]


def _a_top(c: Cells, _):
    a = c.fedmim()
    top = max(c.labels, key=a.get)
    return f"{a[c.labels[6]]:.2f}; best row {top} {a[top]:.2f}", top == c.labels[6]


def _a_beta(c: Cells, _):
    a, lb = c.fedmim(), c.labels
    return " / ".join(f"{a[v]:.2f}" for v in lb[6:9]), a[lb[6]] > a[lb[7]] > a[lb[8]]


def _a_alpha_beta(c: Cells, _):
    a, lb = c.fedmim(), c.labels
    return f"{a[lb[6]]:.2f} with beta vs {a[lb[4]]:.2f} without", a[lb[6]] > a[lb[4]]


def _changes(c: Cells, ms: list[str]) -> str:
    return ", ".join(f"{LABELS[m]} {c.change(m):.2f}" for m in ms) + " points"


def _p_fedavg_slowest(c: Cells, _):
    slowest = {v: min(c.methods, key=lambda m: c.auc[(v, m)]) for v in c.labels}
    measured = "; ".join(f"{v}: lowest {LABELS[slowest[v]]} {c.auc[(v, slowest[v])]:.2f}" for v in c.labels)
    return measured, all(x == "fedavg" for x in slowest.values()) if "fedavg" in c.methods else None


def _p_sensitive(c: Cells, _):
    named = [m for m in ("fedadam", "fedcm", "feddyn") if m in c.methods]
    return _changes(c, [*named, "fedmim"]), all(c.change(m) > c.change("fedmim") for m in named) if named else None


def _p_scaffold(c: Cells, _):
    hi = c.labels[-1]
    ranked = sorted(c.methods, key=lambda m: -c.acc[(hi, m)])
    measured = f"{hi}: " + " > ".join(f"{LABELS[m]} {c.acc[(hi, m)]:.2f}" for m in ranked)
    return measured, "scaffold" in ranked[:2] if "scaffold" in c.methods else None


def _p_stable(c: Cells, _):
    steady = sorted(c.methods, key=c.change)
    return _changes(c, steady), steady[0] == "fedmim"


VARIANT_CLAIMS = {
    "epochs": [
        Claim(
            "FedMIM is the most accurate of the methods run at every E (paper: best in all 9 columns)",
            _e_best,
            declared=lambda c, _: _all(
                (f"{v} vs {LABELS[m]}", _gt(_cell(v), _cell(v, m)))
                for v in c.labels
                for m in c.methods
                if m != "fedmim"
            ),
            records=_records,
        ),
        Claim(
            "accuracy falls as E grows, for every method run (paper: all but one)",
            _e_falls,
            declared=lambda c, _: _all(
                (f"{LABELS[m]} {a} > {b}", _gt(_cell(a, m), _cell(b, m)))
                for m in c.methods
                for a, b in zip(c.labels, c.labels[1:])
            ),
            records=_records,
        ),
    ],
    "ablation": [
        Claim(
            "every inertial row (J >= 1) beats J = 0 (FedAvg)",
            _a_inertial,
            declared=lambda c, _: _all((v, _gt(_cell(v), _cell(c.labels[0]))) for v in c.labels[1:]),
            records=_records,
        ),
        Claim(
            "J = 2 is best: the best J = 2 row beats the best J = 1 row (rows chosen by their seed means)",
            _a_j2,
            declared=lambda c, _: _gt(
                _cell(max(c.labels[3:], key=c.fedmim().get)), _cell(max(c.labels[1:3], key=c.fedmim().get))
            ),
            records=_records,
        ),
        Claim(
            lambda c, _: f"the paper's best row ({c.labels[6]}) is the best row",
            _a_top,
            declared=lambda c, _: _all(
                (f"vs {v}", _gt(_cell(c.labels[6]), _cell(v))) for v in c.labels if v != c.labels[6]
            ),
            records=_records,
        ),
        Claim(
            "beta weighted to the adjacent step is best: beta (0.9, 0.1) > (0.5, 0.5) > (0.1, 0.9)",
            _a_beta,
            declared=lambda c, _: _all(
                (f"{_beta(a)} > {_beta(b)}", _gt(_cell(a), _cell(b))) for a, b in zip(c.labels[6:8], c.labels[7:9])
            ),
            records=_records,
        ),
        Claim(
            "a large alpha and a proper beta: adding beta (0.9, 0.1) to alpha (0.6, 0.3) helps",
            _a_alpha_beta,
            declared=lambda c, _: _gt(_cell(c.labels[6]), _cell(c.labels[4])),
            records=_records,
        ),
    ],
    "participation": [
        Claim(
            "FedAvg loses the most convergence speed: the lowest mean accuracy over the rounds at both ratios",
            _p_fedavg_slowest,
            declared=Untestable("no per-seed records of the mean accuracy over the rounds (results.csv: finals)"),
        ),
        Claim(
            lambda c, _: (
                "FedAdam, FedCM and FedDyn are highly sensitive to the participation ratio: each "
                f"changes more between {c.labels[0]} and {c.labels[-1]} than FedMIM"
            ),
            _p_sensitive,
            declared=lambda c, _: _all(
                (f"{LABELS[m]} vs FedMIM", _gt({"method": m}, {"method": "fedmim"}, "change"))
                for m in ("fedadam", "fedcm", "feddyn")
                if m in c.methods
            ),
            records=Cells.changes,
        ),
        Claim(
            lambda c, _: (
                f"SCAFFOLD performs well at the higher participation: among the two most accurate at {c.labels[-1]}"
            ),
            _p_scaffold,
            # among the two most accurate = above every other method but one: against the second of the others
            declared=lambda c, _: _gt(_cell(c.labels[-1], "scaffold"), _cell(c.labels[-1], _second(c, "scaffold"))),
            records=_records,
        ),
        Claim(
            lambda c, _: (
                f"FedMIM is very stable: the smallest change between {c.labels[0]} and {c.labels[-1]} "
                "of the methods run"
            ),
            _p_stable,
            declared=lambda c, _: _all(
                (f"vs {LABELS[m]}", _gt({"method": "fedmim"}, {"method": m}, "change", "less"))
                for m in c.methods
                if m != "fedmim"
            ),
            records=Cells.changes,
        ),
    ],
}


def variant_markdown(rows: list[dict], checks: list, name: str, p: Preset, wall: float, cpu: float | None) -> str:
    titles = {"epochs": "Table II (local epochs)", "ablation": "Table III (alpha, beta, J)"}
    cpu_note = f"; CPU time of the runs {cpu / 60:.1f} min (one thread each)" if cpu else ""
    paper_note = {
        "epochs": "The paper's numbers are CIFAR-10 with ResNet-18-GN (Table II).",
        "ablation": "The paper's numbers are its Table III (CIFAR-10 probably, E = 5, T = 500).",
        "participation": "The paper shows Fig. 2a as curves only (CIFAR-10, Dir-0.1, E = 5).",
    }[p.table]
    lines = [
        f"# FedMIM {titles.get(p.table, 'Fig. 2a (participation)')}, preset `{name}`",
        "",
        f"{p.note}. {p.num_clients} clients, {p.clients_per_round} per round unless the column says otherwise, "
        f"model `{p.model}`, local {p.local}. Wall time {wall / 60:.1f} min{cpu_note}.",
        "",
        "Final test accuracy (%) of the global model, mean ± std over seeds (per seed in `results.csv` and "
        f"`{name}.csv`); `mean acc.` is the mean test accuracy over the evaluated rounds (every {p.eval_every}; "
        "it measures convergence speed); `cons.` is the local consistency averaged over the last 20 rounds. "
        + paper_note,
        "",
    ]
    labels = [v for v, _ in p.variants]
    if p.table == "ablation":
        header = ["row", "ours", "per seed", "mean acc.", "cons.", "paper"]
        body = [
            [
                r["variant"],
                _acc(r),
                r["final_acc_per_seed"],
                f"{r['mean_acc_over_rounds']:.2f}",
                f"{r['consistency_last20']:.3g}",
                f"{r['paper_c10']:.2f}",
            ]
            for r in rows
        ]
    else:
        paper = p.table == "epochs"
        by = {(r["method"], r["variant"]): r for r in rows}

        def cells(m: str, v: str) -> list | None:
            if (r := by.get((m, v))) is None:
                return None
            div = f" ({r['diverged']}/{r['seeds']} diverged)" if r["diverged"] else ""
            return [
                _acc(r) + div,
                f"{r['mean_acc_over_rounds']:.2f}",
                f"{r['consistency_last20']:.3g}",
            ] + ([f"{r['paper_c10']:.2f}"] if paper else [])

        cols = ["ours", "mean acc.", "cons."] + (["paper C10"] if paper else [])
        methods = list(dict.fromkeys(r["method"] for r in rows))
        header, body = grouped_table("method", methods, labels, cols, cells, LABELS.get)
    lines += [markdown_table(header, body).rstrip("\n"), "", "## Claims", ""]
    lines += [markdown_table(["claim", "verdict", "measured"], [[c, HELD[ok], m] for c, ok, m in checks]).rstrip("\n")]
    return "\n".join(lines) + "\n"


def variant_plot(records: list[dict], p: Preset, name: str, out: Path) -> Path:
    """``OUT/curves-NAME.png``: test accuracy against rounds, the mean over seeds with a band; one panel per
    variant, each method a line (Table III: one panel, each row a line)."""
    labels = [v for v, _ in p.variants]
    methods = list(dict.fromkeys(r["method"] for r in records))
    grid = []
    for panel in [None] if p.table == "ablation" else labels:
        if panel is None:  # Table III: FedMIM alone, each row a line
            lines = seed_lines(records, "variant", labels, style=lambda v: {"lw": 1.2})
        else:
            lines = seed_lines([r for r in records if r["variant"] == panel], "method", methods, LABELS.get, _width)
        title = f"{name}: {panel or 'FedMIM rows'} (mean over seeds)"
        grid.append(
            Panel(
                lines,
                "test_accuracy",
                yscale=100,
                title=title,
                xlabel="round",
                ylabel="test accuracy (%)",
                legend={"fontsize": 7},
            )
        )
    return plot_panels([grid], out / f"curves-{name}.png", panel_size=(5, 4), dpi=100)


RESULT_KEYS = ["dataset", "split", "method", "variant", "seed", "final_acc", "best_acc", "last3_acc"]
RESULT_KEYS += ["consistency_last20", "status", "rounds_done", "wall_seconds", "cpu_seconds"]


def _cpu(records: list[dict]) -> float | None:
    """The runs' summed CPU seconds when every run has them (the machine is shared: CPU time says what a
    preset costs)."""
    cpus = [r["cpu_seconds"] for r in records if r.get("cpu_seconds") is not None]
    return sum(cpus) if cpus and len(cpus) == len(records) else None


def write_variant_outputs(records: list[dict], skipped: list, name: str, p: Preset, out: Path, wall: float) -> int:
    """A variant preset's files: results.csv (one row per run), NAME.csv and NAME.md (the table beside the
    paper's and the claim checks), claims.json and curves-NAME.png."""
    rows = variant_summary(records, p)
    checks = variant_claims(rows, p)
    md = variant_markdown(rows, checks, name, p, wall, _cpu(records)) + not_run(skipped)
    claims = [{"claim": c, "verdict": HELD[ok], "measured": m} for c, ok, m in checks]
    files = {"results.csv": Rows(records, RESULT_KEYS, ".6g"), f"{name}.csv": Rows(rows), f"{name}.md": md}
    files["claims.json"] = Json(claims, ensure_ascii=False)
    return Report(files, show=f"{name}.md", figures=lambda out: variant_plot(records, p, name, out)).write(out)


# ---- the study ------------------------------------------------------------------------------------------
# the page's claim table: the claims judged on the per-seed records of these committed folders beside it (a
# variant preset's folder is named after it), in this order
PAGE_FOLDERS = ("", "long", "ablation", "epochs", "participation")


def verdict_cell(v: Verdict) -> str:
    """A verdict's cell: its declared rule's line (estimate, interval, test, n, outcome), else its word."""
    return v.interval or HELD[v.held]


def page_verdicts(folder: Path) -> list[tuple[str, Verdict]]:
    """(source, verdict) of every claim of the page, judged again by its declared rule from the committed
    per-seed records (``results.csv``) of each folder of ``PAGE_FOLDERS`` under ``folder``; a variant preset's
    seed means from its committed ``NAME.csv``."""
    out = []
    for name in PAGE_FOLDERS:
        records = read_csv(folder / name / "results.csv")
        if name in PRESETS and PRESETS[name].variants:
            got = variant_verdicts(read_csv(folder / name / f"{name}.csv"), PRESETS[name], records)
        else:
            got = claim_verdicts(records)
        out += [(f"{name}/results.csv".lstrip("/"), v) for v in got]
    return out


def sections(folder: Path) -> dict[str, str]:
    """docs/reproductions/fedmim.md's generated claim table: every claim's verdict by its declared rule from
    the committed per-seed records in ``folder`` (``page_verdicts``)."""
    rows = [[v.claim, f"`{src}`", verdict_cell(v), v.measured] for src, v in page_verdicts(folder)]
    return {
        "claims": markdown_table(["claim", "source", "verdict", "measured"], rows),
        "small-cost": _small_cost(folder),
        "round50": _round50(folder),
        "table1": _page_table1(read_csv(folder / "table.csv")),
        "long": _page_long(read_csv(folder / "long" / "gaps.csv")),
        "per-seed": _page_per_seed(read_csv(folder / "results.csv")),
        "mnist": _page_mnist(read_csv(folder / "table.csv")),
        "ablation": _page_ablation(read_csv(folder / "ablation" / "ablation.csv")),
        "epochs": _page_epochs(read_csv(folder / "epochs" / "epochs.csv")),
        "participation": _page_participation(read_csv(folder / "participation" / "participation.csv")),
        "fedadam": _fedadam_settings(),
        **{f"{name}-cost": _cost(folder, name) for name in PAGE_FOLDERS[1:]},
        "same-cell": _same_cell_table(folder),
    }


# Table III's rows that are another method's configuration: J = 0 is FedAvg, the default row FedMIM's default
ABLATION_AS = {"J=0 a=- b=-": "fedavg", "J=2 a=0.6,0.3 b=0.9,0.1": "fedmim"}


def _same_cell(folder: Path) -> dict[str, dict[tuple[str, int], float]]:
    """Per committed preset, the accuracy (%) after 50 rounds of each (method, seed) run of the small preset's
    Dir-0.1 Fashion-MNIST configuration: the small preset's finals, the ``long`` preset at round 50
    (``long/gaps.csv``), Table II's E = 1 column and Table III's J = 0 and default rows."""
    small = read_csv(folder / "results.csv")
    return {
        "`small`": {(r["method"], r["seed"]): r["final_acc"] for r in small if (r["dataset"], r["split"]) == _CELL},
        "`long`, round 50": {
            (r["method"], r["seed"]): r["accuracy"] for r in read_csv(folder / "long" / "gaps.csv") if r["round"] == 50
        },
        "`epochs`, E = 1": {
            (r["method"], r["seed"]): r["final_acc"]
            for r in read_csv(folder / "epochs" / "results.csv")
            if r["variant"] == "E=1"
        },
        "`ablation`, J = 0 and default rows": {
            (ABLATION_AS[r["variant"]], r["seed"]): r["final_acc"]
            for r in read_csv(folder / "ablation" / "results.csv")
            if r["variant"] in ABLATION_AS
        },
    }


def _same_cell_table(folder: Path) -> str:
    """For every two presets of ``_same_cell``: the methods they share, how many of their common (method, seed)
    runs give the same accuracy and the largest difference."""
    runs = _same_cell(folder)
    names, body = list(runs), []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            common = sorted(set(runs[a]) & set(runs[b]), key=lambda k: (PAGE_CORE.index(k[0]), k[1]))
            if not common:
                continue
            diffs = [abs(runs[a][k] - runs[b][k]) for k in common]
            methods = ", ".join(LABELS[m] for m in dict.fromkeys(m for m, _ in common))
            body.append([a, b, methods, f"{sum(d == 0 for d in diffs)} of {len(diffs)}", f"{max(diffs):.2f}"])
    return markdown_table(["runs", "against", "methods", "runs equal", "largest difference (points)"], body)


def _cost(folder: Path, name: str) -> str:
    """What a preset's committed runs cost (``NAME/results.csv``: their number and summed ``cpu_seconds``, one
    torch thread each), per variant where the variants change the work per run (Table II's E, Fig. 2a's
    ratio); the wall time of a shared machine is not a cost, so it is left out."""
    rows = read_csv(folder / name / "results.csv")
    cpu = [r["cpu_seconds"] for r in rows]
    groups = {"": cpu}
    if name in ("epochs", "participation"):
        groups = {
            v: [r["cpu_seconds"] for r in rows if r["variant"] == v] for v in dict.fromkeys(r["variant"] for r in rows)
        }
    spans = ", ".join(
        f"{min(c):.0f}–{max(c):.0f} s" + (f" at {v.replace('=', ' = ').replace('%', ' %')}" if v else " each")
        for v, c in groups.items()
    )
    return (
        f"Cost: {len(rows)} runs, {sum(cpu):,.0f} CPU-seconds in total ({spans}; `cpu_seconds` of\n"
        f"`{name}/results.csv`, one torch thread per run).\n"
    )


def _fedadam_settings() -> str:
    """The FedAdam baseline's server settings as every preset runs them (``METHOD_OPTIONS`` over the
    algorithm's defaults, in a list item: indented), and where ``v_init``, its second moment's start, comes
    from: the presets do not set it, so a change of the default changes the page."""
    from fedweave.algorithms.centralized.fedadam import FedOptHparams

    hp = FedOptHparams(**METHOD_OPTIONS["fedadam"])
    where = "`METHOD_OPTIONS`" if "v_init" in METHOD_OPTIONS["fedadam"] else "`algorithm.v_init`'s default"
    text = (
        f"Server step eta_g = {hp.server_lr:g}, beta1 = {hp.beta1:g}, beta2 = {hp.beta2:g}, tau = {hp.tau:g}\n"
        f"(`METHOD_OPTIONS`), and the second moment starts at v_init = {hp.v_init:g} ({where}, `FedOptHparams`).\n"
    )
    return indent(text)


def _acc(row: dict) -> str:
    """A row's final accuracy, mean ± std over its seeds."""
    return pm(row["final_acc_mean"], row["final_acc_std"])


def _bold_acc(rows: list[dict]) -> list[str]:
    """The rows' final accuracies, the most accurate in bold."""
    return bold_best([_acc(r) for r in rows], [r["final_acc_mean"] for r in rows])


def _page_per_seed(rows: list[dict]) -> str:
    """The small preset's Dir-0.1 Fashion-MNIST finals and best accuracies per seed, FedAvg against FedMIM."""
    by = {(r["method"], r["seed"]): r for r in rows if (r["dataset"], r["split"]) == ("fashion_mnist", "dir0.1")}
    seeds = sorted(s for m, s in by if m == "fedmim")
    pairs = ", ".join(f"{by[('fedavg', s)]['final_acc']:.2f} → {by[('fedmim', s)]['final_acc']:.2f}" for s in seeds)

    def best(m: str) -> str:
        return " / ".join(f"{by[(m, s)]['best_acc']:.2f}" for s in seeds)

    return (
        f"Per seed at Dir-0.1 (final accuracy, FedAvg → FedMIM): {pairs}.\n"
        f"FedMIM's best accuracy over the evaluated rounds is {best('fedmim')}, against FedAvg's\n{best('fedavg')}.\n"
    )


def _page_mnist(rows: list[dict]) -> str:
    """The page's MNIST table (``table.csv``, inside a list item: indented), the best of each split in bold."""
    return indent(markdown_table(["method", "IID", "cons.", "Dir-0.1", "cons."], _core_rows(rows, "mnist", False)))


PAGE_CORE = ["fedavg", "scaffold", "fedcm", "fedmim"]  # the rows of the page's Table I and MNIST table


def _core_rows(rows: list[dict], dataset: str, paper: bool) -> list[list]:
    """Per method of ``PAGE_CORE``, at IID and at Dir-0.1 (``table.csv``): the final accuracy (each split's best
    in bold) and the consistency; with ``paper``, also our rank, the paper's CIFAR-10 number and its rank."""
    body = [[LABELS[m]] for m in PAGE_CORE]
    for split in ("iid", "dir0.1"):
        by = {r["method"]: r for r in rows if (r["dataset"], r["split"]) == (dataset, split)}
        cells = _bold_acc([by[m] for m in PAGE_CORE])
        ours = ranks({m: by[m]["final_acc_mean"] for m in PAGE_CORE})
        theirs = ranks({m: by[m]["paper_cifar10"] for m in PAGE_CORE}) if paper else {}
        for row, m, acc in zip(body, PAGE_CORE, cells):
            cons = f"{by[m]['consistency_last20']:#.3g}"
            row += [acc, ours[m], cons, f"{by[m]['paper_cifar10']:.2f}", theirs[m]] if paper else [acc, cons]
    return body


def _page_long(rows: list[dict]) -> str:
    """The page's ``long`` table (``long/gaps.csv``): per checkpoint round, each method's accuracy (mean ± std
    over seeds) and FedMIM minus each other method, the mean and per seed."""
    methods = ["fedavg", "fedmim", "fedcm", "scaffold"]
    acc = {(r["round"], r["method"], r["seed"]): r["accuracy"] for r in rows}
    seeds = sorted({r["seed"] for r in rows})

    body = []
    for t in sorted({r["round"] for r in rows}):
        cells = [pm(*mean_std([acc[(t, m, s)] for s in seeds])) for m in methods]
        for m in methods[:1] + methods[2:]:
            d = [acc[(t, "fedmim", s)] - acc[(t, m, s)] for s in seeds]
            cells.append(f"{signed(sum(d) / len(d))} ({', '.join(signed(x) for x in d)})")
        body.append([t, *cells])
    header = ["round", *(LABELS[m] for m in methods), *(f"FedMIM − {LABELS[m]}" for m in methods[:1] + methods[2:])]
    return markdown_table(header, body)


def _page_table1(rows: list[dict]) -> str:
    """The page's Table I: the four core methods on Fashion-MNIST (``table.csv``), ranks among them, the best
    of each split in bold, the paper's CIFAR-10 number and its rank among the same four."""
    header = ["method", "IID: ours", "rank", "cons.", "paper C10 IID", "paper rank"]
    header += ["Dir-0.1: ours", "rank", "cons.", "paper C10 DIR.1", "paper rank"]
    return markdown_table(header, _core_rows(rows, "fashion_mnist", True))


ABLATION_ROWS = (  # Table III's rows on the page, in TABLE_III's order
    "J = 0 (= FedAvg)",
    "J = 1, alpha 0.9 (= FedCM)",
    "J = 1, alpha 0.5",
    "J = 2, alpha (0.8, 0.1)",
    "J = 2, alpha (0.6, 0.3)",
    "J = 2, alpha (0.3, 0.6)",
    "J = 2, alpha (0.6, 0.3), beta (0.9, 0.1) (default)",
    "J = 2, alpha (0.6, 0.3), beta (0.5, 0.5)",
    "J = 2, alpha (0.6, 0.3), beta (0.1, 0.9)",
)


def _page_ablation(rows: list[dict]) -> str:
    """The page's Table III (``ablation/ablation.csv``): ours, per seed and the paper's, the best of each in bold."""
    ours = _bold_acc(rows)
    paper = bold_best([f"{r['paper_c10']:.2f}" for r in rows], [r["paper_c10"] for r in rows])
    body = [[label, o, r["final_acc_per_seed"], p] for label, o, r, p in zip(ABLATION_ROWS, ours, rows, paper)]
    return markdown_table(["row (alpha on δ_t, δ_t−1; beta)", "ours", "per seed", "paper"], body)


def _page_epochs(rows: list[dict]) -> str:
    """The page's Table II (``epochs/epochs.csv``): per method, ours at each E and the paper's three numbers."""
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["variant"]): r for r in rows}
    body = [
        [
            LABELS[m],
            *(_acc(by[(m, v)]) for v in labels),
            " / ".join(f"{by[(m, v)]['paper_c10']:.2f}" for v in labels),
        ]
        for m in methods
    ]
    heads = [v.replace("=", " = ") for v in labels]
    return markdown_table(["method", *heads, "paper C10 E = " + " / ".join(h.split(" = ")[1] for h in heads)], body)


def _page_participation(rows: list[dict]) -> str:
    """The page's Fig. 2a table (``participation/participation.csv``): per method and ratio, the final accuracy
    (best in bold) and the mean accuracy over the rounds, and the change of the final accuracy between them."""
    lo, hi = list(dict.fromkeys(r["variant"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["variant"]): r for r in rows}
    cols = {v: _bold_acc([by[(m, v)] for m in methods]) for v in (lo, hi)}
    body = [
        [
            LABELS[m],
            cols[lo][i],
            f"{by[(m, lo)]['mean_acc_over_rounds']:.2f}",
            cols[hi][i],
            f"{by[(m, hi)]['mean_acc_over_rounds']:.2f}",
            f"{abs(by[(m, hi)]['final_acc_mean'] - by[(m, lo)]['final_acc_mean']):.2f}",
        ]
        for i, m in enumerate(methods)
    ]
    h = [v.replace("%", " %") for v in (lo, hi)]
    return markdown_table(
        ["method", h[0], "mean over rounds", h[1], "mean over rounds", f"change {h[0]} → {h[1]}"], body
    )


def _small_cost(folder: Path) -> str:
    """The small preset's wall time (its ``table.md``) and CPU cost (the ``cpu_seconds`` of its MNIST runs,
    the runs that recorded it) as the page states them."""
    wall = re.search(r"Wall time ([\d.]+) min", (folder / "table.md").read_text(encoding="utf-8"))[1]
    cpu = [r["cpu_seconds"] for r in read_csv(folder / "results.csv") if r["dataset"] == "mnist"]
    mean = sum(cpu) / len(cpu)
    return (
        f"Runtime: {wall} min wall (`table.md`) on the 2-core machine while it was shared with several other jobs.\n"
        f"Its cost on idle cores, from the CPU time of the {len(cpu)} MNIST runs that recorded\n"
        f"it ({sum(cpu):.0f} CPU-seconds, {min(cpu):.0f}–{max(cpu):.0f} s per run, {mean:.0f} s on average), is about\n"
        f"{36 * mean / 2 / 60:.0f} minutes for the default preset's 36 runs on 2 idle cores and about"
        f" {66 * mean / 2 / 60:.0f} minutes\nwith `--extend` (66 runs).\n"
    )


def _round50(folder: Path) -> str:
    """How far the ``long`` preset's round-50 accuracies (``long/gaps.csv``) are from the ``small`` preset's
    T = 50 finals (``results.csv``), run by run."""
    small = {
        (r["method"], r["seed"]): r["final_acc"]
        for r in read_csv(folder / "results.csv")
        if (r["dataset"], r["split"]) == ("fashion_mnist", "dir0.1")
    }
    diffs = sorted(
        (abs(r["accuracy"] - small[k]), k, r["accuracy"], small[k])
        for r in read_csv(folder / "long" / "gaps.csv")
        if r["round"] == 50 and (k := (r["method"], r["seed"])) in small
    )
    d, (m, seed), here, there = diffs[-1]
    return (
        f"The round-50 accuracies differ from the `small` preset's T = 50 finals by up to {d:.2f} points\n"
        f"({LABELS[m]} seed {seed}: {here:.2f} here, {there:.2f} there; {sum(x[0] == 0 for x in diffs)} of"
        f" {len(diffs)} runs equal). The two presets differ only in the evaluation interval and the horizon;\n"
        "why the same configuration differs at round 50 is not established here.\n"
    )


def study_plan(opts) -> Plan:
    p = PRESETS[opts.scale]
    seeds = tuple(range(opts.seeds)) if opts.seeds else p.seeds
    return Plan(plan(p, Path(opts.out), seeds, opts.datasets, opts.methods, opts.extend), (p, seeds))


TABLE_KEYS = ["dataset", "split", "method", "seeds", "diverged", "final_acc_mean", "final_acc_std", "best_acc_mean"]
TABLE_KEYS += ["consistency_last20", "rank", "paper_cifar10", "paper_rank"]


def report(records: list[dict], plan_: Plan, opts, wall: float) -> int | Report:
    """Table I (or a variant preset's table), results.csv, the claims, the curves and the gaps."""
    p, seeds = plan_.context
    out = Path(opts.out)
    if p.variants:
        return write_variant_outputs(records, plan_.skipped, opts.scale, p, out, wall)
    table, claims = summarize(records)
    md = markdown(table, claims, opts.scale, p, wall, _cpu(records)) + not_run(plan_.skipped)
    files = {"results.csv": Rows(records, [k for k in RESULT_KEYS if k != "variant"], ".6g")}
    files |= {"table.csv": Rows(table, TABLE_KEYS, ".6g"), "table.md": md, "claims.json": Json(claims)}
    if p.report_rounds:
        files["gaps.csv"], files["gaps.md"] = gaps(out, p, seeds)
    return Report(files, show="table.md", figures=lambda out: plot(records, out))


STUDY = Study(
    name="fedmim",
    description=__doc__.splitlines()[0],
    scales=tuple(sorted(PRESETS)),
    options=(
        option("--datasets", nargs="+", help="replace the preset's datasets, in order (e.g. a test fixture)"),
        option("--methods", nargs="+", choices=METHODS, help="only these methods"),
        option("--extend", action="store_true", help="also run the preset's lower-priority cells"),
    ),
    plan=study_plan,
    record=record,
    report=report,
    sections=sections,
)
main = STUDY.main
