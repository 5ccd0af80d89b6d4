"""Garbage collection of a knowledge base: the files neither the current nor the previous commit needs (orphan
objects, temporary files of interrupted commits, the marker of a first commit) are removed by a writer
holding the lock, at the end of every commit and by ``proteus kb gc``."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from proteus.errors import ProteusError
from proteus.kb.files import (
    _TMP_PREFIXES,
    FIRST_COMMIT,
    HISTORY,
    MANIFEST,
    OBJECTS,
    PREV_MANIFEST,
    _object_names,
    _pid_running,
    _tmp_pid,
    log,
    read_kb_file,
)
from proteus.untrusted import load_json


def restore_kept(root: Path) -> bool:
    """Put back a manifest.prev.json that a failed commit could not restore: its hard link
    (:func:`~proteus.kb.files.kept_name`, left only when the rename back failed) replaces manifest.prev.json
    when that is now a copy of manifest.json (the failed commit's first step); otherwise it is stale and
    removed. Returns whether manifest.prev.json was put back."""
    restored = False
    for p in sorted(root.glob(f".{PREV_MANIFEST}.tmp-*.kept")):
        pid = _tmp_pid(p.name)
        if pid is not None and pid != os.getpid() and _pid_running(pid):
            continue  # another process's commit in progress (it holds the lock: not while we sweep)
        try:
            copy = read_kb_file(root, PREV_MANIFEST) == read_kb_file(root, MANIFEST)
        except (OSError, ProteusError):
            continue
        with contextlib.suppress(OSError):
            if copy:
                os.replace(p, root / PREV_MANIFEST)
                restored = True
                log.warning(
                    "%s: put back the previous commit a failed commit had replaced", root / PREV_MANIFEST
                )
            os.unlink(p)  # stale, or left by a rename onto the same file
    return restored


def previous_names(root: Path) -> set[str] | None:
    """Names of the objects manifest.prev.json references, its record segments' tasks included (an empty set
    when there is none; None when it cannot be read: a FIFO, a link, too large, not JSON, a segment that
    cannot be read ...)."""
    from proteus.kb.manifests import read_segment, segmented
    from proteus.kb.segments import expand

    try:
        data = read_kb_file(root, PREV_MANIFEST)
        if data is None:
            return set()
        prev = load_json(data, str(root / PREV_MANIFEST))
        if isinstance(prev, dict) and segmented(prev) and isinstance(prev.get("segments"), list):
            prev = expand(prev, lambda r, s, n: read_segment(root, r, s, n), str(root / PREV_MANIFEST))
    except (OSError, ProteusError, KeyError, TypeError):
        return None
    return _object_names(prev) if isinstance(prev, dict) else None


def sweep(
    root: Path, keep: set[str], previous: set[str] | None = None, history: bool = False
) -> list[tuple[Path, int]]:
    """Delete the objects whose names are neither in ``keep`` (the current commit's) nor referenced by
    manifest.prev.json, and the temporary files of interrupted commits; returns each file removed with its
    size. Directories and symlinks' targets are never touched (a symlink itself is removed); an unreadable
    manifest.prev.json keeps every object. ``previous``: the names manifest.prev.json references, known
    to a commit that just wrote it (read from the file when None, or when a kept copy was put back).
    ``history``: also the temporary files of interrupted copies into ``history/`` (``kb gc``)."""
    if restore_kept(root) or previous is None:
        previous = previous_names(root)
    if previous is None:
        log.warning("%s: unreadable; no object is swept until the next commit", root / PREV_MANIFEST)
    else:
        keep = keep | previous
    removed: list[tuple[Path, int]] = []

    def remove(p: Path) -> None:
        try:
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode):
                return
            p.unlink()
        except OSError:
            return
        removed.append((p, st.st_size))

    objects = root / OBJECTS
    for name in _names(objects):
        temporary = name.startswith(".") and ".tmp-" in name
        if temporary or (previous is not None and name not in keep):
            remove(objects / name)
    for name in _names(root):
        if name.startswith(_TMP_PREFIXES) or name == FIRST_COMMIT:
            remove(root / name)
    for name in _names(root / HISTORY) if history else []:
        if name.startswith(".") and ".tmp-" in name:
            remove(root / HISTORY / name)
    return removed


def _names(folder: Path) -> list[str]:
    """The names in ``folder`` (sorted; none when it is not a directory, or a symbolic link to one)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    with os.scandir(folder) as it:
        return sorted(e.name for e in it)
