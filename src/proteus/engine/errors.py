"""Errors of the continual learner."""

from __future__ import annotations

__all__ = ["TaskError"]


class TaskError(ValueError):
    """Bad task input, or a task that could not be learned (the message names the task or class)."""
