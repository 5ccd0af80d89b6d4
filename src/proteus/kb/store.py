"""The knowledge base (KB) of Algorithm 1: per task a value (the adapter) and a multi-key (the signature),
plus the head's statistics G and e(c). It is the only memory of data that no longer exists.

On disk::

    kb/manifest.json                     the commit point (JSON, no pickle)
    kb/manifest.prev.json                the previous commit's manifest (kept for readers and for undo)
    kb/objects/<kind>-<sha256[:16]>.safetensors   content-addressed tensor files
    kb/.lock                             the writers' lock (not part of the knowledge base)

The parts: :mod:`.objects` (the snapshot and the writes of objects), :mod:`.commit` (the commit protocol),
:mod:`.sweep` (garbage collection), :mod:`.manifests` (reading both manifests). A commit writes the new
objects first (temporary name, fsync, rename), copies the current manifest to ``manifest.prev.json``
(atomically), then writes the new manifest to a temporary name, fsyncs it, and renames
it over ``manifest.json`` (atomic on POSIX), then fsyncs the directory. Objects are never overwritten (their
names carry their hash), so a process killed at any moment leaves either the old manifest with all its
objects, or the new one. After the rename, files referenced neither by the new manifest nor by the previous
one (``manifest.prev.json``) are swept, with the temporary files of interrupted commits: a reader that opened
the previous state while the commit ran still finds every file it needs. A learner commits its whole state
every time; the objects whose content this KB already wrote (same :func:`~proteus.kb.content.content_key`:
sha256 of the raw tensors, cheaper than serialising them, each unchanged tensor object hashed once) are not
serialised again, so a commit of task k of a long stream writes task k's object and the head, not k objects.

Integrity: every object's sha256 and size are recorded in the manifest; a file is compared with the size
before it is read and with the sha256 after (a truncated, replaced or edited file is detected, never
loaded). The manifest carries ``checksum``, the sha256 of its canonical JSON (sorted keys, no whitespace)
without its time stamps (``created``, ``updated``, each task's ``learned``) and its random identity
``kb_id``: it covers content only, so two identical runs have the same checksum. Format version 3 has
``sequence`` (one more at every commit) and ``kb_id``, which a signature binds (:mod:`.signing`); version 2
manifests (whose checksum covers ``learned``) and version 1 manifests (no checksum) are still read and are
written in version 3 at their next commit; a manifest whose version was lowered by hand is refused.

Files: every file of a knowledge base is opened like an object (:mod:`.files`): inside the directory,
without following a symbolic link, without blocking, only as a regular file within its budget
(:mod:`proteus.budgets`).

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
a :class:`KBError` naming the file (for a full disk, the bytes it tried to write and the space left);
``tests/test_kb_faults.py`` fails each ``open``, ``write``, ``fsync`` and rename of a commit in turn.
:meth:`KnowledgeBase.gc` removes what neither commit references, reporting what it freed.

Crash points (:func:`proteus.faults.crash_point`) mark the commit's steps for the crash-safety tests
(``tests/test_crash_safety.py`` kills ``proteus learn`` at each of them and at random times).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from proteus.collector import collector_paused
from proteus.faults import crash_point
from proteus.kb.chain import keep_in_history
from proteus.kb.commit import Commit
from proteus.kb.files import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    OPEN_ATTEMPTS,
    KBError,
    _damaged,
    _interrupted_first_commit,
    _is_file_error,
    _kb_files,
    _MissingObject,
    _now,
    _object_names,
    _ref_names,
    _refs,
    _segment_refs,
    _sha,
    _shown,
    check_writable,
    kb_file_kind,
    log,
    read_kb_file,
)
from proteus.kb.lock import check_not_moved, lock_holder, write_lock
from proteus.kb.manifests import previous_manifest, read_manifest, segmented
from proteus.kb.objects import ObjectStore, Part, StoredPart
from proteus.kb.packs import StoredTensors, is_pack
from proteus.kb.schema import head_kind, manifest_problems
from proteus.kb.segments import Segments
from proteus.kb.signing import accept, key_from_env, sequence_problem, signature_problem
from proteus.kb.sweep import sweep
from proteus.kb.verified import Verified, state_key
from proteus.tensor_rules import DTYPES

#: a state read back: each task's stored part, and the head's
State = tuple[list[StoredPart], Part | None]


def _check_signed(root: Path, manifest: dict[str, Any], key: bytes) -> None:
    """Refuse ``manifest`` unless signed under ``key`` with a sequence not below what the key accepted."""
    problem = signature_problem(root, manifest, key) or sequence_problem(root, manifest, key)
    if problem:
        raise KBError(problem)


class KnowledgeBase:
    """A directory holding a PROTEUS knowledge base. Use :meth:`open`, :meth:`new` or :meth:`create`; writers
    hold :meth:`write_lock` from before they open it until after their commit. Its objects are
    :attr:`objects` (:class:`~proteus.kb.objects.ObjectStore`); a commit is a
    :class:`~proteus.kb.commit.Commit`."""

    write_lock = staticmethod(write_lock)
    lock_holder = staticmethod(lock_holder)
    #: raise :class:`KBError` unless ``root`` is writable (:func:`proteus.kb.files.check_writable`)
    check_writable = staticmethod(check_writable)

    def __init__(
        self,
        root: str | Path,
        manifest: dict[str, Any],
        key: bytes | None = None,
        segments: Segments | None = None,
        verified: Verified | None = None,
    ) -> None:
        self.root = Path(root)
        #: the committed state, expanded (format 4: its record segments read, :mod:`proteus.kb.segments`)
        self.manifest = manifest
        #: the record segments read or written (a commit writes only those whose records changed)
        self.segments = segments or Segments()
        #: the signing key: checked by open, used by every commit to sign (None: unsigned commits)
        self.key = key
        self.objects = ObjectStore(self.root, verified=verified)
        self.segments.verified = self.objects.verified
        self._manifest_sha: str | None = None  # sha256 of manifest.json's bytes as read or written
        #: the manifest this store committed last, with its tasks' and head's references (:func:`_refs`)
        self._committed_refs: tuple[dict[str, Any], list[tuple[str, str, str]]] | None = None

    @property
    def _on_disk(self) -> bool:
        """False for a KB from :meth:`new` until its first commit."""
        return self.objects.on_disk

    # ------------------------------------------------------------------ open / create
    @staticmethod
    def exists(root: str | Path) -> bool:
        return (Path(root) / MANIFEST).is_file()

    def is_current(self) -> bool:
        """Whether the folder's manifest is still the state this opening read or last committed (False once
        another opening committed, or for a knowledge base not on disk yet): the manifest's bytes only."""
        if not self._on_disk or self._manifest_sha is None:
            return False
        data = read_kb_file(self.root, MANIFEST)
        return data is not None and _sha(data) == self._manifest_sha

    @classmethod
    def new(cls, root: str | Path, header: dict[str, Any], key: bytes | None = None) -> KnowledgeBase:
        """A new knowledge base at ``root``, in memory only: nothing is written before its first
        :meth:`commit`, which creates the directory, ``objects/`` and ``manifest.json`` (signed with ``key``,
        or with the key of ``$PROTEUS_KB_KEY_FILE`` when it is set)."""
        root = Path(root)
        _check_free(root)
        kb = cls(root, _fresh_manifest(header), key if key is not None else key_from_env())
        kb.objects.on_disk = False
        return kb

    @classmethod
    def create(cls, root: str | Path, header: dict[str, Any]) -> KnowledgeBase:
        """A new knowledge base at ``root``, written at once (an empty manifest). Prefer :meth:`new`."""
        kb = cls.new(root, header, key=None)
        kb.commit(kb.manifest)
        return kb

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
        snapshot: every object checked against its size and sha256, served by :meth:`read`. The manifest is
        checked first (:mod:`proteus.kb.schema`: fields and object paths). With ``key`` (None: the key of
        ``$PROTEUS_KB_KEY_FILE`` if set), the manifest's signature must be valid and its sequence not below
        what the key accepted before (``require_signature=False``: not checked, to re-sign); commits sign."""
        root, key = Path(root), key_from_env() if key is None else key
        with collector_paused():  # many small objects, all kept (:mod:`proteus.collector`)
            for attempt in range(OPEN_ATTEMPTS):
                segments, verified = Segments(), Verified(root)
                data: bytes | None = None
                try:
                    data, manifest = read_manifest(root, segments, verified)
                    if key is not None and require_signature:
                        _check_signed(root, manifest, key)
                    kb = cls(root, manifest, key, segments, verified)
                    kb._manifest_sha = _sha(data)
                    if verify:
                        kb.verify()
                except _MissingObject as e:
                    # a commit that ran while we read swept a record segment or an object of the state we had
                    # read: start again
                    read = data if data is not None else e.manifest
                    if read is None or read_kb_file(root, MANIFEST) == read or attempt + 1 == OPEN_ATTEMPTS:
                        raise
                    log.debug(
                        "%s: a concurrent commit swept an object while it was read; reading again", root
                    )
                    time.sleep(min(0.002 * 2**attempt, 0.1))
                    continue
                if key is not None and require_signature:
                    accept(manifest, key, root)
                return kb
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ objects
    def verify(self) -> None:
        """Check that every referenced object exists and has the recorded size and sha256 (read from disk);
        the verified bytes serve later :meth:`read` calls."""
        self.objects.verify(self.manifest)

    def read(self, rel: str, sha: str) -> dict[str, torch.Tensor]:
        """The tensors of object ``rel`` (checked against ``sha``): from the snapshot, or from disk."""
        return self.objects.read(self.manifest, rel, sha)

    def read_task(self, record: dict[str, Any]) -> StoredTensors:  # (ObjectStore.read_task)
        return self.objects.read_task(self.manifest, record)

    def write_object(
        self, kind: str, tensors: dict[str, torch.Tensor], reuse: bool = True
    ) -> tuple[str, str]:
        """Write a content-addressed object; returns (relative path, sha256). Not yet committed (a KB from
        :meth:`new` keeps it in memory until its first commit). ``reuse``: look the content up among the
        objects this KB wrote (:func:`~proteus.kb.content.content_key`) first; False for an object that
        changes at every commit (the head), which would pay for the lookup's hashing for nothing."""
        try:
            if self._on_disk:
                check_not_moved(self.root)
            return self.objects.write(kind, tensors, reuse)
        except BaseException:
            Commit(self.root, self.objects, None).abandon()
            raise

    # ------------------------------------------------------------------ commit
    def commit(self, manifest: dict[str, Any]) -> None:
        """Make ``manifest`` the KB's state (atomic: :class:`~proteus.kb.commit.Commit`), then sweep the
        objects neither it nor the previous state references. Writers hold :meth:`write_lock` around open
        ... commit. A manifest this proteus could not read back is refused; a failed commit leaves the KB as
        it was."""
        check_not_moved(self.root)
        commit = Commit(self.root, self.objects, self._manifest_sha)
        known = self._committed_refs  # each manifest's references walked once: when it is committed
        current = known[1] if known is not None and known[0] is self.manifest else _refs(self.manifest)
        replaced = None
        if self._on_disk and self._manifest_sha:
            replaced = _ref_names(current + _segment_refs(self.manifest))
        kept_segments = list(self.manifest.get("segments") or [])
        physical, expanded = commit.prepare(
            manifest, self.manifest, self._on_disk, self.key, self.segments, current
        )
        data = commit.write(physical, expanded, not self._on_disk, _check_free)
        self.manifest = expanded
        self._manifest_sha = _sha(data)
        task_refs = commit.refs if commit.refs is not None else _refs(expanded)
        self._committed_refs = (expanded, task_refs)
        refs = task_refs + _segment_refs(expanded)
        self.objects.settle(expanded, refs)
        self.segments.settle(expanded["segments"] + kept_segments)
        # the state this proteus wrote: a reader need not check it again
        self.objects.verified.wrote(expanded, head_kind(expanded) or "proteus", {rel for _, rel, _ in refs})
        if self.key is not None:
            accept(manifest, self.key, self.root)
        crash_point("commit:manifest")
        # manifest.prev.json holds the state replaced (write checked it is this one)
        sweep(self.root, _ref_names(refs), replaced)

    def commit_state(
        self, tasks: Sequence[Part], head: Part | None, evaluation: list[dict[str, Any]] | None = None
    ) -> None:
        """Commit a learner's state (:class:`proteus.learners.LearnerState`'s parts): one object per task (its
        record in a segment; a full segment's tasks in one pack), one for the head (its meta in the manifest),
        and the evaluation rows to keep with it (None: the stored rows of the tasks kept)."""
        every = getattr(tasks, "tokens", None)  # a learner's token of each unchanged task
        tokens = every() if every is not None else [None] * len(tasks)
        self.commit(
            state_manifest(self.manifest, self._on_disk, tasks, head, evaluation, tokens, self.write_object)
        )
        done = getattr(tasks, "committed", None)  # the learner keeps each record as its task's token
        for k, record in enumerate(self.manifest["tasks"] if done is not None else []):
            if k >= len(tokens) or record is not tokens[k]:  # (a record that is its token already: skipped)
                done(k, record)  # type: ignore[misc]

    def read_state(self, learner: str | None = None) -> State:
        """The committed state: (record, tensors) per task and the head's (meta, tensors) or None (every
        object's checksum verified). Before a learner sees it: the records must hold the learner's fields,
        and every tensor its dtype, shape and finite values, by the rules of ``learner`` (its
        ``kb_layout``: a role of :data:`proteus.tensor_rules.TENSOR_RULES`; None: the learner whose head
        the manifest holds, else PROTEUS); a :class:`KBError` names the task, the file and the tensor."""
        learner = learner or head_kind(self.manifest) or "proteus"
        checked = self.objects.verified.checked(state_key(self.manifest, learner))  # :mod:`.verified`
        problems = [] if checked else manifest_problems(self.manifest, learner)
        if problems:
            raise KBError(f"{self.root / MANIFEST}: {problems[0]}; no learner can be loaded from it")
        return self._checked_state("no learner can be loaded from it", learner)

    def _checked_state(self, consequence: str, learner: str | None = None) -> State:
        """Every object's tensors, checked (:meth:`~proteus.kb.objects.ObjectStore.checked_state`)."""
        return self.objects.checked_state(self.manifest, consequence, learner)

    def previous_manifest(self, check_signature: bool = True) -> dict[str, Any]:
        """The previous commit's manifest (``manifest.prev.json``), checked like the current one (its
        signature too, when this KB has a key: an undo must not sign what nobody signed)."""
        return previous_manifest(self.root, self.key if check_signature else None, self.segments)

    def undo(self) -> dict[str, Any]:
        """Make the previous commit the current state again (a commit itself, with a new sequence number:
        ``undo`` twice redoes); returns what it restored and what it replaced (``restored``, ``replaced``:
        each its ``updated`` time stamp, ``tasks``, and ``forgotten`` task numbers, 1-based)."""
        prev, replaced = self.previous_manifest(), self.manifest
        self.commit(prev)
        return {"restored": _summary(prev), "replaced": _summary(replaced)}

    def sign(self, key: bytes) -> None:
        """Sign the current commit, and the previous one kept for ``undo``, with ``key`` (in place: the
        state and the previous state stay what they are, written in the newest format with the knowledge
        base's identity and a sequence number; the caller holds :meth:`write_lock`). Every object is
        verified first (checksum, dtypes, shapes, finite values): a signature vouches for what the manifest
        references."""
        commit = Commit(self.root, self.objects, self._manifest_sha)
        if commit.current() is None:
            raise KBError(f"{self.root}: no knowledge base here (missing {MANIFEST})")
        self.verify()
        self._checked_state("not signed")
        self.manifest, data = commit.sign(self.manifest, key)
        self.key = key
        self._manifest_sha = _sha(data)
        accept(self.manifest, key, self.root)

    def sweep(self, previous: set[str] | None = None) -> list[tuple[Path, int]]:
        """Delete the objects referenced neither by the manifest nor by manifest.prev.json (``previous``: its
        names, if known), and temporary files (:func:`~proteus.kb.sweep.sweep`); returns each file removed
        with its size. Only a writer (holding the lock) sweeps."""
        return sweep(self.root, _object_names(self.manifest), previous)

    def upgrade(self) -> int | None:
        """``proteus kb upgrade``: the current state committed again in the newest format (atomic; the caller
        holds :meth:`write_lock`); returns the format it was in (None: the newest already)."""
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            self.commit(self.manifest)
        return int(version) if isinstance(version, int) and version != FORMAT_VERSION else None

    def gc(self) -> list[tuple[Path, int]]:
        """``proteus kb gc``: :meth:`sweep` outside a commit (after a failed one, on a full disk); the caller
        holds :meth:`write_lock`. Returns each file removed with its size."""
        data = Commit(self.root, self.objects, self._manifest_sha).current()  # refuses if another committed
        if data is not None and segmented(self.manifest):
            keep_in_history(self.root, data)  # a commit whose own copy failed
        return sweep(self.root, _object_names(self.manifest), None, history=True)

    # ------------------------------------------------------------------ checks
    def check_backbone(self, identity: dict[str, Any]) -> None:
        """Refuse a KB written under another backbone, other weights or another adapted split."""
        _check_backbone(self.root, self.manifest, identity)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the manifest and of each object (``task<index>``, ``head``)."""
        return _nbytes(self.root, self.manifest, self.objects)


def state_manifest(
    current: dict[str, Any],
    on_disk: bool,
    tasks: Sequence[Part],
    head: Part | None,
    evaluation: list[dict[str, Any]] | None,
    tokens: list[Any],
    write: Callable[..., tuple[str, str]],
) -> dict[str, Any]:
    """The manifest that makes a learner's state (:meth:`KnowledgeBase.commit_state`'s arguments) follow
    ``current`` (``on_disk``: committed before): the tasks' records (:func:`task_records`), the head's object
    written anew (a learner's head changes every task) and the evaluation rows kept."""
    manifest = dict(current)
    manifest["tasks"] = task_records(tasks, (current.get("tasks") or []) if on_disk else [], write, tokens)
    if head is not None:
        rel, sha = write("head", head[1], reuse=False)
        manifest["head"] = {"meta": head[0], "object": rel, "sha256": sha}
    rows = list(current.get("evaluation", []))
    manifest["evaluation"] = rows[: len(tasks)] if evaluation is None else evaluation
    return manifest


def task_records(
    tasks: Sequence[Part],
    stored: list[Any],
    write: Callable[[str, dict[str, torch.Tensor]], tuple[str, str]],
    tokens: list[Any],
) -> list[Any]:
    """The records of a learner's ``tasks`` (:class:`proteus.learners.TaskParts`, or any sequence of parts):
    ``stored[k]`` where task k's token says it is unchanged since that record was committed or read (the
    part is not even built), else a record of its part with its object written (``write``); ``tokens``:
    each task's token (:meth:`proteus.learners.TaskParts.tokens`; None where it has none)."""
    records = []
    for k, token in enumerate(tokens):
        if token is not None and k < len(stored) and (token is stored[k] or token == stored[k]):
            records.append(stored[k])
            continue
        meta, tensors = tasks[k]
        rel, sha = write(f"task{k:03d}", tensors)
        records.append({**meta, "object": rel, "sha256": sha})
    return records


def _check_free(root: Path) -> None:
    """Refuse to start a knowledge base at ``root`` unless nothing of one is there."""
    if root.exists() and not root.is_dir():
        raise _is_file_error(root)
    kind = kb_file_kind(root, MANIFEST)
    if kind == "a regular file":
        raise KBError(f"{root}: a knowledge base already exists here")
    if kind is not None:
        raise KBError(f"{root / MANIFEST}: {kind}, not a manifest; remove it, or choose another --kb")
    files = _kb_files(root)
    if files and not _interrupted_first_commit(root, files):
        raise _damaged(root, files, "refusing to start a new knowledge base over them")
    if files:
        log.info("%s: starting over the files of an interrupted first commit (%s)", root, _shown(files))


def _check_backbone(root: Path, manifest: dict[str, Any], identity: dict[str, Any]) -> None:
    mine = manifest.get("backbone", {})
    for key in ("name", "weights_id", "weights_sha256", "embed_dim", "split"):
        if mine.get(key) != identity.get(key):
            raise KBError(
                f"{root}: knowledge base was written with backbone {key}={mine.get(key)!r}, "
                f"but this run uses {key}={identity.get(key)!r}"
            )


def _nbytes(root: Path, manifest: dict[str, Any], objects: ObjectStore) -> dict[str, int]:
    """Bytes of the manifest and each object; a task in a pack: the bytes of its tensors there."""
    out = {"manifest": (root / MANIFEST).stat().st_size}
    for label, rel, sha in _refs(manifest):
        name = "head" if label == "head" else f"task{label.rsplit(' ', 1)[1]}"
        if name != "head" and is_pack(rel):
            shares = objects.read_task(manifest, manifest["tasks"][int(name[4:])]).shapes().values()
            out[name] = sum(math.prod(shape) * DTYPES[dtype][1] for dtype, shape in shares)
        else:
            out[name] = objects.path(manifest, rel, sha).stat().st_size
    return out


def _fresh_manifest(header: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "created": _now(), **header, "tasks": [],
            "head": None}  # fmt: skip


def _summary(manifest: dict[str, Any]) -> dict[str, Any]:
    tasks = manifest.get("tasks") or []
    return {
        "updated": manifest.get("updated"),
        "tasks": len(tasks),
        "forgotten": [i + 1 for i, t in enumerate(tasks) if isinstance(t, dict) and t.get("forgotten")],
    }
