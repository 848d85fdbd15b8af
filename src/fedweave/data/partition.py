"""Partitioners: split a training set over clients, and matching per-client test sets.

Every partitioner has the signature
``fn(labels, num_clients, rng, *, users=None, **params) -> Partition`` (or a list of arrays) and gives, per
client, a sorted int64 array of indices into the training set. Parts never overlap; samples left out by a scheme are
listed in its docstring and in ``docs/partitioning.md``. All randomness comes from ``rng``, so the same seed
gives the same partition. Errors name the config key as written (``partition.alpha``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from fedweave.registry import PARTITIONERS

# ------------------------------------------------------------------------------------------- partition


class Partition(Sequence):
    """Per-client index arrays held compactly: client ``i`` holds ``indices[offsets[i]:offsets[i + 1]]``.

    It behaves like the list of per-client index arrays it replaces (``len(p)``, ``p[i]``, iteration, ``p[a:b]``),
    but stores one index array and ``m + 1`` offsets instead of a Python list of ``m`` arrays: 8 bytes a client
    and 8 a sample, against some 200 bytes a client for a list of small numpy arrays (and 400 more for torch
    tensors). ``p[i]`` is a view into ``indices``. ``indices`` is a numpy array or a torch tensor (the local
    trainer's copy, :meth:`as_torch`, shares the memory of the numpy one).
    """

    def __init__(self, indices: Any, offsets: np.ndarray) -> None:
        self.indices = indices
        self.offsets = np.asarray(offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or len(self.offsets) < 1:
            raise ValueError("Partition offsets must be a 1-D array of m + 1 positions")

    @classmethod
    def from_sizes(cls, indices: Any, sizes: Sequence[int] | np.ndarray) -> Partition:
        """Client ``i`` holds the next ``sizes[i]`` entries of ``indices``."""
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(indices, offsets)

    @classmethod
    def of(cls, parts: Sequence[Any]) -> Partition:
        """``parts`` as a Partition: itself if it is one, else its arrays (int64) concatenated in client order."""
        if isinstance(parts, Partition):
            return parts
        arrays = [np.asarray(p.cpu() if hasattr(p, "cpu") else p, dtype=np.int64).reshape(-1) for p in parts]
        flat = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
        return cls.from_sizes(flat, [len(a) for a in arrays])

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client, ``(m,)`` int64."""
        return np.diff(self.offsets)

    def as_torch(self) -> Partition:
        """The same partition with a torch ``indices`` tensor (sharing memory with a numpy one)."""
        if isinstance(self.indices, np.ndarray):
            import torch

            return Partition(torch.from_numpy(np.ascontiguousarray(self.indices, dtype=np.int64)), self.offsets)
        return self

    def as_numpy(self) -> Partition:
        """The same partition with a numpy ``indices`` array (sharing memory with a CPU torch tensor)."""
        if isinstance(self.indices, np.ndarray):
            return self
        return Partition(self.indices.cpu().numpy(), self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step == 1:
                return Partition(self.indices, self.offsets[lo : max(lo, hi) + 1])
            return [self[j] for j in range(lo, hi, step)]
        i = operator.index(i)
        m = len(self.offsets) - 1
        if i < 0:
            i += m
        if not 0 <= i < m:
            raise IndexError(f"client {i} is not in the partition (0 .. {m - 1})")
        return self.indices[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __iter__(self) -> Iterator[Any]:
        idx, off = self.indices, self.offsets.tolist()
        return (idx[a:b] for a, b in zip(off, off[1:]))

    def __add__(self, other: Sequence[Any]) -> list[Any]:  # as a list of arrays: p + [extra] is a list
        return [*self, *other]

    def __radd__(self, other: Sequence[Any]) -> list[Any]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Partition({len(self)} clients, {int(self.offsets[-1] - self.offsets[0])} samples)"


def client_sizes(parts: Sequence[Any]) -> np.ndarray:
    """Samples per client of a partition (a :class:`Partition` or a list of index arrays), ``(m,)`` int64."""
    if isinstance(parts, Partition):
        return parts.sizes
    return np.array([len(p) for p in parts], dtype=np.int64)


def clients_with_data(parts: Sequence[Any]) -> np.ndarray:
    """The clients of a partition that hold training samples (every client where none does): those whose local
    steps a per-client mean counts (the papers' K, the simulated clock's unit). A client without samples takes
    no step, and its 0 would only shrink the mean."""
    held = np.flatnonzero(client_sizes(parts) > 0)
    return held if len(held) else np.arange(len(parts))


def check_parts(parts: Sequence[Any], n: int, name: str, num_clients: int = 0) -> Partition:
    """The per-client index arrays of a partitioner of your own as a :class:`Partition`, held to the contract of
    ``docs/partitioning.md``: ``num_clients`` arrays (any number when 0, as ``partition.num_clients: 0`` asks),
    whole-number indices into the ``n`` training samples, no sample on two clients.

    Without this a float index was truncated to another sample, a negative one wrapped around to the last
    samples, a shared sample was trained on by two clients, and another number of clients than the config's ran
    without a word. Raises ``ValueError`` naming the partitioner.
    """
    if num_clients and len(parts) != num_clients:
        raise ValueError(
            f"partition {name!r}: {len(parts)} clients returned where partition.num_clients is {num_clients}; a "
            "partitioner returns one index array per client"
        )
    arrays = []
    for i, p in enumerate(parts):
        a = np.asarray(p.cpu() if hasattr(p, "cpu") else p).reshape(-1)
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(
                f"partition {name!r}: client {i} holds {a.dtype} indices; a partitioner must return whole-number "
                f"indices in [0, {n - 1}] (the training set)"
            )
        outside = a[(a < 0) | (a >= n)] if a.size else a
        if outside.size:
            raise ValueError(
                f"partition {name!r}: client {i} holds index {outside[0]}, outside the training set [0, {n - 1}]"
            )
        arrays.append(a.astype(np.int64, copy=False))
    out = Partition.of(arrays)
    if len(np.unique(out.indices)) != len(out.indices):
        raise ValueError(
            f"partition {name!r}: a sample is given to more than one client (or twice); clients must hold "
            "distinct samples"
        )
    return out


# --------------------------------------------------------------------------------------------- helpers


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"partition labels must be a 1-D array, got shape {labels.shape}")
    if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0):
        raise ValueError("partition labels must be non-negative integers")
    return labels.astype(np.int64, copy=False)


def integral(value: Any) -> Any:
    """``value``, with a float that is a whole number (``10.0``) made an int, as every integer key of the config
    accepts it; anything else unchanged, for the check that reads it to refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _check_int(key: str, value: int, minimum: int) -> int:
    value = integral(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_clients(num_clients: int, n: int) -> int:
    num_clients = _check_int("partition.num_clients", num_clients, 1)
    if num_clients > n:
        raise ValueError(
            f"partition.num_clients ({num_clients}) exceeds the {n} training samples; use at most {n} clients"
        )
    return num_clients


def _check_positive(key: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"partition.{key} must be a number > 0, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"partition.{key} must be > 0, got {value!r}")
    return float(value)


def _check_min_size(min_size: int, num_clients: int, n: int) -> int:
    min_size = _check_int("partition.min_size", min_size, 0)
    if num_clients * min_size > n:
        raise ValueError(
            f"partition.min_size ({min_size}) x partition.num_clients ({num_clients}) = "
            f"{num_clients * min_size} exceeds the {n} training samples; lower partition.min_size "
            f"(at most {n // num_clients} for {num_clients} clients) or partition.num_clients "
            f"(at most {n // max(min_size, 1)} for min_size {min_size})"
        )
    return min_size


def _groups(owner: np.ndarray, num_clients: int) -> Partition:
    """Per-client sorted index arrays from ``owner[i]`` = client of sample i (-1: left out)."""
    kept = np.flatnonzero(owner >= 0)
    n = len(owner)
    if n < 2**31:  # sort the unique keys (client, index): 5x faster than a stable argsort at 20M samples
        key = owner[kept] * n + kept
        key.sort()
        order = key % n
    else:
        order = kept[np.argsort(owner[kept], kind="stable")]  # stable: indices stay ascending per client
    counts = np.bincount(owner[kept], minlength=num_clients)
    return Partition.from_sizes(order.astype(np.int64, copy=False), counts)


def _split_sorted(perm: np.ndarray, sizes: np.ndarray) -> Partition:
    """Client ``i`` takes the next ``sizes[i]`` entries of ``perm`` (a permutation of ``range(n)``), sorted:
    ``[np.sort(p) for p in np.split(perm, np.cumsum(sizes)[:-1])]`` without a Python loop over the clients."""
    owner = np.empty(len(perm), dtype=np.int64)
    owner[perm] = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return _groups(owner, len(sizes))


def _apportion(p: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` proportional to ``p`` (largest-remainder rounding)."""
    raw = p / p.sum() * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(raw - counts), kind="stable")[:short]] += 1
    return counts


def _dirichlet(rng: np.random.Generator, alpha: float, size: int) -> np.ndarray:
    """p ~ Dir(alpha * 1_size). numpy's sampler returns all zeros once the sum of its gamma draws overflows
    (alpha * size above about 1.8e308); Dir(alpha) is then uniform to machine precision, its limit as alpha
    grows, so that is what is returned (a zero vector would give every sample to one client)."""
    p = rng.dirichlet(np.full(size, alpha))
    if not p.sum() > 0 and alpha >= 1:
        p = np.full(size, 1.0 / size)
    return p


def _lognormal_weights(rng: np.random.Generator, sigma: float, size: int) -> np.ndarray:
    """Weights proportional to lognormal(0, sigma) draws. Above sigma ~ 100, exp overflows to inf and the
    shares would be nan: the same normal draws (lognormal is exp of them, one per sample, from the same
    stream) are then exponentiated relative to the largest, which leaves the shares unchanged."""
    state = rng.bit_generator.state
    weights = rng.lognormal(0.0, sigma, size=size)
    if not np.isfinite(weights).all():
        rng.bit_generator.state = state
        z = rng.normal(0.0, sigma, size=size)
        weights = np.exp(z - z.max())
    return weights


def _shuffled_by_class(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """All indices grouped by class (ascending), randomly ordered within each class; and class sizes."""
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    return order, np.bincount(labels, minlength=int(labels.max()) + 1 if labels.size else 0)


# ------------------------------------------------------------------------------------------ partitioners


def label_free(fn: Any) -> Any:
    """Mark a partitioner that reads only the number of samples (or the users, or a file), never the labels: on
    float targets (a regression) it is called with placeholder labels and refuses ``partition.bins``, where the
    others split by class label and need ``bins`` (``RunContext.partition_of``). Under the registration:
    ``@PARTITIONERS.register("name")`` over ``@label_free``."""
    fn.label_free = True
    return fn


def is_label_free(fn: Any) -> bool:
    """Whether partitioner ``fn`` is marked :func:`label_free`."""
    return getattr(fn, "label_free", False) is True


@PARTITIONERS.register("iid")
@label_free
def iid(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, users: np.ndarray | None = None
) -> Partition:
    """Uniformly random split into equal parts (sizes differ by at most 1). Uses every sample."""
    labels = _check_labels(labels)
    n = len(labels)
    m = _check_clients(num_clients, n)
    sizes = np.full(m, n // m, dtype=np.int64)
    sizes[: n % m] += 1  # np.array_split's sizes
    return _split_sorted(rng.permutation(n), sizes)


def _dirichlet_attempt(class_sizes: np.ndarray, m: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """One per-class Dir(alpha) draw over clients: the owner of each sample in class-grouped order."""
    n = int(class_sizes.sum())
    owner = np.empty(n, dtype=np.int64)
    sizes = np.zeros(m, dtype=np.int64)
    start = 0
    for n_k in class_sizes:
        if n_k == 0:
            continue
        p = _dirichlet(rng, alpha, m)
        # Li et al. (NIID-Bench) balancing: clients already holding >= N/m samples get no more of this class.
        masked = p * (sizes < n / m)
        if masked.sum() > 0:
            p = masked / masked.sum()
        cuts = (np.cumsum(p) * n_k).astype(np.int64)[:-1]
        counts = np.diff(np.concatenate(([0], np.minimum(cuts, n_k), [n_k])))
        owner[start : start + n_k] = np.repeat(np.arange(m), counts)
        sizes += counts
        start += n_k
    return owner


def _repair_min_size(owner: np.ndarray, m: int, min_size: int, rng: np.random.Generator) -> None:
    """Move random samples from the currently largest client to each client below ``min_size``.

    In place. Terminates in at most 2*m moves: the caller guarantees m * min_size <= N, so while any
    client is short, the largest one holds more than ``min_size``.
    """
    sizes = np.bincount(owner, minlength=m)
    for i in np.flatnonzero(sizes < min_size):
        while sizes[i] < min_size:
            j = int(np.argmax(sizes))  # ties: lowest client index (deterministic)
            give = int(min(min_size - sizes[i], sizes[j] - min_size))
            moved = rng.choice(np.flatnonzero(owner == j), size=give, replace=False)
            owner[moved] = i
            sizes[j] -= give
            sizes[i] += give


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    alpha: float = 0.5,
    min_size: int = 10,
    max_attempts: int = 100,
) -> Partition:
    """Label skew, per class: the share of class k on each client is p_k ~ Dir(alpha * 1_m).

    The scheme of Li et al. (NIID-Bench), used by ZO-HFL [11]: a client that already holds >= N/m samples
    receives nothing of the later classes. Up to ``max_attempts`` draws are made until every client has
    >= ``min_size`` samples; if none succeeds, the draw with the smallest total shortfall is repaired by
    moving random samples from the largest clients. So it always terminates. Uses every sample.
    """
    labels = _check_labels(labels)
    n = len(labels)
    m = _check_clients(num_clients, n)
    alpha = _check_positive("alpha", alpha)
    min_size = _check_min_size(min_size, m, n)
    max_attempts = _check_int("partition.max_attempts", max_attempts, 1)

    # One shuffle serves all attempts: the draws decide only how many of each class a client gets.
    order, class_sizes = _shuffled_by_class(labels, rng)
    best, best_short = None, None
    for _ in range(max_attempts):
        owner = np.empty(n, dtype=np.int64)
        owner[order] = _dirichlet_attempt(class_sizes, m, alpha, rng)
        short = int(np.maximum(min_size - np.bincount(owner, minlength=m), 0).sum())
        if best_short is None or short < best_short:
            best, best_short = owner, short
        if short == 0:
            break
    assert best is not None
    if best_short:
        _repair_min_size(best, m, min_size, rng)
    return _groups(best, m)


@PARTITIONERS.register("dirichlet_balanced")
def dirichlet_balanced(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    alpha: float = 0.5,
) -> Partition:
    """Label skew, per client, equal sizes (Hsu et al.; DisPFL's code for AFIND+, FedMIM's Sec. V-A).

    Each client i draws a class prior q_i ~ Dir(alpha * 1_C) and has capacity floor(N/m). Until all are
    full: pick a client uniformly among those not full, draw a class from q_i renormalized over classes
    with samples left (equal to the papers' redraw loop, but always terminating; afind-plus spec 4.2,
    fedmim spec A28), and give that client one unused sample of the class. Samples are never reused.
    The N mod m samples left over at the end are left out.
    """
    labels = _check_labels(labels)
    n = len(labels)
    m = _check_clients(num_clients, n)
    alpha = _check_positive("alpha", alpha)
    order, class_sizes = _shuffled_by_class(labels, rng)
    num_classes = len(class_sizes)
    q = rng.dirichlet(np.full(num_classes, alpha), size=m)
    starts = np.concatenate(([0], np.cumsum(class_sizes)[:-1]))
    left = class_sizes.copy()  # unused samples per class; the next one is order[starts[c] + left[c] - 1]
    capacity = np.full(m, n // m, dtype=np.int64)
    open_clients = list(range(m))
    owner = np.full(n, -1, dtype=np.int64)
    u_client, u_class = rng.random(m * (n // m)), rng.random(m * (n // m))
    for t in range(m * (n // m)):
        slot = int(u_client[t] * len(open_clients))
        i = open_clients[slot]
        w = q[i] * (left > 0)
        total = w.sum()
        if total <= 0:  # the prior has no mass left on available classes: fall back to class frequencies
            w, total = left.astype(float), float(left.sum())
        c = min(int(np.searchsorted(np.cumsum(w), u_class[t] * total, side="right")), num_classes - 1)
        if left[c] == 0:  # float edge case at the top of the CDF: take the last available class
            c = int(np.flatnonzero(w)[-1])
        left[c] -= 1
        owner[order[starts[c] + left[c]]] = i
        capacity[i] -= 1
        if capacity[i] == 0:
            open_clients[slot] = open_clients[-1]
            open_clients.pop()
    return _groups(owner, m)


@PARTITIONERS.register("pathological")
def pathological(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    classes_per_client: int = 2,
) -> Partition:
    """Each client gets exactly ``classes_per_client`` (c) distinct classes.

    The m*c class slots are spread as evenly as possible over the C classes present (s_k = floor(mc/C) or
    one more, the extra ones going to random classes that have samples for them); class k's samples are
    shuffled and cut into s_k equal shards (sizes differ by at most 1). Listing each class s_k times and
    reading the list row by row into a c x m grid gives client j column j: since s_k <= m, no column sees a
    class twice. Feasible iff 1 <= c <= C, every class has at least floor(mc/C) samples and at least
    mc mod C classes have more. Classes that get no slot
    (only when m*c < C) are left out.
    """
    labels = _check_labels(labels)
    m = _check_clients(num_clients, len(labels))
    c = integral(classes_per_client)  # 2.0 is 2, as for every integer key of the partition
    present = np.flatnonzero(np.bincount(labels)) if labels.size else np.array([], dtype=np.int64)
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 1 <= c <= len(present):
        raise ValueError(
            f"partition.classes_per_client must be an integer in [1, {len(present)}] "
            f"(the number of classes present), got {c!r}"
        )
    slots = m * c
    shard_counts = np.full(len(present), slots // len(present), dtype=np.int64)
    extra = slots % len(present)
    shard_counts[rng.choice(len(present), size=extra, replace=False)] += 1
    counts = np.bincount(labels)[present]
    able = np.flatnonzero(counts > slots // len(present))  # classes with samples for one more shard
    if np.any(counts < shard_counts) and extra <= len(able):
        # The draw gave an extra shard to a class too small for it, although a feasible split exists: draw the
        # extra shards again among the classes that can take one. This is the first draw conditioned on being
        # feasible (rejection sampling), and a draw that was feasible stays as it was.
        shard_counts[:] = slots // len(present)
        shard_counts[rng.choice(able, size=extra, replace=False)] += 1
    bad = np.flatnonzero(counts < shard_counts)
    if bad.size:
        k = bad[0]
        raise ValueError(
            f"partition 'pathological': class {present[k]} has {counts[k]} samples but needs {shard_counts[k]} "
            f"shards (partition.num_clients x partition.classes_per_client = {slots} shards over "
            f"{len(present)} classes); lower partition.num_clients or partition.classes_per_client"
        )
    class_order = rng.permutation(len(present))
    grid = np.repeat(class_order, shard_counts[class_order]).reshape(c, m)  # grid[r, j]: j's r-th class
    client_of_column = rng.permutation(m)
    owner = np.full(len(labels), -1, dtype=np.int64)
    for k in np.flatnonzero(shard_counts):
        _, cols = np.nonzero(grid == k)  # the s_k slots of class k, one per distinct client
        members = rng.permutation(np.flatnonzero(labels == present[k]))
        for shard, col in zip(np.array_split(members, len(cols)), cols):
            owner[shard] = client_of_column[col]
    return _groups(owner, m)


@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    shards_per_client: int = 2,
) -> Partition:
    """McMahan et al.: sort by label, cut into m * shards_per_client shards, deal them out at random.

    Shards are contiguous runs of the label-sorted data (random order within a label), of sizes differing
    by at most 1, so every sample is used. A client may receive two shards of the same class.
    """
    labels = _check_labels(labels)
    n = len(labels)
    m = _check_clients(num_clients, n)
    s = _check_int("partition.shards_per_client", shards_per_client, 1)
    if m * s > n:
        raise ValueError(
            f"partition.num_clients x partition.shards_per_client = {m * s} shards exceeds the {n} "
            f"training samples; lower one of them"
        )
    order, _ = _shuffled_by_class(labels, rng)
    piece_sizes = np.full(m * s, n // (m * s), dtype=np.int64)
    piece_sizes[: n % (m * s)] += 1  # np.array_split's pieces of ``order``
    deal = rng.permutation(m * s).reshape(m, s)  # client i gets pieces deal[i]
    piece_owner = np.empty(m * s, dtype=np.int64)
    piece_owner[deal.ravel()] = np.repeat(np.arange(m, dtype=np.int64), s)
    owner = np.empty(n, dtype=np.int64)
    owner[order] = np.repeat(piece_owner, piece_sizes)
    return _groups(owner, m)


@PARTITIONERS.register("quantity_skew")
@label_free
def quantity_skew(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    alpha: float | None = None,
    sigma: float | None = None,
    min_size: int = 10,
) -> Partition:
    """Unequal sizes, IID labels. Size shares p ~ Dir(alpha * 1_m) (default, alpha = 0.5), or
    p proportional to lognormal(0, sigma) weights when ``sigma`` is given.

    Client i gets min_size + round(p_i * (N - m * min_size)) samples (largest-remainder rounding), so the
    minimum holds without resampling. Uses every sample.
    """
    labels = _check_labels(labels)
    n = len(labels)
    m = _check_clients(num_clients, n)
    min_size = _check_min_size(min_size, m, n)
    if alpha is not None and sigma is not None:
        raise ValueError("partition 'quantity_skew': give partition.alpha or partition.sigma, not both")
    if sigma is not None:
        weights = _lognormal_weights(rng, _check_positive("sigma", sigma), m)
    else:
        weights = _dirichlet(rng, _check_positive("alpha", 0.5 if alpha is None else alpha), m)
    if not weights.sum() > 0:  # Dir with tiny alpha can underflow to all zeros: one client takes the rest
        weights = np.eye(m)[rng.integers(m)]
    sizes = min_size + _apportion(weights, n - m * min_size)
    return _split_sorted(rng.permutation(n), sizes)


@PARTITIONERS.register("natural")
@label_free
def natural(
    labels: np.ndarray,
    num_clients: int | None,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    select: str = "largest",
) -> Partition:
    """One client per natural user (Shakespeare role, LEAF writer).

    ``num_clients`` 0 or None: every user. Otherwise that many users, chosen by ``select``: ``largest``
    (most samples; ties by user id, deterministic, the default), ``first`` (smallest user ids) or
    ``random`` (uniform, from ``rng``; AFIND+'s "100 writers sampled at random"). Clients are ordered by
    user id. Samples of unselected users are left out.
    """
    labels = _check_labels(labels)
    if users is None:
        others = ", ".join(n for n in PARTITIONERS.names() if n != "natural")  # the registry's, plug-ins too
        raise ValueError(
            "the dataset has no natural users (no per-sample user ids); partition.name 'natural' needs a "
            f"naturally federated dataset, or choose one of {others}"
        )
    users = np.asarray(users)
    if users.shape != labels.shape:
        raise ValueError(f"partition 'natural': users has shape {users.shape}, labels {labels.shape}")
    ids, inverse, counts = np.unique(users, return_inverse=True, return_counts=True)
    n_users = len(ids)
    if num_clients is None or num_clients == 0:
        num_clients = n_users
    num_clients = _check_int("partition.num_clients", num_clients, 0)
    if num_clients > n_users:
        raise ValueError(
            f"partition.num_clients ({num_clients}) exceeds the {n_users} natural users of the dataset; "
            f"use at most {n_users}, or 0 for all users"
        )
    allowed = ("largest", "first", "random")
    if select == "largest":
        chosen = np.argsort(-counts, kind="stable")[:num_clients]
    elif select == "first":
        chosen = np.arange(num_clients)
    elif select == "random":
        chosen = rng.choice(n_users, size=num_clients, replace=False)
    else:
        raise ValueError(f"partition.select must be one of {', '.join(allowed)}, got {select!r}")
    client_of_user = np.full(n_users, -1, dtype=np.int64)
    client_of_user[np.sort(chosen)] = np.arange(num_clients)
    return _groups(client_of_user[inverse.ravel()], num_clients)


# ---------------------------------------------------------------------------------- per-client test sets


def client_test_split(
    train_parts: Sequence[np.ndarray],
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    rng: np.random.Generator,
    *,
    per_client: int | None = None,
) -> list[np.ndarray]:
    """Per-client test sets drawn from the test split with each client's train label distribution.

    DisPFL's rule (afind-plus spec 4.2, the local test sets that the metric of 4.5 averages over):
    n_te = ceil(N_test / m) unless ``per_client`` is given; for each class c held by client i,
    k_c = ceil(train_count_c / n_i * n_te), drawn uniformly without replacement from the test samples of
    class c, independently per client (so test samples may be shared between clients). If k_c exceeds the
    test samples of class c, all of them are taken and the rest drawn with replacement (repeated indices).
    A client with no training data gets an empty test set. Returns sorted int64 arrays.
    """
    train_labels, test_labels = _check_labels(train_labels), _check_labels(test_labels)
    m = len(train_parts)
    if m == 0:
        return []
    n_te = -(-len(test_labels) // m) if per_client is None else _check_int("per_client", per_client, 1)
    order, class_sizes = _shuffled_by_class(test_labels, rng)
    starts = np.concatenate(([0], np.cumsum(class_sizes)))
    out = []
    for i, part in enumerate(train_parts):
        part = np.asarray(part, dtype=np.int64)
        if part.size == 0:
            out.append(np.empty(0, dtype=np.int64))
            continue
        classes, counts = np.unique(train_labels[part], return_counts=True)
        chosen = []
        for c, t_c in zip(classes, counts):
            k_c = -(-int(t_c) * n_te // part.size)  # exact integer ceil
            pool = order[starts[c] : starts[c + 1]] if c < len(class_sizes) else order[:0]
            if pool.size == 0:
                raise ValueError(
                    f"client {i} has training samples of class {c} but the test split has none; "
                    "per-client test sets need every training class in the test split"
                )
            if k_c <= pool.size:
                chosen.append(rng.choice(pool, size=k_c, replace=False))
            else:  # the class ran out: take all, then the rest with replacement
                chosen.append(pool)
                chosen.append(rng.choice(pool, size=k_c - pool.size, replace=True))
        out.append(np.sort(np.concatenate(chosen)).astype(np.int64))
    return out


def holdout_split(
    parts: Sequence[np.ndarray], fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's own train/test split (PFLlib's per-client ``train_test_split(train_size=0.75)``): of a
    client's n samples, a uniformly drawn ``n - floor((1 - fraction) n)`` become its test set and the rest
    stay its training data. Returns ``(train_parts, test_parts)``, sorted int64 indices into the same set."""
    if not 0 <= fraction < 1:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    train, test = [], []
    for part in parts:
        part = np.asarray(part, dtype=np.int64)
        keep = int(np.floor((1 - fraction) * part.size))
        perm = rng.permutation(part)
        train.append(np.sort(perm[:keep]))
        test.append(np.sort(perm[keep:]))
    return train, test


def user_test_split(
    train_parts: Sequence[np.ndarray], train_users: np.ndarray, test_users: np.ndarray
) -> list[np.ndarray]:
    """Per-client test sets of a natural partition: the test samples of the client's own users (LEAF)."""
    train_users, test_users = np.asarray(train_users), np.asarray(test_users)
    out = []
    for part in train_parts:
        mine = np.unique(train_users[np.asarray(part, dtype=np.int64)])
        out.append(np.flatnonzero(np.isin(test_users, mine)).astype(np.int64))
    return out


# ------------------------------------------------------------------------------------------- statistics


def partition_stats(parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int) -> dict[str, object]:
    """Samples per client and the client x class label histogram, plus a few summaries."""
    labels = _check_labels(labels)
    p = Partition.of(parts)
    m = len(p)
    lab = labels[p.indices[p.offsets[0] : p.offsets[-1]]]
    keep = lab < num_classes  # (as before: labels beyond num_classes are not counted)
    client = np.repeat(np.arange(m, dtype=np.int64), p.sizes)  # one bincount for all clients
    hist = np.bincount(client[keep] * num_classes + lab[keep], minlength=m * num_classes).reshape(m, num_classes)
    sizes = hist.sum(axis=1)
    return {
        "num_clients": len(parts),
        "num_samples": int(sizes.sum()),
        "sizes": sizes,
        "histogram": hist,
        "classes_per_client": (hist > 0).sum(axis=1),
        "min_size": int(sizes.min()) if len(parts) else 0,
        "max_size": int(sizes.max()) if len(parts) else 0,
        "mean_size": float(sizes.mean()) if len(parts) else 0.0,
    }


@PARTITIONERS.register("from_file")
@label_free
def from_file(
    labels: np.ndarray,
    num_clients: int | None,
    rng: np.random.Generator,
    *,
    users: np.ndarray | None = None,
    path: str = "",
) -> Partition:
    """Per-client training-set indices read from ``path``: a JSON list of index lists (or an object of them
    keyed "0", "1", ...), or an ``.npz`` with arrays ``client_0``, ``client_1``, ... To match another
    framework's partition exactly. ``num_clients`` 0 (or the file's count) takes every client of the file.
    Indices must be distinct whole numbers inside the training set; samples of no client are left out."""
    import json
    from pathlib import Path

    file = Path(path).expanduser()
    if not path or not file.is_file():
        raise ValueError(f"partition.path must name a JSON or .npz file of per-client index lists, got {path!r}")
    numbers = None  # the clients' numbers in a file that names them (npz keys, JSON object keys)
    try:
        if file.suffix == ".npz":
            with np.load(file, allow_pickle=False) as z:
                keys = sorted((k for k in z.files if k.startswith("client_")), key=lambda k: int(k.split("_")[1]))
                lists = [z[k] for k in keys]
                numbers = [int(k.split("_")[1]) for k in keys]
        else:
            data = json.loads(file.read_text())
            lists = [data[k] for k in sorted(data, key=int)] if isinstance(data, dict) else data
            numbers = sorted(int(k) for k in data) if isinstance(data, dict) else None
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"partition.path {path!r} is not a readable list of index lists ({e})") from e
    if numbers is not None and numbers != list(range(len(numbers))):  # a gap would renumber the later clients
        shown = ", ".join(map(str, numbers[:10])) + (", ..." if len(numbers) > 10 else "")
        raise ValueError(
            f"partition.path {path!r}: clients must be numbered 0 .. {len(numbers) - 1} without gaps, got {shown}"
        )
    if not isinstance(lists, list):  # a bare number, string or null: not a partition
        raise ValueError(
            f"partition.path {path!r} must hold a JSON list of per-client index lists (or an object of them "
            f'keyed "0", "1", ...), got {type(lists).__name__}'
        )
    n = len(labels)
    parts = [_index_list(p, i, n, path) for i, p in enumerate(lists)]
    if not parts:
        raise ValueError(f"partition.path {path!r} holds no clients")
    if num_clients not in (None, 0, len(parts)):
        raise ValueError(f"partition.num_clients is {num_clients} but {path!r} holds {len(parts)} clients (or use 0)")
    flat = np.concatenate(parts)
    if len(np.unique(flat)) != len(flat):
        raise ValueError(f"partition.path {path!r}: a sample is given to more than one client (or twice)")
    return Partition.of([np.sort(p) for p in parts])


def _index_list(entry: object, client: int, n: int, path: str) -> np.ndarray:
    """Client ``client``'s entry of a ``from_file`` partition as int64 indices: a list (or integer array) of
    whole numbers in [0, n). A fractional index (3.7) is refused rather than truncated to another sample, and
    one beyond int64 (2**70) rather than overflowing."""
    where = f"partition.path {path!r}: client {client}"
    if isinstance(entry, np.ndarray):
        if entry.size and entry.dtype.kind not in "iu":
            raise ValueError(f"{where} holds {entry.dtype} indices; indices must be whole numbers in [0, {n - 1}]")
        items = entry.reshape(-1).tolist()
    elif isinstance(entry, list):
        items = entry
    else:
        raise ValueError(f"{where} must be a list of sample indices, got {type(entry).__name__}")
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"{where}: index {i!r} is not a whole number in [0, {n - 1}] (the training set)")
    return np.asarray(items, dtype=np.int64)
