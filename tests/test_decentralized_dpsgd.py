"""Per-sample clipped DP-SGD (fedweave.execution.dpsgd) and its use by the decentralized family (spec A27)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import LocalConfig, load
from fedweave.execution import LocalTrainer, ParamLayout
from fedweave.execution.dpsgd import DPSGD, PrivateTrainer, clip_rows
from fedweave.seeding import Seeds
from tests.conftest import make_toy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 4))


def _trainer(backend: str, batch: int = 16) -> LocalTrainer:
    ds = make_toy()
    parts = [np.arange(0, 50), np.arange(50, 90), np.arange(90, 170)]  # 50 / 40 / 80: partial last batches
    local = LocalConfig(epochs=2, batch_size=batch, lr=0.1, momentum=0.5)
    local.validate()
    return LocalTrainer(_model(), ds.train_x, ds.train_y, parts, local, Seeds(7), backend=backend)


class _Grad:
    """A gradient oracle as the backends build it: the batch, and where the rule reports its loss."""

    def __init__(self, x, y, mask=None):
        self.batch, self.losses = (x, y, mask), []

    def __call__(self, v):  # pragma: no cover - DPSGD computes its own gradients
        raise AssertionError("DP-SGD must not use the mean-gradient oracle")

    def report(self, loss):
        self.losses.append(loss)


def _autograd_per_sample(layout: ParamLayout, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients the slow way: one backward per sample (independent of torch.func)."""
    rows = []
    for b in range(len(y)):
        w = v.detach().clone().requires_grad_(True)
        loss = nn.functional.cross_entropy(layout.functional(w, x[b : b + 1]), y[b : b + 1])
        rows.append(torch.autograd.grad(loss, w)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_huge_clip_and_no_noise_is_plain_sgd(backend):
    tr = _trainer(backend)
    start = tr.layout.flatten()
    plain = tr.train(start, [0, 1, 2], 0)
    private = PrivateTrainer.of(tr, clip=1e9, sigma=0.0).train(start, [0, 1, 2], 0)
    assert torch.allclose(private.params, plain.params, atol=1e-5)
    assert torch.allclose(private.loss, plain.loss, atol=1e-5)  # the loss is reported as the plain rule's
    assert torch.equal(private.steps, plain.steps)


def test_private_gradient_is_the_mean_of_clipped_per_sample_gradients():
    tr = _trainer("loop")
    lay, ds = tr.layout, make_toy()
    v = lay.flatten() + 0.1 * torch.randn(lay.numel, generator=torch.Generator().manual_seed(1))
    x, y = ds.train_x[:12], ds.train_y[:12]
    per = _autograd_per_sample(lay, v, x, y)
    C = float(per.norm(dim=1).median()) + 1e-3  # clips about half of the samples
    rule = DPSGD(lay, C, 0.0, Seeds(0), 0, [0])
    g = _Grad(x, y)
    got = rule.private(v, g, 0)
    want = torch.stack([p * min(1.0, C / float(p.norm())) for p in per]).mean(0)  # Abadi et al., Alg. 1
    assert torch.allclose(got, want, atol=1e-6)
    assert (per.norm(dim=1) > C).any() and (per.norm(dim=1) < C).any()
    assert float(g.losses[0]) == pytest.approx(float(nn.functional.cross_entropy(lay.functional(v, x), y)), abs=1e-6)


def test_clipping_bounds_each_sample_contribution():
    tr = _trainer("loop")
    lay, ds = tr.layout, make_toy()
    v = lay.flatten()
    C, B = 0.05, 16
    rule = DPSGD(lay, C, 0.0, Seeds(0), 0, [0])
    x, y = ds.train_x[:B].clone(), ds.train_y[:B].clone()
    base = rule.private(v, _Grad(x, y), 0)
    assert float(base.norm()) <= C + 1e-6  # the mean of B vectors of norm <= C
    for k, scale in ((0, 100.0), (5, -50.0)):  # replace one sample by an extreme one
        x2, y2 = x.clone(), y.clone()
        x2[k] = scale * ds.train_x[100 + k]
        y2[k] = (y[k] + 1) % 4
        changed = rule.private(v, _Grad(x2, y2), 0)
        assert float((changed - base).norm()) <= 2 * C / B + 1e-6  # one sample moves the step by <= 2C/B
    assert torch.allclose(clip_rows(torch.tensor([[3.0, 4.0], [0.3, 0.4]]), 1.0),
                          torch.tensor([[0.6, 0.8], [0.3, 0.4]]))  # fmt: skip


def test_noise_std_matches_sigma_c_over_b():
    tr = _trainer("loop")
    lay, ds = tr.layout, make_toy()
    v, B, C, sigma = lay.flatten(), 32, 0.5, 2.0
    x, y = ds.train_x[:B], ds.train_y[:B]
    clean = DPSGD(lay, C, 0.0, Seeds(0), 0, [3]).private(v, _Grad(x, y), 0)
    noisy = DPSGD(lay, C, sigma, Seeds(0), 0, [3])
    diffs = torch.stack([noisy.private(v, _Grad(x, y), 0) - clean for _ in range(20)])  # 20 calls x P coords
    assert diffs.numel() > 10_000
    std = float(diffs.std())
    assert std == pytest.approx(sigma * C / B, rel=0.03)
    assert abs(float(diffs.mean())) < 3 * std / diffs.numel() ** 0.5 + 1e-9
    assert not torch.equal(diffs[0], diffs[1])  # a fresh draw per gradient call


def test_noisy_dp_sgd_is_the_same_on_loop_and_vmap():
    a = PrivateTrainer.of(_trainer("loop"), clip=0.3, sigma=1.5)
    b = PrivateTrainer.of(_trainer("vmap"), clip=0.3, sigma=1.5)
    start = a.layout.flatten()
    ra, rb = a.train(start, [0, 1, 2], 4, key=(9,)), b.train(start, [0, 1, 2], 4, key=(9,))
    assert torch.allclose(ra.params, rb.params, atol=1e-5)
    plain = _trainer("loop").train(start, [0, 1, 2], 4, key=(9,))
    assert not torch.allclose(ra.params, plain.params, atol=1e-3)


def _dfl(dp: dict, algo: str = "gossip") -> dict:
    return {
        "name": "dp",
        "seed": 2,
        "rounds": 2,
        "dataset": {"name": "_toy"},
        "partition": {"name": "iid", "num_clients": 4},
        "model": {"name": "mlp", "hidden": [8]},
        "algorithm": {"name": algo, "neighbours": 2, **dp},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.1},
        "output": {"progress": False, "plots": False},
    }


def test_graph_family_dp_modes():
    def models(dp: dict, algo: str = "gossip") -> torch.Tensor:
        a = build_algorithm(RunContext(load(_dfl(dp, algo))))
        a.run_round(0)
        return a.W.clone()

    plain = models({})
    sgd = models({"dp_sigma": 2.0, "dp_clip": 1.0})
    assert not torch.allclose(plain, sgd)
    assert torch.equal(sgd, models({"dp_sigma": 2.0, "dp_mode": "sgd"}))  # sgd is the default mode (A27)
    assert not torch.allclose(models({"dp_sigma": 2.0, "dp_mode": "exchange"}), sgd)
    # sigma 0 is no DP at all, whatever the clip: the Table 4 sigma = 0 row is the plain run
    assert torch.equal(models({"dp_sigma": 0.0, "dp_clip": 1e-6}), plain)
    a = build_algorithm(RunContext(load(_dfl({"dp_sigma": 1.0}, "ditto"))))
    assert isinstance(a.trainer, PrivateTrainer)  # the shared model is trained privately ...
    assert not isinstance(a.personal_trainer, PrivateTrainer) and not isinstance(a.ft_trainer, PrivateTrainer)


def test_dp_sgd_config_errors():
    from fedweave.config import ConfigError

    with pytest.raises(ConfigError, match="dp_mode"):
        build_algorithm(RunContext(load(_dfl({"dp_mode": "both"}))))
    with pytest.raises(ValueError, match="clip"):
        DPSGD(ParamLayout(_model()), 0.0, 1.0, Seeds(0), 0, [0])
    assert dataclasses.is_dataclass(LocalConfig)


def test_dp_sgd_rule_pickles_for_the_ray_backend():
    import pickle

    tr = _trainer("loop")
    rule = DPSGD(tr.layout, 0.5, 1.0, Seeds(0), 2, [0, 1], (3,))
    v, ds = tr.layout.flatten(), make_toy()
    x, y = ds.train_x[:8], ds.train_y[:8]
    copy = pickle.loads(pickle.dumps(rule))
    assert torch.equal(copy.private(v, _Grad(x, y), 1), rule.private(v, _Grad(x, y), 1))


def test_exchange_noise_is_sigma_c_over_l_on_the_received_tensor():
    """``dp_mode: exchange`` (A27's alternative): a received tensor is x + N(0, (sigma_2 C / L)^2 I), one fresh
    draw per message (round, sender, receiver, what) and the same draw on every call for that message."""
    sigma, clip = 2.0, 0.5
    cfg = _dfl({"dp_sigma": sigma, "dp_clip": clip, "dp_mode": "exchange"}, "afind_plus")
    a = build_algorithm(RunContext(load(cfg)))
    L = a.config.local.batch_size
    assert not isinstance(a.trainer, PrivateTrainer)  # exchange mode: the local steps stay plain SGD
    x = torch.linspace(-3.0, 3.0, 200_000)
    noise = a.noisy(x, 1, 2, 0) - x
    assert float(noise.std()) == pytest.approx(sigma * clip / L, rel=0.01)
    assert abs(float(noise.mean())) < 4 * sigma * clip / L / x.numel() ** 0.5
    assert torch.equal(a.noisy(x, 1, 2, 0), x + noise)  # the message's draw, on every call
    assert torch.allclose(a.noisy(torch.zeros_like(x), 1, 2, 0), noise, atol=1e-6)  # additive: x does not matter
    for other in ((2, 2, 0, 0), (1, 3, 0, 0), (1, 2, 3, 0), (1, 2, 0, 1)):  # another round, sender, receiver, what
        assert not torch.allclose(a.noisy(x, *other) - x, noise)
    plain = build_algorithm(RunContext(load(_dfl({"dp_sigma": sigma, "dp_clip": clip}, "afind_plus"))))
    assert plain.noisy(x, 1, 2, 0) is x  # dp_mode sgd: nothing is added to a message
