"""Reproduce ZO-HFL's Table I and Fig. 2 (Qiu, Kim, Yousefian, 2025) at a chosen scale (spec zo-hfl §9).

The presets (``--tune`` searches lambda and mu on a validation split, spec A1), the paper's Table I, the tables'
layouts (a preset's ``table.md`` holds the page's sections of that preset) and the claims C1-C4 of spec §9.2, each
judged by its declared rule on the per-seed records; what each scale runs is on docs/reproductions/zo-hfl.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from functools import partial
from itertools import product
from operator import itemgetter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from fedweave.config import ConfigError
from fedweave.experiments.aggregate import group, mean_of, per_cell, std_of
from fedweave.experiments.blocks import verdict_cell
from fedweave.experiments.grid import Point
from fedweave.experiments.jobs import cache_datasets as _cache_datasets
from fedweave.experiments.jobs import load_average
from fedweave.experiments.pages import REUSED_NOTE, paragraph, stated
from fedweave.experiments.plots import Panel, plot_panels, seed_lines
from fedweave.experiments.study import Claim, Json, Plan, Report, Rows, Study, Verdict, judge, not_run, option
from fedweave.experiments.tables import Col, Grid, csv_text, layout, markdown_table, parse_csv, pm_cell, read_csv
from fedweave.experiments.verdicts import All, Paired, Rule, Select, Untestable, cell, detectable, paired_power
from fedweave.memory import cpu_seconds
from fedweave.runner import Result

SETTINGS = [(1000.0, 0.9), (1.0, 0.5), (0.1, 0.1)]  # (Dirichlet alpha, participation beta), paper §IV
HOMO, MID, EXTREME = SETTINGS
SETTING_NAMES = {s: f"a={s[0]:g}, b={round(100 * s[1])}%" for s in SETTINGS}
BASELINES = ("fedavg", "fedprox", "scaffold")
METHODS = [*BASELINES, "zo_hfl", "server_only"]
FAST_SERVER_LR = 0.1  # sensitivity: a 10x larger server step than the paper's gamma_0 = 0.01
CONSTANT_LR = 0.05  # spec §9.2 sensitivity run
# Sensitivity variants of the baselines (spec §9.2, A11): a constant local step (more client drift) and
# the compute-matched 2 H_{i,r} local steps (ZO-HFL's two solves per round).
VARIANTS = {"const": f"constant local lr {CONSTANT_LR:g}", "2h": "2H local steps"}
LABELS = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "zo_hfl": "ZO-HFL",
    "server_only": "server-only (lambda=0)",
    "fedavg_server": "FedAvg + server as client",
    "zo_hfl_nocrn": "ZO-HFL, `crn: false`",  # independent +/- batches (spec A5)
    "zo_hfl_fast": f"ZO-HFL, gamma_0 = {FAST_SERVER_LR:g} (not the paper's)",
    "server_only_fast": f"server-only, gamma_0 = {FAST_SERVER_LR:g} (not the paper's)",
}
DATASET_LABELS = {"mnist": "MNIST", "fashion_mnist": "Fa.-MNIST", "cifar10": "CIFAR-10", "adult": "Adult"}

# Table I of the paper, test accuracy (%) of the global model (spec §6.1, verbatim).
PAPER_TABLE = {
    m: dict(zip(("mnist", "fashion_mnist", "cifar10"), cols))
    for m, cols in {  # per dataset: the three settings of SETTINGS
        "fedavg": ((87.17, 77.33, 39.19), (77.52, 59.64, 45.50), (68.36, 37.20, 27.43)),
        "fedprox": ((86.90, 75.61, 45.15), (77.34, 60.28, 49.44), (67.52, 38.55, 29.03)),
        "scaffold": ((91.54, 91.25, 87.36), (82.25, 83.48, 74.91), (72.36, 50.41, 44.65)),
        "zo_hfl": ((90.82, 88.44, 87.70), (78.51, 85.51, 76.86), (68.12, 58.06, 52.51)),
    }.items()
}


@dataclass(frozen=True)
class Sweep:
    """The tau sweep of Fig. 2: its datasets, taus, rounds and how many of the seeds it uses."""

    datasets: tuple[str, ...]
    taus: tuple[float, ...]
    rounds: int
    seeds: int


@dataclass
class Preset:
    """What a scale runs: Table I's runs (``datasets``, ``rounds``, ``tau``, ``batch_size``, ``eval_every``), the
    tau sweep (Fig. 2) and the rows the scale adds."""

    datasets: list[str]
    rounds: int  # Table I runs
    tau: float  # Table I tau
    batch_size: int
    eval_every: int
    sweep: Sweep = Sweep((), (), 0, 0)  # none: no sweep
    server_batch_size: int = 0  # 0: batch_size
    # lambda and mu: the small preset's validation-tuned values (docs/reproductions/zo-hfl/tune.md; spec A1)
    lam: float = 1.0
    mu: float = 0.01
    min_size: int = 10
    extra_lams: tuple[float, ...] = ()  # lambda sensitivity: extra ZO-HFL rows
    long_server_only: int | None = None  # also run the (cheap) server-only control for this many rounds
    server_as_client: bool = False  # also run FedAvg with the server's share as an extra client (A12 control)
    server_lr: float = 0.01  # gamma_0 (paper §IV)
    table_eval_every: int = 0  # evaluation interval of the Table I runs (0: eval_every)
    sensitivity: tuple[str, ...] = ()  # extra rows: "<baseline>_const", "<baseline>_2h", ...
    sensitivity_seeds: int = 3
    power: bool = False  # its report and page show what the paired test could find (power_table)
    # ``--tune``: the grid of spec A1, scored by validation accuracy (10% of the training set held out)
    tune_lams: tuple[float, ...] = (0.0, 0.1, 1.0, 10.0, 100.0)
    tune_mus: tuple[float, ...] = (0.01, 0.1, 1.0)
    tune_server_lrs: tuple[float, ...] = (0.01,)

    def __post_init__(self) -> None:
        self.server_batch_size = self.server_batch_size or self.batch_size

    @property
    def methods(self) -> list[str]:
        extra = [f"zo_hfl_lam{lam:g}" for lam in self.extra_lams] + ["fedavg_server"] * self.server_as_client
        return METHODS + extra + ["server_only_long"] * bool(self.long_server_only) + list(self.sensitivity)

    @property
    def sweep_taus(self) -> tuple[float, ...]:
        return self.sweep.taus

    def seeds_of(self, method: str, seeds: list[int]) -> list[int]:
        return seeds[: self.sensitivity_seeds] if method in self.sensitivity else seeds

    def rounds_of(self, method: str) -> int:
        return self.long_server_only if method == "server_only_long" else self.rounds


def label(m: str) -> str:
    """A method's line in the plots and its row in the sensitivity table."""
    base, _, variant = m.partition("_")
    if variant in VARIANTS:
        return f"{LABELS[base]}, {VARIANTS[variant]}"
    return LABELS.get(m) or f"ZO-HFL (lambda={m.removeprefix('zo_hfl_lam')})"


SENSITIVITY = (*(f"{m}_{v}" for v in VARIANTS for m in BASELINES), "zo_hfl_nocrn", "zo_hfl_fast", "server_only_fast")
TAUS = (5, 20, 50)  # the sweep's taus
PRESETS = {
    # lambda = 10, mu = 0.1: the spec's untuned values (A1)
    "smoke": Preset(["digits"], 2, 1, 16, 1, Sweep(("digits",), (1, 2), 2, 1), lam=10.0, mu=0.1, min_size=5),
    # lambda = 10: the spec's untuned scaled-run value; 30: its lambda sensitivity row (§9.2)
    "small": Preset(
        ["mnist", "fashion_mnist"],
        rounds=40,
        tau=5,
        batch_size=32,
        eval_every=2,
        sweep=Sweep(("fashion_mnist",), TAUS, 20, 5),  # seeds up to 5 (--seeds 5): 3 left C3 undecided
        extra_lams=(10.0, 30.0),
        table_eval_every=4,
        long_server_only=500,
        server_as_client=True,
        sensitivity=SENSITIVITY,
        sensitivity_seeds=5,
    ),
    # The smallest setting where Lemma 4 says the zeroth-order term should pay: its estimator's variance
    # grows with d, so the check uses logistic regression on UCI Adult (121 binary features, 2 classes:
    # d = 242 instead of MNIST's 7,840), the paper's three heterogeneity settings and server share.
    # lambda, mu and gamma_0 chosen by --tune on a validation split (docs/reproductions/zo-hfl/adult/tune.md):
    # at the paper's gamma_0 = 0.01 no setting leaves the majority class (76.55 %) in 100 rounds.
    "adult": Preset(
        ["adult"], 100, 5, 32, 2, table_eval_every=4, server_lr=1.0, tune_server_lrs=(0.01, 0.1, 1.0), power=True
    ),
    # Table I with the paper's tau = 20 and batch 64 on MNIST / Fashion-MNIST, over the longest horizon the CPU
    # allowed (its cost: the page's generated `long-cost` section). lambda and mu are the small preset's
    # validation-tuned values, fixed before these runs; the lambda = 10 row is the spec's untuned value.
    "long": Preset(["mnist", "fashion_mnist"], 100, 20, 64, 5, extra_lams=(10.0,)),
    # `--scale paper --tune` repeats the search of lambda and mu at this scale (the same grid on a validation
    # split), but costs about one and a half times a three-seed table (117 ZO-HFL runs of 500 rounds, as many runs
    # as the table's but each ZO-HFL's, the costlier kind), so the preset does not depend on it.
    "paper": Preset(
        ["mnist", "fashion_mnist", "cifar10"], 500, 20, 64, 5, Sweep(("fashion_mnist", "cifar10"), TAUS, 500, 3)
    ),
}
RAW = ("mnist", "fashion_mnist", "cifar10")  # the image datasets, read without normalization (pixels in [0, 1])


def run_config(
    p: Preset,
    dataset: str,
    setting: tuple[float, float],
    method: str,
    seed: int,
    tau: float,
    rounds: int,
    out: Path,
    *,
    overrides: dict[str, Any] | None = None,
    tag: str = "",
) -> dict[str, Any]:
    """The config of one run (spec §9.2/§9.3: pooled 90/10 split, 30% server share, Dir(alpha) clients). The
    server-only control contacts no client, so alpha and beta do not change it: one run serves all three columns
    (the split, the server's share and its batches come from streams independent of both)."""
    alpha, beta = SETTINGS[0] if method.startswith("server_only") else setting
    base = method.partition("_")[0]
    algo: dict[str, Any] = {"name": f"hier_{base}" if base in BASELINES else "zo_hfl", "participation": beta}
    algo |= {"tau": tau, "test_fraction": 0.1, "server_share": 0.3}
    local = {"batch_size": p.batch_size, "lr": 0.1}  # gamma~_{i,t} = 0.1 / (t + 1) (paper §IV)
    if algo["name"] == "zo_hfl":
        lam = float(method.removeprefix("zo_hfl_lam")) if method.startswith("zo_hfl_lam") else p.lam
        lam = 0.0 if method.startswith("server_only") else lam
        algo |= {"lam": lam, "mu": p.mu, "server_batch_size": p.server_batch_size}
        algo["server_lr"] = FAST_SERVER_LR if method.endswith("_fast") else p.server_lr
        if method == "zo_hfl_nocrn":
            algo["crn"] = False  # spec A5 literal reading
    if method.startswith("fedprox"):
        algo["mu"] = p.mu  # mu_p = mu (spec §5)
    if method == "fedavg_server":
        algo["server_data"] = "client"
    if method.endswith("_const"):
        algo["local_schedule"] = "constant"
        local["lr"] = CONSTANT_LR
    if method.endswith("_2h"):
        algo["steps_factor"] = 2
    algo.update(overrides or {})
    name = f"{dataset}-a{alpha:g}-b{beta:g}-{method}-tau{tau:g}-R{rounds}-s{seed}{tag}"
    table_run = rounds == p.rounds and tau == p.tau
    every = (p.table_eval_every or p.eval_every) if table_run else p.eval_every
    return {
        "name": name,
        "seed": seed,
        "rounds": rounds,
        "backend": "vmap",  # closed-form batched gradients: faster than the loop, or within 10% for 1 job
        "threads": 1,
        "dataset": {"name": dataset, **({"normalize": False} if dataset in RAW else {})},
        "partition": {"name": "dirichlet", "num_clients": 10, "alpha": alpha, "min_size": p.min_size},
        "model": {"name": "logistic", "bias": False, "init": "zeros"},  # x^_0 = 0, x in R^{n x C} (A8, A16)
        "algorithm": algo,
        "local": local,
        "eval": {"every": max(every, rounds // 50), "batch_size": 8192},
        "output": {"dir": str(out / "runs" / name), "plots": False, "progress": False},
    }


def record(pt: Point, res: Result, plan: Plan) -> dict[str, Any]:
    """A run's metric rows, status, wall and CPU seconds, and whether an earlier invocation ran it."""
    # a run that diverged before any evaluation keeps a NaN row; the table marks it
    rows = res.metrics or [{"round": 0, "test_accuracy": float("nan"), "global_loss": float("nan")}]
    return {
        "name": pt.slug,
        "rows": rows,
        "status": res.summary["status"],
        "seconds": float(res.summary["wall_seconds"]),
        "cpu": float(res.summary.get("cpu_seconds") or 0.0),
        "reused": pt.slug in plan.reused,
    }


# ---- the per-seed records --------------------------------------------------------------------------------


def _final(res: dict[str, Any], key: str = "test_accuracy") -> float:
    return float(res["rows"][-1][key])


def _last10(res: dict[str, Any], rounds: int) -> float:
    return float(np.mean([r["test_accuracy"] for r in res["rows"] if r["round"] > rounds - 10]))


# the per-seed records (``results.csv``): one row per run and the column it stands for (the server-only
# control, one run, once per setting); ``part`` is "table" for Table I's runs, "sweep" for the tau sweep's
SEED_COLUMNS = ["dataset", "alpha", "beta", "method", "part", "tau", "rounds", "seed", "acc", "acc_last10"]
SEED_COLUMNS += ["test_loss", "global_loss", "status"]


def units(p: Preset, seeds: list[int]):
    """Every run of Table I, then of the tau sweep, as (dataset, setting, method, part, tau, rounds, seed)."""
    for ds, s, m in product(p.datasets, SETTINGS, p.methods):
        yield from ((ds, s, m, "table", p.tau, p.rounds_of(m), k) for k in p.seeds_of(m, seeds))
    for ds, s, seed, tau in product(p.sweep.datasets, SETTINGS, range(p.sweep.seeds), p.sweep.taus):
        yield ds, s, "zo_hfl", "sweep", tau, p.sweep.rounds, seed


def seed_rows(p: Preset, results: dict[str, dict[str, Any]], seeds: list[int], out: Path) -> list[dict[str, Any]]:
    """The per-seed records the claims' declared rules read: final test accuracy (%) and its mean over the last
    10 rounds, and the final test and global loss, of every Table I run and every tau-sweep run."""
    rows = []
    for ds, s, m, part, tau, rounds, seed in units(p, seeds):
        if (r := results.get(run_config(p, ds, s, m, seed, tau, rounds, out)["name"])) is None:
            continue  # not run: the time budget ran out (``plan.skipped``); its rules pair the seeds that ran
        losses = [float(r["rows"][-1].get(k, float("nan"))) for k in ("test_loss", "global_loss")]
        values = [ds, *s, m, part, tau, rounds, seed, 100 * _final(r), 100 * _last10(r, rounds), *losses, r["status"]]
        # ``_rows``: the run's metric rows, for the plots
        rows.append({**dict(zip(SEED_COLUMNS, values)), "seconds": r["seconds"], "cpu": r["cpu"], "_rows": r["rows"]})
    return rows


def paper_acc(r: dict[str, Any]) -> float | None:
    """The paper's Table I number of a record's cell, or None where the paper has none."""
    paper = PAPER_TABLE.get(r["method"], {}).get(r["dataset"])
    return paper[SETTINGS.index((r["alpha"], r["beta"]))] if paper else None


def _finished(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of runs that did not diverge (a diverged run's accuracy is its last before diverging)."""
    return [r for r in records if r["status"] != "diverged"]


TABLE_STATS = {  # table.csv's columns per cell (dataset, setting, method) over its finished seeds (population std)
    "acc_mean": mean_of("acc", _finished, ddof=0, nd=2),
    "acc_std": std_of("acc", _finished, ddof=0, nd=2),
    "acc_last10_mean": mean_of("acc_last10", _finished, ddof=0, nd=2),
    "paper_acc": lambda rs: paper_acc(rs[0]),
    "seeds": len,
    "seconds_mean": mean_of("seconds", nd=1),
    "cpu_seconds_mean": mean_of("cpu", nd=2),
    "diverged": lambda rs: sum(r["status"] == "diverged" for r in rs),
}
CELL = ("dataset", "alpha", "beta", "method")


def fig2_means(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Fig. 2's final global and test loss per tau-sweep dataset, setting and tau: the means over the sweep's
    seeds that did not diverge, to 5 decimals (``claims.json``'s ``fig2``, from the runs' full-precision values;
    None where every seed diverged), and under ``diverged``, where any did, how many of how many."""
    out: dict[str, Any] = {}
    sweep = [r for r in records if r["part"] == "sweep"]
    for (ds, a, b, tau), rs in group(sweep, itemgetter(*CELL[:3], "tau")).items():
        setting, done = SETTING_NAMES[(a, b)], _finished(rs)
        for key in ("global_loss", "test_loss"):
            per = out.setdefault(ds, {}).setdefault(key, {}).setdefault(setting, {})
            per[f"{tau:g}"] = round(float(np.mean([r[key] for r in done])), 5) if done else None
        if len(done) < len(rs):
            out[ds].setdefault("diverged", {}).setdefault(setting, {})[f"{tau:g}"] = [len(rs) - len(done), len(rs)]
    return out


# ---- the claims of spec §9.2, each by its declared rule --------------------------------------------------
# A rule reads one dataset's per-seed records (``results.csv``): final test accuracy (points) or final loss,
# paired by seed (the same seed gives the same split, server share and initialisation to every method), 95 %
# paired t (3 seeds: too few for a percentile bootstrap). Fewer than 2 seeds: untestable.
NO_SEEDS = Untestable("fewer than 2 seeds, no paired test")
LEFT_OUT = All(())  # no comparison: the claim is left out (a dataset without a tau sweep has no C3)
C2_MARGIN = 5.0  # C2's "within 5 points of the best baseline" (spec §9.2)


def at(m: str, s: tuple[float, float], part: str = "table", **more: Any) -> Select:
    """The per-seed records of method ``m`` in setting ``s`` (of Table I, or of the tau sweep)."""
    return cell(method=m, alpha=s[0], beta=s[1], part=part, **more)


def drop(m: str) -> Select:
    """Method ``m``'s drop in final accuracy from (1000, 90%) to (0.1, 10%), per seed."""
    return at(m, HOMO) - at(m, EXTREME)


def _diverged(r: dict[str, Any]) -> str | None:
    """Why a run's record is no pair of a claim's rule: it diverged (``Paired.no_pair``)."""
    return "diverged" if r["status"] == "diverged" else None


def _acc(a: Select, b: Select, direction: str = "greater", min_effect: float = 0.0) -> Paired:
    return Paired("acc", a, b, direction, min_effect, no_pair=_diverged)


def _accs(records, m: str, s: tuple[float, float]) -> list[float]:
    """Method ``m``'s final accuracies in setting ``s``, of its runs that did not diverge."""
    return list(at(m, s).values(_finished(records), "acc").values())


C1_RULE = All(
    (
        ("ZO-HFL - FedAvg at (0.1, 10%)", _acc(at("zo_hfl", EXTREME), at("fedavg", EXTREME))),
        ("ZO-HFL - FedProx at (0.1, 10%)", _acc(at("zo_hfl", EXTREME), at("fedprox", EXTREME))),
        ("half FedAvg's drop - ZO-HFL's drop", _acc(drop("fedavg") * 0.5, drop("zo_hfl"))),
    )
)


def _c2_rule(records) -> All:
    """Against the baseline with the best mean final accuracy at (1000, 90%)."""
    best = max(BASELINES, key=lambda m: np.mean(a) if (a := _accs(records, m, HOMO)) else -np.inf)
    rule = _acc(at("zo_hfl", HOMO), at(best, HOMO) - C2_MARGIN)
    return All(((f"ZO-HFL - ({label(best)} - {C2_MARGIN:g}) at (1000, 90%)", rule),))


def _c3_rule(key: str, moderate: bool):
    """C3 on the tau sweep's final ``key``: each larger tau lowers it at (1000, 90%) and (1, 50%) (every step
    of the sweep's taus, paired by seed), or, at (0.1, 10%), the largest tau's is not below the smallest's."""

    def step(s: tuple[float, float], a: float, b: float) -> tuple[str, Paired]:
        sweep = lambda tau: at("zo_hfl", s, "sweep", tau=tau)  # noqa: E731
        rule = Paired(key, sweep(a), sweep(b), unit="", digits=5, no_pair=_diverged)
        return f"{SETTING_NAMES[s]}: tau {a:g} - tau {b:g}", rule

    def rule(records):
        taus = sorted({r["tau"] for r in records if r["part"] == "sweep"})
        if moderate:
            return All(step(s, a, b) for s in (HOMO, MID) for a, b in zip(taus, taus[1:]))
        return All((step(EXTREME, taus[-1], taus[0]),))

    return rule


def _c4_rule(records) -> All:
    """Within one std in every setting: the larger of the two methods' seed std (population) there."""
    std = lambda m, s: float(np.std(a)) if (a := _accs(records, m, s)) else 0.0  # noqa: E731 (none: all diverged)
    bound = {s: max(std("zo_hfl", s), std("server_only", s), 0.01) for s in SETTINGS}
    rule = lambda s: _acc(at("zo_hfl", s), at("server_only", s), "within", bound[s])  # noqa: E731
    return All((SETTING_NAMES[s], rule(s)) for s in SETTINGS)  # each part names its bound (``All``)


def claim(text: str, rule, part: str = "table") -> Claim:
    """A claim of spec §9.2 on one dataset's per-seed records (its name, the context, is ``{name}`` in
    ``text``): ``rule(records)`` declares its rule on the records of ``part``; left out where the dataset has
    none of them, untestable with fewer than 2 seeds."""

    def declared(records, _) -> Rule:
        seeds = {r["seed"] for r in records if r["part"] == part}
        return LEFT_OUT if not seeds else rule(records) if len(seeds) >= 2 else NO_SEEDS

    return Claim(lambda records, name: text.format(name=name), None, declared=declared)


C3 = "C3 {name}: a larger tau lowers the final {what} at (1000, 90%) and (1, 50%)"
C3_EXTREME = "C3 {name}: no monotone gain from a larger tau at (0.1, 10%) ({what})"
CLAIMS = [
    claim(
        "C1 {name}: robust under extreme heterogeneity (at (0.1, 10%) at least FedAvg's and FedProx's accuracy, "
        "and at most half of FedAvg's drop from (1000, 90%))",
        lambda records: C1_RULE,
    ),
    claim("C2 {name}: competitive when homogeneous (within 5 points of the best baseline at (1000, 90%))", _c2_rule),
    *(
        claim(text.replace("{what}", key.replace("_", " ")), _c3_rule(key, moderate), "sweep")
        for key in ("test_loss", "global_loss")
        for text, moderate in ((C3, True), (C3_EXTREME, False))
    ),
    claim("C4 {name}: ZO-HFL within one std of the server-only control (lambda = 0) in every setting", _c4_rule),
]


def verdicts(records: list[dict[str, Any]]) -> list[Verdict]:
    """The claims' verdicts by their declared rules on each dataset of the per-seed ``records``; a diverged run
    is no pair (``_diverged``): its seed leaves every comparison it is a side of."""
    by = group(records, itemgetter("dataset"))
    return [v for ds, rs in by.items() for v in judge(CLAIMS, rs, DATASET_LABELS.get(ds, ds))]


# ---- the tables: a preset's report and the page's sections, one renderer --------------------------------
# the claims' table: per (records file, verdict), the claim, the file and its declared rule's verdict
CLAIM_COLS = [Col("claim", lambda sv: sv[1].claim), Col("source", lambda sv: f"`{sv[0]}`")]
CLAIM_COLS += [Col("verdict (declared rule)", lambda sv: verdict_cell(sv[1]))]


def table1(p: Preset, rows: list[dict], dataset: str) -> str:
    """Table I of one dataset from ``table.csv``'s rows: per method that ran (the sensitivity rows apart) and
    setting, mean ± std [the mean of the last 10 rounds] / the paper's number (the long control: mean ± std)."""

    def cell(r: dict) -> str:
        shown = r["method"] != "server_only_long" and r["seeds"] > r["diverged"]  # every seed diverged: no mean
        last = f" [{r['acc_last10_mean']:.2f}]" if shown else ""
        paper = "" if r["paper_acc"] is None else f" / {r['paper_acc']:.2f}"
        return f"{pm_cell(r, 'acc')}{last}{paper}"

    special = {"zo_hfl": f"ZO-HFL (lambda = {p.lam:g}, mu = {p.mu:g})", "server_only": "server-only (lambda = 0)"}
    special["server_only_long"] = f"server-only, {p.long_server_only} rounds"
    lam = lambda m: f"ZO-HFL (lambda = {m.removeprefix('zo_hfl_lam')})"  # noqa: E731
    labels = {m: special.get(m) or LABELS.get(m) or lam(m) for m in p.methods if m not in p.sensitivity}
    head = lambda s: f"alpha={s[0]:g}, beta={100 * s[1]:.0f}%"  # noqa: E731
    grid = Grid("method", "method", labels, itemgetter("alpha", "beta"), head, cell)
    return grid.render([r for r in rows if r["dataset"] == dataset])


def sensitivity(rows: list[dict]) -> str:
    """The sensitivity rows of ``table.csv`` (spec §9.2, A5, A11): mean ± std per dataset and setting."""
    labels = {m: label(m) for m in SENSITIVITY}
    head = lambda c: f"{DATASET_LABELS[c[0]]} {c[1]:g}/{100 * c[2]:.0f}%"  # noqa: E731
    return Grid("method", "method", labels, itemgetter(*CELL[:3]), head, partial(pm_cell, key="acc")).render(rows)


def fig2(losses: dict[str, Any]) -> str:
    """Fig. 2's final global and test loss of one dataset per setting and tau (``fig2_means``)."""
    glob, test, diverged = losses["global_loss"], losses["test_loss"], losses.get("diverged", {})
    # every tau of any setting, each cell in that order: a setting whose run of a tau the time budget left unrun
    # shows "–" there, not its other taus' values shifted under the wrong tau
    order = sorted({t for per in test.values() for t in per}, key=float)
    taus = " / ".join(order)

    def value(s: str, per: dict[str, float | None], t: str, f: str) -> str:
        if t not in per:
            return "–"
        bad, n = diverged.get(s, {}).get(t, (0, 0))
        if per[t] is None:
            return f"diverged ({bad}/{n})"
        return f"{per[t]:{f}}" + (f" ({bad}/{n} diverged)" if bad else "")

    def cells(s: str, per: dict[str, float | None], f: str) -> str:
        return " / ".join(value(s, per, t, f) for t in order)

    cols = [
        Col("setting", lambda s: s.replace("a=", "alpha=").replace("b=", "beta=")),
        Col(f"global loss, tau = {taus}", lambda s: cells(s, glob[s], ".4f")),
        Col(f"test loss, tau = {taus}", lambda s: cells(s, test[s], ".5f")),
    ]
    return layout(cols, list(test))


def power_table(records: list[dict]) -> str:
    """How much room one dataset's check left the zeroth-order term (the best baseline's mean final accuracy
    above the server-only control's at (1000, 90%)) and what the paired test at its seeds could find: per
    setting, the seed std of the paired differences ZO-HFL - server-only, the difference detected with 80 %
    power by the 95 % paired t, and the power against a gain as large as that room."""
    table = _finished([r for r in records if r["part"] == "table"])  # a diverged run: no accuracy to pair
    mean = lambda m: float(np.mean(_accs(table, m, HOMO)))  # noqa: E731
    ran = [m for m in BASELINES if _accs(table, m, HOMO)]
    if not ran or not _accs(table, "server_only", HOMO):  # every run of a side diverged: no room to measure
        return "Room: not measured (at (1000, 90%) the server-only control's runs, or every baseline's, diverged).\n"
    best = max(ran, key=mean)
    room = mean(best) - mean("server_only")
    diffs = {s: list((at("zo_hfl", s) - at("server_only", s)).values(table, "acc").values()) for s in SETTINGS}
    # one paired difference (--seeds 1, or a time budget that left one seed) has no std: no test, no power ("—")
    sd = lambda s: float(np.std(diffs[s], ddof=1)) if len(diffs[s]) >= 2 else None  # noqa: E731
    cols = [
        Col("setting", SETTING_NAMES.get),
        Col("seeds", lambda s: len(diffs[s])),
        Col("ZO-HFL - server-only", lambda s: np.mean(diffs[s]) if diffs[s] else None, "+.2f"),
        Col("std of the paired differences", sd, ".2f"),
        Col("difference found with 80 % power", lambda s: detectable(sd(s), len(diffs[s])), ".2f"),
        Col(f"power against a gain of {room:.2f}", lambda s: paired_power(room, sd(s), len(diffs[s])), ".2f"),
    ]
    return (
        f"Room: the best baseline ({label(best)}) ends {room:.2f} points above the server-only control at "
        f"(1000, 90%)\n(the control's seed std: {np.std(_accs(table, 'server_only', HOMO)):.2f} points), so a "
        "zeroth-order term that closed the whole gap would gain that much.\n\n" + layout(cols, SETTINGS)
    )


def preset_sections(p: Preset, records: list[dict], table: list[dict], losses: dict[str, Any]) -> dict[str, str]:
    """A preset's tables by name (its ``table.md``'s and the page's blocks): Table I per dataset, the sensitivity
    rows, Fig. 2's final losses per sweep dataset and (``Preset.power``) the paired test's power."""
    datasets = list(dict.fromkeys(r["dataset"] for r in table))
    out = {f"table1-{ds}": table1(p, table, ds) for ds in datasets}
    out |= {"sensitivity": sensitivity(table)} if p.sensitivity else {}
    out |= {f"fig2-{ds}": fig2(v) for ds, v in losses.items()}
    return out | (
        {f"power-{ds}": power_table([r for r in records if r["dataset"] == ds]) for ds in datasets} if p.power else {}
    )


HEADINGS = {"table1": "Table I", "sensitivity": "Sensitivity rows (spec §9.2, A5, A11)"}
HEADINGS |= {"fig2": "Fig. 2, final losses (means over the sweep's seeds)", "power": "What the paired test could find"}


def table_md(p: Preset, parts: dict[str, str], claims: str, meta: dict) -> str:
    """``table.md``: the preset's settings, its tables (``preset_sections``), the claims and the invocation's cost."""
    # where a time budget left runs unrun: how many of the seeds asked finished every Table I run
    asked = f" asked, {meta['seeds_run']} with every Table I run finished" if "seeds_run" in meta else ""
    lines = [
        "# ZO-HFL Table I at our scale, beside the paper's",
        "",
        f"Scale `{meta['scale']}`: {meta['rounds']} rounds, tau = {p.tau:g} (paper: 500 rounds, tau = 20), "
        f"{meta['seeds']} seed(s){asked}, lambda = {p.lam:g}, mu = {p.mu:g}, eta = 0.1, "
        f"gamma_r = {p.server_lr:g}/sqrt(r+1), "
        f"local 0.1/(t+1), batch {p.batch_size}. Table I's cells: final test accuracy % of the global model, mean "
        "± std over seeds [mean over the last 10 rounds] / the paper's.",
        "",
    ]
    for name, body in parts.items():
        kind, _, ds = name.partition("-")
        lines += [f"## {HEADINGS[kind]}" + (f": {DATASET_LABELS.get(ds, ds)}" if ds else ""), "", body]
    lines += ["## Claims (spec §9.2)", "", claims]
    lines += [
        f"Wall time of this invocation: {meta['wall_seconds']:.0f} s with {meta['workers']} worker process(es); "
        f"CPU time of this invocation (workers, their start-up and data loading included): "
        f"{meta['cpu_seconds']:.0f} s; sum of the {meta['runs']} runs' own CPU times "
        f"{sum(meta['run_cpu_seconds'].values()):.0f} s and wall times {sum(meta['run_seconds'].values()):.0f} s "
        f"({meta['reused']} runs reused from an earlier invocation, counted with their original time); "
        f"load average at the end {meta['load_at_end']}.",
        "",
    ]
    return "\n".join(lines)


def preset_report(p: Preset, records: list[dict], table: list[dict], losses: dict[str, Any], meta: dict) -> Report:
    """A preset's report files: ``table.csv`` (``table``, Table I's cells), ``table.md`` and ``claims.json`` (the
    claims' verdicts by their declared rules on the per-seed ``records``, Fig. 2's final losses, the meta)."""
    got = verdicts(records)
    claim_table = layout(CLAIM_COLS, [("results.csv", v) for v in got])
    md = table_md(p, preset_sections(p, records, table, losses), claim_table, meta)
    claims = [{"claim": v.claim, "verdict": v.outcome, "rule": v.interval} for v in got]
    files = {"table.csv": Rows(table), "table.md": md}
    return Report(files | {"claims.json": Json({"claims": claims, "fig2": losses, "meta": meta})}, show="table.md")


def committed(folder: Path, scale: str) -> tuple:
    """A preset's committed files in ``folder``: its preset, per-seed records, Table I's cells, Fig. 2's final
    losses and the invocation's meta (what ``preset_report`` takes)."""
    saved = json.loads((folder / "claims.json").read_text(encoding="utf-8"))
    return PRESETS[scale], *(read_csv(folder / f) for f in ("results.csv", "table.csv")), saved["fig2"], saved["meta"]


def rebuild(folder: Path, scale: str) -> Report:
    """A preset's report files rebuilt from its committed ones in ``folder``, without running."""
    return preset_report(*committed(folder, scale))


def write_plots(p: Preset, records: list[dict[str, Any]], out: Path) -> None:
    """Fig. 2 (global loss and test cross-entropy against rounds per tau) and test accuracy against rounds per
    method, one panel per setting; the mean over the seeds' records (``seed_rows``) with a band."""

    def panel(ds: str, s: tuple[float, float], part: str, lines, y: str, **kwargs: Any) -> Panel:
        rs = [r for r in records if (r["dataset"], r["alpha"], r["beta"], r["part"]) == (ds, *s, part)]
        title = f"{DATASET_LABELS.get(ds, ds)} ({SETTING_NAMES[s]})"
        return Panel(lines(rs), y, title=title, xlabel="round", **kwargs)

    taus = lambda rs: seed_lines(rs, "tau", label=lambda t: f"tau={t:g}")  # noqa: E731
    for ds in p.sweep.datasets:
        fig = [
            [panel(ds, s, "sweep", taus, metric, ylabel=ylabel) for s in SETTINGS]
            for metric, ylabel in (("global_loss", "global loss f1 + f2"), ("test_loss", "test loss"))
        ]
        plot_panels(fig, out / f"fig2_{ds}.png", panel_size=(4.2, 3.2), dpi=80)
    order = [m for m in p.methods if p.rounds_of(m) == p.rounds and m not in p.sensitivity]
    methods = lambda rs: seed_lines(rs, "method", order, label)  # noqa: E731
    for ds in p.datasets:
        first = {"ylabel": "test accuracy", "legend": {"fontsize": 7}}
        panels = [
            panel(ds, s, "table", methods, "test_accuracy", **(first if j == 0 else {"ylabel": None, "legend": None}))
            for j, s in enumerate(SETTINGS)
        ]
        plot_panels([panels], out / f"accuracy_{ds}.png", panel_size=(4.2, 3.4), sharey=True, dpi=80)


# ---- planning --------------------------------------------------------------------------------------------


def plan(p: Preset, seeds: list[int], out: Path) -> list[dict[str, Any]]:
    """Table I's runs (dataset, setting, method, seed), then the tau sweep's (a run both need runs once)."""
    configs = [run_config(p, ds, s, m, seed, tau, R, out) for ds, s, m, _, tau, R, seed in units(p, seeds)]
    return order(list({c["name"]: c for c in configs}.values()))


def order(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of one (dataset, seed) together, so a worker re-splits the data rarely (the split is cached per
    process); within a group the longest first (local steps x participants), so the workers finish together."""
    cost = lambda c: c["algorithm"]["tau"] * c["rounds"] ** 1.5 * c["algorithm"]["participation"]  # noqa: E731
    return sorted(configs, key=lambda c: (c["dataset"]["name"], c["seed"], -cost(c)))


# ---- tuning lambda and mu on a validation split (spec A1) -----------------------------------------------


def tune_configs(p: Preset, seeds: list[int], out: Path) -> list[dict[str, Any]]:
    """ZO-HFL over the (lambda, mu, gamma_0) grid on every dataset and setting; scored on a validation set
    held out of the training set (10%), so the test set is not looked at. lambda = 0 ignores mu (one run)."""
    configs = {}
    for ds, s, seed, lam in product(p.datasets, SETTINGS, seeds, p.tune_lams):
        for mu, g in product(p.tune_mus if lam > 0 else p.tune_mus[:1], p.tune_server_lrs):
            over, tag = {"lam": lam, "mu": mu, "server_lr": g, "validation": 0.1}, f"-lam{lam:g}-mu{mu:g}-g{g:g}-val"
            c = run_config(p, ds, s, "zo_hfl", seed, p.tau, p.rounds, out, overrides=over, tag=tag)
            configs[c["name"]] = c
    return order(list(configs.values()))


def tune_summary(configs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (lambda, mu, gamma_0): final validation accuracy per dataset and setting (the mean over the seeds that
    finished; None where none did: every run diverged, or the time budget left them unrun) and overall (None
    unless every cell has one: such a row is ranked last, not on the cells it has)."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for c in configs:
        a = c["algorithm"]
        key = (a["lam"], a["mu"] if a["lam"] > 0 else "-", a["server_lr"])
        col = f"{c['dataset']['name']} {SETTING_NAMES[(c['partition']['alpha'], a['participation'])]}"
        got = cells.setdefault(key, {}).setdefault(col, [])
        if (run := results.get(c["name"])) is not None and run["status"] != "diverged":
            got.append(100 * _final(run, "val_accuracy"))
    rows = []
    for (lam, mu, g), cols in cells.items():
        means = {col: round(float(np.mean(v)), 2) if v else None for col, v in cols.items()}
        rows.append({"lam": lam, "mu": mu, "server_lr": g, **means})
        whole = None not in means.values()
        rows[-1]["mean"] = round(float(np.mean(list(means.values()))), 2) if whole else None
    return sorted(rows, key=lambda r: (r["mean"] is None, -(r["mean"] or 0.0)))


def tune_md(
    rows: list[dict[str, Any]], p: Preset, seeds: list[int], workers: int, wall: float, left: str, reused: str = ""
) -> str:
    """``tune.md``: the validation accuracy of every (lambda, mu, gamma_0), best first, the runs ``left`` out of it
    (diverged or not run) and the invocation's cost (``reused``: ``Plan.reused_note``)."""
    body = [["–" if r[c] is None else r[c] for c in rows[0]] for r in rows]
    return (
        "# ZO-HFL: lambda and mu chosen on a validation split (spec A1)\n\n"
        f"Final validation accuracy % (10% of the training set held out; the test set is not used), {p.rounds} "
        f"rounds, tau = {p.tau:g}, {len(seeds)} seed(s); best first. lambda = 0 is the server-only control (mu "
        f"unused).\n\n{markdown_table(list(rows[0]), body)}\n{left}"
        f"Wall time {wall:.0f} s{reused} with {workers} worker(s); CPU time of the invocation (workers included) "
        f"{cpu_seconds():.0f} s; load average at the end {load_average()}.\n"
    )


def tune_left(configs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> str:
    """The grid's runs that no cell's mean holds (``–``, or a mean over fewer seeds): those that diverged and
    those the time budget left unrun, by name; "" when every run finished."""
    diverged = [c["name"] for c in configs if results.get(c["name"], {}).get("status") == "diverged"]
    unrun = [c["name"] for c in configs if c["name"] not in results]
    lines = [f"Diverged: {', '.join(diverged)}."] if diverged else []
    lines += [f"Not run (time budget): {', '.join(unrun)}."] if unrun else []
    return "\n".join(lines) + "\n\n" if lines else ""


def study_plan(opts) -> Plan:
    """Table I and the tau sweep of ``--scale`` (or, with ``--tune``, the lambda/mu grid)."""
    p = PRESETS[opts.scale]
    default = 1 if opts.scale == "smoke" or opts.tune else 3
    seeds = list(range(opts.seeds if opts.seeds is not None else default))
    rounds = opts.rounds if opts.rounds is not None else p.rounds
    sweep = dataclasses.replace(p.sweep, seeds=min(p.sweep.seeds, len(seeds)))
    p = dataclasses.replace(p, rounds=rounds, sweep=sweep)  # a copy: the presets stay as defined
    configs = (tune_configs if opts.tune else plan)(p, seeds, Path(opts.out))
    return Plan([Point.of(c, c["name"]) for c in configs], (p, seeds, configs), initializer=_cache_datasets)


def report(records: list[dict[str, Any]], plan_: Plan, opts, wall: float) -> Report:
    """Table I, the claims and the figures (or the tuning table)."""
    p, seeds, configs = plan_.context
    results = {r["name"]: r for r in records}
    if opts.tune:
        rows, left = tune_summary(configs, results), tune_left(configs, results)
        md = tune_md(rows, p, seeds, opts.workers, wall, left, plan_.reused_note())
        return Report({"tune.csv": Rows(rows), "tune.md": md}, "tune.md")
    meta = {
        "scale": opts.scale,
        "rounds": p.rounds,
        "seeds": len(seeds),
        "workers": opts.workers,
        "wall_seconds": round(wall, 1),
        "runs": len(results),  # the runs finished (a time budget may leave some of ``configs`` unrun)
        "run_seconds": {k: round(v["seconds"], 1) for k, v in results.items()},
        "run_cpu_seconds": {k: round(v.get("cpu", 0.0), 2) for k, v in results.items()},
        "cpu_seconds": round(cpu_seconds(), 1),  # this invocation, workers included
        "load_at_end": load_average(),
        "reused": sum(bool(v.get("reused")) for v in results.values()),
    }
    records = seed_rows(p, results, seeds, Path(opts.out))
    if plan_.skipped:  # the header said the seeds asked, as if every one had run
        planned = Counter(u[-1] for u in units(p, seeds) if u[3] == "table")
        ran = Counter(r["seed"] for r in records if r["part"] == "table")
        meta["seeds_run"] = sum(ran[k] == n for k, n in planned.items())
    saved = csv_text(records, SEED_COLUMNS, ".6g")  # the rules read the records as results.csv holds them
    table = per_cell([r for r in records if r["part"] == "table"], CELL, TABLE_STATS)
    report = preset_report(p, parse_csv(saved), table, fig2_means(records), meta)
    report.files["table.md"] += not_run(plan_.skipped)  # the runs a time budget left unrun, named
    report.files["results.csv"] = saved
    report.figures = lambda out: write_plots(p, records, out)
    return report


# ---- the page's generated sections (docs/reproductions/zo-hfl.md) -----------------------------------------
PAGE_PRESETS = {"adult/": "adult", "": "small", "long/": "long"}  # the page's presets: folder -> scale


def sections(folder: Path) -> dict[str, str]:
    """docs/reproductions/zo-hfl.md's generated sections from the committed files in ``folder``: the costs, what
    the prose reads from the grids, each preset's tables (``preset_sections``, named under its folder) and one
    table of every preset's claims judged by their declared rules on its committed per-seed records."""
    _page_parts(folder)
    out = {
        "cost": cost_section(folder),
        "tune": tune_section(folder / "tune.csv"),
        "adult-tune": adult_tune_section(folder / "adult" / "tune.csv"),
        "adult-tune-best": adult_best_section(folder / "adult" / "tune.csv"),
        "long-cost": long_cost_section(folder),
        "paper-scale": paper_scale_section(folder),
    }
    judged = []
    for prefix, scale in PAGE_PRESETS.items():
        p, records, table, losses, _ = committed(folder / prefix, scale)
        out |= {prefix + name: body for name, body in preset_sections(p, records, table, losses).items()}
        judged += [(f"{prefix}results.csv", v) for v in verdicts(records)]
    return out | {"claims": layout(CLAIM_COLS, judged)}


def _page_parts(folder: Path) -> None:
    """A ``ConfigError`` of one line where a preset's folder beside the page lacks a file the page reads, or holds
    another scale's (a smoke scale's: its ``claims.json``'s meta, its ``tune.csv``'s columns): the folder, what it
    lacks and the command that writes it there."""
    for prefix, scale in PAGE_PRESETS.items():
        d, cols = folder / prefix, [f"{ds} {SETTING_NAMES[s]}" for ds in PRESETS[scale].datasets for s in SETTINGS]
        parts = {"": ["claims.json", "results.csv", "table.csv"] + ["table.md"] * (scale == "long")}
        parts |= {} if scale == "long" else {" --tune": ["tune.csv", "tune.md"]}
        for tune, files in parts.items():
            lacks = next((f"no {f}" for f in files if not (d / f).is_file()), None)
            if lacks is None and tune:  # another scale's grid: its columns name other data sets
                head = (read_csv(d / "tune.csv") or [{}])[0]
                lacks = next((f"no column {c!r}" for c in cols if c not in head), None)
            elif lacks is None:
                got = json.loads((d / "claims.json").read_text(encoding="utf-8"))["meta"]["scale"]
                lacks = None if got == scale else f"its claims.json is the {got} scale's"
            if lacks:
                raise ConfigError(
                    f"{d}: the page's sections read the {scale} scale's{tune} runs, which it lacks ({lacks}); "
                    f"run them with `fedweave reproduce zo-hfl --scale {scale}{tune} --out {d}`"
                )


COST_HEADER = ["invocation", "runs", "wall (2 workers)", "CPU time (workers, start-up and data loading included)"]
COST_HEADER += ["load average at the end (1, 5, 15 min)"]
TUNE_COST = r"Wall time (\d+) s" + REUSED_NOTE + r".*?CPU time [^;]*?(\d+) s; load average at the end ([\d. ]+)\."
COST_ROWS = ("Table I core rows (FedAvg, FedProx, SCAFFOLD, ZO-HFL, server-only)", "the sensitivity rows of spec §9.2")
COST_ROWS += ("the extra rows (ZO-HFL at other lambdas, FedAvg with the server's share, server-only long)",)


def cost_section(folder: Path) -> str:
    """The cost of the two committed invocations (``tune.md``; the small preset's, ``claims.json``'s meta) and the
    split of the small preset's run CPU time (``table.csv``: mean CPU seconds per run times its seeds, per group
    of rows; the tau sweep is the rest of the runs' total)."""
    meta = json.loads((folder / "claims.json").read_text(encoding="utf-8"))["meta"]
    invocation = [f"{meta['wall_seconds']:.0f} s", f"{meta['cpu_seconds']:.0f} s", meta["load_at_end"]]
    wall, reused, cpu, load = stated(folder / "tune.md", TUNE_COST)  # its last line (``tune_md``)
    tune = read_csv(folder / "tune.csv")  # a row per (lambda, mu, gamma_0): its lam, mu, server_lr, mean and cells
    tune_runs = len(tune) * (len(tune[0]) - 4)  # one run per row and cell (dataset and setting), 1 seed
    body = [["`--tune`", f"{tune_runs}{reused or ''}", f"{wall} s", f"{cpu} s", load]]
    # the invocation's wall and CPU time are those of the runs it ran (and its rebuild), not of the ones it reused
    ran = f"{meta['runs'] - meta['reused']} (and {meta['reused']} reused)" if meta.get("reused") else meta["runs"]
    body += [["`--scale small` (the last invocation)", ran, *invocation]]
    rows, runs, total = read_csv(folder / "table.csv"), meta["runs"], round(sum(meta["run_cpu_seconds"].values()))
    part = lambda m: 0 if m in METHODS else 1 if m in SENSITIVITY else 2  # noqa: E731
    cpu = {
        g: sum(r["cpu_seconds_mean"] * r["seeds"] for r in rows if part(r["method"]) == i)
        for i, g in enumerate(COST_ROWS)
    }
    split = "; ".join(f"{g} {v:.0f} s" for g, v in cpu.items())
    return (
        markdown_table(COST_HEADER, body)
        + f"\nThe {runs} runs of the small preset used {total} CPU-s of their own (data loading not included),\n"
        f"so the preset needs about {total / 2 / 60:.0f} minutes of 2 idle cores (CPU time measured under load"
        " is itself\ninflated, so this is an upper estimate). From `table.csv` (mean CPU time per run times its seeds):"
        f" {split};\nthe tau sweep, which `table.csv` does not list, the rest: {total - sum(cpu.values()):.0f} s."
        "\n"
    )


def whole_grid(path: Path) -> list[dict[str, Any]]:
    """A committed ``tune.csv`` whose every cell has a finished run: the page's prose reads given cells of it (a
    cell of none, ``tune_summary``'s empty field, is a ConfigError naming the file and the cell)."""
    rows = read_csv(path)
    if gap := next(((r, k) for r in rows for k, v in r.items() if v is None), None):
        r, k = gap
        raise ConfigError(
            f"{path}: no run of lambda = {r['lam']:g}, mu = {r['mu']}, gamma_0 = {r['server_lr']:g} finished in "
            f"{k!r} (diverged or not run); the page reads every cell: rerun --tune into its folder to finish them"
        )
    return rows


def adult_tune_section(path: Path) -> str:
    """What the Adult grid gives at the paper's server step gamma_0 = 0.01 (``adult/tune.csv``): the server-only
    control's validation accuracy in every setting, and the best any cell reaches."""
    rows = [r for r in whole_grid(path) if r["server_lr"] == 0.01]
    cols = [k for k in rows[0] if k.startswith("adult ")]
    base = next(r for r in rows if r["lam"] == 0)
    top = max(((r[c], r, c) for r in rows for c in cols), key=lambda x: x[0])
    return (
        f"At the paper's gamma_0 = 0.01 the server-only control stays at the majority class ({base[cols[0]]:.2f} %) in"
        f" {PRESETS['adult'].rounds} rounds,\nand no cell gets far from it: the best is {top[0]:.2f} % (lambda = "
        f"{top[1]['lam']:g}, mu = {top[1]['mu']}, {top[2].removeprefix('adult ')}),\nso gamma_0 was tuned too.\n"
    )


# ---- the page's numbers in prose, generated (docs/reproductions/zo-hfl.numbers.yaml declares the rest) ------
def tune_section(path: Path) -> str:
    """The small preset's lambda x mu grid (``tune.csv``, validation accuracy, one seed): the mean over the six
    cells per (lambda, mu), the best in bold, and what the sentence after it reads from the grid."""
    rows = whole_grid(path)
    best = max(rows, key=lambda r: r["mean"])
    base = next(r for r in rows if r["lam"] == 0)
    mus = sorted({r["mu"] for r in rows if r["mu"] != "-"}, key=float)
    mu = lambda r: mus[0] if r["mu"] == "-" else r["mu"]  # noqa: E731 (server-only, mu unused: the first mu's column)
    bold = lambda text, top: f"**{text}**" if top else text  # noqa: E731
    lams = {
        lam: bold(f"{lam:g}", lam == best["lam"]) + " (server-only)" * (lam == 0)
        for lam in sorted({r["lam"] for r in rows})
    }
    mean = lambda r: bold(f"{r['mean']:.2f}", r is best)  # noqa: E731
    grid = Grid("lambda", "lam", lams, mu, lambda m: f"mu = {float(m):g}", mean, missing="")
    table = grid.render(sorted(rows, key=lambda r: float(mu(r))))
    small = [r for r in rows if 0 < r["lam"] <= best["lam"]]
    mu_effect = max(
        max(r["mean"] for r in small if r["lam"] == lam) - min(r["mean"] for r in small if r["lam"] == lam)
        for lam in {r["lam"] for r in small}
    )
    extreme = "fashion_mnist a=0.1, b=10%"

    def span(lam: float) -> str:
        vals = sorted(r[extreme] for r in rows if r["lam"] == lam)
        return f"{vals[0]:.1f}-{vals[-1]:.1f}"

    text = (
        f"lambda = {best['lam']:g}, mu = {float(best['mu']):g} is the best mean, and it is what the Table I row "
        f'"ZO-HFL" uses (the ZO-HFL example config too). The margin over the server-only control is '
        f"{best['mean'] - base['mean']:.2f} points on one seed: the ZO term neither helps nor hurts measurably at "
        f"lambda <= 1, and hurts at lambda >= 10, most under heterogeneity (FMNIST at (0.1, 10%): "
        f"{base[extreme]:.1f} server-only, {span(10)} at lambda = 10, {span(100)} at lambda = 100). mu changed "
        f"the mean by at most {mu_effect:.2f} points at lambda <= 1."
    )
    return table + "\n" + paragraph(text)


def adult_best_section(path: Path) -> str:
    """The best cell of the Adult grid (``adult/tune.csv``) against the server-only control at its gamma_0."""
    rows = whole_grid(path)
    best = max(rows, key=lambda r: r["mean"])
    same = [r for r in rows if r["server_lr"] == best["server_lr"]]
    base = next(r for r in same if r["lam"] == 0)
    worse = max(r["mean"] for r in same if r["lam"] > best["lam"])
    return paragraph(
        f"The best cell is lambda = {best['lam']:g}, mu = {float(best['mu']):g}, gamma_0 = {best['server_lr']:g} "
        f"with mean validation accuracy {best['mean']:.2f}, against {base['mean']:.2f} for the server-only "
        f"control at the same gamma_0; larger lambdas are worse ({worse:.2f} and below)."
    )


def _run_cpu(folder: Path) -> tuple[int, ...]:
    """(runs, the sum of their own CPU seconds) of the `long` preset, as the last line of ``long/table.md`` states."""
    return tuple(map(int, stated(folder / "long" / "table.md", r"sum of the (\d+) runs' own CPU times (\d+) s")))


def long_cost_section(folder: Path) -> str:
    """The `long` preset's CPU, as the last line of ``long/table.md`` states it."""
    runs, total = _run_cpu(folder)
    return paragraph(
        f"The {runs} runs' own CPU times sum to {total:,} s ({total / 60:.0f} CPU-minutes, the last line of "
        f"`zo-hfl/long/table.md`), so the preset needs about {total / 2 / 60:.0f} minutes of two idle cores."
    )


def planned(scale: str) -> list[dict[str, Any]]:
    """The run configs ``fedweave reproduce zo-hfl --scale SCALE`` plans (default seeds and rounds)."""
    opts = SimpleNamespace(scale=scale, rounds=None, seeds=None, tune=False, out="runs")
    return study_plan(opts).context[2]


DIMENSIONS = {"mnist": 784 * 10, "fashion_mnist": 784 * 10, "cifar10": 3 * 32 * 32 * 10}  # softmax regression's d


def paper_scale_section(folder: Path) -> str:
    """The paper scale's CPU estimate from the measured `long` preset (``long/table.md``): its CPU per run, and
    each run the paper preset plans scaled by its rounds as R^1.5 (H = tau sqrt(r+1) local steps per round), by
    its tau and by its data set's dimension, against the `long` preset's."""
    runs, total = _run_cpu(folder)
    base = planned("long")[0]
    r0, tau0, d0 = base["rounds"], base["algorithm"]["tau"], DIMENSIONS[base["dataset"]["name"]]
    p = PRESETS["paper"]
    per_round = (p.rounds / r0) ** 1.5

    def hours(configs: list[dict[str, Any]]) -> float:
        cost = sum(
            (c["rounds"] / r0) ** 1.5 * c["algorithm"]["tau"] / tau0 * DIMENSIONS[c["dataset"]["name"]] / d0
            for c in configs
        )
        return cost * total / runs / 3600

    configs = planned("paper")
    table = [c for c in configs if c["rounds"] == p.rounds and c["algorithm"]["tau"] == p.tau]
    sweep = [c for c in configs if c not in table]
    two = [c for c in table if c["dataset"]["name"] != "cifar10"]
    cifar = [c for c in table if c["dataset"]["name"] == "cifar10"]
    d = DIMENSIONS["cifar10"] / d0
    taus = " / ".join(f"{t:g}" for t in sorted({c["algorithm"]["tau"] for c in sweep}))
    return paragraph(
        f"CPU estimate, from the measured `long` preset (its {runs} runs of {r0} rounds at tau = {tau0:g} used "
        f"{total:,} CPU-s, about {total / runs:.0f} s per run, `long/table.md`), each run the paper preset plans "
        f"scaled by (R/{r0})^1.5 for the rounds (H = tau sqrt(r+1) local steps per round: x {per_round:.1f} at R = "
        f"{p.rounds}), by tau/{tau0:g} and by the dimension (CIFAR-10's d = {DIMENSIONS['cifar10']:,} against "
        f"{d0:,}: x {d:.1f}): Table I's {len(cifar)} runs per data set about {hours(two):.1f} h for MNIST and "
        f"Fashion-MNIST together and {hours(cifar):.1f} h for CIFAR-10; the tau sweep's {len(sweep)} runs (tau "
        f"{taus}) about {hours(sweep):.0f} h: about {hours(configs):.0f} CPU core-hours in all."
    )


STUDY = Study(
    name="zo-hfl",
    description=__doc__.split("\n")[0],
    scales=tuple(sorted(PRESETS)),
    seeds_help="number of seeds (default: 3; smoke: 1)",
    options=(
        option("--rounds", count=True, default=None, help="override the Table I rounds of the preset"),
        option("--tune", action="store_true", help="only tune lambda and mu (and gamma_0) on a validation split (A1)"),
    ),
    plan=study_plan,
    record=record,
    report=report,
    sections=sections,
)
main = STUDY.main
