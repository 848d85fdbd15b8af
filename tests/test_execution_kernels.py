"""The engine's faster kernels compute what autograd computes: the closed-form batched MLP gradient (vmap
backend), the fused plain-SGD MLP step and the channels-last training twin of plain CNNs (loop backend)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from fedweave.config import LocalConfig
from fedweave.execution import LocalTrainer, ParamLayout
from fedweave.execution.batched import batched_grad
from fedweave.execution.fused import FusedSGD, fused_sgd
from fedweave.execution.local import LocalRule, cross_entropy
from fedweave.execution.loop import compute
from fedweave.execution.placement import CPU, take_rows
from fedweave.models import build_model
from fedweave.seeding import Seeds
from tests.conftest import make_toy


def _autograd(layout: ParamLayout, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None):
    v = v.clone().requires_grad_()
    loss = cross_entropy(layout.functional(v, x), y, m)
    (g,) = torch.autograd.grad(loss, v)
    return g, loss.detach()


MLPS = pytest.mark.parametrize(
    ("name", "options"),
    [("logistic", {}), ("logistic", {"bias": False}), ("mlp", {"hidden": [7]}), ("mlp", {"hidden": [5, 6]}),
     ("mlp", {"hidden": [4], "bias": False})],
)  # fmt: skip


@MLPS
def test_batched_mlp_gradient_equals_autograd(name, options):
    torch.manual_seed(0)
    model = build_model(name, (1, 4, 4), 3, **options)
    layout = ParamLayout(model)
    f = batched_grad(layout)
    assert f is not None
    K, B = 4, 6
    V = layout.flatten() + 0.3 * torch.randn(K, layout.numel)
    X, Y = torch.randn(K, B, 1, 4, 4), torch.randint(0, 3, (K, B))
    M = torch.ones(K, B, dtype=torch.bool)
    M[1, 4:] = False  # a partial last batch
    M[2, 1:] = False
    G, loss = f(V, X, Y, M)
    for k in range(K):
        g, lk = _autograd(layout, V[k], X[k], Y[k], M[k])
        torch.testing.assert_close(G[k], g, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss[k], lk, rtol=1e-5, atol=1e-6)
    out = torch.full_like(V, float("nan"))
    G2, loss2 = f(V, X, Y, None, out=out)  # no mask: every row is real; written into `out`
    assert G2 is out and not out.isnan().any()
    g, lk = _autograd(layout, V[2], X[2], Y[2], None)
    torch.testing.assert_close(G2[2], g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss2[2], lk, rtol=1e-5, atol=1e-6)


def test_batched_gradient_only_for_mlps():
    for model in (nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), build_model("cnn_mnist", (1, 28, 28), 10)):
        layout = ParamLayout(model)  # not fedweave's MLP, a CNN
        assert batched_grad(layout) is None and fused_sgd(layout, layout.flatten()) is None


class _ThroughAutograd(LocalRule):
    """The plain SGD direction, but overridden, so the loop takes its general autograd path."""

    def direction(self, w, grad, jobs):
        return grad(w)


@MLPS
@pytest.mark.parametrize(
    ("steps", "sgd"),
    [(None, {}), (70, {}), (None, {"momentum": 0.9}), (None, {"weight_decay": 0.05}),
     (70, {"momentum": 0.5, "weight_decay": 0.01})],
)  # fmt: skip  # one epoch with partial last batches; 70 steps, over two gathers
def test_fused_mlp_sgd_equals_autograd_sgd(name, options, steps, sgd, uneven_parts, monkeypatch):
    ds = make_toy()
    torch.manual_seed(0)
    model = build_model(name, (1, 6, 6), 4, **options)
    cfg = LocalConfig(epochs=1, batch_size=5, lr=0.1, **sgd)
    cfg.validate()
    tr = LocalTrainer(model, ds.train_x, ds.train_y, uneven_parts, cfg, Seeds(3), backend="loop")
    start = tr.layout.flatten() + 0.1 * torch.randn(tr.layout.numel)
    calls = []
    run = FusedSGD.run
    monkeypatch.setattr(FusedSGD, "run", lambda self, *a: calls.append(1) or run(self, *a))
    clients = [0, 2, 3, 5]
    kwargs = {"lr": lambda t: 0.2 / (t + 1), "steps": steps}
    fused = tr.train(start, clients, round=2, **kwargs)
    assert len(calls) == len(clients)  # the fused kernel ran every job
    reference = tr.train(start, clients, round=2, rule=_ThroughAutograd(), **kwargs)
    assert len(calls) == len(clients)
    assert not torch.equal(fused.params, start.expand_as(fused.params))
    torch.testing.assert_close(fused.params, reference.params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.loss, reference.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.steps, reference.steps, rtol=0, atol=0)


def test_fused_kernel_is_not_used_with_gradient_clipping(uneven_parts, monkeypatch):
    ds = make_toy()
    cfg = LocalConfig(epochs=1, batch_size=5, lr=0.1, grad_clip=0.5)
    cfg.validate()
    tr = LocalTrainer(build_model("mlp", (1, 6, 6), 4), ds.train_x, ds.train_y, uneven_parts, cfg, Seeds(3))
    monkeypatch.setattr(FusedSGD, "run", lambda *a: pytest.fail("fused kernel used with clipping"))
    tr.train(tr.layout.flatten(), [0, 2], round=0)


@pytest.mark.parametrize("name", ["logistic", "mlp"])
def test_vmap_with_the_closed_form_gradient_equals_the_loop(name, uneven_parts):
    ds = make_toy()
    out = {}
    for backend in ("loop", "vmap"):
        torch.manual_seed(0)
        model = build_model(name, (1, 6, 6), 4)
        cfg = LocalConfig(epochs=1, batch_size=16, lr=0.1)
        cfg.validate()
        tr = LocalTrainer(model, ds.train_x, ds.train_y, uneven_parts, cfg, Seeds(2), backend=backend)
        out[backend] = tr.train(tr.layout.flatten(), [0, 1, 2, 3, 5], round=1)
    torch.testing.assert_close(out["vmap"].params, out["loop"].params, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["vmap"].loss, out["loop"].loss, rtol=1e-5, atol=1e-5)


def test_channels_last_twin_gradient_equals_the_templates():
    torch.manual_seed(0)
    model = build_model("cnn_mnist", (1, 28, 28), 10)
    layout = ParamLayout(model)
    comp = compute(layout)
    assert comp.channels_last and comp.model is not model
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for _ in range(2):  # the twin follows changes of the flat parameters
        comp.value.add_(0.01 * torch.randn_like(comp.value))
        comp.gradbuf.zero_()
        loss = comp.loss_backward(cross_entropy, x, y)
        twin = comp.gradbuf.clone()
        v = layout.flatten().requires_grad_()
        ref = cross_entropy(layout.functional(v, x), y)  # the NCHW template, through autograd
        (g,) = torch.autograd.grad(ref, v)
        torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(twin, g, rtol=1e-3, atol=1e-5)


def test_models_with_normalization_keep_the_template():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2), nn.Flatten(), nn.Linear(32, 3))
    assert compute(ParamLayout(model)).model is model


def test_take_rows_gives_what_indexing_gives():
    """``Placement.rows`` copies rows with ``index_select`` (faster on a CPU): the same tensor as ``t[idx]``
    for index tensors of any shape and rows of any shape; boolean masks are indexed as before."""
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(50, 1, 4, 4, generator=g), torch.randn(50, 3, generator=g), torch.arange(50)):
        for idx in (torch.randint(0, 50, (7,), generator=g), torch.randint(0, 50, (3, 5), generator=g),
                    torch.tensor(4), torch.zeros(0, dtype=torch.long), torch.rand(50, generator=g) > 0.5):  # fmt: skip
            got = take_rows(t, idx)
            assert got.shape == t[idx].shape and torch.equal(got, t[idx])
            assert torch.equal(CPU.rows(t, idx), t[idx])


def _reference_fused_run(k: FusedSGD, x, y, batches, lrs, momentum, weight_decay) -> torch.Tensor:
    """The fused kernel's steps as first written (each step's loss written into a preallocated tensor, one
    ``_sgd`` call per parameter, the public operators): the rewritten kernel must keep its bits."""
    k.momentum, k.weight_decay = momentum, weight_decay
    k.bufs = [(torch.zeros_like(W), None if b is None else torch.zeros_like(b)) for W, _, b in k.layers]
    dots = torch.empty(len(batches))
    sizes = torch.tensor([len(b) for b in batches], dtype=dots.dtype)
    eye = torch.eye(k.classes)
    for t, b in enumerate(batches):
        xb, target, lr = x[b].reshape(len(b), -1), eye[y[b]], lrs[t]
        acts = [xb]
        for _, Wt, bias in k.layers[:-1]:
            xb = (xb.mm(Wt) if bias is None else torch.addmm(bias, xb, Wt)).relu_()
            acts.append(xb)
        _, Wt, bias = k.layers[-1]
        logp = torch.log_softmax(xb.mm(Wt) if bias is None else torch.addmm(bias, xb, Wt), 1)
        torch.dot(logp.view(-1), target.view(-1), out=dots[t])
        dz = logp.exp_().sub_(target)
        ones = torch.ones(xb.shape[0])
        for layer in range(len(k.layers) - 1, -1, -1):
            W, _, bias = k.layers[layer]
            if layer:
                dh = torch.ops.aten.threshold_backward(dz.mm(W), acts[layer], 0)
            bw, bb = k.bufs[layer] if momentum else (None, None)
            k._sgd(W, bw, dz.t(), acts[layer], lr)
            if bias is not None:
                k._sgd(bias, bb, dz.t(), ones, lr)
            if layer:
                dz = dh
    return -(dots / sizes).sum().to(torch.float64)


@MLPS
@pytest.mark.parametrize("sgd", [{}, {"momentum": 0.9}, {"weight_decay": 0.01}, {"momentum": 0.5, "weight_decay": 0.1}])
def test_fused_kernel_keeps_the_bits_of_its_first_form(name, options, sgd):
    ds = make_toy()
    model = build_model(name, (1, 6, 6), 4, **options)
    layout = ParamLayout(model)
    start = layout.flatten() + 0.01
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, len(ds.train_y), (n,), generator=g) for n in (10, 10, 7, 10, 3)]
    lrs = [0.1, 0.1, 0.05, 0.2, 0.1]
    runs = []
    for run in (FusedSGD.run, _reference_fused_run):
        value = start.clone()
        k = FusedSGD(layout, value)
        loss = run(k, ds.train_x, ds.train_y, batches, lrs, sgd.get("momentum", 0.0), sgd.get("weight_decay", 0.0))
        runs.append((value, loss))
    (new, new_loss), (ref, ref_loss) = runs
    assert torch.equal(new, ref) and torch.equal(new_loss, ref_loss)
    assert not torch.equal(new, start)


def _gathering_trainer(
    sgd: dict, uneven_parts, budget_rows: int, monkeypatch
) -> tuple[LocalConfig, LocalTrainer, list[int]]:
    """An MLP's trainer over uneven clients and one without data, with the loop backend's gather budget set to
    ``budget_rows`` rows, and the clients of its call (every client, then client 1 again)."""
    import fedweave.execution.fused as fused

    ds = make_toy()
    model = build_model("mlp", (1, 6, 6), 4, hidden=[5])
    cfg = LocalConfig(epochs=2, batch_size=3, lr=0.1, **sgd)
    cfg.validate()
    parts = [*uneven_parts, uneven_parts[0][:0]]  # the last client has no data
    tr = LocalTrainer(model, ds.train_x, ds.train_y, parts, cfg, Seeds(4))
    row_bytes = ds.train_x[:1].numel() * ds.train_x.element_size()
    monkeypatch.setattr(fused, "GATHER_BYTES", budget_rows * row_bytes)
    return cfg, tr, [*range(len(parts)), 1]


@pytest.mark.parametrize("budget_rows", [1, 12, 40, 10_000])
@pytest.mark.parametrize("sgd", [{}, {"momentum": 0.9, "weight_decay": 0.01}])
def test_rows_gathered_for_many_jobs_keep_each_jobs_bits(budget_rows, sgd, uneven_parts, monkeypatch):
    """The loop backend gathers the rows of consecutive jobs together (``FusedSGD.gathered``, up to
    ``GATHER_BYTES``; a job over it on its own gets index batches): every job's steps, final parameters and
    loss are bit for bit those of the job gathered alone, for any budget, with a client without data."""
    cfg, tr, clients = _gathering_trainer(sgd, uneven_parts, budget_rows, monkeypatch)
    plans = [tr.flat_batches(c, 3, (), None) for c in clients]
    streams = tr.batch_streams(clients, 3, ())  # the loop backend's way: the call's streams made at once
    for c, g, (flat, sizes) in zip(clients, streams, plans):
        again, same = tr.flat_batches(c, 3, (), None, g)
        assert torch.equal(again, flat) and same == sizes
    start = tr.layout.flatten() + 0.05
    jobs = []
    for (flat, sizes), got in zip(plans, FusedSGD(tr.layout, start.clone()).gathered(tr.train_x, tr.train_y, plans)):
        assert len(got) == len(sizes)
        if budget_rows < len(flat):  # over the budget: its index batches
            assert [b.tolist() for b in got] == [b.tolist() for b in flat.split(sizes)]
        jobs.append(got)
    assert len(jobs) == len(clients)
    for c, got in zip(clients, jobs):
        batches = tr.client_batches(c, 3, (), None)
        runs = []
        for arg in (got, batches):
            value = start.clone()
            loss = FusedSGD(tr.layout, value).run(
                tr.train_x, tr.train_y, arg, [0.1] * len(batches), cfg.momentum, cfg.weight_decay
            )
            runs.append((value, loss))
        (a, la), (b, lb) = runs
        assert torch.equal(a, b) and torch.equal(la, lb)
        assert torch.equal(a, start) == (not batches)


@pytest.mark.parametrize("budget_rows", [1, 12, 10_000])
@pytest.mark.parametrize("sgd", [{}, {"momentum": 0.9, "weight_decay": 0.01}])
def test_loop_call_reduces_its_jobs_losses_at_once_with_each_jobs_bits(budget_rows, sgd, uneven_parts, monkeypatch):
    """The loop backend reduces the losses of its gathered jobs at the end of the call (``job_losses``): every
    job's mean loss and final parameters are bit for bit those of the job run alone by ``FusedSGD.run``,
    whatever the budget sends to ``run``'s own gathers, with a client without data and a client twice."""
    cfg, tr, clients = _gathering_trainer(sgd, uneven_parts, budget_rows, monkeypatch)
    start = tr.layout.flatten() + 0.05
    got = tr.train(start.expand(len(clients), -1), clients, 3, lr=0.1)
    for k, c in enumerate(clients):
        batches = tr.client_batches(c, 3, (), None)
        value = start.clone()
        total = FusedSGD(tr.layout, value).run(
            tr.train_x, tr.train_y, batches, [0.1] * len(batches), cfg.momentum, cfg.weight_decay
        )
        assert torch.equal(got.params[k], value)
        assert torch.equal(got.loss[k], (total / max(len(batches), 1)).to(value.dtype))
        assert int(got.steps[k]) == len(batches)


@MLPS
@pytest.mark.parametrize("threads", [1, 2])
def test_evaluation_of_linear_models_skips_the_module_calls_with_the_same_bits(name, options, threads):
    """``batch_sums`` computes a fedweave MLP's or softmax regression's logits with the functions its modules
    call, without the calls: the same per-batch sums as through the modules, bit for bit, at 1 and 2 threads;
    a forward hook on the model sends evaluation through the modules again (the hook sees every pass)."""
    ev = importlib.import_module("fedweave.execution.evaluate")  # the module (the package exports the function)

    torch.manual_seed(0)
    model = build_model(name, (1, 6, 6), 4, **options)
    layout = ParamLayout(model)
    w = layout.flatten() + 0.3 * torch.randn(layout.numel)
    x, y = torch.randn(300, 1, 6, 6), torch.randint(0, 4, (300,))
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        direct = ev.batch_sums(layout, w, x, y, 64)
        with torch.inference_mode():  # the module path: the model's own forward, then the same sums
            model.eval()
            logits = [layout.load_(w)(x[lo : lo + 64]) for lo in range(0, 300, 64)]
            model.train()
        with ev.one_thread():
            ref = [
                (float(nn.functional.cross_entropy(z, y[lo : lo + 64], reduction="sum")),
                 int((z.argmax(1) == y[lo : lo + 64]).sum()))
                for z, lo in zip(logits, range(0, 300, 64))
            ]  # fmt: skip
        assert direct == ref
        with pytest.MonkeyPatch.context() as mp:  # the modules are not called
            mp.setattr(nn.Linear, "forward", lambda *a: pytest.fail("a module called"))
            assert ev.batch_sums(layout, w, x, y, 64) == ref
        seen = []
        handle = model.register_forward_hook(lambda m, i, o: seen.append(len(o)))
        try:
            assert ev.batch_sums(layout, w, x, y, 64) == ref
        finally:
            handle.remove()
        assert seen == [64, 64, 64, 64, 44]
    finally:
        torch.set_num_threads(n)
