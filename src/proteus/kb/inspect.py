"""What is in a knowledge base and what is wrong with it: ``proteus kb info`` and ``proteus kb verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load

from proteus.kb.files import (
    _TMP_PREFIXES,
    FIRST_COMMIT,
    MANIFEST,
    OBJECTS,
    PREV_MANIFEST,
    KBError,
    _is_file_error,
    _manifest_issues,
    _pid_running,
    _refs,
    _sha,
    _tmp_pid,
)
from proteus.kb.store import KnowledgeBase


def problems(root: str | Path) -> list[str]:
    """Every problem of the knowledge base at ``root`` (an empty list when all is well): manifest
    unreadable or edited, each object missing, edited or not valid safetensors, the same for the previous
    commit, and files left by interrupted commits. Reads only; never takes the lock."""
    root = Path(root)
    if not root.exists():
        return [f"{root}: no knowledge base here (no such directory)"]
    if not root.is_dir():
        return [str(_is_file_error(root))]
    out: list[str] = []
    try:
        data = (root / MANIFEST).read_bytes()
    except OSError:
        data = None
    manifest = None
    if data is None:
        try:
            KnowledgeBase._read_manifest(root)
        except KBError as e:
            out.append(str(e))
    else:
        manifest, issues = _manifest_issues(root / MANIFEST, data, "restore it or manifest.prev.json")
        out += issues
    names: set[str] = set()
    for label, rel, sha in _refs(manifest) if manifest else []:
        names.add(Path(rel).name)
        out += _object_problems(root, rel, sha, label)
    prev_path = root / PREV_MANIFEST
    prev_names: set[str] | None = set()
    if prev_path.is_file():
        prev, issues = _manifest_issues(
            prev_path, prev_path.read_bytes(), "the previous commit cannot be restored from it"
        )
        out += issues
        prev_names = None if prev is None else set()
        for label, rel, sha in _refs(prev) if prev else []:
            assert prev_names is not None
            prev_names.add(Path(rel).name)
            if Path(rel).name not in names:
                out += _object_problems(root, rel, sha, f"{PREV_MANIFEST}, {label}")
    leftover = "left by an interrupted commit; the next commit removes it"
    for p in sorted(root.iterdir()):
        pid = _tmp_pid(p.name)
        if p.name.startswith(_TMP_PREFIXES) and not (pid is not None and _pid_running(pid)):
            out.append(f"{p}: temporary file {leftover}")
        elif p.name == FIRST_COMMIT and manifest is not None:
            out.append(f"{p}: marker of a first commit, {leftover}")
    objects = root / OBJECTS
    for p in sorted(objects.iterdir()) if objects.is_dir() else []:
        pid = _tmp_pid(p.name)
        if p.name.startswith(".") and ".tmp-" in p.name:
            if not (pid is not None and _pid_running(pid)):
                out.append(f"{p}: temporary file {leftover}")
        elif manifest is not None and prev_names is not None and p.name not in names | prev_names:
            out.append(f"{p}: referenced by neither manifest.json nor manifest.prev.json, {leftover}")
    return out


def _object_problems(root: Path, rel: str, sha: str, label: str) -> list[str]:
    path = root / rel
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [f"{path}: missing from the knowledge base ({label})"]
    except OSError as e:
        return [f"{path}: unreadable ({e.strerror}) ({label})"]
    actual = _sha(data)
    if actual != sha:
        return [
            f"{path}: checksum mismatch (expected {sha[:16]}…, found {actual[:16]}…): the file was "
            f"truncated or edited ({label})"
        ]
    try:
        st_load(data)
    except Exception as e:  # safetensors raises several types for bad headers
        return [f"{path}: not a valid safetensors file ({e}) ({label})"]
    return []


def _size(kb: KnowledgeBase, rel: str | None) -> int | None:
    if rel is None:
        return None
    if rel in kb._pending:
        return len(kb._pending[rel])
    if rel in kb._cache:
        return len(kb._cache[rel][1])
    try:
        return (kb.root / rel).stat().st_size
    except OSError:
        return None


def info(kb: KnowledgeBase) -> dict[str, Any]:
    """What the knowledge base holds, for display: format, dates, versions, backbone, method, benchmark,
    per task (0-based ``index``) its classes, size of train set, settings and sizes in bytes (None for a
    missing object)."""
    m = kb.manifest
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    tasks = []
    for i, t in enumerate(m.get("tasks") or []):
        rec: dict[str, Any] = {
            "index": t.get("index", i),
            "classes": t.get("classes", []),
            "class_names": t.get("class_names", []),
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
    objects = {rel: _size(kb, rel) for _, rel, _ in _refs(m)}
    return {
        "root": str(kb.root),
        "committed": kb._on_disk,
        "format_version": m.get("format_version"),
        "created": m.get("created"),
        "updated": m.get("updated"),
        "proteus_version": m.get("proteus_version"),
        "backbone": m.get("backbone"),
        "method": cfg.get("method"),
        "backbone_name": (cfg.get("backbone") or {}).get("name"),
        "benchmark": (m.get("split") or {}).get("benchmark"),
        "num_tasks": len(tasks),
        "tasks": tasks,
        "head_bytes": head_bytes,
        "manifest_bytes": manifest_bytes,
        "total_bytes": manifest_bytes + sum(n for n in objects.values() if n is not None),
    }
