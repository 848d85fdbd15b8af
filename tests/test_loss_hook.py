"""LocalRule.extra_loss: a term of the loss built from the representations of several models, and
LocalRule.loss: a loss in place of the task's, on the loop and vmap backends (batched over the jobs), and the
default hooks that change nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedweave.algorithms.centralized.base import per_job
from fedweave.config import LocalConfig
from fedweave.deploy.jobs import decode_job, encode_header, encode_job
from fedweave.execution import LocalRule, LocalTrainer
from fedweave.execution.dpsgd import DPSGD
from fedweave.execution.job import PLAIN, LocalCall, own_loss, plain_rule, reindexed, uses_loss
from fedweave.execution.placement import resolve_placement
from fedweave.execution.pool import pool
from fedweave.models.head import HeadedModel
from fedweave.models.linear import MLP
from fedweave.registry import RULES
from fedweave.seeding import Seeds
from tests.conftest import make_toy


@RULES.register("_test_contrast")
class Contrast(LocalRule):
    """A model-contrastive term: the representation under ``w`` pulled to the shared ``glob`` model's and
    pushed from the job's row of ``prev``."""

    def __init__(self, mu: float, glob: torch.Tensor, prev: torch.Tensor, tau: float = 0.5) -> None:
        self.mu, self.glob, self.prev, self.tau = mu, glob, prev, tau

    def extra_loss(self, w, x, y, jobs, model):
        z = model.features(w, x)
        with torch.no_grad():
            z_glob = model.features(per_job(self.glob, jobs), x)
            z_prev = model.features(per_job(self.prev, jobs), x)
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], -1)
        return self.mu * (torch.logsumexp(sims / self.tau, -1) - sims[..., 0] / self.tau)


@RULES.register("_test_focal")
class Focal(LocalRule):
    """A loss in place of the task's: the focal loss (gamma 2), which down-weights the samples the model gets
    right; ``gamma = 0`` is the cross-entropy."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def loss(self, w, x, y, jobs, model):
        ce = F.cross_entropy(model.functional(w, x), y, reduction="none")
        return (1 - torch.exp(-ce)) ** self.gamma * ce


class FocalContrast(Focal, Contrast):
    """Both hooks: the focal loss with the model-contrastive term added."""

    def __init__(self, gamma: float, mu: float, glob: torch.Tensor, prev: torch.Tensor) -> None:
        Focal.__init__(self, gamma)
        Contrast.__init__(self, mu, glob, prev)


class Identity(LocalRule):
    """The plain direction, but not the plain rule: the loop backend's general path."""

    def direction(self, w, grad, jobs):
        return grad(w)


class SmallCNN(HeadedModel):
    """A convolution body (the loop backend computes the task's loss on its channels-last twin) and a head."""

    classifier = ("out",)

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = torch.nn.Conv2d(1, 3, 3), torch.nn.Linear(48, 4)

    def features(self, x):
        return torch.relu(self.conv(x)).flatten(1)

    def head(self, z):
        return self.out(z)


CLIENTS = [0, 1, 2, 3, 5]  # sizes 7, 33, 1, 159, 320: partial batches and masked steps on the vmap backend


def _trainer(parts, backend, cnn=False, **local):
    ds = make_toy()
    torch.manual_seed(0)
    model = SmallCNN() if cnn else MLP(36, (8,), 4, True)
    cfg = LocalConfig(**({"epochs": 1, "batch_size": 16, "lr": 0.1} | local))
    cfg.validate()
    return LocalTrainer(model, ds.train_x, ds.train_y, parts, cfg, Seeds(3), backend=backend)


def _rule(tr, mu):
    w0 = tr.layout.flatten()
    prev = w0 + 0.05 * torch.randn(len(CLIENTS), w0.numel(), generator=torch.Generator().manual_seed(2))
    return Contrast(mu, w0, prev)


@pytest.mark.parametrize(
    "cnn, local",
    [(False, {}), (False, {"momentum": 0.9, "weight_decay": 1e-3}), (True, {"grad_clip": 1.0})],
    ids=["mlp-sgd", "mlp-momentum-wd", "cnn-clip"],
)
def test_loop_and_vmap_agree_on_a_term_from_several_models(uneven_parts, cnn, local):
    out = {}
    for backend in ("loop", "vmap"):
        tr = _trainer(uneven_parts, backend, cnn, **local)
        out[backend] = tr.train(tr.layout.flatten(), CLIENTS, 1, rule=_rule(tr, 1.0))
        plain = tr.train(tr.layout.flatten(), CLIENTS, 1)
        assert (out[backend].params - plain.params).abs().max() > 1e-3  # the term moved the models
        assert (out[backend].loss > plain.loss).all()  # ... and is part of the reported loss
    torch.testing.assert_close(out["loop"].params, out["vmap"].params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["loop"].loss, out["vmap"].loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cnn, local", [(False, {}), (True, {"grad_clip": 1.0})], ids=["mlp-sgd", "cnn-clip"])
def test_a_loss_in_place_of_the_tasks_trains_the_same_on_loop_and_vmap(uneven_parts, cnn, local):
    out = {}
    for backend in ("loop", "vmap"):
        tr = _trainer(uneven_parts, backend, cnn, **local)
        w0 = tr.layout.flatten()
        out[backend] = tr.train(w0, CLIENTS, 1, rule=Focal(2.0))
        plain = tr.train(w0, CLIENTS, 1)
        assert (out[backend].params - plain.params).abs().max() > 1e-3  # the focal loss moved the models
        assert (out[backend].loss < plain.loss).all()  # ... and is the reported loss: below the cross-entropy
        # gamma 0 is the task's cross-entropy: its gradient through autograd, the plain rule's to rounding
        torch.testing.assert_close(tr.train(w0, CLIENTS, 1, rule=Focal(0.0)).params, plain.params, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["loop"].params, out["vmap"].params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["loop"].loss, out["vmap"].loss, rtol=1e-5, atol=1e-6)


def test_a_rules_own_loss_takes_its_extra_term_too(uneven_parts):
    """loss + extra_loss: the gradient of their sum; with gamma 0 that is the term added to the task's loss."""
    for backend in ("loop", "vmap"):
        tr = _trainer(uneven_parts, backend)
        w0, contrast = tr.layout.flatten(), _rule(tr, 1.0)
        both = tr.train(w0, CLIENTS, 1, rule=FocalContrast(0.0, 1.0, contrast.glob, contrast.prev))
        added = tr.train(w0, CLIENTS, 1, rule=contrast)
        torch.testing.assert_close(both.params, added.params, rtol=0, atol=1e-6)
        torch.testing.assert_close(both.loss, added.loss, rtol=1e-6, atol=1e-6)
        focal = tr.train(w0, CLIENTS, 1, rule=Focal(0.0))
        assert (both.params - focal.params).abs().max() > 1e-3  # the extra term counted


def test_the_pool_backend_equals_the_loop_with_a_rules_own_loss(uneven_parts):
    loop, pooled = _trainer(uneven_parts, "loop"), _trainer(uneven_parts, "pool")
    pool(pooled, workers=2)
    w0 = loop.layout.flatten()
    a, b = (tr.train(w0, CLIENTS, 1, rule=Focal(2.0)) for tr in (loop, pooled))
    assert torch.equal(a.params, b.params) and torch.equal(a.loss, b.loss)


class Seen(Focal):
    """The focal loss, keeping the dtype its model's output came in."""

    seen: list[torch.dtype] = []

    def loss(self, w, x, y, jobs, model):
        Seen.seen.append(model.functional(w, x).dtype)
        return super().loss(w, x, y, jobs, model)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_loss_in_place_of_the_tasks_is_autocast_as_the_tasks_under_bf16_mixed(uneven_parts, backend):
    """precision: bf16-mixed runs the task's forward passes in bfloat16; a rule's own loss replaces the task's,
    so it runs as that does (FedLC trained in float32 under bf16-mixed otherwise, the only method that did)."""
    ds = make_toy()
    cfg = LocalConfig(epochs=1, batch_size=16, lr=0.1)
    cfg.validate()
    out = {}
    for precision in ("float32", "bf16-mixed"):
        Seen.seen = []
        torch.manual_seed(0)  # the same initial model
        tr = LocalTrainer(
            MLP(36, (8,), 4, True),
            ds.train_x,
            ds.train_y,
            uneven_parts,
            cfg,
            Seeds(3),
            backend=backend,
            placement=resolve_placement("cpu", precision),
        )
        out[precision] = tr.train(tr.layout.flatten(), CLIENTS, 1, rule=Seen(2.0))
        want = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
        assert Seen.seen and set(Seen.seen) == {want}
        assert out[precision].params.dtype == torch.float32 and out[precision].loss.dtype == torch.float32
    # the same training to bfloat16's rounding (0.007 here; the plain rule's differs by 0.004)
    torch.testing.assert_close(out["bf16-mixed"].params, out["float32"].params, rtol=0, atol=0.02)
    assert not torch.equal(out["bf16-mixed"].params, out["float32"].params)


def test_dp_sgd_refuses_a_rule_with_a_loss_of_its_own(uneven_parts):
    tr = _trainer(uneven_parts, "loop")
    with pytest.raises(ValueError, match=r"local rule Focal trains on a loss of its own \(loss\)"):
        DPSGD(tr.layout, 1.0, 0.0, Seeds(0), 0, CLIENTS, base=Focal(2.0))


def test_a_zero_term_changes_no_bit(uneven_parts):
    """mu = 0 adds exact zeros: vmap equals plain SGD (its closed-form MLP gradients stay), and the loop
    equals its general path (the fused kernel steps aside for a rule that uses the hook)."""
    tr = _trainer(uneven_parts, "vmap")
    w0 = tr.layout.flatten()
    assert torch.equal(tr.train(w0, CLIENTS, 1, rule=_rule(tr, 0.0)).params, tr.train(w0, CLIENTS, 1).params)
    tr = _trainer(uneven_parts, "loop")
    hooked, general = tr.train(w0, CLIENTS, 1, rule=_rule(tr, 0.0)), tr.train(w0, CLIENTS, 1, rule=Identity())
    assert torch.equal(hooked.params, general.params) and torch.equal(hooked.loss, general.loss)


def test_the_default_hook_is_no_term():
    assert PLAIN.extra_loss(torch.zeros(3), torch.zeros(2, 3), torch.zeros(2), 0, None) is None
    assert plain_rule(PLAIN) and not uses_loss(PLAIN) and not uses_loss(Identity())
    rule = Contrast(1.0, torch.zeros(3), torch.zeros(2, 3))
    assert uses_loss(rule) and not plain_rule(rule) and uses_loss(reindexed(rule, [1]))
    assert PLAIN.loss(torch.zeros(3), torch.zeros(2, 3), torch.zeros(2), 0, None) is None and not own_loss(PLAIN)
    assert own_loss(Focal(2.0)) and not uses_loss(Focal(2.0)) and own_loss(reindexed(Focal(2.0), [1]))
    assert not plain_rule(Focal(2.0)) and not own_loss(rule)


def test_a_shard_of_a_call_indexes_the_rows_of_the_whole_call(uneven_parts):
    tr = _trainer(uneven_parts, "vmap")
    w0 = tr.layout.flatten()
    rule = _rule(tr, 1.0)
    whole = tr.train(w0, CLIENTS, 1, rule=rule).params
    shard = tr.train(w0, CLIENTS[2:4], 1, rule=reindexed(rule, [2, 3])).params
    torch.testing.assert_close(shard, whole[2:4], rtol=0, atol=1e-7)


def test_dp_sgd_refuses_a_rule_with_a_loss_term(uneven_parts):
    tr = _trainer(uneven_parts, "loop")
    with pytest.raises(ValueError, match="adds a term to the loss"):
        DPSGD(tr.layout, 1.0, 0.0, Seeds(0), 0, CLIENTS, base=_rule(tr, 1.0))


def test_the_pool_backend_equals_the_loop(uneven_parts):
    loop = _trainer(uneven_parts, "loop")
    pooled = _trainer(uneven_parts, "pool")
    pool(pooled, workers=2)  # shards: each worker's rule reads the rows of the whole call
    w0 = loop.layout.flatten()
    a, b = (tr.train(w0, CLIENTS, 1, rule=_rule(tr, 1.0)) for tr in (loop, pooled))
    assert torch.equal(a.params, b.params) and torch.equal(a.loss, b.loss)


def test_a_deployed_job_computes_what_the_simulation_computes(uneven_parts):
    """The rule travels by name with its job's row of ``prev``; the node computes the features itself."""
    tr = _trainer(uneven_parts, "loop")
    w0, rule = tr.layout.flatten(), _rule(tr, 1.0)
    whole = tr.train(w0, CLIENTS, 1, rule=rule, lr=0.1)
    call = LocalCall(w0.expand(len(CLIENTS), -1), CLIENTS, 1, rule, 0.1, None, ())
    header, tensors = encode_job(call, 3, local=tr.local)
    job = decode_job(encode_header(header), tensors).call
    assert type(job.rule) is Contrast and job.rule.prev.shape == (1, w0.numel())
    one = tr.train(job.starts, job.clients, job.round, rule=job.rule, lr=job.lr, steps=job.steps, key=job.key)
    assert torch.equal(one.params[0], whole.params[3])


def test_the_layout_computes_features_and_head_under_any_vector():
    tr = _trainer([], "loop", cnn=True)
    layout, x = tr.layout, make_toy().train_x[:5]
    w = layout.flatten() * 0.5
    model = layout.load_(w)
    z = layout.features(w, x)
    assert torch.equal(z, model.features(x)) and torch.equal(layout.head(w, z), model(x))
    plain = LocalTrainer(torch.nn.Linear(36, 4), x.flatten(1), torch.zeros(5, dtype=torch.long), [], tr.local, Seeds(0))
    with pytest.raises(TypeError, match="has no features"):
        plain.layout.features(plain.layout.flatten(), x.flatten(1))
