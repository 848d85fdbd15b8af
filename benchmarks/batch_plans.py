"""Batch-plan benchmark: the vectorised ``LocalTrainer.plan`` against the per-job plan it replaced.

The cross-device logistic workload of ``benchmarks/peers.py`` (MNIST, 1,000 clients Dirichlet(0.3), 50 per
round, 1 local epoch, batch 10): the plan of each round's call, built by the old per-job code (kept below for
this comparison only: a Python loop over jobs and over their batches) and by ``LocalTrainer.plan``, interleaved
in one process, round after round (per round, the best of ``--reps`` alternate builds of each). Every plan is
checked to be the same (indices, mask, steps) before it is timed. Also printed: the local training of the same
round on the ``vmap`` backend, so the share of the plan in a round is seen.

Usage: python benchmarks/batch_plans.py [--rounds 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from fedweave.config import LocalConfig
from fedweave.data.partition import dirichlet
from fedweave.execution import LocalTrainer
from fedweave.execution.local import Batches
from fedweave.models import build_model
from fedweave.registry import DATASETS
from fedweave.seeding import Seeds


def old_plan(tr: LocalTrainer, clients, round: int, key: tuple[int, ...], steps: int | None) -> Batches:
    """``LocalTrainer.plan`` as it was before it was vectorised (for comparison only)."""
    per_job = [tr.client_batches(int(c), round, key, steps) for c in clients]
    T = max((len(b) for b in per_job), default=0)
    K, B = len(per_job), tr.local.batch_size
    if tr.local.full_batch:
        B = max((len(b[0]) for b in per_job if b), default=1)
    index = torch.zeros((T, K, B), dtype=torch.long, device="cpu")
    mask = torch.zeros((T, K, B), dtype=torch.bool, device="cpu")
    for k, batches in enumerate(per_job):
        for t, b in enumerate(batches):
            index[t, k, : len(b)] = b
            mask[t, k, : len(b)] = True
    return Batches(index, mask, torch.tensor([len(b) for b in per_job], dtype=torch.long, device="cpu"))


def same(a: Batches, b: Batches) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("index", "mask", "steps"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5, help="alternate repetitions of each builder per round")
    args = ap.parse_args()
    for flag in ("rounds", "threads", "clients", "per-round", "batch-size", "reps"):
        if (value := getattr(args, flag.replace("-", "_"))) < 1:
            ap.error(f"--{flag} must be at least 1, got {value}")
    if args.clients * 10 > 60_000:  # the partition's min_size of 10 samples a client, of MNIST's 60,000
        ap.error(f"--clients must be at most 6000 (10 of MNIST's 60,000 samples each), got {args.clients}")
    if args.per_round > args.clients:
        ap.error(f"--per-round must be at most --clients ({args.clients}), got {args.per_round}")
    torch.set_num_threads(args.threads)
    ds = DATASETS.get("mnist")()
    seeds = Seeds(0)
    parts = dirichlet(ds.train_y.numpy(), args.clients, seeds.numpy("partition"), alpha=0.3, min_size=10)
    local = LocalConfig(epochs=1, batch_size=args.batch_size, lr=0.05)
    local.validate()
    model = build_model("logistic", (1, 28, 28), 10)
    tr = LocalTrainer(model, ds.train_x, ds.train_y, parts, local, seeds, backend="vmap")
    start = tr.layout.flatten()
    times: dict[str, list[float]] = {"old plan": [], "new plan": [], "vmap round": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        clients = np.sort(seeds.numpy("client_sampling", r).choice(args.clients, args.per_round, replace=False))
        assert same(old_plan(tr, clients, r, (), None), tr.plan(clients, r, (), None)), f"round {r}: plans differ"
        best = {"old plan": np.inf, "new plan": np.inf}
        for _ in range(args.reps):  # alternately, the best of a few: a 2 ms call is easily preempted
            for name, fn, fn_args in (
                ("old plan", old_plan, (tr, clients, r, (), None)),
                ("new plan", tr.plan, (clients, r, (), None)),
            ):
                t = time.perf_counter()
                fn(*fn_args)
                best[name] = min(best[name], time.perf_counter() - t)
        t = time.perf_counter()
        tr.train(start, clients, r)
        best["vmap round"] = time.perf_counter() - t
        if r:
            for name, v in best.items():
                times[name].append(v)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{torch.get_num_threads()} threads, {args.rounds} rounds (median of rounds 2..R+1), {args.clients} clients, "
        f"{args.per_round} per round, batch {args.batch_size}; load average {load}"
    )
    for name, v in times.items():
        print(f"  {name:10s} min {1e3 * min(v):8.3f} ms   median {1e3 * statistics.median(v):8.3f} ms")
    ratio = [o / n for o, n in zip(times["old plan"], times["new plan"])]
    print(f"  old / new plan, per round: min {min(ratio):.2f}x, median {statistics.median(ratio):.2f}x")
    for name in ("old plan", "new plan"):
        share = statistics.median(times[name]) / statistics.median(times["vmap round"])
        print(f"  {name}: {100 * share:.1f}% of the median vmap round's local training (which builds the new plan)")


if __name__ == "__main__":
    main()
