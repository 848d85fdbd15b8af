"""Sample-level DP: DP-SGD at every client (``privacy.level: sample``), accounted per client.

Each local step of client i is DP-SGD (:class:`fedweave.execution.dpsgd.DPSGD`: per-sample clipping to C,
``N(0, sigma^2 C^2 I)`` on the batch's sum) on a batch of B of its n_i samples. Client i's data are protected
by the composition of its steps, each a Gaussian mechanism sampled at rate ``q_i = B / n_i`` (1 under
full-batch training or when n_i <= B). The accountant is told ``(sigma, q_i, steps_i)`` with ``steps_i`` the
local steps client i has done so far, and the run reports the largest epsilon over the clients.

Opacus's accountants assume Poisson sampling of each batch; fedweave's local batches are a shuffled pass
(fixed size, without replacement within an epoch), as in most DP-SGD code. The reported epsilon is the number
those implementations report, not a proof for shuffled batches (docs/privacy.md says so). With
``privacy.amplification: none`` every step is accounted at q = 1 instead, a bound that holds for any batching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedweave.config import ConfigError
from fedweave.execution.dpsgd import PrivateTrainer, unprivatized_loss
from fedweave.execution.local import LR, PLAIN, LocalResult, LocalRule
from fedweave.privacy.accountant import Accountant


class AccountedTrainer(PrivateTrainer):
    """A :class:`PrivateTrainer` that counts each client's DP-SGD steps for the accountant."""

    steps_done: np.ndarray  # per client: the local DP-SGD steps done so far
    steps_per_round: int  # the most steps one client does in one round
    round_steps: np.ndarray  # per client: the most steps it does in one round (the budget's look-ahead)

    def train(
        self,
        starts: torch.Tensor,
        clients: Sequence[int],
        round: int,
        *,
        rule: LocalRule = PLAIN,
        lr: LR | None = None,
        steps: int | None = None,
        key: tuple[int, ...] = (),
    ) -> LocalResult:
        if rule.draws > 1:  # each draw is a noisy gradient of its own, and the accountant counts one per step
            raise ConfigError(
                f"privacy.level: sample: the method's local rule draws {rule.draws} independent batches a step, "
                "each a noisy gradient, where the accountant counts one per step; use privacy.level: user"
            )
        if how := unprivatized_loss(rule):  # DP-SGD clips per-sample gradients of the task's loss only
            raise ConfigError(
                f"privacy.level: sample: the method's local rule {how}, whose gradient DP-SGD (which clips and "
                "noises the task loss's per-sample gradients) would not privatize; use privacy.level: user"
            )
        out = super().train(starts, clients, round, rule=rule, lr=lr, steps=steps, key=key)
        ids, taken = np.asarray(clients, dtype=np.int64), out.steps.cpu().numpy().astype(np.int64)
        if len(out.steps):
            self.steps_per_round = max(self.steps_per_round, int(out.steps.max()))
            np.maximum.at(self.round_steps, ids, taken)
        np.add.at(self.steps_done, ids, taken)
        return out


class SampleDP:
    """The accounting of DP-SGD at every client: epsilon of the client that has spent the most."""

    # the server releases nothing of its own: a round in which nobody reported trains nobody and accounts nothing
    releases_empty_rounds = False

    def __init__(self, trainer: AccountedTrainer, z: float, rates: np.ndarray, accountant: Accountant) -> None:
        self.trainer, self.z, self.rates, self.accountant = trainer, float(z), rates, accountant
        self._seen: np.ndarray | None = None  # steps_done at the last look-ahead (the budget's, once a round)

    def clip(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: nothing to do at the server (the clients privatized every step)."""
        return updates, weights

    def noise(self, mean: torch.Tensor) -> torch.Tensor:
        """Stage 5: nothing to do at the server."""
        return mean

    def epsilon_after_next(self, next_round: int | None = None) -> float:
        """Epsilon if every client did one more round of its own steps, at its own q_i (an upper bound, for the
        budget: whoever the next round draws)."""
        done = self.trainer.steps_done
        seen = self._seen if self._seen is not None else np.zeros_like(done)
        # each client's round: the most steps it did in one call (at first its planned steps), or what it did
        # since the last look (several calls); not the most of any client, which a small client at q_i = 1 never does
        more = np.maximum(self.trainer.round_steps, done - seen)
        self._seen = done.copy()
        return max((self.accountant.epsilon([(self.z, q, s)]) for q, s in self._pairs(done + more)), default=0.0)

    def _pairs(self, steps: np.ndarray | None = None) -> list[tuple[float, int]]:
        """The (q_i, steps_i) of the clients with steps (default: those done so far), reduced to those no other
        client dominates (epsilon grows with both, so the largest epsilon is among them)."""
        steps = self.trainer.steps_done if steps is None else steps
        pairs = sorted({(float(q), int(s)) for q, s in zip(self.rates, steps) if s > 0}, reverse=True)
        front, most = [], -1
        for q, s in pairs:  # by q descending: keep a pair only if it has more steps than every larger q
            if s > most:
                front.append((q, s))
                most = s
        return front

    def epsilon(self) -> float:
        """The largest epsilon of any client at the run's delta (0 before any step; inf without noise)."""
        pairs = self._pairs()
        if not pairs:
            return 0.0
        return max(self.accountant.epsilon([(self.z, q, s)]) for q, s in pairs)

    def metrics(self) -> dict[str, float]:
        eps = self.epsilon()
        return {"epsilon": eps} if math.isfinite(eps) else {}

    def summary(self) -> dict[str, Any]:
        eps = self.epsilon()
        return {
            "level": "sample",
            "mechanism": "dpsgd",
            "epsilon": eps if math.isfinite(eps) else None,
            "delta": self.accountant.delta,
            "accountant": self.accountant.name,
            "noise_multiplier": self.z,
            "clip": self.trainer.dp_clip,
            "max_local_steps": int(self.trainer.steps_done.max()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.trainer.steps_done.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.steps_done = np.asarray(state["steps_done"], dtype=np.int64)
        # the budget's next look counts the steps done since the checkpoint's round, as the uninterrupted run's
        # look after that round did (not since the run's start: that would stop a resumed run early)
        self._seen = self.trainer.steps_done.copy()


def sample_rates(sizes: Sequence[int], batch_size: int, full_batch: bool) -> np.ndarray:
    """Each client's per-step sampling rate ``q_i = min(1, B / n_i)`` (1 under full-batch training)."""
    n = np.asarray(sizes, dtype=np.float64)
    return np.ones_like(n) if full_batch else np.minimum(1.0, batch_size / np.maximum(n, 1.0))
