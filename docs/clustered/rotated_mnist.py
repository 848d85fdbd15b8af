"""Rotated MNIST, IFCA's clustered setting (Ghosh et al. 2020, Sec. 5.2): the clients fall into 4 groups, and
group k sees MNIST rotated by k * 90 degrees. IFCA with 4 clusters against FedAvg (and IFCA with 1 cluster,
which is FedAvg), each evaluated as IFCA is: every client's model on the client's own rotated test rows.
``--methods`` adds IFCA with weight sharing, and CFL against FedAvg with every client in every round.

    python docs/clustered/rotated_mnist.py --rounds 30 --seeds 0 1 2 --out runs/rotated_mnist

Each run writes its own directory under ``--out`` (an existing one is refused, not overwritten).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import fedweave
from fedweave.registry import DATASETS

GROUPS = 4  # rotations of 0, 90, 180, 270 degrees


def rotated_mnist(clients: int, train_rows: int, test_rows: int, seed: int) -> tuple:
    """(train_x, train_y, test_x, test_y, train_users, test_users): ``train_rows`` and ``test_rows`` distinct MNIST
    images per client, client u's rotated by (u mod 4) * 90 degrees."""
    ds, rng = DATASETS.get("mnist")(), np.random.default_rng(seed)

    def draw(x: torch.Tensor, y: torch.Tensor, per: int) -> tuple:
        idx = torch.as_tensor(rng.permutation(len(x))[: clients * per])
        users = np.repeat(np.arange(clients), per)
        xs = x[idx].clone()
        for k in range(1, GROUPS):
            mine = torch.as_tensor(users % GROUPS == k)
            xs[mine] = torch.rot90(xs[mine], k, dims=(-2, -1))
        return xs, y[idx], users

    (tx, ty, tu), (vx, vy, vu) = draw(ds.train_x, ds.train_y, train_rows), draw(ds.test_x, ds.test_y, test_rows)
    return tx, ty, vx, vy, tu, vu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--clients", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("runs/rotated_mnist"))
    ap.add_argument("--methods", nargs="+", default=["ifca k=4", "fedavg", "ifca k=1"], help="the rows to run")
    args = ap.parse_args()
    rows = {
        "ifca k=4": ("ifca", {"clusters": GROUPS}),
        "fedavg": ("fedavg", {}),
        "ifca k=1": ("ifca", {"clusters": 1}),
        "ifca k=4 shared body": ("ifca", {"clusters": GROUPS, "share_body": True}),
        # CFL needs every client in every round (its clients_per_round is the run's clients)
        # eps1, eps2 read off the update norms of a first run (mean 0.21, max 0.94 at round 6, seed 0)
        "cfl": ("clustered_fl", {"clients_per_round": args.clients, "warmup": 5, "eps1": 0.25, "eps2": 0.7}),
        "fedavg all clients": ("fedavg", {"clients_per_round": args.clients}),
    }
    if unknown := set(args.methods) - set(rows):
        ap.error(f"--methods: unknown {sorted(unknown)}; allowed: {', '.join(map(repr, rows))}")
    methods = {k: rows[k] for k in args.methods}
    print("| method | seed | test accuracy | worst client | clusters used | MiB moved |")
    print("|---|---|---|---|---|---|")
    for seed in args.seeds:
        data = rotated_mnist(args.clients, 500, 100, seed)
        for label, (name, opts) in methods.items():
            cfg = {
                "name": f"rotated-{name}",
                "seed": seed,
                "rounds": args.rounds,
                "dataset": {"name": "python"},
                "partition": {"name": "natural", "num_clients": 0},
                "model": {"name": "mlp", "hidden": [200]},
                "algorithm": {"name": name, "clients_per_round": 10, **opts},  # opts may set all clients
                "local": {"epochs": 1, "batch_size": 50, "lr": 0.1},
                # FedAvg on the clients' own test rows, as IFCA always evaluates
                "eval": {"personal_test": True} if name == "fedavg" else {},
                "output": {"progress": False, "plots": False},
            }
            last = fedweave.run(cfg, dataset=data, run_dir=args.out / f"{label.replace(' ', '')}-seed{seed}").metrics[
                -1
            ]
            used = last.get("clusters_used", last.get("clusters", ""))
            print(
                f"| {label} | {seed} | {100 * last['test_accuracy']:.2f} % | {100 * last['test_accuracy_min']:.2f} % "
                f"| {used if used == '' else int(used)} | {last['bytes_total'] / 2**20:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
