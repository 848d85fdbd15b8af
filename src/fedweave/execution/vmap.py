"""The batched backend: all jobs advance one step at a time in one ``torch.func.vmap`` computation.

Jobs with fewer steps (smaller clients) drop out of the batch once they are done, so no work is spent on
finished jobs. A partial last batch is padded and its padding masked out of the loss, so each job computes
exactly what the loop backend computes.
"""

from __future__ import annotations

import torch
from torch.func import grad_and_value, vmap

from fedweave.execution.batched import batched_grad
from fedweave.execution.local import LR, LocalResult, LocalRule, LocalTrainer, cross_entropy


def run(
    tr: LocalTrainer,
    starts: torch.Tensor,
    clients: list[int],
    round: int,
    rule: LocalRule,
    lr: LR,
    steps: int | None,
    key: tuple[int, ...],
) -> LocalResult:
    outs = []
    for lo in range(0, len(clients), tr.vmap_chunk):
        hi = min(lo + tr.vmap_chunk, len(clients))
        outs.append(_run_chunk(tr, starts[lo:hi], clients[lo:hi], round, rule, lr, steps, key, lo))
    cat = torch.cat
    return LocalResult(cat([o.params for o in outs]), cat([o.steps for o in outs]), cat([o.loss for o in outs]))


def _batch(tr: LocalTrainer, index, mask, clients, active, round, key, gens):
    """Stacked inputs of the active jobs at one step: (A, B, ...) features, labels and validity mask."""
    if tr.augment is None:
        return tr.train_x[index], tr.train_y[index], mask
    xs = []
    for row, k in enumerate(active.tolist()):  # augmentation draws from each client's own stream
        m = mask[row]
        x, _ = tr.batch_data(index[row][m], clients[k], round, key, gens)
        pad = index.shape[1] - x.shape[0]
        xs.append(torch.cat([x, x[:1].expand(pad, *x.shape[1:])]) if pad else x)
    return torch.stack(xs), tr.train_y[index], mask


def _run_chunk(tr, starts, clients, round, rule, lr, steps, key, offset) -> LocalResult:
    layout = tr.layout
    plan = tr.plan(clients, round, key, steps)
    jobs = torch.arange(offset, offset + len(clients))

    def loss_one(v, x, y, m):
        return tr.loss_fn(layout.functional(v, x), y, m)

    # MLPs with the default loss: closed-form backpropagation with bmm (fedweave.execution.batched)
    fast = batched_grad(layout) if tr.loss_fn is cross_entropy else None
    batched = fast or vmap(grad_and_value(loss_one))
    gens: dict = {}
    w = starts.clone()
    buf = None
    total = torch.zeros(len(clients), dtype=starts.dtype)
    for t in range(plan.index.shape[0]):
        active = (plan.steps > t).nonzero().squeeze(1)
        X, Y, M = _batch(tr, plan.index[t, active], plan.mask[t, active], clients, active, round, key, gens)
        seen: list[torch.Tensor] = []

        def grad(v, X=X, Y=Y, M=M, seen=seen):
            g, loss = batched(v, X, Y, M)
            seen.append(loss)
            return g

        grad.batch = (X, Y, M)  # type: ignore[attr-defined]  # per-sample rules (see loop.py)
        grad.report = seen.append  # type: ignore[attr-defined]
        wa = w[active]
        d = rule.direction(wa, grad, jobs[active])
        new, buf_a = tr.sgd_update(wa, d, None if buf is None else buf[active], tr.step_lr(lr, t))
        w[active] = rule.project(new, jobs[active])
        if buf_a is not None:
            if buf is None:
                buf = torch.zeros_like(w)
            buf[active] = buf_a
        if seen:
            total[active] += seen[0]
    return LocalResult(w, plan.steps, total / plan.steps.clamp_min(1))
