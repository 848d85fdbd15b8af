"""The ``fedweave`` command line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from fedweave.config import ConfigError, load, load_plugins, recorded
    from fedweave.runner import resume, run

    load_plugins(args.plugin)  # before the config: it may name what a plug-in registers
    if args.resume:
        overrides = list(args.overrides)
        if args.config and "=" in args.config:  # `run --resume DIR rounds=18`: argparse took it for CONFIG
            overrides.insert(0, args.config)
        elif args.config:
            raise ConfigError(
                f"give either a CONFIG ({args.config}) or --resume RUN_DIR, not both: a resumed run uses the "
                "config saved in its directory (change rounds and the like with key=value overrides)"
            )
        if args.out or args.overwrite:
            raise ConfigError("--out and --overwrite do not apply to --resume (the run continues in RUN_DIR)")
        # the run's output.progress (or an override of it) decides, as for a new run (before: always a bar)
        res = resume(args.resume, overrides, progress=False if args.no_progress else None)
    else:
        if not args.config:
            raise ConfigError("fedweave run needs a CONFIG file (or --resume RUN_DIR)")
        cfg = load(args.config, args.overrides)
        # the run's config.yaml names the plug-ins of --plugin too, so that `--resume` needs nothing more
        cfg.plugins += [p for p in map(recorded, args.plugin) if p not in cfg.plugins]
        res = run(cfg, run_dir=args.out, progress=False if args.no_progress else None, overwrite=args.overwrite)
    # only now: importing the plotting writes matplotlib's font cache and config folder (bad input writes nothing)
    from fedweave.results import run_metric

    s = res.summary
    comm = s["communication"]
    print(f"run directory: {res.run_dir}")
    key = s.get("main_metric")
    if key == "test_accuracy":
        acc = s["final_test_accuracy"]
        print(f"final test accuracy {acc:.4f} (best {s['best_test_accuracy']:.4f} at round {s['best_round']})")
    elif key and s.get("final_main") is not None:
        name = key.replace("_", " ")
        best = (
            "undefined in every round" if s["best_main"] is None else f"{s['best_main']:.6g} at round {s['best_round']}"
        )
        print(f"final {name} {s['final_main']:.6g} (best {best})")
    elif (own := run_metric(s)) and isinstance((s.get("final") or {}).get(own), (int, float)):
        # no test set (the confederated family's synthetic problem): the column its own plots show
        print(f"final {own.replace('_', ' ')} {s['final'][own]:.6g} (round {s['final']['round']})")
    print(
        f"communication: {comm['bytes_up'] / 2**20:.1f} MiB up, {comm['bytes_down'] / 2**20:.1f} MiB down, "
        f"{comm['bytes_lateral'] / 2**20:.1f} MiB lateral; wall {s['wall_seconds']:.1f} s"
    )
    if s.get("privacy"):  # privacy: what the run spent
        dp, eps = s["privacy"], s["privacy"]["epsilon"]
        spent = "no guarantee (no noise)" if eps is None else f"epsilon {eps:.4g} at delta {dp['delta']:g}"
        print(f"privacy: {spent} ({dp['accountant']} accountant)")
    if s.get("stopped_early"):
        print(f"stopped early: {s['stopped_early']}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    import fedweave.callbacks  # noqa: F401  (registers the built-in callbacks)
    from fedweave.config import examples
    from fedweave.registry import (
        AGGREGATORS,
        ALGORITHMS,
        ATTACKS,
        AUGMENTATIONS,
        CALLBACKS,
        COMPRESSORS,
        DATASETS,
        MODELS,
        PARTITIONERS,
        SAMPLERS,
    )
    from fedweave.reproduce import available
    from fedweave.tasks import LOSSES, METRICS

    for title, reg in (
        ("algorithms", ALGORITHMS),
        ("datasets", DATASETS),
        ("models", MODELS),
        ("partitioners", PARTITIONERS),
        ("losses", LOSSES),
        ("metrics", METRICS),
        ("augmentations", AUGMENTATIONS),  # local.augment
        ("samplers", SAMPLERS),
        ("callbacks", CALLBACKS),
        ("aggregators", AGGREGATORS),  # robustness: the aggregator section
        ("attacks", ATTACKS),  # robustness: faults.byzantine.attack
        ("compressors", COMPRESSORS),  # compression.upload and .download (docs/compression.md)
    ):
        print(f"{title}: {', '.join(reg.names())}")
    from fedweave.models.split import SPLIT_MODELS  # the split family's model.name (docs/algorithms/split.md)

    print(f"split models: {', '.join(SPLIT_MODELS.names())}")
    from fedweave.registry import ACCOUNTANTS, PRIVACY_MECHANISMS  # privacy (the privacy section)

    # two of the mechanisms are switched on by their own keys; privacy.mechanism refuses their names
    switched = {"adaptive": "privacy.adaptive: true", "dpsgd": "privacy.level: sample"}
    keyed = [n for n in PRIVACY_MECHANISMS.names() if n not in switched]
    also = "; ".join(f"{n} ({key})" for n, key in switched.items())
    print(f"privacy mechanisms (privacy.mechanism): {', '.join(keyed)}; {also}")
    print(f"privacy accountants: {', '.join(ACCOUNTANTS.names())}")
    print(f"reproductions: {', '.join(available())}")
    print(f"example configs (fedweave run example:NAME): {', '.join(examples())}")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from fedweave.data.sources import SourceFailed, fetch

    if args.root is not None:
        if len(args.names) > 1:
            raise SourceFailed(f"--root holds the files of one dataset; give one NAME, not {len(args.names)}")
        if not Path(args.root).expanduser().is_dir():
            what = "is not a directory" if Path(args.root).expanduser().exists() else "does not exist"
            raise SourceFailed(f"--root {args.root!r} {what}; give the directory that holds the {args.names[0]} files")
    for name in dict.fromkeys(args.names):  # in order, each once
        path = fetch(name, root=args.root, rehash=True)  # "fetch and verify": hash the files every time
        print(f"{name}: {path}", flush=True)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from fedweave.data.sources import DataSourceError, cached, verify

    names = args.names or cached()
    if not names:
        print("no dataset is cached yet (fedweave data fetch NAME)")
        return 0
    failed = []
    for name in names:
        try:
            print(f"{name}: OK ({verify(name)})")
        except DataSourceError as e:
            failed.append(name)
            print(f"fedweave: error: {name}: {e}", file=sys.stderr)
    return 2 if failed else 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from fedweave.config import ConfigError
    from fedweave.experiments.report import sweep_runs
    from fedweave.plots import plot_runs

    out = Path(args.out) if args.out else Path(args.run_dirs[0])
    if args.out:
        _out_under_no_file(out, "give a folder (made if missing)", folder=True)
        if (out / "sweep.json").is_file():  # as a run's folder is refused: its figures were replaced without a word
            raise ConfigError(
                f"--out {out} holds a sweep, whose own plots (its points' bands over the seeds) these curves would "
                "replace; give another folder"
            )
    runs = []  # a sweep directory stands for the runs of its current grid, as in its report
    for d in map(Path, args.run_dirs):
        if not (d / "sweep.json").is_file():
            runs.append(d)
        elif not (found := sweep_runs(d)):
            raise ConfigError(f"{d}: no run of the sweep's grid (sweep.json) has started yet; nothing to plot")
        else:
            runs += found
    if not args.out and runs != [Path(args.run_dirs[0])]:
        # the overlay has the file names of the first directory's own plots (a sweep's bands over seeds, a run's
        # one curve): written there by default, it replaced them without a word
        raise ConfigError(
            f"fedweave plot of {len(runs)} runs needs --out DIR: the default, {args.run_dirs[0]}, would replace its "
            "own plots"
        )
    try:
        written = plot_runs(runs, out, metric=args.metric or _runs_metric(runs))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    for p in written:
        print(p)
    return 0


def _runs_metric(runs: list[Path]) -> str | None:
    """The first finished run's own metric (its task's main metric, or the column its plots show where its
    rows have none: the confederated family's ``opt_gap``); None when no run has a readable summary."""
    from fedweave.results import run_metric

    for d in runs:
        try:
            metric = run_metric(json.loads((d / "summary.json").read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if metric:
            return metric
    return None


SWEEP_KEYS = ("grid", "zip", "seeds", "workers", "out", "baseline", "level", "test", "correction")


def _sweep_section(form: object, config: str) -> dict:
    """A config file's ``sweep:`` section, checked before anything runs: each problem is one ConfigError
    naming the file and the key."""
    from fedweave.config import ConfigError

    where = f"config file {config!r}: sweep"
    if form is None:
        return {}
    if not isinstance(form, dict):
        raise ConfigError(f"{where} must be a mapping of {', '.join(SWEEP_KEYS)}, got {type(form).__name__}")
    unknown = sorted(map(str, set(form) - set(SWEEP_KEYS)))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(SWEEP_KEYS)})")
    for key in ("grid", "zip"):
        axes = form.get(key) or {}
        pairs = axes.items() if isinstance(axes, dict) else [(None, None)]
        if not all(isinstance(k, str) and isinstance(v, list) and v for k, v in pairs):
            raise ConfigError(
                f"{where}.{key} must be a mapping of keys to non-empty lists of values "
                f"(e.g. local.lr: [0.01, 0.1]), got {repr(axes)[:80]}"
            )
    for key in ("seeds", "workers"):
        v = form.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}.{key} must be a whole number >= 1, got {v!r}")
    if not isinstance(form.get("out", "-"), str) or not form.get("out", "-"):
        raise ConfigError(f"{where}.out must be a directory path, got {form['out']!r}")
    b = form.get("baseline", "-")
    if not (isinstance(b, dict) and b or isinstance(b, str | int | float) and not isinstance(b, bool)):
        raise ConfigError(
            f"{where}.baseline must name one grid point, as a mapping (algorithm.name: fedavg) or, with one grid "
            f"key, its value; got {b!r}"
        )
    from fedweave.experiments.baseline import check_correction, check_test

    check_test(form.get("level", 0.95), form.get("test", "t"), f"{where}.")
    check_correction(form.get("correction", "none"), f"{where}.")
    return form


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fedweave.config import read_yaml_file
    from fedweave.experiments import parse_grid, sweep

    config, grid, zipped = args.config, parse_grid(args.grid), parse_grid(args.zip, "--zip")
    seeds, workers, out = args.seeds, args.workers, args.out
    spec = read_yaml_file(config)  # the config loader's checks: duplicate keys, nesting, aliases
    if isinstance(spec, dict) and "sweep" in spec:  # the YAML form: a base config plus a `sweep:` section
        form = _sweep_section(spec.pop("sweep"), config)
        grid = {**(form.get("grid") or {}), **grid}
        zipped = {**(form.get("zip") or {}), **zipped}
        seeds = args.seeds_given or form.get("seeds", seeds)
        workers = args.workers_given or form.get("workers", workers)
        out = args.out_given or form.get("out", out)
        for key in ("baseline", "level", "test", "correction"):  # the command line's win, as for the keys above
            if getattr(args, key) is None and key in form:
                setattr(args, key, form[key] if key != "baseline" or isinstance(form[key], dict) else str(form[key]))
        if args.baseline is None and (keys := [k for k in ("level", "test", "correction") if k in form]):
            from fedweave.config import ConfigError

            # the key as the file spells it: the line sweep() would give names the flags, which were not given
            raise ConfigError(
                f"config file {config!r}: sweep.{keys[0]} applies to a comparison with a baseline point; give "
                "sweep.baseline or --baseline"
            )
    config = {} if spec is None else spec
    res = sweep(
        config,
        grid,
        zipped=zipped,
        seeds=seeds,
        workers=workers,
        out=out,
        overrides=args.overrides,
        metric=args.metric,
        target=args.target,
        progress=not args.no_progress,
        ray_address=args.ray,
        baseline=args.baseline,
        level=args.level,
        test=args.test,
        correction=args.correction,
    )
    print(res.table(), end="")
    print(f"sweep directory: {res.out_dir}")
    return 0


def _out_under_no_file(out: Path, allowed: str, folder: bool) -> None:
    """``--out`` that is a file (where ``folder``: the PNGs' folder) or lies under one is one line naming
    --out, before anything is written."""
    from fedweave.config import ConfigError
    from fedweave.results import file_in_the_way

    if what := file_in_the_way(out, folder=folder):
        raise ConfigError(f"--out: {out} {what}; {allowed}")


def _cmd_report(args: argparse.Namespace) -> int:
    from fedweave.experiments.report import write_report

    out = args.out or str(Path(args.dirs[0]) / "report.html")
    if args.out:
        _out_under_no_file(Path(out), "give an HTML file in a folder (made if missing)", folder=False)
    print(write_report(args.dirs, out))
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    """The one front end of every reproduction: the study's options on the CLI's parser, then its pipeline."""
    from fedweave.config import positive_int
    from fedweave.reproduce import study

    s = study(args.name)
    rp = Parser(prog=f"fedweave reproduce {args.name}", description=s.description)
    s.add_arguments(rp, positive_int)
    return s.execute(rp.parse_args(args.args), args.args)


FLOWER_EXTRA = ("flwr", "tomli_w")  # the modules of the flower extra these commands import


def _flower_extra_missing(command: str, e: ModuleNotFoundError) -> Exception:
    """The one line for a command of the ``flower`` extra run without it (any other missing module re-raises)."""
    from fedweave.config import ConfigError

    if (e.name or "").split(".")[0] not in FLOWER_EXTRA:
        raise e
    return ConfigError(
        f"fedweave {command} needs the flower extra (module {e.name!r} is missing): pip install 'fedweave[flower]'"
    )


def _cmd_flower_app(args: argparse.Namespace) -> int:
    from fedweave.config import load

    try:
        from fedweave.deploy.project import write_app
    except ModuleNotFoundError as e:
        raise _flower_extra_missing("flower-app", e) from e

    cfg = load(args.config, args.overrides)
    export = None
    if args.node_data:  # the node data are checked (data built, no file there) before the app is written
        from fedweave.deploy.node_data import plan_export
        from fedweave.deploy.support import check_deployable

        check_deployable(cfg, args.on_error)  # a refused run is refused as without --node-data, before the data
        export = plan_export(cfg, args.node_data)
    path = write_app(
        cfg, args.dir, run_dir=args.run_dir or "", on_error=args.on_error, reply_timeout=args.reply_timeout,
        node_wait=args.node_wait, overwrite=args.overwrite,
    )  # fmt: skip
    print(f"{path} (run it with: flwr run {args.dir} SUPERLINK)")
    if export is not None:
        files = export()
        print(f"{len(files)} node data files in {args.node_data} (flower-supernode --node-config \"partition-id=N "
              f"data='{args.node_data}/client-N.npz'\")")  # fmt: skip
    return 0


def _cmd_flower_executor(args: argparse.Namespace) -> int:
    from fedweave.deploy.executor import ExecutorError, serve

    try:
        serve(args.runtime_api_address, insecure=args.insecure, root_certificates=args.root_certificates,
              node_wait=args.node_wait)  # fmt: skip
    except ExecutorError as e:
        print(f"fedweave: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        raise _flower_extra_missing("flower-executor", e) from e
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, like every other bad input (docs/reliability.md)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"fedweave: error: {' '.join(message.split())} (see '{self.prog} --help')\n")


class Once(argparse.Action):
    """An option given at most once: ``--out a --out b`` took the last without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            parser.error(f"{option_string} is given twice ({given[self.dest]!r}, then {values!r}); give it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def parser() -> argparse.ArgumentParser:
    from fedweave import __version__
    from fedweave.config import positive_int

    p = Parser(prog="fedweave", description="Federated learning simulator.")
    p.add_argument("--version", action="version", version=f"fedweave {__version__}")
    sub = p.add_subparsers(dest="command")  # required: checked in _main, naming an unknown option first

    r = sub.add_parser("run", help="run an experiment from a YAML config")
    r.add_argument("config", nargs="?", help="YAML config file, or example:NAME for a bundled one")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. local.lr=0.1 rounds=50")
    r.add_argument(
        "--out", action=Once, help="run directory (default: the config's output.dir, else runs/<name>-s<seed>-<time>)"
    )
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--overwrite", action="store_true", help="replace a run already in the run directory")
    r.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="PATH_OR_MODULE",
        help="import a module or .py file that registers datasets, models, losses, metrics or samplers (repeatable)",
    )
    r.set_defaults(fn=_cmd_run)

    ls = sub.add_parser(
        "list",
        help="list algorithms, datasets, models, partitioners, losses, metrics, samplers, aggregators, attacks, "
        "reproductions",
    )
    ls.set_defaults(fn=_cmd_list)

    d = sub.add_parser("data", help="dataset files")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="{fetch,verify}")
    f = dsub.add_parser("fetch", help="fetch and verify datasets into the cache")
    f.add_argument("names", nargs="+", metavar="NAME", help="datasets to fetch, in order (`fedweave list` names them)")
    f.add_argument("--root", help="a directory that already holds the files")
    f.set_defaults(fn=_cmd_data)
    v = dsub.add_parser("verify", help="hash cached dataset files against their checksums now")
    v.add_argument("names", nargs="*", metavar="NAME", help="datasets to verify (default: every cached one)")
    v.set_defaults(fn=_cmd_verify)

    pl = sub.add_parser("plot", help="plot one or more run directories")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument(
        "--out", action=Once, help="where to write the PNGs (default: the run directory, when one run is plotted)"
    )
    pl.add_argument("--metric", default=None, help="metrics column (default: the run's main metric)")
    pl.set_defaults(fn=_cmd_plot)

    sw = sub.add_parser("sweep", help="run a config over a grid of values and seeds; tabulate and plot")
    sw.add_argument("config", help="YAML config (optionally with a `sweep:` section: grid, zip, seeds, ...)")
    sw.add_argument("overrides", nargs="*", help="key=value overrides applied to every point")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis (product)")
    sw.add_argument("--zip", action="append", default=[], metavar="KEY=V1,V2", help="keys varied together")
    sw.add_argument("--seeds", type=positive_int, default=None, help="seeds per point (the config's seed, +1, ...)")
    sw.add_argument("--workers", type=positive_int, default=None, help="runs at once, each with its share of cores")
    sw.add_argument(
        "--out", default=None, action=Once, help="sweep directory (default: the sweep section's out, else runs/sweep)"
    )
    sw.add_argument("--metric", default=None, help="metrics column to tabulate (default: the task's main metric)")
    sw.add_argument("--target", type=float, default=None, help="report rounds and bytes to reach this metric")
    sw.add_argument("--ray", metavar="ADDRESS", help="run the points as tasks on this existing Ray cluster")
    sw.add_argument(
        "--baseline",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="compare every point with this grid point, paired by seed (VALUE alone when the grid varies one key)",
    )
    sw.add_argument("--level", type=float, default=None, help="the comparison's confidence level (default 0.95)")
    sw.add_argument("--test", default=None, metavar="t|bootstrap", help="paired t interval (default) or bootstrap")
    sw.add_argument(
        "--correction",
        default=None,
        metavar="holm|bonferroni|none",
        help="correct the comparisons with the baseline for their number (family-wise at --level); "
        "default: none, each point's interval at --level on its own",
    )
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(fn=_cmd_sweep)

    rep = sub.add_parser(
        "report", help="one self-contained HTML page for run and sweep directories (finished or not), curves overlaid"
    )
    rep.add_argument("dirs", nargs="+", metavar="RUN_OR_SWEEP_DIR")
    rep.add_argument("--out", action=Once, help="the HTML file (default: report.html in the first directory)")
    rep.set_defaults(fn=_cmd_report)

    rp = sub.add_parser("reproduce", help="reproduce a paper's experiments at a chosen scale")
    rp.add_argument("name")
    rp.add_argument("args", nargs=argparse.REMAINDER)
    rp.set_defaults(fn=_cmd_reproduce)

    fa = sub.add_parser("flower-app", help="write a Flower app project that runs a config on SuperNodes")
    fa.add_argument("config", help="YAML config file")
    fa.add_argument("dir", help="directory for the app project")
    fa.add_argument("overrides", nargs="*", help="key=value overrides")
    fa.add_argument("--run-dir", action=Once,
                    help="results directory on the SuperLink's machine (default: the config's)")  # fmt: skip
    fa.add_argument("--on-error", choices=("stop", "drop"), default="stop", action=Once,
                    help="a client's error reply or missing reply: stop the run, or go on without the client "
                    "for that round as a dropout (default: stop)")  # fmt: skip
    fa.add_argument("--reply-timeout", type=positive_seconds, default=600.0, action=Once,
                    help="seconds a round waits for its replies")  # fmt: skip
    fa.add_argument("--node-wait", type=positive_seconds, default=120.0, action=Once,
                    help="seconds to wait for the SuperNodes at start")  # fmt: skip
    fa.add_argument("--overwrite", action="store_true",
                    help="write into a directory that is not empty (its pyproject.toml and fedweave_app.py are "
                    "replaced; its other files are left alone)")  # fmt: skip
    fa.add_argument("--node-data", metavar="DIR", action=Once,
                    help="also write each client's training samples as DIR/client-N.npz, data files for the nodes "
                    "(a trial of nodes that hold their own data)")  # fmt: skip
    fa.set_defaults(fn=_cmd_flower_app)

    fx = sub.add_parser("flower-executor",
                        help="run the ClientApp tasks of a SuperNode started with --isolation process, one forked "
                        "child per message from one warm process")  # fmt: skip
    fx.add_argument("--runtime-api-address", required=True, metavar="HOST:PORT", action=Once,
                    help="the SuperNode's Runtime API (its --port)")  # fmt: skip
    fx.add_argument("--insecure", action="store_true", help="talk to the SuperNode without TLS")
    fx.add_argument("--root-certificates", metavar="FILE", action=Once,
                    help="CA certificate of the SuperNode's Runtime API")  # fmt: skip
    fx.add_argument("--node-wait", type=positive_seconds, default=None, action=Once, metavar="SECONDS",
                    help="give up when the SuperNode has not answered for this long, at start or later (default: "
                    "wait for it)")  # fmt: skip
    fx.set_defaults(fn=_cmd_flower_executor)
    return p


def _os_error(e: OSError) -> str:
    """One line for a file-system failure: which file and what the system said."""
    where = f"{e.filename}: " if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"{where}no space left on device; files already written are intact (free space, then resume or rerun)"
    return f"{where}{e.strerror or _one_line(e)}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt (a run stops the same way and says which signal)."""

    signal_name = "SIGTERM"


def _sigterm(signum, frame) -> None:  # noqa: ARG001
    raise Terminated("terminated")


def _exit_at_once(signum, frame) -> None:  # noqa: ARG001
    """A signal once the command is over (the interpreter joining pool workers, flushing trackers): exit now
    with the signal's status, saying so unless an interruption was already reported."""
    if not _reported:
        os.write(2, b"fedweave: interrupted\n")
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # a closed pipe, or a flush this signal cut
        sys.stdout.flush()
    os._exit(128 + signum)


def _end() -> None:
    """The program's last exit handler, run once every other one has (pool workers joined, trackers closed):
    exit now with the command's status. What the interpreter does after it only frees memory (seconds after a
    large run) and runs no Python signal handler: a Ctrl-C there ended the process as -2, without a word."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(_status)


_status = 1  # the program's exit status for _end (1 if main ends in an exception it does not handle)
_reported = False  # an interruption has been reported: a later signal adds no second line


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


_PACKAGE = Path(__file__).resolve().parent
_python_warning = warnings.formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """fedweave's own warnings (``ignoring root=...``, a replaced cache file) as one line, as its errors are;
    the others as Python writes them (two lines: where, and the source line)."""
    if category is UserWarning and Path(filename).resolve().is_relative_to(_PACKAGE):
        return f"fedweave: warning: {message}\n"
    return _python_warning(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``: its arguments; None: this process's own, as the program). Bad input ends
    in one line and status 2; Ctrl-C or SIGTERM, at any moment from the first import on, in one line and
    status 130 or 143."""
    global _status
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        previous = signal.getsignal(signal.SIGINT), signal.signal(signal.SIGTERM, _sigterm)
        if argv is None:  # registered first, so that it runs after every exit handler of what is imported later
            atexit.register(_end)
            warnings.formatwarning = _one_line_warning
    code = 1  # the status of an exception not handled here
    try:
        code = _main(argv)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: while importing, building, running or stopping a run
        code = _interrupted(e, on_main_thread)
    except Exception as e:
        # an interrupt that Python wrapped on its way (a class being created during an import wraps whatever
        # it raises in a RuntimeError) is still an interrupt
        cause = e.__cause__ or e.__context__
        while cause is not None and not isinstance(cause, KeyboardInterrupt):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        code = _interrupted(cause, on_main_thread)
    except SystemExit as e:  # argparse's --help, --version and usage errors
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    finally:
        _status = code
        if on_main_thread:
            if argv is None:  # the program: only the interpreter's shutdown is left, and a signal ends it at once
                for sig in (signal.SIGINT, signal.SIGTERM):
                    if signal.getsignal(sig) is not signal.SIG_IGN:
                        signal.signal(sig, _exit_at_once)
            else:  # called in-process: leave the caller's handlers as they were
                for sig, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
                    if handler is not None:  # None: a handler not set from Python, which cannot be put back
                        signal.signal(sig, handler)
    return code


def _interrupted(e: KeyboardInterrupt, on_main_thread: bool) -> int:
    """Report an interrupt in one line; its exit status (130, or 143 for SIGTERM)."""
    global _reported
    if on_main_thread:  # a second signal while this is reported must not end in a traceback
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, _exit_at_once)
    detail = _one_line(e) if str(e) else ""
    print(f"fedweave: interrupted{': ' + detail if detail else ''}", file=sys.stderr, flush=True)
    _reported = True
    return 143 if getattr(e, "signal_name", "SIGINT") == "SIGTERM" else 130


def _main(argv: list[str] | None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.command is None:  # `fedweave --bogus` said only that a command is required
        commands = ", ".join(p._subparsers._group_actions[0].choices)
        unknown = f"unrecognized arguments: {' '.join(extra)}; " if extra else ""
        p.error(f"{unknown}a command is required: one of {commands}")
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides += extra  # key=value overrides after the options (`run C --out D rounds=5`)
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "out", None) is not None and not args.out.strip():  # an unset $OUT wrote into ./runs/
        p.error(f"--out {args.out!r}: an empty path; give a {'file' if args.command == 'report' else 'directory'}")
    if args.command == "flower-app":  # an unset $APP wrote the app into ./; --node-data "" wrote no data
        for flag, path in (("DIR", args.dir), ("--run-dir", args.run_dir), ("--node-data", args.node_data)):
            if path is not None and not path.strip():
                p._subparsers._group_actions[0].choices[args.command].error(
                    f"{flag} {path!r}: an empty path; give a directory"
                )
    if args.command == "sweep":  # remember which were given, so they win over a YAML `sweep:` section
        args.seeds_given, args.workers_given, args.out_given = args.seeds, args.workers, args.out
        args.seeds, args.workers, args.out = args.seeds or 1, args.workers or 1, args.out or "runs/sweep"
    import pickle

    from fedweave.config import ConfigError
    from fedweave.data.sources import DataSourceError
    from fedweave.errors import WorkerLost
    from fedweave.experiments.jobs import RunFailed
    from fedweave.registry import UnknownNameError
    from fedweave.results import RunDirError
    from fedweave.runner import CheckpointError, DivergenceError

    try:
        return args.fn(args)
    except (
        ConfigError,
        UnknownNameError,
        DivergenceError,
        CheckpointError,
        RunDirError,
        FileNotFoundError,
        DataSourceError,
        pickle.UnpicklingError,
        RunFailed,
        WorkerLost,
    ) as e:
        print(f"fedweave: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fedweave: error: {_os_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
