"""GT-SAGA (Xin, Khan, Kar, IEEE TSP 2020) and its CFL adaptation with random user selection.

``mode="cfl"`` is the CFL-SAGA paper's Algorithm 2: each server selects m = SR * P_i users uniformly
without replacement; each selected user draws a mini-batch t, uploads g~_ij = grad f_ij,t(x_i^{k+1}) -
grad f_ij,t(phi_ij,t) (eq. 10) and refreshes that table entry; the server forms
g_i^{k+1} = (S~_i / m) sum_selected g~_ij + g_i,sum (eq. 11) and g_i,sum += sum_selected g~_ij (eq. 12).

``mode="decentralized"`` is Algorithm 1 (single level): each server is a node that holds its S~_i mini-batches
itself and draws one uniformly (eq. 8); nothing is uploaded by users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.confederated.base import (
    ConfederatedAlgorithm,
    ConfederatedHparams,
    check_rate,
    users_per_iteration,
)
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class GTSAGAHparams(ConfederatedHparams):
    sample_rate: float = 0.15  # SR: fraction of each server's users selected per iteration (paper: 0.05..0.45)
    mode: Literal["cfl", "decentralized"] = "cfl"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rate("sample_rate", self.sample_rate)
        if self.mode == "decentralized" and self.sample_rate != GTSAGAHparams.sample_rate:
            raise ConfigError(
                "algorithm.sample_rate: gt_saga with mode 'decentralized' selects no users (Algorithm 1: each server "
                "draws one of its own mini-batches); leave it out or use mode 'cfl'"
            )


@ALGORITHMS.register("gt_saga")
class GTSAGA(ConfederatedAlgorithm):
    name = "gt_saga"
    Hparams = GTSAGAHparams
    state_fields = (*ConfederatedAlgorithm.state_fields, "table", "table_sum")

    def __init__(self, ctx: RunContext, hp: GTSAGAHparams) -> None:
        super().__init__(ctx, hp)
        pb = self.problem
        self.m = users_per_iteration(hp.sample_rate, pb.P) if hp.mode == "cfl" else 1
        dev = self.device
        self.table = torch.zeros(pb.N * pb.P * pb.S, pb.d, dtype=torch.float64, device=dev)  # entries 0 (spec A4)
        self.table_sum = torch.zeros(pb.N, pb.d, dtype=torch.float64, device=dev)  # g_i,sum, held by the server
        self.ledger.store("user", "saga_table", pb.S * self.vector_bytes)
        if hp.mode == "decentralized" and "dropout" in self.faults.active():
            raise ConfigError(
                "faults.dropout / faults.outage_rounds: gt_saga with algorithm.mode 'decentralized' has no users "
                "to drop out (use faults.server_miss, or mode 'cfl')"
            )

    def draws_users(self, hp: GTSAGAHparams) -> str | None:
        if hp.mode == "decentralized":
            return "with mode 'decentralized' draws no users (Algorithm 1: each server draws one of its mini-batches)"
        return None

    def taking_part(self) -> int:
        if self.hp.mode == "decentralized":  # single level: the servers are the nodes
            return int(self.server_on.sum())
        return super().taking_part()

    def estimate(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        pb = self.problem
        if self.hp.mode == "cfl":
            users = self.select_users(k, self.m)
            t = self.draw_batches(k).gather(1, users)
            self.broadcast(r, "model", self.m, self.vector_bytes)
        else:  # one of the server's S~_i = P S mini-batches, uniformly (Algorithm 1)
            pick = torch.from_numpy(self.seeds.numpy("batches", k).integers(pb.P * pb.S, size=(pb.N, 1))).to(
                self.device
            )
            users, t = pick // pb.S, pick % pb.S
        idx = pb.batch_index(users, t)
        grad = pb.batch_grad(x_new, idx)
        flat = idx.reshape(-1)
        diff = grad - self.table.index_select(0, flat).view_as(grad)  # eq. (10)
        if self.user_on is None:
            self.table.index_copy_(0, flat, grad.reshape(-1, pb.d))  # phi_ij,t <- x_i^{k+1}, selected users only
            g_new = (pb.P * pb.S / self.m) * diff.sum(1) + self.table_sum  # eq. (11), S~_i = P S
            arrived = pb.N * self.m
        else:  # only what arrives: eq. (11) re-weighted over the m'_i selected users that reported
            on = self.user_on.gather(1, users) if self.hp.mode == "cfl" else self.server_on[:, None]
            diff = diff * on[..., None]
            keep = on.reshape(-1)
            self.table.index_copy_(0, flat[keep], grad.reshape(-1, pb.d)[keep])  # a dropped user keeps its table
            got = on.sum(1, keepdim=True).to(diff.dtype)
            g_new = (pb.P * pb.S / got.clamp_min(1)) * diff.sum(1) + self.table_sum  # m'_i = 0: the table's sum
            arrived = int(on.sum())
        self.table_sum += diff.sum(1)  # eq. (12)
        if self.hp.mode == "cfl":
            self.upload(r, "saga_difference", arrived)
        return g_new
