"""Privacy accounting with Opacus's accountants (``pip install 'fedweave[privacy]'``): no hand-written formulas.

An :class:`Accountant` records every release of the run as Opacus does, one ``(noise_multiplier,
sample_rate)`` step each, and asks Opacus for epsilon at the run's delta. ``rdp`` is Opacus's
``RDPAccountant`` (Renyi DP of the Poisson-subsampled Gaussian mechanism, Mironov et al. 2019), ``prv`` its
``PRVAccountant`` (privacy random variables, Gopi et al. 2021). Both assume Poisson subsampling with rate
``sample_rate`` and add/remove-one neighbouring datasets; ``sample_rate = 1`` is the plain Gaussian mechanism
(no subsampling, no amplification).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from fedweave.config import ConfigError
from fedweave.registry import ACCOUNTANTS


def against_target(epsilon: float, target: float) -> tuple[str, str]:
    """``epsilon`` and ``target`` printed at one precision: the target as configured (``:g``), epsilon to at
    least 4 digits, and more digits for both until they differ ("4.479 > 4.47922" read as the smaller one
    exceeding the larger; now "4.47923 > 4.47922")."""
    shown = float(f"{target:g}")
    for p in range(4, 18):
        a, b = f"{epsilon:.{p}g}", f"{target:.{p}g}"
        if a != b and float(b) == shown:
            return a, b
    return repr(epsilon), repr(target)


def _opacus_accountants() -> Any:
    """Opacus's ``accountants`` module, or one ConfigError that says how to install it. Importing Opacus calls
    ``logging.basicConfig`` (``opacus.utils.module_utils``): in a process whose root logger had no handler (a
    deployed run's ServerApp, a user's script) every library's records, fedweave's and Flower's, were then
    printed a second time; the handler it adds is taken off again."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        from opacus import accountants
    except ImportError as e:
        raise ConfigError(
            "privacy: the accountants need Opacus, an optional dependency; install it with "
            "pip install 'fedweave[privacy]'"
        ) from e
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
    return accountants


@ACCOUNTANTS.register("rdp")
def rdp() -> Any:
    """Opacus's RDP accountant (Renyi DP of the subsampled Gaussian; a valid upper bound on epsilon)."""
    return _opacus_accountants().RDPAccountant()


@ACCOUNTANTS.register("prv")
def prv() -> Any:
    """Opacus's PRV accountant (numerical composition of privacy random variables; a tighter upper bound)."""
    return _opacus_accountants().PRVAccountant()


@contextmanager
def _orders_quiet() -> Iterator[None]:
    """Opacus's RDP warning that the best order is the first or last of its default orders, silenced: the epsilon
    at that order is still a valid upper bound (a wider range could only lower it; docs/privacy.md says so), and
    the warning, printed on every call, would break a run's output and a refusal's one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the (smallest|largest) alpha", category=UserWarning)
        yield


CACHED = 100_000  # the epsilons an accountant keeps (a few MB of histories)


class Accountant:
    """The releases of a run and their epsilon at ``delta``, by the registered accountant ``name``."""

    def __init__(self, name: str, delta: float) -> None:
        self.name, self.delta = name, float(delta)
        self.impl = ACCOUNTANTS.get(name)()
        # history -> epsilon: asked for every row, and sample-level DP asks each client's history every round,
        # unchanged for the clients a round did not train (a PRV composition takes about 0.24 s)
        self._cache: dict[tuple, float] = {}
        self._one_step: dict[tuple[float, float], Any] = {}  # RDP: (z, q) -> one release's RDP at every order

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus's record: ``(noise_multiplier, sample_rate, steps)`` runs of equal steps."""
        return self.impl.history

    @property
    def steps(self) -> int:
        """The releases accounted so far."""
        return sum(s for _, _, s in self.history)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        """One more release of the Gaussian mechanism with this noise multiplier, sampled at this rate."""
        self.impl.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    def epsilon(self, history: list[tuple[float, float, int]] | None = None) -> float:
        """Epsilon at ``delta`` after the releases so far (or after ``history``); 0 before any, inf when a
        release had no noise."""
        hist = list(self.history if history is None else history)
        if not hist:
            return 0.0
        if any(z == 0 for z, _, _ in hist):
            return math.inf
        key = tuple(map(tuple, hist))
        if key in self._cache:
            return self._cache[key]
        # at sample rate 1 Opacus's PRV evaluates both sides of an np.where, one a log of 0 it then discards: its
        # "divide by zero" warnings say nothing about the epsilon, which is right
        with np.errstate(divide="ignore"), _orders_quiet():
            if type(self.impl) is _opacus_accountants().RDPAccountant:
                eps = self._rdp_epsilon(hist)
            else:
                probe = ACCOUNTANTS.get(self.name)()
                probe.history = [tuple(h) for h in hist]
                eps = float(probe.get_epsilon(delta=self.delta))
        if len(self._cache) >= CACHED:  # a long run's: the histories asked lately are the ones asked again
            self._cache.clear()
        self._cache[key] = eps
        return eps

    def _rdp_epsilon(self, hist: list[tuple[float, float, int]]) -> float:
        """Opacus's ``RDPAccountant.get_epsilon`` of ``hist``, the same arithmetic with each ``(z, q)``'s RDP of
        one release computed once per run: Opacus's ``compute_rdp`` is that vector times the steps, and evaluating
        it (one series per order) took about 0.08 s a call, where sample-level DP asks for one epsilon per client
        rate every round (the largest of them), and per-row metrics ask again."""
        from opacus.accountants.analysis import rdp as analysis

        orders = self.impl.DEFAULT_ALPHAS
        for z, q, _ in hist:
            if (z, q) not in self._one_step:
                self._one_step[z, q] = analysis.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=orders)
        rdp = sum([self._one_step[z, q] * s for z, q, s in hist])  # compute_rdp's ``rdp * steps``, summed as Opacus
        eps, _ = analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=self.delta)
        return float(eps)

    def epsilon_after_next(self, noise_multiplier: float, sample_rate: float) -> float:
        """Epsilon if one more such release were made (for stopping before a budget is exceeded)."""
        hist = [tuple(h) for h in self.history]
        if hist and hist[-1][0] == noise_multiplier and hist[-1][1] == sample_rate:
            hist[-1] = (hist[-1][0], hist[-1][1], hist[-1][2] + 1)
        else:
            hist.append((float(noise_multiplier), float(sample_rate), 1))
        return self.epsilon(hist)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.impl.history = [(float(z), float(q), int(s)) for z, q, s in state["history"]]


def calibrate(name: str, target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``delta`` in ``steps`` releases sampled at
    ``sample_rate`` (Opacus's ``get_noise_multiplier``, to within its tolerance of 0.01 in epsilon); a target
    below what the accountant reports at any noise is one ConfigError (:func:`below_floor`)."""
    _opacus_accountants()  # one line when Opacus is missing
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with _orders_quiet():
            return float(
                get_noise_multiplier(
                    target_epsilon=target_epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=steps,
                    accountant=name,
                )
            )
    except ValueError as e:  # Opacus: "The privacy budget is too low." (no noise up to its ceiling reaches it)
        raise ConfigError(below_floor(name, target_epsilon, delta) or f"privacy.target_epsilon: {e}") from e


# the largest noise multiplier Opacus's calibration tries (its ``MAX_SIGMA``)
NOISE_CEILING = 1e6


def below_floor(name: str, target_epsilon: float, delta: float) -> str | None:
    """The line that says ``target_epsilon`` is below the least epsilon accountant ``name`` reports at ``delta``
    whatever the noise (None when it is not): the RDP accountant's orders end at 63, so its epsilon never goes
    below about (ln(1/delta) - ln 63) / 62, 0.103 at delta 1e-5, where no noise multiplier would help."""
    floor = Accountant(name, delta).epsilon([(NOISE_CEILING, 1.0, 1)])
    if floor <= target_epsilon:
        return None
    other = "privacy.accountant: prv (a tighter bound), " if name == "rdp" else ""
    return (
        f"privacy.target_epsilon ({target_epsilon:g}) is below the least epsilon the {name} accountant reports at "
        f"privacy.delta {delta:g} with any noise ({floor:.4g} at noise multiplier {NOISE_CEILING:g}); use "
        f"{other}a larger privacy.delta or a larger target"
    )
