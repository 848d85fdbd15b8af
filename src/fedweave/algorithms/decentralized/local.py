"""Local: every client trains only on its own data; no communication (the lower baseline of Table 1)."""

from __future__ import annotations

from fedweave.algorithms.decentralized.base import GraphAlgorithm
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("local")
class Local(GraphAlgorithm):
    name = "local"

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        own = self.train_up(r, self.trainer, self.W)  # K local epochs from the own model (a dropped client: none)
        self.commit("model", own.params)
        return {"train_loss": self.mean_over_up(r, own.loss), **self.round_fault_metrics(r)}
