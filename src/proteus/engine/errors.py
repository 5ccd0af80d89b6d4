"""Errors of the continual learner."""

from __future__ import annotations

from proteus.errors import ProteusError

__all__ = ["TaskError"]


class TaskError(ProteusError, ValueError):
    """Bad task input, or a task that could not be learned (the message names the task or class)."""
