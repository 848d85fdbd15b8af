"""The star topology: one server, many clients, partial participation (the centralized family's base).

The server samples ``clients_per_round`` clients uniformly without replacement from the
``("client_sampling", round)`` stream, sends them what the algorithm says, receives their uploads and
aggregates. Every transfer is recorded in the ledger with its exact size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.base import Algorithm, RunContext
from fedweave.config import ConfigError
from fedweave.execution import LocalTrainer, ParamLayout, choose_backend, evaluate, evaluate_clients


@dataclass
class StarHparams:
    clients_per_round: int = 10
    weighting: Literal["samples", "uniform"] = "samples"  # aggregation weights over the round's clients
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        if self.clients_per_round < 1:
            raise ConfigError(f"algorithm.clients_per_round must be >= 1, got {self.clients_per_round}")
        if self.server_lr <= 0:
            raise ConfigError(f"algorithm.server_lr must be > 0, got {self.server_lr}")


def make_trainer(ctx: RunContext, jobs_per_call: int) -> LocalTrainer:
    """The local trainer of a run: its data, partition, local config, augmentation and backend."""
    cfg = ctx.config
    augment = None
    if cfg.local.augment:
        from fedweave.data.augment import build_augment

        augment = build_augment(list(cfg.local.augment))
    ds = ctx.dataset
    backend = choose_backend(cfg.backend, ctx.model, jobs_per_call)
    return LocalTrainer(
        ctx.model, ds.train_x, ds.train_y, ctx.partition, cfg.local, ctx.seeds, backend=backend, augment=augment
    )


class StarAlgorithm(Algorithm):
    """Shared mechanics of server-client algorithms: sampling, messages, weights, global evaluation."""

    family = "centralized"
    Hparams = StarHparams

    def __init__(self, ctx: RunContext, hp: StarHparams) -> None:
        super().__init__(ctx, hp)
        n = ctx.num_clients
        if hp.clients_per_round > n:
            raise ConfigError(
                f"algorithm.clients_per_round ({hp.clients_per_round}) exceeds partition.num_clients ({n})"
            )
        self.trainer = make_trainer(ctx, hp.clients_per_round)
        self.layout: ParamLayout = self.trainer.layout
        self.x = self.layout.flatten()  # the global model x_t
        self.sizes = torch.tensor([len(p) for p in ctx.partition], dtype=torch.float32)
        self._checkpoint = ("x",)

    @property
    def num_params(self) -> int:
        return self.layout.numel

    def sample_clients(self, r: int) -> np.ndarray:
        rng = self.seeds.numpy("client_sampling", r)
        return np.sort(rng.choice(self.ctx.num_clients, self.hp.clients_per_round, replace=False))

    def weights(self, clients: np.ndarray) -> torch.Tensor:
        """Aggregation weights of the round's clients, summing to one."""
        w = self.sizes[clients] if self.hp.weighting == "samples" else torch.ones(len(clients))
        return w / w.sum()

    def send(self, r: int, clients: np.ndarray, kind: str, *per_client: torch.Tensor) -> None:
        """Server -> each client of ``clients``: the given tensors (their size is per client)."""
        self.ledger.record(r, "server", "client", kind, len(clients) * _size(per_client), len(clients))

    def receive(self, r: int, clients: np.ndarray, kind: str, *per_client: torch.Tensor) -> None:
        """Each client of ``clients`` -> server: the given tensors (their size is per client)."""
        self.ledger.record(r, "client", "server", kind, len(clients) * _size(per_client), len(clients))

    def evaluate(self, r: int) -> dict[str, float]:
        ds, ev = self.ctx.dataset, self.config.eval
        acc, loss = evaluate(self.layout, self.x, ds.test_x, ds.test_y, ev.batch_size)
        out = {"test_accuracy": acc, "test_loss": loss}
        if ev.per_client:
            accs, _ = evaluate_clients(self.layout, self.x, ds.train_x, ds.train_y, self.ctx.partition, ev.batch_size)
            out["client_train_accuracy_mean"] = float(accs.mean())
        return out


def _size(tensors: tuple[torch.Tensor, ...]) -> int:
    # one client's message; a tensor with a leading client axis counts one row
    return sum((t[0] if t.dim() == 2 else t).numel() * t.element_size() for t in tensors)
