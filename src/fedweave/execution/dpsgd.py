"""Per-sample clipped DP-SGD (Abadi et al., CCS 2016, Algorithm 1) as a :class:`LocalRule`.

Each local step replaces the mean batch gradient by

    g~ = (1/B) * ( sum_b clip(g_b, C) + N(0, sigma^2 C^2 I) ),    clip(g, C) = g * min(1, C / |g|),

with g_b the gradient of sample b's loss (per-sample gradients from ``torch.func.vmap`` over
``torch.func.grad``) and B the number of samples in the batch. So each sample moves the step by at most
C / B, and the noise on the step has standard deviation sigma * C / B per coordinate. The noise of job k's
n-th gradient call comes from the stream ``("dp_sgd", round, client, *key, n)``: the same on every backend.

It wraps another rule (FedProx, a mask, ...): that rule sees the privatized gradient as its oracle, on the
step's batch and on each further draw of a rule that draws several (``LocalRule.draws``).
:class:`PrivateTrainer` is a :class:`LocalTrainer` whose every ``train`` call runs DP-SGD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.func import grad_and_value, vmap

from fedweave.execution.job import StepGradient, own_loss, uses_loss
from fedweave.execution.local import LR, PLAIN, GradFn, LocalResult, LocalRule, LocalTrainer, cross_entropy
from fedweave.execution.params import ParamLayout
from fedweave.seeding import Seeds

LossFn = Callable[..., torch.Tensor]


def clip_rows(g: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row (last axis) scaled to norm at most ``clip``: g * min(1, C / |g|)."""
    return g * (clip / g.norm(dim=-1, keepdim=True).clamp_min(clip))


def unprivatized_loss(rule: LocalRule) -> str | None:
    """What of ``rule``'s loss DP-SGD, which clips and noises the task loss's per-sample gradients, would leave
    unprivatized (a loss of its own, or a term added to the task's), in words; None when it has neither."""
    if own_loss(rule):
        return "trains on a loss of its own (loss)"
    return "adds a term to the loss (extra_loss)" if uses_loss(rule) else None


class DPSGD(LocalRule):
    """DP-SGD around ``base``: per-sample clipping to ``clip``, Gaussian noise ``sigma * clip`` on the sum."""

    def __init__(
        self,
        layout: ParamLayout,
        clip: float,
        sigma: float,
        seeds: Seeds,
        round: int,
        clients: Sequence[int],
        key: tuple[int, ...] = (),
        *,
        base: LocalRule = PLAIN,
        loss_fn: LossFn = cross_entropy,
    ) -> None:
        if not clip > 0:
            raise ValueError(f"DP-SGD clip must be > 0, got {clip}")
        if not sigma >= 0:
            raise ValueError(f"DP-SGD sigma must be >= 0, got {sigma}")
        if how := unprivatized_loss(base):  # its gradient would reach the step unclipped and without noise
            raise ValueError(
                f"DP-SGD clips per-sample gradients of the task loss only; local rule {type(base).__name__} {how}, "
                "which it cannot privatize: run that rule without DP-SGD"
            )
        self.clip, self.sigma, self.base = float(clip), float(sigma), base
        self.seeds, self.round, self.clients, self.key = seeds, round, list(map(int, clients)), tuple(key)
        self.calls: dict[int, int] = {}  # job -> gradient calls so far (the noise stream's last key)
        self.layout, self.loss_fn = layout, loss_fn  # plain attributes: the rule pickles (the ray backend)

    def sample_loss(self, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one sample (x, y) at parameters ``v`` (the forward pass autocast under bf16-mixed)."""
        with self.layout.placement.autocast():
            out = self.layout.functional(v, x.unsqueeze(0))
        return self.loss_fn(out.to(v.dtype), y.unsqueeze(0))

    def per_sample(self, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample gradients and losses at ``v``: (B, P) and (B,); with a leading job axis if ``v`` has one."""
        one = vmap(grad_and_value(self.sample_loss), in_dims=(None, 0, 0))
        return one(v, x, y) if v.dim() == 1 else vmap(one)(v, x, y)

    def noise(
        self, jobs: int | torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """N(0, I) of each job's next gradient call, from its own named stream: (P,) or (len(jobs), P).
        Drawn on the CPU (the same noise on every device), then moved to ``device``."""
        out = []
        # the job ids come to the host: each job's noise comes from its own CPU generator
        for j in [jobs] if isinstance(jobs, int) else jobs.tolist():
            n = self.calls.get(j, 0)
            self.calls[j] = n + 1
            g = self.seeds.torch("dp_sgd", self.round, self.clients[j], *self.key, n)
            out.append(torch.randn(numel, generator=g, dtype=dtype, device="cpu"))
        return (out[0] if isinstance(jobs, int) else torch.stack(out)).to(device, non_blocking=True)

    @property
    def draws(self) -> int:  # the base rule's: each of its draws is privatized as the step's batch is
        return self.base.draws

    def private(self, v: torch.Tensor, grad: StepGradient, jobs: int | torch.Tensor, draw: int = 0) -> torch.Tensor:
        """The privatized mean gradient at ``v`` on the step's batch, or its draw ``draw`` (``grad.batches``
        from the backend)."""
        x, y, mask = grad.batch if draw == 0 else grad.batches[draw]
        g, losses = self.per_sample(v, x, y)
        valid = torch.ones(y.shape, dtype=g.dtype, device=g.device) if mask is None else mask.to(g.dtype)
        count = valid.sum(-1).clamp_min(1.0)  # B: the real samples of the batch (padding excluded)
        grad.report((losses * valid).sum(-1) / count)  # the batch's mean loss
        total = (clip_rows(g, self.clip) * valid.unsqueeze(-1)).sum(-2)
        if self.sigma:
            total = total + self.sigma * self.clip * self.noise(jobs, v.shape[-1], g.dtype, g.device)
        return total / count.unsqueeze(-1)

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        def private_grad(v: torch.Tensor, draw: int = 0) -> torch.Tensor:
            return self.private(v, grad, jobs, draw)

        return self.base.direction(w, private_grad, jobs)

    def project(self, w: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
        return self.base.project(w, jobs)


class PrivateTrainer(LocalTrainer):
    """A :class:`LocalTrainer` that runs every job with :class:`DPSGD` around the rule it is given."""

    dp_clip: float
    dp_sigma: float

    @classmethod
    def of(cls, trainer: LocalTrainer, clip: float, sigma: float) -> PrivateTrainer:
        """A private trainer sharing ``trainer``'s data, model, settings and backend."""
        out = cls.__new__(cls)
        out.__dict__.update(trainer.__dict__)
        out.dp_clip, out.dp_sigma = float(clip), float(sigma)
        return out

    def train(
        self,
        starts: torch.Tensor,
        clients: Sequence[int],
        round: int,
        *,
        rule: LocalRule = PLAIN,
        lr: LR | None = None,
        steps: int | None = None,
        key: tuple[int, ...] = (),
    ) -> LocalResult:
        dp = DPSGD(self.layout, self.dp_clip, self.dp_sigma, self.seeds, round, clients, key, base=rule,
                   loss_fn=self.loss_fn)  # fmt: skip
        return super().train(starts, clients, round, rule=dp, lr=lr, steps=steps, key=key)
