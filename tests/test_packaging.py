"""fedweave as a package: what `import fedweave` and a plain run load, and a built wheel installed into a
fresh environment beside other versions of its dependencies, run from outside the source tree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import fedweave
from fedweave.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ["ray", "flwr", "matplotlib", "tensorboard", "mlflow", "wandb", "opacus"]

# One fresh interpreter: the modules after `import fedweave`, after a plain run, and after a run that writes a
# plot (the plot's run comes last: what it loads is in neither earlier list)
LOADED = """
import json, sys
import fedweave
after_import = sorted(sys.modules)
res = fedweave.run(json.loads(sys.argv[1]), run_dir=sys.argv[3])
after_run = sorted(sys.modules)
plotted = fedweave.run(json.loads(sys.argv[2]), run_dir=sys.argv[4])
print(json.dumps({"import": after_import, "run": after_run, "plot": sorted(sys.modules),
                  "status": res.summary["status"], "plot_status": plotted.summary["status"]}))
"""

TINY = {
    "name": "plain",
    "rounds": 2,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid", "num_clients": 4},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 2},
    "backend": "loop",
    "output": {"progress": False, "plots": False},
}


def _top(modules: list[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("loaded")
    plot = {**TINY, "output": {"progress": False, "plots": True}}
    out = subprocess.run(
        [sys.executable, "-c", LOADED, json.dumps(TINY), json.dumps(plot), str(tmp / "run"), str(tmp / "plot")],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter running a run: about 6 s of CPU
def test_import_and_a_plain_run_load_no_optional_extra(loaded):
    got = loaded
    assert got["status"] == "completed"
    assert "torch" not in _top(got["import"])  # `import fedweave` is cheap: torch loads on first use
    assert not _top(got["run"]) & set(OPTIONAL), sorted(_top(got["run"]) & set(OPTIONAL))


def test_writing_a_plot_is_what_loads_matplotlib(loaded):
    got = loaded
    assert got["plot_status"] == "completed"
    assert "matplotlib" in _top(got["plot"])  # the check above can fail


def test_the_lazy_public_names_are_listed_by_dir():
    """``fedweave.run`` and the other names ``__getattr__`` loads on first use are in ``dir(fedweave)`` (completion
    and ``help(fedweave)`` read it; before: only the submodules already imported and ``annotations``)."""
    import fedweave

    assert set(fedweave.__all__) <= set(dir(fedweave))
    assert "annotations" not in fedweave.__all__


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedweave {fedweave.__version__}"


def test_python_dash_m_fedweave_is_the_command():
    """``python -m fedweave`` runs the ``fedweave`` command: its output, its one-line errors and their status."""
    env = {**os.environ, "PYTHONPATH": str(Path(fedweave.__file__).parents[1])}
    run = [sys.executable, "-m", "fedweave"]
    done = subprocess.run([*run, "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"fedweave {fedweave.__version__}"
    done = subprocess.run([*run, "run", "no-such-config.yaml"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "fedweave: error: config file 'no-such-config.yaml' does not exist\n"


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """pyproject.toml's distributions (normalized names): the dependencies, and those of each extra."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group()).lower() for r in reqs}

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


def _third_party_imports(folder: Path) -> dict[str, set[str]]:
    """The top-level modules that the files under ``folder`` import, outside the standard library and fedweave,
    each with the files importing it (lazy imports inside functions included)."""
    import ast

    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top != "fedweave":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_import_of_the_package_is_declared_and_every_dependency_used():
    """An import of src/ whose distribution pyproject.toml does not declare (in the dependencies or an extra)
    works only where something else happened to install it: ``cloudpickle`` (the pool backend's fallback for
    rules defined in ``__main__``) came with mlflow, so the pool refused such a rule unless the mlflow extra was
    installed. And a dependency that nothing of src/ imports is one more install for every user."""
    from importlib.metadata import packages_distributions

    core, extras = _declared()
    dists = packages_distributions()
    imports = _third_party_imports(ROOT / "src")
    undeclared = {}
    for mod, files in imports.items():
        names = {re.sub(r"[-_.]+", "-", d).lower() for d in dists.get(mod, [mod])}
        if not names & (core | set().union(*extras.values())):
            undeclared[mod] = sorted(files)
    assert not undeclared, f"imported by src/ but not declared in pyproject.toml: {undeclared}"
    imported = {re.sub(r"[-_.]+", "-", d).lower() for mod in imports for d in dists.get(mod, [mod])}
    assert core <= imported, f"dependencies nothing of src/ imports: {sorted(core - imported)}"
    assert not core & extras["dev"], f"in the dependencies and again in dev: {sorted(core & extras['dev'])}"


def test_the_example_configs_ship_in_the_package_and_load():
    from fedweave.config import example_path, examples, load

    assert "demo" in examples() and "centralized/fedmim" in examples()
    assert load("example:demo").name == load(ROOT / "configs" / "demo.yaml").name
    assert example_path("demo").is_relative_to(Path(fedweave.__file__).parent)


def _run(argv: list[str], **kw) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _versions(python: Path, names: list[str]) -> dict[str, str]:
    code = "import importlib.metadata as m, sys; print(*[m.version(n) for n in sys.argv[1:]])"
    return dict(zip(names, _run([str(python), "-c", code, *names]).split(), strict=True))


# Versions inside the declared ranges but not the locked ones: a researcher's environment.
THEIRS = {"numpy": "2.2.6", "scikit-learn": "1.6.1"}


def _share_torch(python: Path, folder: Path) -> None:
    """Give the environment of ``python`` this environment's torch, as a folder on its path that holds links to
    torch's package and metadata only: pip sees torch installed (and installs what torch needs itself), and the
    test does not unpack 750 MB of torch again. The rest of the environment is its own."""
    import torch

    folder.mkdir()
    site = Path(torch.__file__).parent.parent
    for entry in [site / "torch", site / "torchgen", *site.glob("torch-*.dist-info")]:
        if entry.exists():
            (folder / entry.name).symlink_to(entry)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    (Path(purelib) / "shared_torch.pth").write_text(f"{folder}\n")


@pytest.mark.slow
def test_the_wheel_installs_beside_other_versions_and_runs_outside_the_source_tree(tmp_path):
    dist = tmp_path / "dist"
    # --no-isolation: build with the setuptools already installed (pyproject asks for >= 77)
    _run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist", "--outdir", str(dist), str(ROOT)])
    wheel = next(dist.glob("fedweave-*.whl"))
    sdist = next(dist.glob("fedweave-*.tar.gz"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for f in ("fedweave/py.typed", "fedweave/data/checksums.json", "fedweave/configs/demo.yaml"):
        assert f in shipped, f
    assert "fedweave/configs/centralized/fedmim.yaml" in shipped
    with tarfile.open(sdist) as tar:
        in_sdist = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    assert {"src/fedweave/configs/demo.yaml", "src/fedweave/data/checksums.json", "pyproject.toml"} <= in_sdist

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    _share_torch(py, tmp_path / "shared-torch")
    # the fresh environment sees only itself: with the source tree on PYTHONPATH (and the build's egg-info
    # in it), pip would find fedweave installed already and skip the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # --no-compile: no bytecode written ahead for every module of every package (most of pip's time here);
    # Python compiles what a run imports
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    _run([*pip, "torch==2.13.0", *(f"{n}=={v}" for n, v in THEIRS.items())], env=env)
    _run([*pip, str(wheel)], env=env)
    assert _versions(py, list(THEIRS)) == THEIRS  # nothing downgraded or replaced

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    exe = str(venv / "bin" / "fedweave")
    origin = _run([str(py), "-c", "import fedweave; print(fedweave.__file__)"], cwd=outside, env=env)
    assert str(venv) in origin  # the installed package, not the source tree
    assert "example configs" in _run([exe, "list"], cwd=outside, env=env)
    overrides = ["rounds=2", "dataset=digits", "model=logistic", "partition={name: iid, num_clients: 10}"]
    out = _run(
        [exe, "run", "example:centralized/fedavg", *overrides, "--out", "r", "--no-progress"], cwd=outside, env=env
    )
    assert "final test accuracy" in out
    summary = json.loads((outside / "r" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
