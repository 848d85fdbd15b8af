"""The star's personalized methods: their special cases against FedAvg, closed forms of their steps, backends,
checkpoints, deployment, and each client's own test set (``eval.holdout``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedweave
from fedweave.algorithms.base import ProximalRule
from fedweave.algorithms.centralized.personal.apfl import APFLRule
from fedweave.algorithms.centralized.personal.base import PartialSharing, PersonalStar
from fedweave.algorithms.centralized.personal.perfedavg import ADAPT_KEY, PerFedAvgRule, hessian_vector
from fedweave.config import ConfigError, load
from fedweave.data.partition import holdout_split
from fedweave.deploy.support import unsupported
from fedweave.models import HeadedModel
from fedweave.registry import MODELS
from fedweave.runner import run as run_config
from tests.test_centralized import D_Q, M_Q, N_Q, _algo, _cfg, _quad_cfg, _quad_data, _rounds, _squared

PERSONAL = ["fedper", "fedrep", "lg_fedavg", "fedbn", "apfl", "ditto_star", "pfedme", "perfedavg", "fedbabu"]


class _Headless(HeadedModel):
    """An MLP that names no head: FedPer's and FedRep's personal part is empty."""

    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 8), nn.Linear(8, k)

    def features(self, x):
        return torch.relu(self.fc1(x.flatten(1)))

    def head(self, z):
        return self.fc2(z)

    def head_names(self) -> list[str]:
        return []


if "_headless" not in MODELS._items:
    MODELS.register("_headless")(lambda input_shape, num_classes: _Headless(int(np.prod(input_shape)), num_classes))
if "_bn_running" not in MODELS._items:
    MODELS.register("_bn_running")(
        lambda input_shape, num_classes: nn.Sequential(
            nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes)
        )
    )

MLP = {"name": "mlp", "hidden": [8]}


def _pcfg(alg: str, model: dict | None = None, **opts) -> dict:
    cfg = _cfg(alg, **opts)
    cfg["model"] = model or MLP
    return cfg


def _fedavg_x(model: dict, rounds: int = 3) -> torch.Tensor:
    return _rounds(_algo(_pcfg("fedavg", model)), rounds)


# ---- special cases: FedAvg bit for bit --------------------------------------------------------------
@pytest.mark.parametrize("alg", ["fedper", "fedrep"])
def test_an_empty_head_is_fedavg_bit_for_bit(alg):
    algo = _algo(_pcfg(alg, {"name": "_headless"}))
    assert not algo.partial
    assert torch.equal(_rounds(algo, 3), _fedavg_x({"name": "_headless"}))
    assert torch.equal(algo.personal_models(3), algo.x.expand(8, -1))  # nobody keeps anything


def test_fedbabu_trains_the_body_only_and_fine_tunes_at_evaluation():
    cfg = _pcfg("fedbabu", local={"steps": 4, "batch_size": 16, "lr": 0.2, "momentum": 0.9, "weight_decay": 1e-2})
    algo = _algo(cfg)
    x0 = algo.x.clone()
    _rounds(algo, 3)
    assert torch.equal(algo.x[algo.head], x0[algo.head])  # the head keeps its random start, momentum and all
    assert not torch.equal(algo.x[algo.body], x0[algo.body])
    p, n = int(algo.body.sum()), algo.hp.clients_per_round
    assert {(e.sender, e.bytes) for e in algo.ledger.entries()} == {("server", n * p * 4), ("client", n * p * 4)}
    full = algo.personal_models(3)  # tau epochs of local SGD from the global model, the fine-tuning's batches
    want = algo.tuner.train(algo.x, range(8), 3, key=(1,)).params
    assert torch.equal(full, want) and algo.tuner.local.epochs == 5
    head = _algo({**cfg, "algorithm": {**cfg["algorithm"], "finetune": "head"}})
    _rounds(head, 3)
    tuned = head.personal_models(3)
    assert torch.equal(tuned[:, head.body], head.x[head.body].expand(8, -1))  # only the head moved
    assert not torch.equal(tuned[:, head.head], head.x[head.head].expand(8, -1))


def test_fedbabu_with_an_empty_head_trains_as_fedavg_bit_for_bit():
    algo = _algo(_pcfg("fedbabu", {"name": "_headless"}))
    assert torch.equal(_rounds(algo, 3), _fedavg_x({"name": "_headless"}))


@pytest.mark.parametrize(
    "alg, outcome",
    [
        ("fedper", "nothing is shared: each client trains alone"),
        ("fedrep", "nothing is shared: each client trains alone"),
        ("fedbabu", "nothing trains in the rounds: each client fine-tunes the start"),
    ],
)
def test_a_model_whose_head_is_the_whole_model_warns_once_what_the_method_becomes(alg, outcome, caplog):
    """``logistic`` is all head: FedPer and FedRep degenerate into local training, FedBABU into fine-tuning the
    initial model; said once at the start. An MLP with a body, and LG-FedAvg (which then shares everything,
    FedAvg), say nothing."""
    with caplog.at_level("WARNING", logger="fedweave.algorithms.centralized.personal.base"):
        _algo(_pcfg(alg, {"name": "logistic"}))
    assert [r.getMessage() for r in caplog.records] == [
        f"algorithm {alg}: the head of Logistic is the whole model (no body), so {outcome}"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedweave.algorithms.centralized.personal.base"):
        _algo(_pcfg(alg))
        _algo(_pcfg("lg_fedavg", {"name": "logistic"}))
    assert not caplog.records


def test_fedbn_without_batch_norm_is_fedavg_bit_for_bit():
    assert torch.equal(_rounds(_algo(_pcfg("fedbn")), 3), _fedavg_x(MLP))


@pytest.mark.parametrize("alg", ["apfl", "ditto_star"])
def test_the_global_model_of_apfl_and_ditto_is_fedavgs_bit_for_bit(alg):
    """APFL with alpha = 0 (fixed) and Ditto train their global model exactly as FedAvg does."""
    opts = {"alpha": 0.0, "adaptive": False} if alg == "apfl" else {}
    assert torch.equal(_rounds(_algo(_pcfg(alg, **opts)), 3), _fedavg_x(MLP))


def test_apfl_with_alpha_zero_personalizes_nothing(tmp_path):
    cfg = {**_pcfg("apfl", alpha=0.0, adaptive=False), "rounds": 2, "eval": {"personal_test": True}}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    final = res.summary["final"]  # the personal model is the global one, on the same per-client sets
    assert final["test_accuracy_personal"] == final["test_accuracy"]
    assert final["test_loss_personal"] == final["test_loss"]
    ref = fedweave.run({**cfg, "algorithm": {"name": "fedavg", "clients_per_round": 3}}, run_dir=tmp_path / "f")
    assert ref.summary["final"]["test_accuracy"] == final["test_accuracy"]


# ---- what stays personal ------------------------------------------------------------------------------
@pytest.mark.parametrize("alg, personal", [("fedper", "head"), ("fedrep", "head"), ("lg_fedavg", "body")])
def test_the_personal_part_never_moves_in_the_global_model_and_is_not_sent(alg, personal):
    algo = _algo(_pcfg(alg))
    head = torch.zeros(algo.num_params, dtype=torch.bool)
    head[-(8 * 4 + 4) :] = True  # the mlp's last layer: 8 -> 4 classes
    assert torch.equal(algo.mask, head if personal == "head" else ~head)
    x0 = algo.x.clone()
    _rounds(algo, 2)
    assert torch.equal(algo.x[algo.mask], x0[algo.mask]) and not torch.equal(algo.x[~algo.mask], x0[~algo.mask])
    shared = int((~algo.mask).sum())
    assert algo.ledger.bytes("down", round=0) == 3 * shared * 4  # the shared part, to 3 clients, float32
    assert algo.ledger.bytes("up", round=0) == 3 * shared * 4
    kept = algo.store["personal"][:, algo.mask]  # the clients sampled so far hold personal parts of their own
    assert (kept != x0[algo.mask]).any(dim=1).sum() >= 3


@pytest.mark.parametrize("alg", ["fedper", "lg_fedavg", "fedbabu"])
def test_an_attacker_sends_only_what_the_method_uploads(alg):
    """A Byzantine client sends the shared part as every client does: a Gaussian attacker's noise takes the place
    of its shared coordinates, and the coordinates nobody sends (the personal part, FedBABU's fixed head) stay
    where they were in the global model."""
    attack = {"byzantine": {"clients": list(range(8)), "attack": "gaussian", "std": 1.0}}
    algo = _algo({**_pcfg(alg), "faults": attack})
    unsent = algo.head if alg == "fedbabu" else algo.mask
    x0 = algo.x.clone()
    _rounds(algo, 2)
    assert torch.equal(algo.x[unsent], x0[unsent])
    assert (algo.x[~unsent] - x0[~unsent]).abs().max() > 0.1  # the noise arrived where the clients send


def test_fedrep_trains_the_head_then_the_body_with_the_other_frozen(monkeypatch):
    algo = _algo(_pcfg("fedrep", head_epochs=2))
    calls = []
    for name in ("trainer", "head_trainer"):
        tr = getattr(algo, name)
        orig = tr.train

        def spy(starts, clients, r, *, rule, orig=orig, name=name, **kw):
            calls.append((name, rule.frozen.clone(), kw.get("key", ())))
            out = orig(starts, clients, r, rule=rule, **kw)
            moved = (out.params != starts).any(0)
            assert not moved[rule.frozen].any()  # the frozen part did not move, weight decay included
            return out

        monkeypatch.setattr(tr, "train", spy)
    algo.run_round(0)
    assert [c[0] for c in calls] == ["head_trainer", "trainer"]
    assert torch.equal(calls[0][1], ~algo.mask) and torch.equal(calls[1][1], algo.mask)
    assert calls[0][2] == (1,) and calls[1][2] == ()


def test_fedbn_keeps_the_batch_norm_parameters_local(tmp_path):
    cfg = {**_pcfg("fedbn", {"name": "cnn_fmnist", "norm": "batch"}), "dataset": {"name": "digits", "as_image": True}}
    algo = _algo(cfg)
    names = [n for n, k in zip(algo.layout.names, algo.layout.numels) for _ in range(k)]
    assert {n for n, m in zip(names, algo.mask.tolist()) if m} == {"bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"}
    x0 = algo.x.clone()
    _rounds(algo, 1)
    assert torch.equal(algo.x[algo.mask], x0[algo.mask])


def test_fedbn_refuses_running_statistics_with_one_line():
    with pytest.raises(ConfigError, match=r"^algorithm fedbn: the model keeps buffers \(2.running_mean") as e:
        _algo(_pcfg("fedbn", {"name": "_bn_running"}))
    assert "\n" not in str(e.value)


def test_cnn_norm_none_is_the_model_it_was():
    a = fedweave.models.build_model("cnn_mnist", (1, 28, 28), 10)
    torch.manual_seed(0)
    b = fedweave.models.build_model("cnn_mnist", (1, 28, 28), 10, norm="none")
    torch.manual_seed(0)
    c = fedweave.models.build_model("cnn_mnist", (1, 28, 28), 10)
    assert sum(p.numel() for p in a.parameters()) == 582_026 and not list(a.buffers())
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), c.parameters(), strict=True))
    bn = fedweave.models.build_model("cnn_mnist", (1, 28, 28), 10, norm="batch")
    assert sum(p.numel() for p in bn.parameters()) == 582_026 + 2 * (32 + 64) and not list(bn.buffers())
    with pytest.raises(ValueError, match="model.norm = 'layer' is not valid for model 'cnn_mnist'; allowed: none, or"):
        fedweave.models.build_model("cnn_mnist", (1, 28, 28), 10, norm="layer")


# ---- closed forms ---------------------------------------------------------------------------------------
def test_pfedme_one_step_is_the_closed_form_on_least_squares():
    lam, K, plr, beta, lr = 2.0, 3, 0.05, 0.7, 0.1
    cfg = {**_quad_cfg("pfedme", lam=lam, inner_steps=K, personal_lr=plr, beta=beta), "precision": "float64"}
    cfg["local"] = {"steps": 1, "batch_size": M_Q, "lr": lr}  # one full-batch step
    algo = _algo(cfg)
    algo.trainer.loss_fn = _squared
    x0 = algo.x.clone()
    algo.run_round(0)
    ds = _quad_data()
    ws, thetas = [], []
    for i in range(N_Q):
        a, y = ds.train_x[i * M_Q : (i + 1) * M_Q].double(), ds.train_y[i * M_Q : (i + 1) * M_Q].double()
        theta = x0.clone()
        for _ in range(K):  # Alg. 1 line 7 on f_i(theta) = (1/2m)||A theta - y||^2
            theta = theta - plr * (a.T @ (a @ theta - y) / M_Q + lam * (theta - x0))
        thetas.append(theta)
        ws.append(x0 - lr * lam * (x0 - theta))  # line 8
    expect = x0 + beta * (torch.stack(ws) - x0).mean(0)  # Alg. 1's server update, uniform weights
    assert algo.x.dtype == torch.float64 and algo.x.shape == (D_Q,)
    torch.testing.assert_close(algo.x, expect, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(algo.store["personal"], torch.stack(thetas), rtol=1e-12, atol=1e-12)


def _pfedme_closed_form(x0, lam, K, plr, lr):
    """Alg. 1 lines 7-8 of one full-batch local step for every client of the least-squares toy from ``x0``:
    each client's theta~ and w_{i,1}, ``(N_Q, D_Q)`` each."""
    ds, ws, thetas = _quad_data(), [], []
    for i in range(N_Q):
        a, y = ds.train_x[i * M_Q : (i + 1) * M_Q].double(), ds.train_y[i * M_Q : (i + 1) * M_Q].double()
        theta = x0.clone()
        for _ in range(K):  # line 7 on f_i(theta) = (1/2m)||A theta - y||^2
            theta = theta - plr * (a.T @ (a @ theta - y) / M_Q + lam * (theta - x0))
        thetas.append(theta)
        ws.append(x0 - lr * lam * (x0 - theta))  # line 8
    return torch.stack(thetas), torch.stack(ws)


def test_pfedme_train_all_trains_every_client_and_averages_the_sampled_ones():
    lam, K, plr, beta, lr, S = 2.0, 3, 0.05, 0.7, 0.1, 2
    opts = {"lam": lam, "inner_steps": K, "personal_lr": plr, "beta": beta, "clients_per_round": S}
    cfg = {**_quad_cfg("pfedme", **opts, train_all=True), "precision": "float64", "rounds": 3}
    cfg["local"] = {"steps": 1, "batch_size": M_Q, "lr": lr}  # one full-batch step
    algo, default = _algo(cfg), _algo({**cfg, "algorithm": {**cfg["algorithm"], "train_all": False}})
    for a in (algo, default):
        a.trainer.loss_fn = _squared
    nbytes = D_Q * 8  # one float64 model
    for r in range(3):
        x0, before = algo.x.clone(), algo.store["personal"].clone()
        sampled = default.sample_clients(r)  # the default's draw
        assert len(sampled) == S
        algo.run_round(r)
        default.run_round(r)
        thetas, ws = _pfedme_closed_form(x0, lam, K, plr, lr)
        # every client took the local steps from x_t: each personal model is its theta~, the unsampled ones too
        torch.testing.assert_close(algo.store["personal"], thetas, rtol=1e-12, atol=1e-12)
        assert (algo.store["personal"] != before).any(1).all()
        # Alg. 1's server update over the sampled clients' w_{i,R} only (uniform weights)
        expect = x0 + beta * (ws[torch.as_tensor(sampled)] - x0).mean(0)
        torch.testing.assert_close(algo.x, expect, rtol=1e-12, atol=1e-12)
        assert torch.equal(algo.x, default.x)  # the sampled clients' steps are the default's
        # the ledger: w_t down to all N_Q clients (line 3), w_{i,R} up from the S sampled ones
        billed = {(e.sender, e.kind): (e.bytes, e.count) for e in algo.ledger.entries() if e.round == r}
        assert billed == {("server", "model"): (N_Q * nbytes, N_Q), ("client", "model"): (S * nbytes, S)}
        assert default.ledger.bytes("down", round=r) == S * nbytes  # the default sends the sampled ones only


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_pfedme_train_all_with_every_client_sampled_is_the_default_bit_for_bit(backend):
    cfg = {**_pcfg("pfedme", clients_per_round=8), "backend": backend}
    algo, default = _algo({**cfg, "algorithm": {**cfg["algorithm"], "train_all": True}}), _algo(cfg)
    for r in range(3):
        assert algo.run_round(r) == default.run_round(r)
        assert algo.evaluate(r) == default.evaluate(r)
    assert torch.equal(algo.x, default.x) and torch.equal(algo.store["personal"], default.store["personal"])
    assert list(algo.ledger.entries()) == list(default.ledger.entries())


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_pfedme_train_all_keeps_the_default_global_model_and_moves_every_personal_model(backend):
    cfg = {**_pcfg("pfedme"), "backend": backend}  # 3 of 8 clients a round
    algo, default = _algo({**cfg, "algorithm": {**cfg["algorithm"], "train_all": True}}), _algo(cfg)
    for r in range(3):
        before = algo.store["personal"].clone()
        assert algo.run_round(r) == default.run_round(r)  # train_loss: the sampled clients'
        assert torch.equal(algo.x, default.x)
        assert (algo.store["personal"] != before).any(1).all()  # every client trained
        sampled = torch.as_tensor(default.sample_clients(r))
        assert torch.equal(algo.store["personal"][sampled], default.store["personal"][sampled])


@pytest.mark.parametrize(
    "faults", [{"dropout": 0.2}, {"deadline": 2.0}, {"byzantine": {"fraction": 0.25, "attack": "sign_flip"}}]
)
def test_pfedme_train_all_refuses_injected_faults_in_one_line(faults):
    with pytest.raises(ConfigError, match=r"^algorithm.train_all: true has every client take its local steps") as e:
        _algo({**_pcfg("pfedme", train_all=True), "faults": faults})
    assert "\n" not in str(e.value)
    _algo({**_pcfg("pfedme"), "faults": faults})  # the default takes them


def test_pfedme_train_all_resumes_bit_for_bit(tmp_path):
    cfg = {**_pcfg("pfedme", train_all=True), "rounds": 4}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    assert torch.equal(resumed.algorithm.store["personal"], full.algorithm.store["personal"])
    final = [{k: v for k, v in res.summary["final"].items() if k != "wall_seconds"} for res in (resumed, full)]
    assert final[0] == final[1] and "test_accuracy_personal" in final[0]


def _quadratic():
    g = torch.Generator().manual_seed(3)
    m = torch.randn(5, 5, generator=g, dtype=torch.float64)
    a = m @ m.T + torch.eye(5, dtype=torch.float64)  # f(w) = w'Aw/2 + b'w: grad Aw + b, Hessian A
    b = torch.randn(5, generator=g, dtype=torch.float64)
    w = torch.randn(5, generator=g, dtype=torch.float64)
    return a, b, w, (lambda v, draw=0: a @ v + b if v.dim() == 1 else v @ a + b)


def test_perfedavg_first_order_step_is_the_closed_form_on_a_quadratic():
    a, b, w, grad = _quadratic()
    alpha = 0.05
    d = PerFedAvgRule(alpha, "fo").direction(w, grad, 0)
    torch.testing.assert_close(d, a @ (w - alpha * (a @ w + b)) + b, rtol=1e-14, atol=1e-14)


def test_perfedavg_hessian_free_product_is_exact_on_a_quadratic():
    a, b, w, grad = _quadratic()
    v = torch.linspace(-1, 1, 5, dtype=torch.float64)
    torch.testing.assert_close(hessian_vector(grad, w, v, 1e-3), a @ v, rtol=1e-9, atol=1e-9)
    alpha = 0.05
    fo = a @ (w - alpha * (a @ w + b)) + b
    hf = PerFedAvgRule(alpha, "hf", 1e-3).direction(w, grad, 0)
    torch.testing.assert_close(hf, fo - alpha * a @ fo, rtol=1e-9, atol=1e-9)


def _perfedavg_step_closed_form(x0, batches, alpha, beta, variant):
    """Alg. 1 lines 6-7 of one local step on f(w; D) = (1/2|D|)||A_D w - y_D||^2 from ``x0`` with the draws
    ``batches`` = D, D' (and D''): w - beta (I - alpha H(w; D'')) grad f(w - alpha grad f(w; D); D')."""
    ds = _quad_data()
    a, y = ds.train_x.double(), ds.train_y.double()

    def grad(v, rows):
        return a[rows].T @ (a[rows] @ v - y[rows]) / len(rows)

    g = grad(x0 - alpha * grad(x0, batches[0]), batches[1])  # line 6, then grad f(w~; D')
    if variant == "hf":  # (I - alpha H(w; D'')) with the exact Hessian of D''
        g = g - alpha * a[batches[2]].T @ (a[batches[2]] @ g) / len(batches[2])
    return x0 - beta * g


@pytest.mark.parametrize("backend", ["loop", "vmap", "pool"])
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_local_step_uses_the_independent_batches_the_plan_drew(variant, backend):
    alpha, beta, bs = 0.05, 0.1, 8
    cfg = {**_quad_cfg("perfedavg", variant=variant, alpha=alpha), "precision": "float64", "backend": backend}
    cfg["local"] = {"steps": 1, "batch_size": bs, "lr": beta}  # one step on batches of 8 of a client's 40 samples
    algo = _algo(cfg)
    tr = algo.trainer
    tr.loss_fn = _squared
    rule = algo.client_rule(beta)
    assert rule.draws == (3 if variant == "hf" else 2)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(D_Q, generator=g, dtype=torch.float64)
    clients = list(range(N_Q))
    got = tr.train(x0, clients, 2, rule=rule).params
    for c in clients:
        batches = [tr.client_batches(c, 2, (), None, draw=j)[0] for j in range(rule.draws)]
        assert all(len(b) == bs for b in batches)
        assert not torch.equal(batches[0], batches[1])  # independent draws, not the step's batch reused
        if variant == "hf":
            assert not torch.equal(batches[1], batches[2]) and not torch.equal(batches[0], batches[2])
        expect = _perfedavg_step_closed_form(x0, batches, alpha, beta, variant)
        tol = 1e-12 if variant == "fo" else 1e-8  # HF: the central difference of Eq. 14, exact to rounding
        torch.testing.assert_close(got[c], expect, rtol=tol, atol=tol)
    # draw 0 is the step's batch every rule sees: plain SGD from x0 on it is FedAvg's step
    plain = tr.train(x0, clients, 2).params
    for c in clients:
        b = tr.client_batches(c, 2, (), None)[0]
        a, y = _quad_data().train_x.double()[b], _quad_data().train_y.double()[b]
        torch.testing.assert_close(plain[c], x0 - beta * a.T @ (a @ x0 - y) / bs, rtol=1e-12, atol=1e-12)


def test_dp_sgd_around_perfedavg_privatizes_every_draw_and_the_backends_agree():
    from fedweave.execution.dpsgd import PrivateTrainer

    got = []
    for backend in ("loop", "vmap"):
        cfg = {**_quad_cfg("perfedavg", variant="hf"), "precision": "float64", "backend": backend}
        cfg["local"] = {"steps": 2, "batch_size": 8, "lr": 0.1}
        algo = _algo(cfg)
        algo.trainer.loss_fn = _squared
        tr = PrivateTrainer.of(algo.trainer, 1.0, 0.5)
        got.append(tr.train(algo.x, [0, 1, 2], 0, rule=algo.client_rule(0.1)).params)
    torch.testing.assert_close(got[0], got[1], rtol=1e-12, atol=1e-12)


def test_the_accounted_dp_sgd_refuses_a_rule_of_several_draws_in_one_line():
    # each draw is a noisy gradient of its own; the accountant counts one per step, so it would under-count
    from fedweave.config import ConfigError
    from fedweave.privacy.sample import AccountedTrainer

    cfg = {**_quad_cfg("perfedavg"), "backend": "loop"}
    cfg["local"] = {"steps": 1, "batch_size": 8, "lr": 0.1}
    algo = _algo(cfg)
    algo.trainer.loss_fn = _squared
    tr = AccountedTrainer.of(algo.trainer, 1.0, 0.5)
    with pytest.raises(ConfigError, match="draws 2 independent batches a step, each a noisy gradient"):
        tr.train(algo.x, [0], 0, rule=algo.client_rule(0.1))


def test_a_rule_that_asks_for_a_draw_it_did_not_declare_is_told_in_one_line():
    cfg = {**_quad_cfg("perfedavg"), "backend": "loop"}
    cfg["local"] = {"steps": 1, "batch_size": 8, "lr": 0.1}
    algo = _algo(cfg)
    algo.trainer.loss_fn = _squared
    rule = PerFedAvgRule(0.05)
    rule.draws = 1  # declares one batch a step, asks for D' (draw 1)
    with pytest.raises(ValueError, match="asked for the gradient on draw 1 of a step that drew 1 batch"):
        algo.trainer.train(algo.x, [0], 0, rule=rule)


def test_apfl_rule_steps_v_and_alpha_as_the_paper():
    a, b, _, grad = _quadratic()
    v, w = torch.ones(2, 5, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64)
    w[1] = 0.5
    alpha = torch.tensor([[0.25], [0.5]], dtype=torch.float64)
    rule = APFLRule(alpha.clone(), w, alpha_lr=0.01)
    d = rule.direction(v, grad, torch.tensor([0, 1]))
    mix = alpha * v + (1 - alpha) * w
    g = mix @ a + b
    torch.testing.assert_close(d, alpha * g)  # line 6: grad_v f(vbar) = alpha grad f(vbar)
    expect = (alpha - 0.01 * ((v - w) * g).sum(1, keepdim=True)).clamp(0, 1)  # Eq. 10
    torch.testing.assert_close(rule.alpha, expect)


def test_ditto_on_the_star_uses_the_decentralized_rule(monkeypatch):
    algo = _algo(_pcfg("ditto_star", lam=0.3, personal_epochs=1))
    seen = []
    orig = algo.personal_trainer.train

    def spy(starts, clients, r, *, rule, **kw):
        seen.append(rule)
        return orig(starts, clients, r, rule=rule, **kw)

    monkeypatch.setattr(algo.personal_trainer, "train", spy)
    x0 = algo.x.clone()
    algo.run_round(0)
    (rule,) = seen
    assert type(rule) is ProximalRule and rule.lam == 0.3
    assert torch.equal(rule.anchor, x0.expand(3, -1))  # anchored at the round's global model w^t


# ---- backends, checkpoints, deployment, precision -------------------------------------------------------
@pytest.mark.parametrize("alg", PERSONAL)
def test_loop_and_vmap_agree(alg):
    algos = [_algo({**_pcfg(alg), "backend": b}) for b in ("loop", "vmap")]
    xs = [_rounds(a, 2) for a in algos]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)
    ps = [a.personal_models(2) for a in algos]
    torch.testing.assert_close(ps[0], ps[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alg", PERSONAL)
def test_resume_continues_identically(alg, tmp_path):
    cfg = {**_pcfg(alg), "rounds": 4}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    assert torch.equal(resumed.algorithm.personal_models(4), full.algorithm.personal_models(4))
    assert resumed.summary["final"]["test_accuracy_personal"] == full.summary["final"]["test_accuracy_personal"]


@pytest.mark.parametrize("alg", PERSONAL)
def test_personalized_methods_are_refused_for_deployment_with_one_line(alg):
    why = unsupported(alg, "centralized", "stop")
    assert why is not None and why.startswith(f"algorithm {alg!r} (centralized) cannot be deployed on Flower yet: ")
    assert "\n" not in why
    assert unsupported("fedavg", "centralized", "stop") is None


def test_apfl_refuses_an_alpha_step_size_without_the_alpha_steps_in_one_line():
    # alpha_lr is eta_alpha of Eq. 10, which adaptive: false turns off: it would be read by nothing
    with pytest.raises(ConfigError) as err:
        _algo(_pcfg("apfl", adaptive=False, alpha_lr=0.1))
    msg = str(err.value)
    assert msg.startswith("algorithm.alpha_lr is the step size of alpha's update") and "\n" not in msg


@pytest.mark.parametrize("alg", ["apfl", "pfedme"])
def test_rules_that_keep_client_state_refuse_the_out_of_process_backends(alg):
    with pytest.raises(ConfigError, match=f"algorithm {alg} .* backend pool .* choose backend loop or vmap"):
        _algo({**_pcfg(alg), "backend": "pool"})


def test_every_personalized_method_is_a_registered_personal_star():
    from fedweave.registry import ALGORITHMS

    for alg in PERSONAL:
        cls = ALGORITHMS.get(alg)
        assert issubclass(cls, PersonalStar) and cls.family == "centralized"
    assert issubclass(ALGORITHMS.get("fedbn"), PartialSharing)


# ---- each client's own test set ----------------------------------------------------------------------
def test_holdout_split_is_a_per_client_75_25_split():
    parts = [np.arange(0, 10), np.arange(10, 13), np.arange(13, 13)]
    train, test = holdout_split(parts, 0.25, np.random.default_rng(0))
    assert [len(t) for t in train] == [7, 2, 0] and [len(t) for t in test] == [3, 1, 0]
    for p, a, b in zip(parts, train, test):
        assert not set(a) & set(b) and sorted([*a, *b]) == list(p)


def test_eval_holdout_trains_without_and_evaluates_on_the_clients_own_samples(tmp_path):
    base = _pcfg("fedper")
    plain = _algo(base).ctx
    held = _algo({**base, "eval": {"holdout": 0.25}}).ctx
    x, y, parts = held.personal_test_set()
    assert x is held.dataset.train_x and y is held.dataset.train_y
    for whole, train, test in zip(plain.partition, held.partition, parts):
        assert len(test) == len(whole) - int(0.75 * len(whole))
        assert sorted([*train, *test]) == sorted(whole) and not set(train) & set(test)
    # without it the per-client test sets come from the test split, as eval.personal_test's always did
    x, _, parts = plain.personal_test_set()
    assert x is plain.dataset.test_x and all(np.array_equal(a, b) for a, b in zip(parts, plain.personal_test_parts()))
    res = fedweave.run({**base, "rounds": 1, "eval": {"holdout": 0.25}}, run_dir=tmp_path / "r")
    assert {"test_accuracy", "test_accuracy_personal", "test_accuracy_personal_min"} <= set(res.summary["final"])


@pytest.mark.parametrize(
    "algorithm, evaluation, tail",
    [
        ("fedavg", {}, "set eval.personal_test or eval.distribution to evaluate them, or leave it out"),
        ("hier_fedavg", {}, "nothing would evaluate the held-out samples; leave it out"),  # it never read it
        ("cse_fsl", {}, "nothing would evaluate the held-out samples; leave it out"),  # it trained without them
    ],
)
def test_a_holdout_nothing_evaluates_is_refused(algorithm, evaluation, tail, tmp_path):
    """Before: FedAvg without personal_test trained without the held-out samples and evaluated only the test split,
    the hierarchical and confederated families ignored the key, the split family trained without the samples."""
    cfg = {"rounds": 1, "dataset": {"name": "digits"}, "model": {"name": "logistic"}, "algorithm": {"name": algorithm}}
    cfg |= {"partition": {"name": "iid", "num_clients": 10}, "output": {"progress": False, "plots": False}}
    cfg["eval"] = {"holdout": 0.25, **evaluation}
    with pytest.raises(
        ConfigError, match=rf"^eval\.holdout: algorithm '{algorithm}' \(\w+\) evaluates no client's own .*{tail}$"
    ):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    if algorithm == "fedavg":  # asked for, it runs
        for asked in ({"personal_test": True}, {"distribution": True}):
            cfg["eval"] = {"holdout": 0.25, **asked}
            assert fedweave.run(cfg, run_dir=tmp_path / str(asked)).summary["status"] == "completed"


@pytest.mark.parametrize("bad", [1.0, -0.1])
def test_a_bad_holdout_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"^eval.holdout must be in \[0, 1\)"):
        load({**_pcfg("fedper"), "eval": {"holdout": bad}})


def test_vmap_refuses_batch_norm_with_padded_batches_and_agrees_with_loop_on_full_ones():
    cfg = {**_pcfg("fedbn", {"name": "cnn_fmnist", "norm": "batch"}), "dataset": {"name": "digits", "as_image": True}}
    ragged = {**cfg, "backend": "vmap", "local": {"epochs": 1, "batch_size": 16, "lr": 0.1}}
    with pytest.raises(ConfigError, match="^backend: vmap pads short local batches .* set local.steps"):
        _algo(ragged)
    algos = [_algo({**cfg, "backend": b}) for b in ("loop", "vmap")]  # local.steps: every batch full
    xs = [_rounds(a, 2) for a in algos]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(algos[0].personal_models(2), algos[1].personal_models(2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alg", ["fedper", "fedrep", "lg_fedavg"])
def test_a_model_without_a_head_is_refused_with_one_line(alg):
    with pytest.raises(ConfigError, match=f"^algorithm {alg} splits the model into a body and a head, but Sequential"):
        _algo(_pcfg(alg, {"name": "_bn_running"}))


def test_eval_holdout_applies_to_the_decentralized_family_too(tmp_path, monkeypatch):
    import fedweave.algorithms.decentralized.base as graph

    seen = []
    real = graph.evaluate_clients

    def spy(layout, models, x, y, parts, batch_size):
        seen.append((x, parts))
        return real(layout, models, x, y, parts, batch_size)

    monkeypatch.setattr(graph, "evaluate_clients", spy)
    cfg = {**_pcfg("local"), "rounds": 1, "eval": {"holdout": 0.25}}
    cfg["algorithm"] = {"name": "local"}
    algo = fedweave.run(cfg, run_dir=tmp_path / "r").algorithm
    held = algo.ctx.personal_test_set()[2]
    assert [len(p) for p in algo.trainer.parts] == [len(p) for p in algo.ctx.partition]
    assert all(not set(a.tolist()) & set(b) for a, b in zip(algo.trainer.parts, held))
    (x, parts), *_ = seen
    assert x is algo.ctx.dataset.train_x and parts is held  # the clients' own held-out samples


@pytest.mark.parametrize("alg", [a for a in PERSONAL if a not in ("perfedavg", "fedbabu")])  # keep no personal models
def test_under_dropout_only_the_reporting_clients_personal_models_change(alg):
    cfg = {**_pcfg(alg), "faults": {"dropout": 0.5}}
    algo = _algo(cfg)
    before = algo.store.state_dict()
    sampled = algo.sample_clients(0)
    reported = algo.reporting(0, sampled)
    assert 0 < len(reported) < len(sampled)  # this seed drops some but not all
    metrics = algo.run_round(0)
    assert metrics["reported_clients"] == len(reported)
    changed = {int(c) for c in np.flatnonzero((algo.store["personal"] != before["personal"]).any(1).numpy())}
    assert changed and changed <= set(reported.tolist())


@pytest.mark.parametrize(("alg", "opts", "backend"), [("apfl", {}, "loop"), ("pfedme", {}, "loop"),
                                                       ("apfl", {"adaptive": False}, "pool")])  # fmt: skip
def test_auto_never_gives_a_rule_that_keeps_client_state_the_pool(alg, opts, backend):
    """With the default ``backend: auto`` a convolutional model on 2 threads resolved to the pool, which APFL's
    adaptive alpha and pFedMe's personalized models then refused: a default config failed, naming a backend the
    user never chose. ``auto`` picks the loop for them; APFL without the alpha steps keeps the pool."""
    cfg = {**_pcfg(alg, {"name": "cnn_small"}, **opts), "backend": "auto", "threads": 2}
    cfg["dataset"], cfg["partition"] = (
        {"name": "mnist", "max_train": 160, "max_test": 40},
        {"name": "iid", "num_clients": 8},
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what the runner sets from threads: 2 (the trainer reads the process's count)
    try:
        assert _algo(cfg).trainer.backend == backend
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "regularized", [{"weight_decay": 0.05}, {"grad_clip": 1e-3}], ids=["weight_decay", "grad_clip"]
)
def test_perfedavg_evaluates_the_personalization_step_it_trains_for(regularized):
    """Per-FedAvg's personal model is one step w - alpha grad f(w; D) from the global model (Alg. 1 line 6), the
    raw gradient its rule's inner step takes: local.weight_decay and local.grad_clip shape the outer step only.
    The evaluation's step applied them too (a different adaptation from the one meta-trained, 7-8 % of the
    step). From the same global model the personal models are the unregularized run's, on a quadratic the
    closed form x - alpha A^T (A x - y) / B on the client's first batch."""
    alpha, bs = 0.05, 8
    plain = {**_quad_cfg("perfedavg", alpha=alpha), "precision": "float64"}
    plain["local"] = {"steps": 1, "batch_size": bs, "lr": 0.1}
    x0 = torch.randn(D_Q, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    models = []
    for local in (plain["local"], {**plain["local"], **regularized}):
        algo = _algo({**plain, "local": local})
        algo.adapt_trainer.loss_fn = _squared
        algo.x = x0.clone()
        models.append(algo.personal_models(1))
    torch.testing.assert_close(models[1], models[0], rtol=0, atol=0)
    tr = algo.adapt_trainer
    for c in range(N_Q):
        b = tr.client_batches(c, 1, (ADAPT_KEY,), None)[0]
        a, y = _quad_data().train_x.double()[b], _quad_data().train_y.double()[b]
        torch.testing.assert_close(models[1][c], x0 - alpha * a.T @ (a @ x0 - y) / len(b), rtol=1e-12, atol=1e-12)


def test_perfedavg_first_order_refuses_the_hessian_free_difference_step():
    """algorithm.delta is read by variant hf only: under fo it was accepted and changed nothing."""
    with pytest.raises(ConfigError, match=r"^algorithm\.delta \(0\.5\) is the Hessian-free variant's"):
        _algo({**_quad_cfg("perfedavg", variant="fo", delta=0.5)})
    _algo({**_quad_cfg("perfedavg", variant="hf", delta=0.5)})
