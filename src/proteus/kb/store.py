"""The knowledge base (KB) of Algorithm 1: per task a value (the adapter) and a multi-key (the signature),
plus the head's statistics G and e(c). It is the only memory of data that no longer exists.

On disk::

    kb/manifest.json                     the commit point (JSON, no pickle)
    kb/manifest.prev.json                the previous commit's manifest (kept for readers and for undo)
    kb/objects/<kind>-<sha256[:16]>.safetensors   content-addressed tensor files
    kb/.lock                             the writers' lock (not part of the knowledge base)

A commit writes the new objects first (temporary name, fsync, rename), copies the current manifest to
``manifest.prev.json`` (atomically), then writes the new manifest to a temporary name, fsyncs it, and renames
it over ``manifest.json`` (atomic on POSIX), then fsyncs the directory. Objects are never overwritten (their
names carry their hash), so a process killed at any moment leaves either the old manifest with all its
objects, or the new one. After the rename, files referenced neither by the new manifest nor by the previous
one (``manifest.prev.json``) are swept, with the temporary files of interrupted commits: a reader that opened
the previous state while the commit ran still finds every file it needs.

Integrity: every object's sha256 is recorded in the manifest and verified when it is read (a truncated or
edited file is detected, never loaded), and the manifest carries ``checksum``, the sha256 of its canonical
JSON (sorted keys, no whitespace) without the keys ``checksum``, ``created`` and ``updated`` (timestamps
change no prediction, and leaving them out gives two identical runs the same checksum). Format version 2 has
the checksum; version 1 manifests (no checksum) are still read and get one at their next commit.

Concurrency: one writer at a time, by :func:`write_lock` (``fcntl.flock`` on ``.lock``; a lock of a killed
process is released by the kernel and taken over, with a log line). Readers never take the lock:
``KnowledgeBase.open(root, verify=True)`` is a consistent snapshot (the manifest, then every object's bytes,
verified and kept in memory for :meth:`KnowledgeBase.read`); an object deleted by two commits that ran while
it read makes it start again from the new manifest.

Creation: :meth:`KnowledgeBase.new` builds the manifest in memory; its first commit writes the directory. A
first commit interrupted by a crash leaves a marker (``.first-commit``) next to its objects, so that the next
attempt may start over it; any other directory holding knowledge-base files but no ``manifest.json`` is
refused (nothing is deleted that a damaged knowledge base still holds).

Crash points (:func:`proteus.faults.crash_point`) mark the commit's steps for the crash-safety tests
(``tests/test_crash_safety.py`` kills ``proteus learn`` at each of them and at random times).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from proteus.faults import crash_point
from proteus.kb.files import (
    _TMP_PREFIXES,
    FIRST_COMMIT,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    OBJECTS,
    OPEN_ATTEMPTS,
    PREV_MANIFEST,
    KBError,
    _atomic_write,
    _damaged,
    _fsync_dir,
    _interrupted_first_commit,
    _is_file_error,
    _kb_files,
    _manifest_issues,
    _MissingObject,
    _not_writable,
    _now,
    _refs,
    _sha,
    _shown,
    check_writable,
    log,
    manifest_checksum,
)
from proteus.kb.lock import lock_holder, write_lock

#: one part of a learner's state: its JSON record (in the manifest) and its tensors (one object)
Part = tuple[dict[str, Any], dict[str, torch.Tensor]]


class KnowledgeBase:
    """A directory holding a PROTEUS knowledge base. Use :meth:`open`, :meth:`new` or :meth:`create`; writers
    hold :meth:`write_lock` from before they open it until after their commit."""

    write_lock = staticmethod(write_lock)
    lock_holder = staticmethod(lock_holder)

    def __init__(self, root: str | Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self._on_disk = True  # False for a KB from new() until its first commit
        self._manifest_sha: str | None = None  # sha256 of manifest.json's bytes as read or written
        self._cache: dict[str, tuple[str, bytes]] = {}  # rel -> (sha256, verified bytes) of the snapshot
        self._pending: dict[str, bytes] = {}  # objects of a KB not yet on disk, written at its first commit

    # ------------------------------------------------------------------ open / create
    @staticmethod
    def exists(root: str | Path) -> bool:
        return (Path(root) / MANIFEST).is_file()

    @staticmethod
    def _fresh_manifest(header: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": _now(),
            **header,
            "tasks": [],
            "head": None,
        }

    @classmethod
    def _check_free(cls, root: Path) -> None:
        """Refuse to start a knowledge base at ``root`` unless nothing of one is there."""
        if root.exists() and not root.is_dir():
            raise _is_file_error(root)
        if cls.exists(root):
            raise KBError(f"{root}: a knowledge base already exists here")
        files = _kb_files(root)
        if files and not _interrupted_first_commit(root, files):
            raise _damaged(root, files, "refusing to start a new knowledge base over them")
        if files:
            log.info("%s: starting over the files of an interrupted first commit (%s)", root, _shown(files))

    @classmethod
    def new(cls, root: str | Path, header: dict[str, Any]) -> KnowledgeBase:
        """A new knowledge base at ``root``, in memory only: nothing is written before its first
        :meth:`commit`, which creates the directory, ``objects/`` and ``manifest.json``."""
        root = Path(root)
        cls._check_free(root)
        kb = cls(root, cls._fresh_manifest(header))
        kb._on_disk = False
        return kb

    @classmethod
    def create(cls, root: str | Path, header: dict[str, Any]) -> KnowledgeBase:
        """A new knowledge base at ``root``, written at once (an empty manifest). Prefer :meth:`new`."""
        root = Path(root)
        cls._check_free(root)
        (root / OBJECTS).mkdir(parents=True, exist_ok=True)
        manifest = cls._fresh_manifest(header)
        manifest["checksum"] = manifest_checksum(manifest)
        data = json.dumps(manifest, indent=1).encode()
        _atomic_write(root / MANIFEST, data)
        kb = cls(root, manifest)
        kb._manifest_sha = _sha(data)
        return kb

    @classmethod
    def _read_manifest(cls, root: Path) -> tuple[bytes, dict[str, Any]]:
        path = root / MANIFEST
        if root.exists() and not root.is_dir():
            raise _is_file_error(root)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            files = _kb_files(root)
            if files and _interrupted_first_commit(root, files):
                raise KBError(
                    f"{root}: no knowledge base here: its first commit was interrupted (files "
                    f"{_shown(files)}); learn its first task again, or choose another --kb"
                ) from None
            if files:
                raise _damaged(root, files, "the knowledge base cannot be opened") from None
            raise KBError(f"{root}: no knowledge base here (missing {MANIFEST})") from None
        manifest, issues = _manifest_issues(path, data, "restore it or manifest.prev.json")
        if issues:
            raise KBError(issues[0])
        assert manifest is not None
        return data, manifest

    @classmethod
    def open(cls, root: str | Path, verify: bool = True) -> KnowledgeBase:
        """Open the knowledge base at ``root`` (never waits for a writer). With ``verify``, a consistent
        snapshot: every object is read and checked against its sha256, and :meth:`read` serves these bytes."""
        root = Path(root)
        for attempt in range(OPEN_ATTEMPTS):
            data, manifest = cls._read_manifest(root)
            kb = cls(root, manifest)
            kb._manifest_sha = _sha(data)
            if not verify:
                return kb
            try:
                kb.verify()
                return kb
            except _MissingObject:
                # a commit that ran while we read swept an object of the state we had read: start again
                try:
                    changed = (root / MANIFEST).read_bytes() != data
                except OSError:
                    changed = True
                if not changed or attempt + 1 == OPEN_ATTEMPTS:
                    raise
                log.debug("%s: a concurrent commit swept an object while it was read; reading again", root)
                time.sleep(min(0.002 * 2**attempt, 0.1))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ objects
    def _objects(self) -> list[tuple[str, str]]:
        refs = [(t["object"], t["sha256"]) for t in self.manifest["tasks"]]
        if self.manifest.get("head"):
            refs.append((self.manifest["head"]["object"], self.manifest["head"]["sha256"]))
        return refs

    def verify(self) -> None:
        """Check that every referenced object exists and has the recorded sha256 (read from disk); the
        verified bytes serve later :meth:`read` calls."""
        cache = {}
        for rel, sha in self._objects():
            cache[rel] = (sha, self._read_verified(rel, sha))
        self._cache = cache

    def _read_verified(self, rel: str, sha: str) -> bytes:
        path = self.root / rel
        if rel in self._pending:
            data = self._pending[rel]
        else:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise _MissingObject(f"{path}: missing from the knowledge base") from None
        actual = _sha(data)
        if actual != sha:
            raise KBError(
                f"{path}: checksum mismatch (expected {sha[:16]}…, found {actual[:16]}…): "
                "the file was truncated or edited"
            )
        return data

    def read(self, rel: str, sha: str) -> dict[str, torch.Tensor]:
        """The tensors of object ``rel`` (checked against ``sha``): from the snapshot ``open`` verified, or
        from disk."""
        cached = self._cache.get(rel)
        data = cached[1] if cached is not None and cached[0] == sha else self._read_verified(rel, sha)
        try:
            return st_load(data)
        except Exception as e:  # safetensors raises several types for bad headers
            raise KBError(f"{self.root / rel}: not a valid safetensors file ({e})") from None

    def write_object(self, kind: str, tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
        """Write a content-addressed object; returns (relative path, sha256). Not yet committed (a KB from
        :meth:`new` keeps it in memory until its first commit)."""
        data = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        sha = _sha(data)
        rel = f"{OBJECTS}/{kind}-{sha[:16]}.safetensors"
        if not self._on_disk:
            self._pending[rel] = data
            return rel, sha
        path = self.root / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, data, "commit:tmp")
        return rel, sha

    # ------------------------------------------------------------------ commit
    def _begin_first_commit(self, manifest: dict[str, Any]) -> None:
        """Create the directory and write the objects of a KB from :meth:`new` (marked as a first commit)."""
        root = self.root
        self._check_free(root)  # nobody created a knowledge base here since new()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _not_writable(root, e) from None
        marker = root / FIRST_COMMIT
        _atomic_write(marker, json.dumps({"pid": os.getpid(), "since": _now()}).encode())
        (root / OBJECTS).mkdir(exist_ok=True)
        _fsync_dir(root)
        for _, rel, _ in _refs(manifest):
            data = self._pending.get(rel)
            if data is not None and not (root / rel).exists():
                _atomic_write(root / rel, data, "commit:tmp")

    def _current_manifest(self) -> bytes | None:
        """The bytes of manifest.json now (None if there is none); refuses when another writer committed
        since this KB was opened (its state would be lost)."""
        try:
            data = (self.root / MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        if self._manifest_sha is not None and _sha(data) != self._manifest_sha:
            raise KBError(
                f"{self.root / MANIFEST}: changed since this knowledge base was opened (another process "
                "committed); open it again under KnowledgeBase.write_lock and redo the change"
            )
        return data

    def commit(self, manifest: dict[str, Any]) -> None:
        """Make ``manifest`` the KB's state (atomic), then sweep the objects neither it nor the previous
        state references. Writers hold :meth:`write_lock` around open ... commit."""
        manifest = {k: v for k, v in manifest.items() if k != "checksum"}
        manifest["format_version"] = FORMAT_VERSION
        manifest["updated"] = _now()
        manifest["checksum"] = manifest_checksum(manifest)
        previous = None
        if not self._on_disk:
            self._begin_first_commit(manifest)
        else:
            previous = self._current_manifest()
        for _, rel, _ in _refs(manifest):
            if not (self.root / rel).is_file():
                raise KBError(
                    f"{self.root / rel}: missing; write it with write_object before committing a manifest "
                    "that references it"
                )
        crash_point("commit:objects")
        if previous is not None:
            _atomic_write(self.root / PREV_MANIFEST, previous)
        data = json.dumps(manifest, indent=1).encode()
        _atomic_write(self.root / MANIFEST, data, "commit:manifest-tmp")
        self.manifest = manifest
        self._manifest_sha = _sha(data)
        self._on_disk = True
        self._pending.clear()
        keep = dict(self._objects())
        self._cache = {rel: v for rel, v in self._cache.items() if keep.get(rel) == v[0]}
        crash_point("commit:manifest")
        self.sweep()

    def commit_state(
        self,
        tasks: list[Part],
        head: Part | None,
        evaluation: list[dict[str, Any]] | None = None,
    ) -> None:
        """Commit a learner's state (:class:`proteus.engine.learner.LearnerState`'s parts): one object
        per task (its record in the manifest), one for the head (its meta in the manifest), and the
        evaluation rows to keep with it (None: the stored rows of the tasks kept)."""
        manifest = dict(self.manifest)
        records = []
        for k, (meta, tensors) in enumerate(tasks):
            rel, sha = self.write_object(f"task{k:03d}", tensors)
            records.append({**meta, "object": rel, "sha256": sha})
        manifest["tasks"] = records
        if head is not None:
            rel, sha = self.write_object("head", head[1])
            manifest["head"] = {"meta": head[0], "object": rel, "sha256": sha}
        stored = list(self.manifest.get("evaluation", []))
        manifest["evaluation"] = stored[: len(tasks)] if evaluation is None else evaluation
        self.commit(manifest)

    def read_state(self) -> tuple[list[Part], Part | None]:
        """The committed state: (record, tensors) per task and the head's (meta, tensors) or None (every
        object's checksum verified)."""
        tasks = [(t, self.read(t["object"], t["sha256"])) for t in self.manifest["tasks"]]
        head = self.manifest.get("head")
        return tasks, (head["meta"], self.read(head["object"], head["sha256"])) if head else None

    def previous_manifest(self) -> dict[str, Any]:
        """The previous commit's manifest (``manifest.prev.json``), checked like the current one."""
        path = self.root / PREV_MANIFEST
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise KBError(f"{self.root}: no previous commit to go back to (no {PREV_MANIFEST})") from None
        manifest, issues = _manifest_issues(path, data, "the previous commit cannot be restored from it")
        if issues or manifest is None:
            raise KBError(issues[0] if issues else f"{path}: not a manifest")
        return manifest

    def _previous_names(self) -> set[str] | None:
        """Names of the objects manifest.prev.json references (None when it cannot be read)."""
        path = self.root / PREV_MANIFEST
        try:
            prev = json.loads(path.read_bytes())
        except FileNotFoundError:
            return set()
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return {Path(rel).name for _, rel, _ in _refs(prev)} if isinstance(prev, dict) else None

    def sweep(self) -> None:
        """Delete the objects referenced neither by the manifest nor by manifest.prev.json, and the temporary
        files of interrupted commits. Only a writer (holding the lock) sweeps."""
        keep = {Path(rel).name for rel, _ in self._objects()}
        previous = self._previous_names()
        if previous is None:
            log.warning("%s: unreadable; no object is swept until the next commit", self.root / PREV_MANIFEST)
        else:
            keep |= previous
        objects = self.root / OBJECTS
        for p in objects.iterdir() if objects.is_dir() else []:
            temporary = p.name.startswith(".") and ".tmp-" in p.name
            if temporary or (previous is not None and p.name not in keep):
                p.unlink(missing_ok=True)
        for p in self.root.iterdir():
            if p.name.startswith(_TMP_PREFIXES) or p.name == FIRST_COMMIT:
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ checks
    #: raise :class:`KBError` unless ``root`` is writable (:func:`proteus.kb.files.check_writable`)
    check_writable = staticmethod(check_writable)

    def check_backbone(self, identity: dict[str, Any]) -> None:
        """Refuse a KB written under another backbone, other weights or another adapted split."""
        mine = self.manifest.get("backbone", {})
        for key in ("name", "weights_id", "weights_sha256", "embed_dim", "split"):
            if mine.get(key) != identity.get(key):
                raise KBError(
                    f"{self.root}: knowledge base was written with backbone {key}={mine.get(key)!r}, "
                    f"but this run uses {key}={identity.get(key)!r}"
                )

    def nbytes(self) -> dict[str, int]:
        out = {"manifest": (self.root / MANIFEST).stat().st_size}
        for t in self.manifest["tasks"]:
            out[f"task{t['index']}"] = (self.root / t["object"]).stat().st_size
        if self.manifest.get("head"):
            out["head"] = (self.root / self.manifest["head"]["object"]).stat().st_size
        return out
