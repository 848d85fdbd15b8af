"""The l2-regularized logistic regression of the CFL-SAGA paper (eq. 47-48), laid out over servers x users.

f(x) = (1/N) sum_i f_i(x),  f_i = sum_j f_ij,  f_ij = sum_t f_ij,t,
f_ij,t(x) = sum_{s in batch t} [ (kappa/2)||x||^2 + softplus(w_s^T x) - b_s w_s^T x ]           (48)

Sums, not means (spec A8): the scale of every gradient, of alpha and of the trigger threshold rho follows.
Samples live in one float64 tensor ``omega`` of shape (N servers, P users, S mini-batches, B samples, d) with
labels ``b`` (N, P, S, B): mini-batches are a fixed partition chosen once (spec A16). The optimum x* is found
by damped Newton in float64 (spec A15).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import softplus

from fedweave.config import ConfigError
from fedweave.data.base import Dataset
from fedweave.tasks import LOSSES

BCE = LOSSES.get("bce_with_logits")()  # the test set's logistic loss, shared with every other family

FEATURE_SCALINGS = ("none", "unit_norm", "standardize")


@dataclass
class LogRegProblem:
    omega: torch.Tensor  # (N, P, S, B, d) float64
    b: torch.Tensor  # (N, P, S, B) float64 in {0, 1}
    kappa: float
    test_x: torch.Tensor  # (m, d) float64, possibly empty
    test_y: torch.Tensor  # (m,) float64

    def __post_init__(self) -> None:
        self.N, self.P, self.S, self.B, self.d = self.omega.shape
        self.n = self.N * self.P * self.S * self.B
        self.flat_x = self.omega.reshape(self.n, self.d)
        self.flat_b = self.b.reshape(self.n)
        self._servers = torch.arange(self.N, device=self.omega.device)[:, None]
        self._batches = self.omega.view(self.N * self.P * self.S, self.B * self.d)
        self._labels = self.b.view(self.N * self.P * self.S, self.B)

    def to(self, device: torch.device) -> LogRegProblem:
        """The problem with its tensors on ``device`` (itself when they are already there)."""
        if self.omega.device == torch.device(device):
            return self
        move = {k: getattr(self, k).to(device) for k in ("omega", "b", "test_x", "test_y")}
        return LogRegProblem(move["omega"], move["b"], self.kappa, move["test_x"], move["test_y"])

    # ---- gradients at the users (vectorized over servers x users) -------------------------------
    def batch_index(self, users: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Flat index (N, K) of mini-batch t of user j of every server, into (N P S)-long tables."""
        return (self._servers * self.P + users) * self.S + t

    def batch_grad(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """grad f_ij,t(x) = sum_{s in batch} [kappa x + (sig(w_s^T x) - b_s) w_s] for the mini-batches ``idx``
        (N, K) from :meth:`batch_index`, at one point per server ``x`` (N, d) or per user (N, K, d)."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        a = self._batches.index_select(0, flat)  # (N K, B d)
        labels = self._labels.index_select(0, flat).view(n, k, self.B)
        if x.dim() == 2:  # one point per server: a single GEMV per server
            z = torch.bmm(x.unsqueeze(1), a.view(n, k * self.B, self.d).transpose(1, 2)).view(n, k, self.B)
            reg = (self.B * self.kappa) * x[:, None, :]
        else:
            z = (a.view(n, k, self.B, self.d) * x.unsqueeze(2)).sum(-1)
            reg = (self.B * self.kappa) * x
        resid = torch.sigmoid(z) - labels
        g = torch.bmm(resid.view(n * k, 1, self.B), a.view(n * k, self.B, self.d)).view(n, k, self.d)
        return g + reg

    def user_grad(self, x: torch.Tensor) -> torch.Tensor:
        """grad f_ij(x_i) = sum_t grad f_ij,t(x_i) of every user (N, P, d) at its server's point x (N, d)."""
        a = self.omega.reshape(self.N, self.P * self.S * self.B, self.d)
        resid = torch.sigmoid(a @ x.unsqueeze(-1)).squeeze(-1) - self.b.reshape(self.N, -1)  # (N, PSB)
        g = resid.reshape(self.N, self.P, 1, self.S * self.B) @ self.omega.reshape(self.N, self.P, -1, self.d)
        return g.squeeze(-2) + (self.S * self.B * self.kappa) * x[:, None, :]

    def server_grad(self, x: torch.Tensor) -> torch.Tensor:
        """grad f_i(x_i) (N, d) at each server's own point."""
        return self.user_grad(x).sum(1)

    # ---- the global objective --------------------------------------------------------------------
    # Eq. (48) stays written out: its gradient, Hessian and Newton solve are analytic, and the optimality gaps
    # down to 1e-10 are measured with this very expression. softplus(z) - b z is the same function as
    # fedweave.tasks' bce_with_logits (tests/test_confederated.py checks them equal to 1e-12).
    def loss(self, x: torch.Tensor) -> float:
        z = self.flat_x @ x
        return float((softplus(z) - self.flat_b * z).sum() + 0.5 * self.kappa * self.n * (x @ x)) / self.N

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        resid = torch.sigmoid(self.flat_x @ x) - self.flat_b
        return (self.flat_x.T @ resid + self.kappa * self.n * x) / self.N

    def hessian(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.flat_x @ x)
        h = (self.flat_x * (s * (1 - s))[:, None]).T @ self.flat_x
        return (h + self.kappa * self.n * torch.eye(self.d, dtype=x.dtype, device=x.device)) / self.N

    def lipschitz(self) -> float:
        """L_f = lambda_max((1/N)(1/4 Omega^T Omega + n kappa I)), the global smoothness (spec §3, alpha)."""
        gram = self.flat_x.T @ self.flat_x
        return float(torch.linalg.eigvalsh(gram)[-1] / 4 + self.kappa * self.n) / self.N

    def solve(self, tol: float = 1e-12, max_iter: int = 100) -> torch.Tensor:
        """x* by damped Newton (backtracking on f), until ||grad f|| <= tol or no further progress."""
        x = torch.zeros(self.d, dtype=torch.float64, device=self.omega.device)
        g = self.grad(x)
        for _ in range(max_iter):
            gn = float(g.norm())
            if gn <= tol:
                break
            step = torch.linalg.solve(self.hessian(x), g)
            f0, dec, a = self.loss(x), float(g @ step), 1.0
            while a > 1e-10 and self.loss(x - a * step) > f0 - 0.25 * a * dec + 1e-15 * abs(f0):
                a /= 2
            x_new = x - a * step
            g_new = self.grad(x_new)
            if float(g_new.norm()) >= gn and float((x_new - x).norm()) <= 1e-15 * (1 + float(x.norm())):
                break  # rounding floor reached
            x, g = x_new, g_new
        return x

    # ---- test set ---------------------------------------------------------------------------------
    @property
    def has_test(self) -> bool:
        return len(self.test_y) > 0

    def test_metrics(self, x: torch.Tensor) -> dict[str, float]:
        """Accuracy and the mean logistic loss on the test set (fedweave.tasks' ``bce_with_logits``)."""
        z = self.test_x @ x
        acc = float(((z > 0).double() == self.test_y).double().mean())
        nll = float(BCE.per_sample(z, self.test_y).mean())
        return {"test_accuracy": acc, "test_loss": nll}


def _scale(train: torch.Tensor, test: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    if how == "unit_norm":
        return [t / t.norm(dim=1, keepdim=True).clamp_min(1e-12) for t in (train, test)]
    if how == "standardize":
        mu, sd = train.mean(0), train.std(0).clamp_min(1e-12)
        return (train - mu) / sd, (test - mu) / sd
    return train, test


def build_problem(
    ds: Dataset,
    num_servers: int,
    users_per_server: int,
    batch_size: int,
    kappa: float,
    rng: np.random.Generator,
    *,
    feature_scaling: str = "none",
    intercept: bool = False,
) -> LogRegProblem:
    """Distribute a binary dataset over N servers x P users x S mini-batches of B samples.

    Every user gets S = floor(n / (N P B)) mini-batches (equal sizes, as in the paper's experiments); the
    samples are assigned by a permutation from ``rng`` and the n - N P S B left over are not used.
    """
    if ds.num_classes != 2:  # float targets passed from Python are a regression output, not two classes
        has = "float targets" if ds.train_y.is_floating_point() else f"{ds.num_classes} classes"
        raise ConfigError(
            f"dataset {ds.name!r} has {has}; the confederated family solves binary logistic regression: give it "
            "integer labels 0 and 1 (datasets: cfl_logreg, adult, mushroom, breast_cancer)"
        )
    if feature_scaling not in FEATURE_SCALINGS:
        raise ConfigError(f"algorithm.feature_scaling must be one of {', '.join(FEATURE_SCALINGS)}")
    width = int(np.prod(ds.input_shape))
    x = ds.train_x.reshape(len(ds.train_x), width).to(torch.float64)
    tx = ds.test_x.reshape(len(ds.test_x), width).to(torch.float64)
    y, ty = ds.train_y.to(torch.float64), ds.test_y.to(torch.float64)
    for split, labels in (("training", y), ("test", ty)):  # the test split's are scored as 0/1 too (z > 0 == b)
        if not bool(((labels == 0) | (labels == 1)).all()):
            raise ConfigError(
                f"dataset {ds.name!r}: its {split} labels must be 0 or 1 (the confederated family solves binary "
                "logistic regression, eq. (48))"
            )
    for split, feats in (("training", x), ("test", tx)):  # else L_f's eigensolver or Newton fails on them
        if not bool(torch.isfinite(feats).all()):
            raise ConfigError(
                f"dataset {ds.name!r}: its {split} features hold NaN or infinite values; the confederated family "
                "solves eq. (48) on finite features only"
            )
    x, tx = _scale(x, tx, feature_scaling)
    if intercept:
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], 1)
        tx = torch.cat([tx, torch.ones(len(tx), 1, dtype=tx.dtype, device=tx.device)], 1)
    n, d = x.shape
    per_batch = num_servers * users_per_server * batch_size
    s = n // per_batch
    if s < 1:
        raise ConfigError(
            f"dataset {ds.name!r} has {n} training samples, fewer than num_servers x users_per_server x "
            f"batch_size = {per_batch}: lower algorithm.num_servers, users_per_server or batch_size"
        )
    idx = torch.as_tensor(rng.permutation(n)[: per_batch * s], device=x.device)
    shape = (num_servers, users_per_server, s, batch_size)
    return LogRegProblem(x[idx].reshape(*shape, d).contiguous(), y[idx].reshape(shape).contiguous(), kappa, tx, ty)
