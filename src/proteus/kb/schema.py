"""What a knowledge base's manifest may hold, as data: the type of every field the store itself reads
(:data:`MANIFEST`, :data:`TASK`, :data:`HEAD`, ...), the rules between them (:data:`SAME_LENGTH`) and where
an object may live (:func:`object_path`); the fields of a learner's records (a task's signature, a head's
meta) are declared by the parts that write them (:mod:`proteus.tensor_rules`) and gathered here for the
learner the manifest names.

A manifest is checked when it is opened, before any tensor is read, and by ``proteus kb verify`` and
``proteus kb info``. A field not listed here is allowed (and never read); a listed field must have its
type, and a required one must be present. The learner's own fields (a task's classes, a head's meta) are
required only in a knowledge base whose head a learner wrote (the role whose
:class:`~proteus.tensor_rules.Claim` recognises the head's meta): the store itself keeps any records
(``tests/test_kb*.py`` build such knowledge bases), while
:meth:`~proteus.kb.store.KnowledgeBase.read_state`, which feeds a learner, requires its learner's always.

Types are strings: an atom of :data:`~proteus.tensor_rules.ATOMS` (``"count"``, ``"hex64"``, ``"object"``
...), ``"list[T]"`` (every item a ``T``) or alternatives ``"A|B"``; a :class:`F` with ``fields`` checks a
mapping's keys in turn.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import os
import re
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any, TypeGuard

from proteus.budgets import BudgetError, limit, over
from proteus.kb.files import FORMAT, OBJECTS, READABLE_VERSIONS, V3_KEYS, V4_KEYS, KBError, manifest_checksum
from proteus.tensor_rules import (
    ATOMS,
    MAX_DIM,
    REFUSALS,
    TENSOR_RULES,
    F,
    Schema,
    field_problems,
    fields_problems,
    record_problems,
    type_problem,
)
from proteus.tensor_rules import shown as _shown
from proteus.untrusted import InputError, load_json

__all__ = [
    "MANIFEST", "MANIFEST_V4", "MAX_DIM", "OBJECT_NAME", "SEGMENT", "SEGMENT_NAME", "TASK", "F", "Schema",
    "field_problems", "fields_problems", "head_kind", "manifest_issues", "manifest_problems", "object_dirs",
    "object_path", "task_label", "type_problem",
]  # fmt: skip

log = logging.getLogger("proteus")

#: the name :meth:`~proteus.kb.store.KnowledgeBase.write_object` gives an object: its kind, then the first
#: 16 hex digits of its sha256 (so a name is never reused for other bytes)
OBJECT_NAME = re.compile(
    rf"{OBJECTS}/(?P<kind>[A-Za-z0-9][A-Za-z0-9_-]{{0,63}})-(?P<sha>[0-9a-f]{{16}})\.safetensors"
)
ATOMS["object"] = (
    lambda v: isinstance(v, str) and OBJECT_NAME.fullmatch(v) is not None,
    f"an object name {OBJECTS}/<kind>-<16 hex digits>.safetensors",
)
#: the name of a record segment (format 4, :mod:`proteus.kb.segments`): JSON, content-addressed like an object
SEGMENT_NAME = re.compile(rf"{OBJECTS}/records-(?P<sha>[0-9a-f]{{16}})\.json")
ATOMS["segment"] = (
    lambda v: isinstance(v, str) and SEGMENT_NAME.fullmatch(v) is not None,
    f"a record segment name {OBJECTS}/records-<16 hex digits>.json",
)


def _refused(rel: Any) -> str:
    return (
        f"object path {_shown(rel)} refused: not a name this proteus writes "
        f"({OBJECTS}/<kind>-<16 hex digits>.safetensors: no '..', not absolute)"
    )


REFUSALS["object"] = _refused
REFUSALS["segment"] = lambda rel: (
    f"record segment path {_shown(rel)} refused: not a name this proteus writes "
    f"({OBJECTS}/records-<16 hex digits>.json: no '..', not absolute)"
)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------- tables
#: the backbone identity (``check_backbone``): a knowledge base is refused under another backbone
BACKBONE: Schema = {
    "name": F("str"),
    "weights_id": F("str|null"),
    "weights_sha256": F("str|null"),
    "embed_dim": F("dim|null"),
    "split": F("int|null"),
    "data_config": F("map|null"),
}
SPLIT: Schema = {"benchmark": F("str|null"), "sha256": F("str|null"), "class_order": F("list[str]|null")}
#: the fields of a task's record that the store itself reads (``proteus kb info``, the commit summary); a
#: learner's own fields are its parts' declarations
TASK: Schema = {
    "index": F("count", True),
    "object": F("object", True),
    "sha256": F("hex64", True),
    "classes": F("list[count]"),
    "class_names": F("list[str]"),
    "n_train": F("count"),
    "forgotten": F("bool"),
    "learned": F("any"),  # when (a time stamp); only shown, never parsed
    "settings": F("map"),
}
HEAD: Schema = {
    "meta": F("map", True), "object": F("object", True), "sha256": F("hex64", True), "bytes": F("count"),
}  # fmt: skip
#: an accuracy row kept with the state (``Evaluation.to_dict``, read by ``build_results``)
EVALUATION_ROW: Schema = {
    "row": F("list[float|null]", True),
    "retrieval_acc": F("float|null", True),
    "oracle_row": F("list[float|null]|null", True),
}
SIGNATURE: Schema = {"alg": F("str", True), "key_id": F("str", True), "mac": F("hex64", True)}
MANIFEST: Schema = {
    "format": F("str", True),
    "format_version": F("int", True),
    "created": F("str"),
    "updated": F("str"),
    "checksum": F("hex64"),
    "proteus_version": F("str|null"),
    "backbone": F("map", fields=BACKBONE),
    "config": F("map"),
    "split": F("map", fields=SPLIT),
    "evaluation": F("list[map]", items=EVALUATION_ROW),
    "tasks": F("list[map]", True),
    "head": F("map|null", fields=HEAD),
    "signature": F("map", fields=SIGNATURE),
    "sequence": F("count"),
    "kb_id": F("str"),
    "object_bytes": F("map"),
    # format 4 (read back into the fields above by proteus.kb.segments): kept beside them in memory
    "segments": F("list[map]"),
    "num_tasks": F("count"),
    "parent": F("hex64|null"),
}
#: a record segment's reference in a manifest of format 4: its object, and the tasks it holds
SEGMENT_REF: Schema = {
    "object": F("segment", True),
    "sha256": F("hex64", True),
    "bytes": F("count", True),
    "first": F("count", True),
    "count": F("count", True),
    "content": F("hex64", True),
}
#: a manifest of format 4 as it is on disk: the task records and evaluation rows live in record segments
#: (:data:`SEGMENT`), each object's size beside its reference
MANIFEST_V4: Schema = {
    **{k: f for k, f in MANIFEST.items() if k not in ("tasks", "evaluation", "object_bytes", "segments")},
    "segments": F("list[map]", True, items=SEGMENT_REF),
    "num_tasks": F("count", True),
    "sequence": F("count", True),
    "kb_id": F("str", True),
    "parent": F("hex64|null", True),
    "checksum": F("hex64", True),
}
#: a record segment's content (format 4): the records of tasks ``first`` .. ``first + len(tasks) - 1``
#: (each with its object's size, ``bytes``) and their evaluation rows (at most one per task); the records'
#: other fields are checked as the manifest's tasks, by the task's index (:func:`manifest_problems`)
SEGMENT: Schema = {
    "format": F("str", True),
    "first": F("count", True),
    # (each record's object named before the segment is expanded: the sizes are kept by object)
    "tasks": F("list[map]", True, items={"bytes": F("count", True), "object": TASK["object"]}),
    "evaluation": F("list[map]", True, items=EVALUATION_ROW),
}
#: task fields that must have as many items as the first one names
SAME_LENGTH: tuple[tuple[str, str], ...] = (("class_names", "classes"),)


# ---------------------------------------------------------------------------------------------- checks
def head_kind(manifest: dict[str, Any]) -> str | None:
    """The learner that wrote the head: the role of :data:`~proteus.tensor_rules.TENSOR_RULES` whose claim
    recognises the head's meta (``"proteus"``, ``"baseline"``), or None."""
    head = manifest.get("head")
    meta = head.get("meta") if isinstance(head, dict) else None
    return TENSOR_RULES.claimant(meta) if isinstance(meta, dict) else None


def task_label(i: int) -> str:
    """How messages name the task at position ``i`` of the manifest (as :func:`~proteus.kb.files._refs`)."""
    return f"task index {i}"


def _where(i: int) -> str:
    return f"tasks[{i}] ({task_label(i)})"


class ClassOwners:
    """The task holding each class of the kept records that come first (:func:`_kept_owners`), remembered
    from one commit to the next: a commit that keeps the same records (the very objects) extends the map by
    the records kept since, instead of walking every class of a long stream again."""

    def __init__(self) -> None:
        self._records: tuple[Any, ...] = ()
        self._owner: dict[Any, int] = {}

    def of(self, prefix: list[Any]) -> dict[Any, int] | None:
        """Class -> task of ``prefix``, a new map the caller may change; None unless every record is a map
        with a list of classes, those classes distinct (a record remembered is unchanged: the same object,
        kept by the commit because its values are the very objects it was read with). The records remembered
        are those of the last call: the part they share with ``prefix`` is taken from them."""
        n, m = len(self._records), len(prefix)
        owner, start = {}, 0
        if n and all(map(operator.is_, self._records, prefix)):  # (the shorter one's length compared)
            owner, start = dict(self._owner), min(n, m)
            for t in self._records[m:]:  # records remembered beyond the prefix (a segment that changed)
                for c in t["classes"]:
                    owner.pop(c, None)
        added = prefix[start:]
        if not all(isinstance(t, dict) and isinstance(t.get("classes"), list) for t in added):
            return None
        expected = len(owner) + sum(len(t["classes"]) for t in added)
        try:
            for i, t in enumerate(added, start):
                owner.update(zip(t["classes"], itertools.repeat(i)))
        except TypeError:  # an unhashable class: reported by the walk
            return None
        if len(owner) != expected:  # a class in two records
            return None
        self._records, self._owner = tuple(prefix), dict(owner)
        return owner


def _kept_owners(
    tasks: list[Any], kept: Collection[int], cache: ClassOwners | None = None
) -> tuple[dict[Any, int], int]:
    """The task holding each class of the kept records that come first (``kept``: tasks 0 .. m - 1, every
    one a record with a list of classes, those classes distinct), found in one pass (``cache``: from the
    previous commit's, for the records kept since), and m: the records :func:`manifest_problems` still walks
    one by one. (0 and {} when the kept records are not such a prefix, or share a class: then every record is
    walked, and the message names the first conflict.)"""
    m = len(kept)
    if not m or m > len(tasks) or any(i not in kept for i in (0, m - 1)):
        return {}, 0
    if not set(range(m)) <= set(kept):
        return {}, 0
    owner = (cache or ClassOwners()).of(tasks[:m])
    return ({}, 0) if owner is None else (owner, m)


def manifest_problems(
    manifest: dict[str, Any], learner: str | None = None, checked: list[Any] | None = None,
    kept: Collection[int] = frozenset(), owners: ClassOwners | None = None,
) -> list[str]:  # fmt: skip
    """Every way ``manifest`` breaks the schema, as ``"<field>: <problem>"`` (task fields prefixed with
    their position). ``learner`` (a role of :data:`~proteus.tensor_rules.TENSOR_RULES`: a learner's
    ``kb_layout``) applies that learner's field rules and requires its fields whatever the head says
    (:meth:`~proteus.kb.store.KnowledgeBase.read_state`); without it, those of the learner whose head the
    manifest holds (:func:`head_kind`). ``checked``: task records that already passed this check (the
    committed manifest's, a commit re-validates only the records that differ from them at the same
    position) or that sit in a record segment the commit references again (``kept``: the very records it
    was read as or written from, compared by identity): a long stream's commit checks the task it adds and
    the classes of the others, not every record (``owners``: the kept records' classes as the previous
    commit found them, :class:`ClassOwners`)."""
    out = fields_problems(manifest, MANIFEST, "")
    tasks = manifest.get("tasks")
    tasks = tasks if isinstance(tasks, list) else []
    checked = checked or []

    def unchanged(i: int) -> bool:  # the same object may have changed since it was checked, unless kept
        return i in kept or (i < len(checked) and tasks[i] is not checked[i] and tasks[i] == checked[i])

    kind = learner or head_kind(manifest)
    owner, start = _kept_owners(tasks, kept, owners)
    for i, t in enumerate(tasks[start:], start):
        if not isinstance(t, dict):
            continue  # reported above (list[map])
        if i in kept and isinstance(t.get("classes"), list):  # checked: its classes against the others'
            if not owner.keys().isdisjoint(t["classes"]):
                c = next(c for c in t["classes"] if c in owner)
                out.append(f"{_where(i)}.classes: class {c} is also in {task_label(owner[c])}")
            owner.update(dict.fromkeys(t["classes"], i))
            continue
        where = _where(i)
        if not unchanged(i):
            out += fields_problems(t, TASK, where)
        if _is_int(t.get("index")) and t["index"] != i:
            out.append(f"{where}.index: is {t['index']}, but the record is at position {i}")
        for a, b in SAME_LENGTH:
            if isinstance(t.get(a), list) and isinstance(t.get(b), list) and len(t[a]) != len(t[b]):
                out.append(f"{where}.{a}: has {len(t[a])} items, but {b} has {len(t[b])}")
        ref = OBJECT_NAME.fullmatch(t["object"]) if isinstance(t.get("object"), str) else None
        if ref and isinstance(t.get("sha256"), str) and not t["sha256"].startswith(ref["sha"]):
            out.append(f"{where}.object: its name does not carry its sha256 ({t['sha256'][:16]}...)")
        classes = t.get("classes")
        if type_problem(classes, "list[count]") is None and isinstance(classes, list):
            for c in classes:
                if c in owner:
                    first = "earlier in its list" if owner[c] == i else f"also in {task_label(owner[c])}"
                    out.append(f"{where}.classes: class {c} is {first}")
                owner.setdefault(c, i)
    head = manifest.get("head")
    meta = head.get("meta") if isinstance(head, dict) else None
    if isinstance(head, dict):
        ref = OBJECT_NAME.fullmatch(head["object"]) if isinstance(head.get("object"), str) else None
        if ref and isinstance(head.get("sha256"), str) and not head["sha256"].startswith(ref["sha"]):
            out.append(f"head.object: its name does not carry its sha256 ({head['sha256'][:16]}...)")
    if kind is not None:
        out += record_problems(tasks, meta, TENSOR_RULES.rules(kind), kind, _where, unchanged, start)
        if "config" not in manifest:
            out.append(f"config: missing (a {kind} learner's knowledge base needs it)")
        if tasks and not isinstance(head, dict):
            out.append(f"head: missing (a {kind} learner's knowledge base with tasks needs one)")
    elif learner is None and isinstance(manifest.get("config"), dict) and tasks and head is None:
        out.append("head: missing (a learner's knowledge base with tasks needs one)")
    return out


def object_path(
    root: Path, rel: Any, sha: Any = None, dirs: tuple[Path, Path] | None = None, *, segment: bool = False
) -> Path:
    """The path of object ``rel`` of the knowledge base at ``root``, refused (:class:`KBError`, the reason
    without the file) unless ``rel`` is a name the store writes (no ``..``, not absolute; carrying the first
    16 hex digits of ``sha``) and the file, symlinks followed, is inside ``root``'s ``objects/``. The
    returned path is the resolved one: read it with ``O_NOFOLLOW``. ``dirs``: ``root`` and its ``objects/``
    resolved once for many objects (:func:`object_dirs`). ``segment``: a record segment's name
    (:data:`SEGMENT_NAME`), not a tensor object's."""
    pattern, refuse = (SEGMENT_NAME, REFUSALS["segment"]) if segment else (OBJECT_NAME, _refused)
    if not isinstance(rel, str) or pattern.fullmatch(rel) is None:
        raise KBError(refuse(rel))
    suffix = rel.rsplit(".", 1)[1]
    if isinstance(sha, str) and not sha.startswith(rel[-len(suffix) - 17 : -len(suffix) - 1]):
        raise KBError(f"object path {rel!r} refused: its name does not carry its sha256 ({sha[:16]}...)")
    base, objects = object_dirs(root) if dirs is None else dirs
    path = objects / rel.split("/", 1)[1]  # objects/ resolved already; the name is no link: no other step
    link = False
    with contextlib.suppress(OSError):
        link = stat.S_ISLNK(os.lstat(path).st_mode)
    if not _within(objects, base):
        raise KBError(f"object path {rel!r} refused: {root / OBJECTS} resolves to {objects}, outside {base}")
    if link and not (path := path.resolve()).is_relative_to(objects):  # (else a plain name in objects/)
        raise KBError(f"object path {rel!r} refused: it resolves to {path}, outside {objects}")
    return path


@functools.lru_cache(maxsize=64)
def _within(path: Path, base: Path) -> bool:
    """Whether ``path`` lies in ``base`` (both resolved: asked once per knowledge base, not per object)."""
    return path.is_relative_to(base)


def object_dirs(root: Path) -> tuple[Path, Path]:
    """``root`` and its ``objects/``, resolved (symlinks followed), for :func:`object_path`."""
    return root.resolve(), (root / OBJECTS).resolve()


def manifest_issues(path: Path, data: bytes, hint: str) -> tuple[dict[str, Any] | None, list[str]]:
    """Parse a manifest's bytes (:func:`proteus.untrusted.load_json`: duplicate keys, nesting, integer
    size): (the manifest or None when it is no JSON object, every problem found). ``hint`` says what to do
    about an edited or corrupt file."""
    try:
        manifest = load_json(data, str(path))
    except InputError as e:
        return None, [f"{path}: corrupt manifest ({e.reason}); {hint}"]
    except BudgetError as e:
        return None, [f"{e}; {hint}"]
    if not isinstance(manifest, dict):
        return None, [f"{path}: corrupt manifest (a JSON {type(manifest).__name__}, not an object); {hint}"]
    if manifest.get("format") != FORMAT:
        return manifest, [f"{path}: not a proteus knowledge base (format={_shown(manifest.get('format'))})"]
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        return manifest, [
            f"{path}: knowledge base format version {_shown(version)} is not supported by this proteus (it "
            f"reads versions {', '.join(map(str, READABLE_VERSIONS))}); use the proteus release that wrote it"
        ]
    issues = []
    recorded = manifest.get("checksum")
    for since, keys in ((3, V3_KEYS), (4, V4_KEYS)):
        newer = sorted(k for k in keys if k in manifest)
        if version < since and newer:
            issues.append(
                f"{path}: format version {version}, but it holds {', '.join(newer)}, which only version "
                f"{since} writes: the version was lowered by hand (a downgrade); {hint}"
            )
    if version == 1 and recorded is None:
        log.debug("%s: format version 1 (no checksum); it gets one at its next commit", path)
    elif not isinstance(recorded, str):
        issues.append(
            f"{path}: has no checksum, which format version {version} requires: {path.name} was "
            f"edited; {hint}"
        )
    else:
        actual = manifest_checksum(manifest)
        if actual != recorded:
            issues.append(
                f"{path}: checksum mismatch: {path.name} was edited (recorded {recorded[:16]}…, computed "
                f"{actual[:16]}…); {hint}"
            )
    found = segmented_problems(manifest) if version >= 4 else manifest_problems(manifest)
    issues += [f"{path}: {p}; {hint}" for p in found + _size_problems(manifest)]
    return manifest, issues


def segmented_problems(manifest: dict[str, Any]) -> list[str]:
    """Every way a manifest of format 4 as it is on disk breaks :data:`MANIFEST_V4`: its fields, and record
    segments that do not hold tasks 0 .. ``num_tasks`` - 1 in order (the records themselves are checked when
    the segments are read, :mod:`proteus.kb.segments`)."""
    out = fields_problems(manifest, MANIFEST_V4, "")
    out += [f"{k}: format 4 keeps it in the record segments, not in the manifest"
            for k in ("tasks", "evaluation") if k in manifest]  # fmt: skip
    head = manifest.get("head")
    if isinstance(head, dict):
        ref = OBJECT_NAME.fullmatch(head["object"]) if isinstance(head.get("object"), str) else None
        if ref and isinstance(head.get("sha256"), str) and not head["sha256"].startswith(ref["sha"]):
            out.append(f"head.object: its name does not carry its sha256 ({head['sha256'][:16]}...)")
    segments, n = manifest.get("segments"), manifest.get("num_tasks")
    if out or not isinstance(segments, list) or not _is_int(n):
        return out
    first = 0
    for i, ref in enumerate(segments):
        if not isinstance(ref, dict):
            continue
        name = SEGMENT_NAME.fullmatch(ref["object"]) if isinstance(ref.get("object"), str) else None
        if name and not ref["sha256"].startswith(name["sha"]):
            out.append(f"segments[{i}].object: its name does not carry its sha256 ({ref['sha256'][:16]}...)")
        if ref.get("first") != first or not 0 < ref.get("count", 0) <= MAX_SEGMENT_TASKS:
            out.append(
                f"segments[{i}]: holds tasks {ref.get('first')} .. +{ref.get('count')}, but the segments "
                f"must hold the tasks in order, from {first}, at most {MAX_SEGMENT_TASKS} each"
            )
            return out
        first += ref["count"]
    if first != n:
        out.append(f"num_tasks: is {n}, but the record segments hold {first} tasks")
    return out


#: the most task records one record segment may hold (a reader's bound: the writer puts
#: :data:`proteus.kb.segments.SEGMENT_TASKS` in each)
MAX_SEGMENT_TASKS = 4096


def _size_problems(manifest: dict[str, Any]) -> list[str]:
    """``object_bytes`` (format 3): each size an integer >= 0 (an object without one is read as one of
    unknown size: within ``kb_object_bytes``, hashed as a stream before it is read)."""
    sizes = manifest.get("object_bytes")
    if not isinstance(sizes, dict):
        return []
    bad = [(k, v) for k, v in sizes.items() if type_problem(v, "count") is not None]
    out = [f"object_bytes.{_shown(k)}: expected an integer >= 0, got {_shown(v)}" for k, v in bad[:20]]
    total = total_problem(sizes) if not bad else None
    return out + ([total] if total else [])


def total_problem(sizes: dict[str, Any]) -> str | None:
    """What is wrong with the sizes a manifest records for its objects (``sizes``: by object, each
    counted once) taken together: over the budget ``kb_total_bytes``, or None."""
    total = sum(v for v in sizes.values() if _is_int(v))
    return str(over("kb_total_bytes", "its objects", total)) if total > limit("kb_total_bytes") else None


def downgrade_problem(manifest: dict[str, Any], previous: dict[str, Any] | None, path: Path) -> str | None:
    """A manifest at an older format version than the previous commit's (``previous``): every commit writes
    the newest version, so the older one was lowered by hand."""
    if not isinstance(previous, dict):
        return None
    mine, theirs = manifest.get("format_version"), previous.get("format_version")
    if _is_int(mine) and _is_int(theirs) and mine < theirs:
        return (
            f"{path}: format version {mine}, but the previous commit has version {theirs}: the version was "
            "lowered by hand (a downgrade); restore it or manifest.prev.json"
        )
    return None
