"""FSL_MC: federated split learning with one server-side model copy per client (SplitFed V1, Thapa et al.).

Per batch the client uploads smashed data and labels, its server-side copy takes an SGD step and sends
back the gradient of the smashed data, and the client back-propagates it (cse-fsl spec §5). At the end of
the round the fed server averages the client-side models and the main server averages its n copies (A18).
Faults: synchronous; clients that drop out or miss the deadline deliver nothing (``SplitAlgorithm.reporting``).
"""

from __future__ import annotations

from fedweave.registry import ALGORITHMS
from fedweave.topology.split import SplitAlgorithm


@ALGORITHMS.register("fsl_mc")
class FSLMC(SplitAlgorithm):
    handles_faults = ("dropout", "deadline")
    name = "fsl_mc"
    method = "fsl_mc"

    def run_round(self, r: int) -> dict[str, float]:
        clients = self.sample_clients(r)
        lr_c, _, lr_s = self.lrs(r)
        xc_rows, _ = self.download(r, clients)
        clients = self.reporting(r, clients)  # dropouts and stragglers open no server-side copy
        if len(clients) == 0:
            return self.fault_metrics(0)  # nobody reported: the models stay, the runner logs the skip
        xc_rows = xc_rows[: len(clients)]
        xs_rows = self.xs.expand(len(clients), -1).clone()  # n server-side copies, stacked
        self.hold_server_models(len(clients))
        losses, steps = [], 0
        for k, i in enumerate(clients):  # clients run in parallel; their copies are independent
            self.load_client(xc_rows[k])
            self.ls.load_(xs_rows[k])
            with self.stream("dropout", r, int(i)):
                for x, y in self.local_batches(r, int(i)):
                    losses.append(self.backprop_step(x, y, r, lr_c, lr_s))
                    steps += 1
            xc_rows[k], xs_rows[k] = self.lc.flatten(), self.ls.flatten()
        self.upload_models(r, clients)
        self.aggregate(clients, xc_rows, xc_rows)
        self.xs = self.weights(clients) @ xs_rows  # SFLV1: the main server averages its copies
        return {**self.round_metrics(r, len(clients), steps, losses, losses), **self.fault_metrics(len(clients))}
