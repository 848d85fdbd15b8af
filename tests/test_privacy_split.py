"""Differential privacy in the split family (fedweave.privacy.split; docs/privacy.md): DP-FedAvg on the fed
server's average of the client-side models (and auxiliary nets), its accounting, and the refusals.

All data here are SYNTHETIC (class means plus noise)."""

from __future__ import annotations

import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.data.base import Dataset
from fedweave.registry import DATASETS
from fedweave.runner import run

pytest.importorskip("opacus", reason="opacus is not installed (pip install 'fedweave[privacy]')")

if "_toy_split_dp" not in DATASETS._items:

    @DATASETS.register("_toy_split_dp")
    def _toy_split_dp(n_train: int = 240, n_test: int = 60, side: int = 8) -> Dataset:
        """Synthetic class-conditional 1 x side x side images."""
        g = torch.Generator().manual_seed(0)
        mu = torch.randn(10, 1, side, side, generator=g)
        y = torch.randint(0, 10, (n_train + n_test,), generator=g)
        x = mu[y] + 0.8 * torch.randn(len(y), 1, side, side, generator=g)
        return Dataset("_toy_split_dp", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10, (1, side, side))


METHODS = ("fsl_an", "cse_fsl")  # FSL_MC and FSL_OC are refused (their clients get the server's gradients)


def _cfg(method: str, privacy: dict | None = None, rounds: int = 2, **algo) -> dict:
    cfg = {
        "seed": 1,
        "rounds": rounds,
        "dataset": {"name": "_toy_split_dp"},
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "split_small"},
        "algorithm": {"name": method, "weighting": "uniform", **({"h": 2} if method == "cse_fsl" else {}), **algo},
        "local": {"batch_size": 10, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }
    if privacy is not None:
        cfg["privacy"] = privacy
    return cfg


def _built(cfg: dict):
    return build_algorithm(RunContext(load(cfg)))


def _models(algo, rounds: int) -> tuple[torch.Tensor, ...]:
    for r in range(rounds):
        algo.run_round(r)
    return algo.xc, algo.xa, algo.xs


@pytest.mark.parametrize("method", METHODS)
def test_no_noise_and_a_huge_clip_is_the_method_bit_for_bit(method):
    plain = _models(_built(_cfg(method)), 2)
    private = _built(_cfg(method, {"noise_multiplier": 0.0, "clip": 1e30}))
    assert private.privacy is not None and private.privacy.sample_rate == 1.0  # every client, every round
    for got, want in zip(_models(private, 2), plain, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["fsl_an", "cse_fsl"])
def test_the_client_side_update_is_clipped_to_c_with_its_auxiliary_net(method):
    algo = _built(_cfg(method, {"noise_multiplier": 0.0, "clip": 0.05}))
    seen = []
    clip = algo.privacy.clip

    def spy(updates, weights, clients=None):
        out = clip(updates, weights, clients)
        seen.append((updates, out[0]))
        return out

    algo.privacy.clip = spy
    xc, xa = algo.xc.clone(), algo.xa.clone()
    algo.run_round(0)
    ((updates, clipped),) = seen
    width = algo.lc.numel + (algo.la.numel if algo.uses_aux else 0)  # the client's whole message, both parts
    assert updates.shape == (6, width)
    assert (updates.norm(dim=1) > 0.05).all()  # the clip bound every update ...
    assert (clipped.norm(dim=1) <= 0.05 * (1 + 1e-6)).all()  # ... and none exceeds it
    # no noise: the new models are x + the mean of the clipped updates over E = 6
    moved = torch.cat([algo.xc - xc, algo.xa - xa]) if algo.uses_aux else algo.xc - xc
    torch.testing.assert_close(moved, clipped.sum(0) / 6)
    assert moved.norm() <= 0.05 * (1 + 1e-6)


def test_the_noise_has_std_sigma_c_over_the_expected_clients():
    a = _built(_cfg("fsl_an", {"noise_multiplier": 2.0, "clip": 1e30}))
    b = _built(_cfg("fsl_an", {"noise_multiplier": 0.0, "clip": 1e30}))
    a.run_round(0)
    b.run_round(0)
    noise = torch.cat([a.xc - b.xc, a.xa - b.xa])  # the same training, only the noise differs
    assert len(noise) > 3000
    assert abs(noise.std().item() / (2.0 * 1e30 / 6) - 1) < 0.05


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_is_opacus_called_directly_with_poisson_sampling(tmp_path, accountant):
    from opacus.accountants import PRVAccountant, RDPAccountant

    cfg = _cfg("fsl_an", {"noise_multiplier": 1.1, "clip": 0.5, "accountant": accountant}, rounds=3,
               clients_per_round=3)  # fmt: skip
    cfg["sampler"] = {"name": "bernoulli"}
    res = run(load(cfg), run_dir=tmp_path / "r")
    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    acc.history = [(1.1, 0.5, 3)]  # q = clients_per_round / N = 3 / 6
    assert res.summary["privacy"]["epsilon"] == acc.get_epsilon(delta=1e-5)
    assert res.summary["privacy"]["expected_clients"] == 3


def test_a_delta_not_below_one_over_the_clients_is_one_warning(caplog):
    # the fed server's DP-FedAvg protects each of the 6 clients: delta 0.2 >= 1/6 ran without a word
    privacy = {"noise_multiplier": 1.0, "clip": 0.5, "delta": 0.2, "amplification": "none"}
    with caplog.at_level("WARNING", logger="fedweave"):
        _built(_cfg("fsl_an", privacy, clients_per_round=3))
    said = [r.getMessage() for r in caplog.records if "privacy.delta" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("privacy.delta 0.2 is not below 1/n = 0.167 (n = 6 clients, ")


def test_the_split_samplers_are_accounted_as_the_stars():
    """q = 1 for fixed clients, every client every round and any sampler under amplification: none; the default
    fixed-size uniform sample of fewer clients than N is refused in one line, as for the star (docs/privacy.md)."""
    privacy = {"noise_multiplier": 1.0, "clip": 0.5}
    with pytest.raises(
        ConfigError, match=r"^privacy: sampler 'uniform' draws a fixed-size sample.*amplification: none"
    ):
        _built(_cfg("fsl_an", privacy, clients_per_round=3))
    cases = [
        ({**privacy, "amplification": "none"}, {"clients_per_round": 3}, None, 3),
        (privacy, {"clients_per_round": 3}, "fixed", 3),
        (privacy, {"clients_per_round": None}, None, 6),
    ]
    for priv, algo, sampler, expected in cases:
        cfg = _cfg("fsl_an", priv, **algo)
        if sampler is not None:
            cfg["sampler"] = sampler
        dp = _built(cfg).privacy
        assert (dp.sample_rate, dp.expected) == (1.0, expected)


def test_a_resumed_private_split_run_continues_the_accountant(tmp_path):
    from fedweave.runner import resume

    privacy = {"noise_multiplier": 1.0, "clip": 0.5, "adaptive": True, "count_noise": 2.0}
    whole = run(load(_cfg("fsl_an", privacy, rounds=3)), run_dir=tmp_path / "whole")
    cfg = _cfg("fsl_an", privacy, rounds=2)
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    run(load(cfg), run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=3"])
    assert res.algorithm.privacy.releases == 3
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert [r["dp_clip"] for r in res.metrics] == [r["dp_clip"] for r in whole.metrics]
    assert torch.equal(res.algorithm.xc, whole.algorithm.xc)


@pytest.mark.parametrize(
    ("method", "change", "words"),
    [
        ("cse_fsl", {"agg_every": 2}, "privacy: algorithm.agg_every (2)"),
        ("fsl_an", {"weighting": "samples"}, "privacy: algorithm.weighting: samples"),
    ],
)
def test_what_the_proof_does_not_cover_is_refused_with_one_line(method, change, words):
    with pytest.raises(ConfigError) as e:
        _built(_cfg(method, {"noise_multiplier": 1.0}, **change))
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_sample_level_and_ftrl_are_refused_in_the_split_family():
    with pytest.raises(ConfigError, match=r"^privacy.level: sample is not supported in the split family"):
        _built(_cfg("fsl_an", {"level": "sample", "noise_multiplier": 1.0}))
    with pytest.raises(ConfigError, match=r"^privacy.mechanism: ftrl is supported in the centralized family"):
        _built(_cfg("fsl_an", {"mechanism": "ftrl", "noise_multiplier": 1.0}))


@pytest.mark.parametrize("method", ["fsl_mc", "fsl_oc"])
def test_methods_whose_clients_get_the_server_sides_gradients_are_refused(method):
    # another client's update, given the same released client-side model, moves when only client 0's data change
    # (the server-side model it back-propagates through was fitted to client 0's smashed data): the sum's
    # sensitivity is not C, so DP-FedAvg's epsilon does not hold
    with pytest.raises(ConfigError) as e:
        _built(_cfg(method, {"noise_multiplier": 1.0}))
    assert str(e.value).startswith(f"privacy: algorithm {method!r} is refused: its clients train on gradients")


@pytest.mark.parametrize(("method", "moved"), [("fsl_oc", True), ("cse_fsl", False)])
def test_whether_one_clients_data_move_the_other_clients_updates(method, moved):
    # why FSL_OC is refused and CSE-FSL is not: change only client 0's labels; with FSL_OC (one server-side model
    # served client after client) a client served after client 0 sends another update in the same round
    def updates(flip: bool) -> torch.Tensor:
        algo = _built(_cfg(method))
        if flip:
            ys = algo.batcher.train_y
            idx = torch.as_tensor(algo.ctx.partition[0], device=ys.device)
            ys[idx] = (ys[idx] + 1) % 10
        seen, aggregate = [], algo.aggregate

        def spy(clients, xc_rows, xa_rows):
            seen.append(xc_rows.clone())  # each client's client-side model, all from the same released x_c
            return aggregate(clients, xc_rows, xa_rows)

        algo.aggregate = spy
        algo.run_round(0)
        return seen[0]

    a, b = updates(False), updates(True)
    assert bool((a[0] != b[0]).any())  # client 0's own update moves in both
    assert bool(((a - b)[1:].norm(dim=1) > 0).any()) == moved
