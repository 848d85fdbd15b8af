"""The in-memory form every dataset loader returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Dataset:
    """Train/test tensors of one dataset, ready for training.

    ``train_x``/``test_x``: float32 features ``(N, *input_shape)`` (images as C,H,W, normalized) or int64
    token ids for text; ``train_y``/``test_y``: int64 labels ``(N,)``. ``train_users``/``test_users`` hold the
    natural owner of each sample (Shakespeare role, LEAF writer) when the data are naturally federated.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    train_users: np.ndarray | None = None
    test_users: np.ndarray | None = None

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            for key, t in ((f"{split}_x", x), (f"{split}_y", y)):
                if not isinstance(t, torch.Tensor):  # a NumPy array fails far from here, on its missing .device
                    raise ValueError(
                        f"dataset {self.name!r}: {key} must be a torch.Tensor, got {type(t).__name__} "
                        "(torch.as_tensor converts an array)"
                    )
            if len(x) != len(y):
                raise ValueError(f"dataset {self.name!r}: {split}_x has {len(x)} rows but {split}_y has {len(y)}")
            if not (y.dtype == torch.int64 or y.is_floating_point()):
                # uint8 labels passed the loss's check (cross-entropy takes Byte) and ended in round 1 in an
                # index_select's RuntimeError; int32 and bool were named by the loss, as its dtype, not the data's
                raise ValueError(
                    f"dataset {self.name!r}: {split}_y holds {y.dtype} values; class labels are int64 (.long() "
                    "converts them), regression or multi-label targets floating point"
                )
            users = getattr(self, f"{split}_users")
            # one user id per sample: a shorter or longer list would give a natural partition's clients (and
            # their per-client test sets) other samples than their users', with no error
            if users is not None and len(users) != len(x):
                raise ValueError(
                    f"dataset {self.name!r}: {split}_users has {len(users)} ids but {split}_x has {len(x)} rows "
                    "(one user id per sample)"
                )
            if tuple(x.shape[1:]) != tuple(self.input_shape):
                raise ValueError(
                    f"dataset {self.name!r}: {split}_x rows have shape {tuple(x.shape[1:])}, "
                    f"expected input_shape {tuple(self.input_shape)}"
                )

    @property
    def num_train(self) -> int:
        return len(self.train_y)
