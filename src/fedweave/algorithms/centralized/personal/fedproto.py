"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, AAAI 2022): clients keep their own models and share class
prototypes, not parameters.

Client i's prototype of class j is the mean representation of its samples of that class,
``C_i^(j) = 1/|D_ij| sum_{(x,y) in D_ij} f(phi_i; x)`` (Eq. 3). Round t (Alg. 1):
  the server sends the global prototypes Cbar, each with its class id, to the sampled clients
  each trains its own model on L_S(F(w_i; x), y) + lambda L_R                                   (Eqs. 7-8)
  with L_R, as the authors' code computes it, the squared distance of each sample's representation to its
  class's global prototype, averaged over the representation's coordinates and the batch (samples of a
  class without a global prototype add zero: the first round trains on L_S alone)
  and sends back its prototypes C_i (Eq. 3, under its new model, on its whole training data)
  the server sets Cbar^(j) to the mean of the C_i^(j) over the reporting clients that have class j     (Eq. 6)
Eq. 6 as printed weighs C_i^(j) by |D_ij|/N_j and divides by |N_j| again; the authors' code takes the plain
mean over the clients, which is the default here (``prototype_weighting: clients``); ``samples`` weighs by
|D_ij|/N_j (the class's mean representation over those clients' samples). A class no reporting client has
keeps its global prototype. There is no global model: a client's model is its own, and the metrics are its
classifier's on its own test set, with ``test_accuracy_proto`` for the paper's inference by the nearest global
prototype, ``argmin_j ||f(phi_i; x) - Cbar^(j)||_2`` (Eq. 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from fedweave.algorithms.centralized.base import Collected, StarHparams
from fedweave.algorithms.centralized.personal.base import PersonalStar
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule
from fedweave.execution.local import PLAIN
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, RULES


@RULES.register("fedproto")
class PrototypeRule(LocalRule):
    """``lambda * mean_d (f(w; x) - Cbar^(y))^2`` for each sample (L_R of Eq. 7, as the authors compute it),
    zero for a sample whose class has no global prototype.

    Args:
        lam: lambda, the weight of L_R.
        protos: the global prototypes, ``(C, D)``.
        known: which classes have one, ``(C,)`` bool.
    """

    def __init__(self, lam: float, protos: torch.Tensor, known: torch.Tensor) -> None:
        self.lam, self.protos, self.known = float(lam), protos, known

    def extra_loss(self, w, x, y, jobs, model):
        z = model.features(w, x)  # the local representation: the gradient flows through it
        near = (z - self.protos[y]).pow(2).mean(-1)
        return self.lam * torch.where(self.known[y], near, torch.zeros_like(near))


@dataclass
class FedProtoHparams(StarHparams):
    lam: float = 1.0  # lambda of Eq. 7 (the authors' default `ld`)
    prototype_weighting: Literal["clients", "samples"] = "clients"  # Eq. 6: see the module's docstring

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lam <= MAX_LR:  # a larger one is inf in float32: lam * 0 is NaN once prototypes exist
            raise ConfigError(f"algorithm.lam must be in [0, {MAX_LR:.6g}], got {self.lam}")
        if self.server_lr != 1.0:  # Eq. 6 sets each global prototype to the mean: a step size would go unread
            raise ConfigError(
                f"algorithm.server_lr: FedProto's server sets each class's prototype to the clients' mean and takes "
                f"no step size, got {self.server_lr}"
            )


@ALGORITHMS.register("fedproto")
class FedProto(PersonalStar):
    name = "fedproto"
    Hparams = FedProtoHparams
    step_sizes = ()  # server_lr must stay 1: the server sets each prototype to the mean
    global_model = False  # each client keeps its whole model (the store's ``personal`` rows)
    state_fields = ("protos", "known")  # the global prototypes; the clients' models are the store's
    undeployable: ClassVar[str] = "its clients' models are kept by the simulation's state store"
    handles_faults = ("dropout", "deadline")  # an attack and a robust aggregator act on model updates
    robust_aggregation = False
    compresses_uploads = False
    dp_refusal = "its clients send class prototypes of their data, not model updates"

    def __init__(self, ctx, hp: FedProtoHparams) -> None:
        super().__init__(ctx, hp)
        if not callable(getattr(ctx.model, "features", None)):
            raise ConfigError(
                f"algorithm fedproto shares the representations of model.features(), but {type(ctx.model).__name__} "
                "has none (docs/models.md: features(), head(), head_names())"
            )
        ds = ctx.dataset
        probe = self.layout.features(self.x, ctx.placement.data(ds.train_x[:1]))  # to read D
        del self.x  # no global model: the clients start from the run's model, kept in the store
        self.num_classes, self.dim = int(ds.num_classes), int(probe.shape[-1])
        dev = self.store["personal"].device
        self.protos = torch.zeros(self.num_classes, self.dim, dtype=probe.dtype, device=dev)  # Cbar
        self.known = torch.zeros(self.num_classes, dtype=torch.bool, device=dev)  # classes with a Cbar
        self.ledger.store("server", "prototypes", nbytes(self.protos, self.known))  # Cbar and its classes, kept
        self.reported: tuple[torch.Tensor, torch.Tensor] | None = None  # this round's sums and counts

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """The known global prototypes Cbar^(j) and the classes j they are of (the authors' server sends its
        {label: prototype} dict): D values and a 4-byte class id per known class, billed as the upload bills
        each class it names (:meth:`transmit_uploads`)."""
        ids = self.known.nonzero().squeeze(1).to(torch.int32)  # a client reads which class each prototype is
        return {"prototypes": (self.protos[self.known].reshape(-1), ids)}

    def client_rule(self, lr: float) -> LocalRule:
        if self.hp.lam == 0 or not bool(self.known.any()):  # no L_R term: plain local SGD keeps its fast paths
            return PLAIN
        return PrototypeRule(self.hp.lam, self.protos, self.known)

    def client_starts(self, clients: np.ndarray) -> torch.Tensor:
        return self.store.rows("personal", clients)  # each client's own model

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        got = super().train_clients(r, clients)  # its own model on L_S + lambda L_R (Eqs. 7-8)
        self.store.set_rows("personal", clients, got.local.params)
        self.reported = self.class_sums(got.local.params, clients)  # Eq. 3's numerators and denominators
        return got

    def class_sums(self, params: torch.Tensor, clients: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Each client's sum of representations per class on its training data, ``(n, C, D)``, and its
        number of samples per class, ``(n, C)``, under its model (row k of ``params`` for ``clients[k]``)."""
        ds, pl, batch = self.ctx.dataset, self.ctx.placement, self.config.eval.batch_size
        x, y = pl.data(ds.train_x), pl.data(ds.train_y)
        sums = self.protos.new_zeros(len(clients), self.num_classes, self.dim)
        counts = self.protos.new_zeros(len(clients), self.num_classes)
        with torch.no_grad():
            for k, c in enumerate(clients):
                rows = torch.as_tensor(self.ctx.partition[int(c)], dtype=torch.long, device=x.device)
                # a client without a sample (a dirichlet split with min_size: 0) has no class: its sums stay 0
                for part in rows.split(batch) if len(rows) else ():
                    z, labels = self.layout.features(params[k], x[part]), y[part]
                    sums[k].index_add_(0, labels, z.to(sums.dtype))
                    counts[k].index_add_(0, labels, torch.ones_like(labels, dtype=counts.dtype))
        return sums, counts

    def transmit_uploads(self, r: int, got: Collected) -> Collected:
        """Each reporting client sends the prototypes of its classes: D values and 8 bytes (the class id and its
        count, 4 bytes each) per class it has."""
        _, counts = self.reported
        classes = int((counts > 0).sum())
        self.ledger.record(
            r, "client", "server", "prototypes", classes * (self.dim * self.ctx.float_bytes + 8), len(got.clients)
        )
        return got

    def aggregate(
        self, updates: torch.Tensor, weights: torch.Tensor, clients: np.ndarray | None = None
    ) -> torch.Tensor:
        """The new global prototypes (Eq. 6), ``(C, D)``; zero for a class no reporting client has (which
        :meth:`server_update` leaves as it was)."""
        sums, counts = self.reported
        if self.hp.prototype_weighting == "samples":  # sum_i |D_ij| C_i^(j) / N_j: the class's mean representation
            return sums.sum(0) / counts.sum(0).clamp_min(1).unsqueeze(1)
        means = sums / counts.clamp_min(1).unsqueeze(2)  # C_i^(j) (Eq. 3); zero where the client lacks j
        holders = (counts > 0).sum(0)  # |N_j| among the reporting clients
        return means.sum(0) / holders.clamp_min(1).unsqueeze(1).to(means.dtype)  # their plain mean

    def client_updates(self, got: Collected) -> torch.Tensor:
        return got.local.params  # unused by this aggregate: what the clients send are their prototypes

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        reported = self.reported[1].sum(0) > 0  # the classes some reporting client has
        self.protos = torch.where(reported.unsqueeze(1), mean, self.protos)
        self.known = self.known | reported
        self.reported = None

    def evaluate(self, r: int) -> dict[str, float]:
        """Each client's model on its own test set (``PersonalStar``'s metrics under the plain names) and
        ``test_accuracy_proto``: the mean over the clients of the accuracy of Eq. 4's nearest-prototype rule."""
        out = super().evaluate(r)
        if not bool(self.known.any()) or not self.ctx.task.is_default:
            return out
        x, y, parts = self.ctx.personal_test_set()
        pl, models = self.ctx.placement, self.store["personal"]
        x, y = pl.data(x), pl.data(y)
        classes = self.known.nonzero().squeeze(1)  # only classes with a global prototype can be guessed
        accs = []
        with torch.no_grad():
            for i, idx in enumerate(parts):
                rows = torch.as_tensor(idx, dtype=torch.long, device=x.device)
                if len(rows) == 0:
                    continue
                z = self.layout.features(models[i], x[rows]).to(self.protos.dtype)
                guess = classes[torch.cdist(z, self.protos[classes]).argmin(1)]  # Eq. 4
                accs.append(float((guess == y[rows]).double().mean()))
        out["test_accuracy_proto"] = float(np.mean(accs))
        return out
