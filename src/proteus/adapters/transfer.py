"""Each task's row of S (Eq. 9): its transfer coefficients over the older tasks' directions.

Task k's update of a map is ``B diag(c_k) A^T`` with ``c_k`` = (s^(k) on the columns of older tasks, 1 on
its own columns, 0 after them). Over m tasks the rows s^(k) hold O(m) numbers each, O(m^2) in all: by the
method, every older direction enters a new task through S. A composition (prediction, a merged weight)
needs the rows of the tasks it composes only, so :class:`TransferRows` keeps each row where it already
lives instead of in one dense m x R matrix: a task learned in this process as its own tensor until a
knowledge base stores it, then as a view of that knowledge base's memory-mapped object (the page cache,
not this process's memory), and a pack of tasks read from a knowledge base as the pack's one tensor of
rows side by side. :meth:`TransferRows.dense` builds the rows of the tasks asked for (the dense matrix ``C``
of every task for analyses and baselines that read it whole).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence

import torch

__all__ = ["TransferRows"]

#: what a block no task reads any more is replaced with (the blocks' indices stay)
_NONE = torch.zeros(0)


class TransferRows:
    """The rows s^(k) of a unit's tasks, in blocks: each block a 1-D tensor of one or more tasks' rows end
    to end; task k's row is ``blocks[block[k]][offset[k] : offset[k] + start_k]``, with ``start_k`` the
    column where its own directions start (the unit's, :meth:`proteus.adapters.lora.LoRAUnit.columns`).
    A task whose own columns do not enter its composition with 1 (SD-LoRA's learned magnitude) keeps its
    coefficients in :attr:`own`."""

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []
        self._block = array("q")
        self._offset = array("q")
        #: task -> its coefficients on its own columns, where they are not 1
        self.own: dict[int, torch.Tensor] = {}

    @classmethod
    def from_dense(cls, C: torch.Tensor, ends: Sequence[int], width: int) -> TransferRows:
        """The rows of a dense (m, ``width``) matrix ``C`` of m tasks (``ends``: each one's end column): each
        row's older columns (views of ``C``), its own columns (kept apart where not 1); a ValueError when it
        does not fit or has coefficients after a task's own columns."""
        m = len(ends)
        if tuple(C.shape) != (m, width):
            raise ValueError(f"C {tuple(C.shape)} does not fit {m} tasks of {width} columns")
        cols = torch.arange(width, device=C.device)[None, :]
        later = cols >= torch.as_tensor(ends, device=C.device)[:, None]
        if m and bool(C[later].any()):
            raise ValueError("C: a task's row has coefficients on columns of later tasks")
        rows = cls()
        rows.append(C.detach().contiguous().reshape(-1), [width] * m)  # (row k at k * width)
        for k in range(m):
            own = C[k, (ends[k - 1] if k else 0) : ends[k]]
            if not bool((own == 1).all()):
                rows.own[k] = own.detach().clone()
        return rows

    def __len__(self) -> int:
        return len(self._block)

    def append(self, rows: torch.Tensor, lengths: Sequence[int]) -> None:
        """Append tasks whose rows (of ``lengths`` numbers each) lie end to end in ``rows`` (kept as it is: a
        view stays a view)."""
        self.blocks.append(rows.reshape(-1))
        self._block.extend(itertools.repeat(len(self.blocks) - 1, len(lengths)))
        self._offset.extend(itertools.accumulate(lengths[:-1], initial=0))

    def row(self, k: int, length: int) -> torch.Tensor:
        """Task k's row (``length`` numbers: the columns before its own), a view of its block."""
        o = self._offset[k]
        return self.blocks[self._block[k]][o : o + length]

    def adopt(
        self, first: int, rows: torch.Tensor, starts: list[int], lengths: list[int] | None = None
    ) -> bool:
        """Task ``first``'s row is now ``rows`` (the same numbers, stored elsewhere: a knowledge base's mapped
        object), or with ``lengths`` the rows of tasks ``first`` .. ``first + len(lengths) - 1``, end to end
        in ``rows`` (a pack); ``starts``: each one's row length (the unit's). The blocks no task reads any
        more are let go. False (nothing done) when the rows do not have those lengths."""
        if (lengths if lengths is not None else [rows.numel()]) != starts:
            return False
        at, b, n = self._block, self._block[first], len(self._block)
        alone = (first == 0 or at[first - 1] != b) and (first + 1 == n or at[first + 1] != b)
        if lengths is None and alone and self._offset[first] == 0:  # (a block's tasks are consecutive)
            self.blocks[b] = rows.reshape(-1)
            return True
        self._run(first, rows, lengths if lengths is not None else starts)
        return True

    def reads(self, k: int, rows: torch.Tensor) -> bool:
        """Whether task k's row is read from the start of ``rows`` (already adopted from it)."""
        block = self.blocks[self._block[k]]
        return self._offset[k] == 0 and block.numel() > 0 and block.data_ptr() == rows.data_ptr()

    def _run(self, first: int, rows: torch.Tensor, lengths: Sequence[int]) -> None:
        """Tasks ``first`` .. ``first + len(lengths) - 1`` read their rows from ``rows`` (end to end)."""
        end = first + len(lengths)
        old = set(self._block[first:end])
        self.blocks.append(rows.reshape(-1))
        self._block[first:end] = array("q", itertools.repeat(len(self.blocks) - 1, len(lengths)))
        self._offset[first:end] = array("q", itertools.accumulate(lengths[:-1], initial=0))
        for i in old - set(self._block):
            self.blocks[i] = _NONE

    def truncate(self, m: int) -> None:
        """Keep the first ``m`` tasks' rows (and the blocks they are in)."""
        del self._block[m:], self._offset[m:]
        del self.blocks[max(self._block, default=-1) + 1 :]
        self.own = {k: v for k, v in self.own.items() if k < m}

    def apply(self, fn: object) -> None:
        """Every block through ``fn`` (a module's move to another device or dtype)."""
        self.blocks = [fn(b) for b in self.blocks]  # type: ignore[operator]

    def dense(
        self, tasks: Sequence[int], ends: Sequence[int], width: int, like: torch.Tensor
    ) -> torch.Tensor:
        """(G, ``width``) coefficients of ``tasks`` on ``like``'s device and dtype: each task's row, then its
        own columns (1, or :attr:`own`), then zeros; ``ends``: each task's end column, the one before it
        being where its row stops."""
        G = len(tasks)
        out = like.new_zeros(G, width)
        if not G:
            return out
        starts = [ends[t - 1] if t > 0 else 0 for t in tasks]
        stops = [ends[t] for t in tasks]
        cols = torch.arange(width, device=out.device)[None, :]
        lo = torch.as_tensor(starts, device=out.device)[:, None]
        if any(starts):
            flat = torch.cat([self.row(t, n) for t, n in zip(tasks, starts)])
            out.masked_scatter_(cols < lo, flat.to(out.device, out.dtype))
        out.masked_fill_((cols >= lo) & (cols < torch.as_tensor(stops, device=out.device)[:, None]), 1.0)
        for g, t in enumerate(tasks) if self.own else ():  # (SD-LoRA's own coefficients; no other method's)
            if t in self.own:
                out[g, starts[g] : stops[g]] = self.own[t].to(out.device, out.dtype)
        return out
