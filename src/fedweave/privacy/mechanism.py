"""User-level DP of the star round's client updates: clipping, Gaussian noise, adaptive clipping.

DP-FedAvg (McMahan et al., ICLR 2018, Alg. 1 with the fixed-denominator estimator and w_k = 1): each reporting
client's update ``Delta_i = y_i - x_t`` is clipped to L2 norm C, the server adds ``N(0, sigma^2 C^2 I)`` to the
sum and divides by E, the expected number of clients per round (never by the number that reported, which
would depend on who took part):

    Delta~ = ( sum_i clip(Delta_i, C) + N(0, sigma^2 C^2 I) ) / E.

Adding or removing one user moves the sum by at most C, so each round is the Gaussian mechanism with noise
multiplier sigma; the accountant composes the rounds (with Poisson sampling at rate q, amplified).

Adaptive clipping (Andrew et al., NeurIPS 2021, Alg. 1): each client also reports ``b_i = 1[|Delta_i| <= C]``;
the server forms ``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / E + 1/2`` and moves
``C <- C exp(-eta_C (b~ - gamma))``, so C follows the gamma-quantile of the update norms. The count is a second
Gaussian mechanism; centred at zero, each client's ``b_i - 1/2`` is +-1/2, so adding or removing one moves the
noised sum by at most 1/2 (as in the paper's reference implementation, TensorFlow Privacy's
``QuantileEstimatorQuery``: the uncentred sum of ``b_i`` would move by 1). With that sensitivity of 1/2, Theorem 1
of the paper: the pair with update noise multiplier z_Delta and count noise sigma_b is accounted as one Gaussian
mechanism with ``z = (z_Delta^-2 + (2 sigma_b)^-2)^-1/2``, so for an accounted z the update is noised with
``z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2`` (which needs sigma_b > z / 2).

Local DP (``mechanism: local``): each client adds ``N(0, sigma^2 C^2 I)`` to its own clipped update before it
sends it, and the server adds nothing. A client's message is then the Gaussian mechanism on its own data with
sensitivity 2C (its data replaced by any other: both updates lie in the ball of radius C), accounted per
client with noise multiplier sigma / 2 and no amplification (the server sees who sends).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedweave.execution.dpsgd import clip_rows
from fedweave.privacy.accountant import Accountant
from fedweave.registry import PRIVACY_MECHANISMS
from fedweave.seeding import Seeds


def clip_updates(updates: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row scaled to norm at most ``clip``, ``u min(1, C / |u|)``, as :func:`clip_rows`; where a row's norm
    overflows the run's float width (a float32 row of about 1e30 is finite, the sum of its squares is not) the
    norms and that scaling are taken in float64, so such a row is scaled to norm C rather than zeroed (``C / inf``
    was 0: an attacker's scaled-up update then vanished from the sum instead of counting with norm C). Where every
    norm is finite the result is :func:`clip_rows`' bit for bit."""
    norms = updates.norm(dim=-1, keepdim=True)
    if bool(torch.isfinite(norms).all()) or not bool(torch.isfinite(updates).all()):
        # (an update that is not finite itself has no norm to scale it to: it stays as clip_rows leaves it)
        return clip_rows(updates, clip)
    wide = updates.double()
    return (wide * (clip / wide.norm(dim=-1, keepdim=True).clamp_min(clip))).to(updates.dtype)


def clip_per_layer(updates: torch.Tensor, clip: float, numels: list[int]) -> torch.Tensor:
    """Each row's part of each layer (``numels``: the layers' sizes, in the flat vector's order) clipped to
    ``clip / sqrt(layers)``, so that the whole row's norm is at most ``clip`` (McMahan et al. 2018, per-layer
    clipping with an equal share per layer)."""
    share = clip / math.sqrt(len(numels))
    return torch.cat([clip_updates(part, share) for part in updates.split(numels, dim=-1)], dim=-1)


def update_noise_multiplier(z: float, count_noise: float) -> float:
    """Andrew et al. 2021, Sec. 3: the noise multiplier of the update, ``(z^-2 - (2 sigma_b)^-2)^-1/2``, that
    together with the count noise ``sigma_b`` is accounted as the noise multiplier ``z``."""
    if z == 0:
        return 0.0
    rest = z**-2 - (2 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(f"count noise {count_noise:g} leaves no budget for the update at noise multiplier {z:g}")
    return rest**-0.5


PRIVACY_MECHANISMS.register("central")("DP-FedAvg: clip each client's update, Gaussian noise on the sum (server)")
PRIVACY_MECHANISMS.register("local")("local DP: each client clips its update and adds Gaussian noise itself")
PRIVACY_MECHANISMS.register("adaptive")("adaptive clipping (Andrew et al. 2021): C follows a quantile of the norms")
PRIVACY_MECHANISMS.register("dpsgd")("sample-level DP-SGD at every client (privacy.level: sample)")


class UserDP:
    """The user-level DP stages of the star round, and their accounting.

    ``clip`` is stage 3 (each reporting client's update clipped, noised at the client under local DP, and the
    weights of the fixed-denominator estimator, 1/E each), ``noise`` stage 5 (Gaussian noise on the sum over
    E, the adaptive clip's update and one accounted release). ``z`` is the accounted noise multiplier.
    """

    def __init__(
        self,
        *,
        mechanism: str,
        clip: float,
        z: float,
        expected: int | float,
        sample_rate: float,
        seeds: Seeds,
        accountant: Accountant,
        numels: list[int] | None = None,
        adaptive: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        count_noise: float = 1.0,
    ) -> None:
        self.mechanism, self.clip_norm, self.z, self.expected = mechanism, float(clip), float(z), expected
        self.sample_rate, self.seeds, self.accountant, self.numels = float(sample_rate), seeds, accountant, numels
        self.adaptive, self.gamma, self.clip_lr, self.count_noise = adaptive, target_quantile, clip_lr, count_noise
        # the std of the update's noise is z_update * C: z itself, or what the count leaves of it (Theorem 1)
        self.z_update = update_noise_multiplier(self.z, count_noise) if adaptive else self.z
        # local DP: each client's message has sensitivity 2C (its data replaced), so z / 2 is accounted
        self.z_accounted = self.z / 2 if mechanism == "local" else self.z
        self.releases = 0  # rounds released so far: the noise streams' key and the accountant's steps
        self.unclipped: torch.Tensor | None = None  # sum_i (b_i - 1/2) of the round being reduced (adaptive)
        self.last_norms: torch.Tensor | None = None

    @property
    def releases_empty_rounds(self) -> bool:
        """Whether a round in which no client's update arrived is still a release (the noise on an empty sum,
        accounted). Amplification by Poisson sampling is proved for the mechanism that noises the sum of
        whoever was drawn, nobody included: a round skipped when nobody took part would tell who took part.
        Without amplification (q = 1) the bound holds for any set of clients, and a skipped round releases
        nothing."""
        return self.mechanism == "central" and self.sample_rate < 1

    # ---- the round's stages ----------------------------------------------------------------------
    def clip(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: the clipped (under local DP also noised) updates and the weights 1/E of each (``clients``, the
        reporting clients' ids, is what DP-FTRL's accounting needs; unused here)."""
        norms = updates.norm(dim=-1)
        self.last_norms = norms
        if self.adaptive:
            # sum_i (b_i - 1/2): centred, one client moves it by 1/2, the sensitivity Theorem 1's 2 sigma_b assumes
            self.unclipped = ((norms <= self.clip_norm).to(updates.dtype) - 0.5).sum()
        if self.numels is not None:
            out = clip_per_layer(updates, self.clip_norm, self.numels)
        else:
            out = clip_updates(updates, self.clip_norm)
        if self.mechanism == "local" and self.z:
            out = out + self.z * self.clip_norm * self._gaussian(out.shape, out, "dp_local")
        # the fixed-denominator estimator: each reporting client counts 1/E (E does not depend on who reported)
        weights = torch.ones(len(out), dtype=out.dtype, device=out.device) / self.expected
        return out, weights

    def noise(self, mean: torch.Tensor) -> torch.Tensor:
        """Stage 5: Gaussian noise of std ``z_update * C`` on the sum, over E; then the adaptive clip's step and
        the round's release in the accountant."""
        if self.mechanism == "central" and self.z_update:
            mean = mean + (self.z_update * self.clip_norm / self.expected) * self._gaussian(mean.shape, mean, "dp")
        if self.adaptive:
            # b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / E + 1/2; C <- C exp(-eta_C (b~ - gamma)) (Andrew et al.
            # Alg. 1, with the centred count of their reference implementation: adding 1/2 back is post-processing)
            g = self.seeds.torch("dp_count", self.releases)
            noisy = float(self.unclipped) + self.count_noise * float(torch.randn((), generator=g, dtype=torch.float64))
            self.clip_norm = self.clip_norm * math.exp(-self.clip_lr * (noisy / self.expected + 0.5 - self.gamma))
        self.accountant.step(self.z_accounted, 1.0 if self.mechanism == "local" else self.sample_rate)
        self.releases += 1
        return mean

    def _gaussian(self, shape: torch.Size, like: torch.Tensor, stream: str) -> torch.Tensor:
        """N(0, I) of this release from its own named stream, drawn on the CPU (the same on every device)."""
        g = self.seeds.torch(stream, self.releases)
        return torch.randn(tuple(shape), generator=g, dtype=like.dtype).to(like.device, non_blocking=True)

    # ---- what the run reports ---------------------------------------------------------------------
    def epsilon(self) -> float:
        """Epsilon at the run's delta after the releases so far (local DP: of a client that took part in
        every one of them, an upper bound for every client)."""
        return self.accountant.epsilon()

    def epsilon_after_next(self, next_round: int | None = None) -> float:
        """Epsilon after one more release (whoever takes part in ``next_round``)."""
        return self.accountant.epsilon_after_next(
            self.z_accounted, 1.0 if self.mechanism == "local" else self.sample_rate
        )

    def metrics(self) -> dict[str, float]:
        """What a metrics row records: epsilon (when finite) and, with adaptive clipping, the current C."""
        out: dict[str, float] = {}
        eps = self.epsilon()
        if math.isfinite(eps):
            out["epsilon"] = eps
        if self.adaptive:
            out["dp_clip"] = self.clip_norm
        return out

    def summary(self) -> dict[str, Any]:
        """What summary.json records of the privacy of the run."""
        eps = self.epsilon()
        return {
            "level": "user",
            "mechanism": self.mechanism,
            "epsilon": eps if math.isfinite(eps) else None,
            "delta": self.accountant.delta,
            "accountant": self.accountant.name,
            "noise_multiplier": self.z,
            "update_noise_multiplier": self.z_update,
            "sample_rate": self.sample_rate,
            "expected_clients": self.expected,
            "releases": self.releases,
            "clip": self.clip_norm,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"releases": self.releases, "clip": self.clip_norm, "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.releases, self.clip_norm = int(state["releases"]), float(state["clip"])
        self.accountant.load_state_dict(state["accountant"])
