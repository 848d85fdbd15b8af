"""The reference backend: jobs one after another on the one reused template model.

A plain CNN (convolutions and linear layers only, no buffers) computes on a channels-last twin of the
template: its linear parameters are views of the template's flat buffers, its convolution weights
channels-last copies synchronised with them at every step. On CPU this avoids the slow NCHW max-pooling
kernel (3.8 ms vs 0.4 ms for the MNIST CNN's first pool at batch 32) and cut a training step's CPU time by
about 15% (docs/performance.md). Both paths below use the same compute module, so they give the same bits.

Everything runs on the trainer's device; a job's per-step losses stay there and are summed once per job,
so a step makes no round trip to the host. Under ``precision: bf16-mixed`` the forward pass autocasts and
the MLP kernel of ``execution.fused`` (written for float32) steps aside.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING

import torch

from fedweave.execution.evaluate import channels_last_ok, to_channels_last
from fedweave.execution.fused import fused_sgd, job_losses
from fedweave.execution.job import (
    LocalCall,
    LocalResult,
    StepGradient,
    backend,
    own_loss,
    plain_rule,
    rule_loss_grad,
    summed_losses,
    uses_loss,
)
from fedweave.execution.params import ParamLayout
from fedweave.tasks import cross_entropy

if TYPE_CHECKING:
    from fedweave.execution.local import LocalTrainer


class Compute:
    """Loss and gradient on the template's flat buffers ``value`` and ``gradbuf`` (from ``layout.bind()``)."""

    def __init__(self, layout: ParamLayout) -> None:
        self.value, self.gradbuf = layout.bind()
        self.placement = layout.placement
        self.autocast = layout.placement.autocast  # bf16-mixed: the forward pass in bfloat16
        self.mixed = mixed = layout.placement.autocast_dtype is not None
        # SGD without autograd for MLPs (execution.fused), in the storage dtype only
        self.fused = None if mixed else fused_sgd(layout, self.value)
        model = layout.model
        self.sync: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (twin weight, value, grad)
        self.channels_last = channels_last_ok(model) and not list(model.buffers())
        if not self.channels_last:
            self.model = model
            return
        self.model = twin = copy.deepcopy(model)
        params = dict(twin.named_parameters())
        views = zip(self.value.split(layout.numels), self.gradbuf.split(layout.numels), layout.shapes)
        for name, (v, g, shape) in zip(layout.names, views, strict=True):
            p = params[name]
            if len(shape) == 4:  # a convolution weight: its own channels-last tensor
                p.data = torch.empty(shape, dtype=v.dtype, device=v.device, memory_format=torch.channels_last)
                p.grad = torch.zeros_like(p.data)
                self.sync.append((p, v.view(shape), g.view(shape)))
            else:
                p.data, p.grad = v.view(shape), g.view(shape)

    def loss_backward(self, loss_fn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward at the parameters in ``value``; writes the gradient into ``gradbuf``, which
        the caller has zeroed. Returns the loss."""
        if self.channels_last:
            with torch.no_grad():
                for p, v, _ in self.sync:
                    p.copy_(v)
                    p.grad.zero_()
            if x.dim() == 4:
                x = to_channels_last(x)
        if self.mixed:
            with self.autocast():
                out = self.model(x)
            loss = loss_fn(out.to(self.value.dtype), y)  # the loss in float32
        else:
            loss = loss_fn(self.model(x), y)
        loss.backward()  # accumulates into `gradbuf` (zeroed) and the twin's convolution gradients
        for p, _, g in self.sync:
            g.copy_(p.grad)  # 0 + d == d: the same bits as accumulating into the zeroed flat buffer
        return loss


_COMPUTE: weakref.WeakKeyDictionary[ParamLayout, Compute] = weakref.WeakKeyDictionary()


def compute(layout: ParamLayout) -> Compute:
    c = _COMPUTE.get(layout)
    if c is None:
        c = _COMPUTE[layout] = Compute(layout)
    return c


@backend("loop")
def run(tr: LocalTrainer, call: LocalCall) -> LocalResult:
    """Train the jobs in order. A job's per-job rule tensors are indexed by its position in the whole call
    (``call.offset + k``: the call may be one shard of a pool or Ray call)."""
    starts, rule, lr, round, key, steps = call.starts, call.rule, call.lr, call.round, call.key, call.steps
    out = torch.empty_like(starts)
    counts, totals = [], []
    comp = compute(tr.layout)
    template = comp.value.clone()  # restored at the end: training leaves the template model unchanged
    train_job = _train_with_rule
    if plain_rule(rule) and tr.local.grad_clip is None:
        if comp.fused is not None and tr.loss_fn is cross_entropy and tr.augment is None:
            train_job = _train_fused  # MLPs: backpropagation written out (execution.fused)
        elif not tr.local.momentum and not tr.local.weight_decay:
            train_job = _train_plain
    if train_job is _train_fused:  # the rows of consecutive jobs gathered together (FusedSGD.gathered)
        streams = tr.batch_streams(call.clients, round, key)
        plans = [tr.flat_batches(c, round, key, steps, g) for c, g in zip(call.clients, streams)]
        jobs = comp.fused.gathered(tr.train_x, tr.train_y, plans)
    else:
        jobs = (tr.client_batches(c, round, key, steps) for c in call.clients)
    # the fused kernel's gathered jobs leave their losses' reduction to the end of the call (job_losses)
    dots: list[torch.Tensor] | None = [] if train_job is _train_fused else None
    deferred: list[tuple[int, torch.Tensor]] = []  # (job, its batch sizes): not the rows, which may go
    draws = rule.draws  # the rule's independent batches per step: draw 0 is ``batches``, the others drawn here
    for k, (c, batches) in enumerate(zip(call.clients, jobs)):
        if dots is not None:
            out[k], total = _train_fused(tr, comp, starts[k], batches, c, round, key, lr, rule, call.offset + k, dots)
        elif draws > 1:
            more = [tr.client_batches(c, round, key, steps, j) for j in range(1, draws)]
            job = call.offset + k
            out[k], total = _train_with_rule(tr, comp, starts[k], batches, c, round, key, lr, rule, job, more)
        else:
            out[k], total = train_job(tr, comp, starts[k], batches, c, round, key, lr, rule, call.offset + k)
        counts.append(len(batches))
        if total is None:
            deferred.append((k, batches.sizes))
        totals.append(total)
    comp.value.copy_(template)
    dev = starts.device
    nsteps = torch.tensor(counts, dtype=torch.long, device=dev)
    if deferred:
        wide = torch.float32 if dev.type == "mps" else torch.float64  # as FusedSGD.run's own sums
        reduced = job_losses(dots, [sizes for _, sizes in deferred], wide)
        if len(deferred) == len(totals):
            summed = reduced
        else:  # the others' totals (jobs without steps, jobs gathered by run) in their places
            summed = torch.stack([t if t is not None else reduced[0] for t in totals])
            summed[[k for k, _ in deferred]] = reduced
    else:
        summed = torch.stack(totals)
    # each job's mean loss: its float64 sum over max(steps, 1), stored in the run's dtype
    losses = (summed / nsteps.clamp_min(1).to(summed.dtype)).to(starts.dtype)
    return LocalResult(out, nsteps, losses)


def _train_with_rule(
    tr, comp, start, batches, c, round, key, lr, rule, job, more=()
) -> tuple[torch.Tensor, torch.Tensor]:
    """One job's local steps with the rule's direction and projection and the configured SGD; returns the
    final parameters and the summed batch losses (a float64 0-d tensor on the device). ``more``: the batches
    of the steps' further draws 1, 2, ... (``LocalRule.draws``), each a list as long as ``batches``."""
    value, gradbuf = comp.value, comp.gradbuf
    gens: dict = {}
    w, buf, step_losses = start.clone(), None, []
    zero = None
    extra, own = uses_loss(rule), own_loss(rule)
    for t, b in enumerate(batches):
        data = [tr.batch_data(b, c, round, key, gens)]
        data += [tr.batch_data(drawn[t], c, round, key, gens, j) for j, drawn in enumerate(more, 1)]
        last = {}

        def grad_at(v: torch.Tensor, draw: int = 0, data=data, last=last) -> torch.Tensor:
            x, y = data[draw]
            if own:  # the rule's loss in place of the task's (LocalRule.loss), its extra term included
                g, loss = rule_loss_grad(rule, tr.layout, v, x, y, None, job, "loss")
                last.setdefault("loss", loss)
                return g
            value.copy_(v)  # the compute model's parameters are views of `value`
            gradbuf.zero_()
            loss = comp.loss_backward(tr.loss_fn, x, y).detach()
            g = gradbuf.clone()
            if extra:  # the rule's own term of the loss (LocalRule.extra_loss), added to the task's
                g_extra, term = rule_loss_grad(rule, tr.layout, v, x, y, None, job)
                g, loss = g + g_extra, loss + term
            last.setdefault("loss", loss)
            return g

        batch = [(x, y, None) for x, y in data]
        grad = StepGradient(grad_at, batch, lambda loss, last=last: last.setdefault("loss", loss))
        d = rule.direction(w, grad, job)
        w, buf = tr.sgd_update(w, d, buf, tr.step_lr(lr, t))
        w = rule.project(w, job)
        if last:
            step_losses.append(last["loss"])
        else:  # a rule that never asked for a gradient: the step adds 0 to the loss
            zero = torch.zeros((), dtype=w.dtype, device=w.device) if zero is None else zero
            step_losses.append(zero)
    return w, summed_losses(step_losses, w.device)


def _train_plain(tr, comp, start, batches, c, round, key, lr, rule, job) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain SGD (no momentum, weight decay or clipping) in place on the flat buffers: per step one forward,
    one backward into the flat gradient and ``w -= lr * g`` without allocating. ``gradbuf.mul_(lr)`` then
    ``value.sub_`` round exactly like the general path's ``w - lr * d``, so both give the same bits."""
    value, gradbuf = comp.value, comp.gradbuf
    value.copy_(start)
    gens: dict = {}
    step_losses = []
    for t, b in enumerate(batches):
        x, y = tr.batch_data(b, c, round, key, gens)
        gradbuf.zero_()
        loss = comp.loss_backward(tr.loss_fn, x, y)
        value.sub_(gradbuf.mul_(tr.step_lr(lr, t)))
        step_losses.append(loss.detach())
    # the live buffer: the caller copies it into its output row
    return value, summed_losses(step_losses, value.device)


def _train_fused(
    tr, comp, start, batches, c, round, key, lr, rule, job, dots=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SGD with the configured momentum and weight decay on an MLP or softmax regression, by the fused kernel
    of ``execution.fused`` (equal to the general path to float rounding). With ``dots`` (``FusedSGD.run``)
    the loss of gathered rows is left to the caller: None in its place."""
    comp.value.copy_(start)
    lrs = [tr.step_lr(lr, t) for t in range(len(batches))] if callable(lr) else [lr] * len(batches)
    loc = tr.local
    total = comp.fused.run(tr.train_x, tr.train_y, batches, lrs, loc.momentum, loc.weight_decay, dots)
    return comp.value, total  # the live buffer: the caller copies it into its output row
