"""FedAvg (McMahan et al., 2017): local SGD on sampled clients, weighted averaging of their models."""

from __future__ import annotations

from fedweave.algorithms.centralized.base import StarAlgorithm
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("fedavg")
class FedAvg(StarAlgorithm):
    name = "fedavg"
    handles_faults = ("dropout", "deadline")

    def run_round(self, r: int) -> dict[str, float]:
        clients = self.sample_clients(r)
        self.send(r, clients, "model", self.x)
        clients = self.reporting(r, clients)  # dropouts and stragglers deliver nothing
        if len(clients) == 0:
            return self.fault_metrics(clients)  # nobody reported: the model stays, the runner logs the skip
        local = self.trainer.train(self.x, clients, r)
        self.receive(r, clients, "model", local.params)
        p = self.weights(clients)  # re-weighted over the clients that reported
        delta = p @ (local.params - self.x)  # weighted mean of the local updates
        self.x = self.x + self.hp.server_lr * delta
        return {**self.local_metrics(local, p), **self.fault_metrics(clients)}
