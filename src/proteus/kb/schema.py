"""What a knowledge base's manifest may hold, as data: the type of every field the code reads
(:data:`MANIFEST`, :data:`TASK`, :data:`HEAD`, ...), the rules between fields (:data:`SAME_LENGTH`,
:data:`LEARNER_FIELDS`, :data:`HEAD_META_KINDS`) and where an object may live (:func:`object_path`).

A manifest is checked when it is opened, before any tensor is read, and by ``proteus kb verify`` and
``proteus kb info``. A field not listed here is allowed (and never read); a listed field must have its
type, and a required one must be present. The learner's own fields (a task's classes, a head's meta) are
required only in a knowledge base whose head a learner wrote (:data:`HEAD_META_KINDS`): the store itself
keeps any records (``tests/test_kb*.py`` build such knowledge bases), while
:meth:`~proteus.kb.store.KnowledgeBase.read_state`, which feeds a learner, requires them always.

Types are strings: an atom of :data:`ATOMS` (``"count"``, ``"hex64"``, ...), ``"list[T]"`` (every item
a ``T``) or alternatives ``"A|B"``; a :class:`F` with ``fields`` checks a mapping's keys in turn.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proteus.budgets import BudgetError
from proteus.kb.files import FORMAT, OBJECTS, READABLE_VERSIONS, V3_KEYS, KBError, manifest_checksum
from proteus.untrusted import InputError, load_json

log = logging.getLogger("proteus")

#: the name :meth:`~proteus.kb.store.KnowledgeBase.write_object` gives an object: its kind, then the first
#: 16 hex digits of its sha256 (so a name is never reused for other bytes)
OBJECT_NAME = re.compile(
    rf"{OBJECTS}/(?P<kind>[A-Za-z0-9][A-Za-z0-9_-]{{0,63}})-(?P<sha>[0-9a-f]{{16}})\.safetensors"
)
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: the largest tensor dimension a manifest may name (an embedding size, a rank)
MAX_DIM = 1 << 24


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: the atoms of the type strings: (test, how a message names it)
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
    "float": (_is_num, "a number"),
    "number": (lambda v: _is_num(v) and math.isfinite(v), "a finite number"),
    "positive": (lambda v: _is_num(v) and math.isfinite(v) and v > 0, "a finite number > 0"),
    "rate": (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "hex64": (lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None, "64 lowercase hex digits"),
    "object": (
        lambda v: isinstance(v, str) and OBJECT_NAME.fullmatch(v) is not None,
        f"an object name {OBJECTS}/<kind>-<16 hex digits>.safetensors",
    ),
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
#: ``TrainStats.from_dict`` passes these as keyword arguments: all of them, nothing else
TRAIN: Schema = {
    "rank": F("count", True),
    "ranks_min": F("count", True),
    "lambda": F("float", True),
    "loss_first": F("float|null", True),
    "loss_last": F("float|null", True),
    "steps": F("count", True),
    "s_mean_abs": F("float|null", True),
    "s_nonzero_frac": F("float|null", True),
}
STATS: Schema = {
    "task": F("count", True),
    "train": F("map|null", fields=TRAIN, closed=True),
    "signature": F("map|null"),
    "gamma": F("float|null"),
    "peak_gpu_mb": F("float|null"),
}
CALIBRATION: Schema = {
    "scores": F("list[float]", True),
    "tpr": F("rate", True),
    "threshold": F("float", True),
}
#: a task's signature (``Signature.from_tensors``)
SIGNATURE_META: Schema = {
    "method": F("str", True),
    "normalize": F("str", True),
    "score": F("str", True),
    "calibrate": F("str", True),
    "calibration": F("list[number]|null"),
    "n_active": F("dim"),
    "d": F("dim"),
    "n_train": F("count"),
    "n_iter": F("count"),
    "converged": F("bool"),
    "storage_dtype": F("str"),
    "lower_bound": F("float|null"),
}
TASK: Schema = {
    "index": F("count", True),
    "object": F("object", True),
    "sha256": F("hex64", True),
    "classes": F("list[count]"),
    "class_names": F("list[str]"),
    "source_classes": F("list[count]|null"),
    "n_train": F("count"),
    "has_adapter": F("bool"),
    "forgotten": F("bool"),
    "learned": F("any"),  # when (a time stamp); only shown, never parsed
    "settings": F("map"),
    "stats": F("map|null", fields=STATS),
    "calibration": F("map|null", fields=CALIBRATION),
    "novelty": F("map|null", fields={"in_stats": F("bool", True), "tpr": F("rate", True)}),
    "signature": F("map|null", fields=SIGNATURE_META),
    "frozen_signature": F("map|null", fields=SIGNATURE_META),
    "expert": F("map", fields={"gamma": F("positive", True)}),
}
#: a RanPAC head's meta (``proteus.heads.persist.load_head_state``), also under ``task_head``
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
    "task_head": F("map|null"),
}
#: a baseline's head meta (``ContinualClassifier.state``)
BASELINE_META: Schema = {"method": F("str", True), "task_classes": F("list[list[count]]", True)}
HEAD: Schema = {"meta": F("map", True), "object": F("object", True), "sha256": F("hex64", True)}
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
}

#: which learner wrote a head, from its meta: (kind, the key that says so, the meta's schema)
HEAD_META_KINDS: tuple[tuple[str, Callable[[dict[str, Any]], bool], Schema], ...] = (
    ("baseline", lambda meta: "task_classes" in meta, BASELINE_META),
    (
        "proteus",
        lambda meta: "embed_dim" in meta or meta.get("format") == "proteus.heads.ranpac",
        RANPAC_META,
    ),
)
#: the task fields each learner reads (``TaskRecord.from_dict``; a baseline's records), and "config"
LEARNER_FIELDS: dict[str, tuple[str, ...]] = {
    "proteus": ("classes", "class_names", "n_train", "has_adapter"),
    "baseline": ("classes", "class_names", "n_train"),
}
#: task fields that must have as many items as the first one names
SAME_LENGTH: tuple[tuple[str, str], ...] = (("class_names", "classes"), ("source_classes", "classes"))


# ---------------------------------------------------------------------------------------------- checks
def type_problem(value: Any, type_: str) -> str | None:
    """None when ``value`` has type ``type_``, else what it should be."""
    options = _split(type_)
    for option in options:
        if option.startswith("list[") and option.endswith("]"):
            if isinstance(value, list) and all(type_problem(v, option[5:-1]) is None for v in value):
                return None
        elif ATOMS[option][0](value):
            return None
    return " or ".join(_describe(o) for o in options)


def _split(type_: str) -> list[str]:
    """``"list[a|b]|null"`` -> ``["list[a|b]", "null"]`` (a ``|`` inside brackets does not split)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(type_):
        depth += (ch == "[") - (ch == "]")
        if ch == "|" and depth == 0:
            out.append(type_[start:i])
            start = i + 1
    return [*out, type_[start:]]


def _describe(option: str) -> str:
    if option.startswith("list["):
        return f"a list of {' or '.join(_describe(o) for o in _split(option[5:-1]))}"
    return ATOMS[option][1]


def _shown(value: Any) -> str:
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


def field_problems(value: Any, f: F, name: str) -> list[str]:
    want = type_problem(value, f.type)
    if want is not None and f.type == "object":
        return [f"{name}: {_refused(value)}"]
    if want is not None:
        return [f"{name}: expected {want}, got {_shown(value)}"]
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


def head_kind(manifest: dict[str, Any]) -> str | None:
    """The learner that wrote the head (a key of :data:`LEARNER_FIELDS`), or None."""
    head = manifest.get("head")
    meta = head.get("meta") if isinstance(head, dict) else None
    if isinstance(meta, dict):
        for kind, says, _ in HEAD_META_KINDS:
            if says(meta):
                return kind
    return None


def task_label(i: int) -> str:
    """How messages name the task at position ``i`` of the manifest (as :func:`~proteus.kb.files._refs`)."""
    return f"task index {i}"


def manifest_problems(
    manifest: dict[str, Any], learner: str | None = None, checked: list[Any] | None = None
) -> list[str]:
    """Every way ``manifest`` breaks the schema, as ``"<field>: <problem>"`` (task fields prefixed with
    their position). ``learner`` (a key of :data:`LEARNER_FIELDS`) requires that learner's fields whatever
    the head says (:meth:`~proteus.kb.store.KnowledgeBase.read_state`). ``checked``: task records that
    already passed this check (the committed manifest's, a commit re-validates only the records that
    differ from them at the same position: a long stream's commit stays flat)."""
    out = fields_problems(manifest, MANIFEST, "")
    tasks = manifest.get("tasks")
    tasks = tasks if isinstance(tasks, list) else []
    checked = checked or []
    kind = learner or head_kind(manifest)
    owner: dict[int, int] = {}
    for i, t in enumerate(tasks):
        if not isinstance(t, dict):
            continue  # reported above (list[map])
        where = f"tasks[{i}] ({task_label(i)})"
        if i >= len(checked) or t is checked[i] or t != checked[i]:  # the same object may have changed
            out += fields_problems(t, TASK, where)
        if _is_int(t.get("index")) and t["index"] != i:
            out.append(f"{where}.index: is {t['index']}, but the record is at position {i}")
        for a, b in SAME_LENGTH:
            if isinstance(t.get(a), list) and isinstance(t.get(b), list) and len(t[a]) != len(t[b]):
                out.append(f"{where}.{a}: has {len(t[a])} items, but {b} has {len(t[b])}")
        for key in LEARNER_FIELDS.get(kind or "", ()):
            if key not in t:
                out.append(f"{where}.{key}: missing (a {kind} learner's task record needs it)")
        ref = OBJECT_NAME.fullmatch(t["object"]) if isinstance(t.get("object"), str) else None
        if ref and isinstance(t.get("sha256"), str) and not t["sha256"].startswith(ref["sha"]):
            out.append(f"{where}.object: its name does not carry its sha256 ({t['sha256'][:16]}...)")
        classes = t.get("classes")
        if type_problem(classes, "list[count]") is None:
            for c in classes:
                if c in owner:
                    first = "earlier in its list" if owner[c] == i else f"also in {task_label(owner[c])}"
                    out.append(f"{where}.classes: class {c} is {first}")
                owner.setdefault(c, i)
    head = manifest.get("head")
    if isinstance(head, dict):
        ref = OBJECT_NAME.fullmatch(head["object"]) if isinstance(head.get("object"), str) else None
        if ref and isinstance(head.get("sha256"), str) and not head["sha256"].startswith(ref["sha"]):
            out.append(f"head.object: its name does not carry its sha256 ({head['sha256'][:16]}...)")
        meta = head.get("meta")
        for k, _, schema in HEAD_META_KINDS if isinstance(meta, dict) else ():
            if k == kind:
                out += fields_problems(meta, schema, "head.meta")
                if (
                    k == "proteus"
                    and isinstance(meta.get("task_head"), dict)
                    and "embed_dim" in meta["task_head"]
                ):
                    out += fields_problems(meta["task_head"], RANPAC_META, "head.meta.task_head")
        if kind == "baseline" and isinstance(meta, dict) and isinstance(meta.get("task_classes"), list):
            if meta["task_classes"] != [t.get("classes") if isinstance(t, dict) else None for t in tasks]:
                out.append("head.meta.task_classes: differs from the tasks' classes")
    if kind is not None:
        if "config" not in manifest:
            out.append(f"config: missing (a {kind} learner's knowledge base needs it)")
        if tasks and not isinstance(head, dict):
            out.append(f"head: missing (a {kind} learner's knowledge base with tasks needs one)")
    elif learner is None and isinstance(manifest.get("config"), dict) and tasks and head is None:
        out.append("head: missing (a learner's knowledge base with tasks needs one)")
    return out


def _refused(rel: Any) -> str:
    return (
        f"object path {_shown(rel)} refused: not a name this proteus writes "
        f"({OBJECTS}/<kind>-<16 hex digits>.safetensors: no '..', not absolute)"
    )


def object_path(root: Path, rel: Any, sha: Any = None) -> Path:
    """The path of object ``rel`` of the knowledge base at ``root``, refused (:class:`KBError`, the reason
    without the file) unless ``rel`` is a name the store writes (no ``..``, not absolute; carrying the first
    16 hex digits of ``sha``) and the file, symlinks followed, is inside ``root``'s ``objects/``. The
    returned path is the resolved one: read it with ``O_NOFOLLOW``."""
    if not isinstance(rel, str) or OBJECT_NAME.fullmatch(rel) is None:
        raise KBError(_refused(rel))
    if isinstance(sha, str) and not sha.startswith(rel[-len(".safetensors") - 16 : -len(".safetensors")]):
        raise KBError(f"object path {rel!r} refused: its name does not carry its sha256 ({sha[:16]}...)")
    base = root.resolve()
    objects = (root / OBJECTS).resolve()
    path = (root / rel).resolve()
    if not objects.is_relative_to(base):
        raise KBError(f"object path {rel!r} refused: {root / OBJECTS} resolves to {objects}, outside {base}")
    if not path.is_relative_to(objects):
        raise KBError(f"object path {rel!r} refused: it resolves to {path}, outside {objects}")
    return path


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
    newer = sorted(k for k in V3_KEYS if k in manifest)
    if version < 3 and newer:
        issues.append(
            f"{path}: format version {version}, but it holds {', '.join(newer)}, which only version 3 "
            f"writes: the version was lowered by hand (a downgrade); {hint}"
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
    issues += [f"{path}: {p}; {hint}" for p in manifest_problems(manifest) + _size_problems(manifest)]
    return manifest, issues


def _size_problems(manifest: dict[str, Any]) -> list[str]:
    """``object_bytes`` (format 3): each size an integer >= 0 (an object without one is read as one of
    unknown size: within ``kb_object_bytes``, hashed as a stream before it is read)."""
    sizes = manifest.get("object_bytes")
    if not isinstance(sizes, dict):
        return []
    bad = [(k, v) for k, v in sizes.items() if type_problem(v, "count") is not None]
    return [f"object_bytes.{_shown(k)}: expected an integer >= 0, got {_shown(v)}" for k, v in bad[:20]]


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
