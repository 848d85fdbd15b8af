"""Peer-framework benchmark: fedweave against Flower 1.42's simulation engine and pfl-research 0.6's simulator on
the same workloads (the summary names the releases each peer's runs imported).

Workloads (issue 8; MNIST, FedAvg, Dirichlet(0.3) label skew, 1 local epoch, lr 0.05, global-model
evaluation on the 10k test set every round):
  cnn:       CNN (conv 1-32-5, pool, conv 32-64-5, pool, fc 1024-512-10), 100 clients, 10 per round, batch 32
             [fedweave per round <= 0.6x Flower's, start-up <= 5 s, peak memory <= 1 GB, same accuracy]
  logistic:  softmax regression, 1000 clients, 50 per round, batch 10   [fedweave >= 10x faster per round]
  mlp:       2-layer MLP (784-64-10), same setting                        [fedweave >= 10x faster per round]

Both frameworks run the same computation: the same partition indices (fedweave's partitioner and seed), the
same initial weights (fedweave's ``model_init`` stream), the same sampled clients each round (fedweave's
``client_sampling`` stream; Flower's server sends each sampled client its id), the same batches in the same
order (the ``batches`` stream), plain SGD, sample-weighted averaging and the same evaluation code
(inference mode, batches of 2048). A run whose final accuracy differs from the others by more than 0.5
points is reported as void. pfl-research runs the same computation in one process: its user sampler hands out
fedweave's sampled clients, each client's dataset yields fedweave's batches, ``WeightByDatapoints`` weighs the
updates, and a callback times the rounds and evaluates with the same code.

Every configuration runs in a fresh process; the parent samples the resident memory of that process's
whole tree (the process, Ray's processes and actors) every 0.2 s. Start-up = launch to the start of round 1
(imports, data, partition, model, Ray); start-up + warm-up adds round 1's excess over a median round (actors
starting and loading data lazily). Per round = median wall time of rounds 2..R (training + evaluation).

Usage:
  python benchmarks/peers.py --workload cnn --rounds 20
  python benchmarks/peers.py --workload logistic mlp --rounds 20
  python benchmarks/peers.py --workload cnn --rounds 2 --only fedweave   # a quick look
  python benchmarks/peers.py --workload logistic mlp --only fedweave-1t pfl-1t --pfl-python /path/to/pflenv/bin/python
Needs the ``bench`` extra (pip install 'fedweave[bench]') for Flower; telemetry and Ray usage stats are off.
pfl-research cannot share that environment (its dp-accounting requires absl-py 1.x and attrs < 24, fedweave's
constraints pin absl-py 2.5.1 and attrs 26.1.0): the pfl configurations run in a child of ``--pfl-python``, an
environment with ``pip install 'pfl[pytorch]==0.6.0'`` and fedweave's dependencies (docs/performance.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fedweave.memory import cpu_seconds, memory, process_tree

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a measured child process: this checkout's ``src`` (then the checkout, for
    ``benchmarks``) ahead of the caller's path, so the child measures this source tree and not whatever
    ``fedweave`` the environment has installed."""
    path = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

WORKLOADS = {
    "cnn": {"model": "cnn_mnist", "num_clients": 100, "per_round": 10, "batch_size": 32},
    "logistic": {"model": "logistic", "num_clients": 1000, "per_round": 50, "batch_size": 10},
    "mlp": {"model": "mlp", "model_options": {"hidden": [64]}, "num_clients": 1000, "per_round": 50, "batch_size": 10},
}
LR, ALPHA, SEED, EVAL_BATCH = 0.05, 0.3, 0, 2048

# name -> how it runs (each in its own process)
CONFIGS = {
    "fedweave": {"framework": "fedweave", "backend": "auto", "threads": 2},
    "fedweave-1t": {"framework": "fedweave", "backend": "auto", "threads": 1},
    "fedweave-loop-1t": {"framework": "fedweave", "backend": "loop", "threads": 1},
    "fedweave-vmap-1t": {"framework": "fedweave", "backend": "vmap", "threads": 1},
    "fedweave-ray-2x1": {"framework": "fedweave", "backend": "ray", "threads": 2, "workers": 2},
    "fedweave-pool-2x1": {"framework": "fedweave", "backend": "pool", "threads": 2},
    "flower-2x1": {"framework": "flower", "actors": 2, "actor_cpus": 1},
    "flower-1x2": {"framework": "flower", "actors": 1, "actor_cpus": 2},
    # benchmarks/gpu.py: four actors sharing one GPU, the client's training on it
    "flower-gpu-4x0.25": {"framework": "flower", "actors": 4, "actor_cpus": 1, "actor_gpus": 0.25, "device": "cuda"},
    # pfl-research's simulator in one process (run by --pfl-python: pfl's pins conflict with fedweave's)
    "pfl": {"framework": "pfl", "threads": 2},
    "pfl-1t": {"framework": "pfl", "threads": 1},
}
RUNNERS = {"fedweave": "run_fedweave", "flower": "run_flower", "pfl": "run_pfl"}
DEFAULT_CONFIGS = {
    "cnn": ["fedweave-pool-2x1", "fedweave-1t", "flower-2x1"],
    "logistic": ["fedweave-1t", "fedweave-pool-2x1", "flower-2x1"],
    "mlp": ["fedweave-1t", "fedweave-pool-2x1", "flower-2x1"],
}


def fedweave_config(
    workload: str, rounds: int, backend: str = "auto", threads: int | None = None, workers=None, device: str = "cpu"
):
    w = WORKLOADS[workload]
    return {
        "name": f"peers-{workload}",
        "seed": SEED,
        "rounds": rounds,
        "device": device,  # a CPU comparison (benchmarks/gpu.py is the GPU one)
        "backend": backend,
        "threads": threads,
        "dataset": {"name": "mnist"},
        "partition": {"name": "dirichlet", "num_clients": w["num_clients"], "alpha": ALPHA, "min_size": 10},
        "model": {"name": w["model"], **w.get("model_options", {})},
        "algorithm": {"name": "fedavg", "clients_per_round": w["per_round"]},
        "local": {"epochs": 1, "batch_size": w["batch_size"], "lr": LR},
        "eval": {"every": 1, "batch_size": EVAL_BATCH},
        "output": {"progress": False, "plots": False},
        "ray": {"num_workers": workers},
    }


def partition_digest(parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p.astype("int64").tobytes())
    return h.hexdigest()[:16]


def release(distribution: str) -> str:
    """``"flwr 1.42.0"``: the installed release of a peer's distribution, as the measuring process imports it."""
    import importlib.metadata

    return f"{distribution} {importlib.metadata.version(distribution)}"


def peer_timings(marks: dict[str, list], launched: float, ctx, distribution: str) -> dict:
    """A peer's run from the marks its callbacks left: start-up, CPU per round, train and eval seconds per
    round (round start -> train end -> round end), the accuracies, the partition's digest and the peer's
    release (``distribution`` and its installed version: a comparison holds for one release)."""
    starts, ends, trains = marks["round_start"], marks["round_end"], marks["train_end"]
    return {
        "release": release(distribution),
        "startup": starts[0] - launched,
        "cpu": [b - a for a, b in zip(marks["cpu"], marks["cpu"][1:])],
        "train": [t - s for s, t in zip(starts, trains)],
        "eval": [e - t for t, e in zip(trains, ends)],
        "accuracy": marks["accuracy"],
        "partition": partition_digest(ctx.partition),
    }


# ---- fedweave ----------------------------------------------------------------------------------------
def run_fedweave(workload: str, rounds: int, spec: dict, launched: float) -> dict:
    import torch

    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load

    cfg = load(fedweave_config(workload, rounds, spec["backend"], spec.get("threads"), spec.get("workers")))
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    ctx = RunContext(cfg)
    algo = build_algorithm(ctx)  # the runner's loop below, without its result files
    if algo.trainer.backend == "ray":
        from fedweave.execution.ray import pool

        pool(algo.trainer).pids()  # start Ray and the actors before round 1 (counted as start-up)
    if algo.trainer.backend == "pool":
        from fedweave.execution.pool import pool

        pool(algo.trainer)  # fork the workers before round 1 (counted as start-up)
    start = time.time() - launched
    train, evals, accs, cpu = [], [], [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        cpu.append(cpu_seconds())
        algo.run_round(r)
        t1 = time.perf_counter()
        ev = algo.evaluate(r)
        train.append(t1 - t0)
        evals.append(time.perf_counter() - t1)
        accs.append(ev["test_accuracy"])
    cpu.append(cpu_seconds())
    return {
        "startup": start,
        "cpu": [b - a for a, b in zip(cpu, cpu[1:])],
        "train": train,
        "eval": evals,
        "accuracy": accs,
        "backend": algo.trainer.backend,
        "threads": torch.get_num_threads(),
        "partition": partition_digest(ctx.partition),
    }


# ---- Flower ------------------------------------------------------------------------------------------
_CACHE: dict = {}


def _plan(setting: dict):
    """The data, partition, model builder and batch plan shared by Flower's server and client apps."""
    if "plan" not in _CACHE:
        from fedweave.algorithms.base import RunContext
        from fedweave.config import LocalConfig, load
        from fedweave.execution import LocalTrainer

        ctx = RunContext(load(setting["config"]))
        ds = ctx.dataset
        local = LocalConfig(epochs=1, batch_size=setting["batch_size"], lr=LR)
        local.validate()
        # only its batch plan is used: the same ("batches", round, client) stream as fedweave's
        planner = LocalTrainer(ctx.build_model(), ds.train_x, ds.train_y, ctx.partition, local, ctx.seeds)
        _CACHE["plan"] = (ctx, ds, planner)
    return _CACHE["plan"]


def _model(setting: dict):
    if "model" not in _CACHE:
        ctx, _, _ = _plan(setting)
        # reused for every client this process serves, on the client's device
        _CACHE["model"] = ctx.build_model().to(setting.get("device", "cpu"))
    return _CACHE["model"]


def _data(setting: dict):
    """The training set on the client's device, moved once per process."""
    if "data" not in _CACHE:
        _, ds, _ = _plan(setting)
        dev = setting.get("device", "cpu")
        _CACHE["data"] = (ds.train_x.to(dev), ds.train_y.to(dev))
    return _CACHE["data"]


def evaluate_model(model, x, y) -> float:
    import torch

    model.eval()
    correct = 0
    with torch.inference_mode():
        for lo in range(0, len(y), EVAL_BATCH):
            correct += int((model(x[lo : lo + EVAL_BATCH]).argmax(1) == y[lo : lo + EVAL_BATCH]).sum())
    model.train()
    return correct / len(y)


def flower_train(msg, context, setting: dict):
    """The ClientApp's train: plain PyTorch SGD over the client's batches on one reused model."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _, _, planner = _plan(setting)
    x, y = _data(setting)
    dev = x.device
    cid, rnd = int(msg.content["config"]["cid"]), int(msg.content["config"]["round"])
    model = _model(setting)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for b in planner.client_batches(cid, rnd, (), None):
        b = b.to(dev)
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
        opt.step()
    n = len(planner.parts[cid])
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # replies travel in host memory
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": n})})
    return Message(content=content, reply_to=msg)


def run_flower(workload: str, rounds: int, spec: dict, launched: float) -> dict:
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    torch.set_num_threads(2)  # the server's evaluation, like fedweave's
    w = WORKLOADS[workload]
    setting = {
        "config": fedweave_config(workload, rounds),
        "batch_size": w["batch_size"],
        "device": spec.get("device", "cpu"),
    }
    ctx, ds, _ = _plan(setting)
    n, k = w["num_clients"], w["per_round"]
    sampled = [np.sort(ctx.seeds.numpy("client_sampling", r).choice(n, k, replace=False)) for r in range(rounds)]
    marks: dict = {"round_start": [], "train_end": [], "round_end": [], "accuracy": [], "cpu": []}

    class SampledFedAvg(FedAvg):
        """FedAvg whose round-r clients are fedweave's sampled clients (each told its id)."""

        def configure_train(self, server_round, arrays, config, grid):
            marks["round_start"].append(time.time())
            marks["cpu"].append(cpu_seconds())
            nodes = sorted(grid.get_node_ids())
            while len(nodes) < n:  # the nodes register in the background at start-up
                time.sleep(0.05)
                nodes = sorted(grid.get_node_ids())
            msgs = []
            for c in sampled[server_round - 1]:
                cfg = ConfigRecord({"cid": int(c), "round": server_round - 1})
                content = RecordDict({"arrays": arrays, "config": cfg})
                msgs.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=nodes[int(c)]))
            return msgs

        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            marks["train_end"].append(time.time())
            return out

    def central_eval(server_round: int, arrays: ArrayRecord):
        if server_round == 0:
            return None
        model = _model(setting)
        model.load_state_dict(arrays.to_torch_state_dict())
        dev = setting["device"]
        acc = evaluate_model(model, ds.test_x.to(dev), ds.test_y.to(dev))
        marks["accuracy"].append(acc)
        marks["round_end"].append(time.time())
        if server_round == rounds:
            marks["cpu"].append(cpu_seconds())
        return MetricRecord({"accuracy": acc})

    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        strategy = SampledFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n)
        init = ArrayRecord(ctx.build_model().state_dict())  # fedweave's initial weights
        strategy.start(grid=grid, initial_arrays=init, num_rounds=rounds, evaluate_fn=central_eval)

    client = ClientApp()
    # Flower ships the app with every message; the client code lives in an importable module so that each
    # actor process keeps one model and one copy of the data across the messages it serves
    from benchmarks import peers as module

    @client.train()
    def train(msg, context):
        return module.flower_train(msg, context, setting)

    backend = {
        "client_resources": {"num_cpus": spec["actor_cpus"], "num_gpus": spec.get("actor_gpus", 0.0)},
        "init_args": {"num_cpus": spec["actors"] * spec["actor_cpus"]},
    }
    run_simulation(server_app=server, client_app=client, num_supernodes=n, backend_config=backend)
    return peer_timings(marks, launched, ctx, "flwr")


# ---- pfl-research --------------------------------------------------------------------------------
def run_pfl(workload: str, rounds: int, spec: dict, launched: float) -> dict:
    """pfl-research's simulator (``SimulatedBackend``, ``FederatedAveraging``, ``PyTorchModel``) in one process,
    on fedweave's partition, initial weights, sampled clients and batches, weighted by data points."""
    import numpy as np
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(spec["threads"])
    w = WORKLOADS[workload]
    setting = {"config": fedweave_config(workload, rounds), "batch_size": w["batch_size"]}
    ctx, ds, planner = _plan(setting)
    n, k = w["num_clients"], w["per_round"]
    sampled = [np.sort(ctx.seeds.numpy("client_sampling", r).choice(n, k, replace=False)) for r in range(rounds)]
    x, y = ds.train_x, ds.train_y

    class Planned(Dataset):
        """A client's data whose batches are fedweave's (the ``batches`` stream of its round), in order."""

        def __init__(self, cid: int, rnd: int) -> None:
            idx = torch.as_tensor(planner.parts[cid])
            super().__init__((x[idx], y[idx]), user_id=f"{rnd}/{cid}")  # its length weighs its update
            self.planned = list(planner.client_batches(cid, rnd, (), None))

        def iter(self, batch_size):
            for b in self.planned:
                yield (x[b], y[b])

    class Module(torch.nn.Module):
        """fedweave's model with the ``loss`` and ``metrics`` that pfl's ``PyTorchModel`` calls."""

        def __init__(self) -> None:
            super().__init__()
            self.net = ctx.build_model()  # fedweave's initial weights

        def forward(self, inputs):
            return self.net(inputs)

        def loss(self, inputs, targets, eval=False):  # noqa: A002 (pfl's keyword)
            return torch.nn.functional.cross_entropy(self.net(inputs), targets)

        def metrics(self, inputs, targets, eval=False):  # noqa: A002
            return {}  # the global model is evaluated by the Marks callback below, with the peers' code

    # pfl asks its user sampler for one client id at a time: fedweave's sampled clients, round after round
    order = iter([(r, int(c)) for r in range(rounds) for c in sampled[r]])
    data = FederatedDataset(lambda key: Planned(key[1], key[0]), lambda: next(order))
    marks: dict = {"round_start": [], "train_end": [], "round_end": [], "accuracy": [], "cpu": []}

    class Marks(TrainingProcessCallback):
        """Times each round and evaluates the global model with the peers' evaluation code."""

        def on_train_begin(self, *, model):
            marks["round_start"].append(time.time())
            marks["cpu"].append(cpu_seconds())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            marks["train_end"].append(time.time())
            marks["accuracy"].append(evaluate_model(model.pytorch_model, ds.test_x, ds.test_y))
            marks["round_end"].append(time.time())
            marks["cpu"].append(cpu_seconds())
            marks["round_start"].append(time.time())
            return False, Metrics()

    module = Module()
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),  # the averaged difference, applied once
    )
    FederatedAveraging().run(
        # evaluation_frequency past the last round: pfl's per-client evaluation only in round 1 (iteration 0 is a
        # multiple of any frequency), where it costs nothing since ``metrics`` computes nothing
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds, evaluation_frequency=rounds + 1, train_cohort_size=k, val_cohort_size=0
        ),
        backend=SimulatedBackend(training_data=data, val_data=data, postprocessors=[WeightByDatapoints()]),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=LR, local_num_epochs=1, local_batch_size=w["batch_size"]
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=EVAL_BATCH),
        callbacks=[Marks()],
        send_metrics_to_platform=False,  # no metrics table printed each round
    )
    return {**peer_timings(marks, launched, ctx, "pfl"), "threads": torch.get_num_threads()}


# ---- measurement (process-tree memory comes from fedweave.memory) ------------------------------
def matmul_gflops(threads: int, n: int = 2048, reps: int = 10) -> float:
    """Dense float32 matmul throughput of this machine at ``threads`` threads (GFLOP/s)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def eval_variants(workload: str, threads: int, reps: int = 3) -> str:
    """Seconds to evaluate the global model on the 10k test images along cheaper evaluation paths."""
    import torch

    from fedweave.algorithms.base import RunContext
    from fedweave.config import load
    from fedweave.execution import ParamLayout, evaluate
    from fedweave.execution.evaluate import to_channels_last

    torch.set_num_threads(threads)
    ctx = RunContext(load(fedweave_config(workload, 1)))
    x, y = ctx.dataset.test_x, ctx.dataset.test_y
    model = ctx.build_model()
    layout = ParamLayout(model)
    w = layout.flatten()

    def plain(bs: int, channels_last: bool = False):
        m = model.to(memory_format=torch.channels_last) if channels_last else model
        m.eval()
        with torch.inference_mode():
            for lo in range(0, len(y), bs):
                xb = x[lo : lo + bs]
                m(to_channels_last(xb) if channels_last and xb.dim() == 4 else xb).argmax(1)
        m.to(memory_format=torch.contiguous_format).train()

    variants = {
        "fedweave evaluate (channels-last twin for plain CNNs, at most 256 rows a pass)": lambda: evaluate(
            layout, w, x, y, 2048
        ),
        "inference mode, batch 2048 (the peers' evaluation)": lambda: plain(2048),
        "inference mode, batch 256": lambda: plain(256),
        "inference mode, batch 2048, channels-last": lambda: plain(2048, True),
        "inference mode, batch 256, channels-last": lambda: plain(256, True),
    }
    lines = [f"Evaluation of the {workload} model on the 10k test set ({threads} threads, best of {reps}):", ""]
    for name, fn in variants.items():
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        lines.append(f"- {name}: {best:.3f} s")
    return "\n".join(lines)


def train_flops_per_round(workload: str, rounds: int) -> list[float]:
    """FLOPs of local training in each round: 3x the forward FLOPs (forward + backward) of every sample."""
    import numpy as np
    import torch

    from fedweave.algorithms.base import RunContext
    from fedweave.config import load

    ctx = RunContext(load(fedweave_config(workload, rounds)))
    model = ctx.build_model()
    flops = [0]

    def hook(m, inp, out):
        if isinstance(m, torch.nn.Conv2d):
            flops[0] += 2 * out.numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1] // m.groups
        elif isinstance(m, torch.nn.Linear):
            flops[0] += 2 * out.numel() * m.in_features

    for m in model.modules():
        m.register_forward_hook(hook)
    with torch.no_grad():
        model(ctx.dataset.train_x[:1])
    per_sample = flops[0]
    sizes = np.array([len(p) for p in ctx.partition])
    w = WORKLOADS[workload]
    out = []
    for r in range(rounds):
        clients = ctx.seeds.numpy("client_sampling", r).choice(w["num_clients"], w["per_round"], replace=False)
        out.append(3.0 * per_sample * float(sizes[clients].sum()))
    return out


def launch(name: str, workload: str, rounds: int, python: str = sys.executable) -> dict:
    """Run one configuration in a fresh process of the interpreter ``python``, sampling its process tree's
    memory."""
    out = Path(f"/tmp/peers-{os.getpid()}-{name}-{workload}.json")
    cmd = [python, __file__, "--child", name, "--workload", workload, "--rounds", str(rounds)]
    launched = time.time()
    cmd += ["--out", str(out), "--launched", repr(launched)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env())
    peak = {"rss": 0, "pss": 0, "anon": 0, "shmem": 0}
    nprocs = 0
    while proc.poll() is None:
        pids = process_tree(proc.pid)
        for k, v in memory(pids).items():
            peak[k] = max(peak[k], v)
        nprocs = max(nprocs, len(pids))
        time.sleep(0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} on {workload} failed with exit code {proc.returncode}")
    res = json.loads(out.read_text())
    out.unlink()
    res.update({f"peak_{k}": v for k, v in peak.items()}, processes=nprocs, total=time.time() - launched)
    res["load"] = os.getloadavg()[0]
    return res


def _median_rounds(values: list[float]) -> float:
    return statistics.median(values[1:] or values)  # round 1 pays the warm-up


def releases(results: dict[str, list[dict]]) -> str:
    """The peers' releases the runs in ``results`` measured (``flower-2x1: flwr 1.42.0``), each configuration
    once; more than one release for a configuration names them all."""
    seen = {name: sorted({r["release"] for r in runs if "release" in r}) for name, runs in results.items()}
    return "; ".join(f"{name}: {', '.join(found)}" for name, found in seen.items() if found)


def summarize(workload: str, rounds: int, results: dict[str, list[dict]], threads: int) -> str:
    """One table row per configuration: medians over the repetitions, which ran interleaved."""
    fl = train_flops_per_round(workload, rounds)
    peak = matmul_gflops(threads)
    loads = [r["load"] for runs in results.values() for r in runs]
    reps = max(len(runs) for runs in results.values())
    lines = [
        f"## {workload}: {rounds} rounds, {reps} interleaved repetition(s), "
        f"load average {min(loads):.1f}-{max(loads):.1f} (1 min, after each run)",
        "",
        "| configuration | per round (s) | per round, each repetition (s) | train / eval (s) | CPU per round (s) "
        "| round 1 (s) | start-up (s) | start-up + warm-up (s) | peak RSS / PSS (GB) | peak anon / shm (GB) "
        "| processes | final acc (%) | train GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if rounds < 2:  # _median_rounds falls back on round 1: say so rather than label it a median of rounds 2..R
        lines[1:1] = [
            "One round only: per round, train / eval and CPU per round are round 1's, warm-up included, not the "
            "median of rounds 2..R (give --rounds 2 or more).",
        ]
    per_rep: dict[str, list[float]] = {}
    for name, runs in results.items():
        per_rep[name] = [_median_rounds([a + b for a, b in zip(r["train"], r["eval"])]) for r in runs]
        med = statistics.median
        tr = med([_median_rounds(r["train"]) for r in runs])
        ev = med([_median_rounds(r["eval"]) for r in runs])
        cpu = med([_median_rounds(r["cpu"]) for r in runs])
        first = med([r["train"][0] + r["eval"][0] for r in runs])
        start = med([r["startup"] for r in runs])
        warm = med([r["startup"] + max(r["train"][0] + r["eval"][0] - p, 0) for r, p in zip(runs, per_rep[name])])
        gflops = sum(fl[1:] or fl) / tr / max(len(fl) - 1, 1) / 1e9
        pk = {k: max(r[f"peak_{k}"] for r in runs) / 2**30 for k in ("rss", "pss", "anon", "shmem")}
        label = f"{name} ({runs[0]['backend']})" if "backend" in runs[0] else name
        lines.append(
            f"| {label} | {med(per_rep[name]):.3f} | {', '.join(f'{v:.3f}' for v in per_rep[name])} "
            f"| {tr:.3f} / {ev:.3f} | {cpu:.2f} | {first:.2f} | {start:.1f} | {warm:.1f} "
            f"| {pk['rss']:.2f} / {pk['pss']:.2f} | {pk['anon']:.2f} / {pk['shmem']:.2f} "
            f"| {max(r['processes'] for r in runs)} | {100 * runs[-1]['accuracy'][-1]:.2f} "
            f"| {gflops:.1f} ({100 * gflops / peak:.0f}% of matmul) |"
        )
    lines.append("")
    lines.append(
        f"Dense float32 matmul (2048^2, {threads} threads): {peak:.1f} GFLOP/s; train GFLOP/s = training FLOPs "
        "of a median round over its median training time."
    )
    accs = {n: 100 * r["accuracy"][-1] for n, runs in results.items() for r in runs}
    spread = max(accs.values()) - min(accs.values())
    digests = {r["partition"] for runs in results.values() for r in runs}
    lines.append(f"Same partition in every run: {'yes' if len(digests) == 1 else 'NO'} ({', '.join(digests)}).")
    verdict = "agree" if spread <= 0.5 else "DISAGREE: the comparison is void"
    lines.append(f"Final accuracies {verdict} (spread {spread:.2f} points).")
    if peers := releases(results):
        lines.append(f"Peer releases measured: {peers}.")
    med_rep = {n: statistics.median(v) for n, v in per_rep.items()}
    fw = {n: v for n, v in med_rep.items() if n.startswith("fedweave")}
    for framework, label in (("flower", "Flower"), ("pfl", "pfl-research")):
        peer = {n: v for n, v in med_rep.items() if CONFIGS[n]["framework"] == framework}
        if not (fw and peer):
            continue
        best_fw, best_peer = min(fw, key=fw.get), min(peer, key=peer.get)
        pairs = [a / b for a, b in zip(per_rep[best_fw], per_rep[best_peer])]
        ratio = fw[best_fw] / peer[best_peer]
        lines.append(
            f"Best fedweave ({best_fw}) / best {label} ({best_peer}) per round: {ratio:.3f}x ({label} "
            f"{1 / ratio:.1f}x slower); per repetition {', '.join(f'{x:.3f}' for x in pairs)}."
        )
    return "\n".join(lines)


def check_bench_extra(chosen: set[str]) -> str | None:
    """Why this environment cannot run the chosen configurations that need the ``bench`` extra (Flower's
    simulation engine, Ray), or None when it can: checked before anything runs, so that a missing Flower is one
    line and not a child's traceback after the fedweave configurations have run."""
    needs = {"flwr": [n for n in chosen if CONFIGS[n]["framework"] == "flower"]}
    needs["ray"] = needs["flwr"] + [n for n in chosen if CONFIGS[n].get("backend") == "ray"]
    for module, names in needs.items():
        if names and importlib.util.find_spec(module) is None:
            return (
                f"{module} is not installed, and {', '.join(sorted(names))} need{'s' if len(names) == 1 else ''} "
                "it: pip install 'fedweave[bench]', or choose other configurations with --only"
            )
    return None


def check_pfl(python: str) -> str | None:
    """Why ``python`` cannot run the pfl configurations (it must import pfl, torch and this checkout's
    fedweave), or None when it can."""
    hint = "give the Python of an environment with pfl-research (docs/performance.md, Peer frameworks)"
    try:
        done = subprocess.run([python, "-c", "import pfl, torch, fedweave"], env=child_env(), capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    except OSError as e:
        return f"--pfl-python {python}: cannot run it ({e.strerror}); {hint}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"--pfl-python {python}: cannot import pfl, torch and fedweave ({last}); {hint}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["cnn"], choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), help="configurations to run (default: per workload)")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions, interleaved across configurations")
    ap.add_argument("--json", type=Path, help="also write all measurements here")
    ap.add_argument("--eval-variants", action="store_true", help="also time cheaper evaluation paths")
    ap.add_argument(
        "--pfl-python",
        default=sys.executable,
        help="the Python of an environment with pfl-research (pip install 'pfl[pytorch]==0.6.0' and fedweave's "
        "dependencies), which runs the pfl configurations (default: this one)",
    )
    ap.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for flag in ("rounds", "repeat"):
        if (value := getattr(args, flag.replace("-", "_"))) < 1:
            ap.error(f"--{flag} must be at least 1, got {value}")
    if args.json is not None and not args.json.parent.is_dir():  # else the measurements were lost at the end
        ap.error(f"--json {args.json}: its folder {args.json.parent} does not exist")
    if args.json is not None and args.json.is_dir() and not args.child:  # the same: a traceback after every run
        ap.error(f"--json {args.json} is a folder; give the path of a file")
    if args.json is not None and args.json.exists() and not args.child:  # an earlier sitting's measurements
        ap.error(f"--json {args.json} exists; give a new file (the measurements of a sitting are never replaced)")
    if args.child:
        spec = CONFIGS[args.child]
        fn = globals()[RUNNERS[spec["framework"]]]
        res = fn(args.workload[0], args.rounds, spec, args.launched)
        args.out.write_text(json.dumps(res))
        return
    chosen = {n for w in args.workload for n in (args.only or DEFAULT_CONFIGS[w])}
    if gpu := sorted(n for n in chosen if "gpu" in n):
        import torch  # the parent's one use of torch (its measurements run in children)

        if not torch.cuda.is_available():  # Flower's GPU actors never start: its simulation waited forever
            ap.exit(2, f"peers.py: error: --only {', '.join(gpu)} needs a CUDA GPU, and torch sees none here\n")
    if why := check_bench_extra(chosen):
        ap.exit(2, f"peers.py: error: {why}\n")
    if any(CONFIGS[n]["framework"] == "pfl" for n in chosen) and (why := check_pfl(args.pfl_python)):
        ap.exit(2, f"peers.py: error: {why}\n")
    everything = {}
    for workload in args.workload:
        names = args.only or DEFAULT_CONFIGS[workload]
        results: dict[str, list[dict]] = {name: [] for name in names}
        for rep in range(args.repeat):  # interleaved, so that changes in the machine's load hit every one
            for name in names:
                print(f"[{workload}] {name}, repetition {rep + 1} ...", file=sys.stderr, flush=True)
                python = args.pfl_python if CONFIGS[name]["framework"] == "pfl" else sys.executable
                results[name].append(launch(name, workload, args.rounds, python))
        everything[workload] = results
        print(summarize(workload, args.rounds, results, threads=2), flush=True)
        print()
        if args.eval_variants:
            for threads in (1, 2):
                print(eval_variants(workload, threads=threads), flush=True)
                print()
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
