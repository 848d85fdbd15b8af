"""FSL_AN: federated split learning with an auxiliary network (Han et al., 2021).

The client is CSE-FSL's (local loss through the auxiliary net, eq. 8), but it uploads the smashed data of
every batch, and the main server keeps one server-side copy per client, each stepping on its own client's
uploads (cse-fsl spec §5). No gradients go back. The fed server averages client-side models and auxiliary
nets; the main server averages its copies at the end of the round (A18). The client's side is
``SplitAlgorithm.client_epoch``, CSE-FSL's with an upload every batch (deployed, it runs on the client's
node); copy i draws its dropout from ("server_dropout", r, i), client i from ("dropout", r, i).
Faults: synchronous (the copies are averaged at the round's end); clients that drop out or miss the deadline
deliver nothing (``SplitAlgorithm.reporting``).
"""

from __future__ import annotations

from fedweave.algorithms.split.base import SplitAlgorithm
from fedweave.registry import ALGORITHMS


@ALGORITHMS.register("fsl_an")
class FSLAN(SplitAlgorithm):
    handles_faults = ("dropout", "deadline")
    name = "fsl_an"
    method = "fsl_an"
    uses_aux = True

    def run_round(self, r: int) -> dict[str, float]:
        clients = self.sample_clients(r)
        lr_c, lr_a, lr_s = self.lrs(r)
        xc_rows, xa_rows = self.download(r, clients)
        clients = self.reporting(r, clients)  # dropouts and stragglers send no smashed data
        if len(clients) == 0:
            return self.fault_metrics(0)
        xc_rows, xa_rows = xc_rows[: len(clients)], xa_rows[: len(clients)]
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
        self.upload_models(r, clients)
        self.aggregate(clients, xc_rows, xa_rows)  # eq. (14)
        self.xs = self.weights(clients) @ xs_rows
        out = self.round_metrics(r, len(clients), len(server_losses), losses, server_losses)
        return {**out, **self.fault_metrics(len(clients))}
