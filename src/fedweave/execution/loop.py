"""The reference backend: jobs one after another on the one reused template model."""

from __future__ import annotations

import torch

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
    offset: int = 0,
) -> LocalResult:
    """Train the jobs in order. ``offset``: the position of the first job in the whole ``train`` call when
    this runs one shard of it (the ray backend), so a rule's per-job tensors are indexed globally."""
    out = torch.empty_like(starts)
    nsteps = torch.zeros(len(clients), dtype=torch.long)
    losses = torch.zeros(len(clients))
    value, gradbuf = tr.layout.bind()
    model = tr.layout.model
    template = value.clone()  # restored at the end: training leaves the template model unchanged
    if plain_sgd(tr, rule):
        _run_plain(tr, starts, clients, round, lr, steps, key, out, nsteps, losses)
        value.copy_(template)
        return LocalResult(out, nsteps, losses)
    for k, c in enumerate(clients):
        batches = tr.client_batches(c, round, key, steps)
        gens: dict = {}
        w = starts[k].clone()
        buf = None
        total = 0.0
        for t, b in enumerate(batches):
            x, y = tr.batch_data(b, c, round, key, gens)
            last = {}

            def grad(v: torch.Tensor, x=x, y=y, last=last) -> torch.Tensor:
                value.copy_(v)  # the template's parameters are views of `value`
                gradbuf.zero_()
                loss = tr.loss_fn(model(x), y)
                loss.backward()  # accumulates into `gradbuf`
                last.setdefault("loss", loss.detach())
                return gradbuf.clone()

            # for rules that need the samples themselves (per-sample gradients, DP-SGD): the batch and a
            # way to report the loss they computed in place of ``grad``
            grad.batch = (x, y, None)  # type: ignore[attr-defined]
            grad.report = lambda loss, last=last: last.setdefault("loss", loss)  # type: ignore[attr-defined]
            d = rule.direction(w, grad, offset + k)
            w, buf = tr.sgd_update(w, d, buf, tr.step_lr(lr, t))
            w = rule.project(w, offset + k)
            total += float(last["loss"]) if last else 0.0
        out[k] = w
        nsteps[k] = len(batches)
        losses[k] = total / max(len(batches), 1)
    value.copy_(template)
    return LocalResult(out, nsteps, losses)


def plain_sgd(tr: LocalTrainer, rule: LocalRule) -> bool:
    """True when the step is plain SGD: the rule changes neither direction nor projection, and no momentum,
    weight decay or clipping is configured (FedAvg's local step)."""
    c = tr.local
    cls = type(rule)
    plain_rule = cls.direction is LocalRule.direction and cls.project is LocalRule.project
    return plain_rule and not c.momentum and not c.weight_decay and c.grad_clip is None


def _run_plain(tr, starts, clients, round, lr, steps, key, out, nsteps, losses) -> None:
    """Plain SGD trained in place on the template's flat buffers: per step one forward, one backward into
    the flat gradient and ``w -= lr * g`` without allocating. ``gradbuf.mul_(lr)`` then ``value.sub_``
    round exactly like the general path's ``w - lr * d``, so both give the same bits."""
    value, gradbuf = tr.layout.bind()
    model = tr.layout.model
    for k, c in enumerate(clients):
        batches = tr.client_batches(c, round, key, steps)
        gens: dict = {}
        value.copy_(starts[k])
        total = 0.0
        for t, b in enumerate(batches):
            x, y = tr.batch_data(b, c, round, key, gens)
            gradbuf.zero_()
            loss = tr.loss_fn(model(x), y)
            loss.backward()
            value.sub_(gradbuf.mul_(tr.step_lr(lr, t)))
            total += loss.item()
        out[k] = value
        nsteps[k] = len(batches)
        losses[k] = total / max(len(batches), 1)
