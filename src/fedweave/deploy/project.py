"""``fedweave flower-app CONFIG DIR``: write a Flower app project that runs a fedweave config.

The project is a ``pyproject.toml`` naming the app's components and carrying the resolved fedweave config
in ``[tool.flwr.app.config]``, plus a two-line module pointing Flower at fedweave's ServerApp and
ClientApp. ``flwr run DIR SUPERLINK`` runs it against any SuperLink.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedweave.config import RunConfig
from fedweave.deploy.support import check_deployable

MODULE = "fedweave_app"
APP_MODULE = '''"""Flower components of this app: fedweave's own ServerApp and ClientApp."""

from fedweave.deploy.client_app import app as clientapp
from fedweave.deploy.server_app import app as serverapp

__all__ = ["clientapp", "serverapp"]
'''


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def write_app(
    config: RunConfig,
    directory: str | Path,
    *,
    run_dir: str = "",
    reply_timeout: float = 600.0,
    node_wait: float = 120.0,
    on_error: str = "stop",
) -> Path:
    """Write the Flower app project for ``config`` into ``directory``; returns its pyproject path."""
    if on_error not in ("stop", "drop"):
        raise ValueError(f"on_error must be 'stop' or 'drop', got {on_error!r}")
    if not reply_timeout > 0 or not node_wait > 0:
        raise ValueError(f"reply_timeout and node_wait must be > 0 seconds, got {reply_timeout} and {node_wait}")
    check_deployable(config, on_error)  # a setup the ServerApp would refuse at start is refused here
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{MODULE}.py").write_text(APP_MODULE)
    pyproject = f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedweave-app"
version = "1.0.0"
description = "fedweave run {config.name} on Flower's deployment engine"
license = "Apache-2.0"
dependencies = ["fedweave[flower]"]  # already installed where the SuperLink and SuperNodes run

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedweave"

[tool.flwr.app.components]
serverapp = "{MODULE}:serverapp"
clientapp = "{MODULE}:clientapp"

[tool.flwr.app.config]
fedweave-config = {_toml_str(json.dumps(config.to_dict()))}
run-dir = {_toml_str(run_dir)}
reply-timeout = {float(reply_timeout)}
node-wait = {float(node_wait)}
on-error = {_toml_str(on_error)}
"""
    path = out / "pyproject.toml"
    path.write_text(pyproject)
    return path
