"""GT-SVRG (Xin, Khan, Kar, IEEE TSP 2020) adapted to CFL as in the CFL-SAGA paper (§VIII-C, spec B2).

Every ``inner_loop`` (T) iterations, at k = 0, T, 2T, ... (spec §7), the server takes its model as the anchor
tau_i, all its users upload their full local gradients grad f_ij(tau_i), and mu_i = sum_j grad f_ij(tau_i) is
both the estimate of that iteration and the control variate of the next ones. In between, m = SR * P_i
selected users each upload grad f_ij,t(x_i^{k+1}) - grad f_ij,t(tau_i) for one mini-batch t, and
g_i^{k+1} = (S~_i / m) sum_selected (...) + mu_i. The snapshot iteration does the full upload only (spec A19).

Under faults a snapshot needs every user of the server: one that is incomplete (a user dropped out, or the
server missed the round) is discarded and retried at the server's next iteration, so mu_i is always an exact
sum_j grad f_ij(tau_i). Meanwhile the server keeps its estimate g_i^k: stale by one step, an error that
vanishes as the iterates converge (a partial sum of full gradients would not: it stalled GT-SVRG at an
optimality gap near 5e-3). Before its first complete snapshot a server has no control variate and uses the
full gradient re-weighted over the users that reported, (P_i / P'_i) sum_reported grad f_ij(x_i^{k+1}).
Inner iterations re-weight over the m'_i selected users that reported (S~_i / m'_i); with none, the estimate
is the control variate alone.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class GTSVRGHparams(ConfederatedHparams):
    sample_rate: float = 0.15  # SR (paper: 0.15)
    inner_loop: int = 100  # T, not given by the paper (spec A19: tune in {20, 50, 100, 200})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rate("sample_rate", self.sample_rate)
        if self.inner_loop < 1:
            raise ConfigError(f"algorithm.inner_loop must be >= 1, got {self.inner_loop}")
        # T = 1: every iteration is a snapshot (k % 1 == 0), whose full upload selects no users, so SR is never
        # read; a sample_rate set to other than its default is refused, never ignored (one written out as the
        # default, 0.15, is not: the config cannot be told from one that leaves it out)
        if self.inner_loop == 1 and self.sample_rate != GTSVRGHparams.sample_rate:
            raise ConfigError(
                f"algorithm.sample_rate: with inner_loop 1 every iteration is a snapshot (all users upload their "
                f"full gradients), so no users are selected and sample_rate ({self.sample_rate:g}) is never read; "
                "leave it out or set inner_loop >= 2"
            )


@ALGORITHMS.register("gt_svrg")
class GTSVRG(ConfederatedAlgorithm):
    name = "gt_svrg"
    Hparams = GTSVRGHparams
    state_fields = (*ConfederatedAlgorithm.state_fields, "anchor", "mu", "due", "anchored")
    recursive = False  # GT-SARAH: the inner estimate is anchored at x^k and g^k instead of tau_i and mu_i

    def __init__(self, ctx: RunContext, hp: GTSVRGHparams) -> None:
        super().__init__(ctx, hp)
        pb = self.problem
        self.m = users_per_iteration(hp.sample_rate, pb.P)
        dev = self.device
        self.anchor = torch.zeros(pb.N, pb.d, dtype=torch.float64, device=dev)  # tau_i
        self.mu = torch.zeros(pb.N, pb.d, dtype=torch.float64, device=dev)  # sum_j grad f_ij(tau_i)
        self.due = torch.zeros(pb.N, dtype=torch.bool, device=dev)  # a snapshot not yet completed (faults only)
        self.anchored = torch.zeros(pb.N, dtype=torch.bool, device=dev)  # a snapshot has completed once (faults only)

    def draws_users(self, hp: GTSVRGHparams) -> str | None:
        if hp.inner_loop == 1:  # every iteration a snapshot: all users upload, none is selected
            return "with inner_loop 1 draws no users (every iteration is a snapshot: all users upload)"
        return None

    def hold_state(self) -> None:
        super().hold_state()
        if not self.recursive:  # tau_i and mu_i at the server; a user keeps tau_i (an inner iteration sends x only)
            self.ledger.store("edge", "anchor_control", 2 * self.vector_bytes)
            self.ledger.store("user", "anchor", self.vector_bytes)

    def snapshot(self, r: int, x_new: torch.Tensor) -> torch.Tensor:
        """All users upload grad f_ij(x_i^{k+1}); returns g_i^{k+1} = sum_j grad f_ij(x_i^{k+1})."""
        pb = self.problem
        self.net.broadcast(r, "model", pb.N * pb.P, self.vector_bytes)
        self.upload(r, "full_gradient", pb.N * pb.P)
        return self.problem.server_grad(x_new)

    def estimate(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        if self.user_on is not None:
            return self.estimate_under_faults(r, k, x_new, x_old)
        if k % self.hp.inner_loop == 0:
            self.anchor, self.mu = x_new.clone(), self.snapshot(r, x_new)
            return self.mu
        pb = self.problem
        users = self.select_users(k, self.m)
        idx = pb.batch_index(users, self.draw_batches(k).gather(1, users))
        self.net.broadcast(r, "model", pb.N * self.m, self.vector_bytes)  # the users kept tau_i from the snapshot
        diff = pb.batch_grad(x_new, idx) - pb.batch_grad(self.anchor, idx)
        self.upload(r, "svrg_difference", pb.N * self.m)
        return (pb.P * pb.S / self.m) * diff.sum(1) + self.mu

    def estimate_under_faults(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        """The estimate with this round's faults: snapshots complete only with every user (see the module doc)."""
        pb, on_s, on_u, vb = self.problem, self.server_on, self.user_on, self.vector_bytes
        if k % self.hp.inner_loop == 0:
            self.due[:] = True
        snap = self.due & on_s  # servers asking all their users for full gradients
        g = self.G.clone()  # rows of servers that are down are replaced by G in ``step`` anyway
        if bool(snap.any()):
            n = int(snap.sum())
            self.net.broadcast(r, "model", n * pb.P, vb)
            got = on_u & snap[:, None]
            self.upload(r, "full_gradient", int(got.sum()))
            full = pb.user_grad(x_new)  # grad f_ij(x_i^{k+1}), (N, P, d)
            done = snap & got.all(1)
            count = got.sum(1, keepdim=True).to(full.dtype)
            partial = (pb.P / count.clamp_min(1)) * (full * got[..., None]).sum(1)
            first = snap & got.any(1) & ~self.anchored  # no control variate yet: the re-weighted partial sum
            g = torch.where(first[:, None], partial, g)
            exact = full.sum(1)
            g = torch.where(done[:, None], exact, g)
            if not self.recursive:
                self.anchor = torch.where(done[:, None], x_new, self.anchor)
                self.mu = torch.where(done[:, None], exact, self.mu)
            self.due &= ~done
            self.anchored |= done
        inner = on_s & ~snap
        if bool(inner.any()):
            users = self.select_users(k, self.m)
            idx = pb.batch_index(users, self.draw_batches(k).gather(1, users))
            n = int(inner.sum())
            if self.recursive:
                self.net.broadcast(r, "model_and_previous", n * self.m, 2 * vb)
            else:
                self.net.broadcast(r, "model", n * self.m, vb)
            sel = on_u.gather(1, users) & inner[:, None]
            ref = x_old if self.recursive else self.anchor
            diff = (pb.batch_grad(x_new, idx) - pb.batch_grad(ref, idx)) * sel[..., None]
            self.upload(r, "sarah_difference" if self.recursive else "svrg_difference", int(sel.sum()))
            count = sel.sum(1, keepdim=True).to(diff.dtype)
            base = self.G if self.recursive else self.mu
            est = (pb.P * pb.S / count.clamp_min(1)) * diff.sum(1) + base  # m'_i = 0: the control variate
            g = torch.where(inner[:, None], est, g)
        return g
