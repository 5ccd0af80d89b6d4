"""Errors of the continual learner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from proteus.errors import ProteusError

__all__ = ["TaskError", "need"]

T = TypeVar("T")


class TaskError(ProteusError, ValueError):
    """Bad task input, or a task that could not be learned (the message names the task or class)."""


def need(tensors: Mapping[str, T], name: str) -> T:
    """The tensor ``name`` of a stored object, or a :class:`TaskError` naming it."""
    if name not in tensors:
        raise TaskError(f"tensor {name!r} is missing (`proteus kb verify` checks the knowledge base)")
    return tensors[name]
