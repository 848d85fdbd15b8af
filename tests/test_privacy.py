"""Differential privacy (fedweave.privacy; docs/privacy.md): DP-FedAvg's clipping and noise, the accountants,
sampling that matches the proof, adaptive clipping, local DP, sample-level DP-SGD, and the refusals."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.runner import run
from fedweave.seeding import Seeds

# the accountants are Opacus's (fedweave[privacy]); `make test` installs it and fails at start without it
pytest.importorskip("opacus", reason="opacus is not installed (pip install 'fedweave[privacy]')")


def _cfg(toy_config: dict, privacy: dict | None = None, **top) -> dict:
    cfg = {**toy_config, "rounds": 3, **top}
    if privacy is not None:
        cfg["privacy"] = privacy
    return cfg


def _built(cfg: dict):
    return build_algorithm(RunContext(load(cfg)))


def _rounds(algo, n: int) -> torch.Tensor:
    for r in range(n):
        algo.run_round(r)
    return getattr(algo, "x", None)


def _opacus_epsilon(accountant: str, sigma: float, q: float, steps: int, delta: float) -> float:
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    acc.history = [(sigma, q, steps)]
    return acc.get_epsilon(delta=delta)


def _user_dp(z: float = 1.0, clip: float = 1.0, expected: int = 5, **kw):
    from fedweave.privacy import Accountant, UserDP

    return UserDP(mechanism=kw.pop("mechanism", "central"), clip=clip, z=z, expected=expected, sample_rate=0.1,
                  seeds=Seeds(0), accountant=Accountant("rdp", 1e-5), **kw)  # fmt: skip


# ---- 1. DP-FedAvg -------------------------------------------------------------------------------
def test_without_privacy_the_config_records_no_privacy_key(toy_config):
    assert "privacy" not in load(toy_config).to_dict()
    assert _built(toy_config).privacy is None


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "fedavgm", "fedlc", "moon"])
def test_no_noise_and_a_huge_clip_is_the_method_bit_for_bit(toy_config, name):
    algorithm = {"name": name, "clients_per_round": 4, "weighting": "uniform"}
    plain = _rounds(_built(_cfg(toy_config, algorithm=algorithm)), 3)
    private = _built(_cfg(toy_config, {"noise_multiplier": 0.0, "clip": 1e30, "amplification": "none"},
                          algorithm=algorithm))  # fmt: skip
    assert private.privacy is not None
    assert torch.equal(_rounds(private, 3), plain)


TWO_A_ROUND = {"name": "schedule", "clients": [[0, 5], [3, 7], [1, 11]]}


def test_a_schedule_divides_by_its_own_count_not_clients_per_round(toy_config):
    """E is the clients a round of the schedule takes (2 here), whatever clients_per_round says (4): without noise
    and with a huge clip, the private run is the plain one bit for bit; a schedule of varying counts divides by
    their mean over the run's rounds."""
    algorithm = {"name": "fedavg", "clients_per_round": 4, "weighting": "uniform"}
    plain = _rounds(_built(_cfg(toy_config, algorithm=algorithm, sampler=TWO_A_ROUND)), 3)
    private = _built(_cfg(toy_config, {"noise_multiplier": 0.0, "clip": 1e30}, algorithm=algorithm,
                          sampler=TWO_A_ROUND))  # fmt: skip
    assert private.privacy.expected == 2 and private.privacy.sample_rate == 1.0
    assert torch.equal(_rounds(private, 3), plain)
    uneven = {"name": "schedule", "clients": [[0, 5], [3, 7, 9], [1, 11]]}  # rounds 0-3 take 2, 3, 2, 2
    algo = _built(_cfg(toy_config, {"noise_multiplier": 1.0}, algorithm=algorithm, sampler=uneven, rounds=4))
    assert algo.privacy.expected == 9 / 4


def test_noise_moves_the_model(toy_config):
    algorithm = {"name": "fedavg", "clients_per_round": 4, "weighting": "uniform"}
    plain = _rounds(_built(_cfg(toy_config, algorithm=algorithm)), 2)
    noisy = _rounds(
        _built(_cfg(toy_config, {"noise_multiplier": 1.0, "amplification": "none"}, algorithm=algorithm)), 2
    )
    assert not torch.allclose(noisy, plain)


@pytest.mark.parametrize("per_layer", [False, True])
def test_clipped_norms_never_exceed_the_clip(per_layer):
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-3, 3, 40).unsqueeze(1)
    updates = torch.randn(40, 30, generator=g, dtype=torch.float64) * scale
    numels = [10, 5, 15]
    dp = _user_dp(clip=0.7, numels=numels if per_layer else None)
    out, weights = dp.clip(updates, torch.full((40,), 1 / 40, dtype=torch.float64))
    assert (out.norm(dim=1) <= 0.7 * (1 + 1e-12)).all()
    small = updates.norm(dim=1) <= (0.7 / math.sqrt(3) if per_layer else 0.7) * 0.999
    assert small.any() and torch.equal(out[small], updates[small])  # within the bound: untouched
    if per_layer:
        for part in out.split(numels, dim=1):
            assert (part.norm(dim=1) <= 0.7 / math.sqrt(3) * (1 + 1e-12)).all()
    assert torch.equal(weights, torch.full((40,), 1 / 5, dtype=torch.float64))  # 1/E, not 1/reporting


@pytest.mark.parametrize("per_layer", [False, True])
def test_an_update_whose_float32_norm_overflows_is_clipped_to_the_clip_not_zeroed(per_layer):
    # an attacker's update of about 1e30 (sign flipping scaled up) is finite in float32, its norm (squares summed) is
    # not: the factor C / inf was 0 and the row reached the noised sum as zeros, not as a row of norm C, so DP looked
    # like a defence the clipping does not give; float64 is the reference
    honest = torch.randn(6, 30, generator=torch.Generator().manual_seed(0)) * 0.01
    u = torch.cat([honest, -1e30 * honest[:2]])
    assert bool(torch.isfinite(u).all()) and not bool(torch.isfinite(u.norm(dim=1)).all())
    numels = [10, 5, 15]
    kw = {"clip": 0.7, "numels": numels if per_layer else None}
    want, _ = _user_dp(**kw).clip(u.double(), torch.full((8,), 1 / 8, dtype=torch.float64))
    got, _ = _user_dp(**kw).clip(u, torch.full((8,), 1 / 8))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got[:6], honest)  # within the bound: untouched
    torch.testing.assert_close(got[6:].norm(dim=1), torch.full((2,), 0.7), rtol=1e-5, atol=0)


def test_the_noise_std_is_sigma_clip_over_the_expected_clients():
    dp = _user_dp(z=1.3, clip=0.5, expected=8)
    zero = torch.zeros(500, dtype=torch.float64)
    draws = torch.stack([dp.noise(zero) for _ in range(400)])
    want = 1.3 * 0.5 / 8
    assert abs(draws.std().item() / want - 1) < 0.01  # 200,000 draws: the std's relative error is ~0.16 %
    assert abs(draws.mean().item()) < 4 * want / math.sqrt(draws.numel())
    assert dp.releases == 400


def test_local_dp_noises_each_client_and_not_the_sum():
    dp = _user_dp(z=2.0, clip=1.0, expected=4, mechanism="local")
    updates = torch.zeros(4000, 50, dtype=torch.float64)
    out, _ = dp.clip(updates, torch.full((4000,), 1 / 4000, dtype=torch.float64))
    assert abs(out.std().item() / 2.0 - 1) < 0.01  # sigma * C at each client
    mean = torch.zeros(50, dtype=torch.float64)
    assert torch.equal(dp.noise(mean), mean)


# ---- 2. accounting ------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_of_a_poisson_sampled_run_is_opacus_called_directly(toy_config, tmp_path, accountant):
    privacy = {"noise_multiplier": 1.1, "accountant": accountant, "delta": 1e-4}
    res = run(load(_cfg(toy_config, privacy, sampler="bernoulli")), run_dir=tmp_path / "r")
    want = [_opacus_epsilon(accountant, 1.1, 4 / 12, t, 1e-4) for t in (1, 2, 3)]
    assert [row["epsilon"] for row in res.metrics] == want
    s = res.summary["privacy"]
    assert s["epsilon"] == want[-1] and s["sample_rate"] == 4 / 12 and s["releases"] == 3 and s["delta"] == 1e-4
    assert res.summary["final"]["epsilon"] == want[-1]
    assert "epsilon" in (tmp_path / "r" / "metrics.csv").read_text().splitlines()[0]


def test_rdp_epsilon_is_opacus_bit_for_bit_with_each_rate_evaluated_once(monkeypatch):
    """The RDP accountant's epsilon of any history equals Opacus's RDPAccountant.get_epsilon exactly, while the
    one-release RDP of each (noise multiplier, rate) is evaluated once per run (it was evaluated again on every
    call, about 0.08 s each, and sample-level DP asks once per client rate every round)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    from fedweave.privacy import Accountant

    histories = [
        [(1.1, 0.05, 1)],
        [(1.1, 0.05, 37)],
        [(1.1, 0.05, 37), (0.7, 1.0, 3)],
        [(0.7, 1.0, 3), (1.1, 0.05, 37), (1.1, 0.3, 1000)],
        [(2.0, 0.013, 12345)],
    ]
    want = []
    for hist in histories:
        opacus = RDPAccountant()
        opacus.history = list(hist)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want.append(opacus.get_epsilon(delta=1e-5))
    calls, compute = [], analysis.compute_rdp

    def counted(**kw):
        calls.append((kw["noise_multiplier"], kw["q"]))
        return compute(**kw)

    monkeypatch.setattr(analysis, "compute_rdp", counted)
    acc = Accountant("rdp", 1e-5)
    assert [acc.epsilon(h) for h in histories] == want
    assert sorted(calls) == sorted({(z, q) for h in histories for z, q, _ in h})  # once each (Opacus: per entry)


def test_an_epsilon_asked_again_is_not_composed_again(monkeypatch):
    """Sample-level DP asks each client's history every round, unchanged for the clients the round did not train:
    Opacus composed it again each time (a PRV composition takes about 0.24 s); now once per history."""
    from opacus.accountants import PRVAccountant

    from fedweave.privacy import Accountant

    calls, get = [], PRVAccountant.get_epsilon
    monkeypatch.setattr(PRVAccountant, "get_epsilon", lambda self, **kw: calls.append(1) or get(self, **kw))
    acc = Accountant("prv", 1e-5)
    a, b = [(1.1, 0.05, 30)], [(1.1, 0.1, 15)]
    first = [acc.epsilon(a), acc.epsilon(b)]
    assert [acc.epsilon(a), acc.epsilon(b), acc.epsilon([list(a[0])])] == [*first, first[0]]
    assert len(calls) == 2


def test_a_fixed_size_sample_is_accounted_without_amplification_when_asked(toy_config, tmp_path):
    res = run(load(_cfg(toy_config, {"noise_multiplier": 2.0, "amplification": "none"})), run_dir=tmp_path / "r")
    assert res.summary["privacy"]["epsilon"] == _opacus_epsilon("rdp", 2.0, 1.0, 3, 1e-5)


def test_fixed_clients_get_no_amplification(toy_config):
    algo = _built(_cfg(toy_config, {"noise_multiplier": 2.0}, sampler={"name": "fixed", "clients": [1, 2, 5]}))
    assert algo.privacy.sample_rate == 1.0 and algo.privacy.expected == 3


def test_the_target_epsilon_stops_the_run_before_it_is_exceeded(toy_config, tmp_path):
    privacy = {"noise_multiplier": 1.0, "target_epsilon": 5.0}
    res = run(load(_cfg(toy_config, privacy, sampler="bernoulli", rounds=10)), run_dir=tmp_path / "r")
    eps = [row["epsilon"] for row in res.metrics]
    assert res.summary["rounds"] < 10 and eps[-1] <= 5.0
    assert _opacus_epsilon("rdp", 1.0, 4 / 12, res.summary["rounds"] + 1, 1e-5) > 5.0
    assert res.summary["stopped_early"].startswith("privacy budget: one more round would spend epsilon")


def test_the_prv_accountant_calibrates_below_the_rdp_floor(toy_config):
    # the target the rdp accountant cannot report (its floor 0.1029 at delta 1e-5) is within reach of prv's
    algo = _built(_cfg(toy_config, {"noise_multiplier": "auto", "target_epsilon": 0.1, "accountant": "prv"},
                       sampler="bernoulli"))  # fmt: skip
    assert 0.09 <= _opacus_epsilon("prv", algo.privacy.z, 4 / 12, 3, 1e-5) <= 0.1


def test_noise_multiplier_auto_spends_the_target_in_the_planned_rounds(toy_config):
    algo = _built(_cfg(toy_config, {"noise_multiplier": "auto", "target_epsilon": 2.0}, sampler="bernoulli", rounds=20))
    eps = _opacus_epsilon("rdp", algo.privacy.z, 4 / 12, 20, 1e-5)
    assert 1.95 <= eps <= 2.0


def test_the_accountant_resumes_from_its_state(toy_config):
    a = _built(_cfg(toy_config, {"noise_multiplier": 1.0, "adaptive": True, "count_noise": 2.0}, sampler="bernoulli"))
    _rounds(a, 2)
    b = _built(_cfg(toy_config, {"noise_multiplier": 1.0, "adaptive": True, "count_noise": 2.0}, sampler="bernoulli"))
    b.load_state_dict(a.state_dict())
    assert b.privacy.releases == 2 and b.privacy.clip_norm == a.privacy.clip_norm != 1.0
    assert b.privacy.epsilon() == a.privacy.epsilon() > 0


# ---- 3. refusals: one line naming privacy -------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({}, "sampler 'uniform' draws a fixed-size sample"),
        ({"algorithm": {"name": "scaffold", "clients_per_round": 4}, "sampler": "bernoulli"}, "algorithm 'scaffold'"),
        ({"algorithm": {"name": "feddyn", "clients_per_round": 4}, "sampler": "bernoulli"}, "algorithm 'feddyn'"),
        (
            {"algorithm": {"name": "fedavg", "clients_per_round": 4, "weighting": "samples"}, "sampler": "bernoulli"},
            "algorithm.weighting: samples",
        ),
        (
            {"sampler": "bernoulli", "privacy": {"noise_multiplier": 0.1, "target_epsilon": 1.0}},
            "exceeded by the first round alone",
        ),
        # below the RDP accountant's floor (its orders end at 63: 0.1029 at delta 1e-5) no noise reaches the target
        # (before: Opacus's traceback under auto, and advice to raise the noise that no noise follows)
        *[
            (
                {"sampler": "bernoulli", "privacy": {"noise_multiplier": z, "target_epsilon": 0.1, "level": level}},
                "privacy.target_epsilon (0.1) is below the least epsilon the rdp accountant reports at privacy.delta "
                "1e-05 with any noise (0.1029 at noise multiplier 1e+06); use privacy.accountant: prv",
            )
            for z, level in (("auto", "user"), (1e6, "user"), ("auto", "sample"))
        ],
        ({"sampler": "bernoulli", "privacy": {"adaptive": True, "count_noise": 0.4}}, "privacy.count_noise (0.4)"),
        ({"sampler": {"name": "power_of_choice"}}, "chooses clients by their losses"),
        (  # local DP's noise must be on what the client sends, and the compression stage encodes before it
            {
                "privacy": {"mechanism": "local", "noise_multiplier": 1.0},
                "compression": {"upload": {"name": "topk", "ratio": 0.1}},
            },
            "privacy.mechanism: local noises each update at its client before it is sent, but compression.upload",
        ),
        (  # local DP's clipping and noise are the client's own, which an attacker does not apply; the stage order
            # (attack, then clipping and noise) held the attackers' messages to the clip
            {
                "privacy": {"mechanism": "local", "noise_multiplier": 1.0},
                "faults": {"byzantine": {"fraction": 0.25, "attack": "sign_flip", "scale": 100.0}},
            },
            "faults.byzantine: under privacy.mechanism: local each client clips and noises its own update",
        ),
    ],
)
def test_what_the_proof_does_not_cover_is_refused_with_one_line(toy_config, change, words):
    from fedweave.registry import SAMPLERS

    if change.get("sampler") == {"name": "power_of_choice"} and "power_of_choice" not in SAMPLERS:

        @SAMPLERS.register("power_of_choice")
        def power_of_choice(num_clients, per_round, r, rng, *, rounds, context):  # a sampler that reads losses
            return np.sort(rng.choice(num_clients, per_round, replace=False))

    cfg = _cfg(toy_config, {"noise_multiplier": 1.0})
    cfg.update({k: v for k, v in change.items()})
    with pytest.raises(ConfigError) as e:
        _built(cfg)
    msg = str(e.value)
    assert "privacy" in msg and words in msg and "\n" not in msg


@pytest.mark.parametrize(("attack", "mechanism"), [("alie", "central"), ("ipm", "central"), ("min_max", "ftrl")])
def test_an_attack_that_reads_honest_updates_is_refused_under_user_level_dp(toy_config, tmp_path, attack, mechanism):
    # one honest client's data move every omniscient attacker's message too: the noised sum's sensitivity is no
    # longer C, so the epsilon the accountant reports would not bound that client (before: reported all the same)
    cfg = _cfg(toy_config, {"noise_multiplier": 1.0, "mechanism": mechanism}, sampler="bernoulli")
    cfg["faults"] = {"byzantine": {"fraction": 0.25, "attack": attack}}
    with pytest.raises(ConfigError) as e:
        run(load(cfg), run_dir=tmp_path / "r")
    msg = str(e.value)
    assert msg.startswith(f"faults.byzantine.attack: {attack} reads the round's honest updates") and "\n" not in msg
    assert "sign_flip" in msg and "alie" not in msg.split("(")[1] and not (tmp_path / "r").exists()
    cfg["faults"]["byzantine"]["attack"] = "sign_flip"  # reads only its own update: accounted as before
    assert run(load(cfg), run_dir=tmp_path / "own").summary["status"] == "completed"


@pytest.mark.parametrize(
    ("privacy", "words"),
    [
        ({"noise_multiplier": "auto"}, "privacy.noise_multiplier: auto"),
        ({"accountant": "gdp"}, "privacy.accountant must be one of prv, rdp"),
        ({"delta": 1.5}, "privacy.delta"),
        ({"level": "sample", "adaptive": True}, "privacy.adaptive applies to privacy.level: user"),
        ({"clip": 0}, "privacy.clip"),
        ({"noise_multiplier": "autox"}, "privacy.noise_multiplier must be float or auto, got 'autox'"),
        ({"noise_multiplier": True}, "privacy.noise_multiplier must be float or auto, got True"),
    ],
)
def test_bad_privacy_values_are_one_line(toy_config, privacy, words):
    with pytest.raises(ConfigError, match=None) as e:
        load(_cfg(toy_config, privacy))
    assert words in str(e.value)


_CLIENTS = "n = 12 clients, the units user-level DP protects"
_SAMPLES = "n = 1200 training samples of all clients, the units sample-level DP protects"


@pytest.mark.parametrize(
    ("build", "privacy", "units"),
    [
        ("star", {"sampler": "bernoulli"}, _CLIENTS),
        ("star", {"mechanism": "local"}, _CLIENTS),
        ("star", {"mechanism": "ftrl"}, _CLIENTS),
        ("star", {"level": "sample", "delta": 1e-3}, _SAMPLES),
        ("fedbuff", {}, _CLIENTS),
        ("hier", {}, _CLIENTS),
        ("dfl", {"level": "sample", "delta": 1e-3}, _SAMPLES),
    ],
)
def test_a_delta_not_below_one_over_the_protected_units_is_one_warning(toy_config, caplog, build, privacy, units):
    # delta: 0.5 ran without a word, though publishing one of the n protected units at random is (0, 1/n)-DP
    privacy = {"noise_multiplier": 1.0, "delta": 0.1, **privacy}
    sampler = privacy.pop("sampler", "uniform")
    cfg = {
        "star": lambda: _cfg(toy_config, privacy, sampler=sampler),
        "fedbuff": lambda: _cfg(toy_config, privacy, algorithm={"name": "fedbuff", "concurrency": 4, "buffer_size": 2}),
        "hier": lambda: _hier(toy_config, privacy),
        "dfl": lambda: _dfl(toy_config, {}, privacy),
    }[build]()
    with caplog.at_level("WARNING", logger="fedweave"):
        _built(cfg)
    said = [r.getMessage() for r in caplog.records if "privacy.delta" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(f"privacy.delta {privacy['delta']:g} is not below 1/n = ") and f"({units})" in said[0]


@pytest.mark.parametrize("privacy", [{"delta": 0.08}, {"level": "sample", "delta": 8e-4}, {}])
def test_a_delta_below_one_over_the_protected_units_is_not_warned_about(toy_config, caplog, privacy):
    # 1/12 clients = 0.083 and 1/1200 samples = 8.3e-4: just below is allowed without a word (as the default 1e-5)
    cfg = _cfg(toy_config, {"noise_multiplier": 1.0, **privacy}, sampler="bernoulli")
    with caplog.at_level("WARNING", logger="fedweave"):
        _built(cfg)
    assert "privacy.delta" not in caplog.text


@pytest.mark.parametrize(("name", "family"), [("cfl_admm", "confederated")])
def test_another_family_is_refused_with_one_line(toy_config, name, family):
    cfg = _cfg(toy_config, {"noise_multiplier": 1.0}, algorithm={"name": name})
    with pytest.raises(ConfigError, match=rf"^privacy: the {family} family is not supported yet"):
        _built(cfg)


# ---- 4. adaptive clipping -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "privacy",
    [
        {"target_quantile": 0.2},
        {"clip_lr": 0.5},
        {"count_noise": 3.0},
        {"mechanism": "ftrl", "count_noise": 3.0},
        {"mechanism": "local", "target_quantile": 0.9},
        {"level": "sample", "clip_lr": 0.5},
    ],
)
def test_an_adaptive_clipping_option_without_adaptive_clipping_is_refused_with_one_line(toy_config, privacy):
    # read by nothing when privacy.adaptive is off: the run clipped to the fixed privacy.clip, and the target
    # quantile the config asked for was silently ignored
    key = next(k for k in privacy if k in ("target_quantile", "clip_lr", "count_noise"))
    with pytest.raises(ConfigError) as e:
        load(_cfg(toy_config, {"noise_multiplier": 1.0, **privacy}))
    assert str(e.value).startswith(f"privacy.{key} applies to privacy.adaptive: true") and "\n" not in str(e.value)


@pytest.mark.parametrize("gamma", [0.3, 0.5, 0.8])
def test_adaptive_clipping_tracks_the_target_quantile_of_the_norms(gamma):
    from statistics import NormalDist

    mu, s = 0.5, 0.6  # update norms ~ lognormal(mu, s): the gamma-quantile is exp(mu + s Phi^-1(gamma))
    want = math.exp(mu + s * NormalDist().inv_cdf(gamma))
    dp = _user_dp(z=0.0, clip=0.1, expected=100, adaptive=True, target_quantile=gamma, clip_lr=0.2, count_noise=1.0)
    g = torch.Generator().manual_seed(1)
    clips = []
    for _ in range(400):
        direction = torch.nn.functional.normalize(torch.randn(100, 8, generator=g, dtype=torch.float64), dim=1)
        norms = torch.exp(mu + s * torch.randn(100, 1, generator=g, dtype=torch.float64))
        updates, weights = dp.clip(direction * norms, torch.full((100,), 0.01, dtype=torch.float64))
        dp.noise(weights @ updates)
        clips.append(dp.clip_norm)
    assert abs(np.mean(clips[-200:]) / want - 1) < 0.05  # from C = 0.1, far below: it climbs and stays


def test_adaptive_clipping_accounts_the_count_noise_by_theorem_1():
    dp = _user_dp(z=1.0, adaptive=True, count_noise=5.0)
    # z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (Andrew et al. 2021, Sec. 3); the pair is accounted as z
    assert dp.z_update == pytest.approx((1.0 - 1 / 100) ** -0.5, rel=1e-15)
    updates, weights = dp.clip(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    dp.noise(weights @ updates)
    assert dp.accountant.history == [(1.0, 0.1, 1)]


@pytest.mark.parametrize("norm", [0.5, 2.0])  # the added client's update unclipped (b = 1) and clipped (b = 0)
def test_adaptive_clipping_count_moves_by_at_most_one_half_for_one_client(norm):
    # Theorem 1's (2 sigma_b)^-2 holds for a count of sensitivity 1/2: the noised sum of b_i - 1/2 (Andrew et al.'s
    # reference implementation). The uncentred sum of b_i moves by 1 when one client is added: z understated.
    def noised_count(rows: torch.Tensor) -> float:
        dp = _user_dp(z=1.0, clip=1.0, expected=10, adaptive=True, clip_lr=0.2, count_noise=5.0)
        updates, weights = dp.clip(rows, torch.ones(len(rows), dtype=torch.float64))
        dp.noise(weights @ updates)
        # C' = C exp(-eta_C (b~ - gamma)): the released b~ times E, up to what does not depend on the data
        return -math.log(dp.clip_norm) / 0.2 * 10

    g = torch.Generator().manual_seed(0)
    rows = torch.nn.functional.normalize(torch.randn(6, 4, generator=g, dtype=torch.float64), dim=1)
    rows = rows * torch.tensor([0.3, 0.7, 1.5, 0.2, 3.0, 0.9], dtype=torch.float64)[:, None]
    one_more = torch.cat([rows, torch.full((1, 4), norm / 2, dtype=torch.float64)])
    assert abs(noised_count(one_more) - noised_count(rows)) == pytest.approx(0.5, abs=1e-9)


def test_a_private_run_with_adaptive_clipping_records_its_clip(toy_config, tmp_path):
    privacy = {"noise_multiplier": 1.0, "adaptive": True, "count_noise": 2.0}
    res = run(load(_cfg(toy_config, privacy, sampler="bernoulli")), run_dir=tmp_path / "r")
    clips = [row["dp_clip"] for row in res.metrics]
    assert len(set(clips)) == 3 and res.summary["privacy"]["clip"] == clips[-1]


# ---- 5. local DP --------------------------------------------------------------------------------
def test_local_dp_is_accounted_per_client_with_sensitivity_2c(toy_config, tmp_path):
    privacy = {"mechanism": "local", "noise_multiplier": 4.0}
    res = run(load(_cfg(toy_config, privacy, sampler="bernoulli")), run_dir=tmp_path / "r")
    # a client in every round, its message the Gaussian mechanism with sensitivity 2C: z / 2, no amplification
    assert res.summary["privacy"]["epsilon"] == _opacus_epsilon("rdp", 2.0, 1.0, 3, 1e-5)
    # no amplification, so the fixed-size default sampler is as good as any
    assert _built(_cfg(toy_config, privacy)).privacy.sample_rate == 1.0


# ---- 6. sample-level DP-SGD ---------------------------------------------------------------------
def test_dpsgd_per_sample_gradients_equal_a_loop_over_single_samples():
    from fedweave.execution.dpsgd import DPSGD
    from fedweave.execution.params import ParamLayout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    layout = ParamLayout(model.double())
    dp = DPSGD(layout, 1.0, 0.0, Seeds(0), 0, [0])
    v = layout.flatten()
    x, y = torch.randn(7, 1, 3, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    grads, losses = dp.per_sample(v, x, y)
    for b in range(7):
        w = v.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(layout.functional(w, x[b : b + 1]), y[b : b + 1])
        (g,) = torch.autograd.grad(loss, w)
        torch.testing.assert_close(grads[b], g, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(losses[b], loss.detach(), rtol=1e-12, atol=1e-14)


def _sample_level(toy_config, backend: str) -> dict:
    privacy = {"level": "sample", "noise_multiplier": 1.5, "clip": 0.5}
    return _cfg(toy_config, privacy, sampler="bernoulli", backend=backend, precision="float64")


def test_sample_level_dpsgd_loop_and_vmap_agree(toy_config):
    a, b = _built(_sample_level(toy_config, "loop")), _built(_sample_level(toy_config, "vmap"))
    torch.testing.assert_close(_rounds(a, 2), _rounds(b, 2), rtol=1e-10, atol=1e-12)
    assert (a.privacy.trainer.steps_done == b.privacy.trainer.steps_done).all()


def test_sample_level_epsilon_is_opacus_per_client_at_rate_batch_over_size(toy_config, tmp_path):
    res = run(load(_sample_level(toy_config, "loop")), run_dir=tmp_path / "r")
    algo = res.algorithm
    sizes = np.array([len(p) for p in algo.ctx.partition])
    steps = algo.privacy.trainer.steps_done
    want = max(_opacus_epsilon("rdp", 1.5, min(1.0, 16 / n), int(s), 1e-5) for n, s in zip(sizes, steps) if s)
    assert res.summary["privacy"]["epsilon"] == want and res.summary["privacy"]["level"] == "sample"
    plain = _built(_cfg(toy_config, sampler="bernoulli"))
    _rounds(plain, 3)
    # the steps the accountant is told are the local steps the clients did: ceil(n_i / B) per epoch and round
    took = np.zeros(len(sizes), dtype=np.int64)
    for r in range(3):
        for c in plain.sampler(r):
            took[c] += plain.trainer.num_steps(int(c))
    assert (steps == took).all()


def test_sample_level_epsilon_is_the_worst_clients_not_that_of_the_client_with_the_most_steps(toy_config, tmp_path):
    """summary.json's epsilon is the largest over the clients, each at its own (q_i = B / n_i, steps_i): a small
    client (large q_i, few steps) can spend more than the client with ``max_local_steps`` (small q_i), so the
    epsilon reported is not that client's (docs/privacy.md, "Where epsilon appears")."""
    res = run(load(_sample_level(toy_config, "loop")), run_dir=tmp_path / "r")
    algo, summary = res.algorithm, res.summary["privacy"]
    sizes = np.array([len(p) for p in algo.ctx.partition])
    steps = algo.privacy.trainer.steps_done
    per_client = {c: _opacus_epsilon("rdp", 1.5, min(1.0, 16 / n), int(s), 1e-5)
                  for c, (n, s) in enumerate(zip(sizes, steps)) if s}  # fmt: skip
    most_steps = int(np.argmax(steps))
    assert summary["max_local_steps"] == steps[most_steps]
    assert summary["epsilon"] == max(per_client.values())
    assert summary["epsilon"] > per_client[most_steps]  # the worst client is another one


def test_the_sam_methods_are_refused_at_sample_level(toy_config):
    cfg = _cfg(
        toy_config, {"level": "sample"}, sampler="bernoulli", algorithm={"name": "fedsam", "clients_per_round": 4}
    )
    with pytest.raises(ConfigError, match=r"^privacy.level: sample with algorithm 'fedsam'"):
        _built(cfg)


def test_fedlc_is_dp_fedavg_at_user_level_and_refused_in_one_line_at_sample_level(toy_config):
    """Its clients send one model update each and its server is FedAvg's; its own loss (the calibrated
    cross-entropy) is outside what DP-SGD clips, so sample level stops at its first round with one line."""
    algorithm = {"name": "fedlc", "clients_per_round": 4}
    user = _built(_cfg(toy_config, {"noise_multiplier": 1.0}, sampler="bernoulli", algorithm=algorithm))
    _rounds(user, 2)
    assert user.privacy.metrics()["epsilon"] > 0
    sample = _built(_cfg(toy_config, {"level": "sample"}, sampler="bernoulli", algorithm=algorithm))
    with pytest.raises(
        ConfigError, match=r"^privacy.level: sample: the method's local rule trains on a loss of its own"
    ):
        _rounds(sample, 1)


def test_moon_is_dp_fedavg_at_user_level_and_refused_in_one_line_at_sample_level(toy_config):
    """Its clients send one model update each (their previous model stays with them) and its server is FedAvg's;
    its contrastive term is outside what DP-SGD clips, so sample level stops at its first round with one line."""
    algorithm = {"name": "moon", "clients_per_round": 4}
    user = _built(_cfg(toy_config, {"noise_multiplier": 1.0}, sampler="bernoulli", algorithm=algorithm))
    _rounds(user, 2)
    assert user.privacy.metrics()["epsilon"] > 0
    assert user.store.rows("prev", np.arange(user.ctx.num_clients)).abs().sum() > 0  # its clients kept their models
    sample = _built(_cfg(toy_config, {"level": "sample"}, sampler="bernoulli", algorithm=algorithm))
    with pytest.raises(ConfigError, match=r"^privacy.level: sample: the method's local rule adds a term to the loss"):
        _rounds(sample, 1)


def test_batches_that_can_hold_a_sample_twice_are_refused_at_sample_level(toy_config):
    """Under local.steps the fixed-size batches are cut from a stream of reshuffled epochs, so a batch that spans
    two epochs (n_i not a multiple of B, and k B > n_i) can hold one sample twice: that DP-SGD step's sum moves by
    2C when the sample goes, not C, and accounting it with the noise multiplier sigma (at q_i = 1 when n_i < B, or
    under amplification: none) understates epsilon. Refused in one line; local.epochs (an epoch's batches are
    disjoint) and batches that stay within one epoch run."""
    parts = {"name": "dirichlet", "num_clients": 12, "alpha": 0.1, "min_size": 5}
    steps = {"steps": 6, "batch_size": 16, "lr": 0.1}
    plain = _built(_cfg(toy_config, partition=parts, local=steps))
    sizes = [len(p) for p in plain.ctx.partition]
    tiny = int(np.argmin(sizes))
    assert sizes[tiny] < 16
    copies = [max(np.unique(b.numpy(), return_counts=True)[1]) for b in plain.trainer.client_batches(tiny, 0, (), None)]
    assert max(copies) >= 2  # the same sample more than once in one batch
    for amplification in ("auto", "none"):
        dp = {"level": "sample", "noise_multiplier": 1.0, "amplification": amplification}
        words = r"^privacy.level: sample with local.steps: client \d+'s \d+ samples"
        with pytest.raises(ConfigError, match=words) as e:
            _built(_cfg(toy_config, dp, partition=parts, local=steps))
        assert "\n" not in str(e.value)
    dp = {"level": "sample", "noise_multiplier": 1.0}
    assert _built(_cfg(toy_config, dp, partition=parts, local={"epochs": 1, "batch_size": 16, "lr": 0.1})).privacy
    assert _built(_cfg(toy_config, dp, partition=parts, local={**steps, "steps": 1, "batch_size": 4})).privacy


def test_a_batchnorm_model_is_refused_at_sample_level(toy_config):
    """DP-SGD's per-sample gradients run the model on one sample at a time, so a BatchNorm layer (batch statistics)
    would normalize each sample by itself: without noise and clipping the step is not plain SGD's (it is for the
    same model without BatchNorm, to rounding). Refused in one line; user-level DP (whole updates) still runs."""
    cfg = _cfg(toy_config, rounds=1, precision="float64", dataset={"name": "_toy", "side": 28},
               local={"steps": 2, "batch_size": 8, "lr": 0.05})  # fmt: skip
    plain, private = (
        dict(cfg, model={"name": "cnn_mnist"}),
        _cfg(cfg, {"level": "sample", "clip": 1e30, "noise_multiplier": 0.0}),
    )
    private["model"] = {"name": "cnn_mnist"}
    a, b = _built(plain), _built(private)
    torch.testing.assert_close(_rounds(b, 1), _rounds(a, 1), rtol=1e-10, atol=1e-12)
    with pytest.raises(
        ConfigError, match=r"^privacy.level: sample: the model has BatchNorm2d layers.*privacy.level: user$"
    ):
        _built(dict(private, model={"name": "cnn_mnist", "norm": "batch"}))
    user = _cfg(cfg, {"noise_multiplier": 1.0}, sampler="bernoulli", model={"name": "cnn_mnist", "norm": "batch"})
    assert _built(user).privacy is not None


# ---- outputs ------------------------------------------------------------------------------------
def test_the_report_and_the_list_show_privacy(toy_config, tmp_path, capsys):
    from fedweave.cli import main
    from fedweave.experiments.report import build_report

    run(load(_cfg(toy_config, {"noise_multiplier": 1.0}, sampler="bernoulli")), run_dir=tmp_path / "r")
    page = build_report([tmp_path / "r"])
    assert "<th>epsilon</th>" in page and "<th>delta</th>" in page
    assert "test_accuracy_vs_epsilon.png" in page and "epsilon_vs_rounds.png" in page
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    # the names privacy.mechanism takes, apart from the two that other keys switch on (it refuses those names)
    mechanisms = "central, ftrl, local; adaptive (privacy.adaptive: true); dpsgd (privacy.level: sample)"
    assert f"privacy mechanisms (privacy.mechanism): {mechanisms}" in out and "privacy accountants: prv, rdp" in out


def _dfl(toy_config, algorithm: dict, privacy: dict | None) -> dict:
    algo = {"name": "dfedavg", "topology": "random_regular", "degree": 3, "neighbours": 3, **algorithm}
    return _cfg(toy_config, privacy, algorithm=algo, rounds=2, precision="float64")


def test_sample_level_without_amplification_accounts_every_step_at_rate_one(toy_config, tmp_path):
    # the local batches are a shuffled pass, which Opacus's Poisson bound does not cover: amplification: none must
    # account each DP-SGD step at q = 1 (valid for any batching), not at B / n_i
    privacy = {"level": "sample", "noise_multiplier": 1.5, "clip": 0.5, "amplification": "none"}
    res = run(load(_cfg(toy_config, privacy, precision="float64")), run_dir=tmp_path / "r")
    steps = res.algorithm.privacy.trainer.steps_done
    assert (res.algorithm.privacy.rates == 1.0).all()
    assert res.summary["privacy"]["epsilon"] == _opacus_epsilon("rdp", 1.5, 1.0, int(steps.max()), 1e-5)


def test_sample_level_accepts_a_loss_blind_client_sampler_of_any_kind(toy_config):
    # each client is accounted by its own DP-SGD steps whoever drew it: the client sampler amplifies nothing here
    assert _built(_cfg(toy_config, {"level": "sample", "noise_multiplier": 1.0})).privacy is not None


def test_the_decentralized_dpsgd_rule_reports_its_epsilon_and_trains_as_before(toy_config, tmp_path):
    dp = {"dp_sigma": 1.2, "dp_clip": 0.8}
    before = _built(_dfl(toy_config, dp, None))
    _rounds(before, 2)
    assert before.privacy is None
    res = run(load(_dfl(toy_config, dp, {"level": "sample", "noise_multiplier": 1.2, "clip": 0.8})),
              run_dir=tmp_path / "r")  # fmt: skip
    assert torch.equal(res.algorithm.W, before.W)  # the same DP-SGD, now accounted
    sizes = np.array([len(p) for p in res.algorithm.ctx.partition])
    steps = res.algorithm.privacy.trainer.steps_done
    assert (steps > 0).all()
    want = max(_opacus_epsilon("rdp", 1.2, min(1.0, 16 / n), int(s), 1e-5) for n, s in zip(sizes, steps))
    assert res.summary["privacy"]["epsilon"] == want == res.metrics[-1]["epsilon"]


@pytest.mark.parametrize(
    ("algorithm", "privacy", "words"),
    [
        ({}, {"noise_multiplier": 1.0}, "use privacy.level: sample"),
        ({"dp_sigma": 1.0}, {"level": "sample", "noise_multiplier": 2.0}, "set the noise once"),
        ({"dp_sigma": 1.0, "dp_mode": "exchange", "mixing": "sampled"}, {"level": "sample"}, "dp_mode: exchange"),
    ],
)
def test_the_decentralized_family_refuses_what_it_cannot_account(toy_config, algorithm, privacy, words):
    with pytest.raises(ConfigError) as e:
        _built(_dfl(toy_config, algorithm, privacy))
    assert str(e.value).startswith("privacy: ") and words in str(e.value)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "pens", "m_top": 2},
        {"name": "fomo"},
        {"name": "federico"},
        {"name": "afind_plus"},
        {"name": "dispfl"},
        {"name": "dfedavg", "selection": "topk", "select_k": 2},
        {"name": "ditto", "selection": "afind"},
    ],
)
def test_sample_level_dp_refuses_dfl_methods_that_read_their_data_outside_dp_sgd(toy_config, algorithm):
    # scores of the neighbours' models on a peer's own data (PENS, FoMo, FedeRiCo, AFIND+, selection topk/afind) and
    # DisPFL's mask regrowth from a plain gradient choose what is sent from unclipped, unnoised functions of the
    # data: the DP-SGD steps' epsilon does not bound them
    with pytest.raises(ConfigError) as e:
        _built(_dfl(toy_config, algorithm, {"level": "sample", "noise_multiplier": 1.0}))
    assert str(e.value).startswith("privacy: ") and "outside its DP-SGD steps" in str(e.value)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "dfedavg", "topology": "random_regular", "degree": 3, "neighbours": 3},
        {"name": "ditto", "topology": "random_regular", "degree": 3, "neighbours": 3},
        {"name": "choco_sgd", "topology": "random_regular", "degree": 3},
        {"name": "local"},
    ],
)
def test_sample_level_dp_accepts_dfl_methods_that_read_their_data_only_in_dp_sgd(toy_config, algorithm):
    cfg = _cfg(toy_config, {"level": "sample", "noise_multiplier": 1.0}, algorithm=algorithm, rounds=2)
    assert _built(cfg).privacy is not None


def test_the_docs_table_is_generated_from_the_committed_records():
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("privacy_bench", root / "benchmarks" / "privacy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    records = json.loads(bench.RECORDS.read_text())
    assert len(records) == len(bench.POINTS) * len(bench.SEEDS)
    text = bench.DOCS.read_text()
    assert bench.docs_with_table(text, records) == text  # the page holds exactly the table of the records
    assert bench.table(records) in text


def test_a_resumed_private_run_continues_the_accountant_and_the_adaptive_clip(toy_config, tmp_path):
    from fedweave.runner import resume

    privacy = {"noise_multiplier": 1.0, "adaptive": True, "count_noise": 2.0}
    whole = run(load(_cfg(toy_config, privacy, sampler="bernoulli", rounds=4)), run_dir=tmp_path / "whole")
    cfg = _cfg(toy_config, privacy, sampler="bernoulli", rounds=2)
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    run(load(cfg), run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=4"])
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert [r["dp_clip"] for r in res.metrics] == [r["dp_clip"] for r in whole.metrics]
    assert torch.equal(res.algorithm.x, whole.algorithm.x)


def test_the_sample_level_budget_looks_ahead_by_each_clients_own_round(toy_config, tmp_path):
    """The look-ahead adds to each client its own round of steps, at its own q_i: a client of n_i <= B has q_i = 1
    and one step an epoch, the largest client many steps at a small q_i. Before, every client was looked ahead with
    the most steps of any client, and the first look at the largest q_i: eps(1.0, q = 1, 19 steps) = 29.1, which
    refused a target of 8 as 'exceeded by the first round alone', where no client's first round spends more than
    5.78 and the whole run 4.89."""
    parts = {"name": "dirichlet", "num_clients": 12, "alpha": 0.1, "min_size": 5}
    schedule = {"name": "schedule", "clients": [[3], [3], [0], [3]]}
    top = dict(partition=parts, sampler=schedule, algorithm={"name": "fedavg", "clients_per_round": 1}, rounds=4,
               local={"epochs": 1, "batch_size": 16, "lr": 0.1})  # fmt: skip
    free = run(load(_cfg(toy_config, {"level": "sample", "noise_multiplier": 1.0}, **top)), run_dir=tmp_path / "f")
    algo = free.algorithm
    rates, sizes = algo.privacy.rates, [len(p) for p in algo.ctx.partition]
    steps = [algo.trainer.num_steps(c) for c in range(12)]
    assert rates.max() == 1.0 and max(steps) == steps[int(np.argmax(sizes))] > 1
    first = max(_opacus_epsilon("rdp", 1.0, float(q), s, 1e-5) for q, s in zip(rates, steps) if s)
    eps = [r["epsilon"] for r in free.metrics]
    assert eps[0] < first < 8.0 and eps[-1] < 8.0  # the first look: the worst client's own round
    dp = {"level": "sample", "noise_multiplier": 1.0, "target_epsilon": 8.0}
    capped = run(load(_cfg(toy_config, dp, **top)), run_dir=tmp_path / "c")
    assert [r["epsilon"] for r in capped.metrics] == eps and "stopped_early" not in capped.summary


def test_a_resumed_sample_level_run_stops_at_the_budget_where_the_uninterrupted_run_does(toy_config, tmp_path):
    """The budget's look-ahead adds the steps clients did since its last look; a resumed run's first look counts
    from the checkpoint, as the uninterrupted run's does, not from the run's start (which would stop it early)."""
    from fedweave.runner import resume

    # The uninterrupted run's looks reach 4 rounds' steps (epsilon 6.44); a resumed look counted from the run's
    # start after round 3 would see 3 + 3 = 6 rounds' (7.94): the target lies between. (At 8 rounds resumed
    # after 5 with a target of 14, the miscounted look, 10 rounds' steps, stayed below the target.)
    privacy = {"level": "sample", "noise_multiplier": 1.5, "clip": 0.5, "target_epsilon": 7.0}
    cfg = _cfg(toy_config, privacy, sampler="bernoulli", precision="float64", rounds=4)
    whole = run(load(cfg), run_dir=tmp_path / "whole")
    part = {**cfg, "rounds": 3, "output": {**cfg["output"], "checkpoint_every": 1}}
    run(load(part), run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=4"])
    assert len(whole.metrics) == 4  # the budget holds for all 4 rounds
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert torch.equal(res.algorithm.x, whole.algorithm.x)


def test_a_resumed_run_asks_the_budget_before_its_first_round(toy_config, tmp_path):
    """A run ended at its last round never asked the budget about the next one; extended by a resume, it asks
    before its first round, as the uninterrupted run asked after that round: one more round past the target
    is not run, and the run ends as the uninterrupted one did (before: it released a round beyond
    target_epsilon)."""
    from fedweave.runner import resume

    cfg = _cfg(toy_config, {"noise_multiplier": 1.0, "target_epsilon": 5.0}, sampler="bernoulli", rounds=8)
    whole = run(load(cfg), run_dir=tmp_path / "whole")
    assert len(whole.metrics) == 2 and "privacy budget" in whole.summary["stopped_early"]
    part = {**cfg, "rounds": 2, "output": {**cfg["output"], "checkpoint_every": 1}}
    run(load(part), run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=8"])
    kept = ("round", "test_accuracy", "test_loss", "epsilon")
    assert [[m[k] for k in kept] for m in res.metrics] == [[m[k] for k in kept] for m in whole.metrics]  # no more
    assert res.summary["stopped_early"] == whole.summary["stopped_early"]
    assert res.summary["stopped_early"].startswith("privacy budget: one more round would spend epsilon 5.205 > ")


# ---- the hierarchical family's client step ------------------------------------------------------
def _hier(toy_config, privacy: dict | None, **algo) -> dict:
    cfg = _cfg(toy_config, privacy, precision="float64", sampler="bernoulli")
    cfg["partition"] = {"name": "iid", "num_clients": 12}
    cfg["algorithm"] = {"name": "hier_fedavg", "tau": 2, "participation": 0.5, **algo}
    return cfg


def test_hierarchical_dp_fedavg_without_noise_is_the_plain_mean_of_the_clients_models(toy_config):
    a = _built(_hier(toy_config, {"noise_multiplier": 0.0, "clip": 1e30}))
    b = _built(_hier(toy_config, None))
    assert a.privacy.sample_rate == 0.5 and a.privacy.expected == 6
    for r in range(2):
        clients = a.sample_clients(r)
        x = a.x.clone()
        a.run_round(r)
        b.run_round(r)
        models = b.trainer.train(x, clients, r, lr=b.local_lr(), steps=b.round_steps(r)).params
        torch.testing.assert_close(a.x, x + (models - x).sum(0) / 6, rtol=1e-12, atol=1e-14)


def test_hierarchical_dp_fedavg_is_accounted_and_clipped(toy_config, tmp_path):
    res = run(load(_hier(toy_config, {"noise_multiplier": 1.3, "clip": 0.2})), run_dir=tmp_path / "r")
    assert res.summary["privacy"]["epsilon"] == _opacus_epsilon("rdp", 1.3, 0.5, 3, 1e-5)
    assert (res.algorithm.privacy.last_norms > 0.2).any()  # the clip bound the updates


@pytest.mark.parametrize(
    ("algo", "words"),
    [
        ({"name": "hier_scaffold"}, "algorithm 'hier_scaffold' is refused"),
        ({"name": "zo_hfl", "server_batch_size": 16}, "algorithm 'zo_hfl' is refused"),
        ({"server_data": "client"}, "algorithm.server_data: client"),
    ],
)
def test_the_hierarchical_family_refuses_what_the_proof_does_not_cover(toy_config, algo, words):
    with pytest.raises(ConfigError) as e:
        _built(_hier(toy_config, {"noise_multiplier": 1.0}, **algo))
    assert str(e.value).startswith("privacy") and words in str(e.value)


def test_without_opacus_a_private_run_is_one_line_naming_the_extra(toy_config, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "opacus", None)  # import opacus now raises ImportError
    with pytest.raises(ConfigError, match=r"^privacy: the accountants need Opacus.*pip install 'fedweave\[privacy\]'"):
        _built(_cfg(toy_config, {"noise_multiplier": 1.0}, sampler="bernoulli"))


def test_the_command_line_says_what_a_private_run_spent_and_why_it_stopped(toy_config, tmp_path, capsys):
    import yaml

    from fedweave.cli import main

    cfg = _cfg(toy_config, {"noise_multiplier": 1.0, "target_epsilon": 5.0}, sampler="bernoulli", rounds=10)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    eps = json.loads((tmp_path / "r" / "summary.json").read_text())["privacy"]["epsilon"]
    assert f"privacy: epsilon {eps:.4g} at delta 1e-05 (rdp accountant)" in lines
    assert any(line.startswith("stopped early: privacy budget: one more round") for line in lines)


def test_per_layer_clipping_runs_and_bounds_each_layer(toy_config):
    algo = _built(_cfg(toy_config, {"noise_multiplier": 0.0, "clip": 0.05, "per_layer": True}, sampler="bernoulli"))
    assert algo.privacy.numels == list(algo.layout.numels) and len(algo.layout.numels) == 2  # weight, bias
    x = algo.x.clone()
    algo.run_round(0)
    share = 0.05 / math.sqrt(2)
    moved = (algo.x - x) * algo.privacy.expected  # the sum of the clipped updates (no noise)
    reported = len(algo.privacy.last_norms)
    for part in moved.split(algo.layout.numels):
        assert part.norm() <= reported * share * (1 + 1e-5)
    assert (algo.privacy.last_norms > 0.05).all()  # every update was clipped


def test_sample_level_auto_calibrates_for_the_client_with_the_most_steps(toy_config):
    privacy = {"level": "sample", "noise_multiplier": "auto", "target_epsilon": 3.0}
    algo = _built(_cfg(toy_config, privacy, sampler="bernoulli"))
    steps = max(algo.trainer.num_steps(c) for c in range(12)) * 3
    eps = _opacus_epsilon("rdp", algo.privacy.z, float(algo.privacy.rates.max()), steps, 1e-5)
    assert 2.95 <= eps <= 3.0 and algo.privacy.trainer.dp_sigma == algo.privacy.z


def test_algorithm_sampling_bernoulli_is_poisson_sampling_too(toy_config):
    algorithm = {"name": "fedavg", "clients_per_round": 4, "sampling": "bernoulli"}
    algo = _built(_cfg(toy_config, {"noise_multiplier": 1.0}, algorithm=algorithm))
    assert algo.privacy.sample_rate == 4 / 12 and algo.privacy.expected == 4


# ---- DP-FTRL (Kairouz et al. 2021): tree aggregation, no amplification ------------------------------
def _ftrl(toy_config, privacy: dict | None = None, **top) -> dict:
    algorithm = top.pop("algorithm", {"name": "fedavg", "clients_per_round": 4, "weighting": "uniform"})
    return _cfg(toy_config, {"mechanism": "ftrl", **(privacy or {})}, algorithm=algorithm, **top)


# each of the 12 clients once in every period of 3 rounds: the paper's participation pattern
ONCE_PER_PERIOD = {"name": "schedule", "clients": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]}


def _ftrl_dp(z: float = 1.0, clip: float = 1.0, expected: int = 4, **kw):
    from fedweave.privacy import FTRLDP, Accountant

    return FTRLDP(clip=clip, z=z, expected=expected, sample_rate=1.0, seeds=Seeds(0),
                  accountant=Accountant("rdp", 1e-5), restart_every=kw.pop("restart_every", None),
                  momentum=kw.pop("momentum", 0.0), **kw)  # fmt: skip


@pytest.mark.parametrize("restart_every", [None, 2])
def test_dp_ftrl_without_noise_and_clip_is_fedavg_bit_for_bit(toy_config, restart_every):
    plain = _rounds(_built(_cfg(toy_config, algorithm={"name": "fedavg", "clients_per_round": 4,
                                                       "weighting": "uniform", "server_lr": 0.7})), 4)  # fmt: skip
    private = _built(_ftrl(toy_config, {"noise_multiplier": 0.0, "clip": 1e30, "restart_every": restart_every},
                           algorithm={"name": "fedavg", "clients_per_round": 4, "weighting": "uniform",
                                      "server_lr": 0.7}))  # fmt: skip
    assert private.privacy.mechanism == "ftrl" and private.privacy.sample_rate == 1.0
    assert torch.equal(_rounds(private, 4), plain)


def test_dp_ftrlm_without_noise_is_fedavgm_bit_for_bit(toy_config):
    fedavgm = {"name": "fedavgm", "clients_per_round": 4, "weighting": "uniform", "beta1": 0.6, "server_lr": 0.5}
    plain = _rounds(_built(_cfg(toy_config, algorithm=fedavgm)), 4)
    fedavg = {"name": "fedavg", "clients_per_round": 4, "weighting": "uniform", "server_lr": 0.5}
    private = _built(_ftrl(toy_config, {"noise_multiplier": 0.0, "clip": 1e30, "momentum": 0.6}, algorithm=fedavg))
    assert torch.equal(_rounds(private, 4), plain)


@pytest.mark.parametrize("momentum", [0.0, 0.7])
def test_dp_ftrl_model_is_x0_plus_eta_times_the_noised_prefix_sum(momentum):
    # FedAvg's step on the mechanism's outputs is the paper's x_t = x_0 + eta m_t, m_t = gamma m_{t-1} + S~_t, with
    # S~_t = (sum_{s<=t} g_s + sigma C N_t) / E and N_t the tree's prefix noise; a restart starts from x_t afresh
    from fedweave.privacy import TreeNoise

    dp = _ftrl_dp(z=1.3, clip=0.5, expected=4, restart_every=5, momentum=momentum)
    noise = TreeNoise(Seeds(0), 30, torch.float64)
    g = torch.Generator().manual_seed(2)
    eta, x = 0.8, torch.zeros(30, dtype=torch.float64)
    x0, prefix, m = x.clone(), torch.zeros(30, dtype=torch.float64), torch.zeros(30, dtype=torch.float64)
    for r in range(8):
        tree, t = divmod(r, 5)
        if t == 0:
            x0, prefix, m = x.clone(), torch.zeros_like(prefix), torch.zeros_like(m)
        updates, weights = dp.clip(torch.randn(4, 30, generator=g, dtype=torch.float64) * 0.3,
                                   torch.full((4,), 0.25, dtype=torch.float64), np.arange(4) + r)  # fmt: skip
        total = weights @ updates
        x = x + eta * dp.noise(total)
        prefix = prefix + total
        m = momentum * m + prefix + 1.3 * 0.5 / 4 * noise.prefix(tree, t + 1)
        torch.testing.assert_close(x, x0 + eta * m, rtol=1e-12, atol=1e-12)
    assert dp.tree == 1 and len(dp.leaves) == 3


def test_the_tree_prefix_noise_is_the_sum_of_the_nodes_of_the_binary_decomposition():
    from fedweave.privacy import TreeNoise, decomposition

    noise = TreeNoise(Seeds(5), 16, torch.float64)
    running = torch.zeros(16, dtype=torch.float64)
    for t in range(1, 40):
        nodes = decomposition(t)
        assert len(nodes) == bin(t).count("1") and max(h for h, _ in nodes) == t.bit_length() - 1
        spans = sorted((range(k * 2**h + 1, (k + 1) * 2**h + 1) for h, k in nodes), key=lambda s: s.start)
        assert [leaf for span in spans for leaf in span] == list(range(1, t + 1))  # a partition of [1, t]
        want = sum((noise.node(0, h, k) for h, k in nodes), torch.zeros(16, dtype=torch.float64))
        assert torch.equal(noise.prefix(0, t), want)
        running = running + noise.increment(0, t)
        torch.testing.assert_close(running, want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(noise.node(0, 0, 0), noise.node(1, 0, 0))  # each tree its own nodes


def test_the_prefix_noise_variance_is_the_number_of_nodes_times_sigma_c_squared():
    dp = _ftrl_dp(z=1.5, clip=0.4, expected=1)
    zero = torch.zeros(40_000, dtype=torch.float64)
    s, prefixes = torch.zeros_like(zero), []
    for _ in range(8):
        dp.clip(zero.unsqueeze(0), torch.ones(1, dtype=torch.float64), np.array([0]))
        s = s + dp.noise(zero)
        prefixes.append(s)
    unit = (1.5 * 0.4) ** 2
    for t, p in enumerate(prefixes, start=1):  # 40,000 draws: the variance's relative error is ~0.7 %
        assert abs(p.var().item() / (bin(t).count("1") * unit) - 1) < 0.035
    # prefixes 6 = [1,4]+[5,6] and 7 = [1,4]+[5,6]+[7] share two nodes: their covariance is 2 sigma^2 C^2
    assert abs((prefixes[5] * prefixes[6]).mean().item() / (2 * unit) - 1) < 0.035
    assert abs((prefixes[3] * prefixes[4]).mean().item() / unit - 1) < 0.035  # 4 and 5 share [1,4]


def test_the_tree_sensitivity_counts_every_released_node_of_a_client():
    from fedweave.privacy import tree_sensitivity

    once = [np.array([0]), np.array([1]), np.array([2]), np.array([3]), np.array([4])]
    assert tree_sensitivity(once) == 3 == (5).bit_length()  # leaf 1 in [1], [1,2], [1,4]; [1,8] is not released
    assert tree_sensitivity(once[:4]) == 3 and tree_sensitivity(once[:1]) == 1
    # one client in all 4 leaves: [1], [3], [1,2] (2^2) and [1,4] (4^2); [2], [4] and [3,4] are in no prefix sum
    every = [np.array([7])] * 4
    assert tree_sensitivity(every) == 1 + 1 + 4 + 16
    assert tree_sensitivity([np.array([0, 1]), np.array([1])]) == 1 + 4  # client 1 in [1] and twice in [1,2]


# The released nodes of a tree of T leaves, enumerated by hand as spans [first leaf, last leaf]: those that the
# prefix sums S~_1..S~_T add (S~_1 = [1], S~_2 = [1,2], S~_3 = [1,2] + [3], S~_4 = [1,4], S~_5 = [1,4] + [5],
# S~_6 = [1,4] + [5,6], S~_7 = [1,4] + [5,6] + [7], S~_8 = [1,8]); the right children [2], [4], [3,4], [6], [8],
# [7,8], [5,8] are in none of them.
RELEASED_BY_HAND = {
    1: [(1, 1)],
    2: [(1, 1), (1, 2)],
    3: [(1, 1), (1, 2), (3, 3)],
    4: [(1, 1), (1, 2), (3, 3), (1, 4)],
    7: [(1, 1), (1, 2), (3, 3), (1, 4), (5, 5), (5, 6), (7, 7)],
    8: [(1, 1), (1, 2), (3, 3), (1, 4), (5, 5), (5, 6), (7, 7), (1, 8)],
}
# who reports in leaf t (1-based), for a tree of T leaves
PATTERNS = {
    "each client once": lambda T: [[t] for t in range(1, T + 1)],
    "one client in every leaf": lambda T: [[0]] * T,
    "one client in the even leaves": lambda T: [[0] if t % 2 == 0 else [t] for t in range(1, T + 1)],
    "one client in leaves 1 and 2": lambda T: [[0] if t <= 2 else [t] for t in range(1, T + 1)],
}


@pytest.mark.parametrize("T", sorted(RELEASED_BY_HAND))
def test_the_released_nodes_are_the_nodes_of_the_prefix_sums_enumerated_by_hand(T):
    from fedweave.privacy import decomposition

    drawn = {(k * 2**h + 1, (k + 1) * 2**h) for t in range(1, T + 1) for h, k in decomposition(t)}
    assert drawn == set(RELEASED_BY_HAND[T]) and len(drawn) == T  # one new node per leaf
    once = max(sum(a <= leaf <= b for a, b in RELEASED_BY_HAND[T]) for leaf in range(1, T + 1))
    assert once == math.ceil(math.log2(T + 1))  # the paper's count for a client that takes part once


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("T", sorted(RELEASED_BY_HAND))
def test_dp_ftrl_epsilon_counts_only_the_released_nodes(T, pattern):
    from opacus.accountants import RDPAccountant

    from fedweave.privacy import decomposition

    leaves = PATTERNS[pattern](T)
    clients = sorted({c for leaf in leaves for c in leaf})
    # by hand: sum over the released nodes v of c_v^2, c_v the client's leaves inside v; the largest over clients
    sens = {c: sum(sum(c in leaves[t - 1] for t in range(a, b + 1)) ** 2 for a, b in RELEASED_BY_HAND[T])
            for c in clients}  # fmt: skip
    hand = max(sens.values())
    # the exact Gaussian parameter of the release itself, with no node counting: the prefix sums' noises have
    # covariance Sigma_st = (nodes shared by s's and t's decompositions) sigma^2 C^2, and a client with aligned
    # updates of norm C moves S~_t by Delta_t = C (its leaves <= t); the privacy loss is that of the Gaussian
    # mechanism with sensitivity / noise = sqrt(Delta^T Sigma^-1 Delta) / (sigma C), which no bound can go below
    nodes = [set(decomposition(t)) for t in range(1, T + 1)]
    cov = np.array([[len(a & b) for b in nodes] for a in nodes], dtype=np.float64)
    for c in clients:
        delta = np.cumsum([c in leaf for leaf in leaves]).astype(np.float64)
        assert delta @ np.linalg.solve(cov, delta) == pytest.approx(sens[c], rel=1e-12)
    dp = _ftrl_dp(z=2.0, clip=1.0, expected=1)
    zero = torch.zeros(3, dtype=torch.float64)
    for leaf in leaves:
        dp.clip(zero.expand(len(leaf), 3), torch.ones(len(leaf), dtype=torch.float64), np.array(leaf))
        dp.noise(zero)
    acc = RDPAccountant()
    acc.history = [(2.0 / math.sqrt(hand), 1.0, 1)]
    assert dp.summary()["tree_sensitivities"] == [hand]
    assert dp.epsilon() == acc.get_epsilon(delta=1e-5)


def test_dp_ftrl_epsilon_is_opacus_with_sigma_over_sqrt_depth_per_period(toy_config, tmp_path):
    privacy = {"noise_multiplier": 1.1, "restart_every": 3}
    res = run(load(_ftrl(toy_config, privacy, sampler=ONCE_PER_PERIOD, rounds=6)), run_dir=tmp_path / "r")
    from opacus.accountants import RDPAccountant

    def opacus(history):
        acc = RDPAccountant()
        acc.history = history
        return acc.get_epsilon(delta=1e-5)

    # clients 0-3 are the first leaf of each tree of 3 leaves (depth floor(log2 3) + 1 = 2): after each round their
    # squared sensitivity summed over the trees is 1, 2, 2, 2 + 1, 2 + 2, 2 + 2, one Gaussian release each
    want = [opacus([(1.1 / math.sqrt(s), 1.0, 1)]) for s in (1, 2, 2, 3, 4, 4)]
    assert [row["epsilon"] for row in res.metrics] == want
    # the trees composed one by one, sigma / sqrt(depth) per period: the same Renyi DP, equal to rounding
    assert want[-1] == pytest.approx(_opacus_epsilon("rdp", 1.1 / math.sqrt(2), 1.0, 2, 1e-5), rel=1e-12)
    s = res.summary["privacy"]
    assert s["mechanism"] == "ftrl" and s["sample_rate"] == 1.0 and s["tree_sensitivities"] == [2, 2]
    assert s["squared_sensitivity"] == 4


@pytest.mark.parametrize(
    ("restart_every", "rounds", "trees"),
    [(None, 4, [22]), (3, 7, [6, 6, 1])],  # [1],[3],[1,2],[1,4]: 1+1+4+16; [1],[3],[1,2]: 1+1+4; [1]: 1
)
def test_dp_ftrl_accounts_a_client_in_every_leaf_by_its_node_counts(toy_config, tmp_path, restart_every, rounds, trees):
    from opacus.accountants import RDPAccountant

    privacy = {"noise_multiplier": 2.0, "restart_every": restart_every}
    res = run(load(_ftrl(toy_config, privacy, sampler={"name": "fixed"}, rounds=rounds)), run_dir=tmp_path / "r")
    assert res.summary["privacy"]["tree_sensitivities"] == trees
    acc = RDPAccountant()  # the same clients in every tree: each client's total is the trees' sum
    acc.history = [(2.0 / math.sqrt(sum(trees)), 1.0, 1)]
    assert res.summary["privacy"]["epsilon"] == acc.get_epsilon(delta=1e-5)
    assert res.summary["privacy"]["squared_sensitivity"] == sum(trees)


def test_a_restart_starts_a_new_tree_and_zeroes_the_momentum():
    from fedweave.privacy import TreeNoise

    dp = _ftrl_dp(z=1.0, clip=1.0, expected=1, restart_every=2, momentum=0.5)
    zero = torch.zeros(10, dtype=torch.float64)
    outs = []
    for r in range(3):
        dp.clip(zero.unsqueeze(0), torch.ones(1, dtype=torch.float64), np.array([r]))
        outs.append(dp.noise(zero))
        assert dp.buffer is (None if r == 1 else dp.buffer)
    assert dp.closed == [2] and dp.tree == 1 and [c.tolist() for c in dp.leaves] == [[2]]
    noise = TreeNoise(Seeds(0), 10, torch.float64)
    torch.testing.assert_close(outs[2], noise.node(1, 0, 0), rtol=0, atol=0)  # tree 1's first leaf, no momentum
    torch.testing.assert_close(outs[1], 0.5 * outs[0] + noise.increment(0, 2), rtol=1e-15, atol=1e-15)


def test_a_resumed_dp_ftrl_run_continues_the_tree_identically(toy_config, tmp_path):
    from fedweave.runner import resume

    privacy = {"noise_multiplier": 1.0, "restart_every": 3, "momentum": 0.5}
    whole = run(load(_ftrl(toy_config, privacy, rounds=5)), run_dir=tmp_path / "whole")
    cfg = _ftrl(toy_config, privacy, rounds=2)
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    run(load(cfg), run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=5"])
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert torch.equal(res.algorithm.x, whole.algorithm.x)
    assert res.summary["privacy"]["tree_sensitivities"] == whole.summary["privacy"]["tree_sensitivities"]


def test_dp_ftrl_auto_calibrates_for_the_planned_trees(toy_config):
    privacy = {"noise_multiplier": "auto", "target_epsilon": 4.0, "restart_every": 4}
    algo = _built(_ftrl(toy_config, privacy, rounds=10))
    # trees of 4, 4 and 2 leaves, each client once per tree: squared sensitivity 3 + 3 + 2
    eps = _opacus_epsilon("rdp", algo.privacy.z / math.sqrt(8), 1.0, 1, 1e-5)
    assert 3.95 <= eps <= 4.0
    history = [(algo.privacy.z / math.sqrt(3), 1.0, 2), (algo.privacy.z / math.sqrt(2), 1.0, 1)]
    assert algo.privacy.accountant.epsilon(history) == pytest.approx(eps, rel=1e-9)


def test_dp_ftrl_stops_at_the_budget_before_the_next_rounds_clients_would_exceed_it(toy_config, tmp_path):
    from fedweave.privacy import tree_sensitivity

    privacy = {"noise_multiplier": 3.0, "target_epsilon": 6.0}
    res = run(load(_ftrl(toy_config, privacy, sampler=ONCE_PER_PERIOD, rounds=30)), run_dir=tmp_path / "r")
    n = res.summary["rounds"]
    assert n < 30 and res.metrics[-1]["epsilon"] <= 6.0
    # one tree: round n + 1 would add the schedule's next clients as leaf n + 1
    leaves = [np.array(ONCE_PER_PERIOD["clients"][i % 3]) for i in range(n + 1)]
    assert _opacus_epsilon("rdp", 3.0 / math.sqrt(tree_sensitivity(leaves)), 1.0, 1, 1e-5) > 6.0
    assert res.summary["stopped_early"].startswith("privacy budget: one more round would spend epsilon")


def test_dp_ftrl_auto_spends_its_budget_in_all_the_planned_rounds(toy_config, tmp_path):
    privacy = {"noise_multiplier": "auto", "target_epsilon": 3.0, "restart_every": 3}
    res = run(load(_ftrl(toy_config, privacy, sampler=ONCE_PER_PERIOD, rounds=9)), run_dir=tmp_path / "r")
    assert res.summary["rounds"] == 9 and "stopped_early" not in res.summary
    assert 2.95 <= res.summary["privacy"]["epsilon"] <= 3.0 and res.summary["privacy"]["tree_sensitivities"] == [2] * 3


@pytest.mark.parametrize(
    ("privacy", "change", "words"),
    [
        ({"adaptive": True}, {}, "privacy.adaptive needs privacy.mechanism: central"),
        ({"mechanism": "central", "restart_every": 4}, {}, "privacy.restart_every applies to privacy.mechanism: ftrl"),
        ({"momentum": 1.0}, {}, "privacy.momentum must be in [0, 1)"),
        ({"restart_every": 0}, {}, "privacy.restart_every must be an integer >= 1"),
        ({}, {"sampler": {"name": "power_of_choice"}}, "chooses clients by their losses"),
    ],
)
def test_dp_ftrl_refusals_are_one_line(toy_config, privacy, change, words):
    from fedweave.registry import SAMPLERS

    if "power_of_choice" not in SAMPLERS:

        @SAMPLERS.register("power_of_choice")
        def power_of_choice(num_clients, per_round, r, rng, *, rounds, context):
            return np.sort(rng.choice(num_clients, per_round, replace=False))

    cfg = _ftrl(toy_config, privacy, **change)
    with pytest.raises(ConfigError) as e:
        _built(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_dp_ftrl_in_the_hierarchical_family_is_refused_with_one_line(toy_config):
    with pytest.raises(ConfigError, match=r"^privacy.mechanism: ftrl is supported in the centralized family"):
        _built(_hier(toy_config, {"mechanism": "ftrl", "noise_multiplier": 1.0}))


def test_dp_ftrl_needs_no_amplification_so_any_loss_blind_sampler_works(toy_config):
    for sampler in ("uniform", "bernoulli", {"name": "fixed"}):
        algo = _built(_ftrl(toy_config, {"noise_multiplier": 1.0}, sampler=sampler))
        assert algo.privacy.sample_rate == 1.0


# ---- DP-FTRL across trees: each client's squared counts summed over the trees, the worst client's total ----------
def test_dp_ftrl_composes_each_clients_trees_and_accounts_the_worst_clients_total():
    from opacus.accountants import RDPAccountant

    # trees of 2 leaves: client 0 then 1, then 1 then 0. In a tree of 2 the first leaf is in [1] and [1,2] (2), the
    # second in [1,2] only (1): each client has 2 + 1 = 3 over the run, while each tree's worst has 2 (4 summed)
    dp = _ftrl_dp(z=1.7, clip=1.0, expected=1, restart_every=2)
    zero = torch.zeros(3, dtype=torch.float64)
    for leaf in ([0], [1], [1], [0]):
        dp.clip(zero.unsqueeze(0), torch.ones(1, dtype=torch.float64), np.array(leaf))
        dp.noise(zero)
    acc = RDPAccountant()
    acc.history = [(1.7 / math.sqrt(3), 1.0, 1)]  # one Gaussian mechanism of squared sensitivity 2 + 1
    assert dp.epsilon() == acc.get_epsilon(delta=1e-5)
    assert dp.closed == [2, 2] and dp.summary()["squared_sensitivity"] == 3
    worst_per_tree = RDPAccountant()
    worst_per_tree.history = [(1.7 / math.sqrt(2), 1.0, 2)]
    assert dp.epsilon() < worst_per_tree.get_epsilon(delta=1e-5)


# the clients of three groups, rotated so that a different group is first (the deepest leaf) in each tree of 3
ROTATED = {"name": "schedule", "clients": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                           [4, 5, 6, 7], [0, 1, 2, 3], [8, 9, 10, 11]]}  # fmt: skip


def test_a_dp_ftrl_run_whose_worst_client_changes_between_trees_is_accounted_by_the_worst_total(toy_config, tmp_path):
    from opacus.accountants import RDPAccountant

    privacy = {"noise_multiplier": 1.3, "restart_every": 3}
    res = run(load(_ftrl(toy_config, privacy, sampler=ROTATED, rounds=6)), run_dir=tmp_path / "r")
    # a tree of 3: leaf 1 in [1], [1,2] (2), leaves 2 and 3 in one node each; group 0 has 2 + 1, group 1 1 + 2,
    # group 2 1 + 1: the worst total is 3, where each tree's worst summed over the trees would be 4
    s = res.summary["privacy"]
    acc = RDPAccountant()
    acc.history = [(1.3 / math.sqrt(3), 1.0, 1)]
    assert s["epsilon"] == acc.get_epsilon(delta=1e-5)
    assert s["tree_sensitivities"] == [2, 2] and s["squared_sensitivity"] == 3


def test_a_dp_ftrl_run_resumed_after_a_restart_keeps_each_clients_totals(toy_config, tmp_path):
    from fedweave.runner import resume

    privacy = {"noise_multiplier": 1.3, "restart_every": 3, "momentum": 0.5}
    whole = run(load(_ftrl(toy_config, privacy, sampler=ROTATED, rounds=6)), run_dir=tmp_path / "whole")
    cfg = _ftrl(toy_config, privacy, sampler=ROTATED, rounds=4)  # stops in the second tree, the first one closed
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    run(load(cfg), run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=6"])
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert torch.equal(res.algorithm.x, whole.algorithm.x)
    assert res.summary["privacy"] == whole.summary["privacy"]
    assert res.summary["privacy"]["squared_sensitivity"] == 3


def test_a_dp_ftrl_state_without_per_client_totals_resumes_with_each_finished_tree_on_every_client():
    # a checkpoint written before the per-client totals kept only each finished tree's worst client: every client
    # may have been it, so the resumed run adds their sum to every client (the former bound, never below the exact)
    def fed(dp, leaves):
        zero = torch.zeros(3, dtype=torch.float64)
        for leaf in leaves:
            dp.clip(zero.unsqueeze(0), torch.ones(1, dtype=torch.float64), np.array(leaf))
            dp.noise(zero)

    whole = _ftrl_dp(z=1.7, clip=1.0, expected=1, restart_every=2)
    fed(whole, [[0], [1], [1], [0], [2]])
    part = _ftrl_dp(z=1.7, clip=1.0, expected=1, restart_every=2)
    fed(part, [[0], [1], [1], [0]])
    state = part.state_dict()
    del state["squared"], state["unattributed"]
    old = _ftrl_dp(z=1.7, clip=1.0, expected=1, restart_every=2)
    old.load_state_dict(state)
    fed(old, [[2]])
    assert old.summary()["squared_sensitivity"] == 2 + 2 + 1 and whole.summary()["squared_sensitivity"] == 3
    assert old.epsilon() == old.accountant.epsilon([(1.7 / math.sqrt(5), 1.0, 1)]) > whole.epsilon()
    # a state written now resumes exactly
    again = _ftrl_dp(z=1.7, clip=1.0, expected=1, restart_every=2)
    again.load_state_dict(part.state_dict())
    fed(again, [[2]])
    assert again.epsilon() == whole.epsilon() and again.summary() == whole.summary()


def test_dp_ftrl_auto_stays_within_its_target_when_the_worst_client_changes_between_trees(toy_config, tmp_path):
    # auto calibrates for a client first in both trees of 3 (2 + 2 = 4); the rotated schedule's worst has 3, so the
    # run does all its rounds and spends what Opacus gives for 3, below the target
    privacy = {"noise_multiplier": "auto", "target_epsilon": 3.0, "restart_every": 3}
    res = run(load(_ftrl(toy_config, privacy, sampler=ROTATED, rounds=6)), run_dir=tmp_path / "r")
    s = res.summary["privacy"]
    assert res.summary["rounds"] == 6 and "stopped_early" not in res.summary and s["squared_sensitivity"] == 3
    assert _opacus_epsilon("rdp", s["noise_multiplier"] / 2, 1.0, 1, 1e-5) == pytest.approx(3.0, abs=0.05)
    assert s["epsilon"] == _opacus_epsilon("rdp", s["noise_multiplier"] / math.sqrt(3), 1.0, 1, 1e-5) < 3.0


def test_opacus_order_warning_stays_out_of_the_output():
    # at a large target epsilon over few steps RDP's best order is Opacus's largest (63): Opacus warned on every
    # call, so a CLI refusal printed three lines instead of one; the epsilon there is still a valid upper bound
    pytest.importorskip("opacus")
    from fedweave.privacy.accountant import Accountant, calibrate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        z = calibrate("rdp", 20.0, 1e-5, 0.5, 2)
        acc = Accountant("rdp", 1e-5)
        acc.step(z, 0.5)
        acc.step(z, 0.5)
        eps = acc.epsilon()
    assert [str(w.message) for w in caught] == []
    assert 19.9 < eps <= 20.0


def test_the_budget_message_shows_epsilon_and_its_target_at_one_precision():
    # before: "epsilon 4.479 > privacy.target_epsilon 4.47922", epsilon rounded to 4 digits and the target to 6, so
    # the value that exceeds the target read as the smaller one
    from types import SimpleNamespace

    from fedweave.callbacks.builtin import PrivacyBudget

    dp = SimpleNamespace(epsilon_after_next=lambda r: 4.479226, epsilon=lambda: 4.2)
    run = SimpleNamespace(
        algo=SimpleNamespace(privacy=dp),
        config=SimpleNamespace(privacy=SimpleNamespace(target_epsilon=4.47922, delta=1e-5)),
        is_last=lambda r: False,
    )
    stop = PrivacyBudget().after_round(run, 0)
    assert "epsilon 4.47923 > privacy.target_epsilon 4.47922 (spent 4.2 at delta 1e-05)" in stop
    dp.epsilon_after_next = lambda r: 5.2051
    run.config.privacy.target_epsilon = 5.0  # told apart at 4 digits, as before
    assert "epsilon 5.205 > privacy.target_epsilon 5 (" in PrivacyBudget().after_round(run, 0)


@pytest.mark.slow  # a fresh interpreter importing torch and Opacus, 8 s
def test_the_accountant_leaves_the_root_logger_as_it_was():
    """Opacus calls ``logging.basicConfig`` when imported: a deployed run's ServerApp (a process whose root logger
    had no handler) printed each of its lines twice in Flower's stream. Checked in a fresh interpreter, where
    nothing has imported Opacus yet."""
    import subprocess
    import sys

    code = (
        "import logging\n"
        "from fedweave.privacy.accountant import calibrate, rdp\n"
        "rdp(); calibrate('rdp', 5.0, 1e-5, 0.1, 10)\n"
        "print(len(logging.getLogger().handlers))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
