"""Evaluation of flat parameter vectors: inference mode, large batches, the template model in place."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedweave.execution.params import ParamLayout


@torch.inference_mode()
def evaluate(
    layout: ParamLayout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of parameters ``w`` on ``(x, y)``."""
    model = layout.load_(w)
    model.eval()
    correct, loss = 0, 0.0
    for lo in range(0, len(y), batch_size):
        logits = model(x[lo : lo + batch_size])
        yb = y[lo : lo + batch_size]
        loss += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    model.train()
    n = max(len(y), 1)
    return correct / n, loss / n


def evaluate_clients(
    layout: ParamLayout,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    batch_size: int = 2048,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client accuracy and loss: row ``k`` of ``params`` (or one shared vector) on ``parts[k]``."""
    accs, losses = np.zeros(len(parts)), np.zeros(len(parts))
    for k, idx in enumerate(parts):
        w = params[k] if params.dim() == 2 else params
        t = torch.as_tensor(idx, dtype=torch.long)
        accs[k], losses[k] = evaluate(layout, w, x[t], y[t], batch_size)
    return accs, losses
