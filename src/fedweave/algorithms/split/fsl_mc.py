"""FSL_MC: federated split learning with one server-side model copy per client (SplitFed V1, Thapa et al.).

Per batch the client uploads smashed data and labels, its server-side copy takes an SGD step and sends
back the gradient of the smashed data, and the client back-propagates it (cse-fsl spec §5). At the end of
the round the fed server averages the client-side models and the main server averages its n copies (A18).
The client's side is ``SplitAlgorithm.client_turn`` (deployed, it runs on the client's node); copy i draws
its dropout from ("server_dropout", r, i), client i from ("dropout", r, i).
The round is the family's synchronous template (``SplitAlgorithm.run_round``: download, the clients that
report, upload, eq. (14)); dropouts and stragglers open no server-side copy.
"""

from __future__ import annotations

import numpy as np
import torch

from fedweave.algorithms.split.base import SplitAlgorithm, Trained
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("fsl_mc")
class FSLMC(SplitAlgorithm):
    name = "fsl_mc"
    method = "fsl_mc"
    dp_refusal = SplitAlgorithm.SERVER_GRADIENTS  # privacy: one client's data move the others' updates

    def train_round(
        self, r: int, clients: np.ndarray, xc_rows: torch.Tensor, xa_rows: torch.Tensor, lrs: tuple[float, ...]
    ) -> Trained:
        lr_c, _, lr_s = lrs
        xs_rows = self.xs.expand(len(clients), -1).clone()  # n server-side copies, stacked
        self.hold_server_models(len(clients))
        session = self.backprop_session(r, clients, xc_rows, lr_c)
        rng = {k: self.stream_state("server_dropout", r, int(i)) for k, i in enumerate(clients)}
        losses: dict[int, list[float]] = {k: [] for k in range(len(clients))}
        # clients run in parallel, their copies are independent: all at once where that is cheaper (deployed)
        ks = list(range(len(clients)))
        loaded = None
        for group in [ks] if session.parallel else [[k] for k in ks]:
            pending = session.start(group)
            while pending:
                grads = {}
                for k, (a, y) in pending.items():
                    if loaded != k:  # swap copy k into the server template
                        if loaded is not None:
                            xs_rows[loaded] = self.ls.flatten()
                        self.ls.load_(xs_rows[k])
                        loaded = k
                    with self.resumed(rng, k):
                        loss, grads[k] = self.server_exchange(r, a, y, lr_s)  # copy k, eq. (11)
                    losses[k].append(loss)
                pending = session.turn(grads)
        if loaded is not None:
            xs_rows[loaded] = self.ls.flatten()
        xc_rows = session.models()
        self.xs = self.weights(clients) @ xs_rows  # SFLV1: the main server averages its copies
        flat = [v for k in ks for v in losses[k]]  # client by client, whatever the order of the exchanges
        return Trained(xc_rows, xc_rows, flat, flat)
