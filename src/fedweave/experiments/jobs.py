"""Run a sweep's points: in parallel processes with the cores divided, skipping finished runs, resuming
killed ones from their checkpoints, and recording a diverged run as a result."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from fedweave.experiments.grid import Point


def _run_one(config: dict[str, Any], run_dir: str, threads: int) -> dict[str, Any]:
    """Run (or resume, or recognise as finished) one point; returns its summary. Runs in a worker process."""
    import torch

    from fedweave.config import ConfigError, load
    from fedweave.runner import CHECKPOINT, finished_run, run

    cfg = load(config)
    done = finished_run(run_dir, cfg)
    if done is not None:
        return done.summary
    if cfg.threads is None:
        torch.set_num_threads(threads)
    resumable = (Path(run_dir) / CHECKPOINT).is_file()
    if resumable:
        try:
            return run(cfg, run_dir=run_dir, progress=False, resume=True, on_divergence="return").summary
        except ConfigError:  # a checkpoint of another config: start this point again
            pass
    return run(cfg, run_dir=run_dir, progress=False, on_divergence="return").summary


def threads_per_worker(workers: int) -> int:
    """The machine's cores divided among the workers (at least one thread each)."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def run_points(
    points: list[Point],
    runs_dir: str | Path,
    *,
    workers: int = 1,
    progress: bool = True,
    ray_address: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every point into ``runs_dir/<point.slug>``; returns ``{slug: summary}``. ``workers`` processes run
    at once, each with its share of the cores; with ``ray_address`` the points are Ray tasks on that existing
    cluster instead (one CPU each; ``runs_dir`` must be on storage its nodes share)."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    threads = threads_per_worker(workers)
    jobs = {p.slug: (p.config.to_dict(), str(runs_dir / p.slug), threads) for p in points}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), unit="run", dynamic_ncols=True, file=sys.stderr, desc="sweep")
    out: dict[str, dict[str, Any]] = {}
    try:
        if ray_address is not None:
            _on_ray(jobs, out, ray_address, bar)
        elif workers <= 1:
            for slug, args in jobs.items():
                out[slug] = _run_one(*args)
                if bar is not None:
                    bar.update(1)
        else:
            # fork: the workers see what this process registered (datasets, models, algorithms)
            with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as pool:
                pending = {pool.submit(_run_one, *args): slug for slug, args in jobs.items()}
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        out[pending.pop(f)] = f.result()
                        if bar is not None:
                            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return {slug: out[slug] for slug in jobs}


def _on_ray(jobs: dict[str, tuple], out: dict[str, dict[str, Any]], address: str, bar: Any) -> None:
    import ray

    from fedweave.execution.ray import LOCAL_RAY_ENV

    if not ray.is_initialized():
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(address=address)
    task = ray.remote(num_cpus=1)(_run_one)
    pending = {task.remote(cfg, run_dir, 1): slug for slug, (cfg, run_dir, _) in jobs.items()}
    while pending:
        finished, _ = ray.wait(list(pending), num_returns=1)
        for ref in finished:
            out[pending.pop(ref)] = ray.get(ref)
            if bar is not None:
                bar.update(1)
