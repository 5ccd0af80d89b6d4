"""The version of proteus (a module of its own, so that any layer may import it)."""

from __future__ import annotations

__version__ = "0.1.0"
