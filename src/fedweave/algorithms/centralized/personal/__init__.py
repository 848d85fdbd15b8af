"""The star's personalized methods: FedPer, FedRep, LG-FedAvg, FedBN, APFL, Ditto, pFedMe, Per-FedAvg and
FedBABU, each client keeping a personal model that is evaluated on its own test set (``personal.base``);
FedProto, whose clients share class prototypes only; and the clustered IFCA (each client picks one of the
server's cluster models) and CFL (a cluster splits when its clients' updates disagree)."""

from fedweave.algorithms.centralized.personal import (  # noqa: F401
    apfl,
    clustered_fl,
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
