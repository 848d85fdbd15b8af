"""GT-SARAH (Xin, Khan, Kar, SIAM J. Optim. 2022) adapted to CFL as in the CFL-SAGA paper (spec B3).

Same outer loop and full upload as GT-SVRG; the inner iterations use the recursive estimator
g_i^{k+1} = (S~_i / m) sum_selected [grad f_ij,t(x_i^{k+1}) - grad f_ij,t(x_i^k)] + g_i^k.
A selected user needs x_i^{k+1} and x_i^k, so the server sends both.
"""

from __future__ import annotations

import torch

from fedweave.algorithms.confederated.base import ConfederatedAlgorithm
from fedweave.algorithms.confederated.gt_svrg import GTSVRG, GTSVRGHparams
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("gt_sarah")
class GTSARAH(GTSVRG):
    name = "gt_sarah"
    Hparams = GTSVRGHparams
    # the recursion needs only g^k and x^k of the skeleton (and, under faults, ``due``)
    state_fields = (*ConfederatedAlgorithm.state_fields, "due", "anchored")
    recursive = True

    def estimate(self, r: int, k: int, x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        if self.user_on is not None:
            return self.estimate_under_faults(r, k, x_new, x_old)  # GT-SVRG's, with the recursive estimator
        if k % self.hp.inner_loop == 0:
            return self.snapshot(r, x_new)
        pb = self.problem
        users = self.select_users(k, self.m)
        idx = pb.batch_index(users, self.draw_batches(k).gather(1, users))
        self.net.broadcast(r, "model_and_previous", pb.N * self.m, 2 * self.vector_bytes)
        diff = pb.batch_grad(x_new, idx) - pb.batch_grad(x_old, idx)
        self.upload(r, "sarah_difference", pb.N * self.m)
        return (pb.P * pb.S / self.m) * diff.sum(1) + self.G
