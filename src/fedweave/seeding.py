"""One root seed, many named streams (DESIGN principle 6).

A stream is identified by a name and integer keys, e.g. ``("batches", round, client)``. Its seed depends
only on the root seed and that identity, never on the order in which streams are drawn, so a run is the
same on every backend, with any number of workers, and after a resume.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import torch


@functools.lru_cache(maxsize=256)
def _name_key(name: str) -> int:
    # A stable hash (Python's hash() is salted per process).
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


class Seeds:
    """Derives independent, reproducible random streams from one root seed."""

    def __init__(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or root < 0:
            raise ValueError(f"seed must be a non-negative integer, got {root!r}")
        self.root = int(root)

    def sequence(self, name: str, *keys: int) -> np.random.SeedSequence:
        # a negative key (round -1: the initial model's evaluation) gets a stream of its own: 2**64 + key
        keys = tuple(int(k) if k >= 0 else (1 << 64) + int(k) for k in keys)
        return np.random.SeedSequence(self.root, spawn_key=(_name_key(name), *keys))

    def int_seed(self, name: str, *keys: int) -> int:
        """A 63-bit integer seed for the stream (for libraries that take an int)."""
        return int(self.sequence(name, *keys).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))

    def int_seeds(self, name: str, keys: Sequence[tuple[int, ...]]) -> list[int]:
        """``[int_seed(name, *k) for k in keys]``, computed for all the keys at once: numpy's ``SeedSequence``
        hashing (``_seed_sequence_states``) with each entropy word that differs between the keys as an array,
        one operation for every key, instead of one ``SeedSequence`` each (19 us a key: 8 % of the CPU time of
        a cross-device logistic round of 50 clients, docs/performance.md)."""
        if not keys:
            return []
        columns = list(zip(*keys))
        if len({len(k) for k in keys}) > 1 or not all(0 <= v <= _MASK for col in columns for v in col):
            return [self.int_seed(name, *k) for k in keys]  # keys of other word lengths: one at a time
        entropy = [*_words((self.root, _name_key(name)))]  # the words every key shares ...
        for col in columns:  # ... and one word per key position: a number where all keys agree, else an array
            first = col[0]
            entropy.append(first if col.count(first) == len(col) else np.array(col, dtype=np.uint32))
        state = _seed_sequence_states(entropy)
        if isinstance(state, int):  # every key the same
            return [state >> 1] * len(keys)
        return (state >> np.uint64(1)).tolist()

    def torches(self, name: str, keys: Sequence[tuple[int, ...]]) -> list[torch.Generator]:
        """``[torch(name, *k) for k in keys]``, with the seeds derived all at once (:meth:`int_seeds`)."""
        out = []
        for seed in self.int_seeds(name, keys):
            g = torch.Generator()
            g.manual_seed(seed)
            out.append(g)
        return out

    def numpy(self, name: str, *keys: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(self.sequence(name, *keys)))

    def torch(self, name: str, *keys: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.int_seed(name, *keys))
        return g


# numpy's SeedSequence (numpy/random/bit_generator.pyx), pool size 4, on a batch of entropies at once
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _MASK = 0xCA01F9DD, 0x4973F715, 0xFFFFFFFF


def _words(keys: tuple[int, ...]) -> list[int]:
    """The entropy words ``SeedSequence(root, spawn_key=keys[1:])`` hashes for ``keys = (root, *spawn_key)``:
    each integer as little-endian 32-bit words (0 as one word), the root's padded with zeros to the pool size,
    negative keys as ``2**64 + key`` (``Seeds.sequence``)."""

    def split(k: int) -> list[int]:
        out = [k & _MASK]
        while k > _MASK:
            k >>= 32
            out.append(k & _MASK)
        return out

    root = split(keys[0])
    spawn = [w for k in keys[1:] for w in split(int(k) if k >= 0 else (1 << 64) + int(k))]
    return root + [0] * (4 - len(root)) + spawn


def _seed_sequence_states(entropy: list) -> int | np.ndarray:
    """``SeedSequence.generate_state(1, np.uint64)[0]`` of the entropy words ``entropy`` (at least 4, the pool
    size), each word a number or a uint32 array of one word per key: the same mixing as numpy's, on numbers
    where the words are the same for all keys and on arrays (one operation for all keys) where they differ.
    Returns a number, or a uint64 array of one state per key."""
    const = _INIT_A

    def mul(a, c: int):
        return (a * c) & _MASK if isinstance(a, int) else a * np.uint32(c)  # uint32 arrays wrap by themselves

    def hashmix(v):
        nonlocal const
        v = mul(v ^ const, c := (const * _MULT_A) & _MASK)
        const = c
        return v ^ (v >> 16)

    def mix(x, y):
        r = mul(x, _MIX_L) - mul(y, _MIX_R)  # a number and an array: the array's uint32 arithmetic
        if isinstance(r, int):
            r &= _MASK
        return r ^ (r >> 16)

    pool = [hashmix(entropy[i]) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    const, words = _INIT_B, []
    for i in range(2):  # two 32-bit words make the 64-bit state
        v = mul(pool[i] ^ const, c := (const * _MULT_B) & _MASK)
        const = c
        words.append(v ^ (v >> 16))
    if all(isinstance(w, int) for w in words):
        return words[0] | (words[1] << 32)
    lo, hi = (np.asarray(w, dtype=np.uint32).astype(np.uint64) for w in words)
    return lo | (hi << np.uint64(32))
