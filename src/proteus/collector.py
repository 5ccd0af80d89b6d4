"""Python's cyclic garbage collector paused while a knowledge base is read.

Reading a long stream's knowledge base builds many small objects at once (a tensor view per stored tensor,
a record per task), and each of those allocations counts towards the collector's next pass; a full pass
scans every object alive, so the passes a load triggers grow with the tasks learned and, over a long
stream, cost more than the load (measured on the 1,000-task knowledge base of ``tools/perf/perf_long.py``:
0.45 of 0.95 s of ``Proteus.load``). What a load builds is kept, so no pass would free any of it:
:func:`collector_paused` turns the collector off for the load and back on after (it runs again at its next
threshold, as before).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside the block (as it was after; nested blocks keep it off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
