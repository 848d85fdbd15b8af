"""Accuracy vs epsilon: DP-FedAvg with a fixed clip and with adaptive clipping, and DP-FTRL at DP-FedAvg's epsilons,
on MNIST (docs/privacy.md).

The base config is ``benchmarks/privacy/dp_fedavg_mnist.yaml``: 1,000 clients (Dirichlet 0.5), Poisson sampling
of 100 expected clients per round (q = 0.1), a logistic model, 4 local steps of batch 16, 40 rounds, delta = 1e-5,
Opacus's RDP accountant.
The points: no privacy (the same run without the ``privacy`` section), DP-FedAvg with clip 0.5 and noise
multipliers 0.8, 1.2 and 2.0, and adaptive clipping (Andrew et al. 2021: from C = 0.1 towards the median norm,
eta_C = 0.2, sigma_b = 100 / 20) at the same noise multipliers; DP-FTRL (no amplification: each client once per
epoch of 10 rounds in a shuffled order, a tree per epoch) and DP-FedAvg accounted without amplification (q = 1),
each with sigma calibrated to each DP-FedAvg point's epsilon; 3 seeds each.

    python benchmarks/privacy.py run [--workers 2]   # runs the grid, writes benchmarks/privacy/records.json
    python benchmarks/privacy.py run --only DP-FTRL  # runs the points so named, replacing their records
    python benchmarks/privacy.py table [--docs]       # the table from the records (--docs: into docs/privacy.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "benchmarks" / "privacy" / "dp_fedavg_mnist.yaml"
RECORDS = ROOT / "benchmarks" / "privacy" / "records.json"
DOCS = ROOT / "docs" / "privacy.md"
BEGIN, END = "<!-- privacy-table:begin -->", "<!-- privacy-table:end -->"
SEEDS = (0, 1, 2)
SIGMAS = (0.8, 1.2, 2.0)
# point label -> overrides of the base config (None: the privacy section removed)
POINTS: dict[str, list[str] | None] = {"no privacy": None}
for z in SIGMAS:
    POINTS[f"DP-FedAvg, C = 0.5, sigma = {z:g}"] = [f"privacy.noise_multiplier={z}"]
for z in SIGMAS:
    POINTS[f"adaptive clipping, gamma = 0.5, sigma = {z:g}"] = [
        f"privacy.noise_multiplier={z}",
        "privacy.adaptive=true",
        "privacy.clip=0.1",
        "privacy.target_quantile=0.5",
        "privacy.clip_lr=0.2",
    ]
EPOCH = 10  # rounds per epoch: 1,000 clients, 100 per round
for z in SIGMAS:
    POINTS[f"DP-FTRL, C = 0.5, epsilon of sigma = {z:g}"] = [
        "privacy.mechanism=ftrl",
        "privacy.noise_multiplier=auto",
        f"privacy.restart_every={EPOCH}",
    ]
for z in SIGMAS:  # the paper's other baseline: DP-FedAvg accounted without amplification, at the same epsilons
    POINTS[f"DP-FedAvg without amplification (q = 1), epsilon of sigma = {z:g}"] = [
        "privacy.amplification=none",
        "privacy.noise_multiplier=auto",
    ]


def dp_fedavg_epsilon(z: float, data: dict) -> float:
    """Epsilon of the DP-FedAvg point with noise multiplier ``z`` (Opacus's RDP accountant, q = 0.1)."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(z, data["algorithm"]["clients_per_round"] / data["partition"]["num_clients"], data["rounds"])]
    return float(acc.get_epsilon(delta=data["privacy"]["delta"]))


def epochs(seed: int, num_clients: int, per_round: int, rounds: int) -> list[list[int]]:
    """Each client once per epoch: a shuffled order of all clients per epoch, cut into rounds (DP-FTRL's pattern)."""
    import numpy as np

    rng = np.random.default_rng([seed, 28])
    plan: list[list[int]] = []
    while len(plan) < rounds:
        order = rng.permutation(num_clients)
        plan += [sorted(order[i : i + per_round].tolist()) for i in range(0, num_clients, per_round)]
    return plan[:rounds]


def one(label: str, seed: int, out: str) -> dict:
    """Run one point and seed; its record."""
    from fedweave.config import apply_overrides, from_dict, read_yaml_file
    from fedweave.runner import run

    data = read_yaml_file(BASE)
    overrides = POINTS[label]
    if overrides is None:
        data.pop("privacy")
        overrides = []
    if "epsilon of sigma" in label:  # calibrated to the epsilon of the DP-FedAvg point with that sigma
        z = float(label.rsplit("= ", 1)[1])
        overrides = [*overrides, f"privacy.target_epsilon={dp_fedavg_epsilon(z, data)!r}"]
    if label.startswith("DP-FTRL"):  # each client once per epoch, a tree per epoch
        n, k = data["partition"]["num_clients"], data["algorithm"]["clients_per_round"]
        data["sampler"] = {"name": "schedule", "clients": epochs(seed, n, k, data["rounds"])}
    cfg = from_dict(apply_overrides(data, [*overrides, f"seed={seed}"]))
    res = run(cfg, run_dir=Path(out) / f"{label.replace(' ', '').replace(',', '_')}-{seed}", overwrite=True)
    dp = res.summary.get("privacy") or {}
    return {
        "point": label,
        "seed": seed,
        "final_test_accuracy": res.summary["final_test_accuracy"],
        "epsilon": dp.get("epsilon"),
        "delta": dp.get("delta"),
        "noise_multiplier": dp.get("noise_multiplier"),
        "final_clip": dp.get("clip"),
        "sample_rate": dp.get("sample_rate"),
        "rounds": res.summary["rounds"],
        "wall_seconds": res.summary["wall_seconds"],
    }


def cmd_run(args: argparse.Namespace) -> None:
    chosen = [label for label in POINTS if label.startswith(args.only or "")]
    jobs = [(label, seed) for label in chosen for seed in SEEDS]
    with ProcessPoolExecutor(args.workers) as pool:
        fresh = list(pool.map(one, *zip(*jobs), [args.out] * len(jobs)))
    kept = json.loads(RECORDS.read_text()) if args.only and RECORDS.exists() else []
    kept = [r for r in kept if r["point"] not in chosen]
    order = list(POINTS)
    records = sorted(kept + fresh, key=lambda r: (order.index(r["point"]), r["seed"]))
    RECORDS.write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))


def table(records: list[dict]) -> str:
    """The accuracy-vs-epsilon table: per point, the final test accuracy (mean ± std over seeds), epsilon at
    delta (the same for every seed: it depends on sigma, q and the rounds only) and the final clip."""
    lines = [
        "| point | test accuracy (mean ± std, 3 seeds) | epsilon at delta = 1e-5 | final clip C (mean) |",
        "|---|---|---|---|",
    ]
    points = list(dict.fromkeys(r["point"] for r in records))
    for p in points:
        rs = [r for r in records if r["point"] == p]
        accs = [100 * r["final_test_accuracy"] for r in rs]
        eps = {round(r["epsilon"], 6) for r in rs if r["epsilon"] is not None}
        clips = [r["final_clip"] for r in rs if r["final_clip"] is not None]
        eps_text = ", ".join(f"{e:.2f}" for e in sorted(eps)) or "∞ (no privacy)"
        clip_text = f"{statistics.mean(clips):.3f}" if clips else "–"
        lines.append(f"| {p} | {statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f} | {eps_text} | {clip_text} |")
    return "\n".join(lines)


def docs_with_table(text: str, records: list[dict]) -> str:
    """docs/privacy.md's text with the table between its markers generated from ``records``."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(records)}\n{END}{tail}"


def cmd_table(args: argparse.Namespace) -> None:
    records = json.loads(RECORDS.read_text())
    if args.docs:
        DOCS.write_text(docs_with_table(DOCS.read_text(), records))
    print(table(records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--out", default=str(ROOT / "runs" / "privacy-bench"))
    r.add_argument("--only", help="run only the points whose label starts with this; the others' records are kept")
    r.set_defaults(fn=cmd_run)
    t = sub.add_parser("table")
    t.add_argument("--docs", action="store_true", help="write the table into docs/privacy.md")
    t.set_defaults(fn=cmd_table)
    args = parser.parse_args(argv)
    if args.command == "run" and args.workers < 1:
        r.error(f"--workers must be at least 1, got {args.workers}")
    if args.command == "run" and args.only is not None and not any(label.startswith(args.only) for label in POINTS):
        # else nothing ran and the records were written again unchanged, as if the points had run
        starts = sorted({label.split(",")[0] for label in POINTS})
        r.error(f"--only {args.only!r} begins no point's label; the labels begin with: {'; '.join(starts)}")
    from fedweave.config import ConfigError

    try:
        args.fn(args)
    except ConfigError as e:  # a run refused its config (Opacus missing, ...): its one line, not a worker's traceback
        parser.exit(2, f"privacy.py: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
