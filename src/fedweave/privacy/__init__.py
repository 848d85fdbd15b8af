"""Differential privacy of federated training (the ``privacy`` config section; docs/privacy.md).

- :mod:`~fedweave.privacy.mechanism`: user-level DP of the star round's client updates (DP-FedAvg's clipping and
  central Gaussian noise, local DP, per-layer and adaptive clipping);
- :mod:`~fedweave.privacy.ftrl`: DP-FTRL (tree-aggregated prefix sums of the clipped updates, no amplification);
- :mod:`~fedweave.privacy.buffered`: DP-FedBuff (each upload clipped, one noise per buffer, accounted per client);
- :mod:`~fedweave.privacy.sample`: sample-level DP-SGD at every client, accounted per client;
- :mod:`~fedweave.privacy.accountant`: epsilon from Opacus's RDP and PRV accountants (``fedweave[privacy]``);
- :mod:`~fedweave.privacy.star`: which methods and samplers the proofs cover on the star template;
- :mod:`~fedweave.privacy.split`: DP-FedAvg on the split family's client-side models (not its smashed data).
"""

from fedweave.privacy.accountant import Accountant, calibrate
from fedweave.privacy.buffered import BufferedDP
from fedweave.privacy.ftrl import (
    FTRLDP,
    TreeNoise,
    client_history,
    decomposition,
    gaussian_history,
    tree_counts,
    tree_sensitivity,
)
from fedweave.privacy.mechanism import UserDP, clip_per_layer, update_noise_multiplier
from fedweave.privacy.sample import AccountedTrainer, SampleDP
from fedweave.privacy.star import graph_privacy, make_privacy, sampling

__all__ = [
    "FTRLDP",
    "AccountedTrainer",
    "Accountant",
    "BufferedDP",
    "TreeNoise",
    "SampleDP",
    "UserDP",
    "calibrate",
    "client_history",
    "clip_per_layer",
    "decomposition",
    "gaussian_history",
    "graph_privacy",
    "make_privacy",
    "sampling",
    "tree_counts",
    "tree_sensitivity",
    "update_noise_multiplier",
]
