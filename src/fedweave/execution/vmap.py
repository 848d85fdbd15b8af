"""The batched backend: all jobs advance one step at a time in one ``torch.func.vmap`` computation.

Jobs with fewer steps (smaller clients) are masked: after their last step their parameters, momentum and
loss stop changing. A partial last batch is padded and its padding masked out of the loss, so each job
computes exactly what the loop backend computes.
"""

from __future__ import annotations

import torch
from torch.func import grad_and_value, vmap

from fedweave.execution.local import LR, LocalResult, LocalRule, LocalTrainer


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
    return LocalResult(
        torch.cat([o.params for o in outs]), torch.cat([o.steps for o in outs]), torch.cat([o.loss for o in outs])
    )


def _run_chunk(tr, starts, clients, round, rule, lr, steps, key, offset) -> LocalResult:
    layout = tr.layout
    plan = tr.plan(clients, round, key, steps)
    K = len(clients)
    jobs = torch.arange(offset, offset + K)

    def loss_one(v, x, y, m):
        return tr.loss_fn(layout.functional(v, x), y, m)

    batched = vmap(grad_and_value(loss_one))
    gens: dict = {}
    w = starts.clone()
    buf = None
    total = torch.zeros(K)
    for t in range(plan.index.shape[0]):
        idx, m = plan.index[t], plan.mask[t]
        xs, ys = [], []
        for k, c in enumerate(clients):
            if t < plan.steps[k]:
                x, y = tr.batch_data(idx[k][m[k]], c, round, key, gens)
                if x.shape[0] < idx.shape[1]:  # pad a partial batch; the mask removes it from the loss
                    pad = idx.shape[1] - x.shape[0]
                    x = torch.cat([x, x[:1].expand(pad, *x.shape[1:])])
                    y = torch.cat([y, y[:1].expand(pad)])
            else:  # finished job: any data, its update is discarded below
                x, y = tr.train_x[idx[k]], tr.train_y[idx[k]]
            xs.append(x)
            ys.append(y)
        X, Y = torch.stack(xs), torch.stack(ys)
        last = {}

        def grad(v, X=X, Y=Y, m=m, last=last):
            g, loss = batched(v, X, Y, m)
            last.setdefault("loss", loss)
            return g

        active = (t < plan.steps).unsqueeze(1)
        d = rule.direction(w, grad, jobs)
        w_new, buf_new = tr.sgd_update(w, d, buf, tr.step_lr(lr, t))
        w_new = rule.project(w_new, jobs)
        w = torch.where(active, w_new, w)
        buf = buf_new if buf is None else torch.where(active, buf_new, buf)
        if last:
            total += torch.where(active.squeeze(1), last["loss"], 0.0)
    return LocalResult(w, plan.steps, total / plan.steps.clamp_min(1))
