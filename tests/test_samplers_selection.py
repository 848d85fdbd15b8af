"""The samplers that select by what they know of the clients: power-of-choice (Cho et al. 2022) and
Oort's training selector (Lai et al. 2021). Each on a constructed context whose answer is known, seeded by the
round's own stream, and resumed from a checkpoint as if never interrupted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedweave
from fedweave.config import ConfigError
from fedweave.registry import SAMPLERS
from fedweave.runner import resume
from fedweave.topology.samplers import ClientHistory, by_size, oort, power_of_choice


def _context(sizes, losses=None, rounds=None):
    """A context whose clients reported ``losses`` (NaN: never) in ``rounds``."""
    h = ClientHistory(sizes)
    for c, (loss, r) in enumerate(zip(losses or [], rounds or [])):
        if not math.isnan(loss):
            h.record(r, np.array([c]), np.array([loss]))
    return h.context


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---- power-of-choice ---------------------------------------------------------------------------------
def test_power_of_choice_with_every_client_a_candidate_picks_the_highest_losses():
    ctx = _context([10, 20, 30, 40, 50], [0.1, 0.9, 0.5, 0.7, 0.3], [0, 0, 1, 1, 1])
    for seed in range(5):  # d = n: the candidates are everyone, whatever the draw
        assert power_of_choice(5, 2, 2, _rng(seed), rounds=3, context=ctx, d=5).tolist() == [1, 3]


def test_power_of_choice_draws_candidates_by_size_and_puts_the_unheard_first():
    # only clients 1, 3, 4 hold data: with d = 3 they are the candidates; 4 never reported, 3 has the higher loss
    ctx = _context([0, 5, 0, 5, 5, 0], [0.2, 0.1, 0.9, 0.6, float("nan"), 0.8], [0, 0, 0, 0, 0, 0])
    assert power_of_choice(6, 2, 1, _rng(), rounds=2, context=ctx, d=3).tolist() == [3, 4]


def test_power_of_choice_with_d_equal_to_the_round_is_a_size_proportional_draw():
    ctx = _context([1, 1, 98], [5.0, 5.0, 0.0], [0, 0, 0])
    picks = [power_of_choice(3, 1, 0, _rng(s), rounds=1, context=ctx, d=1).item() for s in range(200)]
    assert picks.count(2) > 180  # its size, not its (lowest) loss, decides


@pytest.mark.parametrize("d", [1, 7, 2.5])
def test_power_of_choice_refuses_a_d_outside_the_round_and_the_clients(d):
    with pytest.raises(ConfigError, match=r"sampler.d must be an integer in \[2, 6\]"):
        power_of_choice(6, 2, 0, _rng(), rounds=1, context=_context([3] * 6), d=d)


def test_power_of_choice_with_fewer_clients_with_data_than_the_round_names_clients_per_round():
    # 3 clients hold data and the round takes 4: no d fits, whatever d is; the line names the round's size,
    # not a d the config never set (before: "sampler.d must be an integer in [4, 3] ..., got 3")
    ctx = _context([0, 0, 0, 5, 5, 5])
    for d in (None, 4):
        with pytest.raises(ConfigError) as e:
            power_of_choice(6, 4, 0, _rng(), rounds=1, context=ctx, d=d)
        assert str(e.value).startswith("algorithm.clients_per_round (4) must be at most 3 under sampler power_of")


# ---- Oort's training selector ------------------------------------------------------------------------------
def _share(picks: list[list[int]], client: int) -> float:
    return sum(client in p for p in picks) / len(picks)


def _pair_share(p: np.ndarray, i: int) -> float:
    """The chance that client ``i`` is among 2 drawn without replacement with probabilities ``p``."""
    return p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(len(p)) if j != i)


def test_oort_exploits_in_proportion_to_utility_above_the_cut_off():
    """The authors' getTopK: the explored clients whose score reaches cut_off (0.7) times the score of the
    (exploitLen + 1)-th best, drawn in proportion to their scores. Rewards n_i l_i = 8, 6, 4, 2, 1 (sizes 1,
    no staleness bonus): clip is the largest (rank int(0.98 * 5) = 4), R_min = 0.999, range 7.001, so the
    scores are (R_i - 0.999) / 7.001; 2 slots: the cut-off is 0.7 of client 2's score, which 3 and 4 miss
    (before: always the two highest, [0, 1])."""
    rewards = [8.0, 6.0, 4.0, 2.0, 1.0]
    ctx = _context([1] * 5, rewards, [2] * 5)
    picks = [
        oort(5, 2, 3, _rng(s), rounds=5, context=ctx, explore=0.0, explore_min=0.0, staleness=0.0).tolist()
        for s in range(3000)
    ]
    assert not any({3, 4} & set(p) for p in picks)
    score = (np.array(rewards[:3]) - 0.999) / 7.001
    p = score / score.sum()
    for c in range(3):
        assert abs(_share(picks, c) - _pair_share(p, c)) < 0.03


def test_oort_staleness_bonus_is_the_authors_temporal_uncertainty():
    """sqrt(staleness * log(T) / L_i), T = r + 1, L_i = last round + 1: equal rewards (normalised to 1 each),
    client 1 last heard from in round 1, clients 0 and 2 in round 5, at round 6; one slot drawn in proportion."""
    ctx = _context([10, 10, 10], [1.0, 1.0, 1.0], [5, 1, 5])
    picks = [oort(3, 1, 6, _rng(s), rounds=9, context=ctx, explore=0.0, explore_min=0.0).tolist() for s in range(3000)]
    score = 1.0 + np.sqrt(0.1 * math.log(7) / np.array([6.0, 2.0, 6.0]))
    assert abs(_share(picks, 1) - score[1] / score.sum()) < 0.03


def test_oort_explores_by_size_among_the_largest_unexplored():
    """Unexplored clients are drawn in proportion to their sizes (the authors' initial reward) among the
    int(sample_window * exploreLen) largest: one slot, window 2, sizes 100, 90, 80, 1, 1, 1: only clients 0 and
    1, in ratio 100 : 90 (before: uniformly among all six)."""
    ctx = _context([100, 90, 80, 1, 1, 1])
    picks = [oort(6, 1, 0, _rng(s), rounds=5, context=ctx, sample_window=2.0).tolist() for s in range(3000)]
    assert all(p in ([0], [1]) for p in picks)
    assert abs(_share(picks, 0) - 100 / 190) < 0.03


def test_oort_fills_the_slots_left_by_exploration_at_random():
    """Fewer unexplored clients than exploration slots: the authors fill the rest with any other client,
    uniformly. Of 4 slots with eps 0.5, 2 exploited among clients 0-2 (3 and 4 are below the cut-off), 1 to
    the only unexplored client 5, and the last to any client not yet picked, 3 and 4 included (before: the
    next highest utility, never 3 or 4)."""
    ctx = _context([1] * 6, [8.0, 7.0, 6.0, 0.5, 0.4, float("nan")], [0] * 6)
    picks = [
        oort(6, 4, 1, _rng(s), rounds=5, context=ctx, explore=0.5, explore_decay=1.0, explore_min=0.5).tolist()
        for s in range(600)
    ]
    assert all(5 in p and len(set(p) & {0, 1, 2}) >= 2 for p in picks)
    assert 0.5 < sum(bool({3, 4} & set(p)) for p in picks) / len(picks) < 0.8  # 2 of the 3 left: 2/3


def test_oort_selects_among_the_clients_with_data():
    """Clients without data are not registered (the authors register only clients with enough samples): never
    selected, and a round larger than the clients with data is refused in one line."""
    ctx = _context([0, 5, 5, 5])
    assert all(oort(4, 3, 0, _rng(s), rounds=1, context=ctx).tolist() == [1, 2, 3] for s in range(20))
    with pytest.raises(ConfigError) as e:
        oort(4, 4, 0, _rng(), rounds=1, context=ctx)
    assert str(e.value).startswith("algorithm.clients_per_round (4) must be at most 3 under sampler oort")


def test_oort_explores_the_unheard_and_exploits_the_heard():
    ctx = _context([10] * 6, [1.0, 3.0, 2.0, float("nan"), float("nan"), float("nan")], [0, 0, 0, 0, 0, 0])
    # eps = 0.5 of 4 slots: 2 of the 3 heard from, 2 of the 3 unheard
    for s in range(10):
        got = set(oort(6, 4, 1, _rng(s), rounds=5, context=ctx, explore=0.5, explore_decay=1.0, explore_min=0.5))
        assert len(got & {0, 1, 2}) == 2 and len(got & {3, 4, 5}) == 2
    # before anyone reported, everything is exploration
    assert len(oort(6, 4, 0, _rng(), rounds=5, context=_context([10] * 6))) == 4


@pytest.mark.parametrize("eps,per_round,fresh", [(0.5, 5, 3), (0.5, 3, 2), (0.3, 4, 2), (0.25, 8, 2)])
def test_oort_exploits_the_slots_rounded_down_and_explores_the_rest(eps, per_round, fresh):
    """The authors' getTopK takes exploitLen = int(K (1 - eps)) and explores the other slots: eps K = 2.5 of 5
    explores 3 (Python's round took 2.5 to 2, and 1.2 of 4 to 1); 0.25 of 8, a whole 2, stays 2."""
    # clients 0-7 reported (utility 8 down to 1), 8-15 never did
    ctx = _context([1] * 16, [8.0 - c for c in range(8)] + [float("nan")] * 8, [0] * 16)
    for seed in range(5):
        got = oort(16, per_round, 1, _rng(seed), rounds=5, context=ctx, explore=eps, explore_decay=1.0, explore_min=eps)
        assert len(got) == per_round and int((got >= 8).sum()) == fresh


def test_oort_defaults_are_the_authors():
    """The authors' argParser: exploration 0.9, decay 0.95, floor 0.2 (before: 0.98 and 0.3). At round 20 with
    10 slots, eps = max(0.2, 0.9 * 0.95^21) = 0.305: 6 exploited (before: eps 0.591, 4)."""
    ctx = _context([1] * 20, [1.0 + c for c in range(10)] + [float("nan")] * 10, [0] * 20)
    for s in range(5):
        assert int((oort(20, 10, 20, _rng(s), rounds=30, context=ctx) < 10).sum()) == 6


def test_oort_selects_past_a_diverged_client():
    """A NaN last loss (a diverged client) scores nothing and an infinite one is clipped like any large reward:
    the selection goes on (before: the draw failed on a NaN probability, "a cannot be empty")."""
    ctx = _context([1] * 4, [float("nan"), float("inf"), 1.0, 2.0], [0] * 4)
    for s in range(20):
        assert oort(4, 3, 3, _rng(s), rounds=5, context=ctx, explore=0.0, explore_min=0.0).tolist() == [1, 2, 3]
    assert oort(4, 4, 3, _rng(), rounds=5, context=ctx, explore=0.0, explore_min=0.0).tolist() == [0, 1, 2, 3]


def test_oort_exploits_clients_whose_loss_is_zero():
    """A loss of 0 gives a reward below R_min (0.999 times the least positive reward, here the unexplored
    client's size) and so a negative score, which times cut_off lies above itself: the top exploitLen + 1 are
    kept whatever the cut-off, and drawn uniformly as none weighs more than nothing (before: no client passed
    the cut-off and the draw failed)."""
    ctx = _context([1, 1, 1, 5], [0.0, 0.0, 0.0, float("nan")], [0] * 4)
    picks = [oort(4, 2, 3, _rng(s), rounds=5, context=ctx, explore=0.0, explore_min=0.0).tolist() for s in range(60)]
    assert {tuple(p) for p in picks} == {(0, 1), (0, 2), (1, 2)}


def test_oort_stops_exploring_for_good_once_every_client_was_explored():
    """The authors' getTopK sets the factor and its floor to 0 in the first selection that finds nobody
    unexplored; that selection still used the decayed factor. All 5 clients reported in round 0: round 1's
    selection finds nobody unexplored and keeps eps 0.5 (1 of 2 slots exploited, the other to any client,
    3 and 4 included); from round 2 both slots are exploited above the cut-off, never 3 or 4 (before: eps
    stayed at explore_min 0.5 and the free slot went to any client in every round)."""
    ctx = _context([1] * 5, [8.0, 7.0, 6.0, 0.5, 0.4], [0] * 5)
    assert ctx.all_reported.tolist() == [0]
    opts = {"explore": 0.5, "explore_decay": 1.0, "explore_min": 0.5}
    first = [oort(5, 2, 1, _rng(s), rounds=9, context=ctx, **opts).tolist() for s in range(300)]
    assert any({3, 4} & set(p) for p in first)
    for r in (2, 5):
        later = [oort(5, 2, r, _rng(s), rounds=9, context=ctx, **opts).tolist() for s in range(300)]
        assert not any({3, 4} & set(p) for p in later)


def test_the_history_keeps_the_round_by_which_every_client_with_data_reported():
    h = ClientHistory([5, 0, 5, 5])
    h.record(0, np.array([0, 2]), np.array([1.0, 1.0]))
    h.record(1, np.array([0, 2]), np.array([1.0, 1.0]))
    assert h.context.all_reported.tolist() == [-1]  # client 3 never reported (client 1 holds no data)
    h.record(2, np.array([3]), np.array([1.0]))
    h.record(3, np.array([0, 3]), np.array([1.0, 1.0]))
    assert h.context.all_reported.tolist() == [2]
    again = ClientHistory([5, 0, 5, 5])
    again.load_state_dict(h.state_dict())
    assert again.context.all_reported.tolist() == [2] and again.unheard == 0


@pytest.mark.parametrize(
    "opts,key",
    [
        ({"explore": 1.5}, "explore"),
        ({"explore_min": 0.95}, "explore_min"),
        ({"staleness": -1}, "staleness"),
        ({"cut_off": 1.5}, "cut_off"),
        ({"clip_bound": -0.1}, "clip_bound"),
        ({"sample_window": 0.5}, "sample_window"),
    ],
)
def test_oort_refuses_bad_options(opts, key):
    with pytest.raises(ConfigError, match=f"sampler.{key} must be"):
        oort(6, 2, 0, _rng(), rounds=1, context=_context([3] * 6), **opts)


# ---- in a run: seeded, and resumed exactly -------------------------------------------------------------
def _cfg(sampler: dict, seed: int = 0, rounds: int = 5) -> dict:
    return {
        "name": "sel",
        "seed": seed,
        "rounds": rounds,
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": 12, "alpha": 0.5},
        "model": {"name": "logistic"},
        "algorithm": {"name": "fedavg", "clients_per_round": 3},
        "local": {"steps": 2, "batch_size": 16, "lr": 0.05},
        "sampler": sampler,
        "output": {"progress": False, "plots": False, "checkpoint_every": 1},
    }


def _who(res) -> tuple[list, list]:
    """The last round each client reported in and its loss then: which clients took part, round by round."""
    h = res.algorithm.client_history
    return h.last_round.tolist(), np.nan_to_num(h.last_loss, nan=-1.0).tolist()


def _losses(res) -> list[float]:
    return [r["test_loss"] for r in res.metrics]


@pytest.mark.parametrize("sampler", [{"name": "power_of_choice", "d": 6}, {"name": "oort"}])
def test_same_seed_same_clients_and_a_resume_equals_the_uninterrupted_run(sampler, tmp_path):
    whole = fedweave.run(_cfg(sampler), run_dir=tmp_path / "whole")
    again = fedweave.run(_cfg(sampler), run_dir=tmp_path / "again")
    assert _who(again) == _who(whole) and _losses(again) == _losses(whole)
    other = fedweave.run(_cfg(sampler, seed=1), run_dir=tmp_path / "other")
    assert _who(other) != _who(whole)
    fedweave.run(_cfg(sampler, rounds=2), run_dir=tmp_path / "part")
    resumed = resume(tmp_path / "part", ["rounds=5"], progress=False)
    assert _who(resumed) == _who(whole) and _losses(resumed) == _losses(whole)


def test_the_samplers_select_differently_from_uniform(tmp_path):
    uniform = fedweave.run(_cfg({"name": "uniform"}), run_dir=tmp_path / "u")
    poc = fedweave.run(_cfg({"name": "power_of_choice", "d": 6}), run_dir=tmp_path / "p")
    utility = fedweave.run(_cfg({"name": "oort"}), run_dir=tmp_path / "o")
    assert _losses(poc) != _losses(uniform) and _losses(utility) != _losses(uniform)


# ---- power-of-choice's aggregation weights: equal, its draw already counts the sizes ------------------------
def _rows(res) -> list[dict]:
    return [{k: v for k, v in row.items() if "seconds" not in k and "time" not in k} for row in res.metrics]


@pytest.mark.parametrize("algorithm", ["fedavg", "fednova", "afl"])
def test_power_of_choice_averages_its_clients_with_equal_weights(algorithm, tmp_path):
    """Cho et al. draw the candidates in proportion to their sizes and average the selected clients' models with
    equal weights (eq. (2), ``(1/m) sum_{k in S}``): under the default weighting the run is, bit for bit, the run
    with ``weighting: uniform`` (before: the sizes were counted twice, once by the draw and again by the weights).
    FedNova's tau_eff and AFL's lambda_0 come from the same weights."""
    sampler = {"name": "power_of_choice", "d": 6}
    cfg = _cfg(sampler, rounds=3)
    default = fedweave.run({**cfg, "algorithm": {"name": algorithm, "clients_per_round": 3}}, run_dir=tmp_path / "d")
    sizes = default.algorithm.sizes
    assert len(set(sizes.tolist())) > 3  # the dirichlet split's clients differ in size
    uniform = {"name": algorithm, "clients_per_round": 3, "weighting": "uniform"}
    equal = fedweave.run({**cfg, "algorithm": uniform}, run_dir=tmp_path / "u")
    assert _rows(default) == _rows(equal) and _who(default) == _who(equal)
    picked = np.array([0, 5, 7])
    assert default.algorithm.hp.weighting == "uniform"
    if algorithm != "afl":  # AFL's weights are its lambda, which moved from the uniform lambda_0
        assert torch.equal(default.algorithm.weights(picked), torch.full((3,), 1.0, dtype=sizes.dtype) / 3)
    # the other samplers keep the configured weighting: by size under the default
    plain = fedweave.run(
        {**_cfg({"name": "uniform"}, rounds=1), "algorithm": {"name": "fedavg"}}, run_dir=tmp_path / "p"
    )
    w = plain.algorithm.weights(picked)
    assert plain.algorithm.hp.weighting == "samples" and torch.equal(w, sizes[picked] / sizes[picked].sum())


def test_power_of_choice_refuses_an_explicit_weighting_by_samples_with_one_line(tmp_path):
    cfg = {**_cfg({"name": "power_of_choice"}), "algorithm": {"name": "fedavg", "weighting": "samples"}}
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r")
    msg = str(e.value)
    assert msg.startswith("algorithm.weighting: samples and sampler: power_of_choice both weigh clients by their sizes")
    assert "set it to uniform" in msg and "\n" not in msg
    assert not (tmp_path / "r").exists()


def test_a_registered_sampler_that_draws_by_size_gets_equal_weights_or_is_refused(tmp_path):
    """The declaration (``by_size``), not the name: a plug-in sampler that declares it is averaged with equal
    weights by the split family (its ``weighting``), and refused by the hierarchical one (it always weighs by
    size)."""
    from test_precision import family_config

    if "_by_size" not in SAMPLERS._items:

        @SAMPLERS.register("_by_size")
        @by_size
        def _drawn_by_size(num_clients, per_round, r, rng, *, rounds):
            return np.sort(rng.choice(num_clients, per_round, replace=False))

    split = {**family_config("cse_fsl"), "sampler": {"name": "_by_size"}, "rounds": 1}
    assert fedweave.run(split, run_dir=tmp_path / "s").algorithm.hp.weighting == "uniform"
    with pytest.raises(ConfigError) as e:
        fedweave.run({**family_config("hier_fedavg"), "sampler": {"name": "_by_size"}}, run_dir=tmp_path / "h")
    assert str(e.value).startswith(
        "sampler '_by_size' draws clients in proportion to their sizes, and the hierarchical"
    )
    assert "\n" not in str(e.value) and not (tmp_path / "h").exists()


def test_oort_decays_the_exploration_before_every_selection():
    """The authors' getTopK multiplies the factor by the decay before it selects, the first selection included:
    round r (from 0) explores with explore * decay^(r + 1). Clients 0-3 reported, 4-7 never did; of 4 slots,
    int(4 (1 - eps)) are exploited."""
    ctx = _context([10] * 8, [4.0, 3.0, 2.0, 1.0] + [float("nan")] * 4, [0] * 8)
    # explore 0.5, decay 0.5, round 0: eps 0.25, 3 exploited and 1 explored (before: eps 0.5, 2 and 2)
    got = oort(8, 4, 0, _rng(), rounds=5, context=ctx, explore=0.5, explore_decay=0.5, explore_min=0.0)
    assert int((got < 4).sum()) == 3
    # explore 0.9, decay 0.5, round 0: eps 0.45, int(2.2) = 2 exploited (before: eps 0.9, none)
    got = oort(8, 4, 0, _rng(), rounds=5, context=ctx, explore=0.9, explore_decay=0.5, explore_min=0.0)
    assert int((got < 4).sum()) == 2


def test_a_plug_in_sampler_that_ignores_its_rng_is_refused_in_round_one(tmp_path):
    """A sampler drawing from numpy's global generator ran to the end, and two runs of one seed differed. Round 0
    is drawn when the run is built and again in round 1: the two must agree."""
    if "_global_rng" not in SAMPLERS._items:

        @SAMPLERS.register("_global_rng")
        def _global_rng(num_clients, per_round, r, rng, *, rounds):
            return np.sort(np.random.choice(num_clients, per_round, replace=False))

    from test_precision import family_config

    np.random.seed(3)  # a draw of 2 of 8 that repeats on the second call would pass: make it not
    cfg = {
        **family_config("fedavg"),
        "sampler": {"name": "_global_rng"},
        "partition": {"name": "iid", "num_clients": 8},
    }
    with pytest.raises(ConfigError, match=r"^sampler '_global_rng' chose clients \[.*\] for round 1 and then \[.*\]"):
        fedweave.run(cfg, run_dir=tmp_path / "g")
