"""ZO-HFL (Qiu, Kim, Yousefian, 2025): randomized zeroth-order hierarchical FL (spec zo-hfl, Alg. 1-2).

The server minimizes f(x) = f1(x) + f2(x): its own loss f1 on its own data plus the implicit penalty
f2(x) = (lambda/2) sum_i w_i ||x - y_i(x)||^2, where y_i(x) = argmin_{y in Y_i(x)} L_i(y) + (mu/2)||x - y||^2
is client i's personalized model (eq. (1), §IV). y_i has no usable Jacobian, so the server steps along a
two-point zeroth-order estimate of the gradient of the spherically smoothed f2^eta (Lemma 7(i)):

    g_i = (d / (2 eta)) [f2(x + eta v_i, y_i^+) - f2(x - eta v_i, y_i^-)] v_i            (Alg. 1 line 7)
    x_{r+1} = x_r - gamma_r (grad f~1(x_r, xi_r) + sum_i g_i)                            (Alg. 1 line 8)

where y_i^{+/-} are H_{i,r} projected SGD steps of client i at x_r +/- eta v_i (Algorithm 2). ``lam = 0`` is
the server-only control (SGD on f1; spec §9.2 C4): the clients are then not contacted at all.

Faults (docs/reliability.md): x and v_i go to every sampled client; a client that drops out or misses the
deadline returns nothing and adds g_i = 0, exactly like a non-participant (the paper's H_{i,r} = 0 straggler,
§IV; spec A3), and ``partial: rescale`` multiplies the sum by m / k_r with k_r = |S_r| the number sampled
(spec A3 and §7: k_r = round(beta m)), not the number that reported: a dropout is a client of S_r with
g_i = 0, as H_{i,r} = 0. A client's work on the clock is its two solves, 2 H_r local steps (``faults.work_unit:
step``; exactly 1 under ``round``, every client's the same). ZO-HFL keeps no personalized
state across rounds (y_0 is the input point, A4), so a dropout changes nothing on the client. The server's
own step on f1 is unaffected: in a round nobody reports in, x still moves along grad f~1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.hierarchical.base import (
    HierarchicalAlgorithm,
    HierarchyHparams,
    LowerLevelRule,
    make_projection,
    unit_directions,
    zo_gradient,
)
from fedweave.config import MAX_LR, ConfigError
from fedweave.execution import evaluate_task
from fedweave.registry import ALGORITHMS


@dataclass
class ZOHFLHparams(HierarchyHparams):
    lam: float = 10.0  # lambda, weight of f2 (not given in the paper; spec A1 scaled-run value)
    mu: float = 0.1  # mu, proximal weight of the lower level (not given; spec A1)
    eta: float = 0.1  # smoothing radius (paper §IV)
    server_lr: float = 0.01  # gamma_0 in gamma_r = gamma_0 / (r+1)^p (paper §IV: 0.01 / sqrt(r+1))
    server_lr_power: float = 0.5  # p (Thm 1: 1/2; Thm 2 needs p in (1/2, 1])
    server_batch_size: int = 64  # |xi_r| (not given; spec A6)
    weights: Literal["data", "uniform"] = "data"  # w_i = N_i/N_tr (§IV) or 1/m (eq. (1)); spec A2
    partial: Literal["zero", "rescale"] = "zero"  # non-participants add g_i = 0, or scale the sum by m/k (A3)
    crn: bool = True  # the +/- solves of a client share their mini-batch sequence (spec A5)
    constraint: Literal["none", "ball", "box"] = "none"  # Y_i(x) (spec A17); the ball is centred at x
    radius: float = 1.0  # ball radius
    # either side may be open: -inf or inf leaves it unbounded (clamp's one-sided box {y <= high}, {y >= low})
    box_low: float = field(default=0.0, metadata={"infinite": -1})
    box_high: float = field(default=float("inf"), metadata={"infinite": 1})
    direction_message: Literal["vector", "seed"] = "vector"  # send v_i itself (Alg. 1) or its 8-byte seed
    upload: Literal["models", "values"] = "models"  # y^+/y^- (Alg. 1 line 5) or the two f2 values (A24)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lam < 0:
            raise ConfigError(f"algorithm.lam must be >= 0, got {self.lam}")
        if not 0 <= self.mu <= MAX_LR:  # as FedProx's: a larger one is inf in float32, the first step's mu * 0 NaN
            raise ConfigError(f"algorithm.mu must be in [0, {MAX_LR:.6g}], got {self.mu}")
        for key in ("eta", "server_lr", "radius"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"algorithm.{key} must be > 0, got {getattr(self, key)}")
        for key in ("eta", "server_lr"):  # the smoothing radius and the server's step, float32 as local.lr is
            if getattr(self, key) > MAX_LR:
                raise ConfigError(f"algorithm.{key} must be in (0, {MAX_LR:.6g}], got {getattr(self, key)}")
        if self.server_lr_power < 0:
            raise ConfigError(f"algorithm.server_lr_power must be >= 0, got {self.server_lr_power}")
        if self.server_batch_size < 1:
            raise ConfigError(f"algorithm.server_batch_size must be >= 1, got {self.server_batch_size}")
        # an open side is its own infinity; the other one (box_low inf, box_high -inf: every coordinate at +-inf)
        # is refused as the config is read, by the fields' metadata "infinite" (config._check_finite)
        if self.box_low > self.box_high:
            raise ConfigError(f"algorithm.box_low ({self.box_low}) must be <= algorithm.box_high ({self.box_high})")
        # a constraint's own bounds, set for another constraint, would be ignored: refused instead
        for key, reader in (("radius", "ball"), ("box_low", "box"), ("box_high", "box")):
            if self.constraint != reader and getattr(self, key) != getattr(ZOHFLHparams, key):
                raise ConfigError(
                    f"algorithm.{key}: constraint {self.constraint!r} does not read it (constraint {reader!r} does); "
                    "leave it out or set algorithm.constraint"
                )


@ALGORITHMS.register("zo_hfl")
class ZOHFL(HierarchicalAlgorithm):
    name = "zo_hfl"
    # privacy: the clients send function values of perturbed models, not one model update each
    dp_refusal = "its clients send zeroth-order function values, not one clippable model update each"
    Hparams = ZOHFLHparams
    jobs_per_client = 2  # the +/- solves
    handles_faults = ("dropout", "deadline")

    def __init__(self, ctx: RunContext, hp: ZOHFLHparams) -> None:
        super().__init__(ctx, hp)
        uniform = torch.full((self.m,), 1.0 / self.m, dtype=torch.float64, device=ctx.device)
        w = self.rho if hp.weights == "data" else uniform
        self.w = w
        self.projection = make_projection(hp.constraint, hp.radius, hp.box_low, hp.box_high)
        # (x^_r, f2^_r) of the last round whose f2 was estimated (A13; ``run_round``): none before round 0
        self._estimate: tuple[torch.Tensor, float] | None = None

    def client_round_steps(self, r: int) -> int:
        """A client's local steps: its two calls of Algorithm 2, H_{i,r} projected SGD steps each (Alg. 1 line 5;
        spec §7 counts the +/- calls apart, ``client_sgd_steps``), so 2 H_r."""
        return self.jobs_per_client * self.steps(r)

    def server_lr(self, r: int) -> float:
        try:
            return self.hp.server_lr / (r + 1) ** self.hp.server_lr_power  # gamma_r (paper §IV)
        except OverflowError:  # (r+1)^p past the float range: gamma_r underflows toward 0, no error
            return self.hp.server_lr * (r + 1) ** -self.hp.server_lr_power

    def solve(self, r: int, clients: np.ndarray, inputs: torch.Tensor, H: int) -> torch.Tensor:
        """Algorithm 2 for every job: client ``clients[j // 2]`` from y_0 = its input point ``inputs[j]``
        (spec A4); jobs 2i and 2i+1 are the + and - solves of one client and, with CRN, share the key."""
        jobs = np.repeat(clients, 2)
        rule = LowerLevelRule(self.hp.mu, inputs, self.projection)
        lr = self.local_lr()
        if self.hp.crn:
            return self.trainer.train(inputs, jobs, r, rule=rule, lr=lr, steps=H).params
        out = torch.empty_like(inputs)
        for s in (0, 1):  # independent mini-batch sequences for + and - (the literal zeta^{r,+}, zeta^{r,-})
            sel = slice(s, None, 2)
            part = LowerLevelRule(self.hp.mu, inputs[sel], self.projection)
            out[sel] = self.trainer.train(inputs[sel], jobs[sel], r, rule=part, lr=lr, steps=H, key=(s,)).params
        return out

    def run_round(self, r: int) -> dict[str, float]:
        hp, d = self.hp, self.dim
        g1, f1_batch = self.server_gradient(r, hp.server_batch_size)  # grad f~1(x^_r, xi_r)
        metrics = {"server_batch_loss": f1_batch}
        g = g1.double()
        sampled = clients = np.empty(0, dtype=np.int64)  # S_r, and those of it whose solutions arrive (lam = 0: none)
        if hp.lam > 0:
            H = self.steps(r)
            fp32 = self.x.element_size()  # bytes per value (8 in float64)
            down = d * fp32 + (d * fp32 if hp.direction_message == "vector" else 8)  # x and v_i (or its seed)
            # dropouts and stragglers return nothing: g_i = 0 (A3)
            sampled, clients = self.call_clients(r, "model+direction", down)
            metrics.update(self.call_metrics(sampled, clients))
        if len(clients):
            # all i drawn on the CPU (A28), S_r used on the device
            v = unit_directions(self.seeds, r, self.m, d, self.x.dtype, self.x.device)[clients]
            x_plus, x_minus = self.x + hp.eta * v, self.x - hp.eta * v
            inputs = torch.stack([x_plus, x_minus], 1).reshape(-1, d)  # job order: (i1,+), (i1,-), (i2,+), ...
            y = self.solve(r, clients, inputs, H).reshape(len(clients), 2, d)
            up = 2 * d * fp32 if hp.upload == "models" else 2 * 8
            self.receive(r, clients, "solutions" if hp.upload == "models" else "penalty_values", up)
            # f2(x, y_i) = (lambda/2) w_i ||x - y_i||^2 (§IV); the difference as <a - b, a + b> in float64 (A29)
            a = x_plus.double() - y[:, 0].double()
            b = x_minus.double() - y[:, 1].double()
            half_lw = 0.5 * hp.lam * self.w[clients]
            f_diff = half_lw * ((a - b) * (a + b)).sum(1)
            gz = zo_gradient(f_diff, torch.zeros_like(f_diff), v.double(), hp.eta).sum(0)
            # m / k_r with k_r = |S_r| the sampled count (spec A3, §7: k_r = round(beta m)): a dropout is a client of
            # S_r whose g_i is 0, as H_{i,r} = 0 (A3); it does not shrink k_r (the reporters are a subset of S_r)
            scale = self.m / len(sampled) if hp.partial == "rescale" else 1.0
            g = g + scale * gz
            # A13(b): f2_r = (lambda/2) sum_{i in S_r} w_i (m/k_r) 1/2 (||a_i||^2 + ||b_i||^2), k_r = #S_r the
            # sampled count as in the step: a dropout is a client of S_r with H_{i,r} = 0 (A3), whose y^+/- is
            # the input point, so a_i = b_i = 0 and it adds 0 to the sum; it does not shrink k_r
            pen = (half_lw * 0.5 * ((a * a).sum(1) + (b * b).sum(1))).sum() * self.m / len(sampled)
            metrics.update(
                local_steps=float(H),  # per call of Algorithm 2 (spec A7)
                client_sgd_steps=float(2 * H * len(clients)),  # spec §7 counters: +/- calls counted apart
                zo_evaluations=float(2 * len(clients)),
                penalty=float(pen),
                zo_norm=float(scale * gz.norm()),
            )
        step = self.server_lr(r) * g
        sent = self.x  # x^_r, the model this round's y^+/- were solved around (the step makes a new tensor)
        # x^_{r+1} = x^_r - gamma_r g^_r (Alg. 1 line 8), in float64, stored in the run's precision
        self.x = (self.x.double() - step).to(self.x.dtype)
        metrics["step_norm"] = float(step.norm())  # ||gamma_r g^|| (stability diagnostic, A1)
        # A13: the global loss of round r is (a) f1(x^_r) + (b) f2^_r, both at x^_r: f2^_r is estimated from the
        # y^+/- returned around x^_r, so f1 is taken there too, not at x^_{r+1} (Fig. 2 plots one model's f1 + f2
        # per round). lambda = 0: f2 = 0 at every model, the same x^_r for the same meaning of the row. A round
        # in which no solution arrived keeps the last pair (model, estimate), never one model's f1 with
        # another's f2.
        if "penalty" in metrics or hp.lam == 0:
            self._estimate = (sent, metrics.get("penalty", 0.0))
        return metrics

    def evaluate(self, r: int) -> dict[str, float]:
        out = super().evaluate(r)
        estimate = self._estimate
        if estimate is None and self.hp.lam == 0:  # the initial model (eval.at_start): f2 = 0 is exact there too
            estimate = (self.x, 0.0)
        if estimate is None:  # the initial model with lambda > 0: no f2 estimate exists before round 0's solves
            return out
        x, f2 = estimate
        f1 = 0.0  # server_share: 0 drops f1
        if len(self.server_y):
            f1 = evaluate_task(self.layout, x, self.server_x, self.server_y, self.ctx.task, self.config.eval.batch_size)
            f1 = f1["loss"]
        out["global_loss"] = f1 + f2  # A13: f1(x^_r) + f2^_r, the last round r whose f2 was estimated
        if self.hp.eval_train_loss:  # A13(c), the cross-check of (a) + (b): at the same model x^_r
            out["train_loss_all"] = self.train_loss_at(x)
        return out

    def state_dict(self) -> dict:
        out = {"x": self.x}
        if self._estimate is not None:  # the global loss's model x^_r and its f2 estimate (A13)
            out |= {"penalty_x": self._estimate[0], "penalty": float(self._estimate[1])}
        return out

    def load_state_dict(self, state: dict) -> None:
        self.x = state["x"].clone()
        # a checkpoint without the estimate's model (written before any round, or before it was kept) has none
        self._estimate = (state["penalty_x"].clone(), float(state["penalty"])) if "penalty_x" in state else None
