"""Sphinx configuration of fedweave's API reference (``make docs``; tests/test_api_docs.py builds it with
warnings as errors). The pages are generated from the docstrings by autodoc."""

import sys
from pathlib import Path

# The source tree's package, ahead of any installed copy, so the reference shows the code beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

project = "fedweave"
author = "The fedweave authors"
copyright = "the fedweave authors"

extensions = ["sphinx.ext.autodoc"]

# ``x`` in a docstring is code, as in the rest of the project's text (the default role is a reference).
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # a default as written (``CPU``), not its repr
# Every public member is listed, documented or not: _require_docstring below makes a missing docstring a
# warning, an error in ``make docs`` and the test.
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
# Optional extras that a documented module may import: the reference builds without them installed.
autodoc_mock_imports = ["ray", "flwr", "mlflow", "wandb", "tensorboard"]

html_theme = "alabaster"
html_static_path: list[str] = []
exclude_patterns = ["_build"]


def _require_docstring(app, what, name, obj, options, lines):
    """Warn (an error under ``-W``) about a public function, class or method that has no docstring."""
    if what not in ("function", "method", "class", "exception", "property") or any(line.strip() for line in lines):
        return
    # autodoc asks about a module's imported names too, and then leaves them out of its page
    defined = getattr(obj, "fget", None) or getattr(obj, "func", None) or obj  # a property's, a cached_property's
    module = getattr(defined, "__module__", None)
    if module is None or name.startswith(module + "."):
        from sphinx.util import logging

        logging.getLogger("fedweave.api").warning("%s %s has no docstring", what, name)


def setup(app):
    app.connect("autodoc-process-docstring", _require_docstring)
