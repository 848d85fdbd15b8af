"""The run's placement (``device``, ``precision: bf16-mixed``): every family follows it, checkpoints do not
depend on it, and the execution and algorithm layers make no tensor without saying where.

Tests are parametrized over the devices of this machine: ``cpu`` always, ``cuda`` and ``mps`` where present
(skipped with the reason otherwise), so the same file checks a GPU machine.
"""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import pytest
import torch
from test_precision import family_config  # the tiny two-round config of every family

import fedweave
import fedweave.algorithms  # noqa: F401  (registers the algorithms)
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.checkpoints import CHECKPOINT, floating_tensors, load_checkpoint, read_checkpoint
from fedweave.cli import main
from fedweave.config import ConfigError
from fedweave.config import load as load_config
from fedweave.execution.placement import available_devices, resolve_placement
from fedweave.registry import ALGORITHMS
from fedweave.runner import resume

SRC = Path(fedweave.__file__).parent
HAVE = available_devices()


def _device_param(kind: str):
    present = [d for d in HAVE if d.split(":")[0] == kind]
    reason = f"no {kind} device on this machine (available: {', '.join(HAVE)})"
    return pytest.param(present[0] if present else kind, marks=pytest.mark.skipif(not present, reason=reason))


DEVICES = [_device_param("cpu"), _device_param("cuda"), _device_param("mps")]


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _tensors(v)


# ---- every algorithm of every family, bf16-mixed ---------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in ALGORITHMS.names() if not n.startswith("_")])  # not a test's own
def test_every_algorithm_runs_two_rounds_bf16_mixed(name, device, tmp_path):
    if device == "mps" and ALGORITHMS.get(name).family in ("confederated", "hierarchical"):
        pytest.skip("these families compute in float64, which MPS lacks (a ConfigError there)")
    cfg = {**family_config(name), "device": device, "precision": "bf16-mixed"}
    if ALGORITHMS.get(name).family == "confederated":  # closed-form float64 gradients: nothing to autocast
        with pytest.raises(ConfigError, match="precision: bf16-mixed"):
            fedweave.run(cfg, run_dir=tmp_path / "r")
        assert not (tmp_path / "r").exists()
        return
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert res.summary["status"] == "completed" and res.summary["rounds"] == 2
    assert res.summary["placement"]["precision"] == "bf16-mixed"
    assert torch.device(res.summary["placement"]["device"]).type == device.split(":")[0]
    final = res.summary["final"]
    assert all(math.isfinite(v) for k, v in final.items() if isinstance(v, float)), final
    # parameters, updates and per-client state (tensors of model rows) stay float32 (selection bookkeeping is
    # float64 on the host in every precision)
    algo = res.algorithm
    if algo.family == "split":
        sizes, stored = {algo.lc.numel, algo.ls.numel, algo.la.numel}, torch.float32
    else:
        sizes, stored = {algo.layout.numel}, torch.float32
    rows = {p: t for p, t in floating_tensors(algo.state_dict()) if t.dim() and t.shape[-1] in sizes}
    assert rows, "the algorithm keeps model-sized state"
    wrong = {p: t.dtype for p, t in rows.items() if t.dtype != stored}
    assert not wrong, wrong


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_bf16_mixed_autocasts_training_and_evaluation_and_keeps_float32_state(backend, tmp_path):
    """A matmul inside local training and evaluation runs in bfloat16; parameters and the update stay float32."""
    cfg = {**family_config("fedavg"), "device": "cpu", "precision": "bf16-mixed", "backend": backend}
    cfg["model"] = {"name": "mlp", "hidden": [16]}
    ctx = RunContext(load_config(cfg))
    algo = build_algorithm(ctx)
    seen: list[tuple[str, torch.dtype]] = []
    phase = {"now": "train"}
    for m in ctx.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append((phase["now"], out.dtype)))
    algo.run_round(0)
    phase["now"] = "eval"
    algo.evaluate(0)
    assert {d for p, d in seen if p == "train"} == {torch.bfloat16}
    assert {d for p, d in seen if p == "eval"} == {torch.bfloat16}
    assert algo.x.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in ctx.model.parameters())


def test_float32_does_not_autocast(tmp_path):
    ctx = RunContext(load_config({**family_config("fedavg"), "model": {"name": "mlp", "hidden": [16]}}))
    algo = build_algorithm(ctx)
    seen = []
    for m in ctx.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    algo.evaluate(0)
    assert set(seen) == {torch.float32}


def test_bf16_mixed_changes_the_numbers_a_little(tmp_path):
    """Autocast really computes in bfloat16 (the run differs from float32), yet lands close to it."""
    cfg = {**family_config("fedavg"), "device": "cpu"}
    f32 = fedweave.run(cfg, run_dir=tmp_path / "a").summary["final"]
    bf = fedweave.run({**cfg, "precision": "bf16-mixed"}, run_dir=tmp_path / "b").summary["final"]
    assert f32["test_loss"] != bf["test_loss"]
    assert bf["test_loss"] == pytest.approx(f32["test_loss"], rel=0.05)


# ---- same numbers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fedavg", "scaffold", "zo_hfl", "gossip", "cse_fsl", "cfl_saga"])
def test_explicit_cpu_gives_the_numbers_of_the_default(name, tmp_path):
    """``device: cpu`` computes what a config without ``device`` computes where auto resolves to the CPU;
    where auto picks an accelerator, the two agree to float tolerance (the same seed, the same draws)."""
    base = family_config(name)
    default = fedweave.run(base, run_dir=tmp_path / "auto")
    cpu = fedweave.run({**base, "device": "cpu"}, run_dir=tmp_path / "cpu")
    assert cpu.summary["placement"]["device"] == "cpu"
    if default.summary["placement"]["device"] == "cpu":
        assert cpu.metrics == [{**r, "wall_seconds": c["wall_seconds"]} for r, c in zip(default.metrics, cpu.metrics)]
    else:
        for a, b in zip(default.metrics, cpu.metrics):
            for k, v in a.items():
                if k != "wall_seconds" and isinstance(v, float):
                    assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-4), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fedavg", "scaffold", "hier_scaffold", "dfedavg", "fsl_an", "gt_saga"])
def test_same_seed_same_numbers_on_every_device(name, device, tmp_path):
    if device == "mps" and ALGORITHMS.get(name).family in ("confederated", "hierarchical"):
        pytest.skip("float64 families: not on MPS")
    cpu = fedweave.run({**family_config(name), "device": "cpu"}, run_dir=tmp_path / "cpu").metrics
    got = fedweave.run({**family_config(name), "device": device}, run_dir=tmp_path / "dev").metrics
    for a, b in zip(cpu, got, strict=True):
        assert set(a) == set(b)
        for k, v in a.items():
            if k != "wall_seconds":
                assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-4), k


@pytest.mark.parametrize("device", [_device_param("cuda")])
def test_float32_on_cuda_turns_tf32_off(device):
    """cuDNN lets convolutions run in TF32 by default; precision float32 means float32 there too."""
    torch.backends.cudnn.allow_tf32 = True
    resolve_placement(device, "bf16-mixed")
    assert torch.backends.cudnn.allow_tf32  # bf16-mixed leaves torch's switches alone
    resolve_placement(device, "float32")
    assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("device", [_device_param("cuda")])
def test_a_cuda_run_picks_deterministic_kernels(device, monkeypatch):
    """Whatever the precision: cuDNN's deterministic algorithms without benchmark mode, and cuBLAS's fixed
    workspace unless the environment chose one."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    resolve_placement(device, "bf16-mixed")
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    resolve_placement(device, "float32")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


CNN_ON_MNIST = {
    "name": "cuda-twice", "seed": 3, "rounds": 3, "dataset": {"name": "mnist", "max_train": 3000, "max_test": 1000},
    "partition": {"name": "dirichlet", "num_clients": 10, "alpha": 0.3}, "model": {"name": "cnn_mnist"},
    "algorithm": {"name": "fedavg", "clients_per_round": 5}, "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
    "output": {"progress": False, "plots": False, "checkpoint_every": 1},
}  # fmt: skip


@pytest.mark.parametrize("device", [_device_param("cuda")])
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_cnn_run_twice_on_cuda_gives_the_same_numbers(device, backend, tmp_path):
    """Convolutions' weight gradients are where a GPU's default kernels differ from run to run: the MNIST CNN,
    run twice with one seed on one CUDA device, gives the same metrics and final model, bit for bit."""
    from fedweave.data.sources import DataNotFoundError, resolve

    try:
        resolve("mnist", offline=True)
    except DataNotFoundError:
        pytest.skip("mnist is not in the data cache (fedweave data fetch mnist)")
    cfg = {**CNN_ON_MNIST, "device": device, "backend": backend}
    a, b = (fedweave.run(cfg, run_dir=tmp_path / k) for k in "ab")
    drop = lambda rows: [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]  # noqa: E731
    assert drop(a.metrics) == drop(b.metrics)
    sa, sb = (dict(floating_tensors(read_checkpoint(tmp_path / k / CHECKPOINT))) for k in "ab")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- clear errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cuda:7", "mps"])
def test_an_absent_device_stops_with_one_line_before_anything_is_written(device, tmp_path, capsys):
    if device in HAVE or (device == "cuda" and "cuda:0" in HAVE):
        pytest.skip(f"{device} exists on this machine")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dataset: digits\nmodel: logistic\nrounds: 1\noutput: {progress: false, plots: false}\n")
    out = tmp_path / "run"
    code = main(["run", str(cfg), f"device={device}", f"output.dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("fedweave: error: device:"), err
    assert repr(device) in err[0] and "available: cpu" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "tpu"])
def test_a_malformed_device_names_the_key_and_the_choices(bad):
    with pytest.raises(ConfigError, match=r"device must be one of auto, cpu, cuda, cuda:N or mps"):
        load_config({"device": bad})


@pytest.mark.parametrize(
    "override, match",
    [
        ("memory.data_fraction=1.5", r"memory\.data_fraction must be a fraction in \[0, 1\]"),
        ("memory.vmap_chunk=0", r"memory\.vmap_chunk must be >= 1 or null"),
        ("ray.num_gpus_per_worker=-1", r"ray\.num_gpus_per_worker must be in \[0, 64\]"),
        ("precision=bf16", r"precision must be one of \['float32', 'float64', 'bf16-mixed'\]"),
    ],
)
def test_placement_keys_are_checked(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config({}, [override])


def test_auto_resolves_once_and_is_recorded(tmp_path):
    res = fedweave.run(family_config("fedavg"), run_dir=tmp_path / "r")
    want = resolve_placement("auto", "float32")
    assert res.summary["placement"] == {"device": str(want.device), "device_name": want.name, "precision": "float32"}
    assert res.summary["placement"]["device_name"]


def test_pool_backend_refuses_an_accelerator():
    from fedweave.execution.placement import Placement

    fake_gpu = Placement(torch.device("cuda", 0), precision="float32", name="(not used)")
    from fedweave.config import LocalConfig
    from fedweave.execution import LocalTrainer
    from fedweave.seeding import Seeds

    with pytest.raises(ConfigError, match=r"backend: pool forks CPU worker processes"):
        LocalTrainer(torch.nn.Linear(2, 2), torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), [[0, 1]],
                     LocalConfig(), Seeds(0), backend="pool", placement=fake_gpu)  # fmt: skip


def test_device_out_of_memory_is_one_line_naming_the_knob():
    from fedweave.execution.placement import DeviceMemoryError, Placement

    pl = Placement()
    match = r"^out of memory on cpu .* while training 8 clients; lower memory"
    with (
        pytest.raises(DeviceMemoryError, match=match),
        pl.out_of_memory("training 8 clients", "lower memory.vmap_chunk"),
    ):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "\n" not in str(DeviceMemoryError("a\nb"))


# ---- checkpoints --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["scaffold", "ditto", "cse_fsl", "hier_scaffold"])
def test_checkpoints_are_device_independent(name, device, tmp_path):
    """A run checkpointed on the CPU holds host tensors only, loads onto any placement's device, and resumes
    there to the numbers of an uninterrupted run (exactly on the CPU; to float tolerance elsewhere)."""
    if device == "mps" and name == "hier_scaffold":
        pytest.skip("float64 families: not on MPS")
    cfg = {**family_config(name), "rounds": 4, "device": "cpu"}
    cfg["output"] = {"progress": False, "plots": False, "checkpoint_every": 1}
    whole = fedweave.run(cfg, run_dir=tmp_path / "whole")
    part = fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "part")
    saved = read_checkpoint(part.run_dir / CHECKPOINT)  # where the tensors were stored
    assert all(t.device.type == "cpu" for t in _tensors(saved))
    # loading maps them to the run's device
    ctx = RunContext(load_config({**cfg, "rounds": 4, "device": device}))
    algo = build_algorithm(ctx)
    ckpt = load_checkpoint(part.run_dir, algo, ctx.config, ctx.device)
    assert {t.device for t in _tensors(ckpt["algorithm"])} == {ctx.device}
    resumed = resume(part.run_dir, [f"device={device}", "rounds=4"])
    assert resumed.summary["placement"]["device"] == str(ctx.device)
    for a, b in zip(whole.metrics, resumed.metrics, strict=True):
        for k, v in a.items():
            if k == "wall_seconds":
                continue
            if ctx.device.type == "cpu":
                assert b[k] == v, k
            else:
                assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-4), k


def test_a_resumed_run_may_change_device_but_not_precision(tmp_path):
    cfg = {**family_config("fedavg"), "rounds": 3, "output": {"progress": False, "plots": False, "checkpoint_every": 1}}
    part = fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match=r"precision changed since the checkpoint"):
        resume(part.run_dir, ["precision=bf16-mixed", "rounds=3"])
    assert resume(part.run_dir, ["device=cpu", "rounds=3"]).summary["rounds"] == 3


# ---- memory stays flat on a GPU -------------------------------------------------------------------------------
@pytest.mark.skipif(not any(d.startswith("cuda") for d in HAVE), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_cuda_memory_is_flat_over_100_rounds(backend):
    cfg = {**family_config("scaffold"), "rounds": 100, "device": "cuda", "backend": backend}
    cfg["eval"] = {"every": 10}
    ctx = RunContext(load_config(cfg))
    algo = build_algorithm(ctx)
    pl = ctx.placement
    peaks = {}
    for r in range(100):
        algo.run_round(r)
        if (r + 1) % 10 == 0:
            algo.evaluate(r)
        if r + 1 in (10, 100):
            pl.synchronize()
            peaks[r + 1] = pl.peak_bytes()
    assert peaks[100] <= 1.05 * peaks[10], peaks


# ---- the review rules -------------------------------------------------------------------------------------
FACTORIES = {
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand", "randint", "randperm",
    "eye", "linspace", "from_numpy", "empty_strided", "normal",
}  # fmt: skip
# (file, the call's source text) -> why it may make a tensor without naming a device
ALLOWED_FACTORIES = {
    ("execution/pool.py", "torch.from_numpy(call.starts)"): "pool workers are forked CPU processes (refused off-CPU)",
    ("execution/pool.py", "torch.from_numpy(w)"): "pool workers are forked CPU processes (refused off-CPU)",
    ("execution/pool.py", "torch.from_numpy(p[i])"): "pool results arrive on the CPU driver (refused off-CPU)",
    ("execution/ray.py", "torch.from_numpy(x)"): "the object store's arrays; the trainer places them on its device",
    ("execution/ray.py", "torch.from_numpy(y)"): "the object store's arrays; the trainer places them on its device",
    ("execution/state.py", "torch.from_numpy(arr)"): "a memory-mapped table lives in host memory by design",
    ("algorithms/base.py", "torch.from_numpy(z[k])"): "initial weights read from a file, copied into the model",
    ("topology/confederation.py", "torch.from_numpy(w)"): "the host mixing matrix; mix() moves it to z's device",
    # the batch plan is index arithmetic on the host (numpy); the trainer moves each step's batch to its device
    ("execution/local.py", "torch.from_numpy(np.where(valid, source, 0))"): "the host batch plan's indices",
    ("execution/local.py", "torch.from_numpy(valid)"): "the host batch plan's mask",
    ("execution/local.py", "torch.from_numpy(count.astype(np.int64))"): "the host batch plan's step counts",
}
LAYERS = ("execution", "algorithms", "topology")


def _calls(path: Path, attrs: set[str] | tuple[str, ...]):
    """(call, its parent node, its source text) of every call of an attribute named in ``attrs``."""
    text = path.read_text()
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in attrs:
            yield node, parents.get(node), ast.get_source_segment(text, node)


def test_no_tensor_is_made_without_an_explicit_device():
    """The review rule of DESIGN principle 9: in the execution, topology and algorithm layers every
    torch.zeros/ones/empty/full/tensor/arange/randn/... names its device (``*_like`` and ``x.new_*`` take
    theirs from a tensor), or is a ``from_numpy(...).to(device)``; the exceptions say why."""
    found, used = [], set()
    for layer in LAYERS:
        for path in sorted((SRC / layer).rglob("*.py")):
            rel = str(path.relative_to(SRC))
            for node, parent, text in _calls(path, FACTORIES):
                f = node.func
                if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch"):
                    continue
                if f.attr not in FACTORIES or any(k.arg == "device" for k in node.keywords):
                    continue
                if isinstance(parent, ast.Attribute) and parent.attr == "to":  # torch.from_numpy(a).to(device)
                    continue
                if (rel, text) in ALLOWED_FACTORIES:
                    used.add((rel, text))
                    continue
                found.append(f"{rel}:{node.lineno}: {text}")
    assert not found, "tensors made without an explicit device:\n" + "\n".join(found)
    assert used == set(ALLOWED_FACTORIES), f"stale allow-list entries: {set(ALLOWED_FACTORIES) - used}"


# the per-step code of local training, on every backend
HOT_PATH = ("execution/local.py", "execution/loop.py", "execution/vmap.py", "execution/fused.py",
            "execution/batched.py", "execution/dpsgd.py", "execution/shards.py")  # fmt: skip
ALLOWED_HOST_READS = {
    ("execution/dpsgd.py", "jobs.tolist()"): "each job's DP noise comes from its own CPU generator (the same "
    "noise on every device), so the step's job ids come to the host",
    ("execution/vmap.py", "active.tolist()"): "a CPU tensor (the active jobs are found from the CPU batch plan): "
    "no device synchronisation",
    ("execution/local.py", "torch.cat(draws).numpy()"): "the batch plan's permutations, drawn on the CPU "
    "(device='cpu'): no device synchronisation",
    ("execution/local.py", "c[drawn].tolist()"): "the batch plan's client ids, a numpy array on the host: no "
    "device synchronisation",
}


def test_no_host_round_trip_in_the_hot_path_of_local_training():
    """No ``.item()``, ``.numpy()`` or ``.tolist()`` in local training's per-step code: each waits for the
    device. Per-step losses stay on the device and are summed there (``summed_losses``)."""
    found, used = [], set()
    for rel in HOT_PATH:
        for node, _, text in _calls(SRC / rel, ("item", "numpy", "tolist")):
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("item", "numpy", "tolist"):
                if (rel, text) in ALLOWED_HOST_READS:
                    used.add((rel, text))
                    continue
                found.append(f"{rel}:{node.lineno}: {text}")
    assert not found, "host round trips in local training:\n" + "\n".join(found)
    assert used == set(ALLOWED_HOST_READS)


def test_only_the_placement_asks_torch_which_devices_exist():
    """DESIGN principle 9: one module decides; the others read the run context's placement."""
    asks = ("cuda.is_available", "cuda.device_count", "backends.mps", "mps.is_available")
    where = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if any(a in p.read_text() for a in asks) and p.name != "placement.py"
    ]
    assert not where, where


def test_move_tensors_copies_a_rule_with_its_tensors_moved_and_shares_the_rest():
    """How a rule travels to a worker on another device: every tensor it holds (nested, shared ones once)
    moved, the original untouched, modules, callables and plain values shared."""
    from fedweave.algorithms.centralized.scaffold import ScaffoldRule
    from fedweave.execution.local import Reindexed
    from fedweave.execution.placement import move_tensors

    c = torch.ones(3, 4, dtype=torch.float64)
    inner = ScaffoldRule(c, c[0])
    rule = Reindexed(inner, torch.arange(3))
    rule.extra = {"pair": [c, (c,)], "n": 3, "fn": len, "model": torch.nn.Linear(2, 2)}
    moved = move_tensors(rule, torch.device("meta"))  # a device nothing else uses: every tensor must move
    assert type(moved) is Reindexed and type(moved.rule) is ScaffoldRule and moved is not rule
    assert moved.positions.device.type == "meta" and moved.rule.c_local.device.type == "meta"
    assert moved.extra["pair"][0] is moved.extra["pair"][1][0]  # a tensor held twice is moved once
    assert moved.extra["n"] == 3 and moved.extra["fn"] is len and moved.extra["model"] is rule.extra["model"]
    assert rule.rule.c_local.device.type == "cpu" and rule.positions.device.type == "cpu"  # the original stays
