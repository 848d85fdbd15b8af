"""The ``pool`` backend: the jobs of each ``LocalTrainer.train`` call run on forked worker processes.

On a small CPU machine torch scales poorly with intra-op threads on small convolutions: two processes of
one thread each trained the MNIST CNN about 4x faster than one process with two threads under load
(docs/performance.md). This backend forks ``torch.get_num_threads()`` workers (so ``threads: 2`` means two
one-thread workers) when a trainer first trains; each inherits the trainer's model, training data,
partition and seeds from the fork (copy-on-write, nothing is copied or serialised), and runs contiguous
work-balanced shards of every call on the ``loop`` or ``vmap`` backend, chosen as ``auto`` would for the
shard. The batch plan comes from the same named seed streams and the rule's per-job tensors are indexed by
the job's position in the whole call, as on the ray backend, so the results do not depend on the number
of workers. The workers also evaluate the global model (:func:`fedweave.execution.evaluate.evaluate`):
each computes a contiguous run of the evaluation batches, and the driver adds the per-batch sums in order.

No extra dependency and no daemon: start-up is one ``fork`` per worker, and the workers exit with the
driver (they see end-of-file on their pipe) or when the trainer is garbage-collected.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import traceback
import weakref
from dataclasses import replace
from typing import Any

import torch

from fedweave.errors import WorkerLost
from fedweave.execution.evaluate import batch_sums, evaluators, fork_shared
from fedweave.execution.job import LocalCall, LocalResult, backend
from fedweave.execution.local import LocalTrainer
from fedweave.execution.params import ParamLayout
from fedweave.execution.shards import run_shard, split_call

_CACHE_KEEP = 4  # evaluation sets a worker keeps (test set, server set, ...)


def _dumps(obj: Any) -> bytes:
    """Pickle by value (tensors included); fall back to cloudpickle for rules defined in ``__main__``."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"backend 'pool' sends each call's local rule to its worker processes, and it cannot be "
                f"pickled: {e} (define the rule at module level, or choose backend: loop)"
            ) from e
        return cloudpickle.dumps(obj)


def _serve(conn: Any, tr: LocalTrainer, driver_ends: list | None = None) -> None:
    """A worker's loop: answer ``train`` and ``evaluate`` requests until the driver hangs up. ``driver_ends``:
    the driver's ends of this worker's pipe and of the pool's workers forked before it, which the fork copied
    here and which are closed at once, so that the driver's death closes every pipe: a worker holding them
    kept its own and the other workers' pipes open after a killed driver, and a worker blocked sending a
    reply (or waiting for a request) then never exited. (A later pool's workers may hold this pool's driver
    ends; they exit when the driver dies, since their own pipes are clean, and release them.)"""
    for c in driver_ends or ():
        c.close()
    # Ctrl-C reaches the terminal's whole process group: the driver alone handles it (and SIGTERM), stops
    # the run and closes the pipes, which ends this loop; a worker that raised too would print a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    while True:
        try:
            op, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver exited or closed the pool
            return
        if op == "stop":
            return
        try:
            if op == "train":
                local, call = args
                res = run_shard(tr, local, replace(call, starts=torch.from_numpy(call.starts)))
                out: Any = (res.params.numpy(), res.steps.numpy(), res.loss.numpy())
            elif op == "data":  # an evaluation set's rows for this worker, kept for later calls
                token, x, y = args
                while len(cache) >= _CACHE_KEEP:
                    cache.pop(next(iter(cache)))
                cache[token] = (x, y)
                out = None
            elif op == "view":  # rows of an evaluation set inherited from the fork: views, no copy
                token, ids, (lo, hi) = args
                x, y = (fork_shared[i]()[lo:hi] for i in ids)
                while len(cache) >= _CACHE_KEEP:
                    cache.pop(next(iter(cache)))
                cache[token] = (x, y)
                out = None
            elif op == "evaluate":
                token, w, batch_size = args
                w = torch.from_numpy(w)
                x, y = cache[token]
                out = batch_sums(tr.layout, w, x, y, batch_size)
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = ("ok", out)
        except BaseException as e:  # reported in the driver with the worker's traceback
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the driver died while this worker computed (a broken pipe): no one is left to tell
            return


def _close(conns: list, procs: list) -> None:
    for c in conns:
        try:
            c.send_bytes(pickle.dumps(("stop", None)))
            c.close()
        except OSError:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()  # SIGKILL: the workers ignore SIGTERM


class WorkerPool:
    """Worker processes forked from the driver, each holding a copy-on-write view of one trainer."""

    def __init__(self, tr: LocalTrainer, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"the pool needs >= 1 worker, got {workers}")
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for _ in range(workers):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(there, tr, [here, *self.conns]), daemon=True)
            p.start()
            there.close()
            self.conns.append(here)
            self.procs.append(p)
        # the declared evaluation sets as the workers inherited them (execution.evaluate.share_with_workers)
        self.inherited = {i: (r, t._version) for i, r in list(fork_shared.items()) if (t := r()) is not None}
        self.sent: list[tuple] = []  # evaluation sets already sent (weak references, versions, token, bounds)
        self.tokens = 0
        self._finalizer = weakref.finalize(self, _close, self.conns, self.procs)

    @property
    def size(self) -> int:
        return len(self.conns)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        self._finalizer()

    def request(self, calls: list[tuple[int, str, tuple]]) -> list[Any]:
        """Send ``(worker, op, args)`` requests (at most one per worker), then collect the replies in order."""
        lost: list[int] = []  # workers whose pipe is closed: they died (a request cannot reach them)
        for i, op, args in calls:
            try:
                self.conns[i].send_bytes(_dumps((op, args)))
            except OSError:
                lost.append(i)
        out, errors = [], []
        for i, _, _ in calls:
            if i in lost:
                continue
            try:
                status, value = pickle.loads(self.conns[i].recv_bytes())
            except (EOFError, OSError):
                lost.append(i)
                continue
            (out if status == "ok" else errors).append(value)
        if lost:  # every other reply has been read: the pipes hold nothing stale
            raise self._lost(min(lost))
        if errors:
            raise RuntimeError("a pool worker failed:\n" + errors[0])
        return out

    def _lost(self, i: int) -> WorkerLost:
        """One line on worker ``i``, which died: how it ended and what to do."""
        p = self.procs[i]
        p.join(timeout=5)
        code = p.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (the system may have run out of memory)"
        else:
            how = f"exited with status {code}"
        return WorkerLost.of("pool", f"worker {i} (pid {p.pid}) {how}", "threads")

    # ---- training --------------------------------------------------------------------------------
    def train(self, tr: LocalTrainer, call: LocalCall) -> LocalResult:
        calls = []
        for i, shard in enumerate(split_call(tr, call, self.size)):
            # the starts travel as a numpy array, which pickles as one buffer copy (a torch tensor pickles
            # through torch.save, much slower); the worker turns them back into a tensor
            shard = replace(shard, starts=shard.starts.detach().numpy().copy())
            calls.append((i, "train", (tr.local, shard)))
        parts = self.request(calls)
        cat = torch.cat
        params, nsteps, loss = ([torch.from_numpy(p[i]) for p in parts] for i in range(3))
        return LocalResult(cat(params), cat(nsteps), cat(loss))

    # ---- evaluation ------------------------------------------------------------------------------
    def forked(self, t: torch.Tensor) -> bool:
        """Whether the workers inherited ``t`` from the fork as it is now (declared shared, unmodified since)."""
        hit = self.inherited.get(id(t))
        return hit is not None and hit[0]() is t and t._version == hit[1]

    def batch_sums(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> list:
        """Per-batch (loss sum, correct) of ``w`` on ``(x, y)``, the batches split over the workers."""
        have = None
        for rx, ry, vx, vy, bs, token, bounds in self.sent:  # the same live tensors, unmodified since
            if rx() is x and ry() is y and (vx, vy, bs) == (x._version, y._version, batch_size):
                have = token, bounds
        if have is None:  # send each worker its contiguous run of whole batches, once
            nb = -(-len(y) // batch_size)
            per = [nb // self.size + (i < nb % self.size) for i in range(self.size)]
            edges = [0]
            for p in per:
                edges.append(edges[-1] + p)
            bounds = [(min(a * batch_size, len(y)), min(b * batch_size, len(y))) for a, b in zip(edges, edges[1:])]
            self.tokens += 1
            token = self.tokens
            if self.forked(x) and self.forked(y):  # the workers hold them from the fork: no copy
                calls = [(i, "view", (token, (id(x), id(y)), b)) for i, b in enumerate(bounds)]
            else:  # sent once per evaluation set, so torch's slower pickling of tensors does not matter here
                calls = [(i, "data", (token, x[lo:hi].clone(), y[lo:hi].clone())) for i, (lo, hi) in enumerate(bounds)]
            self.request([c for c in calls if bounds[c[0]][1] > bounds[c[0]][0]])
            self.sent = self.sent[-(_CACHE_KEEP - 1) :]  # the workers keep the last _CACHE_KEEP sets too
            self.sent.append((weakref.ref(x), weakref.ref(y), x._version, y._version, batch_size, token, bounds))
            have = token, bounds
        token, bounds = have
        w = w.detach().numpy().copy()
        calls = [(i, "evaluate", (token, w, batch_size)) for i, (lo, hi) in enumerate(bounds) if hi > lo]
        return [s for part in self.request(calls) for s in part]


def pool(tr: LocalTrainer, workers: int | None = None) -> WorkerPool:
    """The trainer's worker pool (shared with its shallow copies), forked on first use with ``workers``
    processes (default: ``torch.get_num_threads()``, i.e. the run's ``threads``)."""
    p = tr.shared.get("pool")
    if p is None:
        p = tr.shared["pool"] = WorkerPool(tr, workers or max(torch.get_num_threads(), 1))
        evaluators[tr.layout] = p  # evaluation with this layout runs on the pool's workers too
    return p


def pool_for(layout: ParamLayout) -> WorkerPool | None:
    """The live pool whose workers hold ``layout``'s model, if any (used by evaluation)."""
    return evaluators.get(layout)


@backend("pool")
def run(tr: LocalTrainer, call: LocalCall) -> LocalResult:
    return pool(tr).train(tr, call)
