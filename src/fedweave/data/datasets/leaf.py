"""LEAF's JSON output (FEMNIST, Shakespeare, ...): ``train/*.json`` and ``test/*.json`` under one directory.

Each file holds ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``.
Users keep their natural identity: ``train_users`` / ``test_users`` number them in order of first
appearance in the (sorted) train files. LEAF data are not downloadable from a package registry; point
root= at the directory LEAF's preprocessing scripts wrote (e.g. ``leaf/data/femnist/data``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedweave.data.base import Dataset
from fedweave.data.datasets._common import Root, opt_choice, opt_int, reads_user_files, reject_unknown
from fedweave.registry import DATASETS
from fedweave.seeding import Seeds


class LEAFFormatError(ValueError):
    """A LEAF JSON file does not have the expected layout."""


# LEAF's character set (``models/utils/language_utils.py``: ALL_LETTERS), 80 symbols: the text samples of LEAF's
# JSON and the Shakespeare loader's plays (shakespeare.py imports it from here) are encoded with it.
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_INDEX = np.full(256, -1, dtype=np.int16)  # code point (< 256) -> id
for _i, _c in enumerate(VOCAB):
    _INDEX[ord(_c)] = _i


def encode(text: str, unknown: int | None = None) -> np.ndarray:
    """Character ids (uint8). Characters outside :data:`VOCAB` raise, or map to ``unknown`` if given."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    ids = np.where(codes < 256, _INDEX[np.minimum(codes, 255)], -1)
    if (ids < 0).any():
        if unknown is None:
            bad = sorted({text[i] for i in np.flatnonzero(ids < 0)[:20]})
            raise ValueError(f"characters outside the 80-symbol vocabulary: {bad}")
        ids = np.where(ids < 0, unknown, ids)
    return ids.astype(np.uint8)


def read_split(directory: Path) -> dict[str, dict[str, list]]:
    """Merge ``user_data`` of every ``*.json`` in ``directory`` (sorted), users in first-seen order."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no LEAF JSON files (*.json) in {directory}")
    users: dict[str, dict[str, list]] = {}
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                blob = json.load(fh)
        except ValueError as e:  # a truncated or hand-edited file: json's message alone names no file
            raise LEAFFormatError(f"{f}: not valid JSON ({e})") from e
        if (
            not isinstance(blob, dict)
            or not isinstance(blob.get("users"), list)
            or not isinstance(blob.get("user_data"), dict)
        ):
            raise LEAFFormatError(f"{f}: expected keys 'users' and 'user_data' (LEAF layout)")
        listed = Counter(u for u in blob["users"] if isinstance(u, str))  # another kind is refused below
        if twice := next((u for u, times in listed.items() if times > 1), None):
            # its samples were added once per listing, without a word (across files merging is the layout's)
            raise LEAFFormatError(f"{f}: user {twice!r} is listed twice in 'users'; list each user once")
        for u in blob["users"]:
            d = blob["user_data"].get(u) if isinstance(u, str) else None
            if (
                not isinstance(d, dict)
                or not isinstance(d.get("x"), list)
                or not isinstance(d.get("y"), list)
                or len(d["x"]) != len(d["y"])
            ):
                raise LEAFFormatError(f"{f}: user {u!r} lacks equal-length 'x' and 'y'")
            entry = users.setdefault(str(u), {"x": [], "y": []})
            entry["x"].extend(d["x"])
            entry["y"].extend(d["y"])
    return users


def _kind_of(sample: Any) -> str:
    return "text" if isinstance(sample, str) else "image" if np.asarray(sample).size == 784 else "vector"


def _encode_x(xs: list, kind: str, source: str) -> torch.Tensor:
    if kind == "text":
        if others := [s for s in xs if not isinstance(s, str)]:  # else str.join's message, naming no file
            raise LEAFFormatError(
                f"{source}: text samples must all be strings (the first sample is one), got a "
                f"{type(others[0]).__name__}"
            )
        lengths = {len(s) for s in xs}
        if len(lengths) > 1:
            raise LEAFFormatError(f"{source}: text samples have different lengths {sorted(lengths)[:5]}")
        space = VOCAB.index(" ")
        ids = encode("".join(xs), unknown=space).astype(np.int64)
        return torch.from_numpy(ids.reshape(len(xs), -1))
    try:
        arr = np.asarray(xs, dtype=np.float32)
    except (ValueError, TypeError) as e:  # ragged rows or non-numbers: numpy's message names no file
        raise LEAFFormatError(f"{source}: samples must be lists of numbers, all of one length ({e})") from e
    if arr.ndim < 2:  # a bare number per sample is not a feature vector
        raise LEAFFormatError(f"{source}: samples must be lists of numbers, got shape {arr.shape}")
    if kind == "image":
        if arr.ndim != 2 or arr.shape[1] != 784:
            raise LEAFFormatError(f"{source}: image samples must have 784 values, got shape {arr.shape}")
        arr = arr.reshape(-1, 1, 28, 28)
    return torch.from_numpy(arr)


def _encode_y(ys: list, kind: str, source: str) -> np.ndarray:
    if kind == "text":
        if any(not isinstance(c, str) or len(c) != 1 for c in ys):
            raise LEAFFormatError(f"{source}: text labels must be single characters")
        return encode("".join(ys), unknown=VOCAB.index(" ")).astype(np.int64)
    # Class labels are whole numbers: int64 conversion would truncate 1.7 to class 1 and fail on "a" without
    # naming the file. A float that is whole (3.0) is the class it names.
    for y in ys:
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not (abs(y) < 2**63 and float(y).is_integer()):
            raise LEAFFormatError(f"{source}: label {y!r} is not a whole-number class")
    return np.asarray(ys, dtype=np.int64)


def load_leaf_dir(
    root: Path,
    *,
    name: str = "leaf",
    kind: str = "auto",
    num_classes: int | None = None,
    max_users: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Read ``root/train`` and ``root/test``; see :func:`load_leaf` for the options."""
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise FileNotFoundError(
                f"dataset {name!r}: {root / split} is missing; LEAF data need root=DIR with train/*.json and "
                "test/*.json (the output of LEAF's preprocess.sh)"
            )
    train, test = read_split(root / "train"), read_split(root / "test")
    ids = {u: i for i, u in enumerate(train)}
    for u in test:  # users seen only in test get ids after the train users
        ids.setdefault(u, len(ids))
    users = list(ids)
    if max_users is not None and max_users < len(users):
        keep = Seeds(seed).numpy("leaf-users").choice(len(users), max_users, replace=False)
        users = [users[i] for i in np.sort(keep)]
    first = next((d["x"][0] for d in train.values() if d["x"]), None)
    if first is None:
        raise LEAFFormatError(f"{root / 'train'}: no samples")
    if kind == "auto":
        kind = _kind_of(first)

    parts = {}
    for split, data in (("train", train), ("test", test)):
        xs, ys, us = [], [], []
        for u in users:
            d = data.get(u)
            if d:
                xs.extend(d["x"])
                ys.extend(d["y"])
                us.append(np.full(len(d["y"]), ids[u], np.int64))
        if not xs:
            raise LEAFFormatError(f"{root / split}: no samples for the selected users")
        parts[split] = (
            _encode_x(xs, kind, str(root / split)),
            _encode_y(ys, kind, str(root / split)),
            np.concatenate(us),
        )
    ymax = max(int(parts[s][1].max()) for s in parts)
    if num_classes is None:
        num_classes = len(VOCAB) if kind == "text" else 62 if kind == "image" and ymax < 62 else ymax + 1
    if ymax >= num_classes or min(int(parts[s][1].min()) for s in parts) < 0:
        raise LEAFFormatError(f"dataset {name!r}: labels outside 0..{num_classes - 1}")
    (tx, ty, tu), (vx, vy, vu) = parts["train"], parts["test"]
    return Dataset(
        name,
        tx,
        torch.from_numpy(ty),
        vx,
        torch.from_numpy(vy),
        num_classes=num_classes,
        input_shape=tuple(tx.shape[1:]),
        train_users=tu,
        test_users=vu,
    )


@DATASETS.register("leaf")
@reads_user_files
def load_leaf(
    root: Root = None,
    *,
    kind: str = "auto",
    num_classes: int | None = None,
    max_users: int | None = None,
    seed: int = 0,
    **unknown,
) -> Dataset:
    """LEAF JSON: FEMNIST images become float32 (N, 1, 28, 28); text becomes int64 (N, L) over LEAF's
    80-symbol vocabulary (unknown symbols map to a space); other vectors stay float32 (N, d).

    Options: ``kind`` = ``"auto"`` / ``"image"`` / ``"text"`` / ``"vector"``; ``num_classes`` (default: 62
    for 28x28 images (FEMNIST), 80 for text, else max label + 1); ``max_users`` (a random subset of users,
    drawn with ``seed``).
    """
    reject_unknown("leaf", unknown, load_leaf)
    if root is None:
        raise ValueError("dataset 'leaf' needs root=DIR containing LEAF's train/*.json and test/*.json")
    kind = opt_choice("leaf", "kind", kind, ("auto", "image", "text", "vector"))
    num_classes = opt_int("leaf", "num_classes", num_classes, minimum=2, allow_none=True)
    max_users = opt_int("leaf", "max_users", max_users, allow_none=True)
    seed = opt_int("leaf", "seed", seed, minimum=0)
    # "~" names the home directory, as for every loader whose files come through sources.resolve
    root = Path(root).expanduser()
    return load_leaf_dir(root, kind=kind, num_classes=num_classes, max_users=max_users, seed=seed)
