"""The comparison page of the baselines (docs/benchmarks.md): every centralized and personalized method on the
same seeds, partitions and evaluation, with mean ± std over seeds.

The grid is the product of ``METHODS`` (named in ``GLOBAL`` and ``PERSONAL``: adding a method is adding its name),
the datasets of the scale, ``SPLITS`` and the seeds. Every run holds out 25 % of each client's own samples as its
test set (``eval.holdout: 0.25``, PFLlib's split) and evaluates the global model on them (``eval.personal_test``),
so that every method is scored on the same per-client test sets: the global model for a global method, each
client's personal model for a personalized one. A run's record (``record``) holds, for its final round, the global
model's accuracy on the test split, that client-test accuracy, its worst client's and the spread between them,
and the bytes sent (the ledger's ``bytes_total``) until the client-test accuracy first reached the scale's target.

``report`` writes the per-seed records (``records.csv``) and the tables (``tables.md``, one declared layout,
``COLS``) into ``--out``; with ``--page docs/benchmarks.md`` it also rewrites the page's generated block
(``<!-- generated: baselines -->``, ``experiments.pages``) with the same tables, and with ``--from-records FILE``
it rebuilds them from committed records without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from operator import itemgetter
from pathlib import Path
from typing import Any

from fedweave.config import ConfigError
from fedweave.experiments import pages
from fedweave.experiments.aggregate import group, per_cell, to_target
from fedweave.experiments.grid import Point
from fedweave.experiments.study import Plan, Report, Rows, Study, choices, option
from fedweave.experiments.tables import Col, layout, mean_std_cell, pm_of, read_csv
from fedweave.registry import ALGORITHMS, DATASETS
from fedweave.runner import Result

MIB = 2**20
NAME = "baselines"  # the page's generated block


@dataclass(frozen=True)
class Method:
    """A method of the page: its row label and algorithm (with the algorithm's own defaults), whether it is
    personalized (scored with its personal models) and what it changes in the ``model`` section (FedBN's
    batch-norm layers)."""

    key: str
    personal: bool = False
    model: dict[str, Any] = field(default_factory=dict)


# The page's methods, in its order: the global ones, then the personalized ones; adding a method is adding its name.
GLOBAL = ["fedavg", "fedprox", "scaffold", "fedadam", "fedyogi", "fedadagrad", "fedavgm", "fedcm", "feddyn", "fedsam"]
GLOBAL += ["mofedsam", "fedmim", "fednova", "fedexp", "moon", "fedlc", "qfedavg", "afl"]
PERSONAL = ["fedper", "fedrep", "lg_fedavg", "apfl", "ditto_star", "pfedme", "perfedavg", "fedbn", "fedbabu"]
PERSONAL += ["fedproto", "ifca"]
# the methods without a global model: their clients' own models are scored under the plain names (test_accuracy)
NO_GLOBAL = tuple(k for k in PERSONAL if not getattr(ALGORITHMS.get(k), "global_model", True))
MODELS = {"fedbn": {"norm": "batch"}}
METHODS = [Method(k, k in PERSONAL, MODELS.get(k, {})) for k in GLOBAL + PERSONAL]
BY_KEY = {m.key: m for m in METHODS}

# the label-skewed splits of the page: Dirichlet(0.1) over clients per class, and exactly 2 classes per client
SPLITS = {
    "dir0.1": {"name": "dirichlet", "alpha": 0.1, "min_size": 10},
    "path2": {"name": "pathological", "classes_per_client": 2},
}
SPLIT_TEXT = {"dir0.1": "Dirichlet α = 0.1", "path2": "pathological, 2 classes per client"}


@dataclass(frozen=True)
class Preset:
    """What one scale runs, the same for every method: the model per dataset, the rounds, the client-test accuracy
    per dataset whose bytes-to-reach the page reports, the local training and the clients."""

    models: dict[str, str]
    rounds: int
    targets: dict[str, float]
    local: dict[str, Any] = field(default_factory=lambda: {"epochs": 1, "batch_size": 32, "lr": 0.05})
    eval_every: int = 5
    dataset_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per dataset: its own options
    clients: int = 100
    per_round: int = 10
    seeds: int = 3


# paper: the papers' CNNs; small: cnn_small and fewer rounds, 20,000 training images (15,000 after the hold-out)
# keeping a run near 20 s on a loaded 2-core machine; smoke: a pipeline check of about a second a run, on 2,000
# training images (or any registered image dataset, as the tests' own)
SMALL_MNIST, SMOKE_MNIST = {"max_train": 20000}, {"max_train": 2000, "max_test": 500}
PRESETS = {
    "paper": Preset({"mnist": "cnn_mnist", "fashion_mnist": "cnn_fmnist"}, 200, {"mnist": 0.95, "fashion_mnist": 0.80}),
    "small": Preset(
        {"mnist": "cnn_small", "fashion_mnist": "cnn_small"},
        20,
        {"mnist": 0.80, "fashion_mnist": 0.70},
        dataset_options={"mnist": SMALL_MNIST, "fashion_mnist": SMALL_MNIST},
    ),
    "smoke": Preset(
        {},
        2,
        {},
        {"epochs": 1, "batch_size": 16, "lr": 0.05},
        1,
        {"mnist": SMOKE_MNIST, "fashion_mnist": SMOKE_MNIST},
        clients=10,
        per_round=5,
        seeds=1,
    ),
}


def jobs(p: Preset, datasets: list[str], methods: list[Method], seeds: list[int], out: Path) -> list[Point]:
    """One run per (dataset, split, method, seed), in ``OUT/runs/<dataset>/<split>/<method>-s<seed>``; the
    datasets first, so that a budget that runs out leaves whole datasets done."""
    points = []
    for ds, (split, partition), m, s in product(datasets, SPLITS.items(), methods, seeds):
        name = f"{ds}/{split}/{m.key}-s{s}"
        config = {
            "name": f"baselines-{ds}-{split}-{m.key}",
            "seed": s,
            "rounds": p.rounds,
            "threads": 1,
            "dataset": {"name": ds, **p.dataset_options.get(ds, {})},
            "partition": {**partition, "num_clients": p.clients},
            "model": {"name": p.models.get(ds, "cnn_small"), **m.model},
            "algorithm": {"name": m.key, "clients_per_round": p.per_round},
            "local": dict(p.local),
            "eval": {"every": p.eval_every, "holdout": 0.25, "personal_test": True},
            "output": {"dir": str(out / "runs" / name), "plots": False, "progress": False},
        }
        points.append(Point.of(config, name, dataset=ds, split=split, method=m.key))
    return points


def record(point: Point, res: Result, plan: Plan) -> dict[str, Any]:
    """A finished run as one per-seed row of the page (accuracies in %, bytes in MiB; ``mib_to_target`` None where
    the target was not reached). The client-test accuracy is the personal models' for a personalized method, the
    global model's on the clients' own test sets (``eval.personal_test``) otherwise; the worst client's is its
    ``_min``. Per-client accuracies, once the records hold them, give the worst 10 % and the std across clients."""
    v = dict(point.values)
    m, p = BY_KEY[v["method"]], plan.context["preset"]
    metric = "test_accuracy_personal" if m.personal and m.key not in NO_GLOBAL else "test_accuracy"
    rows = [r for r in res.metrics if metric in r]
    out = {"dataset": v["dataset"], "split": v["split"], "method": m.key, "seed": point.seed}
    out["status"] = res.summary["status"]
    if not rows or out["status"] != "completed":  # diverged: its numbers are NaN, counted as such in the cells
        nans = dict.fromkeys(["global_acc", "client_acc", "worst_client_acc", "spread"], math.nan)
        return {**out, "rounds": rows[-1]["round"] if rows else 0, **nans, "mib_to_target": None, "mib_total": math.nan}
    last = rows[-1]
    mean, worst = last[metric], last[f"{metric}_min"]
    target = p.targets.get(v["dataset"])
    reach = to_target(rows, metric, target, "bytes_total") if target is not None else None
    return {
        **out,
        "rounds": last["round"],
        "global_acc": 100 * last["test_accuracy_global"] if m.key not in NO_GLOBAL else math.nan,
        "client_acc": 100 * mean,
        "worst_client_acc": 100 * worst,
        "spread": 100 * (mean - worst),
        "mib_to_target": None if reach is None else reach / MIB,
        "mib_total": last["bytes_total"] / MIB,
    }


# records.csv's columns (a report of no finished run still has its header)
COLUMNS = ["dataset", "split", "method", "seed", "status", "rounds", "global_acc", "client_acc", "worst_client_acc"]
COLUMNS += ["spread", "mib_to_target", "mib_total"]

# ---- the tables: one layout for tables.md and the page's block -------------------------------------------------
# the published numbers beside ours, per (dataset, split, method): (number, source, note). None found whose
# setting matches (see the page's notes): an entry is added here only with its paper and table.
PUBLISHED: dict[tuple[str, str, str], tuple[str, str, str]] = {}


def _reach(rs: list[dict[str, Any]]) -> str:
    """Mean ± std of the MiB to the target over the seeds that reached it, and how many did when not all."""
    got = [r["mib_to_target"] for r in rs if r["mib_to_target"] is not None]
    if not got:
        return "not reached"
    cell = mean_std_cell(got, nd=1)
    return cell if len(got) == len(rs) else f"{cell} ({len(got)}/{len(rs)} seeds)"


def _no_target(cell: dict[str, Any]) -> str:
    return "no target at this scale"


def _published(cell: dict[str, Any]) -> str:
    pub = PUBLISHED.get((cell["dataset"], cell["split"], cell["method"]))
    return f"{pub[0]} ({pub[1]})" if pub else "no matching published setting"


# the accuracies' columns; a cell (dataset, split, method) is its seeds, their accuracies and the MiB to target
ACCURACIES = {
    "global_acc": "global acc (%)",
    "client_acc": "client acc (%)",
    "worst_client_acc": "worst client (%)",
    "spread": "spread (pp)",
}
CELL = {"seeds": len, **{key: pm_of(key) for key in ACCURACIES}, "reach": _reach}
CELL["global_acc"] = lambda rs: "no global model" if rs[0]["method"] in NO_GLOBAL else pm_of("global_acc")(rs)
KIND = {**dict.fromkeys(GLOBAL, "global"), **dict.fromkeys(PERSONAL, "personal"), "ifca": "clustered"}
COLS = [Col("method", "method"), Col("kind", lambda c: KIND[c["method"]])]
COLS += [Col("seeds", "seeds"), *(Col(head, key) for key, head in ACCURACIES.items())]


def section(records: list[dict[str, Any]], context: dict[str, Any], source: str = "") -> str:
    """The tables (one per dataset and split, a row per method in the records' order, ``COLS`` then the MiB to
    the scale's target and the published number) and the runs of the grid that have no record: those a time
    budget left unrun, or, rebuilt from the records file ``source``, those it does not hold."""
    parts = []
    cells = per_cell(records, ("dataset", "split", "method"), CELL)
    for (ds, split), rows in group(cells, itemgetter("dataset", "split")).items():
        target = context["preset"].targets.get(ds)
        # a scale without a target for the dataset (smoke) has nothing to reach: "not reached" would say it missed one
        reach = Col(f"MiB to {100 * target:.0f} %", "reach") if target is not None else Col("MiB to target", _no_target)
        table = layout([*COLS, reach, Col("published", _published)], rows)
        parts.append(f"### {ds}, {SPLIT_TEXT.get(split, split)}\n\n{table}")
    have = {(r["dataset"], r["split"], r["method"], int(r["seed"])) for r in records}
    grid = product(context["datasets"], SPLITS, [m.key for m in context["methods"]], context["seeds"])
    gone = ", ".join("/".join(map(str, run)) for run in grid if run not in have)
    why = f"No record in {source} (--from-records) of" if source else "Not run (the time budget ran out):"
    return "\n".join(parts) + (f"\n{why} {gone}.\n" if gone else "")


# ---- the study ---------------------------------------------------------------------------------------------
def plan(opts) -> Plan:
    """The preset of ``--scale`` restricted to ``--datasets`` / ``--methods``; nothing to run with
    ``--from-records``. The files named are checked before anything runs (``--page``'s existence by the pipeline,
    its block here)."""
    p = PRESETS[opts.scale]
    if opts.scale == "smoke":  # any registered image dataset (the tests use a synthetic one), checked before a run
        datasets = choices(opts.datasets, DATASETS.names(), "--datasets") or ["mnist"]
        if opts.datasets and (flat := [d for d in datasets if len(_shape(d, p)) != 3]):
            raise ConfigError(
                f"--datasets: {flat[0]!r} holds samples of shape {_shape(flat[0], p)}, not images (C, H, W), which "
                "the page's CNNs take; give an image dataset"
            )
    else:
        datasets = choices(opts.datasets, list(p.models), "--datasets") or list(p.models)
    methods = [BY_KEY[k] for k in choices(opts.methods, list(BY_KEY), "--methods") or BY_KEY]
    seeds = list(range(opts.seeds if opts.seeds is not None else p.seeds))
    context = {"preset": p, "datasets": datasets, "methods": methods, "seeds": seeds}
    if opts.from_records:
        _check_records(opts.from_records)
    if opts.page:
        pages.fill(Path(opts.page).read_text(encoding="utf-8"), {NAME: ""}, f"--page {opts.page}")
    if opts.from_records:
        return Plan([], context)
    return Plan(jobs(p, context["datasets"], methods, seeds, Path(opts.out)), context)


def _shape(dataset: str, p: Preset) -> tuple[int, ...]:
    """A dataset's sample shape, with the preset's options for it."""
    return DATASETS.get(dataset)(**p.dataset_options.get(dataset, {})).input_shape


def _check_records(path: str) -> None:
    """``--from-records``: a records.csv this study wrote (a file with its columns), else one line naming it."""
    if not Path(path).is_file():
        raise ConfigError(f"--from-records: {path} is not a file (a records.csv of this study)")
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline().strip().split(",")
    if missing := [c for c in COLUMNS if c not in header]:
        raise ConfigError(
            f"--from-records: {path} is not a records.csv of this study (no column {missing[0]!r}); give the "
            "records.csv a `fedweave reproduce baselines` invocation wrote"
        )


def report(records: list[dict[str, Any]], plan: Plan, opts, wall: float) -> Report:
    """``records.csv`` and ``tables.md`` in ``--out``; the page's generated block with ``--page``."""
    records = read_csv(opts.from_records) if opts.from_records else records
    files: dict[str, Any] = {} if opts.from_records else {"records.csv": Rows(records, COLUMNS)}
    files["tables.md"] = text = section(records, plan.context, opts.from_records or "")
    if opts.page:
        pages.update(opts.page, {NAME: f"\n{text}\n"})
    return Report(files, show="tables.md", say=f"{len(records)} records, wall {wall:.0f} s")


STUDY = Study(
    name="baselines",
    description=__doc__.split("\n\n")[0],
    scales=("smoke", "small", "paper"),
    scale_help="small: cnn_small, 20 rounds; paper: cnn_mnist / cnn_fmnist, 200 rounds; smoke: 2 rounds",
    seeds_help="number of seeds, 0..N-1 (default 3)",
    options=(
        option("--datasets", default=None, help="comma list: mnist, fashion_mnist (default both)"),
        option("--methods", default=None, help="comma list of the page's methods (default all)"),
        option("--page", default=None, help="also rewrite the generated block of this page (docs/benchmarks.md)"),
        option("--from-records", default=None, help="rebuild the tables from this records.csv; run nothing"),
    ),
    plan=plan,
    record=record,
    report=report,
)
main = STUDY.main
