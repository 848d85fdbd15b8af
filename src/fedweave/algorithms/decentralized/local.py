"""Local: every client trains only on its own data; no communication (the lower baseline of Table 1)."""

from __future__ import annotations

from fedweave.algorithms.decentralized.base import GraphAlgorithm, GraphHparams
from fedweave.registry import ALGORITHMS

# the graph's options: Local builds the graph but never sends anything over it
GRAPH_OPTIONS = ("topology", "edge_prob", "degree", "rewire_prob", "torus_rows", "edge_file")


@ALGORITHMS.register("local")
class Local(GraphAlgorithm):
    name = "local"
    undeployable = "its peers never exchange models: there is no gossip to relay (run each client on its own)"
    dp_refusal = None  # its models come from its DP-SGD steps only

    def unread_options(self, hp: GraphHparams) -> dict[str, str]:
        # ``neighbours`` is not read either, but is not named: a comparison may give every method of the family
        # one neighbour budget (tests/test_decentralized_faults.py gives them all neighbours: 3)
        graph = {key: "local trains each client alone and talks to no neighbour" for key in GRAPH_OPTIONS}
        why = "local sends nothing, so there is no exchanged tensor to noise (dp_mode 'sgd' noises its local steps)"
        return {**graph, "dp_mode": why}

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        own = self.train_up(r, self.trainer, self.W)  # K local epochs from the own model (a dropped client: none)
        self.commit("model", own.params)
        return {"train_loss": self.train_loss(r, own), **self.round_fault_metrics(r)}
