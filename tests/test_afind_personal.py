"""AFIND+'s partial personalization (spec A15, Alg. 1 lines 17-23): a personal classifier head beta_i that is
never sent and never aggregated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tests.conftest  # noqa: F401  (registers the _toy dataset)
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.decentralized.afind_plus import FrozenRule
from fedweave.config import ConfigError, load
from fedweave.models import layer_parameter_names


def build(clients: int = 6, **opts):
    cfg = {
        "name": "personal",
        "seed": 3,
        "rounds": 2,
        "dataset": {"name": "_toy"},
        "partition": {"name": "dirichlet_balanced", "num_clients": clients, "alpha": 0.3},
        "model": {"name": "mlp", "hidden": [8]},
        "algorithm": {"name": "afind_plus", "neighbours": 3, "finetune_epochs": 0, **opts},
        "local": {"epochs": 1, "batch_size": 20, "lr": 0.1, "momentum": 0.5},
        "output": {"progress": False, "plots": False},
    }
    return build_algorithm(RunContext(load(cfg)))


def test_head_is_the_classifier_layer_and_only_the_shared_part_is_sent():
    shared, full = build(personal="head"), build()
    names = layer_parameter_names(shared.ctx.model, "classifier")
    head_numel = sum(k for n, k in zip(shared.layout.names, shared.layout.numels, strict=True) if n in names)
    assert int(shared.head.sum()) == head_numel > 0
    assert shared.model_bytes == full.model_bytes - 4 * head_numel
    for a in (shared, full):
        a.run_round(0)
        msgs = sum(e.count for e in a.ledger.entries() if e.kind == "model")
        assert msgs > 0 and a.ledger.bytes(kind="model") == msgs * a.model_bytes  # every model message: w only


def test_personal_head_is_never_aggregated_nor_read_by_others():
    a = build(personal="head", tau=0.0)  # tau 0: every reachable neighbour is selected (most mixing)
    W0 = a.W.clone()
    own = a.local_update(W0, range(a.num_clients), 0)  # what each client's own update gives
    a.run_round(0)
    head = a.head
    assert torch.equal(a.W[:, head], own.params[:, head])  # beta_i^{t+1}: i's own update, untouched by mixing
    assert not torch.equal(a.W[:, ~head], own.params[:, ~head])  # w was aggregated
    assert a.last_coreset[0].size > 0
    # the other clients' heads never reach client 0: change them all, client 0's new head is the same
    b = build(personal="head", tau=0.0)
    b.W[1:, head] += torch.randn(b.num_clients - 1, int(head.sum()), generator=torch.Generator().manual_seed(1))
    b.run_round(0)
    assert torch.equal(b.W[0, head], a.W[0, head])


def test_local_update_trains_the_head_then_the_body():
    a = build(personal="head", head_epochs=2)
    W0 = a.W.clone()
    clients = list(range(a.num_clients))
    h = a.head_trainer.train(W0, clients, 0, rule=FrozenRule(a.head, W0), key=(7,))
    assert torch.equal(h.params[:, ~a.head], W0[:, ~a.head]) and not torch.equal(h.params[:, a.head], W0[:, a.head])
    b = a.trainer.train(h.params, clients, 0, rule=FrozenRule(~a.head, h.params))
    assert torch.equal(b.params[:, a.head], h.params[:, a.head])
    assert not torch.equal(b.params[:, ~a.head], h.params[:, ~a.head])
    assert a.head_trainer.local.epochs == 2 and a.head_trainer.num_steps(0) == 2 * a.trainer.num_steps(0)


def test_neighbours_judge_i_with_their_own_head():
    a = build(personal="head")
    W = a.W.clone()
    g = torch.Generator().manual_seed(0)
    W[2, a.head] += torch.randn(int(a.head.sum()), generator=g)  # client 2's personal head differs from 0's
    at = a.at(W, 0, 2)
    assert torch.equal(at[a.head], W[2, a.head]) and torch.equal(at[~a.head], W[0, ~a.head])
    phis, losses = a.proxies_for(W, 0, [2])
    ref_phi, ref_loss = a.proxy.proxies(at, [2])
    assert torch.allclose(phis[1], ref_phi[0]) and float(losses[1]) == pytest.approx(float(ref_loss[0]))
    assert not np.isclose(float(losses[1]), float(a.proxy.proxies(W[0], [2])[1][0]))


def test_personal_mode_options_are_checked():
    with pytest.raises(ConfigError, match="algorithm.personal"):
        build(personal="body")
    with pytest.raises(ConfigError, match="head_epochs"):
        build(personal="head", head_epochs=0)
    with pytest.raises(ConfigError, match="proxy_layer"):
        build(personal="head", proxy_layer="classifier")
