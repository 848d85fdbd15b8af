"""Per-client state in stacked tensors with a leading client axis (DESIGN principle 3).

Control variates, personal models, momenta and similar per-client quantities are rows of one tensor per
name, not attributes of per-client objects. A table lives on the run's device when it fits in
``memory.state_fraction`` of the free device memory; otherwise in host memory (pinned, or a memory-mapped
file), and :meth:`StateStore.rows` / :meth:`StateStore.set_rows` move only the rows a round uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedweave.execution.placement import CPU, Placement


class StateStore:
    """Named tensors of shape ``(num_clients, *shape)``; rows are indexed by client id.

    ``dtype`` is the default dtype of the states made here (the placement's: the run's precision);
    ``placement`` says which device a state goes to when it fits; ``mmap_dir`` is where a state created
    with ``mmap=True`` is kept as a memory-mapped ``.npy`` file.
    """

    def __init__(
        self,
        num_clients: int,
        mmap_dir: str | Path | None = None,
        dtype: torch.dtype | None = None,
        placement: Placement = CPU,
    ) -> None:
        self.num_clients = int(num_clients)
        self.placement = placement
        self.dtype = placement.dtype if dtype is None else dtype  # the default dtype of every state made here
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
        on_device: bool = False,
    ) -> torch.Tensor:
        """Create state ``name`` for every client, filled with ``fill`` (a scalar or a row to repeat). It is
        placed on the device when it fits (``on_device``: always, for state every round reads whole)."""
        if name in self._tensors:
            raise ValueError(f"client state {name!r} already exists")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        full = (self.num_clients, *shape)
        dtype = self.dtype if dtype is None else dtype
        if mmap:
            if self.mmap_dir is None:
                raise ValueError(f"client state {name!r}: mmap=True needs a StateStore(mmap_dir=...)")
            self.mmap_dir.mkdir(parents=True, exist_ok=True)
            np_dtype = torch.empty((), dtype=dtype, device="cpu").numpy().dtype
            arr = np.lib.format.open_memmap(self.mmap_dir / f"{name}.npy", mode="w+", dtype=np_dtype, shape=full)
            t = torch.from_numpy(arr)
        else:
            nbytes = int(np.prod(full)) * torch.empty((), dtype=dtype, device="cpu").element_size()
            device = self.placement.device if on_device else self.placement.state_device(nbytes)
            t = torch.empty(full, dtype=dtype, device=device)
            if t.device.type == "cpu":
                t = self.placement.pinned(t)  # rows copy to the device without blocking
        # a new memory-mapped file already reads as zeros: writing them would page in the whole table
        if not (mmap and isinstance(fill, (int, float)) and fill == 0):
            t[:] = fill.to(t.device) if isinstance(fill, torch.Tensor) else fill
        self._tensors[name] = t
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(
                f"no client state {name!r}; have {sorted(self._tensors)} (create it when the algorithm is built: "
                f"store.create({name!r}, size))"
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def rows(self, name: str, clients: Any) -> torch.Tensor:
        """The rows of ``clients`` (ids: an array, a list or a tensor), on the run's device."""
        t = self[name]
        idx = torch.as_tensor(clients, dtype=torch.long, device=t.device)
        return self.placement.to(t[idx])

    def set_rows(self, name: str, clients: Any, value: torch.Tensor) -> None:
        """Write ``value`` (one row per client of ``clients``) into state ``name``, wherever it lives."""
        t = self[name]
        if value.shape != (len(clients), *t.shape[1:]):  # a row of another size would fail in an index assignment
            raise ValueError(
                f"client state {name!r}: {len(clients)} rows of shape {tuple(t.shape[1:])} expected, got a tensor of "
                f"shape {tuple(value.shape)}"
            )
        idx = torch.as_tensor(clients, dtype=torch.long, device=t.device)
        t[idx] = value.to(t.device)

    def nbytes(self, name: str | None = None) -> int:
        """The bytes held by state ``name``, or by every state when ``name`` is None."""
        names = [name] if name else list(self._tensors)
        return sum(self._tensors[n].numel() * self._tensors[n].element_size() for n in names)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of every state tensor by name (for a checkpoint)."""
        return {k: v.clone() for k, v in self._tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the states of :meth:`state_dict`: copied into the existing tensors, a state not created yet
        is placed on the store's device."""
        for k, v in state.items():
            if k in self._tensors:
                self._tensors[k].copy_(v)
            else:
                self._tensors[k] = v.to(self.placement.device, copy=True)
