"""The objects of one knowledge base as one process sees them (:class:`ObjectStore`): the verified snapshot
that :meth:`~proteus.kb.store.KnowledgeBase.read` serves, the objects of a knowledge base not yet on disk,
the content keys of the objects written (:mod:`.content`), and the files written since the last commit
(removed if it fails).

Reading goes through :func:`~proteus.kb.files.read_object`: the path is checked first
(:func:`~proteus.kb.schema.object_path`: a name the store writes, inside ``objects/``), then the file is
opened without following a link or blocking, compared with the size its manifest records, and its sha256
checked.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from proteus.kb.content import ContentKeys
from proteus.kb.files import (
    MANIFEST,
    OBJECTS,
    Data,
    KBError,
    _atomic_write,
    _refs,
    _segment_refs,
    _sha,
    _write_error,
    data_sha,
    data_size,
    map_object,
    read_object,
    recorded_size,
)
from proteus.kb.packs import PACK_KIND, Pack, StoredTensors, is_pack
from proteus.kb.schema import object_dirs, object_path, task_label
from proteus.kb.tensors import Obj, check_objects, serialize_chunks, shapes_of, tensors_of
from proteus.kb.verified import Verified, state_key

#: one part of a learner's state: its JSON record (in the manifest) and its tensors (one object)
Part = tuple[dict[str, Any], dict[str, torch.Tensor]]
#: a stored part as read back: its record and its tensors (its object's, or its share of a pack: a mapping
#: whose tensors are made when asked for, :class:`~proteus.kb.packs.StoredTensors`)
StoredPart = tuple[dict[str, Any], Mapping[str, torch.Tensor]]


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (safetensors dtype name, shape): from the header of stored tensors (no view made)."""
    return tensors.shapes() if isinstance(tensors, StoredTensors) else shapes_of(dict(tensors))


class ObjectStore:
    """The objects of the knowledge base at ``root`` (see the module docstring). ``on_disk`` is False for
    a knowledge base from :meth:`~proteus.kb.store.KnowledgeBase.new` until its first commit: its objects
    wait in :attr:`pending`."""

    def __init__(self, root: Path, on_disk: bool = True, verified: Verified | None = None) -> None:
        self.root = root
        self.on_disk = on_disk
        #: rel -> (sha256, its verified mapping) of the snapshot ``open`` read: the page cache, not a copy
        self.cache: dict[str, tuple[str, mmap.mmap]] = {}
        #: objects of a knowledge base not yet on disk, written at its first commit
        self.pending: dict[str, bytes] = {}
        #: content key -> (rel, sha256) of the objects written: a commit of a long stream serialises only
        #: the objects whose content changed
        self.known: dict[str, tuple[str, str]] = {}
        #: objects written since the last commit (removed if it fails)
        self.written: list[str] = []
        #: rel -> bytes of every object this process wrote or read
        self.sizes: dict[str, int] = {}
        self.keys = ContentKeys()  # each unchanged tensor hashed once, each unchanged object keyed once
        #: rel -> (sha256, the pack decoded: its header parsed once for every task it holds)
        self.packs: dict[str, tuple[str, Pack]] = {}
        #: the files and states this proteus verified or wrote before (:mod:`.verified`)
        self.verified = verified if verified is not None else Verified(root)

    # ------------------------------------------------------------------ reading
    def path(
        self,
        manifest: dict[str, Any],
        rel: str,
        sha: str | None = None,
        dirs: tuple[Path, Path] | None = None,
    ) -> Path:
        """The resolved path of object ``rel`` (refused unless inside ``objects/``, naming its record);
        ``dirs``: :func:`~proteus.kb.schema.object_dirs`, for many objects."""
        try:
            return object_path(self.root, rel, sha, dirs)
        except KBError as e:
            label = next((label for label, r, _ in _refs(manifest) if r == rel), "not in the manifest")
            raise KBError(f"{self.root / MANIFEST}: {label}: {e}") from None

    def load(self, manifest: dict[str, Any], rel: str, sha: str) -> bytes:
        """The bytes of object ``rel``, verified against ``sha`` (and the size ``manifest`` records)."""
        if rel in self.pending:
            data = self.pending[rel]
            if _sha(data) != sha:
                raise KBError(f"{self.root / rel}: checksum mismatch (expected {sha[:16]}…)")
            return data
        self.path(manifest, rel, sha)
        data = read_object(self.root, rel, sha, recorded_size(manifest, rel))
        self.sizes[rel] = len(data)
        return data

    def mapped(
        self, manifest: dict[str, Any], rel: str, sha: str, dirs: tuple[Path, Path] | None = None
    ) -> mmap.mmap:
        """Object ``rel`` memory-mapped and checked (:func:`~proteus.kb.files.map_object`); a pending one's
        bytes are mapped anonymously. ``dirs``: :meth:`path`."""
        if rel in self.pending:
            data = self.load(manifest, rel, sha)
            mapped = mmap.mmap(-1, len(data))
            mapped[:] = data
            return mapped
        self.path(manifest, rel, sha, dirs)
        mapped = map_object(self.root, rel, sha, recorded_size(manifest, rel), self.verified)
        self.sizes[rel] = len(mapped)
        return mapped

    def verify(self, manifest: dict[str, Any]) -> None:
        """Map every object ``manifest`` references and check it (a file verified before and unchanged
        since is not hashed again: :mod:`.verified`); keep the mappings as the snapshot (a later sweep
        cannot take a mapped file away)."""
        dirs = object_dirs(self.root)
        cache: dict[str, tuple[str, mmap.mmap]] = {}
        for _, rel, sha in _refs(manifest):
            if cache.get(rel, ("",))[0] != sha:  # (the tasks of a pack share its object)
                cache[rel] = (sha, self.mapped(manifest, rel, sha, dirs))
        self.cache = cache
        self.verified.save(set(self.cache) | {rel for _, rel, _ in _segment_refs(manifest)})

    def read(
        self, manifest: dict[str, Any], rel: str, sha: str, checked: bool = False
    ) -> dict[str, torch.Tensor]:
        """The tensors of object ``rel``, views of its mapping (the page cache, copy-on-write): from the
        snapshot, or mapped now. ``checked``: its content (``sha``) belongs to a state that passed the rules
        before (:mod:`.verified`), so its header is not checked again (:func:`~.tensors.tensors_of`)."""
        cached = self.cache.get(rel)
        mapped = cached[1] if cached is not None and cached[0] == sha else self.mapped(manifest, rel, sha)
        try:
            return tensors_of(mapped, checked)
        except ValueError as e:
            raise KBError(f"{self.root / rel}: not a valid safetensors file ({e})") from None

    def read_task(
        self, manifest: dict[str, Any], record: dict[str, Any], checked: bool = False
    ) -> StoredTensors:
        """The tensors of the task whose record is ``record``: its object's, or its share of the pack its
        record names (format 5, :mod:`.packs`; the pack's header parsed once for all its tasks), each a view
        of the mapped file made when asked for. ``checked``: :meth:`read`."""
        rel, sha = record["object"], record["sha256"]
        if not is_pack(rel):
            cached = self.cache.get(rel)
            mapped = cached[1] if cached is not None and cached[0] == sha else self.mapped(manifest, rel, sha)
            try:
                return StoredTensors.of_object(mapped, checked)
            except ValueError as e:
                raise KBError(f"{self.root / rel}: not a valid safetensors file ({e})") from None
        found = self.packs.get(rel)
        if found is None or found[0] != sha:
            cached = self.cache.get(rel)
            mapped = cached[1] if cached is not None and cached[0] == sha else self.mapped(manifest, rel, sha)
            try:
                found = self.packs[rel] = (sha, Pack(mapped, checked, str(self.root / rel)))
            except ValueError as e:
                raise KBError(f"{self.root / rel}: not a valid pack ({e})") from None
        pack, index = found[1], record.get("index")
        slot = index - pack.first if isinstance(index, int) else -1
        if not 0 <= slot < pack.count:
            raise KBError(
                f"{self.root / rel}: holds tasks {pack.first + 1} .. {pack.first + pack.count}, not task "
                f"{index + 1 if isinstance(index, int) else index!r} whose record names it"
            )
        return pack.task(slot)

    def checked_state(
        self, manifest: dict[str, Any], consequence: str, learner: str | None = None
    ) -> tuple[list[StoredPart], Part | None]:
        """Every task's tensors (:meth:`read_task`) and the head's, checked by
        :func:`~proteus.kb.tensors.check_objects` (dtypes, shapes, finite values: ``learner``'s rules): a
        :class:`KBError` with the first problem and ``consequence``."""
        key = state_key(manifest, learner or "")
        checked = self.verified.checked(key)  # checked before, or committed by this proteus: :mod:`.verified`
        tasks: list[StoredPart] = [(t, self.read_task(manifest, t, checked)) for t in manifest["tasks"]]
        head = manifest.get("head")
        state = (head["meta"], self.read(manifest, head["object"], head["sha256"], checked)) if head else None
        if not checked:
            objects = [
                Obj(task_label(i), str(self.root / t["object"]), t, i, _shapes(x), x)
                for i, (t, x) in enumerate(tasks)
            ]
            if head and state:
                path = str(self.root / head["object"])
                objects.append(Obj("head", path, head["meta"], None, shapes_of(state[1]), state[1]))
            bad = check_objects(manifest["tasks"], objects, learner)
            if bad:
                raise KBError(
                    f"{bad[0]}; {consequence} (`proteus kb verify {self.root}` lists every problem)"
                )
            self.verified.check(key)
            self.verified.save()
        return tasks, state

    def size(self, manifest: dict[str, Any], rel: str) -> int | None:
        """The bytes of object ``rel`` as known here, recorded in ``manifest``, or on disk (None: missing
        or not a regular file)."""
        if rel in self.pending:
            return len(self.pending[rel])
        if rel in self.sizes:
            return self.sizes[rel]
        n = recorded_size(manifest, rel)
        if n is not None:
            return n
        try:
            st = os.lstat(object_path(self.root, rel))
        except (OSError, KBError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    # ------------------------------------------------------------------ writing
    def write(self, kind: str, tensors: dict[str, torch.Tensor], reuse: bool = True) -> tuple[str, str]:
        """Write a content-addressed object (in memory while the knowledge base is not on disk); returns
        (rel, sha256). ``reuse``: look its content up among the objects written before serialising it."""
        key = self.keys(kind, tensors) if reuse else None
        known = None if key is None else self.known.get(key)
        if known is not None and (
            known[0] in self.pending or (self.on_disk and (self.root / known[0]).is_file())
        ):
            return known
        chunks = serialize_chunks(tensors)  # hashed and written in turn: never joined on disk
        sha = data_sha(chunks)
        rel = f"{OBJECTS}/{kind}-{sha[:16]}.safetensors"
        self.sizes[rel] = data_size(chunks)
        if key is not None:
            self.known[key] = (rel, sha)
        if not self.on_disk:
            self.pending[rel] = b"".join(chunks)
        elif not (self.root / rel).exists():
            self.write_new(rel, chunks, sha)
        return rel, sha

    def write_pack(self, data: bytes) -> tuple[str, str]:
        """Write a pack's bytes (format 5, :mod:`.packs`) as a content-addressed object (in memory while the
        knowledge base is not on disk); returns (rel, sha256)."""
        sha = _sha(data)
        rel = f"{OBJECTS}/{PACK_KIND}-{sha[:16]}.safetensors"
        self.sizes[rel] = len(data)
        if not self.on_disk:
            self.pending[rel] = data
        elif not (self.root / rel).exists():
            self.write_new(rel, data, sha)
        return rel, sha

    def write_segment(self, data: bytes) -> tuple[str, str]:
        """Write a record segment's bytes (format 4, :mod:`.segments`) as a content-addressed object (in
        memory while the knowledge base is not on disk); returns (rel, sha256)."""
        sha = _sha(data)
        rel = f"{OBJECTS}/records-{sha[:16]}.json"
        self.sizes[rel] = len(data)
        if not self.on_disk:
            self.pending[rel] = data
        elif not (self.root / rel).exists():
            self.write_new(rel, data, sha)
        return rel, sha

    def write_new(self, rel: str, data: Data, sha: str | None = None) -> None:
        """Write object ``rel`` to disk (atomically) and remember it as written since the last commit (and
        its file as verified, given its ``sha``: :mod:`.verified`)."""
        path = self.root / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _write_error(path, data_size(data), e) from None
        _atomic_write(path, data, "commit:tmp")
        self.written.append(rel)
        if sha is not None:
            self.verified.added(rel, sha)

    def flush_pending(self, manifest: dict[str, Any]) -> None:
        """At a first commit: write the pending objects ``manifest`` references."""
        for _, rel, sha in _refs(manifest) + _segment_refs(manifest):
            data = self.pending.get(rel)
            if data is not None and not (self.root / rel).exists():
                self.write_new(rel, data, sha)

    def settle(self, manifest: dict[str, Any], refs: list[tuple[str, str, str]] | None = None) -> None:
        """After a commit of ``manifest``: nothing is pending or written any more; the snapshot and the
        content keys keep only what it references (``refs``: its objects' and segments' references, when
        the caller has them)."""
        self.written.clear()
        self.pending.clear()
        self.on_disk = True
        keep = {
            rel: sha
            for _, rel, sha in (refs if refs is not None else _refs(manifest) + _segment_refs(manifest))
        }
        self.cache = {rel: v for rel, v in self.cache.items() if keep.get(rel) == v[0]}
        self.packs = {rel: v for rel, v in self.packs.items() if keep.get(rel) == v[0]}
        self.known = {key: v for key, v in self.known.items() if keep.get(v[0]) == v[1]}
