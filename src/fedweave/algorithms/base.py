"""What every algorithm is to the runner, and the context it is built from.

An algorithm is constructed from a :class:`RunContext` and its typed hyper-parameters, then the runner
calls ``run_round(r)`` for r = 0, 1, ... and ``evaluate(r)`` every ``eval.every`` rounds. Both return flat
``{metric: float}`` dicts that become columns of ``metrics.csv``. ``state_dict``/``load_state_dict`` carry
everything a resumed run needs beyond the context (the context's ledger is saved by the runner).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from fedweave.byo import RunObjects, check_loaded, describe_dataset, describe_model
from fedweave.config import (
    MAX_LOCAL_EPOCHS,
    MAX_LR,
    ConfigError,
    RunConfig,
    Section,
    build_dataclass,
    check_options,
    load,
)
from fedweave.data.augment import augment_for
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import loads_user_files
from fedweave.data.partition import Partition, check_parts, integral, is_label_free
from fedweave.execution import LocalTrainer, batch_statistics, check_running_stats, check_seeded, choose_backend
from fedweave.execution.evaluate import share_with_workers
from fedweave.execution.local import LocalRule
from fedweave.execution.placement import Placement, resolve_placement
from fedweave.faults import Faults
from fedweave.ledger import Ledger
from fedweave.registry import ALGORITHMS, DATASETS, METRICS, MODELS, PARTITIONERS
from fedweave.robust import poisoned_data
from fedweave.seeding import Seeds
from fedweave.tasks import NLL, CallableLoss, Loss, Task, build_task
from fedweave.topology.samplers import sampler_options


@dataclasses.dataclass
class NoHparams:
    """For algorithms without hyper-parameters of their own."""


@contextmanager
def _as_config_error(section: str) -> Iterator[None]:
    """Option errors raised by a loader, partitioner or model builder are configuration errors."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise ConfigError(msg if f"{section}." in msg else f"{section}: {msg}") from e


@contextmanager
def model_memory(name: str, options: dict) -> Iterator[None]:
    """A model too large to allocate (``model.hidden: [1000000000]``) is a configuration error naming its
    options, not an allocator traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in str(e):
            raise
        shown = ", ".join(f"model.{k}={v!r}" for k, v in options.items()) or "its default options"
        wanted = re.search(r"allocate (\d+) bytes", str(e))  # the CPU allocator says how much it was asked for
        what = f"{int(wanted[1]):,} bytes for one tensor" if wanted else type(e).__name__
        raise ConfigError(f"model {name!r} with {shown} does not fit in memory ({what}); choose smaller sizes") from e


def load_initial_weights(model: nn.Module, path: str) -> None:
    """``model.init_from``: initial weights from a ``state_dict`` saved by ``torch.save`` (read with
    ``weights_only=True``: no code runs) or an ``.npz`` of arrays named as the model's state_dict keys."""
    from pathlib import Path, PurePath

    if isinstance(path, PurePath):
        path = str(path)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"model.init_from must be the path of a state_dict (.pt) or .npz file, got {path!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"model.init_from: {path!r} is not a file")
    try:
        if file.suffix == ".npz":
            with np.load(file, allow_pickle=False) as z:
                state = {k: torch.from_numpy(z[k]) for k in z.files}
        else:
            state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:
        raise ConfigError(f"model.init_from: {path!r} is not a readable state_dict or .npz ({type(e).__name__})") from e
    if not isinstance(state, dict):
        raise ConfigError(f"model.init_from: {path!r} must hold a mapping of parameter names to tensors")
    not_tensors = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ConfigError(f"model.init_from: {path!r} holds entries that are not tensors: {not_tensors[:5]}")
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ConfigError(f"model.init_from: {path!r} does not match the model (missing {missing}, unexpected {extra})")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ConfigError(
                f"model.init_from: {k!r} has shape {list(v.shape)} in {path!r}, the model's is {list(own[k].shape)}"
            )
    for k, v in state.items():  # NaN weights would surface rounds later as a "diverged, lower the lr" run
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ConfigError(f"model.init_from: {path!r} holds NaN or infinite values in {k!r}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


# the registered losses whose targets index the model's logits (cross_entropy, nll)
CLASS_LOSSES = ("cross_entropy", "nll")


def check_model_fits(
    model: nn.Module,
    ds: Dataset,
    model_name: str,
    dataset_name: str,
    device: torch.device | None = None,
    classes: int | None = None,
    log_probs: bool = False,
    loss: Loss | None = None,
    one_output_for: Sequence[str] = (),
) -> None:
    """One forward pass on two training samples (on ``device``), so that a model that cannot read the
    dataset's input (a character LSTM on images, say) is a configuration error now rather than a traceback
    in round 1. For integer inputs (token ids) the samples holding the smallest and largest id are passed too:
    an id beyond an embedding's vocabulary failed only when a batch first held it. ``classes``: the logits a
    cross-entropy task needs per sample, checked against a ``(B, K)`` output (a model built for fewer classes
    fails in round 1, on a GPU with a device-side assert). ``log_probs`` (``task.loss: nll``): each sample's
    outputs must be log-probabilities, ``logsumexp`` over the classes 0; on logits ``nll_loss`` is ``-z_y``,
    unbounded below, and a run trained to a negative, meaningless loss without a word. ``loss``: the task's loss
    must read the output against the targets (an output of the wrong shape or kind failed in round 1 with torch's
    error) and give one loss per sample, ``(B,)``; a ``(B, 1)`` was broadcast against the ``(B,)`` mask of a
    padded batch into ``(B, B)``, and ``vmap`` trained on a sum of B losses. ``one_output_for``: the task's value
    metrics on class labels (``auc``, ``f1``, ``mse``, ...), which read one output per sample: a model passed
    from Python with more failed at the first evaluation, after round 1 had trained. The loss is called with
    gradients on, as training calls it, and must carry a gradient back to the output: a loss that detaches it
    failed in round 1 with autograd's ``element 0 of tensors does not require grad``, a failed run left behind.
    Complex features are refused (a model check's ``min`` failed on them; NumPy data of complex numbers already
    were, as not real numbers)."""
    for split, t in (("train_x", ds.train_x), ("test_x", ds.test_x)):
        if t.is_complex():
            raise ConfigError(
                f"dataset {dataset_name!r}: its {split} holds {str(t.dtype).removeprefix('torch.')} values, complex "
                "numbers, which the models, losses and metrics do not compute with; give real numbers (the real and "
                "imaginary parts as two features: torch.view_as_real)"
            )
    x, kind = ds.train_x[:2], str(ds.train_x.dtype)
    if len(ds.train_x) and not ds.train_x.is_floating_point():
        flat = ds.train_x.reshape(len(ds.train_x), -1)
        lo, hi = flat.min(1).values, flat.max(1).values
        x = torch.cat([x, ds.train_x[torch.stack([lo.argmin(), hi.argmax()])]])
        kind += f", ids {int(lo.min())}..{int(hi.max())}"
    out, e = trial_forward(model, x.to(device) if device is not None else x)
    fewer = isinstance(out, torch.Tensor) and out.dim() == 2 and classes is not None and out.shape[1] < classes
    if e is None and fewer:
        raise ConfigError(
            f"model {model_name!r} gives {out.shape[1]} logits per sample, but dataset {dataset_name!r} has "
            f"{classes} classes; build the model for {classes} outputs"
        )
    width = out.reshape(len(out), -1).shape[1] if e is None and isinstance(out, torch.Tensor) and len(out) else 1
    if one_output_for and width != 1:
        raise ConfigError(
            f"task.metrics: {one_output_for[0]!r} on class labels needs a model with one output, but model "
            f"{model_name!r} gives {width} outputs per sample; leave it out (accuracy and top-k read the logits), or "
            "give the model one output (binary labels)"
        )
    if e is None and log_probs and isinstance(out, torch.Tensor) and out.dim() >= 2 and out.is_floating_point():
        # 1e-3: far above the rounding of a float32 log_softmax (~1e-6), far below what logits give by chance
        mass = torch.logsumexp(out.double(), 1)
        if not bool((mass.abs() <= 1e-3).all()):
            worst = float(mass.abs().max())
            raise ConfigError(
                f"task.loss: nll needs a model that outputs log-probabilities (ending in log_softmax), but the outputs "
                f"of model {model_name!r} on two training samples are not (logsumexp over the classes "
                f"{worst:.4g} from 0, largest output {float(out.max()):.4g}); for logits use task.loss: cross_entropy"
            )
    if e is None and loss is not None:
        n = min(2, len(ds.train_y))  # the first rows of x are the first training samples
        given: torch.Tensor | None = None  # the output as a leaf that takes a gradient (a float output)
        try:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the model returns a {type(out).__name__}, not a tensor")
            if out.is_floating_point():
                given = out[:n].detach().clone().requires_grad_()
            with torch.enable_grad():
                # a copy of the leaf: the output in training is no leaf, and a loss may work on it in place
                per = loss.per_sample(given.clone() if given is not None else out[:n], ds.train_y[:n].to(out.device))
            shape = tuple(per.shape)
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as err:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"loss {loss.name!r} cannot read the output of model {model_name!r} ({got} for {n} samples) against "
                f"the targets of dataset {dataset_name!r} ({tuple(ds.train_y[:n].shape)}, {ds.train_y.dtype}): "
                f"{_first_line(err)}"
            ) from err
        if shape != (n,):
            raise ConfigError(
                f"loss {loss.name!r}: per_sample must return one loss per sample, shape (B,), but returns {shape} "
                f"for {n} training samples; reduce its other axes (e.g. .mean(1))"
            )
        if given is not None and not _reaches(per, given):
            raise ConfigError(
                f"loss {loss.name!r} does not depend on the model's output: its losses on {n} training samples carry "
                "no gradient back to it (a .detach(), .item(), torch.no_grad() or NumPy round trip in the loss), so "
                "local training would have no gradient to step with; compute the loss from the output with torch "
                "operations"
            )
    if e is not None:
        raise ConfigError(
            f"model {model_name!r} does not fit dataset {dataset_name!r}: its input is "
            f"{tuple(ds.train_x.shape[1:])} ({kind}) with {ds.num_classes} classes, and the model "
            f"fails on it ({_first_line(e)}); choose a model for this kind of input (fedweave list)"
        ) from e


def _reaches(losses: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``losses`` carry a gradient back to ``output`` (a leaf that requires one)."""
    if not losses.requires_grad:
        return False
    try:
        return torch.autograd.grad(losses.sum(), output, allow_unused=True)[0] is not None
    except RuntimeError:  # a graph autograd cannot differentiate (an op without a derivative): no gradient either
        return False


def trial_forward(model: nn.Module, x: torch.Tensor) -> tuple[Any, Exception | None]:
    """One forward pass of ``x`` through ``model``: its output and None, or None and the error it raises. Eval mode
    and no_grad: no batch-norm statistics move and no random numbers are drawn; the model's mode is put back."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(x), None
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        return None, e
    finally:
        model.train(was_training)


def forward_error(model: nn.Module, x: torch.Tensor) -> Exception | None:
    """The error one forward pass of ``x`` through ``model`` raises, or None (:func:`trial_forward`)."""
    return trial_forward(model, x)[1]


def checked_augment(
    ctx: RunContext, model: nn.Module | None = None
) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None:
    """The run's training augmentation (``local.augment``), tried once on two training samples and, given
    ``model``, fed to it, so that an augmentation that cannot apply to the data (a crop of feature vectors, a
    window larger than the padded image) or whose output the model cannot read (a smaller crop into a model
    without a centre crop) is a configuration error now rather than a traceback in round 1. The trial draws
    from a generator of its own, so no named stream moves; the model runs in eval mode without gradients."""
    cfg, ds = ctx.config, ctx.dataset
    aug = list(cfg.local.augment)
    shape = tuple(ds.train_x.shape[1:])
    try:
        augment = augment_for(cfg.local)
        if augment is None:
            return None
        out = augment(ds.train_x[:2], torch.Generator().manual_seed(0))
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        raise ConfigError(
            f"local.augment {aug} cannot apply to dataset {cfg.dataset.name!r}, whose samples have shape {shape} "
            f"({_first_line(e)}); crop and flip need images (channels, height, width) and local.crop_size "
            "at most the image side plus twice local.crop_padding"
        ) from e
    if model is not None and (e := forward_error(model, out.to(ctx.device))) is not None:
        raise ConfigError(
            f"local.augment {aug} gives samples of shape {tuple(out.shape[1:])}, which model "
            f"{cfg.model.name!r} cannot read ({_first_line(e)}); leave local.crop_size out (the image size) "
            "or choose a model for that input"
        ) from e
    return augment


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


TARGET_BINS = 10  # quantile bins that stand for classes where float targets need labels


def dataset_loader(config: RunConfig) -> tuple[Callable[..., Dataset], dict[str, Any]]:
    """The loader registered as ``dataset.name`` and its checked options (nothing loaded)."""
    loader = DATASETS.get(config.dataset.name)
    return loader, check_options(loader, config.dataset.options, "dataset", name=config.dataset.name)


def partitioner(config: RunConfig) -> tuple[Callable[..., Any], dict[str, Any], Any, Any]:
    """The partitioner registered as ``partition.name``, its other options checked, ``partition.num_clients``
    and ``partition.bins`` (which one applies depends on the data's targets: :meth:`RunContext.partition_of`)."""
    part = config.partition
    fn = PARTITIONERS.get(part.name)
    opts = dict(part.options)
    num_clients, bins = (integral(opts.pop(k, None)) for k in ("num_clients", "bins"))
    if num_clients is None and part.name in ("natural", "from_file"):  # left out: every user (or file's client)
        num_clients = 0
    if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 0:
        allowed = {  # the partitioners that read 0 as "all": theirs say so
            "natural": "a non-negative integer (0 = one client per natural user)",
            "from_file": "a non-negative integer (0 = every client of partition.path)",
        }.get(part.name, "a positive integer")
        raise ConfigError(f"partition.num_clients must be {allowed}, got {num_clients!r}")
    opts = check_options(fn, opts, "partition", skip=("labels", "num_clients", "rng", "users"), name=part.name)
    return fn, opts, num_clients, bins


def zoo_model(config: RunConfig) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """The builder registered as ``model.name`` and its checked options, less ``init_from`` (nothing built)."""
    opts = dict(config.model.options)
    opts.pop("init_from", None)  # the weights loaded into the built model, not a builder's option
    with _as_config_error("model"):
        name = config.model.name
        builder = MODELS.get(name)
        return builder, check_options(builder, opts, "model", skip=("input_shape", "num_classes"), name=name)


class RunContext:
    """The pieces of a run, built lazily from the config so that a family uses only what it needs.

    ``config`` is the validated :class:`~fedweave.config.RunConfig`; ``objects`` a model factory, dataset or
    loss passed to :func:`fedweave.run` from Python (none by default). The seeds, the ledger and the
    placement (device, dtype, autocast) are made at once; the dataset, partition, task and model on first use.
    """

    def __init__(self, config: RunConfig, objects: RunObjects | None = None) -> None:
        self.config = config
        self.seeds = Seeds(config.seed)
        self.ledger = Ledger()
        self.objects = objects or RunObjects()  # a model factory, data or a loss passed from Python
        # device, dtype and autocast, decided once (DESIGN principle 9); a device this machine lacks stops here
        self.placement: Placement = resolve_placement(config.device, config.precision, config.memory)

    @property
    def device(self) -> torch.device:
        """Where the run computes (``device``)."""
        return self.placement.device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the run's models, data and state (``precision``; float32 under bf16-mixed)."""
        return self.placement.dtype

    @property
    def float_bytes(self) -> int:
        """Bytes of one value on the wire and in storage: 4 in float32, 8 in float64."""
        return torch.finfo(self.dtype).bits // 8

    @cached_property
    def task(self) -> Task:
        """The run's loss, metrics and main metric (``task`` section, or a loss passed from Python)."""
        t = self.config.task
        if self.objects.loss is not None:
            loss = self.objects.loss
            if not isinstance(loss, Loss):  # a plain function: its targets are what the data hold
                floats = self._loaded.train_y.is_floating_point()
                loss = CallableLoss(loss, targets="float" if floats else "class")
            return build_task(loss, {}, t.metrics, t.main)
        return build_task(t.loss, t.loss_options, t.metrics, t.main)

    @cached_property
    def _loaded(self) -> Dataset:
        """The dataset as its loader (or the Python caller) gave it."""
        if self.objects.dataset is not None:
            return self.objects.dataset
        loader, opts = dataset_loader(self.config)
        with _as_config_error("dataset"):
            ds = loader(**opts)
        if not isinstance(ds, Dataset):  # a plug-in's loader that returned its tensors or nothing
            raise ConfigError(
                f"dataset {self.config.dataset.name!r}: a registered dataset returns a fedweave.data.base.Dataset "
                f"(its training and test tensors, classes and input shape), got {type(ds).__name__}"
            )
        # a plug-in's NaN feature ran to a NaN round-1 loss, advised as a step-size divergence, and its empty
        # test split was scored 0.0 each round. The built-in loaders of verified downloads check their own
        # options (cfl_logreg has no test split by default, as in its paper), and scanning their data each run
        # would cost time; those that read the user's own files (libsvm, leaf, shakespeare's LEAF JSON) are
        # checked as a plug-in's are.
        if loads_user_files(loader, opts):
            check_loaded(self.config.dataset.name, ds)
        return ds

    @cached_property
    def user_files(self) -> dict[str, str]:
        """SHA-256 digests of what the run read from the user's own files, which no download check guards and
        whose rounds to come depend on them: the data of a loader that reads them (``libsvm``, ``leaf``,
        ``shakespeare`` from LEAF JSON, a plug-in's), a ``from_file`` partition and a ``schedule`` sampler's file.
        A checkpoint records them, and a resume refuses files that changed since (``fedweave.checkpoints``).
        (``model.init_from`` is read at the start only: a resume continues from the checkpoint's weights.)"""
        out = {}
        if self.objects.dataset is None and loads_user_files(*dataset_loader(self.config)):
            out["dataset"] = describe_dataset(self._loaded)["sha256"]
        if self.config.partition.name == "from_file":
            h = hashlib.sha256()
            for part in (np.asarray(self.partition.indices), self.partition.offsets):
                h.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
            out["partition"] = h.hexdigest()
        if self.config.sampler.name == "schedule" and self.config.sampler.options.get("file"):
            try:  # the plan as the sampler reads it (not its spacing); a file gone since is the sampler's to name
                plan = json.loads(Path(self.config.sampler.options["file"]).expanduser().read_text())
                out["sampler"] = hashlib.sha256(json.dumps(plan).encode()).hexdigest()
            except (OSError, ValueError):
                pass
        return out

    @cached_property
    def dataset(self) -> Dataset:
        """The dataset in host memory (the placement moves what computes), in the run's precision."""
        ds = self._checked(self._in_precision(self._on_host(self._loaded)))
        share_with_workers(ds.test_x, ds.test_y)  # a pool's workers evaluate on their forked copy: no copies
        return ds

    @staticmethod
    def _on_host(ds: Dataset) -> Dataset:
        """Data passed from Python on a device come to the host: partitions and reports read them there."""
        tensors = {k: getattr(ds, k) for k in ("train_x", "train_y", "test_x", "test_y")}
        if all(t.device.type == "cpu" for t in tensors.values()):
            return ds
        return dataclasses.replace(ds, **{k: t.cpu() for k, t in tensors.items()})

    def _in_precision(self, ds: Dataset) -> Dataset:
        """Floating features and targets in the run's dtype (token ids and class labels stay integers):
        under ``precision: float64`` every dataset; under float32 the data passed from Python (a registered
        loader's own dtype is kept, and so is any data's where the family computes in float64 whatever the
        precision, ``placement.computes_in``: the confederated problems are float64 by design)."""

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t

        tensors = (ds.train_x, ds.train_y, ds.test_x, ds.test_y)
        if all(not t.is_floating_point() or t.dtype == self.dtype for t in tensors):
            return ds  # the common case: nothing to convert
        if self.dtype == torch.float32 and (self.objects.dataset is None or self.placement.computes_in == "float64"):
            return ds  # rounding float64 data to float32 would change the float64 family's problem
        return dataclasses.replace(
            ds, train_x=cast(ds.train_x), train_y=cast(ds.train_y), test_x=cast(ds.test_x), test_y=cast(ds.test_y)
        )

    def _checked(self, ds: Dataset) -> Dataset:
        """The task's loss must fit the targets: class losses need integer labels, the others float ones. A
        family with a fixed task (``Algorithm.fixed_task``) reads no task section and checks its data itself."""
        name = self.config.algorithm.name
        if name in ALGORITHMS and ALGORITHMS.get(name).fixed_task:  # the default task's advice would not apply
            return ds
        wants = self.task.loss.targets
        has = "float" if ds.train_y.is_floating_point() else "class"
        if wants == "class" and has == "float":
            raise ConfigError(
                f"task.loss {self.task.loss.name!r} needs integer class labels, but dataset "
                f"{self.config.dataset.name!r} has float targets; use mse or bce_with_logits (task.loss)"
            )
        if wants == "float" and has == "class" and self.task.loss.name in ("mse", "bce_with_logits"):
            raise ConfigError(
                f"task.loss {self.task.loss.name!r} needs float targets, but dataset {self.config.dataset.name!r} "
                "has class labels; use cross_entropy (the default) or nll"
            )
        if self.task.loss.name == "bce_with_logits" and has == "float":
            # a target outside [0, 1] makes the binary cross-entropy unbounded below: training drives the
            # logits to +-inf and the loss to -inf instead of fitting anything
            lo = min(float(ds.train_y.min()), float(ds.test_y.min()))
            hi = max(float(ds.train_y.max()), float(ds.test_y.max()))
            if not (lo >= 0 and hi <= 1):
                raise ConfigError(
                    f"task.loss 'bce_with_logits' needs targets in [0, 1] (0/1 labels or probabilities), but dataset "
                    f"{self.config.dataset.name!r} has targets from {lo:.6g} to {hi:.6g}; use mse for real-valued "
                    "targets"
                )
        self._check_metrics(ds, has)
        return ds

    def _check_metrics(self, ds: Dataset, has: str) -> None:
        """Each metric must read targets of the dataset's kind: accuracy on float targets scored 0 and
        perplexity, mse or auc on the wrong kind failed with a traceback at the first evaluation."""
        floats = has == "float"
        # a registered model gives num_classes logits, so value metrics on class labels fit only one output
        one_output = ds.num_classes == 1 or self.objects.model is not None
        binary = floats and all(bool(((y == 0) | (y == 1)).all()) for y in (ds.train_y, ds.test_y))  # both splits
        fits = {"class": not floats, "float": floats or one_output, "binary": binary if floats else one_output}
        for m in self.task.metrics:
            # top-k of k or fewer classes is 1 whatever the model: a run reported a perfect score
            if not floats and ds.num_classes <= (k := getattr(METRICS.get(m), "k", 1)) and k > 1:
                raise ConfigError(
                    f"task.metrics: {m!r} is 1 whatever the model when there are at most {k} classes, and dataset "
                    f"{self.config.dataset.name!r} has {ds.num_classes}; use accuracy"
                )
            wants = METRICS.get(m).targets
            if wants is None or fits[wants]:
                continue
            need = {"class": "integer class labels", "float": "float targets", "binary": "0/1 targets"}[wants]
            got = "float targets" if floats else f"class labels ({ds.num_classes} classes)"
            ok = [n for n in METRICS.names() if METRICS.get(n).targets in [k for k, v in fits.items() if v]]
            raise ConfigError(
                f"task.metrics: {m!r} needs {need}, but dataset {self.config.dataset.name!r} has {got}; "
                f"metrics for these targets: {', '.join(ok)}"
            )

    @cached_property
    def partition(self) -> Partition:
        """Training-set indices of each client (one index array and offsets: ``len``, ``[i]``, iteration),
        without its held-out samples under ``eval.holdout``."""
        return self._split[0]

    @cached_property
    def _split(self) -> tuple[Partition, list[np.ndarray] | None]:
        """The clients' training indices and, under ``eval.holdout``, their held-out test indices (into the
        training set; the ``holdout`` stream, drawn after the partition)."""
        ds = self.dataset
        parts = self.partition_of(ds.train_y.numpy(), users=ds.train_users)
        if not self.config.eval.holdout:
            return parts, None
        from fedweave.data.partition import holdout_split

        train, test = holdout_split(parts, self.config.eval.holdout, self.seeds.numpy("holdout"))
        return Partition.of(train), test

    def personal_test_set(self, per_client: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
        """Each client's own test set as ``(x, y, parts)``: under ``eval.holdout`` its held-out samples (rows
        of the training set), else :meth:`personal_test_parts` (rows of the test split)."""
        ds = self.dataset
        held = self._split[1]
        if held is not None:
            return ds.train_x, ds.train_y, held
        return ds.test_x, ds.test_y, self.personal_test_parts(per_client)

    def label_view(self, y: np.ndarray, bins: int = TARGET_BINS) -> np.ndarray:
        """Integer labels of targets: class labels as they are; float targets as the index of their first
        column's quantile bin (over the training targets), so label-based partitioners, per-client test sets
        and reports can work on regression and multi-label data."""
        y = np.asarray(y)
        if np.issubdtype(y.dtype, np.integer):
            return y
        first = y.reshape(len(y), -1)[:, 0] if y.ndim > 1 else y
        return np.searchsorted(self.target_bin_edges(bins), first, side="right").astype(np.int64)

    def target_bin_edges(self, bins: int = TARGET_BINS) -> np.ndarray:
        """The inner edges of ``bins`` quantile bins of the first training-target column (ties merged). Where the
        column holds at most ``bins`` distinct values and the quantile edges do not keep them apart (0/1 targets
        whose median is 0: the one edge, 0, put both values in one bin, and a label-skew partition had no skew),
        the midpoints between the values: each value a bin of its own."""
        train = self.dataset.train_y.numpy()
        ref = train.reshape(len(train), -1)[:, 0] if train.ndim > 1 else train
        edges = np.unique(np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1]))
        values = np.unique(ref)
        if len(values) <= bins and len(np.unique(np.searchsorted(edges, values, side="right"))) < len(values):
            return (values[:-1] + values[1:]) / 2
        return edges

    def partition_of(self, labels: np.ndarray, users: np.ndarray | None = None) -> Partition:
        """Split samples with these labels over the clients with the configured partitioner
        (indices into ``labels``); the ``partition`` stream makes it deterministic."""
        part = self.config.partition
        fn, opts, num_clients, bins = partitioner(self.config)
        if not np.issubdtype(np.asarray(labels).dtype, np.integer):  # float targets (regression, multi-label)
            if is_label_free(fn):  # (fedweave.data.partition.label_free)
                if bins is not None:  # accepted and never read, any value (bins: -3 too) before
                    raise ConfigError(
                        f"partition.bins: partition {part.name!r} reads only the sample counts, not the targets; "
                        "leave it out (it splits float targets by quantile for the label-skew partitioners)"
                    )
                labels = np.zeros(len(labels), dtype=np.int64)  # these partitioners read only the sample count
            elif bins is None:
                free = [n for n in PARTITIONERS.names() if is_label_free(PARTITIONERS.get(n))]
                raise ConfigError(
                    f"partition {part.name!r} splits by class label, but the targets are floats; use "
                    f"{', '.join(free[:-1])} or {free[-1]}, or give partition.bins: N to split by N target quantiles"
                )
            elif not isinstance(bins, int) or isinstance(bins, bool) or bins < 2:
                raise ConfigError(f"partition.bins must be an integer >= 2, got {bins!r}")
            else:
                labels = self.label_view(labels, bins)
        elif bins is not None:
            raise ConfigError("partition.bins applies to float targets only; these targets are class labels")
        with _as_config_error("partition"):
            parts = fn(labels, num_clients, self.seeds.numpy("partition"), users=users, **opts)
        if isinstance(parts, Partition) and fn.__module__ == Partition.__module__:  # built-in: correct by construction
            return parts
        try:  # a partitioner of your own (a list of arrays or a Partition): checked against the contract
            return check_parts(parts, len(labels), part.name, num_clients)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    @property
    def num_clients(self) -> int:
        """The number of clients: the parts of :attr:`partition`."""
        return len(self.partition)

    def personal_test_parts(self, per_client: int | None = None) -> list[np.ndarray]:
        """Per-client test indices: the natural users' own test samples for a ``natural`` partition, else a
        draw from the test split with each client's train label distribution (afind-plus spec 4.2; the
        ``test_split`` stream, so every family evaluating a run's clients sees the same sets)."""
        cache = self.__dict__.setdefault("_personal_test_parts", {})
        if per_client not in cache:
            from fedweave.data.partition import client_test_split, user_test_split

            ds = self.dataset
            if self.config.partition.name == "natural" and ds.train_users is not None and ds.test_users is not None:
                cache[per_client] = user_test_split(self.partition, ds.train_users, ds.test_users)
            else:
                cache[per_client] = client_test_split(
                    self.partition,
                    self.label_view(ds.train_y.numpy()),
                    self.label_view(ds.test_y.numpy()),
                    self.seeds.numpy("test_split"),
                    per_client=per_client,
                )
        return cache[per_client]

    def build_model(self, key: tuple[int, ...] = ()) -> nn.Module:
        """A fresh model, initialized on the CPU from the ``model_init`` stream (same seed, same weights on
        every device), then moved to the run's device and dtype; ``model.init_from`` (a state_dict or .npz
        file) then sets its weights. ``key``: another model of the run with its own initialization (the
        ``("model_init", *key)`` stream: IFCA's cluster models); the run's model is ``key=()``."""
        ds = self.dataset
        opts = dict(self.config.model.options)
        init_from = opts.pop("init_from", None)
        with torch.random.fork_rng(devices=[]), _as_config_error("model"):
            torch.manual_seed(self.seeds.int_seed("model_init", *key))
            if self.objects.model is not None:
                model = self.objects.model()
                if not isinstance(model, nn.Module):
                    raise ConfigError(f"model: the factory must return an nn.Module, got {type(model).__name__}")
            else:
                builder, opts = zoo_model(self.config)
                name = self.config.model.name
                with model_memory(name, opts):
                    model = builder(tuple(ds.input_shape), ds.num_classes, **opts)
        with model_memory(self.config.model.name, opts):
            model = model.to(device=self.device, dtype=self.dtype)
        if init_from is not None:
            load_initial_weights(model, init_from)
        self.check_model(model, self.config.model.name)
        if self.objects.model is not None and not key:  # objects.json: what the factory gave for the run's model
            self.objects.built_model = describe_model(model)
        return model

    def check_model(self, model: nn.Module, name: str) -> None:
        """:func:`check_model_fits` for a model of this run whose outputs the task's loss reads (the run's model,
        or a family's own, such as the split family's x_s ∘ x_c and a_c ∘ x_c), named ``name`` in its errors."""
        ds = self.dataset
        # the built-in class losses index the logits by label (a loss of one's own may read fewer outputs)
        classes = ds.num_classes if self.objects.loss is None and self.task.loss.name in CLASS_LOSSES else None
        nll = isinstance(self.task.loss, NLL)  # the built-in nll (by name or passed from Python) reads log-probs
        # value metrics on class labels read one output; a registered model's width is known (_check_metrics)
        values = [m for m in self.task.metrics if METRICS.get(m).targets in ("float", "binary")]
        one_output_for = values if self.objects.model is not None and not ds.train_y.is_floating_point() else ()
        check_model_fits(
            model, ds, name, self.config.dataset.name, self.device, classes, nll, self.task.loss, one_output_for
        )

    @cached_property
    def model(self) -> nn.Module:
        """The run's model, built once by :meth:`build_model` on first use and then shared."""
        return self.build_model()


def aggregation_weights(sizes: torch.Tensor, clients: np.ndarray, weighting: str) -> torch.Tensor:
    """The round's aggregation weights over ``clients``, summing to one: proportional to their numbers of
    samples (``weighting: samples``) or equal (``uniform``, and where none of them holds a sample: such clients
    take no step, so the mean of their unchanged models keeps the global one, where 0 / 0 would be NaN)."""
    w = sizes[clients] if weighting == "samples" else torch.ones(len(clients), dtype=sizes.dtype, device=sizes.device)
    total = w.sum()
    if not total > 0:
        return torch.full_like(w, 1.0 / len(w))
    return w / total


class _AlgorithmMeta(ABCMeta):
    """Checks an algorithm's state record: its names when the class is defined, and once an instance is
    built (every ``__init__`` of its bases has run), that each names an attribute the instance set."""

    def __init__(cls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> None:
        super().__init__(name, bases, ns, **kw)
        fields = cls.state_fields
        if not isinstance(fields, tuple) or not all(isinstance(f, str) and f.isidentifier() for f in fields):
            raise TypeError(f"{name}.state_fields must be a tuple of attribute names, got {fields!r}")
        if len(set(fields)) != len(fields):
            raise TypeError(f"{name}.state_fields names an attribute twice: {fields!r}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if abstract := sorted(getattr(cls, "__abstractmethods__", ())):  # a method its family calls, not written
            raise ConfigError(
                f"algorithm {getattr(cls, 'name', cls.__name__)!r} ({cls.__module__}.{cls.__qualname__}) does not "
                f"define {', '.join(abstract)}, which its family's round calls (docs/extending.md)"
            )
        algo = super().__call__(*args, **kwargs)
        missing = [f for f in cls.state_fields if not hasattr(algo, f)]
        if missing:
            raise TypeError(
                f"{cls.__name__}.state_fields names {missing}, which {cls.__name__} does not set when it is built "
                f"(its state record: {list(cls.state_fields)})"
            )
        return algo


class Algorithm(metaclass=_AlgorithmMeta):
    """Base class of every registered algorithm.

    ``ctx`` is the run's :class:`RunContext` (config, seeds, ledger, data, model, placement), ``hp`` the
    algorithm's hyper-parameters: an instance of :attr:`Hparams` built from the config's ``algorithm``
    options. A subclass implements :meth:`run_round` and :meth:`evaluate`, and registers itself with
    ``@ALGORITHMS.register(name)`` (:data:`fedweave.registry.ALGORITHMS`).
    """

    #: The registered name (``algorithm.name``).
    name: ClassVar[str] = ""
    #: The topology family: ``centralized``, ``decentralized``, ``split``, ``hierarchical`` or ``confederated``.
    family: ClassVar[str] = ""
    #: The dataclass of the hyper-parameters, filled from the ``algorithm`` section's options.
    Hparams: ClassVar[type] = NoHparams
    #: Injected faults (fedweave.faults) this class's run_round handles; the runner refuses the others.
    handles_faults: ClassVar[tuple[str, ...]] = ()
    #: Whether the class's rounds run on the simulated clock of ``faults.sim_time`` (the star family's); the
    #: runner refuses the key for the others.
    sim_clock: ClassVar[bool] = False
    #: Whether a client's work in a round is a count of local steps (:meth:`client_steps`, with
    #: :meth:`relative_work` its reference), so that ``faults.work_unit: step`` is defined: the star, split and
    #: hierarchical families'. The runner refuses that unit for the others (their clients' work is one round each).
    counts_steps: ClassVar[bool] = False
    #: Why the family trains only its own task (None: it trains any task of fedweave.tasks).
    fixed_task: ClassVar[str | None] = None
    #: Config keys the class never reads (a section such as ``model``, or one key such as ``local.steps``), each
    #: with why: set to other than its default it is refused, naming the key, when the run is built.
    unread_config: ClassVar[dict[str, str]] = {}
    #: Whether the class evaluates on each client's own test set whatever the ``eval`` section says (personal
    #: models, the decentralized family's): where it does not, and neither ``eval.personal_test`` nor
    #: ``eval.distribution`` asks for it, ``eval.holdout`` is refused (its samples would leave training, read by
    #: nothing).
    own_test_sets: ClassVar[bool] = False
    #: The ``algorithm`` options that scale a step of the method (named when a run diverges); None: its
    #: Hparams fields named as step sizes (``lr``, ``*_lr``, ``step_size``, ``step_scale``). A method whose
    #: ``server_lr`` must stay 1 declares its own, so the advice never names an option the run refuses.
    step_sizes: ClassVar[tuple[str, ...] | None] = None
    #: What else a divergence of the method may come from, a sentence that names the option to change; the
    #: line that reports a divergence gives it before the step sizes. None by default.
    divergence_hint: ClassVar[str] = ""
    #: The column a run's plots show when the task's main metric is not among its rows (a fixed task's own).
    plot_metric: ClassVar[str] = "test_loss"
    #: The state record: the attributes that a resumed run needs beyond the context, which the default
    #: ``state_dict`` saves under their own names (the checkpoint's keys). A family base declares its
    #: skeleton's (the star's global model ``("x",)``) and a method adds its server state
    #: (``state_fields = (*StarAlgorithm.state_fields, "m", "v")``); a name the built instance does not set is
    #: an error when the algorithm is built, not a silent miss at the first checkpoint.
    state_fields: ClassVar[tuple[str, ...]] = ()
    #: The tensors of the state record whose first dimension grows during a run (CFL's cluster models, one row
    #: per cluster): a checkpoint's may differ there from a freshly built run's, the other dimensions may not.
    growing_state: ClassVar[tuple[str, ...]] = ()
    #: Whether the class runs the compression stage on its uploads (``compression.upload``); the others refuse it.
    compresses_uploads: ClassVar[bool] = False
    #: Whether a round's computation depends on the run's total ``rounds`` (an annealed schedule): a resumed
    #: run may then not change ``rounds``, which would change the rounds still to come.
    uses_total_rounds: ClassVar[bool] = False
    #: True after a round nobody reported, faults or none (the star's clients all without samples): the runner
    #: logs it as skipped, as it does a round whose ``reported_clients`` is 0 under faults
    nobody_reported: bool = False

    @classmethod
    def check_model(cls, config: RunConfig) -> None:
        """Look up ``model.name`` and check its options as the run will build it, building nothing: a model of
        the zoo (:meth:`RunContext.build_model`); a family that builds its models otherwise says so here."""
        zoo_model(config)

    @classmethod
    def check_sampler(cls, config: RunConfig, hp: Any) -> None:
        """Look up ``sampler.name`` and check its options as the run will make the sampler (:func:`make_sampler`),
        drawing nothing; a family whose own keys also choose the clients checks them against it first."""
        if config.sampler != Section("uniform"):
            # a family that takes a sampler looks it up so (one that takes none refuses the section when built)
            sampler_options(config.sampler.name, config.sampler.options)

    def __init__(self, ctx: RunContext, hp: Any) -> None:
        self.ctx = ctx
        self.hp = hp

    @property
    def config(self) -> RunConfig:
        """The run's validated config (``ctx.config``)."""
        return self.ctx.config

    @property
    def compute_threads(self) -> int:
        """The torch threads the rounds compute on (``summary.json``'s ``execution.threads``): the process's, which
        the runner sets from ``threads``; a family that computes on others says so."""
        return torch.get_num_threads()

    @property
    def seeds(self) -> Seeds:
        """The run's named random streams (``ctx.seeds``): every draw of the algorithm comes from one of them."""
        return self.ctx.seeds

    @property
    def ledger(self) -> Ledger:
        """The run's communication and storage ledger (``ctx.ledger``), where every transfer is recorded."""
        return self.ctx.ledger

    # ---- injected faults (docs/reliability.md): the server side of the star, hierarchical and split
    # families; the graph family asks per peer and link instead
    @cached_property
    def faults(self) -> Faults:
        """The run's fault decisions, pure functions of (seed, round, who); inactive when none are injected."""
        return Faults(self.config.faults, self.seeds)

    @property
    def faulty(self) -> bool:
        """True when the config injects any fault (without faults every family runs its fault-free path)."""
        return bool(self.faults.active())

    def client_work(self, r: int, clients: np.ndarray) -> np.ndarray | float:
        """Each client's work in round ``r`` in the clock's unit (``faults.work_unit``): its upload's arrival time
        scales with it. Every consumer (``reporting``, the synchronous star's ``round_time``, the asynchronous
        ``launch``, the split family's timed uploads) asks here. A family that counts no local steps
        (:attr:`counts_steps` False) gives every client one round's work, 1 (the unit ``step`` is refused)."""
        if not self.counts_steps:
            return 1.0
        return self.work_units(self.client_steps(r, clients))

    def work_units(self, steps: np.ndarray | list[int]) -> np.ndarray:
        """Local steps in the clock's unit, the one place that applies ``faults.work_unit``: ``step`` keeps them
        (a median-speed client takes one unit per step); ``round`` takes them over the mean client's round
        (:meth:`relative_work`)."""
        steps = np.asarray(steps, dtype=np.float64)
        return steps if self.config.faults.work_unit == "step" else self.relative_work(steps)

    def client_steps(self, r: int, clients: np.ndarray) -> np.ndarray:
        """Each client's local steps in round ``r`` (a family with :attr:`counts_steps` defines them)."""
        raise NotImplementedError(f"{type(self).__name__} counts no local steps")

    def relative_work(self, steps: np.ndarray) -> np.ndarray:
        """``steps`` over the local steps of the run's mean client round (a family with :attr:`counts_steps`
        defines its reference): the unit ``round`` of the clock."""
        raise NotImplementedError(f"{type(self).__name__} counts no local steps")

    def reporting(self, r: int, clients: np.ndarray) -> np.ndarray:
        """The clients of ``clients`` whose upload arrives in round ``r`` (order kept): those that drop out,
        and those past the deadline (policy drop), deliver nothing."""
        if not self.faulty:
            return clients
        return self.faults.reporting(r, clients, self.client_work(r, clients))

    def client_samples(self) -> tuple[Sequence[np.ndarray], torch.Tensor] | None:
        """The training samples each client holds, as index arrays into the targets returned with them, for the
        run's partition report (``partition.csv``); None where no partitioner spread samples over clients. By
        default the run's partition of the training set, once a method has read it."""
        if "partition" not in self.ctx.__dict__:
            return None
        return self.ctx.partition, self.ctx.dataset.train_y

    def check_built(self) -> None:
        """Checks that need the whole method built (a subclass's ``__init__`` done), made once by
        :func:`build_algorithm` before anything is written; a problem is a :class:`ConfigError`."""

    def start_metrics(self) -> dict[str, float]:
        """What the initial model's row (``eval.at_start``) carries beside its evaluation; nothing by default."""
        return {}

    def fault_metrics(self, reported: int | np.ndarray) -> dict[str, float]:
        """``reported_clients`` when faults are injected (0 marks a skipped round for the runner)."""
        n = reported if isinstance(reported, int) else len(reported)
        return {"reported_clients": float(n)} if self.faulty else {}

    @abstractmethod
    def run_round(self, r: int) -> dict[str, float]:
        """Run communication round ``r``; return per-round metrics (may be empty)."""

    @abstractmethod
    def evaluate(self, r: int) -> dict[str, float]:
        """Evaluate after round ``r``; must include ``test_accuracy`` and ``test_loss`` where meaningful."""

    def run_files(self) -> dict[str, str]:
        """Files of the algorithm's own that the run writes into its directory when it ends (name -> text),
        e.g. the event order of an asynchronous method; none by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; default: the state record, each attribute of ``state_fields`` under its
        name (a component with a state of its own, such as a neighbour selector, by its ``state_dict``). A
        family or method with more (a client state store, uploads in flight) adds its entries."""
        return {k: _saved(getattr(self, k)) for k in self.state_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the attributes of :meth:`state_dict`; a tensor goes where the fresh algorithm keeps it
        (the run's device, or the host for host-side bookkeeping), whichever device saved it."""
        for k, v in state.items():
            cur = getattr(self, k, None)
            if _stateful(cur):  # a component restores itself, wherever the fresh algorithm built it
                cur.load_state_dict(v)
            elif isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                cur.copy_(v)
            elif isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                setattr(self, k, v.to(cur.device))
            else:
                setattr(self, k, v)


def _stateful(value: Any) -> bool:
    """A component of the state record that saves and restores itself (not a tensor or a plain value)."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "load_state_dict", None))


def _saved(value: Any) -> Any:
    return value.state_dict() if _stateful(value) else value


def make_trainer(
    ctx: RunContext, jobs_per_call: int, *, regularize_in_rule: bool = False, in_process: bool = False
) -> LocalTrainer:
    """The local trainer of a run: its data, partition, local config, augmentation and backend.

    With ``regularize_in_rule`` the trainer applies neither weight decay nor clipping: the algorithm's
    rule adds them to the loss gradient itself (see :func:`fedweave.algorithms.centralized.base.regularized`).
    With ``in_process`` (a rule that keeps the method's state inside the local steps) ``backend: auto`` resolves
    to ``loop`` where it would pick the pool, whose workers would keep that state to themselves.
    """
    cfg = ctx.config
    local = cfg.local
    if regularize_in_rule:
        local = dataclasses.replace(local, weight_decay=0.0, grad_clip=None)
    check_seeded(ctx.model, ctx.dataset.train_x[:2].to(ctx.device))
    augment = checked_augment(ctx, ctx.model)
    ds = ctx.dataset
    backend = choose_backend(cfg.backend, ctx.model, jobs_per_call, device=ctx.device)
    if in_process and cfg.backend == "auto" and backend == "pool":  # an explicit pool or ray is the method's to refuse
        backend = "loop"
    if backend == "vmap" and batch_statistics(ctx.model) and (local.steps is None or local.full_batch):
        raise ConfigError(
            "backend: vmap pads short local batches with rows the loss leaves out, but the model's batch norm "
            "would count them in its statistics; set local.steps (every batch full) or choose backend loop"
        )
    # a data-poisoning attack's clients train on its samples (robustness); otherwise the dataset's own
    train_x, train_y = poisoned_data(cfg, ctx.seeds, ds.train_x, ds.train_y, ctx.partition, ds.num_classes)
    return LocalTrainer(
        ctx.model,
        train_x,
        train_y,
        ctx.partition,
        local,
        ctx.seeds,
        backend=backend,
        augment=augment,
        rounds=cfg.rounds,
        ray=cfg.ray,
        loss_fn=ctx.task.loss,
        placement=ctx.placement,
    )


def with_local(trainer: LocalTrainer, **changes: Any) -> LocalTrainer:
    """A trainer sharing data, model and backend with ``trainer`` but with other ``local`` settings."""
    other = copy.copy(trainer)
    other.local = dataclasses.replace(trainer.local, **changes)
    return other


def check_ditto(lam: float, personal_epochs: int) -> None:
    """Ditto's two options, the same in every family that runs it: lambda >= 0, personal epochs >= 1."""
    if not 0 <= lam <= MAX_LR:  # a larger one is inf in float32: the first step's lam * 0 is NaN
        raise ConfigError(f"algorithm.lam must be in [0, {MAX_LR:.6g}], got {lam}")
    if not 1 <= personal_epochs <= MAX_LOCAL_EPOCHS:  # bounded as local.epochs is: 1e300 would never end
        raise ConfigError(f"algorithm.personal_epochs must be in [1, {MAX_LOCAL_EPOCHS:,}], got {personal_epochs:.6g}")


class ProximalRule(LocalRule):
    """grad F_i(v) + lambda (v - anchor_i): the gradient of Ditto's personal objective (Li et al. 2021,
    Eq. 2), with which both families' Ditto train the personal models; ``anchor`` has one row per job."""

    def __init__(self, lam: float, anchor: torch.Tensor) -> None:
        self.lam, self.anchor = lam, anchor

    def direction(self, w, grad, jobs):
        return grad(w) + self.lam * (w - self.anchor[jobs])


def changed_keys(config: RunConfig, key: str) -> list[str]:
    """The keys under ``key`` (``model``, ``local``, ``local.steps``) whose values differ from a default
    config's, named as written in a config (``local.lr``, ``model.name``, ``partition.alpha``)."""
    mine, default = config, load({})  # a loaded config: its defaults resolved (local.epochs 1) as the run's are
    for part in key.split("."):
        mine, default = getattr(mine, part), getattr(default, part)
    if isinstance(mine, Section):
        if mine.name != default.name:
            return [f"{key}.name"]
        opts = sorted(set(mine.options) | set(default.options))
        return [f"{key}.{k}" for k in opts if mine.options.get(k) != default.options.get(k)]
    if dataclasses.is_dataclass(mine):
        return [
            f"{key}.{f.name}" for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(default, f.name)
        ]
    return [key] if mine != default else []


_STEP_SIZE_NAME = re.compile(r"(.*_)?lr|step_(size|scale)")


def step_size_keys(cls: type[Algorithm]) -> list[str]:
    """The config keys that set a step size the algorithm ``cls`` reads, as written in a config: ``local.lr``
    unless the class never reads it (its ``unread_config``), then its ``step_sizes`` as ``algorithm.<name>``.
    A diverged run's message names these (fedweave.runner), not only ``local.lr``: a server's step (FedAdam's
    ``server_lr``) or the confederated family's ``step_size`` blows up a run just as well."""
    if cls.step_sizes is not None:
        own = list(cls.step_sizes)
    elif dataclasses.is_dataclass(cls.Hparams):
        own = [f.name for f in dataclasses.fields(cls.Hparams) if _STEP_SIZE_NAME.fullmatch(f.name)]
    else:
        own = []
    local = ["local.lr"] if reads_local(cls, "lr") else []
    return local + [f"algorithm.{name}" for name in own]


def reads_local(cls: type[Algorithm], key: str) -> bool:
    """Whether the algorithm ``cls`` reads ``local.<key>``: False where its ``unread_config`` names the key or
    the whole ``local`` section."""
    return not ({"local", f"local.{key}"} & set(cls.unread_config))


def build_algorithm(ctx: RunContext) -> Algorithm:
    """Look up ``algorithm.name``, validate its options against its ``Hparams``, construct it."""
    cls, hp = check_algorithm(ctx.config, ctx.objects)
    algo = cls(ctx, hp)
    algo.check_built()
    trainer = getattr(algo, "trainer", None)
    if trainer is not None:  # after the method's own checks, which may refuse such a model in their words (FedBN)
        check_running_stats(trainer.layout.model)
    if ctx.config.secure_aggregation is not None and getattr(algo, "secagg", None) is None:  # a round of its own
        name = ctx.config.algorithm.name
        raise ConfigError(f"secure_aggregation: algorithm {name!r} runs a round of its own, not billed yet")
    return algo


def check_config(config: RunConfig, objects: RunObjects | None = None) -> None:
    """The checks of a run's sections that need neither its data nor its device: the registered names (the
    config's plug-ins were imported by its loader), their options and the rules between keys that
    :func:`build_algorithm` and the :class:`RunContext` apply when they look the names up. The runner makes them
    before it builds anything and a sweep for every point before its first run; a section the algorithm never
    reads (its ``unread_config``, refused when set) or that ``objects`` replace is not looked up."""
    objects = objects or RunObjects()
    cls, hp = check_algorithm(config, objects)
    if objects.dataset is None:
        dataset_loader(config)
    if "partition" not in cls.unread_config:
        partitioner(config)
    if objects.model is None and "model" not in cls.unread_config:
        cls.check_model(config)
    cls.check_sampler(config, hp)


def check_algorithm(config: RunConfig, objects: RunObjects | None = None) -> tuple[type[Algorithm], Any]:
    """The class registered as ``algorithm.name`` and its ``Hparams`` from the section's options, after the
    rules between its family and the other sections (compression, task, privacy, secure aggregation, the keys
    it never reads); nothing is built."""
    objects = objects or RunObjects()
    section = config.algorithm
    cls = ALGORITHMS.get(section.name)
    hp = build_dataclass(cls.Hparams, section.options, "algorithm", section.name)
    if config.compression.upload is not None and not cls.compresses_uploads:
        raise ConfigError(
            f"compression.upload: algorithm {section.name!r} ({cls.family}) does not compress its uploads yet; the "
            "star methods, the hierarchical model-averaging baselines and choco_sgd (compressed gossip) do "
            "(docs/compression.md); remove the section"
        )
    if config.compression.download is not None and not getattr(cls, "compresses_downloads", False):
        why = (  # the reason where there is one to give
            " (its asynchronous rounds keep no per-client copy of the server's model)"
            if getattr(cls, "asynchronous", False)
            else " (its clients' rule or update reads the server's model, not only where they start)"
            if cls.family == "centralized"
            else ""
        )
        raise ConfigError(
            f"compression.download: algorithm {section.name!r} ({cls.family}) does not compress its downloads yet"
            f"{why}; fedavg, the fedopt family, fedsam, scaffold, fedcm and mofedsam do (docs/compression.md); "
            "remove compression.download"
        )
    if cls.fixed_task and (config.task != type(config.task)() or objects.loss is not None):
        raise ConfigError(f"task: the {cls.family} family {cls.fixed_task}; leave the task section out")
    private = ("centralized", "decentralized", "hierarchical", "split")  # privacy: the families it runs in
    if config.privacy is not None and cls.family not in private:
        raise ConfigError(
            f"privacy: the {cls.family} family is not supported yet (differential privacy runs on the centralized, "
            "hierarchical and split families' rounds and, at sample level, in the decentralized family); leave the "
            "privacy section out"
        )
    secure = config.secure_aggregation is not None
    if secure and cls.family != "centralized":  # secure aggregation: its cost is billed on the star round only
        raise ConfigError(
            f"secure_aggregation: the {cls.family} family is not supported yet (the star methods whose server needs "
            "only the sum of the updates); leave the section out"
        )
    for key, why in cls.unread_config.items():
        changed = changed_keys(config, key)
        if changed:
            raise ConfigError(f"{changed[0]}: the {cls.family} family {why}; leave it out")
    ev = config.eval
    if ev.holdout and not (cls.own_test_sets or ev.personal_test or ev.distribution):
        ask = "set eval.personal_test or eval.distribution to evaluate them, or " if cls.family == "centralized" else ""
        raise ConfigError(
            f"eval.holdout: algorithm {section.name!r} ({cls.family}) evaluates no client's own test set here, so "
            f"nothing would evaluate the held-out samples; {ask}leave it out"
        )
    return cls, hp
