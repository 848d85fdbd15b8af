"""Execution: how the local work of many clients is computed (loop, vmap), and evaluation."""

from __future__ import annotations

from torch import nn

from fedweave.execution.evaluate import evaluate, evaluate_clients
from fedweave.execution.local import LocalResult, LocalRule, LocalTrainer
from fedweave.execution.params import ParamLayout
from fedweave.execution.state import StateStore

__all__ = [
    "LocalResult",
    "LocalRule",
    "LocalTrainer",
    "ParamLayout",
    "StateStore",
    "choose_backend",
    "evaluate",
    "evaluate_clients",
]


def choose_backend(requested: str, model: nn.Module, jobs_per_call: int) -> str:
    """Resolve ``auto``. vmap wins on CPU only for a single linear layer (logistic/softmax regression)
    with at least 2 jobs per call (with the closed-form batched gradient of ``execution.batched``: MNIST
    softmax regression, 2 jobs 0.205 vs 0.289 CPU-s, 4 jobs 0.442 vs 0.517, 1 job a tie); for MLPs and CNNs
    it measured 0.4-1.2x the loop (DESIGN principle 4)."""
    if requested != "auto":
        return requested
    layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
    linear = len(layers) == 1 and isinstance(layers[0], nn.Linear)
    return "vmap" if linear and jobs_per_call >= 2 else "loop"
