"""What the tensors of a knowledge base may hold, as data: the dtypes the code writes
(:data:`DTYPES`), and the shapes that hold between tensors (:data:`TASK_RULES`, :data:`HEAD_RULES`),
checked by ``proteus kb verify`` and whenever a learner is loaded
(:meth:`~proteus.kb.store.KnowledgeBase.read_state`), so that a mis-shaped or non-finite tensor is named
(task, file, tensor) instead of failing deep in the model.

A rule applies to every tensor whose name matches its ``pattern`` (a full match; named groups fill the
``{...}`` of its dimensions). It gives one symbol per axis of the tensor:

* ``*``: any size;
* ``obj.X``: the same size wherever ``X`` appears in one object (a task's or the head's file);
* ``kb.X``: the same size in every object of the commit (every task's ``A`` of one map has the same rows);
* ``sum.X``: the sum of the earlier tasks' ``obj.X`` (a task's transfer coefficients ``s`` have one entry
  per column of the adapters before it);
* ``classes``: the number of the task's classes (its record's ``classes``); ``classes[k]``: task k's;
* ``meta:a/b``: the integer at ``a.b`` of the object's record (the task record, or the head's meta); when
  the record has none, the symbol is an ``obj.`` one;
* ``total:T``: the sum of the values of the object's 1-D integer tensor ``T`` (when it holds one).

``dtype`` is ``"float"``, ``"int"`` or ``"meta:<field>"`` (the dtype name the record gives, as the RanPAC
head's ``dtype``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

#: safetensors dtype -> (kind, bytes per element); the dtypes proteus writes (no float8, no complex)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float", 8),
    "F32": ("float", 4),
    "F16": ("float", 2),
    "BF16": ("float", 2),
    "I64": ("int", 8),
    "I32": ("int", 4),
    "I16": ("int", 2),
    "I8": ("int", 1),
    "U8": ("int", 1),
    "BOOL": ("int", 1),
}
TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: the dtype names a head's meta uses (``proteus.heads.persist``)
META_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class ShapeRule:
    pattern: str
    dims: tuple[str, ...]
    why: str
    dtype: str = "float"


#: the head meta's ``task_head`` (the global keys) may wrap a RanPAC head's meta under one of these keys
#: (``GaussianKeys``' LDA shortlist: ``{"shortlist": meta}``); its tensors are ``task_head/*`` all the same
KEY_HEAD_WRAPPERS = ("shortlist",)


def _head_view(meta: dict[str, Any]) -> dict[str, Any]:
    """The head's meta with ``task_head`` unwrapped (:data:`KEY_HEAD_WRAPPERS`)."""
    inner = meta.get("task_head")
    for key in KEY_HEAD_WRAPPERS:
        if isinstance(inner, dict) and len(inner) == 1 and isinstance(inner.get(key), dict):
            return {**meta, "task_head": inner[key]}
    return meta


_SIG = r"(?P<s>signature|frozen_signature)"
_KEYS = r"(?P<k>lda|shortlist|novelty)"
_HEAD = r"(?P<p>(?:task_head/)?)"

#: tensors whose name starts with a prefix are read only when the record holds the key: (object kind,
#: prefix, key): signature tensors without a signature record would be ignored, the head's task_head/
#: tensors without its meta leave the task keys unfitted
NEEDS_RECORD: tuple[tuple[str, str, str], ...] = (
    ("task", "signature/", "signature"),
    ("task", "frozen_signature/", "frozen_signature"),
    ("task", "expert/", "expert"),
    ("task", "novelty/", "novelty"),
    ("head", "task_head/", "task_head"),
)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _fitted_ranpac(record: Any) -> bool:
    return isinstance(record, dict) and "embed_dim" in record and _positive_int(record.get("n_samples"))


def _stores_prototypes(record: Any) -> bool:
    """Whether a fitted RanPAC head's prototypes keep their own matrix ``P``."""
    from proteus.heads.prototypes import PROTOTYPES  # the strategies' own flag (heads never import kb)

    name = record.get("prototypes", "sum") if isinstance(record, dict) else None
    return _fitted_ranpac(record) and name in PROTOTYPES and PROTOTYPES.get(name).stored


#: tensors an object must hold when its record says so: (object kind, record path ("" the record itself;
#: else also the tensors' prefix), condition on what is there, tensor names; ``a|b``: one of them)
_SIGNATURE_TENSORS = ("means", "weights", "center", "logdet", "prec_chol|U|prior_evecs|prior_qr")
REQUIRED: tuple[tuple[str, str, Any, tuple[str, ...]], ...] = (
    ("head", "", _fitted_ranpac, ("G", "Q", "counts", "W_out")),
    ("head", "", lambda r: _fitted_ranpac(r) and _positive_int(r.get("rp_dim")), ("W_rand",)),
    ("head", "", _stores_prototypes, ("P",)),
    ("head", "task_head", _fitted_ranpac, ("G", "Q", "counts", "W_out")),
    ("task", "signature", lambda r: isinstance(r, dict), _SIGNATURE_TENSORS),
    ("task", "frozen_signature", lambda r: isinstance(r, dict), _SIGNATURE_TENSORS),
    ("task", "expert", lambda r: isinstance(r, dict), ("W",)),
)
#: tensors that come together: (object kind, a pattern, the names all present when one matches it)
TOGETHER: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("task", r"adapter/(?P<g>.+)/(?:A|B|s)", ("adapter/{g}/A", "adapter/{g}/B", "adapter/{g}/s")),
    ("task", r"forget/(?:h|y)", ("forget/h", "forget/y")),
    ("task", r"(?P<g>lda|shortlist|novelty)/(?:x|y)", ("{g}/x", "{g}/y")),
    ("task", rf"{_SIG}/(?:U|lam|sigma2)", ("{s}/U", "{s}/lam", "{s}/sigma2")),
    # kind "shared": the eigenbasis as prior_evecs (d, d) or, stored compactly, as prior_qr (its Householder
    # vectors, d (d - 1) / 2; signatures/householder.py)
    ("task", rf"{_SIG}/(?:prior_evecs|prior_qr|prior_evals|lowrank|ranks|iso|ridge)",
     tuple(f"{{s}}/{n}" for n in ("prior_evals", "lowrank", "ranks", "iso", "ridge"))),
)  # fmt: skip
_ADAPTER_MAP = re.compile(r"adapter/(?P<g>.+)/A")


#: the tensors of a task's object (PROTEUS: adapter, keys, task head, forgettable head inputs)
TASK_RULES: tuple[ShapeRule, ...] = (
    ShapeRule(r"adapter/(?P<m>.+)/A", ("kb.q[{m}]", "obj.r[{m}]"),
              "A (q, r) and B (p, r) share the rank r; every task's A of a map has the same q"),
    ShapeRule(r"adapter/(?P<m>.+)/B", ("kb.p[{m}]", "obj.r[{m}]"),
              "A (q, r) and B (p, r) share the rank r; every task's B of a map has the same p"),
    ShapeRule(r"adapter/(?P<m>.+)/s", ("sum.r[{m}]",),
              "s has one entry per column of the earlier tasks' adapters of the map"),
    ShapeRule(r"expert/W", ("kb.expert_d", "classes"), "the task head has one column per class of the task"),
    ShapeRule(r"forget/h", ("obj.forget_n", "kb.forget_d"), "forget/h (n, d) and forget/y (n) have n rows"),
    ShapeRule(r"forget/y", ("obj.forget_n",), "forget/h (n, d) and forget/y (n) have n rows", "int"),
    ShapeRule(rf"{_KEYS}/x", ("obj.{k}_n", "kb.{k}_d"), "{k}/x (n, d) and {k}/y (n) have n rows"),
    ShapeRule(rf"{_KEYS}/y", ("obj.{k}_n",), "{k}/x (n, d) and {k}/y (n) have n rows", "int"),
    ShapeRule(rf"{_SIG}/means", ("meta:{s}/n_active", "meta:{s}/d"),
              "a signature's means are (components, d), as its record says"),
    ShapeRule(rf"{_SIG}/means", ("*", "kb.{s}_d"), "every task's {s} lives in one space of d dimensions"),
    ShapeRule(rf"{_SIG}/(?:weights|logdet|iso|ridge|sigma2)", ("meta:{s}/n_active",),
              "one entry per signature component"),
    ShapeRule(rf"{_SIG}/ranks", ("meta:{s}/n_active",), "one entry per signature component", "int"),
    ShapeRule(rf"{_SIG}/(?:center|prior_evals)", ("meta:{s}/d",), "one entry per embedding dimension"),
    ShapeRule(rf"{_SIG}/prior_evecs", ("meta:{s}/d", "meta:{s}/d"), "a (d, d) eigenbasis"),
    ShapeRule(rf"{_SIG}/prec_chol", ("meta:{s}/n_active", "meta:{s}/d", "meta:{s}/d"),
              "one (d, d) factor per signature component"),
    ShapeRule(rf"{_SIG}/lowrank", ("total:{s}/ranks", "meta:{s}/d"),
              "the low-rank factors have one row per rank of {s}/ranks and d columns"),
    ShapeRule(rf"{_SIG}/U", ("meta:{s}/n_active", "meta:{s}/d", "obj.{s}_q"), "(components, d, q) factors"),
    ShapeRule(rf"{_SIG}/lam", ("meta:{s}/n_active", "obj.{s}_q"), "(components, q) eigenvalues"),
)  # fmt: skip
#: the tensors of the head's object (RanPAC's statistics, with LDA keys under task_head/; a baseline's
#: per-task linear heads)
HEAD_RULES: tuple[ShapeRule, ...] = (
    ShapeRule(rf"{_HEAD}G", ("obj.{p}m", "obj.{p}m"), "G is (m, m)", "meta:{p}dtype"),
    ShapeRule(rf"{_HEAD}(?:Q|W_out|P)", ("obj.{p}m", "meta:{p}num_classes"),
              "(m, classes): m rows as G, one column per class of the head", "meta:{p}dtype"),
    ShapeRule(rf"{_HEAD}counts", ("meta:{p}num_classes",), "one count per class of the head", "int"),
    ShapeRule(rf"{_HEAD}W_rand", ("meta:{p}embed_dim", "obj.{p}m"),
              "W_rand (embed_dim, m) projects into G's m dimensions", "meta:{p}dtype"),
    ShapeRule(r"head\.(?P<t>\d+)\.weight", ("classes[{t}]", "kb.linear_d"),
              "task {t}'s linear head has one row per class of the task"),
    ShapeRule(r"head\.(?P<t>\d+)\.bias", ("classes[{t}]",), "task {t}'s linear head has one bias per class"),
)  # fmt: skip


@dataclass
class Obj:
    """One object to check: how messages name it, its record (a task's, or the head's meta), its position
    (None for the head) and its tensors (safetensors dtype name, shape) with, for the finiteness check,
    their values."""

    label: str
    path: str
    record: dict[str, Any]
    index: int | None
    shapes: dict[str, tuple[str, tuple[int, ...]]]
    values: dict[str, torch.Tensor] | None = None
    #: the sum of each 1-D integer tensor's values (for ``total:`` symbols; from ``values`` when None)
    totals: dict[str, int] | None = None


def int_totals(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The sum of each small 1-D integer tensor (``signature/ranks``: the rows of ``signature/lowrank``)."""
    return {
        n: int(t.sum())
        for n, t in tensors.items()
        if t.ndim == 1 and t.numel() <= 1 << 16 and not t.dtype.is_floating_point and t.dtype != torch.bool
    }


def parse_header(data: bytes) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The (dtype, shape) of each tensor of a safetensors file, from its header alone; raises ValueError
    naming what is wrong (the header's size, JSON, a dtype proteus does not write, offsets)."""
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
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= size
        ):
            raise ValueError(f"tensor {name!r}: data offsets {offsets!r} outside the {size} bytes of data")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * DTYPES[dtype][1]:
            raise ValueError(
                f"tensor {name!r}: {offsets[1] - offsets[0]} bytes of data for shape {tuple(shape)} {dtype}"
            )
        out[name] = (dtype, tuple(shape))
    return out


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (TORCH_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for n, t in tensors.items()}


def nonfinite(name: str, t: torch.Tensor) -> str | None:
    """What is not finite in tensor ``t`` (None when every value is finite or ``t`` holds integers)."""
    if not t.dtype.is_floating_point or t.numel() == 0 or bool(torch.isfinite(t).all()):
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"tensor {name!r} holds {nan} NaN and {inf} infinite value(s) of {t.numel()}"


def _meta_value(record: dict[str, Any], path: str) -> Any:
    value: Any = record
    for part in path.split("/"):
        value = value.get(part) if isinstance(value, dict) else None
    return value


class _Dims:
    """The sizes the symbols took so far (with who set them, for messages)."""

    def __init__(self, tasks: list[dict[str, Any]]) -> None:
        self.tasks = tasks
        self.kb: dict[str, tuple[int, str]] = {}
        self.complete = True
        self.per_task: dict[int, dict[str, int]] = {}  # each earlier task's obj. sizes (for sum.)

    def check(self, obj: Obj, scope: dict[str, tuple[int, str]], sym: str, size: int, who: str) -> str | None:
        """None when ``size`` fits ``sym``, else what it should be (binding free symbols)."""
        if sym == "*":
            return None
        if sym.startswith("meta:"):
            want = _meta_value(obj.record, sym[5:])
            if isinstance(want, int) and not isinstance(want, bool):
                return None if size == want else f"{want} (the record's {sym[5:].replace('/', '.')})"
            sym = "obj." + sym[5:]
        if sym == "classes" or sym.startswith("classes["):
            k = obj.index if sym == "classes" else int(sym[8:-1])
            rec = self.tasks[k] if k is not None and 0 <= k < len(self.tasks) else None
            if rec is None:
                return f"the classes of task index {k}, which the knowledge base does not hold"
            classes = rec.get("classes")
            if not isinstance(classes, list):
                return None
            return None if size == len(classes) else f"{len(classes)} (the classes of task index {k})"
        if sym.startswith("total:"):
            totals = obj.totals if obj.totals is not None else int_totals(obj.values or {})
            want = totals.get(sym[6:])
            return None if want is None or size == want else f"{want} (the sum of {sym[6:]})"
        if sym.startswith("sum."):
            if not self.complete:
                return None  # an earlier task's object could not be read (reported on its own)
            earlier = [t for k, t in self.per_task.items() if obj.index is not None and k < obj.index]
            want = sum(t.get("obj." + sym[4:], 0) for t in earlier)
            return None if size == want else f"{want} (the earlier tasks' {sym[4:]} summed)"
        table = self.kb if sym.startswith("kb.") else scope
        if sym not in table:
            table[sym] = (size, who)
            return None
        want, by = table[sym]
        return None if size == want else f"{want} (as {by})"


def check_objects(tasks: list[dict[str, Any]], objects: list[Obj]) -> list[str]:
    """Every problem of ``objects`` (the tasks' in order, then the head's): dtypes, shapes by the rules,
    non-finite values (where given). ``tasks`` are the manifest's task records."""
    dims, out = _Dims(tasks), []
    for obj in objects:
        if obj.index is None:
            obj.record = _head_view(obj.record)
    for obj in objects:
        kind = "task" if obj.index is not None else "head"
        for k, prefix, key in NEEDS_RECORD:
            if k == kind and obj.record.get(key) is None:
                names = [n for n in obj.shapes if n.startswith(prefix)]
                if names:
                    out.append(
                        f"{obj.path}: holds {prefix}* tensors ({names[0]!r}, ...) but its record has no "
                        f"{key} ({obj.label})"
                    )
        for k, path, condition, names in REQUIRED:
            if k == kind and condition(_meta_value(obj.record, path) if path else obj.record):
                full = [[f"{path}/{a}" if path else a for a in n.split("|")] for n in names]
                missing = [" or ".join(map(repr, n)) for n in full if not any(a in obj.shapes for a in n)]
                if missing:
                    what = f"its record's {path}" if path else "its record"
                    out.append(f"{obj.path}: tensor {missing[0]} missing, which {what} needs ({obj.label})")
        reported: set[str] = set()
        for k, pattern, together in TOGETHER:
            for name in obj.shapes if k == kind else ():
                m = re.fullmatch(pattern, name)
                if m is None:
                    continue
                want = [n.format(**m.groupdict()) for n in together]
                missing = [n for n in want if n not in obj.shapes and n not in reported]
                if missing:
                    reported.update(missing)
                    out.append(
                        f"{obj.path}: tensor {missing[0]!r} missing, which {name!r} comes with ({obj.label})"
                    )
    adapters = [
        (o, {m["g"] for n in o.shapes if (m := _ADAPTER_MAP.fullmatch(n))})
        for o in objects
        if o.index is not None and o.record.get("has_adapter") is True
    ]
    for o, maps in adapters:
        first, first_maps = adapters[0]
        if maps != first_maps:
            odd = sorted(maps ^ first_maps)
            out.append(
                f"{o.path}: its adapter covers other maps than {first.label}'s ({odd[0]!r} in one only); "
                f"every task's adapter has the same maps ({o.label})"
            )
    dims.complete = {o.index for o in objects if o.index is not None} == set(range(len(tasks)))
    for obj in objects:
        scope: dict[str, tuple[int, str]] = {}
        rules = TASK_RULES if obj.index is not None else HEAD_RULES
        where = f"({obj.label})"
        for name, (dtype, shape) in obj.shapes.items():
            if dtype not in DTYPES:
                out.append(f"{obj.path}: tensor {name!r} has dtype {dtype}, not one proteus writes {where}")
                continue
            for rule in rules:
                m = re.fullmatch(rule.pattern, name)
                if m is None:
                    continue
                groups = {k: v or "" for k, v in m.groupdict().items()}
                why = rule.why.format(**groups)
                values = rule.dtype.format(**groups)
                if values.startswith("meta:"):
                    named = META_DTYPES.get(str(_meta_value(obj.record, values[5:])))
                    if named is not None and dtype != named:
                        out.append(
                            f"{obj.path}: tensor {name!r} is {dtype}, but the record says {named} {where}"
                        )
                elif DTYPES[dtype][0] != values:
                    out.append(f"{obj.path}: tensor {name!r} is {dtype}, expected {values} values {where}")
                if len(shape) != len(rule.dims):
                    out.append(
                        f"{obj.path}: tensor {name!r} has shape {shape}, expected {len(rule.dims)} "
                        f"dimension(s): {why} {where}"
                    )
                    continue
                for axis, (sym, size) in enumerate(zip(rule.dims, shape, strict=True)):
                    sym = sym.format(**groups)
                    who = f"{name} of {obj.label}" if sym.startswith("kb.") else name
                    want = dims.check(obj, scope, sym, size, who)
                    if want is not None:
                        out.append(
                            f"{obj.path}: tensor {name!r} has shape {shape}: axis {axis} should be {want}; "
                            f"{why} {where}"
                        )
            if obj.values is not None and name in obj.values:
                bad = nonfinite(name, obj.values[name])
                if bad:
                    out.append(f"{obj.path}: {bad} {where}")
        if obj.index is not None:
            dims.per_task[obj.index] = {sym: size for sym, (size, _) in scope.items()}
    return out
