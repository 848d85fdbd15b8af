"""MOON (Li, He and Song, CVPR 2021): model-contrastive federated learning.

FedAvg's server; each client adds to its task loss the model-contrastive term

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )   (Eq. 3)
    l     = l_sup + mu l_con                                                                        (Eq. 4)

with ``sim`` the cosine similarity, ``z`` the local model's representation of a sample, ``z_glob`` the
global model's (the round's start) and ``z_prev`` that of the client's previous local model. The
representation is the model's ``features`` (docs/models.md; the paper's projection head is the model's last
hidden layer here). Each client keeps its previous local model as its own state (a ``ClientStep`` over the
``prev`` rows of the state store; on the client's node in a deployment); before a client first trains the
global model stands in for it, so its negative equals its positive. The paper tunes mu in {0.1, 1, 5, 10}
and uses tau = 0.5. ``mu: 0`` is FedAvg. docs/extending.md shows this method written as a plug-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams, per_job
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule, StateStore
from fedweave.execution.job import ClientStep
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, CLIENT_STEPS, RULES


@RULES.register("moon")
class ModelContrastive(LocalRule):
    """The local loss term ``mu l_con`` of each sample (Eq. 3), at the local parameters of one job.

    Args:
        mu: the term's weight (Eq. 4).
        tau: the temperature.
        glob: the global model, ``(P,)``.
        prev: each job's previous local model, ``(K, P)`` (or ``(P,)`` shared).
    """

    def __init__(self, mu: float, tau: float, glob: torch.Tensor, prev: torch.Tensor) -> None:
        self.mu, self.tau, self.glob, self.prev = float(mu), float(tau), glob, prev

    def extra_loss(self, w, x, y, jobs, model):
        z = model.features(w, x)  # the local model's: the gradient flows through it
        with torch.no_grad():  # the global and previous models are fixed
            z_glob = model.features(per_job(self.glob, jobs), x)
            z_prev = model.features(per_job(self.prev, jobs), x)
        pos = F.cosine_similarity(z, z_glob, dim=-1) / self.tau
        neg = F.cosine_similarity(z, z_prev, dim=-1) / self.tau
        return self.mu * (torch.logaddexp(pos, neg) - pos)  # Eq. 3: -log(e^pos / (e^pos + e^neg))


@CLIENT_STEPS.register("moon")
class MoonStep(ClientStep):
    """MOON's client: local training under :class:`ModelContrastive` with its own previous model; it uploads
    its new local model (as FedAvg's client) and keeps it as the next round's ``prev``."""

    state = ("prev",)  # the client's last local model; zero until it first trains

    def __init__(self, mu: float, tau: float, glob: torch.Tensor) -> None:
        self.mu, self.tau, self.glob = float(mu), float(tau), glob

    def rule(self, state: dict[str, torch.Tensor]) -> LocalRule:
        prev = state["prev"]
        untrained = (prev == 0).all(1, keepdim=True)  # never trained: the global model stands in
        return ModelContrastive(self.mu, self.tau, self.glob, torch.where(untrained, self.glob, prev))

    def finish(self, state, start, result):
        return {}, {"prev": result.params}  # an empty upload: the client sends its model


@dataclass
class MoonHparams(StarHparams):
    mu: float = 1.0  # the weight of the contrastive term (Eq. 4)
    tau: float = 0.5  # the temperature (Eq. 3)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mu <= MAX_LR:  # a larger one is inf in float32: the loss is NaN from the first step
            raise ConfigError(f"algorithm.mu must be in [0, {MAX_LR:.6g}], got {self.mu}")
        # a larger tau is inf in float32: every sim / tau of Eq. 3 is 0 and the contrastive term has no gradient
        if not 0 < self.tau <= MAX_LR:
            raise ConfigError(f"algorithm.tau must be in (0, {MAX_LR:.6g}], got {self.tau}")


@ALGORITHMS.register("moon")
class Moon(StarAlgorithm):
    name = "moon"
    Hparams = MoonHparams
    # DP-FedAvg and SecAgg+ see what FedAvg's clients send, one model update each, and its server is FedAvg's;
    # the previous model stays with its client (on its node when deployed), used in its local training only
    dp_refusal = None

    def __init__(self, ctx, hp: MoonHparams) -> None:
        super().__init__(ctx, hp)
        self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("prev", self.num_params)
        self.ledger.store("client", "previous_model", nbytes(self.x))  # per client

    def client_rule(self, lr: float) -> MoonStep:
        return MoonStep(self.hp.mu, self.hp.tau, self.x)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # FedAvg's
