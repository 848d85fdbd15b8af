"""What a run predicts and how it is scored (DESIGN principle 10): a loss, metrics, and the main metric.

A :class:`Loss` gives per-sample losses; local training minimises their mean over a batch (the valid rows
of a masked batch), evaluation adds them up. A :class:`Metric` accumulates over the batches of an
evaluation and returns one or more named values. Local training, every family's evaluation, the summary's
final/best value, the progress bar, the plots and the divergence checks read the task; nothing else names
cross-entropy or accuracy.

Registered losses: ``cross_entropy`` (the default; class indices), ``nll`` (the model outputs
log-probabilities), ``mse`` (``half: true`` for the ``0.5 * mean((pred - y)^2)`` convention) and
``bce_with_logits`` (multi-label or binary 0/1 targets). Any callable ``loss(out, y) -> per-sample losses``
can be passed through the Python API (``fedweave.run(..., loss=fn)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedweave.config import ConfigError, check_options, check_task
from fedweave.registry import LOSSES, METRICS  # the registries this module fills (also found here, as before)


# ---- losses ----------------------------------------------------------------------------------------
class Loss:
    """Per-sample losses of a batch; calling it gives their mean over the valid rows (the training loss)."""

    name = "custom"
    targets = "float"  # "class" (int64 class indices) or "float" (same shape as the model's output)

    def per_sample(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of each row of a batch, shape ``(B,)``, from the model's output ``out`` and the targets
        ``y`` (class indices or values shaped like ``out``, as :attr:`Loss.targets` says)."""
        raise NotImplementedError

    def __call__(self, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        losses = self.per_sample(out, y)
        if mask is None:
            return losses.mean()
        m = mask.to(losses.dtype)
        return (losses * m).sum() / m.sum().clamp_min(1.0)

    def __reduce__(self):  # registered singletons unpickle to themselves (ray actors keep fast paths)
        if LOSSES._items.get(self.name) is type(self) and _SINGLETONS.get(self.name) is self:
            return (_singleton, (self.name,))
        return object.__reduce__(self)


_SINGLETONS: dict[str, Loss] = {}


def _singleton(name: str) -> Loss:
    return _SINGLETONS[name]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over the output columns: (B, ...) -> (B,)."""
    return t.reshape(len(t), -1).mean(1) if t.dim() > 1 else t


def _like(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Float targets in the output's shape and dtype ((N,) targets against an (N, 1) output)."""
    return y.to(out.dtype).reshape(out.shape)


@LOSSES.register("cross_entropy")
class CrossEntropy(Loss):
    """Softmax cross-entropy of logits against class indices."""

    name, targets = "cross_entropy", "class"

    def per_sample(self, out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")


@LOSSES.register("nll")
class NLL(Loss):
    """Negative log-likelihood of a model that outputs log-probabilities (e.g. ends in log_softmax)."""

    name, targets = "nll", "class"

    def per_sample(self, out, y):
        return nn.functional.nll_loss(out, y, reduction="none")


@LOSSES.register("mse")
class MSE(Loss):
    """Squared error, averaged over the output columns; ``half``: times 1/2 (the least-squares convention)."""

    name = "mse"

    def __init__(self, half: bool = False) -> None:
        self.half = half

    def per_sample(self, out, y):
        se = _rows((out - _like(y, out)).pow(2))
        return 0.5 * se if self.half else se

    def __reduce__(self):
        return (MSE, (self.half,))


@LOSSES.register("bce_with_logits")
class BCEWithLogits(Loss):
    """Binary cross-entropy on logits, averaged over the labels (multi-label, or binary with one output)."""

    name = "bce_with_logits"

    def per_sample(self, out, y):
        return _rows(nn.functional.binary_cross_entropy_with_logits(out, _like(y, out), reduction="none"))


class CallableLoss(Loss):
    """A user's ``fn(out, y)`` returning per-sample losses: shape ``(B,)``, or the output's shape ``(B, ...)``
    (``reduction="none"`` on a model with one or more outputs), averaged over the other axes as the registered
    losses are. Float targets come in the output's shape, as the registered losses take them (``(B,)`` targets of a
    ``(B, 1)`` output as ``(B, 1)``: else ``mse_loss(out, y, reduction="none")`` broadcast them to ``(B, B)`` and
    trained on every pair)."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], targets: str = "float") -> None:
        self.fn, self.targets = fn, targets
        self.name = getattr(fn, "__name__", type(fn).__name__)

    def per_sample(self, out, y):
        if self.targets == "float" and y.shape != out.shape and y.numel() == out.numel():
            y = y.reshape(out.shape)
        v = self.fn(out, y)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() == 0:
            got = (
                f"a {type(v).__name__}"
                if not isinstance(v, torch.Tensor)
                else f"a {v.dtype} tensor of {tuple(v.shape)}"
            )
            raise ValueError(
                f"the loss {self.name!r} must return a float tensor with one loss per sample (shape (B,)), got "
                f"{got}; compute it with reduction='none'"
            )
        if v.shape != out.shape and v.shape != out.shape[:1]:
            raise ValueError(
                f"the loss {self.name!r} returns {tuple(v.shape)} for an output of {tuple(out.shape)}: one loss per "
                f"sample is {tuple(out.shape[:1])} (or the output's shape, averaged over its columns)"
            )
        # (B, 1) or (B, k) to (B,): a masked mean would broadcast a (B, 1) against the (B,) mask into (B, B)
        return _rows(v)

    def __reduce__(self):
        return (CallableLoss, (self.fn, self.targets))


for _name in ("cross_entropy", "nll", "bce_with_logits"):
    _SINGLETONS[_name] = LOSSES.get(_name)()
cross_entropy: Loss = _SINGLETONS["cross_entropy"]


# ---- metrics -----------------------------------------------------------------------------------------
class Metric:
    """Accumulates over the batches of one evaluation; ``result()`` gives its named values. ``keys``: the
    values it always gives, with whether higher (``max``) or lower (``min``) is better."""

    keys: dict[str, str] = {}
    # the targets it reads, checked against the dataset when a run is built: "class" (int64 indices),
    # "float" (values shaped like the output), "binary" (0/1 values shaped like the output); None: unchecked
    targets: str | None = None
    # the keys that are NaN where the evaluation set does not define them (R^2 on fewer than two samples): a NaN
    # there, its losses finite, is not a divergence (fedweave.callbacks.builtin.undefined_metrics)
    undefined: frozenset[str] = frozenset()

    def update(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Add one batch: the model's output ``out`` and its targets ``y``."""
        raise NotImplementedError

    def result(self) -> dict[str, float]:
        """The metric's values over the batches added so far, by name (at least those of :attr:`keys`)."""
        raise NotImplementedError


@METRICS.register("accuracy")
class Accuracy(Metric):
    """Share of rows whose true class is among the ``k`` largest outputs."""

    k = 1
    keys = {"accuracy": "max"}
    targets = "class"

    def __init__(self) -> None:
        self.correct, self.n = 0, 0

    def update(self, out, y):
        if self.k == 1:
            self.correct += int((out.argmax(1) == y).sum())
        else:
            self.correct += int((out.topk(min(self.k, out.shape[1]), dim=1).indices == y[:, None]).any(1).sum())
        self.n += len(y)

    def result(self):
        return {next(iter(self.keys)): self.correct / max(self.n, 1)}


@METRICS.register("top3")
class Top3(Accuracy):
    """Share of rows whose true class is among the 3 largest outputs (``top3``)."""

    k, keys = 3, {"top3": "max"}


@METRICS.register("top5")
class Top5(Accuracy):
    """Share of rows whose true class is among the 5 largest outputs (``top5``)."""

    k, keys = 5, {"top5": "max"}


class _Errors(Metric):
    """Sums of squared and absolute errors and of the targets, per output column (all additive). The
    targets are summed less the first row's (``shift``): sum(y^2) - (sum y)^2 / n cancels catastrophically
    when the targets' mean is large against their spread, and constant targets then give an SST of exactly 0."""

    targets = "float"

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] | None = None
        self.shift: torch.Tensor | None = None
        self.n = 0

    def update(self, out, y):
        y = _like(y, out).double().reshape(len(out), -1)
        err = out.double().reshape(len(out), -1) - y
        if self.shift is None:
            self.shift = y[0].clone()
        ys = y - self.shift
        sums = [err.pow(2).sum(0), err.abs().sum(0), ys.sum(0), ys.pow(2).sum(0)]
        self.sums = sums if self.sums is None else [a + b for a, b in zip(self.sums, sums)]
        self.n += len(out)

    def result(self):
        sse, sae, sy, syy = self.sums
        n, cols = max(self.n, 1), sse.numel()
        mse = float(sse.sum()) / (n * cols)
        sst = syy - sy.pow(2) / n
        # a constant column (SST = 0) scores 1 if predicted exactly, else 0: scikit-learn's r2_score
        # (force_finite), not 1 - SSE/1e-300; with fewer than two rows R^2 is undefined (sklearn: nan)
        r2 = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-300), (sse == 0).double())
        r2_mean = float(r2.mean()) if self.n >= 2 else float("nan")
        values = {
            "mse": mse,
            "rmse": math.sqrt(mse),
            "mae": float(sae.sum()) / (n * cols),
            "r2": r2_mean,  # uniform average over outputs (sklearn's)
        }
        return {k: values[k] for k in self.keys}


@METRICS.register("mse")
class MeanSquaredError(_Errors):
    """Mean squared error over every output value (``mse``)."""

    keys = {"mse": "min"}


@METRICS.register("rmse")
class RootMeanSquaredError(_Errors):
    """Square root of the mean squared error (``rmse``)."""

    keys = {"rmse": "min"}


@METRICS.register("mae")
class MeanAbsoluteError(_Errors):
    """Mean absolute error over every output value (``mae``)."""

    keys = {"mae": "min"}


@METRICS.register("r2")
class R2(_Errors):
    """Coefficient of determination, 1 - SSE/SST per output column, averaged."""

    keys = {"r2": "max"}
    undefined = frozenset({"r2"})  # on fewer than two samples


@METRICS.register("auc")
class AUC(Metric):
    """ROC AUC of the logits against 0/1 targets, macro-averaged over the labels that have both classes
    (scikit-learn's ``roc_auc_score``)."""

    keys = {"auc": "max"}
    targets = "binary"
    undefined = frozenset({"auc"})  # where no label has both classes

    def __init__(self) -> None:
        self.scores: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []

    def update(self, out, y):
        self.scores.append(out.detach().double().reshape(len(out), -1).cpu().numpy())
        self.labels.append(_like(y, out).reshape(len(out), -1).cpu().numpy())

    def result(self):
        from sklearn.metrics import roc_auc_score

        s, t = np.concatenate(self.scores), np.concatenate(self.labels)
        both = [j for j in range(t.shape[1]) if 0 < t[:, j].sum() < len(t)]
        return {"auc": float(np.mean([roc_auc_score(t[:, j], s[:, j]) for j in both])) if both else float("nan")}


@METRICS.register("f1")
class F1(Metric):
    """F1 per label at logit 0 (probability 1/2): ``f1`` is their mean, ``f1_<j>`` each label's."""

    keys = {"f1": "max"}
    targets = "binary"

    def __init__(self) -> None:
        self.tp = self.fp = self.fn = None

    def update(self, out, y):
        pred = out.reshape(len(out), -1) > 0
        true = _like(y, out).reshape(len(out), -1) > 0.5
        counts = ((pred & true).sum(0), (pred & ~true).sum(0), (~pred & true).sum(0))
        if self.tp is None:
            self.tp, self.fp, self.fn = counts
        else:
            self.tp, self.fp, self.fn = (a + b for a, b in zip((self.tp, self.fp, self.fn), counts))

    def result(self):
        tp, fp, fn = (c.double() for c in (self.tp, self.fp, self.fn))  # counts: divided in float64, not float32
        f1 = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
        out = {"f1": float(f1.mean())}
        if len(f1) > 1:
            out.update({f"f1_{j}": float(v) for j, v in enumerate(f1)})
        return out


@METRICS.register("perplexity")
class Perplexity(Metric):
    """exp(mean cross-entropy per token), for next-token models."""

    keys = {"perplexity": "min"}
    targets = "class"

    def __init__(self) -> None:
        self.total, self.n = 0.0, 0

    def update(self, out, y):
        self.total += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        self.n += len(y)

    def result(self):
        return {"perplexity": math.exp(self.total / max(self.n, 1))}


# ---- the task ----------------------------------------------------------------------------------------
@dataclass
class Task:
    """A run's loss, its evaluation metrics and the main one (with its direction)."""

    loss: Loss = field(default_factory=lambda: cross_entropy)
    metrics: list[str] = field(default_factory=lambda: ["accuracy"])
    main: str = "accuracy"
    direction: str = "max"  # "max": higher is better; "min": lower is better

    @property
    def is_default(self) -> bool:
        """Cross-entropy and accuracy: the families' fast evaluation paths (and the pool's) apply."""
        return self.loss is cross_entropy and self.metrics == ["accuracy"]

    @property
    def main_key(self) -> str:
        """The metrics.csv column of the main metric."""
        return f"test_{self.main}"

    def new_metrics(self) -> list[Metric]:
        """Fresh metric objects, one per name of :attr:`metrics`, for one evaluation."""
        return [METRICS.get(m)() for m in self.metrics]

    def better(self, a: float, b: float) -> bool:
        """Whether main-metric value ``a`` is strictly better than ``b`` (higher or lower, as
        :attr:`direction` says)."""
        return a > b if self.direction == "max" else a < b


# the words of a column in which lower is better: losses, gaps, errors, costs, an attack's success, a spread
LOWER_IS_BETTER = {
    "loss",
    "gap",
    "error",
    "seconds",
    "bytes",
    "time",
    "epsilon",
    "uploads",
    "upload",
    "backdoor",
    "std",
}


def column_direction(column: str, unknown: str | None = "max") -> str | None:
    """Whether higher (``max``) or lower (``min``) is better in a metrics column (``test_mse``,
    ``val_auc``, ``test_accuracy_min``, ``train_loss``, ...), from the registered metric it names; losses,
    gaps and errors (the confederated family's ``opt_gap``, ``objective_gap``, ``consensus_error``) are ``min``,
    and so are costs (``wall_seconds``, ``bytes_total``, ``sim_time``, ``epsilon``, ``smashed_uploads_per_client``,
    the confederated ``upload_fraction``), an attack's success (``test_backdoor_success``) and a spread across
    clients (``client_test_accuracy_std``); a column that names no metric counts as ``unknown`` (``max``; None
    where a caller must not guess)."""
    words = column.split("_")
    if LOWER_IS_BETTER & set(words):
        return "min"
    for word in words:
        for cls in METRICS._items.values():
            if word in cls.keys:
                return cls.keys[word]
    return unknown


def may_be_undefined(column: str) -> bool:
    """Whether a metrics column (``test_r2``, ``test_r2_personal``, ``client_test_auc_mean``, ...) names a key a
    registered metric declares NaN where its set does not define it (:attr:`Metric.undefined`)."""
    words = set(column.split("_"))
    return any(words & cls.undefined for cls in METRICS._items.values())


def build_task(
    loss: str | Loss | Callable = "cross_entropy",
    options: dict[str, Any] | None = None,
    metrics: list[str] | None = None,
    main: str | None = None,
) -> Task:
    """A :class:`Task` from a registered loss name (with options) or a Loss/callable, checked."""
    if loss == "python":  # what a run records for a loss passed from Python, read back without that loss
        raise ConfigError(
            "task.loss: python names a loss passed from Python (fedweave.run(..., loss=fn), and fedweave.resume with "
            f"the same one); a config names a registered loss: {', '.join(LOSSES.names())}"
        )
    if isinstance(loss, str):
        cls = LOSSES.get(loss)
        opts = check_options(cls, options or {}, "task.loss_options")
        loss_obj = _SINGLETONS[loss] if (loss in _SINGLETONS and not opts) else cls(**opts)
    elif isinstance(loss, Loss):
        loss_obj = loss
    elif callable(loss):
        loss_obj = CallableLoss(loss)
    else:
        raise ConfigError(f"task.loss must be a registered loss name or a callable, got {loss!r}")
    metrics, main, direction = check_task(loss_obj, metrics, main)
    return Task(loss_obj, metrics, main, direction)


def evaluate_batches(
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    task: Task,
    batch_size: int,
    move: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Mean loss and the task's metrics of ``forward`` on ``(x, y)``, in batches (each moved by ``move``
    to where ``forward`` computes, when given)."""
    metrics = task.new_metrics()
    total = 0.0
    for lo in range(0, len(y), batch_size):
        xb, yb = x[lo : lo + batch_size], y[lo : lo + batch_size]
        if move is not None:
            xb, yb = move(xb), move(yb)
        out = forward(xb)
        total += float(task.loss.per_sample(out, yb).sum())
        for m in metrics:
            m.update(out, yb)
    res = {"loss": total / max(len(y), 1)}
    for m in metrics:
        res.update(m.result())
    return res
