"""Algorithm families; importing this package registers every algorithm by name.

Each family is a subpackage (``centralized``, ``decentralized``, ``split``, ``hierarchical``,
``confederated``) whose ``__init__`` imports its algorithm modules.
"""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if _info.ispkg:
        importlib.import_module(f"{__name__}.{_info.name}")
