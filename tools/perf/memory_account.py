"""Where a learner's resident memory goes: tensor bytes by the attribute that holds them, and the rest.

:func:`account` walks the objects reachable from a learner (attributes, containers, modules' parameters and
buffers) and adds up the bytes of every distinct CPU tensor storage under the first attribute that reaches
it (``keys_``, ``head_``, ``model_.units``, ...); views of one storage count once. Beside it, the process's
anonymous and file-backed resident memory (``/proc/self/status``) after ``gc.collect`` and glibc's
``malloc_trim``, and the bytes of every CPU tensor the garbage collector knows of, so that

    native = anonymous resident - every tensor

is what neither the learner's nor any other Python-visible tensor holds. A tensor that is a view of a file
(a knowledge base's memory-mapped object) is the page cache's, not the process's: it is counted apart
(``learner_mapped_mb``) and not subtracted from the anonymous memory. glibc's ``mallinfo2`` splits it:
what ``malloc`` has handed out beyond the tensors (``native_malloc_mb``: C and C++ objects such as oneDNN's
primitive descriptors, the interpreter's larger objects) and the rest (``native_other_mb``: pages mapped
outside ``malloc`` -- the kernels oneDNN compiles, the interpreter's small-object arenas -- and free pages
the allocator keeps). oneDNN and PyTorch's mkldnn bridge cache compiled kernels per shape, at most 1024
each (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``), so a computation whose shapes change
with every task grows them until the caps. :func:`slopes` turns two accounts into MiB per task.
"""

from __future__ import annotations

import ctypes
import gc
import re
from collections import deque
from typing import Any

import torch

from proteus.heap import glibc_function, trim

#: attributes whose tensors are reported one level deeper (``model_.units`` rather than ``model_``)
SPLIT = ("model_", "keys_", "heads_")
_SCALARS = (str, bytes, int, float, bool, type, type(None))


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset, deque)):
        return [(path, v) for v in obj]
    if isinstance(obj, torch.nn.Module):
        own = [*obj._parameters.items(), *obj._buffers.items()]
        kids = [(f"{path}.{k}", v) for k, v in own if v is not None]
        kids += [(f"{path}.{k}", m) for k, m in obj._modules.items()]
        rest = {k: v for k, v in vars(obj).items() if k not in ("_parameters", "_buffers", "_modules")}
        return kids + [(f"{path}.{k}", v) for k, v in rest.items()]
    d = getattr(obj, "__dict__", None)
    kids = [(f"{path}.{k}", v) for k, v in d.items()] if isinstance(d, dict) else []
    for k in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, k):
            kids.append((f"{path}.{k}", getattr(obj, k)))
    return kids


def _owner(path: str) -> str:
    m = re.match(r"\.?([^.\[]+)(?:\.([^.\[]+))?", path)
    if m is None:
        return path
    head, attr = m.groups()
    return f"{head}.{attr}" if head in SPLIT and attr else head


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed memory mappings (``/proc/self/maps``; none elsewhere):
    a tensor whose data lies there is a view of a file (a knowledge base's memory-mapped object), held by the
    page cache, not by the process's anonymous memory."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/") and not parts[5].startswith("/dev/"):
                    lo, hi = (int(v, 16) for v in parts[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        return []
    return sorted(out)


def _in(ranges: list[tuple[int, int]], address: int) -> bool:
    import bisect

    i = bisect.bisect_right(ranges, (address, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= address < ranges[i][1]


def tensor_owners(root: Any, mapped: list[tuple[int, int]] | None = None) -> dict[str, int]:
    """Bytes of the distinct CPU tensor storages reachable from ``root``, by the attribute reaching them first
    (breadth-first, so the shortest path owns a shared storage); storages in ``mapped`` (file mappings) are
    counted under ``"mapped"`` instead (the page cache's, not the process's memory)."""
    mapped = mapped or []
    seen: set[int] = set()
    storages: set[int] = set()
    out: dict[str, int] = {}
    queue: deque[tuple[str, Any]] = deque(_children(root, ""))
    while queue:
        path, obj = queue.popleft()
        if isinstance(obj, _SCALARS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                if st.data_ptr() not in storages:
                    storages.add(st.data_ptr())
                    owner = "mapped" if _in(mapped, st.data_ptr()) else _owner(path)
                    out[owner] = out.get(owner, 0) + st.nbytes()
            continue
        if callable(obj) and not isinstance(obj, torch.nn.Module) and not hasattr(obj, "__dict__"):
            continue
        queue.extend(_children(obj, path))
    return out


def _all_tensor_bytes(mapped: list[tuple[int, int]] | None = None) -> int:
    """Bytes of the distinct CPU storages of every tensor the garbage collector tracks, but those in
    ``mapped`` (file mappings: not anonymous memory); tensors without memory of their own (the fake and
    functional tensors torch.compile leaves behind) are skipped."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                st = obj.untyped_storage()
                if not _in(mapped or [], st.data_ptr()):
                    storages[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return sum(storages.values())


#: glibc's ``struct mallinfo2``, field by field
_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
              "keepcost")  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in _MALLINFO2]


def _malloc_in_use() -> int | None:
    """Bytes glibc's ``malloc`` has handed out and not taken back, every arena and mapped chunk (glibc >=
    2.33; None elsewhere)."""
    fn = glibc_function("mallinfo2")
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def account(learner: Any) -> dict[str, Any]:
    """One account of the process's memory, in MiB (see the module docstring)."""
    gc.collect()
    trim()
    mapped = file_mappings()
    owners = tensor_owners(learner, mapped)
    tensors = _all_tensor_bytes(mapped)
    anon, file = _status_kib("RssAnon"), _status_kib("RssFile")
    in_use = _malloc_in_use()
    mib = 2**20
    native = None if anon is None else anon / 1024 - tensors / mib
    malloced = None if in_use is None else (in_use - tensors) / mib
    in_files = owners.pop("mapped", 0)
    return {
        "learner_tensors_mb": {k: v / mib for k, v in sorted(owners.items())},
        "learner_tensors_total_mb": sum(owners.values()) / mib,
        "learner_mapped_mb": in_files / mib,
        "all_tensors_mb": tensors / mib,
        "rss_anon_mb": None if anon is None else anon / 1024,
        "rss_file_mb": None if file is None else file / 1024,
        "native_mb": native,
        "native_malloc_mb": malloced,
        "native_other_mb": None if native is None or malloced is None else native - malloced,
    }


def slopes(first: dict[str, Any], last: dict[str, Any], tasks: int) -> dict[str, Any]:
    """MiB per task from ``first`` to ``last``, ``tasks`` tasks apart, for every figure of :func:`account`."""

    def per(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) / tasks

    keys = set(first["learner_tensors_mb"]) | set(last["learner_tensors_mb"])
    out: dict[str, Any] = {
        "learner_tensors_mb": {
            k: per(first["learner_tensors_mb"].get(k, 0.0), last["learner_tensors_mb"].get(k, 0.0))
            for k in sorted(keys)
        }
    }
    for k in (
        "learner_tensors_total_mb",
        "learner_mapped_mb",
        "all_tensors_mb",
        "rss_anon_mb",
        "rss_file_mb",
        "native_mb",
        "native_malloc_mb",
        "native_other_mb",
    ):
        out[k] = per(first.get(k), last.get(k))
    return out
