"""A SuperNode's own data: one client's training samples in an ``.npz`` file with arrays ``x`` and ``y``.

``x`` holds the samples in the layout of fedweave's datasets (``(n, *input_shape)``: images as C, H, W,
normalized; feature vectors as ``(n, d)``; token ids as int64) and ``y`` the targets (int64 class labels, or
floats for regression and multi-label tasks). The file is read with ``allow_pickle=False``: no code runs.
:func:`export_clients` writes the files of a configured dataset's partition (a trial whose nodes read their
own files gives the simulation's numbers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedweave.config import ConfigError, RunConfig


class NodeDataError(ValueError):
    """The node's data file is missing or not a fedweave node data file."""


def load_node_data(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(x, y)`` tensors of a node data file, checked."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise NodeDataError(f"node data {str(path)!r} is not a file (node config 'data' names an .npz with x and y)")
    try:
        with np.load(file, allow_pickle=False) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise NodeDataError(f"node data {str(file)!r} lacks the arrays {missing} (it has {z.files})")
            x, y = z["x"], z["y"]
    except NodeDataError:
        raise
    except (OSError, ValueError) as e:
        raise NodeDataError(f"node data {str(file)!r} is not a readable .npz of arrays x and y ({e})") from e
    if len(x) != len(y) or len(x) == 0:
        raise NodeDataError(f"node data {str(file)!r}: x has {len(x)} rows and y {len(y)}; both need the same n > 0")
    for name, a in (("x", x), ("y", y)):
        if a.dtype.kind not in "biuf":
            raise NodeDataError(f"node data {str(file)!r}: {name} must be numbers, got dtype {a.dtype}")
    y = y.astype(np.int64) if y.dtype.kind in "biu" else y
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def export_clients(config: RunConfig, directory: str | Path, clients: list[int] | None = None) -> list[Path]:
    """Write ``client-<i>.npz`` (x and y of client i's training samples, in partition order) for the
    configured dataset and partition; returns the paths. Nothing is overwritten."""
    from fedweave.algorithms.base import RunContext

    ctx = RunContext(config)
    ds, parts = ctx.dataset, ctx.partition
    chosen = range(len(parts)) if clients is None else clients
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in chosen:
        if not 0 <= c < len(parts):
            raise ConfigError(f"client {c} is not in the partition (0 .. {len(parts) - 1})")
        path = out / f"client-{c}.npz"
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it or choose another directory")
        idx = torch.as_tensor(parts[c], dtype=torch.long)
        np.savez(path, x=ds.train_x[idx].numpy(), y=ds.train_y[idx].numpy())
        paths.append(path)
    return paths
