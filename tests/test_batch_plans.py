"""The batch plan of a call, built at once with index arithmetic, equals the per-job plan it replaced: the
same indices, masks and step counts, drawn from the same streams, on many random configurations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.batch_plans import old_plan, same
from fedweave.config import LocalConfig
from fedweave.execution import LocalTrainer
from fedweave.seeding import Seeds

MODEL = torch.nn.Linear(2, 2)


def trainer(sizes: list[int], local: LocalConfig, seed: int) -> LocalTrainer:
    """Clients with ``sizes`` samples (0 allowed), their indices a random split of the training set."""
    perm = np.random.default_rng(seed).permutation(max(sum(sizes), 1))
    parts = np.split(perm[: sum(sizes)], np.cumsum(sizes)[:-1])
    n = max(sum(sizes), 1)
    return LocalTrainer(MODEL, torch.zeros(n, 2), torch.zeros(n, dtype=torch.long), parts, local, Seeds(seed))


@st.composite
def configurations(draw):
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
    mode = draw(st.sampled_from(["epochs", "steps", "full_batch_epochs", "full_batch_steps"]))
    bs = draw(st.integers(1, 16))
    if mode.endswith("epochs"):
        local = LocalConfig(epochs=draw(st.integers(1, 3)), batch_size=bs, full_batch=mode.startswith("full"))
    else:
        local = LocalConfig(steps=draw(st.integers(1, 12)), batch_size=bs, full_batch=mode.startswith("full"))
    local.validate()
    clients = draw(st.lists(st.integers(0, len(sizes) - 1), min_size=0, max_size=10))  # repeats allowed
    steps = draw(st.none() | st.integers(1, 9))  # a call's own number of steps
    key = draw(st.sampled_from([(), (2,), (1, 5)]))
    return sizes, local, clients, draw(st.integers(0, 4)), key, steps, draw(st.integers(0, 3))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
def test_the_vectorised_plan_equals_the_per_job_plan(cfg):
    sizes, local, clients, rnd, key, steps, seed = cfg
    tr = trainer(sizes, local, seed)
    old, new = old_plan(tr, clients, rnd, key, steps), tr.plan(clients, rnd, key, steps)
    assert new.index.dtype == torch.long and new.mask.dtype == torch.bool and new.steps.dtype == torch.long
    assert same(old, new), (old, new)


@pytest.mark.parametrize("clients", [[3, 0, 7], [5, 5], []])
def test_the_plan_of_a_slice_of_a_partition_reads_its_own_clients(clients):
    local = LocalConfig(epochs=2, batch_size=3)
    local.validate()
    tr = trainer([4, 0, 9, 2, 7, 1, 5, 8, 3], local, 0)
    sub = LocalTrainer(MODEL, tr.train_x, tr.train_y, tr.parts[1:], local, Seeds(0))  # offsets not from 0
    assert same(old_plan(sub, clients, 1, (), None), sub.plan(clients, 1, (), None))
    assert all(torch.equal(a, b) for a, b in zip(sub.parts, list(tr.parts)[1:], strict=True))
