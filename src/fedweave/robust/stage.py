"""The robustness stages of a server round: the Byzantine attack (stage 1) and the robust reduction (stage 4).

A family whose server reduces client updates builds one :class:`RobustStage` (:func:`build`; None when the
config has neither ``faults.byzantine`` nor a non-default ``aggregator``, so that run's arithmetic is
untouched) and calls :meth:`RobustStage.attack` on the round's updates, then :meth:`RobustStage.aggregate` in
its ``aggregate`` seam. The attackers are fixed for the run, drawn from the ``byzantine`` seed stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from fedweave.config import ConfigError, RunConfig, Section, check_options, nearest_count
from fedweave.execution import evaluate
from fedweave.registry import AGGREGATORS, ATTACKS, Registry, UnknownNameError
from fedweave.robust.aggregators import Aggregator, bucketed
from fedweave.robust.attacks import Attack, AttackInfo, stamped
from fedweave.seeding import Seeds

DEFAULT = Section("mean")  # the weighted mean: the template's own reduction
BYZANTINE_KEYS = ("fraction", "clients", "attack")  # the section's own keys; the others are the attack's options
STAGE_KEYS = ("bucketing", "f")  # the aggregator section's keys that are the stage's, not the aggregator's


def is_default(section: Section) -> bool:
    """True for the weighted mean without bucketing (the template's reduction, no robust stage needed)."""
    return section == DEFAULT


def byzantine_parts(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``faults.byzantine``'s attack name and options (the keys besides fraction, clients and attack)."""
    if "attack" not in spec:
        raise ConfigError(f"faults.byzantine.attack is required; one of: {', '.join(ATTACKS.names())}")
    return spec["attack"], {k: v for k, v in spec.items() if k not in BYZANTINE_KEYS}


def _lookup(registry: Registry, name: str, key: str) -> Any:
    """A registered class by name; an unknown name is a ConfigError naming the key (and the closest name)."""
    try:
        return registry.get(name)
    except UnknownNameError as e:
        raise ConfigError(f"{key}: {e}") from None


def build_attack(spec: dict[str, Any]) -> Attack:
    """The attack ``faults.byzantine`` names, with its options checked against the attack's own."""
    name, opts = byzantine_parts(spec)
    cls = _lookup(ATTACKS, name, "faults.byzantine.attack")
    return cls(**check_options(cls, opts, "faults.byzantine", name=name))


def build_aggregator(section: Section) -> Aggregator:
    """The aggregator ``aggregator.name`` names, with its options (less ``bucketing`` and ``f``) checked."""
    cls = _lookup(AGGREGATORS, section.name, "aggregator.name")
    opts = {k: v for k, v in section.options.items() if k not in STAGE_KEYS}
    return cls(**check_options(cls, opts, "aggregator", name=section.name))


def _count(section: Section, key: str) -> int | None:
    v = section.options.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "bucketing" else 0)):
        low = 1 if key == "bucketing" else 0
        raise ConfigError(f"aggregator.{key} must be a whole number >= {low} or null, got {v!r}")
    return v


def attacker_count(fraction: float, num_clients: int) -> int:
    """``fraction * N`` attackers, to the nearest whole number with halves up (:func:`nearest_count`)."""
    return nearest_count(fraction, num_clients)


def attackers(spec: dict[str, Any] | None, num_clients: int, seeds: Seeds) -> np.ndarray:
    """The run's Byzantine clients, sorted: ``clients`` as given, or :func:`attacker_count` of the N clients
    drawn without replacement from the ``byzantine`` seed stream (so the same for every seed-equal run)."""
    if not spec:
        return np.zeros(0, dtype=np.int64)
    if spec.get("clients") is not None:
        ids = np.asarray(sorted(set(spec["clients"])), dtype=np.int64)
        if len(ids) and ids[-1] >= num_clients:
            raise ConfigError(
                f"faults.byzantine.clients names client {int(ids[-1])}, but the run has {num_clients} clients "
                f"(ids 0..{num_clients - 1})"
            )
        return ids
    fraction = float(spec.get("fraction") or 0.0)
    f = attacker_count(fraction, num_clients)
    if fraction > 0 and f == 0:  # the run went unattacked without a word, its rows saying byzantine_clients 0
        raise ConfigError(
            f"faults.byzantine.fraction {fraction:g} of {num_clients} clients is 0 attackers (rounded to the nearest "
            f"whole number); give at least {math.ceil(5000 / num_clients) / 10000:g} for one attacker, or 0 for none"
        )
    return np.sort(seeds.numpy("byzantine").choice(num_clients, f, replace=False)).astype(np.int64)


def check(config: RunConfig, algorithm: type) -> None:
    """Before anything is built: the attack and aggregator exist and take their options, and a non-default
    aggregator is refused for an algorithm whose server does not reduce client updates (one line naming it)."""
    if config.faults.byzantine:
        attack = build_attack(config.faults.byzantine)
        privacy = config.privacy
        if attack.omniscient and privacy is not None and privacy.level == "user":
            # the attackers' messages are functions of the round's honest updates: one honest client's data then
            # moves its own clipped row and every attacker's, and the sum's sensitivity is no longer C
            name = byzantine_parts(config.faults.byzantine)[0]
            own = ", ".join(n for n in ATTACKS.names() if not ATTACKS.get(n).omniscient)
            raise ConfigError(
                f"faults.byzantine.attack: {name} reads the round's honest updates, so one client's data would move "
                "the attackers' messages too and the noised sum's sensitivity would exceed privacy.clip, which "
                f"user-level DP accounts; use an attack that reads only its own update ({own}), privacy.level: "
                "sample, or leave privacy out"
            )
    section = config.aggregator
    for key in STAGE_KEYS:
        _count(section, key)
    aggregator = build_aggregator(section)
    if section.options.get("f") is not None and not aggregator.reads_f:  # set, and read by nothing
        raise ConfigError(
            f"aggregator.f: aggregator {section.name!r} reads no Byzantine count (f is what krum, multi_krum, bulyan, "
            "dnc and trimmed_mean cut); leave it out"
        )
    if not is_default(section) and not getattr(algorithm, "robust_aggregation", False):
        name, family = config.algorithm.name, getattr(algorithm, "family", "?")
        raise ConfigError(
            f"aggregator: {section.name}: algorithm '{name}' ({family} family) does not reduce client updates "
            "to one at a server; leave the aggregator section out (robust aggregation applies to the centralized "
            "methods, the hierarchical model-averaging ones and the gossip methods at each peer)"
        )


class RobustStage:
    """One run's attack and reduction. ``num_clients``: the run's clients (attackers are drawn among them)."""

    def __init__(self, config: RunConfig, seeds: Seeds, num_clients: int) -> None:
        spec = config.faults.byzantine or None
        self.seeds = seeds
        self.attack_fn = build_attack(spec) if spec else None
        self.attackers = attackers(spec, num_clients, seeds)
        if self.attack_fn is not None:
            self.attack_fn.check_run(len(self.attackers), num_clients)
        self.num_clients = num_clients
        self.fraction = len(self.attackers) / num_clients if num_clients else 0.0
        section = config.aggregator
        self.aggregator = build_aggregator(section)
        self.plain = is_default(section)  # the weighted mean without bucketing: the family's own reduction applies
        self.bucketing = _count(section, "bucketing") or 1
        self.f = _count(section, "f")
        self.round = 0
        self.last_byzantine = 0  # the reporting attackers of the last round (a metric)
        self.stamped_test: tuple[torch.Tensor, torch.Tensor] | None = None  # a backdoor's triggered test samples

    @property
    def stateful(self) -> bool:
        """Whether the aggregator keeps state between rounds (then the checkpoint carries it)."""
        return self.aggregator.stateful

    def attack(
        self,
        r: int,
        clients: np.ndarray,
        updates: torch.Tensor,
        center: torch.Tensor | None,
        unsent: torch.Tensor | None = None,
        reduced: int | None = None,
    ) -> torch.Tensor:
        """Stage 1: the rows of the round's reporting attackers replaced by what their attack sends.
        ``center``: where the rows are models (the method averages models), the global model they moved from,
        so that the attack acts on the displacement ``y_i - x``. ``unsent``: the coordinates, ``(d,)`` bool, that
        the method's uploads do not carry (a personal part): an attacker cannot send them either, so its row keeps
        its own values there. ``reduced``: the rows the reduction will see, when more than these (a gossip peer's
        own model beside the messages it receives): the ``n`` of ALIE's ``s`` and of model replacement's boost,
        which count every update the aggregator reduces (Baruch et al. 2019, Alg. 3; Bagdasaryan et al. 2020,
        eq. 3); default ``len(clients)``. Also records the round (bucketing's stream)."""
        self.at_round(r)
        bad = np.isin(np.asarray(clients), self.attackers)
        self.last_byzantine = int(bad.sum())
        if self.attack_fn is None or not bad.any():
            return updates
        idx = torch.as_tensor(np.flatnonzero(bad), device=updates.device)
        good = torch.as_tensor(np.flatnonzero(~bad), device=updates.device)
        rows = updates - center if center is not None else updates
        info = AttackInfo(r, np.asarray(clients)[bad], len(clients) if reduced is None else reduced, self.seeds)
        sent = self.attack_fn(rows[idx], rows[good], info).to(rows.dtype)
        if unsent is not None:
            sent = torch.where(unsent, rows[idx], sent)
        out = updates.clone()  # the honest rows exactly as they were
        out[idx] = sent + center if center is not None else sent
        return out

    def reduce_at_peer(
        self, rows: torch.Tensor, weights: torch.Tensor, own: torch.Tensor, peer: int | None = None
    ) -> torch.Tensor:
        """A peer's reduction of the models it received (its own among them) with its mixing ``weights``, for
        the gossip methods: stage 4 around its ``own`` model. A stateful aggregator starts afresh at every
        peer, so that centered clipping clips around the peer's own model: ClippedGossip (He, Karimireddy &
        Jaggi, arXiv:2202.01545, 2022: ``x_i + sum_j w_ij clip(x_j - x_i, tau)``). ``peer``: the peer's id, so
        that an aggregator that draws (DnC) draws from the peer's own ``("robust_aggregator", round, peer)``
        stream."""
        self.aggregator.load_state_dict({})
        return self.aggregate(rows, weights, own, peer=peer)

    def at_round(self, r: int) -> None:
        """Record the server's round (or step) ``r``: bucketing draws its permutation from ``("bucketing", r)``.
        :meth:`attack` records it; a server that reduces without the attack stage calls this first."""
        self.round = r

    def check_round(self, n: int) -> None:
        """Refuse, before the first round, a round of ``n`` updates that the aggregator's bound rules out."""
        buckets = math.ceil(n / self.bucketing)
        self.aggregator.check(buckets, min(self.byzantine_f(n), buckets))

    def byzantine_f(self, n: int) -> int:
        """The Byzantine updates the server guards against among ``n``: ``aggregator.f``, else the run's share
        of attackers times ``n``, rounded up."""
        if self.f is not None:
            return self.f
        return math.ceil(self.fraction * n - 1e-9)

    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        center: torch.Tensor | None = None,
        peer: int | None = None,
    ) -> torch.Tensor:
        """Stage 4: the robust reduction, after bucketing when ``aggregator.bucketing`` > 1 (the permutation from
        the ``("bucketing", round)`` stream). ``center``: where the rows are the clients' models (FedDyn,
        hier_fedavg), the global model they moved from; an aggregator that measures lengths then reduces the
        displacements ``y_i - x`` and the result is ``x`` plus that (the others see the models: the same
        aggregate, and the same bits as before). An aggregator that draws (DnC) gets the
        ``("robust_aggregator", round)`` stream, ``("robust_aggregator", round, peer)`` at a gossip ``peer``: a
        function of the seed and the round, so a resumed run draws what the uninterrupted one did."""
        if center is not None and not self.aggregator.translation_equivariant:
            return center + self.aggregate(updates - center, weights, peer=peer)
        f = self.byzantine_f(len(updates))
        if self.bucketing > 1:
            perm = torch.from_numpy(self.seeds.numpy("bucketing", self.round).permutation(len(updates)))
            updates, weights = bucketed(updates, weights, self.bucketing, perm.to(updates.device))
            f = min(f, len(updates))
        if self.aggregator.random:
            keys = (self.round,) if peer is None else (self.round, peer)
            return self.aggregator(updates, weights, f, rng=self.seeds.numpy("robust_aggregator", *keys))
        return self.aggregator(updates, weights, f)

    def metrics(self) -> dict[str, float]:
        """``byzantine_clients``: the attackers among the round's reporting clients (with an attack only)."""
        return {"byzantine_clients": float(self.last_byzantine)} if self.attack_fn is not None else {}

    def backdoor_metrics(self, layout: Any, x: torch.Tensor, dataset: Any, batch_size: int) -> dict[str, float]:
        """``test_backdoor_success`` of the model ``x`` under a backdoor attack (nothing otherwise): the share of the
        test samples whose class is not the target that, with the trigger stamped on, the model classifies as
        the target. ``dataset``: anything with ``train_x``, ``test_x`` and ``test_y`` (a dataset, or a family's own
        split of it)."""
        attack = self.attack_fn
        if attack is None or not attack.poisons_inputs:
            return {}
        if self.stamped_test is None:  # built once: the trigger at the training inputs' largest value
            keep = dataset.test_y != attack.target
            inputs = stamped(dataset.test_x[keep], attack.size, float(dataset.train_x.max()))
            self.stamped_test = inputs, torch.full((len(inputs),), attack.target, dtype=dataset.test_y.dtype)
        success, _ = evaluate(layout, x, *self.stamped_test, batch_size)
        return {"test_backdoor_success": success}

    def honest(self) -> np.ndarray:
        """The run's clients that are not attackers, sorted."""
        return np.setdiff1d(np.arange(self.num_clients), self.attackers)

    def evaluated(self) -> np.ndarray | None:
        """The clients whose own models a family's per-client metrics average: the honest ones when the run has
        attackers (an attacker's own model serves no one), None (every client) otherwise."""
        return self.honest() if len(self.attackers) else None

    def mean_backdoor_metrics(
        self, layout: Any, models: Iterable[torch.Tensor], dataset: Any, batch_size: int
    ) -> dict[str, float]:
        """``test_backdoor_success`` averaged over ``models`` (the honest clients' or peers' own models), each
        scored by :meth:`backdoor_metrics`; nothing without a backdoor attack or without a model."""
        per = [self.backdoor_metrics(layout, w, dataset, batch_size) for w in models]
        if not per or not per[0]:
            return {}
        return {"test_backdoor_success": sum(p["test_backdoor_success"] for p in per) / len(per)}

    def state_dict(self) -> dict[str, Any]:
        """The aggregator's state (a checkpoint's ``robust`` entry)."""
        return self.aggregator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the aggregator's state."""
        self.aggregator.load_state_dict(state)


def build(config: RunConfig, seeds: Seeds, num_clients: int, per_round: int | Iterable[int]) -> RobustStage | None:
    """The run's robust stage, or None without ``faults.byzantine`` and with the default aggregator (then the
    family's own reduction runs, unchanged). ``per_round``: the updates of a full round, or every count a round
    of the run can reduce, each checked against the aggregator's bound now rather than in the round that has
    it (with ``f`` read from the count, the bound is not monotone in it: the fewest alone is not the worst)."""
    if not config.faults.byzantine and is_default(config.aggregator):
        return None
    stage = RobustStage(config, seeds, num_clients)
    for n in sorted({per_round} if isinstance(per_round, int) else set(per_round)):
        stage.check_round(n)
    return stage


def poisoned_data(config: RunConfig, seeds: Seeds, x: torch.Tensor, labels: torch.Tensor,
                  partition: list[np.ndarray], num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The training inputs and labels the clients train on: for a data-poisoning attack, each attacker's samples
    as the attack poisons them (copies; the dataset is untouched, and the inputs are copied only by an attack
    that changes them); otherwise ``x`` and ``labels`` themselves."""
    spec = config.faults.byzantine
    if not spec:
        return x, labels
    attack = build_attack(spec)
    if not attack.poisons_data:
        return x, labels
    if labels.is_floating_point():
        raise ConfigError(
            f"faults.byzantine.attack {attack.name!r} changes class labels; this dataset has float targets"
        )
    bad = attackers(spec, len(partition), seeds)
    if len(bad) == 0:
        return x, labels
    high = float(x.max()) if attack.poisons_inputs else 0.0
    x_out, y_out = (x.clone() if attack.poisons_inputs else x), labels.clone()
    for c in bad:
        idx = torch.as_tensor(partition[int(c)], dtype=torch.long)
        px, py = attack.poison(x[idx], labels[idx], num_classes, high, seeds.numpy("poison", int(c)))
        if attack.poisons_inputs:
            x_out[idx] = px
        y_out[idx] = py
    return x_out, y_out
