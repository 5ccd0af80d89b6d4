"""The tensors of a knowledge base: written as safetensors bytes (:func:`serialize`), a header read without
its data (:func:`parse_header`) and
the rules of the learner the manifest names applied to every object (:func:`check_objects`), by
``proteus kb verify`` and whenever a learner is loaded
(:meth:`~proteus.kb.store.KnowledgeBase.read_state`), so that a mis-shaped or non-finite tensor is named
(task, file, tensor) instead of failing deep in the model.

The rules themselves are the parts': each declares the tensors it stores next to its ``state()``
(:mod:`proteus.tensor_rules`: the symbol language, the checks, :data:`~proteus.tensor_rules.TENSOR_RULES`).
This module gathers them; it names no part's tensor.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from proteus.tensor_rules import (
    DTYPES,
    META_DTYPES,
    TENSOR_RULES,
    TORCH_DTYPES,
    Obj,
    ShapeRule,
    int_totals,
    nonfinite,
    shapes_of,
)
from proteus.tensor_rules import check_objects as _check

__all__ = [
    "DTYPES", "META_DTYPES", "TORCH_DTYPES", "Obj", "ShapeRule", "check_objects", "int_totals", "nonfinite",
    "parse_header", "serialize", "serialize_chunks", "shapes_of", "tensors_of",
]  # fmt: skip

#: safetensors' dtype names -> torch's
TORCH_BY_NAME = {name: dt for dt, name in TORCH_DTYPES.items()}
#: the order in which the safetensors library lays out a file's tensors: by dtype (its ``Dtype`` enum,
#: widest first), then by name; :func:`serialize` writes the same bytes
_LAYOUT = {
    name: i for i, name in enumerate(("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"))
}


def serialize(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors file of ``tensors`` (any device, layout or dtype of :data:`TORCH_DTYPES`), as the
    safetensors library writes it -- the same layout (tensors by dtype, then name), header and padding, so
    the same bytes -- each tensor's bytes copied once into the result (:func:`serialize_chunks` joined; the
    library's own ``save`` makes a ctypes array type per distinct byte length, which the ctypes module keeps
    for the life of the process: a learner that commits after every task grew by them)."""
    return b"".join(serialize_chunks(tensors))


def serialize_chunks(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """:func:`serialize`'s bytes as the header followed by a byte view of each tensor (no copy of a CPU
    tensor): a writer hashes and writes them in turn, so that an object of many megabytes (a head) is never
    assembled in memory. The views keep their tensors alive."""
    items = sorted(
        ((name, t.detach().cpu().contiguous()) for name, t in tensors.items()),
        key=lambda item: (_LAYOUT[TORCH_DTYPES[item[1].dtype]], item[0]),
    )
    header: dict[str, Any] = {}
    end = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": TORCH_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [end, end + n],
        }
        end += n
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    out = [memoryview(len(head).to_bytes(8, "little") + head)]
    out += [t.reshape(-1).view(torch.uint8).numpy().data for _, t in items if t.numel()]
    return out


def check_objects(tasks: list[dict[str, Any]], objects: list[Obj], learner: str | None = None) -> list[str]:
    """Every problem of ``objects`` (the tasks' in order, then the head's): dtypes, shapes and presence by
    the rules of ``learner`` (a role of :data:`~proteus.tensor_rules.TENSOR_RULES`: ``"proteus"``,
    ``"baseline"``; None: the learner whose head the objects hold, else every learner's rules), non-finite
    values (where given). ``tasks`` are the manifest's task records."""
    if learner is None:
        head = next((o.record for o in objects if o.index is None), None)
        learner = TENSOR_RULES.claimant(head) if head is not None else None
    rules = TENSOR_RULES.rules(learner) if learner else TENSOR_RULES.rules()
    return _check(tasks, objects, rules)


def tensors_of(data: Any, checked: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held by ``data`` (a memory map, or bytes), as views of it (no copy;
    a tensor keeps ``data`` alive); a ValueError names what is wrong with its header. Each tensor's bytes
    are aligned to its dtype (safetensors orders tensors by alignment), else it is copied. ``checked``: these
    bytes (by their sha256) passed this check before: the header is read without checking it again."""
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, start) in (_read_entries(data) if checked else _entries(data)).items():
        dt = TORCH_BY_NAME[dtype]
        numel, width = math.prod(shape), DTYPES[dtype][1]
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dt)
        elif start % width:
            out[name] = torch.frombuffer(bytearray(data[start : start + numel * width]), dtype=dt).view(shape)
        else:
            out[name] = torch.frombuffer(data, dtype=dt, count=numel, offset=start).view(shape)
    return out


def parse_header(data: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The (dtype, shape) of each tensor of a safetensors file, from its header alone; raises ValueError
    naming what is wrong (the header's size, JSON, a dtype proteus does not write, offsets)."""
    return {name: (dtype, shape) for name, (dtype, shape, _) in _entries(data).items()}


def _read_entries(data: Any) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """:func:`_entries` of a header checked before (the same bytes): read, not checked."""
    n = int.from_bytes(data[:8], "little")
    return {
        name: (e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0])
        for name, e in json.loads(data[8 : 8 + n]).items()
        if name != "__metadata__"
    }


def _entries(data: Any) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """(dtype, shape, offset of its first byte in ``data``) of each tensor, the header checked
    (:func:`parse_header`)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, too short for a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(f"header of {n} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    out, size = {}, len(data) - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise ValueError(
                f"tensor {name!r}: dtype {dtype!r} is not one proteus writes ({', '.join(DTYPES)})"
            )
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or not (
                type(offsets[0]) is int and type(offsets[1]) is int and 0 <= offsets[0] <= offsets[1] <= size
            )
        ):
            raise ValueError(f"tensor {name!r}: data offsets {offsets!r} outside the {size} bytes of data")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype][1]:
            raise ValueError(
                f"tensor {name!r}: {offsets[1] - offsets[0]} bytes of data for shape {tuple(shape)} {dtype}"
            )
        out[name] = (dtype, tuple(shape), 8 + n + offsets[0])
    return out
