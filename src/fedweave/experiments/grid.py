"""A sweep's points: a base config crossed with a grid of key values (zipped keys vary together) and seeds."""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedweave.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    load,
    read_yaml_file,
    split_values,
    yaml_load,
)

SLUG_MAX = 200  # characters (ASCII) of a run directory's name: below the 255 bytes a file name may have


class GridError(ConfigError):
    """A grid key or value that cannot make a valid config; raised before anything runs."""


@dataclass(frozen=True)
class Point:
    """One run of a sweep: the grid values it sets (without the seed), its seed and its resolved config.
    ``name``, when given, is its run directory under the sweep's runs directory (a path that may hold
    ``/``); a reproduction names its runs so, to keep the layout its users' finished runs already have."""

    values: tuple[tuple[str, Any], ...]
    seed: int
    config: RunConfig
    name: str | None = None

    @classmethod
    def of(cls, config: dict[str, Any], name: str | None = None, **values: Any) -> Point:
        """A point from a config written out in full (a reproduction's run), labelled by ``values``."""
        cfg = load(config)
        return cls(tuple(values.items()), cfg.seed, cfg, name)

    @property
    def label(self) -> str:
        """The grid values as ``key=value,...``: what the runs of one point over seeds share."""
        return ",".join(f"{k}={_text(v)}" for k, v in self.values) or "base"

    @property
    def slug(self) -> str:
        """This run's directory under the runs directory: its ``name``, else the label and the seed made
        filesystem-safe; a label too long for a file name (255 bytes: a long list value, many keys) is cut and
        told apart by a digest of it, the seed kept last."""
        if self.name is not None:
            return self.name
        slug = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", f"{self.label},seed={self.seed}")
        if len(slug) <= SLUG_MAX:
            return slug
        digest = hashlib.sha256(self.label.encode()).hexdigest()[:16]
        return f"{slug[: SLUG_MAX - 48]}~{digest},seed={self.seed}"


def _text(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def parse_grid(items: list[str], flag: str = "--grid") -> dict[str, list[Any]]:
    """``["KEY=V1,V2", ...]`` -> ``{KEY: [V1, V2]}``; each value is read as a config's YAML is (``0.1`` and
    ``1e-3`` are numbers, ``012`` is 12), so a grid value means what the same ``key=value`` override means.
    The values are cut at the commas outside brackets and quotes (:func:`~fedweave.config.split_values`), so a
    list or a mapping is one value: ``model.hidden=[64],[128,64]`` has the two values ``[64]`` and ``[128, 64]``."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        if "=" not in item or not item.split("=", 1)[0]:
            raise GridError(f"{flag} {item!r} must look like KEY=V1,V2 (e.g. local.lr=0.01,0.1)")
        key, raw = item.split("=", 1)
        if key in grid:
            raise GridError(f"{flag} key {key!r} is given twice")
        try:
            pieces = split_values(raw)  # a cut at every comma broke [128,64] into '[128' and '64]'
        except ConfigError as e:
            raise GridError(f"{flag} {key}: {e}") from e
        try:
            # the config's loader: PyYAML's own (YAML 1.1) read 012 as octal 10 and 1e3 as a string
            values = [yaml_load(v) for v in pieces]
        except (yaml.YAMLError, RecursionError, ConfigError) as e:  # RecursionError: thousands of nested brackets
            raise GridError(f"{flag} {key}: a value is not valid YAML ({e})") from e
        if not values or raw == "":
            raise GridError(f"{flag} {key!r} has no values")
        grid[key] = values
    return grid


def _overlap(a: str, b: str) -> bool:
    """Whether dotted keys ``a`` and ``b`` are one key or one holds the other (``local`` and ``local.lr``)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def expand(
    base: str | Path | dict[str, Any],
    grid: dict[str, list[Any]] | None = None,
    *,
    zipped: dict[str, list[Any]] | None = None,
    seeds: int = 1,
    overrides: list[str] | None = None,
) -> list[Point]:
    """Every point of the sweep: the product of the ``grid`` keys, with all ``zipped`` keys varying together
    (one list position at a time), each for ``seeds`` seeds (the base seed, +1, ...). Every config is resolved
    and validated against the config schema here, so a bad key or value of it fails with one line naming it
    before anything runs; the names a point gives (an algorithm, a dataset, a partitioner, a model, a sampler)
    and their options are the runner's to check, which :func:`~fedweave.experiments.jobs.check_points` does for
    every point before a sweep's first run starts."""
    for name, axes in (("grid", grid), ("zipped", zipped)):  # from Python: a scalar gave a TypeError, [] an IndexError
        if axes is not None and not isinstance(axes, Mapping):
            # not a key's value: a falsy one (0, [], "") ran the base config as if no grid was given
            raise GridError(
                f"{name} must map each key to a non-empty list of values (e.g. {{'local.lr': [0.01, 0.1]}}); "
                f"got {type(axes).__name__} {axes!r}"[:200]
            )
        for k, v in (axes or {}).items():
            if not isinstance(k, str) or not isinstance(v, list | tuple) or not v:
                raise GridError(
                    f"{name} must map each key to a non-empty list of values (e.g. {{'local.lr': [0.01, 0.1]}}); "
                    f"got {k!r}: {v!r}"[:200]
                )
    if overrides is not None and not isinstance(overrides, list | tuple):  # a string was read letter by letter
        got = repr(overrides) if isinstance(overrides, str) else type(overrides).__name__
        raise GridError(f"overrides must be a list of key=value strings, e.g. ['local.lr=0.1']; got {got}")
    grid, zipped = dict(grid or {}), dict(zipped or {})
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise GridError(f"seeds must be a whole number >= 1, got {seeds!r}")
    if "seed" in grid or "seed" in zipped:
        raise GridError("the grid may not set 'seed': use seeds N (runs the base seed and the next N-1)")
    if swept := next((k for k in (*grid, *zipped) if k in ("output", "output.dir")), None):
        # the sweep places each point's run itself: the points ran alike, and config.yaml named a folder never used
        raise GridError(f"the grid may not set {swept!r}: each point runs in the sweep's folder, runs/<point>")
    both = set(grid) & set(zipped)
    if both:
        raise GridError(f"key {sorted(both)[0]!r} is both a grid key and a zipped key")
    lengths = {k: len(v) for k, v in zipped.items()}
    if len(set(lengths.values())) > 1:
        raise GridError(f"zipped keys must have equally many values, got {lengths}")
    data = read_yaml_file(base) if not isinstance(base, dict) else base  # duplicate keys refused, as in a run
    if isinstance(data, dict) and "sweep" in data:  # the loader's line would speak of a single run
        raise GridError(
            "sweep: fedweave.sweep takes the grid, seeds and the rest as its arguments, not from a config's sweep "
            "section; pass the config without it, or run the file with 'fedweave sweep CONFIG', which reads it"
        )
    for o in overrides or []:  # the grid's values are set over the overrides: an override of a grid key was lost
        key = str(o).partition("=")[0].strip()
        if hit := next((k for k in (*grid, *zipped) if _overlap(k, key)), None):
            raise GridError(
                f"override {o!r} sets {key!r}, and the sweep's grid sets {hit!r} for every point over it (the "
                "override's value would never be used); give each key's values in one place"
            )
    data = apply_overrides(data, overrides or [])
    base_seed = load(data).seed
    zip_rows = [tuple(zip(zipped, vs)) for vs in zip(*zipped.values())] or [()]
    grid_rows = [tuple(zip(grid, vs)) for vs in itertools.product(*grid.values())]
    points = []
    for g in grid_rows:
        for z in zip_rows:
            values = g + z
            for i in range(seeds):
                sets = [f"{k}={_text(v)}" for k, v in values]
                try:
                    cfg = load(apply_overrides(data, [*sets, f"seed={base_seed + i}"]))
                except ConfigError as e:
                    where = ",".join(f"{k}={_text(v)}" for k, v in values)
                    raise GridError(f"sweep point {where}: {e}") from e
                points.append(Point(values, base_seed + i, cfg))
    # a value given twice (0.1,0.1, or 0.1,0.10 read as one number) would make two runs of one directory: the
    # second found the first's finished run and was refused as "another config" after the first had run
    seen: dict[str, str] = {}
    for p in points:
        if p.slug in seen:
            what = f"sweep point {p.label} is given twice"
            if seen[p.slug] != p.label:  # distinct values whose directory names agree once made filesystem-safe
                what = f"sweep points {seen[p.slug]} and {p.label} would share the run directory {p.slug}"
            raise GridError(f"{what}; give each grid value (and each zipped row) once")
        seen[p.slug] = p.label
    return points
