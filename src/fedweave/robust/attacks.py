"""Byzantine attacks (``faults.byzantine.attack``), registered in :data:`fedweave.registry.ATTACKS`.

An attack is called once per round on the updates of the round's reporting attackers and returns what they
send instead: ``attack(own, honest, info)`` with ``own`` the ``(a, d)`` updates the attackers computed
honestly, ``honest`` the ``(h, d)`` updates of the round's honest clients and ``info`` the round, the
attackers' ids, the round's number of updates and the run's seeds. The omniscient attacks (ALIE, IPM,
Min-Max, Min-Sum) read ``honest`` as their papers assume; in a round without an honest client they use the attackers'
own updates (what they would compute on their own data). A data-poisoning attack (``label_flip``,
``backdoor``) trains on poisoned data and sends the update that training gives (``backdoor`` may boost it).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import ClassVar, Literal

import numpy as np
import torch

from fedweave.config import ConfigError
from fedweave.registry import ATTACKS
from fedweave.seeding import Seeds


@dataclass
class AttackInfo:
    """What an attack knows of its round besides the updates."""

    round: int
    attackers: np.ndarray  # the ids of the round's reporting attackers, in row order
    n: int  # the updates the round's reduction sees (attackers included; a gossip peer's own row too)
    seeds: Seeds


class Attack:
    """Base class: ``omniscient`` attacks read the honest updates; ``poisons_data`` ones change the samples the
    attackers train on (:meth:`poison`: the labels, and with ``poisons_inputs`` the inputs too)."""

    name: ClassVar[str] = ""
    omniscient: ClassVar[bool] = False
    poisons_data: ClassVar[bool] = False
    poisons_inputs: ClassVar[bool] = False

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        raise NotImplementedError

    def check_run(self, attackers: int, num_clients: int) -> None:
        """Refuse, before round 0 and in one line, a run of ``attackers`` among ``num_clients`` the attack is
        not defined for (nothing by default)."""

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, num_classes: int, high: float, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One attacker's samples ``(x, y)`` as it trains on them (a data-poisoning attack only); ``high``: the
        largest training input value, ``rng``: the attacker's own ``("poison", client)`` stream."""
        return x, y


def _same_for_all(update: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """One malicious update sent by every attacker of the round (the omniscient attacks collude)."""
    return update.expand_as(own).clone()


def _known(own: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    """The updates an omniscient attacker reads: the honest ones, else (no honest client reported) its own."""
    return honest if len(honest) else own


@ATTACKS.register("sign_flip")
class SignFlip(Attack):
    """Sign flipping: send ``-scale * u`` for the honestly computed update ``u`` (Damaskinos et al. 2018;
    Allen-Zhu et al. 2021; the "sign flipping" of Karimireddy et al. 2021)."""

    name = "sign_flip"

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ConfigError(f"faults.byzantine.scale must be > 0, got {scale}")
        self.scale = scale

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        return -self.scale * own


@ATTACKS.register("gaussian")
class Gaussian(Attack):
    """Gaussian noise: send ``N(mean, std^2 I)`` in place of the update (the Gaussian Byzantine workers of
    Blanchard et al. 2017, Sec. 5); the ``("byzantine_noise", round, client)`` seed stream."""

    name = "gaussian"

    def __init__(self, std: float = 1.0, mean: float = 0.0) -> None:
        if not std > 0:
            raise ConfigError(f"faults.byzantine.std must be > 0, got {std}")
        self.std, self.mean = std, mean

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        rows = [
            torch.randn(
                own.shape[1], generator=info.seeds.torch("byzantine_noise", info.round, int(c)), dtype=own.dtype
            )
            for c in info.attackers
        ]
        return (self.mean + self.std * torch.stack(rows)).to(own.device)


@ATTACKS.register("label_flip")
class LabelFlip(Attack):
    """Label flipping, a data-poisoning attack: the attackers train on labels ``c -> C - 1 - c`` (Fang et al.,
    USENIX Security 2020; Tolpegin et al., ESORICS 2020) and send the update that training gives."""

    name = "label_flip"
    poisons_data = True

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        return own

    def poison(self, x, y, num_classes, high, rng):
        return x, num_classes - 1 - y


def stamped(x: torch.Tensor, size: int, value: float) -> torch.Tensor:
    """``x`` (a batch) with the trigger: a ``size`` x ``size`` square of ``value`` in the bottom-right corner of
    every channel of an image, or the last ``size`` values of a flat sample."""
    out = x.clone()
    if out.dim() >= 3:  # (N, H, W) or (N, C, H, W)
        out[..., -size:, -size:] = value
    else:
        out[:, -size:] = value
    return out


@ATTACKS.register("backdoor")
class Backdoor(Attack):
    """A backdoor by data poisoning (Bagdasaryan et al., AISTATS 2020; the pixel-pattern trigger of Gu et al.'s
    BadNets, 2017): each attacker stamps the trigger (:func:`stamped`, ``size`` pixels square, at the largest
    training input value) on a ``poison_fraction`` of its samples, drawn from its ``("poison", client)`` stream,
    and labels them ``target``; it trains on them with the rest of its samples and sends ``boost`` times the
    update (``boost`` > 1: the model replacement of Bagdasaryan et al., eq. 3). The star methods report
    ``test_backdoor_success``: the share of the test samples of other classes, stamped, classified as ``target``."""

    name = "backdoor"
    poisons_data = True
    poisons_inputs = True

    def __init__(self, target: int = 0, poison_fraction: float = 0.5, size: int = 3, boost: float = 1.0) -> None:
        if not 0 < poison_fraction <= 1:
            raise ConfigError(f"faults.byzantine.poison_fraction must be in (0, 1], got {poison_fraction}")
        if size < 1:
            raise ConfigError(f"faults.byzantine.size must be >= 1 (the trigger's side in pixels), got {size}")
        if not boost > 0:
            raise ConfigError(f"faults.byzantine.boost must be > 0, got {boost}")
        self.target, self.poison_fraction, self.size, self.boost = target, poison_fraction, size, boost

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        return own if self.boost == 1.0 else self.boost * own

    def poison(self, x, y, num_classes, high, rng):
        if not 0 <= self.target < num_classes:
            raise ConfigError(f"faults.byzantine.target must be a class, 0..{num_classes - 1}, got {self.target:.6g}")
        side = min(x.shape[-2:]) if x.dim() > 2 else x.shape[-1]  # an image's height and width, or a flat sample
        if self.size > side:  # the trigger would cover the whole sample (or its smaller side): not a trigger
            raise ConfigError(f"faults.byzantine.size must be at most {side} for these samples, got {self.size:.6g}")
        rows = torch.as_tensor(rng.permutation(len(x))[: round(self.poison_fraction * len(x))], dtype=torch.long)
        x, y = x.clone(), y.clone()
        x[rows] = stamped(x[rows], self.size, high)
        y[rows] = self.target
        return x, y


@ATTACKS.register("scaled")
class Scaled(Attack):
    """Boosted updates, the model replacement of Bagdasaryan et al. (AISTATS 2020, eq. 3): send ``gamma * u``
    with ``gamma = boost``, null: the round's number of updates ``n`` (``n / eta`` with the server step 1), so
    that the mean is replaced by the attacker's model (exactly so under uniform weights; under sample weights the
    attacker's share of the mean is its weight times ``n``)."""

    name = "scaled"

    def __init__(self, boost: float | None = None) -> None:
        if boost is not None and not boost > 0:
            raise ConfigError(f"faults.byzantine.boost must be > 0 or null (the round's clients), got {boost}")
        self.boost = boost

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        return (self.boost if self.boost is not None else float(info.n)) * own


def alie_z(n: int, f: int) -> float:
    """ALIE's ``z_max`` (Baruch et al. 2019, Alg. 3): ``s = floor(n/2 + 1) - f`` supporters are needed, and
    ``z = Phi^{-1}((n - s) / n)``. Alg. 3 is defined for a minority, ``s > 0``; a round whose attackers are a
    majority of its ``n`` updates (``s <= 0``, which sampling can give a run whose attackers are a minority of
    its clients) gets 0.0: the attackers send the honest mean. A run whose attackers are a majority of all its
    clients is refused before round 0 (:meth:`ALIE.check_run`)."""
    s = n // 2 + 1 - f
    return NormalDist().inv_cdf((n - s) / n) if 0 < (n - s) / n < 1 else 0.0


@ATTACKS.register("alie")
class ALIE(Attack):
    """A Little Is Enough (Baruch, Baruch & Goldberg, NeurIPS 2019): every attacker sends ``mu - z sigma``, the
    coordinate-wise mean and standard deviation of the honest updates, with ``z`` from :func:`alie_z` (or
    ``z`` given)."""

    name = "alie"
    omniscient = True

    def __init__(self, z: float | None = None) -> None:
        self.z = z

    def check_run(self, attackers: int, num_clients: int) -> None:
        """Refuse ``z`` null where the attackers are a majority of the clients: Alg. 3's ``z_max`` needs
        ``s = floor(n/2 + 1) - f > 0`` (for ``s <= 0`` no finite ``z`` bounds it), so a full round has none."""
        if self.z is None and attackers >= num_clients // 2 + 1:
            raise ConfigError(
                f"faults.byzantine.z: ALIE's z (Baruch et al. 2019, Alg. 3) is defined while the attackers are "
                f"fewer than half the updates (s = floor(n/2 + 1) - f > 0); this run's {attackers} attackers of "
                f"{num_clients} clients are a majority: give z, or fewer attackers"
            )

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        known = _known(own, honest)
        z = self.z if self.z is not None else alie_z(info.n, len(own))
        std = known.std(0, correction=1 if len(known) > 1 else 0)
        return _same_for_all(known.mean(0) - z * std, own)


@ATTACKS.register("ipm")
class IPM(Attack):
    """Inner-product manipulation (Xie, Koyejo & Gupta, UAI 2020): every attacker sends ``-eps`` times the
    mean of the honest updates."""

    name = "ipm"
    omniscient = True

    def __init__(self, eps: float = 0.1) -> None:
        if not eps > 0:
            raise ConfigError(f"faults.byzantine.eps must be > 0, got {eps}")
        self.eps = eps

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        return _same_for_all(-self.eps * _known(own, honest).mean(0), own)


class PerturbedMean(Attack):
    """The aggregation-agnostic attacks of Shejwalkar & Houmansadr (NDSS 2021, Sec. IV-C): every attacker sends
    ``mu - gamma p``, with ``mu`` the honest mean, ``p`` the perturbation (``unit_vec``: ``mu / ||mu||``;
    ``std``: the coordinate-wise standard deviation; ``sign``: ``sign(mu)``; the paper writes ``mu + gamma p``
    with these directions negated) and the largest ``gamma`` for which :meth:`spread` of the malicious update
    stays within :meth:`bound`, found by the paper's halving search (Alg. 1, from ``gamma_init`` to ``tol``).
    A subclass gives the objective: :meth:`spread` and :meth:`bound`."""

    omniscient = True

    def __init__(
        self, perturbation: Literal["unit_vec", "std", "sign"] = "unit_vec", gamma_init: float = 10.0, tol: float = 1e-5
    ) -> None:
        if not gamma_init > 0 or not tol > 0:
            raise ConfigError(f"faults.byzantine.gamma_init and tol must be > 0, got {gamma_init}, {tol}")
        self.perturbation, self.gamma_init, self.tol = perturbation, gamma_init, tol

    def direction(self, known: torch.Tensor) -> torch.Tensor:
        """The perturbation ``p`` of the configured kind, from the known (honest) updates."""
        mu = known.mean(0)
        if self.perturbation == "unit_vec":
            # a zero honest mean has no direction (mu / 0 is NaN, and gamma * NaN poisons even gamma = 0): no
            # perturbation, the attackers send mu; gossip's first round, every peer on the same initial model
            # and so every displacement 0, is such a round
            norm = mu.norm()
            return mu / norm if norm > 0 else torch.zeros_like(mu)
        if self.perturbation == "std":
            return known.std(0, correction=1 if len(known) > 1 else 0)
        return mu.sign()

    def bound(self, known: torch.Tensor) -> torch.Tensor:
        """What the malicious update's :meth:`spread` may reach: the honest updates' own, at its largest."""
        raise NotImplementedError

    def spread(self, known: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The malicious update ``m``'s distance measure to the known updates."""
        raise NotImplementedError

    def gamma(self, known: torch.Tensor, p: torch.Tensor) -> float:
        """The paper's search (Alg. 1): step up by half the last step while ``spread <= bound`` holds, down while
        it fails; the last ``gamma`` at which it held (0.0 if none)."""
        mu = known.mean(0)
        bound = self.bound(known)
        gamma, step, good = self.gamma_init, self.gamma_init, 0.0
        while abs(good - gamma) > self.tol:
            if self.spread(known, mu - gamma * p) <= bound:
                good = gamma
                gamma = gamma + step / 2
            else:
                gamma = gamma - step / 2
            step = step / 2
        return good

    def __call__(self, own: torch.Tensor, honest: torch.Tensor, info: AttackInfo) -> torch.Tensor:
        known = _known(own, honest)
        p = self.direction(known)
        return _same_for_all(known.mean(0) - self.gamma(known, p) * p, own)


@ATTACKS.register("min_max")
class MinMax(PerturbedMean):
    """Min-Max (Shejwalkar & Houmansadr, NDSS 2021, eq. 6): the largest ``gamma`` (:class:`PerturbedMean`) for
    which the malicious update is no farther from any honest update than the two farthest honest updates are
    from each other."""

    name = "min_max"

    def bound(self, known: torch.Tensor) -> torch.Tensor:
        """The largest distance between two known updates, from the differences (torch.cdist's default takes
        ``||a||^2 + ||b||^2 - 2ab`` beyond 25 rows, whose cancellation overstated it)."""
        return torch.cdist(known, known, compute_mode="donot_use_mm_for_euclid_dist").max()

    def spread(self, known: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The largest distance from ``m`` to a known update."""
        return (known - m).norm(dim=1).max()


def _sq_dist_sums(known: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum_j ||m_i - known_j||^2`` for each row ``m_i`` of ``m``, from the differences (no
    ``||a||^2 + ||b||^2 - 2ab`` cancellation)."""
    return torch.cdist(m, known, compute_mode="donot_use_mm_for_euclid_dist").pow(2).sum(1)


@ATTACKS.register("min_sum")
class MinSum(PerturbedMean):
    """Min-Sum (Shejwalkar & Houmansadr, NDSS 2021, their AGR-agnostic Min-Sum attack): the largest ``gamma``
    (:class:`PerturbedMean`) for which the sum of squared distances from the malicious update to the honest
    updates is at most the largest such sum of an honest update to the others."""

    name = "min_sum"

    def bound(self, known: torch.Tensor) -> torch.Tensor:
        """``max_i sum_j ||g_i - g_j||^2`` over the known updates."""
        return _sq_dist_sums(known, known).max()

    def spread(self, known: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``sum_j ||m - g_j||^2``."""
        return _sq_dist_sums(known, m.unsqueeze(0))[0]
