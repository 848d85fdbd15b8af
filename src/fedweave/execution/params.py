"""Model parameters as one flat vector, so algorithms can write their update rules as vector algebra.

A single model object is the template; client models are rows of stacked flat tensors (DESIGN principle 3).
"""

from __future__ import annotations

import torch
from torch import nn

from fedweave.execution.placement import CPU, Placement


class ParamLayout:
    """Maps a model's trainable parameters to and from a flat vector of length ``numel`` (in the model's
    dtype: float32, or float64 under ``precision: float64``), on the model's device. ``placement`` says
    where and in which precision the model computes (evaluation reads it)."""

    def __init__(self, model: nn.Module, placement: Placement = CPU) -> None:
        self.model = model
        self.placement = placement
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.numel = sum(self.numels)
        self.buffers = dict(model.named_buffers())

    def bind(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the template's parameters and their gradients views of two flat buffers (idempotent).

        Loading a client is then one ``copy_`` into the value buffer, and a backward pass writes the flat
        gradient directly, with no per-parameter gather: the loop backend's fast path.
        """
        if getattr(self, "_bound", None) is None:
            value = self.flatten().clone()
            grad = torch.zeros_like(value)
            params = dict(self.model.named_parameters())
            for n, v, g, s in zip(self.names, value.split(self.numels), grad.split(self.numels), self.shapes):
                params[n].data = v.view(s)
                params[n].grad = g.view(s)
            self._bound = (value, grad)
        return self._bound

    def flatten(self) -> torch.Tensor:
        """The template model's current parameters as a new flat vector."""
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters() if p.requires_grad])

    def unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a flat vector ``w`` (P,) as the model's named parameters (differentiable)."""
        return {n: t.view(s) for n, t, s in zip(self.names, w.split(self.numels), self.shapes, strict=True)}

    def load_(self, w: torch.Tensor) -> nn.Module:
        """Copy the flat vector ``w`` into the template model's parameters in place; returns the model."""
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for n, t in self.unflatten(w).items():
                params[n].copy_(t)
        return self.model

    def functional(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Forward pass of the template model with parameters ``w`` (works under ``torch.func.vmap``)."""
        params = self.unflatten(w)
        if self.buffers:
            params = {**params, **self.buffers}
        return torch.func.functional_call(self.model, params, (x,))
