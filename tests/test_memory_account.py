"""tools/perf/memory_account.py: the long-stream harness's account of where resident memory goes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "perf"))

from memory_account import account, slopes, tensor_owners  # noqa: E402


class _Part:
    def __init__(self) -> None:
        self.table = torch.zeros(256, dtype=torch.float64)  # 2 KiB
        self.view = self.table[:10]  # a view: its storage counts once


class _Learner:
    def __init__(self) -> None:
        self.keys_ = {"a": torch.zeros(128)}  # 512 B
        self.model_ = nn.Sequential(nn.Linear(4, 2, bias=False))  # 32 B of weight
        self.part_ = _Part()
        self.again_ = self.part_.table  # reached twice: owned once, by the shorter path


def test_tensors_are_counted_once_under_the_shortest_path_reaching_them() -> None:
    owners = tensor_owners(_Learner())
    assert owners == {"again_": 2048, "keys_": 512, "model_.0": 32}


def test_an_account_and_its_slopes_say_what_grows_per_task() -> None:
    learner = _Learner()
    first = account(learner)
    learner.keys_["b"] = torch.zeros(2**18)  # 1 MiB more
    last = account(learner)
    per = slopes(first, last, 4)
    assert per["learner_tensors_mb"]["keys_"] == 0.25
    assert per["learner_tensors_total_mb"] == 0.25
    assert last["all_tensors_mb"] >= last["learner_tensors_total_mb"]
    if first["rss_anon_mb"] is not None:
        assert first["native_mb"] == first["rss_anon_mb"] - first["all_tensors_mb"]
    if first["native_malloc_mb"] is not None:  # glibc: the native rest is split in two parts that add up
        assert abs(first["native_malloc_mb"] + first["native_other_mb"] - first["native_mb"]) < 1e-9


def test_malloc_in_use_counts_a_new_tensors_bytes() -> None:
    """The split's ``malloc`` figure: a new 8 MiB tensor is memory malloc handed out (torch's CPU allocator
    takes its storage from malloc)."""
    from memory_account import _malloc_in_use

    before = _malloc_in_use()
    if before is None:
        pytest.skip("glibc's mallinfo2 is not available here")
    t = torch.ones(2**21)
    after = _malloc_in_use()
    assert after is not None and after - before >= t.numel() * t.element_size()


def test_the_process_count_skips_tensors_without_memory_of_their_own() -> None:
    """A tensor left behind by a functionalised trace (torch.compile leaves such tensors in the process) has
    no storage of its own: its data pointer raises; the count skips it."""
    from memory_account import _all_tensor_bytes

    kept: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        kept.append(y)
        return y

    torch.func.functionalize(f)(torch.ones(3))
    assert _all_tensor_bytes() > 0
    assert kept
