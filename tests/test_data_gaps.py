"""The data layer's bad input: user files that a resume must digest, a partitioner that reads no labels, option
types, files that a parser overflows on, label dtypes. Each case is one line naming what is wrong."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import fedweave
from fedweave.config import ConfigError
from fedweave.data.base import Dataset
from fedweave.data.datasets._common import loads_user_files
from fedweave.registry import DATASETS, PARTITIONERS
from fedweave.runner import resume

OUT = {"progress": False, "plots": False}


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]


def _write_leaf(root, seed: int) -> None:
    """Tiny LEAF Shakespeare JSON (windows of 8 characters, next-character labels), 4 users."""
    rng = np.random.default_rng(seed)
    chars = np.array(list("abcdefghij "))
    for split, n in (("train", 24), ("test", 8)):
        users = [f"role{i}" for i in range(4)]
        data = {
            u: {"x": ["".join(rng.choice(chars, 8)) for _ in range(n)], "y": list(rng.choice(chars, n))} for u in users
        }
        (root / split).mkdir(parents=True, exist_ok=True)
        blob = {"users": users, "num_samples": [n] * 4, "user_data": data}
        (root / split / "all_data.json").write_text(json.dumps(blob))


def _leaf_run(root, rounds: int) -> dict:
    return {
        "seed": 0,
        "rounds": rounds,
        "backend": "loop",
        "threads": 1,
        "dataset": {"name": "shakespeare", "root": str(root), "source": "leaf", "seq_len": 8},
        "partition": {"name": "natural"},
        "model": {"name": "char_lstm"},
        "algorithm": {"name": "fedavg", "clients_per_round": 2},
        "local": {"epochs": 1, "batch_size": 8, "lr": 0.1},
        "output": {**OUT, "checkpoint_every": 1},
    }


@pytest.mark.parametrize("source", ["leaf", "auto"])
def test_a_resume_refuses_shakespeare_leaf_files_that_changed(tmp_path, source):
    """Shakespeare from the user's LEAF JSON (source: leaf, or auto on a root holding it) is the user's files, as
    the leaf dataset's are: a resume after they changed continued silently on other samples (rc 0)."""
    root = tmp_path / "leaf"
    _write_leaf(root, seed=0)
    cfg = _leaf_run(root, 2)
    cfg["dataset"]["source"] = source
    full = fedweave.run({**cfg, "rounds": 4}, run_dir=tmp_path / "full")
    fedweave.run(cfg, run_dir=tmp_path / "r")
    file = root / "train" / "all_data.json"
    kept = file.read_text()
    blob = json.loads(kept)
    blob["user_data"]["role0"]["y"][0] = "z" if blob["user_data"]["role0"]["y"][0] != "z" else "a"
    file.write_text(json.dumps(blob))
    want = r"^dataset 'shakespeare': the data it loaded changed since the checkpoint \(SHA-256 "
    with pytest.raises(ConfigError, match=want):
        resume(tmp_path / "r", ["rounds=4"], progress=False)
    file.write_text(json.dumps(json.loads(kept), indent=1))  # the same contents, rewritten: the same run
    res = resume(tmp_path / "r", ["rounds=4"], progress=False)
    assert _strip(res.metrics) == _strip(full.metrics)


def test_shakespeare_reads_user_files_only_from_leaf_json(tmp_path):
    """The plays come from verified downloads (pinned checksums), LEAF JSON from the user: only the latter is
    digested; a loader asked without options (a worker memoizing loaders) is taken to read them."""
    loader = DATASETS.get("shakespeare")
    _write_leaf(tmp_path / "leaf", seed=0)
    assert loads_user_files(loader, {"root": str(tmp_path / "leaf"), "source": "leaf"})
    assert loads_user_files(loader, {"root": str(tmp_path / "leaf")})  # auto: LEAF JSON under root
    assert not loads_user_files(loader, {"source": "plays", "max_users": 3})
    assert not loads_user_files(loader, {"root": str(tmp_path / "plays")})  # auto: the plays
    assert loads_user_files(loader)
    assert not loads_user_files(DATASETS.get("mnist"), {"max_train": 10})
    assert loads_user_files(DATASETS.get("libsvm"), {"path": "x"})


REGRESSION = {
    "rounds": 2,
    "dataset": {"name": "diabetes"},
    "model": {"name": "mlp", "hidden": [8]},
    "algorithm": {"name": "fedavg", "clients_per_round": 2},
    "task": {"loss": "mse"},
    "local": {"batch_size": 16, "lr": 0.05},
    "output": OUT,
}


@pytest.fixture
def halves(monkeypatch):
    """A plug-in partitioner that reads only the number of samples, registered for one test."""
    from fedweave.data.partition import label_free

    monkeypatch.setattr(PARTITIONERS, "_items", dict(PARTITIONERS._items))

    def split(labels, num_clients, rng, *, users=None):
        return np.array_split(rng.permutation(len(labels)), num_clients)

    def register(name: str, free: bool):
        fn = type(split)(split.__code__, split.__globals__, name)  # a fresh function: its own marks
        PARTITIONERS.register(name)(label_free(fn) if free else fn)

    return register


def test_a_label_free_plugin_partitioner_runs_on_float_targets(halves, tmp_path):
    """A partitioner of one's own that reads only the counts was refused on float targets ("splits by class
    label"): it declares itself label-free as the built-in iid does, and the error lists it among them."""
    halves("halves", free=True)
    halves("by_label", free=False)
    res = fedweave.run({**REGRESSION, "partition": {"name": "halves", "num_clients": 4}}, run_dir=tmp_path / "a")
    n = len(res.algorithm.ctx.dataset.train_y)
    assert [len(p) for p in res.algorithm.ctx.partition] == [len(p) for p in np.array_split(np.arange(n), 4)]
    with pytest.raises(ConfigError, match=r"^partition.bins: partition 'halves' reads only the sample counts"):
        part = {"name": "halves", "num_clients": 4, "bins": 3}
        fedweave.run({**REGRESSION, "partition": part}, run_dir=tmp_path / "b")
    want = r"^partition 'by_label' splits by class label, but the targets are floats; use from_file, halves, iid, "
    with pytest.raises(ConfigError, match=want):
        fedweave.run({**REGRESSION, "partition": {"name": "by_label", "num_clients": 4}}, run_dir=tmp_path / "c")


def test_the_built_in_label_free_partitioners_carry_the_mark():
    from fedweave.data.partition import is_label_free

    free = {n for n in PARTITIONERS.names() if is_label_free(PARTITIONERS.get(n))}
    assert free == {"iid", "quantity_skew", "natural", "from_file"}


@pytest.mark.parametrize("name", ["mnist", "shakespeare", "leaf", "libsvm", "cifar10", "adult", "mushroom"])
@pytest.mark.parametrize("root", [5, ["data"]])
def test_a_dataset_root_of_another_type_names_the_option(name, root, tmp_path):
    """``dataset.root: 5`` ended in Path's "expected str, bytes or os.PathLike object, not int", naming no key."""
    dataset = {"name": name, "root": root, **({"path": "d.svm"} if name == "libsvm" else {})}
    cfg = {"dataset": dataset}
    cfg.update(rounds=1, model={"name": "logistic"}, output=OUT)
    want = rf"^dataset\.root must be str or PathLike or null, got {re.escape(repr(root))}$"
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_libsvm_feature_index_too_large_to_parse_is_one_line(tmp_path):
    """An index beyond what the svmlight parser holds ended in its OverflowError and a traceback."""
    (tmp_path / "d.svm").write_text("0 1:0.5\n1 99999999999:0.2\n" * 10)
    cfg = {"dataset": {"name": "libsvm", "path": str(tmp_path / "d.svm")}, "rounds": 1, "output": OUT}
    want = rf"^dataset: dataset 'libsvm': cannot parse {re.escape(str(tmp_path / 'd.svm'))}: "
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, run_dir=tmp_path / "r")
    (tmp_path / "t.svm").write_text("0 1:0.5\n1 2:0.2\n" * 4)
    cfg["dataset"]["test_path"] = str(tmp_path / "t.svm")
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, run_dir=tmp_path / "r")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int16, torch.bool])
def test_class_labels_of_another_integer_dtype_are_one_line(dtype, tmp_path, monkeypatch):
    """A plug-in's labels as uint8 passed the loss's check (cross-entropy takes Byte) and ended in round 1 in
    index_select's RuntimeError; int32 and bool were named by the loss, as its dtype, not the data's."""
    monkeypatch.setattr(DATASETS, "_items", dict(DATASETS._items))
    g = torch.Generator().manual_seed(0)
    x, tx = torch.randn(40, 3, generator=g), torch.randn(10, 3, generator=g)

    def small():
        y, ty = (torch.arange(40) % 2).to(dtype), (torch.arange(10) % 2).to(dtype)
        return Dataset("small", x, y, tx, ty, 2, (3,))

    small.__module__ = "plugin"
    DATASETS.register("small_labels")(small)
    cfg = {"dataset": "small_labels", "rounds": 1, "partition": {"name": "iid", "num_clients": 2}, "output": OUT}
    cfg.update(model={"name": "logistic"}, algorithm={"name": "fedavg", "clients_per_round": 2})
    want = (
        rf"^dataset: dataset 'small': train_y holds {re.escape(str(dtype))} values; class labels are int64 "
        r"\(\.long\(\) converts them\), regression or multi-label targets floating point$"
    )
    with pytest.raises(ConfigError, match=want):
        fedweave.run(cfg, run_dir=tmp_path / "r")
