"""ZO-HFL's baselines in the same server-data setting: FedAvg, FedProx, SCAFFOLD (spec zo-hfl §5, A11, A12).

Same split as ZO-HFL (the server's share set aside, the clients' pool partitioned), same participation,
same local-step count H_{i,r} = floor(tau sqrt(r+1)) and local schedule gamma~_t = local.lr / (t + Gamma).
By default the server's share is unused, as the paper's baselines presumably did (A12, primary setting);
``server_data: client`` adds the server as an extra client that trains on its share every round (the control
of A12). ``steps_factor: 2`` gives the compute-matched variant (2 H_{i,r} steps, ZO-HFL's two solves; A11).

Each method fills in the family's model-averaging round template (``AveragingAlgorithm`` in base.py): its
client rule and its server update. Faults (docs/reliability.md), handled there: the server sends to every
sampled client; a client that drops out or misses the deadline delivers nothing (no upload in the ledger) and
keeps its state (SCAFFOLD's c_i); the average is re-weighted over the clients that reported. The server's own
job (``server_data: client``) never drops. A client's work on the clock is its ``steps_factor * H_r`` local steps
(``faults.work_unit: step``; exactly 1 under ``round``, every client's the same).

    FedAvg:   y_i = H steps of SGD from x;  x <- sum_i N_i y_i / sum_i N_i                  (McMahan et al.)
    FedProx:  the same on L_i(y) + (mu/2)||y - x||^2                                         (Li et al., eq. 2)
    SCAFFOLD: steps along grad - c_i + c; c_i+ = c_i - c + (x - y_i) / sum_k eta_k (option II);
              x <- x + mean_i (y_i - x), c <- c + (1/m) sum_i (c_i+ - c_i)                (Karimireddy et al.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.scaffold import ScaffoldStep
from fedweave.algorithms.hierarchical.base import AveragingAlgorithm, AveragingHparams, Collected
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import LocalRule, StateStore
from fedweave.execution.local import LocalResult
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, CLIENT_STEPS


@CLIENT_STEPS.register("hier_scaffold")
class HierScaffoldStep(ScaffoldStep):
    """SCAFFOLD's client in the hierarchical setting: local steps along grad - c_i + c with the family's step
    schedule, then option II with the sum of the step sizes, c_i+ = c_i - c + (x - y_i) / sum_k eta_k (spec
    §5); it uploads Delta y_i and Delta c_i and keeps c_i+ (in the StateStore in simulation, on its node when
    deployed)."""

    def __init__(self, c_global: torch.Tensor, step_sizes_sum: float) -> None:
        self.c_global, self.step_sizes_sum = c_global, float(step_sizes_sum)

    def control(self, c_i: torch.Tensor, start: torch.Tensor, result: LocalResult) -> torch.Tensor:
        """c_i+ by option II; a client that took no step (no training sample) keeps its c_i, as the star's
        SCAFFOLD does (``option_ii``): its c_i - c pulled the server's c towards 0 each round it took part."""
        new = c_i - self.c_global + (start - result.params) / self.step_sizes_sum
        return torch.where(result.steps.unsqueeze(1) > 0, new, c_i)

    def local_model(self, start: torch.Tensor, upload: dict[str, torch.Tensor]) -> torch.Tensor:
        return start + upload["dy"]


BaselineHparams = AveragingHparams  # the round template's options: server_data, steps_factor


@dataclass
class ProxHparams(BaselineHparams):
    mu: float = 0.1  # mu_p = ZO-HFL's lower-level mu (spec §5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mu <= MAX_LR:  # a larger one is inf in float32: the first step's mu * 0 is NaN
            raise ConfigError(f"algorithm.mu must be in [0, {MAX_LR:.6g}], got {self.mu}")


@ALGORITHMS.register("hier_fedavg")
class HierFedAvg(AveragingAlgorithm):
    dp_refusal = None  # privacy: one model per client, x from the (noised) mean only
    name = "hier_fedavg"

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = mean  # x <- sum_i (N_i / sum_j N_j) y_i, over the jobs that delivered


@ALGORITHMS.register("hier_fedprox")
class HierFedProx(AveragingAlgorithm):
    dp_refusal = None  # privacy: one model per client, x from the (noised) mean only
    name = "hier_fedprox"
    Hparams = ProxHparams

    def client_rule(self, r: int) -> LocalRule:
        return ProxRule(self.hp.mu, self.x)  # L_i(y) + (mu/2)||y - x||^2 (Li et al., eq. 2)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = mean  # as FedAvg


@ALGORITHMS.register("hier_scaffold")
class HierScaffold(AveragingAlgorithm):
    dp_refusal = "its clients also upload control-variate deltas, which the server sums into c unclipped"
    name = "hier_scaffold"
    downlink = ("model+control", 2)  # x and c
    uplink = ("update+control_delta", 2)  # Delta y_i and Delta c_i
    updates_are_models = False  # its updates are the displacements Delta y_i

    def __init__(self, ctx: RunContext, hp: BaselineHparams) -> None:
        super().__init__(ctx, hp)
        self.c = torch.zeros_like(self.x)  # server control variate c
        # c_i of every client (+ the server's job)
        self.store = StateStore(self.m + 1, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("c", self.dim)
        self.ledger.store("server", "control_variate", nbytes(self.c))
        self.ledger.store("client", "control_variate", nbytes(self.c))
        if hp.server_data == "client":  # the server's own job keeps a c_i too, held by the server itself
            self.ledger.store("server", "own_job_control_variate", nbytes(self.c))

    def client_rule(self, r: int) -> HierScaffoldStep:
        # option II with a step schedule, (x - y_i) / sum_k eta_k (spec §5); a client that drops keeps its c_i
        return HierScaffoldStep(self.c, self.step_sizes_sum(r))

    def weights(self, jobs: np.ndarray) -> None:
        return None  # eta_g = 1, uniform mean over the round's clients that reported

    def client_updates(self, got: Collected) -> torch.Tensor:
        return got.upload["dy"]

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + mean  # x <- x + mean_i (y_i - x)
        self.c = self.c + got.upload["dc"].sum(0) / (self.m + (self.hp.server_data == "client"))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "c": self.c}  # the c_i: the family's ``client_state``

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.c, c_i = state.pop("c").clone(), state.pop("c_i", None)
        if c_i is not None:  # a checkpoint written before the family saved its clients' state
            self.store["c"].copy_(c_i)
        super().load_state_dict({**state, "x": state["x"].clone()})
