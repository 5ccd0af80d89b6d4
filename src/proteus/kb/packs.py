"""Format 5 of a knowledge base: the tasks of a full record segment in one object, read on demand.

In format 4 every task is one object, so a reader maps one file per task, parses one safetensors header per
task and builds a tensor view per stored tensor -- Python work that grows with every task learned. In
format 5 the commit that fills a record segment (:data:`~proteus.kb.segments.SEGMENT_TASKS` tasks) also
writes its tasks' tensors as one *pack* (``objects/pack-<sha256[:16]>.safetensors``), and the segment's
records name the pack as their object; the tasks' own objects are then swept like any object no commit
references. The tasks of the last, open segment keep an object each until it is full.

A pack stacks each tensor name over the segment's tasks: the tensors of one name are concatenated along one
axis (the last when the tasks agree on every other dimension, else the first when they agree on the others,
else flattened), so that a pack holds a few dozen tensors whatever the number of tasks. Beside them it
stores ``@lengths`` (int64, one row per name, one column per task: the task's extent along the axis, -1
where the task has no such tensor) and, for a flattened name ``n``, ``n@shape`` (each task's shape); the
names (in the rows' order) and their axes are in ``@meta`` (JSON bytes, keys sorted: safetensors' own header
metadata has no fixed order, and a pack's bytes must be the same for the same tensors). A reader gets

* a segment's *block* of a name (:meth:`Pack.block`): the stacked tensor and each task's extent, which a
  part that keeps every task's share in memory (the adapters' directions, the class statistics' columns)
  appends in one operation per segment instead of one per task; and
* a task's tensors (:meth:`Pack.task`: a :class:`StoredTensors`), each a view of the mapped pack made when
  it is first asked for: the detector's Gaussians or a task's own head are read only for the tasks a
  prediction shortlists.

Packing is deterministic (the same tensors give the same bytes), so a segment packed again after a change
that left its tensors as they were (``kb forget`` of another task) is the same object.
"""

from __future__ import annotations

import itertools
import json
import math
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from proteus.errors import ProteusError
from proteus.kb.tensors import TORCH_BY_NAME, _entries, _read_entries, serialize
from proteus.tensor_rules import DTYPES, TORCH_DTYPES
from proteus.untrusted import load_json

__all__ = [
    "PACK_FORMAT", "PACK_KIND", "Pack", "StoredTensors", "is_pack", "pack_tasks", "spans", "task_prefix",
]  # fmt: skip

#: the kind of a pack's object name (``objects/pack-<sha16>.safetensors``)
PACK_KIND = "pack"
#: the ``format`` of a pack's metadata
PACK_FORMAT = "proteus-kb-pack"
#: the pack's metadata (JSON bytes), its (names, tasks) extents (int64) and, beside a flattened name, its
#: tasks' shapes
_META, _LENGTHS, _SHAPE = "@meta", "@lengths", "@shape"


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_pack(rel: Any) -> bool:
    """Whether object name ``rel`` is a pack's."""
    return isinstance(rel, str) and rel.rpartition("/")[2].startswith(f"{PACK_KIND}-")


def task_prefix(index: int) -> str:
    """How messages name task ``index``'s tensors inside a pack."""
    return f"task {index + 1}"


def _axis(shapes: list[tuple[int, ...]], together: bool) -> int:
    """The axis the tensors of one name are concatenated along: side by side (``together``: a part reads the
    pack's tasks of it at once, :class:`~proteus.tensor_rules.SideBySide`), the last if every other
    dimension agrees; else the first if the others agree, which keeps each task's tensor one contiguous piece
    (as flattening does, -1: the rest)."""
    ndim = {len(s) for s in shapes}
    if len(ndim) != 1:
        return -1
    n = ndim.pop()
    if n == 0:
        return -1
    if together and len({s[:-1] for s in shapes}) == 1:
        return n - 1
    if len({s[1:] for s in shapes}) == 1:
        return 0
    return -1


def pack_tasks(
    first: int, tasks: Sequence[Mapping[str, torch.Tensor]], together: Callable[[str], bool] = lambda n: False
) -> bytes:
    """The bytes of the pack of tasks ``first`` .. ``first + len(tasks) - 1`` (each task's tensors, by name;
    ``together``: the names a part reads the tasks of at once, stacked side by side); a ValueError when the
    tasks hold tensors of one name in different dtypes (such a segment stays unpacked)."""
    names = sorted({n for t in tasks for n in t})
    out: dict[str, torch.Tensor] = {}
    axes: dict[str, int] = {}
    lengths = torch.full((len(names), len(tasks)), -1, dtype=torch.long)
    for row, name in enumerate(names):
        have = [(i, t[name]) for i, t in enumerate(tasks) if name in t]
        dtypes = {x.dtype for _, x in have}
        if len(dtypes) != 1:
            raise ValueError(f"tensor {name!r} has dtypes {sorted(map(str, dtypes))} across the tasks")
        axis = _axis([tuple(x.shape) for _, x in have], together(name))
        parts = []
        for i, x in have:
            x = x.detach().cpu()
            if axis < 0:
                x = x.reshape(-1)
            lengths[row, i] = x.shape[0 if axis < 0 else axis]
            parts.append(x)
        out[name] = torch.cat(parts, dim=max(axis, 0)).contiguous()
        if axis < 0:
            dims = max((x.dim() for _, x in have), default=0)
            shape = torch.full((len(tasks), dims), -1, dtype=torch.long)
            for i, x in have:
                shape[i, : x.dim()] = torch.as_tensor(x.shape, dtype=torch.long)
            out[name + _SHAPE] = shape
        axes[name] = axis
    out[_LENGTHS] = lengths
    meta = {"format": PACK_FORMAT, "first": first, "count": len(tasks), "names": names,
            "axes": [axes[n] for n in names]}  # fmt: skip
    # (as a tensor: safetensors writes its own metadata in no fixed order, and a pack's bytes must be)
    out[_META] = torch.frombuffer(bytearray(json.dumps(meta, sort_keys=True).encode()), dtype=torch.uint8)
    return serialize(out)


class Pack:
    """A pack's tensors, read from ``data`` (its memory map, or bytes): its header parsed once (checked,
    unless ``checked``), each task's extents read at once, blocks and task views made when asked for."""

    def __init__(self, data: Any, checked: bool = False, where: str = "pack") -> None:
        self.data, self.where = data, where
        entries = _read_entries(data) if checked else _entries(data)
        meta: Any = None
        if _META in entries and entries[_META][0] == "U8" and len(entries[_META][1]) == 1:
            _, (size,), start = entries[_META]
            try:
                meta = load_json(bytes(data[start : start + size]), where)
            except ProteusError:
                meta = None
        if not isinstance(meta, dict) or meta.get("format") != PACK_FORMAT:
            raise ValueError(f"{where}: not a pack (no {_META} of format {PACK_FORMAT!r})")
        first, count = meta.get("first"), meta.get("count")
        names, axes = meta.get("names"), meta.get("axes")
        if (
            not isinstance(names, list) or not isinstance(axes, list) or len(names) != len(axes)
            or not _count(count) or not _count(first)
        ):  # fmt: skip
            raise ValueError(f"{where}: its {_META} cannot be read (names, axes, first, count)")
        self.first, self.count = int(first), int(count)  # type: ignore[arg-type]
        self.entries = entries
        self.axes: dict[str, int] = {}
        for name, axis in zip(names, axes, strict=True):
            if not isinstance(name, str) or name not in entries or name.startswith("@") or name in self.axes:
                raise ValueError(f"{where}: tensor {name!r} of its metadata is not in it")
            dtype, shape, _ = entries[name]
            if not isinstance(axis, int) or isinstance(axis, bool) or not -1 <= axis < max(len(shape), 1):
                raise ValueError(
                    f"{where}: tensor {name!r}: axis {axis!r} outside its {len(shape)} dimensions"
                )
            if dtype not in TORCH_BY_NAME:
                raise ValueError(f"{where}: tensor {name!r}: dtype {dtype!r}")
            if axis < 0 and name + _SHAPE not in entries:
                raise ValueError(f"{where}: tensor {name!r} is flattened without its tasks' shapes")
            self.axes[name] = axis
        lengths = self._ints(_LENGTHS, (len(names), self.count)).view(len(names), self.count)
        clamped = lengths.clamp_min(0)
        extents = [
            self.entries[n][1][0 if a < 0 else a] if self.entries[n][1] else 0 for n, a in self.axes.items()
        ]
        if bool((lengths < -1).any()) or clamped.sum(1).tolist() != extents:
            bad = next(
                n for n, e, s in zip(self.axes, extents, clamped.sum(1).tolist(), strict=True) if e != s
            )
            raise ValueError(f"{where}: tensor {bad!r}: its tasks' extents do not add up to its size")
        #: per name: each task's extent along the axis (-1: none) and where it starts, as machine integers
        #: (a reader keeps every pack's index: no Python object per task and name); each task's shape (made,
        #: or read for a flattened name, when first needed)
        starts = (torch.cumsum(clamped, 1) - clamped).tolist()
        self._lengths = {n: array("q", row) for n, row in zip(self.axes, lengths.tolist(), strict=True)}
        self._starts = {n: array("q", row) for n, row in zip(self.axes, starts, strict=True)}
        self._shapes: dict[str, list[tuple[int, ...]]] = {}
        self._blocks: dict[str, torch.Tensor] = {}
        self._present: list[frozenset[str]] | None = None  # (:meth:`present`)

    def _ints(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        dtype, got, start = self.entries[name]
        if dtype != "I64" or tuple(got) != tuple(shape):
            raise ValueError(f"{self.where}: tensor {name!r} is {dtype} {tuple(got)}, not I64 {tuple(shape)}")
        n = math.prod(shape)  # (a copy: a few numbers)
        return (
            torch.frombuffer(bytearray(self.data[start : start + 8 * n]), dtype=torch.long)
            if n
            else torch.zeros(0, dtype=torch.long)
        )

    def _index(self, name: str) -> array[int]:
        """Each task's extent of ``name`` along its axis (-1: none); flattened, each task's shape read and
        checked first (a ValueError names what does not fit)."""
        lengths = self._lengths[name]
        if self.axes[name] < 0 and name not in self._shapes:
            dims = self.entries[name + _SHAPE][1]
            if len(dims) != 2 or dims[0] != self.count:
                raise ValueError(f"{self.where}: tensor {name!r} is flattened without its tasks' shapes")
            rows = self._ints(name + _SHAPE, tuple(dims)).view(self.count, dims[1]).tolist()
            shapes = [tuple(v for v in row if v >= 0) for row in rows]
            for i, (s, v) in enumerate(zip(shapes, lengths, strict=True)):
                if v >= 0 and math.prod(s) != v:
                    who = task_prefix(self.first + i)
                    raise ValueError(
                        f"{self.where}: tensor {name!r}: {who}'s shape {s} is not its {v} numbers"
                    )
            self._shapes[name] = shapes
        return lengths

    @property
    def names(self) -> list[str]:
        return list(self.axes)

    def block(self, name: str) -> tuple[torch.Tensor, int, array[int]] | None:
        """The stacked tensor of ``name``, its axis (-1: flattened) and each task's extent along it (-1: the
        task has none); None when no task holds ``name``."""
        if name not in self.axes:
            return None
        lengths = self._index(name)
        t = self._blocks.get(name)
        if t is None:
            dtype, shape, start = self.entries[name]
            dt = TORCH_BY_NAME[dtype]
            numel = math.prod(shape)
            if numel == 0:
                t = torch.empty(shape, dtype=dt)
            elif start % DTYPES[dtype][1]:
                width = DTYPES[dtype][1]
                t = torch.frombuffer(bytearray(self.data[start : start + numel * width]), dtype=dt).view(
                    shape
                )
            else:
                t = torch.frombuffer(self.data, dtype=dt, count=numel, offset=start).view(shape)
            self._blocks[name] = t
        return t, self.axes[name], lengths

    def has(self, slot: int, name: str) -> bool:
        lengths = self._lengths.get(name)
        return lengths is not None and lengths[slot] >= 0

    def present(self, slot: int) -> frozenset[str]:
        """The names task ``slot`` holds (every slot's set made at the first call: a reader asks whether a
        task holds a name many times per task)."""
        if self._present is None:  # (the slots that hold the same names share one set)
            names, sets = list(self.axes), dict[tuple[bool, ...], frozenset[str]]()
            held = zip(*(self._lengths[n] for n in names))
            rows = [tuple(v >= 0 for v in row) for row in held]
            self._present = [sets.setdefault(r, frozenset(itertools.compress(names, r))) for r in rows]
        return self._present[slot]

    def shape(self, slot: int, name: str) -> tuple[int, ...]:
        """Task ``slot``'s shape of ``name`` (from the header: no view is made; every slot's made at the first
        call for ``name``: a reader asks for a task's shapes several times per task)."""
        shapes = self._shapes.get(name)
        if shapes is None:
            lengths, axis = self._index(name), self.axes[name]
            if axis < 0:
                return self._shapes[name][slot]
            block, same = self.entries[name][1], dict[int, tuple[int, ...]]()
            shapes = [same.setdefault(n, (*block[:axis], n, *block[axis + 1 :])) for n in lengths]
            self._shapes[name] = shapes  # (one tuple per distinct shape)
        return shapes[slot]

    def dtype(self, name: str) -> str:
        return self.entries[name][0]

    def tensor(self, slot: int, name: str) -> torch.Tensor:
        """Task ``slot``'s tensor ``name``: a view of the pack."""
        found = self.block(name)
        if found is None or found[2][slot] < 0:
            raise KeyError(name)
        t, axis, lengths = found
        start, n = self._starts[name][slot], lengths[slot]
        if axis < 0:
            return t.narrow(0, start, n).view(self._shapes[name][slot])
        return t.narrow(axis, start, n)

    def span(self, name: str, first: int, end: int) -> tuple[torch.Tensor, list[int]] | None:
        """The tensors of ``name`` of slots ``first`` .. ``end - 1`` as one view of the block (concatenated
        along its axis) and each slot's extent; None when the block is flattened or a slot has none."""
        found = self.block(name)
        if found is None or found[1] < 0:
            return None
        t, axis, lengths = found
        part = lengths[first:end].tolist()
        if part and min(part) < 0:
            return None
        start = self._starts[name][first]
        return t.narrow(axis, start, sum(part)), part

    def task(self, slot: int) -> StoredTensors:
        """Task ``slot``'s tensors (0-based within the pack)."""
        if not 0 <= slot < self.count:
            raise IndexError(f"slot {slot} outside the pack's {self.count} tasks")
        return StoredTensors(self, slot)


class _Loose:
    """One task object's tensors (:class:`StoredTensors` over a single object): its header parsed once,
    views made when asked for."""

    def __init__(self, data: Any, checked: bool = False) -> None:
        self.data = data
        self.entries = _read_entries(data) if checked else _entries(data)

    def has(self, slot: int, name: str) -> bool:
        return name in self.entries

    def present(self, slot: int) -> frozenset[str]:
        return frozenset(self.entries)

    def shape(self, slot: int, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1])

    def dtype(self, name: str) -> str:
        return self.entries[name][0]

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, slot: int, name: str) -> torch.Tensor:
        dtype, shape, start = self.entries[name]
        dt = TORCH_BY_NAME[dtype]
        numel, width = math.prod(shape), DTYPES[dtype][1]
        if numel == 0:
            return torch.empty(shape, dtype=dt)
        if start % width:
            return torch.frombuffer(bytearray(self.data[start : start + numel * width]), dtype=dt).view(shape)
        return torch.frombuffer(self.data, dtype=dt, count=numel, offset=start).view(shape)


class StoredTensors(Mapping[str, torch.Tensor]):
    """A stored task's tensors by name, as a read-only mapping: the names and shapes come from the header
    (:meth:`shape`, no view made); a tensor is a view of the mapped object or pack, made when asked for (each
    time: a part that reads a tensor often keeps it). ``pack`` and ``slot`` say where the task lies when it
    is in a pack (:meth:`Pack.block` serves its whole segment)."""

    def __init__(self, source: Pack | _Loose, slot: int = 0) -> None:
        self._source, self.slot = source, slot
        self._names: list[str] | None = None
        #: the names the task holds (a membership test is a set lookup)
        self._present = source.present(slot)

    def __deepcopy__(self, memo: dict[int, Any]) -> StoredTensors:
        """Itself: what it reads is a mapped file that nothing writes (a copied learner shares it)."""
        return self

    @classmethod
    def of_object(cls, data: Any, checked: bool = False) -> StoredTensors:
        """The tensors of one task object held by ``data`` (its memory map, or bytes)."""
        return cls(_Loose(data, checked))

    @property
    def pack(self) -> Pack | None:
        return self._source if isinstance(self._source, Pack) else None

    def _all(self) -> list[str]:
        if self._names is None:
            self._names = [n for n in self._source.names if n in self._present]
        return self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._present:
            raise KeyError(name)
        return self._source.tensor(self.slot, name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._present

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._present:
            raise KeyError(name)
        return self._source.shape(self.slot, name)

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Each tensor's (safetensors dtype name, shape), from the header alone."""
        return {n: (self._source.dtype(n), self._source.shape(self.slot, n)) for n in self._all()}

    def materialized(self) -> dict[str, torch.Tensor]:
        """Every tensor (views), as a dict."""
        return {n: self[n] for n in self._all()}


#: safetensors' dtype names by torch dtype (for :meth:`StoredTensors.shapes`' callers)
DTYPE_NAMES = TORCH_DTYPES


def spans(
    items: Sequence[Mapping[str, torch.Tensor]], names: list[str]
) -> list[tuple[int, int, dict[str, tuple[torch.Tensor, list[int]]] | None]]:
    """``items`` (tasks' tensors, in order) as runs ``(first, end, blocks)``: consecutive items that lie in
    one pack at consecutive slots and all hold every name of ``names`` come as one run whose ``blocks`` give
    each name's tensors of the run as one view and each item's extent (:meth:`Pack.span`); any other item is
    a run of its own with ``blocks`` None (read it through its mapping). A part that keeps every task's share
    in memory appends a pack's tasks in one operation per run instead of one per task."""
    out: list[tuple[int, int, dict[str, tuple[torch.Tensor, list[int]]] | None]] = []
    i = 0
    while i < len(items):
        pack = getattr(items[i], "pack", None)
        j = i + 1
        if pack is not None:
            slot = getattr(items[i], "slot", -1)
            while j < len(items) and getattr(items[j], "pack", None) is pack:
                if getattr(items[j], "slot", -1) != slot + j - i:
                    break
                j += 1
            found = {n: pack.span(n, slot, slot + j - i) for n in names}
            blocks = {n: v for n, v in found.items() if v is not None}
            if j - i > 1 and len(blocks) == len(found):
                out.append((i, j, blocks))
                i = j
                continue
        out.append((i, i + 1, None))
        i += 1
    return out
