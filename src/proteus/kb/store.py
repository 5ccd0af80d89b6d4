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
the previous state while the commit ran still finds every file it needs. A learner commits its whole state
every time; the objects whose content this KB already wrote (same :func:`~proteus.kb.content.content_key`:
sha256 of the raw tensors, cheaper than serialising them, each unchanged tensor object hashed once) are not
serialised again, so a commit of task k of a long stream writes task k's object and the head, not k objects.

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

Received knowledge bases (:mod:`.schema`, :mod:`.tensors`, :mod:`.signing`): every object path a manifest
names must be a name the store writes and resolve inside ``objects/`` (no ``..``, no absolute path, no
symlink out; :func:`~proteus.kb.schema.object_path`), checked before any file is opened; the manifest's
fields are checked against :data:`~proteus.kb.schema.MANIFEST` when it is opened, before any tensor is read;
:meth:`KnowledgeBase.read_state` checks dtypes, shapes and finiteness (:mod:`.tensors`) before a learner
sees a tensor; with a key (``open(..., key=)`` or ``$PROTEUS_KB_KEY_FILE``) the manifest's HMAC signature
must be valid, and commits sign.

Failures: a write that fails (a full disk, any ``OSError``) removes its temporary file and the objects this
commit wrote that no commit references, restores ``manifest.prev.json`` if it had been replaced, and raises
a :class:`KBError` naming the file (for a full disk, the bytes it tried to write and the space left).
:meth:`KnowledgeBase.gc` removes what neither commit references, reporting what it freed.

Crash points (:func:`proteus.faults.crash_point`) mark the commit's steps for the crash-safety tests
(``tests/test_crash_safety.py`` kills ``proteus learn`` at each of them and at random times).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from proteus.faults import crash_point
from proteus.kb.content import TensorDigests, content_key
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
    _MissingObject,
    _not_writable,
    _now,
    _refs,
    _sha,
    _shown,
    _write_error,
    check_writable,
    log,
    manifest_checksum,
)
from proteus.kb.lock import lock_holder, write_lock
from proteus.kb.schema import head_kind, manifest_issues, manifest_problems, object_path, task_label
from proteus.kb.signing import key_from_env, signature, signature_problem
from proteus.kb.tensors import Obj, check_objects, shapes_of

#: one part of a learner's state: its JSON record (in the manifest) and its tensors (one object)
Part = tuple[dict[str, Any], dict[str, torch.Tensor]]


class KnowledgeBase:
    """A directory holding a PROTEUS knowledge base. Use :meth:`open`, :meth:`new` or :meth:`create`; writers
    hold :meth:`write_lock` from before they open it until after their commit."""

    write_lock = staticmethod(write_lock)
    lock_holder = staticmethod(lock_holder)

    def __init__(self, root: str | Path, manifest: dict[str, Any], key: bytes | None = None) -> None:
        self.root = Path(root)
        self.manifest = manifest
        #: the signing key: checked by open, used by every commit to sign (None: unsigned commits)
        self.key = key
        self._written: list[str] = []  # objects this KB wrote since its last commit (removed if it fails)
        self._on_disk = True  # False for a KB from new() until its first commit
        self._manifest_sha: str | None = None  # sha256 of manifest.json's bytes as read or written
        self._cache: dict[str, tuple[str, bytes]] = {}  # rel -> (sha256, verified bytes) of the snapshot
        self._pending: dict[str, bytes] = {}  # objects of a KB not yet on disk, written at its first commit
        #: content key (:func:`content_key`) -> (rel, sha256) of the objects this KB wrote: each commit of a
        #: long stream serialises only the objects whose content changed since (issue 28)
        self._known: dict[str, tuple[str, str]] = {}
        self._digests = TensorDigests()  # each unchanged tensor object hashed once

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
    def new(cls, root: str | Path, header: dict[str, Any], key: bytes | None = None) -> KnowledgeBase:
        """A new knowledge base at ``root``, in memory only: nothing is written before its first
        :meth:`commit`, which creates the directory, ``objects/`` and ``manifest.json`` (signed with ``key``,
        or with the key of ``$PROTEUS_KB_KEY_FILE`` when it is set)."""
        root = Path(root)
        cls._check_free(root)
        kb = cls(root, cls._fresh_manifest(header), key if key is not None else key_from_env())
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
        data = json.dumps(manifest).encode()
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
        manifest, issues = manifest_issues(path, data, "restore it or manifest.prev.json")
        if issues:
            raise KBError(issues[0])
        assert manifest is not None
        cls._check_paths(root, manifest, path)
        return data, manifest

    @staticmethod
    def _check_paths(root: Path, manifest: dict[str, Any], path: Path) -> None:
        """Refuse a manifest (file ``path``) naming an object outside ``root``'s ``objects/``."""
        for label, rel, sha in _refs(manifest):
            try:
                object_path(root, rel, sha)
            except KBError as e:
                raise KBError(f"{path}: {label}: {e}") from None

    @classmethod
    def open(
        cls,
        root: str | Path,
        verify: bool = True,
        key: bytes | None = None,
        *,
        require_signature: bool = True,
    ) -> KnowledgeBase:
        """Open the knowledge base at ``root`` (never waits for a writer). With ``verify``, a consistent
        snapshot: every object is read and checked against its sha256, and :meth:`read` serves these bytes.
        The manifest is checked first (:mod:`proteus.kb.schema`: fields and object paths). With ``key``
        (or, when it is None, the key of ``$PROTEUS_KB_KEY_FILE`` if set), the manifest's signature must be
        valid (``require_signature=False``: not checked, for re-signing), and commits sign."""
        root = Path(root)
        if key is None:
            key = key_from_env()
        for attempt in range(OPEN_ATTEMPTS):
            data, manifest = cls._read_manifest(root)
            if key is not None and require_signature:
                problem = signature_problem(root, manifest, key)
                if problem:
                    raise KBError(problem)
            kb = cls(root, manifest, key)
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

    def _label(self, rel: str) -> str:
        return next((label for label, r, _ in _refs(self.manifest) if r == rel), "not in the manifest")

    def _path(self, rel: str, sha: str | None = None) -> Path:
        """The resolved path of object ``rel`` (:func:`~proteus.kb.schema.object_path`: refused unless it is
        inside ``objects/``)."""
        try:
            return object_path(self.root, rel, sha)
        except KBError as e:
            raise KBError(f"{self.root / MANIFEST}: {self._label(rel)}: {e}") from None

    def _read_verified(self, rel: str, sha: str) -> bytes:
        path = self.root / rel
        if rel in self._pending:
            data = self._pending[rel]
        else:
            data = read_object_file(self._path(rel, sha), path)
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

    def write_object(
        self, kind: str, tensors: dict[str, torch.Tensor], reuse: bool = True
    ) -> tuple[str, str]:
        """Write a content-addressed object; returns (relative path, sha256). Not yet committed (a KB from
        :meth:`new` keeps it in memory until its first commit). ``reuse``: look the content up among the
        objects this KB wrote (:func:`content_key`) before serialising it; False for an object that
        changes at every commit (the head), which would pay for the lookup's hashing for nothing."""
        key = content_key(kind, tensors, self._digests) if reuse else None
        known = None if key is None else self._known.get(key)
        if known is not None and (
            known[0] in self._pending or (self._on_disk and (self.root / known[0]).is_file())
        ):
            return known
        data = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        sha = _sha(data)
        rel = f"{OBJECTS}/{kind}-{sha[:16]}.safetensors"
        if key is not None:
            self._known[key] = (rel, sha)
        if not self._on_disk:
            self._pending[rel] = data
            return rel, sha
        path = self.root / rel
        if not path.exists():
            try:
                self._write_new_object(rel, data)
            except BaseException:
                self._abandon()
                raise
        return rel, sha

    def _write_new_object(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _write_error(path, len(data), e) from None
        _atomic_write(path, data, "commit:tmp")
        self._written.append(rel)

    def _abandon(self, prev_before: bytes | None = None, copied: bytes | None = None) -> None:
        """After a failed write or commit: remove the objects this KB wrote since its last commit that
        neither manifest on disk references; put back ``prev_before`` (the ``manifest.prev.json`` this commit
        replaced by ``copied``, empty when there was none) unless the new manifest landed; after a failed
        first commit, the marker and the empty ``objects/`` too. Best effort: it never raises."""
        root = self.root
        try:
            current = (root / MANIFEST).read_bytes()
        except FileNotFoundError:
            current = None
        except OSError:
            return  # cannot tell what is referenced: delete nothing
        landed = copied is None or current != copied
        keep: set[str] = set()
        for data in (current, None if landed else prev_before):
            if data:
                try:
                    keep |= {Path(rel).name for _, rel, _ in _refs(json.loads(data))}
                except (ValueError, AttributeError):
                    return
        previous = self._previous_names()
        if previous is None:
            return
        keep |= previous
        for rel in self._written:
            if Path(rel).name not in keep:
                with contextlib.suppress(OSError):
                    (root / rel).unlink()
        self._written.clear()
        if not landed and prev_before is not None:
            with contextlib.suppress(OSError, KBError):
                if prev_before:
                    _atomic_write(root / PREV_MANIFEST, prev_before)
                else:
                    (root / PREV_MANIFEST).unlink()
        if current is None and (root / FIRST_COMMIT).exists():  # a failed first commit
            with contextlib.suppress(OSError):
                (root / OBJECTS).rmdir()  # only when empty
                (root / FIRST_COMMIT).unlink()

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
                self._write_new_object(rel, data)

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

    def _sealed(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """``manifest`` as the next commit writes it: this format version, the time, signed with
        :attr:`key` (or unsigned), its checksum."""
        signed = "signature" in manifest
        manifest = {k: v for k, v in manifest.items() if k not in ("checksum", "signature")}
        manifest["format_version"] = FORMAT_VERSION
        manifest["updated"] = _now()
        if self.key is not None:
            manifest["signature"] = signature(manifest, self.key)
        elif signed:
            log.warning(
                "%s: the knowledge base was signed; this commit, made without a key, is not (sign it again "
                "with `proteus kb sign`, or set $PROTEUS_KB_KEY_FILE)",
                self.root,
            )
        manifest["checksum"] = manifest_checksum(manifest)
        return manifest

    def commit(self, manifest: dict[str, Any]) -> None:
        """Make ``manifest`` the KB's state (atomic), then sweep the objects neither it nor the previous
        state references. Writers hold :meth:`write_lock` around open ... commit. A manifest this proteus
        could not read back is refused; a failed commit leaves the KB as it was (:meth:`_abandon`)."""
        manifest = self._sealed(manifest)
        previous = prev_before = None
        try:
            checked = self.manifest.get("tasks") if self._on_disk else None  # checked at open or commit
            problems = manifest_problems(manifest, checked=checked)
            if problems:
                raise KBError(
                    f"{self.root}: refusing to commit a manifest this proteus cannot read: {problems[0]}"
                )
            if not self._on_disk:
                self._begin_first_commit(manifest)
            else:
                previous = self._current_manifest()
            checked = {(rel, sha) for _, rel, sha in _refs(self.manifest)}  # their paths were checked already
            for label, rel, sha in _refs(manifest):
                path = self.root / rel if (rel, sha) in checked else self._path(rel, sha)
                if not path.is_file():
                    raise KBError(
                        f"{self.root / rel}: missing ({label}); write it with write_object before committing "
                        "a manifest that references it"
                    )
            crash_point("commit:objects")
            if previous is not None:
                try:
                    prev_before = (self.root / PREV_MANIFEST).read_bytes()
                except FileNotFoundError:
                    prev_before = b""
                _atomic_write(self.root / PREV_MANIFEST, previous)
            data = json.dumps(manifest).encode()
            _atomic_write(self.root / MANIFEST, data, "commit:manifest-tmp")
        except BaseException:
            self._abandon(prev_before, previous)
            raise
        self._written.clear()
        self.manifest = manifest
        self._manifest_sha = _sha(data)
        self._on_disk = True
        self._pending.clear()
        keep = dict(self._objects())
        self._cache = {rel: v for rel, v in self._cache.items() if keep.get(rel) == v[0]}
        self._known = {key: v for key, v in self._known.items() if keep.get(v[0]) == v[1]}
        crash_point("commit:manifest")
        self.sweep()

    def commit_state(
        self,
        tasks: list[Part],
        head: Part | None,
        evaluation: list[dict[str, Any]] | None = None,
    ) -> None:
        """Commit a learner's state (:class:`proteus.learners.LearnerState`'s parts): one object
        per task (its record in the manifest), one for the head (its meta in the manifest), and the
        evaluation rows to keep with it (None: the stored rows of the tasks kept)."""
        manifest = dict(self.manifest)
        records = []
        for k, (meta, tensors) in enumerate(tasks):
            rel, sha = self.write_object(f"task{k:03d}", tensors)
            records.append({**meta, "object": rel, "sha256": sha})
        manifest["tasks"] = records
        if head is not None:
            rel, sha = self.write_object("head", head[1], reuse=False)  # a learner's head changes every task
            manifest["head"] = {"meta": head[0], "object": rel, "sha256": sha}
        stored = list(self.manifest.get("evaluation", []))
        manifest["evaluation"] = stored[: len(tasks)] if evaluation is None else evaluation
        self.commit(manifest)

    def read_state(self, learner: str | None = None) -> tuple[list[Part], Part | None]:
        """The committed state: (record, tensors) per task and the head's (meta, tensors) or None (every
        object's checksum verified). Before a learner sees it: the records must hold the learner's fields,
        and every tensor its dtype, shape and finite values, by the rules of ``learner`` (its
        ``kb_layout``: a role of :data:`proteus.tensor_rules.TENSOR_RULES`; None: the learner whose head
        the manifest holds, else PROTEUS); a :class:`KBError` names the task, the file and the tensor."""
        learner = learner or head_kind(self.manifest) or "proteus"
        problems = manifest_problems(self.manifest, learner)
        if problems:
            raise KBError(f"{self.root / MANIFEST}: {problems[0]}; no learner can be loaded from it")
        tasks, state = self._checked_state("no learner can be loaded from it", learner)
        return tasks, state

    def _checked_state(self, consequence: str, learner: str | None = None) -> tuple[list[Part], Part | None]:
        """Every object's tensors, checked by :func:`~proteus.kb.tensors.check_objects` (dtypes, shapes,
        finite values: ``learner``'s rules): a :class:`KBError` with the first problem and ``consequence``."""
        tasks = [(t, self.read(t["object"], t["sha256"])) for t in self.manifest["tasks"]]
        head = self.manifest.get("head")
        state = (head["meta"], self.read(head["object"], head["sha256"])) if head else None
        objects = [
            Obj(task_label(i), str(self.root / t["object"]), t, i, shapes_of(x), x)
            for i, (t, x) in enumerate(tasks)
        ]
        if head and state:
            path = str(self.root / head["object"])
            objects.append(Obj("head", path, head["meta"], None, shapes_of(state[1]), state[1]))
        bad = check_objects(self.manifest["tasks"], objects, learner)
        if bad:
            raise KBError(f"{bad[0]}; {consequence} (`proteus kb verify {self.root}` lists every problem)")
        return tasks, state

    def previous_manifest(self, check_signature: bool = True) -> dict[str, Any]:
        """The previous commit's manifest (``manifest.prev.json``), checked like the current one (its
        signature too, when this KB has a key: an undo must not sign what nobody signed)."""
        path = self.root / PREV_MANIFEST
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise KBError(f"{self.root}: no previous commit to go back to (no {PREV_MANIFEST})") from None
        manifest, issues = manifest_issues(path, data, "the previous commit cannot be restored from it")
        if issues or manifest is None:
            raise KBError(issues[0] if issues else f"{path}: not a manifest")
        self._check_paths(self.root, manifest, path)
        if self.key is not None and check_signature:
            problem = signature_problem(self.root, manifest, self.key, PREV_MANIFEST)
            if problem:
                raise KBError(f"{problem}; the previous commit is not restored")
        return manifest

    def undo(self) -> dict[str, Any]:
        """Make the previous commit the current state again (a commit itself: ``undo`` twice redoes);
        returns what it restored and what it replaced (``restored``, ``replaced``: each its ``updated`` time
        stamp, ``tasks``, and ``forgotten`` task numbers, 1-based)."""
        prev = self.previous_manifest()
        replaced = self.manifest
        self.commit(prev)
        return {"restored": _summary(prev), "replaced": _summary(replaced)}

    def sign(self, key: bytes) -> None:
        """Sign the current commit, and the previous one kept for ``undo``, with ``key`` (in place: the
        state and the previous state stay what they are; the caller holds :meth:`write_lock`). Every
        object is verified first (checksum, dtypes, shapes, finite values): a signature vouches for what the
        manifest references."""
        if self._current_manifest() is None:
            raise KBError(f"{self.root}: no knowledge base here (missing {MANIFEST})")
        self.verify()
        self._checked_state("not signed")
        prev_path = self.root / PREV_MANIFEST
        if prev_path.is_file():
            prev = self.previous_manifest(check_signature=False)
            _atomic_write(prev_path, json.dumps(_resigned(prev, key)).encode())
        self.key = key
        manifest = _resigned(self.manifest, key)
        data = json.dumps(manifest).encode()
        _atomic_write(self.root / MANIFEST, data)
        self.manifest = manifest
        self._manifest_sha = _sha(data)

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

    def sweep(self) -> list[tuple[Path, int]]:
        """Delete the objects referenced neither by the manifest nor by manifest.prev.json, and the temporary
        files of interrupted commits; returns each file removed with its size. Only a writer (holding the
        lock) sweeps. Directories and symlinks' targets are never touched (a symlink itself is removed)."""
        keep = {Path(rel).name for rel, _ in self._objects()}
        previous = self._previous_names()
        if previous is None:
            log.warning("%s: unreadable; no object is swept until the next commit", self.root / PREV_MANIFEST)
        else:
            keep |= previous
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

        objects = self.root / OBJECTS
        for p in sorted(objects.iterdir()) if objects.is_dir() and not objects.is_symlink() else []:
            temporary = p.name.startswith(".") and ".tmp-" in p.name
            if temporary or (previous is not None and p.name not in keep):
                remove(p)
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(_TMP_PREFIXES) or p.name == FIRST_COMMIT:
                remove(p)
        return removed

    def gc(self) -> list[tuple[Path, int]]:
        """``proteus kb gc``: :meth:`sweep` outside a commit (after a failed one, on a full disk); the caller
        holds :meth:`write_lock`. Returns each file removed with its size."""
        self._current_manifest()  # refuses if another writer committed since this KB was opened
        return self.sweep()

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
            out[f"task{t['index']}"] = self._path(t["object"], t["sha256"]).stat().st_size
        if self.manifest.get("head"):
            head = self.manifest["head"]
            out["head"] = self._path(head["object"], head["sha256"]).stat().st_size
        return out


def read_object_file(resolved: Path, shown: Path) -> bytes:
    """The bytes of the object file at ``resolved`` (from :func:`~proteus.kb.schema.object_path`), opened
    without following a symlink and only if it is a regular file; ``shown`` names it in errors."""
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _MissingObject(f"{shown}: missing from the knowledge base") from None
    except OSError as e:
        raise KBError(f"{shown}: cannot be read ({e.strerror or e})") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise KBError(f"{shown}: not a regular file")
        return f.read()


def _resigned(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``manifest`` signed with ``key`` (time stamps kept), with its new checksum."""
    out = {k: v for k, v in manifest.items() if k not in ("checksum", "signature")}
    out["signature"] = signature(out, key)
    out["checksum"] = manifest_checksum(out)
    return out


def _summary(manifest: dict[str, Any]) -> dict[str, Any]:
    tasks = manifest.get("tasks") or []
    return {
        "updated": manifest.get("updated"),
        "tasks": len(tasks),
        "forgotten": [i + 1 for i, t in enumerate(tasks) if isinstance(t, dict) and t.get("forgotten")],
    }
