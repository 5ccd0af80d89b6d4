"""``proteus.heap`` and where ``serve`` uses it: the decode budget trims the heap after a burst of large
decodes, not after every small one."""

from __future__ import annotations

import threading

import pytest

from proteus import heap
from proteus.serve import app


def test_heap_calls_return_what_glibc_did() -> None:
    have = heap.glibc_function("malloc_trim") is not None
    assert heap.trim() is have
    assert heap.glibc_function("no_such_function_in_libc") is None


def test_a_user_arena_setting_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert heap.bound_arenas() is False


def test_the_decode_budget_trims_once_a_large_burst_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(app.heap, "trim", lambda: calls.append(1) or True)
    budget = app.PixelBudget(10 * app.TRIM_AFTER_PIXELS)
    never = threading.Event()
    small = app.TRIM_AFTER_PIXELS // 4
    for _ in range(3):  # small decodes one after the other: idle after each, but not yet a burst
        assert budget.acquire(small, never)
        budget.release(small)
    assert calls == []
    big = app.TRIM_AFTER_PIXELS
    assert budget.acquire(big, never) and budget.acquire(big, never)
    budget.release(big)
    assert calls == []  # another decode still runs
    budget.release(big)
    assert calls == [1]  # idle after more than TRIM_AFTER_PIXELS: trimmed once
    assert budget.acquire(small, never)
    budget.release(small)
    assert calls == [1]
