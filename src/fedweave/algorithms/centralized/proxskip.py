"""Scaffnew, ProxSkip for federated learning (Mishchenko, Malinovsky, Stich, Richtárik, ICML 2022, Alg. 2).

Every local step of every client is a gradient step shifted by its control variate, and after each step the
clients communicate with probability p (one coin for all):
  x^_i = x_i - gamma (g_i(x_i) - h_i)                                            (Alg. 2, the local step)
  with probability p: x_i = (1/n) sum_j x^_j and h_i = h_i + (p/gamma)(x_i - x^_i)   (communicate, then shift)
  otherwise:          x_i = x^_i (h_i unchanged)
The control variates start at 0 and keep summing to 0, so the average of the shifted models ``x^_j -
(gamma/p) h_j`` that the prox step takes is the plain average. A round here is the run of local steps up to a
communication: its length K_r is drawn from Geometric(p) (the ``("local_steps", round)`` stream), every client
takes K_r steps from the global model, and the server averages. The local steps run at the round's local
learning rate (gamma), and h_i's update reads it; with a constant rate Scaffnew converges to the exact optimum
of (1/n) sum_i f_i with deterministic gradients, where FedAvg's local steps drift. It needs every client in every
round (``clients_per_round`` = the number of clients), equal weights and the plain average as the server step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, per_job
from fedweave.config import MAX_LOCAL_STEPS, ConfigError
from fedweave.execution import LocalRule, StateStore
from fedweave.execution.local import GradFn
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, RULES


@RULES.register("proxskip")
class ShiftedGradient(LocalRule):
    """Direction ``g_i(w) - h_i`` (Alg. 2's local step), ``h`` one row per job."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        return grad(w) - per_job(self.h, jobs)


@dataclass
class ProxSkipHparams(StarHparams):
    p: float = 0.2  # the probability of communicating after a local step: 1/p local steps a round on average
    weighting: Literal["samples", "uniform"] = "uniform"  # the average of Alg. 2 (f = (1/n) sum_i f_i)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.p <= 1:
            raise ConfigError(f"algorithm.p must be in (0, 1], got {self.p}")
        if self.p < 1 / MAX_LOCAL_STEPS:  # p = 1e-300 drew 2^63 - 1 local steps: the round never ended
            raise ConfigError(
                f"algorithm.p must be >= {1 / MAX_LOCAL_STEPS:g}: a round takes 1/p local steps on average, and "
                f"local.steps is at most {MAX_LOCAL_STEPS:,} (a larger value runs for days); got {self.p:g}"
            )
        if self.weighting != "uniform":
            raise ConfigError(
                "algorithm.weighting: proxskip averages with equal weights (its h_i sum to 0); use uniform"
            )
        if self.server_lr != 1.0:
            raise ConfigError("algorithm.server_lr: proxskip's server step is the average itself; leave it at 1")


@ALGORITHMS.register("proxskip")
class ProxSkip(StarAlgorithm):
    name = "proxskip"
    Hparams = ProxSkipHparams
    step_sizes = ()  # server_lr must stay 1: the server step is the average itself
    undeployable = "its clients' control variates are updated from the average in the simulation's state store"
    handles_faults: tuple[str, ...] = ()  # a client that misses a communication breaks sum_i h_i = 0
    robust_aggregation = False
    compresses_uploads = False
    dp_refusal = "its control variates are built from the clients' unclipped, unnoised models"
    every_client = "communicates with every client"

    def __init__(self, ctx, hp: ProxSkipHparams) -> None:
        local = ctx.config.local
        if local.steps is not None or local.epochs != 1 or local.momentum:
            raise ConfigError(
                "local: proxskip draws each round's number of local steps from Geometric(algorithm.p) and steps "
                "without momentum; leave local.steps, local.epochs and local.momentum out"
            )
        super().__init__(ctx, hp)
        empty = np.flatnonzero(self.sizes.cpu().numpy() == 0)
        # a client without data takes no local step, so its x^_i is the model it was sent, not Alg. 2's steps on its
        # shifted gradient -h_i: its h_i drifts and the average stalls (0.46 relative error on a least-squares toy)
        if len(empty):
            raise ConfigError(
                f"partition: proxskip steps every client on its own data, but {len(empty)} client(s) (client "
                f"{empty[0]} first) hold no training sample; set partition.min_size to 1 or more"
            )
        self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("h", self.num_params)  # h_i = 0: they sum to 0
        self.ledger.store("client", "control_variate", nbytes(self.x))  # per client

    def local_steps(self, r: int) -> int:
        """K_r ~ Geometric(p): the local steps of round r up to and including the one after which the coin
        says communicate."""
        return int(self.seeds.numpy("local_steps", r).geometric(self.hp.p))

    def client_steps(self, r: int, clients: np.ndarray) -> np.ndarray:
        """Every client takes the round's K_r steps, whatever its data."""
        return np.full(len(clients), float(self.local_steps(r)))

    def relative_work(self, steps: np.ndarray) -> np.ndarray:
        """K_r over its mean 1/p: K_r p (a product, as the clock has always computed it; K_r / (1/p) can differ
        in the last bit)."""
        return steps * self.hp.p

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        lr, steps = self.trainer.lr(r), self.local_steps(r)
        rule = ShiftedGradient(self.store.rows("h", clients))
        local = self.trainer.train(self.x, clients, r, rule=rule, lr=lr, steps=steps)  # x^_i after K_r steps
        return Collected(r, clients, lr, local, {}, self.weights(clients))

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + mean  # (1/n) sum_j x^_j
        h = self.store.rows("h", got.clients)  # each client, given the average: h_i + (p/gamma)(x - x^_i)
        self.store.set_rows("h", got.clients, h + (self.hp.p / got.lr) * (self.x - got.local.params))

    def local_metrics(self, local, p) -> dict[str, float]:
        return {**super().local_metrics(local, p), "local_steps": float(local.steps.max())}
