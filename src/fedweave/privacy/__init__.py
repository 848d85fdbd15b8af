"""Differential privacy of federated training (the ``privacy`` config section; docs/privacy.md).

- :mod:`~fedweave.privacy.mechanism`: user-level DP of the star round's client updates (DP-FedAvg's clipping and
  central Gaussian noise, local DP, per-layer and adaptive clipping);
- :mod:`~fedweave.privacy.sample`: sample-level DP-SGD at every client, accounted per client;
- :mod:`~fedweave.privacy.accountant`: epsilon from Opacus's RDP and PRV accountants (``fedweave[privacy]``);
- :mod:`~fedweave.privacy.star`: which methods and samplers the proofs cover on the star template.
"""

from fedweave.privacy.accountant import Accountant, calibrate
from fedweave.privacy.mechanism import UserDP, clip_per_layer, update_noise_multiplier
from fedweave.privacy.sample import AccountedTrainer, SampleDP
from fedweave.privacy.star import graph_privacy, make_privacy, sampling

__all__ = [
    "AccountedTrainer",
    "Accountant",
    "SampleDP",
    "UserDP",
    "calibrate",
    "clip_per_layer",
    "graph_privacy",
    "make_privacy",
    "sampling",
    "update_noise_multiplier",
]
