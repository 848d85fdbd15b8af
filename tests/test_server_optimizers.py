"""FedYogi, FedAdagrad and FedAvgM under their own names: one server step equals the paper's closed form on a
given pseudo-gradient, and FedAvgM without momentum is FedAvg bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fedweave
from fedweave.algorithms.centralized.fedadam import FedAdagradHparams, FedOpt, FedYogiHparams
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS

CFG = {
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 12, "alpha": 0.5},
    "model": {"name": "logistic"},
    "rounds": 3,
    "backend": "loop",
    "local": {"steps": 3, "batch_size": 16, "lr": 0.05},
    "output": {"progress": False, "plots": False},
}


def _step(hp, delta: torch.Tensor, v0: torch.Tensor) -> torch.Tensor:
    algo = SimpleNamespace(hp=hp, m=torch.zeros_like(delta), v=v0.clone())
    return FedOpt.server_step(algo, delta)


@pytest.mark.parametrize("rule", ["yogi", "adagrad"])
def test_one_server_step_is_the_papers_closed_form(rule):
    # Reddi et al. (2021) Alg. 2 from m_{-1} = 0 and a given v_{-1}: m = (1 - b1) D; Yogi
    # v = v_{-1} - (1 - b2) D^2 sign(v_{-1} - D^2), Adagrad v = v_{-1} + D^2; x += eta m / (sqrt(v) + tau)
    opts = {"server_lr": 0.3, "beta1": 0.8, "tau": 1e-3}  # beta2: Yogi only (Adagrad refuses it, unread)
    hp = FedYogiHparams(**opts, beta2=0.95) if rule == "yogi" else FedAdagradHparams(**opts)
    delta = torch.tensor([0.5, -0.02, 0.0, 1.5], dtype=torch.float64)
    v0 = torch.tensor([0.1, 1e-6, 0.2, 3.0], dtype=torch.float64)
    m = 0.2 * delta
    if rule == "yogi":
        v = torch.stack([v0[i] - 0.05 * delta[i] ** 2 * torch.sign(v0[i] - delta[i] ** 2) for i in range(4)])
    else:
        v = v0 + delta**2
    want = 0.3 * m / (v.sqrt() + 1e-3)
    torch.testing.assert_close(_step(hp, delta, v0), want, rtol=1e-15, atol=0)


def test_each_name_fixes_its_server_rule(tmp_path):
    for name, rule in (("fedyogi", "yogi"), ("fedadagrad", "adagrad"), ("fedavgm", "momentum")):
        cfg = {**CFG, "rounds": 1, "algorithm": {"name": name, "clients_per_round": 4}}
        assert fedweave.run(cfg, run_dir=tmp_path / name).algorithm.hp.server_opt == rule
    with pytest.raises(ConfigError, match="algorithm.server_opt"):
        fedweave.run({**CFG, "algorithm": {"name": "fedyogi", "server_opt": "adam"}}, run_dir=tmp_path / "x")


def test_fedavgm_without_momentum_is_fedavg_bit_for_bit(tmp_path):
    algo = {"clients_per_round": 4}
    plain = fedweave.run({**CFG, "algorithm": {"name": "fedavg", **algo}}, run_dir=tmp_path / "a")
    m0 = fedweave.run({**CFG, "algorithm": {"name": "fedavgm", "beta1": 0.0, **algo}}, run_dir=tmp_path / "b")
    m9 = fedweave.run({**CFG, "algorithm": {"name": "fedavgm", **algo}}, run_dir=tmp_path / "c")
    assert [r["test_loss"] for r in m0.metrics] == [r["test_loss"] for r in plain.metrics]
    assert torch.equal(m0.algorithm.x, plain.algorithm.x)
    assert [r["test_loss"] for r in m9.metrics] != [r["test_loss"] for r in plain.metrics]  # momentum 0.9 acts


@pytest.mark.parametrize(
    ("name", "opts", "key"),
    [
        ("fedavgm", {"beta2": 0.5}, "beta2"),
        ("fedavgm", {"tau": 0.1}, "tau"),
        ("fedavgm", {"v_init": 1e-4}, "v_init"),
        ("fedadam", {"server_opt": "momentum", "tau": 0.1}, "tau"),
        ("fedadagrad", {"beta2": 0.5}, "beta2"),
    ],
)
def test_an_option_the_server_rule_does_not_read_is_refused_in_one_line(name, opts, key):
    """FedAvgM's step reads beta1 and server_lr only, FedAdagrad's v = v + Delta^2 no beta2 (Reddi et al. Alg. 2):
    a sweep over an unread option would give the same run under another label, so it is refused by name."""
    with pytest.raises(ConfigError, match=rf"^algorithm\.{key}: server_opt '\w+' does not read it .*; leave it out$"):
        _hparams(name, opts)


def _hparams(name: str, opts: dict):
    return ALGORITHMS.get(name).Hparams(**opts)


def test_an_unread_option_at_its_default_is_accepted():
    """A resolved config writes every option out: an unread one at its default is what the run read anyway."""
    assert _hparams("fedavgm", {"beta2": 0.99, "tau": 1e-2, "v_init": 0.0}).server_opt == "momentum"
    assert _hparams("fedadam", {"server_opt": "adagrad", "beta2": 0.99, "tau": 0.1}).tau == 0.1
