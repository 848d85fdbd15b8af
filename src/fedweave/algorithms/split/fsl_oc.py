"""FSL_OC: federated split learning with one server-side model copy (SplitFed V2 style), with clipping.

Same per-batch exchange as FSL_MC, but one shared server-side model is updated on every client's batches
in turn. The CSE-FSL authors add gradient clipping to stabilise it; the threshold is not given (spec A17),
so ``clip`` defaults to 1.0 on both parts. Schedule (A19): ``sequential`` serves whole client epochs one
after another in a random order per round (the SFLV2 reference code); ``interleaved`` serves batch m of
every client before batch m+1. The round is the family's synchronous template (``SplitAlgorithm.run_round``);
clients that drop out or miss the deadline are left out of the schedule and the aggregation. The client's side is
``SplitAlgorithm.client_turn`` (deployed, it runs on the client's node); the server model draws its dropout
from ("server_dropout", r), client i from ("dropout", r, i).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.split.base import SplitAlgorithm, SplitHparams, Trained
from fedweave.registry import ALGORITHMS


@dataclass
class FSLOCHparams(SplitHparams):
    clip: float | None = 1.0
    schedule: Literal["sequential", "interleaved"] = "sequential"


@ALGORITHMS.register("fsl_oc")
class FSLOC(SplitAlgorithm):
    name = "fsl_oc"
    method = "fsl_oc"
    dp_refusal = SplitAlgorithm.SERVER_GRADIENTS  # privacy: one client's data move the others' updates
    Hparams = FSLOCHparams

    def train_round(
        self, r: int, clients: np.ndarray, xc_rows: torch.Tensor, xa_rows: torch.Tensor, lrs: tuple[float, ...]
    ) -> Trained:
        lr_c, _, lr_s = lrs  # only the clients that report take a turn on the shared model
        self.hold_server_models(1)
        self.ls.load_(self.xs)  # the one server-side model
        order = self.seeds.numpy("client_order", r).permutation(len(clients)).tolist()
        session = self.backprop_session(r, clients, xc_rows, lr_c)
        # sequential: whole client epochs one after another; interleaved: batch m of every client, in the
        # round's order, before batch m + 1 (the exchanges of one batch can then run at once)
        groups = [order] if self.hp.schedule == "interleaved" else [[k] for k in order]
        rng = {0: self.stream_state("server_dropout", r)}
        losses = []
        for group in groups:
            pending = session.start(group)
            while pending:
                grads = {}
                for k in group:
                    if k in pending:
                        a, y = pending[k]
                        with self.resumed(rng, 0):
                            loss, grads[k] = self.server_exchange(r, a, y, lr_s)  # eq. (11), then g down
                        losses.append(loss)
                pending = session.turn(grads)
        self.xs = self.ls.flatten()
        xc_rows = session.models()
        return Trained(xc_rows, xc_rows, losses, losses)
