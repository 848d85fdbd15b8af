"""The public Python API used as docs/extending.md teaches, and used wrongly as a newcomer would: each mistake
is one clear line naming the thing and what is allowed, nothing runs on silently."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.algorithms.centralized.base import StarAlgorithm, StarHparams, per_job
from fedweave.config import ConfigError, load
from fedweave.data.base import Dataset
from fedweave.execution import LocalRule, StateStore
from fedweave.execution.job import ClientStep
from fedweave.models import HeadedModel
from fedweave.registry import ALGORITHMS, DATASETS, SAMPLERS


def _cfg(**kw) -> dict:
    return {
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "logistic"},
        "algorithm": {"name": "fedavg", "clients_per_round": 3},
        "rounds": 2,
        "threads": 1,
        "output": {"progress": False, "plots": False},
        **kw,
    }


@pytest.fixture
def samplers(monkeypatch):
    """Register a test's samplers in a copy of the registry, forgotten after the test."""
    SAMPLERS.names()  # the built-ins first: they register only once
    monkeypatch.setattr(SAMPLERS, "_items", dict(SAMPLERS._items))

    def register(name, ids=None, fn=None):
        if fn is None:

            def fn(num_clients, per_round, r, rng, *, rounds):
                return ids(r) if callable(ids) else ids

        SAMPLERS.register(name)(fn)
        return {"name": name}

    return register


# what a plug-in sampler may return by mistake; before, the first three ran to the end (client 0 trained twice,
# -1 read as the last client, 0.5 as client 0) and the others failed with an unrelated error
BAD_DRAWS = {
    "repeated": (np.array([0, 0, 1]), "distinct client ids in \\[0, 5\\]"),
    "negative": (np.array([-1, 0, 1]), "distinct client ids in \\[0, 5\\]"),
    "fraction": (np.array([0.5, 1.0, 2.0]), "a 1-D list or array of integer client ids"),
    "whole floats": ([0.0, 1.0, 2.0], "a 1-D list or array of integer client ids"),
    "a mask": (np.array([True, False, True, False, True, False]), "a 1-D list or array of integer client ids"),
    "too large": (np.array([0, 1, 6]), "distinct client ids in \\[0, 5\\]"),
    "nothing returned": (None, "a 1-D list or array of integer client ids"),
    "2-D": (np.array([[0, 1, 2]]), "a 1-D list or array of integer client ids"),
}


@pytest.mark.parametrize("what", list(BAD_DRAWS))
def test_a_sampler_that_returns_bad_ids_is_one_line_naming_it_and_the_round(what, samplers, tmp_path):
    ids, allowed = BAD_DRAWS[what]
    sampler = samplers("_bad", lambda r: np.arange(3) if r == 0 else ids)  # round 1 fine, round 2 bad
    with pytest.raises(ConfigError, match=f"^sampler '_bad' \\(round 2\\) returned .*; a sampler returns {allowed}"):
        fedweave.run(_cfg(sampler=sampler), run_dir=tmp_path / "run")


def test_a_sampler_may_return_its_ids_in_any_order_and_form(samplers, tmp_path):
    plain = fedweave.run(_cfg(sampler=samplers("_sorted", np.array([1, 3, 4]))), run_dir=tmp_path / "sorted")
    for name, ids in [("_unsorted", np.array([4, 1, 3])), ("_list", [3, 4, 1]), ("_tensor", torch.tensor([4, 3, 1]))]:
        other = fedweave.run(_cfg(sampler=samplers(name, ids)), run_dir=tmp_path / name)
        assert other.metrics == [{**r, "wall_seconds": o["wall_seconds"]} for r, o in zip(plain.metrics, other.metrics)]


def test_a_round_the_sampler_leaves_empty_is_said_once(samplers, tmp_path, caplog):
    """Nobody takes part (as in a bernoulli draw without redraw): the model stays as it was. Before, without
    injected faults, nothing said so; the round's row only lacked its train_loss."""
    with caplog.at_level("WARNING", logger="fedweave"):
        empty = fedweave.run(
            _cfg(sampler=samplers("_empty", lambda r: [0, 1, 2] if r == 0 else []), rounds=3), run_dir=tmp_path / "e"
        )
    assert empty.summary["status"] == "completed" and empty.metrics[1]["test_loss"] == empty.metrics[0]["test_loss"]
    said = [m for m in caplog.messages if "chose no client" in m]
    assert said == [f"round {r}: sampler '_empty' chose no client; nobody trains in this round" for r in (2, 3)]


def test_a_sampler_without_the_arguments_every_family_passes_is_refused_when_the_run_is_built(samplers, tmp_path):
    def no_rounds(num_clients, per_round, r, rng):
        return np.arange(per_round)

    sampler = samplers("_no_rounds", fn=no_rounds)
    with pytest.raises(
        ConfigError, match=r"^sampler '_no_rounds' must take \(num_clients, per_round, r, rng, \*, rounds"
    ):
        fedweave.run(_cfg(sampler=sampler), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # before anything is written


def test_the_confederated_edge_servers_check_what_the_sampler_picks(samplers):
    sampler = samplers("_repeats", fn=lambda num_clients, per_round, r, rng, *, rounds: np.zeros(per_round, int))
    cfg = {
        "rounds": 2,
        "dataset": {"name": "cfl_logreg", "num_samples": 300, "dim": 20, "seed": 1},
        "algorithm": {"name": "gt_saga", "num_servers": 6, "users_per_server": 5, "batch_size": 2, "sample_rate": 0.4},
        "sampler": sampler,
    }
    with pytest.raises(ConfigError, match=r"^sampler '_repeats' \(edge server 0, iteration 0\) returned \[0, 0\]"):
        build_algorithm(RunContext(load(cfg)))  # iteration 0 is drawn when the method is built


# fedweave.run called wrongly: before, a raw TypeError or AttributeError from inside the run, or (a string of
# overrides) a complaint about the override 'r', or (a RunConfig) the overrides silently not applied
WRONG_CALLS = {
    "a list as the config": (lambda cfg: fedweave.run([cfg]), r"^config is a YAML file's path, .* got list"),
    "no config": (lambda cfg: fedweave.run(None), r"^config is a YAML file's path, .* got NoneType"),
    "one override as a string": (
        lambda cfg: fedweave.run(cfg, "rounds=3"),
        r"^overrides must be a list of key=value strings, e\.g\. \['local\.lr=0\.1'\]; got 'rounds=3'",
    ),
    "one callback, not a list": (
        lambda cfg: fedweave.run(cfg, callbacks=fedweave.Callback()),
        r"^callbacks must be a list of fedweave\.Callback objects, got Callback",
    ),
    "a callback class": (
        lambda cfg: fedweave.run(cfg, callbacks=[fedweave.Callback]),
        r"^callbacks\[0\] is the class Callback, not an object of it: pass Callback\(\)",
    ),
    "a function as a callback": (
        lambda cfg: fedweave.run(cfg, callbacks=[print]),
        r"^callbacks\[0\] must be a fedweave\.Callback object",
    ),
    "a module, not a factory": (
        lambda cfg: fedweave.run(cfg, model=torch.nn.Linear(64, 10)),
        r"^model must be a function or class returning a fresh nn\.Module .* got a Linear instance",
    ),
    "a loss by name": (
        lambda cfg: fedweave.run(cfg, loss="mse"),
        r"^loss must be a function \(output, target\) -> per-sample losses .* got 'mse'; .* task\.loss",
    ),
    # a string is truthy: progress="no" showed the bar and overwrite="no" removed the old run
    "progress as a string": (
        lambda cfg: fedweave.run(cfg, progress="no"),
        r"^progress must be True, False or None, got 'no'$",
    ),
    "overwrite as a string": (
        lambda cfg: fedweave.run(cfg, overwrite="no"),
        r"^overwrite must be True or False, got 'no'$",
    ),
    # a ValueError before, where every other wrong argument is a ConfigError (one line, the CLI's kind)
    "on_divergence a typo": (
        lambda cfg: fedweave.run(cfg, on_divergence="warn"),
        r"^on_divergence must be 'raise' or 'return', got 'warn'$",
    ),
    "run_dir a number": (
        lambda cfg: fedweave.run(cfg, run_dir=5),
        r"^run_dir must be a directory's path \(str or Path\), got int$",
    ),
    "resume's run_dir a number": (
        lambda cfg: fedweave.resume(5),
        r"^run_dir must be a directory's path \(str or Path\), got int$",
    ),
}


@pytest.mark.parametrize("what", list(WRONG_CALLS))
def test_fedweave_run_called_wrongly_is_one_line_saying_what_to_pass(what, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    call, message = WRONG_CALLS[what]
    with pytest.raises(ConfigError, match=message):
        call(_cfg())
    assert not (tmp_path / "runs").exists()  # refused before anything is written


def test_the_overrides_apply_to_a_runconfig_too(tmp_path):
    result = fedweave.run(load(_cfg()), ["rounds=1"], run_dir=tmp_path / "run")
    assert result.summary["rounds"] == 1


class _Net(HeadedModel):
    """A model of one's own with a representation and a head (MOON reads both)."""

    classifier = ("out",)

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.body, self.out = torch.nn.Linear(64, hidden), torch.nn.Linear(hidden, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x.flatten(1)))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(z)


class _TanhNet(_Net):
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x.flatten(1)))


def _NetWithTanh() -> _Net:  # noqa: N802 - a factory named as the class it builds
    net = _Net()
    net.act = torch.nn.Tanh()  # a layer without parameters: the same weights, printed otherwise
    return net


class _StopAfter(fedweave.Callback):
    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def after_round(self, run, r):
        return f"stopped after round {r + 1}" if r + 1 >= self.rounds else None


def test_a_run_with_python_objects_and_callbacks_resumes_with_them_through_fedweave_resume(tmp_path):
    """docs/tasks.md: a run made with objects passed from Python resumes from Python; before, there was no way
    to pass them (fedweave.runner.resume took none) and the run failed with "unknown model 'python'"."""
    cfg = _cfg(
        algorithm={"name": "moon", "clients_per_round": 3},
        rounds=3,
        output={"progress": False, "plots": False, "checkpoint_every": 1},
    )
    whole = fedweave.run(cfg, model=_Net, run_dir=tmp_path / "whole")
    part = fedweave.run(cfg, model=_Net, run_dir=tmp_path / "part", callbacks=[_StopAfter(1)])
    assert part.summary["rounds"] == 1
    with pytest.raises(ConfigError, match=r"^the run was made with a model passed from Python .* model=\.\.\.\)$"):
        fedweave.resume(tmp_path / "part")
    with pytest.raises(ConfigError, match=r"^the model passed is not the one the run was made with: its initial w"):
        fedweave.resume(tmp_path / "part", model=lambda: _Net(hidden=9))
    # the same weights, another forward (the run went on silently with it): the class tells them apart
    with pytest.raises(ConfigError, match=r"^the model passed is not .*: its class is test_extending_api\._TanhNet, "):
        fedweave.resume(tmp_path / "part", model=_TanhNet)
    # the same class and weights, other layers
    with pytest.raises(ConfigError, match=r"^the model passed is not .*: its layers' SHA-256 \(as torch prints them\)"):
        fedweave.resume(tmp_path / "part", model=_NetWithTanh)
    with pytest.raises(ConfigError, match=r"^loss= was passed, but the run was made with the loss its config names"):
        fedweave.resume(tmp_path / "part", model=_Net, loss=torch.nn.CrossEntropyLoss(reduction="none"))
    again = fedweave.resume(tmp_path / "part", model=_Net, callbacks=[_StopAfter(1)])  # ends where it ended
    assert again.summary["rounds"] == 1 and again.summary["stopped_early"] == "stopped after round 1"
    resumed = fedweave.resume(tmp_path / "part", model=_Net)
    assert [r["test_loss"] for r in resumed.metrics] == [r["test_loss"] for r in whole.metrics]


def test_a_run_with_a_python_loss_resumes_with_it(tmp_path):
    """docs/tasks.md: a run made with ``loss=`` resumes with it passed again; the resume failed with "task.loss:
    unknown loss 'python'" before the loss was read. A config naming ``python`` itself is one line."""
    cfg = _cfg(rounds=3, output={"progress": False, "plots": False, "checkpoint_every": 1})

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="none")

    whole = fedweave.run(cfg, loss=loss, run_dir=tmp_path / "whole")
    fedweave.run({**cfg, "rounds": 2}, loss=loss, run_dir=tmp_path / "part")
    resumed = fedweave.resume(tmp_path / "part", ["rounds=3"], loss=loss)
    assert [r["test_loss"] for r in resumed.metrics] == [r["test_loss"] for r in whole.metrics]

    # another loss passed again was accepted without a word (objects.json held only its name)
    def other(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="none", label_smoothing=0.1)

    with pytest.raises(ConfigError, match=r"^the loss passed is not the one the run was made with: its callable is "):
        fedweave.resume(tmp_path / "part", ["rounds=4"], loss=other)
    # a partial names its function and arguments: two partials of other functions were one record
    smooth = functools.partial(torch.nn.functional.cross_entropy, reduction="none", label_smoothing=0.1)
    fedweave.run({**cfg, "rounds": 1}, loss=smooth, run_dir=tmp_path / "partial")
    plain = functools.partial(torch.nn.functional.cross_entropy, reduction="none")
    with pytest.raises(ConfigError, match=r"^the loss passed is not .*: its callable is functools\.partial\(torch"):
        fedweave.resume(tmp_path / "partial", ["rounds=2"], loss=plain)
    # a lambda written again, on another line, is the same loss
    fedweave.run({**cfg, "rounds": 1}, loss=lambda o, y: loss(o, y), run_dir=tmp_path / "lambda")
    fedweave.resume(tmp_path / "lambda", ["rounds=2"], loss=lambda o, y: loss(o, y))
    with pytest.raises(ConfigError, match=r"^task\.loss: python names a loss passed from Python"):
        fedweave.run({**cfg, "task": {"loss": "python"}}, run_dir=tmp_path / "yaml")


@pytest.fixture
def algorithms(monkeypatch):
    """Register a test's algorithms in a copy of the registry, forgotten after the test."""
    ALGORITHMS.names()
    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))

    def register(name, rule=None, hparams=StarHparams):
        class Method(StarAlgorithm):
            Hparams = hparams

            def client_rule(self, lr):
                return LocalRule() if rule is None else rule

            def server_update(self, mean, got):
                self.x = self.x + mean

        Method.name = name
        ALGORITHMS.register(name)(Method)
        return {"name": name, "clients_per_round": 3}

    return register


class _SummedTerm(LocalRule):
    def extra_loss(self, w, x, y, jobs, model):
        return model.features(w, x).pow(2).sum()  # the batch's sum, not one term per sample


class _FeatureTerm(LocalRule):
    def extra_loss(self, w, x, y, jobs, model):
        return model.features(w, x).pow(2)  # (B, D), not (B,)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize(("rule", "got"), [(_SummedTerm(), r"\(\)"), (_FeatureTerm(), r"\(32, 8\)")])
def test_an_extra_loss_of_another_shape_than_one_term_per_sample_is_one_line_on_every_backend(
    rule, got, backend, algorithms, tmp_path
):
    """Before, the loop backend averaged a scalar or a (B, D) term silently and vmap failed on the (B, D) one
    with a broadcasting error."""
    cfg = _cfg(algorithm=algorithms("_term", rule), model={"name": "mlp", "hidden": [8]}, backend=backend)
    with pytest.raises(ValueError, match=rf"^{type(rule).__name__}\.extra_loss must return one term per sample, "):
        fedweave.run(cfg, run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=rf"shape \(32,\), got shape {got}$"):
        fedweave.run(cfg, run_dir=tmp_path / "again")


def test_an_option_for_an_algorithm_without_options_names_the_algorithm(algorithms, tmp_path):
    from fedweave.algorithms.base import NoHparams

    cfg = _cfg(algorithm={"name": algorithms("_bare", hparams=NoHparams)["name"], "mu": 1})
    with pytest.raises(ConfigError, match=r"^unknown key 'algorithm\.mu': algorithm '_bare' takes no options$"):
        fedweave.run(cfg, run_dir=tmp_path / "run")


def test_a_client_rule_that_is_no_rule_is_one_line(algorithms, tmp_path):
    with pytest.raises(TypeError, match=r"^the local rule must be a LocalRule .* got 'prox'$"):
        fedweave.run(_cfg(algorithm=algorithms("_no_rule", "prox")), run_dir=tmp_path / "run")


def test_hyper_parameters_not_decorated_as_a_dataclass_are_refused_naming_their_fields(algorithms, tmp_path):
    """Before, mu was an unknown key 'algorithm.mu' (allowed: the base's keys), and left out it was the class
    attribute's default, silently."""

    class Undecorated(StarHparams):
        mu: float = 0.1

    section = algorithms("_undecorated", hparams=Undecorated)
    for options in ({}, {"mu": 0.5}):
        cfg = _cfg(algorithm={**section, **options})
        with pytest.raises(TypeError, match=r"^.*Undecorated declares mu but is not a dataclass: decorate it with"):
            fedweave.run(cfg, run_dir=tmp_path / "run")


_X, _Y = torch.randn(40, 3, generator=torch.Generator().manual_seed(0)), torch.arange(40) % 3
BAD_DATASETS = {  # before: an AttributeError far from the loader
    "its tensors, not a Dataset": (
        lambda: (_X, _Y, _X, _Y),
        r"^dataset '_data': a registered dataset returns a fedweave\.data\.base\.Dataset .* got tuple$",
    ),
    "nothing": (lambda: None, r"^dataset '_data': a registered dataset returns .* got NoneType$"),
    "NumPy arrays": (
        lambda: Dataset("d", _X.numpy(), _Y.numpy(), _X.numpy(), _Y.numpy(), 3, (3,)),
        r"^dataset: dataset 'd': train_x must be a torch\.Tensor, got ndarray \(torch\.as_tensor converts an array\)$",
    ),
}


_NAN_X = _X.clone()
_NAN_X[5, 1] = float("nan")
BAD_DATA = {  # before: a NaN ran to round 1's NaN loss, advised as a step-size divergence; no test set scored 0.0
    "a NaN feature": (
        lambda: Dataset("d", _NAN_X, _Y, _X, _Y, 3, (3,)),
        r"^dataset '_data': its training features hold NaN or infinite values \(1\); give finite numbers$",
    ),
    "an empty test split": (
        lambda: Dataset("d", _X, _Y, _X[:0], _Y[:0], 3, (3,)),
        r"^dataset '_data': test_x has no samples; .* give each at least one sample$",
    ),
}


# a registered loader's data are checked as the data passed from Python are (BAD_DATA)
@pytest.mark.parametrize("what", [*BAD_DATASETS, *BAD_DATA])
def test_a_registered_dataset_that_returns_something_else_is_one_line(what, monkeypatch, tmp_path):
    DATASETS.names()
    monkeypatch.setattr(DATASETS, "_items", dict(DATASETS._items))
    loader, message = {**BAD_DATASETS, **BAD_DATA}[what]
    DATASETS.register("_data")(loader)
    cfg = _cfg(dataset={"name": "_data"}, partition={"name": "iid", "num_clients": 4})
    with pytest.raises(ConfigError, match=message):
        fedweave.run(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


class _Triples(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(3), i % 2, i  # (x, y, index)


class _Ragged(_Triples):
    def __getitem__(self, i):
        return torch.zeros(3 + i % 2), i % 2


_PAIR = torch.utils.data.TensorDataset(_X, _Y)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            (_X, np.array(["a"] * len(_Y)), _X, _Y),
            r"^dataset: train_y holds <U1 values, not numbers; ",
        ),
        ((_X, 5, _X, _Y), r"^dataset: train_y must hold one row per sample, got a single value \(5\)$"),
        ((_Triples(), _PAIR), r"^dataset: item 0 of the train torch Dataset is 3 values, not an \(x, y\) pair$"),
        ((_Ragged(), _PAIR), r"^dataset: the train torch Dataset's x items differ in shape \(\[\(3,\), \(4,\)\]\)"),
    ],
)
def test_data_from_python_torch_cannot_hold_is_one_line(data, message, tmp_path):
    """Before: 'train_y must be an array or a tensor, got ndarray' for string labels, 'len() of a 0-d tensor',
    'too many values to unpack' and torch.stack's error."""
    with pytest.raises(ConfigError, match=message):
        fedweave.run(_cfg(), dataset=data, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", [3, "", "  ", None])
def test_a_name_no_config_could_give_is_refused_at_registration(name):
    """Before, SAMPLERS.register(3) registered the function under 3, which no config could ever name."""
    with pytest.raises(ValueError, match=r"^a sampler is registered under a non-empty string, its config name; got "):
        SAMPLERS.register(name)


def test_registering_a_taken_name_never_replaces_the_registered_object():
    want = r"^sampler 'uniform' is registered twice: fedweave.topology.samplers.uniform and test_extending_api\."
    with pytest.raises(ValueError, match=want):
        SAMPLERS.register("uniform")(lambda num_clients, per_round, r, rng, *, rounds: [0])
    from fedweave.topology.samplers import uniform

    assert SAMPLERS.get("uniform") is uniform


@pytest.mark.slow  # fresh interpreters: about 5 s of CPU
def test_a_built_ins_name_taken_before_the_built_ins_load_is_refused_at_registration(tmp_path):
    """A script's first lines registering a sampler 'fixed': the registration went through, and the built-in's own
    registration then failed inside the import of the samplers, on every later run of the process (a run with no
    sampler too, on 'uniform')."""
    script = """
import sys

import fedweave
from fedweave.registry import SAMPLERS
try:
    SAMPLERS.register("fixed")(lambda num_clients, per_round, r, rng, *, rounds: [0])
except ValueError as e:
    print("refused:", e)
cfg = {"rounds": 1, "dataset": {"name": "digits"}, "model": {"name": "logistic"},
       "partition": {"name": "iid", "num_clients": 3}, "algorithm": {"name": "fedavg", "clients_per_round": 2},
       "output": {"progress": False, "plots": False}}
print(fedweave.run(cfg, run_dir=sys.argv[1]).summary["status"])
"""
    run = [sys.executable, "-c", script, str(tmp_path / "run")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: sampler 'fixed' is registered twice: fedweave.topology.samplers.")
    assert lines[-1] == "completed"


class _Corrected(LocalRule):
    def __init__(self, c: torch.Tensor) -> None:
        self.c = c

    def direction(self, w, grad, jobs):
        return grad(w) + per_job(self.c, jobs)


class _Step(ClientStep):
    """A client that keeps a correction of the model's size (SCAFFOLD-like); ``keep`` is its new state."""

    state = ("c",)

    def __init__(self, keep) -> None:
        self.keep = keep

    def rule(self, state):
        return _Corrected(state["c"])

    def finish(self, state, start, result):
        return {}, self.keep(state["c"])


# before: an AssertionError, a KeyError naming no way out, an index assignment's shape error
STEP_MISTAKES = {
    "no state store": (
        None,
        lambda c: {"c": c},
        TypeError,
        r"^_Step keeps client state \['c'\], but the algorithm has no StateStore: make one when it is built",
    ),
    "its row not created": ((), lambda c: {"c": c}, KeyError, r"no client state 'c'; have \[\] \(create it when"),
    "new state of another size": (
        ("c",),
        lambda c: {"c": c[:, :5]},
        ValueError,
        r"^client state 'c': 3 rows of shape \(650,\) expected, got a tensor of shape \(3, 5\)$",
    ),
}


@pytest.mark.parametrize("what", list(STEP_MISTAKES))
def test_a_client_step_without_its_state_store_or_rows_is_one_line(what, monkeypatch, tmp_path):
    rows, keep, error, message = STEP_MISTAKES[what]
    ALGORITHMS.names()
    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))

    class Method(StarAlgorithm):
        name = "_stateful"

        def __init__(self, ctx, hp) -> None:
            super().__init__(ctx, hp)
            if rows is not None:
                self.store = StateStore(ctx.num_clients, dtype=ctx.dtype, placement=ctx.placement)
                for row in rows:
                    self.store.create(row, self.num_params)

        def client_rule(self, lr):
            return _Step(keep)

        def server_update(self, mean, got):
            self.x = self.x + mean

    ALGORITHMS.register("_stateful")(Method)
    with pytest.raises(error, match=message):
        fedweave.run(_cfg(algorithm={"name": "_stateful", "clients_per_round": 3}), run_dir=tmp_path / "run")


def test_a_model_built_for_fewer_classes_than_the_data_is_refused_when_the_run_is_built(tmp_path):
    """Before: 'Target 2 is out of bounds' in round 1 (on a GPU, a device-side assert)."""
    with pytest.raises(ConfigError, match=r"^model 'python' gives 8 logits per sample, but dataset 'digits' has 10"):
        fedweave.run(_cfg(), model=lambda: torch.nn.Linear(64, 8), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()

    def binary(out, y):  # a loss of one's own may read fewer outputs than classes: not refused
        return torch.nn.functional.binary_cross_entropy_with_logits(out[:, 0], (y > 4).float(), reduction="none")

    fedweave.run(_cfg(rounds=1), model=lambda: torch.nn.Linear(64, 1), loss=binary, run_dir=tmp_path / "own-loss")


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_model_with_dropout_is_refused_by_the_families_that_seed_local_training(backend, tmp_path):
    """Before: on loop the same seed gave other numbers (the masks came from torch's global generator), on vmap
    a RuntimeError about vmap's randomness flags."""

    def net():
        return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 10))

    with pytest.raises(ConfigError, match=r"^model: its dropout '1' would draw its masks from torch's global gen"):
        fedweave.run(_cfg(backend=backend), model=net, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()

    def no_dropout():
        return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Dropout(0.0), torch.nn.Linear(16, 10))

    runs = [fedweave.run(_cfg(backend=backend), model=no_dropout, run_dir=tmp_path / f"p0-{i}") for i in range(2)]
    assert runs[0].metrics[-1]["test_loss"] == runs[1].metrics[-1]["test_loss"]


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_forward_that_draws_from_torchs_generator_is_refused(backend, tmp_path):
    """F.dropout in forward (no dropout module to see): on loop the same seed gave other numbers, on vmap torch's
    randomness error in round 1, a failed run directory left."""

    class Drops(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 16), torch.nn.Linear(16, 10)

        def forward(self, x):
            return self.b(torch.nn.functional.dropout(self.a(x), 0.5, self.training))

    state = torch.random.get_rng_state()
    with pytest.raises(ConfigError, match=r"^model: its forward pass in training mode draws random numbers from torc"):
        fedweave.run(_cfg(backend=backend), model=Drops, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and torch.equal(torch.random.get_rng_state(), state)


class _Branches(torch.nn.Module):
    """A Python branch on a tensor's value in forward: the loop runs it, vmap cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        out = self.fc(x)
        return out.clamp(-1e6, 1e6) if out.abs().max() > 1e6 else out


def test_what_vmap_cannot_batch_names_the_backend_and_what_runs_it(tmp_path):
    """Before: torch's own 'vmap: It looks like you're either (1) calling .item() ...' from round 1."""
    want = r"^backend vmap cannot train this model or loss \(vmap: .*\): .*; choose backend: loop or pool$"
    with pytest.raises(RuntimeError, match=want):
        fedweave.run(_cfg(backend="vmap"), model=_Branches, run_dir=tmp_path / "vmap")
    assert json.loads((tmp_path / "vmap" / "summary.json").read_text())["status"] == "failed"
    assert (
        fedweave.run(_cfg(backend="loop"), model=_Branches, run_dir=tmp_path / "loop").summary["status"] == "completed"
    )


def test_class_labels_beyond_the_declared_classes_are_one_line(tmp_path):
    """Before: an IndexError from inside round 1's fused kernel, a failed run directory left."""
    from fedweave.data.datasets.bundled import load_digits

    ds = load_digits()
    fewer = Dataset("fewer", ds.train_x, ds.train_y, ds.test_x, ds.test_y, 8, ds.input_shape)
    with pytest.raises(ConfigError, match=r"^dataset 'fewer': train_y holds labels 0\.\.9, but the Dataset declares "):
        fedweave.run(_cfg(), dataset=fewer, run_dir=tmp_path / "run")
    x, y = ds.train_x, ds.train_y.clone()
    y[0] = -1
    with pytest.raises(ConfigError, match=r"^dataset 'python': train_y holds labels -1\.\.9"):
        fedweave.run(_cfg(), dataset=(x, y, ds.test_x, ds.test_y), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_taken_run_directory_of_a_python_run_offers_pythons_resume(tmp_path):
    """The refusal offered 'fedweave run --resume', which refuses a run of objects passed from Python."""
    cfg = _cfg(output={"progress": False, "plots": False, "checkpoint_every": 1}, rounds=1)
    fedweave.run(cfg, model=_Net, run_dir=tmp_path / "r")
    with pytest.raises(fedweave.results.RunDirError, match=r"resume it from Python with fedweave\.resume\(") as e:
        fedweave.run(cfg, model=_Net, run_dir=tmp_path / "r")
    assert "--resume" not in str(e.value) and "overwrite=True" in str(e.value) and "run_dir=" in str(e.value)


def test_a_callback_that_changes_its_row_changes_nothing_recorded(tmp_path):
    """Before, the row a callback got was the recorded one: Result.metrics and summary.json took the change, and
    metrics.jsonl took it for every row but the last (rewritten before the hook)."""

    class Overwrites(fedweave.Callback):
        def on_row(self, run, row):
            row["test_accuracy"] = -1.0

    seen = []

    class Reads(fedweave.Callback):
        def on_row(self, run, row):
            seen.append(row["test_accuracy"])

    result = fedweave.run(_cfg(), run_dir=tmp_path / "run", callbacks=[Overwrites(), Reads()])
    written = [json.loads(line)["test_accuracy"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert -1.0 not in written and [r["test_accuracy"] for r in result.metrics] == written == seen
    assert result.summary["final_test_accuracy"] == written[-1]


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("size", [15, 30])
def test_user_ids_of_another_length_than_their_split_are_one_line(split, size, tmp_path):
    # before, test_users of another length than test_x ran on: a natural partition's per-client test sets
    # were read from ids that belong to no test sample
    g = np.random.default_rng(0)
    data = [g.normal(size=(80, 5)), g.integers(0, 3, 80), g.normal(size=(20, 5)), g.integers(0, 3, 20)]
    users = {"train": np.arange(10).repeat(8), "test": np.arange(10).repeat(2)}
    users[split] = np.arange(size) % 10
    rows = 80 if split == "train" else 20
    with pytest.raises(ValueError, match=f"{split}_users has {size} ids but {split}_x has {rows} rows"):
        fedweave.run(
            _cfg(partition={"name": "natural", "num_clients": 0}, eval={"per_client": True}),
            model=lambda: torch.nn.Linear(5, 3),
            dataset=(*data, users["train"], users["test"]),
            run_dir=tmp_path / "run",
        )
    assert not (tmp_path / "run").exists()


def test_bfloat16_data_are_described_in_objects_json(tmp_path):
    # before, objects.json's SHA-256 read the data with .numpy(), which has no bfloat16: a bare TypeError
    g = torch.Generator().manual_seed(0)
    tx, vx = torch.randn(40, 5, generator=g), torch.randn(10, 5, generator=g)
    ty, vy = torch.randint(0, 3, (40,), generator=g), torch.randint(0, 3, (10,), generator=g)
    runs = {}
    for name, (a, b) in {
        "bf16": (tx.bfloat16(), vx.bfloat16()),
        "f32": (tx.bfloat16().float(), vx.bfloat16().float()),
    }.items():
        fedweave.run(_cfg(), model=lambda: torch.nn.Linear(5, 3), dataset=(a, ty, b, vy), run_dir=tmp_path / name)
        runs[name] = json.loads((tmp_path / name / "objects.json").read_text())["dataset"]
    assert runs["bf16"]["train_x"] == [[40, 5], "torch.bfloat16"]
    assert runs["bf16"]["sha256"] != runs["f32"]["sha256"]  # the same values, another dtype: told apart


@pytest.mark.parametrize("split", ["train", "test"])
def test_an_empty_split_passed_from_python_is_one_line(split, tmp_path):
    # before, an empty test set ran to the end and reported test_accuracy 0.0 and test_loss 0.0 every round
    g = np.random.default_rng(0)
    data = {
        "train": [g.normal(size=(40, 5)), g.integers(0, 3, 40)],
        "test": [g.normal(size=(10, 5)), g.integers(0, 3, 10)],
    }
    data[split] = [a[:0] for a in data[split]]
    with pytest.raises(ConfigError, match=f"dataset 'python': {split}_x has no samples"):
        fedweave.run(
            _cfg(), model=lambda: torch.nn.Linear(5, 3), dataset=(*data["train"], *data["test"]), run_dir=tmp_path / "r"
        )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        # a NaN feature made round 1's loss NaN, reported as a divergence to be cured by a smaller step size
        ("train_x", np.nan, r"dataset 'python': its training features hold NaN or infinite values \(1\)"),
        ("test_x", np.inf, r"dataset 'python': its test features hold NaN or infinite values \(1\)"),
        # integer train labels and a float test split: 1.5 was cast to class 1 and scored as such
        (
            "test_y",
            1.5,
            r"dataset 'python': train_y holds integer class labels but test_y holds 1\.5, which is no class",
        ),
    ],
)
def test_data_from_python_with_a_value_that_is_no_number_or_class_is_one_line(key, value, message, tmp_path):
    g = np.random.default_rng(0)
    data = {"train_x": g.normal(size=(40, 5)), "train_y": g.integers(0, 3, 40)}
    data.update(test_x=g.normal(size=(10, 5)), test_y=g.integers(0, 3, 10).astype(np.float64))
    data[key] = data[key].astype(np.float64)
    data[key].flat[3] = value
    with pytest.raises(ConfigError, match=message):
        fedweave.run(_cfg(), model=lambda: torch.nn.Linear(5, 3), dataset=tuple(data.values()), run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    data[key].flat[3] = 1.0  # whole float test labels are the classes they name
    fedweave.run(_cfg(), model=lambda: torch.nn.Linear(5, 3), dataset=tuple(data.values()), run_dir=tmp_path / "s")


def test_float_training_targets_with_integer_test_labels_are_one_line_naming_both_kinds(tmp_path):
    """Float train_y make a task of one output per column: integer test labels were then refused as "labels 0..2,
    but the Dataset declares num_classes 1", which named neither split's kind."""
    g = np.random.default_rng(0)
    data = (g.normal(size=(40, 5)), g.normal(size=40), g.normal(size=(10, 5)), g.integers(0, 3, 10))
    want = (
        r"^dataset 'python': train_y holds float targets \(a regression or multi-label task\) but test_y holds integers"
    )
    with pytest.raises(ConfigError, match=want):
        fedweave.run(_cfg(), model=lambda: torch.nn.Linear(5, 1), dataset=data, run_dir=tmp_path / "r")


def test_a_fedweave_dataset_passed_from_python_is_checked_as_tuples_are(tmp_path):
    # a Dataset object skipped the checks: its empty test split was scored test_accuracy 0.0, test_loss 0.0
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    with pytest.raises(ConfigError, match="dataset 'mine': test_x has no samples"):
        fedweave.run(_cfg(), dataset=Dataset("mine", x, y, x[:0], y[:0], 3, (5,)), run_dir=tmp_path / "a")
    x[3, 1] = float("nan")
    with pytest.raises(ConfigError, match=r"dataset 'mine': its training features hold NaN or infinite values \(1\)"):
        fedweave.run(_cfg(), dataset=Dataset("mine", x, y, x[:10], y[:10], 3, (5,)), run_dir=tmp_path / "b")


def test_plot_runs_given_one_path_not_a_list_says_so(tmp_path):
    from fedweave.plots import plot_runs

    # before: the path was iterated character by character ("/metrics.jsonl not found")
    for one in (str(tmp_path), tmp_path):
        with pytest.raises(
            TypeError, match=r"^run_dirs must be a list of run directories, e\.g\. \[.*\]; got one path"
        ):
            plot_runs(one, tmp_path / "plots")
    # an empty list (before: ": no metrics row yet (metrics.jsonl): no run has evaluated a round to plot")
    with pytest.raises(ValueError, match=r"^run_dirs is empty: give at least one run directory to plot$"):
        plot_runs([], tmp_path / "plots")


def test_plot_runs_of_a_confederated_run_defaults_to_the_column_its_own_plots_show(tmp_path):
    from fedweave.plots import plot_runs

    # its synthetic problem has no test set: summary.json's main_metric is null. Before, plot_runs fell back to
    # test_accuracy and refused the run ("--metric 'test_accuracy' is not a metric of ..."), where `fedweave
    # plot`, the run's own plots, the sweep and the report all use opt_gap
    cfg = {
        "dataset": {"name": "cfl_logreg"},
        "rounds": 2,
        "threads": 1,
        "algorithm": {"name": "cfl_saga", "iterations_per_round": 2},
        "output": {"progress": False, "plots": False},
    }
    res = fedweave.run(cfg, run_dir=tmp_path / "r")
    assert res.summary["main_metric"] is None
    written = plot_runs([tmp_path / "r"], tmp_path / "plots")
    assert [p.name for p in written] == ["opt_gap_vs_rounds.png", "opt_gap_vs_bytes.png"]


def test_a_method_without_the_step_its_family_calls_is_one_line_when_it_is_built(monkeypatch):
    """A star method without ``server_update`` ended in Python's ``TypeError: Can't instantiate abstract class``
    traceback; a hierarchical one without it failed at round 1 in a bare ``NotImplementedError``, its run directory
    written. Both are one line now, when the algorithm is built."""
    from fedweave.algorithms.hierarchical.base import AveragingAlgorithm

    ALGORITHMS.names()
    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))

    @ALGORITHMS.register("_no_server_step")
    class NoServer(StarAlgorithm):
        name = "_no_server_step"

    @ALGORITHMS.register("_no_hier_step")
    class NoHier(AveragingAlgorithm):
        name = "_no_hier_step"

    with pytest.raises(ConfigError, match=r"^algorithm '_no_server_step' \(.*NoServer\) does not define server_update"):
        build_algorithm(RunContext(load(_cfg(algorithm={"name": "_no_server_step", "clients_per_round": 3}))))
    hier = {"name": "_no_hier_step", "tau": 2, "participation": 0.5}
    with pytest.raises(ConfigError, match=r"^algorithm '_no_hier_step' \(.*NoHier\) does not define server_update"):
        build_algorithm(RunContext(load(_cfg(algorithm=hier))))
