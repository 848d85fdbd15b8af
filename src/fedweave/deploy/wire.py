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
    """Bytes of ``obj`` as Flower serialises it for transport and a receiver pulls it: the object and its
    children; a parent's children are keyed by content, so identical arrays of one record (or identical 5 MB
    chunks of one array) travel once."""
    children = getattr(obj, "children", None) or {}
    return len(obj.deflate()) + sum(wire_bytes(c) for c in children.values())


def tree_bytes(obj: Any) -> int:
    """Bytes of ``obj`` and its children counted as often as the message names them (every array of a record,
    every chunk of an array): ``wire_bytes`` plus what Flower saves by sending identical children once."""
    if isinstance(obj, ArrayRecord):
        return len(obj.deflate()) + sum(tree_bytes(a) for a in obj.values())
    if isinstance(obj, Array):  # its children are its distinct chunks; ``slice_array`` names every one
        return len(obj.deflate()) + sum(len(chunk.deflate()) for _, chunk in obj.slice_array())
    children = getattr(obj, "children", None) or {}
    return len(obj.deflate()) + sum(tree_bytes(c) for c in children.values())


def pushed_bytes(msgs: list[Any]) -> int:
    """Bytes of the distinct objects of the messages pushed in one call: the ServerApp uploads an object that
    several messages of one push share (every job's start vector ``x`` of a round) to the SuperLink once."""
    out: dict[str, int] = {}

    def collect(obj: Any) -> None:
        out[obj.object_id] = len(obj.deflate())
        for child in (getattr(obj, "children", None) or {}).values():
            collect(child)

    for m in msgs:
        collect(m)
    return sum(out.values())
