"""What the star's personalized methods share: each client's personal model, kept in the client state store,
evaluated on the client's own test set beside the global model's test metric.

:class:`PersonalStar` keeps one personal model per client (a row of ``store["personal"]``, the global model
at the start) and adds, to the star's global evaluation, the personal models' metrics on each client's own
test set (``ctx.personal_test_set``: the client's held-out samples under ``eval.holdout``, else a draw
from the test split with its label distribution): ``test_accuracy_personal``, ``test_loss_personal`` and
the worst client's ``test_accuracy_personal_min`` (under another task ``test_<metric>_personal`` and
``test_<main>_personal_worst``). Under an attack (``faults.byzantine``) these are the honest clients' figures, as
Ditto reports accuracy on the benign devices (Li, Hu, Beirami & Smith 2021, Sec. 5): an attacker's own model
serves no one. Under a backdoor attack ``test_backdoor_success`` is the honest clients' personal models' mean, and
the global model's is ``test_backdoor_success_global`` (docs/robustness.md).

:class:`PartialSharing` is the template of the methods that share part of the model and keep the rest
(FedPer, FedRep, LG-FedAvg, FedBN): a boolean mask over the flat parameter vector marks the personal
coordinates. A client starts from the global model on the shared coordinates and from its own model on
the personal ones, sends back only the shared coordinates, and the server averages those; the personal
coordinates of the global model never move. With no personal coordinate it is FedAvg bit for bit.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np
import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, per_job
from fedweave.config import ConfigError
from fedweave.execution import LocalResult, StateStore, client_means, evaluate_clients, evaluate_clients_task
from fedweave.execution.local import LocalRule
from fedweave.execution.params import ParamLayout


class PersonalStar(StarAlgorithm):
    """A star method whose clients keep personal models (``store["personal"]``), evaluated on their own
    test sets beside the global model."""

    # the deployment keeps a client's state on its node through a ClientStep; these methods keep their
    # personal models in the server's store, so they are refused for deployment (fedweave.deploy.support)
    undeployable: ClassVar[str] = "its clients' personal models are kept by the simulation's state store"

    own_test_sets = True  # the personal models are evaluated on the clients' own test sets
    keeps_personal: ClassVar[bool] = True  # False: the personal models are derived, not kept (Per-FedAvg)
    # False: the method has no global model (IFCA, FedProto), so its test metrics are the personal models' on the
    # clients' own test sets, under the plain names (test_accuracy, ...), as eval.personal_test names them
    global_model: ClassVar[bool] = True

    def __init__(self, ctx, hp) -> None:
        if not self.global_model and ctx.config.eval.per_client:
            raise ConfigError(
                f"eval.per_client scores the global model on each client's training data, but algorithm {self.name} "
                "has no global model (its clients' own models are scored on their own test sets); leave it out"
            )
        super().__init__(ctx, hp)
        if not self.keeps_personal:
            return
        self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("personal", self.num_params, fill=self.x)  # v_i = x_0
        self.ledger.store("client", "personal_model", self.num_params * ctx.float_bytes)  # per client

    def personal_models(self, r: int) -> torch.Tensor:
        """The model each client uses after round ``r``, ``(N, P)``: its personal model by default."""
        return self.store["personal"]

    def evaluate(self, r: int) -> dict[str, float]:
        models = self.personal_models(r)
        if not self.global_model:  # the clients' own models are the method's: the plain names, eval.distribution
            out, per, ids = self.personal_metrics(models, "")
            out.update(self.personal_backdoor_metrics(models))
            if self.config.eval.distribution:
                out.update(self.client_distribution(r, per, ids))
            return out
        out = super().evaluate(r)  # the global model on the global test split (and eval.personal_test's)
        return {**out, **self.personal_metrics(models, "_personal")[0], **self.personal_backdoor_metrics(models)}

    def backdoor_metrics(self) -> dict[str, float]:
        """Under a backdoor attack (robustness), the global model's figure as ``test_backdoor_success_global``:
        the plain name is the honest clients' own models' (:meth:`personal_backdoor_metrics`), the models they
        use."""
        return {f"{k}_global": v for k, v in super().backdoor_metrics().items()}

    def personal_backdoor_metrics(self, models: torch.Tensor) -> dict[str, float]:
        """Under a backdoor attack (robustness), ``test_backdoor_success``: its mean over the honest clients of
        client i's model (row i of ``models``), each scored as the star scores its global model; an attacker's own
        model is not what the attack does to the others. Nothing otherwise."""
        if self.robust is None:
            return {}
        honest = (models[int(i)] for i in self.robust.honest())  # row by row: no copy of the (N, P) table
        return self.robust.mean_backdoor_metrics(self.layout, honest, self.ctx.dataset, self.config.eval.batch_size)

    def personal_metrics(
        self, models: torch.Tensor, suffix: str
    ) -> tuple[dict[str, float], dict[str, np.ndarray], np.ndarray | None]:
        """Client i's model (row i of ``models``) on client i's own test set: the means over the evaluated clients
        (:meth:`~fedweave.algorithms.centralized.base.StarAlgorithm.evaluated`: the honest ones under an attack)
        of ``test_accuracy<suffix>`` and ``test_loss<suffix>`` and the worst one's ``test_accuracy<suffix>_min``
        (under another task ``test_<metric><suffix>`` and ``test_<main><suffix>_worst``), each evaluated
        client's values of the task's metrics, and the evaluated clients' ids (None: every client, in order)."""
        ev, task = self.config.eval, self.ctx.task
        x, y, parts = self.ctx.personal_test_set()
        parts, ids = self.evaluated(parts)
        if ids is not None:  # the attackers' rows left out too
            models = models[torch.as_tensor(ids, device=models.device)]
        if task.is_default:
            accs, losses = evaluate_clients(self.layout, models, x, y, parts, ev.batch_size)
            out = {
                f"test_accuracy{suffix}": float(accs.mean()),
                f"test_loss{suffix}": float(losses.mean()),
                f"test_accuracy{suffix}_min": float(accs.min()),
            }
            return out, {"accuracy": accs, "loss": losses}, ids
        per = evaluate_clients_task(self.layout, models, x, y, parts, task, ev.batch_size)
        means, worst = client_means(per, task.main, task.direction)
        out = {f"test_{k}{suffix}": v for k, v in means.items()}
        out[f"test_{task.main}{suffix}_worst"] = worst
        return out, per, ids


def name_mask(layout: ParamLayout, names: set[str] | list[str]) -> torch.Tensor:
    """The coordinates of the flat parameter vector that belong to the parameters ``names``, ``(P,)`` bool."""
    names = set(names)
    unknown = names - set(layout.names)
    if unknown:
        raise ValueError(f"not parameters of the model: {sorted(unknown)}")
    dev = layout.placement.device
    parts = [
        torch.full((n,), name in names, dtype=torch.bool, device=dev) for name, n in zip(layout.names, layout.numels)
    ]
    return torch.cat(parts)


log = logging.getLogger(__name__)


def warn_if_nothing_shared(personal: torch.Tensor, algorithm: str, model: torch.nn.Module, outcome: str) -> None:
    """Log once, at the start of a run, when the personal coordinates ``personal`` cover the whole model (a model
    whose head is all of it: ``logistic``, an ``mlp`` without hidden layers): the method then degenerates into
    ``outcome``, which a run may mean (a control) but rarely does."""
    if bool(personal.all()):
        log.warning(
            "algorithm %s: the head of %s is the whole model (no body), so %s",
            algorithm,
            type(model).__name__,
            outcome,
        )


def head_names(model: torch.nn.Module, algorithm: str) -> list[str]:
    """The model's head parameters (``fedweave.models.head``), or a one-line ConfigError naming the method."""
    names = getattr(model, "head_names", None)
    if not callable(names) or getattr(model, "no_head", None):
        raise ConfigError(
            f"algorithm {algorithm} splits the model into a body and a head, but {type(model).__name__} has no "
            "head_names() (docs/models.md: features(), head(), head_names())"
        )
    return list(names())


class FreezeRule(LocalRule):
    """Local SGD that leaves the coordinates ``frozen`` at ``anchor`` (FedRep's alternating phases): after
    each step they are put back, so weight decay and momentum do not move them either.

    Args:
        frozen: ``(P,)`` bool, the coordinates that do not train.
        anchor: their values, ``(P,)`` or ``(K, P)`` with one row per job.
    """

    def __init__(self, frozen: torch.Tensor, anchor: torch.Tensor) -> None:
        self.frozen, self.anchor = frozen, anchor

    def project(self, w: torch.Tensor, jobs: int | torch.Tensor) -> torch.Tensor:
        return torch.where(self.frozen, per_job(self.anchor, jobs), w)


class PartialSharing(PersonalStar):
    """Template of the methods that share the coordinates outside ``self.mask`` and keep those inside."""

    compresses_uploads = False  # the compression stage encodes whole models, not the shared part

    def __init__(self, ctx, hp) -> None:
        super().__init__(ctx, hp)
        self.mask = self.personal_mask()  # True: personal, never sent
        self.shared = ~self.mask
        self.partial = bool(self.mask.any())  # False: every coordinate is shared (FedAvg)
        warn_if_nothing_shared(self.mask, self.name, self.layout.model, "nothing is shared: each client trains alone")

    def personal_mask(self) -> torch.Tensor:
        """The personal coordinates of the flat parameter vector, ``(P,)`` bool."""
        raise NotImplementedError

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return {"model": (self.x[self.shared] if self.partial else self.x,)}  # the shared part only

    def starts(self, clients: np.ndarray) -> torch.Tensor:
        """Each client's start: the global model on the shared coordinates, its own on the personal ones."""
        if not self.partial:
            return self.x
        return torch.where(self.mask, self.store.rows("personal", clients), self.x)

    def local_train(self, r: int, clients: np.ndarray, starts: torch.Tensor, lr: float) -> LocalResult:
        """The clients' local training from ``starts`` (plain local SGD of every coordinate by default)."""
        return self.trainer.train(starts, clients, r, lr=lr)

    def train_clients(self, r: int, clients: np.ndarray) -> Collected:
        lr = self.trainer.lr(r)
        local = self.local_train(r, clients, self.starts(clients), lr)
        self.store.set_rows("personal", clients, local.params)  # the personal part is read from here next time
        self.report_losses(r, clients, local.loss)
        upload = {"shared": local.params[:, self.shared]} if self.partial else {}  # what the ledger counts
        return Collected(r, clients, lr, local, upload, self.weights(clients))

    def unsent(self) -> torch.Tensor | None:
        return self.mask if self.partial else None  # the personal coordinates never travel

    def client_updates(self, got: Collected) -> torch.Tensor:
        d = got.local.params - self.x
        return torch.where(self.mask, torch.zeros_like(d), d) if self.partial else d

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # FedAvg on the shared coordinates; the rest get 0

    def personal_models(self, r: int) -> torch.Tensor:
        return torch.where(self.mask, self.store["personal"].to(self.x.device), self.x)
