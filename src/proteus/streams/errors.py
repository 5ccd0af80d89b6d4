"""Errors raised while building benchmark task streams (paper Sec. 5.1, Appendix "Datasets, Hyperparameters").

Every error names the file, folder or class it is about, so a user can fix the data without reading code.
:class:`BenchmarkError` is a :class:`~proteus.errors.ProteusError` (and a ``ValueError``), so the CLI
prints its message (``error: ...``, exit code 2) without a traceback; its subclasses keep their historical
second base (``FileNotFoundError`` for missing data, ``OSError`` for an unreadable image) so existing
``except`` clauses still catch them.
"""

from __future__ import annotations

from proteus.errors import ProteusError
from proteus.images import ImageError


class BenchmarkError(ProteusError, ValueError):
    """Base class of every benchmark/data error (a ``ValueError``)."""


class TaskSpecError(BenchmarkError, ValueError):
    """A task specification (YAML, num_tasks, groups) that does not fit the data."""


class DataNotFoundError(BenchmarkError, FileNotFoundError):
    """The data of a benchmark is missing; the message names the expected layouts and where to put them."""


class CorruptImageError(BenchmarkError, ImageError, OSError):
    """An image file of a dataset that cannot be used (unreadable, corrupt, or above the pixel limit).

    Also an :class:`~proteus.images.ImageError` (the message starts with the file's path).
    """
