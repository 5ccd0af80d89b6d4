"""Task shares read on demand (:mod:`proteus.engine.stored`): a task's value is held until it is bound to its
stored tensors, then decoded when asked for, the decoded values used last kept within a byte budget."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from proteus.engine.stored import TaskShares, nbytes


def _decode(calls: list[int]):  # noqa: ANN202
    def decode(k: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        calls.append(k)
        return tensors["x"] * 1

    return decode


def test_a_bound_task_is_decoded_when_asked_for_and_kept_within_the_budget() -> None:
    calls: list[int] = []
    shares: TaskShares[torch.Tensor] = TaskShares(_decode(calls), budget=2 * 4 * 100)  # two values of 100
    shares[0] = torch.zeros(100)  # held: a task not yet stored
    for k in (1, 2, 3):
        shares.bind(k, {"x": torch.full((100,), float(k))})
    assert (
        shares.held(0)
        and not shares.held(1)
        and calls == []
        and len(shares) == 4
        and list(shares) == [0, 1, 2, 3]
    )
    assert float(shares[1][0]) == 1 and float(shares[1][0]) == 1 and calls == [1]  # decoded once, kept
    shares[2], shares[3]  # noqa: B018  (three decoded: the budget keeps the two used last)
    assert shares.decoded_bytes == 2 * 400 and calls == [1, 2, 3]
    shares[1]  # noqa: B018  (evicted: decoded again)
    assert calls == [1, 2, 3, 1]
    shares.bind(0, {"x": torch.ones(100)})  # task 0 committed: no longer held
    assert not shares.held(0) and float(shares[0][0]) == 1
    del shares[3]
    assert 3 not in shares and shares.get(3) is None and nbytes([torch.zeros(2), {"a": torch.zeros(3)}]) == 20


def test_a_budget_of_zero_decodes_every_time() -> None:
    calls: list[int] = []
    shares: TaskShares[torch.Tensor] = TaskShares(_decode(calls), budget=0)
    shares.bind(5, {"x": torch.ones(3)})
    shares[5], shares[5]  # noqa: B018
    assert calls == [5, 5] and shares.decoded_bytes == 0


def test_the_budget_counts_a_value_as_its_size_says() -> None:
    """``size``: what a decoded value costs the process (here a tenth of its tensor), so that a budget of
    the copies a decoder makes keeps more values than one of every byte they reference."""
    calls: list[int] = []
    shares: TaskShares[torch.Tensor] = TaskShares(
        _decode(calls), budget=3 * 40, size=lambda v: v.numel() * v.element_size() // 10
    )
    for k in range(4):
        shares.bind(k, {"x": torch.full((100,), float(k))})
    for k in range(4):
        shares[k]  # noqa: B018
    assert shares.decoded_bytes == 3 * 40  # three of 40 counted bytes each: task 0 out
    assert shares.holding(lambda v: int(v[0] > 1)) == 2  # what they hold now, as another size counts it
    shares[1], shares[2], shares[3]  # noqa: B018  (kept: not decoded again)
    assert calls == [0, 1, 2, 3]
    shares[0]  # noqa: B018
    assert calls == [0, 1, 2, 3, 0]
