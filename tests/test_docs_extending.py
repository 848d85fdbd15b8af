"""docs/extending.md's Python examples run as written (each in a fresh namespace, inside a temporary
directory, so that the run directories they name land there)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
TEXT = PAGE.read_text()
# each block padded with the page's lines above it, so that a traceback names the page's own line
EXAMPLES = [
    "\n" * TEXT.count("\n", 0, m.start(1)) + m.group(1) for m in re.finditer(r"```python\n(.*?)```", TEXT, flags=re.S)
]


def test_the_page_has_examples():
    assert EXAMPLES


def test_no_two_examples_write_one_run_directory():
    """A reader runs the examples one after another in one folder: two writing runs/fedavg stopped the second on
    the first's finished run."""
    named = re.findall(r'run_dir=f?"([^"]+)"', TEXT)
    assert len(named) >= len(EXAMPLES) and len(set(named)) == len(named), sorted(named)


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example-{i}" for i in range(len(EXAMPLES))])
def test_an_example_runs_as_written(code, tmp_path, monkeypatch):
    """Run as a module of its own (dataclasses look their module up), without this file's __future__ flags. What
    an example registers (a rule, an algorithm, ...) is forgotten after it, so no later test sees it."""
    import fedweave.registry

    for registry in vars(fedweave.registry).values():
        if isinstance(registry, fedweave.registry.Registry):
            registry.names()  # every built-in module imported (and registered) first: they register only once
            monkeypatch.setattr(registry, "_items", dict(registry._items))
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType(f"extending_example_{EXAMPLES.index(code)}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, str(PAGE), "exec", dont_inherit=True), module.__dict__)
