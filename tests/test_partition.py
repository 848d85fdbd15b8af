"""Partitioners, per-client test sets and the partition report."""

from __future__ import annotations

import csv
import time

import numpy as np
import pytest

from fedweave.data.partition import (
    Partition,
    client_test_split,
    dirichlet,
    natural,
    partition_stats,
    pathological,
    quantity_skew,
    shards,
    user_test_split,
)
from fedweave.data.report import write_partition_report
from fedweave.registry import PARTITIONERS

NUM_CLASSES = 10
# Unequal class sizes (200..290 samples), shuffled, so nothing relies on sorted or balanced labels.
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(NUM_CLASSES), 200 + 10 * np.arange(10)))
N = len(LABELS)

CASES = {
    "iid": {},
    "dirichlet": {"alpha": 0.3},
    "dirichlet_balanced": {"alpha": 0.3},
    "pathological": {"classes_per_client": 3},
    "shards": {"shards_per_client": 2},
    "quantity_skew": {"alpha": 0.5},
}


def run(name: str, seed: int = 0, m: int = 20, labels: np.ndarray = LABELS, **kw) -> list[np.ndarray]:
    return PARTITIONERS.get(name)(labels, m, np.random.default_rng(seed), **{**CASES.get(name, {}), **kw})


def assert_valid(parts: list[np.ndarray], n: int, m: int) -> np.ndarray:
    assert len(parts) == m
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)  # sorted, no repeats within a client
    union = np.concatenate(parts)
    assert len(np.unique(union)) == len(union), "clients overlap"
    assert union.min() >= 0 and union.max() < n
    return union


@pytest.mark.parametrize("name", sorted(CASES))
def test_disjoint_deterministic_and_seed_dependent(name):
    parts = run(name)
    assert_valid(parts, N, 20)
    again = run(name)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = run(name, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("name", ["iid", "dirichlet", "pathological", "shards", "quantity_skew"])
def test_full_coverage(name):
    assert len(np.concatenate(run(name))) == N


def test_iid_sizes_equal_within_one():
    sizes = [len(p) for p in run("iid", m=7)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == N


def test_dirichlet_balanced_equal_sizes_leaves_out_remainder():
    parts = run("dirichlet_balanced", m=7)
    assert [len(p) for p in parts] == [N // 7] * 7
    assert len(np.concatenate(parts)) == N - N % 7


def test_dirichlet_balanced_small_alpha_is_skewed():
    hist = partition_stats(run("dirichlet_balanced", alpha=0.05, m=10), LABELS, NUM_CLASSES)["histogram"]
    top = np.sort(hist, axis=1)[:, ::-1]
    # Most of each client's data comes from its 3 largest classes (iid would give ~30%).
    assert np.median(top[:, :3].sum(1) / hist.sum(1)) > 0.8


def test_dirichlet_min_size_and_alpha_skew():
    parts = run("dirichlet", alpha=0.1, min_size=10, m=20)
    stats = partition_stats(parts, LABELS, NUM_CLASSES)
    assert stats["min_size"] >= 10
    assert np.median(stats["classes_per_client"]) < 8  # skewed: far from all 10 classes


def test_dirichlet_tiny_alpha_terminates_fast_with_repair():
    # alpha 0.01 puts each class on ~1 client: 90 of 100 clients would stay empty, so every attempt
    # fails and the repair step must fill them.
    labels = np.repeat(np.arange(NUM_CLASSES), 500)
    t0 = time.perf_counter()
    parts = dirichlet(labels, 100, np.random.default_rng(0), alpha=0.01, min_size=20)
    assert time.perf_counter() - t0 < 5.0
    union = assert_valid(parts, len(labels), 100)
    assert len(union) == len(labels)
    assert min(len(p) for p in parts) >= 20


def test_dirichlet_repair_at_the_exact_limit():
    labels = np.repeat(np.arange(4), 25)  # N = 100 = 10 clients x 10
    parts = dirichlet(labels, 10, np.random.default_rng(3), alpha=0.01, min_size=10, max_attempts=2)
    assert [len(p) for p in parts] == [10] * 10


def test_dirichlet_impossible_min_size_is_a_clear_error():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"partition\.min_size.*partition\.num_clients.*at most 49 for 50 clients"):
        dirichlet(LABELS, 50, np.random.default_rng(0), min_size=N // 40)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"alpha": -1}, r"partition\.alpha must be > 0, got -1"),
        ({"alpha": 0}, r"partition\.alpha must be > 0"),
        ({"max_attempts": 0}, r"partition\.max_attempts"),
        ({"min_size": -1}, r"partition\.min_size must be an integer >= 0"),
    ],
)
def test_dirichlet_bad_params(kw, match):
    with pytest.raises(ValueError, match=match):
        dirichlet(LABELS, 10, np.random.default_rng(0), **kw)


@pytest.mark.parametrize("name", sorted(CASES))
def test_more_clients_than_samples_is_a_clear_error(name):
    labels = np.arange(5) % 2
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"partition\.num_clients \(6\) exceeds the 5 training samples"):
        run(name, labels=labels, m=6)
    with pytest.raises(ValueError, match=r"partition\.num_clients must be an integer >= 1"):
        run(name, m=0)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("c", [1, 2, 3, 10])
def test_pathological_exactly_c_classes(c):
    parts = run("pathological", classes_per_client=c, m=30)
    assert_valid(parts, N, 30)
    hist = partition_stats(parts, LABELS, NUM_CLASSES)["histogram"]
    assert np.all((hist > 0).sum(1) == c)
    # m*c = 30c slots over 10 classes: every class is used, all samples assigned
    assert hist.sum() == N


def test_pathological_fewer_slots_than_classes_leaves_classes_out():
    parts = run("pathological", classes_per_client=2, m=3)
    hist = partition_stats(parts, LABELS, NUM_CLASSES)["histogram"]
    assert np.all((hist > 0).sum(1) == 2)
    used = hist.sum(0) > 0
    assert used.sum() == 6  # 3 clients x 2 classes, each class on one client, whole class
    assert hist.sum() == np.bincount(LABELS)[used].sum()


def test_pathological_errors():
    with pytest.raises(ValueError, match=r"partition\.classes_per_client must be an integer in \[1, 10\]"):
        run("pathological", classes_per_client=11)
    tiny = np.repeat(np.arange(2), 3)  # 2 classes x 3 samples; 5 clients x 2 classes needs 5 shards per class
    with pytest.raises(ValueError, match=r"class \d has 3 samples but needs 5 shards"):
        pathological(tiny, 5, np.random.default_rng(0), classes_per_client=2)


def test_pathological_reads_a_whole_float_as_an_integer():
    # classes_per_client: 2.0 (as YAML or a sweep may write it) is 2, as for every other integer key of the
    # partition (num_clients, shards_per_client, min_size); it used to be refused. 2.5 still is.
    as_float = run("pathological", classes_per_client=2.0)
    assert all(np.array_equal(a, b) for a, b in zip(as_float, run("pathological", classes_per_client=2)))
    with pytest.raises(ValueError, match=r"partition\.classes_per_client must be an integer .*got 2\.5"):
        run("pathological", classes_per_client=2.5)


def test_pathological_extra_shard_goes_to_a_class_that_can_take_it():
    # 4 clients x 2 classes = 8 slots over 3 classes: two classes get 3 shards, one gets 2. Class 0 has only
    # 2 samples, so a feasible split always exists; it used to be refused whenever the random draw gave
    # class 0 one of the extra shards (seeds 1, 2 and 3), with advice to lower the settings.
    labels = np.array([0, 0] + [1] * 50 + [2] * 50)
    for seed in range(8):
        parts = pathological(labels, 4, np.random.default_rng(seed), classes_per_client=2)
        hist = partition_stats(parts, labels, 3)["histogram"]
        assert np.all((hist > 0).sum(1) == 2) and hist.sum() == len(labels)
        assert np.array_equal((hist > 0).sum(0), [2, 3, 3])
    # a draw that was feasible is left as it was: seed 0 gives the same partition as before
    parts = pathological(labels, 4, np.random.default_rng(0), classes_per_client=2)
    assert [len(p) for p in parts] == [33, 18, 34, 17]


def test_shards_sizes_and_label_runs():
    labels = np.repeat(np.arange(NUM_CLASSES), 60)  # McMahan-like: 600 samples, 20 shards of 30
    parts = shards(labels, 10, np.random.default_rng(0), shards_per_client=2)
    assert [len(p) for p in parts] == [60] * 10
    hist = partition_stats(parts, labels, NUM_CLASSES)["histogram"]
    assert np.all((hist > 0).sum(1) <= 2)  # each shard lies within one class here
    with pytest.raises(ValueError, match=r"partition\.shards_per_client"):
        shards(labels, 10, np.random.default_rng(0), shards_per_client=0)
    with pytest.raises(ValueError, match=r"1000 shards exceeds the 600"):
        shards(labels, 100, np.random.default_rng(0), shards_per_client=10)


@pytest.mark.parametrize("kw", [{"alpha": 0.5}, {"sigma": 1.0}, {"alpha": 0.01}])
def test_quantity_skew_sizes(kw):
    parts = quantity_skew(LABELS, 20, np.random.default_rng(0), min_size=15, **kw)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 15 and sizes.sum() == N
    assert sizes.max() > 2 * N / 20  # unequal


def test_quantity_skew_large_sigma_keeps_finite_shares():
    # lognormal(0, 5000) overflows exp: the shares were nan and the sizes a bare numpy error
    parts = quantity_skew(LABELS, 20, np.random.default_rng(0), min_size=15, sigma=5000.0)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 15 and sizes.sum() == N
    assert sizes.max() == N - 19 * 15  # the limit of sigma -> inf: one client takes all but the minimum


@pytest.mark.parametrize("name", ["dirichlet", "quantity_skew"])
def test_huge_alpha_is_near_iid_not_one_client(name):
    # numpy's Dir(alpha) overflows to all zeros once alpha * m exceeds ~1.8e308; that used to give (nearly)
    # every sample to one client, the opposite of the alpha -> inf limit (equal shares)
    parts = run(name, alpha=1e308, min_size=5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == N and sizes.min() > 0.8 * N / 20


def test_quantity_skew_errors():
    with pytest.raises(ValueError, match="not both"):
        quantity_skew(LABELS, 5, np.random.default_rng(0), alpha=1.0, sigma=1.0)
    with pytest.raises(ValueError, match=r"partition\.sigma must be > 0"):
        quantity_skew(LABELS, 5, np.random.default_rng(0), sigma=-1.0)
    with pytest.raises(ValueError, match=r"partition\.min_size"):
        quantity_skew(LABELS, 5, np.random.default_rng(0), min_size=N)


USERS = np.array(["bob"] * 5 + ["amy"] * 2 + ["cat"] * 9 + ["dan"] * 1)
ULABELS = np.arange(len(USERS)) % 3


def test_natural_all_users():
    parts = natural(ULABELS, 0, np.random.default_rng(0), users=USERS)
    assert [USERS[p[0]] for p in parts] == ["amy", "bob", "cat", "dan"]  # ordered by user id
    for p in parts:
        assert len(set(USERS[p])) == 1
        assert len(p) == np.count_nonzero(USERS[p[0]] == USERS)
    assert [len(p) for p in natural(ULABELS, None, np.random.default_rng(0), users=USERS)] == [2, 5, 9, 1]


def test_natural_selection():
    def chosen(m, select, seed=0):
        parts = natural(ULABELS, m, np.random.default_rng(seed), users=USERS, select=select)
        return [str(USERS[p[0]]) for p in parts]

    assert chosen(2, "largest") == ["bob", "cat"]
    assert chosen(2, "first") == ["amy", "bob"]
    assert chosen(3, "random") == chosen(3, "random")
    assert len({tuple(chosen(2, "random", s)) for s in range(20)}) > 1


def test_natural_errors():
    with pytest.raises(ValueError, match="no natural users") as e:
        natural(ULABELS, 2, np.random.default_rng(0), users=None)
    assert all(n in str(e.value) for n in PARTITIONERS.names() if n != "natural")  # every other partitioner
    with pytest.raises(ValueError, match=r"partition\.num_clients \(5\) exceeds the 4 natural users"):
        natural(ULABELS, 5, np.random.default_rng(0), users=USERS)
    with pytest.raises(ValueError, match=r"partition\.select must be one of largest, first, random"):
        natural(ULABELS, 2, np.random.default_rng(0), users=USERS, select="biggest")


def test_user_test_split():
    parts = natural(ULABELS, 2, np.random.default_rng(0), users=USERS)  # bob, cat
    test_users = np.array(["cat", "amy", "bob", "cat", "eve"])
    got = user_test_split(parts, USERS, test_users)
    assert [g.tolist() for g in got] == [[2], [0, 3]]


# ------------------------------------------------------------------------------ per-client test sets

TEST_LABELS = np.repeat(np.arange(NUM_CLASSES), 100)


def test_client_test_split_follows_train_distribution():
    parts = run("dirichlet", alpha=0.3, m=20)
    tests = client_test_split(parts, LABELS, TEST_LABELS, np.random.default_rng(0))
    n_te = -(-len(TEST_LABELS) // 20)  # ceil(N_test / m) = 50
    for part, te in zip(parts, tests):
        train_counts = np.bincount(LABELS[part], minlength=NUM_CLASSES)
        test_counts = np.bincount(TEST_LABELS[te], minlength=NUM_CLASSES)
        expected = np.ceil(train_counts * n_te / len(part)).astype(int)  # k_c = ceil(t_c / n_i * n_te)
        assert np.array_equal(test_counts, expected)
        assert np.all(np.abs(test_counts / test_counts.sum() - train_counts / len(part)) < NUM_CLASSES / n_te)
        assert len(np.unique(te)) == len(te)  # enough test samples per class: no replacement


def test_client_test_split_per_client_and_replacement():
    labels = np.array([0] * 90 + [1] * 10)
    parts = [np.arange(100)]
    test_labels = np.array([0] * 50 + [1] * 3)
    (te,) = client_test_split(parts, labels, test_labels, np.random.default_rng(0), per_client=40)
    assert np.sum(test_labels[te] == 0) == 36 and np.sum(test_labels[te] == 1) == 4
    ones = te[test_labels[te] == 1]
    assert set(ones.tolist()) == {50, 51, 52}  # the class ran out: all 3 taken, then 1 more repeated
    assert len(np.unique(te[test_labels[te] == 0])) == 36


def test_client_test_split_deterministic_empty_and_errors():
    parts = run("iid", m=5) + [np.empty(0, dtype=np.int64)]
    a = client_test_split(parts, LABELS, TEST_LABELS, np.random.default_rng(4))
    b = client_test_split(parts, LABELS, TEST_LABELS, np.random.default_rng(4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert a[-1].size == 0 and a[-1].dtype == np.int64
    with pytest.raises(ValueError, match="test split has none"):
        client_test_split(parts, LABELS, np.zeros(10, dtype=np.int64), np.random.default_rng(0))


# ------------------------------------------------------------------------------------------- report


def test_partition_stats_and_report(tmp_path):
    parts = run("pathological", classes_per_client=2, m=8)
    stats = write_partition_report(parts, LABELS, NUM_CLASSES, tmp_path / "out")
    assert np.array_equal(stats["sizes"], [len(p) for p in parts])
    assert stats["num_samples"] == sum(len(p) for p in parts)
    rows = list(csv.reader((tmp_path / "out" / "partition.csv").read_text().splitlines()))
    assert rows[0] == ["client", "n", *[f"class_{k}" for k in range(NUM_CLASSES)]]
    assert len(rows) == 9
    for i, row in enumerate(rows[1:]):
        counts = np.bincount(LABELS[parts[i]], minlength=NUM_CLASSES)
        assert row == [str(i), str(len(parts[i])), *map(str, counts)]
    png = (tmp_path / "out" / "partition.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["partition.csv", "partition.png"]


def test_report_heat_map_for_many_classes(tmp_path):
    labels = np.arange(300) % 30
    parts = run("iid", labels=labels, m=6)
    write_partition_report(parts, labels, 30, tmp_path)
    assert (tmp_path / "partition.png").stat().st_size > 1000


# ---------------------------------------------------------------------------------------- from_file


@pytest.mark.parametrize("content", ["5", "null", '"0 1 2"', "true"])
def test_from_file_that_is_not_a_list_of_lists_is_a_clear_error(tmp_path, content):
    path = tmp_path / "parts.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"^partition.path .*parts.json' must hold a JSON list of per-client index"):
        PARTITIONERS.get("from_file")(LABELS, 0, np.random.default_rng(0), path=str(path))


def test_from_file_keys_with_a_gap_are_refused_not_renumbered(tmp_path):
    # {"0": ..., "2": ...} would otherwise make the file's client 2 the run's client 1.
    (tmp_path / "gap.json").write_text('{"0": [0, 1], "2": [2]}')
    np.savez(tmp_path / "gap.npz", client_0=np.array([0, 1]), client_2=np.array([2]))
    for name in ("gap.json", "gap.npz"):
        with pytest.raises(ValueError, match=r"clients must be numbered 0 \.\. 1 without gaps, got 0, 2"):
            PARTITIONERS.get("from_file")(LABELS, 0, np.random.default_rng(0), path=str(tmp_path / name))
    (tmp_path / "ok.json").write_text('{"1": [2], "0": [1, 0]}')
    parts = PARTITIONERS.get("from_file")(LABELS, 0, np.random.default_rng(0), path=str(tmp_path / "ok.json"))
    assert [p.tolist() for p in parts] == [[0, 1], [2]]


# ------------------------------------------------------------------------------ a partitioner of your own

_OWN = {  # name -> (the parts it returns for n training samples, the error)
    "_own_negative": (lambda n: [np.array([-1, 0, 1]), np.arange(2, 10)], r"client 0 holds index -1, outside"),
    "_own_beyond": (lambda n: [np.array([0, n + 5]), np.arange(2, 10)], r"client 0 holds index {n5}, outside"),
    "_own_float": (lambda n: [np.array([0.7, 1.2]), np.arange(3, 10)], r"client 0 holds float64 indices"),
    "_own_shared": (lambda n: [np.arange(0, 10), np.arange(5, 15)], r"a sample is given to more than one client"),
    # one client where partition.num_clients asks for 2: the run went on with 1
    "_own_fewer": (lambda n: [np.arange(0, 10)], r"1 clients returned where partition.num_clients is 2"),
    # returned as a Partition (as the built-in ones do) rather than a list: held to the same contract
    "_own_shared_partition": (
        lambda n: Partition.of([np.arange(0, 10), np.arange(5, 15)]),
        r"a sample is given to more than one client",
    ),
}
for _name, (_make, _) in _OWN.items():
    if _name not in PARTITIONERS._items:
        PARTITIONERS.register(_name)(lambda labels, num_clients, rng, *, users=None, _make=_make: _make(len(labels)))


@pytest.mark.parametrize("name", sorted(_OWN))
def test_a_partitioner_of_your_own_that_breaks_the_contract_is_a_clear_error(name):
    # Float indices were truncated to other samples, shared samples trained twice, and a negative index
    # wrapped around to the last sample (or failed as a bare IndexError deep in training).
    from fedweave.algorithms.base import RunContext
    from fedweave.config import ConfigError, load

    cfg = {"name": "t", "dataset": {"name": "digits"}, "model": {"name": "logistic"}, "algorithm": {"name": "fedavg"}}
    ctx = RunContext(load({**cfg, "rounds": 1, "partition": {"name": name, "num_clients": 2}}))
    n = len(ctx.dataset.train_y)
    with pytest.raises(ConfigError, match=rf"^partition {name!r}: " + _OWN[name][1].replace("{n5}", str(n + 5))):
        _ = ctx.partition
