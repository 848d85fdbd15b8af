"""Power-of-choice's three variants (Cho, Wang and Joshi, AISTATS 2022, Algorithm 1 and Sec. 4): rpow-d ranks the
d candidates by the loss each last reported, pow-d by each candidate's loss of the current global model on its
whole training data, cpow-d on a mini-batch of b of its samples. On the centralized toy (8 clients of 60 samples,
3 a round, a logistic model of 148 float32 parameters): the candidates' losses recomputed by hand in numpy, the
probe billed by hand count, the same picks on every backend and after a resume, and the candidates that drop
out of a round answering no probe."""

from __future__ import annotations

import numpy as np
import pytest

import fedweave
from fedweave.config import ConfigError
from fedweave.runner import resume
from fedweave.topology.samplers import ClientHistory, power_of_choice
from tests.test_centralized import D_TOY, _algo, _cfg

F32 = 4
D = 6  # candidates a round, of the 8 clients


def _sampler(**opts) -> dict:
    return {"name": "power_of_choice", "d": D, **opts}


def _picked(algo, r: int) -> list[int]:
    """The clients that trained in round ``r`` (no faults: every sampled client reports)."""
    return np.flatnonzero(algo.client_history.last_round == r).tolist()


def _by_hand(algo, r: int, batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Round ``r``'s candidates (the size-proportional draw on the round's stream) and each one's mean
    cross-entropy of the global model, in numpy: softmax regression ``W x + b`` on its samples (a mini-batch of
    ``batch`` from the ``("candidate_batch", r, client)`` stream under cpow-d), rounded to float32."""
    sizes = algo.client_history.sizes.astype(np.float64)
    rng = algo.seeds.numpy("client_sampling", r)
    candidates = rng.choice(len(sizes), D, replace=False, p=sizes / sizes.sum())
    x = algo.x.double().numpy()
    w, b = x[: 4 * 36].reshape(4, 36), x[4 * 36 :]
    data = algo.trainer.train_x.double().numpy().reshape(-1, 36)
    labels = algo.trainer.train_y.numpy()
    losses = []
    for c in candidates:
        rows = algo.ctx.partition[int(c)]
        if batch is not None and len(rows) > batch:
            rows = rows[algo.seeds.numpy("candidate_batch", r, int(c)).choice(len(rows), batch, replace=False)]
        z = data[rows] @ w.T + b
        z = z - z.max(1, keepdims=True)
        nll = np.log(np.exp(z).sum(1)) - z[np.arange(len(rows)), labels[rows]]
        losses.append(nll.mean())
    return candidates, np.float32(losses).astype(np.float64)


def _top(candidates: np.ndarray, losses: np.ndarray, m: int = 3) -> list[int]:
    return sorted(candidates[np.argsort(-losses, kind="stable")[:m]].tolist())


# ---- the picks: the highest losses of the global model --------------------------------------------------------
@pytest.mark.parametrize("variant,batch", [("pow-d", None), ("cpow-d", 8)])
def test_the_candidates_evaluate_the_global_model_and_the_highest_losses_train(variant, batch):
    algo = _algo(
        {**_cfg("fedavg", rounds=3), "sampler": _sampler(variant=variant, **({"batch": batch} if batch else {}))}
    )
    for r in range(3):
        candidates, losses = _by_hand(algo, r, batch)
        assert len(np.unique(losses)) == D  # no tie: the order is the losses'
        np.testing.assert_allclose(algo.candidate_losses(candidates, r, batch), losses, rtol=1e-5)  # the context's
        algo.run_round(r)
        assert _picked(algo, r) == _top(candidates, losses)


def test_cpow_d_ranks_by_the_mini_batch_losses_not_the_whole_data():
    """A round where the two disagree: cpow-d's picks are the mini-batch ranking's, pow-d's the whole data's."""
    cfg = {**_cfg("fedavg", rounds=1), "sampler": _sampler(variant="cpow-d", batch=2)}
    algo = _algo(cfg)
    candidates, small = _by_hand(algo, 0, batch=2)
    _, whole = _by_hand(algo, 0)
    assert _top(candidates, small) != _top(candidates, whole)
    algo.run_round(0)
    assert _picked(algo, 0) == _top(candidates, small)


def test_the_sampler_ranks_by_what_the_context_evaluates():
    """The sampler alone, on a context whose losses of the model are given: the top ``per_round`` by them, the
    last reported losses ignored; rpow-d reads the last reported ones and never calls the evaluation."""
    asked = []

    def at_model(candidates, r, batch):
        asked.append((sorted(candidates.tolist()), r, batch))
        return np.array([[0.5, 0.1, 0.9, 0.3, 0.7][c] for c in candidates])

    h = ClientHistory(np.full(5, 10), at_model)
    h.record(0, np.arange(5), np.array([0.9, 0.8, 0.1, 0.2, 0.3]))
    rng = np.random.default_rng
    assert power_of_choice(5, 2, 1, rng(0), rounds=2, context=h.context, d=5, variant="pow-d").tolist() == [2, 4]
    assert asked == [([0, 1, 2, 3, 4], 1, None)]
    assert power_of_choice(5, 2, 1, rng(0), rounds=2, context=h.context, d=5, variant="cpow-d", batch=4).tolist() == [
        2,
        4,
    ]
    assert asked[-1] == ([0, 1, 2, 3, 4], 1, 4)
    assert power_of_choice(5, 2, 1, rng(0), rounds=2, context=h.context, d=5).tolist() == [0, 1]
    assert len(asked) == 2


def test_a_candidate_without_a_loss_is_not_selected():
    """NaN from the context's evaluation: the candidate sent no loss (it dropped out of the round). The others
    are ranked; fewer answers than the round takes: those that answered; none: nobody."""
    losses = np.array([0.5, np.nan, 0.9, np.nan, 0.7])
    h = ClientHistory(np.full(5, 10), lambda candidates, r, batch: losses[candidates])
    rng = np.random.default_rng
    assert power_of_choice(5, 2, 1, rng(0), rounds=2, context=h.context, d=5, variant="pow-d").tolist() == [2, 4]
    losses[[0, 2]] = np.nan
    assert power_of_choice(5, 2, 1, rng(0), rounds=2, context=h.context, d=5, variant="pow-d").tolist() == [4]
    losses[4] = np.nan
    assert power_of_choice(5, 2, 1, rng(0), rounds=2, context=h.context, d=5, variant="pow-d").tolist() == []


# ---- rpow-d is the default, bit for bit ------------------------------------------------------------------------
def test_rpow_d_named_is_the_default_bit_for_bit():
    default = _algo({**_cfg("fedavg", rounds=3), "sampler": _sampler()})
    named = _algo({**_cfg("fedavg", rounds=3), "sampler": _sampler(variant="rpow-d")})
    for r in range(3):
        default.run_round(r)
        named.run_round(r)
        assert _picked(default, r) == _picked(named, r)
    assert default.x.equal(named.x) and default.ledger.summary() == named.ledger.summary()
    assert named.ledger.bytes(kind="candidate_model") == named.ledger.bytes(kind="candidate_loss") == 0


# ---- the ledger: the model down to each candidate, one loss float up each ----------------------------------------
@pytest.mark.parametrize("variant,batch", [("pow-d", None), ("cpow-d", 8)])
def test_the_probe_is_billed_by_hand_count(variant, batch):
    """Per round: x_t down to each of the D candidates and one loss up each; the 3 selected train from the x_t
    they evaluated (Algorithm 1), so the round's message reaches them without it (FedAvg's holds nothing else:
    3 messages of 0 bytes), then their 3 models and 3 training losses up. Before, x_t went down twice to them."""
    opts = {"variant": variant, **({"batch": batch} if batch else {})}
    algo = _algo({**_cfg("fedavg", rounds=2), "sampler": _sampler(**opts)})
    plain = _algo({**_cfg("fedavg", rounds=2), "sampler": _sampler()})
    model = algo.num_params * F32  # 148 float32
    assert algo.num_params == D_TOY
    assert algo.ledger.bytes(kind="candidate_model") == 0  # the check draw when the run is built: not a round
    for r in range(2):
        algo.run_round(r)
        plain.run_round(r)
        assert algo.ledger.bytes("down", round=r, kind="candidate_model") == D * model
        assert algo.ledger.bytes("up", round=r, kind="candidate_loss") == D * F32
        assert algo.ledger.bytes("down", round=r, kind="model") == 0
        assert algo.ledger.bytes("down", round=r) == D * model
        assert algo.ledger.bytes("up", round=r) == 3 * model + 3 * F32 + D * F32  # models, train losses, the probe's
        assert plain.ledger.bytes("down", round=r) == 3 * model  # rpow-d: no probe, the model to the 3
        assert algo.ledger.bytes("up", round=r) == plain.ledger.bytes("up", round=r) + D * F32
    assert algo.ledger.count(kind="candidate_model") == algo.ledger.count(kind="candidate_loss") == 2 * D
    assert algo.ledger.count(kind="model", sender="server") == 2 * 3  # the call to train still reaches each
    # the forward passes are evaluation, not local steps: the clients' work is what it was
    assert algo.client_work(0, np.arange(8)).tolist() == plain.client_work(0, np.arange(8)).tolist()


def test_the_rest_of_the_rounds_message_is_still_sent_to_the_selected():
    """SCAFFOLD's message is (x, c): the selected candidates hold x_t from the probe and get c alone."""
    algo = _algo({**_cfg("scaffold", rounds=2), "sampler": _sampler(variant="pow-d")})
    model = algo.num_params * F32
    for r in range(2):
        algo.run_round(r)
        assert algo.ledger.bytes("down", round=r, kind="candidate_model") == D * model
        assert algo.ledger.bytes("down", round=r, kind="model+control") == 3 * model  # c, not x_t again
        assert algo.ledger.bytes("down", round=r) == (D + 3) * model


def test_a_model_changed_after_the_probe_is_sent_and_billed_again(monkeypatch):
    """Were x_t to change between the probe and the round's message, the selected candidates would not hold what
    they are sent: it is billed in full."""
    algo = _algo({**_cfg("fedavg", rounds=1), "sampler": _sampler(variant="pow-d")})
    sample = algo.sample_clients

    def sample_then_move(r):
        clients = sample(r)
        algo.x.add_(1.0)  # after the probe, before the round's message
        return clients

    monkeypatch.setattr(algo, "sample_clients", sample_then_move)
    algo.run_round(0)
    model = algo.num_params * F32
    assert algo.ledger.bytes("down", round=0, kind="model") == 3 * model
    assert algo.ledger.bytes("down", round=0) == (D + 3) * model


# ---- faults: a candidate that drops out of the round answers no probe ----------------------------------------------
def test_a_dropped_candidate_sends_no_loss_and_the_highest_of_those_that_answered_train():
    """Dropout 0.5 on the toy: a candidate that drops out of round r (the run's own draw, faults.dropped) sends
    no loss back, so the sampler ranks the others; every selected client then reports (its fate in the round is
    the same draw). Round 0 has two of the three highest losses dropped: [5, 6, 7] train (before: the three
    highest were selected, two of them dropped, and [5] alone trained); round 3 has 2 answers: those 2 train."""
    algo = _algo({**_cfg("fedavg", rounds=4), "sampler": _sampler(variant="pow-d"), "faults": {"dropout": 0.5}})
    picks, answers = [], 0
    for r in range(4):
        candidates, losses = _by_hand(algo, r)
        answered = ~algo.faults.dropped(r, candidates)
        answers += int(answered.sum())
        out = algo.run_round(r)
        picks.append(_picked(algo, r))
        assert picks[-1] == _top(candidates[answered], losses[answered])
        assert out["reported_clients"] == min(3, answered.sum())
        assert algo.ledger.bytes("down", round=r, kind="candidate_model") == D * D_TOY * F32  # sent to all D
        assert algo.ledger.bytes("up", round=r, kind="candidate_loss") == answered.sum() * F32  # answers only
        assert algo.ledger.count(kind="candidate_loss") == answers  # one message per answer
    assert picks[0] == [5, 6, 7] and picks[3] == [5, 7]


def test_an_outage_round_selects_nobody_and_is_skipped():
    algo = _algo({**_cfg("fedavg", rounds=2), "sampler": _sampler(variant="pow-d"), "faults": {"outage_rounds": [1]}})
    x0 = algo.x.clone()
    out = algo.run_round(0)
    assert out["reported_clients"] == 0 and algo.nobody_reported and algo.x.equal(x0)
    assert algo.ledger.bytes("down", round=0) == D * D_TOY * F32  # the probe went out; no loss came back
    assert algo.ledger.bytes("up", round=0) == 0 and algo.ledger.count(kind="model") == 0


def test_a_loss_that_is_not_a_number_is_still_an_answer():
    """A diverged model's losses are NaN: the candidates did answer, so the round still takes 3 of them (NaN
    from the context means no answer only)."""
    algo = _algo({**_cfg("fedavg", rounds=1), "sampler": _sampler(variant="pow-d")})
    algo.x.fill_(float("nan"))
    assert np.isneginf(algo.candidate_losses(np.arange(D), 0)).all()
    assert len(algo.sample_clients(0)) == 3


def test_the_deadline_does_not_cut_the_probe():
    """The probe takes no time on the clock (forward passes, no local step): every candidate answers, the three
    highest losses are selected, and a selected straggler misses the deadline with its update."""
    faults = {"deadline": 1.0, "speed_sigma": 1.0}
    algo = _algo({**_cfg("fedavg", rounds=3), "sampler": _sampler(variant="pow-d"), "faults": faults})
    late = 0
    for r in range(3):
        candidates, losses = _by_hand(algo, r)
        selected = _top(candidates, losses)
        algo.run_round(r)
        assert algo.ledger.bytes("up", round=r, kind="candidate_loss") == D * F32
        on_time = algo.reporting(r, np.array(selected)).tolist()
        assert _picked(algo, r) == on_time
        late += len(selected) - len(on_time)
    assert late > 0  # the case is exercised


# ---- the same picks on every backend, and after a resume ---------------------------------------------------------
@pytest.mark.parametrize("variant,batch", [("pow-d", None), ("cpow-d", 8)])
def test_the_backends_pick_the_same_clients(variant, batch):
    opts = {"variant": variant, **({"batch": batch} if batch else {})}
    runs = {}
    for backend in ("loop", "vmap", "pool"):
        algo = _algo({**_cfg("fedavg", rounds=3, backend=backend), "sampler": _sampler(**opts)})
        assert algo.trainer.backend == backend
        picks = []
        for r in range(3):
            algo.run_round(r)
            picks.append(_picked(algo, r))
        runs[backend] = picks
    assert runs["loop"] == runs["vmap"] == runs["pool"]


def _run_cfg(sampler: dict, rounds: int = 4) -> dict:
    return {**_cfg("fedavg", rounds=rounds), "sampler": sampler, "output": {"progress": False, "plots": False,
                                                                           "checkpoint_every": 1}}  # fmt: skip


@pytest.mark.parametrize("variant,batch", [("pow-d", None), ("cpow-d", 8)])
def test_a_resume_picks_and_bills_as_the_uninterrupted_run(variant, batch, tmp_path):
    sampler = _sampler(variant=variant, **({"batch": batch} if batch else {}))
    whole = fedweave.run(_run_cfg(sampler), run_dir=tmp_path / "whole")
    fedweave.run(_run_cfg(sampler, rounds=2), run_dir=tmp_path / "part")
    resumed = resume(tmp_path / "part", ["rounds=4"], progress=False)
    h, g = whole.algorithm.client_history, resumed.algorithm.client_history
    assert h.last_round.tolist() == g.last_round.tolist() and np.array_equal(h.last_loss, g.last_loss, equal_nan=True)
    assert [r["test_loss"] for r in whole.metrics] == [r["test_loss"] for r in resumed.metrics]
    for kind in ("candidate_model", "candidate_loss"):
        assert resumed.algorithm.ledger.bytes(kind=kind) == whole.algorithm.ledger.bytes(kind=kind)


# ---- bad options: one line each ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts,start",
    [
        ({"variant": "powd"}, "sampler.variant must be one of rpow-d, pow-d, cpow-d, got 'powd'"),
        ({"batch": 8}, "sampler.batch is cpow-d's mini-batch size; set variant: cpow-d or leave batch out"),
        ({"variant": "pow-d", "batch": 8}, "sampler.batch is cpow-d's mini-batch size"),
        ({"variant": "cpow-d"}, "sampler.batch (cpow-d's mini-batch size b) must be an integer >= 1, got None"),
        ({"variant": "cpow-d", "batch": 0}, "sampler.batch (cpow-d's mini-batch size b) must be an integer >= 1"),
        ({"variant": "cpow-d", "batch": 2.5}, "sampler.batch must be int or null, got 2.5"),
    ],
)
def test_bad_options_are_refused_in_one_line_when_the_run_is_built(opts, start):
    with pytest.raises(ConfigError) as e:
        _algo({**_cfg("fedavg"), "sampler": _sampler(**opts)})
    assert str(e.value).startswith(start) and "\n" not in str(e.value)


def test_a_method_without_a_global_model_is_refused_in_one_line():
    cfg = {**_cfg("ifca", clusters=2), "sampler": _sampler(variant="pow-d")}
    with pytest.raises(ConfigError) as e:
        _algo(cfg)
    assert str(e.value).startswith("sampler 'power_of_choice' has its candidates evaluate the global model, and ifca")


def test_a_context_without_the_models_losses_is_refused_in_one_line():
    ctx = ClientHistory(np.full(4, 5)).context  # a family that gives no loss_at_model
    with pytest.raises(ConfigError, match=r"^sampler.variant: pow-d has the candidates evaluate the global model"):
        power_of_choice(4, 1, 0, np.random.default_rng(0), rounds=1, context=ctx, variant="pow-d")


def test_compressed_downloads_are_refused_in_one_line():
    """The probe sends x_t dense to the candidates, which the replicas of compression.download do not follow."""
    cfg = {**_cfg("fedavg"), "sampler": _sampler(variant="pow-d"), "compression": {"download": {"name": "qsgd"}}}
    with pytest.raises(ConfigError) as e:
        _algo(cfg)
    msg = str(e.value)
    assert msg.startswith("sampler 'power_of_choice' sends the global model to its candidates") and "\n" not in msg
