"""Lazy public names for a package ``__init__`` (PEP 562).

``import kvplan`` must stay cheap (the CLI starts fast, and importing planning must not pull
in Triton), so packages map each public name to the module that defines it and import that
module on first access.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` given ``{name: defining module}``.

    Example (in ``kvplan/plan/__init__.py``)::

        __getattr__, __dir__ = lazy_exports(__name__, {"InputMetadata": "kvplan.plan.metadata"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
