"""Property-based tests of the configuration: any wrong type, unknown key or out-of-range value ends in one
ConfigError that names the key (one line), never another exception; the CLI prints it and exits 2."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedweave.algorithms  # noqa: F401  (registers the algorithms)
from fedweave.cli import main as cli_main
from fedweave.config import (
    ConfigError,
    EvalConfig,
    FaultsConfig,
    LocalConfig,
    OutputConfig,
    RunConfig,
    build_dataclass,
    check_options,
    load,
)
from fedweave.registry import ALGORITHMS, DATASETS, MODELS, PARTITIONERS

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

BASE = {
    "name": "fuzz",
    "dataset": {"name": "digits"},
    "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 2},
    "output": {"progress": False, "plots": False},
}

# Every typed key of the fixed sections: (dotted key, section, field name).
TOP = [f.name for f in dataclasses.fields(RunConfig) if f.name not in ("dataset", "partition", "model", "algorithm")]
SECTIONS = {"local": LocalConfig, "eval": EvalConfig, "output": OutputConfig, "faults": FaultsConfig}
TYPED_KEYS = [(k, None, k) for k in TOP if k not in SECTIONS] + [
    (f"{s}.{f.name}", s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 0.5, -0.5, 1e-300, 1e300, 2**63, "", "0", "1e-3", "null", "loop", "drop"]),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _set(key: str, section: str | None, name: str, value: object) -> dict:
    data = copy.deepcopy(BASE)
    if section is None:
        data[name] = value
    else:
        data.setdefault(section, {})[name] = value
    return data


def _assert_clear(err: ConfigError, key: str) -> None:
    msg = str(err)
    assert key in msg, f"the error does not name {key!r}: {msg}"
    assert len(msg.splitlines()) == 1, msg


def _valid(value: object, tp: object) -> bool:
    """Is ``value`` (as accepted) of the annotated type? (the config may coerce int -> float, list -> tuple)"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, type(int | None)):
        return any(_valid(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_valid(v, typing.get_args(tp)[0]) for v in value)
    if tp is float:
        return isinstance(value, float)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)  # type: ignore[arg-type]


# Values every typed key is tried with (deterministic sweep), before the random ones.
NASTY = [
    None,
    True,
    -1,
    0,
    10**30,
    -0.5,
    1.5,
    float("nan"),
    float("inf"),
    -float("inf"),
    "",
    "x",
    [],
    [1, "a"],
    {"a": 1},
]


def _check_typed(key: str, section: str | None, name: str, value: object) -> None:
    try:
        cfg = load(_set(key, section, name, value))
    except ConfigError as e:
        _assert_clear(e, key)
        return
    obj = cfg if section is None else getattr(cfg, section)
    tp = typing.get_type_hints(type(obj))[name]
    assert _valid(getattr(obj, name), tp), f"{key}={value!r} accepted as {getattr(obj, name)!r}"
    for f in dataclasses.fields(obj):  # accepted floats are finite: NaN/Inf never slip through
        v = getattr(obj, f.name)
        assert not (isinstance(v, float) and not math.isfinite(v)), f"{key}: {f.name}={v!r} accepted"


def test_every_typed_key_with_nasty_values_loads_or_names_the_key():
    for key, section, name in TYPED_KEYS:
        for value in NASTY:
            _check_typed(key, section, name, value)


@settings(FUZZ, max_examples=300)
@given(spec=st.sampled_from(TYPED_KEYS), value=values)
def test_any_value_of_a_typed_key_loads_or_names_the_key(spec, value):
    _check_typed(*spec, value)


@settings(FUZZ, max_examples=200)
@given(
    section=st.sampled_from([None, *SECTIONS]),
    bad=st.one_of(st.text(min_size=1, max_size=12), st.integers(), st.booleans(), st.none()),
)
def test_unknown_keys_are_named(section, bad):
    allowed = TOP if section is None else [f.name for f in dataclasses.fields(SECTIONS[section])]
    if bad in allowed or (section is None and bad in ("dataset", "partition", "model", "algorithm")):
        return
    data = _set("", section, bad, 1) if section else {**copy.deepcopy(BASE), bad: 1}
    with pytest.raises(ConfigError) as e:
        load(data)
    _assert_clear(e.value, f"unknown key {(section + '.' if section else '') + str(bad)!r}")


@FUZZ
@given(section=st.sampled_from(list(SECTIONS)), value=scalars)
def test_a_section_that_is_not_a_mapping_is_named(section, value):
    if value is None:
        return  # null = the defaults
    with pytest.raises(ConfigError) as e:
        load({**BASE, section: value})
    _assert_clear(e.value, section)


@FUZZ
@given(section=st.sampled_from(["dataset", "partition", "model", "algorithm"]), value=values)
def test_named_sections_reject_anything_but_a_name_or_mapping_with_a_name(section, value):
    data = {**BASE, section: value}
    try:
        cfg = load(data)
    except ConfigError as e:
        _assert_clear(e, section)
        return
    assert isinstance(getattr(cfg, section).name, str)


@FUZZ
@given(text=st.text(max_size=24))
def test_overrides_are_parsed_or_refused_clearly(text):
    try:
        load(BASE, [text])
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg
        if "=" in text and text.split("=", 1)[0]:
            key = text.split("=", 1)[0]
            assert key.split(".")[0] in msg or "override" in msg, msg


# ---- options of the registered objects --------------------------------------------------------------
def _options(fn, skip=()) -> list[str]:
    import inspect

    sig = inspect.signature(fn)
    return [
        n for n, p in sig.parameters.items() if n not in skip and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


OPTION_KEYS = (
    [("dataset", n, k) for n in DATASETS.names() for k in _options(DATASETS.get(n))]
    + [
        ("partition", n, k)
        for n in PARTITIONERS.names()
        for k in _options(PARTITIONERS.get(n), ("labels", "num_clients", "rng", "users"))
    ]
    + [("model", n, k) for n in MODELS.names() for k in _options(MODELS.get(n), ("input_shape", "num_classes"))]
)


def _check_option(section: str, name: str, key: str, value: object) -> None:
    reg = {"dataset": DATASETS, "partition": PARTITIONERS, "model": MODELS}[section]
    try:
        check_options(reg.get(name), {key: value}, section)
    except ConfigError as e:
        _assert_clear(e, f"{section}.{key}")


def _check_hparam(name: str, key: str, value: object) -> None:
    try:
        build_dataclass(ALGORITHMS.get(name).Hparams, {key: value}, "algorithm")
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and "algorithm." in msg, f"{name}: {msg}"


HPARAM_KEYS = [(n, f.name) for n in ALGORITHMS.names() for f in dataclasses.fields(ALGORITHMS.get(n).Hparams)]


def test_every_option_and_hyperparameter_with_nasty_values():
    """Loader, partitioner and model options are type-checked by name; an algorithm's hyper-parameters load
    or fail with a ConfigError naming ``algorithm.<key>`` (never a TypeError from inside the dataclass)."""
    for value in (None, True, -1, 10**30, float("nan"), "x", [1, "a"], {"a": 1}):
        for spec in OPTION_KEYS:
            _check_option(*spec, value)
        for spec in HPARAM_KEYS:
            _check_hparam(*spec, value)


@settings(FUZZ, max_examples=150)
@given(spec=st.sampled_from(OPTION_KEYS), value=values)
def test_object_options_are_type_checked_by_name(spec, value):
    _check_option(*spec, value)


@settings(FUZZ, max_examples=150)
@given(spec=st.sampled_from(HPARAM_KEYS), value=values)
def test_algorithm_hyperparameters_load_or_name_the_key(spec, value):
    _check_hparam(*spec, value)


# ---- the command line -------------------------------------------------------------------------------
never_valid = st.one_of(
    st.builds(lambda k, v: {"local": {k: v}}, st.sampled_from(["lr", "epochs", "momentum"]), st.text(max_size=5)),
    st.builds(
        lambda v: {"rounds": v},
        st.one_of(st.text(min_size=1, max_size=5), st.dictionaries(st.text(), st.integers(), min_size=1)),
    ),
    st.builds(lambda v: {"faults": {"dropout": v}}, st.floats(min_value=1.0001, allow_infinity=True)),
    st.builds(
        lambda k: {"eval": {k: 1}},
        st.text(min_size=1, max_size=8).filter(lambda k: k not in ("every", "batch_size", "per_client")),
    ),
)


@settings(FUZZ, max_examples=15)
@given(bad=never_valid)
def test_cli_prints_one_line_and_exits_2(tmp_path, capsys, bad):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASE, **bad}))
    assert cli_main(["run", str(path), "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fedweave: error: ")
    assert list(bad)[0] in err


@pytest.mark.parametrize(
    "text, key",
    [
        ("rounds: [1, 2\n", "not valid YAML"),
        ("- a\n- b\n", "must be a mapping"),
        ("local: {lr: .nan}\n", "local.lr"),
        ("faults: {deadline: .inf}\n", "faults.deadline"),
        ("local: {augment: [rotate]}\n", "local.augment[0]"),
    ],
)
def test_cli_file_errors_are_one_line(tmp_path, capsys, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli_main(["run", str(path), "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and key in err


def test_cli_non_utf8_config_and_bad_override(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"rounds: \xff\xfe\n")
    assert cli_main(["run", str(path), "--no-progress"]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(BASE))
    assert cli_main(["run", str(path), "local.lr=[0.1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "local.lr" in err
