"""DP-FedBuff (fedweave.privacy.buffered; docs/privacy.md): each upload clipped, one Gaussian noise per buffer,
each client accounted by its uploads per server step without amplification, the budget's look-ahead by a replay
of the schedule, resume, and what stays refused (FedAsync, secure aggregation)."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

import fedweave
from fedweave.config import ConfigError
from fedweave.runner import resume
from fedweave.seeding import Seeds
from tests.test_async import _async, _three, _timed, record_jobs
from tests.test_centralized import _algo

pytest.importorskip("opacus", reason="opacus is not installed (pip install 'fedweave[privacy]')")


def _private(cfg: dict, **privacy) -> dict:
    return {**cfg, "privacy": {"noise_multiplier": 1.0, "clip": 0.5, **privacy}}


def _buff(rounds: int = 6, **opts) -> dict:
    """Five of eight clients at once at random speeds, buffers of 2: stale and repeated uploads."""
    opts = {"concurrency": 5, "buffer_size": 2, "weighting": "uniform", **opts}
    return _async("fedbuff", rounds=rounds, sigma=0.6, **opts)


def _contributions(run_dir) -> dict[int, dict[int, int]]:
    """From events.csv: per server step, each client's number of uploads it used (the ``arrive`` rows)."""
    out: dict[int, dict[int, int]] = {}
    with open(run_dir / "events.csv") as f:
        for row in csv.DictReader(f):
            if row["event"] == "arrive":
                step = out.setdefault(int(row["server_step"]), {})
                step[int(row["client"])] = step.get(int(row["client"]), 0) + 1
    return out


def _opacus_worst(
    sigma: float, steps: dict[int, dict[int, int]], delta: float = 1e-5, accountant: str = "rdp"
) -> float:
    """The largest over the clients of Opacus's epsilon of the steps composed one by one, each the Gaussian
    mechanism of sensitivity c C (c: the client's uploads in it), noise multiplier sigma / c, sample rate 1."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    worst = 0.0
    for client in {c for step in steps.values() for c in step}:
        acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
        for step in steps.values():
            if client in step:
                acc.step(noise_multiplier=sigma / step[client], sample_rate=1.0)
        with np.errstate(divide="ignore"):  # PRV at sample rate 1: a discarded log of 0 (as the accountant's)
            worst = max(worst, acc.get_epsilon(delta=delta))
    return worst


# ---- the mechanism ------------------------------------------------------------------------------
def test_dp_fedbuff_with_a_full_buffer_and_equal_latencies_is_dp_fedavg_bit_for_bit():
    """Buffer = concurrency = clients_per_round, equal latencies and constant staleness: FedBuff is FedAvg draw for
    draw, so DP-FedBuff is DP-FedAvg (without amplification): the same clip, the same noise from the same stream."""
    privacy = {"noise_multiplier": 0.8, "clip": 0.05, "amplification": "none"}
    sync = _algo(_private(_timed(_async("fedavg", weighting="uniform")), **privacy))
    buff = _algo(_private(_async("fedbuff", buffer_size=3, concurrency=3, staleness="constant"), **privacy))
    for r in range(4):
        sync.run_round(r)
        buff.run_round(r)
    assert torch.equal(sync.x, buff.x)
    assert sync.privacy.last_norms.min() > 0.05  # every update clipped: the clip is exercised
    # DP-FedAvg at q = 1 accounts every client in every round; DP-FedBuff the most often dispatched client
    counts = buff.privacy.squared
    assert counts.max() <= 4 and counts.sum() == 12
    expect = sync.privacy.epsilon() if counts.max() == 4 else None
    assert buff.privacy.epsilon() <= sync.privacy.epsilon() and (expect is None or buff.privacy.epsilon() == expect)


def test_sigma_zero_and_no_clip_is_plain_fedbuff_bit_for_bit():
    plain = _algo(_buff(weighting="uniform"))
    private = _algo(_private(_buff(weighting="uniform"), noise_multiplier=0.0, clip=1e30))
    for r in range(6):
        plain.run_round(r)
        private.run_round(r)
    assert torch.equal(plain.x, private.x)
    assert math.isinf(private.privacy.epsilon())


def test_the_clipped_sum_is_sum_of_staleness_weighted_clipped_updates_over_k(monkeypatch):
    """sigma = 0: x <- x + eta_g sum_i s(t - tau_i) clip(Delta_i, C) / K, by hand from every job's start and result
    (client 0 uploads twice to three of the buffers)."""
    clip = 0.02
    cfg = _private(_three("fedbuff", buffer_size=3, server_lr=0.7, staleness="polynomial"), noise_multiplier=0.0)
    cfg["privacy"]["clip"] = clip
    algo = _algo(cfg)
    jobs = record_jobs(algo, monkeypatch)
    norms = []
    for r in range(4):
        x, n = algo.x.clone(), len(algo.events)
        algo.run_round(r)
        got = [(j, r - v) for _, e, _, j, v, _ in algo.events[n:] if e == "arrive"]
        step = torch.zeros_like(x)
        for j, tau in got:
            delta = jobs[j][1] - jobs[j][0]
            norms.append(float(delta.norm()))
            step = step + (1 + tau) ** -0.5 * delta * min(1.0, clip / float(delta.norm()))
        torch.testing.assert_close(algo.x, x + 0.7 * step / 3, rtol=1e-6, atol=1e-8)
    assert min(norms) > clip  # every update clipped
    # the buffers' clients (works 0.5, 1, 1.5): [0, 1, 0], [2, 0, 1], [0, 0, 2], [1, 0, 0]
    assert algo.privacy.squared.tolist() == [2**2 + 1 + 2**2 + 2**2, 1 + 1 + 0 + 1, 0 + 1 + 1 + 0]


def test_the_noise_is_the_seeded_stream_times_sigma_c_over_k():
    """The noised run minus the noiseless one (same schedule, same clipped sums) is eta_g sigma C / K times the
    ("dp", step) draw; over the steps its std is that."""
    sigma, clip, k = 3.0, 0.5, 2
    quiet = _algo(_private(_buff(server_lr=0.5), noise_multiplier=0.0, clip=clip))
    loud = _algo(_private(_buff(server_lr=0.5), noise_multiplier=sigma, clip=clip))
    quiet.run_round(0)
    loud.run_round(0)
    draw = torch.randn(len(loud.x), generator=Seeds(4).torch("dp", 0), dtype=loud.x.dtype)
    torch.testing.assert_close(loud.x - quiet.x, 0.5 * sigma * clip / k * draw, rtol=1e-5, atol=1e-6)
    assert not torch.equal(loud.x, quiet.x)


def test_the_noise_std_is_sigma_c_over_k_statistically():
    from fedweave.privacy import Accountant
    from fedweave.privacy.buffered import BufferedDP

    dp = BufferedDP(num_clients=4, clip=0.4, z=1.5, expected=5, seeds=Seeds(1), accountant=Accountant("rdp", 1e-5))
    rows, w = dp.clip(torch.zeros(5, 40_000, dtype=torch.float64), torch.full((5,), 0.2), np.array([0, 1, 1, 2, 3]))
    noise = dp.noise(w @ rows)
    assert float(noise.std()) == pytest.approx(1.5 * 0.4 / 5, rel=0.02)
    assert dp.squared.tolist() == [1, 4, 1, 1]


# ---- the accounting -----------------------------------------------------------------------------
@pytest.mark.parametrize(("accountant", "rel"), [("rdp", 1e-9), ("prv", 1e-4)])
def test_epsilon_is_opacus_composed_by_hand_from_events_csv(tmp_path, accountant, rel):
    """Each step a Gaussian mechanism of sensitivity c C per client, composed for every client by Opacus one step
    at a time; the run's epsilon is the worst client's (the run composes them as one Gaussian: exact for RDP, and
    for PRV to its numerical tolerance). A client uploads more than once to some buffer."""
    sigma = 4.0
    cfg = _private(_buff(rounds=8, concurrency=3, buffer_size=4), noise_multiplier=sigma, accountant=accountant)
    res = fedweave.run(cfg, run_dir=tmp_path)
    steps = _contributions(tmp_path)
    assert len(steps) == 8 and max(c for step in steps.values() for c in step.values()) >= 2
    expect = _opacus_worst(sigma, steps, accountant=accountant)
    assert res.summary["privacy"]["epsilon"] == pytest.approx(expect, rel=rel)
    assert res.metrics[-1]["epsilon"] == pytest.approx(expect, rel=rel)
    # counting each upload once (c, not c^2) would give less: the squares matter here
    linear = {t: {c: 1 for c in step} for t, step in steps.items()}
    assert _opacus_worst(sigma, linear, accountant=accountant) < expect * (1 - 10 * rel)
    s = res.summary["privacy"]
    assert s["sample_rate"] == 1.0 and s["buffer_size"] == 4 and s["mechanism"] == "central"


@pytest.mark.parametrize(
    ("algorithm", "extra"),
    [
        ({"max_staleness": 1}, {}),
        ({}, {"faults": {"speed_sigma": 0.6, "dropout": 0.2, "deadline": 1.6}}),
        ({}, {"faults": {"speed_sigma": 0.6, "sim_time": True}}),
        ({}, {"compression": {"upload": {"name": "topk", "ratio": 0.1}}}),
        ({"concurrency": 7, "buffer_size": 2}, {}),
        ({"staleness": "hinge", "staleness_a": 0.5, "staleness_b": 1}, {}),
    ],
    ids=["max_staleness", "dropout-deadline", "sim_time", "compression", "concurrency>buffer", "hinge"],
)
def test_epsilon_is_opacus_from_events_csv_under_every_schedule_setting(tmp_path, algorithm, extra):
    """Discards, lost jobs, the clock switch, compressed uploads (clipped as decoded), more clients in flight than a
    buffer holds and another staleness function: the run's epsilon is still the worst client's composition of the
    steps whose uploads events.csv records as arrived."""
    cfg = {**_private(_buff(rounds=6, **algorithm), noise_multiplier=2.0), **extra}
    res = fedweave.run(cfg, run_dir=tmp_path)
    expect = _opacus_worst(2.0, _contributions(tmp_path))
    assert res.summary["privacy"]["epsilon"] == pytest.approx(expect, rel=1e-9)


def test_a_target_equal_to_a_steps_epsilon_runs_that_step_and_stops_before_the_next(tmp_path):
    """The budget's boundary: a next step that would spend exactly the target is taken (epsilon <= target)."""
    cfg = _private(_buff(rounds=12), noise_multiplier=3.0)
    free = fedweave.run(cfg, run_dir=tmp_path / "free")
    eps = [r["epsilon"] for r in free.metrics]
    n = next(i for i in range(1, 12) if eps[i] > eps[i - 1])  # steps 1..n spend eps[n - 1], step n + 1 more
    aimed = {**cfg, "privacy": {**cfg["privacy"], "target_epsilon": eps[n - 1]}}
    res = fedweave.run(aimed, run_dir=tmp_path / "aimed")
    assert res.summary["rounds"] == n and res.metrics[-1]["epsilon"] == eps[n - 1]
    assert res.summary["stopped_early"].startswith("privacy budget: one more round would spend epsilon")


@pytest.mark.parametrize(
    "faults",
    [{}, {"dropout": 0.3}, {"deadline": 1.3}, {"dropout": 0.2, "deadline": 1.6}],
    ids=["plain", "dropout", "deadline", "both"],
)
@pytest.mark.parametrize("max_staleness", [None, 1])
def test_the_replayed_schedule_is_the_next_steps_uploads(faults, max_staleness):
    """The budget's look-ahead: the clients the replay says step r uses are those whose uploads it used."""
    cfg = _buff(rounds=10, concurrency=4, buffer_size=3, max_staleness=max_staleness)
    algo = _algo({**cfg, "faults": {**cfg["faults"], **faults}})
    for r in range(10):
        ahead = algo.upcoming_clients(r)
        n = len(algo.events)
        algo.run_round(r)
        assert ahead.tolist() == [c for _, e, c, *_ in algo.events[n:] if e == "arrive"]


def test_the_budget_stops_before_the_next_step_would_exceed_it(tmp_path):
    cfg = _private(_buff(rounds=40), noise_multiplier=3.0, target_epsilon=3.0)
    res = fedweave.run(cfg, run_dir=tmp_path / "stop")
    n = res.summary["rounds"]
    assert 1 < n < 40 and res.metrics[-1]["epsilon"] <= 3.0
    assert res.summary["stopped_early"].startswith("privacy budget: one more round would spend epsilon")
    # the run without a target (the same schedule) has step n + 1 past the target
    free = fedweave.run({**cfg, "rounds": n + 1, "privacy": {**cfg["privacy"], "target_epsilon": None}},
                        run_dir=tmp_path / "free")  # fmt: skip
    assert free.metrics[n - 1]["epsilon"] == res.metrics[-1]["epsilon"]
    assert free.metrics[n]["epsilon"] > 3.0
    assert free.metrics[n]["epsilon"] == pytest.approx(_opacus_worst(3.0, _contributions(tmp_path / "free")))


def test_the_look_ahead_changes_nothing_in_the_run(tmp_path):
    """The replay draws from the schedule's streams without consuming them: a target never reached leaves the
    model, the events and the epsilons as without one."""
    cfg = _private({**_buff(rounds=5), "faults": {"speed_sigma": 0.6, "dropout": 0.2}}, noise_multiplier=2.0)
    plain = fedweave.run(cfg, run_dir=tmp_path / "plain")
    aimed = fedweave.run({**cfg, "privacy": {**cfg["privacy"], "target_epsilon": 1e6}}, run_dir=tmp_path / "aimed")
    assert torch.equal(plain.algorithm.x, aimed.algorithm.x) and len(aimed.metrics) == 5
    assert (tmp_path / "plain" / "events.csv").read_text() == (tmp_path / "aimed" / "events.csv").read_text()
    assert [r["epsilon"] for r in plain.metrics] == [r["epsilon"] for r in aimed.metrics]


def test_a_target_the_first_step_exceeds_is_one_line():
    with pytest.raises(ConfigError, match=r"exceeded by the first round alone") as e:
        _algo(_private(_buff(), noise_multiplier=0.3, target_epsilon=1.0))
    assert "\n" not in str(e.value)


def test_a_resumed_dp_fedbuff_run_continues_bit_for_bit(tmp_path):
    cfg = _private(_buff(rounds=6), noise_multiplier=2.0)
    whole = fedweave.run(cfg, run_dir=tmp_path / "whole")
    part = {**cfg, "rounds": 3, "output": {**cfg["output"], "checkpoint_every": 1}}
    fedweave.run(part, run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=6"])
    assert torch.equal(res.algorithm.x, whole.algorithm.x)
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert res.summary["privacy"] == whole.summary["privacy"]
    assert res.algorithm.privacy.squared.tolist() == whole.algorithm.privacy.squared.tolist()


def test_a_resumed_run_stops_at_the_budget_where_the_whole_run_does(tmp_path):
    cfg = _private(_buff(rounds=40), noise_multiplier=3.0, target_epsilon=3.0)
    whole = fedweave.run(cfg, run_dir=tmp_path / "whole")
    n = whole.summary["rounds"]
    part = {**cfg, "rounds": n - 1, "output": {**cfg["output"], "checkpoint_every": 1}}
    fedweave.run(part, run_dir=tmp_path / "part")
    res = resume(tmp_path / "part", ["rounds=40"])
    assert [r["epsilon"] for r in res.metrics] == [r["epsilon"] for r in whole.metrics]
    assert res.summary["stopped_early"] == whole.summary["stopped_early"]
    assert torch.equal(res.algorithm.x, whole.algorithm.x)


# ---- what stays refused -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("alg", "privacy", "words"),
    [
        ("fedasync", {}, "algorithm 'fedasync' is refused: every arrival is its own server step"),
        ("fedbuff", {"mechanism": "local"}, "privacy.mechanism: fedbuff supports user-level central DP only"),
        ("fedbuff", {"mechanism": "ftrl"}, "privacy.mechanism: fedbuff supports user-level central DP only"),
        ("fedbuff", {"level": "sample"}, "privacy.level: fedbuff supports user-level central DP only"),
        ("fedbuff", {"adaptive": True}, "privacy.adaptive: fedbuff supports user-level central DP only"),
        ("fedbuff", {"noise_multiplier": "auto", "target_epsilon": 5.0}, "privacy.noise_multiplier: auto needs"),
        ("fedbuff", {"_top": {"aggregator": {"name": "median"}}}, "aggregator: median and privacy both decide"),
    ],
)
def test_what_the_proof_does_not_cover_is_one_line(alg, privacy, words):
    cfg = _async(alg, concurrency=3, **({"buffer_size": 2} if alg == "fedbuff" else {}))
    privacy = dict(privacy)
    cfg = {**cfg, **privacy.pop("_top", {})}  # a section beside privacy: a robust aggregator
    with pytest.raises(ConfigError) as e:
        _algo(_private(cfg, **privacy))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_weighting_samples_is_refused_naming_dp_fedbuffs_weight_1_over_k():
    """DP-FedBuff weighs each upload 1/K (K the buffer); before, its refusal of weighting: samples said 1/E, E the
    expected clients per round, which FedBuff has not."""
    with pytest.raises(ConfigError) as e:
        _algo(_private(_async("fedbuff", concurrency=3, buffer_size=2, weighting="samples")))
    assert "privacy: algorithm.weighting: samples would weigh a client by its data size" in str(e.value)
    assert "(each upload counts 1/K, K the algorithm.buffer_size)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("alg", ["fedbuff", "fedasync"])
def test_secure_aggregation_stays_refused_for_the_asynchronous_methods(alg):
    cfg = {**_async(alg, concurrency=3), "secure_aggregation": {}}
    with pytest.raises(ConfigError, match=rf"secure_aggregation: algorithm '{alg}' is refused") as e:
        _algo(cfg)
    assert "\n" not in str(e.value)
