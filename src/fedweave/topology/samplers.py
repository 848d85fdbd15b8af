"""Who takes part in a round (DESIGN principle 11): registered, pluggable client samplers.

Every server-based topology (star, hierarchical, split) asks the run's sampler for round ``r``'s clients;
algorithms never draw clients themselves. A sampler is a function::

    sampler(num_clients, per_round, r, rng, *, rounds, **options) -> sorted client ids

with ``rng`` the round's ``("client_sampling", r)`` stream (so the same seed picks the same clients on every
backend and after a resume) and ``per_round`` the algorithm's ``clients_per_round``. Choose one with the
``sampler`` section of a config (``sampler: {name: schedule, clients: [[0, 1], [2, 3]]}``); register your
own with ``@SAMPLERS.register("name")`` (in a plug-in, for YAML configs).

The confederated family keeps its own vectorised uniform draw of ``m = sample_rate * P`` users per edge
server (spec A13) under the default; any other sampler is asked by each edge server for exactly m of its
users, on the ``("user_selection", k, server)`` stream (``ConfederatedAlgorithm._sampled_users``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedweave.config import ConfigError, check_options
from fedweave.registry import SAMPLERS


@SAMPLERS.register("uniform")
def uniform(num_clients: int, per_round: int, r: int, rng: np.random.Generator, *, rounds: int) -> np.ndarray:
    """``per_round`` clients uniformly without replacement (the default)."""
    return np.sort(rng.choice(num_clients, per_round, replace=False))


@SAMPLERS.register("bernoulli")
def bernoulli(num_clients: int, per_round: int, r: int, rng: np.random.Generator, *, rounds: int) -> np.ndarray:
    """Each client independently with probability ``per_round / num_clients``; drawn again when nobody is
    active (fedmim spec A6), so the expected number per round is ``per_round`` (slightly more)."""
    while True:
        active = np.flatnonzero(rng.random(num_clients) < per_round / num_clients)
        if len(active):
            return active


@SAMPLERS.register("fixed")
def fixed(
    num_clients: int, per_round: int, r: int, rng: np.random.Generator, *, rounds: int, clients: int | list[int] = 0
) -> np.ndarray:
    """The same clients every round: the first ``clients`` (an int; 0 = ``per_round``) or the given list.
    CSE-FSL's code parity: the authors' code always trains the first 5 F-EMNIST clients (spec A13)."""
    if isinstance(clients, int):
        k = clients or per_round
        if not 1 <= k <= num_clients:
            raise ConfigError(f"sampler.clients must be in [1, {num_clients}] (the number of clients), got {k}")
        return np.arange(k)
    return _checked(clients, num_clients, "sampler.clients")


@SAMPLERS.register("schedule")
def schedule(
    num_clients: int,
    per_round: int,
    r: int,
    rng: np.random.Generator,
    *,
    rounds: int,
    clients: list[list[int]] | None = None,
    file: str | None = None,
    cycle: bool = True,
) -> np.ndarray:
    """An explicit list of client lists, one per round (inline ``clients`` or a JSON ``file`` holding such a
    list), for matching another framework's participation exactly. ``cycle``: round r takes entry
    ``r % len``; otherwise the list must cover every round."""
    plan = _checked_plan(num_clients, rounds, clients, file, cycle, every=False)
    return _checked(plan[r % len(plan)], num_clients, f"sampler.clients[{r % len(plan)}]")


def _checked_plan(
    num_clients: int,
    rounds: int,
    clients: list[list[int]] | None = None,
    file: str | None = None,
    cycle: bool = True,
    every: bool = True,
) -> list[list[int]]:
    """The schedule's plan, its length checked against the run and, with ``every``, the client ids of every
    entry: ``make_sampler`` checks them all when the run is built, so that a bad entry for round 900 is not
    found in round 900 (each round then checks its own entry only)."""
    plan = _plan(clients, file)
    if not cycle and len(plan) < rounds:
        raise ConfigError(f"sampler: the schedule has {len(plan)} rounds but the run has {rounds} (or set cycle: true)")
    if every:
        for i, ids in enumerate(plan):
            _checked(ids, num_clients, f"sampler.clients[{i}]")
    return plan


def _plan(clients: list[list[int]] | None, file: str | None) -> list[list[int]]:
    if (clients is None) == (file is None):
        raise ConfigError("sampler 'schedule' needs exactly one of clients (a list of client lists) and file")
    if file is not None:
        path = Path(file).expanduser()
        try:
            clients = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"sampler.file {file!r} is not a readable JSON list of client lists ({e})") from e
    if not isinstance(clients, list) or not clients or not all(isinstance(c, list) and c for c in clients):
        raise ConfigError("sampler.clients must be a non-empty list of non-empty client lists, e.g. [[0, 1], [2, 3]]")
    return clients


def _checked(ids: list[int], num_clients: int, key: str) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"{key} must be a list of client ids, got {ids!r}")
    if len(np.unique(a)) != len(a) or a.min() < 0 or a.max() >= num_clients:
        raise ConfigError(f"{key} must hold distinct client ids in [0, {num_clients - 1}], got {ids!r}")
    return np.sort(a).astype(np.int64)


def make_sampler(
    ctx, per_round: int, num_clients: int | None = None, *, default: str = "uniform"
) -> Callable[[int], np.ndarray]:
    """Round -> client ids, from the run's ``sampler`` section (``default`` when it names the uniform default;
    options checked now, every entry of a ``schedule`` checked, and round 0 drawn once, so a bad schedule or
    client id is a configuration error before anything runs)."""
    section = ctx.config.sampler
    name = default if section.name == "uniform" and not section.options else section.name
    fn = SAMPLERS.get(name)
    opts = check_options(fn, section.options, "sampler", skip=("num_clients", "per_round", "r", "rng", "rounds"))
    n = ctx.num_clients if num_clients is None else num_clients
    rounds = ctx.config.rounds
    if not 1 <= per_round <= n:
        raise ConfigError(f"algorithm.clients_per_round ({per_round}) must be in [1, {n}] (the number of clients)")

    def sample(r: int) -> np.ndarray:
        return np.asarray(fn(n, per_round, r, ctx.seeds.numpy("client_sampling", r), rounds=rounds, **opts))

    check_every_round(fn, opts, n, rounds)
    sample(0)
    return sample


def check_every_round(fn: Callable, opts: dict, num_clients: int, rounds: int) -> None:
    """What sampler ``fn`` will be asked for in any round, checked now, when the run is built: every entry of
    a ``schedule`` (a bad entry for round 900 is a configuration error before round 1, not in round 900)."""
    if fn is schedule:
        _checked_plan(num_clients, rounds, **opts)
