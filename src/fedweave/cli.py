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
    for p in plot_runs(args.run_dirs, out, metric=args.metric):
        print(p)
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from fedweave.reproduce import main as reproduce_main

    return reproduce_main(args.name, args.args)


def _cmd_flower_app(args: argparse.Namespace) -> int:
    from fedweave.config import load
    from fedweave.deploy.project import write_app

    cfg = load(args.config, args.overrides)
    path = write_app(cfg, args.dir, run_dir=args.run_dir or "")
    print(f"{path} (run it with: flwr run {args.dir} SUPERLINK)")
    return 0


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

    rp = sub.add_parser("reproduce", help="reproduce a paper's experiments at a chosen scale")
    rp.add_argument("name")
    rp.add_argument("args", nargs=argparse.REMAINDER)
    rp.set_defaults(fn=_cmd_reproduce)

    fa = sub.add_parser("flower-app", help="write a Flower app project that runs a config on SuperNodes")
    fa.add_argument("config", help="YAML config file")
    fa.add_argument("dir", help="directory for the app project")
    fa.add_argument("overrides", nargs="*", help="key=value overrides")
    fa.add_argument("--run-dir", help="results directory on the SuperLink's machine (default: the config's)")
    fa.set_defaults(fn=_cmd_flower_app)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
