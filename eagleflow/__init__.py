"""eagleflow core: every step of the pipeline, runnable as ``python -m eagleflow <step>``.

Nothing here imports Airflow; the heavy libraries (torch, transformers, speculators) are
imported inside the functions that use them so ``import eagleflow`` stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, list[str]]) -> tuple[list[str], Callable[[str], Any]]:
    """A stage package's public names, imported from its modules on first use (PEP 562).

    Other stages import a stage only through these names (``from eagleflow.engine import EngineClient``;
    ``tests/test_package_architecture.py`` checks it). Importing the package imports none of its
    modules, so a name whose module needs torch costs nothing to the processes that never use it.

    :param package: the package's ``__name__``.
    :param exports: module (relative to the package) -> the names it gives.
    :returns: ``__all__`` and the module ``__getattr__`` to assign in the package's ``__init__``.
    """
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return sorted(where), __getattr__
