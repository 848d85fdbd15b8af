"""FedBuff (Nguyen et al., AISTATS 2022, Alg. 1): buffered asynchronous aggregation on the simulated clock.

Clients train from the model they were sent, ``x_tau``, and send ``Delta_i = y_i - x_tau``; the server adds
each arrival to a buffer, and once ``buffer_size`` K of them are in it steps
``x <- x + eta_g sum_i p_i s(t - tau_i) Delta_i`` (``p_i`` the aggregation weights over the buffer,
``weighting``: samples or uniform, the paper's 1/K; ``s`` the staleness weighting, the paper's
``1/sqrt(1 + tau)`` by default). The clock, the dispatching and the staleness functions are the protocol's
(``async_base.py``).

With a ``privacy`` section it is DP-FedBuff (:mod:`fedweave.privacy.buffered`): each upload clipped to C, the
buffer's staleness-weighted sum noised with N(0, sigma^2 C^2 I) and divided by K.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.centralized.async_base import AsyncHparams, AsyncStar
from fedweave.config import ConfigError
from fedweave.privacy.star import check_first_release
from fedweave.registry import ALGORITHMS


@dataclass
class FedBuffHparams(AsyncHparams):
    buffer_size: int = 10  # K: the updates that make one server step (the paper's K = 10)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.buffer_size < 1:
            raise ConfigError(f"algorithm.buffer_size must be >= 1, got {self.buffer_size}")


@ALGORITHMS.register("fedbuff")
class FedBuff(AsyncStar):
    name = "fedbuff"
    Hparams = FedBuffHparams
    uplink = "update"  # Delta_i = y_i - x_tau
    # privacy: DP-FedBuff (fedweave.privacy.buffered): each upload clipped, one noise per buffer, each client
    # accounted by its uploads per step
    dp_refusal = None

    def __init__(self, ctx, hp: FedBuffHparams) -> None:
        super().__init__(ctx, hp)
        self.buffer_size = hp.buffer_size
        # the buffer of K decoded updates Delta_i (d values each) the server holds until its step (Alg. 1): kept
        # row by row, as a robust aggregator and DP-FedBuff's per-upload clipping read every row
        self.ledger.store("server", "update_buffer", hp.buffer_size * self.num_params * ctx.float_bytes)
        if self.privacy is not None:  # the budget replays the schedule to learn whose uploads the next step takes
            self.privacy.upcoming = self.upcoming_clients
            check_first_release(ctx.config.privacy, self.privacy)

    def reduced_per_round(self) -> tuple[int, ...]:
        return (self.hp.buffer_size,)  # a server step reduces one buffer of K arrivals

    def apply(
        self, deltas: torch.Tensor, models: torch.Tensor, weights: torch.Tensor, s: torch.Tensor, clients: np.ndarray
    ) -> None:
        if self.privacy is not None:  # DP-FedBuff: (sum_i s_i clip(Delta_i) + N(0, sigma^2 C^2 I)) / K
            # the sensitivity C per upload needs s(t - tau) <= 1, which every staleness function with a >= 0 gives
            assert float(s.max()) <= 1.0, "a staleness weight above 1 would exceed the noise's sensitivity C"
            clipped, w = self.privacy.clip(deltas, weights, clients)  # w = 1/K each, whatever weighting says
            step = self.privacy.noise((w * s) @ clipped)
        elif self.robust is None:
            step = self.aggregate(deltas, weights * s)  # sum_i p_i s(t - tau_i) Delta_i
        else:  # an aggregator may ignore or renormalize weights: the rows carry s(t - tau_i), the weights sum to one
            step = self.aggregate(s.unsqueeze(1) * deltas, weights)
        self.x = self.x + self.hp.server_lr * step  # Alg. 1, server lines
