"""CFL-SAGA with conditionally-triggered user selection (Wang, Fang, Li, Eldar, 2024; Algorithm 3).

Every user computes a SAGA estimate at every iteration and refreshes one table entry (eq. 16, spec A3);
it uploads the innovation Delta_ij = g_ij^{k+1} - g^_ij only if ||Delta_ij||^2 > rho e_i^{k+1}, where
e_i^{k+1} = ||sum_i' w_ii' x_i'^{k+1} - x_i^{k+1}||^2 is broadcast by its server (eq. 17). The server sums
the copies it holds (eq. 18). ``g^_ij`` is the user's last *uploaded* estimate, i.e. the server's copy
(spec A2, LAG semantics, the reading the proof's eq. 73 needs); ``trigger="drift"`` is the other reading
(Delta against the previous fresh estimate), kept as an ablation: it does not converge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.confederated.base import ConfederatedAlgorithm, ConfederatedHparams
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS


@dataclass
class CFLSAGAHparams(ConfederatedHparams):
    rho: float = 10.0  # trigger threshold (paper: 0..50, 10 in Figs. 4-7); its scale depends on the data (A1)
    trigger: Literal["lag", "drift"] = "lag"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rho < 0:
            raise ConfigError(f"algorithm.rho must be >= 0, got {self.rho}")


@ALGORITHMS.register("cfl_saga")
class CFLSAGA(ConfederatedAlgorithm):
    name = "cfl_saga"
    Hparams = CFLSAGAHparams
    state_fields = (*ConfederatedAlgorithm.state_fields, "table", "table_sum", "held", "ref")

    def __init__(self, ctx: RunContext, hp: CFLSAGAHparams) -> None:
        super().__init__(ctx, hp)
        pb = self.problem
        z = torch.zeros(pb.N, pb.P, pb.d, dtype=torch.float64, device=self.device)
        self.table = torch.zeros(
            pb.N * pb.P * pb.S, pb.d, dtype=torch.float64, device=self.device
        )  # grad f_ij,t(phi_ij,t); entries 0 (A4)
        self.table_sum = z.clone()  # sum_t of the table
        self.held = z.clone()  # the server's copy of each user's estimate (g^_ij)
        self.ref = z.clone() if hp.trigger == "drift" else self.held  # what Delta is measured against
        self.last_ratio_median = float("nan")
        self.ledger.store("user", "saga_table", (pb.S + 2) * self.vector_bytes)

    def draws_users(self, hp: CFLSAGAHparams) -> str | None:
        return "draws no users: every user checks its trigger (17) at every iteration"

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.hp.trigger == "lag":
            self.ref = self.held

    def estimate(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        pb, users, on = self.problem, self._all_users, self.user_on  # on: None without faults
        self.broadcast(r, "model", pb.P, self.vector_bytes)
        e = ((self.mix(x_new) - x_new) ** 2).sum(1)  # step 2: e_i^{k+1}, a scalar per server (W_r under faults)
        self.broadcast(r, "trigger_threshold", pb.P, x_new.element_size())
        idx = pb.batch_index(users, self.draw_batches(k))
        grad = pb.batch_grad(x_new, idx)  # grad f_ij,t(x_i^{k+1})
        flat = idx.reshape(-1)
        diff = grad - self.table.index_select(0, flat).view_as(grad)
        if on is not None:  # a user that drops out computes nothing: its table and copy stay as they are
            diff = diff * on[..., None]
        fresh = pb.S * diff + self.table_sum  # eq. (16)
        self.table_sum += diff
        if on is None:
            self.table.index_copy_(0, flat, grad.reshape(-1, pb.d))  # phi_ij,t <- x_i^{k+1} for every user (A3)
        else:
            keep = on.reshape(-1)
            self.table.index_copy_(0, flat[keep], grad.reshape(-1, pb.d)[keep])
        delta = fresh - self.ref
        lhs = (delta**2).sum(-1)
        fire = lhs > self.hp.rho * e[:, None]  # eq. (17), strict
        if on is not None:
            fire &= on  # the trigger sees no new estimate of a user that dropped out
        if self.hp.trigger == "lag":
            self.held.copy_(torch.where(fire[..., None], fresh, self.held))  # g^_ij <- g_ij^{k+1} on upload
        else:
            self.held += delta * fire[..., None]
            self.ref = fresh if on is None else torch.where(on[..., None], fresh, self.ref)
        self.upload(r, "vr_gradient_innovation", int(fire.sum()))
        ratio = lhs / e[:, None]
        if on is None:
            ok = bool(e.gt(0).all())
        else:
            ratio, ok = ratio[on], bool(e[on.any(1)].gt(0).all())
        self.last_ratio_median = float(ratio.median()) if ok and ratio.numel() else float("nan")
        return self.held.sum(1)  # eq. (18): g_i^{k+1} = sum_j of the held copies

    def run_round(self, r: int) -> dict[str, float]:
        self.last_ratio_median = float("nan")  # a round skipped under faults checks no trigger: it reports none
        out = super().run_round(r)
        out["upload_fraction"] = out["uploads_per_iteration"] / self.net.num_users
        if self.last_ratio_median == self.last_ratio_median:  # finite: e_i > 0 on every server
            out["trigger_ratio_median"] = self.last_ratio_median  # median ||Delta||^2 / e (calibrates rho, A1)
        return out
