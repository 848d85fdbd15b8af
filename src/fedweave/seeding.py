"""One root seed, many named streams (DESIGN principle 6).

A stream is identified by a name and integer keys, e.g. ``("batches", round, client)``. Its seed depends
only on the root seed and that identity, never on the order in which streams are drawn, so a run is the
same on every backend, with any number of workers, and after a resume.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


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

    def numpy(self, name: str, *keys: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(self.sequence(name, *keys)))

    def torch(self, name: str, *keys: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.int_seed(name, *keys))
        return g
