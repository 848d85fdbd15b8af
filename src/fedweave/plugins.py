"""User plug-ins: modules or ``.py`` files that register datasets, models, losses, metrics or samplers, so
that a YAML config and the command line can name them (``plugins:`` in a config, ``fedweave run --plugin``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

_LOADED: dict[str, str] = {}  # a file's absolute path, or a module name -> the module name it was imported as


def load_plugin(spec: str) -> str:
    """Import ``spec``: a path to a ``.py`` file, or a module name on the path. Imported once per process."""
    from fedweave.config import ConfigError

    is_file = spec.endswith(".py") or "/" in spec
    # a file is known by its absolute path: `plug.py` in another working directory is another plug-in
    key = str(Path(spec).expanduser().resolve()) if is_file else spec
    if key in _LOADED:
        return _LOADED[key]
    if is_file:
        path = Path(key)
        if not path.is_file():
            raise ConfigError(f"plugins: {spec!r} is not a file (give a .py file or an importable module name)")
        name = f"fedweave_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"plugins: {spec!r} cannot be imported as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # a plug-in's sys.exit() must not end the run without a word
            del sys.modules[name]
            raise ConfigError(f"plugins: importing {spec!r} failed ({_one_line(e)})") from e
    else:
        name = spec
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as e:
            if e.name is None or not spec.startswith(e.name):  # a module the plug-in itself imports is missing
                raise ConfigError(f"plugins: importing {spec!r} failed ({_one_line(e)})") from e
            raise ConfigError(f"plugins: no module {spec!r} ({e}); give a .py file or an importable module") from e
        except (Exception, SystemExit) as e:
            raise ConfigError(f"plugins: importing {spec!r} failed ({_one_line(e)})") from e
    _LOADED[key] = name
    return name


def _one_line(e: BaseException) -> str:
    """What a plug-in raised while importing, on one line (``SystemExit: 3``)."""
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_plugins(specs: list[str]) -> None:
    """Import each plug-in (see :func:`load_plugin`); a failing one is a ConfigError naming it."""
    for spec in specs:
        load_plugin(spec)


def recorded(spec: str) -> str:
    """How a run's config records a plug-in: a ``.py`` file by its absolute path (a relative path means the
    working directory of the command, which a resume from elsewhere would not share), a module by its name."""
    if spec.endswith(".py") or "/" in spec:
        return str(Path(spec).expanduser().resolve())
    return spec
