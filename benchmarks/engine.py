"""Engine benchmark: per-round local-training time of fedweave's backends against a hand-written loop.

Workloads (issue targets in brackets):
  cnn:      FedAvg, MNIST, CNN (conv 1-32-5, pool, conv 32-64-5, pool, fc 1024-512-10), 100 clients
            Dirichlet(0.3), 10 per round, 1 epoch, batch 32   [loop <= 1.15x hand-written]
  logistic: softmax regression on MNIST, 100 clients all participating, same local settings
            [vmap >= 4x faster than loop]
For both: [auto within 10% of the best backend]. With 2 or more threads the pool backend (one-thread worker
processes) runs too; auto picks it for the CNN then.

Memory: the peak of the whole process tree (this process and the pool's workers, sampled every 0.1 s while the
workload runs: PSS divides the pages the forked workers share with the driver among them, RSS counts them
once per process), printed per workload and per process (each process's own peak), so that a regression shows
in the same output as the times, and where it lives. The
workloads run one after another in this process, so a later one's peak includes what the earlier left.

The hand-written loop is what one would write without a framework: one reused model, torch.optim.SGD,
the same batch indices, the same start weights; every variant's local updates are first checked against
it. Every variant runs the same rounds side by side in this process, so the ratios compare like with like.

Usage: python benchmarks/engine.py [--rounds 3] [--threads N] [--workload cnn logistic]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import numpy as np
import torch

from fedweave.config import LocalConfig
from fedweave.data.partition import dirichlet
from fedweave.execution import LocalTrainer, choose_backend
from fedweave.memory import PeakMemory
from fedweave.models import build_model
from fedweave.registry import DATASETS
from fedweave.seeding import Seeds

WORKLOADS = {
    "cnn": {"model": "cnn_mnist", "clients_per_round": 10},
    "logistic": {"model": "logistic", "clients_per_round": 100},
}


def hand_written_round(model, x, y, batches_per_client, start, lr):
    """A plain PyTorch FedAvg round: reset the reused model per client, SGD over its batches."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())
    finals = []
    for batches in batches_per_client:
        torch.nn.utils.vector_to_parameters(start.clone(), params)  # (it aliases its argument)
        for b in batches:
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
        finals.append(torch.nn.utils.parameters_to_vector(params).detach())
    return torch.stack(finals)


def check_same_updates(workload, trainers, ref_model, ds, seeds, k, start, local, steps=3) -> None:
    """The timing is void unless every variant computes the hand-written loop's local updates. They are not
    bit-identical (`w - lr * d` vs SGD's fused in-place add, channels-last vs NCHW kernels, batched kernels
    summing in another order), and over a full epoch on the CNN such rounding differences grow chaotically:
    the hand-written loop itself, at 1 vs 2 threads, differed by up to 7e-2 relative after one epoch. So the
    updates are compared after a few local steps, relative to their size."""
    short = dataclasses.replace(local, epochs=None, steps=steps)
    clients = np.sort(seeds.numpy("client_sampling", 0).choice(100, k, replace=False))
    batches = [trainers["loop"].client_batches(int(c), 0, (), steps) for c in clients]
    ref = hand_written_round(ref_model, ds.train_x, ds.train_y, batches, start, local.lr)
    for b, tr in trainers.items():
        tr = copy.copy(tr)  # the same backend (and pool) with the short local settings
        tr.local = short
        out = tr.train(start, clients, 0).params
        rel = ((out - ref).norm() / (ref - start).norm()).item()
        print(f"  [{workload}] {b}: update after {steps} local steps vs hand-written, relative difference {rel:.1e}")
        assert rel < 1e-3, f"{workload}: {b}'s local updates differ from the hand-written loop's by {rel:.1e}"


def bench(workload: str, rounds: int) -> dict[str, float]:
    spec = WORKLOADS[workload]
    ds = DATASETS.get("mnist")()
    seeds = Seeds(0)
    parts = dirichlet(ds.train_y.numpy(), 100, seeds.numpy("partition"), alpha=0.3, min_size=10)
    local = LocalConfig(epochs=1, batch_size=32, lr=0.05)
    local.validate()
    # The start weights come from the run's ``model_init`` stream, as a run's do: unseeded, they changed from run
    # to run, and so did the check below (the CNN's loop after 3 steps differed from the hand-written loop by 7e-7
    # from one start, by 2.2e-3 from another, failing about one run in three)
    torch.manual_seed(seeds.int_seed("model_init"))
    model = build_model(spec["model"], (1, 28, 28), 10)
    k = spec["clients_per_round"]
    backends = ("loop", "vmap", "pool") if torch.get_num_threads() >= 2 else ("loop", "vmap")
    trainers = {b: LocalTrainer(model, ds.train_x, ds.train_y, parts, local, seeds, backend=b) for b in backends}
    auto = choose_backend("auto", model, k)
    start = trainers["loop"].layout.flatten()
    ref_model = build_model(spec["model"], (1, 28, 28), 10)
    times: dict[str, list[float]] = {"hand-written": [], **{b: [] for b in backends}}
    check_same_updates(workload, trainers, ref_model, ds, seeds, k, start, local)
    for r in range(rounds + 1):  # round 0 warms up
        clients = np.sort(seeds.numpy("client_sampling", r).choice(100, k, replace=False))
        batches = [trainers["loop"].client_batches(int(c), r, (), None) for c in clients]
        t = time.perf_counter()
        hand_written_round(ref_model, ds.train_x, ds.train_y, batches, start, local.lr)
        dt = {"hand-written": time.perf_counter() - t}
        for b, tr in trainers.items():
            t = time.perf_counter()
            tr.train(start, clients, r)
            dt[b] = time.perf_counter() - t
        if r > 0:
            for name, v in dt.items():
                times[name].append(v)
    res = {name: float(np.median(v)) for name, v in times.items()}
    res["auto"] = res[auto]
    res["auto_choice"] = auto
    res["best"] = min(res[b] for b in backends)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    for w in args.workload:
        with PeakMemory() as mem:
            r = bench(w, args.rounds)
        hw = r["hand-written"]
        print(f"\n[{w}] seconds per round (local training of the round's clients)")
        for name in ("hand-written", "loop", "vmap", "pool", "auto"):
            if name not in r:
                continue
            extra = f" (chose {r['auto_choice']})" if name == "auto" else ""
            print(f"  {name:13s} {r[name]:8.3f} s   {r[name] / hw:5.2f}x hand-written{extra}")
        print(f"  loop / hand-written = {r['loop'] / hw:.2f}  (target <= 1.15)")
        print(f"  loop / vmap         = {r['loop'] / r['vmap']:.2f}  (logistic target >= 4)")
        print(f"  auto / best backend = {r['auto'] / r['best']:.2f}  (target <= 1.10)")
        gib = {k: v / 2**30 for k, v in mem.peak.items()}
        print(
            f"  peak memory of the process tree ({mem.processes} processes): PSS {gib['pss']:.3f} GB "
            f"(anonymous {gib['anon']:.3f}), summed RSS {gib['rss']:.3f} GB"
        )
        for i, (pid, peak) in enumerate(mem.per_process.items()):  # the root first: this process
            who = "this process" if i == 0 else f"worker {pid}"
            print(
                f"    {who:14s} peak PSS {peak['pss'] / 2**30:.3f} GB (anonymous {peak['anon'] / 2**30:.3f}), "
                f"RSS {peak['rss'] / 2**30:.3f} GB"
            )


if __name__ == "__main__":
    main()
