"""GPU benchmark: fedweave's loop and vmap backends against a hand-written per-client PyTorch GPU loop and
Flower's simulation with GPU actors, side by side in one process tree on one machine.

Workloads (issue 14; FedAvg, 1 local epoch, lr 0.05; targets on one H100 in brackets):
  cnn:     the MNIST CNN of benchmarks/peers.py, 100 clients Dirichlet(0.3), 10 per round, batch 32
           [>= 3x faster per round than the hand-written loop, >= 10x faster than Flower]
  resnet:  ResNet-18-GN (fedmim's resnet18_gn) on SYNTHETIC data of CIFAR-10's shape (3x32x32, 10 classes;
           timing only, its accuracy means nothing), 100 clients, 10 per round, batch 50   [>= 1.5x hand-written]
  mlp:     the cross-device MLP (784-64-10) on MNIST, 1000 clients, 50 per round, batch 10
           [>= 3x hand-written, >= 10x Flower]
fedweave runs each at float32 and bf16-mixed (``--precision both``, the default); the hand-written loop at the first
of them (float32 under ``both``; ``--precision bf16-mixed`` alone autocasts it too, and its row says so), Flower at
float32. For each: seconds per round (median of rounds 2..R: local training and aggregation, the device synchronised
before and after), the ratios, GPU utilisation while training (torch.cuda.utilization or nvidia-smi), peak GPU
memory, and max_memory_allocated after round 10 against round R (flat: within 5%). Then a projection of
FedMIM on CIFAR-10 at the paper's scale (100 clients, 10 per round, E = 5, B = 50, crop + flip, 1000 rounds,
evaluation every 10), from FedMIM rounds measured on the synthetic CIFAR-shaped data.

The hand-written loop is what one writes without a framework: one reused model on the GPU, torch.optim.SGD,
the data on the GPU, the same sampled clients, batch indices and start weights as fedweave. Its first round
is compared with fedweave's (relative difference of the new global model) before anything is timed.

Usage:
  python benchmarks/gpu.py                        # all three workloads on cuda (25 rounds; resnet 12)
  python benchmarks/gpu.py --quick                # a few rounds of small versions
  python benchmarks/gpu.py --device cpu --quick   # the same code end to end on a CPU (tiny sizes)
  python benchmarks/gpu.py --workload cnn --precision bf16-mixed
On a machine without a CUDA GPU (and without --device) it says so and exits 0. MNIST comes through the data
layer (fedweave data fetch mnist); where it cannot be loaded the MNIST workloads are skipped with that
reason. Flower runs where the ``bench`` extra is installed (pip install 'fedweave[bench]').
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "cnn": {"model": {"name": "cnn_mnist"}, "data": "mnist", "clients": 100, "per_round": 10, "batch": 32},
    "resnet": {"model": {"name": "resnet18_gn"}, "data": "cifar_shaped", "clients": 100, "per_round": 10, "batch": 50},
    "mlp": {"model": {"name": "mlp", "hidden": [64]}, "data": "mnist", "clients": 1000, "per_round": 50, "batch": 10},
}
QUICK = {  # small versions: a few local steps each, small data
    "cnn": {"clients": 20, "per_round": 4, "steps": 4, "max_train": 2000},
    "resnet": {"clients": 10, "per_round": 2, "batch": 8, "steps": 2, "max_train": 400},
    "mlp": {"clients": 100, "per_round": 10, "steps": 4, "max_train": 2000},
}
LR, ALPHA, SEED = 0.05, 0.3, 0
CIFAR_TRAIN, CIFAR_TEST = 50_000, 10_000


# ---- data ----------------------------------------------------------------------------------------
def cifar_shaped(n_train: int, n_test: int):
    """Synthetic data of CIFAR-10's shape (timing only): N(0, 1) images, uniform labels, fixed seed."""
    from fedweave.data.base import Dataset

    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n_train + n_test, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    return Dataset("cifar10_shaped_synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10, (3, 32, 32))


def config(workload: str, quick: bool, device: str, backend: str, precision: str, rounds: int) -> tuple[dict, object]:
    """The fedweave config of a workload and, for the synthetic data, the dataset object passed with it."""
    from fedweave.byo import RunObjects

    w = {**WORKLOADS[workload], **(QUICK[workload] if quick else {})}
    local = {"batch_size": w["batch"], "lr": LR, **({"steps": w["steps"]} if "steps" in w else {"epochs": 1})}
    cfg = {
        "name": f"gpu-{workload}",
        "seed": SEED,
        "rounds": rounds,
        "device": device,
        "backend": backend,
        "precision": precision,
        "partition": {"name": "dirichlet", "num_clients": w["clients"], "alpha": ALPHA, "min_size": 5},
        "model": w["model"],
        "algorithm": {"name": "fedavg", "clients_per_round": w["per_round"]},
        "local": local,
        "output": {"progress": False, "plots": False},
    }
    if w["data"] == "mnist":
        cfg["dataset"] = {"name": "mnist", **({"max_train": w["max_train"], "max_test": 1000} if quick else {})}
        return cfg, None
    n_train = w.get("max_train", CIFAR_TRAIN)
    cfg["dataset"] = {"name": "cifar10_shaped_synthetic"}
    return cfg, RunObjects(dataset=cifar_shaped(n_train, max(n_train // 5, 100)))


# ---- GPU utilisation ------------------------------------------------------------------------------
class Utilisation:
    """Samples the GPU's utilisation every 0.1 s in a thread (torch.cuda.utilization, else nvidia-smi)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.samples, self.source = device, [], None
        self._stop = threading.Event()
        if device.type != "cuda":
            return
        try:
            torch.cuda.utilization(device)
            self.source = "torch.cuda.utilization"
        except Exception:
            if shutil.which("nvidia-smi"):
                self.source = "nvidia-smi"

    def _read(self) -> float | None:
        if self.source == "torch.cuda.utilization":
            return float(torch.cuda.utilization(self.device))
        cmd = [
            "nvidia-smi",
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
            f"-i={self.device.index or 0}",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
        return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 and out.stdout.strip() else None

    def __enter__(self) -> Utilisation:
        if self.source:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            v = self._read()
            if v is not None:
                self.samples.append(v)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.source:
            self._thread.join()

    def mean(self) -> str:
        return f"{statistics.mean(self.samples):.0f}%" if self.samples else "n/a"


# ---- the variants ---------------------------------------------------------------------------------
ONE_ROUND = (
    "One round only: a time per round below is round 1's, warm-up included, not the median of rounds 2..R "
    "(give --rounds 2 or more)."
)


def median_round(times: list[float]) -> float:
    return statistics.median(times[1:] or times)  # round 1 pays the warm-up


def run_fedweave(
    workload: str,
    args,
    backend: str,
    precision: str = "float32",
    algorithm: dict | None = None,
    local: dict | None = None,
) -> dict:
    """R rounds of fedweave (``backend``, ``precision``); per-round times, utilisation, memory after round 10
    and R."""
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load

    cfg, objects = config(workload, args.quick, args.device, backend, precision, args.rounds_of[workload])
    if algorithm:
        cfg["algorithm"] = {**cfg["algorithm"], **algorithm}
    if local:
        cfg["local"] = {**cfg["local"], **local}
    ctx = RunContext(load(cfg), objects)
    algo = build_algorithm(ctx)
    pl = ctx.placement
    pl.synchronize()
    pl.reset_peak()
    times, peaks = [], {}
    with Utilisation(pl.device) as util:
        for r in range(cfg["rounds"]):
            pl.synchronize()
            t0 = time.perf_counter()
            algo.run_round(r)
            pl.synchronize()
            times.append(time.perf_counter() - t0)
            if r + 1 in (10, cfg["rounds"]):
                peaks[r + 1] = pl.peak_bytes()
    t0 = time.perf_counter()
    ev = algo.evaluate(cfg["rounds"] - 1)
    pl.synchronize()
    return {
        "label": f"fedweave {algo.trainer.backend}" + ("" if precision == "float32" else f" {precision}"),
        "times": times,
        "eval": time.perf_counter() - t0,
        "accuracy": ev.get("test_accuracy"),
        "util": util.mean(),
        "peaks": peaks,
        "ctx": ctx,
        "algo": algo,
    }


def run_hand_written(ref: dict, args) -> dict:
    """The same rounds written by hand: one reused model, torch.optim.SGD, fedweave's clients and batches."""
    ctx, algo = ref["ctx"], ref["algo"]
    pl, tr = ctx.placement, algo.trainer
    model = ctx.build_model()  # the same initial weights (the model_init stream)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    x, y = tr.train_x, tr.train_y  # placed on the device once, as fedweave's
    sizes = torch.tensor([len(p) for p in ctx.partition], dtype=torch.float32, device=pl.device)
    w = torch.nn.utils.parameters_to_vector(params).detach().clone()
    steps = tr.local.steps
    times, first = [], None
    with Utilisation(pl.device) as util:
        for r in range(len(ref["times"])):
            pl.synchronize()
            t0 = time.perf_counter()
            clients = algo.sample_clients(r)  # the same clients (the run's sampler is a pure function of r)
            finals = []
            for c in clients:
                torch.nn.utils.vector_to_parameters(w.clone(), params)  # (it aliases its argument)
                for b in tr.client_batches(int(c), r, (), steps):
                    b = b.to(pl.device, non_blocking=True)
                    opt.zero_grad(set_to_none=False)
                    with pl.autocast():
                        out = model(x[b])
                    torch.nn.functional.cross_entropy(out.float(), y[b]).backward()
                    opt.step()
                finals.append(torch.nn.utils.parameters_to_vector(params).detach().clone())
            p = sizes[clients] / sizes[clients].sum()
            w = p @ torch.stack(finals)
            pl.synchronize()
            times.append(time.perf_counter() - t0)
            if first is None:
                first = w.clone()
    label = "hand-written loop" + ("" if pl.autocast_dtype is None else " bf16-mixed")  # autocast as fedweave's first
    return {"label": label, "times": times, "util": util.mean(), "first": first}


def first_round_difference(workload: str, args, hand_first: torch.Tensor) -> float:
    """Relative difference between fedweave's (loop) and the hand-written loop's global model after round 1."""
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load

    cfg, objects = config(workload, args.quick, args.device, "loop", "float32", 1)
    algo = build_algorithm(RunContext(load(cfg), objects))
    algo.run_round(0)
    return float((algo.x - hand_first).norm() / hand_first.norm())


def run_flower(workload: str, args) -> dict | None:
    """Flower's simulation with GPU actors (benchmarks/peers.py's client code on the device), or None."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        return None
    from benchmarks import peers

    name = "flower-gpu-4x0.25" if args.device.startswith("cuda") else "flower-2x1"
    res = peers.launch(name, workload, args.flower_rounds)
    # training and aggregation per round, as timed for fedweave (Flower's evaluation runs apart)
    return {"label": f"Flower ({name})", "times": res["train"], "util": "n/a", "accuracy": res["accuracy"][-1]}


# ---- FedMIM projection ------------------------------------------------------------------------------
def fedmim_projection(args) -> str:
    """Seconds per FedMIM round at the paper's CIFAR-10 setting, measured on the CIFAR-shaped data, times
    1000 rounds plus 100 evaluations of the 10k test set (every 10 rounds)."""
    paper_local = {"weight_decay": 0.001, "grad_clip": 10.0, "augment": ["crop", "flip"], "lr_decay": 0.998}
    algo_opts = {"name": "fedmim", "weighting": "uniform", "alpha": [0.6, 0.3], "beta": [0.9, 0.1]}
    if not args.quick:
        paper_local.update(epochs=5)
    best = None
    for backend in args.backends:
        saved = args.rounds_of["resnet"]
        args.rounds_of["resnet"] = args.fedmim_rounds
        try:
            res = run_fedweave("resnet", args, backend, args.projection_precision, algo_opts, paper_local)
        finally:
            args.rounds_of["resnet"] = saved
        per = median_round(res["times"])
        n_test = len(res["ctx"].dataset.test_y)
        eval_10k = res["eval"] * CIFAR_TEST / max(n_test, 1)
        if best is None or per < best[1]:
            best = (res["label"], per, eval_10k)
    label, per, ev = best
    total = 1000 * per + 100 * ev
    scale = "" if not args.quick else " (quick sizes: 2 clients x 2 steps a round, not the paper's 10 x 250)"
    return (
        f"FedMIM, CIFAR-10 setting (100 clients, 10 a round, E=5, B=50, crop+flip, ResNet-18-GN), {label}: "
        f"{per:.3f} s a round, evaluation {ev:.2f} s; 1000 rounds + 100 evaluations = {total / 3600:.2f} h "
        f"[target < 2 h on one H100]{scale}"
    )


# ---- report -------------------------------------------------------------------------------------------
def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def report(
    workload: str, quick: bool, rows: list[dict], hand: dict | None, flower: dict | None, diff: float | None
) -> str:
    w = {**WORKLOADS[workload], **(QUICK[workload] if quick else {})}
    head = f"{w['model']['name']}, {w['clients']} clients, {w['per_round']} a round, batch {w['batch']}"
    if quick:
        head += f", {w['steps']} local steps (quick), the first {w['max_train']} training samples"
    lines = [f"## {workload}: {head}"]
    if w["data"] != "mnist":
        lines.append("Data: SYNTHETIC, of CIFAR-10's shape (timing only; the accuracy means nothing).")
    if diff is not None:
        lines.append(f"fedweave (loop) vs the hand-written loop after round 1: relative difference {diff:.1e}")
    if any(len(row["times"]) < 2 for row in [*rows, *filter(None, (hand, flower))]):
        lines.append(ONE_ROUND)
    lines += [
        "",
        "| variant | s / round | vs hand-written | vs Flower | GPU util | peak GPU MiB | "
        "max allocated after round 10 -> last | final acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref_hand = median_round(hand["times"]) if hand else None
    ref_flower = median_round(flower["times"]) if flower else None
    for row in [*rows, *([hand] if hand else []), *([flower] if flower else [])]:
        per = median_round(row["times"])
        vs_hand = f"{ref_hand / per:.2f}x faster" if ref_hand and row is not hand else ""
        vs_flower = f"{ref_flower / per:.1f}x faster" if ref_flower and row is not flower else ""
        peaks = row.get("peaks", {})
        last = max(peaks) if peaks else None
        peak = mib(peaks[last]) if last and peaks[last] else "n/a"
        flat = "n/a"
        if 10 in peaks and last and last > 10 and peaks[10]:
            growth = peaks[last] / max(peaks[10], 1) - 1
            flat = f"{mib(peaks[10])} -> {mib(peaks[last])} ({100 * growth:+.1f}%{', FLAT' if growth <= 0.05 else ''})"
        acc = row.get("accuracy")
        lines.append(
            f"| {row['label']} | {per:.4f} | {vs_hand} | {vs_flower} | {row['util']} | {peak} | {flat} | "
            f"{'' if acc is None else f'{100 * acc:.2f}%'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--device", default=None, help="cuda (default), cuda:N, mps or cpu")
    ap.add_argument(
        "--precision",
        default="both",
        choices=["both", "float32", "bf16-mixed"],
        help="fedweave's precision (both: float32 and bf16-mixed rows side by side; the hand-written loop runs in "
        "the first, Flower in float32)",
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="rounds per variant (default 25, quick 3; resnet 12 at most)"
    )
    ap.add_argument("--flower-rounds", type=int, default=10)
    ap.add_argument(
        "--fedmim-rounds", type=int, default=None, help="FedMIM rounds for the projection (default 3, quick 2)"
    )
    ap.add_argument("--no-flower", action="store_true", help="skip Flower even where it is installed")
    ap.add_argument("--flower", action="store_true", help="run Flower in --quick mode too (full-size, slow to start)")
    ap.add_argument("--quick", action="store_true", help="small versions, a few rounds")
    ap.add_argument("--no-projection", action="store_true", help="skip the FedMIM CIFAR-10 projection")
    args = ap.parse_args()
    for flag in ("rounds", "flower-rounds", "fedmim-rounds"):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None and value < 1:
            ap.error(f"--{flag} must be at least 1, got {value}")
    started = time.perf_counter()

    from fedweave.config import ConfigError
    from fedweave.data.sources import DataSourceError
    from fedweave.execution.placement import available_devices, resolve_placement

    have = available_devices()
    if args.device is None:
        if not any(d.startswith("cuda") for d in have):
            print(
                f"benchmarks/gpu.py: no CUDA GPU on this machine (available: {', '.join(have)}); nothing measured. "
                "Run it on a machine with one, or check it end to end here with --device cpu --quick."
            )
            return 0
        args.device = "cuda"
    try:
        precisions = ["float32", "bf16-mixed"] if args.precision == "both" else [args.precision]
        pl = resolve_placement(args.device, precisions[-1])
    except ConfigError as e:
        print(f"benchmarks/gpu.py: {e}")
        return 2
    # 25 rounds (ResNet 12) keep the whole command under 8 minutes on one H100 (issue 31, target 6): the medians
    # of rounds 2..R and memory after round 10 against round R need no more
    default = 3 if args.quick else 25
    rounds = args.rounds or default
    args.rounds_of = {w: min(rounds, 12) if w == "resnet" else rounds for w in WORKLOADS}  # resnet: 12 at most
    args.fedmim_rounds = args.fedmim_rounds or (2 if args.quick else 3)
    args.backends = ["loop", "vmap"]
    args.projection_precision = precisions[0]
    print(
        f"# fedweave GPU benchmark: {pl.device} ({pl.name}), precision {', '.join(precisions)}, "
        f"torch {torch.__version__}"
    )
    print("GPU numbers are measured only where this runs on a GPU; see docs/performance.md.\n")
    for workload in args.workload:
        try:
            rows = [run_fedweave(workload, args, b, p) for p in precisions for b in args.backends]
        except DataSourceError as e:
            print(f"## {workload}: skipped, its data could not be loaded: {e}\n")
            continue
        hand = run_hand_written(rows[0], args)
        diff = first_round_difference(workload, args, hand["first"])
        flower = None
        wants_flower = not args.no_flower and (not args.quick or args.flower) and workload != "resnet"
        if wants_flower:
            flower = run_flower(workload, args)
            if flower is None:
                print("(Flower is not installed: pip install 'fedweave[bench]')")
        print(report(workload, args.quick, rows, hand, flower, diff), flush=True)
        print()
    if not args.no_projection:
        print(fedmim_projection(args))
    print(f"\nbenchmarks/gpu.py: the whole command took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
