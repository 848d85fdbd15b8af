"""Models and losses passed from Python that the run cannot train as its numbers promise are one line when the
run is built, before anything is written; a model factory's module is never trained in place."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedweave
from fedweave.config import ConfigError
from fedweave.data.datasets.bundled import load_digits


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _cfg(rounds: int = 2, backend: str = "loop") -> dict:
    return {
        "rounds": rounds,
        "seed": 0,
        "backend": backend,
        "threads": 1,
        "partition": {"name": "iid", "num_clients": 4},
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "local": {"batch_size": 16, "lr": 0.1},
        "output": {"progress": False, "plots": False, "checkpoint_every": 1},
    }


def _losses(result) -> list[float]:
    return [row["test_loss"] for row in result.metrics]


# ---- buffers that training changes (1)


def _instance_norm() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 32),
        nn.Unflatten(1, (4, 8)),
        nn.InstanceNorm1d(4, track_running_stats=True, affine=True),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _spectral_norm() -> nn.Module:
    return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(64, 32)), nn.ReLU(), nn.Linear(32, 10))


class _Counter(nn.Module):
    """Counts its training forward passes in a buffer: a state of the model that no parameter carries."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.lin(x)


class _Scaled(nn.Module):
    """A constant buffer, registered once and only read: nothing for a backend or checkpoint to carry."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)
        self.register_buffer("scale", torch.full((64,), 1 / 16))

    def forward(self, x):
        return self.lin(x * self.scale)


@pytest.mark.parametrize(
    ("factory", "named"),
    [
        (_instance_norm, r"its InstanceNorm1d '2' changes its buffer 'running_mean'"),
        (_spectral_norm, r"its _SpectralNorm '0\.parametrizations\.weight\.0' changes its buffer '_u'"),
        (_Counter, r"its _Counter \(the model itself\) changes its buffer 'calls'"),
        (
            lambda: nn.utils.spectral_norm(nn.Linear(64, 10)),
            r"its Linear \(the model itself\) changes its buffer 'weight_u'",
        ),
    ],
)
def test_buffers_that_training_changes_are_refused(tmp_path, digits, factory, named):
    # before: accepted, and a resume or the pool backend gave other numbers (instance norm: test loss 0.650 at
    # round 3 uninterrupted, 0.895 resumed from round 2)
    with pytest.raises(ConfigError, match=rf"^model: {named} in training") as e:
        fedweave.run(_cfg(), model=factory, dataset=digits, run_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_batch_norm_keeps_its_own_refusal(tmp_path, digits):
    model = lambda: nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, 10))  # noqa: E731
    with pytest.raises(ConfigError, match=r"^model: its BatchNorm1d '1' keeps running statistics"):
        fedweave.run(_cfg(), model=model, dataset=digits, run_dir=tmp_path / "r")


def test_constant_buffer_is_accepted_and_resumes_exactly(tmp_path, digits):
    full = fedweave.run(_cfg(rounds=4), model=_Scaled, dataset=digits, run_dir=tmp_path / "full")
    fedweave.run(_cfg(rounds=2), model=_Scaled, dataset=digits, run_dir=tmp_path / "half")
    resumed = fedweave.resume(tmp_path / "half", ["rounds=4"], model=_Scaled, dataset=digits)
    assert _losses(resumed) == _losses(full)


# ---- no trainable parameters (2)


class _NoParameters(nn.Module):
    def forward(self, x):
        return x[:, :10]


@pytest.mark.parametrize(
    ("factory", "why"),
    [(_NoParameters, "it has none"), (lambda: nn.Linear(64, 10).requires_grad_(False), "none of its 2 requires grad")],
)
def test_model_without_trainable_parameters_is_one_line(tmp_path, digits, factory, why):
    # before: torch's "torch.cat(): expected a non-empty list of Tensors"
    with pytest.raises(ConfigError, match=rf"^model: the \w+ has no trainable parameters \({why}\)") as e:
        fedweave.run(_cfg(), model=factory, dataset=digits, run_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


# ---- a loss that breaks the gradient (3)


def _detached(out, y):
    return F.cross_entropy(out.detach(), y, reduction="none")


def _via_numpy(out, y):
    return torch.as_tensor(F.cross_entropy(out, y, reduction="none").detach().numpy())


@pytest.mark.parametrize("loss", [_detached, _via_numpy])
def test_loss_without_gradient_is_refused_when_built(tmp_path, digits, loss):
    # before: round 1 failed with autograd's "element 0 of tensors does not require grad", a failed run left
    with pytest.raises(ConfigError, match=rf"^loss '{loss.__name__}' does not depend on the model's output") as e:
        fedweave.run(_cfg(), model=lambda: nn.Linear(64, 10), dataset=digits, loss=loss, run_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_loss_that_reads_the_output_trains(tmp_path, digits):
    def clamped(out, y):  # in-place work on the output, as in training (where it is no leaf)
        return F.cross_entropy(out.clamp_(-50, 50), y, reduction="none")

    result = fedweave.run(_cfg(), model=lambda: nn.Linear(64, 10), dataset=digits, loss=clamped, run_dir=tmp_path)
    assert result.summary["status"] == "completed"


# ---- a factory that returns the same module each call (4)


def test_factory_returning_one_module_trains_a_copy(tmp_path, digits):
    torch.manual_seed(1)
    module = nn.Linear(64, 10)
    start = copy.deepcopy(module.state_dict())
    first = fedweave.run(_cfg(), model=lambda: module, dataset=digits, run_dir=tmp_path / "a")
    # before: the run trained the caller's module in place, and the second run started from the first's end
    assert all(torch.equal(v, start[k]) for k, v in module.state_dict().items())
    second = fedweave.run(_cfg(), model=lambda: module, dataset=digits, run_dir=tmp_path / "b")
    assert _losses(second) == _losses(first)
    fresh = fedweave.run(_cfg(), model=lambda: copy.deepcopy(module), dataset=digits, run_dir=tmp_path / "c")
    assert _losses(fresh) == _losses(first)


def test_factory_returning_one_module_resumes(tmp_path, digits):
    torch.manual_seed(1)
    module = nn.Linear(64, 10)
    full = fedweave.run(_cfg(rounds=4), model=lambda: module, dataset=digits, run_dir=tmp_path / "full")
    fedweave.run(_cfg(rounds=2), model=lambda: module, dataset=digits, run_dir=tmp_path / "half")
    # before: refused, "the model passed is not the one the run was made with" (its weights were trained)
    resumed = fedweave.resume(tmp_path / "half", ["rounds=4"], model=lambda: module, dataset=digits)
    assert _losses(resumed) == _losses(full)


class _Locked(nn.Module):
    """A module holding what copy.deepcopy cannot copy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.lin(x)


def test_factory_module_that_cannot_be_copied_is_one_line(tmp_path, digits):
    # before: "cannot pickle '_thread.lock' object" from the dropout check's copy, a traceback
    with pytest.raises(ConfigError, match=r"^model: the _Locked the factory returns cannot be copied \(") as e:
        fedweave.run(_cfg(), model=_Locked, dataset=digits, run_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


# ---- complex features (5)


def test_complex_features_are_one_line(tmp_path):
    x = torch.randn(40, 8, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    y = torch.arange(40) % 3
    # before: "min(): does not support complex input" from the model check
    with pytest.raises(ConfigError, match=r"^dataset: train_x holds torch\.complex64 values, complex numbers") as e:
        fedweave.run(_cfg(), model=lambda: nn.Linear(8, 3), dataset=(x, y, x[:9], y[:9]), run_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    # complex labels kept their real part without a word (.long())
    real = x.real.contiguous()
    with pytest.raises(ConfigError, match=r"^dataset: train_y holds torch\.complex64 values, complex numbers"):
        fedweave.run(_cfg(), model=lambda: nn.Linear(8, 3), dataset=(real, y.to(torch.complex64), real, y),
                     run_dir=tmp_path / "y")  # fmt: skip
