"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates (FedMIM spec §5).

Client step ``y <- y - eta_l (g_i(y) - c_i + c)`` (Alg. 1 line 10); after K_i steps
``c_i+ = c_i - c + (x - y_i) / (K_i eta_l)`` (line 12, option II). The client sends ``Delta y_i`` and
``Delta c_i = c_i+ - c_i`` (twice FedAvg's uplink); the server updates ``x += eta_g mean(Delta y)`` and
``c += (1/N) sum_{i in S} Delta c_i`` (lines 16-17). The c_i are the client's own: :class:`ScaffoldStep`
keeps them in the client state store in simulation, and on the client's node when deployed.
"""

from __future__ import annotations

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, per_job
from fedweave.execution import LocalRule, StateStore
from fedweave.execution.local import ClientStep, GradFn, LocalResult
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS, CLIENT_STEPS, RULES


@RULES.register("scaffold")
class ScaffoldRule(LocalRule):
    """Direction ``grad f_i(w) - c_i + c`` (SCAFFOLD Alg. 1 line 10).

    Args:
        c_local: the client control variates, ``(K, P)`` with one row per job in the job order of
            ``LocalTrainer.train`` (or ``(P,)`` if every job shares one).
        c_global: the server control variate ``c``, ``(P,)`` (or ``(K, P)`` per job).
    """

    def __init__(self, c_local: torch.Tensor, c_global: torch.Tensor) -> None:
        self.c_local, self.c_global = c_local, c_global

    def direction(self, w: torch.Tensor, grad: GradFn, jobs: int | torch.Tensor) -> torch.Tensor:
        return grad(w) - per_job(self.c_local, jobs) + per_job(self.c_global, jobs)


def option_ii(
    c_local: torch.Tensor, c_global: torch.Tensor, x: torch.Tensor, y: torch.Tensor, steps: torch.Tensor, lr: float
) -> torch.Tensor:
    """New client control variates ``c_i - c + (x - y_i) / (K_i eta_l)`` (SCAFFOLD Eq. option II).

    A client that took no step (no training sample) keeps its ``c_i``: option II is the mean of its K_i corrected
    gradients ``g_i - c_i + c`` plus ``c_i - c``, and with K_i = 0 there is no gradient to average; the formula
    with K_i clamped to 1 gave ``c_i - c``, so each round it took part pulled the server's c towards 0 by c / N
    and SCAFFOLD no longer reached the optimum."""
    k = steps.to(y.dtype).unsqueeze(1)
    new = c_local - c_global + (x - y) / (k.clamp_min(1) * lr)
    return torch.where(k > 0, new, c_local)


@CLIENT_STEPS.register("scaffold")
class ScaffoldStep(ClientStep):
    """SCAFFOLD's client (Alg. 1 lines 8-13): local steps with its own ``c_i`` and the server's ``c``, then
    ``c_i+`` by option II; it uploads ``Delta y_i`` and ``Delta c_i`` and keeps ``c_i+``."""

    state = ("c",)
    uploads = ("dy", "dc")

    def __init__(self, c_global: torch.Tensor, lr: float) -> None:
        self.c_global, self.lr = c_global, float(lr)

    def rule(self, state: dict[str, torch.Tensor]) -> LocalRule:
        return ScaffoldRule(state["c"], self.c_global)

    def control(self, c_i: torch.Tensor, start: torch.Tensor, result: LocalResult) -> torch.Tensor:
        """c_i+ (line 12, option II)."""
        return option_ii(c_i, self.c_global, start, result.params, result.steps, self.lr)

    def finish(self, state, start: torch.Tensor, result: LocalResult):
        c_i, y = state["c"], result.params
        c_new = self.control(c_i, start, result)
        return {"dy": y - start, "dc": c_new - c_i}, {"c": c_new}  # line 13

    def local_model(self, start: torch.Tensor, upload: dict[str, torch.Tensor]) -> torch.Tensor:
        return start + upload["dy"]


@ALGORITHMS.register("scaffold")
class Scaffold(StarAlgorithm):
    name = "scaffold"
    compresses_downloads = True  # compression.download: x_t compressed, the rest of its message dense
    # privacy: the control-variate deltas Delta c_i are a second, unclipped upload summed into c
    dp_refusal = "its clients also upload control-variate deltas, which the server sums into c unclipped and unnoised"
    uplink = "update+control_delta"  # Delta y_i and Delta c_i (line 13)
    sums_unweighted = "sums the control-variate deltas"  # secure aggregation: line 17's sum of the Delta c_i
    state_fields = (*StarAlgorithm.state_fields, "c")

    def __init__(self, ctx, hp) -> None:
        super().__init__(ctx, hp)
        self.c = torch.zeros_like(self.x)  # server control variate
        self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, placement=ctx.placement)
        self.store.create("c", self.num_params)  # c_i, initialised to 0
        self.ledger.store("server", "control_variate", nbytes(self.c))
        self.ledger.store("client", "control_variate", nbytes(self.c))  # per client

    def downlink(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return {"model+control": (self.x, self.c)}  # (x, c), line 6

    def client_rule(self, lr: float) -> ScaffoldStep:
        return ScaffoldStep(self.c, lr)  # lines 8-13, with the client's own c_i

    def client_updates(self, got: Collected) -> torch.Tensor:
        return got.upload["dy"]

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.hp.server_lr * mean  # line 16
        self.c = self.c + got.upload["dc"].sum(0) / self.ctx.num_clients  # line 17
