"""Reproduce CSE-FSL's Table V and Fig. 9 (Mu and Shen) at a chosen scale (cse-fsl spec §9).

The presets, Table V's layout and the claims C1-C9 (spec §9.3); what each scale runs and what the outputs hold
is on the page, docs/reproductions/cse-fsl.md. Measured load and storage are checked against the closed forms
of ``fedweave.accounting.split``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from fedweave.accounting.split import (
    FLOAT_BYTES,
    GIB,
    PAPER_TABLE_V,
    SplitSizes,
    round_bytes,
    server_copies,
    storage_params,
)
from fedweave.config import ConfigError
from fedweave.experiments.aggregate import finite, group, if_all, mean_std, seed_gaps, seed_value, to_target
from fedweave.experiments.blocks import verdict_cell
from fedweave.experiments.grid import Point
from fedweave.experiments.pages import REUSED_NOTE, paragraph, stated
from fedweave.experiments.plots import plot_curves
from fedweave.experiments.study import Claim, Plan, Report, Rows, Study, judge, known_datasets, not_run, option
from fedweave.experiments.tables import Col, layout, markdown_table, read_csv, signed
from fedweave.experiments.verdicts import All, Paired, Select, Threshold, Untestable, cell
from fedweave.runner import Result

NONIID_GAP = 3.0  # C8: "well below" FSL_MC = further below than C2's "similar accuracy" tolerance of 3 pp
# C5 (spec §9.3's extra sweep): the server's storage at n = 2, 5, 10 clients, one round of each method; C5's
# ratio to FSL_AN is the spec's at n = 5
STORAGE_CLIENTS = (2, 5, 10)
STORAGE_N = 5


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
    # the per-seed final accuracies the claims' declared rules read (``seed_records`` of table.md)
    records: list[dict[str, Any]] = field(default_factory=list)
    # the storage measurement's rows (``storage_rows``) that C5 reads; none beside a Table V alone (one n)
    storage: list[dict[str, Any]] = field(default_factory=list)

    @property
    def noniid(self) -> bool:
        return self.partition["name"] != "iid"


def preset(scale: str, dataset: str) -> Preset:
    """The preset of ``scale`` on ``dataset``."""
    if scale == "paper":
        # spec §3: random 24×24 crops and flips to train, the centre crop to test (q = 2304); the authors'
        # Normalize(0.5, 0.5) (docs/algorithms/split.md)
        model = {"name": "split_cifar", "aux": "mlp", "init": "normal", "crop": 24}
        local = {"lr_decay": 0.99, "augment": ["crop", "flip"], "crop_size": 24, "crop_padding": 0}
        cifar = {"name": "cifar10", "stats": "half"}
        return Preset(cifar, model, 5, 50, 0.15, 200, [5, 10, 25, 50], 5, 0.70, 5, local, {"lr_decay_every": 10})
    if dataset == "digits":  # spec §9.3: 1,400 train / 397 test, 5 × 280, B = 10 → M_i = 28
        data = {"name": "digits", "as_image": True, "test_fraction": 0.2213}
        p = Preset(data, {"name": "split_small"}, 5, 10, 0.05, 30, [1, 2, 4, 7, 14], 4, 0.90, 3)
    elif dataset in ("fashion_mnist", "mnist"):  # 5 × 600, B = 20 → M_i = 30
        data = {"name": dataset, "max_train": 3000, "max_test": 2000}
        target = 0.75 if dataset == "fashion_mnist" else 0.90
        p = Preset(data, {"name": "split_small", "width": 16}, 5, 20, 0.1, 15, [1, 5, 15], 5, target, 3)
    else:  # any registered image dataset (tests use a synthetic one); smoke-sized, h at most its 2 batches a client
        p = Preset({"name": dataset}, {"name": "split_small"}, 5, 10, 0.05, 2, [1, 2], 2, 0.5, 1)
    if scale == "smoke":
        p.rounds, p.seeds, p.hs = 2, 1, p.hs[:1] + p.hs[-1:]
    if scale == "storage":  # C5: one round at each of STORAGE_CLIENTS (storage needs no training to converge)
        p.rounds, p.seeds = 1, 1
    if scale == "noniid":  # Table V's non-IID column: label-sorted shards, 2 per client (spec A11)
        p.partition = {"name": "shards", "shards_per_client": 2}
    return p


def jobs(p: Preset, seeds: list[int], out: Path, storage: bool = False) -> list[Point]:
    """One run per (method variant, seed), in ``OUT/runs/<variant>-s<seed>``; ``storage``: the four methods
    (CSE-FSL at the random run's h) at each of ``STORAGE_CLIENTS``, in ``OUT/runs/n<n>-<method>-s<seed>``."""
    variants: list[tuple[str, dict[str, Any]]] = [(m, {"name": m}) for m in ("fsl_mc", "fsl_oc", "fsl_an")]
    if storage:
        variants.append((f"cse_fsl h={p.random_h}", {"name": "cse_fsl", "h": p.random_h}))
        clients = [(n, f"n{n}-") for n in STORAGE_CLIENTS]
    else:
        variants += [(f"cse_fsl h={h}", {"name": "cse_fsl", "h": h}) for h in p.hs]
        random = {"name": "cse_fsl", "h": p.random_h, "server_order": "random"}
        variants.append((f"cse_fsl h={p.random_h} random", random))
        clients = [(p.clients, "")]
    points = []
    for (n, prefix), (key, algo), s in product(clients, variants, seeds):
        tag = prefix + key.replace(" ", "_").replace("=", "")
        config = {
            "name": f"cse-fsl-{tag}",
            "seed": s,
            "rounds": p.rounds,
            "threads": 1,
            "dataset": p.dataset,
            "partition": {**p.partition, "num_clients": n},
            "model": p.model,
            "algorithm": {**algo, **p.algorithm},
            "local": {"epochs": 1, "batch_size": p.batch_size, "lr": p.lr, **p.local},
            "eval": {"every": 1},
            "output": {"dir": str(out / "runs" / f"{tag}-s{s}"), "plots": False, "progress": False},
        }
        at = {"clients": f"n={n}"} if storage else {}  # the storage runs of one method differ by n alone
        points.append(Point.of(config, f"{tag}-s{s}", **at, key=key))
    return points


# ---- summaries ---------------------------------------------------------------------------------------------
def completed(run: dict[str, Any]) -> bool:
    """Whether a run's record is of a completed run: a diverged one has no final accuracy, and its load stops at
    the round it diverged in (none at all before its first evaluation)."""
    return run["status"] == "completed" and bool(run["rows"])


def summarize(results: list[dict[str, Any]], p: Preset) -> list[dict[str, Any]]:
    """Table V's rows, one per method variant over its seeds: final accuracy (mean and std over the seeds that
    completed, and per seed: NaN where a run diverged), the measured load and storage of a completed run beside
    their closed forms (``_measured``), the load to reach the target (over the completed runs) and the paper's
    CIFAR-10 numbers."""
    table = []
    for key, rs in group(results, itemgetter("key")).items():
        method, h, sizes = rs[0]["method"], rs[0]["h"], rs[0]["sizes"]
        done = [r for r in rs if completed(r)]
        accs = [100 * r["rows"][-1]["test_accuracy"] if completed(r) else math.nan for r in rs]
        ok, _ = finite(accs)
        acc_m, acc_s = mean_std(ok)
        formulas = [round_bytes(method, sizes, r["samples"], p.batch_size, h=h)["load"] for r in rs]  # per round
        reach = if_all([to_target(r["rows"], "test_accuracy", p.target, "load_bytes") for r in done], np.mean)
        paper = PAPER_TABLE_V["cifar10"].get(key) or (None,) * 4  # (IID acc, non-IID acc, load, storage)
        table.append(
            {
                "method": key,
                "accuracy": acc_m,
                "accuracy_std": acc_s if len(ok) > 1 else None,  # one completed seed has no spread to show ("—")
                "load_exact": all(x["load_bytes"] == f * x["round"] for r, f in zip(rs, formulas) for x in r["rows"]),
                **_measured(done, p),
                "load_to_target_gib": float(reach) / GIB if reach is not None else None,
                "paper_acc": paper[1] if p.noniid else paper[0],
                "paper_load": paper[2],
                "paper_storage": paper[3],
                "accs": accs,
            }
        )
    mc = next(t for t in table if t["method"] == "fsl_mc")
    for t in table:
        t["load_ratio"] = t["load_gib"] / mc["load_gib"] if None not in (t["load_gib"], mc["load_gib"]) else None
        t["paper_load_ratio"] = t["paper_load"] / mc["paper_load"] if t["paper_load"] and mc["paper_load"] else None
    return table


MEASURED = ("load_gib", "load_formula_gib", "storage_m", "storage_formula_m", "server_copies", "uploads_per_client")


def _measured(done: list[dict[str, Any]], p: Preset) -> dict[str, Any]:
    """A method's measured load and storage beside their closed forms, read from the first of its completed runs
    ``done`` (the presets' equal IID shares and label shards give every seed the same samples per client). A
    diverged run's numbers stop where it diverged, so a method none of whose runs completed has none (None)."""
    if not done:
        return dict.fromkeys(MEASURED)
    run, last = done[0], done[0]["rows"][-1]
    per_round = round_bytes(run["method"], run["sizes"], run["samples"], p.batch_size, h=run["h"])["load"]
    return {
        "load_gib": last["load_bytes"] / GIB,
        "load_formula_gib": per_round * last["round"] / GIB,
        "storage_m": last["storage_params"] / 1e6,
        "storage_formula_m": storage_params(run["method"], run["sizes"], len(run["samples"])) / 1e6,
        "server_copies": last["server_copies"],
        "uploads_per_client": last["smashed_uploads_per_client"],
    }


def _by(table: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["method"]: t for t in table}


def _cse(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CSE-FSL rows with the ordered server, by h."""
    return [t for t in table if t["method"].startswith("cse_fsl") and "random" not in t["method"]]


# a seed's final accuracy in a table's per-seed list: a number, or ``diverged`` (``nan`` in a table written before
# diverged runs were named so)
SEED_ACC = r"(?:[\d.]+|nan|diverged)"


def seed_records(md: str) -> list[dict[str, Any]]:
    """The per-seed final accuracies a ``table-*.md`` lists (``- METHOD: a, b, c`` under its seeds
    ``[0, 1, 2]``, at the 2 decimals it prints), one record per method and seed: what the claims' rules read.
    A seed whose run diverged is listed ``diverged``: its record's accuracy is NaN, which the rules leave out of
    their pairs (``_diverged``)."""
    seeds = json.loads(re.search(r"seeds (\[[\d, ]*\])", md)[1])
    listing = md.split("Per-seed final accuracies (%):", 1)[1]
    per = re.findall(rf"^- (.+): ({SEED_ACC}(?:, {SEED_ACC})*)$", listing, re.M)
    return [
        {"method": m, "seed": s, "accuracy": math.nan if a == "diverged" else float(a)}
        for m, accs in per
        for s, a in zip(seeds, accs.split(", "))
    ]


def _seed_acc(a: float) -> str:
    """A seed's final accuracy as a table lists it: 2 decimals, or ``diverged`` (no accuracy)."""
    return seed_value(a)


# ---- claims (spec §9.3) ------------------------------------------------------------------------------------
def _acc(a: str | Select, b: str | Select, direction: str = "greater", min_effect: float = 0.0) -> Paired:
    """``a`` against ``b`` (methods, or selectors such as ``cell(method="fsl_an") - 3``) on the final accuracy
    (%), paired by seed, 95 % paired t: 3 to 10 seeds, too few for a percentile bootstrap."""
    a, b = (cell(method=m) if isinstance(m, str) else m for m in (a, b))
    return Paired("accuracy", a, b, direction, min_effect, unit="pp", no_pair=_diverged)


def _diverged(r: dict[str, Any]) -> str | None:
    """Why a seed's record is no pair: its run diverged (no final accuracy, NaN), or None (``Paired.no_pair``)."""
    return None if math.isfinite(r["accuracy"]) else "diverged"


def _mismatches(table) -> int:
    """C1's value: how many methods' measured load is not its closed form."""
    return sum(not r["load_exact"] for r in table)


def _storage_ratio(table) -> float | None:
    """C5's value on a Table V alone: CSE-FSL's server-side storage over FSL_AN's (the same for every h); None
    where no run of CSE-FSL or of FSL_AN completed (a diverged run's storage is not read)."""
    cse = next((t["storage_m"] for t in _cse(table) if t["storage_m"] is not None), None)
    an = _by(table)["fsl_an"]["storage_m"]
    return None if cse is None or an is None else cse / an


def _storage_diverged(p: Preset) -> bool:
    """Whether a run of the storage measurement diverged (its row has no measured storage or copies)."""
    return any(r["storage_params"] is None or r["server_copies"] is None for r in p.storage)


# C5's growth per added client by the spec, in the parts' parameter counts: the spec's |w| is P_c + P_s and |a|
# is P_a (named so: a "|" splits a table cell)
GROWTH = {"cse_fsl": "P_c + P_a", "fsl_mc": "P_c + P_s", "fsl_an": "P_c + P_s + P_a"}
PARTS = {"P_c": "client_params", "P_s": "server_params", "P_a": "aux_params"}


def _c5_records(table, p: Preset) -> list[dict[str, Any]]:
    """What C5's rule reads: the storage measurement's rows (``p.storage``) with their growth per added client,
    and CSE-FSL's storage over FSL_AN's at ``STORAGE_N``; without a measurement (a Table V alone, one n), the
    ratio on the table."""
    if not p.storage:
        return [{"quantity": "ratio", "ratio": _storage_ratio(table)}]
    if _storage_diverged(p):  # C5 is untestable (``_c5_rule``)
        return []
    growth = _growth(p.storage)
    rows = [{**r, "growth": growth.get((r["method"], r["clients"]))} for r in p.storage]
    at = {(r["method"], r["clients"]): r["storage_params"] for r in p.storage}
    if STORAGE_N in (r["clients"] for r in p.storage):
        rows.append({"quantity": "ratio", "ratio": at["cse_fsl", STORAGE_N] / at["fsl_an", STORAGE_N]})
    return rows


def _c5_rule(table, p: Preset) -> Threshold | All | Untestable:
    """The spec's C5 on the storage measurement: CSE-FSL one server-side model at every n; between consecutive n
    its storage grows by exactly P_c + P_a per added client, FSL_MC's by |w| = P_c + P_s and FSL_AN's by |w| + |a|
    (the runs' model's counts); CSE-FSL's storage below 0.4× FSL_AN's at n = 5 (``SHARED``). A Table V alone
    (one n) judges only that ratio."""
    if not p.storage:
        if _storage_ratio(table) is None:
            return Untestable("no run of CSE-FSL or of FSL_AN completed: no storage to compare")
        return SHARED
    if _storage_diverged(p):
        return Untestable("a run of the storage measurement diverged: no storage measured there")
    sizes, ns = p.storage[0], sorted({r["clients"] for r in p.storage})

    def exact(metric: str, bound: int, method: str, n: int, unit: str = "") -> Threshold:  # a single run's value
        return Threshold(metric, "==", bound, {"method": method, "clients": n}, unit=unit, digits=0)

    parts = [(f"CSE-FSL copies at n={n}:", exact("server_copies", 1, "cse_fsl", n)) for n in ns]
    for m, name in GROWTH.items():
        grows = sum(sizes[PARTS[x]] for x in name.split(" + "))
        unit = f"params per client (= {name})"
        parts += [(f"{_label(m)} n={a}→{b}:", exact("growth", grows, m, b, unit)) for a, b in zip(ns, ns[1:])]
    return All([*parts, (f"n={STORAGE_N}:", SHARED)])


def _c5_text(table, p: Preset) -> str:
    if not p.storage:
        return "C5 CSE-FSL keeps one server-side model; storage < 0.4× FSL_AN"
    ns = ", ".join(str(n) for n in sorted({r["clients"] for r in p.storage}))
    return (
        f"C5 CSE-FSL keeps one server-side model at n = {ns}; its storage grows by P_c + P_a per client, FSL_MC's "
        f"by P_c + P_s (the whole model), FSL_AN's by P_c + P_s + P_a; < 0.4× FSL_AN at n = {STORAGE_N}"
    )


def _c2_rule(table, p) -> All:
    """Each CSE-FSL row of small h (1 < h <= 5; all of them when there are none) at most 3 pp below FSL_AN,
    paired by seed."""
    small = [t for t in _cse(table) if 1 < int(t["method"].split("h=")[1]) <= 5] or _cse(table)
    return All((f"{x['method']} vs FSL_AN - 3 pp", _acc(x["method"], cell(method="fsl_an") - 3.0)) for x in small)


def _c6_rule(table, p) -> Paired:
    """The ordered server against the randomly ordered one at the random run's h, within 1.5 pp."""
    return _acc(f"cse_fsl h={p.random_h}", f"cse_fsl h={p.random_h} random", "within", 1.5)


def _c7_rule(table, p):
    """C7 needs the problem it claims to fix: FSL_OC more than 1 pp below the better of FSL_MC / FSL_AN in the
    means (the paper: 73.74 vs 80.55 on CIFAR); otherwise untestable."""
    by = _by(table)
    # the means are over the seeds that completed; a method none of whose seeds did has none (NaN)
    oc, best = by["fsl_oc"]["accuracy"], finite([by["fsl_mc"]["accuracy"], by["fsl_an"]["accuracy"]])[0]
    if not (math.isfinite(oc) and best):
        return Untestable("no run of FSL_OC, or none of FSL_MC and FSL_AN, completed: no means to compare")
    if oc >= max(best) - 1:
        return Untestable("FSL_OC is not more than 1 pp below FSL_MC/AN in the means: no problem to fix")
    return All((("h=1 vs FSL_OC - 1 pp", _acc("cse_fsl h=1", cell(method="fsl_oc") - 1.0)),))


def _c8_rule(table, p) -> Paired:
    """Non-IID: CSE-FSL at the random run's h more than ``NONIID_GAP`` below FSL_MC, paired by seed."""
    return _acc(f"cse_fsl h={p.random_h}", "fsl_mc", "less", NONIID_GAP)


def _c9_rule(table, p) -> All:
    """Table V's non-IID order, best first: each method above the next, paired by seed."""
    ms = ["fsl_mc", "fsl_an", "fsl_oc", f"cse_fsl h={p.random_h}"]
    short = ["MC", "AN", "OC", "CSE"]
    return All((f"{a} > {b}", _acc(x, y)) for a, b, x, y in zip(short, short[1:], ms, ms[1:]))


def _text(text: str) -> Callable[[Any, Preset], str]:
    """A claim's text naming its preset's randomly ordered h (``{h}``), target (``{target}``, %) and the
    non-IID gap (``{gap}``)."""
    return lambda t, p: text.format(h=p.random_h, target=100 * p.target, gap=NONIID_GAP)


def seeded(text: str, declared, noniid: bool = False) -> Claim:
    """A claim whose declared rule reads the per-seed final accuracies (``Preset.records``; untestable without
    them or with fewer than 2 seeds; a diverged run's seed leaves the pairs); a ``noniid`` claim reads none on an
    IID preset, so it is left out there."""
    records = lambda t, p: p.records if p.noniid or not noniid else []  # noqa: E731

    def rule(t, p) -> Untestable | Paired | All:
        if not (seeds := {r["seed"] for r in records(t, p)}) and (p.noniid or not noniid):
            return NO_RECORDS
        return NO_PAIRS if len(seeds) == 1 else declared(t, p)

    return Claim(_text(text), None, declared=rule, records=records)


def _one(text: str, rule: Threshold | Untestable, value: Callable | None = None) -> Claim:
    """A claim on the table itself: ``rule`` on the one value ``value(table)`` (a deterministic one)."""
    return Claim(_text(text), None, declared=rule, records=value and (lambda t, p: [{rule.metric: value(t)}]))


NO_SEEDS = Untestable("the load to reach the target has no per-seed record (the table: its seed mean)")
NO_PAIRS = Untestable("fewer than 2 seeds, no paired test")
NO_RECORDS = Untestable("no per-seed records (Preset.records: the seeds of table.md); Table V holds their means")
EXACT = Threshold("mismatches", "==", 0, digits=0, unit="methods off the closed form")
SHARED = Threshold("ratio", "<", 0.4, {"quantity": "ratio"}, unit="× FSL_AN's storage")
C8 = "C8 non-IID: CSE-FSL h={h} more than {gap:g} pp below FSL_MC (paper, h=5: 42.33 vs 61.17 %)"
# Each claim's one verdict is its declared rule's (``Claim.declared``) on the per-seed final accuracies
# (``records``: a table's ``seeds``, see ``seed_records``) or, for the deterministic C1 and C5, thresholds (C1
# on the table, C5 on the storage measurement at several n, ``_c5_rule``). Minimum effects: the spec's 3 pp of
# "similar accuracy" (C2, one-sided: a CSE row above FSL_AN is no failure), 1.5 pp of Fig. 6's order
# invariance (C6), the 1 pp of C7, NONIID_GAP (C8), 0 for C9's order.
C5 = Claim(_c5_text, None, declared=_c5_rule, records=_c5_records)
CLAIMS = [
    _one("C1 measured bytes equal the closed forms (every method, every round)", EXACT, _mismatches),
    seeded("C2 CSE-FSL with small h within 3 pp of FSL_AN at equal rounds", _c2_rule),
    _one("C3 less load to reach {target:.0f} % test accuracy: CSE (h>1) < FSL_AN < FSL_MC", NO_SEEDS),
    C5,
    seeded("C6 ordered vs randomly ordered server within 1.5 pp (Fig. 6)", _c6_rule),
    seeded("C7 CSE-FSL h=1 >= FSL_OC (+clip) - 1 pp (testable only if FSL_OC is > 1 pp below FSL_MC/AN)", _c7_rule),
    seeded(C8, _c8_rule, noniid=True),
    seeded("C9 non-IID ordering of Table V: FSL_MC > FSL_AN > FSL_OC > CSE-FSL h={h}", _c9_rule, noniid=True),
]
CLAIM_COLS = [Col("claim", attrgetter("claim")), Col("verdict (declared rule)", verdict_cell)]


def claims_table(table: list[dict[str, Any]], p: Preset) -> str:
    """The claims on Table V and its per-seed records (``p.records``), each with its declared rule's verdict and
    interval: ``table.md``'s and the page's claim table."""
    return layout(CLAIM_COLS, judge(CLAIMS, table, p))


# ---- the report: table.md, table.csv and the figures -------------------------------------------------------
def markdown(table, p: Preset, scale: str, seeds: list[int], wall: float, reused: str = "") -> str:
    """``table.md``: Table V and the claims as the page shows them, and the per-seed final accuracies the claims'
    rules read (``seed_records`` of this file: the page reads them from it too)."""
    split, noniid = f"{p.clients} IID clients", ""
    if p.noniid:
        split = f"{p.clients} non-IID clients ({p.partition['shards_per_client']} label-sorted shards each)"
        noniid = ", its non-IID column: 2 label-sorted shards per client"
    head = (
        f"# CSE-FSL reproduction (Table V / Fig. 9 style)\n\nScale `{scale}`, dataset `{p.dataset['name']}` "
        f"({split}, B = {p.batch_size}, lr {p.lr}, {p.rounds} rounds, model `{p.model['name']}`), seeds "
        f"{seeds}, wall {wall:.0f} s{reused}.\nThe paper's columns are its CIFAR-10 Table V (5 clients, 200 epochs"
        f"{noniid}); accuracies are not comparable across datasets, the load *ratios* and the storage structure "
        "are.\n\n"
    )
    listing = "Per-seed final accuracies (%):\n\n" + "".join(
        f"- {t['method']}: {', '.join(map(_seed_acc, t['accs']))}\n" for t in table
    )
    p.records = seed_records(head + listing)
    return head + page_table(table, p) + "\n## Claims (spec §9.3)\n\n" + claims_table(table, p) + "\n" + listing


# table.csv's columns: Table V's (the paper's beside ours), then the checks of the measured load and storage
CSV_COLUMNS = ["method", "accuracy", "accuracy_std", "load_gib", "load_ratio", "storage_m", "server_copies"]
CSV_COLUMNS += ["load_to_target_gib", "paper_acc", "paper_load", "paper_load_ratio", "paper_storage"]
CSV_COLUMNS += ["load_formula_gib", "load_exact", "storage_formula_m", "uploads_per_client"]


def plots(results: list[dict[str, Any]], out: Path) -> None:
    """Fig. 9a (accuracy against load), accuracy against rounds and against smashed uploads (Fig. 4), each the
    mean over the seeds that completed with a band (a diverged run's curve would cut the others short); the
    randomly ordered server dashed."""
    curves = {k: [r["rows"] for r in rs if completed(r)] for k, rs in group(results, itemgetter("key")).items()}
    styles = {k: {"ls": "--"} for k in curves if "random" in k}
    common = {"y": "test_accuracy", "yscale": 100, "ylabel": "test accuracy (%), mean over seeds", "styles": styles}
    figures = {  # file -> x, its label, whether its axis is logarithmic, its scale
        "fig9_accuracy_vs_load": ("load_bytes", "communication load (GiB, labels excluded)", True, 1 / GIB),
        "accuracy_vs_rounds": ("round", "round (epoch)", False, 1.0),
        "accuracy_vs_uploads": ("smashed_uploads_per_client", "smashed-data uploads per client", True, 1.0),
    }
    for name, (x, xlabel, logx, xscale) in figures.items():
        plot_curves(curves, out / f"{name}.png", x=x, xlabel=xlabel, logx=logx, xscale=xscale, **common)


def plan(opts) -> Plan:
    """The preset of ``--scale`` / ``--dataset`` and its points; the context is the preset and the seeds."""
    from fedweave.registry import DATASETS

    dataset = opts.dataset or ("cifar10" if opts.scale == "paper" else "fashion_mnist")
    known_datasets([dataset], "--dataset")
    p = preset(opts.scale, dataset)
    # the split models take images (C, H, W): other samples are one line naming --dataset before any run
    options = {k: v for k, v in p.dataset.items() if k != "name"}
    if len(shape := DATASETS.get(p.dataset["name"])(**options).input_shape) != 3:
        raise ConfigError(
            f"--dataset: {p.dataset['name']!r} holds samples of shape {shape}, not images (C, H, W), which the split "
            "models take; give an image dataset such as fashion_mnist, mnist, digits or cifar10"
        )
    if opts.scale == "storage" and opts.seeds not in (None, 1):
        raise ConfigError(f"--seeds: the storage scale runs one seed (storage is deterministic); got {opts.seeds}")
    seeds = list(range(opts.seeds if opts.seeds is not None else p.seeds))
    return Plan(jobs(p, seeds, Path(opts.out), storage=opts.scale == "storage"), (p, seeds, {}))


def record(point: Point, res: Result, plan: Plan) -> dict[str, Any]:
    """A run as a record: its rows with the split model's sizes and the clients' samples, rebuilt from its config
    (a run read back from disk has no algorithm object) once per data, model and seed. A run that diverged before
    its first evaluation has no rows: a record marked diverged, reported as such beside the others."""
    from fedweave.algorithms.base import RunContext, build_algorithm

    c, facts = point.config, plan.context[2]
    key = json.dumps([c.dataset.to_dict(), c.partition.to_dict(), c.model.to_dict(), c.seed], sort_keys=True)
    if key not in facts:
        algo = build_algorithm(RunContext(c))
        facts[key] = algo.split_sizes, [len(part) for part in algo.ctx.partition]
    sizes, samples = facts[key]
    return {
        "key": dict(point.values)["key"],
        "seed": point.seed,
        "method": c.algorithm.name,
        "clients": len(samples),
        "h": c.algorithm.options.get("h", 1),
        "status": res.summary["status"] if res.metrics else "diverged",
        "run_dir": str(res.run_dir),
        "rows": res.metrics,
        "sizes": sizes,
        "samples": samples,
        "wall": res.summary["wall_seconds"],
    }


def report(results: list[dict[str, Any]], plan: Plan, opts, wall: float) -> Report:
    """Table V (markdown and CSV), the claims and the figures; exit 1 when a measured load is not its formula."""
    p, seeds, _ = plan.context
    if plan.skipped:  # Table V's load ratios and per-seed lists need every run (the finished ones are kept)
        what = "the storage measurement" if opts.scale == "storage" else "Table V"
        raise ConfigError(f"cse-fsl: {what} needs every run; {not_run(plan.skipped).strip()}; rerun to finish them")
    if opts.scale == "storage":
        return storage_report(results, p, wall, plan.reused_note())
    table = summarize(results, p)
    status = 0 if all(t["load_exact"] for t in table) else 1
    md = markdown(table, p, opts.scale, seeds, wall, plan.reused_note())
    files = {"table.md": md, "table.csv": Rows(table, CSV_COLUMNS)}
    return Report(files, "table.md", status, figures=lambda out: plots(results, out))


# ---- C5: the storage measurement (``--scale storage``) ---------------------------------------------------
def storage_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run of the storage measurement: the method, n, the storage (parameters) and server-side
    copies the run measured (its last round) beside their closed forms, and the parts' parameter counts
    (P_c, P_s, P_a: what C5's growth per client is compared with). A run that diverged measured none (None)."""
    rows = []
    for r in results:
        m, n, sizes = r["method"], r["clients"], r["sizes"]
        last = r["rows"][-1] if completed(r) else {}
        rows.append(
            {
                "method": m,
                "clients": n,
                "storage_params": last.get("storage_params"),
                "storage_formula": storage_params(m, sizes, n),
                "server_copies": last.get("server_copies"),
                "copies_formula": server_copies(m, n),
                "client_params": sizes.client,
                "server_params": sizes.server,
                "aux_params": sizes.aux,
            }
        )
    return rows


def _growth(rows: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """Each method's measured storage growth per added client since its previous n, by (method, n); none beside
    a run that diverged."""
    growth = {}
    for m, rs in group(sorted(rows, key=itemgetter("clients")), itemgetter("method")).items():
        for q, r in zip(rs, rs[1:]):
            if None not in (q["storage_params"], r["storage_params"]):
                growth[m, r["clients"]] = (r["storage_params"] - q["storage_params"]) / (r["clients"] - q["clients"])
    return growth


def storage_table(rows: list[dict[str, Any]]) -> str:
    """The storage measurement as the page shows it: per method and n, the measured storage and copies beside
    the closed forms, and the growth per added client since the previous n."""
    growth = _growth(rows)
    cols = [
        Col("method", lambda r: _label(r["method"])),
        Col("n", "clients"),
        Col("storage (params)", "storage_params", ",", "diverged"),
        Col("storage, closed form", "storage_formula", ","),
        Col("server copies", "server_copies", "", "diverged"),
        Col("copies, closed form", "copies_formula"),
        Col("growth per added client", lambda r: growth.get((r["method"], r["clients"])), ",.0f"),
    ]
    return layout(cols, rows)


def storage_report(results: list[dict[str, Any]], p: Preset, wall: float, reused: str = "") -> Report:
    """The storage measurement (``storage.md``, ``storage.csv``) and C5 judged on it; exit 1 when a measured
    storage or copy count is not its closed form (a run that diverged measured none: C5 is untestable)."""
    rows = p.storage = storage_rows(results)
    s = rows[0]
    head = (
        f"# CSE-FSL server storage at several n (claim C5)\n\nScale `storage`, dataset `{p.dataset['name']}` "
        f"(model `{p.model['name']}`: P_c = {s['client_params']:,}, P_s = {s['server_params']:,}, "
        f"P_a = {s['aux_params']:,}; IID clients, B = {p.batch_size}, {p.rounds} round, seed 0, CSE-FSL h = "
        f"{p.random_h}), n = {', '.join(map(str, STORAGE_CLIENTS))}, wall {wall:.0f} s{reused}.\nStorage is "
        "the server's in parameters, Table V's convention: its server-side copies and the received client models (and "
        "auxiliary nets).\n\n"
    )
    md = head + storage_table(rows) + "\n## Claim C5 (spec §9.3)\n\n" + layout(CLAIM_COLS, judge([C5], [], p))
    ok = all(
        r["storage_params"] == r["storage_formula"] and r["server_copies"] == r["copies_formula"]
        for r in rows
        if r["storage_params"] is not None
    )
    return Report({"storage.md": md, "storage.csv": Rows(rows)}, "storage.md", 0 if ok else 1)


# ---- the page's generated sections -------------------------------------------------------------------------
# the committed Tables V beside the page, ``table-<name>.csv`` and ``.md``: (name, its scale and dataset), each
# judged with the storage measurement of its dataset's model (``storage-<dataset>.csv``, ``--scale storage``)
PAGE_TABLES = (("fashion_mnist", "small", "fashion_mnist"), ("fashion_mnist-noniid", "noniid", "fashion_mnist"))
PAGE_TABLES += (("digits", "small", "digits"),)


def sections(folder: Path) -> dict[str, str]:
    """docs/reproductions/cse-fsl.md's generated sections: the closed forms of §1 and the readings of the
    committed tables that the prose states; each storage measurement; and per committed Table V, the claims
    judged again with its preset, the page's Table V and the wall time its file states."""
    reports = {f"storage-{d}.csv": ("storage", d, "storage.csv") for *_, d in PAGE_TABLES}
    reports |= {f"table-{n}.{x}": (s, d, f"table.{x}") for n, s, d in PAGE_TABLES for x in ("csv", "md")}
    if gone := next((f for f in reports if not (folder / f).is_file()), None):
        scale, dataset, written = reports[gone]
        raise ConfigError(
            f"{folder / gone} is missing: the page's sections read it, the {written} that `fedweave reproduce cse-fsl "
            f"--scale {scale} --dataset {dataset}` writes, copied there"
        )
    out = {
        "models": models_section(),
        "table-v": table_v_section(),
        "digits-bytes": digits_bytes_section(),
        "h1-vs-an": h1_vs_an_section(folder),
        "noniid-gaps": gaps_section(folder),
    }
    storage = {d: read_csv(folder / f"storage-{d}.csv") for *_, d in PAGE_TABLES}
    out |= {f"storage-{d}": storage_table(rows) for d, rows in storage.items()}
    for name, scale, dataset in PAGE_TABLES:
        table, p = read_csv(folder / f"table-{name}.csv"), preset(scale, dataset)
        p.records = seed_records((folder / f"table-{name}.md").read_text(encoding="utf-8"))
        p.storage = storage[dataset]
        out[f"claims-{name}"] = claims_table(table, p)
        out[f"table-{name}"] = page_table(table, p)
        out[f"wall-{name}"] = wall_section(folder, f"table-{name}.md")
    return out


def _label(method: str) -> str:
    """A method as the page names it: FSL_MC, FSL_OC (+clip), CSE-FSL h=5, CSE-FSL h=5, random order."""
    name = method.replace("cse_fsl", "CSE-FSL").replace(" random", ", random order")
    return {"fsl_oc": "FSL_OC (+clip)"}.get(method, name.upper() if method.startswith("fsl") else name)


def _mib(t: dict[str, Any]) -> float | None:
    return None if t["load_to_target_gib"] is None else 1024 * t["load_to_target_gib"]


def _acc_cell(t: dict[str, Any], seeds: list[dict[str, Any]]) -> str:
    """Table V's accuracy: the mean over the seeds that completed and how many of its ``seeds`` (records)
    diverged, ``(k/n diverged)``; ``diverged (n/n)`` when none completed."""
    bad = sum(not math.isfinite(r["accuracy"]) for r in seeds)
    if not math.isfinite(t["accuracy"]):
        return f"diverged ({bad}/{len(seeds)})"
    return f"{t['accuracy']:.2f}" + (f" ({bad}/{len(seeds)} diverged)" if bad else "")


def page_table(table: list[dict[str, Any]], p: Preset) -> str:
    """The page's Table V of one committed ``table-*.csv``: accuracy (mean, std), load and storage with the
    paper's CIFAR-10 numbers (the non-IID column: accuracy per seed and the paper's non-IID accuracy); a run that
    diverged is counted beside the accuracy, and a load or storage of a method none of whose runs completed is —."""
    per = group(p.records, itemgetter("method"))
    cols = [
        Col("method", lambda t: _label(t["method"])),
        Col("acc (%)", lambda t: _acc_cell(t, per.get(t["method"], []))),
        Col("± std", "accuracy_std", ".2f"),
    ]
    load = Col("load / FSL_MC", "load_ratio", ".3f")
    if p.noniid:
        seeds = Col("per seed", lambda t: ", ".join(_seed_acc(r["accuracy"]) for r in per.get(t["method"], [])))
        return layout([*cols, seeds, load, Col("paper non-IID acc (%)", "paper_acc", ".2f")], table)
    digits = p.dataset["name"] == "digits"
    cols += [
        Col("load (GiB)", "load_gib", ".4f"),
        load,
        Col("storage (M)" if digits else "storage (M params)", "storage_m", ".4f"),
        Col("copies" if digits else "server copies", "server_copies"),
        Col(f"load to reach {100 * p.target:.0f} % (MiB)", _mib, ".1f"),
    ]
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
        paper = PAPER_TABLE_V[dataset]  # its keys: the three baselines, then CSE-FSL by h
        computed = [table_v_row(dataset, k) for k in paper]
        hs = [k.removeprefix("cse_fsl ") for k in list(paper)[3:]]
        lines = ["| | FSL_MC | FSL_OC | FSL_AN | CSE " + " | ".join(hs) + " |", "|" + "---|" * (len(paper) + 1)]
        for i, what in ((0, "load (GiB)"), (1, "storage (M)")):
            mine, theirs = [c[i] for c in computed], [v[2 + i] for v in paper.values()]
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
        paragraph(
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
    fixed = 2 * n * (sizes.client + sizes.aux) * FLOAT_BYTES  # the paper's float32 convention (spec A8)
    return paragraph(
        f"The spec's §9.3 digits numbers also hold: {' / '.join(f'{b:,}' for b in per_round)} bytes per round "
        f"(FSL_MC and FSL_OC, FSL_AN and CSE-FSL h = 1, then CSE-FSL h = {', '.join(str(h) for h in p.hs[1:])}), "
        f"and storage of {' / '.join(f'{s:,}' for s in store)} parameters (FSL_MC / FSL_OC / FSL_AN / CSE-FSL) "
        f"at n = {n}. Of a CSE-FSL round, the client models and auxiliary nets going down and up, "
        f"2n(P_c + P_a)·4 bytes, are a fixed {fixed:,} B whatever h."
    )


def h1_vs_an_section(folder: Path) -> str:
    """Fig. 9a's CSE-FSL h = 1 against FSL_AN at their equal load on IID Fashion-MNIST: the seed means and the
    per-seed gaps of the committed table, on the seeds where both completed (a diverged run has no accuracy)."""
    table = _by(read_csv(folder / "table-fashion_mnist.csv"))
    records = seed_records((folder / "table-fashion_mnist.md").read_text(encoding="utf-8"))
    per = group([r for r in records if math.isfinite(r["accuracy"])], itemgetter("method"))
    gaps = seed_gaps(per.get("fsl_an", []), per.get("cse_fsl h=1", []), "accuracy")
    means = (
        f"{_seed_acc(table['cse_fsl h=1']['accuracy'])} vs {_seed_acc(table['fsl_an']['accuracy'])} % in the seed means"
    )
    if not gaps:
        return paragraph(f"CSE-FSL h = 1 against FSL_AN at their equal load: {means}; no seed where both completed.")
    return paragraph(
        f"CSE-FSL h = 1 against FSL_AN at their equal load: {means}, higher on {sum(g > 0 for g in gaps)} of the "
        f"{len(gaps)} seeds (per-seed gaps {signed(min(gaps))} to {signed(max(gaps))} pp)."
    )


def gaps_section(folder: Path) -> str:
    """Each method's seed-mean gap to FSL_MC on IID and non-IID Fashion-MNIST beside the paper's CIFAR-10 ones
    (Table V): what the non-IID verdict compares."""
    ours = {x: _by(read_csv(folder / f"table-fashion_mnist{f}.csv")) for x, f in (("IID", ""), ("non-IID", "-noniid"))}
    acc = {f"{x} (pp)": {k: t["accuracy"] for k, t in by.items()} for x, by in ours.items()}
    acc |= {
        f"paper CIFAR-10 {x} (pp)": {k: v[i] for k, v in PAPER_TABLE_V["cifar10"].items()} for i, x in enumerate(ours)
    }

    def gap(a: dict[str, float]) -> Callable[[str], str]:  # none where a method did not run or no seed completed
        return lambda k: signed(a[k] - a["fsl_mc"]) if k in a and math.isfinite(a[k] - a["fsl_mc"]) else "—"

    methods = [k for k in ours["non-IID"] if k != "fsl_mc"]
    return layout([Col("method", _label), *(Col(h, gap(a)) for h, a in acc.items())], methods)


def wall_section(folder: Path, f: str) -> str:
    """The wall time the committed table file states: that of the invocation that wrote it (runs it reused
    from an earlier invocation count nothing: its note says how many there were)."""
    wall, reused = stated(folder / f, r"wall (\d+) s" + REUSED_NOTE + r"\.")
    seconds = int(wall)
    text = (
        f"Wall time of the invocation that wrote `cse-fsl/{f}`: {seconds:,} s ({seconds / 60:.0f} min){reused or ''}."
    )
    return paragraph(text)


STUDY = Study(
    name="cse-fsl",
    description=__doc__.split("\n\n")[0],
    scales=("smoke", "small", "noniid", "paper", "storage"),
    scale_help="noniid: the small preset with 2 label-sorted shards per client (Table V's non-IID column); "
    "storage: the dataset's model at n = 2, 5, 10, one round of each method (claim C5)",
    seeds_help="number of seeds, 0..N-1 (default 3; paper 5)",
    options=(option("--dataset", default=None, help="fashion_mnist (small default), mnist, digits, or cifar10"),),
    plan=plan,
    record=record,
    report=report,
    sections=sections,
)
main = STUDY.main
