"""The centralized family: FedMIM's identities and special cases, known optima, byte formulas, backends."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.centralized import fedmim as fedmim_mod
from fedweave.algorithms.centralized.base import local_consistency, regularized
from fedweave.algorithms.centralized.fedadam import FedOpt, FedOptHparams
from fedweave.algorithms.centralized.fedmim import MIMRule
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.scaffold import ScaffoldRule, option_ii
from fedweave.config import ConfigError, load
from fedweave.data.base import Dataset
from fedweave.registry import DATASETS, MODELS, PARTITIONERS
from fedweave.runner import run as run_config
from tests.conftest import make_toy

# ---- fixtures: a small classification toy and a federated least-squares problem (test data) ----------
if "_toy_central" not in DATASETS._items:
    DATASETS.register("_toy_central")(lambda: make_toy(n_train=480, n_test=120, seed=5))

N_Q, M_Q, D_Q = 4, 40, 3  # clients, samples per client, features of the least-squares toy


def _quad_data() -> Dataset:
    """Client i: features scaled by (i+2)/3 and its own linear target map, so the client Hessians and
    optima differ (heterogeneity). Whole-number float targets (the half squared error's)."""
    g = torch.Generator().manual_seed(7)
    xs, ys = [], []
    for i in range(N_Q):
        a = torch.randn(M_Q, D_Q, generator=g) * (i + 2) / 3
        w = torch.randn(D_Q, generator=g) * 2
        xs.append(a)
        ys.append((a @ w).round())
    x, y = torch.cat(xs), torch.cat(ys)
    return Dataset("_quad_central", x, y, x[:4], y[:4], 1, (D_Q,))


if "_quad_central" not in DATASETS._items:
    DATASETS.register("_quad_central")(_quad_data)
if "_quad_lin" not in MODELS._items:
    MODELS.register("_quad_lin")(lambda input_shape, num_classes: nn.Linear(input_shape[0], 1, bias=False))
if "_blocks" not in PARTITIONERS._items:

    @PARTITIONERS.register("_blocks")
    def _blocks(labels, num_clients, rng, *, users=None):
        return list(np.array_split(np.arange(len(labels)), num_clients))


def _cfg(alg: str, rounds: int = 3, backend: str = "loop", local: dict | None = None, **opts) -> dict:
    return {
        "name": "t",
        "seed": 4,
        "rounds": rounds,
        "backend": backend,
        "dataset": {"name": "_toy_central"},
        "partition": {"name": "_blocks", "num_clients": 8},
        "model": {"name": "logistic"},
        "algorithm": {"name": alg, "clients_per_round": 3, **opts},
        "local": local or {"steps": 4, "batch_size": 16, "lr": 0.2, "weight_decay": 1e-2, "grad_clip": 1.0},
        "output": {"progress": False, "plots": False},
    }


def _algo(cfg: dict):
    return build_algorithm(RunContext(load(cfg)))


def _rounds(algo, n: int, start: int = 0) -> torch.Tensor:
    for r in range(start, start + n):
        algo.run_round(r)
    return algo.x


# ---- FedMIM special cases (spec 2.3, 9.3 items 3-5) -------------------------------------------------
@pytest.mark.parametrize("opts", [{"alpha": [0.0, 0.0], "beta": [0.0, 0.0]}, {"alpha": [], "beta": []}])
def test_fedmim_without_momentum_is_fedavg_bit_for_bit(opts):
    base = _rounds(_algo(_cfg("fedavg")), 3)
    mim = _rounds(_algo(_cfg("fedmim", **opts)), 3)
    assert torch.equal(base, mim)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize(
    ("alg", "opts", "other", "base", "base_opts"),
    [
        ("fedprox", {"mu": 0.0}, {"mu": 0.5}, "fedavg", {}),
        ("fedcm", {"alpha": 1.0}, {"alpha": 0.5}, "fedavg", {}),
        ("mofedsam", {"alpha": 1.0, "sam_rho": 0.05}, {"alpha": 0.5, "sam_rho": 0.05}, "fedsam", {"rho": 0.05}),
    ],
)
def test_special_cases_are_their_base_method_bit_for_bit(alg, opts, other, base, base_opts, backend):
    # FedProx Eq. 2 without its proximal term and FedCM Alg. 1 without the momentum share are FedAvg's clients;
    # MoFedSAM (Qu et al. 2022, Alg. 2) without the momentum share is FedSAM's
    ref = _rounds(_algo(_cfg(base, backend=backend, **base_opts)), 3)
    assert torch.equal(_rounds(_algo(_cfg(alg, backend=backend, **opts)), 3), ref)
    assert not torch.equal(_rounds(_algo(_cfg(alg, backend=backend, **other)), 3), ref)  # the term matters


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize("local", [{}, {"weight_decay": 1e-2}], ids=["plain", "wd"])
@pytest.mark.parametrize(("alg", "opts"), [("fedprox", {"mu": 0.0}), ("fedcm", {"alpha": 1.0})])
def test_special_cases_are_fedavg_bit_for_bit_without_clipping(alg, opts, local, backend):
    """Without grad_clip the loop backend trains FedAvg's plain SGD by its own kernels (the fused one for a
    softmax regression): each special case below is FedAvg's clients and must take that path too, so that it
    stays FedAvg bit for bit (the documented claim) in the default local configuration."""
    loc = {"steps": 4, "batch_size": 16, "lr": 0.2, **local}
    ref = _rounds(_algo(_cfg("fedavg", backend=backend, local=loc)), 3)
    assert torch.equal(_rounds(_algo(_cfg(alg, backend=backend, local=loc, **opts)), 3), ref)


def test_feddyn_refuses_a_server_step_size_in_one_line():
    # Alg. 1's server sets theta^t = mean theta_i - h / alpha: a server_lr would be read by nothing
    with pytest.raises(ConfigError) as err:
        _algo(_cfg("feddyn", server_lr=0.5))
    assert str(err.value).startswith("algorithm.server_lr: FedDyn's server model is") and "\n" not in str(err.value)


def test_fedmim_j1_beta0_is_fedcm():
    local = {"steps": 4, "batch_size": 16, "lr": 0.2, "weight_decay": 1e-2}  # constant lr (spec A8)
    cm = _rounds(_algo(_cfg("fedcm", local=local, alpha=0.1)), 4)
    mim = _rounds(_algo(_cfg("fedmim", local=local, alpha=[0.9], beta=[0.0])), 4)
    torch.testing.assert_close(cm, mim, rtol=1e-5, atol=1e-6)
    fedavg = _rounds(_algo(_cfg("fedavg", local=local)), 4)
    assert (cm - fedavg).abs().max() > 1e-3  # the momentum mattered


def test_fedmim_round_zero_is_fedavg_with_lr_A_eta():
    local = {"steps": 4, "batch_size": 16, "lr": 0.2, "weight_decay": 1e-2}
    mim = _rounds(_algo(_cfg("fedmim", local=local, rounds=1)), 1)
    avg = _rounds(_algo(_cfg("fedavg", local={**local, "lr": 0.2 * (1 - 0.6 - 0.3)}, rounds=1)), 1)
    torch.testing.assert_close(mim, avg, rtol=1e-6, atol=1e-7)


class _Recording(MIMRule):
    """MIMRule that also sums each job's gradients g_{i,k} (for the lemma checks)."""

    sums: dict[int, torch.Tensor] = {}

    def direction(self, w, grad, jobs):
        g = regularized(grad, self.weight_decay, self.grad_clip)(w - self.m_beta)
        _Recording.sums[jobs] = _Recording.sums.get(jobs, 0) + g
        return self.m_alpha / self.lr + self.A * g


def test_fedmim_lemmas_5_and_6_hold(monkeypatch):
    monkeypatch.setattr(fedmim_mod, "MIMRule", _Recording)
    alpha, beta = [0.6, 0.3], [0.9, 0.1]
    local = {"steps": 5, "batch_size": 16, "lr": 0.1, "lr_decay": 0.9}
    algo = _algo(_cfg("fedmim", local=local, alpha=alpha, beta=beta, weighting="uniform"))
    A, K, S = 0.1, 5, 3
    c = torch.tensor([sum(alpha[j:]) for j in range(2)])

    def u(hist):  # Lemma 5's auxiliary sequence, hist[j] = x_{t-j}
        return hist[0] + sum(c[j] * (hist[j] - hist[j + 1]) for j in range(2)) / A

    for r in range(5):
        _Recording.sums = {}
        hist, d_old = algo.history.clone(), algo.deltas()
        algo.run_round(r)
        gsum = sum(_Recording.sums.values())  # sum over clients and steps
        lr = 0.1 * 0.9**r
        # Lemma 6 (Eq. 19-20): delta_{t+1} = A (eta/(S K)) sum g + sum_j alpha_j delta_{t-j}
        lhs = (hist[0] - algo.x) / K
        rhs = A * lr / (S * K) * gsum + alpha[0] * d_old[0] + alpha[1] * d_old[1]
        torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=1e-7)
        # Lemma 5 (Eq. 15-17): u_{t+1} = u_t - (eta/S) sum g
        torch.testing.assert_close(u(algo.history), u(hist) - lr / S * gsum, rtol=1e-4, atol=1e-6)
    assert algo.deltas().abs().max() > 0


def test_fedmim_history_is_kept_on_the_server():
    algo = _algo(_cfg("fedmim"))
    xs = [algo.x.clone()]
    for r in range(3):
        algo.run_round(r)
        xs.append(algo.x.clone())
    torch.testing.assert_close(algo.history, torch.stack([xs[3], xs[2], xs[1]]))
    torch.testing.assert_close(algo.deltas()[0], (xs[2] - xs[3]) / 4)  # K = local.steps


@pytest.mark.parametrize(
    "opts,key",
    [
        ({"alpha": [0.6, 0.5], "beta": [0.9, 0.1]}, "algorithm.alpha must sum"),
        ({"alpha": [-0.1, 0.3], "beta": [0.9, 0.1]}, "algorithm.alpha[0]"),
        ({"alpha": [0.6], "beta": [0.9, 0.1]}, "same length"),
        ({"beta": [0.9, -0.1]}, "algorithm.beta[1]"),
        # NaN passes `b < 0` and inf is no weight: either turns every model into NaN from round 1 on
        ({"beta": [0.9, float("nan")]}, "algorithm.beta[1] must be a finite number >= 0"),
        ({"beta": [float("inf"), 0.1]}, "algorithm.beta[0] must be a finite number >= 0"),
        ({"downlink": "carrier_pigeon"}, "algorithm.downlink"),
    ],
)
def test_fedmim_rejects_bad_hyperparameters(opts, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        _algo(_cfg("fedmim", **opts))


# ---- a federated least-squares problem with a known optimum -------------------------------------------
def _quad_cfg(alg: str, **opts) -> dict:
    return {
        "name": "q",
        "seed": 0,
        "rounds": 1,
        "backend": "vmap",
        "dataset": {"name": "_quad_central"},
        "partition": {"name": "_blocks", "num_clients": N_Q, "bins": 2},  # bins: float targets; _blocks reads none
        "model": {"name": "_quad_lin"},
        "algorithm": {"name": alg, "clients_per_round": N_Q, "weighting": "uniform", **opts},
        "local": {"steps": 5, "batch_size": M_Q, "lr": 0.1},  # full-batch gradient descent
        "task": {"loss": "mse", "loss_options": {"half": True}},  # _squared, which tests set as the trainer's loss
        "output": {"progress": False, "plots": False},
    }


def _squared(out, y, mask=None):
    err = 0.5 * (out.squeeze(-1) - y.to(out.dtype)) ** 2
    if mask is None:
        return err.mean()
    m = mask.to(err.dtype)
    return (err * m).sum() / m.sum().clamp_min(1.0)


def _quad_optimum() -> torch.Tensor:
    ds = _quad_data()
    a, y = ds.train_x.double(), ds.train_y.double()  # balanced clients: pooled least squares
    return torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).float()


QUAD_ROUNDS = 40


@pytest.fixture(scope="module")
def quad_final() -> dict[str, float]:
    """Relative distance to the optimum after QUAD_ROUNDS rounds, full participation, 5 local GD steps."""
    opt = _quad_optimum()
    out = {}
    for alg, opts in [("fedavg", {}), ("scaffold", {}), ("feddyn", {"alpha": 1.0}), ("fedmim", {})]:
        algo = _algo(_quad_cfg(alg, **opts))
        algo.trainer.loss_fn = _squared
        x = _rounds(algo, QUAD_ROUNDS)
        out[alg] = float((x - opt).norm() / opt.norm())
    return out


def test_scaffold_and_feddyn_reach_the_optimum_where_fedavg_drifts(quad_final):
    assert quad_final["fedavg"] > 1e-2, quad_final  # client drift: a biased fixed point
    assert quad_final["scaffold"] < 1e-4, quad_final
    assert quad_final["feddyn"] < 1e-4, quad_final
    assert quad_final["fedmim"] < quad_final["fedavg"], quad_final  # its fixed point is FedAvg at lr A eta


def _uneven_blocks(labels, num_clients, rng, *, users=None):
    return [np.arange(i * M_Q, i * M_Q + 10 * (i + 1)) for i in range(num_clients)]  # 10, 20, 30, 40 samples


if "_uneven_blocks" not in PARTITIONERS._items:  # this module may be imported twice in one process
    PARTITIONERS.register("_uneven_blocks")(_uneven_blocks)


@pytest.mark.parametrize(("alg", "opts"), [("scaffold", {}), ("feddyn", {"alpha": 1.0})])
def test_scaffold_and_feddyn_reach_the_unweighted_optimum_under_either_weighting(alg, opts):
    # c = (1/N) sum c_i (SCAFFOLD Alg. 1 line 17) and h = (1/N) sum grad L_i (FedDyn Alg. 1) make the fixed point
    # the optimum of (1/N) sum f_i, the papers' objective: `weighting` changes the path, not the limit
    ds, parts = _quad_data(), _uneven_blocks(None, N_Q, None)
    a, y = ds.train_x.double(), ds.train_y.double()

    def optimum(p: list[float]) -> torch.Tensor:  # argmin sum_i p_i f_i, f_i the mean squared error of client i
        h = sum(w * a[i].T @ a[i] / len(i) for w, i in zip(p, parts))
        return torch.linalg.solve(h, sum(w * a[i].T @ y[i] / len(i) for w, i in zip(p, parts)))

    sizes = [len(i) for i in parts]
    plain, by_size = optimum([1 / N_Q] * N_Q), optimum([n / sum(sizes) for n in sizes])
    assert (plain - by_size).norm() / plain.norm() > 1e-2  # the two objectives differ on this split
    for weighting in ("uniform", "samples"):
        cfg = _quad_cfg(alg, weighting=weighting, **opts)
        cfg["partition"]["name"] = "_uneven_blocks"
        cfg["local"] = {"steps": 5, "full_batch": True, "lr": 0.1}
        algo = _algo(cfg)
        algo.trainer.loss_fn = _squared
        x = _rounds(algo, 60).double()
        assert (x - plain).norm() / plain.norm() < 1e-5, weighting


def _one_empty(labels, num_clients, rng, *, users=None):
    return [np.arange(0, 50), np.arange(0), np.arange(50, 100), np.arange(100, 4 * M_Q)]  # client 1 has no sample


if "_one_empty" not in PARTITIONERS._items:
    PARTITIONERS.register("_one_empty")(_one_empty)


@pytest.mark.parametrize("clients_per_round", [N_Q, 2])
def test_scaffold_with_a_client_without_samples_keeps_its_control_variate_and_reaches_the_optimum(
    clients_per_round,
):
    # the empty client takes no step: option II has no gradient to average, so its c_i stays 0. Its c_i - c (the
    # formula with K_i clamped to 1) pulled c towards 0 each round it took part: 0.3 relative error after 60 rounds
    ds, parts = _quad_data(), _one_empty(None, N_Q, None)
    a, y = ds.train_x.double(), ds.train_y.double()
    full = [i for i in parts if len(i)]  # argmin (1/N) sum_i f_i, the empty client's f_i = 0
    h = sum(a[i].T @ a[i] / len(i) for i in full)
    opt = torch.linalg.solve(h, sum(a[i].T @ y[i] / len(i) for i in full))
    cfg = _quad_cfg("scaffold", clients_per_round=clients_per_round)
    cfg["partition"]["name"] = "_one_empty"
    cfg["local"] = {"steps": 5, "full_batch": True, "lr": 0.1}
    algo = _algo(cfg)
    algo.trainer.loss_fn = _squared
    x = _rounds(algo, 60).double()
    assert any(1 in algo.sample_clients(r) for r in range(60))
    c_i = algo.store.rows("c", np.arange(N_Q))
    assert torch.equal(c_i[1], torch.zeros_like(c_i[1]))
    torch.testing.assert_close(algo.c, c_i.mean(0))  # c = (1/N) sum_i c_i (line 17)
    assert (x - opt).norm() / opt.norm() < 1e-4


# ---- ledger bytes per round (spec §7) -------------------------------------------------------------------
D_TOY = (36 + 1) * 4  # logistic on 6x6 inputs, 4 classes


@pytest.mark.parametrize(
    "alg,opts,down,up",
    [
        ("fedavg", {}, 1, 1),
        ("fedprox", {}, 1, 1),
        ("fedsam", {}, 1, 1),
        ("fedadam", {}, 1, 1),
        ("feddyn", {}, 1, 1),
        ("fedcm", {}, 2, 1),
        ("mofedsam", {}, 2, 1),
        ("scaffold", {}, 2, 2),
        ("fedmim", {}, 3, 1),  # x_t and delta_t, delta_{t-1}
        ("fedmim", {"alpha": [0.5], "beta": [0.0]}, 2, 1),
        ("fedmim", {"alpha": [0.0, 0.0], "beta": [0.0, 0.0]}, 1, 1),
    ],
)
def test_ledger_bytes_per_round_match_the_formulas(alg, opts, down, up):
    algo = _algo(_cfg(alg, **opts))
    algo.run_round(0)
    algo.run_round(1)
    d, S = D_TOY * 4, 3
    for r in (0, 1):
        assert algo.ledger.bytes("down", round=r) == down * S * d
        assert algo.ledger.bytes("up", round=r) == up * S * d


@pytest.mark.parametrize("alg,vectors", [("fedadam", 2), ("fedyogi", 2), ("fedadagrad", 2), ("fedavgm", 1)])
def test_server_optimizer_storage_is_the_state_its_rule_keeps(alg, vectors):
    # Adam, Yogi and Adagrad keep m and v (Reddi et al. 2021, Alg. 2); FedAvgM only its momentum m
    # (Hsu et al. 2019): the ledger's storage holds what the server's rule needs, not what the class allocates
    algo = _algo(_cfg(alg))
    assert algo.ledger.summary()["storage_peak_bytes"]["server"] == {"optimizer_state": vectors * D_TOY * 4}


def test_fedmim_broadcast_downlink_counts_every_client():
    algo = _algo(_cfg("fedmim", downlink="broadcast"))
    algo.run_round(0)
    assert algo.ledger.bytes("down", round=0) == 8 * D_TOY * 4
    assert algo.ledger.count(kind="model", sender="server") == 8


# ---- backends, checkpoints, metrics ---------------------------------------------------------------
@pytest.mark.parametrize("alg", ["fedmim", "scaffold", "feddyn", "fedcm", "fedsam"])
def test_loop_and_vmap_agree(alg):
    xs = [_rounds(_algo(_cfg(alg, backend=b)), 3) for b in ("loop", "vmap")]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alg", ["scaffold", "fedmim"])
def test_resume_continues_identically(alg, tmp_path):
    cfg = _cfg(alg, rounds=4)
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    part = fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    assert part.metrics[-1]["round"] == 2
    resumed = run_config(load({**cfg2, "rounds": 4}), run_dir=tmp_path / "part", resume=True)
    torch.testing.assert_close(resumed.algorithm.x, full.algorithm.x)


def test_consistency_metric_is_the_papers_formula(tmp_path):
    xs = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0]])
    # mean (1, 1): squared distances 2, 2, 4 -> mean 8/3
    assert local_consistency(xs) == pytest.approx(8 / 3)
    res = fedweave.run(_cfg("fedmim", rounds=2, consistency=True), run_dir=tmp_path)
    assert all(row["local_consistency"] > 0 for row in res.metrics)


# ---- the rules on their own ---------------------------------------------------------------------
def test_prox_and_scaffold_rules_on_their_own():
    w, anchor = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
    grad = lambda v: 3 * v  # noqa: E731  (gradient of 1.5 ||v||^2)
    torch.testing.assert_close(ProxRule(0.1, anchor).direction(w, grad, 0), 3 * w + 0.1 * (w - anchor))
    table = torch.stack([anchor, -anchor])  # per-job rows
    torch.testing.assert_close(ProxRule(0.1, table).direction(w, grad, 1), 3 * w + 0.1 * (w + anchor))
    c_i, c = torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([0.0, 5.0])
    torch.testing.assert_close(ScaffoldRule(c_i, c).direction(w, grad, 1), 3 * w - c_i[1] + c)
    with pytest.raises(ValueError, match="mu"):
        ProxRule(-1.0, anchor)
    # option II: c_i+ = c_i - c + (x - y) / (K eta)
    new = option_ii(c_i, c, torch.zeros(2), torch.ones(2, 2), torch.tensor([2, 4]), 0.5)
    torch.testing.assert_close(new, c_i - c + torch.tensor([[-1.0], [-0.5]]))


def test_scaffold_rule_with_zero_variates_is_plain_sgd():
    a = _rounds(_algo(_cfg("fedavg", rounds=1)), 1)
    s = _algo(_cfg("scaffold", rounds=1))
    torch.testing.assert_close(_rounds(s, 1), a)  # c = c_i = 0 in round 0
    assert s.store["c"].abs().sum() > 0 and s.c.abs().sum() > 0


@pytest.mark.parametrize("opt", ["adam", "yogi", "adagrad", "momentum"])
def test_fedopt_server_step_closed_form(opt):
    hp = FedOptHparams(server_opt=opt, server_lr=0.1, beta1=0.9, beta2=0.99, tau=1e-2)
    algo = SimpleNamespace(hp=hp, m=torch.zeros(2), v=torch.zeros(2))
    d1, d2 = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
    FedOpt.server_step(algo, d1)
    step = FedOpt.server_step(algo, d2)
    if opt == "momentum":
        m = 0.9 * d1 + d2
        torch.testing.assert_close(step, 0.1 * m)
        return
    m = 0.9 * 0.1 * d1 + 0.1 * d2
    v1 = {"adam": 0.01 * d1**2, "yogi": 0.01 * d1**2, "adagrad": d1**2}[opt]
    v = {
        "adam": 0.99 * v1 + 0.01 * d2**2,
        "yogi": v1 - 0.01 * d2**2 * torch.sign(v1 - d2**2),
        "adagrad": v1 + d2**2,
    }[opt]
    torch.testing.assert_close(step, 0.1 * m / (v.sqrt() + 1e-2))


@pytest.mark.parametrize("v_init", [0.0, 1e-4, 0.25])
def test_fedadam_v_init_first_step_known_answer(v_init):
    # Reddi et al. Alg. 2 with v_{-1} = v_init: one round from x = 0, Delta = (1, -2, 0):
    # m = 0.1 Delta, v = 0.99 v_init + 0.01 Delta^2, x_1 = 0.1 m / (sqrt(v) + 0.01)
    algo = _algo(_cfg("fedadam", rounds=1, v_init=v_init))
    torch.testing.assert_close(algo.v, torch.full_like(algo.x, v_init))
    d = torch.zeros_like(algo.x)
    d[:3] = torch.tensor([1.0, -2.0, 0.0])
    step = algo.server_step(d)
    expected = (
        torch.tensor([1.0, -2.0, 0.0]) * 0.01 / (torch.tensor([0.01, 0.04, 0.0]) + 0.99 * v_init).sqrt().add(0.01)
    )
    torch.testing.assert_close(step[:3], expected)
    if v_init == 0.0:  # by hand: 0.1 * 0.1 / (sqrt(0.01) + 0.01) = 0.01 / 0.11
        assert float(step[0]) == pytest.approx(0.01 / 0.11)
    with pytest.raises(ConfigError, match="algorithm.v_init"):
        _algo(_cfg("fedadam", v_init=-1.0))


def test_fedadam_defaults_and_errors():
    hp = FedOptHparams()
    assert (hp.server_lr, hp.beta1, hp.beta2, hp.tau, hp.v_init) == (0.1, 0.9, 0.99, 1e-2, 0.0)
    with pytest.raises(ConfigError, match="algorithm.beta2"):
        _algo(_cfg("fedadam", beta2=1.0))
    with pytest.raises(ConfigError, match="algorithm.server_opt"):
        _algo(_cfg("fedopt", server_opt="lion"))


def test_example_configs_are_valid():
    from pathlib import Path

    from fedweave.config import build_dataclass
    from fedweave.registry import ALGORITHMS

    files = sorted(Path(__file__).parents[1].glob("configs/centralized/*.yaml"))
    assert len(files) >= 8
    for f in files:
        cfg = load(f)
        cfg.validate()
        build_dataclass(ALGORITHMS.get(cfg.algorithm.name).Hparams, cfg.algorithm.options, "algorithm")


@pytest.mark.parametrize("wd_at", ["lookahead", "iterate"])
def test_mim_rule_closed_form(wd_at):
    w, ma, mb = torch.tensor([1.0, -1.0]), torch.tensor([0.2, 0.1]), torch.tensor([0.5, -0.5])
    rule = MIMRule(ma, mb, A=0.1, lr=0.05, weight_decay=0.01, wd_at=wd_at)
    y2 = w - mb
    l2 = 0.01 * (y2 if wd_at == "lookahead" else w)
    expected = ma / 0.05 + 0.1 * (2 * y2 + l2)  # grad of ||v||^2 at the look-ahead point
    torch.testing.assert_close(rule.direction(w, lambda v: 2 * v, 0), expected)
    # one SGD step of size eta_l from x_k lands on y1 - A eta_l g (P-line 12)
    torch.testing.assert_close(w - 0.05 * expected, (w - ma) - 0.1 * 0.05 * (2 * y2 + l2))


def test_bernoulli_sampling_is_seeded_and_has_the_right_mean_size():
    algo = _algo(_cfg("fedavg", sampling="bernoulli"))
    draws = [algo.sample_clients(r) for r in range(400)]
    assert all(len(d) >= 1 and len(set(d.tolist())) == len(d) for d in draws)
    assert np.mean([len(d) for d in draws]) == pytest.approx(3, abs=0.2)  # p = 3/8 of 8 clients
    assert len({len(d) for d in draws}) > 3  # sizes vary, unlike the fixed-size default
    again = _algo(_cfg("fedavg", sampling="bernoulli"))
    assert all(np.array_equal(a, again.sample_clients(r)) for r, a in enumerate(draws[:20]))
    algo.run_round(0)
    assert algo.ledger.bytes("up", round=0) == len(draws[0]) * D_TOY * 4


def test_a_round_of_clients_without_samples_keeps_the_global_model():
    """A partition may leave clients empty (dirichlet, min_size 0); they take no local step, so a round that
    samples only empty clients keeps x, where the sample weights N_i / sum_j N_j were 0 / 0 and x turned NaN
    for the rest of the run; rounds with data are weighted as before."""
    cfg = _cfg("fedavg", clients_per_round=1)
    cfg["partition"] = {"name": "dirichlet", "num_clients": 20, "alpha": 0.01, "min_size": 0}
    a = _algo(cfg)
    empty = [r for r in range(20) if a.sizes[a.sample_clients(r)].sum() == 0]
    full = [r for r in range(20) if a.sizes[a.sample_clients(r)].sum() > 0]
    e = next(r for r in empty if r > full[0])  # the fixture: a round with data, later one without
    _rounds(a, e)
    before = a.x.clone()
    out = a.run_round(e)
    assert torch.equal(a.x, before) and "train_loss" not in out  # skipped: no client trained
    assert torch.isfinite(_rounds(a, 3, e + 1)).all()


if "_blocks_with_empty" not in PARTITIONERS._items:

    @PARTITIONERS.register("_blocks_with_empty")
    def _blocks_with_empty(labels, num_clients, rng, *, users=None):
        """The least-squares toy's rows in blocks of 20, 60, 0 and 80: 1, 3, 0 and 4 steps of batch 20."""
        return list(np.split(np.arange(len(labels)), [20, 80, 80]))


@pytest.mark.parametrize("alg", ["fedcm", "fedmim"])
def test_the_default_k_counts_only_the_clients_that_hold_data(alg):
    """K normalizes FedCM's Delta_{t+1} = -mean / (eta_l K) and FedMIM's delta = (x_{t-1} - x_t) / K: the
    steps an active client runs. Steps (1, 3, 0, 4): K = round(8 / 3) = 3 over the clients that step (the
    empty client's 0 made it round(8 / 4) = 2), and after round 0 the direction is -(x_1 - x_0) / (eta_l 3),
    resp. (x_0 - x_1) / 3."""
    cfg = _quad_cfg(alg)
    cfg["partition"] = {**cfg["partition"], "name": "_blocks_with_empty"}
    cfg["local"] = {"epochs": 1, "batch_size": 20, "lr": 0.05}
    a = _algo(cfg)
    assert [a.trainer.num_steps(c) for c in range(N_Q)] == [1, 3, 0, 4]
    assert a.K == 3
    a.trainer.loss_fn = _squared
    x0 = a.x.clone()
    a.run_round(0)
    if alg == "fedcm":
        torch.testing.assert_close(a.momentum, -(a.x - x0) / (0.05 * 3))
    else:
        torch.testing.assert_close(a.deltas()[0], (x0 - a.x) / 3)


@pytest.mark.parametrize("local", [{"steps": 3, "batch_size": 20}, {"steps": 3, "full_batch": True}])
def test_a_client_without_samples_takes_no_step(local):
    """Blocks of 20, 60, 0 and 80 rows: the empty client has no batch, so its steps are 0 whatever local.steps
    (or a call's ``steps``) asks, as the trainer reports them (it counted local.steps for it before)."""
    cfg = _quad_cfg("fedavg")
    cfg["partition"] = {**cfg["partition"], "name": "_blocks_with_empty"}
    cfg["local"] = {**local, "lr": 0.05}
    a = _algo(cfg)
    assert [a.trainer.num_steps(c) for c in range(N_Q)] == [3, 3, 0, 3]
    assert [a.trainer.num_steps(c, 5) for c in range(N_Q)] == [5, 5, 0, 5]
    a.trainer.loss_fn = _squared
    got = a.trainer.train(a.x.expand(N_Q, -1), np.arange(N_Q), 0, lr=0.05)
    assert got.steps.tolist() == [a.trainer.num_steps(c) for c in range(N_Q)]


def test_the_clocks_unit_is_the_mean_round_of_a_client_with_data():
    """``faults.work_unit: round`` times a client's steps over the mean client's round: steps (1, 3, 0, 4) make
    it round(8 / 3) = 3 over the clients that step, K as reference_steps counts it (the empty client's 0 made it
    round(8 / 4) = 2, so a client of 3 steps took 1.5 mean rounds)."""
    cfg = _quad_cfg("fedavg")
    cfg["partition"] = {**cfg["partition"], "name": "_blocks_with_empty"}
    cfg["local"] = {"epochs": 1, "batch_size": 20, "lr": 0.05}
    a = _algo(cfg)
    assert a.mean_round_steps == a.reference_steps() == 3
    np.testing.assert_array_equal(a.relative_work(a.client_steps(0, np.arange(N_Q))), [1 / 3, 1.0, 0.0, 4 / 3])


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


@pytest.mark.parametrize("alg", ["fedavgm", "fedadam", "fedcm", "feddyn"])
def test_a_round_of_only_clients_without_samples_is_skipped_as_one_nobody_reports(alg):
    # the aggregate of clients without samples is 0, yet a server step on it moved FedAvgM's and FedAdam's model
    # along their momentum, FedDyn's by -h/alpha, and zeroed FedCM's momentum; now the round leaves every state
    # as it was and sends nothing up, as a round in which no client reports
    cfg = _cfg(alg, clients_per_round=1)
    cfg["partition"] = {"name": "dirichlet", "num_clients": 20, "alpha": 0.01, "min_size": 0}
    a = _algo(cfg)
    empty = [r for r in range(20) if a.sizes[a.sample_clients(r)].sum() == 0]
    full = [r for r in range(20) if a.sizes[a.sample_clients(r)].sum() > 0]
    e = next(r for r in empty if r > full[0])  # after a round with data: the server state is not its initial one
    _rounds(a, e)
    before = copy.deepcopy(a.state_dict())
    assert any(v.abs().sum() > 0 for k, v in before.items() if k not in ("x", "client_state"))
    a.run_round(e)
    assert _same_state(before, a.state_dict())
    assert a.ledger.bytes("up", round=e) == 0
