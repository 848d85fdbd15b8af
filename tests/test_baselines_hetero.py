"""The heterogeneity and fairness baselines of the centralized family: FedNova, FedExP, MOON, FedLC, q-FedAvg
and AFL. Each on a special case whose answer is known (FedAvg, bit for bit where the arithmetic allows), one
step against its paper's closed form, loop and vmap agreeing, and its rules surviving a deployment's trip."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.centralized.afl import lambda_step, project_simplex
from fedweave.algorithms.centralized.fedexp import fedexp_step_size
from fedweave.algorithms.centralized.fedlc import LogitCalibration, calibration
from fedweave.algorithms.centralized.fednova import nova_scale
from fedweave.algorithms.centralized.moon import ModelContrastive, MoonStep
from fedweave.algorithms.centralized.qffl import qffl_client, qffl_step
from fedweave.config import ConfigError, LocalConfig, load
from fedweave.deploy.jobs import decode_job, encode_header, encode_job
from fedweave.errors import DivergenceError
from fedweave.execution import client_spread, evaluate_clients
from fedweave.execution.job import rule_loss_grad
from fedweave.execution.local import LocalCall
from fedweave.experiments.report import build_report
from fedweave.registry import PARTITIONERS
from fedweave.runner import resume
from fedweave.runner import run as run_config
from tests.test_centralized import M_Q, N_Q, _quad_cfg, _quad_data, _squared

CFG = {
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 12, "alpha": 0.3},
    "model": {"name": "mlp", "hidden": 16},
    "rounds": 3,
    "backend": "vmap",
    "local": {"steps": 3, "batch_size": 16, "lr": 0.05},
    "output": {"progress": False, "plots": False},
}
NEW = ("fednova", "fedexp", "moon", "fedlc", "qfedavg", "afl")


def _run(tmp_path, name: str, backend: str = "vmap", local: dict | None = None, **opts):
    cfg = {**CFG, "backend": backend, "algorithm": {"name": name, "clients_per_round": 4, **opts}}
    if local is not None:
        cfg["local"] = local
    tag = "-".join([name, backend, *(f"{k}{v}" for k, v in opts.items())])
    return fedweave.run(cfg, run_dir=tmp_path / tag)


def _losses(res) -> list[float]:
    return [r["test_loss"] for r in res.metrics]


def _same_as_fedavg(special, fedavg) -> None:
    assert _losses(special) == _losses(fedavg)
    assert torch.equal(special.algorithm.x, fedavg.algorithm.x)


# ---- every new method ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NEW)
def test_loop_and_vmap_agree(name, tmp_path):
    """One epoch each: the clients of the Dirichlet split take unequal numbers of steps (FedNova's case)."""
    epoch = {"epochs": 1, "batch_size": 16, "lr": 0.05}
    loop, vmap = _run(tmp_path, name, "loop", local=epoch), _run(tmp_path, name, "vmap", local=epoch)
    torch.testing.assert_close(loop.algorithm.x, vmap.algorithm.x, rtol=1e-5, atol=1e-6)
    assert _losses(loop) != _losses(_run(tmp_path, "fedavg", "loop", local=epoch))  # each changes the numbers


@pytest.mark.parametrize("name", ["moon", "afl", "fednova"])
def test_resume_continues_identically(name, tmp_path):
    """MOON's clients keep their previous models, AFL's server its lambda: both are in the checkpoint."""
    cfg = {**CFG, "rounds": 4, "algorithm": {"name": name, "clients_per_round": 4}}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert _losses(resumed) == _losses(full)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)


# ---- FedNova ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_fednova_with_equal_local_steps_is_fedavg_bit_for_bit(backend, tmp_path):
    """local.steps gives every client the same tau: each coefficient tau_eff / tau_i is exactly 1.0 (computed
    in float64 as sum_j p_j tau_j / (tau_i sum_j p_j), whose products and sums are exact), so the update is
    FedAvg's own weighted mean, bit for bit."""
    _same_as_fedavg(_run(tmp_path, "fednova", backend), _run(tmp_path, "fedavg", backend))


def test_nova_scale_is_tau_eff_over_tau_i():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    steps = torch.tensor([1, 2, 4, 8])
    tau_eff = 0.1 * 1 + 0.2 * 2 + 0.3 * 4 + 0.4 * 8
    torch.testing.assert_close(nova_scale(p, steps), torch.tensor([tau_eff / t for t in (1, 2, 4, 8)]))
    assert torch.equal(nova_scale(torch.full((7,), 1 / 7), torch.full((7,), 13)), torch.ones(7))


if "_blocks_uneven" not in PARTITIONERS._items:

    @PARTITIONERS.register("_blocks_uneven")
    def _blocks_uneven(labels, num_clients, rng, *, users=None):
        """The least-squares toy's rows in blocks of 20, 40, 60 and 40: 1, 2, 3 and 2 steps of batch 20."""
        return list(np.split(np.arange(len(labels)), [20, 60, 120]))


def _fednova_round_by_hand(partition: str, lr: float = 0.05) -> tuple[Any, torch.Tensor, list, list[int]]:
    """One FedNova round on the least-squares toy under ``partition`` (epochs of batch 20), and each client's
    round-0 displacement by local gradient steps on 0.5 (a^T w - y)^2 by hand, in float64 from the trainer's
    batch plan, with its number of steps: (algorithm after the round, x0, displacements, steps)."""
    cfg = _quad_cfg("fednova")
    cfg["partition"] = {**cfg["partition"], "name": partition}
    cfg["local"] = {"epochs": 1, "batch_size": 20, "lr": lr}
    algo = build_algorithm(RunContext(load(cfg)))
    algo.trainer.loss_fn = _squared
    x0 = algo.x.double().clone()
    algo.run_round(0)
    ds = _quad_data()
    a_all, y_all = ds.train_x.double(), ds.train_y.double()
    deltas, taus = [], []
    for c in range(N_Q):
        w = x0.clone()
        batches = algo.trainer.client_batches(c, 0, (), None)
        for b in batches:
            a, y = a_all[b], y_all[b]
            w = w - lr * a.T @ (a @ w - y) / len(b)
        deltas.append(w - x0)
        taus.append(len(batches))
    return algo, x0, deltas, taus


def test_fednova_one_round_on_least_squares_with_unequal_steps_is_the_closed_form():
    """One round of local gradient steps on 0.5 (a^T w - y)^2, by hand in float64 from the trainer's batch plan:
    x+ = x + sum_i p_i (tau_eff / tau_i) Delta_i with tau = (1, 2, 3, 2), p uniform, tau_eff = 2."""
    algo, x0, deltas, taus = _fednova_round_by_hand("_blocks_uneven")
    assert taus == [1, 2, 3, 2] and len(_quad_data().train_y) == 4 * M_Q
    tau_eff = sum(taus) / N_Q
    want = x0 + sum((tau_eff / t) * d for t, d in zip(taus, deltas)) / N_Q
    torch.testing.assert_close(algo.x.double(), want, rtol=1e-5, atol=1e-6)
    fedavg = x0 + sum(deltas) / N_Q
    assert float((want - fedavg).norm()) > 1e-3 * float(want.norm())  # unequal steps: not FedAvg's answer


if "_blocks_one_empty" not in PARTITIONERS._items:

    @PARTITIONERS.register("_blocks_one_empty")
    def _blocks_one_empty(labels, num_clients, rng, *, users=None):
        """The least-squares toy's rows in blocks of 20, 60, 0 and 80: 1, 3, 0 and 4 steps of batch 20."""
        return list(np.split(np.arange(len(labels)), [20, 80, 80]))


def test_nova_scale_counts_an_empty_client_as_no_step_and_no_direction():
    # uniform p = 1/4, tau = (2, 4, 0, 0): tau_eff = (2 + 4) / 4 = 1.5; the clients that stepped share the
    # direction's weight 1/2, so the coefficients are 1.5 / (tau_i / 2) = (1.5, 0.75) and 0 for the empty ones
    p = torch.full((4,), 0.25)
    torch.testing.assert_close(nova_scale(p, torch.tensor([2, 4, 0, 0])), torch.tensor([1.5, 0.75, 0.0, 0.0]))
    # equal steps among the clients that stepped: coefficient 1, FedAvg's uniform mean (empty clients' Delta = 0)
    assert torch.equal(nova_scale(p, torch.tensor([3, 3, 0, 0])), torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_fednova_round_with_an_empty_client_under_uniform_weights_is_the_closed_form():
    """tau = (1, 3, 0, 4), p = 1/4: the empty client adds 0 to tau_eff = 8 / 4 = 2 (it counted as one step,
    tau_eff 9 / 4) and has no normalized update, so x+ = x + sum_{i: tau_i > 0} (1/3) (2 / tau_i) Delta_i."""
    algo, x0, deltas, taus = _fednova_round_by_hand("_blocks_one_empty")
    want = x0 + sum((2 / t) * d / 3 for t, d in zip(taus, deltas) if t)
    assert taus == [1, 3, 0, 4]
    torch.testing.assert_close(algo.x.double(), want, rtol=1e-5, atol=1e-6)


def test_fednova_refuses_local_momentum(tmp_path):
    with pytest.raises(ConfigError, match="algorithm fednova .* local.momentum must be 0"):
        _run(tmp_path, "fednova", local={**CFG["local"], "momentum": 0.9})


# ---- FedExP -----------------------------------------------------------------------------------------------
def test_fedexp_without_extrapolation_is_fedavg_bit_for_bit(tmp_path):
    off = _run(tmp_path, "fedexp", extrapolate=False)
    _same_as_fedavg(off, _run(tmp_path, "fedavg", weighting="uniform"))
    on = _run(tmp_path, "fedexp")
    assert _losses(on) != _losses(off) and all(r["server_step_size"] >= 1 for r in on.metrics)


def test_fedexp_step_size_is_the_closed_form():
    # Delta_1 = (3, 0), Delta_2 = (-1, 2), Delta_3 = (1, 1): sum ||Delta_i||^2 = 9 + 5 + 2 = 16,
    # Delta = (1, 1), ||Delta||^2 = 2: eta_g = 16 / (2 * 3 * (2 + 0.5)) = 16 / 15
    updates = torch.tensor([[3.0, 0.0], [-1.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    assert fedexp_step_size(updates, updates.mean(0), eps=0.5) == pytest.approx(16 / 15, rel=1e-15)
    # agreeing clients: the ratio is below one and the step is FedAvg's
    same = torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=torch.float64)
    assert fedexp_step_size(same, same.mean(0), eps=1e-3) == 1.0


def test_one_fedexp_server_step_is_the_closed_form():
    """x_1 = x_0 + eta_g mean_i Delta_i with eta_g from the round's own updates (uniform weights), through the
    template's steps: the round's clients train, their updates are reduced, the server steps."""
    cfg = {**CFG, "rounds": 1, "algorithm": {"name": "fedexp", "clients_per_round": 4}}
    algo = build_algorithm(RunContext(load(cfg)))
    x0 = algo.x.clone()
    got = algo.train_clients(0, algo.sample_clients(0))
    algo.server_update(algo.aggregate(algo.client_updates(got), got.weights), got)
    d = (got.local.params - x0).double()
    eta = max(1.0, float((d**2).sum() / (2 * 4 * ((d.mean(0) ** 2).sum() + 1e-3))))
    assert eta > 1 and algo.last_step_size == pytest.approx(eta, rel=1e-5)  # the example extrapolates
    torch.testing.assert_close(algo.x.double(), x0.double() + eta * d.mean(0), rtol=1e-5, atol=1e-7)


def test_fedexp_weighted_step_size_is_the_closed_form():
    # p = (1/2, 1/4, 1/4), Delta_1 = (4, 0), Delta_2 = (-2, 0), Delta_3 = (0, 2): sum_i p_i ||Delta_i||^2 =
    # 8 + 1 + 1 = 10, Delta = (3/2, 1/2), ||Delta||^2 = 5/2: eta_g = 10 / (2 (5/2 + 1/2)) = 5/3 (the plain count
    # M = 3 beside the weighted mean gave 24 / (2 * 3 * 3) = 4/3)
    updates = torch.tensor([[4.0, 0.0], [-2.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert fedexp_step_size(updates, p @ updates, eps=0.5, weights=p) == pytest.approx(5 / 3, rel=1e-15)
    # equal weights: the paper's formula (16 / 15 on the rows of the closed-form test above)
    rows = torch.tensor([[3.0, 0.0], [-1.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    equal = torch.full((3,), 1 / 3, dtype=torch.float64)
    assert fedexp_step_size(rows, rows.mean(0), eps=0.5, weights=equal) == pytest.approx(16 / 15, rel=1e-15)


def test_one_fedexp_server_step_under_sample_weights_is_the_weighted_closed_form():
    """weighting: samples: Delta = sum_i p_i Delta_i with p_i = n_i / sum_j n_j, and eta_g its weighted form
    sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps)), the clients' sizes unequal on the Dirichlet split."""
    cfg = {**CFG, "rounds": 1, "algorithm": {"name": "fedexp", "clients_per_round": 4, "weighting": "samples"}}
    algo = build_algorithm(RunContext(load(cfg)))
    x0 = algo.x.clone()
    got = algo.train_clients(0, algo.sample_clients(0))
    algo.server_update(algo.aggregate(algo.client_updates(got), got.weights), got)
    d = (got.local.params - x0).double()
    n = algo.sizes[got.clients].double()
    p = n / n.sum()
    assert len(set(n.tolist())) > 1  # unequal sizes: the weights are not 1/M
    mean = p @ d
    eta = max(1.0, float(p @ (d**2).sum(1) / (2 * ((mean**2).sum() + 1e-3))))
    plain = max(1.0, float((d**2).sum() / (2 * 4 * ((mean**2).sum() + 1e-3))))
    assert eta > 1 and abs(eta - plain) > 1e-3 * eta  # the example extrapolates, and not as the count M did
    assert algo.last_step_size == pytest.approx(eta, rel=1e-5)
    torch.testing.assert_close(algo.x.double(), x0.double() + eta * mean, rtol=1e-5, atol=1e-7)


def test_fedexp_steps_by_the_updates_the_server_received_under_an_attack():
    """eta_g is the server's: computed from the rows it received (a Gaussian attacker's noise in place of its
    update), the same rows its aggregate reduces, not from the updates the attackers computed and never sent."""
    attack = {"byzantine": {"fraction": 0.5, "attack": "gaussian", "std": 1.0}}
    cfg = {**CFG, "rounds": 1, "algorithm": {"name": "fedexp", "clients_per_round": 4}, "faults": attack}
    algo = build_algorithm(RunContext(load(cfg)))
    reduced, plain = [], algo.aggregate

    def aggregate(updates, weights, clients=None):
        reduced.append((updates, plain(updates, weights, clients)))
        return reduced[-1][1]

    algo.aggregate = aggregate
    out = algo.run_round(0)
    assert out["byzantine_clients"] > 0
    rows, mean = reduced[0]
    assert algo.last_step_size == fedexp_step_size(rows, mean, algo.hp.eps) > 1
    assert out["server_step_size"] == algo.last_step_size


# ---- MOON -------------------------------------------------------------------------------------------------
def test_moon_with_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    """With mu = 0 the term is exact zeros; on the vmap backend the task's gradient comes from FedAvg's kernels."""
    _same_as_fedavg(_run(tmp_path, "moon", mu=0.0), _run(tmp_path, "fedavg"))


def test_moon_on_a_model_without_a_hidden_layer_is_fedavg(tmp_path):
    """logistic's representation is its input, which no parameter moves: l_con has no gradient (docs)."""
    cfg = {**CFG, "model": {"name": "logistic"}}
    moon = fedweave.run(
        {**cfg, "algorithm": {"name": "moon", "clients_per_round": 4, "mu": 5.0}}, run_dir=tmp_path / "m"
    )
    fedavg = fedweave.run({**cfg, "algorithm": {"name": "fedavg", "clients_per_round": 4}}, run_dir=tmp_path / "f")
    _same_as_fedavg(moon, fedavg)


def test_moon_clients_keep_their_last_local_model(tmp_path):
    res = _run(tmp_path, "moon")
    prev = res.algorithm.store["prev"]
    took_part = (prev != 0).any(1)
    assert 0 < int(took_part.sum()) < CFG["partition"]["num_clients"]  # those who trained, not the others
    assert not torch.equal(prev[took_part][0], res.algorithm.x)


def test_moon_term_is_eq_3():
    """-log(e^{s(z, z_glob)/tau} / (e^{s(z, z_glob)/tau} + e^{s(z, z_prev)/tau})) by hand, on a representation
    z = x * v of the parameters v."""

    class Identity:
        @staticmethod
        def features(v, x):
            return x * v  # a representation that depends on the parameters

    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    w, glob, prev = (torch.tensor(v, dtype=torch.float64) for v in ([1.0, 1.0], [1.0, 1.0], [1.0, -1.0]))
    got = ModelContrastive(2.0, 0.5, glob, prev).extra_loss(w, x, None, 0, Identity)
    # sample 0: z = (1, 0), z_prev = (1, 0): pos = neg = 2; sample 1: z = (0, 2), z_prev = (0, -2): neg = -2
    want = [2.0 * (math.log(math.exp(2) + math.exp(2)) - 2), 2.0 * (math.log(math.exp(2) + math.exp(-2)) - 2)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


def test_moon_before_a_client_first_trains_the_global_model_stands_in():
    glob = torch.tensor([1.0, 2.0])
    rule = MoonStep(1.0, 0.5, glob).rule({"prev": torch.tensor([[0.0, 0.0], [3.0, 4.0]])})
    assert torch.equal(rule.prev, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


# ---- FedLC ------------------------------------------------------------------------------------------------
def test_fedlc_without_calibration_is_fedavg(tmp_path):
    """tau = 0: the rule's loss is the task's cross-entropy and its gradient the task loss's through autograd,
    bit for bit; a run is FedAvg's to float32 rounding (FedAvg's MLP steps on vmap take the closed-form
    gradient, which rounds otherwise)."""
    special, fedavg = _run(tmp_path, "fedlc", tau=0.0), _run(tmp_path, "fedavg")
    torch.testing.assert_close(special.algorithm.x, fedavg.algorithm.x, rtol=0, atol=1e-7)
    np.testing.assert_allclose(_losses(special), _losses(fedavg), rtol=1e-6)
    algo = special.algorithm
    x, y = algo.ctx.dataset.train_x[:32], algo.ctx.dataset.train_y[:32]
    rule = LogitCalibration(calibration(torch.ones(1, 10), 0.0, 1e-8), 0.0, 1e-8)
    task = lambda v: F.cross_entropy(algo.layout.functional(v, x), y, reduction="none").mean()  # noqa: E731
    assert torch.equal(
        rule.loss(algo.x, x, y, 0, algo.layout), F.cross_entropy(algo.layout.functional(algo.x, x), y, reduction="none")
    )
    g, value = rule_loss_grad(rule, algo.layout, algo.x, x, y, None, 0, "loss")
    assert torch.equal(g, torch.func.grad(task)(algo.x)) and torch.equal(value, task(algo.x))


def test_fedlc_loss_is_the_calibrated_cross_entropy(tmp_path):
    """The margins are tau n_{i,y}^{-1/4} of each client's own label counts, and the rule's loss is
    -log(exp(f_y - m_y) / sum_j exp(f_j - m_j)) by hand."""
    cfg = {**CFG, "rounds": 1, "algorithm": {"name": "fedlc", "clients_per_round": 4, "tau": 0.7}}
    algo = build_algorithm(RunContext(load(cfg)))
    ds, part = algo.ctx.dataset, algo.ctx.partition
    c = 3
    counts = np.bincount(ds.train_y.numpy()[part[c]], minlength=ds.num_classes)
    assert (counts == 0).any() and (counts > 0).any()  # label skew: some classes absent
    want_margins = [0.7 * max(n, 1e-8) ** -0.25 for n in counts.tolist()]
    torch.testing.assert_close(algo.margins[c].double(), torch.tensor(want_margins, dtype=torch.float64))

    rule = LogitCalibration(algo.margins[[c, c + 1]], algo.hp.tau, algo.hp.absent_count)
    own = rule.at_client(ds.train_y[torch.as_tensor(part[c])], ds.num_classes)  # as client c's node derives them
    torch.testing.assert_close(own.margins[0].to(algo.margins.dtype), algo.margins[c], rtol=0, atol=0)
    idx = torch.as_tensor(part[c][:5])
    x, y = ds.train_x[idx], ds.train_y[idx]
    w = algo.x + 0.1 * torch.randn(algo.x.shape, generator=torch.Generator().manual_seed(0))
    logits = algo.layout.functional(w, x)
    total = rule.loss(w, x, y, 0, algo.layout)
    f = logits.double().tolist()
    want = []
    for row, label in zip(f, y.tolist()):
        cal = [fj - mj for fj, mj in zip(row, want_margins)]
        want.append(-math.log(math.exp(cal[label]) / sum(math.exp(v) for v in cal)))
    torch.testing.assert_close(total.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_fedlc_with_sign_compression_trains_the_same_on_loop_and_vmap(tmp_path):
    """A class a client does not hold has a true gradient of about exp(-100 tau) times the input. Written as
    CE + (L_cal - CE), it was the rounding residue of two cancelling gradients, of a sign that depends on the
    backend, and efsign sent that sign at full size: loop and vmap differed by 1.1e-3 in test loss after 4
    rounds of 10 local steps (FedAvg with efsign by about 1e-8). The rule's own loss (LocalRule.loss) is L_cal
    alone."""
    runs = []
    for backend in ("loop", "vmap"):
        cfg = {**CFG, "rounds": 4, "backend": backend, "compression": {"upload": "efsign"}}
        cfg["local"] = {**CFG["local"], "steps": 10}
        cfg["algorithm"] = {"name": "fedlc", "clients_per_round": 4, "tau": 1.0}
        runs.append(fedweave.run(cfg, run_dir=tmp_path / backend))
    a, b = (np.array(_losses(r)) for r in runs)
    assert np.abs(a - b).max() < 1e-6, (a, b)


def test_fedlc_refuses_a_task_without_logits(tmp_path):
    cfg = {**CFG, "task": {"loss": "mse"}, "algorithm": {"name": "fedlc"}}
    cfg["dataset"] = {"name": "diabetes"}
    cfg["partition"] = {"name": "iid", "num_clients": 4}
    with pytest.raises(ConfigError, match="algorithm fedlc calibrates the logits .* got task.loss 'mse'"):
        fedweave.run(cfg, run_dir=tmp_path / "r")


# ---- q-FFL / q-FedAvg -------------------------------------------------------------------------------------
def test_qfedavg_with_q_zero_is_uniform_fedavg_up_to_rounding(tmp_path):
    """q = 0: w - sum_k L (w - wbar_k) / (m L), the plain mean of the local models; the products with L and
    1 / L round differently from FedAvg's weighted mean, so the two agree to float32 rounding, not bit for bit."""
    q0 = _run(tmp_path, "qfedavg", q=0.0)
    fedavg = _run(tmp_path, "fedavg", weighting="uniform")
    torch.testing.assert_close(q0.algorithm.x, fedavg.algorithm.x, rtol=1e-5, atol=1e-6)
    assert _losses(_run(tmp_path, "qfedavg", q=2.0)) != _losses(q0)


@pytest.mark.parametrize("q", [1.0, 2.0])
def test_one_qfedavg_step_is_the_closed_form(q):
    # Delta w_k = L (x - wbar_k): (5, 0) and (0, -10); F = (2, 0.5); Delta_k = F^q Delta w_k;
    # h_k = q F^{q-1} ||Delta w_k||^2 + L F^q; x+ = x - sum Delta_k / sum h_k
    x = torch.tensor([1.0, -1.0], dtype=torch.float64)
    local = torch.tensor([[0.5, -1.0], [1.0, 0.0]], dtype=torch.float64)
    loss = torch.tensor([2.0, 0.5], dtype=torch.float64)
    delta, h = qffl_client(x, local, loss, q, 10.0)
    d1, d2 = [2.0**q * 5, 0.0], [0.0, 0.5**q * -10]
    h1, h2 = q * 2.0 ** (q - 1) * 25 + 10 * 2.0**q, q * 0.5 ** (q - 1) * 100 + 10 * 0.5**q
    torch.testing.assert_close(h, torch.tensor([h1, h2], dtype=torch.float64), rtol=1e-15, atol=0)
    want = torch.tensor([1.0 - (d1[0] + d2[0]) / (h1 + h2), -1.0 - (d1[1] + d2[1]) / (h1 + h2)], dtype=torch.float64)
    torch.testing.assert_close(qffl_step(x, delta, h), want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("moved", [0.0, 1e-9])
def test_a_qfedavg_client_at_zero_loss_neither_freezes_nor_breaks_the_step(moved):
    """A client whose loss underflows to 0 (a confident classifier: float32 cross-entropy is exactly 0 past a
    margin of about 17) with q < 1: F^{q-1} is infinite there. As the authors' code (F + 1e-10), it adds
    next to nothing to sum h_k, so the step is the other clients', not NaN (Delta w_k = 0) or no step at all."""
    x = torch.tensor([1.0, -1.0], dtype=torch.float64)
    local = torch.tensor([[1.0 - moved, -1.0], [0.5, 0.0]], dtype=torch.float64)
    delta, h = qffl_client(x, local, torch.tensor([0.0, 1.0], dtype=torch.float64), 0.5, 10.0)
    alone = qffl_step(x, *qffl_client(x, local[1:], torch.tensor([1.0], dtype=torch.float64), 0.5, 10.0))
    assert torch.isfinite(h).all()
    torch.testing.assert_close(qffl_step(x, delta, h), alone, rtol=1e-5, atol=0)


@pytest.mark.parametrize("q", [1.0, 2.0])
def test_a_qfedavg_round_whose_clients_are_all_at_zero_loss_and_unmoved_stays_put(q):
    """q >= 1 and every F_k = 0 with Delta w_k = 0: sum h_k was 0 and the step 0/0 = NaN; it is no step."""
    x = torch.tensor([1.0, -1.0], dtype=torch.float64)
    delta, h = qffl_client(x, x.repeat(2, 1), torch.zeros(2, dtype=torch.float64), q, 10.0)
    assert torch.equal(qffl_step(x, delta, h), x)


def test_qfedavg_refuses_a_server_step_size(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.server_lr: q-FedAvg's server step"):
        _run(tmp_path, "qfedavg", server_lr=0.5)


@pytest.mark.parametrize("name", ["qfedavg", "afl"])
def test_a_client_without_samples_has_loss_zero_under_a_regression_task(name, tmp_path):
    """q-FFL's F_k and AFL's L_k of a client without a training sample are 0 under any task, as under cross-entropy:
    a regression's evaluation of no sample stopped the round with a TypeError (its metric sums were None). One round
    of every client by hand in float64: q-FFL floors F_k = 0 at 1e-10; AFL's lambda_0 (n_k / n) of the empty client is
    0 and its g_k = 0, so lambda's step and w's are the other clients'."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 3, generator=g, dtype=torch.float64)
    y = a @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(
        12, generator=g, dtype=torch.float64
    )
    parts = [range(0, 4), range(0), range(4, 9), range(9, 12)]  # client 1 holds no sample
    (tmp_path / "parts.json").write_text(json.dumps([list(p) for p in parts]))

    cfg = {
        "rounds": 1,
        "precision": "float64",
        "partition": {"name": "from_file", "num_clients": 4, "path": str(tmp_path / "parts.json")},
        "algorithm": {"name": name, "clients_per_round": 4, **({"q": 2.0} if name == "qfedavg" else {})},
        "task": {"loss": "mse", "loss_options": {"half": True}},
        "local": {"steps": 3, "full_batch": True, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run(cfg, model=_zero_linear, dataset=(a, y, a[:2], y[:2]), run_dir=tmp_path / name)

    w0 = torch.zeros(3, dtype=torch.float64)
    local, loss = [], []
    for p in parts:
        ap, yp, w = a[list(p)], y[list(p)], w0.clone()
        for _ in range(3 if len(p) else 0):  # full-batch gradient steps on 0.5 mean (a w - y)^2
            w = w - 0.05 * ap.T @ (ap @ w - yp) / len(p)
        local.append(w)
        loss.append(float(0.5 * (ap @ w0 - yp).pow(2).mean()) if len(p) else 0.0)
    if name == "qfedavg":
        dw = [(w0 - w) / 0.05 for w in local]  # L (x - wbar_k), L = 1 / lr
        f = [max(v, 1e-10) for v in loss]
        h = sum(2.0 * fk * float(d @ d) + fk**2 / 0.05 for fk, d in zip(f, dw))
        want = w0 - sum(fk**2 * d for fk, d in zip(f, dw)) / h
    else:
        lam = torch.tensor([len(p) / 12 for p in parts], dtype=torch.float64)  # lambda_0 = n_k / n
        want = w0 + sum(lk * (w - w0) for lk, w in zip(lam, local))
        torch.testing.assert_close(
            res.algorithm.lam, project_simplex(lam + 0.01 * torch.tensor(loss, dtype=torch.float64)), rtol=1e-12, atol=0
        )
        assert float(res.algorithm.lam[1]) == 0.0
    torch.testing.assert_close(res.algorithm.x, want, rtol=1e-12, atol=1e-15)


def _zero_linear() -> torch.nn.Module:
    model = torch.nn.Linear(3, 1, bias=False)  # starts at w = 0
    torch.nn.init.zeros_(model.weight)
    return model


# ---- AFL --------------------------------------------------------------------------------------------------
def test_simplex_projection_by_hand():
    # v = (0.5, 0.3, 0.6): every entry stays; theta = (1.4 - 1) / 3
    got = project_simplex(torch.tensor([0.5, 0.3, 0.6], dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor([0.5, 0.3, 0.6], dtype=torch.float64) - 0.4 / 3)
    # v = (1, 0.2, -0.5): the last is cut to 0; theta = (1.2 - 1) / 2 = 0.1
    got = project_simplex(torch.tensor([1.0, 0.2, -0.5], dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor([0.9, 0.1, 0.0], dtype=torch.float64))
    # a point of the simplex is its own projection
    p = torch.tensor([0.2, 0.0, 0.8], dtype=torch.float64)
    torch.testing.assert_close(project_simplex(p), p)


def test_afl_stops_with_the_divergence_error_when_a_loss_is_not_finite(tmp_path):
    """A diverged model's losses (inf, NaN) have no projection onto the simplex: lambda becomes NaN and the run
    stops with the divergence error naming lambda_lr, not a RuntimeError from inside the projection."""
    for bad in (float("inf"), float("nan")):
        assert torch.isnan(project_simplex(torch.tensor([0.5, bad, 0.2], dtype=torch.float64))).all()
    cfg = {**CFG, "rounds": 4, "eval": {"every": 5}, "local": {"steps": 3, "batch_size": 16, "lr": 1e8}}
    with pytest.raises(DivergenceError, match="algorithm.lambda_lr"):
        fedweave.run({**cfg, "algorithm": {"name": "afl", "clients_per_round": 4}}, run_dir=tmp_path / "afl")


def test_one_lambda_step_by_hand():
    # lambda = 1/4 each; clients 1 and 3 report losses 2 and 0.5; N/|S| = 2, gamma = 0.1:
    # lambda + gamma g = (0.25, 0.65, 0.25, 0.35), sum 1.5; theta = (1.5 - 1) / 4 = 0.125
    lam = torch.full((4,), 0.25, dtype=torch.float64)
    got = lambda_step(lam, np.array([1, 3]), torch.tensor([2.0, 0.5], dtype=torch.float64), 0.1)
    torch.testing.assert_close(got, torch.tensor([0.125, 0.525, 0.125, 0.225], dtype=torch.float64))


def test_afl_lambda_stays_on_the_simplex_and_moves_to_the_worst_clients(tmp_path):
    res = _run(tmp_path, "afl", lambda_lr=0.05)
    lam = res.algorithm.lam.double()
    assert float(lam.min()) >= 0 and float(lam.sum()) == pytest.approx(1.0, abs=1e-6)
    start = res.algorithm.sizes.double() / res.algorithm.sizes.double().sum()
    assert not torch.allclose(lam, start)


def test_afl_with_a_frozen_mixture_is_fedavg_up_to_rounding(tmp_path):
    """lambda_lr = 0 keeps lambda at n_k / n, whose renormalization over the round's clients is FedAvg's
    weights computed in another order (lambda_S / sum lambda_S versus n_S / sum n_S)."""
    frozen = _run(tmp_path, "afl", lambda_lr=0.0)
    torch.testing.assert_close(frozen.algorithm.x, _run(tmp_path, "fedavg").algorithm.x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregator", ["geometric_median", "median", {"name": "centered_clipping", "tau": 0.5}])
def test_afl_leaves_w_where_it_was_when_the_rounds_clients_have_no_weight_under_any_aggregator(toy_config, aggregator):
    """A round whose clients all have lambda_k = 0 leaves w unchanged (AFL's rule, the mean's zero step), whatever
    the aggregator: before, the geometric median divided by the zero weights (NaN), the median stepped."""
    cfg = {**toy_config, "rounds": 10, "algorithm": {"name": "afl", "clients_per_round": 4, "lambda_lr": 1.0}}
    algo = build_algorithm(RunContext(load({**cfg, "aggregator": aggregator})))
    idle = 0
    for r in range(10):
        x = algo.x.clone()
        nobody = float(algo.weights(algo.sample_clients(r)).sum()) == 0
        algo.run_round(r)
        assert torch.isfinite(algo.x).all()
        if nobody:
            idle += 1
            assert torch.equal(algo.x, x)
    assert idle > 0


def test_afls_train_loss_is_the_plain_mean_in_a_round_whose_clients_have_no_weight(toy_config):
    """train_loss is the lambda-weighted mean of the round's losses; where every lambda_k of the round is 0 that
    weighting is undefined, and the row gives the clients' plain mean (before: 0.0, as if they had no loss)."""
    cfg = {**toy_config, "rounds": 10, "algorithm": {"name": "afl", "clients_per_round": 4, "lambda_lr": 1.0}}
    algo = build_algorithm(RunContext(load(cfg)))
    losses, train = [], algo.trainer.train

    def spy(*args, **kw):  # the round's local losses, as the clients report them
        out = train(*args, **kw)
        losses.append(out.loss)
        return out

    algo.trainer.train = spy
    idle = 0
    for r in range(10):
        nobody = float(algo.weights(algo.sample_clients(r)).sum()) == 0
        row = algo.run_round(r)
        if nobody:
            idle += 1
            assert row["train_loss"] == pytest.approx(float(losses[-1].mean()), rel=1e-6) and row["train_loss"] > 0
    assert idle > 0


# ---- the rules travel to a deployment's nodes by name ------------------------------------------------------
def _trip(rule, k: int, jobs: int = 3, step=None):
    start = torch.zeros(5)
    call = LocalCall(start.expand(jobs, -1), [7] * jobs, 2, rule, 0.05, 3, (1,))
    header, tensors = encode_job(call, k, local=LocalConfig(steps=3), step=step, state_round=0 if step else None)
    return decode_job(encode_header(header), tensors)


class _Model:
    @staticmethod
    def features(v, x):
        return x * v

    @staticmethod
    def functional(v, x):
        return x * v


def test_moon_and_fedlc_rules_and_moons_step_travel_by_name():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 5, generator=g), torch.tensor([0, 1, 2, 3])
    w = torch.randn(5, generator=g)
    labels = [torch.tensor([0, 0, 1, 4]), torch.tensor([2, 3, 3, 3]), torch.tensor([1, 1, 1, 0])]  # each job's client's
    margins = torch.cat([calibration(torch.bincount(t, minlength=5)[None], 0.7, 1e-8) for t in labels]).float()
    rules = [
        ModelContrastive(1.5, 0.5, torch.randn(5, generator=g), torch.randn(3, 5, generator=g)),
        LogitCalibration(margins, 0.7, 1e-8),
    ]
    for rule in rules:
        for k in range(3):
            job = _trip(rule, k)
            assert type(job.call.rule) is type(rule)
            node = job.call.rule
            if isinstance(rule, LogitCalibration):  # a client's margins are its own: not sent, derived on its node
                assert "margins" not in vars(node) and (node.tau, node.absent_count) == (0.7, 1e-8)
                node = node.at_client(labels[k], 5)
            torch.testing.assert_close(node.extra_loss(w, x, y, 0, _Model), rule.extra_loss(w, x, y, k, _Model))
    step = MoonStep(1.0, 0.5, torch.randn(5, generator=g))
    job = _trip(rules[0], 0, step=step)
    assert type(job.step) is MoonStep and (job.step.mu, job.step.tau) == (1.0, 0.5)
    assert torch.equal(job.step.glob, step.glob)


# ---- per-client metric distributions (eval.distribution) ----------------------------------------------
def test_client_spread_by_hand():
    v = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.6, 0.4, 1.0, 0.05]  # 11 clients: the worst 10 % is 2 of them
    mean = sum(v) / 11
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / 11)
    got = client_spread(np.array(v))
    assert got == pytest.approx({"mean": mean, "worst10": (0.05 + 0.1) / 2, "std": std}, rel=1e-12)
    assert client_spread(np.array(v), "min")["worst10"] == pytest.approx((1.0 + 0.9) / 2)  # a loss: the highest
    assert client_spread(np.array([0.3, 0.7]))["worst10"] == 0.3  # at least one client


DIST = {**CFG, "backend": "loop", "rounds": 3, "algorithm": {"name": "fedavg", "clients_per_round": 4}}


def _dist_cfg(**eval_opts) -> dict:
    return {**DIST, "eval": {"distribution": True, **eval_opts}, "output": {**DIST["output"], "checkpoint_every": 1}}


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]


def test_distribution_records_each_clients_test_accuracy_and_its_spread(tmp_path):
    res = fedweave.run(_dist_cfg(), run_dir=tmp_path / "d")
    records = _records(tmp_path / "d")
    assert [e["round"] for e in records] == [1, 2, 3] and records[-1]["metric"] == "accuracy"
    # the last record is the global model on each client's own test set, by hand
    algo, ds = res.algorithm, res.algorithm.ctx.dataset
    accs, losses = evaluate_clients(algo.layout, algo.x, ds.test_x, ds.test_y, algo.ctx.personal_test_parts())
    assert records[-1]["accuracy"] == accs.tolist() and records[-1]["loss"] == losses.tolist()
    assert records[-1]["clients"] == list(range(12))
    for e, row in zip(records, res.metrics):
        spread = client_spread(np.array(e["accuracy"]))
        assert {k: row[f"client_test_accuracy_{k}"] for k in spread} == spread
    assert 0 < row["client_test_accuracy_worst10"] < row["client_test_accuracy_mean"]
    # with personal_test the same per-client evaluation gives test_accuracy (their mean): computed once
    both = fedweave.run(_dist_cfg(personal_test=True), run_dir=tmp_path / "p")
    assert [r["test_accuracy"] for r in both.metrics] == [r["client_test_accuracy_mean"] for r in both.metrics]


def test_distribution_changes_no_other_number(tmp_path):
    off = fedweave.run({**DIST, "output": {**DIST["output"], "checkpoint_every": 1}}, run_dir=tmp_path / "off")
    on = fedweave.run(_dist_cfg(), run_dir=tmp_path / "on")
    assert not (tmp_path / "off" / "clients.jsonl").exists()
    for a, b in zip(off.metrics, on.metrics):
        assert {k: v for k, v in b.items() if not k.startswith("client_test") and "seconds" not in k} == {
            k: v for k, v in a.items() if "seconds" not in k
        }
    assert torch.equal(off.algorithm.x, on.algorithm.x)


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint(tmp_path):
    fedweave.run(_dist_cfg(), run_dir=tmp_path / "whole")
    fedweave.run({**_dist_cfg(), "rounds": 2}, run_dir=tmp_path / "part")
    # a record past the checkpoint (a round that ran but was not checkpointed) and a line cut short
    with open(tmp_path / "part" / "clients.jsonl", "a") as f:
        f.write('{"round": 9, "metric": "accuracy", "accuracy": [0.5]}\n{"round": 3, "met')
    resume(tmp_path / "part", ["rounds=3"], progress=False)
    assert _records(tmp_path / "part") == _records(tmp_path / "whole")


def test_distribution_under_a_regression_task_takes_the_highest_errors_as_the_worst(tmp_path):
    cfg = {
        **_dist_cfg(),
        "dataset": {"name": "diabetes"},
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "mlp", "hidden": 8},
        "task": {"loss": "mse"},
        "algorithm": {"name": "fedavg", "clients_per_round": 3},
    }
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    last = _records(tmp_path / "r")[-1]
    main = last["metric"]
    assert last["direction"] == "min"
    assert res.metrics[-1][f"client_test_{main}_worst10"] == max(last[main])  # 6 clients: the worst one


def test_distribution_is_refused_outside_the_centralized_family(tmp_path):
    from tests.test_precision import family_config

    cfg = {**family_config("gossip"), "eval": {"distribution": True}}
    with pytest.raises(ConfigError, match="eval.distribution records .* which the decentralized family does not"):
        fedweave.run(cfg, run_dir=tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_the_report_shows_the_per_client_spread(tmp_path):
    fedweave.run(_dist_cfg(), run_dir=tmp_path / "d")
    page = build_report([tmp_path / "d"])
    assert "Per-client test accuracy" in page and "worst 10 %" in page
    assert "Each client's test accuracy at round 3" in page
    fedweave.run(DIST, run_dir=tmp_path / "plain")
    assert "Per-client" not in build_report([tmp_path / "plain"])  # only a run that recorded them


def test_fedweave_list_names_the_methods_and_samplers(capsys):
    from fedweave.cli import main as cli_main

    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    algorithms = next(line for line in out.splitlines() if line.startswith("algorithms:"))
    samplers = next(line for line in out.splitlines() if line.startswith("samplers:"))
    assert all(name in algorithms.split(": ")[1].split(", ") for name in (*NEW, "qffl"))
    assert {"power_of_choice", "oort"} <= set(samplers.split(": ")[1].split(", "))


def test_moon_clients_on_their_nodes_equal_the_simulation(tmp_path):
    """Two rounds of MOON's clients: the simulation's call over its state store, and each client as a node job
    (its previous model in the node's files, the step rebuilt from the message), agree; the node keeps the
    model the simulation stores."""
    pytest.importorskip("flwr")
    from fedweave.deploy.client_app import _run_step
    from fedweave.deploy.node_state import INITIAL, NodeState
    from fedweave.execution import StateStore
    from fedweave.execution.local import LocalTrainer

    ctx = RunContext(load({**CFG, "local": {"steps": 3, "batch_size": 8, "lr": 0.1}}))
    ds = ctx.dataset
    tr = LocalTrainer(ctx.model, ds.train_x, ds.train_y, ctx.partition, ctx.config.local, ctx.seeds)
    x = tr.layout.flatten()
    store = StateStore(ctx.num_clients)
    store.create("prev", x.numel())
    node = NodeState(tmp_path, run_id=3)
    clients, accepted = [1, 4], dict.fromkeys([1, 4], INITIAL)
    for r in range(2):
        step = MoonStep(1.0, 0.5, x)
        res, upload = tr.train_with_state(x, clients, r, step, store, lr=0.1)
        assert upload == {}  # MOON's client sends its model
        for k, c in enumerate(clients):
            call = LocalCall(x.expand(2, -1), clients, r, ModelContrastive(1.0, 0.5, x, x), 0.1, None, ())
            header, tensors = encode_job(call, k, local=tr.local, step=step, state_round=accepted[c])
            job = decode_job(encode_header(header), tensors)
            got, sent = _run_step(tr, job, node)
            assert sorted(sent) == ["params"]
            torch.testing.assert_close(got.params[0], res.params[k])
            accepted[c] = r
            torch.testing.assert_close(node.load(c, r, step.state, x)["prev"][0], store["prev"][c])
        x = res.params.mean(0)
    assert float(store["prev"][clients].abs().sum()) > 0  # the comparison above was not of two zeros
