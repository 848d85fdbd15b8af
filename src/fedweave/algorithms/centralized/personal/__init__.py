"""The star's personalized methods: FedPer, FedRep, LG-FedAvg, FedBN, APFL, Ditto, pFedMe, Per-FedAvg and
FedBABU, each client keeping a personal model that is evaluated on its own test set (``personal.base``);
FedProto, whose clients share class prototypes only; and the clustered IFCA, each client picking one of the
server's cluster models."""

from fedweave.algorithms.centralized.personal import (  # noqa: F401
    apfl,
    ditto,
    fedbabu,
    fedbn,
    fedper,
    fedproto,
    fedrep,
    ifca,
    lg_fedavg,
    perfedavg,
    pfedme,
)
