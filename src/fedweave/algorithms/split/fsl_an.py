"""FSL_AN: federated split learning with an auxiliary network (Han et al., 2021).

The client is CSE-FSL's (local loss through the auxiliary net, eq. 8), but it uploads the smashed data of
every batch, and the main server keeps one server-side copy per client, each stepping on its own client's
uploads (cse-fsl spec §5). No gradients go back. The fed server averages client-side models and auxiliary
nets; the main server averages its copies at the end of the round (A18). The client's side is
``SplitAlgorithm.client_epoch``, CSE-FSL's with an upload every batch (deployed, it runs on the client's
node); copy i draws its dropout from ("server_dropout", r, i), client i from ("dropout", r, i).
The round is the family's synchronous template (``SplitAlgorithm.run_round``; the copies are averaged at
the round's end); clients that drop out or miss the deadline send no smashed data.
"""

from __future__ import annotations

import numpy as np
import torch

from fedweave.algorithms.split.base import SplitAlgorithm, Trained
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("fsl_an")
class FSLAN(SplitAlgorithm):
    name = "fsl_an"
    method = "fsl_an"
    uses_aux = True

    def train_round(
        self, r: int, clients: np.ndarray, xc_rows: torch.Tensor, xa_rows: torch.Tensor, lrs: tuple[float, ...]
    ) -> Trained:
        lr_c, lr_a, lr_s = lrs
        xs_rows = self.xs.expand(len(clients), -1).clone()  # n server-side copies, stacked
        self.hold_server_models(len(clients))
        longest = max(self.batcher.num_steps(int(i)) for i in clients)
        # the clients' epochs (eq. 8; deployed, on their nodes): none waits for the server
        epochs = self.client_epochs(r, clients, xc_rows, xa_rows, (lr_c, lr_a), 0, max(longest, 1), 0)
        losses, server_losses = [], []
        for k, (i, ep) in enumerate(zip(clients, epochs, strict=True)):
            self.ls.load_(xs_rows[k])
            with self.stream("server_dropout", r, int(i)):
                for _, _, a, y in ep.uploads:  # every batch's smashed data, in order
                    self.send_smashed(r, a, y)
                    server_losses.append(self.server_step(a, y, lr_s)[0])  # copy i, eq. (11)
            losses.extend(ep.losses)
            xc_rows[k], xa_rows[k], xs_rows[k] = ep.xc, ep.xa, self.ls.flatten()
        self.xs = self.weights(clients) @ xs_rows  # the main server averages its copies
        return Trained(xc_rows, xa_rows, losses, server_losses)
