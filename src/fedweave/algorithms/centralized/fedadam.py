"""FedOpt (Reddi et al., ICLR 2021, Alg. 2): FedAvg clients, an adaptive server optimizer on the
pseudo-gradient ``Delta = mean_S (y_i - x_t)`` (FedMIM spec §5). ``server_opt`` picks the server rule:

- ``adam``    (FedAdam):    m = b1 m + (1-b1) Delta,  v = b2 v + (1-b2) Delta^2
- ``yogi``    (FedYogi):    m as Adam,                v = v - (1-b2) Delta^2 sign(v - Delta^2)
- ``adagrad`` (FedAdagrad): m as Adam,                v = v + Delta^2
- ``momentum`` (FedAvgM, Hsu et al. 2019): m = b1 m + Delta, x += eta_g m

and ``x_{t+1} = x_t + eta_g m / (sqrt(v) + tau)`` for the adaptive three; m starts at 0, no bias correction.
The second moment starts at ``v_init`` (default 0). Reddi et al. Alg. 2 initialise ``v_{-1} >= tau^2``; set
``v_init: tau^2`` (or larger) for the paper's rule. The default 0 is the convention of Flower's FedAdam /
FedYogi / FedAdagrad strategies (``flwr.server.strategy``: ``v_t`` starts as zeros) and of FedMIM's
baselines; with v = 0 the first step is ``eta_g (1-b1) Delta / (sqrt(1-b2) |Delta| + tau)``, larger than
under the paper's rule when |Delta| is small.
Registered as ``fedadam`` (server_opt adam) and ``fedopt`` (the same class), and each server rule under its
own paper's name with that rule fixed: ``fedyogi`` and ``fedadagrad`` (Reddi et al. 2021) and ``fedavgm``
(Hsu, Qi, Brown 2019: server momentum 0.9 and server step 1, so that ``beta1: 0`` is FedAvg).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from fedweave.algorithms.centralized.base import Collected, StarAlgorithm, StarHparams
from fedweave.config import MAX_LR, ConfigError
from fedweave.ledger import nbytes
from fedweave.registry import ALGORITHMS

# the server rules' updates (Reddi et al. 2021, Alg. 2; Hsu et al. 2019) and the options each leaves unread
RULE = {"momentum": "m = beta1 m + Delta, x += server_lr m", "adagrad": "v = v + Delta^2"}
UNREAD = {"momentum": ("beta2", "tau", "v_init"), "adagrad": ("beta2",)}


@dataclass
class FedOptHparams(StarHparams):
    server_lr: float = 0.1  # eta_g of FedAdam in FedMIM Sec. V-A
    server_opt: Literal["adam", "yogi", "adagrad", "momentum"] = "adam"
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-2  # adaptivity; Reddi et al. tune it in [1e-3, 1e-1]
    v_init: float = 0.0  # v_{-1}; Reddi et al. Alg. 2 take v_{-1} >= tau^2, Flower 0 (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"algorithm.{key} must be in [0, 1), got {getattr(self, key)}")
        # the state is float32 at most: a larger tau or v_init overflows it (a RuntimeError, or tau = inf: no step)
        if not 0 < self.tau <= MAX_LR:
            raise ConfigError(f"algorithm.tau must be in (0, {MAX_LR:.6g}], got {self.tau}")
        if not 0 <= self.v_init <= MAX_LR:
            raise ConfigError(
                f"algorithm.v_init must be in [0, {MAX_LR:.6g}] (Reddi et al.: >= tau^2), got {self.v_init}"
            )
        # the options the chosen server rule never reads: set to other than their default, a sweep over one would
        # repeat the same run under another label, so they are refused (at the default: what a resolved config writes)
        default = {f.name: f.default for f in fields(self)}
        for key in UNREAD.get(self.server_opt, ()):
            if getattr(self, key) != default[key]:
                raise ConfigError(
                    f"algorithm.{key}: server_opt {self.server_opt!r} does not read it ({RULE[self.server_opt]}); "
                    "leave it out"
                )


@ALGORITHMS.register("fedopt")
@ALGORITHMS.register("fedadam")
class FedOpt(StarAlgorithm):
    name = "fedadam"
    compresses_downloads = True  # compression.download: its clients read the model only as their start
    dp_refusal = None  # privacy: m and v are functions of the noised means only (post-processing)
    Hparams = FedOptHparams
    state_fields = (*StarAlgorithm.state_fields, "m", "v")

    def __init__(self, ctx, hp: FedOptHparams) -> None:
        super().__init__(ctx, hp)
        self.m = torch.zeros_like(self.x)
        self.v = torch.full_like(self.x, hp.v_init)  # v_{-1} (Reddi et al. Alg. 2)
        # the state the rule keeps: FedAvgM's momentum only (its v is never read), else m and v
        kept = (self.m,) if hp.server_opt == "momentum" else (self.m, self.v)
        self.ledger.store("server", "optimizer_state", nbytes(*kept))

    def server_step(self, delta: torch.Tensor) -> torch.Tensor:
        """The server optimizer's step from the pseudo-gradient ``delta`` (Reddi et al. Alg. 2)."""
        hp = self.hp
        if hp.server_opt == "momentum":
            self.m = hp.beta1 * self.m + delta
            return hp.server_lr * self.m
        self.m = hp.beta1 * self.m + (1 - hp.beta1) * delta
        d2 = delta * delta
        if hp.server_opt == "adam":
            self.v = hp.beta2 * self.v + (1 - hp.beta2) * d2
        elif hp.server_opt == "yogi":
            self.v = self.v - (1 - hp.beta2) * d2 * torch.sign(self.v - d2)
        else:  # adagrad
            self.v = self.v + d2
        return hp.server_lr * self.m / (self.v.sqrt() + hp.tau)

    def server_update(self, mean: torch.Tensor, got: Collected) -> None:
        self.x = self.x + self.server_step(mean)  # Delta = mean_S (y_i - x_t), the pseudo-gradient


@dataclass
class FedYogiHparams(FedOptHparams):
    server_opt: Literal["yogi"] = "yogi"


@dataclass
class FedAdagradHparams(FedOptHparams):
    server_opt: Literal["adagrad"] = "adagrad"


@dataclass
class FedAvgMHparams(FedOptHparams):
    server_lr: float = 1.0  # Hsu et al.: the server applies the averaged update with step 1 ...
    server_opt: Literal["momentum"] = "momentum"
    beta1: float = 0.9  # ... and momentum 0.9 (beta1 = 0: FedAvg)


@ALGORITHMS.register("fedyogi")
class FedYogi(FedOpt):
    name = "fedyogi"
    Hparams = FedYogiHparams


@ALGORITHMS.register("fedadagrad")
class FedAdagrad(FedOpt):
    name = "fedadagrad"
    Hparams = FedAdagradHparams


@ALGORITHMS.register("fedavgm")
class FedAvgM(FedOpt):
    name = "fedavgm"
    Hparams = FedAvgMHparams
