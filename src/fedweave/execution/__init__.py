"""Execution: how the local work of many clients is computed (loop, vmap), and evaluation."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedweave.config import ConfigError
from fedweave.execution.evaluate import (
    client_means,
    client_spread,
    evaluate,
    evaluate_clients,
    evaluate_clients_task,
    evaluate_task,
    with_samples,
)
from fedweave.execution.job import LocalCall, StepGradient
from fedweave.execution.local import LocalResult, LocalRule, LocalTrainer
from fedweave.execution.params import ParamLayout
from fedweave.execution.placement import CPU, Placement, resolve_placement
from fedweave.execution.state import StateStore

__all__ = [
    "LocalCall",
    "StepGradient",
    "LocalResult",
    "LocalRule",
    "LocalTrainer",
    "ParamLayout",
    "CPU",
    "Placement",
    "StateStore",
    "resolve_placement",
    "choose_backend",
    "evaluate",
    "evaluate_task",
    "evaluate_clients_task",
    "client_means",
    "client_spread",
    "evaluate_clients",
    "with_samples",
]


def choose_backend(
    requested: str,
    model: nn.Module,
    jobs_per_call: int,
    threads: int | None = None,
    device: torch.device | str = "cpu",
) -> str:
    """Resolve ``auto`` (DESIGN principle 4) for a process with ``threads`` torch threads (default: the
    current count) computing on ``device``.

    On an accelerator: ``vmap`` from 2 jobs per call for a model it can batch (no buffers, no recurrent
    layers), else ``loop``; never ``pool`` (forked CPU workers). It follows the design (many clients in one
    computation keep a GPU busy); ``benchmarks/gpu.py`` measures it, and its H100 and H200 numbers in
    docs/performance.md (GPUs) found ``vmap`` the fastest variant in every workload.

    On a CPU, measured on 2 cores, FedAvg on MNIST (docs/performance.md):

    - ``vmap`` for a single linear layer (softmax regression) from 16 jobs per call with 2 or more threads:
      its batched matrix products use both threads (50 jobs: 2.5 vs 3.4-3.8 s wall for 20 rounds), while the
      loop's fused kernel (``execution.fused``) is as fast or faster at one thread or with few jobs (2
      jobs, 2 threads: 0.28-0.34 vs 0.44-0.50 s; 10 jobs a tie; 100 jobs, 1 thread: 0.30 vs 0.35 s a round).
    - ``pool`` for a convolutional model from 2 jobs per call with 2 or more threads: one-thread worker
      processes beat one process with the same threads on small convolutions, on an idle machine (the
      demo's CNN: 7.0 vs 9.3 s for 10 rounds) and more so on a busy one, where the threads of one process
      spin waiting for each other.
    - ``loop`` otherwise; MLPs train with the loop's fused kernel (vmap measured 0.4-1.2x the loop on MLPs
      and CNNs).
    """
    if requested != "auto":
        return requested
    if torch.device(device).type != "cpu":
        batchable = not list(model.buffers()) and not any(isinstance(m, nn.RNNBase) for m in model.modules())
        batchable = batchable and not batch_statistics(model)  # vmap's padded rows would enter its statistics
        return "vmap" if batchable and jobs_per_call >= 2 else "loop"
    threads = torch.get_num_threads() if threads is None else threads
    layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
    if len(layers) == 1 and isinstance(layers[0], nn.Linear):
        return "vmap" if threads >= 2 and jobs_per_call >= 16 else "loop"
    conv = any(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for m in layers)
    return "pool" if conv and jobs_per_call >= 2 and threads >= 2 else "loop"


def batch_statistics(model: nn.Module) -> bool:
    """True when ``model`` normalizes with its batch's statistics (batch norm): every row of a batch then
    changes every other row's output, the padding rows of the vmap backend's short batches included."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


DROPOUTS = (nn.modules.dropout._DropoutNd,)  # Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout


def check_seeded(model: nn.Module, sample: torch.Tensor | None = None) -> None:
    """Local training draws every random number from the run's named streams; a dropout module draws its masks
    from torch's global generator instead, so the same seed would give other numbers on the loop backend
    (silently) and the vmap backend could not draw them at all. One ConfigError naming the module. With a
    ``sample`` of training inputs, a forward pass in training mode that draws from the global generator some
    other way (``F.dropout`` in ``forward``, ``torch.rand``) is one ConfigError too, and so is one that changes a
    buffer of the model (an instance norm's running statistics, a spectral norm's power-iteration vectors, a
    counter): the flat parameter vector that every backend trains, the server averages and a checkpoint holds does
    not carry buffers, so the pool's and Ray's workers would each move their own and a resumed run would start
    from the built model's, and the same seed would give other numbers (batch norm's running statistics are
    :func:`check_running_stats`'s to refuse, in its words, after a method's own checks)."""
    drops = [repr(n or type(m).__name__) for n, m in model.named_modules() if isinstance(m, DROPOUTS) and m.p > 0]
    if drops:
        raise ConfigError(
            f"model: its dropout {', '.join(drops)} would draw its masks from torch's global generator, not from "
            "the run's seed, so a seed would not give the same numbers (and backend vmap cannot draw them); remove it "
            "or set p=0 (the split family draws its models' dropout from the run's streams)"
        )
    if sample is None:
        return
    trial = training_trial(model, sample)
    if trial is None:  # the model cannot read the sample: another check names that
        return
    draws, changed = trial
    if draws:
        raise ConfigError(
            "model: its forward pass in training mode draws random numbers from torch's global generator (as "
            "F.dropout or torch.rand in forward do), not from the run's seed, so a seed would not give the same "
            "numbers (and backend vmap cannot draw them); draw nothing at random in forward"
        )
    if changed is not None:
        owner, kind, buffer = changed
        where = repr(owner) if owner else "(the model itself)"
        raise ConfigError(
            f"model: its {kind} {where} changes its buffer {buffer!r} in training, and buffers are not parameters: "
            "no backend carries them from client to server, no checkpoint holds them, and the pool's and Ray's "
            "workers would each keep their own, so a seed would not give the same numbers; keep what training "
            "changes in parameters and only constants in buffers (a norm layer: track_running_stats=False)"
        )


def draws_global_random(model: nn.Module, sample: torch.Tensor) -> bool:
    """Whether a training-mode forward pass of ``sample`` through a copy of ``model`` (no batch-norm statistics of
    the run's model move) moves torch's global generator: the CPU's, and the sample's CUDA device's. The
    generators are put back as they were; a model that cannot read the sample is another check's to report."""
    trial = training_trial(model, sample)
    return trial is not None and trial[0]


def training_trial(model: nn.Module, sample: torch.Tensor) -> tuple[bool, tuple[str, str, str] | None] | None:
    """One training-mode forward pass of ``sample`` through a deep copy of ``model``, without gradients, so that
    nothing of the run's model moves: whether it moved torch's global generator (the CPU's, and the sample's CUDA
    device's; both are put back as they were), and the first buffer it changed, as ``(module name, module class,
    buffer name)``, or None. Batch norm's running statistics are left out (:func:`check_running_stats` refuses
    them). None when the model cannot read the sample, which is another check's to report."""
    trial = copy.deepcopy(model).train()
    cuda = [sample.device.index or 0] if sample.device.type == "cuda" else []
    owners = _buffer_owners(trial)

    def states() -> list[torch.Tensor]:
        return [torch.random.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda)]

    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        # clones: a buffer updated in place would otherwise compare equal to itself
        before = {n: b.clone() for n, b in trial.named_buffers() if n in owners}
        rng = states()
        try:
            trial(sample)
        except (RuntimeError, ValueError, IndexError, TypeError):
            return None
        draws = not all(torch.equal(a, b) for a, b in zip(rng, states()))
    owners |= _buffer_owners(trial)  # a buffer registered during the pass (a lazily built one) is a change too
    after = {n: b for n, b in trial.named_buffers() if n in owners}
    for n in [*before, *(n for n in after if n not in before)]:
        if n not in after or not _same(before.get(n), after[n]):
            return draws, owners[n]
    return draws, None


def _buffer_owners(model: nn.Module) -> dict[str, tuple[str, str, str]]:
    """The buffers of ``model`` by their full names, each as ``(module name, module class, buffer name)``, less
    batch norm's running statistics (:func:`check_running_stats` refuses those in its own words)."""
    return {
        f"{name}.{b}" if name else b: (name, type(m).__name__, b)
        for name, m in model.named_modules()
        if not (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats)
        for b, _ in m.named_buffers(recurse=False)
    }


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether two buffers hold the same values (NaN equal to NaN: a constant NaN is not a change)."""
    if a is None or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return (a.is_floating_point() or a.is_complex()) and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all())


def check_running_stats(model: nn.Module) -> None:
    """A model whose batch norm keeps running statistics (buffers) is refused in one ConfigError naming the
    first such module: the flat parameter vector that every backend trains, the server averages and a checkpoint
    holds does not carry them, so local training would move them in whichever process trains (each worker of
    ``pool`` and ``ray``, which also evaluate with them) and the same seed would give other numbers on another
    backend, and on resume. (Batch norm without running statistics normalizes with each batch's own.)"""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            raise ConfigError(
                f"model: its {type(m).__name__} {name!r} keeps running statistics, which are not parameters: no "
                "backend carries them from client to server, no checkpoint holds them, and the pool's and Ray's "
                "workers would each keep their own, so a seed would not give the same numbers; use "
                "track_running_stats=False (each batch's statistics, as the cnn models' norm: batch)"
            )
