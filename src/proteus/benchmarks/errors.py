"""Errors raised while building benchmark task streams (paper Sec. 5.1, Appendix "Datasets, Hyperparameters").

Every error names the file, folder or class it is about, so a user can fix the data without reading code.
The CLI can catch :class:`BenchmarkError` to print the message without a traceback.
"""

from __future__ import annotations


class BenchmarkError(Exception):
    """Base class of every benchmark/data error."""


class TaskSpecError(BenchmarkError, ValueError):
    """A task specification (YAML, num_tasks, groups) that does not fit the data."""


class DataNotFoundError(BenchmarkError, FileNotFoundError):
    """The data of a benchmark is missing; the message names the expected layouts and where to put them."""


class CorruptImageError(BenchmarkError, OSError):
    """An image file that cannot be decoded; the message names the file path."""
