"""Jobs and results as Flower records, and the bytes Flower actually serialises for them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedweave.deploy.jobs import encode_header


def _array(t: torch.Tensor) -> Array:
    t = t.detach().cpu()
    # numpy has no bfloat16 (the smashed data of a bf16-mixed split run): its bits travel as int16
    return Array((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())


def to_records(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> RecordDict:
    arrays = ArrayRecord(array_dict={k: _array(t) for k, t in tensors.items()})
    bf16 = sorted(k for k, t in tensors.items() if t.dtype == torch.bfloat16)
    return RecordDict({"tensors": arrays, "header": ConfigRecord({"json": encode_header(header), "bfloat16": bf16})})


def on_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors off the wire (host memory) on the device that computes with them."""
    return {k: t.to(device) for k, t in tensors.items()}


def from_records(content: RecordDict, device: torch.device | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """The JSON header and the tensors of a record dict (KeyError when either is missing), the tensors on
    ``device`` when one is given (else in host memory)."""
    header = str(content["header"]["json"])
    bf16 = set(content["header"].get("bfloat16", []))
    tensors = {k: torch.from_numpy(np.array(a.numpy())) for k, a in content["tensors"].items()}
    tensors = {k: t.view(torch.bfloat16) if k in bf16 else t for k, t in tensors.items()}
    return header, tensors if device is None else on_device(tensors, device)


def payload_bytes(msg: Any) -> int:
    """Bytes of the array values a message carries (what fedweave's ledger counts as payload)."""
    if msg.has_error():
        return 0
    arrays = msg.content.array_records.get("tensors")
    if arrays is None:
        return 0
    return sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in arrays.values())


def wire_bytes(obj: Any) -> int:
    """Bytes of ``obj`` as Flower serialises it for transport (the object and its children)."""
    children = getattr(obj, "children", None) or {}
    return len(obj.deflate()) + sum(wire_bytes(c) for c in children.values())
