"""The API reference (docs/api, ``make docs``) builds from the docstrings with warnings as errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A page of the reference and objects it must describe (the anchors autodoc writes for them).
EXPECTED = {
    "fedweave.html": ["fedweave.run", "fedweave.sweep", "fedweave.Result", "fedweave.Callback", "fedweave.RunState"],
    "callbacks.html": ["fedweave.callbacks.Callback.after_round", "fedweave.callbacks.StopAtTarget"],
    "config.html": ["fedweave.config.RunConfig", "fedweave.config.ConfigError", "fedweave.config.load"],
    "execution.html": [
        "fedweave.execution.local.LocalTrainer",
        "fedweave.execution.job.LocalRule",
        "fedweave.execution.job.ClientStep",
        "fedweave.execution.state.StateStore",
    ],
    "algorithms.html": [
        "fedweave.algorithms.base.Algorithm.run_round",
        "fedweave.algorithms.base.RunContext",
        "fedweave.algorithms.centralized.base.StarAlgorithm",
        "fedweave.algorithms.decentralized.base.GraphAlgorithm",
        "fedweave.algorithms.split.base.SplitAlgorithm",
        "fedweave.algorithms.hierarchical.base.HierarchicalAlgorithm",
        "fedweave.algorithms.confederated.base.ConfederatedAlgorithm",
    ],
    "samplers.html": ["fedweave.topology.samplers.uniform", "fedweave.topology.samplers.make_sampler"],
    "registry.html": ["fedweave.registry.Registry.register", "fedweave.registry.SAMPLERS"],
    "experiments.html": ["fedweave.experiments.jobs.run_points"],
}


@pytest.mark.slow  # a whole Sphinx build: about 16 s of CPU
def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    import sphinx  # noqa: F401  (not installed: the test skips, naming fedweave[docs]; see conftest.py)

    out = tmp_path / "html"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs/api"), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for page, objects in EXPECTED.items():
        html = (out / page).read_text()
        missing = [o for o in objects if f'id="{o}"' not in html]
        assert not missing, f"{page} does not describe {missing}"


def test_a_public_member_without_a_docstring_is_a_warning(monkeypatch) -> None:
    import runpy

    import sphinx.util.logging

    warnings: list[str] = []

    class Logger:
        def warning(self, msg: str, *args: object) -> None:
            warnings.append(msg % args)

    monkeypatch.setattr(sphinx.util.logging, "getLogger", lambda name: Logger())
    check = runpy.run_path(str(ROOT / "docs/api/conf.py"))["_require_docstring"]

    def undocumented() -> None:
        pass

    name = f"{undocumented.__module__}.undocumented"
    check(None, "function", name, undocumented, {}, [])
    assert warnings == [f"function {name} has no docstring"]
    check(None, "function", name, undocumented, {}, ["Does something."])  # documented
    check(None, "class", f"{undocumented.__module__}.Path", Path, {}, [])  # imported: not on the page
    check(None, "attribute", f"{undocumented.__module__}.ROOT", ROOT, {}, [])  # data: a comment may say it
    assert len(warnings) == 1
