"""DP-FedAvg in the split family: the fed server's average of the client-side models (docs/privacy.md).

A split client sends the fed server its client-side model (and, for CSE-FSL and FSL_AN, its auxiliary net) once
per round, and the fed server averages them (eq. 14). That average is DP-FedAvg's release here: each reporting
client's update ``(x_c,i - x_c, a_c,i - a_c)`` (both parts in one vector, the whole message of the client) is
clipped to C by the privacy package's :class:`~fedweave.privacy.mechanism.UserDP`, the sum gets ``N(0, sigma^2
C^2 I)`` and is divided by E, the expected clients of a round, and the accountant counts one release per round
(amplified with ``sampler: bernoulli``, as for the star).

Which methods: FSL_AN and CSE-FSL, whose clients train on a local loss through the auxiliary net. FSL_MC and
FSL_OC are refused (their ``dp_refusal``): their clients back-propagate gradients of a server-side model fitted to
every client's smashed data, so one client's data move the others' updates and the sum's sensitivity is not C.

What this does NOT protect: the smashed data (activations) and labels each client sends the main server every
batch, the gradients that come back, and the server-side model(s) trained on them. Only the fed server's
client-side model and auxiliary net are covered; the trained model ``x_s . x_c`` as a whole is not.
"""

from __future__ import annotations

from typing import Any

import torch

from fedweave.config import ConfigError
from fedweave.privacy.mechanism import UserDP
from fedweave.privacy.star import make_privacy


def split_privacy(algo: Any) -> UserDP | None:
    """The DP stages of a split method's fed server (None without a ``privacy`` section); what the proof does
    not cover is one ConfigError naming ``privacy``."""
    if algo.config.privacy is None:
        return None
    if getattr(algo.hp, "agg_every", None) is not None:
        raise ConfigError(
            f"privacy: algorithm.agg_every ({algo.hp.agg_every}) averages the same sampled clients' models several "
            "times a round, which one accounted release per Poisson draw does not cover; set it to null"
        )
    numels = list(algo.lc.numels) + (list(algo.la.numels) if algo.uses_aux else [])
    return make_privacy(algo, algo.per_round, algo.ctx.num_clients, numels=numels)


def private_average(dp: UserDP, base: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """DP-FedAvg's new model from the fed server's ``base`` and the reporting clients' models ``rows`` (one row
    each): ``base + (sum_i clip(rows_i - base, C) + N(0, sigma^2 C^2 I)) / E``."""
    updates = rows - base
    clipped, weights = dp.clip(updates, torch.ones(len(rows), dtype=rows.dtype, device=rows.device))
    # base + clip(d_i), written as rows_i - (d_i - clip(d_i)): a model within the clip keeps its bits (the
    # difference is exactly 0), so without noise and clipping this is the plain uniform average bit for bit
    models = rows - (updates - clipped)
    mean = weights @ models  # sum_i (base + clip(d_i)) / E
    absent = 1 - len(rows) / dp.expected  # the fixed denominator: the E - k clients that did not report add 0
    if absent:
        mean = mean + absent * base
    return dp.noise(mean)  # central noise on the sum over E, the adaptive clip's step, one accounted release
