"""`serve`'s native heap: few malloc arenas, and freed memory handed back after a burst of decodes.

Each thread that decodes an image gets its own glibc malloc arena by default (up to eight per core), and an
arena keeps the pages a decode freed, so ``serve``'s resident memory grew with the requests in flight and
stayed up after they ended. :func:`bound_arenas` allows :data:`ARENAS` arenas (``mallopt(M_ARENA_MAX)``, what
``MALLOC_ARENA_MAX`` sets; the command line sets it before torch starts its threads) and :func:`trim` returns
the free pages (``malloc_trim``) once no decode runs. ``python tools/perf/serve_burst.py KB`` measures the
server's memory with requests of large images in flight and after them. Without glibc both do nothing, and a
user's ``MALLOC_ARENA_MAX`` is left as it is."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

__all__ = ["ARENAS", "bound_arenas", "glibc_function", "trim"]

#: malloc arenas ``serve`` allows (glibc's ``M_ARENA_MAX``): decodes run in a few worker threads
ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


@functools.cache
def glibc_function(name: str) -> Any | None:
    """glibc's function ``name`` through ctypes (None without glibc, or in a glibc without it)."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def bound_arenas(n: int = ARENAS) -> bool:
    """At most ``n`` malloc arenas for this process from now on (unless ``MALLOC_ARENA_MAX`` is set); True
    when glibc took it."""
    mallopt = glibc_function("mallopt")
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(mallopt(_M_ARENA_MAX, int(n)))


def trim() -> bool:
    """Hand the heap's free pages back to the operating system (glibc's ``malloc_trim(0)``); False
    without glibc."""
    fn = glibc_function("malloc_trim")
    if fn is None:
        return False
    fn(0)
    return True
