"""Task shares read on demand: what a part keeps per task, in memory only while it must be.

A learner's parts keep a share of every task they learned (the detector's Gaussians and calibration rows,
each task's own head, the inputs kept for forgetting). Once a task is committed to a knowledge base, its
share is there, memory-mapped (:class:`~proteus.kb.packs.StoredTensors`): the part need not hold it. A
:class:`TaskShares` holds, per task, either the value itself (a task learned in this process and not yet
committed: it cannot be read back from anywhere) or how to decode it from the task's stored tensors, and
decodes a stored task's value when it is first asked for, keeping the decoded values of the tasks used last
within a byte budget (least recently used out first). A prediction that shortlists a few tasks reads only
theirs, so the memory a learner holds stops growing with the tasks learned; the bytes the decoded values
reference are views of the knowledge base's mapped files (the page cache, which the operating system may
evict), their bookkeeping the only memory of the process.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Generic, TypeVar

import torch

__all__ = ["DEFAULT_BUDGET", "TaskShares", "nbytes"]

V = TypeVar("V")

#: the default byte budget of the decoded values a :class:`TaskShares` keeps
DEFAULT_BUDGET = 64 << 20


def nbytes(value: object) -> int:
    """The bytes of the tensors ``value`` holds (a tensor, or a list, tuple, dict or object of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    d = getattr(value, "__dict__", None)
    return sum(nbytes(v) for v in d.values() if isinstance(v, torch.Tensor)) if isinstance(d, dict) else 0


class TaskShares(MutableMapping[int, V], Generic[V]):
    """Task -> value: held (``shares[k] = v``: a task not yet stored), or bound to its stored tensors
    (:meth:`bind`) and decoded by ``decode(k, tensors)`` when first asked for; the decoded values within
    ``budget`` bytes are kept (least recently used out first; None: every one, 0: none), a value's bytes as
    ``size`` counts them (by default every tensor it holds; a decoder whose values are mostly views of the
    mapped files counts the copies it makes). Iteration and ``len`` cover both kinds without decoding;
    ``items()`` and ``values()`` decode every one."""

    def __init__(
        self,
        decode: Callable[[int, Mapping[str, torch.Tensor]], V],
        budget: int | None = DEFAULT_BUDGET,
        size: Callable[[V], int] = nbytes,
    ) -> None:
        self.decode, self.budget, self.size = decode, budget, size
        self._held: dict[int, V] = {}
        self._bound: dict[int, Mapping[str, torch.Tensor]] = {}
        self._decoded: OrderedDict[int, tuple[V, int]] = OrderedDict()
        self._decoded_bytes = 0

    # ------------------------------------------------------------------ the mapping
    def __getitem__(self, k: int) -> V:
        if k in self._held:
            return self._held[k]
        found = self._decoded.get(k)
        if found is not None:
            self._decoded.move_to_end(k)
            return found[0]
        tensors = self._bound[k]  # KeyError: neither held nor bound
        value = self.decode(k, tensors)
        self._keep(k, value)
        return value

    def __setitem__(self, k: int, value: V) -> None:
        self._forget_decoded(k)
        self._bound.pop(k, None)
        self._held[k] = value

    def __delitem__(self, k: int) -> None:
        if k not in self._held and k not in self._bound:
            raise KeyError(k)
        self._held.pop(k, None)
        self._bound.pop(k, None)
        self._forget_decoded(k)

    def __contains__(self, k: object) -> bool:
        return k in self._held or k in self._bound

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self._held, *self._bound}))

    def __len__(self) -> int:
        return len(self._held) + sum(1 for k in self._bound if k not in self._held)

    def clear(self) -> None:
        self._held, self._bound = {}, {}
        self._decoded.clear()
        self._decoded_bytes = 0

    # ------------------------------------------------------------------ stored tasks
    def bind(self, k: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Task k is stored as ``tensors``: its value is decoded from them when asked for (what was held or
        decoded for it is let go)."""
        self._held.pop(k, None)
        self._forget_decoded(k)
        self._bound[k] = tensors

    def held(self, k: int) -> bool:
        """Whether task k's value is held in memory (not read back from its stored tensors)."""
        return k in self._held

    def stored(self, k: int) -> Mapping[str, torch.Tensor] | None:
        """Task k's stored tensors where it is bound (None: held, or unknown)."""
        return self._bound.get(k)

    @property
    def decoded_bytes(self) -> int:
        """The bytes of the decoded values kept (at most the budget, but for the one used last)."""
        return self._decoded_bytes

    def holding(self, size: Callable[[V], int]) -> int:
        """The bytes the decoded values kept hold now, as ``size`` counts them (:attr:`decoded_bytes` counts
        each as its ``size`` when it was decoded: for values that make their copies later, what they may
        come to hold, the bound the budget keeps)."""
        return sum(size(v) for v, _ in self._decoded.values())

    def _keep(self, k: int, value: V) -> None:
        if self.budget == 0:
            return
        size = self.size(value)
        self._decoded[k] = (value, size)
        self._decoded_bytes += size
        while self.budget is not None and self._decoded_bytes > self.budget and len(self._decoded) > 1:
            _, (_, n) = self._decoded.popitem(last=False)
            self._decoded_bytes -= n

    def _forget_decoded(self, k: int) -> None:
        found = self._decoded.pop(k, None)
        if found is not None:
            self._decoded_bytes -= found[1]
