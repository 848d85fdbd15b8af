"""Runtime checks of the split protocols (cse-fsl spec §9.2): exact ledger bytes, server copies and steps,
order identities, reductions between methods, the server clock, checkpoints and config errors.

All data here are SYNTHETIC (class means plus noise), used only to count bytes and check identities.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from fedweave.accounting.split import round_bytes, server_copies, server_steps, storage_params
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.split.base import Upload, process_order, simulate_server
from fedweave.config import ConfigError, from_dict
from fedweave.data.base import Dataset
from fedweave.models.split import SPLIT_MODELS, SplitModel, split_small
from fedweave.registry import DATASETS, PARTITIONERS

if "_toy_split" not in DATASETS._items:

    @DATASETS.register("_toy_split")
    def _toy_split(n_train: int = 1000, n_test: int = 200, side: int = 8, channels: int = 1) -> Dataset:
        """Synthetic class-conditional images (for counting and identities only)."""
        g = torch.Generator().manual_seed(0)
        mu = torch.randn(10, channels, side, side, generator=g)
        y = torch.randint(0, 10, (n_train + n_test,), generator=g)
        x = mu[y] + 0.8 * torch.randn(len(y), channels, side, side, generator=g)
        return Dataset("_toy_split", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10, (channels, side, side))


if "_two_thirds" not in PARTITIONERS._items:

    @PARTITIONERS.register("_two_thirds")
    def _two_thirds(labels, num_clients, rng, *, users=None):
        """Two clients, the first with two thirds of the samples (uneven: 4 and 2 batches of 10 out of 60)."""
        n = len(labels) // 3
        return [np.arange(0, 2 * n), np.arange(2 * n, 3 * n)]


torch.set_num_threads(1)
METHODS = ("fsl_mc", "fsl_oc", "fsl_an", "cse_fsl")


def make(
    algorithm, *, model="split_small", data=None, clients=5, batch=10, lr=0.05, seed=0, precision="float32", **local
):
    cfg = from_dict(
        {
            "seed": seed,
            "rounds": 1,
            "precision": precision,
            "dataset": {"name": "_toy_split", "n_train": 400, **(data or {})},
            "partition": {"name": "iid", "num_clients": clients},
            "model": model if isinstance(model, dict) else {"name": model},
            "algorithm": algorithm if isinstance(algorithm, dict) else {"name": algorithm},
            "local": {"batch_size": batch, "lr": lr, **local},
        }
    )
    return build_algorithm(RunContext(cfg))


def kinds(algo):
    led = algo.ledger
    return {k: led.bytes(kind=k) for k in ("smashed", "labels", "gradient", "client_model", "aux_model")}


# ---- spec §9.2: the full-size CIFAR models on synthetic CIFAR-shaped data ------------------------------
CIFAR_DATA = {"n_train": 100, "n_test": 10, "side": 24, "channels": 3}  # 5 clients × 20 samples, B = 5 → M_i = 4


@pytest.mark.parametrize("method, h", [("fsl_mc", 1), ("fsl_oc", 1), ("fsl_an", 1), ("cse_fsl", 2), ("cse_fsl", 4)])
def test_cifar_round_bytes_copies_steps(method, h):
    opts = {"name": method, **({"h": h} if method == "cse_fsl" else {})}
    algo = make(opts, model="split_cifar", data=CIFAR_DATA, batch=5, lr=0.01)
    sizes = algo.split_sizes
    assert (sizes.client, sizes.server, sizes.aux, sizes.smashed) == (107_328, 960_970, 23_050, 2304)
    m = algo.run_round(0)
    samples = [20] * 5
    expected = round_bytes(method, sizes, samples, 5, h=h)
    got = kinds(algo)
    assert got == {k: expected[k] for k in got}, method
    assert m["load_bytes"] == expected["load"]
    assert (
        m["server_copies"]
        == algo.server_copies
        == server_copies(method, 5)
        == {"fsl_mc": 5, "fsl_an": 5}.get(method, 1)
    )
    assert m["server_steps"] == server_steps(method, samples, 5, h=h)
    storage = algo.ledger.summary()["storage_peak_bytes"]
    held = storage["server"]["server_models"] + storage["fed_server"]["client_models"]
    assert held == 4 * storage_params(method, sizes, 5) == 4 * m["storage_params"]
    if method == "cse_fsl":
        assert m["server_steps"] == 5 * (4 // h)  # n·⌊M_i/h⌋ steps: the queue is drained
    if method in ("fsl_mc", "fsl_oc"):
        assert got["gradient"] == got["smashed"]


def test_digits_shaped_bytes_match_spec_table():
    # spec §9.3: 5 × 280 samples of 1×8×8, B = 10; CSE h = 4 sends 1,304,720 B per round, FSL_MC 6,117,120
    algo = make({"name": "cse_fsl", "h": 4}, data={"n_train": 1400, "n_test": 10})
    algo.run_round(0)
    assert algo.round_metrics(0, 5, 0, [], [])["load_bytes"] == 1_304_720
    assert kinds(algo)["labels"] == 5 * 7 * 10 * 8


# ---- the ledger bills the width a run sends, the closed forms stay the paper's float32 ------------------
@pytest.mark.parametrize("method", METHODS)
def test_float64_run_bills_twice_the_float32_value_bytes(method):
    # 5 clients x 80 samples, B = 10: M = 8 batches each; CSE-FSL h = 2 uploads batches 1, 3, 5, 7
    opts = {"name": method, **({"h": 2} if method == "cse_fsl" else {})}
    runs = {}
    for precision in ("float32", "float64"):
        algo = make(opts, precision=precision)
        m = algo.run_round(0)
        runs[precision] = (kinds(algo), algo.ledger.summary()["storage_peak_bytes"], m)
    s = algo.split_sizes
    up = 5 * (40 if method == "cse_fsl" else 80)  # samples whose smashed data go up
    aux = method in ("fsl_an", "cse_fsl")
    copies = 5 if method in ("fsl_mc", "fsl_an") else 1
    for precision, width in (("float32", 4), ("float64", 8)):  # bytes a value, as sent
        got, storage, m = runs[precision]
        assert got == {
            "smashed": up * s.smashed * width,
            "labels": up * 8,  # int64 labels in either precision
            "gradient": up * s.smashed * width if method in ("fsl_mc", "fsl_oc") else 0,
            "client_model": 2 * 5 * s.client * width,  # down to and up from every client
            "aux_model": 2 * 5 * s.aux * width if aux else 0,
        }, precision
        assert m["load_bytes"] == got["smashed"] + got["gradient"] + got["client_model"] + got["aux_model"]
        assert storage["server"]["server_models"] == copies * s.server * width
        assert storage["fed_server"]["client_models"] == 5 * (s.client + (s.aux if aux else 0)) * width
        if method == "cse_fsl":
            assert storage["server"]["queue_peak"] == m["queue_peak"] * 10 * s.smashed * width
    (b32, st32, m32), (b64, st64, m64) = runs["float32"], runs["float64"]
    assert {k: 2 * v for k, v in b32.items() if k != "labels"} == {k: v for k, v in b64.items() if k != "labels"}
    assert b64["labels"] == b32["labels"] and m64["load_bytes"] == 2 * m32["load_bytes"]
    assert st64 == {role: {k: 2 * v for k, v in held.items()} for role, held in st32.items()}
    # the closed forms are the paper's float32 convention (Table V) whatever the run's precision
    assert m32["load_bytes"] == round_bytes(method, s, [80] * 5, 10, h=2 if method == "cse_fsl" else 1)["load"]


def test_bf16_mixed_queue_peak_is_held_at_the_width_the_smashed_data_were_sent():
    # under bf16-mixed the client's last layer autocasts: smashed data travel in bfloat16 (2 bytes), the models
    # in float32; the server's queue holds what arrived
    algo = make({"name": "cse_fsl", "h": 2, "speed_spread": 3.0}, precision="bf16-mixed")
    m = algo.run_round(0)
    s = algo.split_sizes
    assert kinds(algo)["smashed"] == 5 * 40 * s.smashed * 2 and kinds(algo)["client_model"] == 2 * 5 * s.client * 4
    assert m["queue_peak"] >= 1
    assert algo.ledger.summary()["storage_peak_bytes"]["server"]["queue_peak"] == m["queue_peak"] * 10 * s.smashed * 2


def test_full_batch_queue_peak_is_held_in_the_batches_that_went_up():
    # local.full_batch: a client's one batch is its whole data (80 samples here), not local.batch_size (10); h = 1
    # uploads it, and the server's queue holds those batches
    algo = make({"name": "cse_fsl", "h": 1}, full_batch=True)
    m = algo.run_round(0)
    s = algo.split_sizes
    assert kinds(algo)["smashed"] == 5 * 80 * s.smashed * 4 and m["queue_peak"] >= 1
    assert algo.ledger.summary()["storage_peak_bytes"]["server"]["queue_peak"] == m["queue_peak"] * 80 * s.smashed * 4


# ---- identities ------------------------------------------------------------------------------------------
def _round(opts, **kw):
    algo = make(opts, **kw)
    algo.run_round(0)
    return algo


def test_client_side_independent_of_server_order():
    base = {"name": "cse_fsl", "h": 2}
    a = _round({**base, "server_order": "ordered"})
    s = _round({**base, "server_order": "sync"})
    r = _round({**base, "server_order": "random"})
    e = _round({**base, "server_order": "event"})  # equal speeds: arrivals tie window by window
    for other in (s, r, e):
        assert torch.equal(a.xc, other.xc) and torch.equal(a.xa, other.xa)  # clients never see the server
    assert torch.equal(a.xs, s.xs) and torch.equal(a.xs, e.xs)  # same processing order
    assert not torch.equal(a.xs, r.xs)  # another order of sequential steps gives another model


def test_cse_h1_equals_fsl_an_for_one_client():
    # with n = 1, FSL_AN's single copy takes the same steps on the same batches as CSE-FSL's one model
    cse = _round({"name": "cse_fsl", "h": 1}, clients=1, data={"n_train": 60})
    an = _round("fsl_an", clients=1, data={"n_train": 60})
    assert torch.allclose(cse.xc, an.xc) and torch.allclose(cse.xa, an.xa)
    assert torch.allclose(cse.xs, an.xs, atol=1e-6)


def test_cse_client_update_equals_fsl_an_for_any_n():
    cse = _round({"name": "cse_fsl", "h": 3})
    an = _round("fsl_an")
    assert torch.equal(cse.xc, an.xc) and torch.equal(cse.xa, an.xa)  # eq. (8) does not depend on h
    assert cse.server_copies == 1 and an.server_copies == 5


def test_fsl_mc_equals_fsl_oc_for_one_client():
    mc = _round("fsl_mc", clients=1, data={"n_train": 60})
    oc = _round({"name": "fsl_oc", "clip": None}, clients=1, data={"n_train": 60})
    assert torch.allclose(mc.xc, oc.xc, atol=1e-6) and torch.allclose(mc.xs, oc.xs, atol=1e-6)


def test_oc_schedules_differ_but_count_the_same():
    seq = _round("fsl_oc")
    inter = _round({"name": "fsl_oc", "schedule": "interleaved"})
    assert kinds(seq) == kinds(inter)
    assert not torch.equal(seq.xs, inter.xs)


def test_reproducible_and_learns():
    a = make({"name": "cse_fsl", "h": 2}, seed=3)
    b = make({"name": "cse_fsl", "h": 2}, seed=3)
    for r in range(3):
        a.run_round(r)
        b.run_round(r)
    assert torch.equal(a.xs, b.xs) and torch.equal(a.xc, b.xc)
    ev = a.evaluate(2)
    assert ev["test_accuracy"] > 0.6 and ev["aux_test_accuracy"] > 0.6  # synthetic, chance is 0.1


def test_partial_participation_counts():
    algo = make({"name": "cse_fsl", "h": 5, "clients_per_round": 2}, clients=10, data={"n_train": 1000})
    m = algo.run_round(0)  # 10 clients × 100 samples, 2 active: 10 batches each, 2 uploads each
    assert m["server_steps"] == 4
    assert kinds(algo)["client_model"] == 2 * 2 * 9_568 * 4
    assert m["storage_params"] == 66_954 + 2 * (9_568 + 5_130)


def test_checkpoint_roundtrip():
    a = _round({"name": "cse_fsl", "h": 2})
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make({"name": "cse_fsl", "h": 2})
    b.load_state_dict(torch.load(buf, weights_only=True))
    for k in ("xc", "xs", "xa"):
        assert torch.equal(getattr(a, k), getattr(b, k))
    a.run_round(1)
    b.run_round(1)
    assert torch.equal(a.xs, b.xs)


# ---- the server queue and clock ----------------------------------------------------------------------------
def _items(arrivals):
    return [Upload(pos, win, 0, torch.zeros(1), torch.zeros(1), arr) for pos, win, arr in arrivals]


def test_event_order_and_clock_closed_form():
    # client 0 is slow (τ = 3), client 1 fast (τ = 1); h = 1, two uploads each
    items = _items([(0, 0, 3.0), (0, 1, 6.0), (1, 0, 1.0), (1, 1, 2.0)])
    rng = np.random.default_rng(0)
    order = process_order("event", items, rng)
    assert order == [2, 3, 0, 1]
    clock = simulate_server(items, order, step_time=0.5, barrier=False)
    # starts 1, 2, 3, 6; idle 1 + 0.5 + 0.5 + 2.5 = 4.5; finish 6.5
    assert clock == {"finish": 6.5, "idle": 4.5, "queue_peak": 1}
    sync = simulate_server(items, process_order("sync", items, rng), step_time=0.5, barrier=True)
    # window 0 ready at 3: steps at 3, 3.5; window 1 ready at 6: steps at 6, 6.5
    assert sync["finish"] == 7.0 and sync["idle"] == 3.0 + 2.0
    slow = simulate_server(items, order, step_time=5.0, barrier=False)
    assert slow["queue_peak"] == 3  # items pile up while the server is busy


def test_event_mode_run_reports_clock():
    algo = make({"name": "cse_fsl", "h": 2, "server_order": "event", "speed_spread": 4.0, "server_step_time": 0.1})
    m = algo.run_round(0)
    assert m["sim_round_time"] > 8 and m["server_idle_time"] >= 0 and m["queue_peak"] >= 1


def test_event_clock_waits_for_each_aggregation(monkeypatch):
    # agg_every = c: a client starts its batches of the next c only once the fed server has averaged the last
    # c of every client, at the slowest one's end; client 0 takes 1 per batch, client 1 takes 3; h = 1, c = 2
    import fedweave.algorithms.split.cse_fsl as cse

    seen = []
    clock = cse.simulate_server
    monkeypatch.setattr(cse, "simulate_server", lambda items, *a, **k: seen.append(items) or clock(items, *a, **k))
    opts = {"name": "cse_fsl", "h": 1, "agg_every": 2, "server_order": "event", "speed_spread": 3.0}
    algo = make(opts, clients=2, batch=5, data={"n_train": 40})  # 20 samples a client: 4 batches
    monkeypatch.setattr(algo, "batch_time", lambda client: (1.0, 3.0)[client])
    m = algo.run_round(0)
    arrivals = {pos: sorted(u.arrival for u in seen[0] if u.pos == pos) for pos in (0, 1)}
    # client 0: batches 0, 1 at 1, 2; the average at 6 (client 1's second batch); batches 2, 3 at 7, 8
    assert arrivals == {0: [1.0, 2.0, 7.0, 8.0], 1: [3.0, 6.0, 9.0, 12.0]}
    assert m["sim_round_time"] == 12.0


# ---- configuration errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm, model, local, match",
    [
        ({"name": "cse_fsl", "h": 0}, "split_small", {}, "algorithm.h"),
        ({"name": "cse_fsl", "server_order": "lifo"}, "split_small", {}, "algorithm.server_order"),
        ({"name": "fsl_mc", "clients_per_round": 9}, "split_small", {}, "clients_per_round"),
        ("fsl_an", "logistic", {}, "not a split model"),
        ("fsl_an", {"name": "split_small", "aux": "rnn"}, {}, "model.aux"),
        ("fsl_an", {"name": "split_small", "depth": 3}, {}, "model.depth"),
        ("fsl_mc", "split_small", {"momentum": 0.9}, "local.momentum"),
        # a split model's options are checked against their types, naming the key (before: a bare TypeError, a
        # torch message naming no key, or a string taken as true)
        ("cse_fsl", {"name": "split_small", "width": 2.5}, {}, "model.width must be an integer"),
        ("cse_fsl", {"name": "split_small", "hidden": True}, {}, "model.hidden must be an integer"),
        ("cse_fsl", {"name": "split_small", "aux": "cnn", "aux_channels": 2.5}, {}, "model.aux_channels must be"),
        ("cse_fsl", {"name": "split_cifar", "crop": 4.5}, {}, "model.crop must be"),
        ("cse_fsl", {"name": "split_femnist", "client_relu": "no"}, {}, "model.client_relu must be true or false"),
        # the CNN+MLP head's width beside the MLP head, which has none (before: silently not read)
        ("cse_fsl", {"name": "split_small", "aux_channels": 4}, {}, "model.aux_channels applies to model.aux: cnn"),
        ("fsl_an", {"name": "split_small", "aux": "mlp", "aux_channels": 4}, {}, "model.aux_channels applies"),
        # a decay period without a decay: lrs reads it as 1 ** (r // 10) (before: silently not read)
        ({"name": "cse_fsl", "lr_decay_every": 10}, "split_small", {}, r"algorithm.lr_decay_every \(10\) spaces"),
        ({"name": "fsl_an", "lr_decay_every": 10}, "split_small", {"lr_decay": 1.0}, "set local.lr_decay below 1"),
    ],
)
def test_config_errors(algorithm, model, local, match):
    with pytest.raises(ConfigError, match=match):
        make(algorithm, model=model, **local)


def _split_log_probs(input_shape: tuple[int, ...], num_classes: int, aux_log_probs: bool = True) -> SplitModel:
    """split_small whose server part (and auxiliary net, with aux_log_probs) end in log_softmax; registered for
    the test that uses it only (the registry is the process's: `fedweave list` in the same worker lists it)."""
    m = split_small(input_shape, num_classes)
    aux = nn.Sequential(m.aux, nn.LogSoftmax(1)) if aux_log_probs else m.aux
    return SplitModel(m.client, nn.Sequential(m.server, nn.LogSoftmax(1)), aux, m.cut_shape)


def make_nll(algorithm: str, model: dict) -> object:
    cfg = from_dict(
        {
            "rounds": 1,
            "dataset": {"name": "_toy_split", "n_train": 400},
            "partition": {"name": "iid", "num_clients": 5},
            "model": model,
            "algorithm": {"name": algorithm},
            "local": {"batch_size": 10, "lr": 0.05},
            "task": {"loss": "nll"},
        }
    )
    return build_algorithm(RunContext(cfg))


@pytest.mark.parametrize("method", METHODS)
def test_nll_on_split_parts_that_output_logits_is_one_line(method, monkeypatch):
    """task.loss: nll reads log-probabilities; the split family built its parts without the run's model check, so
    split_small (logits) trained to train losses -13.2, nan, nan (fsl_an, cse_fsl) or -2.2, -27.8, -120.3
    (fsl_oc) without a word. Now one line when the run is built, from the check of the run's model: on x_s ∘ x_c,
    and on a_c ∘ x_c for the methods with an auxiliary net; parts that end in log_softmax train."""
    monkeypatch.setitem(SPLIT_MODELS._items, "_split_log_probs", _split_log_probs)
    with pytest.raises(ConfigError) as e:
        make_nll(method, {"name": "split_small"})
    msg = str(e.value)
    assert msg.startswith(
        "task.loss: nll needs a model that outputs log-probabilities (ending in log_softmax), but the outputs of "
        "model 'split_small' on two training samples are not"
    )
    assert "\n" not in msg
    # a server part ending in log_softmax, the auxiliary net on logits: refused where the net is trained
    logits_aux = {"name": "_split_log_probs", "aux_log_probs": False}
    if method in ("fsl_an", "cse_fsl"):
        with pytest.raises(ConfigError, match=r"outputs of model '_split_log_probs \(client part and auxiliary net\)'"):
            make_nll(method, logits_aux)
    else:
        make_nll(method, logits_aux)
    m = make_nll(method, {"name": "_split_log_probs"}).run_round(0)
    assert "train_loss" in m and all(0 < m[k] < 5 for k in ("train_loss", "server_loss") if k in m), m


def test_an_h_beyond_every_clients_batches_is_refused_and_h_at_them_uploads_once():
    # 2 batches per client < h: no client uploaded, the main server never trained and the run went on at chance
    # without a word (before); with h = 2 each client uploads its epoch's last batch
    with pytest.raises(ConfigError, match=r"^algorithm\.h \(50\) is more than the 2 batches of the largest client"):
        make({"name": "cse_fsl", "h": 50}, data={"n_train": 100})
    algo = make({"name": "cse_fsl", "h": 2}, data={"n_train": 100})
    m = algo.run_round(0)
    assert m["server_steps"] == 5 and np.isfinite(m["server_loss"]) and np.isfinite(m["train_loss"])


def test_windows_restart_each_local_epoch(monkeypatch):
    # 5 × 70 samples, B = 10 → M_i = 7; E = 2, h = 4: one window per epoch (batches 3 and 10 of the round), its 3
    # trailing batches trained, not uploaded. Before, the windows ran on across the epochs: batches 3, 7, 11,
    # three uploads a client, the second window holding the end of epoch 1 and the start of epoch 2
    algo = make({"name": "cse_fsl", "h": 4}, data={"n_train": 350}, epochs=2)
    sent, epoch = [], algo.client_epoch
    monkeypatch.setattr(algo, "client_epoch", lambda *a: (ep := epoch(*a)) and sent.append(ep.uploads) or ep)
    m = algo.run_round(0)
    assert [[(w, b) for w, b, _, _ in ups] for ups in sent] == [[(0, 3), (1, 10)]] * 5
    assert m["server_steps"] == 5 * 2 == server_steps("cse_fsl", [70] * 5, 10, h=4, epochs=2)
    expected = round_bytes("cse_fsl", algo.split_sizes, [70] * 5, 10, h=4, epochs=2)
    assert kinds(algo) == {k: expected[k] for k in kinds(algo)}
    steps = make({"name": "cse_fsl", "h": 4}, data={"n_train": 350}, steps=14, epochs=None)
    assert steps.run_round(0)["server_steps"] == 5 * 3  # local.steps: no epochs, one run of windows


def test_aggregation_every_c_batches():
    # 5 × 80 samples, B = 10 → M = 8; c = 3 → the models go down and up ⌈8/3⌉ = 3 times
    c3 = _round({"name": "cse_fsl", "h": 2, "agg_every": 3})
    expected = round_bytes("cse_fsl", c3.split_sizes, [80] * 5, 10, h=2, agg_every=3)
    assert kinds(c3) == {k: expected[k] for k in kinds(c3)}
    assert kinds(c3)["client_model"] == 3 * 2 * 5 * 9_568 * 4
    once = _round({"name": "cse_fsl", "h": 2})
    late = _round({"name": "cse_fsl", "h": 2, "agg_every": 8})  # c = M: the default schedule
    assert torch.equal(once.xc, late.xc) and torch.equal(once.xs, late.xs)
    assert not torch.equal(once.xc, c3.xc)


def test_a_segment_is_for_the_clients_with_batches_left_in_it(monkeypatch):
    # clients of 4 and 2 batches, c = 2: the second segment is the first client's alone. Before, the second client,
    # its batches done, downloaded, uploaded and was averaged unchanged into the first one's model there
    cfg = from_dict(
        {
            "rounds": 1,
            "dataset": {"name": "_toy_split", "n_train": 60},
            "partition": {"name": "_two_thirds", "num_clients": 2},
            "model": {"name": "split_small"},
            "algorithm": {"name": "cse_fsl", "h": 1, "agg_every": 2},
            "local": {"batch_size": 10, "lr": 0.05},
        }
    )
    algo = build_algorithm(RunContext(cfg))
    averaged, aggregate = [], algo.aggregate
    monkeypatch.setattr(algo, "aggregate", lambda got, *rows: averaged.append(got.tolist()) or aggregate(got, *rows))
    algo.run_round(0)
    assert averaged == [[0, 1], [0]]
    expected = round_bytes("cse_fsl", algo.split_sizes, [40, 20], 10, h=1, agg_every=2)
    assert kinds(algo) == {k: expected[k] for k in kinds(algo)}
    assert kinds(algo)["client_model"] == 2 * (2 + 1) * algo.split_sizes.client * 4  # trips: 2 + 1, down and up


def test_a_split_run_reads_no_backend_and_refuses_one(tmp_path):
    # the family's own loop reads no backend: its summary records none, and a backend set is refused (before: a
    # backend: vmap was accepted and silently not used)
    import fedweave
    from fedweave.config import ConfigError

    cfg = {"rounds": 1, "dataset": {"name": "_toy_split", "n_train": 100},
           "partition": {"name": "iid", "num_clients": 2}, "model": {"name": "split_small"},
           "algorithm": {"name": "cse_fsl", "h": 1}, "local": {"batch_size": 10, "lr": 0.05},
           "output": {"progress": False, "plots": False}}  # fmt: skip
    assert fedweave.run(cfg, run_dir=tmp_path / "r").summary["execution"]["backend"] is None
    for key, value in (("backend", "vmap"), ("memory", {"vmap_chunk": 4})):
        with pytest.raises(ConfigError, match=rf"^{key}(\.vmap_chunk)?: the split family trains its client and server"):
            fedweave.run({**cfg, key: value}, run_dir=tmp_path / key)


def test_cifar_crop_trains_on_random_crops_and_tests_on_the_centre(monkeypatch):
    """CSE-FSL's CIFAR pipeline (spec §3): RandomCrop(24) to train, CenterCrop(24) to test, so q = 2304 and
    the server has 960,970 parameters on 32×32 images."""
    from fedweave.models.split import CenterCrop

    seen = []
    forward = CenterCrop.forward
    monkeypatch.setattr(CenterCrop, "forward", lambda self, x: seen.append(tuple(x.shape[-2:])) or forward(self, x))
    crop = {"augment": ["crop", "flip"], "crop_size": 24, "crop_padding": 0}
    algo = make({"name": "cse_fsl", "h": 2}, model={"name": "split_cifar", "crop": 24},
                data={**CIFAR_DATA, "side": 32}, batch=5, lr=0.01, **crop)  # fmt: skip
    sizes = algo.split_sizes
    assert (sizes.client, sizes.server, sizes.aux, sizes.smashed) == (107_328, 960_970, 23_050, 2304)
    seen.clear()  # the model check's forward passes when the run was built (two whole training images)
    algo.run_round(0)
    assert seen and set(seen) == {(24, 24)}  # training batches arrive as random 24×24 crops
    expected = round_bytes("cse_fsl", sizes, [20] * 5, 5, h=2)
    got = kinds(algo)
    assert got == {k: expected[k] for k in got}  # 2304 floats of smashed data per sample
    seen.clear()
    algo.evaluate(0)
    assert set(seen) == {(32, 32)}  # whole test images, centre-cropped by the model
    with pytest.raises(ConfigError, match="local.crop_size"):
        make("cse_fsl", crop_size=24)  # without the crop augmentation


def test_center_crop_offsets_are_torchvisions():
    from fedweave.data.augment import center_crop

    x = torch.arange(2 * 3 * 32 * 31, dtype=torch.float32).reshape(2, 3, 32, 31)
    assert torch.equal(center_crop(x, 24), x[..., 4:28, 4:28])  # (32-24)/2 = 4; (31-24)/2 = 3.5 -> 4
    assert torch.equal(center_crop(x, 31), x[..., 0:31, :])  # 0.5 rounds to 0 (half to even)
    with pytest.raises(ValueError, match="does not fit"):
        center_crop(x, 33)


# ---- the updates against a plain float64 transcription of the paper's equations --------------------------
def _reference_round(algo, r, method, h):
    """One round of ``method`` written directly from eqs. (8), (11), (14) (and SFLV1/V2's exchange), with
    functional calls on copies of the templates: each client from x_c^t (a_c^t), its batches in order; CSE-FSL's
    server steps window by window, clients in order; FSL_MC/FSL_AN average their copies (A18)."""
    from torch.func import functional_call

    def params(module, flat):
        out, o = {}, 0
        for name, p in module.named_parameters():
            out[name] = flat[o : o + p.numel()].view_as(p).clone().requires_grad_(True)
            o += p.numel()
        return out

    def sgd(ps, grads, lr):
        with torch.no_grad():
            for v, g in zip(ps.values(), grads, strict=True):
                v.sub_(lr * g)

    def ce(module, ps, x, y):
        return torch.nn.functional.cross_entropy(functional_call(module, ps, (x,)), y)

    C, S, A = algo.client, algo.server, algo.aux
    clients = algo.sample_clients(r)
    lr_c, lr_a, lr_s = algo.lrs(r)
    sizes = torch.tensor([len(algo.ctx.partition[int(i)]) for i in clients], dtype=torch.float64)
    p = sizes / sizes.sum()
    shared = params(S, algo.xs)  # FSL_OC's and CSE-FSL's one server-side model
    order = list(range(len(clients)))
    if method == "fsl_oc":
        order = algo.seeds.numpy("client_order", r).permutation(len(clients)).tolist()
    rows, queue = {}, []
    for k in order:
        pc, pa = params(C, algo.xc), params(A, algo.xa)
        ps = params(S, algo.xs) if method in ("fsl_mc", "fsl_an") else shared
        for m, (x, y) in enumerate(algo.local_batches(r, int(clients[k]))):
            a = functional_call(C, pc, (x,))
            if method in ("cse_fsl", "fsl_an"):  # eq. (8): the local loss through the auxiliary net
                g = torch.autograd.grad(ce(A, pa, a, y), [*pc.values(), *pa.values()])
                sgd(pc, g[: len(pc)], lr_c)
                sgd(pa, g[len(pc) :], lr_a)
                if method == "fsl_an":
                    sgd(ps, torch.autograd.grad(ce(S, ps, a.detach(), y), list(ps.values())), lr_s)  # copy k
                elif (m + 1) % h == 0:
                    queue.append(((m + 1) // h, k, a.detach(), y))
            else:  # the server steps on the smashed batch and sends dL/dA back down
                ad = a.detach().requires_grad_(True)
                g = torch.autograd.grad(ce(S, ps, ad, y), [ad, *ps.values()])
                sgd(ps, g[1:], lr_s)
                sgd(pc, torch.autograd.grad(a, list(pc.values()), g[0]), lr_c)
        rows[k] = [torch.cat([v.detach().reshape(-1) for v in d.values()]) for d in (pc, pa, ps)]
    for _, _, a, y in sorted(queue, key=lambda q: q[:2]):  # eq. (11), window by window, clients in order
        sgd(shared, torch.autograd.grad(ce(S, shared, a, y), list(shared.values())), lr_s)
    xc, xa, xs = (sum(p[k] * rows[k][j] for k in rows) for j in range(3))  # eq. (14)
    if method in ("cse_fsl", "fsl_oc"):
        xs = torch.cat([v.detach().reshape(-1) for v in shared.values()])
    return xc, xa, xs


@pytest.mark.parametrize(
    "algorithm, h",
    [
        ({"name": "cse_fsl", "h": 3, "client_lr": 0.03, "aux_lr": 0.2, "server_lr": 0.07}, 3),
        ("fsl_an", 1),
        ("fsl_mc", 1),
        ({"name": "fsl_oc", "clip": None}, 1),
    ],
)
def test_rounds_equal_the_equations_in_float64(algorithm, h):
    # 3 clients of 133/133/134 samples, B = 64: a short last batch, unequal weights; lr decay 0.5 from round 1
    algo = make(algorithm, clients=3, batch=64, lr=0.1, precision="float64", lr_decay=0.5)
    method = algo.name
    for r in range(2):
        xc, xa, xs = _reference_round(algo, r, method, h)
        algo.run_round(r)
        assert torch.allclose(algo.xc, xc, rtol=0, atol=1e-12)
        assert torch.allclose(algo.xs, xs, rtol=0, atol=1e-12)
        if algo.uses_aux:
            assert torch.allclose(algo.xa, xa, rtol=0, atol=1e-12)


def test_a_model_passed_from_python_is_one_line_naming_the_split_models(tmp_path):
    """The split family builds its parts from a split model; a model passed from Python was refused as
    "model.name 'python' is not a split model", which named no cause."""
    import fedweave

    cfg = {
        "rounds": 1,
        "dataset": {"name": "_toy_split", "n_train": 100},
        "partition": {"name": "iid", "num_clients": 2},
        "algorithm": {"name": "fsl_mc"},
        "local": {"batch_size": 10, "lr": 0.05},
        "output": {"progress": False},
    }
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, model=lambda: nn.Linear(64, 10), run_dir=tmp_path / "run")
    assert str(e.value) == (
        "model: algorithm 'fsl_mc' builds its client and server parts (and auxiliary net) from a split model "
        f"(model.name: one of {', '.join(sorted(SPLIT_MODELS._items))}, or one registered with "
        "fedweave.models.split.SPLIT_MODELS.register), so it takes no model from Python"
    )
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything
