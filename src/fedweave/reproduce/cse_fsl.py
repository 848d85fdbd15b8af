"""Reproduce CSE-FSL's Table V and Fig. 9 (Mu and Shen) at a chosen scale (cse-fsl spec §9).

The presets, Table V's layout and the claims C1-C9 (spec §9.3); what each scale runs and what the outputs hold
is on the page, docs/reproductions/cse-fsl.md. Measured load and storage are checked against the closed forms
of ``fedweave.accounting.split``.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from fedweave.accounting.split import GIB, PAPER_TABLE_V, SplitSizes, round_bytes, storage_params
from fedweave.config import RunConfig
from fedweave.experiments.aggregate import group, if_all, mean_std, to_target
from fedweave.experiments.grid import Point
from fedweave.experiments.plots import plot_curves
from fedweave.experiments.study import YES_NO, Claim, Plan, Report, Rows, Study, Verdict, judge, option, verdict_table
from fedweave.experiments.tables import Col, layout, markdown_table, read_csv, signed
from fedweave.experiments.verdicts import All, Paired, Select, Threshold, Untestable, cell
from fedweave.runner import Result

LABELS = {"fsl_mc": "FSL_MC", "fsl_oc": "FSL_OC (+clip)", "fsl_an": "FSL_AN", "cse_fsl": "CSE-FSL"}
NONIID_NOTE = ", its non-IID column: 2 label-sorted shards per client"
NONIID_GAP = 3.0  # C8: "well below" FSL_MC = further below than C2's "similar accuracy" tolerance of 3 pp


@dataclass
class Preset:
    dataset: dict[str, Any]
    model: dict[str, Any]
    clients: int
    batch_size: int
    lr: float
    rounds: int
    hs: list[int]
    random_h: int  # the h of the randomly ordered CSE-FSL run (Fig. 6)
    target: float  # accuracy for the "load to reach" comparison (claim C3)
    seeds: int
    local: dict[str, Any] = field(default_factory=dict)
    algorithm: dict[str, Any] = field(default_factory=dict)
    partition: dict[str, Any] = field(default_factory=lambda: {"name": "iid"})
    # the per-seed final accuracies the claims' declared rules read (``seed_records``; set by the page)
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def noniid(self) -> bool:
        return self.partition["name"] != "iid"

    @property
    def split_text(self) -> str:
        if self.partition["name"] == "iid":
            return f"{self.clients} IID clients"
        return f"{self.clients} non-IID clients ({self.partition['shards_per_client']} label-sorted shards each)"


def preset(scale: str, dataset: str) -> Preset:
    if scale == "paper":
        # spec §3: random 24×24 crops and flips to train, the centre crop to test (q = 2304)
        cifar = {"name": "cifar10", "stats": "half"}  # the authors' Normalize(0.5, 0.5) (docs/algorithms/split.md)
        return Preset(
            cifar,
            {"name": "split_cifar", "aux": "mlp", "init": "normal", "crop": 24},
            5,
            50,
            0.15,
            200,
            [5, 10, 25, 50],
            5,
            0.70,
            5,
            {"lr_decay": 0.99, "augment": ["crop", "flip"], "crop_size": 24, "crop_padding": 0},
            {"lr_decay_every": 10},
        )
    if dataset == "digits":  # spec §9.3: 1,400 train / 397 test, 5 × 280, B = 10 → M_i = 28
        p = Preset(
            {"name": "digits", "as_image": True, "test_fraction": 0.2213},
            {"name": "split_small"},
            5,
            10,
            0.05,
            30,
            [1, 2, 4, 7, 14],
            4,
            0.90,
            3,
        )
    elif dataset in ("fashion_mnist", "mnist"):  # 5 × 600, B = 20 → M_i = 30
        target = 0.75 if dataset == "fashion_mnist" else 0.90
        p = Preset(
            {"name": dataset, "max_train": 3000, "max_test": 2000},
            {"name": "split_small", "width": 16},
            5,
            20,
            0.1,
            15,
            [1, 5, 15],
            5,
            target,
            3,
        )
    else:  # any registered image dataset (tests use a synthetic one); smoke-sized
        p = Preset({"name": dataset}, {"name": "split_small"}, 5, 10, 0.05, 2, [1, 4], 4, 0.5, 1)
    if scale == "smoke":
        p.rounds, p.seeds, p.hs = 2, 1, p.hs[:1] + p.hs[-1:]
    if scale == "noniid":  # Table V's non-IID column: label-sorted shards, 2 per client (spec A11)
        p.partition = {"name": "shards", "shards_per_client": 2}
    return p


def jobs(p: Preset, seeds: list[int], out: Path) -> list[Point]:
    """One run per (method variant, seed), in ``OUT/runs/<variant>-s<seed>``."""
    variants: list[tuple[str, dict[str, Any]]] = [(m, {"name": m}) for m in ("fsl_mc", "fsl_oc", "fsl_an")]
    variants += [(f"cse_fsl h={h}", {"name": "cse_fsl", "h": h}) for h in p.hs]
    variants.append((f"cse_fsl h={p.random_h} random", {"name": "cse_fsl", "h": p.random_h, "server_order": "random"}))
    points = []
    for (key, algo), s in product(variants, seeds):
        tag = key.replace(" ", "_").replace("=", "")
        config = {
            "name": f"cse-fsl-{tag}",
            "seed": s,
            "rounds": p.rounds,
            "threads": 1,
            "dataset": p.dataset,
            "partition": {**p.partition, "num_clients": p.clients},
            "model": p.model,
            "algorithm": {**algo, **p.algorithm},
            "local": {"epochs": 1, "batch_size": p.batch_size, "lr": p.lr, **p.local},
            "eval": {"every": 1},
            "output": {"dir": str(out / "runs" / f"{tag}-s{s}"), "plots": False, "progress": False},
        }
        points.append(Point.of(config, f"{tag}-s{s}", key=key))
    return points


def split_facts(config: RunConfig) -> tuple[SplitSizes, list[int]]:
    """The parameter counts of the split model's parts and every client's samples, rebuilt from a run's
    config (a run read back from disk has no algorithm object): what the closed forms need."""
    from fedweave.algorithms.base import RunContext, build_algorithm

    algo = build_algorithm(RunContext(config))
    return algo.split_sizes, [len(part) for part in algo.ctx.partition]


def collect(point: Point, res: Result, facts: tuple[SplitSizes, list[int]]) -> dict[str, Any]:
    if not res.metrics:
        raise SystemExit(f"{res.run_dir}: the run diverged before its first evaluation; nothing to tabulate")
    algo = point.config.algorithm
    return {
        "key": dict(point.values)["key"],
        "seed": point.seed,
        "method": algo.name,
        "h": algo.options.get("h", 1),
        "status": res.summary["status"],
        "run_dir": str(res.run_dir),
        "rows": res.metrics,
        "sizes": facts[0],
        "samples": facts[1],
        "wall": res.summary["wall_seconds"],
    }


# ---- summaries ---------------------------------------------------------------------------------------------
def summarize(results: list[dict[str, Any]], p: Preset) -> list[dict[str, Any]]:
    table = []
    for key, rs in group(results, lambda r: r["key"]).items():
        method, h = rs[0]["method"], rs[0]["h"]
        sizes = rs[0]["sizes"]
        accs = [100 * r["rows"][-1]["test_accuracy"] if r["status"] == "completed" else math.nan for r in rs]
        acc_m, acc_s = mean_std(accs)
        load = rs[0]["rows"][-1]["load_bytes"]
        formulas = [round_bytes(method, sizes, r["samples"], p.batch_size, h=h)["load"] * len(r["rows"]) for r in rs]
        reach = if_all([to_target(r["rows"], "test_accuracy", p.target, "load_bytes") for r in rs], np.mean)
        paper_key = key if key in PAPER_TABLE_V["cifar10"] else method if method != "cse_fsl" else None
        paper = PAPER_TABLE_V["cifar10"].get(paper_key) if paper_key else None
        last = rs[0]["rows"][-1]
        table.append(
            {
                "method": key,
                "accuracy": acc_m,
                "accuracy_std": acc_s,
                "load_gib": load / GIB,
                "load_formula_gib": formulas[0] / GIB,
                "load_exact": all(r["rows"][-1]["load_bytes"] == f for r, f in zip(rs, formulas, strict=True)),
                "storage_m": last["storage_params"] / 1e6,
                "storage_formula_m": storage_params(method, sizes, len(rs[0]["samples"])) / 1e6,
                "server_copies": last["server_copies"],
                "load_to_target_gib": float(reach) / GIB if reach is not None else None,
                "uploads_per_client": last["smashed_uploads_per_client"],
                "paper_acc": (paper[1] if p.noniid else paper[0]) if paper else None,
                "paper_load": paper[2] if paper else None,
                "paper_storage": paper[3] if paper else None,
                "accs": accs,
            }
        )
    mc = next(t for t in table if t["method"] == "fsl_mc")
    for t in table:
        t["load_ratio"] = t["load_gib"] / mc["load_gib"]
        t["paper_load_ratio"] = t["paper_load"] / mc["paper_load"] if t["paper_load"] and mc["paper_load"] else None
    return table


def _by(table: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["method"]: t for t in table}


def _cse(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CSE-FSL rows with the ordered server, by h."""
    return [t for t in table if t["method"].startswith("cse_fsl") and "random" not in t["method"]]


def _h(t: dict[str, Any]) -> int:
    return int(t["method"].split("h=")[1])


def _c1(table, p):
    return ", ".join(f"{t['method']}: {'exact' if t['load_exact'] else 'MISMATCH'}" for t in table), all(
        t["load_exact"] for t in table
    )


def _mid(table) -> list[dict[str, Any]]:
    """C2's "small h": the CSE-FSL rows with 1 < h <= 5 (all of them when there are none)."""
    return [t for t in _cse(table) if 1 < _h(t) <= 5] or _cse(table)


def _c2(table, p):
    an, cse = _by(table)["fsl_an"], _cse(table)
    mid = _mid(table)
    measured = ", ".join(f"{t['method']}: {t['accuracy'] - an['accuracy']:+.2f} pp" for t in cse)
    return measured, all(an["accuracy"] - t["accuracy"] <= 3.0 for t in mid)


def _c3(table, p):
    reach = {t["method"]: t["load_to_target_gib"] for t in table}
    big = [t for t in _cse(table) if _h(t) > 1]
    c3 = (
        all(reach[t["method"]] is not None for t in big)
        and reach["fsl_an"] is not None
        and all(reach[t["method"]] < reach["fsl_an"] for t in big)
        and (reach["fsl_mc"] is None or reach["fsl_an"] < reach["fsl_mc"])
    )
    if reach["fsl_an"] is None and all(reach[t["method"]] is None for t in big):
        c3 = None  # neither CSE-FSL (h > 1) nor FSL_AN reached the target: no load to compare
    measured = ", ".join(f"{k}: {'not reached' if v is None else f'{1024 * v:.1f} MiB'}" for k, v in reach.items())
    return measured, c3


def _c5(table, p):
    by, cse = _by(table), _cse(table)
    an, mc, oc = by["fsl_an"], by["fsl_mc"], by["fsl_oc"]
    c5 = all(t["server_copies"] == 1 for t in cse) and cse[0]["storage_m"] < 0.4 * an["storage_m"]
    return (
        f"CSE {cse[0]['storage_m']:.4f} M vs FSL_AN {an['storage_m']:.4f} M "
        f"({cse[0]['storage_m'] / an['storage_m']:.2f}×), copies MC {mc['server_copies']}, "
        f"AN {an['server_copies']}, OC {oc['server_copies']}, CSE 1"
    ), c5


def _c6(table, p):
    rnd = next(t for t in table if "random" in t["method"])
    ordered = _by(table).get(rnd["method"].replace(" random", ""))
    if not ordered:
        return None
    return f"{ordered['accuracy']:.2f} vs {rnd['accuracy']:.2f} %", abs(rnd["accuracy"] - ordered["accuracy"]) <= 1.5


def _c7(table, p):
    by = _by(table)
    h1, an, mc, oc = by.get("cse_fsl h=1"), by["fsl_an"], by["fsl_mc"], by["fsl_oc"]
    if not h1:
        return None
    # "the auxiliary net fixes the single-server-model problem" needs that problem: FSL_OC more than 1 pp
    # below the better of FSL_MC / FSL_AN (the paper: 73.74 vs 80.55 on CIFAR); otherwise untestable
    struggled = oc["accuracy"] < max(mc["accuracy"], an["accuracy"]) - 1
    return (
        f"{h1['accuracy']:.2f} vs {oc['accuracy']:.2f} %; FSL_OC vs best of FSL_MC/AN "
        f"{oc['accuracy']:.2f} vs {max(mc['accuracy'], an['accuracy']):.2f} %",
        h1["accuracy"] >= oc["accuracy"] - 1 if struggled else None,
    )


def _noniid_cse(table, p):
    """Table V's non-IID column (CSE-FSL h=5 42.33 vs FSL_MC 61.17, FSL_AN 54.67, FSL_OC 50.14): the CSE-FSL
    row at the random run's h (h = 5 on Fashion-MNIST/MNIST, as Table V's first CSE row)."""
    return _by(table).get(f"cse_fsl h={p.random_h}") if p.noniid else None


def _c8(table, p):
    if not (cse := _noniid_cse(table, p)):
        return None
    mc = _by(table)["fsl_mc"]
    gap = cse["accuracy"] - mc["accuracy"]
    return f"{cse['accuracy']:.2f} vs {mc['accuracy']:.2f} % ({gap:+.2f} pp)", gap < -NONIID_GAP


def _c9(table, p):
    if not (cse := _noniid_cse(table, p)):
        return None
    by = _by(table)
    order = [by["fsl_mc"], by["fsl_an"], by["fsl_oc"], cse]
    name = dict(zip(map(id, order), ["FSL_MC", "FSL_AN", "FSL_OC", f"CSE-FSL h={p.random_h}"], strict=True))
    ranked = sorted(order, key=lambda t: -t["accuracy"])
    return " > ".join(f"{name[id(t)]} {t['accuracy']:.2f}" for t in ranked), all(
        a["accuracy"] > b["accuracy"] for a, b in zip(order, order[1:])
    )


def seed_records(md: str) -> list[dict[str, Any]]:
    """The per-seed final accuracies a committed ``table-*.md`` lists (``- METHOD: a, b, c`` under its seeds
    ``[0, 1, 2]``, at the 2 decimals it prints), one record per method and seed."""
    seeds = json.loads(re.search(r"seeds (\[[\d, ]*\])", md)[1])
    per = re.findall(r"^- (.+): ([\d., ]+)$", md.split("Per-seed final accuracies (%):", 1)[1], re.M)
    return [{"method": m, "seed": s, "accuracy": float(a)} for m, accs in per for s, a in zip(seeds, accs.split(", "))]


def _acc(a: str | Select, b: str | Select, direction: str = "greater", min_effect: float = 0.0) -> Paired:
    """``a`` against ``b`` (methods, or selectors such as ``below("fsl_an", 3)``) on the final accuracy (%),
    paired by seed, 95 % paired t: 3 seeds, too few for a percentile bootstrap."""
    side = lambda m: cell(method=m) if isinstance(m, str) else m  # noqa: E731
    return Paired("accuracy", side(a), side(b), direction, min_effect, unit="pp")


def below(method: str, pp: float) -> Select:
    """``method``'s accuracy per seed less ``pp`` points: a row above it is less than ``pp`` below ``method`` (a
    one-sided "at most ``pp`` below")."""
    return cell(method=method) - pp


def _seeds(table, p: Preset) -> list[dict[str, Any]]:
    return p.records


def _closed_forms(table, p) -> Threshold:
    return Threshold("mismatches", "==", 0, digits=0, unit="methods off the closed form")


def _c7_rule(table, p):
    by = _by(table)
    if by["fsl_oc"]["accuracy"] >= max(by["fsl_mc"]["accuracy"], by["fsl_an"]["accuracy"]) - 1:
        return Untestable("FSL_OC is not more than 1 pp below FSL_MC/AN in the means: no problem to fix")
    return All((("h=1 vs FSL_OC - 1 pp", _acc("cse_fsl h=1", below("fsl_oc", 1.0))),))


NO_SEEDS = "the load to reach the target has no per-seed record (the table: its seed mean)"
# Each claim's declared rule (``Claim.declared``) on the per-seed final accuracies (``records``: a table's
# ``seeds``, see ``seed_records``); the spec's criterion on the means stays each claim's ``rule`` (the committed
# tables' "held"). Minimum effects: the spec's 3 pp of "similar accuracy" (C2, one-sided: a CSE row above FSL_AN
# is no failure), 1.5 pp of Fig. 6's order invariance (C6), the 1 pp of C7, NONIID_GAP (C8), 0 for C9's order.
CLAIMS = [
    Claim(
        "C1 measured bytes equal the closed forms (every method, every round)",
        _c1,
        declared=_closed_forms,
        records=lambda t, p: [{"mismatches": sum(not r["load_exact"] for r in t)}],
    ),
    Claim(
        "C2 CSE-FSL with small h within 3 pp of FSL_AN at equal rounds",
        _c2,
        declared=lambda t, p: All(
            tuple((f"{x['method']} vs FSL_AN - 3 pp", _acc(x["method"], below("fsl_an", 3.0))) for x in _mid(t))
        ),
        records=_seeds,
    ),
    Claim(
        lambda t, p: f"C3 less load to reach {100 * p.target:.0f} % test accuracy: CSE (h>1) < FSL_AN < FSL_MC",
        _c3,
        declared=Untestable(NO_SEEDS),
    ),
    Claim(
        "C5 CSE-FSL keeps one server-side model; storage < 0.4× FSL_AN",
        _c5,
        declared=Threshold("ratio", "<", 0.4, unit="× FSL_AN's storage"),
        records=lambda t, p: [{"ratio": _cse(t)[0]["storage_m"] / _by(t)["fsl_an"]["storage_m"]}],
    ),
    Claim(
        "C6 ordered vs randomly ordered server within 1.5 pp (Fig. 6)",
        _c6,
        records=_seeds,
        declared=lambda t, p: (lambda r: _acc(r.replace(" random", ""), r, "within", 1.5))(
            next(x["method"] for x in t if "random" in x["method"])
        ),
    ),
    Claim(
        "C7 CSE-FSL h=1 >= FSL_OC (+clip) - 1 pp (testable only if FSL_OC is > 1 pp below FSL_MC/AN)",
        _c7,
        declared=_c7_rule,
        records=_seeds,
    ),
    Claim(
        lambda t, p: (
            f"C8 non-IID: CSE-FSL h={p.random_h} more than {NONIID_GAP:g} pp below FSL_MC "
            "(paper, h=5: 42.33 vs 61.17 %)"
        ),
        _c8,
        declared=lambda t, p: _acc(f"cse_fsl h={p.random_h}", "fsl_mc", "less", NONIID_GAP),
        records=_seeds,
    ),
    Claim(
        lambda t, p: f"C9 non-IID ordering of Table V: FSL_MC > FSL_AN > FSL_OC > CSE-FSL h={p.random_h}",
        _c9,
        declared=lambda t, p: All(
            (
                ("MC > AN", _acc("fsl_mc", "fsl_an")),
                ("AN > OC", _acc("fsl_an", "fsl_oc")),
                ("OC > CSE", _acc("fsl_oc", f"cse_fsl h={p.random_h}")),
            )
        ),
        records=_seeds,
    ),
]


def claims(table: list[dict[str, Any]], p: Preset) -> list[Verdict]:
    """The verdicts of the spec's claims (§9.3) on the summary table's means, as a preset's ``table.md``
    states them (each claim's own rule; ``Claim.criterion``)."""
    return [v for c in CLAIMS if (v := c.criterion(table, p)) is not None]


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


COLUMNS = [
    ("method", "method"),
    ("accuracy", "acc (%)"),
    ("accuracy_std", "± std"),
    ("load_gib", "load (GiB)"),
    ("load_ratio", "load / FSL_MC"),
    ("storage_m", "storage (M)"),
    ("server_copies", "server copies"),
    ("load_to_target_gib", "load to target (GiB)"),
    ("paper_acc", "paper acc IID (%)"),
    ("paper_load", "paper load (GiB)"),
    ("paper_load_ratio", "paper load / FSL_MC"),
    ("paper_storage", "paper storage (M)"),
]


def markdown(table, verdicts, p: Preset, scale: str, seeds: list[int], wall: float) -> str:
    lines = [
        "# CSE-FSL reproduction (Table V / Fig. 9 style)",
        "",
        f"Scale `{scale}`, dataset `{p.dataset['name']}` ({p.split_text}, B = {p.batch_size}, "
        f"lr {p.lr}, {p.rounds} rounds, model `{p.model['name']}`), seeds {seeds}, wall {wall:.0f} s.",
        f"The paper's columns are its CIFAR-10 Table V (5 clients, 200 epochs{NONIID_NOTE if p.noniid else ''}); "
        "accuracies are not comparable across datasets, the load *ratios* and the storage structure are.",
        "",
    ]
    nd = {"load_gib": 5, "storage_m": 4, "load_to_target_gib": 5, "load_ratio": 3, "paper_load_ratio": 3}
    body = [[_fmt(t[k], nd.get(k, 2)) for k, _ in COLUMNS] for t in table]
    header = [h.replace("IID", "non-IID") if k == "paper_acc" and p.noniid else h for k, h in COLUMNS]
    lines += [markdown_table(header, body), "## Claims (spec §9.3)", ""]
    lines += [verdict_table(verdicts).rstrip("\n")]
    lines += ["", "Per-seed final accuracies (%):", ""]
    lines += [f"- {t['method']}: {', '.join(f'{a:.2f}' for a in t['accs'])}" for t in table]
    return "\n".join(lines) + "\n"


CSV_EXTRA = ["load_formula_gib", "load_exact", "storage_formula_m", "uploads_per_client"]


def plots(results: list[dict[str, Any]], out: Path) -> None:
    """Fig. 9a (accuracy against load), accuracy against rounds and against smashed uploads (Fig. 4), each the
    mean over seeds with a band; the randomly ordered server dashed."""
    curves = {k: [r["rows"] for r in rs] for k, rs in group(results, lambda r: r["key"]).items()}
    styles = {k: {"ls": "--"} for k in curves if "random" in k}
    common = {"y": "test_accuracy", "yscale": 100, "ylabel": "test accuracy (%), mean over seeds", "styles": styles}
    plot_curves(
        curves,
        out / "fig9_accuracy_vs_load.png",
        x="load_bytes",
        xscale=1 / GIB,
        logx=True,
        xlabel="communication load (GiB, labels excluded)",
        **common,
    )
    plot_curves(curves, out / "accuracy_vs_rounds.png", x="round", xlabel="round (epoch)", **common)
    plot_curves(
        curves,
        out / "accuracy_vs_uploads.png",
        x="smashed_uploads_per_client",
        logx=True,
        xlabel="smashed-data uploads per client",
        **common,
    )


def plan(opts) -> Plan:
    """The preset of ``--scale`` / ``--dataset`` and its points; the context is the preset and the seeds."""
    dataset = opts.dataset or ("cifar10" if opts.scale == "paper" else "fashion_mnist")
    p = preset(opts.scale, dataset)
    seeds = list(range(opts.seeds if opts.seeds is not None else p.seeds))
    return Plan(jobs(p, seeds, Path(opts.out)), (p, seeds, {}))


def record(point: Point, res: Result, plan: Plan) -> dict[str, Any]:
    """A run as a record: its rows with the split model's sizes and the clients' samples (the same for every
    method at one data, model and seed: built once per those)."""
    c, facts = point.config, plan.context[2]
    key = json.dumps([c.dataset.to_dict(), c.partition.to_dict(), c.model.to_dict(), c.seed], sort_keys=True)
    facts.setdefault(key, split_facts(c))
    return collect(point, res, facts[key])


def report(results: list[dict[str, Any]], plan: Plan, opts, wall: float) -> Report:
    """Table V (markdown and CSV), the claims and the figures; exit 1 when a measured load is not its formula."""
    p, seeds, _ = plan.context
    table = summarize(results, p)
    md = markdown(table, claims(table, p), p, opts.scale, seeds, wall)
    status = 0 if all(t["load_exact"] for t in table) else 1
    files = {"table.md": md, "table.csv": Rows(table, [k for k, _ in COLUMNS] + CSV_EXTRA)}
    return Report(files, "table.md", status, figures=lambda out: plots(results, out))


# the page's generated claim tables: (block, the committed Table V beside the page, its scale and dataset)
PAGE_TABLES = (
    ("claims-fashion_mnist", "table-fashion_mnist.csv", "small", "fashion_mnist"),
    ("claims-fashion_mnist-noniid", "table-fashion_mnist-noniid.csv", "noniid", "fashion_mnist"),
    ("claims-digits", "table-digits.csv", "small", "digits"),
)


def sections(folder: Path) -> dict[str, str]:
    """docs/reproductions/cse-fsl.md's generated claim tables: the claims judged again on each committed
    Table V (``table-*.csv``) with its preset."""
    out = {}
    for block, f, scale, dataset in PAGE_TABLES:
        table, p = read_csv(folder / f), preset(scale, dataset)
        p.records = seed_records((folder / f).with_suffix(".md").read_text(encoding="utf-8"))
        declared = {v.claim: v.interval for v in judge(CLAIMS, table, p)}
        rows = [[v.claim, v.measured, declared.get(v.claim, "-"), YES_NO[v.held]] for v in claims(table, p)]
        out[block] = markdown_table(["claim", "measured", "verdict (declared rule)", "held"], rows)
        out[block.replace("claims", "table")] = page_table(table, p, block.endswith("noniid"))
    return out | prose_sections(folder)


def _label(method: str) -> str:
    """A method as the page names it: FSL_MC, FSL_OC (+clip), CSE-FSL h=5, CSE-FSL h=5, random order."""
    name = method.replace("cse_fsl", "CSE-FSL").replace(" random", ", random order")
    return {"fsl_oc": "FSL_OC (+clip)"}.get(method, name.upper() if method.startswith("fsl") else name)


def _mib(t: dict[str, Any]) -> float | None:
    return None if t["load_to_target_gib"] is None else 1024 * t["load_to_target_gib"]


# the page's Table V, declared: the columns of every table of it, then the load's
V5 = [
    Col("method", lambda t: _label(t["method"])),
    Col("acc (%)", "accuracy", ".2f"),
    Col("± std", "accuracy_std", ".2f"),
]
LOAD = Col("load / FSL_MC", "load_ratio", ".3f")


def page_table(table: list[dict[str, Any]], p: Preset, noniid: bool) -> str:
    """The page's Table V of one committed ``table-*.csv``: accuracy (mean, std), load and storage with the
    paper's CIFAR-10 numbers (the non-IID column: accuracy per seed and the paper's non-IID accuracy)."""
    per = group(p.records, lambda r: r["method"])
    if noniid:
        seeds = Col("per seed", lambda t: ", ".join(f"{r['accuracy']:.2f}" for r in per[t["method"]]))
        return layout([*V5, seeds, LOAD, Col("paper non-IID acc (%)", "paper_acc", ".2f")], table)
    digits = p.dataset["name"] == "digits"
    cols = [
        *V5,
        Col("load (GiB)", "load_gib", ".4f"),
        LOAD,
        Col("storage (M)" if digits else "storage (M params)", "storage_m", ".4f"),
    ]
    cols.append(Col("copies" if digits else "server copies", "server_copies"))
    cols.append(Col(f"load to reach {100 * p.target:.0f} % (MiB)", _mib, ".1f"))
    if not digits:
        cols += [Col("paper CIFAR acc", "paper_acc", ".2f"), Col("paper load / FSL_MC", "paper_load_ratio", ".3f")]
        cols.append(Col("paper storage (M)", "paper_storage", ".2f"))
    return layout(cols, table)


# ---- the page's numbers in prose, generated (docs/reproductions/cse-fsl.numbers.yaml declares the rest) -----
# the paper's models as Tables III/IV build them: (dataset, split model, input shape, classes, the CNN+MLP
# auxiliary nets' channels c of the table)
PAPER_MODELS = (
    ("CIFAR", "split_cifar", (3, 24, 24), 10, (54, 27, 14, 7)),
    ("F-EMNIST", "split_femnist", (1, 28, 28), 62, (64, 32, 8, 2)),
)
DIGITS_MODEL = ("split_small", (1, 8, 8), 10)  # spec §9.3's digits-mini
DIGITS_TRAIN = 1400  # spec §9.3: the digits preset's training images (the rest of the 1,797 are its test set)
TABLE_V_CSE = {"cifar10": (5, 10, 25, 50), "femnist": (2, 4, 5)}  # Table V's CSE-FSL columns, by h


def _sizes(name: str, shape: tuple[int, ...], classes: int, **options: Any) -> SplitSizes:
    from fedweave.models.split import build_split_model, count

    m = build_split_model(name, shape, classes, options)
    return SplitSizes(count(m.client), count(m.server), count(m.aux), m.smashed_floats)


def models_section() -> str:
    """The paper's models' parameter counts as ``fedweave.models.split`` builds them (the tests pin them to
    spec §9.1's counts)."""
    rows, cnn = [], []
    for label, name, shape, k, channels in PAPER_MODELS:
        s = _sizes(name, shape, k)
        rows.append([label, f"{s.client:,}", f"{s.server:,}", f"{s.aux:,}", f"{s.smashed:,}"])
        aux = [_sizes(name, shape, k, aux="cnn", aux_channels=c).aux for c in channels]
        cnn.append(f"- {label}, c = {'/'.join(map(str, channels))}: {' / '.join(f'{a:,}' for a in aux)}.")
    table = markdown_table(["model", "client", "server", "MLP aux", "smashed floats per sample"], rows)
    return table + "\nThe CNN+MLP auxiliary nets also match:\n\n" + "\n".join(cnn) + "\n"


def _v_row(label: str, cells: list[float]) -> str:
    return f"| {label} | " + " | ".join(f"{c:.2f}" for c in cells) + " |"


def table_v_section() -> str:
    """Table V's loads and storage from the closed forms with the paper's configurations, beside the paper's,
    and the F-EMNIST samples per client per round that give the paper's FSL_MC load (spec A21)."""
    from fedweave.accounting.split import PAPER_SETUPS, load_gib, table_v_row

    out = []
    for dataset, name in (("cifar10", "CIFAR-10"), ("femnist", "F-EMNIST")):
        keys = ["fsl_mc", "fsl_oc", "fsl_an"] + [f"cse_fsl h={h}" for h in TABLE_V_CSE[dataset]]
        paper = PAPER_TABLE_V[dataset]
        computed = [table_v_row(dataset, k) for k in keys]
        hs = [f"h={h}" for h in TABLE_V_CSE[dataset]]
        lines = ["| | FSL_MC | FSL_OC | FSL_AN | CSE " + " | ".join(hs) + " |", "|" + "---|" * (len(keys) + 1)]
        for i, what in ((0, "load (GiB)"), (1, "storage (M)")):
            mine, theirs = [c[i] for c in computed], [paper[k][2 + i] for k in keys]
            if [round(x, 2) for x in mine] == theirs:
                lines.append(_v_row(f"{name} {what}, computed = paper", mine))
            else:
                lines += [_v_row(f"{name} {what}, computed", mine), _v_row(f"{name} {what}, paper", theirs)]
        out.append("\n".join(lines) + "\n")
    # spec A21: the samples per client per round whose FSL_MC load is the paper's (its FSL_AN/CSE need the 200)
    setup, want = PAPER_SETUPS["femnist"], PAPER_TABLE_V["femnist"]["fsl_mc"][2]
    n = setup["clients"]
    samples = next(
        s
        for s in range(setup["samples"], 2 * setup["samples"])
        if round(load_gib("fsl_mc", setup["sizes"], [s] * n, setup["batch_size"], setup["rounds"]), 2) == want
    )
    out.append(
        _fill(
            f"The paper's F-EMNIST baselines ({want:.2f} GiB) correspond to {samples} samples per client per round "
            f"instead of {setup['samples']}: the closed form gives {want:.2f} exactly with {samples} (spec A21). "
            f"Every other figure matches with {setup['samples']}."
        )
    )
    return "\n".join(out)


def digits_bytes_section() -> str:
    """Spec §9.3's digits numbers from the closed forms with the digits preset's model and clients: the bytes
    of one round per method, the storage at n = 5 and the models' fixed traffic per round."""
    p = preset("small", "digits")
    sizes, n = _sizes(*DIGITS_MODEL), p.clients
    samples = [DIGITS_TRAIN // n] * n  # equal IID shares
    rows = [("fsl_mc", 1), ("fsl_an", 1)] + [("cse_fsl", h) for h in p.hs[1:]]
    per_round = [round_bytes(m, sizes, samples, p.batch_size, h=h)["load"] for m, h in rows]
    store = [storage_params(m, sizes, n) for m in ("fsl_mc", "fsl_oc", "fsl_an", "cse_fsl")]
    fixed = 2 * n * (sizes.client + sizes.aux) * 4
    return _fill(
        f"The spec's §9.3 digits numbers also hold: {' / '.join(f'{b:,}' for b in per_round)} bytes per round "
        f"(FSL_MC and FSL_OC, FSL_AN and CSE-FSL h = 1, then CSE-FSL h = {', '.join(str(h) for h in p.hs[1:])}), "
        f"and storage of {' / '.join(f'{s:,}' for s in store)} parameters (FSL_MC / FSL_OC / FSL_AN / CSE-FSL) "
        f"at n = {n}. Of a CSE-FSL round, the client models and auxiliary nets going down and up, "
        f"2n(P_c + P_a)·4 bytes, are a fixed {fixed:,} B whatever h."
    )


def _fill(text: str) -> str:
    """A generated sentence wrapped as the page's prose is."""
    return textwrap.fill(text, 110, break_long_words=False, break_on_hyphens=False) + "\n"


def _records(folder: Path, f: str) -> dict[tuple[str, int], float]:
    md = (folder / f).read_text(encoding="utf-8")
    return {(r["method"], r["seed"]): r["accuracy"] for r in seed_records(md)}


def h1_vs_an_section(folder: Path) -> str:
    """Fig. 9a's CSE-FSL h = 1 against FSL_AN at their equal load on IID Fashion-MNIST: the seed means and the
    per-seed gaps of the committed table."""
    table = _by(read_csv(folder / "table-fashion_mnist.csv"))
    acc = _records(folder, "table-fashion_mnist.md")
    seeds = sorted({s for _, s in acc})
    gaps = [acc["cse_fsl h=1", s] - acc["fsl_an", s] for s in seeds]
    return _fill(
        f"CSE-FSL h = 1 against FSL_AN at their equal load: {table['cse_fsl h=1']['accuracy']:.2f} vs "
        f"{table['fsl_an']['accuracy']:.2f} % in the seed means, higher on {sum(g > 0 for g in gaps)} of the "
        f"{len(seeds)} seeds (per-seed gaps {signed(min(gaps))} to {signed(max(gaps))} pp)."
    )


def gaps_section(folder: Path) -> str:
    """Each method's seed-mean gap to FSL_MC on IID and non-IID Fashion-MNIST beside the paper's CIFAR-10 ones
    (Table V): what the non-IID verdict compares."""
    iid, non = (_by(read_csv(folder / f)) for f in ("table-fashion_mnist.csv", "table-fashion_mnist-noniid.csv"))
    paper = PAPER_TABLE_V["cifar10"]

    def gap(by: dict[str, dict[str, Any]], key: str) -> str:
        return signed(by[key]["accuracy"] - by["fsl_mc"]["accuracy"]) if key in by else "—"

    def paper_gap(key: str, col: int) -> str:
        return signed(paper[key][col] - paper["fsl_mc"][col]) if key in paper else "—"

    head = ["method", "IID (pp)", "non-IID (pp)", "paper CIFAR-10 IID (pp)", "paper CIFAR-10 non-IID (pp)"]
    rows = [[_label(k), gap(iid, k), gap(non, k), paper_gap(k, 0), paper_gap(k, 1)] for k in non if k != "fsl_mc"]
    return markdown_table(head, rows)


def wall_section(folder: Path, f: str) -> str:
    """The wall time the committed table file states: that of the invocation that wrote it (runs it reused
    from an earlier invocation count nothing)."""
    wall = int(re.search(r"wall (\d+) s\.", (folder / f).read_text(encoding="utf-8"))[1])
    return _fill(f"Wall time of the invocation that wrote `cse-fsl/{f}`: {wall:,} s ({wall / 60:.0f} min).")


def prose_sections(folder: Path) -> dict[str, str]:
    """The page's generated numbers outside its tables of results: the closed forms of §1 and the readings of
    the committed tables that the prose states."""
    return {
        "models": models_section(),
        "table-v": table_v_section(),
        "digits-bytes": digits_bytes_section(),
        "h1-vs-an": h1_vs_an_section(folder),
        "noniid-gaps": gaps_section(folder),
        **{b.replace("claims", "wall"): wall_section(folder, f.replace(".csv", ".md")) for b, f, *_ in PAGE_TABLES},
    }


STUDY = Study(
    name="cse-fsl",
    description=__doc__.split("\n\n")[0],
    scales=("smoke", "small", "noniid", "paper"),
    scale_help="noniid: the small preset with 2 label-sorted shards per client (Table V's non-IID column)",
    seeds_help="number of seeds, 0..N-1 (default 3; paper 5)",
    options=(option("--dataset", default=None, help="fashion_mnist (small default), mnist, digits, or cifar10"),),
    plan=plan,
    record=record,
    report=report,
    sections=sections,
)
main = STUDY.main
