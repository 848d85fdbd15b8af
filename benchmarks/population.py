"""Large-population benchmark: memory of 10,000 stateful clients, and per-round cost vs population size.

(a) SCAFFOLD (fedweave's implementation, unchanged) with 10,000 clients whose control variates c_i
    (one small CNN's worth of parameters each, ``cnn_small``) live in a memory-mapped state store instead of
    RAM. Reported: the store's size, the process's resident memory before the algorithm is built, after the
    rounds, its peak (VmHWM), and the anonymous (heap) part, against the RAM an in-memory store would need.
(b) FedAvg with 1,000 and with 10,000 clients at 10 clients per round, the same local work per client
    (``local.steps`` fixed), median wall time of a round (training and aggregation, no evaluation): the cost
    should follow the clients per round, not the population.

(c) ``--curve``: FedAvg on a population of 1,000 to 10,000,000 clients, each in a fresh process: per population,
    the process's peak resident memory (VmHWM) and its proportional set size (PSS) after the rounds, the memory
    the partition and the algorithm add per client, the start-up (partition + building the algorithm) and the
    median round. Generated in-memory data (not a stand-in for a dataset: only its size matters here): 2 samples
    of 4 features per client, 10 classes, an IID split, softmax regression, 10 clients per round, 5 local steps
    of batch 2; 8 bytes a sample of features, 8 of label.

MNIST, IID split (10,000 clients hold 6 images each). Each measurement runs in a fresh process so peaks are
its own.

Usage: python benchmarks/population.py [--rounds 20] [--clients 10000] [--small 1000] [--threads 1]
       python benchmarks/population.py --curve 1000 10000 100000 1000000 10000000 [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a measured child process: this checkout's ``src`` (then the checkout, for
    ``benchmarks``) ahead of the caller's path, so the child measures this source tree and not whatever
    ``fedweave`` the environment has installed."""
    path = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


PER_ROUND = 10  # clients per round, in every part: no population may be smaller
MNIST_TRAIN = 60_000  # the iid partition of parts (a) and (b) gives each client one sample at least


def config(algorithm: str, clients: int, rounds: int, threads: int) -> dict:
    return {
        "name": f"population-{algorithm}-{clients}",
        "seed": 0,
        "rounds": rounds,
        "backend": "loop",
        "threads": threads,
        "dataset": {"name": "mnist"},
        "partition": {"name": "iid", "num_clients": clients},
        "model": {"name": "cnn_small"},
        "algorithm": {"name": algorithm, "clients_per_round": PER_ROUND},
        "local": {"steps": 5, "batch_size": 5, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }


def proc_status() -> dict[str, int]:
    """This process's memory counters from /proc/self/status, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def memory_mapped(store_cls, directory: Path):
    """A StateStore class whose tables are memory-mapped files in ``directory``."""

    class MmapStore(store_cls):
        def __init__(self, num_clients: int, mmap_dir=None, **kw) -> None:
            super().__init__(num_clients, mmap_dir or directory, **kw)

        def create(self, name, shape, **kw):
            return super().create(name, shape, **{**kw, "mmap": True})

    return MmapStore


def child(kind: str, clients: int, rounds: int, threads: int) -> dict:
    import torch

    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.algorithms.centralized import scaffold
    from fedweave.config import load

    torch.set_num_threads(threads)
    cfg = load(config("scaffold" if kind == "scaffold-mmap" else "fedavg", clients, rounds, threads))
    ctx = RunContext(cfg)
    _ = ctx.dataset, ctx.partition  # loaded before the baseline
    before = proc_status()
    with tempfile.TemporaryDirectory(prefix="fedweave-state-") as d:
        if kind == "scaffold-mmap":
            with mock.patch.object(scaffold, "StateStore", memory_mapped(scaffold.StateStore, Path(d))):
                algo = build_algorithm(ctx)
            store_bytes = algo.store.nbytes()
            disk = sum(f.stat().st_blocks * 512 for f in Path(d).iterdir())
        else:
            algo = build_algorithm(ctx)
            store_bytes = disk = 0
        built = proc_status()
        times = []
        for r in range(rounds):
            t = time.perf_counter()
            algo.run_round(r)
            times.append(time.perf_counter() - t)
        after = proc_status()  # before the check below, which reads every row
        touched = 0
        if kind == "scaffold-mmap":
            disk = sum(f.stat().st_blocks * 512 for f in Path(d).iterdir())
            c = algo.store["c"]
            for lo in range(0, len(c), 256):  # rows written so far, in small pieces
                touched += int((c[lo : lo + 256] != 0).any(1).sum())
    return {
        "kind": kind,
        "clients": clients,
        "params": algo.num_params,
        "store_bytes": store_bytes,
        "disk_bytes": disk,
        "rows_written": touched,
        "before": before,
        "built": built,
        "after": after,
        "round_times": times,
    }


def pss() -> int:
    """This process's proportional set size from /proc/self/smaps_rollup, bytes."""
    line = next(x for x in Path("/proc/self/smaps_rollup").read_text().splitlines() if x.startswith("Pss:"))
    return int(line.split()[1]) * 1024


def child_curve(clients: int, rounds: int, threads: int) -> dict:
    import numpy as np
    import torch

    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.byo import RunObjects, as_dataset
    from fedweave.config import load

    torch.set_num_threads(threads)
    g = np.random.default_rng(0)
    n = 2 * clients
    x, vx = g.standard_normal((n, 4), dtype=np.float32), g.standard_normal((1000, 4), dtype=np.float32)
    data = as_dataset((x, g.integers(0, 10, n), vx, g.integers(0, 10, 1000)))
    del x
    cfg = config("fedavg", clients, rounds, threads)
    cfg.update(dataset={"name": "python"}, model={"name": "logistic"}, local={"steps": 5, "batch_size": 2, "lr": 0.05})
    cfg = load(cfg)
    data_loaded = proc_status()
    t0 = time.perf_counter()
    ctx = RunContext(cfg, RunObjects(dataset=data))
    _ = ctx.partition
    t1 = time.perf_counter()
    partitioned = proc_status()
    algo = build_algorithm(ctx)
    t2 = time.perf_counter()
    built = proc_status()
    times = []
    for r in range(rounds):
        t = time.perf_counter()
        algo.run_round(r)
        times.append(time.perf_counter() - t)
    return {
        "clients": clients,
        "data": data_loaded,
        "partitioned": partitioned,
        "built": built,
        "after": proc_status(),
        "pss": pss(),
        "partition_s": t1 - t0,
        "build_s": t2 - t1,
        "round_times": times,
    }


def launch(kind: str, clients: int, rounds: int, threads: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", kind, "--clients", str(clients), "--rounds", str(rounds)]
        cmd += ["--threads", str(threads), "--out", f.name]
        subprocess.run(cmd, check=True, cwd=ROOT, env=child_env())
        return json.loads(Path(f.name).read_text())


def gb(x: int) -> str:
    return f"{x / 2**30:.3f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=10000, help="the large population")
    ap.add_argument("--small", type=int, default=1000, help="the small population of (b)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest for this small model)")
    ap.add_argument("--curve", type=int, nargs="+", help="(c) only: these populations (e.g. 1000 ... 10000000)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 2:  # every part reports the median of rounds 2..R
        ap.error(f"--rounds must be at least 2 (the median is of rounds 2..R), got {args.rounds}")
    if args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    # a smaller population ended in a child's ConfigError traceback (clients_per_round exceeds num_clients)
    for flag in ("clients", "small"):
        if (value := getattr(args, flag)) < PER_ROUND:
            ap.error(f"--{flag} must be at least {PER_ROUND} (the clients of a round), got {value}")
    if (value := max(args.clients, args.small)) > MNIST_TRAIN:  # one sample a client at least
        flag = "--clients" if value == args.clients else "--small"
        ap.error(f"{flag} must be at most {MNIST_TRAIN} (MNIST's training samples, one a client), got {value}")
    if args.curve and min(args.curve) < PER_ROUND:
        ap.error(f"--curve populations must be at least {PER_ROUND} (the clients of a round), got {min(args.curve)}")
    if args.child:
        run = child_curve(args.clients, args.rounds, args.threads) if args.child == "curve" else None
        run = run or child(args.child, args.clients, args.rounds, args.threads)
        Path(args.out).write_text(json.dumps(run))
        return
    if args.curve:
        curve(args.curve, args.rounds, args.threads)
        return

    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, {args.rounds} rounds")
    a = launch("scaffold-mmap", args.clients, args.rounds, args.threads)
    in_ram = a["clients"] * a["params"] * 4
    print(f"\n(a) SCAFFOLD, {a['clients']} clients, cnn_small ({a['params']} parameters), c_i memory-mapped")
    print(f"  client state: {gb(a['store_bytes'])} (all of it in RAM with an in-memory store)")
    print(f"  on disk (allocated blocks of the sparse file): {gb(a['disk_bytes'])}")
    print(f"  clients whose state was written: {a['rows_written']}")
    for stage in ("before", "built", "after"):
        s = a[stage]
        print(f"  RSS {stage:6s}: {gb(s['VmRSS'])} (anonymous {gb(s['RssAnon'])}, file-backed {gb(s['RssFile'])})")
    growth = a["after"]["VmHWM"] - a["before"]["VmRSS"]
    print(f"  peak RSS (VmHWM): {gb(a['after']['VmHWM'])}; growth over the data-loaded baseline: {gb(growth)}")
    print(f"  = {100 * growth / in_ram:.1f}% of the {gb(in_ram)} an in-RAM store needs")
    print(f"  median round: {statistics.median(a['round_times'][1:]):.4f} s")

    print(f"\n(b) FedAvg, 10 clients per round, {args.rounds} rounds (median of rounds 2..R, no evaluation)")
    med = []  # in run order: keyed by population, equal --small and --clients would share one entry
    for n in (args.small, args.clients):
        b = launch("fedavg", n, args.rounds, args.threads)
        med.append(statistics.median(b["round_times"][1:]))
        print(f"  {n:6d} clients: {med[-1]:.4f} s per round  (peak RSS {gb(b['after']['VmHWM'])})")
    print(f"  ratio {args.clients} / {args.small} clients: {med[1] / med[0]:.3f}")


def curve(populations: list[int], rounds: int, threads: int) -> None:
    print(f"(c) FedAvg, 10 clients per round, {rounds} rounds (median of rounds 2..R, no evaluation), {threads} thread")
    print(f"    load average {os.getloadavg()[0]:.2f}; generated data: 2 samples of 4 features a client")
    print(
        f"  {'clients':>10s}  {'peak RSS':>9s}  {'PSS end':>9s}  {'data':>9s}  {'partition':>9s}  {'B/client':>8s}  "
        f"{'algorithm':>9s}  {'B/client':>8s}  {'start-up':>8s}  {'per round':>9s}"
    )
    for n in populations:
        try:
            c = launch("curve", n, rounds, threads)
        except subprocess.CalledProcessError as e:  # e.g. killed for memory: say so and stop
            print(f"  {n:10d}  failed ({e}); larger populations not measured")
            break
        part = c["partitioned"]["VmRSS"] - c["data"]["VmRSS"]
        build = c["built"]["VmRSS"] - c["partitioned"]["VmRSS"]
        print(
            f"  {n:10d}  {gb(c['after']['VmHWM']):>9s}  {gb(c['pss']):>9s}  {gb(c['data']['VmRSS']):>9s}  "
            f"{gb(part):>9s}  {part / n:8.1f}  {gb(build):>9s}  {build / n:8.1f}  "
            f"{c['partition_s'] + c['build_s']:7.2f}s  {statistics.median(c['round_times'][1:]):8.4f}s"
        )


if __name__ == "__main__":
    main()
