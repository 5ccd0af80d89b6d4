"""Every progress bar of the package, made by :func:`bar`: on a terminal a tqdm bar as before; when the
bars' stream is not a terminal (``make demo | tee log``, a batch job's log file) no bar at all, so a log
holds the run's lines and not megabytes of carriage-return updates. In a notebook (tqdm's widget bars)
the bars stay.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _auto_tqdm
from tqdm.std import tqdm as std_tqdm

__all__ = ["bar", "is_tty"]


def is_tty(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is an interactive terminal (False for None, files, pipes and closed streams)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str | None = None,
    total: int | None = None,
    enabled: bool = True,
    file: IO[str] | None = None,
    **kwargs: Any,
) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one with ``total``), shown only when ``enabled`` and the
    bar's stream (``file``, default ``sys.stderr``) is a terminal; a disabled bar still iterates and takes
    ``update`` / ``set_postfix`` / ``close``. ``kwargs`` go to tqdm (``unit``, ...); ``leave=False`` and
    ``dynamic_ncols=True`` unless given."""
    stream = sys.stderr if file is None else file
    notebook = _auto_tqdm is not std_tqdm  # tqdm.auto chose the notebook widget: the stream is no terminal
    show = enabled and (notebook or is_tty(stream))
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, desc=desc, total=total, disable=not show, file=file, **kwargs)
