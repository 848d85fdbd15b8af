"""Any task, any model, any data (docs/tasks.md): losses, metrics, float targets, samplers, objects passed from
Python, plug-ins, and exact agreement with closed forms on a federated least-squares problem."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import fedweave
from fedweave.cli import main as cli_main
from fedweave.config import ConfigError
from fedweave.registry import ALGORITHMS, SAMPLERS
from fedweave.runner import resume
from fedweave.tasks import LOSSES, METRICS, Loss, build_task

# ---- a deterministic federated least-squares problem -------------------------------------------------
D, SIZES, K, LR, ROUNDS = 4, (7, 12, 5, 20, 9), 3, 0.05, 6
SCHEDULE = [[0, 2, 4], [1, 3], [0, 1, 2, 3, 4], [3, 4]]  # cycled: partial participation


def _problem():
    g = np.random.default_rng(3)
    n = sum(SIZES)
    A = g.normal(size=(n, D))
    x_true = g.normal(size=D)
    b = A @ x_true + 0.3 * g.normal(size=n) + np.repeat(g.normal(size=len(SIZES)), SIZES)  # heterogeneous
    edges = np.cumsum((0, *SIZES))
    parts = [list(range(edges[i], edges[i + 1])) for i in range(len(SIZES))]
    return A, b, parts


def _client(A, b, part):
    """f_i(x) = (1/2n_i)||A_i x - b_i||^2: K full-batch GD steps are x <- (I - lr H_i) x + lr g_i."""
    Ai, bi = A[part], b[part]
    return Ai.T @ Ai / len(part), Ai.T @ bi / len(part)


def _closed_form(method: str, weighting: str, mu: float = 0.1, alpha: float = 0.1) -> np.ndarray:
    """The global model after ROUNDS rounds, each client's K steps computed with the quadratic's affine map."""
    A, b, parts = _problem()
    H, g = zip(*(_client(A, b, p) for p in parts), strict=True)
    N = len(SIZES)
    x = np.zeros(D)
    c, c_i = np.zeros(D), np.zeros((N, D))  # SCAFFOLD
    h, lin = np.zeros(D), np.zeros((N, D))  # FedDyn
    for r in range(ROUNDS):
        S = SCHEDULE[r % len(SCHEDULE)]
        ys = []
        for i in S:
            y = x.copy()
            for _ in range(K):
                grad = H[i] @ y - g[i]
                if method == "fedprox":
                    grad = grad + mu * (y - x)  # FedProx eq. (2)
                elif method == "scaffold":
                    grad = grad - c_i[i] + c  # SCAFFOLD Alg. 1 line 10
                elif method == "feddyn":
                    grad = grad - lin[i] + alpha * (y - x)  # FedDyn's local objective
                y = y - LR * grad
            ys.append(y)
        ys = np.array(ys)
        sizes = np.array([SIZES[i] for i in S], dtype=float)
        p = sizes / sizes.sum() if weighting == "samples" else np.full(len(S), 1 / len(S))
        if method == "scaffold":
            new_c = c_i[S] - c + (x - ys) / (K * LR)  # option II
            dc = new_c - c_i[S]
            c_i[S] = new_c
            x = x + p @ (ys - x)
            c = c + dc.sum(0) / N
        elif method == "feddyn":
            lin[S] = lin[S] - alpha * (ys - x)
            h = h - alpha * (ys - x).sum(0) / N
            x = p @ ys - h / alpha
        else:
            x = x + p @ (ys - x)
    return x


def _zero_linear() -> nn.Module:
    m = nn.Linear(D, 1, bias=False)
    nn.init.zeros_(m.weight)
    return m


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize(
    "method, weighting",
    [
        ("fedavg", "uniform"),
        ("fedavg", "samples"),
        ("fedprox", "samples"),
        ("scaffold", "uniform"),
        ("feddyn", "uniform"),
    ],
)
def test_least_squares_equals_the_closed_form(method, weighting, backend, tmp_path):
    A, b, parts = _problem()
    (tmp_path / "parts.json").write_text(json.dumps(parts))
    x = torch.from_numpy(A)
    y = torch.from_numpy(b)
    algo = {"name": method, "clients_per_round": 1, "weighting": weighting}
    algo.update({"mu": 0.1} if method == "fedprox" else {"alpha": 0.1} if method == "feddyn" else {})
    config = {
        "name": "lsq",
        "rounds": ROUNDS,
        "precision": "float64",
        "backend": backend,
        "partition": {"name": "from_file", "num_clients": 0, "path": str(tmp_path / "parts.json")},
        "sampler": {"name": "schedule", "clients": SCHEDULE},
        "algorithm": algo,
        "task": {"loss": "mse", "loss_options": {"half": True}},
        "local": {"full_batch": True, "steps": K, "epochs": None, "lr": LR},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run(config, model=_zero_linear, dataset=(x, y, x, y), run_dir=tmp_path / "r")
    got = res.algorithm.x.numpy()
    want = _closed_form(method, weighting)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    assert np.abs(want).max() > 0.1  # the problem moved: the comparison means something
    described = json.loads((res.run_dir / "objects.json").read_text())
    assert described["dataset"]["train_x"] == [[sum(SIZES), D], "torch.float64"]
    assert described["model"]["factory"].endswith("_zero_linear")
    assert described["model"]["class"] == "torch.nn.modules.linear.Linear" and described["model"]["parameters"] == D
    assert len(described["dataset"]["sha256"]) == len(described["model"]["sha256"]) == 64


# ---- regression on a real dataset through every partitioner that takes float targets -------------------
REGRESSION = {
    "name": "reg",
    "rounds": 8,
    "dataset": {"name": "diabetes"},
    "model": {"name": "mlp", "hidden": [16]},
    "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "task": {"loss": "mse"},
    "local": {"batch_size": 16, "lr": 0.05},
    "output": {"progress": False, "plots": False},
}


@pytest.mark.parametrize(
    "partition",
    [
        {"name": "iid", "num_clients": 8},
        {"name": "quantity_skew", "num_clients": 8},
        {"name": "dirichlet", "num_clients": 8, "alpha": 0.5, "bins": 5, "min_size": 5},
        {"name": "dirichlet_balanced", "num_clients": 8, "alpha": 0.5, "bins": 5},
        {"name": "pathological", "num_clients": 8, "bins": 5},
        {"name": "shards", "num_clients": 8, "bins": 4},
    ],
)
def test_regression_on_diabetes(partition, tmp_path):
    res = fedweave.run({**REGRESSION, "partition": partition}, run_dir=tmp_path / "r")
    s = res.summary
    assert s["main_metric"] == "test_mse" and s["direction"] == "min"
    first, last = res.metrics[0], res.metrics[-1]
    assert set(last) >= {"test_mse", "test_rmse", "test_mae", "test_r2", "test_loss"}
    assert last["test_rmse"] == pytest.approx(last["test_mse"] ** 0.5)
    assert last["test_mse"] < 1.0 and last["test_r2"] > 0.0  # better than predicting the mean (targets standardized)
    assert last["test_mse"] < first["test_mse"] and s["best_main"] == min(r["test_mse"] for r in res.metrics)
    assert "test_accuracy" not in last and s["final_test_accuracy"] is None
    # the partition report: each client's histogram over 10 quantile bins of the target
    import csv

    rows = list(csv.DictReader((res.run_dir / "partition.csv").open()))
    bins = [f"target_bin_{k}" for k in range(10)]
    assert list(rows[0]) == ["client", "n", *bins] and len(rows) == 8
    assert all(sum(int(r[b]) for b in bins) == int(r["n"]) for r in rows)
    totals = [sum(int(r[b]) for r in rows) for b in bins]
    assert sum(totals) == sum(len(p) for p in res.algorithm.ctx.partition) and min(totals) > 0.05 * sum(totals)


@pytest.mark.parametrize(
    "algorithm, personal",
    [
        ({"name": "hier_fedavg", "tau": 2, "participation": 0.5}, False),
        ({"name": "zo_hfl", "tau": 2, "participation": 0.5, "server_batch_size": 16}, False),
        ({"name": "gossip"}, False),
        ({"name": "fedavg", "clients_per_round": 3}, True),
    ],
    ids=["hier_fedavg", "zo_hfl", "gossip", "fedavg-personal"],
)
def test_hierarchical_decentralized_and_personal_evaluation_follow_the_task(algorithm, personal, tmp_path):
    cfg = {**REGRESSION, "rounds": 2, "algorithm": algorithm, "partition": {"name": "iid", "num_clients": 6}}
    if personal:
        cfg["eval"] = {"personal_test": True}
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    last = res.metrics[-1]
    assert res.summary["main_metric"] == "test_mse" and res.summary["direction"] == "min"
    assert {"test_mse", "test_rmse", "test_mae", "test_r2", "test_loss"} <= set(last)
    assert not any("accuracy" in k for k in last)
    if algorithm["name"] in ("gossip", "fedavg"):  # per-client evaluation: the worst client is the largest MSE
        assert last["test_mse_worst"] >= last["test_mse"]


@pytest.mark.parametrize("name", ["dirichlet", "dirichlet_balanced", "pathological", "shards"])
def test_label_partitioners_refuse_float_targets_without_bins(name, tmp_path):
    with pytest.raises(ConfigError, match="partition.bins"):
        fedweave.run({**REGRESSION, "partition": {"name": name, "num_clients": 4}}, run_dir=tmp_path / "r")


@pytest.mark.parametrize("bins", [7, -3, "foo"])
def test_label_free_partitioners_refuse_bins_they_never_read(bins, tmp_path):
    # before: accepted whatever its value, recorded in config.yaml and never read (the counts are all iid reads)
    part = {"name": "iid", "num_clients": 4, "bins": bins}
    with pytest.raises(ConfigError, match="^partition.bins: partition 'iid' reads only the sample counts"):
        fedweave.run({**REGRESSION, "partition": part}, run_dir=tmp_path / "r")


def _diabetes_arrays():
    from fedweave.data.datasets.bundled import load_diabetes

    ds = load_diabetes()
    return ds.train_x, ds.train_y, ds.test_x, ds.test_y


def test_regression_with_user_ids_from_python_and_a_partition_file(tmp_path):
    """Float targets through the two partitioners that read users or a file: ``natural`` with per-sample user
    ids passed with the arrays, and ``from_file`` with an .npz of per-client index lists."""
    x, y, tx, ty = _diabetes_arrays()
    users, test_users = np.arange(len(y)) % 5 * 10, np.arange(len(ty)) % 5 * 10  # 5 users, ids 0, 10, ..., 40
    cfg = {**REGRESSION, "rounds": 3, "partition": {"name": "natural", "num_clients": 0}}
    res = fedweave.run(cfg, dataset=(x, y, tx, ty, users, test_users), run_dir=tmp_path / "nat")
    parts = res.algorithm.ctx.partition
    assert [sorted(p.tolist()) for p in parts] == [np.flatnonzero(users == u).tolist() for u in range(0, 50, 10)]
    # num_clients left out takes every user too, as docs/partitioning.md says (before: "got None")
    left_out = {**cfg, "rounds": 1, "partition": {"name": "natural"}}
    again = fedweave.run(left_out, dataset=(x, y, tx, ty, users, test_users), run_dir=tmp_path / "nat0")
    assert [p.tolist() for p in again.algorithm.ctx.partition] == [p.tolist() for p in parts]
    assert res.summary["main_metric"] == "test_mse" and res.metrics[-1]["test_mse"] < res.metrics[0]["test_mse"]
    described = json.loads((res.run_dir / "objects.json").read_text())
    assert described["dataset"]["train_users"] == [[len(y)], str(users.dtype)]

    chosen = [np.arange(0, 40), np.arange(40, 200), np.arange(200, len(y))]
    np.savez(tmp_path / "parts.npz", **{f"client_{i}": p for i, p in enumerate(chosen)})
    cfg = {**REGRESSION, "rounds": 2, "algorithm": {"name": "fedavg", "clients_per_round": 3}}
    cfg["partition"] = {"name": "from_file", "num_clients": 0, "path": str(tmp_path / "parts.npz")}
    res = fedweave.run(cfg, run_dir=tmp_path / "file")
    assert [p.tolist() for p in res.algorithm.ctx.partition] == [p.tolist() for p in chosen]


def test_a_class_loss_on_float_targets_and_mse_on_labels_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs integer class labels"):
        fedweave.run({**REGRESSION, "task": {"loss": "cross_entropy"}}, run_dir=tmp_path / "a")
    digits = {**REGRESSION, "dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 4}}
    with pytest.raises(ConfigError, match="needs float targets"):
        fedweave.run(digits, run_dir=tmp_path / "b")


def test_bce_with_logits_on_targets_outside_0_1_is_refused(tmp_path):
    # diabetes' standardized targets run from about -2 to 3: a binary cross-entropy against them is unbounded
    # below (-y log s(z) - (1 - y) log(1 - s(z)) -> -inf as z -> inf for y > 1), and the run trained on it
    cfg = {**REGRESSION, "rounds": 1, "task": {"loss": "bce_with_logits", "metrics": ["mse"]}}
    with pytest.raises(ConfigError, match=r"task.loss 'bce_with_logits' needs targets in \[0, 1\].*'diabetes'"):
        fedweave.run(cfg, run_dir=tmp_path / "a")
    x, y = torch.randn(40, 3), torch.rand(40, 2)  # soft labels in [0, 1] are targets it takes
    test = torch.full((10, 2), 0.5)
    test[3, 1] = -0.5  # ... in the test split too
    ok = {**cfg, "dataset": {"name": "python"}, "partition": {"name": "iid", "num_clients": 4}}
    ok["algorithm"] = {"name": "fedavg", "clients_per_round": 2}
    fedweave.run(ok, dataset=(x, y, torch.randn(10, 3), torch.full((10, 2), 0.5)), run_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match=r"needs targets in \[0, 1\].*from -0\.5 to "):
        fedweave.run(ok, dataset=(x, y, torch.randn(10, 3), test), run_dir=tmp_path / "c")


def test_auc_on_a_test_split_that_is_not_0_1_is_refused_when_the_run_is_built(tmp_path):
    # 0/1 training targets and a test split with soft labels: auc read only the training split's kind, and the
    # first evaluation failed in scikit-learn with a traceback ("continuous format is not supported")
    x, y = torch.randn(40, 3), (torch.rand(40, 2) > 0.5).float()
    test = (torch.rand(10, 2) > 0.5).float()
    test[0, 0] = 0.5
    cfg = {**REGRESSION, "rounds": 1, "dataset": {"name": "python"}, "partition": {"name": "iid", "num_clients": 4}}
    cfg.update(algorithm={"name": "fedavg", "clients_per_round": 2}, task={"loss": "bce_with_logits"})
    with pytest.raises(ConfigError, match=r"task.metrics: 'auc' needs 0/1 targets"):
        fedweave.run(cfg, dataset=(x, y, torch.randn(10, 3), test), run_dir=tmp_path / "a")


@pytest.mark.parametrize(
    ("dataset", "task", "message"),
    [
        # accuracy on float targets scored 0 in every round; the others failed with a traceback in evaluation
        ("diabetes", {"loss": "mse", "metrics": ["mse", "accuracy"]}, r"'accuracy' needs integer class labels"),
        ("diabetes", {"loss": "mse", "metrics": ["perplexity"]}, r"'perplexity' needs integer class labels"),
        ("diabetes", {"loss": "mse", "metrics": ["auc"]}, r"'auc' needs 0/1 targets.*float targets; .*mse"),
        ("digits", {"metrics": ["accuracy", "mse"]}, r"'mse' needs float targets.*class labels \(10 classes\)"),
        ("digits", {"metrics": ["f1"]}, r"task\.metrics: 'f1' needs 0/1 targets.*accuracy"),
        # top-k of k or fewer classes reported 1 in every round, whatever the model
        ("breast_cancer", {"metrics": ["accuracy", "top3"]}, r"^task\.metrics: 'top3' is 1 whatever the model when"),
        ("breast_cancer", {"metrics": ["top5"]}, r"at most 5 classes, and dataset 'breast_cancer' has 2; use accuracy"),
        ("digits", {"metrics": ["accuracy", "top3", "accuracy"]}, r"^task\.metrics names 'accuracy' twice"),
    ],
)
def test_a_metric_that_does_not_fit_the_targets_is_refused(tmp_path, dataset, task, message):
    cfg = {**REGRESSION, "dataset": {"name": dataset}, "partition": {"name": "iid", "num_clients": 4}, "task": task}
    with pytest.raises(ConfigError, match=message):
        fedweave.run(cfg, run_dir=tmp_path / "r")


# ---- multi-label with bce_with_logits on real images -------------------------------------------------
def _multilabel_digits():
    from fedweave.data.datasets.bundled import load_digits

    ds = load_digits()

    def labels(y):  # three properties of the digit: even, greater than four, has a closed loop
        return torch.stack([(y % 2 == 0), (y > 4), torch.isin(y, torch.tensor([0, 6, 8, 9]))], 1).double()

    return ds.train_x, labels(ds.train_y), ds.test_x, labels(ds.test_y)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_multilabel_with_bce(backend, tmp_path):
    cfg = {
        "name": "ml",
        "rounds": 6,
        "backend": backend,
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "logistic"},
        "algorithm": {"name": "fedavg", "clients_per_round": 3},
        "task": {"loss": "bce_with_logits"},
        "local": {"batch_size": 32, "lr": 0.2},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run(cfg, dataset=_multilabel_digits(), run_dir=tmp_path / "r")
    last = res.metrics[-1]
    assert res.summary["main_metric"] == "test_auc" and res.summary["direction"] == "max"
    assert {"test_auc", "test_f1", "test_f1_0", "test_f1_1", "test_f1_2", "test_loss"} <= set(last)
    assert last["test_auc"] > 0.9 and last["test_f1"] > 0.7


@pytest.mark.parametrize("backend", ["vmap", "pool", pytest.param("ray", marks=pytest.mark.slow)])
def test_regression_and_multilabel_are_the_same_on_every_backend(backend, tmp_path):
    """A regression on real tabular data (diabetes) and a multi-label task (digits' properties) give the loop
    backend's model on vmap, pool and ray, to float tolerance."""
    if backend == "ray":
        pytest.importorskip("ray")
    common = {"threads": 2, "ray": {"num_workers": 2}, "output": {"progress": False, "plots": False}}
    regression = {**REGRESSION, **common, "rounds": 3, "partition": {"name": "quantity_skew", "num_clients": 6}}
    multilabel = {
        **common,
        "rounds": 3,
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "mlp", "hidden": [16]},
        "algorithm": {"name": "fedavg", "clients_per_round": 3},
        "task": {"loss": "bce_with_logits"},
        "local": {"batch_size": 32, "lr": 0.2},
    }
    for name, cfg, data in (("reg", regression, None), ("ml", multilabel, _multilabel_digits())):
        ref = fedweave.run({**cfg, "backend": "loop"}, dataset=data, run_dir=tmp_path / f"{name}-loop")
        res = fedweave.run({**cfg, "backend": backend}, dataset=data, run_dir=tmp_path / f"{name}-{backend}")
        torch.testing.assert_close(res.algorithm.x, ref.algorithm.x, rtol=1e-4, atol=1e-5)
        main = ref.summary["main_metric"]
        assert res.metrics[-1][main] == pytest.approx(ref.metrics[-1][main], rel=1e-3, abs=1e-3), name
        assert res.summary["execution"]["backend"] == backend


def test_bce_loss_and_auc_match_torch_and_sklearn():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(50, 3, generator=g), (torch.rand(50, 3, generator=g) > 0.5).double()
    task = build_task("bce_with_logits")
    want = nn.functional.binary_cross_entropy_with_logits(out, y.float())
    assert float(task.loss(out, y)) == pytest.approx(float(want), rel=1e-6)
    auc = METRICS.get("auc")()
    auc.update(out[:20], y[:20])
    auc.update(out[20:], y[20:])
    assert auc.result()["auc"] == pytest.approx(np.mean([roc_auc_score(y[:, j], out[:, j]) for j in range(3)]))


def test_regression_metrics_match_their_definitions():
    g = torch.Generator().manual_seed(1)
    pred, y = torch.randn(40, 1, generator=g), torch.randn(40, generator=g)
    ms = [METRICS.get(m)() for m in ("mse", "rmse", "mae", "r2")]
    for m in ms:
        m.update(pred[:15], y[:15])
        m.update(pred[15:], y[15:])
    got = {k: v for m in ms for k, v in m.result().items()}
    err = pred[:, 0].double() - y.double()
    assert got["mse"] == pytest.approx(float(err.pow(2).mean()))
    assert got["rmse"] == pytest.approx(float(err.pow(2).mean().sqrt()))
    assert got["mae"] == pytest.approx(float(err.abs().mean()))
    assert got["r2"] == pytest.approx(1 - float(err.pow(2).sum() / (y.double() - y.double().mean()).pow(2).sum()))
    assert float(build_task("mse", {"half": True}).loss(pred, y)) == pytest.approx(0.5 * got["mse"], rel=1e-6)


def test_f1_matches_sklearn_per_label_and_macro():
    from sklearn.metrics import f1_score

    g = torch.Generator().manual_seed(4)
    out, y = torch.randn(12, 3, generator=g), (torch.rand(12, 3, generator=g) > 0.5).float()
    f1 = METRICS.get("f1")()
    f1.update(out[:5], y[:5])
    f1.update(out[5:], y[5:])
    got = f1.result()
    want = f1_score(y.numpy(), (out > 0).int().numpy(), average=None, zero_division=0)
    assert [got[f"f1_{j}"] for j in range(3)] == pytest.approx(want, rel=1e-12, abs=0)
    assert got["f1"] == pytest.approx(float(np.mean(want)), rel=1e-12, abs=0)


def test_r2_matches_sklearn_on_constant_and_offset_targets():
    from sklearn.metrics import r2_score

    def r2(pred, y):
        m = METRICS.get("r2")()
        m.update(pred[:3], y[:3])
        m.update(pred[3:], y[3:])
        return m.result()["r2"]

    pred = torch.linspace(-1, 1, 7, dtype=torch.float64)[:, None]
    # a constant column: sklearn's rule (force_finite) scores 0, or 1 if predicted exactly; its own
    # mean can miss c by an ulp (c = 0.1 gives it -2e33), so the rule is asserted, and sklearn where exact
    for c in (0.1, 0.3, 1.7, 3.0):
        y = torch.full((7,), c, dtype=torch.float64)
        assert r2(y[:, None] + pred, y) == 0.0
        assert r2(y[:, None], y) == 1.0
    y = torch.full((7,), 3.0, dtype=torch.float64)
    assert r2(y[:, None] + pred, y) == r2_score(y, y + pred[:, 0])
    one = METRICS.get("r2")()  # one row: undefined, nan as in sklearn (which also warns)
    one.update(torch.ones(1, 1), torch.zeros(1))
    assert math.isnan(one.result()["r2"])
    g = torch.Generator().manual_seed(3)  # a large mean against a small spread: no cancellation
    y = 1e8 + torch.randn(9, generator=g, dtype=torch.float64)
    p = y[:, None] + 0.5 * torch.randn(9, 1, generator=g, dtype=torch.float64)
    assert r2(p, y) == pytest.approx(r2_score(y, p[:, 0]), rel=1e-9)


def test_topk_and_perplexity_match_their_definitions():
    g = torch.Generator().manual_seed(2)
    out, y = torch.randn(60, 7, generator=g), torch.randint(0, 7, (60,), generator=g)
    ms = {m: METRICS.get(m)() for m in ("accuracy", "top3", "top5", "perplexity")}
    for m in ms.values():
        m.update(out[:25], y[:25])
        m.update(out[25:], y[25:])
    rank = (out > out.gather(1, y[:, None])).sum(1)  # how many classes score above the true one
    for name, k in (("accuracy", 1), ("top3", 3), ("top5", 5)):
        assert ms[name].result()[name] == pytest.approx(float((rank < k).double().mean()))
    ce = float(nn.functional.cross_entropy(out, y))
    assert ms["perplexity"].result()["perplexity"] == pytest.approx(np.exp(ce))


def test_a_next_token_model_reports_perplexity(tmp_path):
    """Perplexity for next-token models: the char-LSTM on counting sequences, the main metric, minimised."""
    g = torch.Generator().manual_seed(0)
    V, T = 12, 8
    x = (torch.randint(0, V, (1200, 1), generator=g) + torch.arange(T)) % V
    y = (x[:, -1] + 1) % V  # the next token
    cfg = {
        "rounds": 3,
        "partition": {"name": "iid", "num_clients": 4},
        "model": {"name": "char_lstm", "hidden": 16, "num_layers": 1},
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "task": {"metrics": ["accuracy", "top3", "perplexity"], "main": "perplexity"},
        "local": {"batch_size": 32, "lr": 0.5},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run(cfg, dataset=(x[:1000], y[:1000], x[1000:], y[1000:]), run_dir=tmp_path / "r")
    rows = res.metrics
    assert res.summary["main_metric"] == "test_perplexity" and res.summary["direction"] == "min"
    for r in rows:
        assert r["test_perplexity"] == pytest.approx(np.exp(r["test_loss"]), rel=1e-6)
        assert r["test_top3"] >= r["test_accuracy"]
    assert rows[-1]["test_perplexity"] < rows[0]["test_perplexity"] < V  # learning, and better than uniform
    assert res.summary["best_main"] == min(r["test_perplexity"] for r in rows)


def test_nll_on_log_probabilities_equals_cross_entropy_on_logits(tmp_path):
    cfg = {
        "rounds": 2,
        "backend": "loop",
        "partition": {"name": "iid", "num_clients": 4},
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "local": {"batch_size": 32, "lr": 0.1},
        "output": {"progress": False, "plots": False},
    }
    data = _digits_arrays()

    def log_probs():
        return nn.Sequential(SmallNet(), nn.LogSoftmax(dim=1))

    ce = fedweave.run(cfg, model=SmallNet, dataset=data, run_dir=tmp_path / "ce")
    nll = fedweave.run({**cfg, "task": {"loss": "nll"}}, model=log_probs, dataset=data, run_dir=tmp_path / "nll")
    torch.testing.assert_close(nll.algorithm.x, ce.algorithm.x, rtol=1e-5, atol=1e-6)
    assert nll.metrics[-1]["test_loss"] == pytest.approx(ce.metrics[-1]["test_loss"], rel=1e-5)
    assert nll.metrics[-1]["test_accuracy"] == ce.metrics[-1]["test_accuracy"] > 0.5


@pytest.mark.parametrize("how", ["factory", "registered"])
def test_nll_on_a_model_that_outputs_logits_is_one_line(tmp_path, toy_config, how):
    # nll_loss of logits is -z_y, unbounded below: the run trained to a negative, meaningless loss without a word
    if how == "factory":
        cfg = {
            "rounds": 1,
            "partition": {"name": "iid", "num_clients": 4},
            "algorithm": {"name": "fedavg", "clients_per_round": 2},
            "task": {"loss": "nll"},
            "output": {"progress": False, "plots": False},
        }
        kw = {"model": SmallNet, "dataset": _digits_arrays()}
        name = "'python'"
    else:
        cfg, kw, name = {**toy_config, "task": {"loss": "nll"}}, {}, "'logistic'"
    with pytest.raises(ConfigError) as e:
        fedweave.run(cfg, run_dir=tmp_path / "r", **kw)
    msg = str(e.value)
    assert msg.startswith(
        f"task.loss: nll needs a model that outputs log-probabilities (ending in log_softmax), "
        f"but the outputs of model {name} on two training samples are not"
    )
    assert msg.endswith("for logits use task.loss: cross_entropy") and "\n" not in msg


# ---- a custom loss and the user's own nn.Module on every backend -------------------------------------
class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10))

    def forward(self, x):
        return self.body(x.flatten(1))


def smoothed_ce(out, y):
    """Label-smoothed cross-entropy, per sample."""
    return nn.functional.cross_entropy(out, y, reduction="none", label_smoothing=0.1)


def _digits_arrays():
    from fedweave.data.datasets.bundled import load_digits

    ds = load_digits()
    return ds.train_x, ds.train_y, ds.test_x, ds.test_y


BACKENDS = ["loop", "vmap", "pool", pytest.param("ray", marks=pytest.mark.slow)]


def _mse_none(out, y):
    return nn.functional.mse_loss(out, y.reshape(out.shape), reduction="none")  # (B, 1) for one output


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_loss_function_with_a_column_per_output_is_the_registered_mse(backend, tmp_path):
    # reduction="none" on a one-output model gives (B, 1), not (B,): vmap's masked mean broadcast it against
    # the (B,) mask into a (B, B) matrix, trained on a sum instead of a mean and diverged in round 1
    cfg = {**REGRESSION, "rounds": 3, "backend": backend, "partition": {"name": "quantity_skew", "num_clients": 5}}
    cfg.update(algorithm={"name": "fedavg", "clients_per_round": 3}, local={"epochs": 1, "batch_size": 16, "lr": 0.05})
    ref = fedweave.run(cfg, run_dir=tmp_path / "mse")
    byo = {k: v for k, v in cfg.items() if k != "task"}
    res = fedweave.run(byo, loss=_mse_none, run_dir=tmp_path / "fn")
    got, want = [r["test_loss"] for r in res.metrics], [r["test_loss"] for r in ref.metrics]
    assert got == pytest.approx(want, rel=1e-6)
    two = torch.tensor([[1.0, 2.0], [3.0, 5.0]])  # a column per output: its per-sample loss is their mean
    assert build_task(_mse_none).loss.per_sample(two, torch.zeros(2, 2)).tolist() == [2.5, 17.0]
    # written as torch's examples write it, without reshaping (B,) targets to the (B, 1) output: they come in the
    # output's shape, as the registered losses take them (broadcast, the run trained on all B x B pairs)
    written = fedweave.run(byo, loss=_mse_as_written, run_dir=tmp_path / "as-written")
    assert [r["test_loss"] for r in written.metrics] == got


def _mse_as_written(out, y):
    return nn.functional.mse_loss(out, y, reduction="none")


def _mean_kept(out, y):
    return nn.functional.cross_entropy(out, y).reshape(1)  # a mean kept as (1,): one loss for the whole batch


class _Flat(nn.Module):  # one output per sample as (B,): cross-entropy cannot read it
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 1)

    def forward(self, x):
        return self.fc(x.flatten(1)).flatten(0)


class _Pair(SmallNet):  # logits and features: a tuple
    def forward(self, x):
        return self.body(x.flatten(1)), x


class _Trailing(SmallNet):  # (B, C, 1)
    def forward(self, x):
        return self.body(x.flatten(1))[..., None]


@pytest.mark.parametrize(
    "model, loss, want",
    [
        (SmallNet, _mean_kept, r"loss '_mean_kept' cannot read .*returns \(1,\) for an output of \(2, 10\)"),
        (_Flat, None, r"loss 'cross_entropy' cannot read the output of model 'python' \(\(2,\) for 2 samples\)"),
        (_Pair, None, r"loss 'cross_entropy' cannot read .*\(tuple for 2 samples\).*returns a tuple, not a tensor"),
        (_Trailing, None, r"loss 'cross_entropy' cannot read the output of model 'python' \(\(2, 10, 1\) for 2"),
    ],
)
def test_an_output_or_loss_the_task_cannot_read_is_one_line_when_the_run_is_built(model, loss, want, tmp_path):
    """A model output of the wrong shape or kind failed in round 1 with torch's error, a run directory left
    behind; a loss returning (1,) trained and reported a test loss about N times too small."""
    cfg = {"rounds": 1, "partition": {"name": "iid", "num_clients": 3}, "output": {"progress": False, "plots": False}}
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 3}
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, model=model, dataset=_digits_arrays(), loss=loss, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


BYO = {
    "name": "byo",
    "rounds": 3,
    "threads": 2,
    "partition": {"name": "iid", "num_clients": 6},
    "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "local": {"batch_size": 32, "lr": 0.1},
    "ray": {"num_workers": 2},
    "output": {"progress": False, "plots": False},
}


@pytest.fixture(scope="module")
def byo_on_the_loop(tmp_path_factory):
    """The loop backend's run of BYO, the reference each backend's run is compared with (run once)."""
    cfg = {**BYO, "backend": "loop"}
    run_dir = tmp_path_factory.mktemp("byo") / "loop"
    return fedweave.run(cfg, model=SmallNet, dataset=_digits_arrays(), loss=smoothed_ce, run_dir=run_dir)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_loss_and_module_are_the_same_on_every_backend(backend, byo_on_the_loop, tmp_path):
    if backend == "ray":
        pytest.importorskip("ray")
        import sys

        from ray import cloudpickle

        # Ray's workers cannot import this test module: ship its objects by value (docs/tasks.md)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = {**BYO, "backend": backend}
    ref = byo_on_the_loop
    res = fedweave.run(cfg, model=SmallNet, dataset=_digits_arrays(), loss=smoothed_ce, run_dir=tmp_path / "b")
    torch.testing.assert_close(res.algorithm.x, ref.algorithm.x, rtol=1e-4, atol=1e-5)
    assert res.metrics[-1]["test_accuracy"] == pytest.approx(ref.metrics[-1]["test_accuracy"], abs=0.01)
    assert ref.metrics[-1]["test_accuracy"] > 0.5
    described = json.loads((res.run_dir / "objects.json").read_text())
    assert described["loss"]["callable"].endswith("smoothed_ce") and described["model"]["factory"].endswith("SmallNet")
    assert described["model"]["class"].endswith("SmallNet") and described["model"]["parameters"] == 64 * 12 + 12 + 130
    before = json.loads((ref.run_dir / "objects.json").read_text())
    assert described == before  # same objects, same seed: the same record (hashes of data and initial weights)


def test_objects_json_tells_other_weights_and_other_data_apart(tmp_path):
    cfg = {"rounds": 1, "partition": {"name": "iid", "num_clients": 2}, "output": {"progress": False, "plots": False}}
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 2}
    x, y, tx, ty = _digits_arrays()

    def described(name, seed, data):
        res = fedweave.run({**cfg, "seed": seed}, model=SmallNet, dataset=data, run_dir=tmp_path / name)
        return json.loads((res.run_dir / "objects.json").read_text())

    a, b = described("a", 0, (x, y, tx, ty)), described("b", 1, (x, y, tx, ty))
    assert a["model"]["sha256"] != b["model"]["sha256"] and a["dataset"] == b["dataset"]
    c = described("c", 0, (x, y, tx, ty.flip(0)))
    assert c["dataset"]["sha256"] != a["dataset"]["sha256"] and c["model"] == a["model"]


def test_a_torch_dataset_and_a_scalar_loss(tmp_path):
    x, y, tx, ty = _digits_arrays()
    train, test = torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(tx, ty)
    cfg = {"rounds": 1, "partition": {"name": "iid", "num_clients": 3}, "output": {"progress": False, "plots": False}}
    cfg["algorithm"] = {"name": "fedavg", "clients_per_round": 3}
    res = fedweave.run(cfg, dataset=(train, test), run_dir=tmp_path / "r")
    assert res.summary["status"] == "completed"
    with pytest.raises(ValueError, match="one loss per sample"):
        fedweave.run(cfg, dataset=(train, test), loss=nn.functional.cross_entropy, run_dir=tmp_path / "s")


# ---- samplers -----------------------------------------------------------------------------------------
def _star(tmp_path, sampler=None, **algo):
    cfg = {
        "name": "smp",
        "rounds": 5,
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "num_clients": 10},
        "algorithm": {"name": "fedavg", "clients_per_round": 3, **algo},
        "output": {"progress": False, "plots": False},
        **({"sampler": sampler} if sampler else {}),
    }
    return fedweave.run(cfg, run_dir=tmp_path / f"r{len(list(tmp_path.iterdir()))}")


def _picked(res):
    return [res.algorithm.sample_clients(r).tolist() for r in range(5)]


def test_schedule_fixed_and_bernoulli_samplers(tmp_path):
    sched = _star(tmp_path, {"name": "schedule", "clients": [[1, 2], [9, 0, 4]]})
    assert _picked(sched) == [[1, 2], [0, 4, 9], [1, 2], [0, 4, 9], [1, 2]]
    (tmp_path / "plan.json").write_text(json.dumps([[1, 2], [9, 0, 4], [3], [5, 6], [7, 8]]))
    from_file = _star(tmp_path, {"name": "schedule", "file": str(tmp_path / "plan.json"), "cycle": False})
    assert _picked(from_file) == [[1, 2], [0, 4, 9], [3], [5, 6], [7, 8]]
    sent = sched.summary["communication"]["by_transfer"]
    assert sum(v["count"] for k, v in sent.items() if k.startswith("server->client")) == 2 + 3 + 2 + 3 + 2
    assert _picked(_star(tmp_path, {"name": "fixed", "clients": 5})) == [[0, 1, 2, 3, 4]] * 5
    assert _picked(_star(tmp_path, {"name": "fixed"})) == [[0, 1, 2]] * 5  # clients_per_round of them
    # the star's `sampling: bernoulli` hyper-parameter is the bernoulli sampler
    assert _picked(_star(tmp_path, {"name": "bernoulli"})) == _picked(_star(tmp_path, sampling="bernoulli"))
    uniform = _picked(_star(tmp_path))
    assert uniform == _picked(_star(tmp_path, {"name": "uniform"})) and len({tuple(c) for c in uniform}) > 1


@pytest.mark.parametrize(
    "sampler, match",
    [
        ({"name": "schedule", "clients": [[0, 10]]}, "distinct client ids in"),
        ({"name": "schedule", "clients": [[1, 1]]}, "distinct client ids"),
        ({"name": "schedule", "clients": [[0]], "cycle": False}, "schedule has 1 rounds"),
        ({"name": "schedule"}, "exactly one of clients"),
        ({"name": "fixed", "clients": 11}, "sampler.clients"),
        ({"name": "nosuch"}, "unknown sampler"),
        ({"name": "uniform", "k": 3}, "sampler.k"),
    ],
)
def test_bad_sampler_settings_fail_before_training(sampler, match, tmp_path):
    with pytest.raises((ConfigError, KeyError), match=match):
        _star(tmp_path, sampler)


def _numbers(res) -> list[dict]:
    """A run's metric rows without its clock readings."""
    return [{k: v for k, v in row.items() if "time" not in k and "seconds" not in k} for row in res.metrics]


def test_the_stars_sampling_key_is_the_bernoulli_sampler(tmp_path):
    """``algorithm.sampling: bernoulli`` is another name for ``sampler: bernoulli``: the same numbers, and a run
    that used it resumes from its resolved config (which records the default sampler section)."""
    old = _star(tmp_path, sampling="bernoulli")
    assert _numbers(old) == _numbers(_star(tmp_path, {"name": "bernoulli"}))
    assert _numbers(old) == _numbers(_star(tmp_path, {"name": "bernoulli"}, sampling="bernoulli"))
    assert _picked(old) != _picked(_star(tmp_path))  # not the uniform default
    cfg = {
        "name": "smp",
        "rounds": 3,
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "num_clients": 10},
        "algorithm": {"name": "fedavg", "clients_per_round": 3, "sampling": "bernoulli"},
        "output": {"progress": False, "plots": False, "checkpoint_every": 1},
    }
    fedweave.run(cfg, run_dir=tmp_path / "part")
    resumed = resume(tmp_path / "part", ["rounds=5"])
    assert _numbers(resumed) == _numbers(old)


@pytest.mark.parametrize(
    "sampler", [{"name": "schedule", "clients": [[0, 1]]}, {"name": "fixed"}, {"name": "uniform", "k": 3}]
)
def test_the_stars_sampling_key_refuses_another_sampler(sampler, tmp_path, capsys):
    """A sampler section naming another sampler beside ``algorithm.sampling: bernoulli`` is refused in one line
    naming both keys, before anything runs (it was silently ignored)."""
    with pytest.raises(ConfigError, match="algorithm.sampling: bernoulli and sampler: ") as e:
        _star(tmp_path, sampler, sampling="bernoulli")
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())
    (tmp_path / "c.yaml").write_text(
        json.dumps({"algorithm": {"name": "fedavg", "sampling": "bernoulli"}, "sampler": sampler, "rounds": 1})
    )
    args = ["run", str(tmp_path / "c.yaml"), "dataset=digits", "--out", str(tmp_path / "r"), "--no-progress"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedweave: error: algorithm.sampling: bernoulli and sampler: ") and "\n" not in err


def _downloads_per_round(res) -> list[int]:
    """How many clients the server sent the model to, per round, from the ledger."""
    per: dict[int, int] = {}
    for e in res.algorithm.ledger.entries():
        if e.receiver == "client" and e.sender in ("server", "fed_server"):
            per[e.round] = max(per.get(e.round, 0), e.count)  # each kind sent goes to every chosen client
    return [per.get(r, 0) for r in range(res.summary["rounds"])]


def test_the_hierarchical_and_split_servers_ask_the_sampler(tmp_path):
    """The sampler decides who takes part in the hierarchical and split families too (the star's are above),
    and the ledger shows only those clients: CSE-FSL's code parity with the authors' first five clients
    (spec A13) is ``sampler: {name: fixed, clients: 5}``."""
    from test_precision import family_config

    plan = [[0, 4], [1, 2, 5]]
    hier = {**family_config("hier_fedavg"), "rounds": 3, "sampler": {"name": "schedule", "clients": plan}}
    res = fedweave.run(hier, run_dir=tmp_path / "h")
    assert [res.algorithm.sample_clients(r).tolist() for r in range(3)] == [[0, 4], [1, 2, 5], [0, 4]]
    assert _downloads_per_round(res) == [2, 3, 2]

    split = {**family_config("cse_fsl"), "rounds": 3, "partition": {"name": "iid", "num_clients": 8}}
    split["sampler"] = {"name": "fixed", "clients": 5}
    res = fedweave.run(split, run_dir=tmp_path / "s")
    assert [res.algorithm.sample_clients(r).tolist() for r in range(3)] == [[0, 1, 2, 3, 4]] * 3
    assert _downloads_per_round(res) == [5, 5, 5]
    paper = {**split, "sampler": {"name": "uniform"}, "algorithm": {**split["algorithm"], "clients_per_round": 5}}
    default = fedweave.run(paper, run_dir=tmp_path / "u")
    assert len({tuple(default.algorithm.sample_clients(r).tolist()) for r in range(3)}) > 1  # the paper's draw


def test_split_aggregation_weights_follow_weighting(tmp_path):
    """Eq. (14) averages the client models with 1/n (``weighting: uniform``); the authors' code, and fedweave's
    default, with |D_i| (spec A20). They differ under unequal clients."""
    from test_precision import family_config

    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load

    cfg = {**family_config("cse_fsl"), "partition": {"name": "quantity_skew", "num_clients": 4}}
    by_size = build_algorithm(RunContext(load(cfg)))
    uniform = build_algorithm(RunContext(load({**cfg, "algorithm": {**cfg["algorithm"], "weighting": "uniform"}})))
    clients = np.array([0, 1, 3])
    sizes = torch.tensor([len(by_size.ctx.partition[i]) for i in clients], dtype=torch.float64)
    assert len(set(sizes.tolist())) > 1
    torch.testing.assert_close(by_size.weights(clients).double(), sizes / sizes.sum())
    torch.testing.assert_close(uniform.weights(clients).double(), torch.full((3,), 1 / 3, dtype=torch.float64))


def test_a_registered_sampler_is_used(tmp_path):
    if "_evens" not in SAMPLERS._items:

        @SAMPLERS.register("_evens")
        def _evens(num_clients, per_round, r, rng, *, rounds):
            return np.arange(0, num_clients, 2)

    assert _picked(_star(tmp_path, {"name": "_evens"})) == [[0, 2, 4, 6, 8]] * 5


def _register_context_samplers() -> None:
    """Two samplers that read the clients' context: a power-of-choice-like one (Cho et al., 2022: d candidates
    drawn in proportion to the clients' sizes, the per_round of them with the highest last loss, a client
    never heard from first) and a uniform one that reads the context but ignores it. Each keeps what it saw."""
    if "_power_of_choice" in SAMPLERS._items:
        return

    @SAMPLERS.register("_power_of_choice")
    def power_of_choice(num_clients, per_round, r, rng, *, rounds, context, d: int = 6):
        p = context.sizes / context.sizes.sum()
        candidates = rng.choice(num_clients, min(d, num_clients), replace=False, p=p)
        loss = np.where(np.isnan(context.last_loss[candidates]), np.inf, context.last_loss[candidates])
        picked = np.sort(candidates[np.argsort(-loss, kind="stable")[:per_round]])
        seen.append((r, context.sizes.copy(), context.last_loss.copy(), context.last_round.copy(), picked))
        return picked

    @SAMPLERS.register("_uniform_reading_context")
    def uniform_reading_context(num_clients, per_round, r, rng, *, rounds, context=None):
        assert context is not None
        return np.sort(rng.choice(num_clients, per_round, replace=False))

    @SAMPLERS.register("_writes_context")
    def writes_context(num_clients, per_round, r, rng, *, rounds, context):
        context.last_loss[0] = 0.0  # read-only: raises
        return np.arange(per_round)


seen: list[tuple] = []


def test_a_sampler_reading_the_context_sees_sizes_last_losses_and_rounds(tmp_path):
    _register_context_samplers()
    seen.clear()
    res = _star(tmp_path, {"name": "_power_of_choice"}, weighting="samples")
    sizes = np.array([len(p) for p in res.algorithm.ctx.partition])
    assert [r for r, *_ in seen] == [0, 0, 1, 2, 3, 4]  # round 0 is drawn once more when the run is built
    draws = seen[1:]
    for r, got_sizes, last_loss, last_round, _ in draws:
        assert np.array_equal(got_sizes, sizes)
        # at round r the context knows rounds < r: the round each client last took part, with its loss
        expected = np.full(len(sizes), -1)
        for q in range(r):
            expected[draws[q][4]] = q
        assert np.array_equal(last_round, expected)
        assert np.isnan(last_loss[expected < 0]).all() and not np.isnan(last_loss[expected >= 0]).any()
    # the weighted train loss of round r is the mean of the losses the context holds at round r + 1
    for r in range(4):
        picked = draws[r][4]
        w = sizes[picked] / sizes[picked].sum()
        assert np.isclose(w @ draws[r + 1][2][picked], res.metrics[r]["train_loss"], rtol=1e-6, atol=0)
    # a client never heard from comes first: the first rounds take new clients only
    assert not set(draws[0][4]) & set(draws[1][4])


def test_reading_the_context_changes_no_number_and_resumes_exactly(tmp_path):
    _register_context_samplers()
    reading, plain = _numbers(_star(tmp_path, {"name": "_uniform_reading_context"})), _numbers(_star(tmp_path))

    def trained(rows):
        return [{k: v for k, v in row.items() if not k.startswith("bytes_")} for row in rows]

    assert trained(reading) == trained(plain)
    # the ledger alone differs: the losses the context is fed with are sent, one float32 per client (3 a round)
    for r, (a, b) in enumerate(zip(reading, plain)):
        assert (a["bytes_up"], a["bytes_down"]) == (b["bytes_up"] + (r + 1) * 3 * 4, b["bytes_down"])
    whole = _star(tmp_path, {"name": "_power_of_choice"})
    cfg = {
        "name": "smp",
        "rounds": 3,
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "num_clients": 10},
        "algorithm": {"name": "fedavg", "clients_per_round": 3},
        "sampler": {"name": "_power_of_choice"},
        "output": {"progress": False, "plots": False, "checkpoint_every": 1},
    }
    fedweave.run(cfg, run_dir=tmp_path / "part")
    resumed = resume(tmp_path / "part", ["rounds=5"])
    assert _numbers(resumed) == _numbers(whole)
    assert _picked(resumed) == _picked(whole)


def test_the_context_is_read_only_and_only_the_star_gives_one(tmp_path):
    from test_precision import family_config

    _register_context_samplers()
    with pytest.raises(ValueError, match="read-only"):
        _star(tmp_path, {"name": "_writes_context"})
    for name in ("hier_fedavg", "cse_fsl"):
        cfg = {**family_config(name), "sampler": {"name": "_power_of_choice"}}
        with pytest.raises(ConfigError, match=r"sampler '_power_of_choice' reads the clients' context") as e:
            fedweave.run(cfg, run_dir=tmp_path / name)
        assert f"which the {ALGORITHMS.get(name).family} family does not give" in str(e.value)


# ---- eval.at_start, model.init_from, full_batch ---------------------------------------------------------
def test_eval_at_start_reports_the_initial_model_as_round_0(tmp_path):
    base = {
        "rounds": 2,
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "num_clients": 4},
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run({**base, "eval": {"at_start": True}}, run_dir=tmp_path / "a")
    plain = fedweave.run(base, run_dir=tmp_path / "b")
    assert [r["round"] for r in res.metrics] == [0, 1, 2] and res.metrics[0]["bytes_total"] == 0
    assert res.metrics[0]["test_accuracy"] < 0.3  # an untrained model
    strip = [{k: v for k, v in r.items() if k != "wall_seconds"} for r in res.metrics[1:]]
    assert strip == [{k: v for k, v in r.items() if k != "wall_seconds"} for r in plain.metrics]


def test_model_init_from_a_state_dict_and_an_npz(tmp_path):
    from fedweave.algorithms.base import RunContext
    from fedweave.config import load

    base = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 2}}
    model = RunContext(load(base)).build_model()
    state = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "w.pt")
    np.savez(tmp_path / "w.npz", **{k: v.numpy() for k, v in state.items()})
    for f in ("w.pt", "w.npz"):
        m = RunContext(load({**base, "model": {"name": "logistic", "init_from": str(tmp_path / f)}})).build_model()
        assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
    torch.save({"linear.weight": torch.zeros(3)}, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="model.init_from"):
        RunContext(load({**base, "model": {"name": "logistic", "init_from": str(tmp_path / "bad.pt")}})).build_model()
    torch.save({k: 3 for k in state}, tmp_path / "ints.pt")  # loads under weights_only, but holds no tensors
    with pytest.raises(ConfigError, match="not tensors"):
        RunContext(load({**base, "model": {"name": "logistic", "init_from": str(tmp_path / "ints.pt")}})).build_model()


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("touch ran-code",))


def test_model_init_from_runs_no_code(tmp_path, monkeypatch):
    from fedweave.algorithms.base import RunContext
    from fedweave.config import load

    monkeypatch.chdir(tmp_path)
    torch.save({"linear.weight": _RunsCode()}, tmp_path / "evil.pt")
    base = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 2}}
    with pytest.raises(ConfigError, match="not a readable state_dict"):
        RunContext(load({**base, "model": {"name": "logistic", "init_from": "evil.pt"}})).build_model()
    assert not (tmp_path / "ran-code").exists()


def test_full_batch_steps_and_the_large_batch_warning(tmp_path, caplog):
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.config import load

    base = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "num_clients": 40}}
    algo = build_algorithm(RunContext(load({**base, "local": {"steps": 2, "epochs": None, "full_batch": True}})))
    batches = algo.trainer.client_batches(3, 0, (), None)
    assert len(batches) == 2 and all(torch.equal(b, algo.trainer.parts[3]) for b in batches)
    with caplog.at_level("WARNING", logger="fedweave"):
        build_algorithm(RunContext(load({**base, "local": {"steps": 2, "epochs": None, "batch_size": 64}})))
    assert "local.full_batch" in caplog.text


class _CrossEntropyColumn(Loss):
    """Cross-entropy per sample as a column, (B, 1): the shape per_sample must not have."""

    name = "ce_column"
    targets = "class"

    def per_sample(self, out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")[:, None]


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_loss_class_whose_per_sample_is_a_column_is_refused(backend, tmp_path):
    """A Loss class of one's own returning (B, 1): the vmap backend's masked mean broadcast it against the (B,)
    mask into (B, B) and trained on a sum (the loop backend, without a mask, on the mean); now one line when the
    run is built, on every backend."""
    cfg = {"rounds": 1, "backend": backend, "dataset": {"name": "digits"}, "model": {"name": "logistic"}}
    cfg |= {"partition": {"name": "iid", "num_clients": 3}, "algorithm": {"name": "fedavg", "clients_per_round": 3}}
    want = r"^loss 'ce_column': per_sample must return one loss per sample, shape \(B,\), but returns \(2, 1\) for 2"
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, loss=_CrossEntropyColumn(), run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


# ---- plug-ins and the listing ---------------------------------------------------------------------------
PLUGIN = """
import torch
from fedweave.tasks import LOSSES, Loss

@LOSSES.register("plugin_l1")
class L1(Loss):
    name = "plugin_l1"
    def per_sample(self, out, y):
        return (out - y.to(out.dtype).reshape(out.shape)).abs().reshape(len(out), -1).mean(1)
"""


def test_a_plugin_registers_a_loss_for_the_command_line(tmp_path, capsys):
    (tmp_path / "myplug.py").write_text(PLUGIN)
    args = [
        "run",
        "example:centralized/fedavg",
        "dataset=diabetes",
        "model={name: mlp, hidden: [8]}",
        "partition={name: iid, num_clients: 4}",
        "algorithm.clients_per_round=2",
        "rounds=2",
        "task={loss: plugin_l1, metrics: [mae]}",
        "--plugin",
        str(tmp_path / "myplug.py"),
        "--out",
        str(tmp_path / "r"),
        "--no-progress",
    ]
    assert cli_main(args) == 0, capsys.readouterr().err
    assert "final test mae" in capsys.readouterr().out
    assert "plugin_l1" in LOSSES


@pytest.mark.slow
def test_a_runs_plugins_are_recorded_so_it_resumes_from_anywhere(tmp_path, monkeypatch, capsys):
    """``--plugin`` and ``plugins:`` name files relative to the working directory; the run's config.yaml records
    them by absolute path, so ``fedweave run --resume`` works from another directory with nothing more."""
    import subprocess
    import sys

    import yaml

    work = tmp_path / "work"
    work.mkdir()
    (work / "plug.py").write_text(PLUGIN.replace("plugin_l1", "plugin_l1_resumed"))
    monkeypatch.chdir(work)
    args = ["run", "example:centralized/fedavg", "--plugin", "plug.py", "--out", "r", "--no-progress"]
    args += ["dataset=diabetes", "model={name: mlp, hidden: [8]}", "partition={name: iid, num_clients: 4}"]
    args += ["algorithm.clients_per_round=2", "rounds=2", "task={loss: plugin_l1_resumed, metrics: [mae]}"]
    assert cli_main([*args, "output.checkpoint_every=1"]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((work / "r" / "config.yaml").read_text())
    assert saved["plugins"] == [str(work / "plug.py")]
    proc = subprocess.run(
        [sys.executable, "-m", "fedweave.cli", "run", "--resume", str(work / "r"), "rounds=3", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "final test mae" in proc.stdout
    # the YAML key: a relative path, recorded absolute
    cfg = {**yaml.safe_load((work / "r" / "config.yaml").read_text()), "plugins": ["plug.py"]}
    from fedweave.config import load

    assert load(cfg).plugins == [str(work / "plug.py")]


def test_list_shows_losses_metrics_and_samplers(capsys):
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    for word in ("mse", "bce_with_logits", "nll", "auc", "perplexity", "schedule", "bernoulli", "from_file"):
        assert word in out


@pytest.mark.parametrize("method", ["cse_fsl", "fsl_mc"])
def test_split_learning_trains_a_regression_task(method, tmp_path):
    """The split family's auxiliary (eq. 8) and server (eq. 11) losses follow the task: regress the digit's
    value from its image with mse."""
    from fedweave.data.datasets.bundled import load_digits

    ds = load_digits(as_image=True)
    data = (ds.train_x, ds.train_y.double() / 9, ds.test_x, ds.test_y.double() / 9)
    cfg = {
        "name": "split-reg",
        "rounds": 4,
        "partition": {"name": "iid", "num_clients": 4},
        "model": {"name": "split_small"},
        "algorithm": {"name": method, **({"h": 2} if method == "cse_fsl" else {})},
        "task": {"loss": "mse"},
        "local": {"batch_size": 32, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run(cfg, dataset=data, run_dir=tmp_path / "r")
    first, last = res.metrics[0], res.metrics[-1]
    assert res.summary["main_metric"] == "test_mse" and "test_accuracy" not in last
    assert last["test_mse"] < first["test_mse"] and last["test_r2"] > 0.3
    if method == "cse_fsl":
        assert "aux_test_mse" in last


# ---- plots and sweeps follow the task ----------------------------------------------------------------
def test_column_directions():
    from fedweave.tasks import column_direction

    want = {
        "test_accuracy": "max",
        "test_accuracy_min": "max",
        "val_auc": "max",
        "test_f1_2": "max",
        "test_r2": "max",
        "test_mse": "min",
        "test_mse_worst": "min",
        "aux_test_rmse": "min",
        "test_perplexity": "min",
        "train_loss": "min",
        "test_loss_global": "min",
        # the confederated family's solver columns: lower is better (before: "max", so a sweep over them
        # marked the point with the largest optimality gap best)
        "opt_gap": "min",
        "objective_gap": "min",
        "consensus_error": "min",
        # costs: lower is better (before: "max", so a sweep's best wall_seconds was its slowest point)
        "wall_seconds": "min",
        "bytes_total": "min",
        "bytes_up": "min",
        "sim_time": "min",
        "epsilon": "min",
        "smashed_uploads_per_client": "min",
        "upload_fraction": "min",
        # an attack's success and a spread across clients (before: "max", so a sweep over defences marked the
        # most backdoored point best, and the least fair one)
        "test_backdoor_success": "min",
        "client_test_accuracy_std": "min",
        "client_test_accuracy_worst10": "max",
    }
    assert {k: column_direction(k) for k in want} == want


def test_plot_and_sweep_follow_a_regression_task(tmp_path, capsys):
    cfg = {**REGRESSION, "rounds": 3, "partition": {"name": "iid", "num_clients": 4}}
    res = fedweave.sweep(cfg, {"local.lr": [0.001, 0.05]}, out=tmp_path / "sw", target=0.9, progress=False)
    by_lr = {r["point"]: r for r in res.summary}
    slow, fast = by_lr["local.lr=0.001"], by_lr["local.lr=0.05"]
    assert fast["test_mse_mean"] < 0.9 < slow["test_mse_mean"]  # lower is better: the fast one wins
    assert fast["best"] and not slow["best"]
    assert slow["rounds_to_target_mean"] is None and fast["rounds_to_target_mean"] is not None
    for rec in res.records:
        rows = [r["test_mse"] for r in fedweave.results.read_metrics(tmp_path / "sw" / rec["run_dir"])]
        assert rec["best_test_mse"] == min(rows)
    assert cli_main(["plot", str(tmp_path / "sw" / res.records[0]["run_dir"]), "--out", str(tmp_path / "p")]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["test_mse_vs_bytes.png", "test_mse_vs_rounds.png"]


def test_the_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/tasks.md's dozen-line regression with a custom model, executed verbatim."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 20 and "fedweave.run(" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/tasks.md", "exec"), {"__name__": "walkthrough"})
    key, value = capsys.readouterr().out.split()[-2:]
    assert key == "test_mse" and float(value) < 0.7  # well below 1, the score of predicting the mean
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_plot_sweep_and_report_of_a_solver_run_follow_its_optimality_gap(tmp_path):
    """A confederated run on the synthetic problem (no test set, no task metric among its rows) is plotted,
    tabulated and reported by the column its own plots show, ``opt_gap``, lower being better (before: `fedweave
    plot` failed asking for --metric 'test_accuracy', the sweep's table and report were empty)."""
    cfg = {
        "name": "solver", "seed": 0, "rounds": 2, "dataset": {"name": "cfl_logreg", "num_samples": 300, "dim": 20},
        "algorithm": {"name": "gt_saga", "num_servers": 6, "users_per_server": 5, "batch_size": 2},
        "output": {"progress": False, "plots": False},
    }  # fmt: skip
    res = fedweave.sweep(cfg, {"algorithm.sample_rate": [0.2, 0.6]}, out=tmp_path / "sw", progress=False)
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["metric"] == "opt_gap"
    gaps = {r["point"]: r["opt_gap_mean"] for r in res.summary}
    assert all(math.isfinite(g) for g in gaps.values())
    assert [r["point"] for r in res.summary if r["best"]] == [min(gaps, key=gaps.get)]  # the lowest gap is best
    run = tmp_path / "sw" / res.records[0]["run_dir"]
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "p")]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["opt_gap_vs_bytes.png", "opt_gap_vs_rounds.png"]
    assert cli_main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    assert "final opt_gap" in (tmp_path / "r.html").read_text()


def test_a_metric_undefined_on_its_evaluation_set_is_nan_not_a_divergence(tmp_path, caplog, capsys):
    """R^2 is undefined on fewer than two samples (NaN, as scikit-learn's): a client's held-out test set of one
    sample, or a test split of one, gave NaN and stopped the run as diverged with step-size advice, its losses
    finite. It is NaN in its column now, one warning says why, and the run completes; best is over the rounds
    that define it."""
    cfg = {**REGRESSION, "rounds": 2, "partition": {"name": "iid", "num_clients": 4}}
    with caplog.at_level("WARNING", logger="fedweave"):
        res = fedweave.run({**cfg, "eval": {"holdout": 0.01, "personal_test": True}}, run_dir=tmp_path / "own")
    assert res.summary["status"] == "completed" and len(res.metrics) == 2
    assert all(math.isnan(r["test_r2"]) and math.isfinite(r["test_mse"]) for r in res.metrics)
    assert all(math.isfinite(r["test_r2_global"]) for r in res.metrics)  # the global model on the pooled sets
    warned = [m for m in caplog.messages if m.startswith("test_r2 is NaN")]
    assert len(warned) == 1 and "undefined on the set it scored" in warned[0]

    one = {**cfg, "dataset": {"name": "diabetes", "test_fraction": 0.003}, "task": {"loss": "mse", "main": "r2"}}
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    assert cli_main(["run", str(tmp_path / "one.yaml"), "--out", str(tmp_path / "one")]) == 0
    assert "final test r2 nan (best undefined in every round)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["best_main"] is None and summary["best_round"] is None


def test_a_client_whose_own_test_set_cannot_define_the_metric_is_left_out_of_the_summaries(tmp_path):
    """One client's held-out set of one sample (R^2 undefined there: NaN) made test_r2, test_r2_worst and the
    distribution's mean and std NaN for every client, while worst10 (sorted, NaN last) quietly left it out. The
    summaries over clients now leave that client out, as they leave out a client without a test sample: each is
    the figure over the clients that define it, computed from the run's per-client values."""
    from sklearn.metrics import r2_score

    rng = np.random.default_rng(0)
    perm, sizes = rng.permutation(354), [10, 100, 100, 100]
    parts = [sorted(int(i) for i in perm[sum(sizes[:k]) : sum(sizes[: k + 1])]) for k in range(4)]
    (tmp_path / "parts.json").write_text(json.dumps(parts))
    cfg = {**REGRESSION, "rounds": 1, "task": {"loss": "mse", "main": "r2"},
           "partition": {"name": "from_file", "path": str(tmp_path / "parts.json"), "num_clients": 0},
           "eval": {"holdout": 0.1, "personal_test": True, "distribution": True}}  # fmt: skip
    res = fedweave.run(cfg, run_dir=tmp_path / "run")
    algo, row = res.algorithm, res.metrics[-1]
    tx, ty, own = algo.ctx.personal_test_set()
    model = algo.layout.load_(algo.x).eval()
    with torch.no_grad():
        out = model(tx.to(algo.x.dtype)).double().reshape(-1).numpy()
    assert [len(p) for p in own] == [1, 10, 10, 10]
    r2 = [r2_score(ty[p].numpy(), out[p]) for p in own[1:]]  # the client of one sample defines none
    assert row["test_r2"] == pytest.approx(np.mean(r2), rel=1e-5)
    assert row["test_r2_worst"] == pytest.approx(min(r2), rel=1e-5)
    assert row["client_test_r2_mean"] == pytest.approx(np.mean(r2), rel=1e-5)
    assert row["client_test_r2_std"] == pytest.approx(np.std(r2), rel=1e-4)
    assert res.summary["status"] == "completed" and math.isfinite(res.summary["final_main"])


@pytest.mark.parametrize("metric", ["auc", "f1", "mse"])
def test_a_value_metric_on_class_labels_with_a_python_model_of_several_outputs_is_refused_when_built(metric, tmp_path):
    """Value metrics on class labels read one output per sample. A registered model's width is known from the
    dataset, but a model passed from Python was taken to have one: ten logits trained round 1 and the first
    evaluation failed (``shape '[256, 10]' is invalid for input of size 256``). The forward pass made when the run
    is built reads its width: one line, nothing written."""
    from fedweave.data.datasets.bundled import load_digits

    d = load_digits()
    cfg = {"rounds": 1, "partition": {"name": "iid", "num_clients": 2},
           "algorithm": {"name": "fedavg", "clients_per_round": 2},
           "task": {"loss": "cross_entropy", "metrics": ["accuracy", metric]},
           "output": {"progress": False, "plots": False}}  # fmt: skip
    want = rf"^task\.metrics: '{metric}' on class labels needs a model with one output, but model 'python' gives 10"
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 10)),
                     dataset=(d.train_x, d.train_y, d.test_x, d.test_y), run_dir=tmp_path / "r")  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_partition_bins_on_two_valued_targets_keep_the_values_apart(tmp_path):
    """bins: 2 on 0/1 float targets whose median is 0: the one quantile edge, 0, put both values in one bin, so
    pathological with one class per client gave every client about half of each (no skew at all). Each
    value is a bin of its own now, and every client holds one value only."""
    from fedweave.data.datasets.bundled import load_digits

    d = load_digits()
    parity = lambda y: (y % 2 == 0).double().reshape(-1, 1)  # noqa: E731  (49.6 % even: the median is 0)
    data = (d.train_x, parity(d.train_y), d.test_x, parity(d.test_y))
    cfg = {"rounds": 1, "model": {"name": "logistic"}, "task": {"loss": "bce_with_logits"},
           "partition": {"name": "pathological", "num_clients": 4, "classes_per_client": 1, "bins": 2},
           "algorithm": {"name": "fedavg", "clients_per_round": 4},
           "output": {"progress": False, "plots": False}}  # fmt: skip
    res = fedweave.run(cfg, dataset=data, run_dir=tmp_path / "r")
    y = data[1].reshape(-1).numpy()
    assert np.quantile(y, 0.5) == 0.0  # the case: the one quantile edge is the lower value
    held = [set(np.unique(y[p]).tolist()) for p in res.algorithm.ctx.partition]
    assert all(len(h) == 1 for h in held) and set().union(*held) == {0.0, 1.0}


def test_only_a_metric_that_may_be_undefined_is_summarised_over_the_clients_that_define_it():
    """A NaN R^2 or AUC is a set the metric cannot define, left out of the summaries over clients; a NaN loss or
    accuracy is a client's diverged model, and the summary stays NaN so that the run's divergence guard stops it."""
    from fedweave.execution import client_means, client_spread

    means, worst = client_means({"r2": np.array([np.nan, 0.1, 0.3]), "mse": np.array([1.0, np.nan, 2.0])}, "r2")
    assert means["r2"] == pytest.approx(0.2) and worst == 0.1 and math.isnan(means["mse"])
    means, worst = client_means({"accuracy": np.array([np.nan, 0.5]), "loss": np.array([1.0, 2.0])}, "accuracy")
    assert math.isnan(means["accuracy"]) and math.isnan(worst) and means["loss"] == 1.5
    assert client_spread(np.array([np.nan, 0.1, 0.3]), metric="auc")["mean"] == pytest.approx(0.2)
    assert math.isnan(client_spread(np.array([np.nan, 0.1, 0.3]), metric="accuracy")["mean"])
    assert all(math.isnan(v) for v in client_spread(np.array([np.nan, np.nan]), metric="r2").values())
