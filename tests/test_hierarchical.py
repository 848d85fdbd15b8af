"""The hierarchical topology and ZO-HFL on a tiny fixture dataset: the data split, the ledger, identities
of the algorithm (lambda = 0 is server SGD, CRN pairs), backend equivalence, resume and config errors."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.data.base import Dataset
from fedweave.registry import DATASETS


def _toy_hier(n_train: int = 600, n_test: int = 200, side: int = 4, classes: int = 3) -> Dataset:
    """Test fixture (synthetic): labels are the argmax of a fixed random linear map of Gaussian images."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n_train + n_test, 1, side, side, generator=g)
    y = (x.flatten(1) @ torch.randn(side * side, classes, generator=g)).argmax(1)
    return Dataset("_toy_hier", x[:n_train], y[:n_train], x[n_train:], y[n_train:], classes, (1, side, side))


if "_toy_hier" not in DATASETS._items:
    DATASETS.register("_toy_hier")(_toy_hier)


def _config(**algo) -> dict:
    return {
        "name": "hier",
        "seed": 2,
        "rounds": 3,
        "backend": algo.pop("backend", "loop"),
        "dataset": {"name": "_toy_hier"},
        "partition": {"name": "dirichlet", "num_clients": 6, "alpha": 1.0, "min_size": 10},
        "model": {"name": "logistic", "bias": False, "init": "zeros"},
        "algorithm": {"name": "zo_hfl", "tau": 2, "participation": 0.5, "server_batch_size": 16, **algo},
        "local": {"batch_size": 8, "lr": 0.1},
        "output": {"progress": False, "plots": False},
    }


def _build(**algo):
    name = algo.pop("name", "zo_hfl")
    cfg = _config(**algo)
    cfg["algorithm"]["name"] = name
    if name != "zo_hfl":
        cfg["algorithm"].pop("server_batch_size")
    return build_algorithm(RunContext(load(cfg)))


def test_split_server_share_and_client_pool():
    a = _build(server_share=0.3)
    d = a.data
    server = set(d.server.tolist())
    clients = [set(p.tolist()) for p in d.parts]
    assert len(server) == round(0.3 * 600)
    assert all(not (server & c) for c in clients)
    assert set().union(*clients) | server == set(range(600))  # dirichlet keeps every pool sample
    assert sum(map(len, clients)) == 600 - 180 and min(map(len, clients)) >= 10
    assert float(a.rho.sum()) == pytest.approx(0.7)  # rho_i = N_i / N_tr, N_tr includes the server (spec A2)
    assert a.k == 3 and len(a.sample_clients(0)) == 3
    # pooled 90/10 re-split (paper §IV)
    b = _build(test_fraction=0.1)
    assert len(b.data.test_y) == 80 and len(b.data.train_y) == 720 and len(b.data.server) == 216


@pytest.mark.parametrize(
    ("message", "upload", "down", "up"),
    [
        ("vector", "models", 2 * 48 * 4, 2 * 48 * 4),
        ("seed", "models", 48 * 4 + 8, 2 * 48 * 4),
        ("vector", "values", 2 * 48 * 4, 16),
    ],
)
def test_ledger_bytes_per_round_match_the_formula(message, upload, down, up):
    # spec §7: down x^_r and v_i (or a seed), up y^+ and y^- (or two float64 penalty values), per participant
    a = _build(direction_message=message, upload=upload)
    assert a.dim == 16 * 3
    for r in range(2):
        a.run_round(r)
        assert a.ledger.bytes("down", round=r) == a.k * down
        assert a.ledger.bytes("up", round=r) == a.k * up
    assert a.ledger.count(kind="model+direction") == 2 * a.k


def test_lambda_zero_is_sgd_on_the_server_data_and_contacts_no_client():
    a = _build(lam=0.0, server_lr=0.5)
    x = a.x.clone()
    for r in range(3):
        xb, yb = a.server_batch(r, 16)
        w = x.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(xb.flatten(1) @ w.view(3, 16).T, yb)
        (g,) = torch.autograd.grad(loss, w)
        x = x - 0.5 / (r + 1) ** 0.5 * g  # gamma_r = gamma_0 / sqrt(r+1)
        a.run_round(r)
    assert torch.allclose(a.x, x, atol=1e-6)
    assert a.ledger.bytes() == 0


def test_crn_pairs_share_batches_and_the_zo_term_uses_them():
    a = _build(crn=True)
    same = torch.zeros(4, a.dim)  # two clients, identical + and - inputs
    out = a.solve(0, np.array([1, 4]), same, H=3)
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[3])
    assert not torch.equal(out[0], out[2])
    b = _build(crn=False)
    out = b.solve(0, np.array([1, 4]), same, H=3)
    assert not torch.equal(out[0], out[1])


def test_zo_step_matches_a_hand_computation():
    a = _build(lam=4.0, eta=0.2, server_lr=0.3)
    r, x0 = 0, a.x.clone()
    clients = a.sample_clients(r)
    g1, _ = a.server_gradient(r, 16)
    from fedweave.algorithms.hierarchical.base import unit_directions

    v = unit_directions(a.seeds, r, a.m, a.dim)[clients]
    inputs = torch.stack([x0 + 0.2 * v, x0 - 0.2 * v], 1).reshape(-1, a.dim)
    y = a.solve(r, clients, inputs, a.steps(r)).reshape(len(clients), 2, a.dim)
    g = g1.double()
    for j, i in enumerate(clients):
        fp = 2.0 * a.rho[i] * ((inputs[2 * j] - y[j, 0]).double() ** 2).sum()  # (lam/2) rho_i ||x - y||^2
        fm = 2.0 * a.rho[i] * ((inputs[2 * j + 1] - y[j, 1]).double() ** 2).sum()
        g = g + a.dim / (2 * 0.2) * (fp - fm) * v[j].double()
    a.run_round(r)
    assert torch.allclose(a.x.double(), x0.double() - 0.3 * g, atol=1e-5)


def test_global_loss_is_f1_and_the_f2_estimate_at_the_model_the_round_sent():
    # spec A13: round r's global loss is f1(x^_r) + f2^_r, f2^_r from the y^+/- solved around x^_r. x^_0 = 0
    # gives every class probability 1/3, so f1(x^_0) = ln 3 on any data; the step then moves x (server_loss,
    # f1(x^_1), is no longer ln 3), and f1(x^_1) + f2^_0 would mix two models
    from fedweave.algorithms.hierarchical.base import unit_directions

    lam, eta = 4.0, 0.2
    a = _build(lam=lam, eta=eta, server_lr=0.3)
    assert "global_loss" not in a.evaluate(-1)  # the initial model: no f2 estimate before round 0's solves
    r, x0 = 0, a.x.clone()
    clients = a.sample_clients(r)
    v = unit_directions(a.seeds, r, a.m, a.dim)[clients]
    inputs = torch.stack([x0 + eta * v, x0 - eta * v], 1).reshape(-1, a.dim)
    y = a.solve(r, clients, inputs, a.steps(r)).reshape(len(clients), 2, a.dim).double().numpy()
    plus, minus = inputs[0::2].double().numpy() - y[:, 0], inputs[1::2].double().numpy() - y[:, 1]
    w = a.rho[clients].numpy()
    # (lambda/2) sum_{i in S_r} w_i (m/k_r) 1/2 (||a_i||^2 + ||b_i||^2)
    f2 = float((lam / 2 * w * 0.5 * ((plus**2).sum(1) + (minus**2).sum(1))).sum() * a.m / len(clients))
    assert a.run_round(r)["penalty"] == pytest.approx(f2, rel=1e-6)
    ev = a.evaluate(r)
    assert abs(ev["server_loss"] - np.log(3)) > 1e-2
    assert ev["global_loss"] == pytest.approx(np.log(3) + f2, rel=1e-6)
    b = _build(lam=0.0, server_lr=0.3)  # lambda = 0: f2 = 0 at every model, f1 of the same x^_r
    assert b.evaluate(-1)["global_loss"] == pytest.approx(np.log(3), rel=1e-6)
    b.run_round(0)
    assert b.evaluate(0)["global_loss"] == pytest.approx(np.log(3), rel=1e-6)


def test_loop_and_vmap_backends_agree_and_auto_resolves():
    a, b = _build(backend="loop"), _build(backend="vmap")
    # softmax regression with 2 x 6 jobs per call at one thread (conftest): the loop's fused kernel
    assert _build(backend="auto", participation=1.0).backend == "loop"
    for r in range(3):
        ma, mb = a.run_round(r), b.run_round(r)
        assert ma["penalty"] == pytest.approx(mb["penalty"], rel=1e-4)
    assert torch.allclose(a.x, b.x, atol=1e-5)


def test_resume_from_state_dict_continues_identically():
    a = _build()
    for r in range(3):
        a.run_round(r)
    b = _build()
    b.run_round(0)
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = _build()
    c.load_state_dict(torch.load(buf, weights_only=True))
    for r in (1, 2):
        c.run_round(r)
    assert torch.equal(a.x, c.x)


def test_run_end_to_end_writes_metrics(tmp_path):
    from fedweave.runner import run

    cfg = _config()
    cfg["output"]["dir"] = str(tmp_path / "run")
    res = run(load(cfg))
    last = res.metrics[-1]
    for key in ("test_accuracy", "server_loss", "global_loss", "penalty", "step_norm", "local_steps"):
        assert np.isfinite(last[key])
    assert last["local_steps"] == 2 * 3**0.5 // 1  # H_2 = floor(2 sqrt(3))
    assert last["client_sgd_steps"] == 2 * 3 * last["local_steps"] and last["zo_evaluations"] == 6


def test_run_writes_the_clients_partition_report(tmp_path):
    # the clients' shares of the pool, as docs/results.md promises for every run (before: no partition.csv)
    from fedweave.runner import run

    cfg = _config(server_share=0.3, test_fraction=0.1)
    cfg["rounds"], cfg["output"]["dir"] = 1, str(tmp_path / "run")
    run(load(cfg))
    d = _build(server_share=0.3, test_fraction=0.1).data
    rows = (tmp_path / "run" / "partition.csv").read_text().splitlines()
    assert rows[0] == "client,n,class_0,class_1,class_2" and len(rows) == 1 + len(d.parts)
    for i, (row, part) in enumerate(zip(rows[1:], d.parts, strict=True)):
        counts = np.bincount(d.train_y.numpy()[part], minlength=3)
        assert row == ",".join(map(str, [i, len(part), *counts]))
    assert sum(int(r.split(",")[1]) for r in rows[1:]) == 720 - 216  # the pool: no server or test sample


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"participation": 0.0}, "algorithm.participation"),
        ({"server_share": 1.0}, "algorithm.server_share"),
        ({"eta": 0.0}, "algorithm.eta"),
        ({"lam": -1.0}, "algorithm.lam"),
        ({"mu": -1.0}, "algorithm.mu"),
        # inf in float32: mu (y - x) at the first step is inf * 0 = NaN (before: a diverged run blamed on the lr)
        ({"mu": 1e39}, r"algorithm.mu must be in \[0, 3.40282e\+38\]"),
        ({"constraint": "disk"}, "algorithm.constraint"),
        ({"lamda": 1.0}, "algorithm.lamda"),
        ({"tau": 0}, "algorithm.tau"),
        # an option of another variant, which would be ignored (before: accepted and silently unread)
        ({"radius": 0.5}, "algorithm.radius: constraint 'none' does not read it"),
        ({"constraint": "ball", "box_low": -1.0}, "algorithm.box_low: constraint 'ball' does not read it"),
        ({"constraint": "box", "radius": 2.0}, "algorithm.radius: constraint 'box' does not read it"),
        ({"local_schedule": "constant", "local_offset": 5.0}, "algorithm.local_offset: local_schedule 'constant'"),
        ({"name": "hier_fedavg", "local_schedule": "constant", "local_offset": 5.0}, "algorithm.local_offset"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _build(**options)


@pytest.mark.parametrize(
    ("options", "most"),
    [
        ({"steps_power": 15.0}, "2.87e+07"),  # H_2 = floor(2 * 3^15): the run would take days, not end in error
        ({"steps_power": 1000.0}, "inf"),  # 3^1000 overflows a float
        ({"name": "hier_fedavg", "steps_factor": 4_000_000}, "1.2e+07"),  # 4e6 x H_2 = 3
    ],
)
def test_local_steps_past_the_bound_in_the_last_round_are_refused(options, most):
    # H_r = floor(tau (r+1)^q) grows with r; its last round's (x steps_factor) is bounded as local.steps is.
    # Before, the run was built and its first long round never ended (or a float overflow surfaced mid-run).
    pattern = rf"algorithm\.steps_power .* {re.escape(most)} local steps .* round 3 .*10,000,000"
    with pytest.raises(ConfigError, match=pattern):
        _build(**options)
    _build(steps_power=14.0)  # H_2 = floor(2 * 3^14) = 9,565,938: allowed


def test_a_server_step_power_past_the_float_range_steps_by_zero_not_an_overflow():
    # gamma_r = server_lr / (r+1)^p: 3^1000 overflows a float, which raised OverflowError in round 2
    a = _build(server_lr_power=1000.0)
    assert a.server_lr(0) == 0.01 and a.server_lr(1) == 0.01 / 2**1000
    assert a.server_lr(2) == 0.0
    for r in range(2):
        a.run_round(r)
    x = a.x.clone()
    a.run_round(2)
    assert torch.equal(a.x, x)


def test_an_option_of_another_variant_at_its_default_builds():
    _build(constraint="ball", radius=0.5, box_low=0.0, box_high=float("inf"))
    _build(constraint="box", box_low=-1.0, box_high=1.0, radius=1.0)
    _build(local_schedule="constant", local_offset=1.0)


@pytest.mark.parametrize(("low", "high"), [(float("-inf"), 0.5), (-0.5, float("inf"))])
def test_a_one_sided_box_builds_and_projects_on_its_one_side(low, high):
    # box_high .inf was accepted but box_low -.inf refused ("must be a finite number"): {y <= high} is a box too
    a = _build(constraint="box", box_low=low, box_high=high)
    y = torch.tensor([-1e30, -1.0, 0.0, 1.0, 1e30])
    torch.testing.assert_close(a.projection(y, y), y.clamp(low, high))
    a.run_round(0)
    assert torch.isfinite(a.x).all()


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"box_low": float("inf")}, r"algorithm\.box_low must be a finite number or -inf, got inf"),
        ({"box_high": float("-inf")}, r"algorithm\.box_high must be a finite number or inf, got -inf"),
    ],
)
def test_a_box_bound_at_the_other_infinity_is_refused(options, shown):
    # the box would be empty, or every coordinate clamped to +-inf
    with pytest.raises(ConfigError, match=shown):
        _build(constraint="box", **options)


# ---- the baselines in the same server-data setting ----------------------------------------------------------


def test_baselines_ledger_and_fedprox_mu_zero_is_fedavg():
    avg, prox = _build(name="hier_fedavg"), _build(name="hier_fedprox", mu=0.0)
    scaf = _build(name="hier_scaffold")
    for r in range(2):
        avg.run_round(r), prox.run_round(r), scaf.run_round(r)
    assert torch.allclose(avg.x, prox.x, atol=1e-6)
    d = avg.dim * 4
    assert avg.ledger.bytes("down") == avg.ledger.bytes("up") == 2 * avg.k * d
    assert scaf.ledger.bytes("down") == scaf.ledger.bytes("up") == 2 * scaf.k * 2 * d  # x and c / dy and dc


def test_fedavg_round_is_the_sample_weighted_mean_of_local_solves():
    a = _build(name="hier_fedavg", tau=3)
    clients = a.sample_clients(0)
    local = a.trainer.train(a.x, clients, 0, lr=a.local_lr(), steps=3)
    p = a.sizes[clients] / a.sizes[clients].sum()
    a.run_round(0)
    assert torch.allclose(a.x, p.float() @ local.params, atol=1e-6)


def test_scaffold_option_ii_with_the_step_schedule():
    a = _build(name="hier_scaffold", tau=3)
    clients = a.sample_clients(0)
    local = a.trainer.train(a.x, clients, 0, lr=a.local_lr(), steps=3)
    a.run_round(0)  # c = c_i = 0: local steps are plain SGD, x <- x + mean(dy)
    assert torch.allclose(a.x, local.params.mean(0), atol=1e-6)
    lr_sum = 0.1 * (1 + 1 / 2 + 1 / 3)  # sum_k 0.1 / (k + 1)
    assert torch.allclose(a.store["c"][clients], -local.params / lr_sum, atol=1e-4)  # (x - y_i)/sum eta, x = 0
    assert torch.allclose(a.c, a.store["c"][clients].sum(0) / a.m, atol=1e-6)


def test_server_as_client_trains_on_the_server_share_without_traffic():
    a = _build(name="hier_fedavg", server_data="client")
    clients, jobs = a.participants(0)
    assert jobs[-1] == a.server_job and len(jobs) == a.k + 1
    assert set(a.trainer.parts[a.server_job].tolist()) == set(a.data.server.tolist())
    a.run_round(0)
    assert a.ledger.count(kind="model") == 2 * a.k  # the server's own job sends nothing


def test_scaffold_server_holds_its_own_jobs_control_variate_under_server_data_client():
    for server_data, own in (("none", []), ("client", ["own_job_control_variate"])):
        a = _build(name="hier_scaffold", server_data=server_data)
        a.run_round(0)
        d = a.dim * 4
        storage = a.ledger.summary()["storage_peak_bytes"]
        server = {k: v for k, v in storage["server"].items() if k != "server_data"}
        assert server == {k: d for k in ("control_variate", *own)}  # c, and the c_i of the server's own job
        assert storage["client"] == {"control_variate": d}


@pytest.mark.parametrize("name", ["hier_fedavg", "hier_fedprox", "hier_scaffold"])
@pytest.mark.parametrize("share", [0.0, 0.0005])  # 0.0005 of 600 samples rounds to none
def test_server_as_client_without_server_data_is_refused(name, share):
    # an empty server job would train nothing, yet count in SCAFFOLD's uniform mean of the Delta y (pulling x back
    # toward x_r by k / (k + 1)), in its c update's 1 / (m + 1), in train_loss and in client_sgd_steps
    with pytest.raises(ConfigError, match=r"algorithm\.server_data: 'client' .* no samples"):
        _build(name=name, server_share=share, server_data="client")


def test_example_configs_validate():
    from pathlib import Path

    from fedweave.config import build_dataclass
    from fedweave.registry import ALGORITHMS

    paths = sorted((Path(__file__).parents[1] / "configs" / "hierarchical").glob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:
        cfg = load(path)
        build_dataclass(ALGORITHMS.get(cfg.algorithm.name).Hparams, cfg.algorithm.options, "algorithm")


def test_validation_holds_out_training_samples_and_hides_the_test_set():
    a = _build(server_share=0.3, validation=0.2)
    d = a.data
    val = set(d.validation.tolist())
    server = set(d.server.tolist())
    clients = set().union(*(set(p.tolist()) for p in d.parts))
    assert len(val) == 120 and not (val & server) and not (val & clients)
    assert val | server | clients == set(range(600))  # every training sample is somewhere, once
    assert d.num_train == 480 and len(server) == round(0.3 * 480)
    assert float(a.rho.sum()) == pytest.approx(0.7)  # N_tr excludes the held-out samples
    out = a.evaluate(0)
    assert "val_accuracy" in out and "val_loss" in out and "test_accuracy" not in out
    # without validation the split is the one it always was (same streams)
    assert torch.equal(_build(server_share=0.3).data.server, _build(server_share=0.3, validation=0.0).data.server)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"test_fraction": 1e-4}, r"algorithm\.test_fraction 0\.0001 of the 800 pooled samples is no test sample"),
        ({"validation": 1e-4}, r"algorithm\.validation 0\.0001 of the 600 training samples is no sample"),
    ],
)
def test_a_hold_out_that_rounds_to_no_sample_is_refused(options, message):
    # before: the run scored the empty set as test_accuracy 0 and test_loss 0 (val_* likewise) in every round
    with pytest.raises(ConfigError, match=message):
        _build(**options)
    _build(**{k: 10 * v for k, v in options.items()})  # 0.001 of 800 or 600: one sample


def test_a_server_share_that_leaves_the_clients_no_sample_names_it():
    # before: "partition.num_clients (6) exceeds the 0 training samples; use at most 0 clients", a count refused too
    with pytest.raises(ConfigError, match=r"algorithm\.server_share 0\.9995 of the 600 training samples leaves the"):
        _build(server_share=0.9995)


def test_train_loss_all_leaves_out_the_validation_hold_out():
    # A13(c): the cross-entropy of x on the training data, i.e. the N_tr samples held by the server or a
    # client; the validation hold-out is nobody's training data, so it must not enter this series
    a = _build(server_share=0.3, validation=0.2, eval_train_loss=True, server_lr=2.0)
    a.run_round(0)  # move x away from 0, where every sample's loss is log 3
    x1 = a.x.clone()  # x^_1, the model round 1 sends, whose global loss (and so this series) round 1 reports
    a.run_round(1)
    d = a.data
    held = torch.cat([d.server, *(torch.as_tensor(p) for p in d.parts)])
    assert len(held) == d.num_train
    logits = d.train_x[held].flatten(1).double() @ x1.double().view(3, 16).T
    expected = float(torch.nn.functional.cross_entropy(logits, d.train_y[held]))
    assert a.evaluate(1)["train_loss_all"] == pytest.approx(expected, rel=1e-5)


def test_train_loss_all_is_taken_at_the_model_of_the_global_loss():
    # A13(c) cross-checks (a) + (b): the cross-entropy of the same x^_r, the model round r sent, not of x^_{r+1}.
    # x^_0 = 0 gives every class probability 1/3, so round 0's train_loss_all is ln 3 whatever the step did
    # (before, it was taken at x^_1 after the step)
    a = _build(server_share=0.3, eval_train_loss=True, server_lr=2.0)
    a.run_round(0)
    ev = a.evaluate(0)
    assert abs(ev["server_loss"] - np.log(3)) > 1e-2  # the step moved x: x^_1's loss is not ln 3
    assert ev["train_loss_all"] == pytest.approx(np.log(3), rel=1e-6)
    b = _build(server_share=0.3, eval_train_loss=True, name="hier_fedavg")  # one model per round: its x, as before
    b.run_round(0)
    assert b.evaluate(0)["train_loss_all"] == pytest.approx(b.train_loss_at(b.x), rel=1e-12)


@pytest.mark.parametrize(("beta", "k"), [(0.25, 3), (0.35, 4), (0.45, 5), (0.15, 2), (0.05, 1), (0.9, 9), (0.5, 5)])
def test_clients_per_round_round_halves_up(beta, k):
    # spec A20: k = max(1, round(beta m)), the nearest whole number with halves up, as for every beta alike
    # (round-half-to-even would give 0.25 of 10 clients 2 but 0.35 of 10 clients 4)
    cfg = _config(participation=beta)
    cfg["partition"] = {"name": "dirichlet", "num_clients": 10, "alpha": 1.0, "min_size": 5}
    a = build_algorithm(RunContext(load(cfg)))
    assert a.k == k and len(a.sample_clients(0)) == k


def test_scaffold_clients_without_samples_keep_their_control_variate():
    # such a client takes no step, so option II has no gradient to average: its c_i stays as it was (0), and c
    # stays (1/m) sum_i c_i; it used to become c_i - c, pulling c towards 0 by c / m each round it took part
    cfg = _config(participation=0.5, tau=2)
    cfg["algorithm"]["name"] = "hier_scaffold"
    cfg["algorithm"].pop("server_batch_size")
    cfg["partition"] = {"name": "dirichlet", "num_clients": 20, "alpha": 0.01, "min_size": 0}
    a = build_algorithm(RunContext(load(cfg)))
    empty = [i for i in range(20) if len(a.data.parts[i]) == 0]
    sampled = set()
    for r in range(6):
        sampled |= set(a.sample_clients(r).tolist())
        a.run_round(r)
    assert sampled & set(empty) and a.c.abs().sum() > 0  # the fixture: empty clients took part, c moved
    assert torch.equal(a.store["c"][empty], torch.zeros_like(a.store["c"][empty]))
    torch.testing.assert_close(a.c, a.store["c"].sum(0) / a.m)


@pytest.mark.parametrize("name", ["hier_fedavg", "hier_fedprox"])
def test_a_round_of_clients_without_samples_keeps_the_model(name):
    # a partition may leave clients empty (min_size 0); such a client takes no step (y_i = x), so a round that
    # samples only empty clients must leave x as it was, where N_i / sum_j N_j would be 0 / 0 (x turned NaN)
    cfg = _config(participation=0.05, tau=2)
    cfg["algorithm"]["name"] = name
    cfg["algorithm"].pop("server_batch_size")
    cfg["partition"] = {"name": "dirichlet", "num_clients": 20, "alpha": 0.01, "min_size": 0}
    a = build_algorithm(RunContext(load(cfg)))
    empty = [r for r in range(20) if len(a.data.parts[a.sample_clients(r)[0]]) == 0]
    full = [r for r in range(20) if len(a.data.parts[a.sample_clients(r)[0]]) > 0]
    assert empty and full and full[0] < empty[0]  # the fixture: a round with data, then one without
    for r in range(empty[0]):
        a.run_round(r)
    before = a.x.clone()
    assert before.abs().sum() > 0
    out = a.run_round(empty[0])
    assert torch.equal(a.x, before)
    assert out["train_loss"] == 0.0  # the mean over no samples, as hier_scaffold's plain mean reports it


def _register_stateful_method() -> None:
    """A hierarchical method whose clients keep their last local model (a ``ClientStep`` over ``self.store``) and
    train proximally to it: what a researcher's own method with client state writes (docs/architecture.md)."""
    from dataclasses import dataclass

    from fedweave.algorithms.hierarchical.base import AveragingAlgorithm, AveragingHparams
    from fedweave.execution import LocalRule, StateStore
    from fedweave.execution.job import ClientStep
    from fedweave.registry import ALGORITHMS, CLIENT_STEPS, RULES

    if "_test_hier_prev" in ALGORITHMS._items:
        return

    @RULES.register("_test_hier_prox")
    class Prox(LocalRule):
        def __init__(self, prev: torch.Tensor) -> None:
            self.prev = prev

        def direction(self, w, grad, jobs):
            return grad(w) + (w - self.prev[jobs])

    @CLIENT_STEPS.register("_test_hier_step")
    class Step(ClientStep):
        state = ("prev",)

        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

        def rule(self, state):
            prev = state["prev"]
            return Prox(torch.where((prev == 0).all(1, keepdim=True), self.x, prev))

        def finish(self, state, start, result):
            return {}, {"prev": result.params}

    @dataclass
    class Hparams(AveragingHparams):
        pass

    @ALGORITHMS.register("_test_hier_prev")
    class Prev(AveragingAlgorithm):
        name = "_test_hier_prev"

        def __init__(self, ctx, hp) -> None:
            super().__init__(ctx, hp)
            self.store = StateStore(self.m + 1, dtype=ctx.dtype, placement=ctx.placement)
            self.store.create("prev", self.dim)

        def client_rule(self, r: int):
            return Step(self.x)

        def server_update(self, mean, got) -> None:
            self.x = mean

    Prev.Hparams = Hparams


def test_a_methods_own_client_state_is_in_the_checkpoint():
    """A method's per-client ``StateStore`` was not saved by the family base (only hier_scaffold saved its own
    c_i): a resumed run restarted its clients' state and its numbers differed from the uninterrupted run's."""
    _register_stateful_method()
    a = _build(name="_test_hier_prev")
    for r in range(3):
        a.run_round(r)
    b = _build(name="_test_hier_prev")
    b.run_round(0)
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = _build(name="_test_hier_prev")
    c.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(c.store["prev"], b.store["prev"]) and c.store["prev"].abs().sum() > 0
    for r in (1, 2):
        c.run_round(r)
    assert torch.equal(a.x, c.x)


def test_hier_scaffold_reads_a_checkpoint_of_its_c_i_written_before_the_family_saved_client_state():
    """hier_scaffold's c_i moved into the family's ``client_state``; a checkpoint that holds them as ``c_i`` (its
    own key before) still resumes to the same state."""
    a = _build(name="hier_scaffold")
    a.run_round(0)
    state = a.state_dict()
    old = {k: v for k, v in state.items() if k != "client_state"} | {"c_i": a.store["c"].clone()}
    b, c = _build(name="hier_scaffold"), _build(name="hier_scaffold")
    b.load_state_dict(state)
    c.load_state_dict(old)
    assert (
        a.store["c"].abs().sum() > 0
        and torch.equal(b.store["c"], a.store["c"])
        and torch.equal(c.store["c"], a.store["c"])
    )
