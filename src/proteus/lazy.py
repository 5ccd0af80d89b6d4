"""Lazy package faces (PEP 562): a package names what it exports and from which of its modules, and a name
is imported on first use. ``import proteus.config`` then costs no torch import (the configuration's
sections live in packages whose other modules need torch), and ``proteus --help`` answers at once."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["exports"]


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose attribute ``name`` lives in its submodule
    ``names[name]`` (imported when the name is first used)."""

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    def dir_() -> list[str]:
        return sorted(names)

    return getattr_, dir_
