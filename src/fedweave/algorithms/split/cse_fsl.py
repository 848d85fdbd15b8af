"""CSE-FSL (Mu and Shen): communication- and storage-efficient federated split learning.

Clients train the client-side model and an auxiliary net on a local loss (eq. 8) and never wait for the
server; every h local batches they upload one mini-batch of smashed data and its labels (Alg. 1 lines
10-13). The main server keeps ONE server-side model and takes one SGD step per received batch, in the
order its dataQueue delivers them (eq. 11, Alg. 2). Once per round the fed server averages the client-side
models and auxiliary nets (eq. 14). Inference uses x_s ∘ x_c; the auxiliary net is dropped.

Resolutions of the spec (cse-fsl §2.5, §8): uploads at the end of each full h-window with the pre-update
activations (A4, code parity; ``upload_at='start'`` is Alg. 1 as written, ``recompute_smashed`` uses the
updated client model); trailing batches are trained but not uploaded (A27); ``server_order`` picks the
dataQueue discipline and the simulated clock (``ordered``, ``random``, ``event``, ``sync``; §1.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedweave.accounting.split import upload_batches
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS
from fedweave.topology.split import SplitAlgorithm, SplitHparams, Upload, process_order, simulate_server


@dataclass
class CSEFSLHparams(SplitHparams):
    h: int = 5  # batch frequency of client-server communication
    upload_at: Literal["end", "start"] = "end"
    recompute_smashed: bool = False
    server_order: Literal["ordered", "random", "event", "sync"] = "ordered"
    speed_spread: float = 1.0  # client i needs τ_i ~ U[1, speed_spread] time units per local batch
    latency: float = 0.0  # uplink latency of a smashed upload, in the same units
    server_step_time: float = 0.0  # time of one server step
    agg_every: int | None = None  # c: aggregate every c local batches (Alg. 1 line 16); null: once per round

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.h < 1:
            raise ConfigError(f"algorithm.h must be >= 1, got {self.h}")
        if self.agg_every is not None and self.agg_every < 1:
            raise ConfigError(f"algorithm.agg_every must be >= 1 or null, got {self.agg_every}")
        if self.speed_spread < 1:
            raise ConfigError(f"algorithm.speed_spread must be >= 1, got {self.speed_spread}")
        for key in ("latency", "server_step_time"):
            if getattr(self, key) < 0:
                raise ConfigError(f"algorithm.{key} must be >= 0, got {getattr(self, key)}")


@ALGORITHMS.register("cse_fsl")
class CSEFSL(SplitAlgorithm):
    name = "cse_fsl"
    method = "cse_fsl"
    uses_aux = True
    Hparams = CSEFSLHparams

    def batch_time(self, client: int) -> float:
        """τ_i: the simulated time client i needs per local batch (a fixed device speed)."""
        return float(self.seeds.numpy("clock", client).uniform(1.0, self.hp.speed_spread))

    def run_round(self, r: int) -> dict[str, float]:
        hp = self.hp
        clients = self.sample_clients(r)
        lr_c, lr_a, lr_s = self.lrs(r)
        self.hold_server_models(1)
        queue: list[Upload] = []
        losses, client_end = [], 0.0
        plan = [len(self.batcher.client_batches(int(i), r, (), None)) for i in clients]
        longest = max(max(plan, default=0), 1)
        period = hp.agg_every or longest  # default: aggregate once, after the local epoch(s)
        for seg, start in enumerate(range(0, longest, period)):
            xc_rows, xa_rows = self.download(r, clients)  # Alg. 1 line 3
            for k, i in enumerate(clients):  # in parallel: nothing here depends on the server
                self.load_client(xc_rows[k], xa_rows[k])
                batches = self.local_batches(r, int(i))
                window = {m: w for w, m in enumerate(upload_batches(len(batches), hp.h, hp.upload_at))}
                tau = self.batch_time(int(i))
                with self.stream("dropout", r, int(i), *((seg,) if seg else ())):
                    for m in range(start, min(start + period, len(batches))):
                        x, y = batches[m]
                        a, loss = self.local_step(x, y, lr_c, lr_a)  # eq. (8)
                        losses.append(loss)
                        if m in window:  # Alg. 1 lines 10-13: one batch per h goes up
                            if hp.recompute_smashed:
                                a = self.smashed(x)
                            self.send_smashed(r, y)
                            queue.append(Upload(k, window[m], m, a, y, arrival=(m + 1) * tau + hp.latency))
                client_end = max(client_end, len(batches) * tau)
                xc_rows[k], xa_rows[k] = self.lc.flatten(), self.la.flatten()
            self.upload_models(r, clients)  # Alg. 1 lines 16-17: every c batches
            self.aggregate(clients, xc_rows, xa_rows)  # eq. (14)
        # Alg. 2 lines 3-10: the server drains its dataQueue, one SGD step per item on its one model
        order = process_order(hp.server_order, queue, self.seeds.numpy("server_order", r))
        clock = simulate_server(queue, order, hp.server_step_time, barrier=hp.server_order == "sync")
        batch_bytes = self.config.local.batch_size * self.smashed_bytes
        self.ledger.store("server", "queue_peak", clock["queue_peak"] * batch_bytes)  # high-water, full batches
        self.ls.load_(self.xs)
        server_losses = []
        with self.stream("server_dropout", r):
            for j in order:
                server_losses.append(self.server_step(queue[j].smashed, queue[j].labels, lr_s)[0])  # eq. (11)
        self.xs = self.ls.flatten()
        out = self.round_metrics(r, len(clients), len(order), losses, server_losses)
        out.update(
            sim_round_time=max(client_end, clock["finish"]),
            server_idle_time=clock["idle"],
            queue_peak=clock["queue_peak"],
        )
        return out
