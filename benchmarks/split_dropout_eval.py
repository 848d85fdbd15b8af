"""Effect of testing with dropout on (the CSE-FSL authors' code never calls ``model.eval()``) versus eval
mode (fedweave) on the F-EMNIST split model, trained by CSE-FSL on an F-EMNIST-shaped MNIST slice.

    python benchmarks/split_dropout_eval.py [--rounds 10] [--seeds 0 1 2]

Prints, per seed, the test accuracy of the same final weights in eval mode and with dropout on (mean over
``--draws`` dropout masks).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import load


def config(seed: int, rounds: int) -> dict:
    return {
        "name": "dropout-eval",
        "seed": seed,
        "rounds": rounds,
        "threads": 1,
        "dataset": {"name": "mnist", "max_train": 3000, "max_test": 2000},
        "partition": {"name": "iid", "num_clients": 5},
        "model": {"name": "split_femnist", "aux": "mlp"},
        "algorithm": {"name": "cse_fsl", "h": 5},
        "local": {"epochs": 1, "batch_size": 20, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--draws", type=int, default=5)
    args = ap.parse_args()
    for flag in ("rounds", "draws"):
        if (value := getattr(args, flag.replace("-", "_"))) < 1:
            ap.error(f"--{flag} must be at least 1, got {value}")
    if min(args.seeds) < 0:  # checked here: the run's config refused it only after the seeds before it had run
        ap.error(f"--seeds must be at least 0 (a run's seed), got {min(args.seeds)}")
    torch.set_num_threads(1)
    for seed in args.seeds:
        algo = build_algorithm(RunContext(load(config(seed, args.rounds))))
        for r in range(args.rounds):
            algo.run_round(r)
        reported = algo.evaluate(args.rounds - 1)["test_accuracy"]
        model = nn.Sequential(algo.client, algo.server)
        vector_to_parameters(torch.cat([algo.xc, algo.xs]), model.parameters())
        ds = algo.ctx.dataset
        model.eval()
        eval_acc = accuracy(model, ds.test_x, ds.test_y)
        model.train()  # dropout 0.25 (client) and 0.5 (server) active, as in the authors' test loop
        torch.manual_seed(seed)
        on = [accuracy(model, ds.test_x, ds.test_y) for _ in range(args.draws)]
        print(
            f"seed {seed}: eval mode {100 * eval_acc:.2f}% (run reports {100 * reported:.2f}%), "
            f"dropout on {100 * sum(on) / len(on):.2f}% (min {100 * min(on):.2f}, max {100 * max(on):.2f})"
        )


if __name__ == "__main__":
    main()
