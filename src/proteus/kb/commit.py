"""The commit protocol of a knowledge base (:class:`Commit`): seal the new manifest, write it atomically after
the previous one is kept, and on any failure leave the knowledge base as it was.

Sealing (:func:`seal`) writes the newest format (:data:`~proteus.kb.files.FORMAT_VERSION`), the time, one
more ``sequence`` than the state it replaces (``undo`` included: a sequence never goes back), the knowledge
base's identity ``kb_id`` (kept from its first commit), the size of every object it references
(``object_bytes``: readers compare a file with it before reading), the signature when there is a key, and
the checksum.

Writing: the current manifest is copied to ``manifest.prev.json`` (atomically), then the new one is
written to a temporary name, fsynced and renamed over ``manifest.json`` (the commit point), then the
directory is fsynced. A failure at any step (:meth:`Commit.abandon`) removes the objects this commit wrote
that no manifest on disk references and puts ``manifest.prev.json`` back, so the knowledge base is its old
state byte for byte (``tests/test_kb_faults.py`` fails every ``open``, ``write``, ``fsync`` and rename of a
commit in turn).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.faults import crash_point
from proteus.kb.chain import keep_in_history
from proteus.kb.files import (
    EXPANDED_KEYS,
    FIRST_COMMIT,
    FORMAT_VERSION,
    MANIFEST,
    OBJECTS,
    PREV_MANIFEST,
    KBError,
    _atomic_write,
    _fsync_dir,
    _not_writable,
    _now,
    _object_names,
    _refs,
    _sha,
    kept_name,
    log,
    manifest_checksum,
    read_kb_file,
)
from proteus.kb.manifests import previous_manifest
from proteus.kb.objects import ObjectStore
from proteus.kb.packs import is_pack, pack_tasks
from proteus.kb.schema import ClassOwners, head_kind, manifest_problems, object_dirs
from proteus.kb.segments import SEGMENT_TASKS, Segments
from proteus.kb.signing import signature
from proteus.kb.sweep import previous_names
from proteus.tensor_rules import TENSOR_RULES, side_by_side
from proteus.untrusted import file_kind, load_json


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def seal(
    manifest: dict[str, Any],
    current: dict[str, Any],
    sizes: dict[str, int],
    key: bytes | None,
    root: Path,
    parent: str | None,
    pack: Callable[[dict[str, Any]], list[dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``manifest`` (expanded) as a commit replacing ``current`` writes it (the module docstring): the
    manifest.json of format 4 -- its records packed into segments (``pack``: the references, writing the
    segments that changed), ``parent`` the sha256 of the manifest.json it replaces (None for a first commit)
    -- and the same manifest expanded, as the knowledge base then holds it. Signed with ``key`` (unsigned
    without one, with a warning when the knowledge base was signed)."""
    signed = "signature" in manifest
    out = {k: v for k, v in manifest.items() if k not in ("checksum", "signature", *EXPANDED_KEYS)}
    out["format_version"] = FORMAT_VERSION
    kb_id = current.get("kb_id") if isinstance(current.get("kb_id"), str) else manifest.get("kb_id")
    out["kb_id"] = kb_id if isinstance(kb_id, str) else uuid.uuid4().hex
    out["sequence"] = max(_int(current.get("sequence")), _int(manifest.get("sequence"))) + 1
    out["parent"] = parent
    tasks = list(manifest.get("tasks") or [])
    out["num_tasks"] = len(tasks)
    out["segments"] = pack(manifest)
    head = manifest.get("head")
    if isinstance(head, dict) and isinstance(head.get("object"), str):
        out["head"] = {**head, "bytes": sizes.get(head["object"], 0)}
    out["updated"] = _now()
    if key is not None:
        out["signature"] = signature(out, key)
    elif signed:
        log.warning(
            "%s: the knowledge base was signed; this commit, made without a key, is not (sign it again "
            "with `proteus kb sign`, or set $PROTEUS_KB_KEY_FILE)",
            root,
        )
    out["checksum"] = manifest_checksum(out)
    objects = {**sizes, **{ref["object"]: ref["bytes"] for ref in out["segments"]}}
    rows = list(manifest.get("evaluation") or [])
    return out, {**out, "tasks": tasks, "evaluation": rows, "object_bytes": objects}


def upgraded(manifest: dict[str, Any], kb_id: str, sequence: int, sizes: dict[str, int]) -> dict[str, Any]:
    """``manifest`` (content and time stamps unchanged) as ``kb sign`` writes it: format 3 at least (1 and 2
    are brought to 3: its identity, a sequence number, its objects' sizes; kept when it has them), format 4
    as it is on disk (its manifest.json's fields)."""
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 4:
        return {k: v for k, v in manifest.items() if k not in ("checksum", "signature", *EXPANDED_KEYS)}
    out = {k: v for k, v in manifest.items() if k not in ("checksum", "signature")}
    out["format_version"] = 3
    out.setdefault("kb_id", kb_id)
    out.setdefault("sequence", sequence)
    out.setdefault("object_bytes", sizes)
    return out


def packed(manifest: dict[str, Any], objects: ObjectStore) -> dict[str, Any]:
    """``manifest`` (expanded) with the tasks of every full record segment in one pack (format 5,
    :mod:`.packs`): a segment whose records do not all name one pack -- the segment the new task just filled,
    or every full one of a knowledge base written in an older format, or after a change that rewrote its
    tasks -- is packed from its tasks' objects (written with :meth:`~.objects.ObjectStore.write_pack`) and its
    records name the pack; the rest of ``manifest`` is as it was (the same objects)."""
    tasks = manifest.get("tasks")
    if not isinstance(tasks, list) or len(tasks) < SEGMENT_TASKS:
        return manifest
    out: list[Any] | None = None
    together: Any = None  # the learner's names read a pack's tasks at once (:class:`SideBySide`), when needed
    for first in range(0, len(tasks) - SEGMENT_TASKS + 1, SEGMENT_TASKS):
        seg = tasks[first : first + SEGMENT_TASKS]
        if not all(isinstance(r, dict) and isinstance(r.get("object"), str) for r in seg):
            continue  # refused by the checks of the commit, by name
        rel = seg[0]["object"]
        if is_pack(rel) and all(r["object"] == rel for r in seg):
            continue
        shares = [objects.read_task(manifest, r) for r in seg]
        together = together or side_by_side(TENSOR_RULES.rules(head_kind(manifest) or "proteus"))
        try:
            data = pack_tasks(first, shares, together)
        except ValueError as e:
            log.warning("%s: tasks %d .. %d stay unpacked: %s", objects.root, first + 1, first + len(seg), e)
            continue
        prel, psha = objects.write_pack(data)
        out = list(tasks) if out is None else out
        out[first : first + SEGMENT_TASKS] = [{**r, "object": prel, "sha256": psha} for r in seg]
    return manifest if out is None else {**manifest, "tasks": out}


class Commit:
    """One commit of the knowledge base at ``root`` whose objects are ``objects``: :meth:`run` makes a sealed
    manifest the state; ``previous`` is the manifest.json it replaces (its bytes; None for a first
    commit)."""

    def __init__(self, root: Path, objects: ObjectStore, expected_sha: str | None) -> None:
        self.root, self.objects, self.expected_sha = root, objects, expected_sha
        self.previous: bytes | None = None
        self.prev_before: bytes | None = None  # manifest.prev.json before this commit (b"": none)
        self.written: bytes | None = None  # the new manifest once its rename is done (the commit point)
        self.first = False
        self.kept: Path | None = None  # a hard link to the manifest.prev.json this commit replaces
        #: the object references (:func:`_refs`) of the manifest :meth:`prepare` sealed (its tasks are the
        #: expanded manifest's): the store keeps them for the next commit instead of walking them again
        self.refs: list[tuple[str, str, str]] | None = None

    def current(self) -> bytes | None:
        """The bytes of manifest.json now (None if there is none); refuses when another writer committed
        since ``expected_sha`` was read (its state would be lost)."""
        data = read_kb_file(self.root, MANIFEST)
        if data is not None and self.expected_sha is not None and _sha(data) != self.expected_sha:
            raise KBError(
                f"{self.root / MANIFEST}: changed since this knowledge base was opened (another process "
                "committed); open it again under KnowledgeBase.write_lock and redo the change"
            )
        return data

    def sizes(
        self,
        manifest: dict[str, Any],
        known: dict[str, Any],
        known_refs: list[tuple[str, str, str]] | None = None,
    ) -> dict[str, int]:
        """The size of every object ``manifest`` references; refuses one that is neither written nor
        pending (``known``: a manifest whose records were checked, to find sizes in: an object it references
        under the same sha256, with its size, is taken as it is; ``known_refs``: its :func:`_refs`, when the
        caller has them)."""
        out: dict[str, int] = {}
        dirs: tuple[Path, Path] | None = None
        found = known.get("object_bytes")
        committed: dict[str, Any] = found if isinstance(found, dict) else {}
        refs = {rel: sha for _, rel, sha in (known_refs or _refs(known))} if committed else {}
        self.refs = _refs(manifest)
        for label, rel, sha in self.refs:
            if rel in out:  # (the tasks of a pack share its object)
                continue
            n = committed.get(rel)
            if refs.get(rel) == sha and isinstance(n, int) and not isinstance(n, bool):
                out[rel] = n  # checked when it was committed or read
                continue
            dirs = dirs or object_dirs(self.root)
            self.objects.path(manifest, rel, sha, dirs)  # confined, or refused by name
            n = self.objects.size(known, rel)
            if rel not in self.objects.pending:
                try:
                    st = os.lstat(self.root / rel)
                    kind = None if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
                except FileNotFoundError:
                    kind = "missing"
                if kind is not None:
                    raise KBError(
                        f"{self.root / rel}: {kind} ({label}); write it with write_object before committing "
                        "a manifest that references it"
                    )
                n = st.st_size if n is None else n
            out[rel] = n if n is not None else 0
        return out

    def prepare(
        self, manifest: dict[str, Any], current: dict[str, Any], on_disk: bool, key: bytes | None,
        segments: Segments, current_refs: list[tuple[str, str, str]] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
        """``manifest`` (expanded) sealed to replace ``current`` (:func:`seal`; its changed record segments
        written, ``on_disk``: ``current`` is committed), and refused when this proteus could not read it
        back; the manifest.json to write and the same expanded (``current_refs``: ``current``'s
        :func:`_refs`, when the caller has them). Any failure: :meth:`abandon`, then the error."""
        try:
            manifest = packed(manifest, self.objects)  # a segment just filled: its tasks in one pack
            sizes = self.sizes(manifest, current, current_refs)

            def pack(m: dict[str, Any]) -> list[dict[str, Any]]:
                return segments.pack(m, m.get("segments"), self.objects.write_segment, sizes.__getitem__)

            parent = self.expected_sha if on_disk else None
            physical, expanded = seal(manifest, current, sizes, key, self.root, parent, pack)
            checked = current.get("tasks") if on_disk else None
            reused = segments.reused if on_disk else set()
            refuse_unreadable(self.root, expanded, checked, reused, segments.owners)
        except BaseException:
            self.abandon()
            raise
        return physical, expanded

    def begin_first(self, check_free: Any) -> None:
        """Create the directory and write the pending objects of a knowledge base (marked as a first
        commit)."""
        root = self.root
        check_free(root)  # nobody created a knowledge base here since new()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _not_writable(root, e) from None
        _atomic_write(root / FIRST_COMMIT, json.dumps({"pid": os.getpid(), "since": _now()}).encode())
        try:
            (root / OBJECTS).mkdir(exist_ok=True)
        except OSError as e:
            raise _not_writable(root / OBJECTS, e) from None
        _fsync_dir(root)

    def write(
        self, manifest: dict[str, Any], expanded: dict[str, Any], first: bool, check_free: Any
    ) -> bytes:
        """Write the sealed ``manifest`` (``expanded``: the same with its records, :func:`seal`) after the
        objects it needs, the copy of the current state to manifest.prev.json and of that one to
        ``history/``; returns its bytes. Any failure: :meth:`abandon`, then the error."""
        self.first = first
        try:
            if first:
                self.begin_first(check_free)
                self.objects.flush_pending(expanded)
            else:
                self.previous = self.current()
            crash_point("commit:objects")
            if self.previous is not None:
                prev = read_kb_file(self.root, PREV_MANIFEST)
                self.prev_before = b"" if prev is None else prev
                if prev is not None:
                    self._keep_previous()
                keep_in_history(self.root, self.previous)  # kept at its commit, as a rule
                _atomic_write(self.root / PREV_MANIFEST, self.previous)
            data = json.dumps(manifest).encode()
            _atomic_write(self.root / MANIFEST, data, "commit:manifest-tmp")
            self.written = data
        except BaseException:
            self.abandon()
            raise
        self._drop_kept()
        with contextlib.suppress(OSError, ProteusError):  # the next commit keeps it otherwise
            keep_in_history(self.root, data)
        return data

    def _keep_previous(self) -> None:
        """Hard-link manifest.prev.json before it is replaced: putting it back is then one rename, which
        works even when no file can be opened (a failing device)."""
        kept = self.root / kept_name(os.getpid())
        with contextlib.suppress(OSError):
            os.unlink(kept)
        try:
            os.link(self.root / PREV_MANIFEST, kept, follow_symlinks=False)
        except OSError:  # no hard links here: abandon() writes the bytes back instead
            return
        self.kept = kept

    def _drop_kept(self) -> None:
        if self.kept is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.kept)
            self.kept = None

    def sign(self, manifest: dict[str, Any], key: bytes) -> tuple[dict[str, Any], bytes]:
        """``kb sign``: write ``manifest`` (the current state) and manifest.prev.json again, signed with
        ``key`` (formats 1 and 2 brought to 3; format 4's ``parent`` then names the new manifest.prev.json);
        returns the new manifest (expanded as ``manifest`` was) and its bytes."""
        found = manifest.get("kb_id")
        kb_id = found if isinstance(found, str) else uuid.uuid4().hex
        current = upgraded(manifest, kb_id, 1, self.sizes(manifest, manifest))
        if read_kb_file(self.root, PREV_MANIFEST) is not None:
            prev = previous_manifest(self.root)
            if "sequence" not in manifest:  # the first signature of an older knowledge base: 0, then 1
                current["sequence"] = _int(prev.get("sequence")) + 1
            prev = upgraded(prev, kb_id, max(current["sequence"] - 1, 0), self.sizes(prev, prev))
            prev_data = json.dumps(_resigned(prev, key)).encode()
            _atomic_write(self.root / PREV_MANIFEST, prev_data)
            if "parent" in current:  # format 4: the history holds every commit, as it is now
                keep_in_history(self.root, prev_data)
            if "parent" in current:
                current["parent"] = _sha(prev_data)
        current = _resigned(current, key)
        data = json.dumps(current).encode()
        _atomic_write(self.root / MANIFEST, data)
        with contextlib.suppress(OSError, ProteusError):  # the next commit keeps it otherwise
            keep_in_history(self.root, data)
        expanded = {k: manifest[k] for k in EXPANDED_KEYS if k in manifest and "segments" in current}
        return {**current, **expanded}, data

    def abandon(self) -> None:
        """After a failed write or commit: remove the objects written since the last commit that no manifest
        references (the state replaced, the previous one, the new one if it landed: known without reading a
        file, so that this works on a device that keeps failing, and whatever is on disk now); put back
        manifest.prev.json (``prev_before``, empty when there was none) unless the new manifest landed;
        after a failed first commit, the marker and the empty ``objects/`` too. Best effort: it never
        raises."""
        root, landed = self.root, self.written is not None
        keep: set[str] = set()
        for data in (self.previous, self.prev_before, self.written):
            keep |= _names(data)
        try:
            keep |= _names(read_kb_file(root, MANIFEST))
        except (OSError, ProteusError):
            pass
        on_disk = previous_names(root)
        keep |= on_disk or set()
        for rel in self.objects.written:
            if Path(rel).name not in keep:
                with contextlib.suppress(OSError):
                    (root / rel).unlink()
        self.objects.written.clear()
        if not landed and self.prev_before is not None:
            with contextlib.suppress(OSError, KBError):
                if self.kept is not None:
                    os.replace(self.kept, root / PREV_MANIFEST)
                    self._drop_kept()  # a rename onto the same file (not replaced yet) leaves both names
                elif self.prev_before:
                    _atomic_write(root / PREV_MANIFEST, self.prev_before)
                else:
                    (root / PREV_MANIFEST).unlink()
        if landed:
            self._drop_kept()  # else: a kept link that could not be renamed back is left to the sweep
        if self.first and not landed:  # a failed first commit
            with contextlib.suppress(OSError):
                (root / OBJECTS).rmdir()  # only when empty
                (root / FIRST_COMMIT).unlink()


def _names(data: bytes | None) -> set[str]:
    """Names of the objects the manifest ``data`` references (none when it is None or not a manifest)."""
    if not data:
        return set()
    try:
        return _object_names(load_json(data, MANIFEST))
    except (ProteusError, AttributeError):
        return set()


def _resigned(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``manifest`` signed with ``key`` (time stamps kept), with its new checksum."""
    out = {k: v for k, v in manifest.items() if k not in ("checksum", "signature")}
    out["signature"] = signature(out, key)
    out["checksum"] = manifest_checksum(out)
    return out


def refuse_unreadable(
    root: Path, manifest: dict[str, Any], checked: list[Any] | None, kept: Collection[int] = frozenset(),
    owners: ClassOwners | None = None,
) -> None:  # fmt: skip
    """Refuse to commit a manifest this proteus could not read back (``checked``, ``kept``, ``owners``:
    :func:`~proteus.kb.schema.manifest_problems`)."""
    problems = manifest_problems(manifest, checked=checked, kept=kept, owners=owners)
    if problems:
        raise KBError(f"{root}: refusing to commit a manifest this proteus cannot read: {problems[0]}")
