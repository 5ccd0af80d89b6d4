"""LoRA with knowledge transfer and orthogonal new directions (Eq. 9 and Eq. 15).

For task k+1 the update of one adapted map W (p x q) is

    dW_{k+1} = sum_{tau<=k} B_tau S_tau A_tau^T + B_{k+1} A_{k+1}^T            (Eq. 9)

with the old rank-1 directions b_{tau,i} a_{tau,i}^T frozen, S_tau diagonal and learnable, and the new
directions constrained by <B_{k+1} A_{k+1}^T, B_tau A_tau^T> = 0 for every old task (Eq. 15).

Storage. A unit keeps every task's directions side by side, ``A`` (q x R) and ``B`` (p x R), and each
task's row of S (:class:`~proteus.adapters.transfer.TransferRows`, where the row lives: a knowledge base's
mapped object once stored). The composition matrix ``C`` (m x R) has row k = s^(k) on the columns of older
tasks, 1 on task k's own columns and 0 after them; any task's update is ``B diag(C[k]) A^T`` and a forward
that applies a different task to each group of a batch is two ordinary matmuls and a per-group diagonal
scale: ``((x A) * C[tasks]) B^T`` -- no gather of per-task matrices (the *factored* forward), the rows of
``C[tasks]`` built for the tasks composed only. Only the columns up to the last composed task's enter it
(the later ones have coefficient 0).

Merged forward. When the rank stacked over tasks is large against the map's width (MobileNetV2's early
1x1 convolutions: m x r = 40 > 16..32 channels), the factored update costs more than the map itself. A
:class:`LoRAWrapper` can then run each group with its own merged weight ``W_k = W_0 + B diag(C[k]) A^T``
(Eq. 9 summed into the map once, cached per task): each group costs exactly one plain map, so a forward
of m compositions costs m plain forwards. :class:`~proteus.adapters.model.AdaptedBackbone` chooses the
form per map from the shapes (:meth:`LoRAWrapper.factored_cost`); both agree to float round-off.

Orthogonality. The new A is kept in the orthogonal complement of span(A_old): A_new = (I - QQ^T) A_raw
with Q an orthonormal basis of the old columns. Then A_tau^T A_new = 0 and therefore
<B_new A_new^T, B_tau A_tau^T>_F = tr((A_tau^T A_new)(B_new^T B_tau)) = 0 to numerical precision, for
any B. This is sufficient for Eq. 15's constraint and leaves B free. When the old span fills the input
space no new orthogonal direction exists; the rank is reduced (and reported) instead.

The basis Q is extended one task at a time: each task's columns are orthogonalised against the basis of the
older ones (classical Gram-Schmidt, twice, in float64) and orthonormalised (QR), so opening task k costs
O(q R r), not a QR of the whole q x R matrix, O(q R^2) (else the cost of opening task k grows with k). It is
built the same way from the first task after a truncation, a load from a knowledge base, or a move to another
device or dtype, so that a learner restored from a knowledge base trains bit for bit as the one that never
stopped. Once the old columns fill the input space (``total_rank == in_features``: every later task opens
with rank 0) nothing is left to project out and no basis is kept (a q x q matrix per map that no task
reads); a truncation that frees room builds it again from the first task.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from proteus.adapters.options import TRANSFER_INIT
from proteus.adapters.transfer import TransferRows

#: consecutive tasks as a knowledge base stores them (:meth:`LoRAUnit.append_stored`): their directions A
#: (q, sum r) and B (p, sum r) side by side, each task's columns in turn, their rows of S concatenated (each
#: the columns before the task), each task's rank and row length
Stored = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]


class LoRAUnit(nn.Module):
    """The adapter state of one adapted map (one weight matrix, or one output slice of a fused matrix)."""

    # buffers (registered in __init__, reassigned as tasks are added or dropped)
    A: torch.Tensor
    B: torch.Tensor
    s_fixed: torch.Tensor
    basis: torch.Tensor

    def __init__(self, in_features: int, out_features: int, scaling: float = 1.0) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scaling = float(scaling)
        self.register_buffer("A", torch.zeros(in_features, 0))
        self.register_buffer("B", torch.zeros(out_features, 0))
        #: each task's row of S (Eq. 9), where it lives
        self.rows = TransferRows()
        #: the buffers A and B are top-left views of (:func:`_grown`)
        self._bufs: dict[str, torch.Tensor] = {}
        self.ranks: list[int] = []
        # the task being trained
        self.A_new: nn.Parameter | None = None
        self.B_new: nn.Parameter | None = None
        self.s: nn.Parameter | None = None
        self.register_buffer("s_fixed", torch.zeros(0))
        #: an orthonormal basis of the first ``_basis_tasks`` tasks' columns of A (:meth:`_extend_basis`)
        self.register_buffer("basis", torch.zeros(in_features, 0))
        self._basis_tasks = 0
        self.orthogonal = True
        #: the composition of the next forwards (:func:`set_composition`); None: the training composition
        self.composed: Composed | None = None
        #: (the ranks list, each task's end column): the cumulative ranks (:meth:`_end`)
        self._ends: tuple[list[int] | None, tuple[int, ...]] = (None, ())
        #: bumped whenever stored tasks are dropped (merged weights cached from them are then stale)
        self.generation = 0
        #: coefficient of the open task's own directions in the training forward (None: 1; SD-LoRA's
        #: learned magnitude of the current direction)
        self.new_scale: torch.Tensor | None = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def total_rank(self) -> int:
        return int(self.A.shape[1])

    @property
    def num_tasks(self) -> int:
        return len(self.ranks)

    @property
    def training_task(self) -> bool:
        return self.A_new is not None

    @property
    def C(self) -> torch.Tensor:
        """(m, R): every task's composition coefficients (module doc, "Storage"), built when asked for."""
        return self.coefficient_rows(list(range(self.num_tasks)))

    @C.setter
    def C(self, C: torch.Tensor) -> None:
        """Every task's coefficients from a dense (m, R) matrix over the unit's tasks (:attr:`ranks` set)."""
        ends = [self._end(t) for t in range(len(self.ranks))]
        self.rows = TransferRows.from_dense(C, ends, self.total_rank)
        self.generation += 1

    def row(self, task: int) -> torch.Tensor:
        """Task ``task``'s row of S: its coefficients over the older tasks' columns (a view)."""
        return self.rows.row(task, self.columns(task).start)

    def coefficient_rows(self, tasks: list[int]) -> torch.Tensor:
        """(G, R): the rows of C of ``tasks`` (Eq. 9), on the unit's device and dtype."""
        if tasks:
            self._end(max(tasks))  # (each task's end column known up to the last of them)
        return self.rows.dense(tasks, self._ends[1], self.total_rank, self.A)

    def scale_own(self, task: int, value: torch.Tensor) -> None:
        """Task ``task``'s own columns enter its composition with ``value`` instead of 1 (SD-LoRA's
        magnitude)."""
        self.rows.own[task] = value.detach().reshape(-1).expand(self.ranks[task]).clone()
        self.generation += 1

    def adopt(self, first: int, rows: torch.Tensor, lengths: list[int] | None = None) -> bool:
        """Task ``first``'s row of S is stored as ``rows`` (its committed object, memory-mapped: the same
        numbers), held from there instead of in this process's memory; with ``lengths``, the rows of tasks
        ``first`` .. ``first + len(lengths) - 1`` end to end (a knowledge base's pack: one view). False
        (nothing done) when they do not fit, or lie on another device or dtype."""
        if lengths is not None and self.rows.reads(first, rows):
            return True  # (adopted already: a pack's other tasks)
        starts = [self.columns(k).start for k in range(first, first + len(lengths or [rows]))]
        return (rows.device, rows.dtype) == (self.A.device, self.A.dtype) and self.rows.adopt(
            first, rows, starts, lengths
        )

    def _apply(self, fn: Any, recurse: bool = True) -> LoRAUnit:
        out = super()._apply(fn, recurse)
        self.rows.apply(fn)
        return out

    def _end(self, task: int) -> int:
        """The column after task ``task``'s (0 for task -1) (:func:`_cumulative`)."""
        self._ends = _cumulative(self.ranks, self._ends)
        return self._ends[1][task] if task >= 0 else 0

    def columns(self, task: int) -> slice:
        return slice(self._end(task - 1), self._end(task))

    # ------------------------------------------------------------------ task life cycle
    def begin_task(self, rank: int, transfer: str, orthogonal: bool, generator: torch.Generator) -> int:
        """Open task k+1: r new directions (orthogonal to the old ones) and S over the old ones."""
        if transfer not in TRANSFER_INIT:
            raise ValueError(f"transfer must be one of {tuple(TRANSFER_INIT)}, got {transfer!r}")
        if self.training_task:
            raise RuntimeError("begin_task called twice without end_task")
        dev, dt = self.A.device, self.A.dtype
        R = self.total_rank
        self.orthogonal = orthogonal
        if orthogonal:
            rank = max(0, min(rank, self.in_features - R))
            self._extend_basis()
        bound = 1.0 / math.sqrt(self.in_features)  # PEFT's kaiming_uniform(a=sqrt(5)) for lora_A
        a = (torch.rand(self.in_features, rank, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        self.A_new = nn.Parameter(a.to(device=dev, dtype=dt))
        self.B_new = nn.Parameter(torch.zeros(self.out_features, rank, device=dev, dtype=dt))
        fill = TRANSFER_INIT[transfer]
        if fill is None and R:
            self.s = nn.Parameter(torch.zeros(R, device=dev, dtype=dt))
            self.s_fixed = torch.zeros(0, device=dev, dtype=dt)
        else:
            self.s = None
            self.s_fixed = torch.full((R,), fill or 0.0, device=dev, dtype=dt)
        return rank

    @torch.no_grad()
    def _extend_basis(self) -> None:
        """Make :attr:`basis` an orthonormal basis of span(A), one task's columns at a time (module doc,
        "Orthogonality": O(q R r) per task, built the same way after a truncation, a load or a move, none kept
        once the room is full)."""
        if self.total_rank >= self.in_features:
            self.basis, self._basis_tasks = self.A.new_zeros(self.in_features, 0), self.num_tasks
            return
        A, Q = self.A, self.basis
        if self._basis_tasks > self.num_tasks or Q.device != A.device or Q.dtype != A.dtype:
            Q, self._basis_tasks = A.new_zeros(self.in_features, 0), 0
        for t in range(self._basis_tasks, self.num_tasks):
            Q = torch.cat([Q, _orthonormal_complement(Q, A[:, self.columns(t)])], 1)
        self._basis_tasks = self.num_tasks
        self.basis = Q

    def projected_A_new(self) -> torch.Tensor:
        assert self.A_new is not None
        if self.orthogonal and self.basis.shape[1]:
            return self.A_new - self.basis @ (self.basis.T @ self.A_new)
        return self.A_new

    def transfer_coefficients(self) -> torch.Tensor:
        return self.s if self.s is not None else self.s_fixed

    @torch.no_grad()
    def end_task(self) -> None:
        """Freeze the trained directions and S: append them to A, B and a new row of C."""
        if not self.training_task:
            raise RuntimeError("end_task called without begin_task")
        a_k = self.projected_A_new().detach().clone()
        assert self.B_new is not None
        b_k = self.B_new.detach().clone()
        s_k = self.transfer_coefficients().detach().clone()
        self.append_task(a_k, b_k, s_k)
        self.abort_task()

    def abort_task(self) -> None:
        """Close a task still being trained without keeping anything of it."""
        dev, dt = self.A.device, self.A.dtype
        self.A_new = self.B_new = self.s = None
        self.s_fixed = torch.zeros(0, device=dev, dtype=dt)

    @torch.no_grad()
    def truncate(self, m: int) -> None:
        """Keep the first ``m`` tasks only (abort an open task first): the rollback of a failed task."""
        if self.training_task:
            self.abort_task()
        if self.num_tasks > m:
            start = self.columns(m).start
            self.A, self.B = self.A[:, :start], self.B[:, :start]
            self.rows.truncate(m)
            self.ranks = self.ranks[:m]
            self.generation += 1
            # the basis now covers more tasks than are left: _extend_basis rebuilds it at the next task

    def append_task(self, a_k: torch.Tensor, b_k: torch.Tensor, s_k: torch.Tensor) -> None:
        """Append one task's directions (q x r, p x r) and its transfer coefficients over older columns."""
        self.append_tasks([(a_k, b_k, s_k)])

    def append_tasks(
        self, tasks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], names: Sequence[str] | None = None
    ) -> None:
        """:meth:`append_task` for many tasks at once (:meth:`append_stored`, one task a piece)."""
        self.append_stored([(a, b, s, [int(a.shape[-1]) if a.ndim else 0], [s.numel()]) for a, b, s in tasks],
                           names)  # fmt: skip

    @torch.no_grad()
    def append_stored(self, pieces: list[Stored], names: Sequence[str] | None = None) -> None:
        """Append tasks as a knowledge base stores them (:data:`Stored` pieces: one task, or the tasks of a
        pack, :func:`proteus.kb.packs.spans`): checked (a ValueError names the task, by ``names`` or its
        number), then appended by a few whole-matrix operations for all of them (:func:`_append_block`)."""
        _check_pieces(self, pieces, names)
        if pieces:
            A, B = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1)
            _append_block(self, A, B, [r for p in pieces for r in p[3]])
            dev, dt = self.A.device, self.A.dtype
            for p in pieces:  # each piece's rows as they are (a pack's: a view of its mapped file)
                self.rows.append(p[2].to(dev, dt), p[4])

    def task_tensors(self, task: int) -> dict[str, torch.Tensor]:
        """What a knowledge base stores for one task: its own directions and its row of S, on the CPU, as
        copies (:func:`_own`), never views. Built when asked for: a knowledge base asks only for a task it
        has not stored as it is (:class:`proteus.learners.TaskParts`), so no second copy of every task is
        kept for it."""
        c = self.columns(task)
        return {"A": _own(self.A[:, c]), "B": _own(self.B[:, c]), "s": _own(self.row(task))}

    # ------------------------------------------------------------------ compositions
    def coefficients(self, tasks: list[int], kind: str = "task") -> torch.Tensor:
        """(G, R) coefficients of a composition ``kind`` (:data:`COMPOSITION_KINDS`) for each task."""
        return _composition(kind)(self, tasks)

    def used_columns(self, tasks: list[int]) -> int:
        """How many leading columns the compositions of ``tasks`` can use (later ones have coefficient 0
        in every kind: a task composes its own and older directions only)."""
        return self._end(max(tasks)) if tasks else 0

    def merged_updates(self, tasks: list[int], kind: str = "task") -> torch.Tensor:
        """(G, p, q): each task's whole update ``scaling * B diag(coef) A^T`` (Eq. 9) as one matrix, over the
        columns the coefficients keep (:func:`sparse_columns`)."""
        cols = self.used_columns(tasks)
        coef, keep = sparse_columns(self.coefficients(tasks, kind)[:, :cols])
        A, B = _columns(self.A, keep, cols), _columns(self.B, keep, cols)
        dW = ((B if B.ndim == 3 else B[None]) * coef[:, None, :]) @ A.mT
        return self._scale(dW)

    # ------------------------------------------------------------------ forward
    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x: (G, M, q) grouped inputs -> (G, M, p) update, each group with its own composition."""
        if self.composed is not None:
            coef, cols = self.composed.form(x.shape[1])
            if coef.shape[1] == 0:
                return x.new_zeros(*x.shape[:-1], self.out_features)
            A, B = self._composed(x.dtype, coef, cols)
            u = (x @ A) * coef.to(x.dtype)[:, None, :]
            return self._scale(u @ B.mT)
        if not self.training_task:  # no composition set and nothing being trained: frozen backbone
            return x.new_zeros(*x.shape[:-1], self.out_features)
        return self._scale(self._new_update(x) + self._old_update(x))

    def _new_update(self, x: torch.Tensor) -> torch.Tensor:
        """The open task's own directions, ``x A_new B_new^T`` (times SD-LoRA's magnitude when set)."""
        dt = x.dtype
        assert self.B_new is not None
        u = x @ self.projected_A_new().to(dt)
        if self.new_scale is not None:
            u = u * self.new_scale.to(dt)
        return u @ self.B_new.to(dt).T

    def _old_update(self, x: torch.Tensor) -> torch.Tensor | float:
        """The frozen old directions through S, ``x A diag(s) B^T`` (Eq. 9's sum over older tasks). A and
        B are buffers, kept apart from the new directions: the backward computes no gradient for them (a
        concatenation with the new ones would make autograd compute the whole (q + p) x R of it at every
        step, and copy A and B twice)."""
        if not self.total_rank:
            return 0.0
        dt = x.dtype
        return ((x @ self.A.to(dt)) * self.transfer_coefficients().to(dt)) @ self.B.to(dt).T

    def _scale(self, d: torch.Tensor) -> torch.Tensor:
        return d if self.scaling == 1.0 else d * self.scaling

    def delta_conv(self, x: torch.Tensor, groups: int) -> torch.Tensor | None:
        """Grouped update for a 1x1 convolution on NCHW input, (G*n, q, H, W) -> (G*n, p, H, W)
        (:func:`_grouped_1x1`); None when nothing is composed."""
        if self.composed is None or self.composed.coef.shape[1] == 0:
            return None
        coef, cols = self.composed.form(x.shape[0] // groups * x.shape[2] * x.shape[3])
        A, B = self._composed(x.dtype, coef, cols)
        return self._scale(_grouped_1x1(x, A, B, coef.to(x.dtype), groups))

    def _composed(
        self, dtype: torch.dtype, coef: torch.Tensor, cols: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns of A and B that a composition runs (``coef``, its columns ``cols``:
        :meth:`Composed.form`): (q, c) and (p, c), or per group (G, q, c) and (G, p, c)
        (:func:`sparse_columns`)."""
        n = coef.shape[1]
        return _columns(self.A, cols, n).to(dtype), _columns(self.B, cols, n).to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, ranks={self.ranks}"


def _cumulative(
    ranks: list[int], known: tuple[list[int] | None, tuple[int, ...]]
) -> tuple[list[int] | None, tuple[int, ...]]:
    """(``ranks``, each task's end column): the cumulative ranks, extended from ``known`` (computed for the
    same list, which only grows while tasks are appended) by the tasks added since."""
    of, ends = known
    if of is not ranks or len(ends) > len(ranks):
        of, ends = ranks, ()
    if len(ends) < len(ranks):
        start = ends[-1] if ends else 0
        ends = ends + tuple(itertools.accumulate(ranks[len(ends) :], initial=start))[1:]
    return of, ends


def _composition(kind: str) -> Callable[[LoRAUnit, list[int]], torch.Tensor]:
    try:
        return COMPOSITION_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown composition kind {kind!r}; one of {sorted(COMPOSITION_KINDS)}") from None


#: a composition selects its nonzero columns (:func:`sparse_columns`) from this many columns on
SPARSE_FROM = 64
#: groups run their own columns (:func:`sparse_columns`) only when each group's positions times the columns
#: that saves reach this many times its own columns (:meth:`Composed.form`): gathering a group's columns
#: copies them, and a group of few positions (a small image's last maps, one image per task) then costs
#: more than running the union of the groups' columns for every row (measured on a CPU:
#: ``tools/perf/perf_columns.py``)
OWN_COLUMNS_MIN_WORK = 128.0


def sparse_columns(coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``coef`` (G, cols) restricted to the columns its groups' coefficients keep, and their indices, when
    that saves most of at least :data:`SPARSE_FROM` columns (the elastic net of Eq. 15 zeroes most of S: a
    task's composition then costs its own directions and the few old ones it uses, not every older
    direction): each group's own nonzero columns, (G, c) indices and coefficients (zeros where a group has
    fewer), when their union is over twice the most any group keeps (many groups, each of other tasks: a
    batch spread over many tasks costs each image its own task's columns, not every task's); else the
    union, (c,) indices (:func:`union_columns`); else ``coef`` itself and None. The same update: the columns
    left out add exact zeros."""
    G, cols = coef.shape
    if cols < SPARSE_FROM:
        return coef, None
    nonzero = coef.ne(0)
    most = int(nonzero.sum(1).max()) if G else 0
    if G > 1 and 2 * most < int(nonzero.any(0).sum()):
        own = nonzero.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :most]
        return coef.gather(1, own), own
    return union_columns(coef, nonzero)


def union_columns(
    coef: torch.Tensor, nonzero: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``coef`` (G, cols) over the union of its groups' nonzero columns and their (c,) indices when that
    keeps at most half of them, else ``coef`` itself and None (:func:`sparse_columns`)."""
    keep = (coef.ne(0) if nonzero is None else nonzero).any(0).nonzero().flatten()
    if 2 * len(keep) > coef.shape[1]:
        return coef, None
    return coef[:, keep], keep


@dataclass
class Composed:
    """A unit's composition for the next forwards (:func:`set_composition`): each group's (row's) coefficients
    ``coef`` (G, c) over the columns ``cols`` of A and B (None: the first c; (c,): the same for every group;
    (G, c): each group its own, :func:`sparse_columns`), and where each group has its own, the same
    composition over the union of the groups' columns, ``union`` (coefficients, columns)."""

    coef: torch.Tensor
    cols: torch.Tensor | None = None
    union: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def form(self, positions: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(coefficients, columns) for groups of ``positions`` rows each: each group's own columns, or the
        union's where gathering them would not pay (the gather copies every group's columns of A and B,
        which pays only when the positions times the columns it saves reach :data:`OWN_COLUMNS_MIN_WORK`
        times its columns)."""
        if self.union is not None:
            own, union = self.coef.shape[1], self.union[0].shape[1]
            if positions * (union - own) < OWN_COLUMNS_MIN_WORK * own:
                return self.union
        return self.coef, self.cols


def set_composition(u: LoRAUnit, coef: torch.Tensor, sizes: list[int] | None = None) -> None:
    """Set unit ``u``'s composition for the next forwards: group g with coefficients ``coef[g]`` over the
    columns :func:`sparse_columns` keeps, repeated for the ``sizes[g]`` rows of unequal groups; where each
    group keeps its own columns, the union's form beside it (:class:`Composed`)."""
    full = coef
    coef, cols = sparse_columns(full)
    union = union_columns(full) if cols is not None and cols.ndim == 2 else None
    if sizes is not None:
        reps = torch.as_tensor(sizes, device=coef.device)
        coef = coef.repeat_interleave(reps, 0)
        if cols is not None and cols.ndim == 2:  # each row its group's own columns
            cols = cols.repeat_interleave(reps, 0)
        if union is not None:
            union = (union[0].repeat_interleave(reps, 0), union[1])
    u.composed = Composed(coef, cols, union)


def _columns(t: torch.Tensor, cols: torch.Tensor | None, n: int) -> torch.Tensor:
    """Columns of A or B (rows x R): the first ``n`` (``cols`` None), those of ``cols`` (c,) -- or, per group,
    those of each row of ``cols`` (G, c), as (G, rows, c) (:func:`sparse_columns`)."""
    if cols is None:
        return t[:, :n]
    return t[:, cols] if cols.ndim == 1 else t[:, cols].permute(1, 0, 2)


def _grown(
    buf: torch.Tensor | None, view: torch.Tensor, shape: tuple[int, int], most: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer and its top-left ``shape`` view that holds ``view``'s numbers: ``buf`` itself when ``view`` is
    its top-left corner and it is large enough, else a new zeroed one with each growing dimension half as
    large again (amortised O(1) copies per appended number), the columns no more than ``most`` (the most
    the unit can hold) when that is enough. A device or dtype move, or a tensor assigned in place of the
    view (a baseline's load), starts a new buffer."""
    ours = (
        buf is not None
        and view.data_ptr() == buf.data_ptr()
        and (view.numel() == 0 or view.stride() == buf.stride())
        and (buf.device, buf.dtype) == (view.device, view.dtype)
    )
    if buf is None or not ours or buf.shape[0] < shape[0] or buf.shape[1] < shape[1]:
        cap = [n if n <= have else max(n, have + have // 2, 4) for n, have in zip(shape, view.shape)]
        if most is not None and shape[1] <= most:
            cap[1] = min(cap[1], most)
        buf = view.new_zeros(cap)
        buf[: view.shape[0], : view.shape[1]] = view
    return buf, buf[: shape[0], : shape[1]]


def _append_block(u: LoRAUnit, A: torch.Tensor, B: torch.Tensor, ranks: list[int]) -> None:
    """Append checked tasks' directions stored side by side to unit ``u`` (:meth:`LoRAUnit.append_stored`;
    their rows of S go to :attr:`LoRAUnit.rows`). A and B are views of buffers grown by half at a time
    (:func:`_grown`): an append copies the new tasks' numbers only, not every older task's, so learning task
    k, and loading k tasks, costs no more per task on a long stream than on a short one."""
    dev, dt = u.A.device, u.A.dtype
    R0 = u.total_rank
    R = R0 + int(sum(ranks))
    most = u.in_features  # (orthogonal directions: at most q of them, Eq. 15)
    u._bufs["A"], u.A = _grown(u._bufs.get("A"), u.A, (u.in_features, R), most)
    u._bufs["B"], u.B = _grown(u._bufs.get("B"), u.B, (u.out_features, R), most)
    u.A[:, R0:] = A.to(dev, dt)
    u.B[:, R0:] = B.to(dev, dt)
    u.ranks.extend(map(int, ranks))


def _check_pieces(u: LoRAUnit, pieces: list[Stored], names: Sequence[str] | None) -> None:
    """Whether stored tasks' directions and coefficients fit unit ``u`` (:meth:`LoRAUnit.append_stored`): a
    ValueError names the first task that does not, by ``names`` or its number."""
    R, i = u.total_rank, 0
    for A, B, s, ranks, counts in pieces:
        who = names[i] if names else f"task {u.num_tasks + i + 1}"
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1] or A.shape[1] != sum(ranks):
            shapes = f"A {tuple(A.shape)} and B {tuple(B.shape)}"
            raise ValueError(f"{who}: directions {shapes} must be (q, r) and (p, r)")
        if (A.shape[0], B.shape[0]) != (u.in_features, u.out_features):
            raise ValueError(
                f"{who}: directions A {tuple(A.shape)}, B {tuple(B.shape)} do not fit a map of "
                f"{u.in_features} -> {u.out_features} features"
            )
        if s.numel() != sum(counts):
            raise ValueError(f"{who}: transfer coefficients: {s.numel()} entries for rows of {counts}")
        if len(counts) != len(ranks):
            raise ValueError(f"{who}: {len(counts)} rows of transfer coefficients for {len(ranks)} tasks")
        expected = list(itertools.accumulate(ranks, initial=R))  # each task's row: the columns before it
        if counts != expected[:-1]:
            j = next(j for j, (c, e) in enumerate(zip(counts, expected)) if c != e)
            who = names[i + j] if names else f"task {u.num_tasks + i + j + 1}"
            raise ValueError(f"{who}: transfer coefficients have {counts[j]} entries, expected {expected[j]}")
        R, i = expected[-1], i + len(ranks)


def _grouped_1x1(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, coef: torch.Tensor, groups: int
) -> torch.Tensor:
    """``B diag(coef[g]) A^T`` applied to each group g of x (G*n, q, H, W) as a 1x1 map, as two GEMMs:
    channels first, (cols, q) @ (n, q, HW), over >= 16 positions, else rows of q channels (as the merged
    form, :meth:`LoRAWrapper._merged_forward`). Not as convolutions: the composed columns grow with every
    task, and oneDNN compiles and caches kernels per shape, so a long stream grew its native memory with
    every task (docs/performance.md, "`long-300`"). The result may be a channels-last view."""
    n, q, h, w = x.shape
    if h * w >= 16 and x.is_contiguous():
        At, Bg = (A.mT, B) if A.ndim == 2 else (A.mT[:, None], B[:, None])  # per group: (G, 1, ...)
        u = At @ x.view(groups, n // groups, q, h * w)  # (G, n/G, cols, HW)
        return (Bg @ (u * coef[:, None, :, None])).view(n, -1, h, w)  # (G, n/G, p, HW)
    rows = x.movedim(1, -1).reshape(groups, -1, q)  # (G, n/G HW, q)
    d = ((rows @ A) * coef[:, None, :]) @ B.mT  # (G, n/G HW, p)
    return d.view(n, h, w, -1).movedim(-1, 1)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t``: a view (a column block of A is one) would keep alive the whole matrix
    it was cut from when the task was stored, one matrix per stored task (O(m^3) numbers over m tasks)."""
    return t.detach().cpu().clone(memory_format=torch.contiguous_format)


def _orthonormal_complement(Q: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning what ``new`` (q x r) adds to span(Q) (Q: q x b, orthonormal), in Q's
    dtype: classical Gram-Schmidt against Q twice in float64, then QR. A column already in the span (only
    without orthogonal new directions) adds nothing: what is left of it is its own rounding."""
    n64, Q64 = new.double(), Q.double()
    N = n64
    for _ in range(2):
        N = N - Q64 @ (Q64.T @ N)
    q, r = torch.linalg.qr(N)
    keep = r.diagonal().abs() > torch.finfo(new.dtype).eps * new.shape[0] * n64.norm(dim=0)
    return q[:, keep].to(Q.dtype)


def _task_rows(u: LoRAUnit, tasks: list[int]) -> torch.Tensor:
    """Eq. 9 for each task: its row of C."""
    return u.coefficient_rows(tasks)


def _all_units(u: LoRAUnit, tasks: list[int]) -> torch.Tensor:
    """Every unit up to the task, summed with weight 1 (the O-LoRA-like ablation)."""
    ends = torch.as_tensor([sum(u.ranks[: t + 1]) for t in tasks], device=u.A.device)
    return (torch.arange(u.total_rank, device=u.A.device)[None, :] < ends[:, None]).to(u.A.dtype)


def _no_units(u: LoRAUnit, tasks: list[int]) -> torch.Tensor:
    return torch.zeros(len(tasks), u.total_rank, device=u.A.device, dtype=u.A.dtype)


#: composition kinds: (unit, tasks) -> (G, R) coefficients
COMPOSITION_KINDS = {"task": _task_rows, "all-units": _all_units, "none": _no_units}

#: how the old directions enter a new task: S learned (Eq. 15), S = 0, or S = I


class MergedCache:
    """The merged weights ``W_0 + B diag(C[k]) A^T`` of every wrapper of a backbone, held within a byte
    ``budget`` (None: no limit): beyond it the least recently used are dropped first. Keys are ``(owner,
    kind, task)``; a wrapper drops its own entries when its stored tasks change."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.entries: OrderedDict[tuple[int, str, int], torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def get(self, key: tuple[int, str, int]) -> torch.Tensor | None:
        w = self.entries.get(key)
        if w is not None:
            self.entries.move_to_end(key)
        return w

    def put(self, key: tuple[int, str, int], w: torch.Tensor) -> torch.Tensor:
        """Keep ``w`` under ``key`` in storage of its own (a view of a larger block would keep the whole block
        alive past its eviction, beyond the bytes counted here); returns the tensor kept."""
        if w.untyped_storage().nbytes() != w.numel() * w.element_size():
            w = w.clone()
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        self.entries[key] = w
        self.nbytes += w.numel() * w.element_size()
        return w

    def evict(self, keep: frozenset[tuple[int, str, int]] = frozenset()) -> None:
        """Drop least recently used entries (other than ``keep``) until the cache fits its budget."""
        if self.budget is None:
            return
        for key in list(self.entries):
            if self.nbytes <= self.budget:
                break
            if key not in keep:
                w = self.entries.pop(key)
                self.nbytes -= w.numel() * w.element_size()

    def fitting(self, sizes: list[tuple[str, int]], n_tasks: int, bounded: bool = True) -> set[str]:
        """Of maps ``(name, bytes of one task's merged weight)``, costliest first: those whose merged
        weights for ``n_tasks`` tasks fit the budget together (all of them when not ``bounded``)."""
        left = self.budget if bounded else None
        out = set()
        for name, size in sizes:
            if left is not None:
                if n_tasks * size > left:
                    continue
                left -= n_tasks * size
            out.add(name)
        return out

    def drop(self, owner: int) -> None:
        for key in [k for k in self.entries if k[0] == owner]:
            w = self.entries.pop(key)
            self.nbytes -= w.numel() * w.element_size()

    def owner_nbytes(self, owner: int) -> int:
        return sum(w.numel() * w.element_size() for k, w in self.entries.items() if k[0] == owner)


class LoRAWrapper(nn.Module):
    """Wraps an ``nn.Linear`` or a 1x1 ``nn.Conv2d`` (PEFT style): the base layer is untouched and frozen.

    ``units`` maps a name to (LoRAUnit, (start, end)) over the base layer's output features, so a fused
    qkv projection carries separate q and v units. ``groups`` splits the batch into contiguous groups,
    each with its own composition (set by :class:`~proteus.adapters.model.AdaptedBackbone`): equal
    groups, or ``sizes`` rows each. With ``merged`` set to ``(tasks, kind)`` group g runs the map with
    the merged weight of composition ``tasks[g]`` (:meth:`merged_weights`, cached) instead of the base
    map plus the factored update, when that pays on the batch at hand (:meth:`merge_pays`).
    """

    #: a merged forward must save at least this many rows of the map per group (rows per group x the
    #: factored update's relative cost) to pay for reading a whole merged weight per group; measured on
    #: a CPU (docs/performance.md, "A 100-task stream"); 0: always merged when composed so
    merge_min_work: float = 16.0

    def __init__(
        self, base: nn.Module, slices: dict[str, tuple[int, int]], scaling: float,
        cache: MergedCache | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if isinstance(base, nn.Linear):
            self.is_conv = False
            q, p = base.in_features, base.out_features
        elif isinstance(base, nn.Conv2d) and base.kernel_size == (1, 1) and base.groups == 1:
            self.is_conv = True
            q, p = base.in_channels, base.out_channels
        else:
            raise TypeError(f"LoRA wraps nn.Linear or 1x1 nn.Conv2d, not {type(base).__name__}")
        self.base = base
        for prm in base.parameters():
            prm.requires_grad_(False)
        slices = slices or {"": (0, p)}
        self.slices = dict(sorted(slices.items(), key=lambda kv: kv[1][0]))
        self.units = nn.ModuleDict(
            {(k or "w"): LoRAUnit(q, e - s, scaling) for k, (s, e) in self.slices.items()}
        )
        self.in_features = q
        self.out_features = p
        self.groups = 1
        self.sizes: list[int] | None = None
        self.merged: tuple[list[int], str] | None = None
        #: where the merged weights live (an :class:`AdaptedBackbone` shares one across its wrappers)
        self.cache = cache if cache is not None else MergedCache()
        self._cache_key: tuple = ()

    def unit_list(self) -> list[LoRAUnit]:
        """The units of :attr:`units`, in order."""
        return [cast(LoRAUnit, u) for u in self.units.values()]

    # ------------------------------------------------------------------ merged weights
    def factored_cost(self, cols: list[int] | None = None) -> float:
        """Multiply-adds of the factored update per position over those of the map itself:
        ``sum_u cols_u (q + p_u) / (p q)`` (``cols``: columns used per unit; default all). The merged
        form adds none (it is the map, with another weight) but caches p q numbers per task."""
        units = self.unit_list()
        cols = [u.total_rank for u in units] if cols is None else cols
        extra = sum(c * (self.in_features + u.out_features) for c, u in zip(cols, units))
        return extra / (self.in_features * self.out_features)

    def merged_weights(self, tasks: list[int], kind: str = "task") -> list[torch.Tensor]:
        """``W_0 + B diag(C[k]) A^T`` (each unit's rows of a fused map) for each task: cached per (kind,
        task) in :attr:`cache` (least recently used out beyond its budget), built for the missing ones in
        one batched product. This wrapper's entries are dropped when a unit loses tasks
        (:meth:`LoRAUnit.truncate`) or moves; adding a task keeps them (older rows of C and older columns
        of A, B never change)."""
        units = self.unit_list()
        W0 = self.base.weight
        key = (W0.device, W0.dtype, W0._version, tuple(u.generation for u in units))
        if key != self._cache_key:
            self.cache.drop(id(self))
            self._cache_key = key
        found = {t: self.cache.get((id(self), kind, t)) for t in dict.fromkeys(tasks)}
        missing = sorted(t for t, w in found.items() if w is None)
        if missing:
            with torch.no_grad():
                W = W0.detach().reshape(self.out_features, self.in_features).expand(len(missing), -1, -1)
                W = W.clone()
                for u, (s, e) in zip(units, self.slices.values()):
                    W[:, s:e] += u.merged_updates(missing, kind).to(W.dtype)
            for t, w in zip(missing, W):
                found[t] = self.cache.put((id(self), kind, t), w)
            self.cache.evict(frozenset((id(self), kind, t) for t in found))
        return [found[t] for t in tasks]  # type: ignore[misc]

    def clear_merged(self) -> None:
        self.cache.drop(id(self))
        self._cache_key = ()

    def merged_nbytes(self) -> int:
        """Bytes of this wrapper's merged weights in the cache."""
        return self.cache.owner_nbytes(id(self))

    def merged_bytes_per_task(self) -> int:
        """Bytes of one task's merged weight of this map."""
        return self.in_features * self.out_features * self.base.weight.element_size()

    def _merged_forward(self, x: torch.Tensor, tasks: list[int], kind: str) -> torch.Tensor:
        """Group g through the map with task ``tasks[g]``'s merged weight. Without autocast each group is
        one GEMM written in place into the output (no concatenation); a 1x1 map over >= 16 positions
        multiplies channels-first, (p, q) @ (n, q, HW); over fewer positions, and a linear map, multiplies
        rows, (n HW, q) @ (q, p), channels last: on a CPU the convolution kernel and the channels-first GEMM
        are 3-5x slower there (2x2 and 3x3 maps: docs/performance.md), and a batch spread over many tasks
        makes one such call per task. Under autocast, one map call per group."""
        weights = self.merged_weights(tasks, kind)
        sizes = self.sizes or [x.shape[0] // len(tasks)] * len(tasks)
        b, q, p = self.base, self.in_features, self.out_features
        bias = b.bias
        direct = (
            not torch.is_autocast_enabled(x.device.type) and x.is_contiguous() and x.dtype == weights[0].dtype
        )
        n_all = x.shape[0]
        if direct and self.is_conv and x.shape[2] * x.shape[3] >= 16:
            xv = x.view(n_all, q, -1)
            out = x.new_empty(n_all, p, xv.shape[2])
            pos = 0
            for n, W in zip(sizes, weights):  # (p, q) @ (n, q, HW) -> (n, p, HW)
                torch.matmul(W, xv[pos : pos + n], out=out[pos : pos + n])
                pos += n
            if bias is not None:
                out += bias[:, None]
            return out.view(n_all, p, *x.shape[2:])
        if direct:
            xr = x.movedim(1, -1) if self.is_conv else x  # rows of q channels
            per = xr[0].numel() // q  # rows per input
            xr = xr.reshape(-1, q)
            out = x.new_empty(xr.shape[0], p)
            pos = 0
            for n, W in zip(sizes, weights):
                torch.mm(xr[pos : pos + n * per], W.T, out=out[pos : pos + n * per])
                pos += n * per
            if bias is not None:
                out += bias
            if self.is_conv:
                return out.view(n_all, *x.shape[2:], p).movedim(-1, 1).contiguous()
            return out.view(*x.shape[:-1], p)
        outs = []
        for xs, W in zip(x.split(sizes), weights):
            if self.is_conv:
                outs.append(b._conv_forward(xs, W[:, :, None, None], bias))  # type: ignore[operator]
            else:
                outs.append(F.linear(xs, W, bias))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # ------------------------------------------------------------------ forward
    def merge_pays(self, x: torch.Tensor) -> bool:
        """Whether the merged weights beat the factored update on ``x`` (:attr:`merge_min_work`): each
        group reads a whole merged weight (p q numbers), which pays only when the group's rows times the
        factored update's relative cost (:meth:`factored_cost` over the columns composed) exceed it."""
        if self.merged is None:
            return False
        units = self.unit_list()
        if any(u.composed is None for u in units):  # composed merged only ("always"): nothing else to run
            return True
        if self.merge_min_work <= 0:
            return True
        rows_per_group = x.numel() / self.in_features / max(1, len(self.merged[0]))
        cost = self.factored_cost([u.composed.coef.shape[1] for u in units if u.composed is not None])
        return rows_per_group * cost >= self.merge_min_work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merge_pays(x):
            assert self.merged is not None
            return self._merged_forward(x, *self.merged)
        out = self.base(x)
        units = self.unit_list()
        if all(u.composed is None and not u.training_task for u in units):
            return out
        if self.is_conv and len(units) == 1 and units[0].composed is not None:  # inference on a 1x1 conv
            d = units[0].delta_conv(x, self.groups)
            return out if d is None else out + d
        xl = x.movedim(1, -1) if self.is_conv else x  # channels last
        lead = xl.shape[:-1]
        xg = xl.reshape(self.groups, -1, xl.shape[-1])
        # each unit's update added in place to its slice of the base map's fresh output (no reassembly of
        # the output by concatenation; a linear map's or a convolution's backward never reads its output)
        outl = out.movedim(1, -1) if self.is_conv else out
        for unit, (s, e) in zip(units, self.slices.values()):
            outl[..., s:e].add_(unit.delta(xg).reshape(*lead, e - s))
        return out
