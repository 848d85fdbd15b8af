"""``fedweave flower-app CONFIG DIR``: write a Flower app project that runs a fedweave config.

The project is a ``pyproject.toml`` naming the app's components and carrying the resolved fedweave config
in ``[tool.flwr.app.config]``, plus a two-line module pointing Flower at fedweave's ServerApp and
ClientApp. ``flwr run DIR SUPERLINK`` runs it against any SuperLink.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import tomli_w

from fedweave.config import RunConfig
from fedweave.deploy.support import check_deployable
from fedweave.results import atomic_write

MODULE = "fedweave_app"
APP_MODULE = '''"""Flower components of this app: fedweave's own ServerApp and ClientApp."""

from fedweave.deploy.client_app import app as clientapp
from fedweave.deploy.server_app import app as serverapp

__all__ = ["clientapp", "serverapp"]
'''


def write_app(
    config: RunConfig,
    directory: str | Path,
    *,
    run_dir: str = "",
    reply_timeout: float = 600.0,
    node_wait: float = 120.0,
    on_error: str = "stop",
    overwrite: bool = False,
) -> Path:
    """Write the Flower app project for ``config`` into ``directory``; returns its pyproject path. A directory
    that is not empty is refused (a ``FileExistsError`` naming it) unless ``overwrite``, which replaces the
    project's two files and leaves everything else in it alone."""
    if on_error not in ("stop", "drop"):
        raise ValueError(f"on_error must be 'stop' or 'drop', got {on_error!r}")
    if not 0 < reply_timeout < math.inf or not 0 < node_wait < math.inf:  # what the ServerApp takes at start
        raise ValueError(
            f"reply_timeout and node_wait must be > 0 seconds (finite), got {reply_timeout} and {node_wait}"
        )
    check_deployable(config, on_error)  # a setup the ServerApp would refuse at start is refused here
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{str(out)!r} is a file; give a directory for the app project")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"{str(out)!r} is not empty; give a new or empty directory for the app project, or --overwrite to "
            f"replace its pyproject.toml and {MODULE}.py"
        )
    pyproject = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": "fedweave-app",
            "version": "1.0.0",
            "description": f"fedweave run {config.name} on Flower's deployment engine",
            "license": "Apache-2.0",
            "dependencies": ["fedweave[flower]"],  # already installed where the SuperLink and SuperNodes run
        },
        "tool": {
            "hatch": {"build": {"targets": {"wheel": {"packages": ["."]}}}},
            "flwr": {
                "app": {
                    "publisher": "fedweave",
                    "components": {"serverapp": f"{MODULE}:serverapp", "clientapp": f"{MODULE}:clientapp"},
                    "config": {
                        "fedweave-config": json.dumps(config.to_dict()),
                        "run-dir": run_dir,
                        "reply-timeout": float(reply_timeout),
                        "node-wait": float(node_wait),
                        "on-error": on_error,
                    },
                }
            },
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / f"{MODULE}.py", APP_MODULE)
    path = out / "pyproject.toml"
    atomic_write(path, tomli_w.dumps(pyproject))  # a TOML writer: any run name gives valid TOML
    return path
