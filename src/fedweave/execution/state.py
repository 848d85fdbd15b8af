"""Per-client state in stacked tensors with a leading client axis (DESIGN principle 3).

Control variates, personal models, momenta and similar per-client quantities are rows of one tensor per
name, not attributes of per-client objects. Large tables can live in a memory-mapped file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class StateStore:
    """Named tensors of shape ``(num_clients, *shape)``; rows are indexed by client id."""

    def __init__(
        self, num_clients: int, mmap_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self.num_clients = int(num_clients)
        self.dtype = dtype  # the run's precision: the default dtype of every state created here
        self.mmap_dir = Path(mmap_dir) if mmap_dir is not None else None
        self._tensors: dict[str, torch.Tensor] = {}

    def create(
        self,
        name: str,
        shape: tuple[int, ...] | int,
        *,
        dtype: torch.dtype | None = None,
        fill: float | torch.Tensor = 0.0,
        mmap: bool = False,
    ) -> torch.Tensor:
        """Create state ``name`` for every client, filled with ``fill`` (a scalar or a row to repeat)."""
        if name in self._tensors:
            raise ValueError(f"client state {name!r} already exists")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        full = (self.num_clients, *shape)
        dtype = self.dtype if dtype is None else dtype
        if mmap:
            if self.mmap_dir is None:
                raise ValueError(f"client state {name!r}: mmap=True needs a StateStore(mmap_dir=...)")
            self.mmap_dir.mkdir(parents=True, exist_ok=True)
            np_dtype = torch.empty((), dtype=dtype).numpy().dtype
            arr = np.lib.format.open_memmap(self.mmap_dir / f"{name}.npy", mode="w+", dtype=np_dtype, shape=full)
            t = torch.from_numpy(arr)
        else:
            t = torch.empty(full, dtype=dtype)
        # a new memory-mapped file already reads as zeros: writing them would page in the whole table
        if not (mmap and isinstance(fill, (int, float)) and fill == 0):
            t[:] = fill
        self._tensors[name] = t
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no client state {name!r}; have {sorted(self._tensors)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def nbytes(self, name: str | None = None) -> int:
        names = [name] if name else list(self._tensors)
        return sum(self._tensors[n].numel() * self._tensors[n].element_size() for n in names)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            if k in self._tensors:
                self._tensors[k].copy_(v)
            else:
                self._tensors[k] = v.clone()
