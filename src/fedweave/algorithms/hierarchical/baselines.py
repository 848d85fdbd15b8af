"""ZO-HFL's baselines in the same server-data setting: FedAvg, FedProx, SCAFFOLD (spec zo-hfl §5, A11, A12).

Same split as ZO-HFL (the server's share set aside, the clients' pool partitioned), same participation,
same local-step count H_{i,r} = floor(tau sqrt(r+1)) and local schedule gamma~_t = local.lr / (t + Gamma).
By default the server's share is unused, as the paper's baselines presumably did (A12, primary setting);
``server_data: client`` adds the server as an extra client that trains on its share every round (the control
of A12). ``steps_factor: 2`` gives the compute-matched variant (2 H_{i,r} steps, ZO-HFL's two solves; A11).

Faults (docs/reliability.md): the server sends to every sampled client; a client that drops out or misses the
deadline delivers nothing (no upload in the ledger) and keeps its state (SCAFFOLD's c_i); the average is
re-weighted over the clients that reported. The server's own job (``server_data: client``) never drops.

    FedAvg:   y_i = H steps of SGD from x;  x <- sum_i N_i y_i / sum_i N_i                  (McMahan et al.)
    FedProx:  the same on L_i(y) + (mu/2)||y - x||^2                                         (Li et al., eq. 2)
    SCAFFOLD: steps along grad - c_i + c; c_i+ = c_i - c + (x - y_i) / sum_k eta_k (option II);
              x <- x + mean_i (y_i - x), c <- c + (1/m) sum_i (c_i+ - c_i)                (Karimireddy et al.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.scaffold import ScaffoldStep
from fedweave.algorithms.hierarchical.base import HierarchicalAlgorithm, HierarchyHparams
from fedweave.config import ConfigError
from fedweave.execution import LocalRule, StateStore
from fedweave.execution.local import PLAIN, LocalResult
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS


class HierScaffoldStep(ScaffoldStep):
    """SCAFFOLD's client in the hierarchical setting: local steps along grad - c_i + c with the family's step
    schedule, then option II with the sum of the step sizes, c_i+ = c_i - c + (x - y_i) / sum_k eta_k (spec
    §5); it uploads Delta y_i and Delta c_i and keeps c_i+ (in the StateStore in simulation, on its node when
    deployed)."""

    def __init__(self, c_global: torch.Tensor, step_sizes_sum: float) -> None:
        self.c_global, self.step_sizes_sum = c_global, float(step_sizes_sum)

    def control(self, c_i: torch.Tensor, start: torch.Tensor, result: LocalResult) -> torch.Tensor:
        return c_i - self.c_global + (start - result.params) / self.step_sizes_sum

    def local_model(self, start: torch.Tensor, upload: dict[str, torch.Tensor]) -> torch.Tensor:
        return start + upload["dy"]


@dataclass
class BaselineHparams(HierarchyHparams):
    server_data: Literal["none", "client"] = "none"  # the server's share: unused, or an always-on client (A12)
    steps_factor: int = 1  # local steps per round = steps_factor * H_{i,r} (2: compute-matched with ZO-HFL)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps_factor < 1:
            raise ConfigError(f"algorithm.steps_factor must be >= 1, got {self.steps_factor}")


@dataclass
class ProxHparams(BaselineHparams):
    mu: float = 0.1  # mu_p = ZO-HFL's lower-level mu (spec §5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ConfigError(f"algorithm.mu must be >= 0, got {self.mu}")


class _Baseline(HierarchicalAlgorithm):
    """Model-averaging baselines on the hierarchical split."""

    Hparams = BaselineHparams
    handles_faults = ("dropout", "deadline")

    def participants(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(the round's sampled clients, the training jobs: those clients plus the server's job if any)."""
        clients = self.sample_clients(r)
        return clients, self.jobs_of(clients)

    def jobs_of(self, clients: np.ndarray) -> np.ndarray:
        """The training jobs of a round: ``clients`` plus the server's own job under ``server_data: client``."""
        return np.append(clients, self.server_job) if self.hp.server_data == "client" else clients

    def local_train(self, r: int, jobs: np.ndarray, rule: LocalRule) -> LocalResult:
        return self.trainer.train(self.x, jobs, r, rule=rule, lr=self.local_lr(), steps=self.round_steps(r))

    def round_steps(self, r: int) -> int:
        return self.hp.steps_factor * self.steps(r)

    def step_sizes_sum(self, r: int) -> float:
        lr, H = self.local_lr(), self.round_steps(r)
        return sum(self.trainer.step_lr(lr, t) for t in range(H))

    def counters(self, r: int, jobs: np.ndarray) -> dict[str, float]:
        H = self.round_steps(r)
        return {"local_steps": float(H), "client_sgd_steps": float(H * len(jobs))}

    def sample_weights(self, jobs: np.ndarray) -> torch.Tensor:
        w = self.job_sizes[torch.as_tensor(jobs, device=self.job_sizes.device)].to(self.x.dtype)
        return w / w.sum()


class _Averaging(_Baseline):
    def rule(self) -> LocalRule:
        return PLAIN

    def run_round(self, r: int) -> dict[str, float]:
        sampled = self.sample_clients(r)
        self.send(r, sampled, "model", nbytes(self.x))
        clients = self.reporting(r, sampled)  # dropouts and stragglers deliver nothing
        jobs = self.jobs_of(clients)
        if len(jobs) == 0:
            return self.fault_metrics(clients)  # nobody reported: x stays, the runner logs the skip
        local = self.local_train(r, jobs, self.rule())
        self.receive(r, clients, "model", nbytes(self.x))
        p = self.sample_weights(jobs)  # re-weighted over the jobs that delivered
        self.x = p @ local.params  # x <- sum_i (N_i / sum_j N_j) y_i
        return {"train_loss": float(p @ local.loss), **self.counters(r, jobs), **self.fault_metrics(clients)}


@ALGORITHMS.register("hier_fedavg")
class HierFedAvg(_Averaging):
    name = "hier_fedavg"


@ALGORITHMS.register("hier_fedprox")
class HierFedProx(_Averaging):
    name = "hier_fedprox"
    Hparams = ProxHparams

    def rule(self) -> LocalRule:
        return ProxRule(self.hp.mu, self.x)


@ALGORITHMS.register("hier_scaffold")
class HierScaffold(_Baseline):
    name = "hier_scaffold"

    def __init__(self, ctx: RunContext, hp: BaselineHparams) -> None:
        super().__init__(ctx, hp)
        self.c = torch.zeros_like(self.x)  # server control variate c
        # c_i of every client (+ the server's job)
        self.store = StateStore(self.m + 1, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("c", self.dim)
        self.ledger.store("server", "control_variate", nbytes(self.c))
        self.ledger.store("client", "control_variate", nbytes(self.c))

    def run_round(self, r: int) -> dict[str, float]:
        sampled = self.sample_clients(r)
        self.send(r, sampled, "model+control", 2 * nbytes(self.x))
        clients = self.reporting(r, sampled)  # a client that drops keeps its c_i
        jobs = self.jobs_of(clients)
        if len(jobs) == 0:
            return self.fault_metrics(clients)  # nobody reported: x and c stay, the runner logs the skip
        # the clients' side (HierScaffoldStep): option II with a step schedule, (x - y_i) / sum_k eta_k (spec §5)
        step = HierScaffoldStep(self.c, self.step_sizes_sum(r))
        local, up = self.trainer.train_with_state(
            self.x, jobs, r, step, self.store, lr=self.local_lr(), steps=self.round_steps(r)
        )
        dy, dc = up["dy"], up["dc"]
        self.receive(r, clients, "update+control_delta", 2 * nbytes(self.x))
        self.x = self.x + dy.mean(0)  # eta_g = 1, uniform mean over the round's clients that reported
        self.c = self.c + dc.sum(0) / (self.m + (self.hp.server_data == "client"))
        return {"train_loss": float(local.loss.mean()), **self.counters(r, jobs), **self.fault_metrics(clients)}

    def state_dict(self) -> dict:
        return {"x": self.x, "c": self.c, "c_i": self.store["c"].clone()}

    def load_state_dict(self, state: dict) -> None:
        self.x, self.c = state["x"].clone(), state["c"].clone()
        self.store["c"].copy_(state["c_i"])
