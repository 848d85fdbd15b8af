"""Centralized (star) FL: FedMIM and its baselines FedAvg, FedAdam/FedOpt, SCAFFOLD, FedDyn, FedCM
(+ MoFedSAM), FedSAM, and FedProx; the personalized methods in ``personal``."""

from fedweave.algorithms.centralized import (  # noqa: F401
    fedadam,
    fedavg,
    fedcm,
    feddyn,
    fedmim,
    fedprox,
    fedsam,
    personal,
    scaffold,
)
