"""DP-FedBuff: user-level central DP of buffered asynchronous aggregation (Nguyen et al., AISTATS 2022, FedBuff
with the clipping and server-side Gaussian noise of DP-FedAvg, McMahan et al. 2018), accounted per client without
any amplification by sampling.

Mechanism. Each arriving update ``Delta_i = y_i - x_tau`` is clipped to L2 norm C. When the buffer holds K uploads,
the server releases the noised sum ``S~ = sum_i s(t - tau_i) clip(Delta_i, C) + N(0, sigma^2 C^2 I)`` and steps
``x <- x + eta_g S~ / K``. The aggregation weight of every upload is 1/K, fixed by the configuration (never the
clients' data sizes: ``weighting: samples`` is refused) and applied after the noise, as DP-FedAvg's 1/E; the
staleness weights ``s(t - tau) <= 1`` (every ``staleness`` function with ``staleness_a >= 0``) are fixed by the
schedule before the noise. So one upload moves ``S~`` by at most ``s C <= C``: the noise is scaled to the largest
weight one contribution can get, 1.

Accounting. A client may take part several times in one buffer (it is dispatched again while the buffer fills) and
in many buffers. Its ``c_t`` uploads to step t add up inside the one noised sum, so step t is, for that client, the
Gaussian mechanism of sensitivity ``c_t C`` (all its updates aligned: the worst case), that is of Renyi DP
``alpha c_t^2 / (2 sigma^2)``; the steps compose to ``alpha (sum_t c_t^2) / (2 sigma^2)``, one Gaussian mechanism of
noise multiplier ``sigma / sqrt(sum_t c_t^2)`` (exactly: the Gaussian mechanisms compose to a Gaussian one, so the
PRV accountant gets the same number as composing them one by one). The run's epsilon is that of the client with the
largest ``sum_t c_t^2``, computed by Opacus at sample rate 1 through the same function as DP-FTRL's trees
(:func:`fedweave.privacy.ftrl.client_history`). No amplification is claimed: the dispatch order is the
simulation's schedule, not Poisson sampling.

Threat model. The counts come from the schedule: who is dispatched when, and when each upload arrives, follow from
the seed (the ``client_sampling`` draws, the latencies and faults of :mod:`fedweave.faults`) and from each client's
amount of local work (its number of local steps, so its data size), never from its data's values or the model. The
schedule is treated as public, as the seeds are; the neighbouring runs are DP-FedAvg's add/remove with the schedule
held fixed: one client's clipped contributions present, or all zero (replacing them by others in the C-ball would
move a sum by up to 2C). The same replay of the schedule tells the budget who the next step's uploads come from
before it is run (:meth:`fedweave.algorithms.centralized.async_base.AsyncStar.upcoming_clients`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedweave.privacy.ftrl import client_history
from fedweave.privacy.mechanism import UserDP


class BufferedDP(UserDP):
    """DP-FedBuff's stages: :meth:`clip` (each upload clipped, weight 1/K) and :meth:`noise` (Gaussian noise of std
    sigma C on the staleness-weighted sum, over K; the step's uploads counted per client)."""

    def __init__(self, *, num_clients: int, **kw: Any) -> None:
        super().__init__(mechanism="central", sample_rate=1.0, **kw)
        # sum over the released steps of (the client's uploads in the step)^2: its squared sensitivity in C^2
        self.squared = np.zeros(int(num_clients), dtype=np.int64)
        self.upcoming: Callable[[int], np.ndarray] | None = None  # step -> its uploads' clients (the look-ahead)
        self._clients: np.ndarray | None = None

    def clip(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each upload clipped to C and weighted 1/K; ``clients`` (one id per upload, repeats allowed) are kept for
        the step's counts."""
        if clients is None:
            raise ValueError("DP-FedBuff's clipping stage needs the client of each upload")
        self._clients = np.asarray(clients, dtype=np.int64)
        return super().clip(updates, weights)

    def noise(self, mean: torch.Tensor) -> torch.Tensor:
        """``(sum_i s_i clip(Delta_i) + N(0, sigma^2 C^2 I)) / K`` from ``mean`` (the weighted sum over K), the noise
        from the ``("dp", step)`` stream as DP-FedAvg's; the step's uploads are counted per client."""
        assert self._clients is not None, "clip() comes before noise()"
        if self.z:
            mean = mean + (self.z * self.clip_norm / self.expected) * self._gaussian(mean.shape, mean, "dp")
        self.squared += counts(self._clients, len(self.squared)) ** 2
        self._clients = None
        self.releases += 1
        self.accountant.impl.history = self.history()  # what Opacus is told, for whoever reads the accountant
        return mean

    # ---- accounting -------------------------------------------------------------------------------
    def history(self, squared: np.ndarray | None = None) -> list[tuple[float, float, int]]:
        """Opacus's history: the worst client's composed Gaussian mechanism, noise multiplier
        ``sigma / sqrt(max_i sum_t c_{i,t}^2)`` at sample rate 1 (empty before any upload)."""
        return client_history(self.z, self.squared if squared is None else squared)

    def epsilon(self) -> float:
        """Epsilon at the run's delta after the steps so far, of the client with the most squared contributions."""
        return self.accountant.epsilon(self.history())

    def epsilon_after_next(self, next_round: int | None = None) -> float:
        """Epsilon after one more server step: its uploads' clients replayed from the schedule (``upcoming``; the
        next step is ``releases`` when no round is given), or, without a replay, every client with all K uploads
        of the step (an upper bound whatever the schedule)."""
        step = self.releases if next_round is None else next_round
        if self.upcoming is not None:
            ahead = counts(self.upcoming(step), len(self.squared))
        else:
            ahead = np.full(len(self.squared), int(self.expected), dtype=np.int64)
        return self.accountant.epsilon(self.history(self.squared + ahead**2))

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(buffer_size=self.expected, squared_sensitivity=int(self.squared.max(initial=0)))
        return out

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["squared"] = self.squared.tolist()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.squared = np.asarray(state["squared"], dtype=np.int64)
        self.accountant.impl.history = self.history()


def counts(clients: np.ndarray, num_clients: int) -> np.ndarray:
    """Each client's number of entries in ``clients`` (its uploads to one step), ``(num_clients,)`` int64."""
    return np.bincount(np.asarray(clients, dtype=np.int64), minlength=num_clients).astype(np.int64)
