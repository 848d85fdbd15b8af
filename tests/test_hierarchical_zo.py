"""ZO-HFL's mathematical machinery against closed forms (spec zo-hfl §9.1): the randomized-smoothing
estimator (Lemma 7), the lower-level solves of Algorithm 2 (Prop. 1), and the appendix example (3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedweave.algorithms.hierarchical.base import (
    BallProjection,
    BoxProjection,
    LowerLevelRule,
    decaying,
    local_steps,
    unit_directions,
    zo_gradient,
)
from fedweave.config import LocalConfig
from fedweave.execution import LocalTrainer
from fedweave.seeding import Seeds


def _sphere(n: int, d: int, seed: int) -> torch.Tensor:
    z = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return z / z.norm(dim=1, keepdim=True)


# ---- the estimator ---------------------------------------------------------------------------------------


def test_unit_directions_are_unit_reproducible_and_isotropic():
    s = Seeds(7)
    v = unit_directions(s, 3, 4000, 5)
    assert torch.allclose(v.norm(dim=1), torch.ones(4000), atol=1e-6)
    assert torch.equal(v[11], unit_directions(s, 3, 12, 5)[11])  # stream ("zo_direction", r, i) per client
    assert not torch.equal(v[0], unit_directions(s, 4, 1, 5)[0])
    cov = (v.double().T @ v.double()) / len(v)  # E[v v^T] = I/d on the sphere
    assert torch.allclose(cov, torch.eye(5, dtype=torch.float64) / 5, atol=0.02)


@pytest.mark.parametrize("eta", [1.5, 0.75, 0.25])
def test_estimator_is_unbiased_for_the_smoothed_cubic(eta):
    # f(x) = sum x_j^3 / 3: the ball-smoothed f^eta has grad_j = x_j^2 + eta^2/(d+2) (E[u_j^2] = 1/(d+2)),
    # while grad f = x^2: the estimator is unbiased for grad f^eta (Lemma 7(i)) and its bias to grad f is O(eta^2).
    d, n = 3, 300_000
    x = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64)
    v = _sphere(n, d, seed=1)
    f = lambda z: (z**3).sum(-1) / 3  # noqa: E731
    g = zo_gradient(f(x + eta * v), f(x - eta * v), v, eta)
    mean, se = g.mean(0), g.std(0) / n**0.5
    smoothed = x**2 + eta**2 / (d + 2)
    assert ((mean - smoothed).abs() < 4 * se).all(), (mean, smoothed, se)
    assert float((mean - x**2).norm()) == pytest.approx(float((smoothed - x**2).norm()), abs=6 * float(se.norm()))


def test_estimator_error_to_the_true_gradient_shrinks_with_eta():
    d, n = 3, 300_000
    x = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64)
    v = _sphere(n, d, seed=2)
    f = lambda z: (z**3).sum(-1) / 3  # noqa: E731
    errs = [(zo_gradient(f(x + e * v), f(x - e * v), v, e).mean(0) - x**2).norm() for e in (2.0, 1.0, 0.5)]
    assert errs[0] > errs[1] > errs[2]
    assert errs[0] > 3 * errs[2]


def test_estimator_on_the_implicit_quadratic_matches_the_closed_form_gradient():
    # L(y) = 1/2 ||A y - b||^2, y(x) = (A^T A + mu I)^{-1}(A^T b + mu x), f2 = lam/2 ||x - y(x)||^2
    # = lam/2 ||P x - c||^2 with P = I - mu M^{-1}, c = M^{-1} A^T b: grad f2 = lam P^T (P x - c) = grad f2^eta.
    rng = np.random.default_rng(0)
    d, mu, lam, eta, n = 4, 0.5, 3.0, 0.1, 200_000
    A, b = torch.tensor(rng.normal(size=(6, d))), torch.tensor(rng.normal(size=6))
    M = A.T @ A + mu * torch.eye(d, dtype=torch.float64)
    y_of = lambda x: torch.linalg.solve(M, (A.T @ b).unsqueeze(-1) + mu * x.T).T  # noqa: E731
    f2 = lambda x: 0.5 * lam * ((x - y_of(x)) ** 2).sum(-1)  # noqa: E731
    P = torch.eye(d, dtype=torch.float64) - mu * torch.linalg.inv(M)
    c = torch.linalg.solve(M, A.T @ b)
    x = torch.tensor([0.3, -1.0, 0.5, 2.0], dtype=torch.float64)
    exact = lam * P.T @ (P @ x - c)
    v = _sphere(n, d, seed=3)
    g = zo_gradient(f2(x + eta * v), f2(x - eta * v), v, eta)
    mean, se = g.mean(0), g.std(0) / n**0.5
    assert ((mean - exact).abs() < 4 * se).all()
    # its second moment is of the order d ||grad f2||^2 (Lemma 4(ii)): exactly that for a quadratic
    assert float((g**2).sum(1).mean()) == pytest.approx(float(d * exact.norm() ** 2), rel=0.02)


# ---- Algorithm 2 on quadratic client losses --------------------------------------------------------------


class _Quadratic:
    """Client losses 1/2 mean_j (u_j . y - b_j)^2 on a linear model: y_i(x) has a closed form."""

    def __init__(self, clients: int = 3, per_client: int = 24, n: int = 5, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.U = torch.randn(clients * per_client, n, generator=g)
        self.b = self.U @ torch.randn(n, generator=g) + 0.3 * torch.randn(clients * per_client, generator=g)
        self.parts = [np.arange(i * per_client, (i + 1) * per_client) for i in range(clients)]
        self.n, self.per_client = n, per_client

    def trainer(self, backend: str, batch_size: int) -> LocalTrainer:
        model = nn.Linear(self.n, 1, bias=False)
        local = LocalConfig(steps=1, batch_size=batch_size, lr=0.1)
        tr = LocalTrainer(model, self.U, self.b, self.parts, local, Seeds(0), backend=backend)

        def loss(out, y, mask=None):
            e = 0.5 * (out.squeeze(-1) - y) ** 2
            return e.mean() if mask is None else (e * mask).sum() / mask.sum()

        tr.loss_fn = loss
        return tr

    def solution(self, client: int, x: torch.Tensor, mu: float) -> torch.Tensor:
        idx = torch.as_tensor(self.parts[client])
        U, b = self.U[idx].double(), self.b[idx].double()
        M = U.T @ U / len(idx) + mu * torch.eye(self.n, dtype=torch.float64)
        return torch.linalg.solve(M, U.T @ b / len(idx) + mu * x.double())


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_lower_level_solves_converge_to_the_closed_form(backend):
    q, mu = _Quadratic(), 0.5
    tr = q.trainer(backend, batch_size=q.per_client)  # full batches: deterministic gradient steps
    clients = np.array([0, 0, 1, 1, 2, 2])  # two jobs per client, as in ZO-HFL
    anchors = torch.randn(6, q.n, generator=torch.Generator().manual_seed(5))
    out = tr.train(anchors, clients, 0, rule=LowerLevelRule(mu, anchors), lr=0.4, steps=80).params
    for j, c in enumerate(clients):
        assert torch.allclose(out[j].double(), q.solution(int(c), anchors[j], mu), atol=1e-4)


def test_stochastic_lower_level_error_decays_like_one_over_h():
    # Prop. 1(i): with gamma~_t = c/(t+Gamma), mu_h c > 1, E||y_H - y*||^2 = O(1/H).
    q, mu = _Quadratic(per_client=40), 1.0
    tr = q.trainer("vmap", batch_size=4)
    clients = np.repeat(np.arange(3), 8)
    x = torch.zeros(len(clients), q.n)
    stars = torch.stack([q.solution(int(c), x[0], mu) for c in clients])
    errs = {}
    for H in (10, 160):
        out = tr.train(x, clients, 0, rule=LowerLevelRule(mu, x), lr=decaying(2.0, 4.0), steps=H, key=(H,)).params
        errs[H] = float(((out.double() - stars) ** 2).sum(1).mean())
    assert errs[160] < errs[10] / 5


def test_same_key_means_same_batches_for_the_pair_of_solves():
    q = _Quadratic()
    tr = q.trainer("loop", batch_size=3)
    start = torch.ones(2, q.n)
    same = tr.train(start, [1, 1], 4, rule=LowerLevelRule(0.1, start), lr=0.05, steps=7).params
    assert torch.equal(same[0], same[1])
    a = tr.train(start[:1], [1], 4, rule=LowerLevelRule(0.1, start[:1]), lr=0.05, steps=7, key=(0,)).params
    b = tr.train(start[:1], [1], 4, rule=LowerLevelRule(0.1, start[:1]), lr=0.05, steps=7, key=(1,)).params
    assert not torch.equal(a, b)


def test_projections_keep_iterates_feasible():
    centre = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    w = torch.tensor([[4.0, 6.0], [0.1, -0.1]])
    p = BallProjection(1.0)(w, centre)
    assert torch.allclose((p - centre).norm(dim=1), torch.tensor([1.0, (0.02**0.5)]), atol=1e-6)
    assert torch.allclose(p[0], torch.tensor([1.6, 2.8]))  # along the ray from the centre
    assert torch.equal(BoxProjection(0.0, float("inf"))(w, centre), w.clamp_min(0.0))
    with pytest.raises(ValueError, match="low <= high"):
        BoxProjection(1.0, 0.0)


def test_local_step_schedule():
    assert [local_steps(20, r) for r in (0, 3, 499)] == [20, 40, 447]  # floor(tau sqrt(r+1)), spec §4.4
    assert sum(local_steps(20, r) for r in range(500)) == 149_029  # spec §7
    assert local_steps(0.1, 0) == 1


# ---- the appendix example (3): a nonsmooth, nonconvex implicit function ------------------------------------


def _implicit(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((x + 1 - x.clamp_min(0)) ** 2).sum(-1)  # f(x) = sum_i g(x_i), g(t) = (t + 1 - max(0, t))^2/2


def _lower(x: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """y(x) = argmin_{y >= 0} ||y - x||^2 by projected gradient steps of Algorithm 2 (data loss 0, mu = 2)."""
    rule = LowerLevelRule(2.0, x, BoxProjection(0.0, float("inf")))
    zero = lambda w: torch.zeros_like(w)  # noqa: E731
    y = x.clone()
    for _ in range(steps):
        y = rule.project(y - 0.3 * rule.direction(y, zero, torch.arange(len(x))), torch.arange(len(x)))
    return y


def test_appendix_example_is_nonconvex_and_kinked_as_stated():
    n = 2
    one = torch.ones(n, dtype=torch.float64)
    assert float(_implicit(0 * one)) == pytest.approx(n / 2)  # f(0) = n/2 > n/4 = (f(1) + f(-1))/2
    assert float(0.5 * (_implicit(one) + _implicit(-one))) == pytest.approx(n / 4)
    h = 1e-6
    e = torch.tensor([1.0, 0.0], dtype=torch.float64)
    right = (_implicit(h * e) - _implicit(0 * e)) / h
    left = (_implicit(0 * e) - _implicit(-h * e)) / h
    assert float(right) == pytest.approx(0.0, abs=1e-6) and float(left) == pytest.approx(1.0, abs=1e-5)
    # the lower-level solver recovers y(x) = Pi_{R^n_+}[x]
    x = torch.tensor([[0.7, -0.4], [-2.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(_lower(x), x.clamp_min(0))


@pytest.mark.parametrize("start", [(-0.5, -0.3), (0.05, 0.02)])
def test_zo_hfl_on_the_appendix_example_descends_through_the_kink(start):
    # Spec §9.1(3): m = 1, f1 = 0, eta = 0.1; from (-1, 0)^n f -> 0 (x -> -1). From just right of the kink,
    # where grad f = 0, the smoothed gradient still points left and the iterate leaves the flat region.
    g = torch.Generator().manual_seed(0)
    eta, x = 0.1, torch.tensor([start], dtype=torch.float64)
    f0 = float(_implicit(x))
    for _ in range(600):
        v = torch.randn(1, 2, generator=g, dtype=torch.float64)
        v = v / v.norm()
        xp, xm = x + eta * v, x - eta * v
        fp = 0.5 * ((xp + 1 - _lower(xp)) ** 2).sum(-1)  # f2(x + eta v, y(x + eta v))
        fm = 0.5 * ((xm + 1 - _lower(xm)) ** 2).sum(-1)
        x = x - 0.05 * zo_gradient(fp, fm, v, eta)
        assert torch.isfinite(x).all()
    assert float(_implicit(x)) < 0.02 < f0
    assert (x < -0.8).all()


def test_step_schedule_gives_the_same_numbers_on_loop_and_vmap():
    q = _Quadratic()
    clients = np.array([0, 0, 2, 2])
    start = torch.randn(4, q.n, generator=torch.Generator().manual_seed(1))
    out = {
        b: q.trainer(b, 5).train(start, clients, 3, rule=LowerLevelRule(0.2, start), lr=decaying(0.1), steps=6).params
        for b in ("loop", "vmap")
    }
    assert torch.allclose(out["loop"], out["vmap"], atol=1e-6)
    const = q.trainer("loop", 5).train(start, clients, 3, rule=LowerLevelRule(0.2, start), lr=0.1, steps=6).params
    assert not torch.allclose(out["loop"], const)
