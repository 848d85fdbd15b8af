"""The built-in callbacks: the progress bar, the divergence guard, checkpoints, the partition report, the
per-client record, plots, trackers, and stopping at a target or a budget."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import sys
from typing import TYPE_CHECKING, Any

from fedweave.callbacks import Callback
from fedweave.errors import DivergenceError
from fedweave.registry import CALLBACKS
from fedweave.tasks import may_be_undefined

if TYPE_CHECKING:
    from fedweave.config import RunConfig, Section


def check_finite(values: dict[str, Any], r: int, what: str) -> None:
    """Raise :class:`DivergenceError` naming round ``r`` (0-based) when a float in ``values`` is NaN or Inf."""
    bad = {k: v for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise DivergenceError(
            f"round {r + 1}: {what} is not finite ({', '.join(f'{k}={v}' for k, v in bad.items())}); the run stopped."
        )  # the runner adds which step sizes to lower: the algorithm's own (fedweave.runner.divergence_advice)


def watched(key: str) -> bool:
    """Whether a metrics column is one whose growth means a blown-up run: a loss, or an optimality or objective gap
    (the confederated family's ``opt_gap``, ``objective_gap``: a solver whose steps are too large grew them to
    1e227, finite, the run completed)."""
    return key.endswith("loss") or key.endswith("_gap")


def undefined_metrics(values: dict[str, Any]) -> list[str]:
    """The columns of one evaluation that are NaN while each of its losses is finite, of a metric that its set may
    leave undefined (R^2 on fewer than two samples, AUC where no label has both classes: ``Metric.undefined``):
    not a blown-up model, whose outputs would make its losses NaN or Inf too. None where the evaluation reports
    no loss; any other NaN (a callback's value included) stays a divergence."""
    losses = [v for k, v in values.items() if watched(k) and isinstance(v, float)]
    if not losses or not all(math.isfinite(v) for v in losses):
        return []
    return [k for k, v in values.items() if isinstance(v, float) and math.isnan(v) and may_be_undefined(k)]


def defined(values: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's values less those :func:`undefined_metrics` names: what the finiteness check reads."""
    undefined = undefined_metrics(values)
    return {k: v for k, v in values.items() if k not in undefined}


def check_explosion(values: dict[str, Any], first: dict[str, float], r: int, factor: float | None) -> None:
    """A loss or gap far above its first value means the run has blown up, long before it overflows to Inf."""
    if factor is None:
        return
    for key, v in values.items():
        if not watched(key) or not isinstance(v, float):
            continue
        if v > 0:
            first.setdefault(key, v)  # the first positive value (a round nobody reported may give 0)
        base = first.get(key)
        if base is not None and v > factor * base:
            raise DivergenceError(
                f"round {r + 1}: {key} = {v:.4g} exploded (over eval.explode_factor = {factor:g} times its first "
                f"value {base:.4g}); the run stopped."
            )


class DivergenceGuard(Callback):
    """NaN or Inf in a training or evaluation metric (but for a metric undefined on its set,
    :func:`undefined_metrics`, warned of once), or a loss or gap (:func:`watched`) above ``explode_factor`` times
    its first positive value, ends the run as ``diverged`` before the bad row is recorded (docs/reliability.md)."""

    def __init__(self, explode_factor: float | None) -> None:
        self.factor = explode_factor
        self.first: dict[str, float] = {}
        self.undefined: set[str] = set()  # the columns already reported undefined (one warning each)

    def on_start(self, run):
        # a resumed run's reference: the first losses it reported, as its checkpoint keeps them (the rows hold
        # only the evaluated rounds' values; they stand in for a checkpoint written without the reference)
        self.first = run.loss_reference
        for row in run.rows:
            self._remember(row)

    def _remember(self, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if watched(k) and isinstance(v, float) and v > 0:
                self.first.setdefault(k, v)

    def after_training(self, run, r, metrics):
        check_finite(metrics, r, "a training metric")
        check_explosion(metrics, self.first, r, self.factor)

    def on_evaluation(self, run, r, values):
        undefined = undefined_metrics(values)
        for key in sorted(set(undefined) - self.undefined):
            logging.getLogger("fedweave").warning(
                f"{key} is NaN in round {max(r + 1, 0)} while the evaluation's losses are finite: the metric is "
                "undefined on the set it scored (R^2 needs 2 samples or more, AUC a label with both classes); kept "
                "as NaN in metrics.csv, the run goes on."
            )
        self.undefined |= set(undefined)
        values = defined(values)
        if r < 0:  # the initial model: its losses are the reference, not checked against one
            check_finite(values, r, "an evaluation metric of the initial model")
            return
        check_finite(values, r, "an evaluation metric")
        check_explosion(values, self.first, r, self.factor)

    def on_row(self, run, row):
        self._remember(row)  # the initial model's row (eval.at_start) sets the reference


class ProgressBar(Callback):
    """A tqdm bar on stderr: rounds, the main metric and the bytes sent."""

    def __init__(self) -> None:
        self.bar = None

    def on_start(self, run):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=run.config.rounds, initial=run.start_round, unit="round", dynamic_ncols=True,
                        file=sys.stderr)  # fmt: skip

    def on_row(self, run, row):
        if self.bar is None or row["round"] == 0:
            return
        main = run.ctx.task.main_key
        post = {main.removeprefix("test_"): f"{row[main]:.4g}"} if main in row else {}
        if "epsilon" in row:  # privacy: the epsilon spent so far
            post["eps"] = f"{row['epsilon']:.3g}"
        post["sent"] = f"{row['bytes_total'] / 2**20:.1f}MiB"
        self.bar.set_postfix(post, refresh=False)

    def on_round_end(self, run, r):
        if self.bar is not None:
            self.bar.update(1)

    def on_end(self, run, summary):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Checkpointer(Callback):
    """``checkpoint.pt`` after every ``every`` rounds and after the last (docs/reliability.md): only states whose
    floating tensors are all finite are written, but for those that held NaN when the algorithm was built (its
    markers)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.markers: frozenset[str] = frozenset()
        self.verified = False

    def on_build(self, run):
        from fedweave.checkpoints import nan_markers

        self.markers = nan_markers(run.algo.state_dict())  # before a checkpoint's state is loaded

    def on_round_end(self, run, r):
        if not ((r + 1) % self.every == 0 or run.is_last(r)):
            return
        from fedweave.checkpoints import save_checkpoint, signals_held
        from fedweave.memory import cpu_seconds

        extra = {"config": run.config.recorded(), "skipped_rounds": run.skipped, "loss_reference": run.loss_reference}
        extra["cpu_seconds"] = cpu_seconds() - run.cpu0
        extra["user_files"] = run.ctx.user_files  # digests of what the run read from the user's own files
        # a signal between the checkpoint's rename and its record would make summary.json name the previous
        # round: held until both are done
        with signals_held():
            save_checkpoint(run.out, run.algo, r + 1, run.wall(), extra=extra, verify=not self.verified,
                            markers=self.markers)  # fmt: skip
            run.last_checkpoint = r + 1
        self.verified = True
        run.callbacks.on_checkpoint(run, r + 1)


class PartitionReport(Callback):
    """A new run that partitioned a dataset writes how the classes (or target bins) fell to the clients."""

    def on_start(self, run):
        held = None if run.resumed else run.algo.client_samples()
        if held is None:
            return
        from fedweave.data.report import write_partition_report

        ctx, (parts, targets) = run.ctx, held
        labels = ctx.label_view(targets.numpy())  # float targets: their quantile bins
        floats = targets.is_floating_point()
        edges = ctx.target_bin_edges() if floats else None
        classes = len(edges) + 1 if floats else ctx.dataset.num_classes
        write_partition_report(parts, labels, classes, run.path, plot=run.config.output.plots, bin_edges=edges)


class ClientRecord(Callback):
    """``eval.distribution``: each evaluation's per-client values (the star's ``client_values``: client ids and
    each of the task's values on the client's own test set) as one line of ``clients.jsonl`` in the run
    directory. A resumed run keeps the lines up to its checkpoint, as it keeps the metrics rows."""

    FILE = "clients.jsonl"

    def on_build(self, run):
        from fedweave.config import ConfigError

        if run.algo.family != "centralized":
            raise ConfigError(
                f"eval.distribution records the global model on each client's own test set, which the "
                f"{run.algo.family} family does not evaluate; use it with a centralized algorithm"
            )

    def on_start(self, run):
        from fedweave.results import atomic_write

        self.path = run.path / self.FILE
        kept = []
        if run.resumed and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut short when the run stopped
                    continue
                if isinstance(entry, dict) and entry.get("round", math.inf) <= run.start_round:
                    kept.append(line + "\n")
        atomic_write(self.path, "".join(kept))

    def on_row(self, run, row):
        values = run.algo.client_values
        if values is not None and values["round"] == row["round"]:
            with open(self.path, "a") as f:
                f.write(json.dumps(values) + "\n")


class Plots(Callback):
    """The run's curves as PNG files once it ends (``output.plots``)."""

    def on_end(self, run, summary):
        if summary is not None and run.rows:
            from fedweave.plots import plot_runs

            plot_runs([run.path], run.path, metric=summary["main_metric"] or run.algo.plot_metric)


@CALLBACKS.register("stop_at_target")
class StopAtTarget(Callback):
    """End the run after the first evaluated round whose ``metric`` reaches ``target`` (at least it, or at
    most it for a metric where lower is better: ``direction``, else the task's for its main metric, else the
    one the column's name says (:func:`fedweave.tasks.column_direction`: ``test_loss``, ``opt_gap`` are
    ``min``); a column whose name says none needs ``direction``)."""

    def __init__(self, metric: str, target: float, direction: str | None = None, each_round: bool = False) -> None:
        if direction not in (None, "max", "min"):
            raise ValueError(f"StopAtTarget: direction must be 'max' or 'min', got {direction!r}")
        self.metric, self.target, self.direction = metric, float(target), direction
        self._direction = direction  # as resolved for the run being built (the task's, where direction is None)
        self.each_round = each_round  # also watch the round's training metrics (a metric reported every round)
        self.reached: int | None = None

    def on_build(self, run):
        # resolved when the run is built, before anything is written: a missing direction is a config error;
        # kept apart from the one given, so that the same object on a run of another task resolves it again
        self._direction = self.direction
        if self.direction is None:
            from fedweave.config import ConfigError
            from fedweave.tasks import column_direction

            main = run.ctx.task.main_key
            self._direction = run.ctx.task.direction if self.metric == main else column_direction(self.metric, None)
            if self._direction is None:
                raise ConfigError(
                    f"StopAtTarget: give direction='max' or 'min' for {self.metric!r} (its name says neither; the "
                    f"task's main metric, whose direction is known, is {main!r})"
                )

    def on_start(self, run):
        self.reached = None
        self._seen = False  # whether the metric has appeared in a row or (each_round) a round's training metrics
        self._warned = False
        for row in run.rows:  # a resumed run's recorded rows: a target reached before the checkpoint stays reached
            self._check(row["round"], row.get(self.metric))

    def on_row(self, run, row):
        self._seen = self._seen or self.metric in row
        if not self._seen and not self._warned and row["round"] > 0:
            # a column the run never writes (a misspelling) would let the run go on to its last round silently
            self._warned = True
            columns = ", ".join(k for k in row if k != "round")
            logging.getLogger("fedweave").warning(
                "stop_at_target: the run's first evaluated row has no column %r, so it can never stop the run; "
                "its columns: %s",
                self.metric,
                columns,
            )
        self._check(row["round"], row.get(self.metric))

    def after_training(self, run, r, metrics):
        if self.each_round:
            self._seen = self._seen or self.metric in metrics
            self._check(r + 1, metrics.get(self.metric))

    def _check(self, round_: int, v: Any) -> None:
        if self.reached is not None or round_ == 0 or not isinstance(v, (int, float)):
            return
        if (v >= self.target) if self._direction == "max" else (v <= self.target):
            self.reached = round_

    def after_round(self, run, r):
        if self.reached is not None:
            return f"{self.metric} reached {self.target:g} at round {self.reached}"
        return None


@CALLBACKS.register("round_trace")
class RoundTrace(Callback):
    """Keep the training metrics ``keys`` of every round (what an algorithm reports each round, e.g. the
    confederated methods' ``opt_gap`` and ``uploads``; the initial evaluation's values as round 0) with the
    run's wall seconds, in the run directory's ``trace.csv``: a per-round curve without evaluating every round.
    Each row is appended as its round ends, so the file always holds at least the rounds of the last
    checkpoint, even after a kill between the checkpoint and anything else, and a resumed run keeps its rows up to
    the checkpoint, as it keeps the metrics rows; the whole file is written again at the end."""

    FILE = "trace.csv"

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)
        self.rows: list[dict[str, Any]] = []

    def on_start(self, run):
        self.rows = []
        path = run.path / self.FILE
        if run.resumed and path.is_file():
            # the rows as written (strings, so they are written back byte for byte) up to the checkpoint's round
            for row in csv.DictReader(io.StringIO(path.read_text())):
                try:
                    round_ = int(row.get("round") or "")
                except ValueError:  # a line cut short when the run stopped
                    continue
                if round_ <= run.start_round:
                    self.rows.append(row)
        self._write(run)  # the header and the rows kept: each round's row is appended to it

    def _add(self, run, round_: int, values: dict[str, Any]) -> None:
        row = {"round": round_, **{k: values.get(k) for k in self.keys}, "wall_seconds": run.wall()}
        self.rows.append(row)
        buf = io.StringIO()
        self._writer(buf).writerow(row)
        with open(run.path / self.FILE, "a", newline="") as f:  # a line cut short by a kill is skipped on resume
            f.write(buf.getvalue())

    def _writer(self, buf: io.StringIO) -> csv.DictWriter:
        # (a resumed run whose keys changed: a kept row's column no longer traced is left out)
        return csv.DictWriter(buf, ["round", *self.keys, "wall_seconds"], lineterminator="\n", extrasaction="ignore")

    def on_row(self, run, row):
        if row["round"] == 0:
            self._add(run, 0, row)

    def after_training(self, run, r, metrics):
        self._add(run, r + 1, metrics)

    def _write(self, run) -> None:
        from fedweave.results import atomic_write

        buf = io.StringIO()
        w = self._writer(buf)
        w.writeheader()
        w.writerows(self.rows)
        atomic_write(run.path / self.FILE, buf.getvalue())

    def on_end(self, run, summary):
        if summary is not None:
            self._write(run)


@CALLBACKS.register("budget")
class Budget(Callback):
    """End the run once it has used ``seconds`` of wall time (a resumed run's earlier time included) or run
    ``rounds`` rounds in this process, whichever comes first."""

    def __init__(self, seconds: float | None = None, rounds: int | None = None) -> None:
        if seconds is None and rounds is None:
            raise ValueError("Budget: give seconds, rounds or both")
        # a negative budget is a mistake, not a request for one round (seconds: 0 asks for that)
        if seconds is not None and not (
            isinstance(seconds, int | float) and not isinstance(seconds, bool) and 0 <= seconds < math.inf
        ):
            raise ValueError(f"Budget: seconds must be a number >= 0 (wall seconds), got {seconds!r}")
        if rounds is not None and not (isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1):
            raise ValueError(f"Budget: rounds must be an integer >= 1, got {rounds!r}")
        self.seconds, self.rounds = seconds, rounds

    def after_round(self, run, r):
        if self.seconds is not None and run.wall() >= self.seconds:
            return f"the time budget of {self.seconds:g} s is spent"
        if self.rounds is not None and r + 1 - run.start_round >= self.rounds:
            return f"the budget of {self.rounds} round{'s' * (self.rounds != 1)} is spent"
        return None


class PrivacyBudget(Callback):
    """Privacy (the ``privacy`` section): epsilon at the configured delta in every metrics row, and with
    ``privacy.target_epsilon`` the run stops after the last round whose release keeps epsilon within it."""

    def on_evaluation(self, run, r, values):
        dp = getattr(run.algo, "privacy", None)
        if dp is not None and r >= 0:
            values.update(dp.metrics())

    def after_round(self, run, r):
        dp, target = getattr(run.algo, "privacy", None), run.config.privacy.target_epsilon
        if dp is None or target is None or run.is_last(r):
            return None
        after = dp.epsilon_after_next(r + 1)  # DP-FTRL asks the sampler who round r + 1 draws
        if after > target:
            from fedweave.privacy.accountant import against_target

            after_shown, target_shown = against_target(after, target)
            return (
                f"privacy budget: one more round would spend epsilon {after_shown} > privacy.target_epsilon "
                f"{target_shown} (spent {dp.epsilon():.4g} at delta {run.config.privacy.delta:g})"
            )
        return None


def default_callbacks(config: RunConfig, progress: bool | None = None) -> list[Callback]:
    """The callbacks a config asks for, in the order they are called: the divergence guard first (a bad row
    is never recorded), checkpoints before the progress bar moves, plots before the trackers upload them."""
    out: list[Callback] = [DivergenceGuard(config.eval.explode_factor)]
    if config.output.checkpoint_every:
        out.append(Checkpointer(config.output.checkpoint_every))
    if config.output.progress if progress is None else progress:
        out.append(ProgressBar())
    out.append(PartitionReport())
    if config.eval.distribution:
        out.append(ClientRecord())
    if config.privacy is not None:  # privacy: epsilon in the rows, the budget's stop
        out.append(PrivacyBudget())
    if config.output.plots:
        out.append(Plots())
    if config.output.trackers:
        from fedweave.callbacks.trackers import TrackerCallback

        out.append(TrackerCallback(config.output.trackers))
    return out + [configured(section, f"callbacks[{i}]") for i, section in enumerate(config.callbacks)]


def configured(section: Section, key: str) -> Callback:
    """The registered callback a config's ``callbacks`` entry names, built with its options; a wrong name or
    option is one :class:`ConfigError` naming ``key``."""
    from fedweave.config import ConfigError, check_options

    cls = CALLBACKS.get(section.name)
    options = check_options(cls.__init__, section.options, key, skip=("self",))
    try:
        made = cls(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} ({section.name}): {e}") from e
    if not isinstance(made, Callback):  # its hooks would fail one by one, from inside the run
        raise ConfigError(
            f"{key} ({section.name}): the registered callback made a {type(made).__name__}, not a fedweave.Callback; "
            "register a subclass of fedweave.Callback"
        )
    return made
