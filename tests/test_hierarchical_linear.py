"""The closed-form softmax-regression gradient of the hierarchical family's local solves: equal to autograd
(with and without bias, padded batches), used on the loop and vmap backends with the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedweave.algorithms  # noqa: F401  (families first: topology modules import the algorithm base)
from fedweave.algorithms.hierarchical.linear import ClosedFormGrad, closed_form_gradient, with_closed_form
from fedweave.config import LocalConfig
from fedweave.execution import LocalTrainer, ParamLayout
from fedweave.execution.local import PLAIN, cross_entropy
from fedweave.models.linear import build_logistic
from fedweave.seeding import Seeds


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trainer(bias: bool, backend: str = "loop", n: int = 90) -> LocalTrainer:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 3, 4, generator=g), torch.randint(0, 5, (n,), generator=g)
    model = build_logistic((1, 3, 4), 5, bias=bias)
    parts = [np.arange(0, 40), np.arange(40, 67), np.arange(67, 90)]  # 27 and 23 samples: partial batches
    return LocalTrainer(model, x, y, parts, LocalConfig(batch_size=8, lr=0.1), Seeds(1), backend=backend)


@pytest.mark.parametrize("bias", [False, True])
def test_closed_form_equals_autograd_on_single_and_padded_batches(bias):
    tr = _trainer(bias)
    fn = closed_form_gradient(tr)
    assert fn is not None
    layout: ParamLayout = tr.layout
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, layout.numel, generator=g)
    x, y = torch.randn(3, 8, 1, 3, 4, generator=g), torch.randint(0, 5, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False  # a padded last batch
    mask[2, :] = False  # a fully padded row gives zero
    got, loss = fn(v, x, y, mask)
    for k in range(3):
        w = v[k].clone().requires_grad_(True)
        ref = cross_entropy(layout.functional(w, x[k]), y[k], mask[k])
        (want,) = torch.autograd.grad(ref, w)
        assert torch.allclose(got[k], want, atol=1e-6) and loss[k] == pytest.approx(float(ref.detach()), abs=1e-6)
    one, one_loss = fn(v[0], x[0], y[0], None)  # the loop backend: (P,) and no mask
    w = v[0].clone().requires_grad_(True)
    ref = cross_entropy(layout.functional(w, x[0]), y[0])
    assert torch.allclose(one, torch.autograd.grad(ref, w)[0], atol=1e-6)
    assert float(one_loss) == pytest.approx(float(ref.detach()), abs=1e-6)


def test_only_softmax_regression_gets_the_closed_form():
    from fedweave.models.linear import build_mlp

    tr = _trainer(False)
    tr_mlp = LocalTrainer(build_mlp((1, 3, 4), 5), tr.train_x, tr.train_y, tr.parts, tr.local, tr.seeds)
    assert closed_form_gradient(tr_mlp) is None and with_closed_form(PLAIN, tr_mlp) is PLAIN
    assert isinstance(with_closed_form(PLAIN, tr), ClosedFormGrad)


@pytest.mark.parametrize("bias", [False, True])
def test_training_with_the_closed_form_matches_autograd_on_both_backends(bias):
    clients = [0, 1, 2, 1]
    starts = torch.randn(4, _trainer(bias).layout.numel, generator=torch.Generator().manual_seed(5)) * 0.1
    results = {}
    for backend in ("loop", "vmap"):
        tr = _trainer(bias, backend)
        for fast in (False, True):
            rule = with_closed_form(PLAIN, tr) if fast else PLAIN
            calls = []
            if fast:  # count the closed-form evaluations: the backend must hand the rule its batch
                fn = rule.fn
                rule.fn = lambda *a, fn=fn, calls=calls: calls.append(1) or fn(*a)
            results[backend, fast] = tr.train(starts, clients, 0, rule=rule, lr=lambda t: 0.1 / (t + 1), steps=7)
            assert len(calls) == (7 * (4 if backend == "loop" else 1) if fast else 0)
    ref = results["loop", False]
    for key, res in results.items():
        assert torch.allclose(res.params, ref.params, atol=1e-5), key
        assert torch.allclose(res.loss, ref.loss, atol=1e-5), key  # the reported loss at each step's iterate
