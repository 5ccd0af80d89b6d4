"""What is in a knowledge base and what is wrong with it: ``proteus kb info`` and ``proteus kb verify``."""

from __future__ import annotations

import json
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.kb.chain import chain_problems
from proteus.kb.files import (
    _TMP_PREFIXES,
    FIRST_COMMIT,
    FORMAT_VERSION,
    HISTORY,
    MANIFEST,
    OBJECTS,
    PREV_MANIFEST,
    KBError,
    _is_file_error,
    _pid_running,
    _refs,
    _segment_refs,
    _sha,
    _tmp_pid,
    kb_file_kind,
    map_object,
    read_kb_file,
    recorded_size,
)
from proteus.kb.manifests import parse, read_manifest
from proteus.kb.packs import Pack, is_pack
from proteus.kb.schema import downgrade_problem, object_path
from proteus.kb.signing import accept, describe, key_from_env, sequence_problem, signature_problem
from proteus.kb.store import KnowledgeBase
from proteus.kb.tensors import Obj, check_objects, int_totals, nonfinite, parse_header, tensors_of


@dataclass
class Report:
    """What ``proteus kb verify`` found: ``errors`` (the committed state, or the previous one kept for
    ``undo``, is damaged, edited or refused) and ``warnings`` (files no commit needs: temporary files of
    interrupted commits, orphan objects; a previous commit not signed with the key given). The knowledge
    base is valid when ``errors`` is empty."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: the files the warnings name that ``proteus kb gc`` removes, and their bytes
    leftover_bytes: int = 0
    #: what a valid signature vouched for ("signed commit 7 of knowledge base 1a2b3c4d (key id …)"), when
    #: a key was given and the knowledge base is valid
    verified: str | None = None


def problems(root: str | Path, key: bytes | None = None) -> list[str]:
    """Every problem of the knowledge base at ``root`` (an empty list when all is well): the errors of
    :func:`check`, then its warnings. Reads only; never takes the lock."""
    report = check(root, key)
    return report.errors + report.warnings


def check(root: str | Path, key: bytes | None = None) -> Report:
    """Check the knowledge base at ``root``: the manifest (checksum, fields, object paths, the signature
    with ``key`` or ``$PROTEUS_KB_KEY_FILE``'s), every object (present, checksum, safetensors header,
    dtypes, finite values, the shapes of :mod:`proteus.kb.tensors`), the same for the previous commit, and
    the files no commit references. Reads only; never takes the lock."""
    root = Path(root)
    report = Report()
    out = report.errors
    if not root.exists():
        return Report([f"{root}: no knowledge base here (no such directory)"])
    if not root.is_dir():
        return Report([str(_is_file_error(root))])
    if key is None:
        try:
            key = key_from_env()
        except KBError as e:
            out.append(str(e))
    manifest = _current(root, key, out)
    seen: dict[str, Obj | None] = {}
    names: set[str] = set()
    if manifest is not None:
        names = _check_commit(root, manifest, MANIFEST, "", seen, out)
    prev_names: set[str] | None = set()
    kind = kb_file_kind(root, PREV_MANIFEST)
    if kind is not None:
        prev, issues = _parsed(root, PREV_MANIFEST, "the previous commit cannot be restored from it")
        out += issues
        prev_names = None
        if prev is not None:
            prev_names = _check_commit(root, prev, PREV_MANIFEST, f"{PREV_MANIFEST}, ", seen, out)
            if key is not None and not issues:
                problem = signature_problem(root, prev, key, PREV_MANIFEST)
                if problem:
                    report.warnings.append(f"{problem}; `proteus kb undo` with this key refuses it")
            if manifest is not None and manifest.get("format_version") != FORMAT_VERSION:
                problem = downgrade_problem(manifest, prev, root / MANIFEST)
                out += [problem] if problem else []
    if manifest is not None and not out:
        out += chain_problems(root, manifest)
        parent = manifest.get("parent")
        prev_data = read_kb_file(root, PREV_MANIFEST) if isinstance(parent, str) else None
        copy = prev_data == read_kb_file(root, MANIFEST)  # an interrupted commit's first step (warned below)
        if prev_data is not None and _sha(prev_data) != parent and not copy:
            report.warnings.append(
                f"{root / PREV_MANIFEST}: is not the parent manifest.json names (kept in {HISTORY}/): it was "
                "edited or replaced; `proteus kb undo` would restore it as it is now"
            )
    _leftovers(root, manifest, names, prev_names, report)
    if key is not None and manifest is not None and not out:
        problem = accept(manifest, key, root)
        out += [problem] if problem else []
        report.verified = None if problem else describe(manifest, key)
    return report


def _parsed(root: Path, name: str, hint: str) -> tuple[dict[str, Any] | None, list[str]]:
    """Manifest file ``name`` read like every file of the knowledge base and parsed: (it or None, its
    problems; a missing file is one)."""
    try:
        data = read_kb_file(root, name)
    except ProteusError as e:
        return None, [str(e)]
    if data is None:
        return None, [f"{root / name}: missing"]
    return parse(root, name, data, hint)


def _current(root: Path, key: bytes | None, out: list[str]) -> dict[str, Any] | None:
    """manifest.json, parsed and checked into ``out`` (with its signature and sequence under ``key``)."""
    if kb_file_kind(root, MANIFEST) is None:
        try:
            read_manifest(root)
        except ProteusError as e:
            out.append(str(e))
        return None
    manifest, issues = _parsed(root, MANIFEST, "restore it or manifest.prev.json")
    out += issues
    if manifest is not None and key is not None and not issues:
        problem = signature_problem(root, manifest, key) or sequence_problem(root, manifest, key)
        if problem:
            out.append(problem)
    return manifest


def _check_commit(
    root: Path, manifest: dict[str, Any], name: str, prefix: str, seen: dict[str, Obj | None], out: list[str]
) -> set[str]:
    """Check the objects of one commit (``name``: its manifest file) into ``out``; returns their names.
    ``seen`` holds the objects already read (another commit's), by path."""
    names: set[str] = {Path(rel).name for _, rel, _ in _segment_refs(manifest)}
    objects: list[Obj] = []
    found = manifest.get("tasks")
    tasks: list[Any] = found if isinstance(found, list) else []
    head: Any = manifest.get("head")  # a dict where _refs yields "head"
    for label, rel, sha in _refs(manifest):
        try:
            object_path(root, rel, sha)
        except KBError as e:
            out.append(f"{root / name}: {prefix}{label}: {e}")
            continue
        names.add(Path(rel).name)
        if rel not in seen:
            problems, obj = _object_problems(root, rel, sha, recorded_size(manifest, rel), f"{prefix}{label}")
            out += problems
            seen[rel] = obj
        obj = seen[rel]
        if obj is None:
            continue
        if label == "head":
            record, index = head.get("meta") if isinstance(head.get("meta"), dict) else {}, None
        else:
            index = int(label.rsplit(" ", 1)[1])
            record = tasks[index]
        shapes, totals = obj.shapes, obj.totals
        if isinstance(obj.values, _PackValues) and index is not None:  # a task's share of a pack
            found = obj.values.share(record, index)
            if isinstance(found, str):
                out.append(f"{obj.path}: {found} ({prefix}{label})")
                continue
            shapes, totals = found
        objects.append(Obj(f"{prefix}{label}", obj.path, record, index, shapes, totals=totals))
    if all(isinstance(t, dict) for t in tasks):
        out += check_objects(tasks, objects)
    return names


def _object_problems(
    root: Path, rel: str, sha: str, size: int | None, label: str
) -> tuple[list[str], Obj | None]:
    """The problems of one object (missing, size, checksum, header, dtypes, non-finite values) and, when
    its tensors could be read, their shapes for the rules of :mod:`proteus.kb.tensors`."""
    path = root / rel
    try:  # mapped, hashed as a stream: an object's pages are resident only while its values are checked
        data = map_object(root, rel, sha, size)
    except ProteusError as e:
        return [f"{e} ({label})"], None
    try:
        shapes = parse_header(data)
        tensors = tensors_of(data)
    except ValueError as e:
        return [f"{path}: not a valid safetensors file ({e}) ({label})"], None
    pack = None
    if is_pack(rel):  # the tasks' shares are checked one by one (:class:`_PackValues`)
        try:
            pack = Pack(data, where=str(path))
        except ValueError as e:
            return [f"{path}: not a valid pack ({e}) ({label})"], None
    found = [f"{path}: {bad} ({label})" for n, t in tensors.items() if (bad := nonfinite(n, t))]
    totals = None if pack is not None else int_totals(tensors)
    data.madvise(mmap.MADV_DONTNEED)  # its pages leave the process (read again from the file if needed)
    if pack is not None:
        return found, Obj(label, str(path), {}, None, shapes, _PackValues(pack))
    return found, Obj(label, str(path), {}, None, shapes, totals=totals)


class _PackValues(dict[str, Any]):
    """Stands for a pack's values in its :class:`Obj`: each task's share is read by :meth:`share`."""

    def __init__(self, pack: Pack) -> None:
        super().__init__()
        self.pack = pack

    def share(
        self, record: Any, index: int
    ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, int]] | str:
        """The shapes and integer totals of task ``index``'s share, or what is wrong with it."""
        pack, at = self.pack, record.get("index", index) if isinstance(record, dict) else index
        if not isinstance(at, int) or not pack.first <= at < pack.first + pack.count:
            return f"holds tasks {pack.first + 1} .. {pack.first + pack.count}, not task {index + 1}"
        share = pack.task(at - pack.first)
        return share.shapes(), int_totals(share)


def _leftovers(
    root: Path, manifest: dict[str, Any] | None, names: set[str], prev_names: set[str] | None, report: Report
) -> None:
    """Warnings for the files no commit needs (``proteus kb gc`` removes them)."""
    leftover = (
        "left by an interrupted commit (or a failed one); `proteus kb gc` (or the next commit) removes it"
    )

    def warn(p: Path, text: str) -> None:
        report.warnings.append(f"{p}: {text}")
        try:
            report.leftover_bytes += p.lstat().st_size
        except OSError:
            pass

    for p in sorted(root.iterdir()):
        pid = _tmp_pid(p.name)
        if p.name.startswith(_TMP_PREFIXES) and not (pid is not None and _pid_running(pid)):
            warn(p, f"temporary file {leftover}")
        elif p.name == FIRST_COMMIT and manifest is not None:
            warn(p, f"marker of a first commit, {leftover}")
    objects = root / OBJECTS  # a symlinked objects/ is refused by the checks above; its files are not ours
    for p in sorted(objects.iterdir()) if objects.is_dir() and not objects.is_symlink() else []:
        pid = _tmp_pid(p.name)
        if p.name.startswith(".") and ".tmp-" in p.name:
            if not (pid is not None and _pid_running(pid)):
                warn(p, f"temporary file {leftover}")
        elif p.is_dir() and not p.is_symlink():
            report.warnings.append(f"{p}: a directory in {OBJECTS}/, which holds only files (not removed)")
        elif manifest is not None and prev_names is not None and p.name not in names | prev_names:
            warn(p, f"referenced by neither manifest.json nor manifest.prev.json, {leftover}")


def _size(kb: KnowledgeBase, rel: Any) -> int | None:
    if not isinstance(rel, str):
        return None
    if rel in kb.objects.cache:
        return len(kb.objects.cache[rel][1])
    return kb.objects.size(kb.manifest, rel)


def _disk_bytes(root: Path) -> int:
    """The bytes of every file under ``root`` (symlinks counted as themselves, never followed)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _previous_bytes(kb: KnowledgeBase, current: set[str]) -> int:
    """The bytes kept for ``undo`` only: manifest.prev.json and the objects only it references (its record
    segments included)."""
    try:
        data = read_kb_file(kb.root, PREV_MANIFEST)
        prev = kb.previous_manifest(check_signature=False) if data is not None else None
    except ProteusError:
        return 0
    if data is None:
        return 0
    refs = {rel for _, rel, _ in _refs(prev) + _segment_refs(prev)} if isinstance(prev, dict) else set()
    sizes = prev.get("object_bytes") if isinstance(prev, dict) else None
    sizes = sizes if isinstance(sizes, dict) else {}

    def size(rel: str) -> int:
        n = _size(kb, rel)
        return n if n is not None else sizes.get(rel) or 0

    return len(data) + sum(size(rel) for rel in refs - current)


#: the most header bytes :func:`object_shapes` reads
_MAX_HEADER = 16 * 2**20


def object_shapes(kb: KnowledgeBase, rel: Any) -> dict[str, tuple[int, ...]] | None:
    """The shape of each tensor of object ``rel``, from its safetensors header alone (the parts that store
    the tensors say what a shape means). None where the object cannot be read (``kb verify`` says why)."""
    if not isinstance(rel, str):
        return None
    try:
        cached = kb.objects.cache.get(rel)
        if cached is not None:
            data = cached[1]
            n = int.from_bytes(data[:8], "little")
            raw = data[8 : 8 + n]
        else:
            with open(object_path(kb.root, rel), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > _MAX_HEADER:
                    return None
                raw = f.read(n)
        header = json.loads(raw)
    except (OSError, ValueError, KBError):
        return None
    out: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items() if isinstance(header, dict) else ():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            out[name] = tuple(shape)
    return out


def info(kb: KnowledgeBase) -> dict[str, Any]:
    """What the knowledge base holds, for display: format, dates, versions, backbone, method, benchmark,
    per task (0-based ``index``) its classes, size of train set, settings, sizes in bytes (None for a
    missing object); ``total_bytes`` the current state's (manifest and objects), ``previous_bytes`` what
    is kept for ``undo`` only (manifest.prev.json and the objects only it references), ``disk_bytes``
    every file under the directory (leftovers of failed commits included: ``proteus kb gc``);
    ``history_bytes`` the older commits' manifests (``history/``, the chain ``kb verify`` follows);
    ``signature`` its algorithm and key id (``checked``: verified with a key when opened), or None."""
    m = kb.manifest
    cfg = _map(m.get("config"))
    tasks = []
    for i, t in enumerate(m.get("tasks") or []):
        t = _map(t)
        rec: dict[str, Any] = {
            "index": t.get("index", i) if isinstance(t.get("index", i), int) else i,
            "classes": _list(t.get("classes")),
            "class_names": _list(t.get("class_names")),
            "n_train": t.get("n_train"),
        }
        for key in ("settings", "learned", "forgotten"):
            if key in t:
                rec[key] = t[key]
        rec.update(object=t.get("object"), sha256=t.get("sha256"), bytes=_size(kb, t.get("object")))
        tasks.append(rec)
    head = m.get("head")
    head_bytes = _size(kb, head.get("object")) if isinstance(head, dict) else None
    try:
        manifest_bytes = (kb.root / MANIFEST).stat().st_size if kb._on_disk else 0
    except OSError:
        manifest_bytes = 0
    objects = {rel: _size(kb, rel) for _, rel, _ in _refs(m) + _segment_refs(m)}
    total = manifest_bytes + sum(n for n in objects.values() if n is not None)
    sig = m.get("signature")
    return {
        "root": str(kb.root),
        "committed": kb._on_disk,
        "format_version": m.get("format_version"),
        "created": m.get("created"),
        "updated": m.get("updated"),
        "proteus_version": m.get("proteus_version"),
        "backbone": m.get("backbone"),
        "method": cfg.get("method"),
        "backbone_name": _map(cfg.get("backbone")).get("name"),
        "benchmark": _map(m.get("split")).get("benchmark"),
        "num_tasks": len(tasks),
        "tasks": tasks,
        "head_bytes": head_bytes,
        "manifest_bytes": manifest_bytes,
        "total_bytes": total,
        "previous_bytes": _previous_bytes(kb, set(objects)) if kb._on_disk else 0,
        "history_bytes": _disk_bytes(kb.root / HISTORY) if kb._on_disk else 0,
        "disk_bytes": _disk_bytes(kb.root) if kb._on_disk else 0,
        "signature": (
            {"alg": sig.get("alg"), "key_id": sig.get("key_id"), "checked": kb.key is not None}
            if isinstance(sig, dict)
            else None
        ),
    }


def _map(v: Any) -> dict[str, Any]:
    """``v`` when it is a mapping, else ``{}`` (what ``info`` shows of a malformed field)."""
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []
