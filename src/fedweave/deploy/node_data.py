"""A SuperNode's own data: one client's training samples in an ``.npz`` file with arrays ``x`` and ``y``.

``x`` holds the samples in the layout of fedweave's datasets (``(n, *input_shape)``: images as C, H, W,
normalized; feature vectors as ``(n, d)``; token ids as int64) and ``y`` the targets (int64 class labels, or
floats for regression and multi-label tasks). The file is read with ``allow_pickle=False``: no code runs.
:func:`export_clients` writes the files of a configured dataset's partition (a trial whose nodes read their
own files gives the simulation's numbers). A trial node without a file derives its client's samples once
per run and keeps them as such a file in its state directory (``fedweave.deploy.client_app``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fedweave.config import ConfigError, RunConfig
from fedweave.data.base import Dataset
from fedweave.results import UMASK, folder_refusal


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


def trial_parts(config: RunConfig, ctx=None) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """``(train_x, train_y, parts)``: the training samples and each client's indices as the simulation of
    ``config`` gives them (the hierarchical family: the clients' parts of its server/client split), with the
    samples its trainer has (a data-poisoning attacker's samples poisoned, ``faults.byzantine``)."""
    from fedweave.algorithms.base import RunContext
    from fedweave.config import build_dataclass
    from fedweave.registry import ALGORITHMS
    from fedweave.robust import poisoned_data

    ctx = ctx or RunContext(config)
    cls = ALGORITHMS.get(config.algorithm.name)
    if cls.family == "hierarchical":
        from fedweave.algorithms.hierarchical.base import split_hierarchy

        hp = build_dataclass(cls.Hparams, config.algorithm.options, "algorithm", config.algorithm.name)
        d = split_hierarchy(ctx, hp.server_share, hp.test_fraction, hp.validation)
        x, y, parts = d.train_x, d.train_y, d.parts
    else:
        x, y, parts = ctx.dataset.train_x, ctx.dataset.train_y, ctx.partition
    x, y = poisoned_data(config, ctx.seeds, x, y, parts, ctx.dataset.num_classes)
    return x, y, parts


def node_dataset(path: str, num_classes: int, name: str) -> Dataset:
    """A node data file as the dataset ``name`` its node trains on (no test split: the server evaluates), checked
    as a plug-in's data are, naming the file: a NaN feature trained the node to NaN, a label beyond
    ``num_classes`` failed inside the loss (the training split stands in for the test split it has none of)."""
    from fedweave.byo import check_loaded

    x, y = load_node_data(path)
    shape = tuple(x.shape[1:])
    check_loaded(f"node data {path}", Dataset(f"node data {path}", x, y, x, y, num_classes, shape))
    return Dataset(name, x, y, x[:0], y[:0], num_classes, shape)


def own_parts(client: int, samples: int, num_clients: int) -> list[np.ndarray]:
    """A partition in which ``client`` holds all ``samples`` (a node's own data) and the others none."""
    empty = np.zeros(0, dtype=np.int64)
    return [np.arange(samples) if i == client else empty for i in range(max(num_clients, client + 1))]


def write_samples(path: str | Path, x: torch.Tensor, y: torch.Tensor, *, shared: bool = False) -> None:
    """A node data file of ``x`` and ``y``, written atomically (a reader sees no half-written file). ``shared``:
    with the user's usual permissions, as the run's files (an exported file, handed to a node); else 0600, as
    the node's other state files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # as NodeState names it
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x=x.cpu().numpy(), y=y.cpu().numpy())
        if shared:
            os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_clients(config: RunConfig, directory: str | Path, clients: list[int] | None = None) -> list[Path]:
    """Write ``client-<i>.npz`` (x and y of client i's training samples, in partition order) for the
    configured dataset and partition (the hierarchical family: its clients' parts); returns the paths.
    Nothing is overwritten: an existing file, or a client not in the partition, is refused before any file
    is written."""
    return plan_export(config, directory, clients)()


def plan_export(config: RunConfig, directory: str | Path, clients: list[int] | None = None) -> Callable[[], list[Path]]:
    """Check what :func:`export_clients` would write (the run's data and partition built, every client in
    it, no file already there) and return the function that writes the files, so that a caller can refuse
    before it writes anything of its own."""
    train_x, train_y, parts = trial_parts(config)
    chosen = list(range(len(parts)) if clients is None else clients)
    out = Path(directory)
    if what := folder_refusal(out):  # before the app or any file is written, nothing created
        raise ConfigError(f"node data directory {str(out)!r} {what}; give a folder this user can write")
    for c in chosen:
        if not 0 <= c < len(parts):
            raise ConfigError(f"client {c} is not in the partition (0 .. {len(parts) - 1})")
        path = out / f"client-{c}.npz"
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it or choose another directory")

    def write() -> list[Path]:
        paths = []
        for c in chosen:
            path = out / f"client-{c}.npz"
            if path.exists():  # appeared since the check
                raise FileExistsError(f"{path} exists; remove it or choose another directory")
            idx = torch.as_tensor(parts[c], dtype=torch.long)
            write_samples(path, train_x[idx], train_y[idx], shared=True)
            paths.append(path)
        return paths

    return write
