"""Package faces whose names resolve on first use (PEP 562).

Each package's `__init__` lists what it offers, module by module; a name's module is imported
only when the name is first read. Why lazily: the agents and the controller import pieces of
the lower layers and must not pay for torch, and an eager face would import every module of
its package (and form import circles) whenever any one of them is imported.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_face(package: str, modules: dict[str, tuple[str, ...]]
              ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(`__all__`, `__getattr__`, `__dir__`) for `package`, given {module: names} under it."""
    where = {name: module for module, names in modules.items() for name in names}
    public = sorted(where)

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # resolved once
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return public, getattr_, dir_
