"""Centralized (star) FL: FedMIM and its baselines FedAvg, FedAdam/FedOpt, SCAFFOLD, FedDyn, FedCM
(+ MoFedSAM), FedSAM, and FedProx; the asynchronous FedAsync and FedBuff on the simulated clock."""

from fedweave.algorithms.centralized import (  # noqa: F401
    fedadam,
    fedasync,
    fedavg,
    fedbuff,
    fedcm,
    feddyn,
    fedmim,
    fedprox,
    fedsam,
    scaffold,
)
