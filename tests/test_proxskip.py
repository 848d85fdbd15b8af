"""Scaffnew / ProxSkip (Mishchenko et al. 2022, Alg. 2): the exact optimum where FedAvg drifts, p = 1 as gradient
descent, the control variates by hand and their zero sum, the Geometric(p) round lengths, resume and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedweave
from fedweave.algorithms.centralized.proxskip import ProxSkipHparams
from fedweave.config import ConfigError, load
from fedweave.runner import run as run_config
from tests.test_centralized import M_Q, _algo, _cfg, _quad_cfg, _quad_optimum, _squared

GD = {"batch_size": M_Q, "lr": 0.1}  # full-batch gradient steps: deterministic gradients


def _quad(alg: str, local: dict | None = None, **opts):
    cfg = _quad_cfg(alg, **opts)
    cfg["local"] = local or GD
    algo = _algo(cfg)
    algo.trainer.loss_fn = _squared
    return algo


def _distance(algo, rounds: int) -> float:
    for r in range(rounds):
        algo.run_round(r)
    opt = _quad_optimum()
    return float((algo.x - opt).norm() / opt.norm())


def test_scaffnew_reaches_the_exact_optimum_where_fedavg_drifts():
    assert _distance(_quad("proxskip", p=0.2), 40) < 1e-5
    assert _distance(_quad("fedavg", {**GD, "steps": 5}), 40) > 1e-2  # 5 local steps: a biased fixed point


def test_with_p_1_every_round_is_one_gradient_step_on_the_average():
    skip, gd = _quad("proxskip", p=1.0), _quad("fedavg", {**GD, "steps": 1})
    for r in range(10):
        assert skip.run_round(r)["local_steps"] == 1
        gd.run_round(r)
        torch.testing.assert_close(skip.x, gd.x, rtol=1e-6, atol=1e-6)  # the h_i cancel in the average


def test_the_control_variates_follow_alg2_and_sum_to_zero():
    algo = _quad("proxskip", p=0.3)
    seen = []
    train = algo.trainer.train
    algo.trainer.train = lambda *a, **k: seen.append(train(*a, **k)) or seen[-1]
    for r in range(5):
        h = algo.store["h"].clone()
        algo.run_round(r)
        local = seen[-1]
        torch.testing.assert_close(algo.x, local.params.mean(0))  # x = (1/n) sum_j x^_j
        want = h + (0.3 / 0.1) * (algo.x - local.params)  # h_i + (p/gamma)(x - x^_i)
        torch.testing.assert_close(algo.store["h"], want)
        assert float(algo.store["h"].sum(0).abs().max()) < 1e-4  # sum_i h_i = 0, to float32 rounding
        assert (local.steps == algo.local_steps(r)).all()  # every client took the round's K_r steps


def test_round_lengths_are_geometric_with_mean_1_over_p():
    algo = _algo({**_cfg("proxskip", clients_per_round=8), "local": {"batch_size": 16, "lr": 0.1}})
    k = np.array([algo.local_steps(r) for r in range(4000)])
    assert k.min() == 1 and abs(k.mean() - 1 / 0.2) < 0.2  # mean 5, std of the mean about 0.07
    assert abs((k == 1).mean() - 0.2) < 0.02  # P(K = 1) = p
    again = _algo({**_cfg("proxskip", clients_per_round=8), "local": {"batch_size": 16, "lr": 0.1}})
    assert [again.local_steps(r) for r in range(50)] == k[:50].tolist()  # the ("local_steps", r) stream


def test_loop_and_vmap_agree_and_resume_continues_identically(tmp_path):
    cfg = {**_cfg("proxskip", rounds=4, clients_per_round=8), "local": {"batch_size": 16, "lr": 0.1}}
    algos = [_algo({**cfg, "backend": b}) for b in ("loop", "vmap")]
    for algo in algos:
        for r in range(3):
            algo.run_round(r)
    torch.testing.assert_close(algos[0].x, algos[1].x, rtol=1e-5, atol=1e-6)
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    assert torch.equal(resumed.algorithm.store["h"], full.algorithm.store["h"])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"algorithm": {"name": "proxskip", "clients_per_round": 3}}, "proxskip communicates with every client (8)"),
        ({"algorithm": {"name": "proxskip", "clients_per_round": 8, "p": 0}}, "algorithm.p must be in (0, 1], got 0"),
        ({"algorithm": {"name": "proxskip", "clients_per_round": 8, "weighting": "samples"}}, "use uniform"),
        ({"algorithm": {"name": "proxskip", "clients_per_round": 8, "server_lr": 0.5}}, "leave it at 1"),
        ({"local": {"steps": 4}}, "leave local.steps, local.epochs and local.momentum out"),
        ({"local": {"momentum": 0.9}}, "leave local.steps, local.epochs and local.momentum out"),
        ({"faults": {"dropout": 0.1}}, "algorithm 'proxskip' does not handle this fault (it handles: none)"),
        ({"privacy": {"mechanism": "central", "noise_multiplier": 1.0, "clip": 1.0}}, "privacy"),
        (
            {"partition": {"name": "dirichlet", "num_clients": 8, "alpha": 0.01, "min_size": 0}},
            "client(s) (client 0 first) hold no training sample; set partition.min_size to 1 or more",
        ),
    ],
)
def test_what_scaffnew_needs_is_checked_in_one_line(change, words, tmp_path):
    cfg = {**_cfg("proxskip", clients_per_round=8), "local": {"batch_size": 16, "lr": 0.1}, **change}
    with pytest.raises(ConfigError) as err:
        fedweave.run(cfg, run_dir=tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_probability_whose_mean_round_exceeds_local_steps_bound_is_refused():
    # p = 1e-300 drew K_r = 2^63 - 1 local steps: the first round never ended
    with pytest.raises(ConfigError) as err:
        ProxSkipHparams(clients_per_round=8, p=1e-300)
    assert str(err.value) == (
        "algorithm.p must be >= 1e-07: a round takes 1/p local steps on average, and local.steps is at most "
        "10,000,000 (a larger value runs for days); got 1e-300"
    )
    ProxSkipHparams(clients_per_round=8, p=1e-7)


@pytest.mark.parametrize("name", ["proxskip", "ifca", "fedproto", "clustered_fl"])
def test_the_methods_whose_client_state_stays_in_the_simulation_are_refused_for_deployment_in_one_line(name):
    from fedweave.deploy.support import unsupported

    why = unsupported(name, "centralized", "stop")
    assert why is not None and why.startswith(f"algorithm {name!r} (centralized) cannot be deployed on Flower yet: ")
    assert "\n" not in why


def test_a_round_lasts_its_k_r_steps_on_the_simulated_clock():
    """Every client takes the round's K_r ~ Geometric(p) steps, so on the clock (faults.sim_time) a round lasts
    K_r p (the steps over their mean 1/p) times the slowest client's speed: the same factor every round. The
    configured local steps (one epoch of each client's data) gave every round the same length."""
    cfg = _quad_cfg("proxskip", p=0.3)
    cfg["local"] = GD
    cfg["faults"] = {"speed_sigma": 0.5, "sim_time": True}
    algo = _algo(cfg)
    algo.trainer.loss_fn = _squared
    now, ratios, steps = 0.0, [], []
    for r in range(8):
        row = algo.run_round(r)
        steps.append(row["local_steps"])
        ratios.append((row["sim_time"] - now) / (row["local_steps"] * 0.3))
        now = row["sim_time"]
    assert len(set(steps)) > 1  # the rounds' lengths differ
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-12)  # the slowest client's speed, every round
    assert ratios[0] > 1  # speeds exp(0.5 z_i): the slowest of the clients is slower than the median


def test_the_mnist_comparison_of_centralized_md_states_each_methods_bytes(tmp_path):
    """docs/algorithms/centralized.md compares `example:centralized/proxskip_mnist` with FedAvg and SCAFFOLD at
    the same expected local work and said all three moved the same bytes (18.0 MiB each way); SCAFFOLD sends
    its control variates beside the model, twice Scaffnew's bytes. The ledger's bytes depend only on the
    model, the clients and the rounds: one round on arrays of MNIST's shape, times the config's 30 rounds."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs/algorithms/centralized.md").read_text(encoding="utf-8")
    [para] = [p for p in text.split("\n\n") if "example:centralized/proxskip_mnist" in p]
    para = re.sub(r"\s+", " ", para)
    g = np.random.default_rng(0)
    data = (g.random((400, 1, 28, 28), dtype=np.float32), g.integers(0, 10, 400))
    data = (*data, data[0][:50], data[1][:50])
    rounds = load("example:centralized/proxskip_mnist").rounds
    stated = {}
    for name, algorithm in [
        ("proxskip", None),
        ("fedavg", "algorithm={name: fedavg, clients_per_round: 20, weighting: uniform}"),
        ("scaffold", "algorithm={name: scaffold, clients_per_round: 20, weighting: uniform}"),
    ]:
        overrides = ["rounds=1", "output.dir=null", "output.plots=false", "output.progress=false"]
        overrides += [algorithm, "local.steps=5"] if algorithm else []
        res = fedweave.run("example:centralized/proxskip_mnist", overrides, dataset=data, run_dir=tmp_path / name)
        comm = res.summary["communication"]
        assert comm["bytes_up"] == comm["bytes_down"]
        stated[name] = f"{rounds * comm['bytes_up'] / 2**20:.1f}"
    assert stated["proxskip"] == stated["fedavg"] == "18.0" and stated["scaffold"] == "35.9"
    for name, mib in stated.items():
        assert f"{mib} MiB" in para, f"{name}'s {mib} MiB is not stated"
