"""Closed-form mini-batch gradients of softmax regression for the family's local solves (speed only).

The paper's model is multinomial logistic regression (spec zo-hfl §4.3), whose cross-entropy gradient is
known in closed form: for logits ``u W^T + b`` of a batch U with one-hot labels Y,

    grad_W = (softmax(U W^T + b) - Y)^T U / B,    grad_b = sum_rows (softmax(U W^T + b) - Y) / B.

Computing this directly (two matrix products per step, batched over jobs) avoids the per-step cost of
autograd and of ``torch.func.vmap`` over ``grad``, which dominated the small reproduction (about 3x the
arithmetic). The numbers are those of autograd up to float rounding; the batches, step sizes and rules are
unchanged. :class:`ClosedFormGrad` wraps any ``LocalRule`` and hands it this gradient oracle whenever the
backend exposes the step's batch (``grad.batch``/``grad.report`` of the loop and vmap backends); on other
backends, or for any other model, the rule gets the backend's own oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from fedweave.execution import LocalRule, ParamLayout
from fedweave.execution.local import GradFn, LocalTrainer, cross_entropy
from fedweave.models.linear import Logistic


class SoftmaxRegressionGrad:
    """``(v, X, Y, M) -> (grad, loss)`` of the masked mean cross-entropy of a bias-free or biased
    :class:`~fedweave.models.linear.Logistic` model with flat parameters ``v`` (``(P,)`` or ``(A, P)``, the
    layout's order: ``fc.weight`` row-major, then ``fc.bias``), on inputs ``X`` (``(B, ...)`` or
    ``(A, B, ...)``), labels ``Y`` and an optional validity mask ``M`` (the padding of the vmap backend)."""

    def __init__(self, classes: int, features: int, bias: bool) -> None:
        self.classes, self.features, self.bias = classes, features, bias

    def __call__(
        self, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        C, n = self.classes, self.features
        lead = v.shape[:-1]  # () on the loop backend, (A,) on vmap
        u = x.reshape(*lead, x.shape[len(lead)], n)  # (..., B, n)
        w = v[..., : C * n].reshape(*lead, C, n)
        logits = u @ w.transpose(-1, -2)  # (..., B, C)
        if self.bias:
            logits = logits + v[..., C * n :].unsqueeze(-2)
        logp = torch.log_softmax(logits, -1)
        nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (..., B)
        if mask is None:
            weight = torch.full_like(nll, 1.0 / nll.shape[-1])
        else:
            m = mask.to(nll.dtype)
            weight = m / m.sum(-1, keepdim=True).clamp_min(1.0)  # as cross_entropy(..., mask)
        loss = (nll * weight).sum(-1)
        # d loss / d logits = (softmax - onehot) * weight, per sample
        dl = logp.exp()
        dl.scatter_add_(-1, y.unsqueeze(-1), -torch.ones_like(nll).unsqueeze(-1))
        dl = dl * weight.unsqueeze(-1)
        gw = (dl.transpose(-1, -2) @ u).reshape(*lead, C * n)  # (..., C n), fc.weight row-major
        return (torch.cat([gw, dl.sum(-2)], -1) if self.bias else gw), loss


def closed_form_gradient(trainer: LocalTrainer) -> SoftmaxRegressionGrad | None:
    """The closed-form gradient of the trainer's model and loss, or None if it is not softmax regression
    with the trainer's masked mean cross-entropy."""
    layout: ParamLayout = trainer.layout
    model = layout.model
    if type(model) is not Logistic or trainer.loss_fn is not cross_entropy:
        return None
    fc: nn.Linear = model.fc
    bias = fc.bias is not None and fc.bias.requires_grad
    if not fc.weight.requires_grad or layout.names != (["fc.weight", "fc.bias"] if bias else ["fc.weight"]):
        return None
    return SoftmaxRegressionGrad(fc.out_features, fc.in_features, bias)


class ClosedFormGrad(LocalRule):
    """``inner`` with the closed-form gradient oracle in place of the backend's autograd one."""

    def __init__(self, inner: LocalRule, fn: SoftmaxRegressionGrad) -> None:
        self.inner, self.fn = inner, fn

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        batch, report = getattr(grad, "batch", None), getattr(grad, "report", None)
        if batch is None or report is None:  # a backend that does not expose its batch
            return self.inner.direction(w, grad, jobs)
        x, y, mask = batch
        reported: list[bool] = []

        def fast(v: torch.Tensor) -> torch.Tensor:
            g, loss = self.fn(v, x, y, mask)
            if not reported:  # the backends log the loss of the first gradient evaluation of a step
                report(loss.detach())
                reported.append(True)
            return g

        return self.inner.direction(w, fast, jobs)

    def project(self, w: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
        return self.inner.project(w, jobs)


def with_closed_form(rule: LocalRule, trainer: LocalTrainer) -> LocalRule:
    """``rule`` with the closed-form gradient when the trainer's model is softmax regression, else ``rule``."""
    fn = closed_form_gradient(trainer)
    return rule if fn is None else ClosedFormGrad(rule, fn)
