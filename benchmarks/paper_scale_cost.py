"""What a paper-scale reproduction run needs: training passes, CPU time and an H100 estimate per paper.

    python benchmarks/paper_scale_cost.py [--out docs/reproductions/paper-scale.csv] [--repeats 5]

For each paper's ``--scale paper`` preset with a neural model, one training step (forward, backward and the SGD
update) of the preset's model at its batch size is timed on this machine's CPU (one torch thread, synthetic
inputs of the data's shape: timing only), and its floating-point operations are counted
(``torch.utils.flop_counter``). The preset's training passes (one sample through one step) are counted from
its definition (the ``passes`` column says how). From these:

- CPU core-hours = passes x the measured seconds per sample (one thread; evaluation, aggregation and data
  loading are left out, so it is a lower bound);
- the FLOPs per sample are shown beside it; GPU hours are measured, not derived from them (below).

With ``--device cuda`` the same steps are timed on the GPU instead (wall clock, synchronized; float32 with TF32
off, as fedweave's ``precision: float32`` computes on CUDA) and written to ``paper-scale-gpu.csv``: GPU ms per
sample and the GPU hours they give for the same passes (one client's step at a time at the preset's batch size,
as the ``loop`` backend trains; evaluation, aggregation and data loading left out, so again a lower bound).

    python benchmarks/paper_scale_cost.py --device cuda --out docs/reproductions/paper-scale-gpu.csv --repeats 20

ZO-HFL (softmax regression) and CFL-SAGA (closed-form problems) need no GPU; the pages state their CPU cost.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedweave.experiments.tables import write_csv
from fedweave.models.build import build_model
from fedweave.models.split import build_split_model

# paper, what runs, model, input shape, classes, batch size, passes per run, runs, how the passes are counted
WORKLOADS = [
    ("fedmim", "Table I, CIFAR-10 and CIFAR-100 (7 methods x 3 splits x 2 data sets, 1 seed)", "resnet18_gn",
     (3, 32, 32), 10, 50, 1000 * 10 * 5 * 500, 42,
     "1000 rounds x 10 clients x 5 epochs x 500 samples; FedSAM's second pass not counted"),
    ("afind", "Table 1, CIFAR-10 columns (6 methods x 4 splits x 3 seeds)", "cnn_cifar",
     (3, 32, 32), 10, 128, 500 * 100 * 5 * 500, 72,
     "500 rounds x 100 clients x 5 epochs x 500 samples (every client trains each round); proxies not counted"),
    ("afind", "Table 1, CIFAR-100 columns (6 methods x 4 splits x 3 seeds)", "resnet18_gn",
     (3, 32, 32), 100, 128, 500 * 100 * 5 * 500, 72,
     "500 rounds x 100 clients x 5 epochs x 500 samples (every client trains each round); proxies not counted"),
    ("cse-fsl", "Table V, CIFAR-10 (8 methods x 5 seeds)", "split_cifar",
     (3, 24, 24), 10, 50, 200 * 5 * 10_000, 40,
     "200 epochs x 5 clients x 10,000 samples; client, aux net and server each step (CSE-FSL h > 1: server less)"),
]  # fmt: skip


def _model(name: str, shape: tuple[int, ...], classes: int) -> tuple[nn.Module, ...]:
    """The modules one training step updates: the model, or a split model's client, server and auxiliary net."""
    torch.manual_seed(0)
    if name.startswith("split_"):
        split = build_split_model(name, shape, classes, {"aux": "mlp"})
        return split.client, split.server, split.aux
    return (build_model(name, shape, classes),)


def _step(parts: tuple[nn.Module, ...], x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    """One SGD step of every part: the whole model, or the client with its auxiliary net and the server."""
    loss = nn.functional.cross_entropy
    opt.zero_grad(set_to_none=True)
    if len(parts) == 1:
        loss(parts[0](x), y).backward()
    else:
        client, server, aux = parts
        smashed = client(x)
        loss(aux(smashed), y).backward()
        loss(server(smashed.detach().requires_grad_()), y).backward()
    opt.step()


def measure(
    name: str, shape: tuple[int, ...], classes: int, batch: int, repeats: int, device: str = "cpu"
) -> tuple[float, float]:
    """(seconds, FLOPs) per sample of one training step at ``batch``: the median of ``repeats`` timed steps
    after untimed warm-up steps (CPU time on the CPU, synchronized wall time on a GPU), and the counted
    operations of one step."""
    parts = tuple(m.to(device) for m in _model(name, shape, classes))
    opt = torch.optim.SGD([p for m in parts for p in m.parameters()], lr=0.01)
    x, y = torch.randn(batch, *shape, device=device), torch.randint(0, classes, (batch,), device=device)
    gpu = device != "cpu"
    clock = time.perf_counter if gpu else time.process_time
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for _ in range(3 if gpu else 1):  # the GPU's first steps pick kernels and allocate
        _step(parts, x, y, opt)
    times = []
    for _ in range(repeats):
        sync()
        t0 = clock()
        _step(parts, x, y, opt)
        sync()
        times.append(clock() - t0)
    with FlopCounterMode(display=False) as counter:
        _step(parts, x, y, opt)
    return sorted(times)[len(times) // 2] / batch, counter.get_total_flops() / batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="default docs/reproductions/paper-scale.csv (paper-scale-gpu.csv on a GPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: time the steps on the GPU")
    opts = parser.parse_args(argv)
    if opts.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {opts.repeats}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", opts.device):  # another name reached torch as a traceback
        parser.error(f"--device must be cpu, cuda or cuda:N, got {opts.device!r}")
    if opts.out is not None and Path(opts.out).is_dir():  # else a traceback after every row was timed
        parser.error(f"--out {opts.out} is a folder; give the path of a CSV file")
    if opts.out is not None and Path(opts.out).exists():  # the default is the page's own record, rewritten on purpose
        parser.error(f"--out {opts.out} exists; give a new file (without --out the page's CSV is rewritten)")
    if opts.out is None:  # the GPU rows never land in the CPU file by default; the checkout's, from any folder
        pages = Path(__file__).resolve().parents[1] / "docs" / "reproductions"
        opts.out = str(pages / ("paper-scale.csv" if opts.device == "cpu" else "paper-scale-gpu.csv"))
    if opts.device != "cpu":
        return _gpu(opts)
    torch.set_num_threads(1)
    rows = []
    for paper, what, model, shape, classes, batch, passes, runs, how in WORKLOADS:
        sec, flops = measure(model, shape, classes, batch, opts.repeats)
        total = passes * runs
        rows.append({
            "paper": paper, "runs": what, "model": model, "batch": batch, "passes_per_run": passes,
            "n_runs": runs, "passes_counted_as": how, "cpu_ms_per_sample": round(1e3 * sec, 3),
            "mflop_per_sample": round(flops / 1e6, 1), "cpu_core_hours": round(total * sec / 3600),
        })  # fmt: skip
        print(rows[-1], flush=True)
    write_csv(Path(opts.out), rows)
    return 0


def _gpu(opts: argparse.Namespace) -> int:
    """The same steps timed on ``opts.device`` in float32 with TF32 off (``precision: float32``)."""
    from fedweave.execution.placement import full_float32_on_cuda

    if not torch.cuda.is_available():
        print(
            f"error: --device {opts.device}: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    full_float32_on_cuda()
    name = torch.cuda.get_device_name()
    rows = []
    for paper, what, model, shape, classes, batch, passes, runs, _ in WORKLOADS:
        sec, _flops = measure(model, shape, classes, batch, opts.repeats, opts.device)
        rows.append({
            "paper": paper, "runs": what, "model": model, "batch": batch, "device": name, "precision": "float32",
            "torch": torch.__version__, "gpu_ms_per_sample": round(1e3 * sec, 4),
            "gpu_hours": round(passes * runs * sec / 3600, 1),
        })  # fmt: skip
        print(rows[-1], flush=True)
    write_csv(Path(opts.out), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def page_table(rows: list[dict], gpu_rows: list[dict], paper: str) -> str:
    """The table a reproduction page shows of ``paper``'s rows of the CPU CSV and the GPU CSV (``read_csv`` of
    ``paper-scale.csv`` and ``paper-scale-gpu.csv``): what runs, the model and batch, the training passes, the
    measured CPU time per sample and core-hours, the measured GPU time per sample and GPU hours, and the GPU."""
    from fedweave.experiments.tables import markdown_table

    gpu = {(g["paper"], g["runs"]): g for g in gpu_rows}
    mine = [r for r in rows if r["paper"] == paper]
    header = ["what runs", "model, batch", "training passes (how counted)", "CPU ms per sample (1 thread)",
              "MFLOP per sample", "CPU core-hours", "GPU ms per sample", "GPU hours",
              "GPU (precision, torch)"]  # fmt: skip
    body = [[r["runs"], f"`{r['model']}`, {r['batch']}",
             f"{r['passes_per_run'] * r['n_runs'] / 1e9:.2f} G ({r['n_runs']} runs x {r['passes_counted_as']})",
             f"{r['cpu_ms_per_sample']:.2f}", f"{r['mflop_per_sample']:.0f}", f"{r['cpu_core_hours']:,}",
             f"{gpu[paper, r['runs']]['gpu_ms_per_sample']:.4f}", f"{gpu[paper, r['runs']]['gpu_hours']:.1f}",
             "{device} ({precision}, {torch})".format_map(gpu[paper, r["runs"]])]
            for r in mine]  # fmt: skip
    return markdown_table(header, body)
