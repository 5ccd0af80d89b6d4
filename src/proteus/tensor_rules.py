"""What a learner leaves in a knowledge base, declared by the parts that store it, and the checks that apply
those declarations (``proteus kb verify`` and every load, before a learner sees a tensor).

A part declares its rules next to the ``state()`` / ``task_state()`` that writes them, under a *role* (the
learner family whose knowledge base holds them, or a part others mount) and its own name::

    TENSOR_RULES.declare("proteus", "experts", ShapeRule(r"expert/W", ("kb.expert_d", "classes"), "..."))

:mod:`proteus.kb` gathers the rules of the role a manifest names (:meth:`RuleBook.rules`: a learner's
``kb_layout``, or the role whose :class:`Claim` recognises the head's meta) and applies them; it never names
a part's tensor. A key strategy or covariance kind that stores a new tensor declares it in its own file.

**Record fields** (the JSON of a task's record or of the head's meta): :class:`F` types, as strings: an
atom of :data:`ATOMS` (``"count"``, ``"hex64"``, ...), ``"list[T]"`` (every item a ``T``) or alternatives
``"A|B"``; an ``F`` with ``fields`` checks a mapping's keys in turn. :class:`Fields` declares a part's
fields (and those the learner's records must hold); :class:`Check` a rule between records.

**Tensors**: a :class:`ShapeRule` applies to every tensor whose name matches its ``pattern`` (a full match;
named groups fill the ``{...}`` of its dimensions). It gives one symbol per axis of the tensor:

* ``*``: any size;
* ``obj.X``: the same size wherever ``X`` appears in one object (a task's or the head's file);
* ``kb.X``: the same size in every object of the commit (every task's ``A`` of one map has the same rows);
* ``sum.X``: the sum of the earlier tasks' ``obj.X`` (a task's transfer coefficients ``s`` have one entry
  per column of the adapters before it);
* ``classes``: the number of the task's classes (its record's ``classes``); ``classes[k]``: task k's;
* ``meta:a/b``: the integer at ``a.b`` of the object's record (the task record, or the head's meta); when
  the record has none, the symbol is an ``obj.`` one; ``meta:a|b``: the first of ``a``, ``b`` that is a
  positive integer;
* ``total:T``: the sum of the values of the object's 1-D integer tensor ``T`` (when it holds one).

``dtype`` is ``"float"``, ``"int"`` or ``"meta:<field>"`` (the dtype name the record gives, as the RanPAC
head's ``dtype``). :class:`Together` (tensors that come together), :class:`Required` (tensors a record
needs), :class:`NeedsRecord` (tensors read only with their record) and :class:`SameGroups` (every task holds
the same groups) complete them. A :class:`Mount` places another role's rules under a tensor prefix and a
record path (the signatures of a task under ``signature/``, the RanPAC head's of the keys under
``task_head/``), evaluated when the rules are gathered: a covariance kind registered later is mounted too.

This module is a floor below the parts: it imports the standard library, torch, :mod:`proteus.errors` and
:mod:`proteus.registry` only.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Any

import torch

__all__ = [
    "ATOMS", "DTYPES", "META_DTYPES", "TENSOR_RULES", "TORCH_DTYPES", "Check", "Claim", "F", "Fields",
    "Mount", "NeedsRecord", "Obj", "Required", "RuleBook", "SameGroups", "Schema", "ShapeRule", "Together",
    "check_objects", "field_problems", "fields_problems", "int_totals", "nonfinite", "record_problems",
    "shapes_of", "type_problem",
]  # fmt: skip


# ============================================================================ record fields (JSON)
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    """A finite number (an integer too large for a float is not: every reader converts it)."""
    try:
        return _is_num(v) and math.isfinite(v)
    except OverflowError:
        return False


#: the largest tensor dimension a record may name (an embedding size, a rank)
MAX_DIM = 1 << 24
_HEX64 = re.compile(r"[0-9a-f]{64}")

#: the atoms of the type strings: (test, how a message names it); :mod:`proteus.kb.schema` adds its own
ATOMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "any": (lambda v: True, "anything"),
    "null": (lambda v: v is None, "null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "map": (lambda v: isinstance(v, dict), "a mapping"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "int": (lambda v: _is_int(v) and abs(v) < 2**63, "an integer"),
    "count": (lambda v: _is_int(v) and 0 <= v < 2**53, "an integer >= 0"),
    "dim": (lambda v: _is_int(v) and 0 <= v <= MAX_DIM, f"an integer in [0, {MAX_DIM}]"),
    "float": (lambda v: _is_num(v) and (not _is_int(v) or abs(v) < 2**1023), "a number"),
    "number": (_finite, "a finite number"),
    "positive": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "rate": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "hex64": (lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None, "64 lowercase hex digits"),
}


@dataclass(frozen=True)
class F:
    """One field: its type, whether it must be present, and (a mapping's) the fields it holds, or (a list
    of mappings') the fields of each item; a ``closed`` mapping holds no other key (the code passes it on
    as keyword arguments)."""

    type: str
    required: bool = False
    fields: dict[str, F] | None = None
    closed: bool = False
    #: a list's items that are mappings hold these fields
    items: dict[str, F] | None = None


Schema = dict[str, F]


def type_problem(value: Any, type_: str) -> str | None:
    """None when ``value`` has type ``type_``, else what it should be."""
    options = _split(type_)
    for option in options:
        if option.startswith("list[") and option.endswith("]"):
            if isinstance(value, list):
                item = option[5:-1]
                test = ATOMS[item][0] if item in ATOMS else None  # (a long list of one atom: no recursion)
                if all(test(v) for v in value) if test else all(type_problem(v, item) is None for v in value):
                    return None
        elif ATOMS[option][0](value):
            return None
    return " or ".join(_describe(o) for o in options)


@functools.lru_cache(maxsize=256)
def _split(type_: str) -> tuple[str, ...]:
    """``"list[a|b]|null"`` -> ``("list[a|b]", "null")`` (a ``|`` inside brackets does not split)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(type_):
        depth += (ch == "[") - (ch == "]")
        if ch == "|" and depth == 0:
            out.append(type_[start:i])
            start = i + 1
    return (*out, type_[start:])


def _describe(option: str) -> str:
    if option.startswith("list["):
        return f"a list of {' or '.join(_describe(o) for o in _split(option[5:-1]))}"
    return ATOMS[option][1]


def shown(value: Any) -> str:
    """``value`` for a message: its repr, cut at 60 characters (an integer of any size included)."""
    if _is_int(value) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value))) if abs(value) < 10**4000 else 'over 4000'} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fields_problems(value: dict[str, Any], schema: Schema, where: str) -> list[str]:
    """Every field of mapping ``value`` that breaks ``schema`` (``where`` prefixes the field names)."""
    out = []
    for key, f in schema.items():
        name = f"{where}.{key}" if where else key
        if key not in value:
            if f.required:
                out.append(f"{name}: missing")
            continue
        out += field_problems(value[key], f, name)
    return out


#: how a message says what a field holds, by type (:mod:`proteus.kb.schema` adds its object names)
REFUSALS: dict[str, Callable[[Any], str]] = {}


def field_problems(value: Any, f: F, name: str) -> list[str]:
    want = type_problem(value, f.type)
    if want is not None and f.type in REFUSALS:
        return [f"{name}: {REFUSALS[f.type](value)}"]
    if want is not None:
        return [f"{name}: expected {want}, got {shown(value)}"]
    if f.items is not None and isinstance(value, list):
        return [
            p
            for i, v in enumerate(value)
            if isinstance(v, dict)
            for p in fields_problems(v, f.items, f"{name}[{i}]")
        ]
    if f.fields is None or not isinstance(value, dict):
        return []
    out = fields_problems(value, f.fields, name)
    if f.closed:
        out += [f"{name}.{k}: not a field of {name}" for k in value if k not in f.fields]
    return out


# ============================================================================ the rules
#: a condition on an object's record: (a path in it, a test of the value there)
Gate = tuple[str, Callable[[Any], bool]]


@dataclass(frozen=True, kw_only=True)
class _Rule:
    #: the object the rule applies to: ``"task"`` (a task's object and record) or ``"head"`` (the global
    #: object and the head's meta)
    on: str = "task"
    #: conditions on the record (added by a :class:`Mount` with ``when``)
    gates: tuple[Gate, ...] = ()

    def applies(self, record: Any) -> bool:
        return all(test(meta_value(record, path)) for path, test in self.gates)


@dataclass(frozen=True)
class ShapeRule(_Rule):
    """The shape (one symbol per axis, module docstring) and dtype of every tensor named ``pattern``."""

    pattern: str
    dims: tuple[str, ...]
    #: the rule in words, for messages (``{group}`` from the pattern; ``{prefix}`` and ``{record}``: where
    #: a :class:`Mount` places it)
    why: str
    dtype: str = "float"


@dataclass(frozen=True)
class Together(_Rule):
    """Tensors that come together: when one matches ``pattern``, all of ``names`` (``{group}`` filled from
    the match; ``a|b``: one of them) are present."""

    pattern: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Required(_Rule):
    """Tensors an object must hold when ``when`` holds for its record at ``path`` ("" the record itself);
    ``a|b`` in ``names``: one of them. ``names`` may be a function, called when the rule is applied (the
    first tensors of every covariance kind registered by then)."""

    names: tuple[str, ...] | Callable[[], tuple[str, ...]]
    when: Callable[[Any], bool]
    path: str = ""

    def wanted(self) -> tuple[str, ...]:
        return self.names() if callable(self.names) else self.names


@dataclass(frozen=True)
class NeedsRecord(_Rule):
    """Tensors named ``prefix*`` are read only when the record's ``key`` is set (not missing, null, false or
    empty): signature tensors without a signature record, or adapter tensors of a record that says it has
    no adapter, would be ignored silently."""

    prefix: str
    key: str


@dataclass(frozen=True)
class SameGroups(_Rule):
    """Every task whose record's ``flag`` is true holds the same groups ``g`` of tensors matching ``pattern``
    (every task's adapter covers the same maps); ``what`` names them in messages."""

    pattern: str
    flag: str
    what: str


@dataclass(frozen=True)
class Fields(_Rule):
    """The record fields a part writes (their types), at ``path`` of the record ("" the record itself; a
    path whose value is no mapping is skipped: its parent's declaration types it); ``required``: the fields
    the learner's records must hold."""

    fields: Schema
    path: str = ""
    required: tuple[str, ...] = ()


@dataclass(frozen=True)
class Check(_Rule):
    """A rule between records: ``fn(tasks, head_meta, where)`` -> problems, as ``"<field>: <problem>"``
    (the manifest's task records, in order, some maybe no mapping; the head's meta or None; ``where(i)``
    names task ``i``'s record in a message). ``each``: a rule within each record (the records already
    checked are not asked again: a commit checks the one it adds)."""

    fn: Callable[[list[Any], dict[str, Any] | None, Callable[[int], str]], list[str]]
    each: bool = False


@dataclass(frozen=True)
class Claim(_Rule):
    """A role's knowledge base is recognised by its head's meta (``fn(meta)``): how an old knowledge base
    (or one whose method this release does not know) names its learner."""

    fn: Callable[[dict[str, Any]], bool]


@dataclass(frozen=True)
class SideBySide(_Rule):
    """Tensors named ``pattern`` that a part reads a whole pack's tasks of at once (it appends them to what
    it keeps of every task: :func:`proteus.kb.packs.spans`): a pack stacks them side by side along their
    last axis. A pack lays every other tensor out whole per task (one contiguous piece each), for the parts
    that read a task's tensor alone (a shortlist's)."""

    pattern: str


@dataclass(frozen=True)
class Mount(_Rule):
    """``role``'s rules, applied to the tensors under ``prefix`` and the record at ``record`` of this
    ``on`` object, when ``when`` holds for that record (``role``'s own ``on`` is replaced)."""

    role: str
    prefix: str = ""
    record: str = ""
    when: Callable[[Any], bool] | None = None


Rule = (
    ShapeRule | Together | Required | NeedsRecord | SameGroups | Fields | Check | Claim | SideBySide | Mount
)


def _join(record: str, path: str) -> str:
    return "/".join(p for p in (record, path) if p)


def _prefixed(prefix: str, names: str) -> str:
    """``a|b`` -> ``<prefix>a|<prefix>b``."""
    return "|".join(prefix + a for a in names.split("|"))


def _symbol(sym: str, prefix: str, record: str) -> str:
    """A dimension or dtype symbol of a rule mounted at ``prefix`` / ``record``."""
    for scope in ("obj.", "kb.", "sum."):
        if sym.startswith(scope):
            return scope + prefix + sym[len(scope) :]
    if sym.startswith("total:"):
        return "total:" + prefix + sym[6:]
    if sym.startswith("meta:"):
        return "meta:" + "|".join(_join(record, p) for p in sym[5:].split("|"))
    return sym


def _mounted(rule: Rule, m: Mount) -> Rule | None:
    """``rule`` as ``m`` mounts it (None: a rule that only its own role applies: a claim, a check)."""
    p, r = m.prefix, m.record
    gates = rule.gates + (((r, m.when),) if m.when is not None else ())
    base: dict[str, Any] = {"on": m.on, "gates": gates}
    if isinstance(rule, ShapeRule):
        dims = tuple(_symbol(d, p, r) for d in rule.dims)
        dtype = rule.dtype if rule.dtype in ("float", "int") else _symbol(rule.dtype, p, r)
        why = rule.why.replace("{prefix}", p).replace("{record}", r.replace("/", ".") or "record")
        return ShapeRule(re.escape(p) + rule.pattern, dims, why, dtype, **base)
    if isinstance(rule, Together):
        return Together(re.escape(p) + rule.pattern, tuple(_prefixed(p, n) for n in rule.names), **base)
    if isinstance(rule, Required):
        inner = rule

        def names() -> tuple[str, ...]:
            return tuple(_prefixed(p, n) for n in inner.wanted())

        return Required(names, rule.when, _join(r, rule.path), **base)
    if isinstance(rule, NeedsRecord):
        return NeedsRecord(p + rule.prefix, _join(r, rule.key), **base)
    if isinstance(rule, SameGroups):
        return SameGroups(re.escape(p) + rule.pattern, _join(r, rule.flag), rule.what, **base)
    if isinstance(rule, SideBySide):
        return SideBySide(re.escape(p) + rule.pattern, **base)
    if isinstance(rule, Fields):
        return Fields(rule.fields, _join(r, rule.path), rule.required, **base)
    if isinstance(rule, Mount):
        return replace(rule, prefix=p + rule.prefix, record=_join(r, rule.record), **base)
    return None


class RuleBook:
    """The rules of every role, by the part (owner) that declared them. Its *plugins* are the modules whose
    import declares them (the learners' packages, which import their parts), imported one by one the first
    time a head's meta is claimed by no role loaded so far, or every role is asked for; the modules that
    installed packages advertise under the ``proteus.plugins`` entry-point group with them."""

    def __init__(self, plugins: tuple[str, ...] = ()) -> None:
        self._rules: dict[str, dict[str, tuple[Rule, ...]]] = {}
        self.plugins = plugins
        self._imported = 0

    def declare(self, role: str, owner: str, *rules: Rule) -> None:
        """Register ``owner``'s rules under ``role`` (an owner declares once per role)."""
        owners = self._rules.setdefault(role, {})
        if owner in owners:
            raise KeyError(f"tensor rules of {owner!r} are declared twice under {role!r}")
        owners[owner] = tuple(rules)

    def withdraw(self, role: str, owner: str) -> tuple[Rule, ...]:
        """Remove ``owner``'s rules from ``role`` (a plugin's or a test's own); returns them."""
        return self._rules.get(role, {}).pop(owner)

    def owners(self, role: str) -> list[str]:
        return sorted(self._rules.get(role, {}))

    def discover(self, until: Callable[[], bool] | None = None) -> None:
        """Import the plugins (then the entry points), stopping as soon as ``until()`` holds."""
        while self._imported < len(self.plugins):
            if until is not None and until():
                return
            self._imported += 1
            importlib.import_module(self.plugins[self._imported - 1])
        if self._imported == len(self.plugins):
            self._imported += 1
            for ep in entry_points(group="proteus.plugins"):
                ep.load()

    def learners(self) -> list[str]:
        """The roles of learner families (those with a :class:`Claim`), every plugin imported."""
        self.discover()
        return sorted(r for r, owners in self._rules.items() if any(_claims(owners)))

    def claimant(self, meta: Any) -> str | None:
        """The role whose :class:`Claim` recognises the head's ``meta`` (plugins imported until one does)."""

        def found() -> str | None:
            if not isinstance(meta, dict):
                return None
            claimed = (r for r, owners in self._rules.items() if any(c.fn(meta) for c in _claims(owners)))
            return next(claimed, None)

        self.discover(until=lambda: found() is not None)
        return found()

    def rules(self, *roles: str) -> list[Rule]:
        """Every rule of ``roles`` (none given: of every learner family), mounts resolved (a mounted role's
        rules as the mount places them, recursively)."""
        if not roles:
            roles = tuple(self.learners())
        out: list[Rule] = []
        for role in roles:
            out += self._expanded(role, ())
        return out

    def _expanded(self, role: str, seen: tuple[str, ...]) -> list[Rule]:
        if role in seen:
            raise ValueError(f"tensor rules mount each other in a loop: {' -> '.join((*seen, role))}")
        out: list[Rule] = []
        for owner_rules in list(self._rules.get(role, {}).values()):
            for rule in owner_rules:
                if not isinstance(rule, Mount):
                    out.append(rule)
                    continue
                for inner in self._expanded(rule.role, (*seen, role)):
                    placed = _mounted(inner, rule)
                    if placed is not None:
                        out.append(placed)
        return out


def _claims(owners: dict[str, tuple[Rule, ...]]) -> list[Claim]:
    return [r for rules in owners.values() for r in rules if isinstance(r, Claim)]


#: every part's rules; the learners' packages declare them (through their parts) when imported
TENSOR_RULES = RuleBook(plugins=("proteus.core", "proteus.baselines"))


# ============================================================================ records
def side_by_side(rules: list[Rule]) -> Callable[[str], bool]:
    """Whether a tensor name is one that ``rules`` lay out side by side in a pack (:class:`SideBySide`)."""
    patterns = [re.compile(r.pattern) for r in rules if isinstance(r, SideBySide)]
    return lambda name: any(p.fullmatch(name) for p in patterns)


def meta_value(record: Any, path: str) -> Any:
    """The value at ``path`` (``a/b``) of a record ("" the record itself; None where a step is missing)."""
    value: Any = record
    for part in path.split("/") if path else ():
        value = value.get(part) if isinstance(value, dict) else None
    return value


def record_problems(
    tasks: list[Any], head_meta: Any, rules: list[Rule], role: str, where: Callable[[int], str],
    checked: Callable[[int], bool] = lambda i: False, first: int = 0,
) -> list[str]:  # fmt: skip
    """Every problem of the records by ``rules`` (``role``'s :class:`Fields` and :class:`Check`): task ``i``'s
    fields prefixed ``where(i)`` (skipped when ``checked(i)``, or before ``first``: a commit re-checks only
    changed records), the head's ``head.meta``."""
    out: list[str] = []
    fields = [r for r in rules if isinstance(r, Fields)]
    for i, t in enumerate(tasks[first:], first):
        if not isinstance(t, dict) or checked(i):
            continue
        for fr in fields:
            if fr.on == "task" and fr.applies(t):
                out += _fields_of(t, fr, where(i), role, "task record")
    if isinstance(head_meta, dict):
        for fr in fields:
            if fr.on == "head" and fr.applies(head_meta):
                out += _fields_of(head_meta, fr, "head.meta", role, "head")
    meta = head_meta if isinstance(head_meta, dict) else None
    for r in rules:
        if isinstance(r, Check) and r.each:
            for i, t in enumerate(tasks[first:], first):
                if not checked(i):
                    out += r.fn([t], meta, lambda _, i=i: where(i))  # type: ignore[misc]
        elif isinstance(r, Check):
            out += r.fn(tasks, meta, where)
    return out


def _fields_of(record: dict[str, Any], r: Fields, where: str, role: str, what: str) -> list[str]:
    value = meta_value(record, r.path)
    if not isinstance(value, dict):
        return []
    name = ".".join([where, *r.path.split("/")]) if r.path else where
    out = fields_problems(value, r.fields, name)
    out += [f"{name}.{k}: missing (a {role} learner's {what} needs it)" for k in r.required if k not in value]
    return out


# ============================================================================ tensors
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
#: the dtype names a record uses for its tensors (the RanPAC head's ``dtype``)
META_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}


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
    values: Mapping[str, torch.Tensor] | None = None
    #: the sum of each 1-D integer tensor's values (for ``total:`` symbols; from ``values`` when None)
    totals: dict[str, int] | None = field(default=None)

    @property
    def kind(self) -> str:
        return "task" if self.index is not None else "head"


def int_totals(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The sum of each small 1-D integer tensor (``signature/ranks``: the rows of ``signature/lowrank``)."""
    return {
        n: int(t.sum())
        for n, t in tensors.items()
        if t.ndim == 1 and t.numel() <= 1 << 16 and not t.dtype.is_floating_point and t.dtype != torch.bool
    }


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (TORCH_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for n, t in tensors.items()}


def nonfinite(name: str, t: torch.Tensor) -> str | None:
    """What is not finite in tensor ``t`` (None when every value is finite or ``t`` holds integers)."""
    if not t.dtype.is_floating_point or t.numel() == 0 or bool(torch.isfinite(t).all()):
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"tensor {name!r} holds {nan} NaN and {inf} infinite value(s) of {t.numel()}"


def _positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


class _Dims:
    """The sizes the symbols took so far (with who set them, for messages)."""

    def __init__(self, tasks: list[dict[str, Any]]) -> None:
        self.tasks = tasks
        self.kb: dict[str, tuple[int, str]] = {}
        self.complete = True
        self.per_task: dict[int, dict[str, int]] = {}  # each earlier task's obj. sizes (for sum.)
        #: (the task indices summed, in order, their obj. sizes summed): the totals of ``sum.`` for tasks
        #: checked in order (:meth:`done`), so that a long stream's check stays linear
        self._prefix: tuple[int, dict[str, int]] = (0, {})

    def done(self, index: int, sizes: dict[str, int]) -> None:
        """Task ``index``'s object is checked: its sizes join the earlier tasks' (``sum.``)."""
        self.per_task[index] = sizes
        upto, totals = self._prefix
        if index == upto:
            merged = dict(totals)
            for sym, size in sizes.items():
                merged[sym] = merged.get(sym, 0) + size
            self._prefix = (upto + 1, merged)

    def check(self, obj: Obj, scope: dict[str, tuple[int, str]], sym: str, size: int, who: str) -> str | None:
        """None when ``size`` fits ``sym``, else what it should be (binding free symbols)."""
        if sym == "*":
            return None
        if sym.startswith("meta:"):
            paths = sym[5:].split("|")
            found = [(p, meta_value(obj.record, p)) for p in paths]
            if len(paths) > 1:
                found = [(p, v) for p, v in found if _positive_int(v)][:1]
            for path, want in found:
                if _is_int(want):
                    return None if size == want else f"{want} (the record's {path.replace('/', '.')})"
            sym = "obj." + paths[0]
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
            upto, totals = self._prefix
            if obj.index == upto:  # tasks checked in order: their running totals
                want = totals.get("obj." + sym[4:], 0)
            else:
                earlier = [t for k, t in self.per_task.items() if obj.index is not None and k < obj.index]
                want = sum(t.get("obj." + sym[4:], 0) for t in earlier)
            return None if size == want else f"{want} (the earlier tasks' {sym[4:]} summed)"
        table = self.kb if sym.startswith("kb.") else scope
        if sym not in table:
            table[sym] = (size, who)
            return None
        want, by = table[sym]
        return None if size == want else f"{want} (as {by})"


def check_objects(tasks: list[dict[str, Any]], objects: list[Obj], rules: list[Rule]) -> list[str]:
    """Every problem of ``objects`` (the tasks' in order, then the head's) by ``rules``: dtypes, shapes,
    tensors that come together or that a record needs, non-finite values (where given). ``tasks`` are the
    manifest's task records."""
    out: list[str] = []
    for obj in objects:
        out += _presence(obj, rules)
    out += _same_groups(objects, rules)
    dims = _Dims(tasks)
    dims.complete = {o.index for o in objects if o.index is not None} == set(range(len(tasks)))
    shape_rules = [r for r in rules if isinstance(r, ShapeRule)]
    for obj in objects:
        scope: dict[str, tuple[int, str]] = {}
        mine = [r for r in shape_rules if r.on == obj.kind and r.applies(obj.record)]
        patterns = tuple(r.pattern for r in mine)
        where = f"({obj.label})"
        for name, (dtype, shape) in obj.shapes.items():
            if dtype not in DTYPES:
                out.append(f"{obj.path}: tensor {name!r} has dtype {dtype}, not one proteus writes {where}")
                continue
            for i in _matching(patterns, name):
                out += _shape_problems(obj, mine[i], name, dtype, shape, dims, scope)
            if obj.values is not None and name in obj.values:
                bad = nonfinite(name, obj.values[name])
                if bad:
                    out.append(f"{obj.path}: {bad} {where}")
        if obj.index is not None:
            dims.done(obj.index, {sym: size for sym, (size, _) in scope.items()})
    return out


def _presence(obj: Obj, rules: list[Rule]) -> list[str]:
    """The tensors ``obj`` lacks or should not hold by the :class:`NeedsRecord`, :class:`Required` and
    :class:`Together` rules."""
    out: list[str] = []
    mine = [r for r in rules if r.on == obj.kind and r.applies(obj.record)]
    for nr in (r for r in mine if isinstance(r, NeedsRecord)):
        value = meta_value(obj.record, nr.key)
        names = [n for n in obj.shapes if n.startswith(nr.prefix)]
        if names and not value:
            key = nr.key.replace("/", ".")
            says = f"has no {key}" if value is None else f"says {key}: {shown(value)}"
            out.append(
                f"{obj.path}: holds {nr.prefix}* tensors ({names[0]!r}, ...) but its record {says} "
                f"({obj.label})"
            )
    for r in mine:
        if isinstance(r, Required) and r.when(meta_value(obj.record, r.path)):
            missing = [_missing(n) for n in r.wanted() if not _held(obj, n)]
            if missing:
                what = f"its record's {r.path.replace('/', '.')}" if r.path else "its record"
                out.append(f"{obj.path}: tensor {missing[0]} missing, which {what} needs ({obj.label})")
    reported: set[str] = set()
    for r in mine:
        if not isinstance(r, Together):
            continue
        for name in obj.shapes:
            m = _fullmatch(r.pattern, name)
            if m is None:
                continue
            want = [n.format(**m.groupdict()) for n in r.names]
            missing = [n for n in want if not _held(obj, n) and n not in reported]
            if missing:
                reported.update(missing)
                out.append(
                    f"{obj.path}: tensor {_missing(missing[0])} missing, which {name!r} comes with "
                    f"({obj.label})"
                )
    return out


def _held(obj: Obj, names: str) -> bool:
    """Whether ``obj`` holds one of ``a|b``."""
    return any(a in obj.shapes for a in names.split("|"))


def _missing(names: str) -> str:
    """``a|b`` -> ``'a' or 'b'``."""
    return " or ".join(map(repr, names.split("|")))


def _same_groups(objects: list[Obj], rules: list[Rule]) -> list[str]:
    out: list[str] = []
    for r in rules:
        if not isinstance(r, SameGroups):
            continue
        held = [
            (o, {m["g"] for n in o.shapes if (m := _fullmatch(r.pattern, n))})
            for o in objects
            if o.kind == r.on and r.applies(o.record) and meta_value(o.record, r.flag) is True
        ]
        for o, groups in held:
            first, first_groups = held[0]
            if groups != first_groups:
                odd = sorted(groups ^ first_groups)
                out.append(
                    f"{o.path}: its {r.what} covers other maps than {first.label}'s ({odd[0]!r} in one "
                    f"only); every task's {r.what} has the same maps ({o.label})"
                )
    return out


@functools.lru_cache(maxsize=2**16)
def _fullmatch(pattern: str, name: str) -> re.Match[str] | None:
    """``re.fullmatch``, kept per (pattern, tensor name): every task's object holds the same names."""
    return re.fullmatch(pattern, name)


@functools.lru_cache(maxsize=2**12)
def _matching(patterns: tuple[str, ...], name: str) -> tuple[int, ...]:
    """The positions of the ``patterns`` that tensor ``name`` matches in full."""
    return tuple(i for i, p in enumerate(patterns) if _fullmatch(p, name))


def _shape_problems(
    obj: Obj, rule: ShapeRule, name: str, dtype: str, shape: tuple[int, ...], dims: _Dims,
    scope: dict[str, tuple[int, str]],
) -> list[str]:  # fmt: skip
    m = _fullmatch(rule.pattern, name)
    if m is None:
        return []
    out: list[str] = []
    where = f"({obj.label})"
    groups = {k: v or "" for k, v in m.groupdict().items()}
    why = rule.why.replace("{prefix}", "").replace("{record}", "record").format(**groups)
    values = rule.dtype.format(**groups)
    if values.startswith("meta:"):
        named = META_DTYPES.get(str(meta_value(obj.record, values[5:])))
        if named is not None and dtype != named:
            out.append(f"{obj.path}: tensor {name!r} is {dtype}, but the record says {named} {where}")
    elif DTYPES[dtype][0] != values:
        out.append(f"{obj.path}: tensor {name!r} is {dtype}, expected {values} values {where}")
    if len(shape) != len(rule.dims):
        expected = f"expected {len(rule.dims)} dimension(s): {why} {where}"
        return [*out, f"{obj.path}: tensor {name!r} has shape {shape}, {expected}"]
    for axis, (sym, size) in enumerate(zip(rule.dims, shape, strict=True)):
        sym = sym.format(**groups)
        who = f"{name} of {obj.label}" if sym.startswith("kb.") else name
        want = dims.check(obj, scope, sym, size, who)
        if want is not None:
            out.append(
                f"{obj.path}: tensor {name!r} has shape {shape}: axis {axis} should be {want}; {why} {where}"
            )
    return out
