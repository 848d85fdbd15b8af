"""CSE-FSL (Mu and Shen): communication- and storage-efficient federated split learning.

Clients train the client-side model and an auxiliary net on a local loss (eq. 8) and never wait for the
server; every h local batches they upload one mini-batch of smashed data and its labels (Alg. 1 lines
10-13). The main server keeps ONE server-side model and takes one SGD step per received batch, in the
order its dataQueue delivers them (eq. 11, Alg. 2). Once per round the fed server averages the client-side
models and auxiliary nets (eq. 14). Inference uses x_s ∘ x_c; the auxiliary net is dropped.

Resolutions of the spec (cse-fsl §2.5, §8): uploads at the end of each full h-window with the pre-update
activations (A4, code parity; ``upload_at='start'`` is Alg. 1 as written, ``recompute_smashed`` uses the
updated client model); the windows restart with each local epoch (Alg. 1's m counts one pass over D_i),
and an epoch's trailing batches are trained but not uploaded (A27); ``server_order`` picks the
dataQueue discipline and the simulated clock (``ordered``, ``random``, ``event``, ``sync``; §1.6).

Faults (docs/reliability.md), on the family's simulated clock (``TimedSplit`` in base.py, which also times
the uploads without faults). A client that drops out trains nothing and sends nothing in the round. With
``faults.deadline`` set, the clock is the fault model's: client i's upload after local batch m arrives at
``faults.arrival_times(r, i, (m + 1) / reference_batches)`` (+ ``latency``; ``m + 1`` under ``faults.work_unit:
step``), and its model upload at the end
of its epoch, so the fed server aggregates exactly the clients of ``faults.reporting``; a late model misses
the aggregation and is not sent (the client gets the new model next round). A smashed upload past the
deadline is discarded (policy ``drop``) or, with the asynchronous ``event`` server and policy ``late``,
reaches the server's queue ``ceil(t / deadline) - 1`` rounds later, at time ``t - delay * deadline`` of that
round (rounds last one deadline), where it is processed in arrival order like any other batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.split.base import (  # noqa: F401  (ClientEpoch, InFlight: re-exported)
    ClientEpoch,
    InFlight,
    SplitHparams,
    TimedSplit,
    Upload,
    process_order,
    simulate_server,
)
from fedweave.config import ConfigError
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS


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
class CSEFSL(TimedSplit):
    name = "cse_fsl"
    method = "cse_fsl"
    uses_aux = True
    Hparams = CSEFSLHparams

    def __init__(self, ctx: RunContext, hp: CSEFSLHparams) -> None:
        super().__init__(ctx, hp)
        # the client's side (``SplitAlgorithm.client_epoch``): one smashed batch every h (Alg. 1 lines 10-13)
        self.upload_every, self.upload_at, self.recompute_smashed = hp.h, hp.upload_at, hp.recompute_smashed
        if self.timed and hp.agg_every is not None:
            raise ConfigError(
                "faults.deadline: cse_fsl times one aggregation per round; set algorithm.agg_every to null"
            )
        if self.late_policy and hp.server_order != "event":
            raise ConfigError(
                f"faults.straggler_policy 'late' needs the asynchronous server, algorithm.server_order 'event' "
                f"(got {hp.server_order!r}, which processes the queue in a fixed order); use policy 'drop'"
            )

    def run_round(self, r: int) -> dict[str, float]:
        hp = self.hp
        clients = self.sample_clients(r)
        lr_c, lr_a, lr_s = self.lrs(r)
        self.hold_server_models(1)
        queue: list[Upload] = []
        losses, client_end = [], 0.0  # client_end: when the last segment's training ends (the clock)
        dropped = self.dropped(r, clients)  # a client that drops out trains nothing, sends nothing
        on_time = self.models_on_time(r, clients)  # whose model reaches the fed server (None: everyone's)
        delivered: set[int] = set()  # clients of which something reaches a server this round
        models_in = 0
        plan = np.array([len(self.batcher.client_batches(int(i), r, (), None)) for i in clients], dtype=np.int64)
        longest = max(int(plan[~dropped].max(initial=0)), 1)  # the segments of the clients that train
        period = hp.agg_every or longest  # default: aggregate once, after the local epoch(s)
        offset = 0.0  # when the segment starts on the clock
        for seg, start in enumerate(range(0, longest, period)):
            seg_end = offset
            # a later segment (agg_every) is for the clients with batches left in it: one whose batches are done
            # (fewer samples than the others) has nothing to train, so it neither downloads, uploads nor is
            # averaged unchanged into the others' models (eq. (14) over the clients that trained)
            active = np.flatnonzero(~dropped) if seg == 0 else np.flatnonzero(~dropped & (plan > start))
            self.download(r, clients if seg == 0 else clients[active])  # Alg. 1 line 3
            xc_rows = self.xc.expand(len(clients), -1).clone()
            xa_rows = self.xa.expand(len(clients), -1).clone()
            arrived = []  # positions whose model reaches the fed server
            rows = (xc_rows[active], xa_rows[active])
            epochs = self.client_epochs(r, clients[active], *rows, (lr_c, lr_a), start, period, seg)
            for k, ep in zip(active.tolist(), epochs, strict=True):  # in parallel: none depends on the server
                i = int(clients[k])
                losses.extend(ep.losses)
                # Alg. 1 lines 10-13: one batch per h went up; the segment starts once the fed server has
                # averaged the one before, at the latest client's end of it (``offset``)
                up = self.deliver(r, k, i, ep.uploads, start, offset)
                queue.extend(up)
                if up:
                    delivered.add(i)
                done = len(range(start, min(start + period, ep.batches)))  # its batches in this segment
                seg_end = max(seg_end, self.training_end(r, i, done, offset))
                xc_rows[k], xa_rows[k] = ep.xc, ep.xa
                if on_time is None or i in on_time:
                    arrived.append(k)
            if arrived:
                got = clients[arrived]
                self.upload_models(r, got)  # Alg. 1 lines 16-17: every c batches
                self.aggregate(got, xc_rows[arrived], xa_rows[arrived])  # eq. (14), re-weighted over arrivals
                delivered.update(got.tolist())
                models_in = max(models_in, len(arrived))
            else:
                self.release_nobody(clients[arrived])  # privacy: under amplification, the noise alone
            offset = client_end = seg_end
        late_in = self.late_arrivals(r)  # stragglers' uploads of earlier rounds
        for f in late_in:
            queue.append(f.upload)
            delivered.add(f.client)
        if self.nothing_delivered(delivered):
            return self.skipped_round()  # both models stay, the runner logs the skip
        # Alg. 2 lines 3-10: the server drains its dataQueue, one SGD step per item on its one model
        order = process_order(hp.server_order, queue, self.seeds.numpy("server_order", r))
        clock = simulate_server(queue, order, hp.server_step_time, barrier=hp.server_order == "sync")
        # high-water mark in full batches: the largest batch that went up, at the width the smashed data were sent
        # in (bfloat16 under bf16-mixed where the client's last layer autocasts, not the run's float width), and
        # at the size it went up in (a client's whole data under local.full_batch, not local.batch_size)
        batch_bytes = max((nbytes(u.smashed) for u in queue), default=0)  # an empty queue peaks at 0 batches
        self.ledger.store("server", "queue_peak", clock["queue_peak"] * batch_bytes)
        self.ls.load_(self.xs)
        server_losses = []
        with self.stream("server_dropout", r):
            for j in order:
                server_losses.append(self.server_step(queue[j].smashed, queue[j].labels, lr_s)[0])  # eq. (11)
        self.xs = self.ls.flatten()
        n = models_in if self.faulty else len(clients)
        out = self.round_metrics(r, n, len(order), losses, server_losses)
        out.update(
            sim_round_time=max(client_end, clock["finish"]),
            server_idle_time=clock["idle"],
            queue_peak=clock["queue_peak"],
        )
        return {**out, **self.timed_fault_metrics(len(delivered), len(late_in))}
