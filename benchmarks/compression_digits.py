"""Accuracy against uploaded bytes for each compressor: FedAvg on scikit-learn's digits (docs/compression.md).

Logistic regression (650 parameters, float32) on digits, Dirichlet(0.5) over 20 clients, 5 clients per round,
40 rounds of one local epoch (batch 32, lr 0.1), seeds 0, 1, 2; every compressor of docs/compression.md at
one setting, and the dense uploads. ``run`` writes each run's evaluated rows (round, cumulative bytes up,
test accuracy) to ``records.csv``; ``render`` draws ``accuracy-vs-bytes.png`` and writes ``table.md`` from
that file alone (tests/test_compression.py rebuilds both from the committed records).

Usage: python benchmarks/compression_digits.py [--out docs/compression] [--seeds 3]   (about 2 minutes)
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

SETTINGS = {  # label -> compression.upload (None: dense)
    "dense": None,
    "topk 5% (EF)": {"name": "topk", "ratio": 0.05},
    "randk 10% (EF)": {"name": "randk", "ratio": 0.1, "error_feedback": True},
    "qsgd s=4": {"name": "qsgd", "levels": 4},
    "efsign (EF)": {"name": "efsign"},
    "int8": {"name": "int8"},
}
ROUNDS = 40
TARGET = 0.90  # the accuracy of the table's "bytes to reach" column
COLUMNS = ("setting", "seed", "round", "bytes_up", "test_accuracy")


def config(upload: dict | None, seed: int) -> dict:
    """The run of one setting and seed."""
    return {
        "name": "compression-digits",
        "seed": seed,
        "rounds": ROUNDS,
        "backend": "loop",
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": 20, "alpha": 0.5},
        "model": {"name": "logistic"},
        "algorithm": {"name": "fedavg", "clients_per_round": 5},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.1},
        "compression": {"upload": upload},
        "output": {"progress": False, "plots": False},
    }


def run(out: Path, seeds: int) -> Path:
    """Run every setting and seed; write their rows to ``out/records.csv``."""
    import fedweave

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, upload in SETTINGS.items():
            for seed in range(seeds):
                res = fedweave.run(config(upload, seed), run_dir=Path(tmp) / f"{len(rows)}")
                rows += [
                    (label, seed, m["round"], m["bytes_up"], round(m["test_accuracy"], 6))
                    for m in res.metrics
                    if m["round"] > 0
                ]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(COLUMNS)
        w.writerows(rows)
    return out / "records.csv"


def _read(records: Path) -> dict[str, dict[int, list[tuple[int, int, float]]]]:
    out: dict[str, dict[int, list[tuple[int, int, float]]]] = {}
    with open(records, newline="") as f:
        for r in csv.DictReader(f):
            rows = out.setdefault(r["setting"], {}).setdefault(int(r["seed"]), [])
            rows.append((int(r["round"]), int(r["bytes_up"]), float(r["test_accuracy"])))
    return out


def table(records: Path) -> str:
    """The Markdown table of ``records``: bytes per round, final accuracy over the seeds, bytes to TARGET."""
    data = _read(records)
    dense = statistics.mean(rows[-1][1] for rows in data["dense"].values())
    lines = [
        f"| setting | uploaded after {ROUNDS} rounds | vs dense | final test accuracy (mean ± sd, "
        f"{len(data['dense'])} seeds) | bytes up to reach {TARGET:.0%} (mean of the seeds that do) |",
        "|---|---|---|---|---|",
    ]
    for label, seeds in data.items():
        total = statistics.mean(rows[-1][1] for rows in seeds.values())
        finals = [rows[-1][2] for rows in seeds.values()]
        reach = [next((b for _, b, a in rows if a >= TARGET), None) for rows in seeds.values()]
        hit = [b for b in reach if b is not None]
        reached = (
            f"{statistics.mean(hit) / 1e3:,.1f} kB ({len(hit)}/{len(reach)})" if hit else f"never (0/{len(reach)})"
        )
        lines.append(
            f"| {label} | {total / 1e3:,.1f} kB | {total / dense:.3f} | "
            f"{statistics.mean(finals):.4f} ± {statistics.pstdev(finals):.4f} | {reached} |"
        )
    return "\n".join(lines) + "\n"


def render(records: Path, out: Path) -> list[Path]:
    """``accuracy-vs-bytes.png`` (mean test accuracy over the seeds against the mean cumulative bytes up, log
    scale) and ``table.md``, from ``records`` alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _read(records)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, seeds in data.items():
        runs = list(seeds.values())
        n = min(len(r) for r in runs)
        x = [statistics.mean(r[i][1] for r in runs) for i in range(n)]
        y = [statistics.mean(r[i][2] for r in runs) for i in range(n)]
        ax.plot(x, y, label=label, marker=".", markersize=3)
    ax.set_xscale("log")
    ax.set_xlabel("bytes uploaded (all clients, cumulative)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"FedAvg on digits, logistic, {ROUNDS} rounds, mean of {len(runs)} seeds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out / "accuracy-vs-bytes.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    (out / "table.md").write_text(table(records))
    return [png, out / "table.md"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the committed folder of the checkout, wherever the script is run from (not ./docs/compression of the cwd)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "compression")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {args.seeds}")
    try:  # before the runs: a folder that cannot be made failed with a traceback after two minutes of them
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out}: cannot make this folder ({e.strerror})")
    for p in render(run(args.out, args.seeds), args.out):
        print(p)


if __name__ == "__main__":
    main()
