"""Evaluation of flat parameter vectors: inference mode, the template model (or its channels-last twin).

A plain CNN (only convolutions and linear layers carry parameters) is evaluated on a channels-last copy of
the template: about 1.5-2x faster on CPU for the MNIST CNN (docs/performance.md). Evaluation is a sum over
batches; when the layout's trainer runs on the ``pool`` backend, the pool's workers compute contiguous runs
of the batches and the sums are added here in batch order, so the result is the same function of the
per-batch values either way.

Evaluation follows the layout's placement: the evaluated set is placed once (on the device when it fits,
else in pinned host memory with each batch copied), the forward pass autocasts under ``bf16-mixed`` and
the loss is taken in the storage dtype; the per-batch sums stay on the device and come to the host once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedweave.config import ConfigError
from fedweave.execution.batched import mlp_layers
from fedweave.execution.params import ParamLayout
from fedweave.tasks import Task, evaluate_batches, may_be_undefined

# Rows per forward pass at most: beyond this the activations of a CNN fall out of the CPU caches (MNIST CNN,
# one thread: 256 rows ran 1.7x faster than 2048; docs/performance.md). ``batch_size`` only lowers it.
EVAL_ROWS = 256
# layout -> the worker pool whose workers hold that layout's model (``execution.pool`` adds itself), so
# that evaluation runs on the pool's workers; an object with ``batch_sums(w, x, y, batch_size)``
evaluators: weakref.WeakKeyDictionary[ParamLayout, Any] = weakref.WeakKeyDictionary()
# id -> weak reference of the tensors that a pool's workers read from their fork (``share_with_workers``)
fork_shared: dict[int, weakref.ref] = {}
# layout -> (channels-last copy of its model, that copy's layout), made on first use
_TWINS: weakref.WeakKeyDictionary[ParamLayout, tuple[nn.Module, ParamLayout]] = weakref.WeakKeyDictionary()


def share_with_workers(*tensors: torch.Tensor) -> None:
    """Declare evaluation sets (e.g. the dataset's test set) that a ``pool`` backend's workers read from their
    fork instead of receiving a copy: a pool forked while they exist records them, and evaluates on views of
    the workers' inherited copies as long as the tensors are unmodified (their ``_version``), so their pages
    stay shared with the driver (copy-on-write) and count once in the process tree's memory."""
    for t in tensors:
        fork_shared[id(t)] = weakref.ref(t)
        weakref.finalize(t, fork_shared.pop, id(t), None)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch's intra-op threads set to one for the block, for row-wise work on small tensors (log-softmax,
    per-row losses and argmax of an evaluation pass): each row's result, and the sums over rows, do not depend
    on the thread count, while with two threads every such operation is a parallel region that waits for the
    other thread, which on a busy machine waits for a core. Measured at 2 threads, load average 12, the 10k
    MNIST test images: softmax regression evaluated in 113.7 ms (best) / 881 ms (median of 15) with these
    operations at 2 threads, 30.0 / 398 ms at one; the 784-64-10 MLP 211 / 1278 against 125 / 329 ms."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def channels_last_ok(model: nn.Module) -> bool:
    """True for a plain CNN: 2-D convolutions and linear layers only (normalization layers keep NCHW)."""
    layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
    return any(isinstance(m, nn.Conv2d) for m in layers) and all(isinstance(m, nn.Conv2d | nn.Linear) for m in layers)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """A channels-last copy of a 4-D batch. (``x.contiguous(memory_format=...)`` keeps a one-channel batch's
    NCHW strides, with which convolution and pooling still take their slower NCHW kernels.)"""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last).copy_(x)


def eval_model(layout: ParamLayout, w: torch.Tensor) -> tuple[nn.Module, bool]:
    """The model to evaluate ``w`` with, loaded, and whether its inputs should be channels-last."""
    if not channels_last_ok(layout.model):
        return layout.load_(w), False
    twin = _TWINS.get(layout)
    if twin is None:
        m = copy.deepcopy(layout.model).to(memory_format=torch.channels_last)
        twin = _TWINS[layout] = (m, ParamLayout(m, layout.placement))
    model, lay = twin
    with torch.no_grad():
        for (_, b), (_, src) in zip(model.named_buffers(), layout.model.named_buffers(), strict=True):
            b.copy_(src)
    return lay.load_(w), True


@torch.inference_mode()
def batch_sums(
    layout: ParamLayout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int
) -> list[tuple[float, int]]:
    """(summed cross-entropy, number correct) of parameters ``w`` on each batch of ``(x, y)`` in order."""
    pl = layout.placement
    x, y = pl.data(x), pl.data(y)
    model, cl = eval_model(layout, w)
    model.eval()
    losses, correct, passes = [], [], []
    forward = model
    if pl.autocast_dtype is None and (layers := mlp_layers(model)) is not None and not _hooked(model):
        forward = functools.partial(_linear_stack, [(m.weight, m.bias) for m in layers])
    try:
        for lo in range(0, len(y), batch_size):
            xb, yb = pl.to(x[lo : lo + batch_size]), pl.to(y[lo : lo + batch_size])
            if cl and xb.dim() == 4:
                xb = to_channels_last(xb)
            with pl.autocast():
                logits = forward(xb)
            passes.append((logits.to(w.dtype), yb))  # the loss in the storage dtype (a no-op unless autocast)
    finally:
        model.train()
    if not passes:
        return []
    with one_thread():  # row by row: the same bits at any thread count
        for logits, yb in passes:
            losses.append(nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct.append((logits.argmax(1) == yb).sum())
    # one trip to the host for all batches (float(...) and int(...) of each would be one per batch)
    return list(zip(torch.stack(losses).tolist(), torch.stack(correct).tolist(), strict=True))


def _hooked(model: nn.Module) -> bool:
    """Whether a forward hook would see ``model``'s calls (then its modules are called, hooks and all)."""
    mod = nn.modules.module
    if mod._global_forward_hooks or mod._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _linear_stack(layers: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor) -> torch.Tensor:
    """The forward pass of a fedweave MLP or softmax regression (``models.linear``) with its layers' parameters
    ``layers``: the functions its modules call (flatten, ``F.linear``, ``F.relu``), on the same tensors, without
    the modules' calls around them (a few us each, on 40 passes of the 10k test images)."""
    h = x.reshape(x.shape[0], -1)
    for weight, bias in layers[:-1]:
        h = nn.functional.relu(nn.functional.linear(h, weight, bias))
    weight, bias = layers[-1]
    return nn.functional.linear(h, weight, bias)


def evaluate(
    layout: ParamLayout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of parameters ``w`` on ``(x, y)``, in batches of at most
    ``min(batch_size, EVAL_ROWS)`` rows."""
    batch_size = min(batch_size, EVAL_ROWS)
    pool = evaluators.get(layout)
    sums = pool.batch_sums(w, x, y, batch_size) if pool is not None else batch_sums(layout, w, x, y, batch_size)
    return _accuracy_and_loss(sums, len(y))


def _accuracy_and_loss(sums: list[tuple[float, int]], n: int) -> tuple[float, float]:
    """Accuracy and mean loss over ``n`` rows from per-batch (loss sum, correct), added in batch order
    (wherever the batches were computed)."""
    loss, correct = 0.0, 0
    for s, c in sums:
        loss += s
        correct += c
    return correct / max(n, 1), loss / max(n, 1)


def evaluate_task(
    layout: ParamLayout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, task: Task, batch_size: int = 2048
) -> dict[str, float]:
    """The task's mean loss and metrics of parameters ``w`` on ``(x, y)`` (keys without a ``test_`` prefix).
    Classification with cross-entropy takes :func:`evaluate` (and the pool where there is one)."""
    if task.is_default:
        acc, loss = evaluate(layout, w, x, y, batch_size)
        return {"accuracy": acc, "loss": loss}
    pl = layout.placement
    x, y = pl.data(x), pl.data(y)
    model, cl = eval_model(layout, w)
    model.eval()

    def forward(xb: torch.Tensor) -> torch.Tensor:
        with pl.autocast():
            out = model(to_channels_last(xb) if cl and xb.dim() == 4 else xb)
        return out.to(w.dtype) if out.is_floating_point() else out

    try:
        with torch.inference_mode():
            return evaluate_batches(forward, x, y, task, min(batch_size, EVAL_ROWS), move=pl.to)
    finally:
        model.train()


def evaluate_clients_task(
    layout: ParamLayout,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    task: Task,
    batch_size: int = 2048,
) -> dict[str, np.ndarray]:
    """Per client (row ``k`` of ``params``, or one shared vector, on ``parts[k]``): each of the task's values."""
    if task.is_default:
        accs, losses = evaluate_clients(layout, params, x, y, parts, batch_size)
        return {"accuracy": accs, "loss": losses}
    pl = layout.placement
    x, y = pl.data(x), pl.data(y)  # placed once; each client's rows are gathered where they live
    rows = []
    for k, idx in enumerate(parts):
        if len(idx) == 0:
            # a client without a sample (AFL's, q-FFL's L_k): loss 0, as evaluate_clients counts it; a metric of no
            # sample has no value (a regression metric's sums were None: a TypeError)
            rows.append({"loss": 0.0})
            continue
        t = torch.as_tensor(idx, dtype=torch.long, device=x.device)
        rows.append(evaluate_task(layout, params[k] if params.dim() == 2 else params, x[t], y[t], task, batch_size))
    keys = dict.fromkeys(key for r in rows for key in r)  # the task's values, in their order; NaN where none
    return {key: np.array([r.get(key, np.nan) for r in rows]) for key in keys}


def evaluate_clients(
    layout: ParamLayout,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    batch_size: int = 2048,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client accuracy and loss: row ``k`` of ``params`` (or one shared vector) on ``parts[k]``."""
    accs, losses = np.zeros(len(parts)), np.zeros(len(parts))
    pl = layout.placement
    x, y = pl.data(x), pl.data(y)  # placed once; each client's rows are gathered where they live
    for k, idx in enumerate(parts):
        w = params[k] if params.dim() == 2 else params
        t = torch.as_tensor(idx, dtype=torch.long, device=x.device)
        sums = batch_sums(layout, w, x[t], y[t], min(batch_size, EVAL_ROWS))  # small sets: here, not on a pool
        accs[k], losses[k] = _accuracy_and_loss(sums, len(t))
    return accs, losses


def with_samples(parts: Sequence[np.ndarray], ids: np.ndarray | None = None) -> np.ndarray | None:
    """Of the clients ``ids`` (None: every one of ``parts``), those whose set ``parts[i]`` holds a sample, the
    clients a per-client mean averages: one without a sample has no accuracy or loss (it would count as 0 and
    pull the mean down). ``ids`` itself when none is left out, so that the usual case keeps every bit."""
    every = np.arange(len(parts)) if ids is None else np.asarray(ids)
    kept = np.asarray([i for i in every if len(parts[int(i)])], dtype=np.int64)
    if len(kept) == len(every):
        return ids
    if not len(kept):
        raise ConfigError("no evaluated client has a sample in its own set: there is no per-client figure to average")
    return kept


def _defined(values: Any, metric: str | None) -> np.ndarray:
    """The clients' values of ``metric`` that are defined: a metric that declares NaN where a set cannot define it
    (:attr:`fedweave.tasks.Metric.undefined`: the R² of one sample, the AUC where no label has both classes) is
    NaN on such a client's own test set, and a summary over clients leaves that client out, as it leaves out a
    client without a test sample. Any other NaN (a loss, an accuracy: a client's model diverged) stays, so that
    the summary is NaN and the run's divergence guard sees it."""
    v = np.asarray(values, dtype=np.float64)
    return v[~np.isnan(v)] if metric is not None and may_be_undefined(metric) and np.isnan(v).any() else v


def client_means(per: dict[str, Any], main: str, direction: str = "max") -> tuple[dict[str, float], float]:
    """Each value's mean over the clients, and the worst client's ``main`` metric (the lowest where higher is
    better, ``direction`` "max"), a metric that may be undefined taken over the clients that define it (NaN only
    where none does; before, one client's undefined R² or AUC made every summary over the clients NaN)."""
    means = {}
    for k, v in per.items():
        d = _defined(v, k)
        means[k] = float(d.mean()) if len(d) else math.nan
    d = _defined(per[main], main)
    worst = math.nan if not len(d) else float(d.min() if direction == "max" else d.max())
    return means, worst


def client_spread(
    values: np.ndarray, direction: str = "max", worst: float = 0.1, metric: str | None = None
) -> dict[str, float]:
    """How a metric is spread over clients: its ``mean``, ``worst10`` (the mean over the worst ``worst``
    fraction of the clients, at least one: the lowest values when higher is better, ``direction`` "max", the
    highest otherwise, as q-FFL reports its "worst 10 %") and ``std`` (over the clients, ddof 0); a ``metric``
    that may be undefined over the clients that define it (:func:`_defined`; NaN where none does)."""
    v = _defined(values, metric)  # in client order: the mean is that of personal_test's mean
    if not len(v):
        return {"mean": math.nan, "worst10": math.nan, "std": math.nan}
    k = max(1, int(np.ceil(worst * len(v))))
    ordered = np.sort(v)
    tail = ordered[:k] if direction == "max" else ordered[-k:]
    return {"mean": float(v.mean()), "worst10": float(tail.mean()), "std": float(v.std())}
