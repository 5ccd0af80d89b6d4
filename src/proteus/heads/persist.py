"""Persistence of the RanPAC head (Eq. 23's statistics): its meta (JSON) and tensors (safetensors),
restored bit-exactly.

:func:`head_meta`, :func:`head_tensors` and :func:`load_head_state` read and write the hyper-parameters
and the fitted tensors ``W_rand``, ``G``, ``Q``, ``counts``, ``W_out`` (and ``P`` for prototypes that keep
their own matrix, :data:`~proteus.heads.prototypes.PROTOTYPES`) of any object with the head's fields
(:class:`HeadFields`); :class:`~proteus.heads.ranpac.RanPACHead`'s ``meta``, ``state_tensors`` and
``load_state_tensors`` call them. What a stored head may hold (its meta's fields, its tensors' shapes and
dtypes) is declared here too, as the role ``"ranpac"`` of :data:`proteus.tensor_rules.TENSOR_RULES`: the
learners that store a RanPAC head mount it where they keep it (the head over every class at the root of
the head's object, the LDA keys under ``task_head/``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeGuard

import torch
from torch import Tensor

from proteus.heads.prototypes import PROTOTYPES
from proteus.kb.packs import spans
from proteus.tensor_rules import TENSOR_RULES, F, Fields, Required, Schema, ShapeRule, SideBySide, Together

__all__ = [
    "COLUMNS", "RANPAC_META", "SUPPORTED_DTYPES", "HeadFields", "assemble_columns", "classes_outside",
    "column_pieces",
    "dtype_name", "head_columns", "head_meta", "head_tensors", "is_head_meta", "load_head_state",
    "meta_dtype",
]  # fmt: skip

SUPPORTED_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
_FORMAT = "proteus.heads.ranpac"
_FORMAT_VERSION = 1


#: a head's meta (:func:`head_meta`), as :func:`load_head_state` reads it
RANPAC_META: Schema = {
    "format": F("str"),
    "format_version": F("int"),
    "embed_dim": F("dim", True),
    "rp_dim": F("dim", True),
    "seed": F("int", True),
    "dtype": F("str", True),
    "num_classes": F("count", True),
    "n_samples": F("count"),
    "n_updates": F("count"),
    "gamma": F("positive|null"),
    "fixed_gamma": F("positive|null"),
    "gamma_min_exp": F("int"),
    "gamma_max_exp": F("int"),
    "holdout": F("number"),
    "selection": F("str"),
    "prototypes": F("str"),
    "columns": F("str"),
}

#: the tensors of a head with one column per class: a learner whose tasks own disjoint classes stores each
#: task's columns in that task's object (:func:`head_columns`, written once) and the head's meta says so
#: (``"columns": "tasks"``): the head's own object then keeps the same size however many classes there are
#: (``W_out``, derived from the rest, is not stored: it is solved when the head is loaded or first used)
COLUMNS = ("Q", "counts", "P")


def is_head_meta(meta: Any) -> TypeGuard[dict[str, Any]]:
    """Whether ``meta`` describes a RanPAC head (:func:`head_meta`'s format, or an older one's fields)."""
    return isinstance(meta, dict) and ("embed_dim" in meta or meta.get("format") == _FORMAT)


def _fitted(meta: Any) -> bool:
    n = meta.get("n_samples") if isinstance(meta, dict) else None
    return is_head_meta(meta) and isinstance(n, int) and not isinstance(n, bool) and n > 0


def _projects(meta: Any) -> bool:
    rp = meta.get("rp_dim") if isinstance(meta, dict) else None
    return _fitted(meta) and isinstance(rp, int) and not isinstance(rp, bool) and rp > 0


def _in_tasks(meta: Any) -> bool:
    """Whether a head's class columns live in its tasks' objects (``"columns": "tasks"``)."""
    return isinstance(meta, dict) and meta.get("columns") == "tasks"


def _stores_prototypes(meta: Any) -> bool:
    """Whether a fitted head's prototypes keep their own matrix ``P``."""
    name = meta.get("prototypes", "sum") if isinstance(meta, dict) else None
    return _fitted(meta) and isinstance(name, str) and name in PROTOTYPES and PROTOTYPES.get(name).stored


#: the head's feature dimension m: rp_dim, or embed_dim without a random projection (``feature_dim``)
_M = "meta:rp_dim|embed_dim"
TENSOR_RULES.declare(
    "ranpac", "RanPACHead",
    Fields(RANPAC_META, on="head"),
    ShapeRule("G", (_M, _M), "G is (m, m), m the head's rp_dim (its embed_dim without a projection)",
              "meta:dtype", on="head"),
    ShapeRule("(?:Q|W_out|P)", (_M, "meta:num_classes"),
              "(m, classes): m rows as G, one column per class of the head", "meta:dtype", on="head"),
    ShapeRule("counts", ("meta:num_classes",), "one count per class of the head", "int", on="head"),
    ShapeRule("W_rand", ("meta:embed_dim", _M), "W_rand (embed_dim, m) projects into G's m dimensions",
              "meta:dtype", on="head"),
    Required(("G",), _fitted, on="head"),
    Required(("Q", "counts", "W_out"), lambda m: _fitted(m) and not _in_tasks(m), on="head"),
    # W_out is solved from gamma where the columns live in the tasks: without gamma, only a stored one serves
    Required(("W_out",), lambda m: _fitted(m) and _in_tasks(m) and m.get("gamma") is None, on="head"),
    Required(("W_rand",), _projects, on="head"),
    Required(("P",), lambda m: _stores_prototypes(m) and not _in_tasks(m), on="head"),
)  # fmt: skip
#: a task's columns of a head (:func:`head_columns`), mounted in a task's object where a part keeps them
TENSOR_RULES.declare(
    "ranpac columns", "RanPACHead",
    ShapeRule("(?:Q|P)", ("kb.m", "classes"), "a task's columns of the head (its m features, one column per "
              "class of the task): every task's have the same m"),
    ShapeRule("counts", ("classes",), "one count per class of the task", "int"),
    Together("(?:Q|counts)", ("Q", "counts")),
    SideBySide("(?:Q|P|counts)"),  # a pack's tasks placed in the head at once (column_pieces)
)  # fmt: skip


def classes_outside(
    tasks: list[Any], meta: dict[str, Any] | None, where: Callable[[int], str], path: str = ""
) -> list[str]:
    """Every task whose classes fall outside the head's (``meta`` at ``path``: the head's ``num_classes``
    columns score the global labels 0 .. num_classes - 1): such a class could never be scored."""
    head = meta
    for part in path.split("/") if path else ():
        head = head.get(part) if isinstance(head, dict) else None
    n = head.get("num_classes") if is_head_meta(head) else None
    if not isinstance(n, int) or isinstance(n, bool):
        return []
    name = ".".join(["head.meta", *path.split("/")]) if path else "head.meta"
    every = itertools.chain.from_iterable(
        t["classes"] for t in tasks if isinstance(t, dict) and isinstance(t.get("classes"), list)
    )
    if _within(list(every), n):  # (one pass in C over every class: a long stream's commit checks them all)
        return []
    out = []
    for i, t in enumerate(tasks):
        classes = t.get("classes") if isinstance(t, dict) else None
        if isinstance(classes, list) and _within(classes, n):
            continue
        bad = (
            [c for c in classes if isinstance(c, int) and not 0 <= c < n] if isinstance(classes, list) else []
        )
        if bad:
            out.append(
                f"{where(i)}.classes: class {bad[0]} is not one of the head's {n} classes "
                f"({name}.num_classes: the head scores the global labels 0 .. num_classes - 1)"
            )
    return out


def _within(classes: list[Any], n: int) -> bool:
    """Whether no integer of ``classes`` falls outside 0 .. n - 1, found in C when it holds numbers only
    (False when it cannot tell: the caller looks at each)."""
    try:
        return not classes or (min(classes) >= 0 and max(classes) < n)
    except TypeError:
        return False


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HeadFields(Protocol):
    """The fields of a RanPAC head that its state holds (:class:`~proteus.heads.ranpac.RanPACHead`)."""

    embed_dim: int
    rp_dim: int
    gamma_min_exp: int
    gamma_max_exp: int
    holdout: float
    selection: str
    prototypes: str
    seed: int
    dtype: torch.dtype
    device: torch.device | str | None
    gamma: float | None
    W_rand_: Tensor | None
    G_: Tensor | None
    Q_: Tensor | None
    P_: Tensor | None
    counts_: Tensor | None
    gamma_: float | None
    W_out_: Tensor | None
    gamma_selection_: Any
    n_samples_: int
    n_updates_: int

    @property
    def feature_dim(self) -> int: ...

    @property
    def num_classes_(self) -> int: ...


def head_meta(head: HeadFields, columns: bool = True) -> dict[str, Any]:
    """JSON-serialisable description of the head (hyper-parameters and scalar fitted state); without
    ``columns``: its class columns are stored by task (``"columns": "tasks"``, :data:`COLUMNS`)."""
    extra = {} if columns else {"columns": "tasks"}
    return {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "embed_dim": head.embed_dim,
        "rp_dim": head.rp_dim,
        "gamma_min_exp": head.gamma_min_exp,
        "gamma_max_exp": head.gamma_max_exp,
        "holdout": head.holdout,
        "selection": head.selection,
        "prototypes": head.prototypes,
        "seed": head.seed,
        "dtype": dtype_name(head.dtype),
        "fixed_gamma": head.gamma,
        "gamma": head.gamma_,
        "num_classes": head.num_classes_,
        "n_samples": head.n_samples_,
        "n_updates": head.n_updates_,
        **extra,
    }


def head_tensors(head: HeadFields, columns: bool = True) -> dict[str, Tensor]:
    """Fitted tensors for safetensors storage (contiguous CPU copies). ``W_rand`` is stored too. Without
    ``columns``, only those of a fixed size (``W_rand``, ``G``): the class columns are stored by task
    (:func:`head_columns`) and ``W_out`` not at all (:data:`COLUMNS`)."""
    out: dict[str, Tensor] = {}
    fixed = (("W_rand", head.W_rand_), ("G", head.G_))
    by_class: tuple[tuple[str, Tensor | None], ...] = ()  # W_out: solved when asked for, so only if stored
    if columns:
        by_class = (("Q", head.Q_), ("counts", head.counts_), ("W_out", head.W_out_), ("P", head.P_))
    for key, t in (*fixed, *by_class):
        if t is not None:
            out[key] = t.detach().to("cpu", copy=True).contiguous()
    return out


def head_columns(head: HeadFields, classes: list[int]) -> dict[str, Tensor]:
    """The columns of ``classes`` (a task's, in its order) of the head's class statistics: ``Q``, ``counts``
    (and ``P`` where the prototypes keep it), contiguous CPU copies; none before the head is fitted."""
    if head.Q_ is None or head.counts_ is None:
        return {}
    idx = torch.as_tensor(classes, dtype=torch.long, device=head.Q_.device)
    out = {"Q": head.Q_[:, idx], "counts": head.counts_[idx]}
    if head.P_ is not None:
        out["P"] = head.P_[:, idx]
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def assemble_columns(
    meta: dict[str, Any], pieces: list[tuple[list[int], dict[str, Tensor]]]
) -> dict[str, Tensor]:
    """The class statistics (:data:`COLUMNS`) of a head whose tasks hold its columns: each task's classes and
    columns (:func:`head_columns`) in place, every other class's zero; a ValueError names the task whose
    columns do not fit the head's meta. Pieces whose classes are 0 .. C-1 in order (a class-incremental
    stream's) are joined side by side, without first filling the matrices with zeros."""
    dtype = meta_dtype(meta) or torch.float64
    m = int(meta["rp_dim"]) or int(meta["embed_dim"])
    c = int(meta["num_classes"])
    tiled = _tiled(meta, pieces, m, c)
    if tiled is not None:
        return tiled
    Q = torch.zeros(m, c, dtype=dtype)
    counts = torch.zeros(c, dtype=torch.long)
    P = torch.zeros(m, c, dtype=dtype) if any("P" in cols for _, cols in pieces) else None
    for k, (classes, cols) in enumerate(pieces):
        idx = torch.as_tensor(classes, dtype=torch.long)
        q, n = cols.get("Q"), cols.get("counts")
        if q is None or n is None:
            raise ValueError(f"task {k + 1}: no columns of the head in its object (Q and counts)")
        if tuple(q.shape) != (m, len(classes)) or tuple(n.shape) != (len(classes),):
            raise ValueError(
                f"task {k + 1}: the head's columns have shapes {tuple(q.shape)} and {tuple(n.shape)}, the "
                f"head expects ({m}, {len(classes)}) and ({len(classes)},)"
            )
        if len(classes) and (int(idx.max()) >= c or int(idx.min()) < 0):
            raise ValueError(f"task {k + 1}: classes outside the head's {c}")
        at: slice | Tensor = idx
        if classes and classes == list(range(classes[0], classes[0] + len(classes))):
            at = slice(classes[0], classes[0] + len(classes))  # consecutive classes: a block copy
        Q[:, at] = q.to(dtype)
        counts[at] = n.long()
        if P is not None and "P" in cols:
            P[:, at] = cols["P"].to(dtype)
    out = {"Q": Q, "counts": counts}
    if P is not None:
        out["P"] = P
    return out


def _tiled(
    meta: dict[str, Any], pieces: list[tuple[list[int], dict[str, Tensor]]], m: int, c: int
) -> dict[str, Tensor] | None:
    """:func:`assemble_columns` of pieces whose classes are 0 .. c-1 in order, each with every column (and all
    with ``P`` or none), fit to the head: their columns side by side; else None (placed one by one)."""
    flat = [x for classes, _ in pieces for x in classes]
    has_p = {"P" in cols for _, cols in pieces}
    fits = all(
        cols.get("Q") is not None and tuple(cols["Q"].shape) == (m, len(classes))
        and cols.get("counts") is not None and tuple(cols["counts"].shape) == (len(classes),)
        and ("P" not in cols or tuple(cols["P"].shape) == (m, len(classes)))
        for classes, cols in pieces
    )  # fmt: skip
    if not pieces or not fits or len(has_p) != 1 or flat != list(range(c)):
        return None
    dtype = meta_dtype(meta) or torch.float64
    out = {
        "Q": torch.cat([cols["Q"].to(dtype) for _, cols in pieces], 1),
        "counts": torch.cat([cols["counts"].long() for _, cols in pieces]),
    }
    if has_p == {True}:
        out["P"] = torch.cat([cols["P"].to(dtype) for _, cols in pieces], 1)
    return out


def column_pieces(
    entries: list[tuple[list[int], Mapping[str, Tensor]]], prefix: str
) -> list[tuple[list[int], dict[str, Tensor]]]:
    """:func:`assemble_columns`' pieces from each task's classes and stored tensors (its columns named
    ``prefix<name>``): the tasks of a knowledge base's pack as one piece (their columns side by side, one view
    of the pack: :func:`proteus.kb.packs.spans`), any other task as its own."""
    names = [n for n in COLUMNS if entries and f"{prefix}{n}" in entries[0][1]]
    out: list[tuple[list[int], dict[str, Tensor]]] = []
    for first, end, blocks in spans([t for _, t in entries], [f"{prefix}{n}" for n in names]):
        if blocks is None or not names:
            for classes, t in entries[first:end]:
                out.append((classes, {n[len(prefix) :]: t[n] for n in t if n.startswith(prefix)}))
            continue
        classes = [c for cs, _ in entries[first:end] for c in cs]
        out.append((classes, {n: blocks[f"{prefix}{n}"][0] for n in names}))
    return out


def meta_dtype(meta: dict[str, Any]) -> torch.dtype | None:
    """The head dtype a meta names (None for a missing or unsupported name)."""
    return {v: k for k, v in SUPPORTED_DTYPES.items()}.get(meta.get("dtype", ""))


def load_head_state(head: HeadFields, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Restore into ``head`` a state saved with :func:`head_tensors` and :func:`head_meta` (bit-exact; no
    dtype casts); a head written before ``prototypes`` existed reads as ``"sum"``."""
    if meta.get("format", _FORMAT) != _FORMAT:
        raise ValueError(f"not a RanPAC head state: format={meta.get('format')!r}")
    dtype = meta_dtype(meta)
    if dtype is None:
        raise ValueError(f"unsupported dtype {meta['dtype']!r} in head meta")
    head.embed_dim = int(meta["embed_dim"])
    head.rp_dim = int(meta["rp_dim"])
    head.gamma_min_exp = int(meta.get("gamma_min_exp", head.gamma_min_exp))
    head.gamma_max_exp = int(meta.get("gamma_max_exp", head.gamma_max_exp))
    head.holdout = float(meta.get("holdout", head.holdout))
    head.selection = str(meta.get("selection", head.selection))
    head.prototypes = str(meta.get("prototypes", "sum"))
    head.seed = int(meta["seed"])
    head.dtype = dtype
    head.gamma = None if meta.get("fixed_gamma") is None else float(meta["fixed_gamma"])
    m, c = head.feature_dim, int(meta["num_classes"])
    device = torch.device(head.device) if head.device is not None else None
    if "G" not in tensors and int(meta.get("n_samples", 0)) == 0:  # saved before the first update
        w = tensors.get("W_rand")
        head.W_rand_ = None if w is None or head.rp_dim == 0 else w.to(device or w.device)
        head.G_ = head.Q_ = head.P_ = head.counts_ = head.W_out_ = None
        head.gamma_, head.gamma_selection_, head.n_samples_, head.n_updates_ = None, None, 0, 0
        return
    keeps_P = PROTOTYPES.get(head.prototypes).stored
    expected = {
        "G": ((m, m), dtype),
        "Q": ((m, c), dtype),
        "counts": ((c,), torch.long),
    }
    solved = "W_out" in tensors or not _in_tasks(meta)  # else solved when first used (:data:`COLUMNS`)
    if solved:
        expected["W_out"] = ((m, c), dtype)
    if keeps_P:
        expected["P"] = ((m, c), dtype)
    if head.rp_dim > 0:
        expected["W_rand"] = ((head.embed_dim, head.rp_dim), dtype)
    for key, (shape, dt) in expected.items():
        if key not in tensors:
            raise ValueError(f"head state is missing tensor {key!r}")
        t = tensors[key]
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ValueError(
                f"head tensor {key!r} has shape {tuple(t.shape)} and dtype {t.dtype}; expected {shape}, {dt}"
            )
    device = device or tensors["G"].device
    head.W_rand_ = tensors["W_rand"].to(device) if head.rp_dim > 0 else None
    head.G_ = tensors["G"].to(device)
    head.Q_ = tensors["Q"].to(device)
    head.counts_ = tensors["counts"].to(device)
    head.W_out_ = tensors["W_out"].to(device) if solved else None
    head.P_ = tensors["P"].to(device) if keeps_P else None
    head.gamma_ = None if meta.get("gamma") is None else float(meta["gamma"])
    head.n_samples_ = int(meta.get("n_samples", int(head.counts_.sum())))
    head.n_updates_ = int(meta.get("n_updates", 0))
    head.gamma_selection_ = None
