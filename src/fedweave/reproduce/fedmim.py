"""``fedweave reproduce fedmim``: FedMIM against its baselines (FedMIM paper, Table I; spec §9).

The presets (Table I's grid; ``long``; the variant presets ``epochs`` (Table II), ``ablation`` (Table III) and
``participation`` (Fig. 2a)), the paper's numbers, the table layouts and the claims of spec §9.2; what each
preset runs and which files it writes is on the page, docs/reproductions/fedmim.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fedweave.config import ConfigError
from fedweave.experiments.aggregate import (
    diverged,
    finite_runs,
    group,
    is_finite,
    mean_of,
    mean_std,
    per_cell,
    per_seed,
    ranks,
    seed_value,
    std_of,
)
from fedweave.experiments.blocks import claim_table, cost_line, gap_table, run_values, same_runs_table, verdict_cell
from fedweave.experiments.grid import Point
from fedweave.experiments.pages import REUSED_NOTE, stated
from fedweave.experiments.plots import Panel, plot_panels, seed_lines
from fedweave.experiments.study import (
    Claim,
    Json,
    Plan,
    Report,
    Rows,
    Study,
    Verdict,
    judge,
    known_datasets,
    not_run,
    option,
    reading,
)
from fedweave.experiments.tables import Best, Col, bold_layout, indent, layout, lookup, pm_cell, read_csv
from fedweave.experiments.verdicts import All, Paired, Select, Untestable, cell, complete_pairs
from fedweave.runner import Result

# ---- the paper's numbers ------------------------------------------------------------------------------
METHODS = ("fedavg", "fedadam", "scaffold", "fedcm", "feddyn", "fedsam", "fedmim")
LABELS = dict(zip(METHODS, ("FedAvg", "FedAdam", "SCAFFOLD", "FedCM", "FedDyn", "FedSAM", "FedMIM")))
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


MAIN = ("fedavg", "fedmim")  # the main claim, spec §9.1
SECOND = ("fedcm", "scaffold")  # FedMIM's J = 1 special case; the paper's strongest baseline at DIR.1
CORE = MAIN + SECOND
REST = ("fedadam", "feddyn", "fedsam")
DIR_IID = ("dir0.1", "iid")  # a cell and its IID control
SMALL_LOCAL = {"epochs": 1, "batch_size": 20, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3, "grad_clip": 10.0}


@dataclass
class Preset:
    """A preset; its defaults are the small preset's (Fashion-MNIST/MNIST, 20k images, 100 clients, T = 50)."""

    grid: list[tuple[str, str, tuple[str, ...]]]  # (dataset, split, methods), in priority order
    note: str
    seeds: tuple[int, ...] = (0, 1, 2)
    rounds: int = 50
    num_clients: int = 100
    clients_per_round: int = 10
    model: str = "cnn_small"
    local: dict[str, Any] = field(default_factory=lambda: SMALL_LOCAL)
    dataset_options: dict[str, Any] = field(default_factory=lambda: {"max_train": 20000})
    eval_every: int = 5
    extension: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # run with --extend
    report_rounds: tuple[int, ...] = ()  # also write OUT/gaps.{csv,md}: accuracy and gaps at these rounds
    # Table II / III / Fig. 2a presets: every grid cell runs once per (label, overrides) variant; overrides
    # may set "local" (merged into local), "clients_per_round", or "options" (FedMIM's alpha/beta)
    variants: tuple[tuple[str, dict[str, Any]], ...] = ()
    table: str = ""  # the variant table this preset writes: "epochs", "ablation" or "participation"


PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        [("mnist", "dir0.1", MAIN), ("mnist", "iid", MAIN)],
        "smoke preset: a few rounds on a tiny slice; checks the pipeline, not the paper",
        seeds=(0,),
        rounds=3,
        num_clients=10,
        clients_per_round=3,
        model="logistic",
        local={"steps": 2, "batch_size": 16, "lr": 0.1, "lr_decay": 0.998, "weight_decay": 1e-3},
        dataset_options={"max_train": 600, "max_test": 200},
        eval_every=1,
    ),
    # Spec §9 priority: (1) FedMIM vs FedAvg at Dir-0.1 and the IID control, (2) FedCM (FedMIM's J = 1
    # special case) and SCAFFOLD (the paper's strongest baseline at DIR.1) on Fashion-MNIST, (3) the main
    # claim again on MNIST: 36 runs (what they cost is the page's generated cost line, from their records).
    # --extend adds the other baselines on Fashion-MNIST and FedCM/SCAFFOLD on MNIST (30 more runs).
    "small": Preset(
        [(d, s, g) for d, gs in (("fashion_mnist", (MAIN, SECOND)), ("mnist", (MAIN,))) for g in gs for s in DIR_IID],
        "small preset: Fashion-MNIST/MNIST, 20k training images (200 per client), E = 1 epoch of B = 20 "
        "(K = 10), T = 50",
        extension=[(d, s, g) for d, g in (("fashion_mnist", REST), ("mnist", SECOND)) for s in DIR_IID],
    ),
    # Issue check of the page's explanation "the gain comes from the learning-rate ramp-up": the small
    # preset's Dir-0.1 Fashion-MNIST cell with the four core methods, run ten times longer (T = 500);
    # evaluated every 10 rounds so the gap can be read at rounds 50, 150, 300 and 500.
    "long": Preset(
        [("fashion_mnist", "dir0.1", CORE)],
        "long preset: the small preset's Dir-0.1 Fashion-MNIST cell (FedMIM, FedAvg, FedCM, SCAFFOLD) at T = 500",
        rounds=500,
        eval_every=10,
        report_rounds=(50, 150, 300, 500),
    ),
    "paper": Preset(
        [(d, s, METHODS) for d in ("cifar10", "cifar100") for s in ("iid", "dir0.3", "dir0.1")],
        "paper preset: Table I settings (spec §9.4); needs the CIFAR files and a fast machine",
        seeds=(0,),
        rounds=1000,
        model="resnet18_gn",
        eval_every=10,
        dataset_options={},
        local={**SMALL_LOCAL, "epochs": 5, "batch_size": 50, "augment": ["crop", "flip"]},
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


_CELL = ("fashion_mnist", "dir0.1")
_E1 = "E = 1 (K = 10), T = 50"
PRESETS |= {
    # Table II: E = 1 is the small preset's cell (K = 10 local steps); E = 5 and 10 give K = 50 and 100,
    # the paper's K at E = 5 and 10 on CIFAR (10 batches of 50 per epoch). --extend adds FedCM, SCAFFOLD.
    "epochs": Preset(
        [(*_CELL, MAIN)],
        "epochs preset (Table II): the small preset's Dir-0.1 Fashion-MNIST cell at E = 1, 5 and 10 local epochs "
        "of B = 20 (K = 10, 50, 100), T = 50",
        extension=[(*_CELL, SECOND)],
        variants=tuple((f"E={e}", {"local": {"epochs": e}}) for e in (1, 5, 10)),
        table="epochs",
    ),
    # Table III: every row is FedMIM with that (alpha, beta); J = 0 is FedAvg, J = 1 with beta = 0 FedCM
    "ablation": Preset(
        [(*_CELL, ("fedmim",))],
        f"ablation preset (Table III): FedMIM's alpha/beta/J rows on the small preset's Dir-0.1 Fashion-MNIST "
        f"cell, {_E1}",
        variants=tuple(
            (ablation_label(a, b), {"options": {"alpha": list(a), "beta": list(b)}}) for a, b, _ in TABLE_III
        ),
        table="ablation",
    ),
    # Fig. 2a: 5 % and 20 % of the 100 clients per round (the small preset's 10 % is its Table I cell);
    # the methods its claims name, FedSAM with --extend
    "participation": Preset(
        [(*_CELL, ("fedavg", "fedadam", "scaffold", "fedcm", "feddyn", "fedmim"))],
        f"participation preset (Fig. 2a): the small preset's Dir-0.1 Fashion-MNIST cell with 5 % and 20 % of the "
        f"clients per round, {_E1}",
        extension=[(*_CELL, ("fedsam",))],
        variants=(("5%", {"clients_per_round": 5}), ("20%", {"clients_per_round": 20})),
        table="participation",
    ),
}


# ---- the grid ----------------------------------------------------------------------------------------
def run_config(p: Preset, dataset: str, split: str, method: str, seed: int, run_dir: Path, variant: str = "") -> dict:
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


def plan(p: Preset, out: Path, seeds: tuple, datasets: list | None, methods: list | None, extend=False) -> list[Point]:
    """The runs of a preset in priority order: grid entry, seed, variant, method (a variant preset: seed first),
    each in ``OUT/runs/<dataset>-<split>-<method>[-<variant>]-s<seed>``."""
    names = preset_names(p, extend)[0]
    # the preset's datasets after the names given are not run (study_plan refuses more names than it has)
    rename = dict(zip(names, datasets)) if datasets else {d: d for d in names}
    variants = [v for v, _ in p.variants] or [""]
    runs = [
        (seed, d, split, v, m)
        for d, split, ms in p.grid + (p.extension if extend else [])
        for seed in seeds
        for v in variants
        for m in ms
        if d in rename and (methods is None or m in methods)
    ]
    if p.variants:  # seed first (a stable sort): a time budget leaves whole seeds
        runs.sort(key=lambda run: seeds.index(run[0]))
    return [_point(p, out, rename[d], split, m, seed, v) for seed, d, split, v, m in runs]


def preset_names(p: Preset, extend: bool = False) -> tuple[list[str], list[str]]:
    """The preset's datasets, in the order ``--datasets`` replaces them, and its methods (with ``--extend``, its
    extension's too)."""
    grid = p.grid + (p.extension if extend else [])
    return list(dict.fromkeys(d for d, _, _ in grid)), list(dict.fromkeys(m for _, _, ms in grid for m in ms))


def _point(p: Preset, out: Path, dataset: str, split: str, method: str, seed: int, variant: str) -> Point:
    """One run of the grid, in ``OUT/runs/<name>``: named by its cell, variant (made filesystem-safe) and seed."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", variant).strip("_")
    name = "-".join(x for x in (dataset, split, method, slug, f"s{seed}") if x)
    cfg = run_config(p, dataset, split, method, seed, out / "runs" / name, variant)
    return Point.of(cfg, name, dataset=dataset, split=split, method=method, **({"variant": variant} if variant else {}))


def record(point: Point, res: Result, plan: Plan | None = None) -> dict[str, Any]:
    """One run's row of results.csv; a diverged run (NaN/Inf) is kept as such, with no final accuracy."""
    rows, summary = res.metrics or [{"round": 0, "test_accuracy": float("nan")}], res.summary
    status = summary.get("status", "completed")
    last = rows[-1]["round"]
    tail = [r for r in rows if r["round"] > last - 20 and r.get("local_consistency") is not None]
    accs = [100 * r["test_accuracy"] for r in rows]
    if status == "diverged":  # no final model: the run is reported as diverged
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
        "status": status,
        "rounds_done": last,
        "_rows": res.metrics,
    }


RESULT_KEYS = ["dataset", "split", "method", "variant", "seed", "final_acc", "best_acc", "last3_acc"]
RESULT_KEYS += ["consistency_last20", "status", "rounds_done", "wall_seconds", "cpu_seconds"]


# ---- the per-cell summaries: Table I's (table.csv) and a variant preset's (NAME.csv) ------------------------
_finished = finite_runs("final_acc")  # a cell's runs that did not diverge (none: its statistics are NaN, shown —)
_ok = finite_runs("final_acc", by_seed=True)  # the same in seed order, without the fallback


def _auc(rs: list[dict]) -> float:
    """The mean over the finished runs of their mean test accuracy (%) over the evaluated rounds, to 2 decimals."""
    means = [100 * sum(x["test_accuracy"] for x in r["_rows"]) / len(r["_rows"]) for r in _ok(rs)]
    return round(mean_std(means)[0], 2)


TABLE_STATS = {
    "seeds": len,
    "diverged": diverged("final_acc"),
    "final_acc_mean": mean_of("final_acc", _finished),
    "final_acc_std": std_of("final_acc", _finished),
    "best_acc_mean": mean_of("best_acc", _finished),
    "consistency_last20": mean_of("consistency_last20", _finished),
}
TABLE_KEYS = ["dataset", "split", "method", *TABLE_STATS, "rank", "paper_cifar10", "paper_rank"]
VARIANT_STATS = {
    "seeds": len,
    "diverged": diverged("final_acc"),
    "final_acc_mean": mean_of("final_acc", _ok, nd=2),
    "final_acc_std": std_of("final_acc", _ok, nd=2),
    "mean_acc_over_rounds": _auc,
    "consistency_last20": mean_of("consistency_last20", _ok, nd=4),
    "final_acc_per_seed": per_seed("final_acc"),
}


def summarize(records: list[dict]) -> tuple[list[dict], list[Verdict]]:
    """Per (dataset, split, method): mean/std of final accuracy and consistency, the rank in the column and the
    paper's CIFAR-10 number and rank beside them (``table.csv``); and the claims' verdicts (``claim_verdicts``)."""
    table = per_cell(records, ("dataset", "split", "method"), TABLE_STATS)
    for (_, s), col in group(table, lambda t: (t["dataset"], t["split"])).items():
        paper = {t["method"]: TABLE_I[t["method"]][("cifar10", s)] for t in col}
        ours, paper_ranks = ranks({t["method"]: t["final_acc_mean"] for t in col}), ranks(paper)
        for t in col:
            t.update(paper_cifar10=paper[t["method"]], rank=ours[t["method"]], paper_rank=paper_ranks[t["method"]])
    return table, claim_verdicts(records)


def variant_summary(records: list[dict], p: Preset) -> list[dict]:
    """Per (variant, method), in the preset's order: ``VARIANT_STATS`` (diverged runs counted apart) and the
    paper's number where it has one."""
    methods = preset_names(p, extend=True)[1]
    cells = {(c["variant"], c["method"]): c for c in per_cell(records, ("variant", "method"), VARIANT_STATS)}
    paper = {"epochs": lambda i, m: TABLE_II_C10[m][i], "ablation": lambda i, m: TABLE_III[i][2]}.get(p.table)
    rows = [(i, v, m) for i, (v, _) in enumerate(p.variants) for m in methods if (v, m) in cells]
    return [cells[(v, m)] | {"paper_c10": paper(i, m) if paper else ""} for i, v, m in rows]


# ---- the claims: each verdict by its declared rule, 95 % paired t over the seeds (3 to 5 of them: too few for a
# percentile bootstrap); ``measured`` says what the seed means show ---------------------------------------------
DIR_FEDMIM, DIR_FEDAVG = cell(split="dir0.1", method="fedmim"), cell(split="dir0.1", method="fedavg")
UNPAIRED = "fewer than 2 seeds finished every run it compares"  # what was measured, where the rule is untestable


def _cells(*splits: str) -> Callable[[list[dict], str], list[dict]]:
    """The records a Table I claim on ``splits`` reads, per dataset: the runs of FedMIM and FedAvg there, each with
    ``log_cons``, the log of its local dispersion; its rule leaves a diverged run out of its pairs (``_no_pair``)."""

    def records(rs: list[dict], dataset: str) -> list[dict]:
        main = [r for r in rs if r["dataset"] == dataset and r["split"] in splits and r["method"] in MAIN]
        return [{**r, "log_cons": math.log(c) if (c := r["consistency_last20"]) > 0 else math.nan} for r in main]

    return records


def _of(*splits: str) -> Callable[[list[dict], str], list[dict]]:
    """The paired runs of ``_cells(*splits)``: the seeds that finished every one of its runs (what was measured)."""
    return lambda rs, dataset: complete_pairs(
        _cells(*splits)(rs, dataset), lambda r: (r["split"], r["method"]), ("final_acc", "log_cons")
    )


def _no_pair(r: dict) -> str | None:
    """Why a run is no pair of a Table I rule (``Paired.no_pair``): it diverged (no final accuracy or dispersion)."""
    return None if is_finite(r["final_acc"]) and is_finite(r["log_cons"]) else "diverged"


def _gap(split: str) -> Select:
    """Per seed, FedMIM's final accuracy minus FedAvg's on ``split`` (the same seed: the same partition)."""
    return cell(split=split, method="fedmim") - cell(split=split, method="fedavg")


def _mean_gap(records: list[dict], split: str) -> tuple[float, int, int] | None:
    """The mean of the seed gaps ``_gap(split)`` of paired ``records``, on how many seeds FedMIM is ahead and of
    how many; None where ``split`` has none."""
    g = list(_gap(split).values(records, "final_acc").values())
    return (sum(g) / len(g), sum(x > 0 for x in g), len(g)) if g else None


def _accuracy(records: list[dict], d: str) -> tuple:
    g = _mean_gap(_of("dir0.1")(records, d), "dir0.1")
    rule = Paired("final_acc", DIR_FEDMIM, DIR_FEDAVG, min_effect=1.0, no_pair=_no_pair)
    return "FedMIM - FedAvg {:+.2f} points, ahead on {}/{} seeds".format(*g) if g else UNPAIRED, rule


def _dispersion(records: list[dict], d: str) -> tuple:
    def ratio(split: str) -> float | None:  # the mean over the seeds of FedMIM's dispersion / FedAvg's
        a, b = (cell(split=split, method=m).values(_of(split)(records, d), "consistency_last20") for m in MAIN[::-1])
        ratios = [a[s] / b[s] for s in sorted(a) if s in b]
        return sum(ratios) / len(ratios) if ratios else None

    at, iid = ratio("dir0.1"), ratio("iid")
    measured = UNPAIRED if at is None else f"FedMIM / FedAvg {at:.3f}" + ("" if iid is None else f" (IID {iid:.3f})")
    return measured, Paired("log_cons", DIR_FEDMIM, DIR_FEDAVG, "less", math.log(2), unit="ln ratio", no_pair=_no_pair)


def _iid(records: list[dict], d: str) -> tuple:
    both = _of("dir0.1", "iid")(records, d)
    g, i = _mean_gap(both, "dir0.1"), _mean_gap(both, "iid")
    measured = f"FedMIM - FedAvg: IID {i[0]:+.2f}, Dir-0.1 {g[0]:+.2f} points" if g and i else UNPAIRED
    return measured, Paired("final_acc", _gap("dir0.1"), _gap("iid"), "greater", 0.0, no_pair=_no_pair)


# spec §9.2 on one dataset (the table: the per-seed records, the context: the dataset), by key
TABLE_I_CLAIMS = {
    # min effect 1.0 point: spec §9.2's bar; a smaller gain is within what another partition moves at this scale
    "claim_accuracy": reading(
        "Dir-0.1 FedMIM beats FedAvg by more than 1.0 point (final accuracy, paired by seed)",
        _accuracy,
        _cells("dir0.1"),
    ),
    # the ratio is tested on its log, paired by seed; min effect ln 2: the spec's "less than half"
    "claim_consistency": reading(
        "Dir-0.1 FedMIM's local dispersion < 0.5 x FedAvg's (log of the ratio, paired by seed)",
        _dispersion,
        _cells("dir0.1"),
    ),
    # the paper: the advantage shrinks without heterogeneity; any shrinking counts (min effect 0), per seed
    "claim_iid_smaller": reading(
        "FedMIM's gain over FedAvg is larger on Dir-0.1 than on IID (difference of the seed gaps)",
        _iid,
        _cells("dir0.1", "iid"),
    ),
}
NO_PAIRS = "no claim testable: its paired rule needs 2 seeds or more that finished every cell it compares"
NO_RUNS = "no claim testable: no run finished"


def claim_verdicts(records: list[dict]) -> list[Verdict]:
    """The Table I checks (spec §9.2) on the per-seed records (a ``results.csv``), per dataset: ``Verdict``s."""
    out = []
    for d in sorted({r["dataset"] for r in records}):
        got = judge(list(TABLE_I_CLAIMS.values()), records, d) or [Verdict("spec §9.2", NO_PAIRS, None)]
        out += [dataclasses.replace(v, claim=f"{d}: {v.claim}") for v in got]
    return out or [Verdict("spec §9.2", NO_RUNS, None)]  # a time budget that let no run finish


@dataclass
class Cells:
    """A variant preset's seed means per (variant, method), of the final accuracy and of the mean accuracy over
    the rounds, its variants and methods in order, and the paired per-seed records its declared rules read."""

    acc: dict[tuple[str, str], float]
    auc: dict[tuple[str, str], float]
    labels: list[str]
    methods: list[str]
    records: list[dict]

    def fedmim(self) -> dict[str, float]:
        return {v: self.acc[(v, "fedmim")] for v in self.labels}

    def change(self, m: str) -> float:
        """How much ``m``'s accuracy changes between the first and the last variant."""
        return abs(self.acc[(self.labels[-1], m)] - self.acc[(self.labels[0], m)])

    def changes(self, *_) -> list[dict]:
        """Per method and seed, how much its final accuracy changes between the first and the last variant."""
        by = {(r["variant"], r["method"], r["seed"]): r["final_acc"] for r in self.records}
        lo, hi = self.labels[0], self.labels[-1]
        return [{"method": m, "seed": k, "change": abs(by[(hi, m, k)] - a)} for (v, m, k), a in by.items() if v == lo]


def verdicts(p: Preset, records: list[dict], rows: list[dict]) -> list[Verdict]:
    """A preset's claims, each verdict by its declared rule on the per-seed ``records``: Table I's per dataset
    (``claim_verdicts``), or a variant preset's readings of its seed means ``rows`` (``variant_verdicts``)."""
    return variant_verdicts(rows, p, records) if p.variants else claim_verdicts(records)


def variant_verdicts(rows: list[dict], p: Preset, records: list[dict]) -> list[Verdict]:
    """The paper's readings of Table II, Table III or Fig. 2a, each verdict by its declared rule on the per-seed
    ``records`` (a ``results.csv``), what was measured from the seed means of ``rows`` (its ``NAME.csv``)."""
    acc = {(r["variant"], r["method"]): r["final_acc_mean"] for r in rows if r["diverged"] < r["seeds"]}
    labels, methods = [v for v, _ in p.variants], list(dict.fromkeys(r["method"] for r in rows))
    ran = {(r["variant"], r["method"]) for r in rows}
    cells = [(v, m) for v in labels for m in methods]
    gone = [f"{v} {LABELS[m]}" for v, m in cells if (v, m) in ran and (v, m) not in acc]
    unrun = [f"{v} {LABELS[m]}" for v, m in cells if (v, m) not in ran]
    if "fedmim" not in methods or gone or unrun:  # the readings compare every cell's seed means
        why = [f"every run of {', '.join(gone)} diverged"] if gone else []
        why += [f"not run: {', '.join(unrun)}"] if unrun else []
        return [Verdict("every cell of the preset ran", f"{'; '.join(why) or 'FedMIM not run'} (see the table)", None)]
    auc = {(r["variant"], r["method"]): r["mean_acc_over_rounds"] for r in rows}
    cells = Cells(
        acc, auc, labels, methods, complete_pairs(records, lambda r: (r["variant"], r["method"]), ("final_acc",))
    )
    return judge(VARIANT_CLAIMS[p.table], cells) if cells.records else [Verdict("the paper's readings", NO_PAIRS, None)]


# the paper's readings of each variant table, by ``reads`` (the table: its ``Cells``)
VARIANT_CLAIMS: dict[str, list[Claim]] = {}


def reads(table: str, text: str, records: Callable | None = None) -> Callable:
    """Declare the decorated ``read(cells, ctx) -> (measured, declared rule)`` a reading of the variant ``table``
    whose rule reads ``records`` (default: the paired runs); ``{lo}``, ``{hi}``, ``{labels[i]}`` name variants."""

    def claim(c: Cells, _) -> str:
        return text.format(lo=c.labels[0], hi=c.labels[-1], labels=c.labels)

    def declare(read: Callable) -> Callable:
        VARIANT_CLAIMS.setdefault(table, []).append(reading(claim, read, records or (lambda c, _: c.records)))
        return read

    return declare


def _gt(a: str, b: str, m: str = "fedmim", n: str | None = None) -> Paired:
    """Variant ``a`` of method ``m`` beats variant ``b`` of method ``n`` (by default ``m``) on the final accuracy,
    paired by seed. Min effect 0: the paper states orders, not sizes, so any difference in the claimed direction
    counts and the interval decides whether the seeds see it."""
    return Paired("final_acc", {"variant": a, "method": m}, {"variant": b, "method": n or m})


def _changed(a: str, b: str, direction: str = "greater") -> Paired:
    """Method ``a``'s change between the first and the last variant against method ``b``'s, paired by seed."""
    return Paired("change", {"method": a}, {"method": b}, direction)


@reads("epochs", "FedMIM is the most accurate of the methods run at every E (paper: best in all 9 columns)")
def _e_best(c: Cells, _) -> tuple:
    best = {v: max(c.methods, key=lambda m: c.acc[(v, m)]) for v in c.labels}
    where = [f"{v}: FedMIM {c.acc[(v, 'fedmim')]:.2f}, best {LABELS[b]} {c.acc[(v, b)]:.2f}" for v, b in best.items()]
    others = [m for m in c.methods if m != "fedmim"]
    return "; ".join(where), All((f"{v} vs {LABELS[m]}", _gt(v, v, "fedmim", m)) for v in c.labels for m in others)


@reads("epochs", "accuracy falls as E grows, for every method run (paper: all but one)")
def _e_falls(c: Cells, _) -> tuple:
    steps = list(zip(c.labels, c.labels[1:]))

    def trend(m: str) -> str:
        accs = [c.acc[(v, m)] for v in c.labels]
        falls = all(a > b for a, b in zip(accs, accs[1:]))
        return f"{LABELS[m]} " + " / ".join(f"{a:.2f}" for a in accs) + ("" if falls else " (not falling)")

    rule = All((f"{LABELS[m]} {a} > {b}", _gt(a, b, m)) for m in c.methods for a, b in steps)
    return "; ".join(map(trend, c.methods)), rule


# Table III's rows in TABLE_III's order: 0 J = 0 (FedAvg); 1-2 J = 1; 3-5 J = 2 without beta; 6-8 J = 2 with beta
@reads("ablation", "every inertial row (J >= 1) beats J = 0 (FedAvg)")
def _a_inertial(c: Cells, _) -> tuple:
    a, lb = c.fedmim(), c.labels
    rest = [a[v] for v in lb[1:]]
    return f"J = 0: {a[lb[0]]:.2f}; J >= 1: {min(rest):.2f} to {max(rest):.2f}", All((v, _gt(v, lb[0])) for v in lb[1:])


@reads("ablation", "J = 2 is best: the best J = 2 row beats the best J = 1 row (rows chosen by their seed means)")
def _a_j2(c: Cells, _) -> tuple:
    a = c.fedmim()
    j1, j2 = max(c.labels[1:3], key=a.get), max(c.labels[3:], key=a.get)
    return f"best J = 2 ({j2}) {a[j2]:.2f} vs best J = 1 ({j1}) {a[j1]:.2f}", _gt(j2, j1)


@reads("ablation", "the paper's best row ({labels[6]}) is the best row")
def _a_top(c: Cells, _) -> tuple:
    a, paper = c.fedmim(), c.labels[6]
    top, rule = max(c.labels, key=a.get), All((f"vs {v}", _gt(paper, v)) for v in c.labels if v != paper)
    return f"{a[paper]:.2f}; best row {top} {a[top]:.2f}", rule


@reads("ablation", "beta weighted to the adjacent step is best: beta (0.9, 0.1) > (0.5, 0.5) > (0.1, 0.9)")
def _a_beta(c: Cells, _) -> tuple:
    a, lb = c.fedmim(), c.labels
    rule = All((f"b={x.split('b=')[1]} > b={y.split('b=')[1]}", _gt(x, y)) for x, y in zip(lb[6:8], lb[7:9]))
    return " / ".join(f"{a[v]:.2f}" for v in lb[6:9]), rule


@reads("ablation", "a large alpha and a proper beta: adding beta (0.9, 0.1) to alpha (0.6, 0.3) helps")
def _a_alpha_beta(c: Cells, _) -> tuple:
    a, lb = c.fedmim(), c.labels
    return f"{a[lb[6]]:.2f} with beta vs {a[lb[4]]:.2f} without", _gt(lb[6], lb[4])


def _changes(c: Cells, ms: list[str]) -> str:
    return ", ".join(f"{LABELS[m]} {c.change(m):.2f}" for m in ms) + " points"


@reads(
    "participation", "FedAvg loses the most convergence speed: the lowest mean accuracy over the rounds at both ratios"
)
def _p_fedavg_slowest(c: Cells, _) -> tuple:
    slowest = {v: min(c.methods, key=lambda m: c.auc[(v, m)]) for v in c.labels}
    measured = "; ".join(f"{v}: lowest {LABELS[m]} {c.auc[(v, m)]:.2f}" for v, m in slowest.items())
    return measured, Untestable("no per-seed records of the mean accuracy over the rounds (results.csv: finals)")


@reads(
    "participation",
    "FedAdam, FedCM and FedDyn are highly sensitive to the participation ratio: each changes more between "
    "{lo} and {hi} than FedMIM",
    Cells.changes,
)
def _p_sensitive(c: Cells, _) -> tuple:
    named = [m for m in ("fedadam", "fedcm", "feddyn") if m in c.methods]
    return _changes(c, [*named, "fedmim"]), All((f"{LABELS[m]} vs FedMIM", _changed(m, "fedmim")) for m in named)


@reads("participation", "SCAFFOLD performs well at the higher participation: among the two most accurate at {hi}")
def _p_scaffold(c: Cells, _) -> tuple:
    hi = c.labels[-1]
    ranked = sorted(c.methods, key=lambda m: -c.acc[(hi, m)])
    measured = f"{hi}: " + " > ".join(f"{LABELS[m]} {c.acc[(hi, m)]:.2f}" for m in ranked)
    # among the two most accurate = above every other method but one: against the second of the others
    others, few = [m for m in ranked if m != "scaffold"], Untestable("fewer than three methods ran")
    return measured, _gt(hi, hi, "scaffold", others[1]) if len(others) > 1 else few


@reads(
    "participation",
    "FedMIM is very stable: the smallest change between {lo} and {hi} of the methods run",
    Cells.changes,
)
def _p_stable(c: Cells, _) -> tuple:
    rule = All((f"vs {LABELS[m]}", _changed("fedmim", m, "less")) for m in c.methods if m != "fedmim")
    return _changes(c, sorted(c.methods, key=c.change)), rule


# ---- the tables: one layout each, for a preset's report and the page's generated sections ---------------------
# Table III's rows that are another method's configuration: J = 0 is FedAvg, the default row FedMIM's default
ABLATION_AS = {"J=0 a=- b=-": "fedavg", "J=2 a=0.6,0.3 b=0.9,0.1": "fedmim"}


def _same_cell(folder: Path) -> dict[str, dict[tuple[str, int], float]]:
    """Per committed preset, the accuracy (%) after 50 rounds of each (method, seed) run of the small preset's
    Dir-0.1 Fashion-MNIST configuration (Table II's E = 1 column, Table III's J = 0 and default rows)."""
    small, epochs, ablation = (
        read_csv(folder / f) for f in ("results.csv", "epochs/results.csv", "ablation/results.csv")
    )
    return {
        "`small`": run_values(small, "final_acc", lambda r: (r["dataset"], r["split"]) == _CELL),
        "`long`, round 50": run_values(read_csv(folder / "long" / "gaps.csv"), "accuracy", lambda r: r["round"] == 50),
        "`epochs`, E = 1": run_values(epochs, "final_acc", lambda r: r["variant"] == "E=1"),
        "`ablation`, J = 0 and default rows": run_values(
            ablation, "final_acc", lambda r: r["variant"] in ABLATION_AS, lambda r: ABLATION_AS[r["variant"]]
        ),
    }


def _same_cell_table(folder: Path) -> str:
    """For every two presets of ``_same_cell``: their common runs' methods, how many are equal, the largest
    difference."""
    return same_runs_table(_same_cell(folder), lambda k: (CORE_ROWS.index(k[0]), k[1]), LABELS.get)


def _cost(folder: Path, name: str) -> str:
    """What a preset's committed runs cost (``cost_line``), per variant where the variants change the work per
    run (Table II's E, Fig. 2a's ratio)."""
    by = "variant" if name in ("epochs", "participation") else None
    return cost_line(read_csv(folder / name / "results.csv"), f"{name}/results.csv", by, _spaced)


def _fedadam_settings() -> str:
    """The FedAdam baseline's server settings as every preset runs them, indented for a list item; ``v_init`` is
    the algorithm's default unless ``METHOD_OPTIONS`` sets it, so a change of the default changes the page."""
    from fedweave.algorithms.centralized.fedadam import FedOptHparams

    hp = FedOptHparams(**METHOD_OPTIONS["fedadam"])
    where = "`METHOD_OPTIONS`" if "v_init" in METHOD_OPTIONS["fedadam"] else "`algorithm.v_init`'s default"
    text = (
        f"Server step eta_g = {hp.server_lr:g}, beta1 = {hp.beta1:g}, beta2 = {hp.beta2:g}, tau = {hp.tau:g}\n"
        f"(`METHOD_OPTIONS`), and the second moment starts at v_init = {hp.v_init:g} ({where}, `FedOptHparams`).\n"
    )
    return indent(text)


ACC = "test accuracy (%)"


def _spaced(variant: str) -> str:
    """A Table II or Fig. 2a variant as the page writes it: ``E = 1``, ``5 %``."""
    return variant.replace("=", " = ").replace("%", " %")


_acc = partial(pm_cell, key="final_acc")  # a row's final accuracy, mean ± std over seeds


SPLIT_NAMES = {"iid": ("IID", "IID"), "dir0.3": ("Dir-0.3", "DIR.3"), "dir0.1": ("Dir-0.1", "DIR.1")}  # ours, paper's
CORE_ROWS = ["fedavg", "scaffold", "fedcm", "fedmim"]  # the rows of the page's Table I and MNIST table


def table_i(rows: list[dict], dataset: str, methods=METHODS, paper: bool = True) -> str:
    """Table I's layout of ``dataset``'s rows (``table.csv``): per method that ran and split, the final accuracy
    (best in bold) and the consistency; with ``paper`` also our rank and the paper's CIFAR-10 number and rank."""
    ran = [r for r in rows if r["dataset"] == dataset and r["method"] in methods]
    keys = [m for m in methods if any(r["method"] == m for r in ran)]
    cols = [Col("method", LABELS.get)]
    for split, (name, c10) in SPLIT_NAMES.items():
        if not (by := {r["method"]: r for r in ran if r["split"] == split}):
            continue
        acc = Best(f"{name}: ours" if paper else name, lookup(by, _acc), key=lookup(by, "final_acc_mean", -math.inf))
        cons = Col("cons.", lookup(by, "consistency_last20"), "#.3g")
        if not paper:
            cols += [acc, cons]
            continue
        ours, theirs = (ranks({m: by[m][k] for m in keys if m in by}) for k in ("final_acc_mean", "paper_cifar10"))
        cols += [acc, Col("rank", ours.get), cons, Col(f"paper C10 {c10}", lookup(by, "paper_cifar10"), ".2f")]
        cols.append(Col("paper rank", theirs.get))
    return bold_layout(cols, keys)


rounds_table = partial(gap_table, ref="fedmim", label=LABELS.get)  # the long preset's gaps per round


ABLATION_ROWS = (  # Table III's rows in TABLE_III's order
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
ROW_NAMES = dict(zip((v for v, _ in PRESETS["ablation"].variants), ABLATION_ROWS))
ABLATION_COLS = [
    Col("row (alpha on δ_t, δ_t−1; beta)", lambda r: ROW_NAMES[r["variant"]]),
    Best("ours", _acc, key="final_acc_mean"),
    Col("per seed", "final_acc_per_seed"),
    Best("paper", "paper_c10", ".2f"),
]


def _per_variant(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """A variant table's rows (its ``NAME.csv``) per variant, then per method, in their order."""
    return {v: {r["method"]: r for r in rs} for v, rs in group(rows, lambda r: r["variant"]).items()}


def _epochs(rows: list[dict]) -> str:
    """Table II: per method, ours at each E and the paper's three numbers."""
    per = _per_variant(rows)
    cols = [Col("method", LABELS.get), *(Col(_spaced(v), lookup(by, _acc)) for v, by in per.items())]
    paper = [lookup(by, lambda r: f"{r['paper_c10']:.2f}", "–") for by in per.values()]
    cols.append(
        Col("paper C10 E = " + " / ".join(v.split("=")[1] for v in per), lambda m: " / ".join(f(m) for f in paper))
    )
    return layout(cols, list(dict.fromkeys(r["method"] for r in rows)))


def _participation(rows: list[dict]) -> str:
    """Fig. 2a: per method and ratio, the final accuracy (best in bold) and the mean accuracy over the rounds, and
    the change of the final accuracy between the first and the last ratio."""
    per, cols = _per_variant(rows), [Col("method", LABELS.get)]
    for v, by in per.items():
        cols += [Best(_spaced(v), lookup(by, _acc), key=lookup(by, "final_acc_mean", -math.inf))]
        cols += [Col("mean over rounds", lookup(by, "mean_acc_over_rounds"), ".2f")]
    (lo, a), (hi, b) = list(per.items())[0], list(per.items())[-1]

    def change(m: str) -> float | None:
        return abs(b[m]["final_acc_mean"] - a[m]["final_acc_mean"]) if m in a and m in b else None

    cols.append(Col(f"change {_spaced(lo)} → {_spaced(hi)}", change, ".2f"))
    return bold_layout(cols, list(dict.fromkeys(r["method"] for r in rows)))


VARIANT_TABLES = {"ablation": partial(bold_layout, ABLATION_COLS), "epochs": _epochs, "participation": _participation}


# ---- a preset's report: its records and summaries, the tables above, the claims, the curves ----------------------
TITLES = {"epochs": "Table II (local epochs)", "ablation": "Table III (alpha, beta, J)"}
TITLES["participation"] = "Fig. 2a (participation)"
TABLE_I_TEXT = (
    "Final test accuracy (%) of the global model, mean ± std over seeds, the best of a split in bold. `rank` is our "
    "ranking in the split (among the methods run there, as is `paper rank`); the paper has no MNIST/Fashion-MNIST "
    "column, so its CIFAR-10 number and rank for the same split (Table I) are shown beside ours. `cons.` is the local "
    "consistency (1/S)Σ‖x_i − x̄‖² averaged over the evaluations of the last 20 rounds (Fig. 2b; lower is more "
    "consistent); per run in `results.csv`."
)
VARIANT_TEXT = (
    "Final test accuracy (%) of the global model, mean ± std over seeds. Per cell in `{name}.csv`: the per-seed "
    "finals, the mean test accuracy over the evaluated rounds (every {p.eval_every}; it measures convergence speed) "
    "and the local consistency averaged over the last 20 rounds; per run in `results.csv`. "
)
PAPER_NOTES = {
    "epochs": "The paper's numbers are CIFAR-10 with ResNet-18-GN (Table II).",
    "ablation": "The paper's numbers are its Table III (CIFAR-10 probably, E = 5, T = 500).",
    "participation": "The paper shows Fig. 2a as curves only (CIFAR-10, Dir-0.1, E = 5).",
}
GAPS_TEXT = "Test accuracy (%) at each round, mean ± std over the seeds that reached it, and FedMIM − method, per seed."
GAP_KEYS = ["dataset", "split", "method", "seed", "round", "accuracy", "fedmim_minus_method"]


def _setting(p: Preset, wall: float, records: list[dict], reused: str = "") -> str:
    """A report's line on its preset and cost: the runs share the machine, so their summed CPU time (when every
    run has it) says what the preset costs on idle cores; ``reused``: ``Plan.reused_note``."""
    cpus = [r.get("cpu_seconds") for r in records]
    cpu = f"; CPU time of the runs {sum(cpus) / 60:.1f} min (one thread each)" if cpus and None not in cpus else ""
    per_round = " unless the column says otherwise" if p.variants else ""
    horizon = "" if p.variants else f", T = {p.rounds}"
    return (
        f"{p.note}. {p.num_clients} clients, {p.clients_per_round} per round{per_round}, model `{p.model}`, "
        f"local {p.local}{horizon}. Wall time {wall / 60:.1f} min{reused}{cpu}."
    )


def report_files(
    records: list[dict], rows: list[dict], name: str, p: Preset, wall: float, skipped=(), gaps=None, reused: str = ""
):
    """A preset's report files from its per-seed ``records`` and per-cell ``rows`` (read back from the committed
    CSV files, they rebuild the committed report); with the ``long`` preset's ``gaps`` rows gaps.csv and gaps.md."""
    title = f"# FedMIM {TITLES.get(p.table, 'reproduction')}, preset `{name}`"
    md = [title, "", _setting(p, wall, records, reused), ""]
    if p.variants:
        keys, csv_name = RESULT_KEYS, f"{name}.csv"
        table = VARIANT_TABLES[p.table](rows) if rows else "No run finished.\n"
        md += [VARIANT_TEXT.format(name=name, p=p) + PAPER_NOTES[p.table], "", table]
    else:
        keys, csv_name = [k for k in RESULT_KEYS if k != "variant"], "table.csv"
        md += [TABLE_I_TEXT, ""]
        for d in sorted({r["dataset"] for r in rows}):
            md += [f"## {d}", "", table_i(rows, d)]
    judged = verdicts(p, records, rows)
    md += ["## Claims (each by its declared rule)", "", claim_table([("results.csv", v) for v in judged])]
    files = {
        "results.csv": Rows(records, keys, ".6g"),
        csv_name: Rows(rows) if p.variants else Rows(rows, TABLE_KEYS, ".6g"),
    }
    files[f"{name}.md" if p.variants else "table.md"] = "\n".join(md) + not_run(skipped)
    claims = [{"claim": v.claim, "verdict": verdict_cell(v), "measured": v.measured} for v in judged]
    files["claims.json"] = Json(claims, ensure_ascii=False)
    if gaps is not None:
        gaps_md = [f"# FedMIM's gap over a longer horizon (preset rounds {p.rounds})", "", GAPS_TEXT]
        for d, s, methods in p.grid:
            cell_rows = [r for r in gaps if (r["dataset"], r["split"]) == (d, s)]
            gaps_md += ["", f"## {d} {s}", "", rounds_table(cell_rows, methods)]
        files |= {"gaps.csv": Rows(gaps, GAP_KEYS, ".2f"), "gaps.md": "\n".join(gaps_md)}
    return files


def gaps(out: Path, p: Preset, seeds: tuple[int, ...]) -> list[dict]:
    """Per run of ``p.grid`` and round of ``p.report_rounds`` it reached (its ``metrics.csv``): the test accuracy
    and FedMIM's minus it at the same seed."""
    rows: list[dict] = []
    for dataset, split, methods in p.grid:
        runs = {(m, s): out / "runs" / f"{dataset}-{split}-{m}-s{s}" / "metrics.csv" for m in methods for s in seeds}
        acc = {k: {r["round"]: 100 * r["test_accuracy"] for r in read_csv(f)} for k, f in runs.items() if f.is_file()}
        for t in p.report_rounds:
            at = {k: a[t] for k, a in acc.items() if t in a}
            mim = {s: x for (m, s), x in at.items() if m == "fedmim"}
            ordered = [(k, x) for k, x in at.items() if k[0] != "fedmim" and k[1] in mim]
            ordered += [(k, x) for k, x in at.items() if k[0] == "fedmim"]
            rows += [dict(zip(GAP_KEYS, (dataset, split, m, s, t, x, mim[s] - x))) for (m, s), x in ordered]
    return rows


def _width(method: str) -> dict[str, float]:
    """FedMIM's line drawn wider than the others."""
    return {"lw": 2.2 if method == "fedmim" else 1.2}


def plot(records: list[dict], p: Preset, name: str, out: Path) -> list[Path]:
    """``OUT/curves-<dataset>.png`` (a variant preset: ``curves-NAME.png``): test accuracy (mean over seeds, band)
    per split or variant, a line per method (Table III: per row); below, for Table I, the local consistency."""
    key, paths = "variant" if p.variants else "split", []
    for d, rs in sorted(group(records, lambda r: r["dataset"]).items()):
        panels = [v for v, _ in p.variants] or [s for s in SPLIT_NAMES if any(r["split"] == s for r in rs)]
        lines = {g: seed_lines([r for r in rs if r[key] == g], "method", METHODS, LABELS.get, _width) for g in panels}
        if p.table == "ablation":  # FedMIM alone, each row a line
            lines = {"FedMIM rows": seed_lines(rs, "variant", panels, style=lambda v: {"lw": 1.2})}
        acc = {"yscale": 100, "xlabel": "round" if p.variants else None, "ylabel": ACC, "legend": {"fontsize": 8}}
        grid = [[Panel(ls, "test_accuracy", title=f"{d}, {g} (mean over seeds)", **acc) for g, ls in lines.items()]]
        cons = {"xlabel": "round", "ylabel": "local consistency", "logy": True, "legend": None}
        if not p.variants:
            grid.append([Panel(ls, "local_consistency", **cons) for ls in lines.values()])
        paths.append(plot_panels(grid, out / f"curves-{name if p.variants else d}.png", panel_size=(5, 3.5), dpi=110))
    return paths


# ---- the page: docs/reproductions/fedmim.md's generated sections, from the committed records beside it ------
# the page's claim table: the claims judged on the per-seed records of these committed folders beside it (a
# variant preset's folder is named after it), in this order
PAGE_FOLDERS = ("", "long", "ablation", "epochs", "participation")


def page_verdicts(folder: Path) -> list[tuple[str, Verdict]]:
    """(source, verdict) of every claim of the page, judged again from the committed ``results.csv`` (and a
    variant preset's ``NAME.csv``) of each folder of ``PAGE_FOLDERS`` under ``folder``."""
    out = []
    for name in PAGE_FOLDERS:
        p, d = PRESETS[name or "small"], folder / name
        rows = read_csv(d / f"{name}.csv") if p.variants else []
        out += [(f"{name}/results.csv".lstrip("/"), v) for v in verdicts(p, read_csv(d / "results.csv"), rows)]
    return out


def sections(folder: Path) -> dict[str, str]:
    """docs/reproductions/fedmim.md's generated sections, from the committed files in ``folder``: the claim table
    (every claim's verdict by its declared rule, ``page_verdicts``), the tables and the prose with numbers."""
    _page_parts(folder)
    table, results = read_csv(folder / "table.csv"), read_csv(folder / "results.csv")
    return {
        "claims": claim_table(page_verdicts(folder)),
        "small-cost": _small_cost(folder, results),
        "round50": _round50(folder),
        "table1": table_i(table, "fashion_mnist", CORE_ROWS),
        "long": rounds_table(read_csv(folder / "long" / "gaps.csv"), CORE),
        "per-seed": _page_per_seed(results),
        "mnist": indent(table_i(table, "mnist", CORE_ROWS, paper=False)),
        **{t: VARIANT_TABLES[t](read_csv(folder / t / f"{t}.csv")) for t in ("ablation", "epochs", "participation")},
        "fedadam": _fedadam_settings(),
        **{f"{name}-cost": _cost(folder, name) for name in PAGE_FOLDERS[1:]},
        "same-cell": _same_cell_table(folder),
    }


CELL_KEY = ("dataset", "split", "method", "variant")  # a run's cell (no variant: "")


def _page_parts(folder: Path) -> None:
    """A ``ConfigError`` of one line where a folder of ``PAGE_FOLDERS`` lacks a file of its preset's report that
    the page reads, or a cell its preset runs (a smoke scale's folder, ``--datasets``, a time budget): the folder,
    what it lacks and the command that runs it there."""
    for name, scale in ((n, n or "small") for n in PAGE_FOLDERS):
        p, d = PRESETS[scale], folder / name
        files = ["results.csv", *((f"{name}.csv", f"{name}.md") if p.variants else ("table.csv", "table.md"))]
        lacks = next((f"no {f}" for f in files + ["gaps.csv"] * bool(p.report_rounds) if not (d / f).is_file()), None)
        have = set() if lacks else {tuple(r.get(k, "") for k in CELL_KEY) for r in read_csv(d / "results.csv")}
        cells = dict.fromkeys(tuple(dict(q.values).get(k, "") for k in CELL_KEY) for q in plan(p, d, (0,), None, None))
        if gone := [] if lacks else [c for c in cells if c not in have]:
            lacks = f"{len(gone)} of its {len(cells)} cells: {', '.join(filter(None, gone[0]))}…"
        if lacks:
            raise ConfigError(
                f"{d}: the page's sections read the {scale} preset's runs, which it lacks ({lacks}); run them with "
                f"`fedweave reproduce fedmim --scale {scale} --out {d}`"
            )


def _page_per_seed(rows: list[dict]) -> str:
    """The small preset's Dir-0.1 Fashion-MNIST finals and best accuracies per seed, FedAvg against FedMIM."""
    by = {(r["method"], r["seed"]): r for r in rows if (r["dataset"], r["split"]) == _CELL}
    seeds = sorted(s for m, s in by if m == "fedmim")

    def acc(method: str, seed: int, key: str) -> str:  # a run that diverged has no final accuracy
        return seed_value(by[(method, seed)][key])

    pairs = ", ".join(f"{acc('fedavg', s, 'final_acc')} → {acc('fedmim', s, 'final_acc')}" for s in seeds)
    best = {m: " / ".join(acc(m, s, "best_acc") for s in seeds) for m in MAIN}
    return (
        f"Per seed at Dir-0.1 (final accuracy, FedAvg → FedMIM): {pairs}.\n"
        f"FedMIM's best accuracy over the evaluated rounds is {best['fedmim']}, against FedAvg's\n{best['fedavg']}.\n"
    )


def _small_cost(folder: Path, results: list[dict]) -> str:
    """The small preset's wall time (its ``table.md``) and CPU cost (the ``cpu_seconds`` of its MNIST runs,
    the runs that recorded it) as the page states them."""
    # its invocation's wall time, and what it says of runs an earlier invocation ran (their time is not in it)
    wall, reused = stated(folder / "table.md", r"Wall time ([\d.]+) min" + REUSED_NOTE)
    cpu = [r["cpu_seconds"] for r in results if r["dataset"] == "mnist"]
    if not cpu:
        raise ConfigError(f"{folder / 'results.csv'} holds no MNIST run: the page's cost is read from its CPU time")
    mean = sum(cpu) / len(cpu)
    small = PRESETS["small"]
    runs, extended = (len(plan(small, Path(), small.seeds, None, None, extend)) for extend in (False, True))
    return (
        f"Runtime: {wall} min wall (`table.md`){reused or ''} on the 2-core machine while it was shared with several "
        "other jobs.\n"
        f"Its cost on idle cores, from the CPU time of the {len(cpu)} MNIST runs that recorded\n"
        f"it ({sum(cpu):.0f} CPU-seconds, {min(cpu):.0f}–{max(cpu):.0f} s per run, {mean:.0f} s on average), is about\n"
        f"{runs * mean / 2 / 60:.0f} minutes for the default preset's {runs} runs on 2 idle cores and about"
        f" {extended * mean / 2 / 60:.0f} minutes\nwith `--extend` ({extended} runs).\n"
    )


def _round50(folder: Path) -> str:
    """How far the ``long`` preset's round-50 accuracies (``long/gaps.csv``) are from the ``small`` preset's
    T = 50 finals (``results.csv``), run by run (``_same_cell``)."""
    runs = _same_cell(folder)
    small, long = runs["`small`"], runs["`long`, round 50"]
    diffs = sorted((abs(x - small[k]), k, x, small[k]) for k, x in long.items() if k in small)
    d, (m, seed), here, there = diffs[-1]
    if d == 0:  # the same configuration, run twice: the same numbers, as it should be
        return (
            f"The round-50 accuracies equal the `small` preset's T = 50 finals in all {len(diffs)} runs (the two\n"
            "presets differ only in the evaluation interval and the horizon).\n"
        )
    return (
        f"The round-50 accuracies differ from the `small` preset's T = 50 finals by up to {d:.2f} points\n"
        f"({LABELS[m]} seed {seed}: {here:.2f} here, {there:.2f} there; {sum(x[0] == 0 for x in diffs)} of"
        f" {len(diffs)} runs equal). The two presets differ only in the evaluation interval and the horizon;\n"
        "why the same configuration differs at round 50 is not established here.\n"
    )


# ---- the study ------------------------------------------------------------------------------------------
def study_plan(opts) -> Plan:
    p = PRESETS[opts.scale]
    seeds = tuple(range(opts.seeds)) if opts.seeds else p.seeds
    known_datasets(opts.datasets or [], "--datasets")
    if opts.extend and not p.extension:  # it was ignored without a word
        with_one = ", ".join(k for k, q in PRESETS.items() if q.extension)
        raise ConfigError(f"--extend: preset {opts.scale!r} has no lower-priority cells; presets with some: {with_one}")
    # a name beyond the preset's datasets replaced none of them and was dropped without a word
    takes, runs = preset_names(p, opts.extend)
    if opts.datasets and len(opts.datasets) > len(takes):
        raise ConfigError(
            f"--datasets: {len(opts.datasets)} names, but preset {opts.scale!r} has {len(takes)} dataset(s) "
            f"({', '.join(takes)}), which the names replace in order; give at most {len(takes)}"
        )
    # a method the preset does not run was dropped too: with none left the report's tables were written empty
    if bad := [m for m in opts.methods or [] if m not in runs]:
        more = [m for m in preset_names(p, extend=True)[1] if m not in runs]
        raise ConfigError(
            f"--methods: preset {opts.scale!r} runs no {', '.join(bad)}; it runs {', '.join(runs)}"
            + (f" (with --extend also {', '.join(more)})" if more else "")
        )
    return Plan(plan(p, Path(opts.out), seeds, opts.datasets, opts.methods, opts.extend), (p, seeds))


def report(records: list[dict], plan_: Plan, opts, wall: float) -> Report:
    """The preset's report files (``report_files``) and its curves."""
    p, seeds = plan_.context
    rows = variant_summary(records, p) if p.variants else summarize(records)[0]
    gap_rows = gaps(Path(opts.out), p, seeds) if p.report_rounds else None
    files = report_files(records, rows, opts.scale, p, wall, plan_.skipped, gap_rows, plan_.reused_note())
    show = f"{opts.scale}.md" if p.variants else "table.md"
    return Report(files, show=show, figures=lambda out: plot(records, p, opts.scale, out))


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
