"""Reading a knowledge base's manifests: ``manifest.json`` (:func:`read_manifest`) and ``manifest.prev.json``
(:func:`previous_manifest`), each read like every file of a knowledge base
(:func:`~proteus.kb.files.read_kb_file`: inside it, no symbolic link, no FIFO, within
``kb_manifest_bytes``), parsed within the JSON budgets and checked
(:func:`~proteus.kb.schema.manifest_issues`: checksum, fields, a lowered format version), with every object
path confined to ``objects/`` before any object is opened. A manifest of format 4 is returned expanded
(:mod:`.segments`): its record segments read, verified and checked, their records in ``tasks`` as in formats
1-3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.kb.files import (
    FORMAT_VERSION,
    HISTORY,
    MANIFEST,
    PREV_MANIFEST,
    KBError,
    _damaged,
    _interrupted_first_commit,
    _is_file_error,
    _kb_files,
    _MissingObject,
    _refs,
    _segment_refs,
    _shown,
    read_kb_file,
    read_object,
)
from proteus.kb.schema import downgrade_problem, manifest_issues, manifest_problems, object_dirs, object_path
from proteus.kb.segments import Segments
from proteus.kb.signing import signature_problem
from proteus.kb.verified import Verified, state_key
from proteus.untrusted import load_json


def segmented(manifest: dict[str, Any]) -> bool:
    """Whether ``manifest`` is of format 4 or later (its records in segments)."""
    v = manifest.get("format_version")
    return isinstance(v, int) and not isinstance(v, bool) and v >= 4


def read_segment(root: Path, rel: str, sha: str, size: int, dirs: tuple[Path, Path] | None = None) -> bytes:
    """The verified bytes of record segment ``rel`` (its path confined like an object's, its size and sha256
    checked, within ``kb_manifest_bytes``); ``dirs``: :func:`~proteus.kb.schema.object_dirs` of ``root``,
    resolved once for many segments."""
    object_path(root, rel, sha, dirs, segment=True)
    return read_object(root, rel, sha, size, budget="kb_manifest_bytes")


def parse(
    root: Path, name: str, data: bytes, hint: str, segments: Segments | None = None,
    verified: Verified | None = None, *, raise_missing: bool = False,
) -> tuple[dict[str, Any] | None, list[str]]:  # fmt: skip
    """Manifest file ``name``'s bytes parsed and checked: (the manifest, expanded when it is of format 4, or
    None; every problem found). ``verified``: the store's record (:mod:`.verified`); a state whose fields
    it passed before is not checked again. ``raise_missing``: a record segment missing from disk is raised
    (:class:`~proteus.kb.files._MissingObject`, for a reader to retry: a commit may have swept it since the
    manifest was read), not returned as a problem."""
    path = root / name
    manifest, issues = manifest_issues(path, data, hint)
    if issues or manifest is None or not segmented(manifest):
        return manifest, issues
    try:
        dirs = object_dirs(root)  # (resolved once: a long stream's manifest names many segments)
        for _, rel, sha in _segment_refs(manifest):
            object_path(root, rel, sha, dirs, segment=True)
        expanded = (segments or Segments()).expand(
            manifest, lambda r, s, n: read_segment(root, r, s, n, dirs), str(path), verified
        )
    except ProteusError as e:
        problem = f"{e}" if str(path) in str(e) else f"{path}: {e}"
        if raise_missing and isinstance(e, _MissingObject):
            raise _MissingObject(problem) from None
        return manifest, [problem]
    key = state_key(expanded, "")  # the fields every manifest must have, whatever the learner
    if verified is not None and verified.checked(key):
        return expanded, []
    problems = [f"{path}: {p}; {hint}" for p in manifest_problems(expanded)]
    if verified is not None and not problems:
        verified.check(key)
    return expanded, problems


def read_manifest(
    root: Path, segments: Segments | None = None, verified: Verified | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The bytes and the parsed, checked ``manifest.json`` of the knowledge base at ``root`` (expanded when it
    is of format 4: ``segments`` keeps what it read; ``verified``: :func:`parse`); a :class:`KBError` (or a
    :class:`~proteus.budgets.BudgetError`) naming the file and what to do (a :class:`_MissingObject`
    holding the manifest's bytes for a record segment missing from disk)."""
    path = root / MANIFEST
    if root.exists() and not root.is_dir():
        raise _is_file_error(root)
    data = read_kb_file(root, MANIFEST)
    if data is None:
        files = _kb_files(root)
        if files and _interrupted_first_commit(root, files):
            raise KBError(
                f"{root}: no knowledge base here: its first commit was interrupted (files "
                f"{_shown(files)}); learn its first task again, or choose another --kb"
            )
        if files:
            raise _damaged(root, files, "the knowledge base cannot be opened")
        raise KBError(f"{root}: no knowledge base here (missing {MANIFEST})")
    try:
        manifest, issues = parse(
            root, MANIFEST, data, "restore it or manifest.prev.json", segments, verified, raise_missing=True
        )
    except _MissingObject as e:
        e.manifest = data
        raise
    if not issues and manifest is not None and manifest.get("format_version") != FORMAT_VERSION:
        problem = downgrade_problem(manifest, previous_or_none(root), path)
        if problem is None and (root / HISTORY).is_dir() and not segmented(manifest):
            problem = (
                f"{path}: format version {manifest.get('format_version')}, but the knowledge base keeps a "
                f"history of format {FORMAT_VERSION} commits: the version was lowered by hand (a downgrade); "
                "restore it or manifest.prev.json"
            )
        issues = [problem] if problem else []
    if issues:
        raise KBError(issues[0])
    assert manifest is not None
    check_paths(root, manifest, path)
    return data, manifest


def check_paths(root: Path, manifest: dict[str, Any], path: Path) -> None:
    """Refuse a manifest (file ``path``) naming an object outside ``root``'s ``objects/``."""
    dirs = object_dirs(root)
    seen: set[tuple[str, str]] = set()
    for label, rel, sha in _refs(manifest):
        if (rel, sha) in seen:  # (the tasks of a pack share its object)
            continue
        seen.add((rel, sha))
        try:
            object_path(root, rel, sha, dirs)
        except KBError as e:
            raise KBError(f"{path}: {label}: {e}") from None


def previous_manifest(
    root: Path, key: bytes | None = None, segments: Segments | None = None
) -> dict[str, Any]:
    """``manifest.prev.json``, checked like the current one (expanded when it is of format 4; its signature
    too, with ``key``: an undo must not sign what nobody signed)."""
    path = root / PREV_MANIFEST
    data = read_kb_file(root, PREV_MANIFEST)
    if data is None:
        raise KBError(f"{root}: no previous commit to go back to (no {PREV_MANIFEST})")
    manifest, issues = parse(
        root, PREV_MANIFEST, data, "the previous commit cannot be restored from it", segments
    )
    if issues or manifest is None:
        raise KBError(issues[0] if issues else f"{path}: not a manifest")
    check_paths(root, manifest, path)
    if key is not None:
        problem = signature_problem(root, manifest, key, PREV_MANIFEST)
        if problem:
            raise KBError(f"{problem}; the previous commit is not restored")
    return manifest


def previous_or_none(root: Path) -> dict[str, Any] | None:
    """manifest.prev.json parsed (not expanded), or None when it is missing or cannot be used (for the
    downgrade rule)."""
    try:
        data = read_kb_file(root, PREV_MANIFEST)
        prev = load_json(data, PREV_MANIFEST) if data is not None else None
    except ProteusError:
        return None
    return prev if isinstance(prev, dict) else None
