"""The personalized and clustered star methods against a hand computation in numpy: 3 clients of 6 samples, a
softmax regression or a one-hidden-layer ReLU MLP, float64, full-batch local steps, 2 of the 3 clients a round
for 3 rounds, so a client's personal state also waits out rounds it is not sampled in. Each round's global (or
cluster) models and, at the end, every client's personal model agree with the hand computation to 1e-12."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedweave.data.base import Dataset
from fedweave.registry import DATASETS, PARTITIONERS
from tests.test_centralized import _algo

N, M, D, C, H = 3, 6, 3, 3, 2  # clients, samples per client, features, classes, hidden units
LR, STEPS, ROUNDS = 0.1, 2, 3
LABELS = np.array([0, 1, 2, 0, 1, 1, 2, 2, 0, 1, 0, 2, 1, 0, 0, 2, 2, 1])


def _tiny() -> Dataset:
    g = np.random.default_rng(3)
    x = torch.from_numpy((g.integers(-8, 9, size=(N * M, D)) / 8.0).astype(np.float32))  # exact in float32
    tx = torch.from_numpy((g.integers(-8, 9, size=(12, D)) / 8.0).astype(np.float32))
    return Dataset("_tiny_personal", x, torch.from_numpy(LABELS), tx, torch.from_numpy(g.integers(0, C, 12)), C, (D,))


if "_tiny_personal" not in DATASETS._items:
    DATASETS.register("_tiny_personal")(_tiny)
if "_blocks_personal" not in PARTITIONERS._items:
    PARTITIONERS.register("_blocks_personal")(
        lambda labels, num_clients, rng, *, users=None: list(np.array_split(np.arange(len(labels)), num_clients))
    )

X = _tiny().train_x.double().numpy()
PARTS = [np.arange(i * M, (i + 1) * M) for i in range(N)]
MLP = {"name": "mlp", "hidden": [H]}
HEAD = np.zeros(H * D + H + C * H + C, bool)  # the MLP's output layer: out.weight, out.bias
HEAD[H * D + H :] = True


def _cfg(alg: str, model: dict | None = None, clients: int = 2, **opts) -> dict:
    return {
        "name": "hand",
        "seed": 1,
        "rounds": ROUNDS,
        "backend": "loop",
        "precision": "float64",
        "dataset": {"name": "_tiny_personal"},
        "partition": {"name": "_blocks_personal", "num_clients": N},
        "model": model or {"name": "logistic"},
        "algorithm": {"name": alg, "clients_per_round": clients, **opts},
        "local": {"steps": STEPS, "batch_size": M, "lr": LR},  # full-batch gradient steps
        "output": {"progress": False, "plots": False},
    }


def _ce(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean cross-entropy and its gradient with respect to the logits."""
    z = logits - logits.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    g = p.copy()
    g[np.arange(len(y)), y] -= 1
    return float(-np.log(p[np.arange(len(y)), y]).mean()), g / len(y)


def logistic(v: np.ndarray, i: int) -> tuple[float, np.ndarray]:
    """Client i's loss and gradient for the softmax regression: fc.weight (C, D), fc.bias (C)."""
    x, y = X[PARTS[i]], LABELS[PARTS[i]]
    loss, g = _ce(x @ v[: C * D].reshape(C, D).T + v[C * D :], y)
    return loss, np.concatenate([(g.T @ x).ravel(), g.sum(0)])


def _mlp_parts(v: np.ndarray) -> tuple[np.ndarray, ...]:
    w1, b1 = v[: H * D].reshape(H, D), v[H * D : H * D + H]
    return w1, b1, v[H * D + H : H * D + H + C * H].reshape(C, H), v[H * D + H + C * H :]


def features(v: np.ndarray, i: int) -> np.ndarray:
    w1, b1, _, _ = _mlp_parts(v)
    return np.maximum(X[PARTS[i]] @ w1.T + b1, 0)


def mlp(v: np.ndarray, i: int, proto: tuple | None = None) -> tuple[float, np.ndarray]:
    """Client i's loss and gradient for the MLP; with ``proto`` (lam, prototypes, known) FedProto's L_R too: lam
    times the mean over the batch of the mean over the coordinates of (z - prototype of the label)^2."""
    x, y = X[PARTS[i]], LABELS[PARTS[i]]
    w1, b1, w2, b2 = _mlp_parts(v)
    a = x @ w1.T + b1
    h = np.maximum(a, 0)
    loss, g = _ce(h @ w2.T + b2, y)
    dh = g @ w2
    if proto is not None:
        lam, protos, known = proto
        dh = dh + lam * 2 * (h - protos[y]) / H * known[y][:, None] / len(y)
    da = dh * (a > 0)
    return loss, np.concatenate([(da.T @ x).ravel(), da.sum(0), (g.T @ h).ravel(), g.sum(0)])


def sgd(v: np.ndarray, grad, steps: int = STEPS, frozen: np.ndarray | None = None) -> np.ndarray:
    for _ in range(steps):
        g = grad(v)
        v = v - LR * (g if frozen is None else np.where(frozen, 0, g))
    return v


def _close(got: torch.Tensor, want: np.ndarray) -> None:
    np.testing.assert_allclose(got.detach().cpu().numpy(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("alg", ["fedper", "lg_fedavg", "fedrep"])
def test_partial_sharing_by_hand(alg):
    personal = ~HEAD if alg == "lg_fedavg" else HEAD  # FedPer and FedRep keep the head, LG-FedAvg the body
    algo = _algo(_cfg(alg, MLP, **({"head_epochs": 3} if alg == "fedrep" else {})))
    x = algo.x.numpy().copy()
    own = [x.copy() for _ in range(N)]
    for r in range(ROUNDS):
        sampled = algo.sample_clients(r)
        algo.run_round(r)
        for i in sampled:
            start = np.where(personal, own[i], x)
            grad = lambda v, i=i: mlp(v, i)[1]  # noqa: E731
            if alg == "fedrep":  # 3 epochs on the head, the body frozen; then the body, the head frozen
                own[i] = sgd(sgd(start, grad, 3, frozen=~HEAD), grad, frozen=HEAD)
            else:
                own[i] = sgd(start, grad)
        x = np.where(personal, x, np.mean([own[i] for i in sampled], 0))  # FedAvg on the shared part
        _close(algo.x, x)
    _close(algo.personal_models(ROUNDS), np.stack([np.where(personal, v, x) for v in own]))


@pytest.mark.parametrize("adaptive", [True, False])
def test_apfl_by_hand(adaptive):
    algo = _algo(_cfg("apfl", alpha=0.3, adaptive=adaptive))
    x = algo.x.numpy().copy()
    v, alpha = [x.copy() for _ in range(N)], [0.3] * N
    for r in range(ROUNDS):
        sampled = algo.sample_clients(r)
        algo.run_round(r)
        ws = []
        for i in sampled:
            w = sgd(x, lambda u, i=i: logistic(u, i)[1])  # line 5: FedAvg's client
            ws.append(w)
            for _ in range(STEPS):  # line 6 and Eq. 10, each step from the step's v and alpha
                g = logistic(alpha[i] * v[i] + (1 - alpha[i]) * w, i)[1]
                step = LR * alpha[i] * g
                if adaptive:
                    alpha[i] = float(np.clip(alpha[i] - LR * np.dot(v[i] - w, g), 0, 1))
                v[i] = v[i] - step
        x = np.mean(ws, 0)
        _close(algo.x, x)
    _close(algo.store["alpha"].squeeze(1), np.array(alpha))
    _close(algo.personal_models(ROUNDS), np.stack([a * vi + (1 - a) * x for a, vi in zip(alpha, v)]))


def test_ditto_by_hand():
    lam = 0.7
    algo = _algo(_cfg("ditto_star", lam=lam, personal_epochs=3))
    x = algo.x.numpy().copy()
    v = [x.copy() for _ in range(N)]
    for r in range(ROUNDS):
        sampled = algo.sample_clients(r)
        algo.run_round(r)
        for i in sampled:  # Eq. 2 from v_i, anchored at the round's global model
            v[i] = sgd(v[i], lambda u, i=i, w=x: logistic(u, i)[1] + lam * (u - w), 3)
        x = np.mean([sgd(x, lambda u, i=i: logistic(u, i)[1]) for i in sampled], 0)
        _close(algo.x, x)
    _close(algo.personal_models(ROUNDS), np.stack(v))


@pytest.mark.parametrize("finetune", ["full", "head"])
def test_fedbabu_by_hand(finetune):
    algo = _algo(_cfg("fedbabu", MLP, finetune_epochs=2, finetune=finetune))
    x = algo.x.numpy().copy()
    for r in range(ROUNDS):
        sampled = algo.sample_clients(r)
        algo.run_round(r)
        x = np.mean([sgd(x, lambda u, i=i: mlp(u, i)[1], frozen=HEAD) for i in sampled], 0)
        _close(algo.x, x)
    frozen = None if finetune == "full" else ~HEAD
    tuned = [sgd(x, lambda u, i=i: mlp(u, i)[1], 2, frozen=frozen) for i in range(N)]
    _close(algo.personal_models(ROUNDS), np.stack(tuned))


def test_ifca_by_hand():
    algo = _algo(_cfg("ifca", clusters=2))
    models = algo.models.numpy().copy()
    for r in range(ROUNDS):
        sampled = algo.sample_clients(r)
        picks = {i: int(np.argmin([logistic(m, i)[0] for m in models])) for i in sampled}  # line 6
        algo.run_round(r)
        new = models.copy()
        for j in range(len(models)):  # line 13: the plain mean of the members' local models
            members = [i for i in sampled if picks[i] == j]
            if members:
                new[j] = np.mean([sgd(models[j], lambda u, i=i: logistic(u, i)[1]) for i in members], 0)
        models = new
        _close(algo.models, models)
    picks = [int(np.argmin([logistic(m, i)[0] for m in models])) for i in range(N)]
    _close(algo.personal_models(ROUNDS), models[picks])


@pytest.mark.parametrize("weighting", ["clients", "samples"])
def test_fedproto_by_hand(weighting):
    lam = 0.5
    algo = _algo(_cfg("fedproto", MLP, lam=lam, prototype_weighting=weighting))
    own = [algo.store["personal"][0].numpy().copy() for _ in range(N)]
    protos, known = np.zeros((C, H)), np.zeros(C, bool)
    for r in range(ROUNDS):
        sampled = algo.sample_clients(r)
        algo.run_round(r)
        sums, counts = np.zeros((len(sampled), C, H)), np.zeros((len(sampled), C))
        for k, i in enumerate(sampled):
            own[i] = sgd(own[i], lambda u, i=i, p=(lam, protos, known): mlp(u, i, p)[1])  # Eqs. 7-8
            z, y = features(own[i], i), LABELS[PARTS[i]]
            for c in range(C):  # Eq. 3's sums and counts
                sums[k, c], counts[k, c] = z[y == c].sum(0), (y == c).sum()
        if weighting == "samples":
            new = sums.sum(0) / np.maximum(counts.sum(0), 1)[:, None]
        else:  # the plain mean over the clients that have the class
            new = (sums / np.maximum(counts, 1)[:, :, None]).sum(0) / np.maximum((counts > 0).sum(0), 1)[:, None]
        reported = counts.sum(0) > 0
        protos, known = np.where(reported[:, None], new, protos), known | reported
        _close(algo.protos, protos)
    _close(algo.store["personal"], np.stack(own))


def test_clustered_fl_split_by_hand():
    # every cluster of more than 2 clients splits past the warmup (round 1): here the one cluster at round 1
    algo = _algo(_cfg("clustered_fl", clients=N, warmup=1, eps1=1e9, eps2=0.0))
    models, assignment = [algo.models[0].numpy().copy()], [0] * N
    for r in range(ROUNDS):
        algo.run_round(r)
        updates = [
            sgd(models[assignment[i]], lambda u, i=i: logistic(u, i)[1]) - models[assignment[i]] for i in range(N)
        ]
        if r >= 1 and len(set(assignment)) == 1:
            u = np.stack([d / np.linalg.norm(d) for d in updates])
            sim = u @ u.T
            # complete linkage of 3 points into 2 groups: the most similar pair, and the third alone
            _, p, q = max((sim[a, b], a, b) for a in range(N) for b in range(a + 1, N))
            second = [({0, 1, 2} - {p, q}).pop()] if 0 in (p, q) else [p, q]  # client 0's group keeps the cluster
            for i in second:
                assignment[i] = 1
            models.append(models[0].copy())
        models = [m + np.mean([updates[i] for i in range(N) if assignment[i] == c], 0) for c, m in enumerate(models)]
        _close(algo.models, np.stack(models))
        assert algo.assignment.tolist() == assignment
    assert len(models) == 2
