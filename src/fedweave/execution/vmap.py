"""The batched backend: all jobs advance one step at a time in one ``torch.func.vmap`` computation.

Jobs with fewer steps (smaller clients) drop out of the batch once they are done, so no work is spent on
finished jobs. A partial last batch is padded and its padding masked out of the loss, so each job computes
exactly what the loop backend computes.

On an accelerator the jobs of a call run in chunks that fit its memory: ``memory.vmap_chunk`` jobs, or
as many as fit in half the free memory (at most 4096), measured on the first chunk (8 jobs). The batch plan is drawn on
the CPU and moved to the device once per chunk; a step makes no round trip to the host. Under
``precision: bf16-mixed`` the forward pass autocasts and the closed-form MLP gradients of
``execution.batched`` (written for float32) step aside.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.func import grad_and_value, vmap

from fedweave.execution.batched import batched_grad
from fedweave.execution.job import LocalCall, LocalResult, StepGradient, backend, own_loss, rule_loss_grad, uses_loss
from fedweave.tasks import cross_entropy

if TYPE_CHECKING:
    from fedweave.execution.local import LocalTrainer

PROBE_JOBS = 8  # jobs of the first chunk on an accelerator, whose peak memory sizes the later chunks


@backend("vmap")
def run(tr: LocalTrainer, call: LocalCall) -> LocalResult:
    """Train the jobs in chunks, each in one batched computation; the rule sees each job's position
    ``call.offset + k``."""
    clients = call.clients
    outs = []
    lo = 0
    while lo < len(clients):
        pl = tr.placement
        measure = not pl.on_cpu and not tr.vmap_chunk_fixed and not getattr(tr, "vmap_chunk_measured", False)
        chunk = min(tr.vmap_chunk, PROBE_JOBS) if measure else tr.vmap_chunk
        hi = min(lo + chunk, len(clients))
        if measure:
            pl.synchronize()
            pl.reset_peak()
            before = pl.allocated_bytes()
        chunk_call = replace(call, starts=call.starts[lo:hi], clients=clients[lo:hi], offset=call.offset + lo)
        try:
            outs.append(_run_chunk(tr, chunk_call))
        except RuntimeError as e:
            if not str(e).startswith("vmap:"):
                raise
            raise RuntimeError(
                f"backend vmap cannot train this model or loss ({str(e).splitlines()[0][:160]}): it trains the clients "
                "in one batched computation (torch.func.vmap), which allows no .item() or Python branch on a "
                "tensor's value and no draw from torch's global generator; choose backend: loop or pool"
            ) from e
        if measure:  # the memory one job takes, from the first chunk's peak: later chunks fill half the free
            pl.synchronize()
            per_job = max(1, (pl.peak_bytes() - before) // (hi - lo))
            tr.vmap_chunk = pl.vmap_chunk(per_job)
            tr.vmap_chunk_measured = True
        lo = hi
    cat = torch.cat
    return LocalResult(cat([o.params for o in outs]), cat([o.steps for o in outs]), cat([o.loss for o in outs]))


def _batch(tr: LocalTrainer, index, mask, clients, active, round, key, gens, draw=0):
    """Stacked inputs of the active jobs at one step (of its draw ``draw``): (A, B, ...) features, labels and
    validity mask. ``index`` and ``mask`` are on the device; ``active`` (job positions) on the CPU."""
    if tr.augment is None:
        return tr.placement.rows(tr.train_x, index), tr.placement.rows(tr.train_y, index), mask
    xs = []
    for row, k in enumerate(active.tolist()):  # augmentation draws from each client's own stream
        m = mask[row]
        x, _ = tr.batch_data(index[row][m], clients[k], round, key, gens, draw)
        pad = index.shape[1] - x.shape[0]
        xs.append(torch.cat([x, x[:1].expand(pad, *x.shape[1:])]) if pad else x)
    return torch.stack(xs), tr.placement.rows(tr.train_y, index), mask


def _run_chunk(tr: LocalTrainer, call: LocalCall) -> LocalResult:
    """Jobs ``call.offset ..`` of the call, all at once."""
    starts, clients, round, rule, lr, steps, key = (
        call.starts, call.clients, call.round, call.rule, call.lr, call.steps, call.key
    )  # fmt: skip
    offset = call.offset
    layout, pl = tr.layout, tr.placement
    dev = starts.device
    plan = tr.plan(clients, round, key, steps)  # drawn on the CPU
    # the steps' further draws (LocalRule.draws): plans of the same shape, steps and masks, other samples
    more = [tr.plan(clients, round, key, steps, j).index for j in range(1, rule.draws)]
    index, mask = pl.to(plan.index), pl.to(plan.mask)  # (T, K, B), once per chunk
    more = [pl.to(i) for i in more]
    steps_dev = pl.to(plan.steps)
    jobs = torch.arange(offset, offset + len(clients), device=dev)
    dtype = starts.dtype

    def loss_plain(v, x, y, m):
        return tr.loss_fn(layout.functional(v, x), y, m)

    def loss_mixed(v, x, y, m):  # bf16-mixed: the forward pass autocast, the loss in float32
        with pl.autocast():
            out = layout.functional(v, x)
        return tr.loss_fn(out.to(dtype), y, m)

    loss_one = loss_plain if pl.autocast_dtype is None else loss_mixed

    # MLPs with the default loss: closed-form backpropagation with bmm (fedweave.execution.batched)
    fast = batched_grad(layout) if tr.loss_fn is cross_entropy and pl.autocast_dtype is None else None
    batched = fast or vmap(grad_and_value(loss_one))
    extra = uses_loss(rule)  # the rule adds a term to the loss: its gradient, batched, joins the task's
    own = own_loss(rule)  # the rule's loss in place of the task's: the task's is not computed
    gens: dict = {}
    w = starts.clone()
    buf = None
    total = torch.zeros(len(clients), dtype=dtype, device=dev)
    for t in range(plan.index.shape[0]):
        active_cpu = (plan.steps > t).nonzero().squeeze(1)  # on the CPU: no device synchronisation
        active = active_cpu if pl.on_cpu else pl.to(active_cpu)
        M = mask[t, active]
        data = [_batch(tr, index[t, active], M, clients, active_cpu, round, key, gens)]
        data += [_batch(tr, i[t, active], M, clients, active_cpu, round, key, gens, j) for j, i in enumerate(more, 1)]
        seen: list[torch.Tensor] = []

        def grad_at(v, draw=0, data=data, seen=seen, J=jobs[active] if extra or own else None):
            X, Y, M = data[draw]
            if own:  # its extra term included
                g, loss = rule_loss_grad(rule, layout, v, X, Y, M, J, "loss")
            else:
                g, loss = batched(v, X, Y, M)
                if extra:
                    g_extra, term = rule_loss_grad(rule, layout, v, X, Y, M, J)
                    g, loss = g + g_extra, loss + term
            seen.append(loss)
            return g

        grad = StepGradient(grad_at, data, seen.append)
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
    return LocalResult(w, steps_dev, total / steps_dev.clamp_min(1))
