"""The ``ray`` backend: the jobs of each ``LocalTrainer.train`` call run as shards on Ray actors.

The jobs of a call are split into contiguous shards that balance the work (local steps) of the jobs, one
shard per actor. Each actor (one CPU) holds one reused template model and the training data (put once in
the object store and read in place), and runs its shard on the ``loop`` or ``vmap`` backend (chosen as
``auto`` would for the shard), with the same named seed streams as every other backend. The actors live as
long as the Ray session and serve every trainer of the process in turn (a sweep pays their start-up once);
an actor drops a trainer's model and data when the trainer is garbage-collected. The rule object
travels with the call and its per-job tensors are indexed by each job's position in the whole call, so
the results equal the ``loop`` backend's to float tolerance whatever the number of workers
(DESIGN principles 4 and 6).

Ray is optional (``pip install 'fedweave[ray]'``). By default fedweave starts a local Ray with one CPU per
worker, no dashboard and usage statistics off; ``ray.address`` connects to an existing cluster instead, whose
nodes must have fedweave installed.
"""

from __future__ import annotations

import math
import os
import uuid
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from fedweave.config import ConfigError, LocalConfig, RayConfig
from fedweave.execution.local import LR, PLAIN, LocalResult, LocalRule, LocalTrainer
from fedweave.execution.shards import run_shard, split_call

# Set for a Ray that fedweave starts itself (the user's environment wins).
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
MB = 2**20


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "backend 'ray' needs Ray, an optional dependency: pip install 'fedweave[ray]' "
            "(or choose backend: loop, vmap or auto)"
        ) from e
    return ray


class Worker:
    """A Ray actor (one CPU): runs shards of ``train`` calls for the trainers registered with it, each as a
    trainer of its own over one template model and the training data read in place from the object store."""

    KEEP = 4  # setups kept at most (a backstop: the driver drops each one when its trainer is collected)

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.trainers: dict[str, LocalTrainer] = {}

    def _trainer(self, setup_id: str, setup: list) -> LocalTrainer:
        tr = self.trainers.pop(setup_id, None)
        if tr is None:
            import ray

            s = ray.get(setup[0])
            x, y, parts = ray.get([s["x"], s["y"], s["parts"]])
            with warnings.catch_warnings():  # object-store arrays are read-only; training only reads them
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tx, ty = torch.from_numpy(x), torch.from_numpy(y)
            tr = LocalTrainer(
                s["model"], tx, ty, parts, LocalConfig(epochs=1), s["seeds"],
                augment=s["augment"], rounds=s["rounds"], vmap_chunk=s["vmap_chunk"], loss_fn=s["loss_fn"],
            )  # fmt: skip
            while len(self.trainers) >= self.KEEP:
                self.trainers.pop(next(iter(self.trainers)))
        self.trainers[setup_id] = tr  # most recently used last
        return tr

    def run(
        self,
        setup_id: str,
        setup: list,
        local: LocalConfig,
        starts: torch.Tensor,
        count: int,
        clients: list[int],
        round: int,
        rule: LocalRule,
        lr: LR,
        steps: int | None,
        key: tuple[int, ...],
        offset: int,
    ) -> LocalResult:
        tr = self._trainer(setup_id, setup)
        return run_shard(tr, local, starts, count, clients, round, rule, lr, steps, key, offset)

    def forget(self, setup_id: str) -> None:
        self.trainers.pop(setup_id, None)

    def pid(self) -> int:
        return os.getpid()


def _start_ray(ray: Any, cfg: RayConfig, data_bytes: int) -> None:
    if ray.is_initialized():  # the user's (or an earlier run's) Ray
        return
    if cfg.address is not None:
        ray.init(address=cfg.address)
        return
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    cpus = cfg.num_workers or len(os.sched_getaffinity(0))
    store_mb = cfg.object_store_memory_mb or max(128, math.ceil(1.25 * data_bytes / MB) + 64)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=store_mb * MB)


_ACTORS: dict[tuple[str, str], list] = {}  # (job id, node id) -> the actors started in that session


def actors(ray: Any, n: int) -> list:
    """``n`` worker actors of the current Ray session, started on first need and then reused."""
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if n > cpus:
        raise ConfigError(f"ray.num_workers ({n}) exceeds the CPUs of the Ray cluster ({cpus})")
    ctx = ray.get_runtime_context()
    # the job id alone repeats across sessions (a fresh local Ray numbers its first job 01000000 again);
    # with the driver's node id, the handles of a shut-down session are never reused
    job = (ctx.get_job_id(), ctx.get_node_id())
    for old in [k for k in _ACTORS if k != job]:  # handles of an earlier, shut-down session
        del _ACTORS[old]
    have = _ACTORS.setdefault(job, [])
    remote = ray.remote(num_cpus=1)(Worker)
    have.extend(remote.remote() for _ in range(n - len(have)))
    return have[:n]


def _forget(actors: list, setup_id: str) -> None:
    try:
        for a in actors:
            a.forget.remote(setup_id)
    except Exception:  # Ray already shut down: nothing to free
        pass


class RayPool:
    """A trainer's (and its shallow copies') data in the object store and the actors that serve it."""

    def __init__(self, tr: LocalTrainer) -> None:
        self.ray = ray = import_ray()
        x = np.ascontiguousarray(tr.train_x.numpy())
        y = np.ascontiguousarray(tr.train_y.numpy())
        _start_ray(ray, tr.ray, x.nbytes + y.nbytes)
        self.actors = actors(ray, tr.ray.num_workers or int(ray.cluster_resources().get("CPU", 1)))
        setup = {
            "x": ray.put(x),  # once, read in place by every actor
            "y": ray.put(y),
            "parts": ray.put([p.numpy() for p in tr.parts]),
            "model": tr.layout.model,
            "seeds": tr.seeds,
            "augment": tr.augment,
            "rounds": tr.rounds,
            "vmap_chunk": tr.vmap_chunk,
            "loss_fn": tr.loss_fn,
        }
        self.setup = [ray.put(setup)]  # in a list: actors fetch it only the first time they serve this trainer
        self.setup_id = uuid.uuid4().hex
        weakref.finalize(self, _forget, list(self.actors), self.setup_id)

    def pids(self) -> list[int]:
        """Process ids of the actors (for memory measurements)."""
        return self.ray.get([a.pid.remote() for a in self.actors])

    def run(self, tr, starts, clients, round, rule, lr, steps, key) -> LocalResult:
        ray = self.ray
        rule_ref = ray.put(rule) if rule is not PLAIN else rule  # serialized once for all shards
        futures = []
        for actor, (lo, hi, s) in zip(self.actors, split_call(tr, starts, clients, steps, len(self.actors))):
            args = (tr.local, s.clone(), hi - lo, clients[lo:hi], round, rule_ref, lr, steps, key, lo)
            futures.append(actor.run.remote(self.setup_id, self.setup, *args))
        parts = ray.get(futures)
        cat = torch.cat
        return LocalResult(cat([p.params for p in parts]), cat([p.steps for p in parts]), cat([p.loss for p in parts]))


def pool(tr: LocalTrainer) -> RayPool:
    """The trainer's data and actors (shared with its shallow copies), set up on first use."""
    p = tr.shared.get("ray")
    if p is None:
        p = tr.shared["ray"] = RayPool(tr)
    return p


def run(
    tr: LocalTrainer,
    starts: torch.Tensor,
    clients: list[int],
    round: int,
    rule: LocalRule,
    lr: LR,
    steps: int | None,
    key: tuple[int, ...],
) -> LocalResult:
    return pool(tr).run(tr, starts, clients, round, rule, lr, steps, key)
