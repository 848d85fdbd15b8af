"""Bring your own objects: a model factory, data and a loss passed from Python, no registry involved.

``fedweave.run(config, model=..., dataset=..., loss=...)`` hands them to the run through :class:`RunObjects`.
The data may be a fedweave :class:`~fedweave.data.base.Dataset`, a tuple ``(train_x, train_y, test_x,
test_y)`` of arrays or tensors (optionally with ``train_users, test_users`` for a ``natural`` partition), or
a pair of in-memory ``torch.utils.data.Dataset`` objects ``(train, test)`` whose items are ``(x, y)``. The
run directory records what was passed in ``objects.json`` (class names, shapes, dtypes, a hash of the data
and of the model's initial weights), so a run can be told apart from another made with other objects.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedweave.config import ConfigError
from fedweave.data.base import Dataset
from fedweave.results import OBJECTS_FILE  # what was passed, in the run directory (re-exported)

PYTHON = "python"  # the name a config records for an object passed from Python


class FreshModels:
    """A model factory whose every call gives a module of the run's own: a deep copy of what ``factory`` returns.

    The run trains the module it is given in place. A factory that returns the same object each call (``lambda:
    m``), or a module holding one it keeps (a shared pretrained part), would have its first run train the caller's
    weights, and the next run from the same seed start from where that one ended; a resumed run's model would no
    longer match the initial weights its ``objects.json`` recorded. The copy holds the values the factory gave (no
    random number is drawn), so a factory that builds a fresh module each call gives the same numbers as before."""

    def __init__(self, factory: Callable[[], nn.Module]) -> None:
        self.factory = factory

    def __call__(self) -> Any:
        made = self.factory()
        if not isinstance(made, nn.Module):  # the run names what it got in its own words
            return made
        try:
            return copy.deepcopy(made)
        except Exception as e:  # whatever an attribute of the module raises when copied
            why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"model: the {type(made).__name__} the factory returns cannot be copied ({why}); the run trains a "
                "copy, so that the module the factory returns is never changed: keep what copy.deepcopy cannot copy "
                "out of the module"
            ) from e


@dataclass
class RunObjects:
    """Objects that replace what the config's ``model``, ``dataset`` and ``task.loss`` would name. The model
    factory is kept as :class:`FreshModels` of it: the run trains a copy of each module it returns."""

    model: Callable[[], nn.Module] | None = None
    dataset: Dataset | None = None
    loss: Callable | None = None
    built_model: dict[str, Any] | None = None  # what the factory returned (set when the run builds it)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, FreshModels):
            self.model = FreshModels(self.model)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.model is not None:
            factory = self.model.factory if isinstance(self.model, FreshModels) else self.model
            out["model"] = {"factory": _qualname(factory), **(self.built_model or {})}
        if self.dataset is not None:
            out["dataset"] = describe_dataset(self.dataset)
        if self.loss is not None:
            out["loss"] = {"callable": _loss_name(self.loss)}
        return out


def _loss_name(fn: Any) -> str:
    """What a resumed run's loss is compared by: its function's or class's name, a partial's function with its
    arguments (as repr prints them). Its code is not compared (a lambda's source is the line it sits on, its
    bytecode another on each Python): another function of the same name passes, as a model's same-named class
    with another forward does."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_loss_name(fn.func)}, *{fn.args!r}, **{fn.keywords!r})"
    return _qualname(fn)


def _qualname(obj: Any) -> str:
    """module.name of a class or function; of an instance (a callable object), its class's."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{target.__module__}.{target.__qualname__}"


def _tensor(a: Any, what: str, rows: bool = True) -> torch.Tensor:
    """``a`` as a CPU tensor of numbers; ``rows``: one row per sample (a split, not one sample's item)."""
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu()
        if t.is_complex():  # as numpy's complex arrays below: labels kept their real part without a word
            raise ConfigError(f"dataset: {what} holds {t.dtype} values, complex numbers; give real numbers")
    else:
        try:
            values = np.asarray(a)
        except Exception as e:
            raise ConfigError(f"dataset: {what} must be an array or a tensor, got {type(a).__name__}") from e
        if values.dtype.kind not in "biuf":  # strings, objects: torch holds no tensor of them
            raise ConfigError(
                f"dataset: {what} holds {values.dtype} values, not numbers; give numbers (class labels 0..K-1, or "
                "float features and targets)"
            )
        t = torch.as_tensor(values)
    if rows and t.dim() == 0:
        raise ConfigError(f"dataset: {what} must hold one row per sample, got a single value ({t.item()!r})")
    return t


def _stack(ds: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``(x, y)`` items of an in-memory torch Dataset, stacked."""
    try:
        n = len(ds)
    except TypeError as e:
        raise ConfigError(f"dataset: the {what} torch Dataset must have a length (an in-memory Dataset)") from e
    items = [ds[i] for i in range(n)]
    pairs = [isinstance(item, tuple | list) and len(item) == 2 for item in items]
    if not all(pairs):
        odd = items[pairs.index(False)]
        got = f"{len(odd)} values" if isinstance(odd, tuple | list) else f"a {type(odd).__name__}"
        raise ConfigError(
            f"dataset: item {pairs.index(False)} of the {what} torch Dataset is {got}, not an (x, y) pair"
        )
    stacked = []
    for k, part in enumerate(("x", "y")):
        values = [_tensor(item[k], f"{what} {part}", False) for item in items]
        try:
            stacked.append(torch.stack(values) if values else torch.empty(0))
        except RuntimeError as e:
            shapes = sorted({tuple(v.shape) for v in values})[:3]
            raise ConfigError(
                f"dataset: the {what} torch Dataset's {part} items differ in shape ({shapes}); give one shape"
            ) from e
    return stacked[0], stacked[1]


def _check_splits(name: str, tx: torch.Tensor, ty: torch.Tensor, vx: torch.Tensor, vy: torch.Tensor) -> None:
    """Data a run can train and evaluate on: samples in each split, finite numbers, test labels that are classes."""
    for split, x in (("train", tx), ("test", vx)):
        if len(x) == 0:  # an empty test set would be reported as test_accuracy 0.0 and test_loss 0.0 each round
            raise ConfigError(
                f"dataset {name!r}: {split}_x has no samples; the run trains on the train split and evaluates every "
                "model on the test split: give each at least one sample"
            )
    for split, what, t in (("training", "features", tx), ("training", "targets", ty), ("test", "features", vx),
                           ("test", "targets", vy)):  # fmt: skip
        # a NaN or Inf in the data made the first round's loss NaN, reported as a divergence to be cured by a
        # smaller step size
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(
                f"dataset {name!r}: its {split} {what} hold NaN or infinite values ({bad}); give finite numbers"
            )
    if ty.is_floating_point() and not vy.is_floating_point() and len(vy):
        # float training targets make a regression (or multi-label) task of one output per column: integer test
        # labels were then checked against "num_classes 1", which named neither split's kind
        raise ConfigError(
            f"dataset {name!r}: train_y holds float targets (a regression or multi-label task) but test_y holds "
            f"integers ({vy.dtype}); give both splits the same kind: float test targets, or integer class labels "
            "in train_y"
        )
    if not ty.is_floating_point() and vy.is_floating_point():
        # class labels in train_y: a float test_y is cast to them, and a 1.5 would silently become class 1
        frac = vy[vy != vy.round()]
        if len(frac):
            raise ConfigError(
                f"dataset {name!r}: train_y holds integer class labels but test_y holds {float(frac[0])!r}, which is "
                "no class; give whole-number test labels (or float targets in both splits)"
            )


def check_loaded(name: str, ds: Dataset) -> None:
    """A registered loader's data, checked as the data passed from Python are (one line naming ``name``)."""
    _check_splits(name, ds.train_x, ds.train_y, ds.test_x, ds.test_y)
    _check_classes(name, ds)


def _check_classes(name: str, ds: Dataset) -> None:
    """Class labels within the ``num_classes`` the Dataset declares, the outputs the models are built with: a
    label beyond them failed in round 1, inside the loss (an index error, on a GPU a device-side assert)."""
    for split, y in (("train_y", ds.train_y), ("test_y", ds.test_y)):
        if len(y) and not y.is_floating_point() and not (int(y.min()) >= 0 and int(y.max()) < ds.num_classes):
            raise ConfigError(
                f"dataset {name!r}: {split} holds labels {int(y.min())}..{int(y.max())}, but the Dataset declares "
                f"num_classes {ds.num_classes} (labels 0..{ds.num_classes - 1}); give labels in that range or the "
                "number of classes they need"
            )


def as_dataset(data: Any, name: str = "python") -> Dataset:
    """A fedweave Dataset from what ``fedweave.run(dataset=...)`` accepts (see the module docstring)."""
    if isinstance(data, Dataset):  # checked as the tuples are: an empty test split scored 0.0 here too
        _check_splits(data.name, data.train_x, data.train_y, data.test_x, data.test_y)
        _check_classes(data.name, data)
        return data
    users = (None, None)
    if isinstance(data, tuple | list) and len(data) == 2 and isinstance(data[0], torch.utils.data.Dataset):
        (tx, ty), (vx, vy) = _stack(data[0], "train"), _stack(data[1], "test")
    elif isinstance(data, tuple | list) and len(data) in (4, 6):
        tx, ty, vx, vy = (_tensor(a, w) for a, w in zip(data[:4], ("train_x", "train_y", "test_x", "test_y")))
        if len(data) == 6:
            users = (np.asarray(data[4]), np.asarray(data[5]))
    else:
        raise ConfigError(
            "dataset must be a fedweave Dataset, (train_x, train_y, test_x, test_y[, train_users, test_users]) "
            f"arrays or tensors, or (train, test) torch Datasets; got {type(data).__name__}"
        )
    _check_splits(name, tx, ty, vx, vy)
    # floating data keep their dtype here; the run casts them to its precision
    if ty.is_floating_point():  # regression or multi-label targets: float, one column per output
        num_outputs = 1 if ty.dim() == 1 else int(np.prod(ty.shape[1:]))
    else:
        ty, vy = ty.long(), vy.long()
        num_outputs = int(max(int(ty.max()), int(vy.max()) if len(vy) else 0)) + 1 if len(ty) else 0
    ds = Dataset(name, tx, ty, vx, vy, num_outputs, tuple(tx.shape[1:]), *users)
    _check_classes(name, ds)  # a negative label
    return ds


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The values of ``t`` as a NumPy array to hash; bfloat16, which NumPy has no type for, widened to float32
    (exact: every bfloat16 is a float32), where ``.numpy()`` would raise a TypeError."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def describe_model(model: nn.Module) -> dict[str, Any]:
    """The module a factory returned: its class, its number of parameters, a SHA-256 of its initial state (names,
    shapes, dtypes and values) and one of its layers as torch prints them, so two runs started from other weights
    or other layers can be told apart."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(str((name, tuple(t.shape), str(t.dtype))).encode())
        h.update(np.ascontiguousarray(_numpy(t)).tobytes())
    return {
        "class": _qualname(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sha256": h.hexdigest(),
        # its layers as torch prints them: a ReLU and a Tanh network of one shape start from the same weights
        "structure": hashlib.sha256(repr(model).encode()).hexdigest(),
    }


def describe_dataset(ds: Dataset) -> dict[str, Any]:
    arrays = {"train_x": ds.train_x, "train_y": ds.train_y, "test_x": ds.test_x, "test_y": ds.test_y}
    if ds.train_users is not None:  # per-sample user ids: they decide a natural partition
        arrays.update(train_users=np.asarray(ds.train_users), test_users=np.asarray(ds.test_users))
    h = hashlib.sha256()
    out: dict[str, Any] = {"class": type(ds).__name__}
    for key, t in arrays.items():
        a = _numpy(t) if isinstance(t, torch.Tensor) else t
        h.update(str((key, tuple(a.shape), str(t.dtype))).encode())
        h.update(np.ascontiguousarray(a).tobytes())
        out[key] = [list(a.shape), str(t.dtype)]
    return {**out, "outputs": ds.num_classes, "sha256": h.hexdigest()}


def named_python(config: Any) -> dict[str, bool]:
    """Which objects the run's ``config`` records as passed from Python (``python`` in place of a name)."""
    return {
        "model": config.model.name == PYTHON,
        "dataset": config.dataset.name == PYTHON,
        "loss": config.task.loss == PYTHON,
    }


def check_resumed_objects(config: Any, objects: RunObjects | None) -> None:
    """A resumed run continues with the objects it was made with: each one its config records as passed from
    Python must be passed again, and none that it does not (that would replace the model, data or loss it
    named). One :class:`ConfigError` line each, before anything is built."""
    for key, named in named_python(config).items():
        given = objects is not None and getattr(objects, key) is not None
        if named and not given:
            raise ConfigError(
                f"the run was made with a {key} passed from Python (its config.yaml records {key}: python, its "
                f"{OBJECTS_FILE} what it was): resume it from Python with the same one, "
                f"fedweave.resume(RUN_DIR, {key}=...)"
            )
        if given and not named:
            raise ConfigError(
                f"{key}= was passed, but the run was made with the {key} its config names; a resumed run continues "
                f"with that one: leave {key}= out"
            )


def check_same_objects(saved: dict[str, Any], objects: RunObjects) -> None:
    """The model and data passed to a resumed run are those it was made with: the model's class and the SHA-256
    digests of its initial weights, of its layers as torch prints them, and of the data equal those
    ``objects.json`` recorded (``saved``; a record without the layers' digest is not checked on them); else one
    line."""
    now = objects.describe()
    for key, field, what in (
        ("model", "class", "class"),
        ("model", "sha256", "initial weights' SHA-256"),
        ("model", "structure", "layers' SHA-256 (as torch prints them)"),
        ("dataset", "sha256", "data's SHA-256"),
        ("loss", "callable", "callable"),
    ):
        was, got = saved.get(key, {}).get(field), now.get(key, {}).get(field)
        if was and got and was != got:
            named = field in ("class", "callable")  # a name, shown whole; a digest, its start
            shown = (got, was) if named else (f"{got[:12]}...", f"{was[:12]}... ({saved[key].get('class')})")
            raise ConfigError(
                f"the {key} passed is not the one the run was made with: its {what} is {shown[0]}, {OBJECTS_FILE} "
                f"recorded {shown[1]}; a resumed run continues with the same {key}"
            )
