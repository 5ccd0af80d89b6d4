"""The history of a knowledge base as a hash chain (format 4).

Every manifest of format 4 names its parent -- the manifest it replaced -- by the sha256 of its bytes
(``parent``; None for the first commit). The parent is ``manifest.prev.json`` (kept for ``undo`` and for
readers of the previous state); every committed manifest, the current one included, is kept in
``history/<sha256>.json`` (a copy of its bytes). A commit's
sequence number is its parent's plus one. Since a signature covers the ``parent`` field, signing the head of
the chain vouches for the whole history: a signed state put back over a newer one leaves the newer one in
``history/`` (``kb verify`` names it) and has a sequence below what the key accepted
(:func:`~proteus.kb.signing.sequence_problem`), and a different history with the same sequence is not the
one the key accepted (its hash differs).

:func:`walk` follows the chain back from a manifest; :func:`chain_problems` is what ``kb verify`` reports
about it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.kb.files import (
    HISTORY,
    PREV_MANIFEST,
    KBError,
    _atomic_write,
    _sha,
    read_kb_file,
)
from proteus.untrusted import load_json

__all__ = ["chain_problems", "history_name", "keep_in_history", "walk"]


def history_name(sha: str) -> str:
    """Where the manifest whose bytes have sha256 ``sha`` is kept once it leaves manifest.prev.json."""
    return f"{HISTORY}/{sha}.json"


def keep_in_history(root: Path, data: bytes) -> None:
    """Keep ``data``, the bytes of a committed manifest, in ``history/`` (a copy: a link would share the file
    with manifest.json, which a hand copied over it would change too); nothing when it is kept already.
    Every commit keeps the manifest it replaces (kept already, unless an older proteus or a crash left it
    out) and, once it landed, its own, so that ``history/`` holds every commit: a newer one outlives a
    rollback."""
    target = root / history_name(_sha(data))
    if target.exists():
        return
    try:
        (root / HISTORY).mkdir(exist_ok=True)
    except OSError as e:
        raise KBError(f"{root / HISTORY}: cannot be created ({e.strerror or e})") from None
    _atomic_write(target, data)


def _read(root: Path, sha: str) -> tuple[str, bytes] | None:
    """The bytes of the manifest with sha256 ``sha`` (manifest.prev.json, else ``history/``) and the file
    they came from; None when neither holds them."""
    data = read_kb_file(root, PREV_MANIFEST)
    if data is not None and _sha(data) == sha:
        return PREV_MANIFEST, data
    name = history_name(sha)
    data = read_kb_file(root / HISTORY, name.split("/", 1)[1])
    if data is None:
        return None
    if _sha(data) != sha:
        raise KBError(f"{root / name}: its sha256 is not its name: the kept commit was edited")
    return name, data


def _sequence(manifest: dict[str, Any]) -> int | None:
    n = manifest.get("sequence")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def walk(root: Path, manifest: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """The ancestors of ``manifest`` (nearest first): (file, sha256 of its bytes, the manifest as parsed);
    stops at a manifest without a parent. A :class:`KBError` names a missing, edited or unreadable link."""
    seen: set[str] = set()
    child, where = manifest, "manifest.json"
    while True:
        parent = child.get("parent")
        if not isinstance(parent, str):
            return
        if parent in seen:
            raise KBError(
                f"{root}: {where} names a parent that is its own descendant (a cycle in the history)"
            )
        seen.add(parent)
        found = _read(root, parent)
        if found is None and where == "manifest.json" and (root / PREV_MANIFEST).exists():
            raise KBError(
                f"{root / PREV_MANIFEST}: is not the parent manifest.json names (sha256 {parent[:16]}…), and "
                f"{HISTORY}/ does not hold that one: the previous commit was edited or replaced"
            )
        if found is None:
            raise KBError(
                f"{root / history_name(parent)}: missing: {where} (commit {_sequence(child)}) names it as "
                "its parent; the history of the knowledge base is broken there"
            )
        name, data = found
        try:
            parsed = load_json(data, str(root / name))
        except ProteusError as e:
            raise KBError(f"{root / name}: cannot be read as a manifest ({e})") from None
        if not isinstance(parsed, dict):
            raise KBError(f"{root / name}: not a manifest (a JSON {type(parsed).__name__})")
        seq, child_seq = _sequence(parsed), _sequence(child)
        if seq is not None and child_seq is not None and seq != child_seq - 1:
            raise KBError(
                f"{root / name}: is commit {seq}, but its child {where} is commit {child_seq} (a parent is "
                "the commit just before)"
            )
        if parsed.get("kb_id") != child.get("kb_id"):
            raise KBError(f"{root / name}: belongs to another knowledge base than its child {where}")
        yield name, parent, parsed
        child, where = parsed, name


def ancestor(root: Path, manifest: dict[str, Any], sequence: int) -> str | None:
    """The sha256 of the manifest of commit ``sequence`` on ``manifest``'s chain (None when the chain does not
    reach it); a broken chain raises :class:`KBError`."""
    for _, sha, parsed in walk(root, manifest):
        seq = _sequence(parsed)
        if seq == sequence:
            return sha
        if seq is not None and seq < sequence:
            return None
    return None


def chain_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """What ``kb verify`` reports about the history of ``manifest`` (manifest.json): a broken chain, and a
    commit kept in the knowledge base that is newer than manifest.json (an older state was put back)."""
    out: list[str] = []
    on_chain = set()
    try:
        for name, _, _ in walk(root, manifest):
            on_chain.add(Path(name).name)
    except KBError as e:
        out.append(str(e))
    seq, kb_id = _sequence(manifest), manifest.get("kb_id")
    current = read_kb_file(root, "manifest.json")
    if seq is None:
        return out
    candidates = [(PREV_MANIFEST, root)]
    history = root / HISTORY
    if history.is_dir() and not history.is_symlink():
        candidates += [(p.name, history) for p in sorted(history.iterdir()) if p.name.endswith(".json")]
    for name, where in candidates:
        try:
            data = read_kb_file(where, name)
            other = load_json(data, str(where / name)) if data is not None and data != current else None
        except ProteusError:
            continue  # (a copy of manifest.json: an interrupted commit's first step, which undoes itself)
        if not isinstance(other, dict) or other.get("kb_id") != kb_id:
            continue
        n = _sequence(other)
        if n is not None and n > seq:  # (the same sequence: the same commit before `kb sign` rewrote it)
            out.append(
                f"{root}: rollback: manifest.json is commit {seq}, but {where / name} is commit {n} of the "
                "same knowledge base: an older state was put back over a newer one"
            )
    return out
