"""The layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml (``[tool.importlinter]``)
are kept by this source tree, lazy imports inside functions included, and a broken one fails the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = (
    "Layers: a lower layer never imports a higher one",
    "Topology is passive: no module in fedweave.topology imports fedweave.algorithms",
    "The runner imports nothing above it",
    "No import cycle among the modules of any package of fedweave",
)


def lint_imports(src: Path, config: Path) -> subprocess.CompletedProcess:
    """import-linter's check of the package under ``src`` against ``config``, in a fresh interpreter (no cache)."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(sys.argv[1], no_cache=True))"
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [sys.executable, "-c", code, str(config)], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_source_tree_keeps_every_contract():
    out = lint_imports(ROOT / "src", ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in CONTRACTS:
        assert f"{name} KEPT" in out.stdout, out.stdout


def test_an_import_from_below_breaks_the_contracts(tmp_path):
    """A topology module importing an algorithm lazily, the runner importing the experiments, the job record
    importing a backend (the backends import the record: a cycle) and the LEAF loader importing the Shakespeare
    loader lazily (which imports LEAF's: a cycle inside one layer), each fail."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "fedweave", src / "fedweave", ignore=shutil.ignore_patterns("__pycache__"))
    graph = src / "fedweave" / "topology" / "graph.py"
    graph.write_text(
        graph.read_text()
        + textwrap.dedent(
            """

            def _star():
                from fedweave.algorithms.centralized.base import StarAlgorithm

                return StarAlgorithm
            """
        )
    )
    runner = src / "fedweave" / "runner.py"
    runner.write_text(runner.read_text() + "\nfrom fedweave.experiments import sweep  # noqa: E402\n")
    job = src / "fedweave" / "execution" / "job.py"
    job.write_text(job.read_text() + "\n\ndef _loop():\n    from fedweave.execution import loop\n\n    return loop\n")
    leaf = src / "fedweave" / "data" / "datasets" / "leaf.py"
    leaf.write_text(
        leaf.read_text()
        + "\n\ndef _plays():\n    from fedweave.data.datasets import shakespeare\n\n    return shakespeare\n"
    )
    out = lint_imports(src, ROOT / "pyproject.toml")
    assert out.returncode == 1, out.stdout + out.stderr
    for name in CONTRACTS:
        assert f"{name} BROKEN" in out.stdout, out.stdout
    assert "fedweave.topology.graph -> fedweave.algorithms.centralized.base" in out.stdout
    assert "fedweave.runner -> fedweave.experiments.sweep" in out.stdout
    assert "No cycles are allowed in fedweave.execution." in out.stdout
    assert "No cycles are allowed in fedweave.data.datasets." in out.stdout
