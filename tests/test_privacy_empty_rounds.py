"""The empty round under Poisson sampling (docs/privacy.md, "The empty round"): a private run amplified by the
``bernoulli`` sampler keeps an empty draw and releases the noise alone, accounted like every other round; runs
without privacy keep the redraw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import load
from fedweave.runner import run

pytest.importorskip("opacus", reason="opacus is not installed (pip install 'fedweave[privacy]')")

PRIVACY = {"noise_multiplier": 1.0, "clip": 0.5}
ROUNDS = 8


def _star(toy_config: dict, privacy: dict | None = PRIVACY) -> dict:
    # 12 clients, q = 1/12: a round draws nobody with probability (11/12)^12 = 0.35
    cfg = {**toy_config, "rounds": ROUNDS, "sampler": {"name": "bernoulli"}, "precision": "float64"}
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 1}
    return {**cfg, "privacy": privacy} if privacy is not None else cfg


def _built(cfg: dict):
    return build_algorithm(RunContext(load(cfg)))


def _noise(algo, release: int) -> torch.Tensor:
    """DP-FedAvg's noise of a release, from its named stream: sigma C / E times N(0, I)."""
    dp = algo.privacy
    g = algo.ctx.seeds.torch("dp", release)
    return dp.z * dp.clip_norm / dp.expected * torch.randn(algo.x.shape, generator=g, dtype=algo.x.dtype)


def test_a_private_run_keeps_the_empty_draw_and_releases_the_noise_alone(toy_config):
    algo = _built(_star(toy_config))
    draws = [algo.sample_clients(r) for r in range(ROUNDS)]
    empty = [r for r, c in enumerate(draws) if len(c) == 0]
    assert empty and len(empty) < ROUNDS  # the seed draws both kinds of round
    for r in range(ROUNDS):
        x = algo.x.clone()
        algo.run_round(r)
        assert algo.privacy.releases == r + 1  # every round is a release, the empty ones included
        if r in empty:  # FedAvg's server step on the noise of an empty sum (server_lr 1)
            assert torch.equal(algo.x, x + _noise(algo, r))
    assert algo.privacy.accountant.history == [(1.0, 1 / 12, ROUNDS)]


def test_without_privacy_the_sampler_still_draws_again(toy_config):
    plain = _built(_star(toy_config, None))
    private = _built(_star(toy_config))
    for r in range(ROUNDS):
        a, b = plain.sample_clients(r), private.sample_clients(r)
        assert len(a) > 0  # the redraw (FedMIM's rule): the numbers of runs without privacy are unchanged
        if len(b):  # the first draw of the round is the same
            assert np.array_equal(a, b)


def test_without_amplification_an_empty_round_is_neither_drawn_nor_released(toy_config):
    algo = _built(_star(toy_config, {**PRIVACY, "amplification": "none"}))
    assert "redraw" not in algo.sampler.options
    assert all(len(algo.sample_clients(r)) for r in range(ROUNDS))


def test_an_explicit_redraw_is_refused_where_the_proof_needs_the_empty_draw(toy_config):
    """The privacy section keeps bernoulli's empty draw (redraw: false); a redraw: true written in the config had
    been replaced in silence. It is refused in one line; without amplification the redraw stays as written."""
    from fedweave.config import ConfigError

    cfg = {**_star(toy_config), "sampler": {"name": "bernoulli", "redraw": True}}
    with pytest.raises(ConfigError, match=r"^privacy: sampler.redraw: true draws a round again") as e:
        _built(cfg)
    assert "\n" not in str(e.value)
    cfg["privacy"] = {**PRIVACY, "amplification": "none"}
    assert _built(cfg).sampler.options["redraw"] is True
    cfg = {**_star(toy_config), "sampler": {"name": "bernoulli", "redraw": False}}
    assert _built(cfg).sampler.options["redraw"] is False


def test_epsilon_counts_the_empty_rounds(toy_config, tmp_path):
    from opacus.accountants import RDPAccountant

    res = run(load(_star(toy_config)), run_dir=tmp_path / "r")
    acc = RDPAccountant()
    acc.history = [(1.0, 1 / 12, ROUNDS)]
    assert res.summary["privacy"]["epsilon"] == acc.get_epsilon(delta=1e-5)
    assert res.summary["privacy"]["releases"] == ROUNDS


def test_a_round_every_drawn_client_dropped_is_released_too(toy_config):
    cfg = _star(toy_config)
    cfg["algorithm"]["clients_per_round"] = 3
    cfg["faults"] = {"dropout": 0.9}
    algo = _built(cfg)
    dropped_all = []
    for r in range(ROUNDS):
        x = algo.x.clone()
        m = algo.run_round(r)
        if m["reported_clients"] == 0:
            assert torch.equal(algo.x, x + _noise(algo, r))
            if len(algo.sample_clients(r)):
                dropped_all.append(r)
    assert dropped_all  # somebody was drawn and nobody reported
    assert algo.privacy.releases == ROUNDS


def test_a_sample_level_round_nobody_reported_leaves_the_model_and_the_count_alone(toy_config):
    """At sample level the server releases nothing of its own (the clients' DP-SGD steps are what is accounted), so
    a round whose clients all dropped out trains nobody, moves nothing and counts no step; it had stopped the run
    with an AttributeError (SampleDP has no empty-round release to ask about)."""
    from opacus.accountants import RDPAccountant

    cfg = {**toy_config, "rounds": ROUNDS, "precision": "float64", "faults": {"dropout": 0.9}}
    cfg["privacy"] = {"level": "sample", "noise_multiplier": 1.0, "clip": 0.5}
    algo = _built(cfg)
    nobody = []
    for r in range(ROUNDS):
        x, steps = algo.x.clone(), algo.privacy.trainer.steps_done.copy()
        if algo.run_round(r)["reported_clients"] == 0:
            nobody.append(r)
            assert torch.equal(algo.x, x) and np.array_equal(algo.privacy.trainer.steps_done, steps)
    assert nobody and len(nobody) < ROUNDS  # the seed gives both kinds of round
    done, rates = algo.privacy.trainer.steps_done, algo.privacy.rates
    want = []
    for q, s in zip(rates, done):
        if s:
            acc = RDPAccountant()
            acc.history = [(1.0, float(q), int(s))]
            want.append(acc.get_epsilon(delta=1e-5))
    assert algo.privacy.epsilon() == max(want)


def test_the_hierarchical_client_step_releases_an_empty_round(toy_config):
    cfg = {**toy_config, "rounds": ROUNDS, "sampler": {"name": "bernoulli"}, "precision": "float64"}
    cfg["partition"] = {"name": "iid", "num_clients": 12}
    cfg["algorithm"] = {"name": "hier_fedavg", "tau": 2, "participation": 1 / 12}
    algo = _built({**cfg, "privacy": PRIVACY})
    empty = [r for r in range(ROUNDS) if len(algo.sample_clients(r)) == 0]
    assert empty
    for r in range(ROUNDS):
        x = algo.x.clone()
        algo.run_round(r)
        if r in empty:
            assert torch.equal(algo.x, x + _noise(algo, r))
    assert algo.privacy.releases == ROUNDS


@pytest.mark.parametrize("method", ["fsl_an", "cse_fsl"])
def test_the_split_fed_server_releases_an_empty_round(method):
    from tests.test_privacy_split import _cfg

    cfg = _cfg(method, PRIVACY, rounds=ROUNDS, clients_per_round=1)  # q = 1/6: empty with probability 0.33
    cfg["sampler"] = {"name": "bernoulli"}
    algo = _built(cfg)
    empty = [r for r in range(ROUNDS) if len(algo.sample_clients(r)) == 0]
    assert empty
    for r in range(ROUNDS):
        xc, xa = algo.xc.clone(), algo.xa.clone()
        algo.run_round(r)
        if r in empty:
            dp = algo.privacy
            g = algo.ctx.seeds.torch("dp", r)
            moved = torch.cat([algo.xc - xc, algo.xa - xa]) if algo.uses_aux else algo.xc - xc
            noise = dp.z * dp.clip_norm / dp.expected * torch.randn(len(moved), generator=g, dtype=xc.dtype)
            torch.testing.assert_close(moved, noise)
    assert algo.privacy.releases == ROUNDS
