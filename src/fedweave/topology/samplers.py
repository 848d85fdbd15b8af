"""Who takes part in a round (DESIGN principle 11): registered, pluggable client samplers.

Every server-based topology (star, hierarchical, split) asks the run's sampler for round ``r``'s clients;
algorithms never draw clients themselves. A sampler is a function::

    sampler(num_clients, per_round, r, rng, *, rounds, **options) -> client ids

with ``rng`` the round's ``("client_sampling", r)`` stream (so the same seed picks the same clients on every
backend and after a resume) and ``per_round`` the algorithm's ``clients_per_round``; the ids it returns are
checked every round (distinct integers in ``[0, num_clients)``, :func:`drawn`) and sorted. Choose one with the
``sampler`` section of a config (``sampler: {name: schedule, clients: [[0, 1], [2, 3]]}``); register your
own with ``@SAMPLERS.register("name")`` (in a plug-in, for YAML configs).

A sampler that draws its clients in proportion to their sizes (the built-in ``power_of_choice``) declares it
with :func:`by_size`: its draw already counts each client's size, so the family aggregates the round's clients
with equal weights rather than weighing them by their sizes a second time (:func:`weighting_under`).

A sampler that selects by what it knows of the clients (the built-in ``power_of_choice`` and ``oort``) declares
a ``context`` keyword and gets a read-only :class:`SamplerContext`: each client's number of training samples,
its last reported training loss and the round it last reported, and the round by which every client with data
had reported, as of the start of round ``r``, and a callable ``loss_at_model`` that has given clients evaluate
the current global model on their training data. The centralized family gives one
(``StarAlgorithm.client_history``; its ledger bills each reported loss, one float up with the client's upload,
and keeps the table as server storage: ``StarAlgorithm.report_losses``; and each ``loss_at_model`` call as the
model down to each client and its loss up: ``StarAlgorithm.candidate_losses``); the others refuse such a
sampler with one line.

The confederated family keeps its own vectorised uniform draw of ``m = sample_rate * P`` users per edge
server (spec A13) under the default; any other sampler is asked by each edge server for exactly m of its
users, on the ``("user_selection", k, server)`` stream (``ConfederatedAlgorithm._sampled_users``).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedweave.config import ConfigError, check_options
from fedweave.registry import SAMPLERS

log = logging.getLogger("fedweave")


@SAMPLERS.register("uniform")
def uniform(num_clients: int, per_round: int, r: int, rng: np.random.Generator, *, rounds: int) -> np.ndarray:
    """``per_round`` clients uniformly without replacement (the default)."""
    return np.sort(rng.choice(num_clients, per_round, replace=False))


@SAMPLERS.register("bernoulli")
def bernoulli(
    num_clients: int, per_round: int, r: int, rng: np.random.Generator, *, rounds: int, redraw: bool = True
) -> np.ndarray:
    """Each client independently with probability ``per_round / num_clients``; drawn again when nobody is
    active (fedmim spec A6), so the expected number per round is ``per_round`` (slightly more). ``redraw``
    false: an empty draw is returned as it is (pure Poisson sampling, what a private run's accountant assumes;
    the ``privacy`` section sets it, docs/privacy.md)."""
    while True:
        active = np.flatnonzero(rng.random(num_clients) < per_round / num_clients)
        if len(active) or not redraw:
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
            raise ConfigError(f"sampler.clients must be in [1, {num_clients}] (the number of clients), got {k:.6g}")
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
    unit: str = "rounds",
    note: str = "",
) -> list[list[int]]:
    """The schedule's plan, its length checked against the run and, with ``every``, the client ids of every
    entry: ``make_sampler`` checks them all when the run is built, so that a bad entry for round 900 is not
    found in round 900 (each round then checks its own entry only). ``unit`` names what one entry is for
    (``note``: how the run's count of them is made), for a family that asks its sampler other than per round."""
    plan = _plan(clients, file)
    if not cycle and len(plan) < rounds:
        raise ConfigError(
            f"sampler: the schedule has {len(plan)} {unit} but the run has {rounds}{note} (or set cycle: true)"
        )
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


def drawn(ids: Any, num_clients: int, who: str) -> np.ndarray:
    """What a sampler returned (``who`` names it and its round) as the sorted int64 client ids every family
    takes: a 1-D list, array or tensor of distinct integer ids in ``[0, num_clients)``, in any order, or none (a
    round nobody takes part in). Anything else is one :class:`ConfigError` naming ``who``, where a repeated id
    would have trained one client twice in the round and ``-1`` would have indexed the last client, silently."""
    a = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids)
    if a.ndim == 1 and a.size == 0:
        return np.zeros(0, dtype=np.int64)
    shown = np.array2string(a, threshold=12, separator=", ") if a.ndim else repr(ids)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"{who} returned {shown}; a sampler returns a 1-D list or array of integer client ids")
    if len(np.unique(a)) != len(a) or a.min() < 0 or a.max() >= num_clients:
        raise ConfigError(f"{who} returned {shown}; a sampler returns distinct client ids in [0, {num_clients - 1}]")
    return np.sort(a).astype(np.int64)


def by_size(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """Declares that sampler ``fn`` draws clients with probability proportional to their sizes (a decorator,
    under the registration): the family then averages the round's clients with equal weights
    (:func:`weighting_under`), as the analyses of such draws do (Li et al. 2020's scheme; Cho et al. 2022)."""
    fn.draws_by_size = True  # type: ignore[attr-defined]
    return fn


def draws_by_size(fn: Callable[..., Any]) -> bool:
    """True when sampler ``fn`` declared with :func:`by_size` that it draws clients in proportion to their sizes."""
    return bool(getattr(fn, "draws_by_size", False))


@SAMPLERS.register("power_of_choice")
@by_size
def power_of_choice(
    num_clients: int,
    per_round: int,
    r: int,
    rng: np.random.Generator,
    *,
    rounds: int,
    context: SamplerContext,
    d: int | None = None,
    variant: str = "rpow-d",
    batch: int | None = None,
) -> np.ndarray:
    """Power-of-choice (Cho, Wang and Joshi, AISTATS 2022, pi_pow-d): ``d`` candidates drawn without replacement
    with probability proportional to their sizes, then the ``per_round`` of them with the highest loss.

    Which loss is the paper's ``variant`` (its Algorithm 1 and Sec. 4):

    - ``rpow-d`` (the default): each candidate's last reported mean training loss (the context's ``last_loss``),
      no extra round trip; a candidate never heard from counts as the highest;
    - ``pow-d``: the server sends the current global model to the d candidates and each computes its loss
      ``F_k(w)`` on its whole training data (the context's ``loss_at_model``); the selected ones train from
      the model they evaluated, which is not sent to them again;
    - ``cpow-d``: the same on a mini-batch of ``batch`` of its samples (all of them where it holds fewer).

    Under faults a candidate that drops out of round ``r`` sends no loss (NaN from ``loss_at_model``) and is
    not selected: the ``per_round`` highest of the losses that arrived train (all of them where fewer arrived;
    none in an outage round). ``rpow-d`` asks nothing in the round, so it ranks by the last reported losses
    as without faults; a selected client that drops out keeps its older loss in the table.

    Ties keep the candidates' random order. ``d`` (default ``2 * per_round``, at most the number of clients with
    data) must be at least ``per_round``; ``d = per_round`` is a size-proportional draw, larger ``d`` selects
    more by loss. ``pow-d`` and ``cpow-d`` need a family whose context evaluates the global model (the
    centralized family, which bills the model down to each candidate and its loss up).

    The draw already counts the sizes, so the selected clients are averaged with equal weights, the paper's
    ``(1/m) sum_{k in S}`` (its update rule, Sec. 2): declared with :func:`by_size`."""
    sizes = context.sizes.astype(np.float64)
    holders = int((sizes > 0).sum())
    if per_round > holders:  # no d can be both >= per_round and <= holders: the round itself is too large
        raise ConfigError(
            f"algorithm.clients_per_round ({per_round}) must be at most {holders} under sampler power_of_choice "
            f"(the clients with data, from which its candidates are drawn)"
        )
    d = min(2 * per_round, holders) if d is None else d
    if not isinstance(d, int) or not per_round <= d <= holders:
        raise ConfigError(
            f"sampler.d must be an integer in [{per_round}, {holders}] (clients_per_round .. the clients with "
            f"data), got {f'{d:.6g}' if isinstance(d, int) else repr(d)}"
        )
    _check_variant(variant, batch)
    candidates = rng.choice(num_clients, d, replace=False, p=sizes / sizes.sum())
    if variant == "rpow-d":
        loss = np.nan_to_num(context.last_loss[candidates], nan=np.inf)  # never reported: first
    else:  # Algorithm 1, lines 3-4: the candidates' losses of the current global model, top per_round train
        if context.loss_at_model is None:
            raise ConfigError(
                f"sampler.variant: {variant} has the candidates evaluate the global model, which this family's "
                "context does not do; use it with a centralized algorithm, or variant: rpow-d"
            )
        loss = np.asarray(context.loss_at_model(candidates, r, batch), dtype=np.float64)
    order = np.argsort(-loss, kind="stable")
    # a candidate that sent no loss (NaN: it dropped out of round r, so it would not train either) is not
    # selectable; fewer than per_round answers: the round takes those that answered
    order = order[~np.isnan(loss[order])]
    return np.sort(candidates[order[:per_round]])


POWER_OF_CHOICE_VARIANTS = ("rpow-d", "pow-d", "cpow-d")  # Cho et al. 2022, Sec. 4


def _check_variant(variant: Any, batch: Any) -> None:
    """One line for a ``variant`` the paper does not name, or a ``batch`` that is not cpow-d's mini-batch."""
    if variant not in POWER_OF_CHOICE_VARIANTS:
        raise ConfigError(f"sampler.variant must be one of {', '.join(POWER_OF_CHOICE_VARIANTS)}, got {variant!r}")
    if variant != "cpow-d" and batch is not None:
        raise ConfigError(
            f"sampler.batch is cpow-d's mini-batch size; set variant: cpow-d or leave batch out (variant: {variant})"
        )
    if variant == "cpow-d" and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ConfigError(f"sampler.batch (cpow-d's mini-batch size b) must be an integer >= 1, got {batch!r}")


@SAMPLERS.register("oort")
def oort(
    num_clients: int,
    per_round: int,
    r: int,
    rng: np.random.Generator,
    *,
    rounds: int,
    context: SamplerContext,
    explore: float = 0.9,
    explore_decay: float = 0.95,
    explore_min: float = 0.2,
    staleness: float = 0.1,
    cut_off: float = 0.7,
    sample_window: float = 5.0,
    clip_bound: float = 0.98,
) -> np.ndarray:
    """Oort's training selector (Lai, Zhu, Madhyastha and Chowdhury, OSDI 2021), statistical utility only, as
    the authors' code selects (SymbioticLab/Oort, oort/oort.py, ``_training_selector.getTopK``).

    The clients are those holding data (the authors register only clients with enough samples). Of the
    round's ``K`` slots, ``int(K (1 - eps_r))`` (``exploitLen``), with ``eps_r = max(explore_min, explore *
    explore_decay^(r + 1))`` (decayed before every selection, the first included; 0 for good from the
    selection after the first that finds every client explored), go to explored clients (those that reported
    before), at most as many as there are. Each explored client's score is

        U_i = (min(R_i, clip) - R_min) / range + sqrt(staleness * log(T) / L_i)

    with ``R_i = n_i l_i`` its reward (``n_i`` its size, ``l_i`` its last reported mean training loss),
    ``T = r + 1`` the selection and ``L_i`` the round it last reported in (both counted from 1). ``clip``,
    ``R_min`` and ``range`` come from the positive rewards of all the clients, an unexplored one's reward
    being its size (the authors' initial reward): ``clip`` the value at rank ``int(clip_bound * count)`` of
    them sorted, ``R_min`` 0.999 times the least, ``range`` the largest minus ``R_min``, at least 1e-4. The
    exploited clients are drawn without replacement with probability proportional to ``U_i`` among those
    whose score is at least ``cut_off`` times the score of the ``(exploitLen + 1)``-th best (all of them when
    there is no such client). The other slots go to unexplored clients, drawn without replacement with
    probability proportional to their sizes among the ``int(sample_window * exploreLen)`` largest; slots
    still empty (fewer unexplored clients than slots) go to the remaining clients uniformly at random. Ties
    in any ordering keep a random order. The defaults are the authors' (``training/argParser.py``:
    exploration_factor, exploration_decay, exploration_min, cut_off_util, sample_window, clip_bound; the 0.1
    of the staleness bonus is written into their getTopK).

    Not the authors' selector: the reward uses the mean training loss where the authors take the root mean
    square of the per-sample losses (the context keeps the mean) and the client's full size where they cap it
    at the samples one round trains on (a fedweave round goes over the client's data); there is no system
    utility (no client speed model, so the authors' duration penalty and its pacer, which only moves the
    preferred round duration, do not apply), and no blacklist (off by default in the authors' code). Round 0
    is selected by it too, all exploration, where the authors' training harness draws its first round's
    clients uniformly before the selector's first call. Where the authors' code stops on an error, this
    goes on: when every explored client is exploited there is no score past them to cut at (all are
    candidates), the cut-off keeps at least the top ``exploitLen + 1`` (a loss of 0 scores below zero), and a
    NaN loss scores nothing (weight 0)."""
    for key, v, lo, hi in (
        ("explore", explore, 0, 1),
        ("explore_decay", explore_decay, 0, 1),
        ("cut_off", cut_off, 0, 1),
        ("clip_bound", clip_bound, 0, 1),
    ):
        if not lo <= v <= hi:
            raise ConfigError(f"sampler.{key} must be in [{lo}, {hi}], got {v}")
    if not 0 <= explore_min <= explore:
        raise ConfigError(f"sampler.explore_min must be in [0, explore = {explore}], got {explore_min}")
    if not staleness >= 0:
        raise ConfigError(f"sampler.staleness must be >= 0, got {staleness}")
    if not sample_window >= 1:  # the window must hold the clients to explore
        raise ConfigError(f"sampler.sample_window must be >= 1, got {sample_window}")
    sizes = context.sizes.astype(np.float64)
    holders = int((sizes > 0).sum())
    if per_round > holders:
        raise ConfigError(
            f"algorithm.clients_per_round ({per_round}) must be at most {holders} under sampler oort "
            f"(the clients with data, from which it selects)"
        )
    order = rng.permutation(num_clients)  # a random order breaks ties
    order = order[sizes[order] > 0]
    seen = context.last_round[order] >= 0
    fresh, known = order[~seen], order[seen]
    eps = max(explore_min, explore * explore_decay ** (r + 1))
    # the authors set the factor and its floor to 0 for good in the first selection that finds no client left
    # unexplored (getTopK's else branch; that selection itself still used the decayed factor). A client once
    # explored stays so, so this happened before round r exactly when every client with data had first
    # reported before round r - 1
    if 0 <= context.all_reported[0] <= r - 2:
        eps = 0.0
    # the authors' exploitLen = int(numOfSamples * (1.0 - exploration)) (oort/oort.py, getTopK), in the same
    # float arithmetic: exploration takes the remaining slots, eps K rounded up (2.5 of 5 slots: 3), never to even
    n_exploit = min(int(per_round * (1.0 - eps)), len(known))
    # the rewards: n_i l_i for an explored client, its size for an unexplored one (the authors' initial reward)
    reward = np.where(context.last_round >= 0, sizes * context.last_loss, sizes)
    positive = reward[order]
    positive = np.sort(positive[np.isfinite(positive) & (positive > 0)])  # an infinite loss is clipped below
    if len(positive):  # the authors' get_norm(clip_bound) over the positive rewards
        clip = positive[min(int(len(positive) * clip_bound), len(positive) - 1)]
        low = positive[0] * 0.999
        span = max(positive[-1] - low, 1e-4)
    else:
        clip, low, span = 0.0, 0.0, 1e-4
    last = context.last_round[known].astype(np.float64) + 1
    score = (np.minimum(reward[known], clip) - low) / span + np.sqrt(staleness * np.log(r + 1) / last)
    # a client whose last loss is NaN (its training diverged) has no score: last in line, weight 0 (taken only
    # when the others cannot fill its slots), where the draw would otherwise fail on a NaN probability
    score = np.where(np.isnan(score), -np.inf, score)
    ranked = np.argsort(-score, kind="stable")
    if n_exploit < len(known):  # the cut-off: a fraction of the score just past the top exploitLen
        passed = int((score >= score[ranked[n_exploit]] * cut_off).sum())  # a prefix of the ranking
        # never fewer than those exploitLen + 1: a negative score (a loss of 0, below R_min) times cut_off is
        # above itself, and would pass none of them (the authors' draw then fails on an empty list)
        ranked = ranked[: max(n_exploit + 1, passed)]
    exploited = _proportional(rng, known[ranked], score[ranked], n_exploit)
    n_explore = min(len(fresh), per_round - n_exploit)
    window = fresh[np.argsort(-sizes[fresh], kind="stable")][: min(int(sample_window * n_explore), len(fresh))]
    explored = _proportional(rng, window, sizes[window], n_explore)
    picked = np.concatenate([exploited, explored])
    rest = np.setdiff1d(order, picked)  # slots still empty: any other client, uniformly (the authors' fill)
    filled = rng.choice(rest, per_round - len(picked), replace=False)
    return np.sort(np.concatenate([picked, filled]))


def _proportional(rng: np.random.Generator, ids: np.ndarray, weight: np.ndarray, k: int) -> np.ndarray:
    """``k`` of ``ids`` drawn without replacement with probability proportional to ``weight`` (numpy's
    ``choice(p=...)``, as the authors draw); where fewer than ``k`` weigh more than nothing, those are all
    taken and the rest drawn uniformly from the others."""
    w = np.maximum(weight, 0.0)
    pos = w > 0
    n = min(k, int(pos.sum()))
    first = rng.choice(ids[pos], n, replace=False, p=w[pos] / w[pos].sum()) if n else ids[:0]
    rest = rng.choice(ids[~pos], k - n, replace=False) if k > n else ids[:0]
    return np.concatenate([first, rest])


# the arguments fedweave gives a sampler; the other keywords are its options (the ``sampler`` section)
SAMPLER_ARGS = ("num_clients", "per_round", "r", "rng", "rounds", "context")


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class SamplerContext:
    """What a sampler may read about the clients at the start of a round (read-only views, kept current by
    the family that owns the :class:`ClientHistory`)."""

    sizes: np.ndarray  # (n,) int64: each client's number of training samples
    last_loss: np.ndarray  # (n,) float64: each client's last reported mean training loss; NaN if it never reported
    last_round: np.ndarray  # (n,) int64: the last round in which each client reported; -1 if it never did
    all_reported: np.ndarray  # (1,) int64: the round in which the last client with data first reported; -1 before
    # (candidates, r, batch) -> (len(candidates),) float64: each candidate's mean training loss of the current
    # global model (on a mini-batch of ``batch`` of its samples; None: all of them), as a float of the run's
    # width, evaluated only when called (power_of_choice's pow-d and cpow-d); NaN for a candidate that sent
    # none (it dropped out of round r under faults); None where the family gives none
    loss_at_model: Callable[[np.ndarray, int, int | None], np.ndarray] | None = None


@dataclass
class ClientHistory:
    """The family's record behind a :class:`SamplerContext`: it writes, the sampler reads (``context``)."""

    sizes: np.ndarray
    loss_at_model: Callable[[np.ndarray, int, int | None], np.ndarray] | None = None  # the context's, as given
    last_loss: np.ndarray = field(init=False)
    last_round: np.ndarray = field(init=False)
    all_reported: np.ndarray = field(init=False)
    unheard: int = field(init=False)  # the clients with data that never reported
    context: SamplerContext = field(init=False)  # read-only views of the four, and loss_at_model

    def __post_init__(self) -> None:
        self.sizes = np.asarray(self.sizes, dtype=np.int64)
        self.last_loss = np.full(len(self.sizes), np.nan)
        self.last_round = np.full(len(self.sizes), -1, dtype=np.int64)
        self.all_reported = np.full(1, -1, dtype=np.int64)  # one number, not one per client (no memory per client)
        self.unheard = int((self.sizes > 0).sum())
        views = (self.sizes, self.last_loss, self.last_round, self.all_reported)
        self.context = SamplerContext(*(_read_only(a) for a in views), self.loss_at_model)

    def record(self, r: int, clients: np.ndarray, losses: Any) -> None:
        """The clients that reported in round ``r`` and their mean training losses (a tensor or an array)."""
        if isinstance(losses, torch.Tensor):  # wherever it was computed: a copy, the computation is untouched
            losses = losses.detach().to("cpu", torch.float64).numpy()
        if self.unheard:
            new = np.unique(clients[(self.last_round[clients] < 0) & (self.sizes[clients] > 0)])
            self.unheard -= len(new)
            if not self.unheard:
                self.all_reported[0] = r
        self.last_loss[clients] = losses
        self.last_round[clients] = r

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors (a checkpoint is read with ``weights_only=True``): the losses and rounds recorded so far."""
        return {
            "last_loss": torch.tensor(self.last_loss, device="cpu"),  # host bookkeeping; checkpoints hold CPU tensors
            "last_round": torch.tensor(self.last_round, device="cpu"),
            "all_reported": torch.tensor(self.all_reported, device="cpu"),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the losses and rounds recorded before a checkpoint (:meth:`state_dict`'s tensors)."""
        self.last_loss[:] = state["last_loss"].cpu().numpy()  # in place: the context's views stay valid
        self.last_round[:] = state["last_round"].cpu().numpy()
        holders = self.sizes > 0
        self.unheard = int((self.last_round[holders] < 0).sum())
        if "all_reported" in state:
            self.all_reported[:] = state["all_reported"].cpu().numpy()
        else:  # a checkpoint from before it was kept: the latest last round bounds it (the sampler that reads it,
            # oort, selected otherwise then, so such a run does not continue as it was whatever is taken here)
            self.all_reported[0] = -1 if self.unheard or not holders.any() else int(self.last_round[holders].max())


def reads_context(fn: Callable[..., Any]) -> bool:
    """True when sampler ``fn`` declares a ``context`` keyword (it selects by what it knows of the clients)."""
    return "context" in inspect.signature(fn).parameters


def check_signature(name: str, fn: Callable[..., Any], options: dict[str, Any]) -> None:
    """One line for a registered sampler that cannot be called the way every family calls one (a plug-in that
    left out ``rounds``, say), when the run is built rather than as a TypeError in its first round."""
    extra = {"context": None} if reads_context(fn) else {}
    try:
        inspect.signature(fn).bind(1, 1, 0, None, rounds=1, **extra, **options)
    except TypeError as e:
        raise ConfigError(
            f"sampler {name!r} must take (num_clients, per_round, r, rng, *, rounds, **options) (and a context "
            f"keyword to read one): {e}"
        ) from e


def refuse_context(name: str, fn: Callable[..., Any], family: str) -> None:
    """One line for a sampler that reads a context the ``family`` does not give."""
    if reads_context(fn):
        raise ConfigError(
            f"sampler {name!r} reads the clients' context (sizes, last losses, last rounds), which the {family} "
            "family does not give; use it with a centralized algorithm, or a sampler without a context argument"
        )


@dataclass
class Sampler:
    """Round -> client ids: the registered function with the run's arguments and options."""

    name: str
    fn: Callable[..., np.ndarray]
    num_clients: int
    per_round: int
    rounds: int
    options: dict[str, Any]
    seeds: Any  # the run's Seeds: round r draws from its own ("client_sampling", r) stream
    context: SamplerContext | None = None
    reads_context: bool = field(init=False)  # the function declares a ``context`` keyword
    draws_by_size: bool = field(init=False)  # the function draws clients in proportion to their sizes (by_size)
    empty: set[int] = field(init=False, default_factory=set)  # the rounds it chose nobody for (said once each)
    first: np.ndarray | None = field(init=False, default=None)  # round 0's draw when the run was built
    user_made: bool = field(init=False)  # a plug-in's function, not one of fedweave's

    def __post_init__(self) -> None:
        self.reads_context = reads_context(self.fn)
        self.draws_by_size = draws_by_size(self.fn)
        self.user_made = not (getattr(self.fn, "__module__", None) or "").startswith("fedweave.")

    def fewest(self) -> int:
        """The fewest clients the sampler gives in a round of the run, where that is known when the run is built:
        ``fixed``'s clients, the shortest entry of a ``schedule`` that the run's rounds use; ``per_round`` for the
        others (a draw of that many; bernoulli's count is random, and each round checks its own). What a robust
        aggregator's bound is checked against before round 0."""
        if self.fn is fixed:
            chosen = self.options.get("clients", 0)
            return len(chosen) if isinstance(chosen, list) else (chosen or self.per_round)
        if self.fn is schedule:
            plan = _plan(self.options.get("clients"), self.options.get("file"))
            return min(len(ids) for ids in plan[: self.rounds])  # round r takes entry r % len(plan)
        return self.per_round

    def sizes(self) -> tuple[int, ...]:
        """Every count of clients the sampler gives in a round of the run, where known when the run is built,
        ascending: ``fixed``'s one, the lengths of the ``schedule`` entries the run's rounds use, ``per_round``
        for the others. What a robust aggregator's bound is checked against before round 0: a bound that reads
        ``f`` from the round's count (a share of attackers, rounded up) is not monotone in it, so the fewest
        alone is not the worst (Bulyan with a fifth of the clients: 15 pass, 16 need 19)."""
        if self.fn is schedule:
            plan = _plan(self.options.get("clients"), self.options.get("file"))
            return tuple(sorted({len(ids) for ids in plan[: self.rounds]}))
        return (self.fewest(),)

    def expected(self, rounds: int | None = None) -> int | float:
        """The mean number of clients a round of the run takes: :meth:`fewest` for every sampler but ``schedule``,
        whose count is the mean length of the entries the run's rounds take (an int where it is whole). DP-FedAvg's
        fixed denominator E (fedweave.privacy), known before round 0 and independent of the data. ``rounds``: over
        that many rounds instead of the run's (a resumed run compares its total with the checkpoint's)."""
        if self.fn is not schedule:
            return self.fewest()
        rounds = rounds or self.rounds
        plan = _plan(self.options.get("clients"), self.options.get("file"))
        mean = sum(len(plan[r % len(plan)]) for r in range(rounds)) / rounds
        return int(mean) if mean.is_integer() else mean

    def __call__(self, r: int) -> np.ndarray:
        extra = {"context": self.context} if self.reads_context else {}
        rng = self.seeds.numpy("client_sampling", r)
        ids = self.fn(self.num_clients, self.per_round, r, rng, rounds=self.rounds, **extra, **self.options)
        ids = drawn(ids, self.num_clients, f"sampler {self.name!r} (round {r + 1})")
        if r == 0 and self.first is None:
            self.first = ids
        elif r == 0 and self.user_made and not self.reads_context and not np.array_equal(ids, self.first):
            # round 0 is drawn when the run is built and again in round 1: a plug-in sampler drawing from another
            # source than its rng (numpy's global one, a counter) ran, and the same seed gave other numbers (a
            # built-in one may draw again by design, an empty round's redraw; one that reads the context may see
            # the round's own)
            raise ConfigError(
                f"sampler {self.name!r} chose clients {self.first.tolist()[:8]} for round 1 and then "
                f"{ids.tolist()[:8]} when asked again: it must choose from its rng argument (and the context) only, "
                "so that the same seed gives the same run"
            )
        if len(ids) == 0 and r not in self.empty:  # a round nobody trains in is said, not only seen in the rows
            self.empty.add(r)
            log.warning("round %d: sampler %r chose no client; nobody trains in this round", r + 1, self.name)
        return ids


def sampler_options(name: str, options: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The sampler registered as ``name`` and its ``options`` checked against its signature: what needs no
    data nor client count (a run's :func:`make_sampler`, and a sweep's check of its points before any runs)."""
    fn = SAMPLERS.get(name)
    opts = check_options(fn, options, "sampler", skip=SAMPLER_ARGS, name=name)
    check_signature(name, fn, opts)
    return fn, opts


def make_sampler(
    ctx,
    per_round: int,
    num_clients: int | None = None,
    *,
    default: str = "uniform",
    context: SamplerContext | None = None,
    family: str = "",
) -> Sampler:
    """Round -> client ids, from the run's ``sampler`` section (``default`` when it names the uniform default;
    options checked now, every entry of a ``schedule`` checked, and round 0 drawn once, so a bad schedule or
    client id is a configuration error before anything runs). ``context``: what the family gives a sampler
    that reads one; without it such a sampler is refused (``family`` names the family in that line)."""
    section = ctx.config.sampler
    name = default if section.name == "uniform" and not section.options else section.name
    fn, opts = sampler_options(name, section.options)
    if context is None:
        refuse_context(name, fn, family or "this")
    n = ctx.num_clients if num_clients is None else num_clients
    if not 1 <= per_round <= n:
        raise ConfigError(f"algorithm.clients_per_round ({per_round}) must be in [1, {n}] (the number of clients)")
    check_every_round(fn, opts, n, ctx.config.rounds)
    sample = Sampler(name, fn, n, per_round, ctx.config.rounds, opts, ctx.seeds, context)
    sample(0)
    return sample


def check_every_round(
    fn: Callable, opts: dict, num_clients: int, rounds: int, unit: str = "rounds", note: str = ""
) -> None:
    """What sampler ``fn`` will be asked for in any round, checked now, when the run is built: every entry of
    a ``schedule`` (a bad entry for round 900 is a configuration error before round 1, not in round 900).
    ``rounds``: how many times the run asks it (``unit`` and ``note`` say so where that is not per round)."""
    if fn is schedule:
        _checked_plan(num_clients, rounds, **opts, unit=unit, note=note)


def weighting_under(ctx, sampler: Sampler, weighting: str | None, family: str = "") -> str | None:
    """The aggregation weighting a run uses with ``sampler``: ``weighting`` (the family's ``algorithm.weighting``)
    unless the sampler draws clients in proportion to their sizes (:func:`by_size`); then ``uniform``, the
    simple average its draw is analysed with, since weighing by size again would count every size twice. An
    explicit ``algorithm.weighting: samples`` is then refused, and so is the sampler by a family that always
    weighs by size (``weighting`` None: it has no such key). One line each."""
    if not sampler.draws_by_size:
        return weighting
    if weighting is None:
        raise ConfigError(
            f"sampler {sampler.name!r} draws clients in proportion to their sizes, and the {family} family weighs "
            "them by their sizes again; use it with a centralized or split algorithm (they average its clients "
            "with equal weights), or another sampler"
        )
    if ctx.config.algorithm.options.get("weighting") == "samples":
        raise ConfigError(
            f"algorithm.weighting: samples and sampler: {sampler.name} both weigh clients by their sizes (the "
            "sampler draws them in proportion to their sizes); leave algorithm.weighting out or set it to uniform "
            "(the equal weights the draw is analysed with)"
        )
    return "uniform"
