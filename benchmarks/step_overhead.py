"""Step-overhead benchmark: the cross-device workloads' rounds against a plain PyTorch loop and the machine's
matmul rate, measured side by side in one process (issue 31, target 1).

Workloads (``benchmarks/peers.py``'s: MNIST, FedAvg, 1,000 clients Dirichlet(0.3), 50 per round, 1 local
epoch, batch 10, lr 0.05, the global model evaluated on the 10k test images every round):
  logistic: softmax regression;   mlp: 784-64-10 MLP.

Per round, interleaved, the same sampled clients and batches:
  fedweave:  ``run_round`` (local training, aggregation) and ``evaluate`` of the run built from the peers
             benchmark's config with ``backend`` (default ``auto``) and ``threads``;
  plain:     the loop a careful user writes without a framework: one reused model, ``torch.optim.SGD`` over
             fedweave's batch indices, a sample-weighted average, then inference-mode evaluation in batches
             of 2048 (the peers' evaluation);
  matmul:    the matrix products of the MLP's training steps alone, shaped and batched as the engine computes
             them (backend ``loop``: per job and step, forward ``x W^T``, weight gradient ``dz^T h`` and the
             input gradient ``dz W`` of every layer above the first on ``batch``-row batches; backend ``vmap``:
             the same as ``bmm`` over the round's jobs), at this process's thread count: the dense matmul rate
             those shapes reach on this machine now.
Printed: min and median per round of each; fedweave's training rate = the FLOPs of those products for every
trained sample (forward and weight gradient of every layer, the input gradient above the first: what the matmul
rate counts, not ``peers.py``'s 3x the forward FLOPs, which counts a first-layer input gradient no step computes)
over its median training time, as a percentage of the matmul rate (target >= 20 %); per local step, fedweave's
training time against the time of that step's matrix products (what a step costs beyond its matmuls). Every
number comes from the same run, so their ratios hold under the machine's load.

The script imports ``fedweave`` from the path, so the same file measures another checkout's code:
``PYTHONPATH=<checkout>/src python benchmarks/step_overhead.py``.

Usage: python benchmarks/step_overhead.py [--workload logistic mlp] [--rounds 20] [--threads 2] [--backend auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ``benchmarks`` importable when run as a script
from benchmarks.peers import EVAL_BATCH, LR, WORKLOADS, fedweave_config  # noqa: E402
from fedweave.config import BACKENDS  # noqa: E402


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(in, out) of each linear layer, in order."""
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def step_flops(model: torch.nn.Module) -> int:
    """FLOPs of one sample's training step as the engine computes it (2 per multiply-add): at every linear layer
    the forward ``x W^T`` and the weight gradient ``dz^T h``, and above the first the input gradient ``dz W``
    (no step computes the gradient of the data). The training rate and ``matmul_rate`` both count these, so their
    ratio compares like with like; 3x the forward FLOPs would count the first layer's input gradient too (1.49x
    these for the 784-64-10 MLP, 1.5x for softmax regression)."""
    return sum(2 * i * o * (3 if layer else 2) for layer, (i, o) in enumerate(linear_shapes(model)))


def matmul_rate(model: torch.nn.Module, batch: int, jobs: int, batched: bool, seconds: float = 0.25) -> float:
    """GFLOP/s of the matrix products of one training step, as the engine computes them: per job (``batched``
    False: ``mm`` on ``batch`` rows) or for ``jobs`` jobs at once (``bmm``). Best of 3 timed runs."""
    K = jobs if batched else 1
    shapes = linear_shapes(model)
    ops = []
    for layer, (i, o) in enumerate(shapes):
        h, W, dz = torch.randn(K, batch, i), torch.randn(K, o, i), torch.randn(K, batch, o)
        if batched:
            ops.append((torch.bmm, h, W.transpose(1, 2)))  # forward
            ops.append((torch.bmm, dz.transpose(1, 2), h))  # weight gradient
            if layer:
                ops.append((torch.bmm, dz, W))  # input gradient (not needed at the first layer)
        else:
            ops.append((torch.mm, h[0], W[0].t()))
            ops.append((torch.mm, dz[0].t(), h[0]))
            if layer:
                ops.append((torch.mm, dz[0], W[0]))
    flops = K * batch * step_flops(model)
    best = float("inf")
    for _ in range(4):  # the first run warms up
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            for _ in range(20):
                for f, a, b in ops:
                    f(a, b)
            n += 20
        best = min(best, elapsed / n)
    return flops / best / 1e9


def plain_round(model, x, y, batches_per_client, sizes, start, test_x, test_y) -> tuple[float, float, float]:
    """One FedAvg round as a plain PyTorch loop; returns (train seconds, eval seconds, accuracy)."""
    t0 = time.perf_counter()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    finals = []
    for batches in batches_per_client:
        torch.nn.utils.vector_to_parameters(start.clone(), params)
        for b in batches:
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
        finals.append(torch.nn.utils.parameters_to_vector(params).detach())
    w = torch.tensor(sizes, dtype=torch.float32)
    new = (w / w.sum()) @ torch.stack(finals)
    torch.nn.utils.vector_to_parameters(new, params)
    t1 = time.perf_counter()
    model.eval()
    correct = 0
    with torch.inference_mode():
        for lo in range(0, len(test_y), EVAL_BATCH):
            correct += int((model(test_x[lo : lo + EVAL_BATCH]).argmax(1) == test_y[lo : lo + EVAL_BATCH]).sum())
    model.train()
    return t1 - t0, time.perf_counter() - t1, correct / len(test_y)


def bench(workload: str, rounds: int, threads: int, backend: str) -> None:
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load

    cfg = load(fedweave_config(workload, rounds + 1, backend, threads))
    ctx = RunContext(cfg)
    algo = build_algorithm(ctx)
    tr, ds = algo.trainer, ctx.dataset
    spec = WORKLOADS[workload]
    k, batch = spec["per_round"], spec["batch_size"]
    plain_model = ctx.build_model()
    plain_x = torch.nn.utils.parameters_to_vector(plain_model.parameters()).detach().clone()
    per_sample = step_flops(plain_model)
    rows = {"fedweave train": [], "fedweave eval": [], "plain train": [], "plain eval": [], "matmul": []}
    samples, steps = [], []
    for r in range(rounds + 1):  # round 0 warms up
        clients = np.sort(ctx.seeds.numpy("client_sampling", r).choice(spec["num_clients"], k, replace=False))
        batches = [tr.client_batches(int(c), r, (), None) for c in clients]
        sizes = [len(tr.parts[int(c)]) for c in clients]
        t0 = time.perf_counter()
        algo.run_round(r)
        t1 = time.perf_counter()
        acc = algo.evaluate(r)["test_accuracy"]
        t2 = time.perf_counter()
        p_train, p_eval, p_acc = plain_round(
            plain_model, ds.train_x, ds.train_y, batches, sizes, plain_x, ds.test_x, ds.test_y
        )
        plain_x = torch.nn.utils.parameters_to_vector(plain_model.parameters()).detach().clone()
        rate = matmul_rate(plain_model, batch, k, batched=tr.backend == "vmap")
        if r == 0:
            continue
        rows["fedweave train"].append(t1 - t0)
        rows["fedweave eval"].append(t2 - t1)
        rows["plain train"].append(p_train)
        rows["plain eval"].append(p_eval)
        rows["matmul"].append(rate)
        samples.append(sum(len(b) for bs in batches for b in bs))
        steps.append(sum(len(bs) for bs in batches))
    med = {name: statistics.median(v) for name, v in rows.items()}
    low = {name: min(v) for name, v in rows.items()}
    fw = [a + b for a, b in zip(rows["fedweave train"], rows["fedweave eval"])]
    pl = [a + b for a, b in zip(rows["plain train"], rows["plain eval"])]
    threads = torch.get_num_threads()
    print(f"\n[{workload}] backend {tr.backend}, {threads} threads, {rounds} rounds after a warm-up round")
    print("                    min (s)   median (s)")
    for name in ("fedweave train", "fedweave eval", "plain train", "plain eval"):
        print(f"  {name:16s} {low[name]:8.4f}   {med[name]:8.4f}")
    print(f"  {'fedweave round':16s} {min(fw):8.4f}   {statistics.median(fw):8.4f}")
    print(f"  {'plain round':16s} {min(pl):8.4f}   {statistics.median(pl):8.4f}")
    print(
        f"  fedweave faster than the plain loop per round: {min(pl) / min(fw):.2f}x (min / min), "
        f"{statistics.median(pl) / statistics.median(fw):.2f}x (median / median)"
    )
    print(f"  final accuracy: fedweave {acc:.4f}, plain {p_acc:.4f}")
    train_rate = per_sample * statistics.median(samples) / med["fedweave train"] / 1e9
    print(
        f"  training rate {train_rate:.2f} GFLOP/s (step FLOPs of the trained samples / median training time); "
        f"matmul rate of the step's shapes {med['matmul']:.2f} GFLOP/s (min {low['matmul']:.2f}): "
        f"**{100 * train_rate / med['matmul']:.1f} %** (target >= 20 %)"
    )
    per_step = med["fedweave train"] / statistics.median(steps) * 1e6
    mm_step = per_sample * batch / (med["matmul"] * 1e9) * 1e6
    print(
        f"  per local step: {per_step:.1f} us of training (round time incl. aggregation / steps) "
        f"against {mm_step:.1f} us for its matmuls at the measured rate"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["logistic", "mlp"], choices=["logistic", "mlp"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    args = ap.parse_args()
    for flag in ("rounds", "threads"):
        if (value := getattr(args, flag.replace("-", "_"))) < 1:
            ap.error(f"--{flag} must be at least 1, got {value}")
    torch.set_num_threads(args.threads)
    import fedweave

    print(f"fedweave from {Path(fedweave.__file__).parent}, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}")
    for w in args.workload:
        bench(w, args.rounds, args.threads, args.backend)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
