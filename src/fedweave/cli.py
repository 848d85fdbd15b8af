"""The ``fedweave`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from fedweave.config import load
    from fedweave.runner import resume, run

    if args.resume:
        res = resume(args.resume, progress=not args.no_progress)
    else:
        if not args.config:
            raise SystemExit("fedweave run: give a CONFIG file (or --resume RUN_DIR)")
        cfg = load(args.config, args.overrides)
        res = run(cfg, run_dir=args.out, progress=False if args.no_progress else None)
    s = res.summary
    acc = s.get("final_test_accuracy")
    comm = s["communication"]
    print(f"run directory: {res.run_dir}")
    if acc is not None:
        print(f"final test accuracy {acc:.4f} (best {s['best_test_accuracy']:.4f} at round {s['best_round']})")
    print(
        f"communication: {comm['bytes_up'] / 2**20:.1f} MiB up, {comm['bytes_down'] / 2**20:.1f} MiB down, "
        f"{comm['bytes_lateral'] / 2**20:.1f} MiB lateral; wall {s['wall_seconds']:.1f} s"
    )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from fedweave.registry import ALGORITHMS, DATASETS, MODELS, PARTITIONERS
    from fedweave.reproduce import available

    for title, reg in (
        ("algorithms", ALGORITHMS),
        ("datasets", DATASETS),
        ("models", MODELS),
        ("partitioners", PARTITIONERS),
    ):
        print(f"{title}: {', '.join(reg.names())}")
    print(f"reproductions: {', '.join(available())}")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from fedweave.data.sources import fetch

    path = fetch(args.name, root=args.root)
    print(f"{args.name}: {path}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from fedweave.plots import plot_runs

    out = Path(args.out) if args.out else Path(args.run_dirs[0])
    runs = []  # a sweep directory stands for all its runs
    for d in map(Path, args.run_dirs):
        runs += sorted((d / "runs").iterdir()) if (d / "sweep.json").is_file() else [d]
    for p in plot_runs(runs, out, metric=args.metric):
        print(p)
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    import yaml

    from fedweave.experiments import parse_grid, sweep

    config, grid, zipped = args.config, parse_grid(args.grid), parse_grid(args.zip, "--zip")
    seeds, workers, out = args.seeds, args.workers, args.out
    spec = yaml.safe_load(Path(config).read_text()) if Path(config).is_file() else None
    if isinstance(spec, dict) and "sweep" in spec:  # the YAML form: a base config plus a `sweep:` section
        form = dict(spec.pop("sweep") or {})
        unknown = set(form) - {"grid", "zip", "seeds", "workers", "out"}
        if unknown:
            raise SystemExit(
                f"fedweave sweep: {config}: unknown sweep key {sorted(unknown)[0]!r} "
                "(allowed: grid, zip, seeds, workers, out)"
            )
        grid = {**(form.get("grid") or {}), **grid}
        zipped = {**(form.get("zip") or {}), **zipped}
        seeds = args.seeds_given or form.get("seeds", seeds)
        workers = args.workers_given or form.get("workers", workers)
        out = args.out_given or form.get("out", out)
        config = spec
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
    )
    print(res.table(), end="")
    print(f"sweep directory: {res.out_dir}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from fedweave.experiments.report import write_report

    out = args.out or str(Path(args.dirs[0]) / "report.html")
    print(write_report(args.dirs, out))
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from fedweave.reproduce import main as reproduce_main

    return reproduce_main(args.name, args.args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedweave", description="Federated learning simulator.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run an experiment from a YAML config")
    r.add_argument("config", nargs="?", help="YAML config file")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. local.lr=0.1 rounds=50")
    r.add_argument("--out", help="run directory (default: runs/<name>-s<seed>-<time>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(fn=_cmd_run)

    ls = sub.add_parser("list", help="list algorithms, datasets, models, partitioners, reproductions")
    ls.set_defaults(fn=_cmd_list)

    d = sub.add_parser("data", help="dataset files")
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="fetch and verify a dataset into the cache")
    f.add_argument("name")
    f.add_argument("--root", help="a directory that already holds the files")
    f.set_defaults(fn=_cmd_data)

    pl = sub.add_parser("plot", help="plot one or more run directories")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument("--out", help="where to write the PNGs (default: the first run directory)")
    pl.add_argument("--metric", default="test_accuracy")
    pl.set_defaults(fn=_cmd_plot)

    sw = sub.add_parser("sweep", help="run a config over a grid of values and seeds; tabulate and plot")
    sw.add_argument("config", help="YAML config (optionally with a `sweep:` section: grid, zip, seeds, ...)")
    sw.add_argument("overrides", nargs="*", help="key=value overrides applied to every point")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis (product)")
    sw.add_argument("--zip", action="append", default=[], metavar="KEY=V1,V2", help="keys varied together")
    sw.add_argument("--seeds", type=int, default=None, help="seeds per point (the config's seed, +1, ...)")
    sw.add_argument("--workers", type=int, default=None, help="runs at once, each with its share of cores")
    sw.add_argument("--out", default=None, help="sweep directory (default runs/sweep)")
    sw.add_argument("--metric", default="test_accuracy")
    sw.add_argument("--target", type=float, default=None, help="report rounds and bytes to reach this metric")
    sw.add_argument("--ray", metavar="ADDRESS", help="run the points as tasks on this existing Ray cluster")
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(fn=_cmd_sweep)

    rep = sub.add_parser("report", help="one self-contained HTML page for run and sweep directories")
    rep.add_argument("dirs", nargs="+", metavar="RUN_OR_SWEEP_DIR")
    rep.add_argument("--out", help="the HTML file (default: report.html in the first directory)")
    rep.set_defaults(fn=_cmd_report)

    rp = sub.add_parser("reproduce", help="reproduce a paper's experiments at a chosen scale")
    rp.add_argument("name")
    rp.add_argument("args", nargs=argparse.REMAINDER)
    rp.set_defaults(fn=_cmd_reproduce)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and args.command == "sweep" and not any(e.startswith("-") for e in extra):
        args.overrides += extra  # key=value overrides after the options
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "sweep":  # remember which were given, so they win over a YAML `sweep:` section
        args.seeds_given, args.workers_given, args.out_given = args.seeds, args.workers, args.out
        args.seeds, args.workers, args.out = args.seeds or 1, args.workers or 1, args.out or "runs/sweep"
    import pickle

    from fedweave.config import ConfigError
    from fedweave.data.sources import DataSourceError
    from fedweave.registry import UnknownNameError
    from fedweave.runner import DivergenceError

    try:
        return args.fn(args)
    except (
        ConfigError,
        UnknownNameError,
        DivergenceError,
        FileNotFoundError,
        DataSourceError,
        pickle.UnpicklingError,
    ) as e:
        print(f"fedweave: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
