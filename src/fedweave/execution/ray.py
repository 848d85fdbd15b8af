"""The ``ray`` backend: the jobs of each ``LocalTrainer.train`` call run as shards on Ray actors.

The jobs of a call are split into contiguous shards that balance the work (local steps) of the jobs, one
shard per actor. Each actor (one CPU) holds one reused template model and the training data (put once in
the object store and read in place), and runs its shard on the ``loop`` or ``vmap`` backend (chosen as
``auto`` would for the shard), with the same named seed streams as every other backend.

On a run placed on a GPU with ``ray.num_gpus_per_worker`` > 0 each actor also holds that (fractional)
share of a GPU: several actors share one GPU at 0.25 or 0.5. An actor places the data on its GPU once
and trains there in the run's precision; starts, rules and results travel through host memory (the object
store), so actors and driver never exchange device tensors. With ``num_gpus_per_worker: 0`` the actors
train on their CPUs and the driver moves the results to its device. The actors live as
long as the Ray session and serve every trainer of the process in turn (a sweep pays their start-up once);
an actor drops a trainer's model and data when the trainer is garbage-collected. The rule object
travels with the call and its per-job tensors are indexed by each job's position in the whole call, so
the results equal the ``loop`` backend's to float tolerance whatever the number of workers
(DESIGN principles 4 and 6).

Ray is optional (``pip install 'fedweave[ray]'``). By default fedweave starts a local Ray with one CPU per
worker, no dashboard and usage statistics off, whose files (logs, sockets, port files) are in a folder of its
own under the temporary directory, removed with the session: when a later run starts it again, or when the
process exits (the session shut down first, so that none of its processes outlives the process).
``ray.address`` connects to an existing cluster instead, whose nodes must have fedweave installed; fedweave
never shuts down or removes anything of a session it did not start.
"""

from __future__ import annotations

import atexit
import copy
import ipaddress
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
import warnings
import weakref
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedweave.config import ConfigError, LocalConfig, RayConfig, is_host_port
from fedweave.errors import WorkerLost
from fedweave.execution.job import PLAIN, LocalCall, LocalResult, LocalRule, backend
from fedweave.execution.local import LocalTrainer
from fedweave.execution.placement import move_tensors, resolve_placement
from fedweave.execution.shards import run_shard, split_call

# Set for a Ray that fedweave starts itself (the user's environment wins).
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
MB = 2**20
log = logging.getLogger("fedweave")
# The room a socket path has (AF_UNIX, the terminating NUL aside), and the longest one Ray makes below its
# temporary folder: the session's folder (named by the time and the driver's pid), then the object store's socket
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
RAY_SOCKET_TAIL = "/session_2026-01-01_00-00-00_000000_{pid}/sockets/plasma_store"
# short: under a sweep worker's TMPDIR (/tmp/fedweave-workers-XXXXXXXX) the socket paths take all 107 bytes
TEMP_PREFIX = "ray"


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
            # this actor's placement: its GPU share (Ray sets which GPU it sees) or its CPU, in the run's precision
            placement = resolve_placement(s["device"], s["precision"], s["memory"])
            tr = LocalTrainer(
                s["model"].to(placement.device), tx, ty, parts, LocalConfig(epochs=1), s["seeds"],
                augment=s["augment"], rounds=s["rounds"], vmap_chunk=s["vmap_chunk"], loss_fn=s["loss_fn"],
                placement=placement,
            )  # fmt: skip
            while len(self.trainers) >= self.KEEP:
                self.trainers.pop(next(iter(self.trainers)))
        self.trainers[setup_id] = tr  # most recently used last
        return tr

    def run(self, setup_id: str, setup: list, local: LocalConfig, call: LocalCall, rule: LocalRule) -> LocalResult:
        """Train a shard of a call; ``rule`` is the call's (an object-store reference resolved by Ray,
        fetched once for all shards), in place of the shard's own."""
        tr = self._trainer(setup_id, setup)
        if not tr.placement.on_cpu:  # the rule's tensors travel on the host; they compute here
            rule = move_tensors(rule, tr.placement.device)
        res = run_shard(tr, local, replace(call, rule=rule))
        host = tr.placement.host  # results travel through the object store in host memory
        return LocalResult(host(res.params), host(res.steps), host(res.loss))

    def forget(self, setup_id: str) -> None:
        self.trainers.pop(setup_id, None)

    def pid(self) -> int:
        return os.getpid()


# The local Ray that fedweave started in this process (none: the caller's ``ray.init``, a cluster, or none up)
_OWN: dict[str, Any] = {}
_OWN_EXIT: list[int] = []  # the exit handler is registered (once a process)


def _own_session(ray: Any) -> bool:
    """Whether the Ray session up in this process is the local one fedweave started, which it may shut down and
    start again: never the caller's ``ray.init`` or a cluster's. Its session name is unique to each start (a
    caller who shut it down and started their own has another one); the process id keeps a forked child, which
    shares the parent's handles, from shutting down the parent's Ray."""
    if not _OWN or not ray.is_initialized() or _OWN["pid"] != os.getpid():
        return False
    return ray.get_runtime_context().get_session_name() == _OWN["session"]


def _temp_dir() -> str:
    """A new folder of fedweave's own for the local Ray it starts (Ray's ``_temp_dir``; Ray's default is
    ``$TMPDIR/ray``, shared by every session and never cleaned): under ``RAY_TMPDIR``, else the temporary
    directory, else ``/tmp`` where those are too deep for the Unix sockets Ray makes in it."""
    base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    tail = f"/{TEMP_PREFIX}xxxxxxxx" + RAY_SOCKET_TAIL.format(pid=os.getpid())
    if len(os.fsencode(base + tail)) > SOCKET_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=base)


def _remove(folder: str) -> None:
    """Remove a shut-down session's folder. Its processes end on their own just after ``ray.shutdown`` returns
    (the raylet stops its agents as it exits), and may write a last log line meanwhile: tried again briefly."""
    for _ in range(50):
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.lexists(folder):
            return
        time.sleep(0.1)
    log.warning("could not remove the local Ray session's folder %s", folder)


def _end_own(ray: Any = None) -> None:
    """Shut down fedweave's own local Ray, if it is up, remove its folder and forget it; a folder of one the
    caller shut down goes too. Never another process's (a forked child inherits ``_OWN`` and the exit handler),
    nor a session fedweave did not start. Also the exit handler (registered after Ray's import, so run before
    Ray's own): ``ray`` then read from the loaded modules."""
    ray = ray or sys.modules.get("ray")
    if ray is not None and _own_session(ray):
        ray.shutdown()
    elif _OWN.get("pid") != os.getpid():
        return
    _remove(_OWN["temp_dir"])
    _OWN.clear()


def _wanted_cpus(cfg: RayConfig) -> int:
    return cfg.num_workers or len(os.sched_getaffinity(0))


def _restart_own(cfg: RayConfig) -> bool:
    """Whether fedweave's own local Ray must be started again for this run: it asks for more workers than it
    has CPUs (one actor each), or for another object store cap than the one it was started with."""
    store = cfg.object_store_memory_mb
    return _wanted_cpus(cfg) > _OWN["cpus"] or (store is not None and store != _OWN["store_mb"])


def _start_ray(ray: Any, cfg: RayConfig, data_bytes: int) -> None:
    cpus = _wanted_cpus(cfg)
    if ray.is_initialized():  # the user's, a cluster's, or the local Ray an earlier run of the process started
        if not _own_session(ray):  # never shut down; a conflicting ray.address was refused by check_session
            return
        if cfg.address is None and not _restart_own(cfg):
            return
        if cfg.address is not None and (cfg.address == "auto" or _names_gcs(ray, cfg.address)):
            return  # "auto" (any session up) or the session's own address: it is the cluster named
        # fedweave's own local session, and this run names a cluster (before, the run silently stayed on the
        # local Ray), or the session is too small for this run (or has another store cap): it is shut down,
        # and the cluster connected to or a local one sized for both the earlier runs and this one started
        # (the earlier runs' actors go with it; a new trainer starts its own)
        cpus = max(cpus, _OWN["cpus"])
    _end_own(ray)  # fedweave's own session, shut down here; or none up: the folder of one the caller shut down
    if cfg.address is not None:  # (where nothing listens was refused when the run was built: check_session)
        ray.init(address=cfg.address)
        return
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    store_mb = cfg.object_store_memory_mb or max(128, math.ceil(1.25 * data_bytes / MB) + 64)
    temp = _temp_dir()
    try:
        ray.init(
            address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=store_mb * MB,
            _temp_dir=temp,
        )  # fmt: skip
    except BaseException:
        if ray.is_initialized():
            ray.shutdown()
        _remove(temp)
        raise
    session = ray.get_runtime_context().get_session_name()
    _OWN.update(pid=os.getpid(), session=session, cpus=cpus, store_mb=store_mb, temp_dir=temp)
    if not _OWN_EXIT:  # registered after Ray's import, so run before Ray's own exit handler
        atexit.register(_end_own)
        _OWN_EXIT.append(os.getpid())


_ACTORS: dict[tuple[str, str, float], list] = {}  # (job id, node id, GPUs each) -> the actors of that session


def _check_cpus(ray: Any, n: int) -> None:
    """``n`` one-CPU actors must fit in the Ray session's CPUs: one line naming ``ray.num_workers`` if not."""
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if n > cpus:
        raise ConfigError(f"ray.num_workers ({n}) exceeds the CPUs of the Ray cluster ({cpus})")


def check_session(cfg: RayConfig) -> None:
    """The ``ray`` section against a Ray session already up in this process, when the run is built: at its first
    training call the run had already written its files. ``ray.num_workers`` must fit in the CPUs of a session
    fedweave did not start (the caller's ``ray.init``, a cluster), which fedweave never shuts down; and
    ``ray.object_store_memory_mb`` cannot change its store: one warning line, unless it was started with that
    store; ``ray.address`` must name that session (:func:`_check_address`), and without one, an address where
    something listens (:func:`_check_listening`). The local Ray that an earlier run
    of a notebook or an in-process sweep started is started again with more CPUs or the asked store, or left
    for the cluster ``ray.address`` names, when the run first trains (:func:`_start_ray`). A session not yet up is
    not started here: fedweave starts a local one with ``num_workers`` CPUs (nothing to exceed), and a
    cluster's CPUs (``ray.address``) are known only once connected, at the first training call."""
    ray = sys.modules.get("ray")  # never imported: no session (and no import cost)
    if ray is None or not ray.is_initialized() or _own_session(ray):  # fedweave's own: started again as needed
        if cfg.address is not None:  # the cluster the first training call connects to: before the run writes
            _check_listening(cfg.address)
        return
    if cfg.address is not None:
        _check_address(ray, cfg.address)
    store = cfg.object_store_memory_mb
    have = ray.cluster_resources().get("object_store_memory", 0)
    if store is not None and have != store * MB:  # a session started with this store is what was asked for
        log.warning(
            "ray.object_store_memory_mb (%d) changes nothing: the run uses the Ray session already up in this "
            "process, whose object store (%d MB) was sized when it started",
            store, round(have / MB),
        )  # fmt: skip
    if cfg.num_workers is not None:
        _check_cpus(ray, cfg.num_workers)


def _check_listening(address: str) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) cluster address where something accepts a connection: with
    nothing listening there, ``ray.init`` retried for minutes before its own error. ``auto`` and ``local`` are
    Ray's to resolve."""
    target = address.split("://")[-1]
    if not is_host_port(target):
        return
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise ConfigError(
            f"ray.address {address!r}: nothing accepts a connection there ({e.strerror or e}); start the cluster "
            "first (ray start --head) or drop ray.address to run on a local Ray"
        ) from None


def _check_address(ray: Any, address: str) -> None:
    """``ray.address`` against the caller's Ray session already up in this process, which fedweave uses and
    never shuts down: one line when it names another cluster (before, the run silently used the session up).
    ``auto`` is any session; a ``ray://`` client address names a client server, not a cluster's GCS address,
    and cannot be compared; ``host:port`` must be the session's GCS address (a loopback host standing for this
    machine)."""
    if address == "auto" or "://" in address:
        return
    gcs = ray.get_runtime_context().gcs_address
    if not _names_gcs(ray, address):
        raise ConfigError(
            f"ray.address {address!r} is not the Ray session already up in this process ({gcs}): drop "
            f"ray.address to use that session, or call ray.shutdown() first to connect to {address!r}"
        )


def _names_gcs(ray: Any, address: str) -> bool:
    """Whether ``address`` (``host:port``) names the GCS of the Ray session up in this process (``ip:port``); a
    loopback host stands for this machine's address. A ``ray://`` client address names no GCS."""
    if "://" in address:
        return False
    host, _, port = address.rpartition(":")
    gcs_host, _, gcs_port = ray.get_runtime_context().gcs_address.rpartition(":")
    if port != gcs_port:
        return False
    try:
        ip = socket.gethostbyname(host)
    except OSError:  # a host name that does not resolve names no session here
        return False
    return ip == gcs_host or (ipaddress.ip_address(ip).is_loopback and gcs_host == ray.util.get_node_ip_address())


def actors(ray: Any, n: int, num_gpus: float = 0.0) -> list:
    """``n`` worker actors of the current Ray session holding ``num_gpus`` GPUs each (a fraction lets
    several share one), started on first need and then reused."""
    _check_cpus(ray, n)
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if num_gpus and n * num_gpus > gpus + 1e-9:
        raise ConfigError(
            f"ray.num_workers ({n}) x ray.num_gpus_per_worker ({num_gpus:g}) exceeds the GPUs of the Ray cluster "
            f"({gpus:g}); lower ray.num_gpus_per_worker (0.25: four actors share a GPU) or ray.num_workers"
        )
    ctx = ray.get_runtime_context()
    # the job id alone repeats across sessions (a fresh local Ray numbers its first job 01000000 again);
    # with the driver's node id, the handles of a shut-down session are never reused
    session = (ctx.get_job_id(), ctx.get_node_id())
    for old in [k for k in _ACTORS if k[:2] != session]:  # handles of an earlier, shut-down session
        del _ACTORS[old]
    have = _ACTORS.setdefault((*session, float(num_gpus)), [])
    remote = ray.remote(num_cpus=1, num_gpus=num_gpus)(Worker) if num_gpus else ray.remote(num_cpus=1)(Worker)
    have.extend(remote.remote() for _ in range(n - len(have)))
    return have[:n]


def _drop(actor: Any) -> None:
    """Forget a dead actor's handle, so that :func:`actors` starts a live one in its place."""
    for have in _ACTORS.values():
        if actor in have:
            have.remove(actor)


def _forget(actors: list, setup_id: str) -> None:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():  # shut down (at exit, say): a call would start a new local Ray
        return
    try:
        for a in actors:
            a.forget.remote(setup_id)
    except Exception:  # Ray already shut down: nothing to free
        pass


class RayPool:
    """A trainer's (and its shallow copies') data in the object store and the actors that serve it."""

    def __init__(self, tr: LocalTrainer) -> None:
        self.ray = ray = import_ray()
        pl = self.placement = tr.placement
        x = np.ascontiguousarray(pl.host(tr.host_x).numpy())
        y = np.ascontiguousarray(pl.host(tr.host_y).numpy())
        _start_ray(ray, tr.ray, x.nbytes + y.nbytes)
        gpus = tr.ray.num_gpus_per_worker if pl.device.type == "cuda" else 0.0  # GPU actors for a GPU run only
        self.actors = actors(ray, tr.ray.num_workers or int(ray.cluster_resources().get("CPU", 1)), gpus)
        model = tr.layout.model
        if not pl.on_cpu:  # the template travels on the host; each actor moves it where it computes
            model = copy.deepcopy(model).to("cpu")
        setup = {
            "x": ray.put(x),  # once, read in place by every actor
            "y": ray.put(y),
            "parts": ray.put(tr.parts.as_numpy()),
            "model": model,
            "device": "cuda" if gpus else "cpu",  # an actor sees its GPU as cuda (Ray sets which one)
            "precision": pl.precision,
            "memory": pl.memory,
            "seeds": tr.seeds,
            "augment": tr.augment,
            "rounds": tr.rounds,
            "vmap_chunk": tr.vmap_chunk if pl.on_cpu else None,  # a GPU actor sizes its own chunks
            "loss_fn": tr.loss_fn,
        }
        self.setup = [ray.put(setup)]  # in a list: actors fetch it only the first time they serve this trainer
        self.setup_id = uuid.uuid4().hex
        weakref.finalize(self, _forget, list(self.actors), self.setup_id)

    def pids(self) -> list[int]:
        """Process ids of the actors (for memory measurements)."""
        return self.ray.get([a.pid.remote() for a in self.actors])

    def run(self, tr: LocalTrainer, call: LocalCall) -> LocalResult:
        ray, pl = self.ray, self.placement
        rule = call.rule
        if rule is not PLAIN and not pl.on_cpu:
            rule = move_tensors(rule, torch.device("cpu"))  # device tensors travel through the host
        # serialized once for all shards, and passed beside each shard (Ray resolves a top-level reference
        # only): the shard itself travels with the plain rule in its place
        rule_ref = ray.put(rule) if rule is not PLAIN else rule
        futures = []
        for actor, shard in zip(self.actors, split_call(tr, call, len(self.actors))):
            shard = replace(shard, starts=pl.host(shard.starts).clone(), rule=PLAIN)
            futures.append(actor.run.remote(self.setup_id, self.setup, tr.local, shard, rule_ref))
        parts, lost = [], None
        for k, future in enumerate(futures):  # each shard's reply, so that a dead actor is known by its place
            try:
                parts.append(ray.get(future))
            except ray.exceptions.RayActorError as e:
                lost = (k, e) if lost is None else lost
        if lost is not None:
            k, e = lost
            _drop(self.actors[k])  # the next trainer of this session starts a live actor in its place
            pid = re.search(r"\bpid: (\d+)", str(e))
            who = f"worker {k} (pid {pid[1]})" if pid else f"worker {k}"
            how = "died (a Ray actor killed from outside, e.g. by the out-of-memory killer)"
            raise WorkerLost.of("ray", f"{who} {how}", "ray.num_workers") from e
        cat, to = torch.cat, pl.to
        params, nsteps, loss = (cat([getattr(p, k) for p in parts]) for k in ("params", "steps", "loss"))
        return LocalResult(to(params), to(nsteps), to(loss))


def pool(tr: LocalTrainer) -> RayPool:
    """The trainer's data and actors (shared with its shallow copies), set up on first use."""
    p = tr.shared.get("ray")
    if p is None:
        p = tr.shared["ray"] = RayPool(tr)
    return p


@backend("ray")
def run(tr: LocalTrainer, call: LocalCall) -> LocalResult:
    return pool(tr).run(tr, call)
