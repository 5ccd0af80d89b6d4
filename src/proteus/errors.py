"""The common base of proteus's own errors.

Every error that proteus raises on purpose -- a bad input, file or environment -- derives from
:class:`ProteusError`, and each keeps its historical built-in base as well (``ValueError``,
``RuntimeError``, ``OSError`` ...), so ``except ValueError`` in user code keeps working. The command
line reports a ``ProteusError`` as the user's error (one ``error: ...`` line, exit code 2); any other
exception is a bug in proteus (exit code 1).
"""

from __future__ import annotations

__all__ = ["ConfigError", "NotFittedError", "ProteusError"]


class ProteusError(Exception):
    """An error in the user's input, files or environment, with a message naming the file, task, key or
    device at fault."""


class NotFittedError(ProteusError, ValueError, AttributeError):
    """An estimator used before it was fitted (or loaded); as scikit-learn's, also a ``ValueError`` and an
    ``AttributeError``."""


class ConfigError(ProteusError, ValueError):
    """A configuration key or value that does not fit the schema."""
