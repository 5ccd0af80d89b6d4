"""Timing side by side (interleaved repetitions, medians) and peak memory (CUDA allocator; CPU resident
set size sampled by a thread).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from proteus.heap import trim


# ====================================================================== timing and memory
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_call(fn: Callable[[], Any], dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def interleaved(
    fns: dict[str, Callable[[], Any]],
    dev: torch.device,
    reps: int | dict[str, int],
    warmup: int | dict[str, int] = 1,
) -> dict[str, list[float]]:
    """Time every function ``reps`` times (per name or for all), interleaved: round r runs the names in
    order, round r + 1 in reverse order, skipping a name once it has its repetitions. ``warmup`` untimed
    calls of each function come first. Returns the times in seconds per name."""
    names = list(fns)
    rep = reps if isinstance(reps, dict) else {n: int(reps) for n in names}
    warm = warmup if isinstance(warmup, dict) else {n: int(warmup) for n in names}
    for n in names:
        for _ in range(warm.get(n, 0)):
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    r = 0
    while any(len(times[n]) < rep[n] for n in names):
        for n in names if r % 2 == 0 else names[::-1]:
            if len(times[n]) < rep[n]:
                times[n].append(_time_call(fns[n], dev))
        r += 1
    return times


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _maxrss_bytes() -> int:
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


class PeakMemory:
    """Peak memory used inside a ``with`` block, in MiB (``.result``).

    CUDA: ``max_memory_allocated`` minus the allocated memory at entry (``peak_mb``). CPU: free heap
    memory is first returned to the system (``gc.collect`` and glibc's ``malloc_trim``), then the peak
    resident set size sampled every 2 ms by a thread, minus the resident size at entry (``peak_mb``),
    and the increase of ``ru_maxrss`` (only positive when the process reaches a new high-water mark).
    """

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.result: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            v = _rss_bytes()
            if v is not None and v > self._peak:
                self._peak = v
            self._stop.wait(0.002)

    def __enter__(self) -> PeakMemory:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            self._base = torch.cuda.memory_allocated(self.dev)
        else:
            gc.collect()
            trimmed = trim()
            self._base = _rss_bytes() or 0
            self._peak = self._base
            self._trimmed = trimmed
            self._maxrss0 = _maxrss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        mib = 2.0**20
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            peak = torch.cuda.max_memory_allocated(self.dev)
            self.result = {"kind": "cuda max_memory_allocated", "peak_mb": (peak - self._base) / mib}
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        v = _rss_bytes()
        if v is not None:
            self._peak = max(self._peak, v)
        self.result = {
            "kind": "cpu resident set size (sampled every 2 ms) minus RSS at entry"
            + (" (after malloc_trim)" if self._trimmed else ""),
            "peak_mb": (self._peak - self._base) / mib if self._base else None,
            "ru_maxrss_increase_mb": (_maxrss_bytes() - self._maxrss0) / mib,
        }


def _autocast(dev: torch.device) -> torch.autocast:
    """bfloat16 autocast on CUDA (as the learner), disabled elsewhere."""
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
