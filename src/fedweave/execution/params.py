"""Model parameters as one flat vector, so algorithms can write their update rules as vector algebra.

A single model object is the template; client models are rows of stacked flat tensors (DESIGN principle 3).
"""

from __future__ import annotations

import torch
from torch import nn

from fedweave.config import ConfigError
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
        """The template model's current parameters as a new flat vector. A model without trainable parameters
        is one :class:`ConfigError` (every family flattens its model when it is built, before anything is
        written): there would be nothing to train, average or save, and torch's ``cat`` of no tensors failed."""
        if not self.names:
            total = sum(1 for _ in self.model.parameters())
            why = f"none of its {total} requires grad" if total else "it has none"
            raise ConfigError(
                f"model: the {type(self.model).__name__} has no trainable parameters ({why}), so training would "
                "change nothing; give it at least one parameter with requires_grad=True"
            )
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
        return self._call(self.model, w, x)

    def features(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The representation ``model.features(x)`` under parameters ``w``, differentiable in ``w`` and under
        ``torch.func.vmap`` (the model follows ``fedweave.models.head``'s convention)."""
        return self._call(self._part("features"), w, x)

    def head(self, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The logits ``model.head(z)`` of representations ``z`` under parameters ``w`` (as :meth:`features`)."""
        return self._call(self._part("head"), w, z)

    def _part(self, method: str) -> nn.Module:
        """A module whose forward is ``model.<method>``: ``functional_call`` calls a module's forward."""
        parts = self.__dict__.setdefault("_parts", {})
        if method not in parts:
            if not callable(getattr(self.model, method, None)):
                raise TypeError(
                    f"{type(self.model).__name__} has no {method}(); a rule that reads representations needs a "
                    "model with features() and head() (docs/models.md)"
                )
            parts[method] = _Method(self.model, method)
        return parts[method]

    def _call(self, module: nn.Module, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        params = self.unflatten(w)
        if self.buffers:
            params = {**params, **self.buffers}
        if module is not self.model:  # a _Method holds the model as its submodule "model"
            params = {f"model.{n}": t for n, t in params.items()}
        return torch.func.functional_call(module, params, (x,))


class _Method(nn.Module):
    """``model.<method>`` as a module's forward (for ``torch.func.functional_call``)."""

    def __init__(self, model: nn.Module, method: str) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.method)(x)
