"""Centralized (star) FL: FedMIM and its baselines FedAvg, FedAdam/FedOpt, SCAFFOLD, FedDyn, FedCM
(+ MoFedSAM), FedSAM, and FedProx; the heterogeneity and fairness baselines FedNova, FedExP, MOON, FedLC,
q-FFL and AFL; Scaffnew (ProxSkip); the asynchronous FedAsync and FedBuff on the simulated clock; the
personalized and clustered methods in ``personal``."""

from fedweave.algorithms.centralized import (  # noqa: F401
    afl,
    fedadam,
    fedasync,
    fedavg,
    fedbuff,
    fedcm,
    feddyn,
    fedexp,
    fedlc,
    fedmim,
    fednova,
    fedprox,
    fedsam,
    moon,
    personal,
    proxskip,
    qffl,
    scaffold,
)
