"""Splitting a ``LocalTrainer.train`` call into shards for worker processes (the ``pool`` and ``ray``
backends), and running one shard inside a worker.

A shard is a contiguous range of the call's jobs, itself a ``LocalCall``. The rule's per-job tensors stay
indexed by each job's position in the whole call (``LocalCall.offset``), and the batch plan comes from the
named seed streams, so the results do not depend on how the call was split (DESIGN principles 4 and 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from fedweave.config import LocalConfig
from fedweave.execution.job import LocalCall, LocalResult, backend_run, reindexed

if TYPE_CHECKING:
    from fedweave.execution.local import LocalTrainer


def shard_bounds(work: Sequence[int], shards: int) -> list[tuple[int, int]]:
    """Split jobs ``0..K-1`` into at most ``shards`` contiguous non-empty ranges ``[lo, hi)`` that minimise
    the largest total work of a range (binary search on that bound; greedy filling is optimal for it)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    w = [max(int(x), 0) for x in work]
    if not w:
        return []

    def fill(cap: int) -> list[tuple[int, int]]:
        out, lo, load = [], 0, 0
        for k, x in enumerate(w):
            if k > lo and load + x > cap:
                out.append((lo, k))
                lo, load = k, 0
            load += x
        out.append((lo, len(w)))
        return out

    lo, hi = max(max(w), 1), max(sum(w), 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(fill(mid)) <= shards:
            hi = mid
        else:
            lo = mid + 1
    return fill(lo)


def split_call(tr: LocalTrainer, call: LocalCall, shards: int) -> list[LocalCall]:
    """The call's work-balanced shards (by local steps), each a :class:`LocalCall` of contiguous jobs whose
    ``offset`` is its first job's position; a shard's starts are one row when every job starts from the
    same vector (an expanded tensor), so only that row is sent."""
    work = [tr.num_steps(c, call.steps) for c in call.clients]
    return [call.shard(lo, hi) for lo, hi in shard_bounds(work, shards)]


def run_shard(tr: LocalTrainer, local: LocalConfig, call: LocalCall) -> LocalResult:
    """Inside a one-thread worker: train a shard of a call on the backend ``auto`` picks for the shard.
    ``local`` is the call's (it may come from a copy of the trainer with other local settings)."""
    from fedweave.execution import choose_backend

    tr.local = local
    count = len(call.clients)
    starts = tr.placement.to(call.starts)  # sent through the host: computed where this worker computes
    call = replace(call, starts=starts.expand(count, -1) if starts.dim() == 1 else starts)
    if choose_backend("auto", tr.layout.model, count, threads=1, device=tr.placement.device) == "loop":
        return backend_run("loop")(tr, call)
    # job positions in the whole call, as a rule of the shard's own jobs
    rule = reindexed(call.rule, range(call.offset, call.offset + count))
    return backend_run("vmap")(tr, replace(call, rule=rule, offset=0))
