"""The execution engine: loop and vmap compute the same thing; local SGD matches its closed form."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from fedweave.config import LocalConfig
from fedweave.execution import LocalRule, LocalTrainer, choose_backend
from fedweave.execution.job import LocalCall, backend_run, reindexed
from fedweave.seeding import Seeds
from tests.conftest import make_toy


class ProxLookAhead(LocalRule):
    """A rule exercising per-job tensors, a look-ahead gradient and a projection."""

    def __init__(self, anchors: torch.Tensor) -> None:
        self.anchors = anchors

    def direction(self, w, grad, jobs):
        return grad(w - 0.01 * self.anchors[jobs]) + 0.5 * (w - self.anchors[jobs])

    def project(self, w, jobs):
        return w.clamp(-0.3, 0.3)


def _trainer(model, parts, backend, **local):
    ds = make_toy()
    cfg = LocalConfig(**local)
    cfg.validate()
    return LocalTrainer(model, ds.train_x, ds.train_y, parts, cfg, Seeds(11), backend=backend)


def _models():
    torch.manual_seed(0)
    yield nn.Sequential(nn.Flatten(), nn.Linear(36, 4))
    torch.manual_seed(0)
    yield nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 4))


@pytest.mark.parametrize("model", list(_models()), ids=["linear", "cnn"])
@pytest.mark.parametrize(
    "local",
    [
        {"epochs": 2, "batch_size": 16, "lr": 0.1},
        {"steps": 5, "batch_size": 8, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2, "grad_clip": 0.5},
    ],
    ids=["epochs", "steps-momentum-wd-clip"],
)
def test_loop_and_vmap_agree_on_uneven_clients(model, local, uneven_parts):
    clients = [0, 1, 2, 3, 5]  # sizes 7, 33, 1, 159, 320: partial batches and masked steps
    results = {}
    for backend in ("loop", "vmap"):
        tr = _trainer(model, uneven_parts, backend, **local)
        w0 = tr.layout.flatten()
        starts = w0 + 0.01 * torch.arange(len(clients), dtype=torch.float32)[:, None]
        results[backend] = tr.train(starts, clients, round=2)
    a, b = results["loop"], results["vmap"]
    assert torch.equal(a.steps, b.steps)
    torch.testing.assert_close(a.params, b.params, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a.params, starts)  # something was trained


def test_loop_and_vmap_agree_with_a_custom_rule(uneven_parts):
    model = next(_models())
    clients = [1, 3, 4]
    out = {}
    for backend in ("loop", "vmap"):
        tr = _trainer(model, uneven_parts, backend, epochs=1, batch_size=32, lr=0.2)
        anchors = torch.randn(3, tr.layout.numel, generator=torch.Generator().manual_seed(1)) * 0.1
        out[backend] = tr.train(tr.layout.flatten(), clients, round=0, rule=ProxLookAhead(anchors)).params
    torch.testing.assert_close(out["loop"], out["vmap"], rtol=1e-5, atol=1e-6)
    assert out["loop"].abs().max() <= 0.3 + 1e-7  # the projection ran


def test_one_full_batch_step_is_plain_gradient_descent():
    ds = make_toy()
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 4))
    parts = [torch.arange(50).numpy()]
    cfg = LocalConfig(steps=1, batch_size=50, lr=0.3)
    cfg.validate()
    tr = LocalTrainer(model, ds.train_x, ds.train_y, parts, cfg, Seeds(0))
    w0 = tr.layout.flatten()
    loss = nn.functional.cross_entropy(model(ds.train_x[:50]), ds.train_y[:50])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = w0 - 0.3 * torch.cat([g.reshape(-1) for g in grads])
    torch.testing.assert_close(tr.train(w0, [0], round=0).params[0], expected)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_shard_of_a_call_computes_the_whole_calls_rows(backend, uneven_parts):
    """Every backend runs one ``LocalCall`` record; a shard of it (``LocalCall.shard``: its offset places the
    rule's per-job rows) gives the bits of the same jobs in the whole call, on the loop backend as the pool
    and Ray workers run it, and on vmap with the rule reindexed as ``execution.shards`` does."""
    tr = _trainer(next(_models()), uneven_parts, backend, epochs=1, batch_size=16, lr=0.2)
    clients = [1, 3, 4, 0, 2]
    anchors = torch.randn(len(clients), tr.layout.numel, generator=torch.Generator().manual_seed(2)) * 0.1
    w0 = tr.layout.flatten()
    starts = w0 + 0.01 * torch.arange(len(clients), dtype=torch.float32)[:, None]
    call = LocalCall(starts, clients, 3, ProxLookAhead(anchors), 0.2, None, (1,))
    run = backend_run(backend)
    whole = run(tr, call)
    shard = call.shard(2, 5)
    assert shard.offset == 2 and shard.clients == [4, 0, 2] and torch.equal(shard.starts, starts[2:5])
    if backend == "vmap":
        shard = replace(shard, rule=reindexed(shard.rule, range(2, 5)), offset=0)
    part = run(tr, shard)
    assert torch.equal(part.params, whole.params[2:5]) and torch.equal(part.loss, whole.loss[2:5])
    shared = replace(call, starts=w0.expand(len(clients), -1)).shard(1, 3)
    assert shared.starts.shape == (tr.layout.numel,)  # a shared start travels as its one row


def test_same_stream_same_batches_and_key_changes_them(uneven_parts):
    tr = _trainer(next(_models()), uneven_parts, "loop", epochs=1, batch_size=16, lr=0.1)
    a = tr.client_batches(4, 3, (), None)
    assert all(torch.equal(x, y) for x, y in zip(a, tr.client_batches(4, 3, (), None)))
    assert not torch.equal(a[0], tr.client_batches(4, 3, (1,), None)[0])
    assert sorted(torch.cat(a).tolist()) == sorted(uneven_parts[4].tolist())  # one epoch = every sample once


def test_lr_schedules(uneven_parts):
    tr = _trainer(next(_models()), uneven_parts, "loop", epochs=1, lr=0.1, lr_decay=0.5)
    assert tr.lr(0) == 0.1 and tr.lr(3) == pytest.approx(0.0125)
    tr = _trainer(next(_models()), uneven_parts, "loop", epochs=1, lr=0.1, lr_decay=0.5, lr_schedule="step", lr_step=2)
    assert [tr.lr(r) for r in range(5)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    tr = _trainer(next(_models()), uneven_parts, "loop", epochs=1, lr=0.1, lr_schedule="cosine", lr_min=0.02)
    with pytest.raises(ValueError, match="cosine"):
        tr.lr(0)
    tr.rounds = 10
    assert tr.lr(0) == pytest.approx(0.1) and tr.lr(5) == pytest.approx(0.06) and tr.lr(10) == pytest.approx(0.02)


def test_auto_backend_picks_vmap_for_a_linear_layer_and_the_pool_for_convolutions_with_threads():
    lin, cnn = _models()
    assert torch.get_num_threads() == 1  # pinned by conftest: the default below is one thread
    assert choose_backend("auto", lin, 50) == "loop"  # one thread: the fused loop kernel
    assert choose_backend("auto", lin, 16, threads=2) == "vmap"
    assert choose_backend("auto", lin, 10, threads=2) == "loop"
    assert choose_backend("auto", cnn, 10) == "loop"
    assert choose_backend("auto", cnn, 10, threads=2) == "pool"  # one-thread workers beat two threads
    assert choose_backend("auto", cnn, 1, threads=2) == "loop"  # one job: nothing to spread
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 4))
    assert choose_backend("auto", mlp, 10, threads=2) == "loop"
    assert choose_backend("vmap", cnn, 10) == "vmap"
    assert choose_backend("loop", cnn, 10, threads=2) == "loop"
