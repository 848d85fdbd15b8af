"""FSL_OC: federated split learning with one server-side model copy (SplitFed V2 style), with clipping.

Same per-batch exchange as FSL_MC, but one shared server-side model is updated on every client's batches
in turn. The CSE-FSL authors add gradient clipping to stabilise it; the threshold is not given (spec A17),
so ``clip`` defaults to 1.0 on both parts. Schedule (A19): ``sequential`` serves whole client epochs one
after another in a random order per round (the SFLV2 reference code); ``interleaved`` serves batch m of
every client before batch m+1. Faults: synchronous; clients that drop out or miss the deadline are left out
of the schedule and the aggregation (``SplitAlgorithm.reporting``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedweave.registry import ALGORITHMS
from fedweave.topology.split import SplitAlgorithm, SplitHparams


@dataclass
class FSLOCHparams(SplitHparams):
    clip: float | None = 1.0
    schedule: Literal["sequential", "interleaved"] = "sequential"


@ALGORITHMS.register("fsl_oc")
class FSLOC(SplitAlgorithm):
    handles_faults = ("dropout", "deadline")
    name = "fsl_oc"
    method = "fsl_oc"
    Hparams = FSLOCHparams

    def run_round(self, r: int) -> dict[str, float]:
        clients = self.sample_clients(r)
        lr_c, _, lr_s = self.lrs(r)
        xc_rows, _ = self.download(r, clients)
        clients = self.reporting(r, clients)  # dropouts and stragglers take no turn on the shared model
        if len(clients) == 0:
            return self.fault_metrics(0)
        xc_rows = xc_rows[: len(clients)]
        self.hold_server_models(1)
        self.ls.load_(self.xs)  # the one server-side model
        batches = {k: self.local_batches(r, int(i)) for k, i in enumerate(clients)}
        order = self.seeds.numpy("client_order", r).permutation(len(clients))
        if self.hp.schedule == "sequential":
            plan = [(k, m) for k in order for m in range(len(batches[k]))]
        else:
            longest = max(len(b) for b in batches.values())
            plan = [(k, m) for m in range(longest) for k in order if m < len(batches[k])]
        losses, loaded = [], None
        with self.stream("dropout", r):
            for k, m in plan:
                if loaded != k:  # swap the client's row into the template
                    if loaded is not None:
                        xc_rows[loaded] = self.lc.flatten()
                    self.load_client(xc_rows[k])
                    loaded = k
                x, y = batches[k][m]
                losses.append(self.backprop_step(x, y, r, lr_c, lr_s))
        if loaded is not None:
            xc_rows[loaded] = self.lc.flatten()
        self.xs = self.ls.flatten()
        self.upload_models(r, clients)
        self.aggregate(clients, xc_rows, xc_rows)
        return {**self.round_metrics(r, len(clients), len(plan), losses, losses), **self.fault_metrics(len(clients))}
