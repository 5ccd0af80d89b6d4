"""Reading a knowledge base's manifests: ``manifest.json`` (:func:`read_manifest`) and
``manifest.prev.json`` (:func:`previous_manifest`), each read like every file of a knowledge base
(:func:`~proteus.kb.files.read_kb_file`: inside it, no symbolic link, no FIFO, within
``kb_manifest_bytes``), parsed within the JSON budgets and
checked (:func:`~proteus.kb.schema.manifest_issues`: checksum, fields, a lowered format version), with
every object path confined to ``objects/`` before any object is opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.kb.files import (
    FORMAT_VERSION,
    MANIFEST,
    PREV_MANIFEST,
    KBError,
    _damaged,
    _interrupted_first_commit,
    _is_file_error,
    _kb_files,
    _refs,
    _shown,
    read_kb_file,
)
from proteus.kb.schema import downgrade_problem, manifest_issues, object_path
from proteus.kb.signing import signature_problem
from proteus.untrusted import load_json


def read_manifest(root: Path) -> tuple[bytes, dict[str, Any]]:
    """The bytes and the parsed, checked ``manifest.json`` of the knowledge base at ``root``; a
    :class:`KBError` (or a :class:`~proteus.budgets.BudgetError`) naming the file and what to do."""
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
    manifest, issues = manifest_issues(path, data, "restore it or manifest.prev.json")
    if not issues and manifest is not None and manifest.get("format_version") != FORMAT_VERSION:
        problem = downgrade_problem(manifest, previous_or_none(root), path)
        issues = [problem] if problem else []
    if issues:
        raise KBError(issues[0])
    assert manifest is not None
    check_paths(root, manifest, path)
    return data, manifest


def check_paths(root: Path, manifest: dict[str, Any], path: Path) -> None:
    """Refuse a manifest (file ``path``) naming an object outside ``root``'s ``objects/``."""
    for label, rel, sha in _refs(manifest):
        try:
            object_path(root, rel, sha)
        except KBError as e:
            raise KBError(f"{path}: {label}: {e}") from None


def previous_manifest(root: Path, key: bytes | None = None) -> dict[str, Any]:
    """``manifest.prev.json``, checked like the current one (its signature too, with ``key``: an undo must
    not sign what nobody signed)."""
    path = root / PREV_MANIFEST
    data = read_kb_file(root, PREV_MANIFEST)
    if data is None:
        raise KBError(f"{root}: no previous commit to go back to (no {PREV_MANIFEST})")
    manifest, issues = manifest_issues(path, data, "the previous commit cannot be restored from it")
    if issues or manifest is None:
        raise KBError(issues[0] if issues else f"{path}: not a manifest")
    check_paths(root, manifest, path)
    if key is not None:
        problem = signature_problem(root, manifest, key, PREV_MANIFEST)
        if problem:
            raise KBError(f"{problem}; the previous commit is not restored")
    return manifest


def previous_or_none(root: Path) -> dict[str, Any] | None:
    """manifest.prev.json parsed, or None when it is missing or cannot be used (for the downgrade rule)."""
    try:
        data = read_kb_file(root, PREV_MANIFEST)
        prev = load_json(data, PREV_MANIFEST) if data is not None else None
    except ProteusError:
        return None
    return prev if isinstance(prev, dict) else None
