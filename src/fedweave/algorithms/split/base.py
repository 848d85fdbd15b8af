"""Injected faults in the split family (docs/reliability.md), on top of the protocol mechanics of
:mod:`fedweave.topology.split`.

A client that drops out received the fed server's download and delivers nothing in the round: no smashed
data, no model upload, and (FSL_MC, FSL_AN) no server-side copy is opened for it. Split clients keep no
state across rounds (each round starts from the fed server's x_c), so nothing else changes.

A client's work in a round is its local batches over the mean over all clients (``reference_batches``), so
a client with twice the data is twice as slow. The synchronous protocols (FSL_MC, FSL_OC, FSL_AN: the main
server waits for the round's clients and averages at the end) decide per client and round: a client past the
deadline is dropped like a dropout, and ``late`` is refused. CSE-FSL times each upload (see ``cse_fsl``).
Aggregation (eq. 14, and the main server's average of its copies) re-weights over the clients that reported.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from fedweave.algorithms.base import RunContext
from fedweave.faults import Faults
from fedweave.topology.split import SplitAlgorithm, SplitHparams


class FaultySplitAlgorithm(SplitAlgorithm):
    """A split algorithm whose ``run_round`` asks :class:`fedweave.faults.Faults` who delivers."""

    handles_faults: ClassVar[tuple[str, ...]] = ("dropout", "deadline")

    def __init__(self, ctx: RunContext, hp: SplitHparams) -> None:
        super().__init__(ctx, hp)
        self.faults = Faults(ctx.config.faults, self.seeds)
        self.faulty = bool(self.faults.active())
        n = ctx.num_clients
        self.reference_batches = max(1, round(sum(self.batcher.num_steps(c) for c in range(n)) / n))

    def work(self, clients: np.ndarray) -> np.ndarray:
        """Each client's local batches relative to the mean (its amount of work in the round)."""
        return np.array([self.batcher.num_steps(int(c)) for c in clients], dtype=np.float64) / self.reference_batches

    def reporting(self, r: int, clients: np.ndarray) -> np.ndarray:
        """The clients of ``clients`` that deliver in round r: not dropped, and (policy drop) on time."""
        if not self.faulty:
            return clients
        return self.faults.reporting(r, clients, self.work(clients))

    def fault_metrics(self, reported: int) -> dict[str, float]:
        """``reported_clients`` when faults are injected (0 marks a skipped round for the runner)."""
        return {"reported_clients": float(reported)} if self.faulty else {}
