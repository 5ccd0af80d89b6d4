"""What this proteus has verified of a knowledge base, remembered from one process to the next.

Opening a knowledge base verifies it (:meth:`~proteus.kb.store.KnowledgeBase.open`): every object's sha256
against its manifest, and, before a learner loads it, every record and tensor against the learner's rules
(:func:`~proteus.kb.tensors.check_objects`). Both read every byte, so on a long stream an open costs in
proportion to everything ever learned. Like git's index, the store remembers what it verified:

* per object file, the identity of the file it hashed -- device, inode, size, modification and change
  times (nanoseconds) -- with the sha256 it found. A later open hashes only the files whose identity
  changed: any write, rename, ``chmod`` or copy gives a file a new change time, which no program can set
  back;
* per state, that the state passed the rules: its manifest's checksum (which covers every record, and
  every object by its sha256), the learner's rules that applied and the proteus version. A state this
  proteus committed is one it wrote, and is recorded so as well.

The record lives outside the knowledge base -- ``$PROTEUS_CACHE_DIR/verified``, else
``$XDG_CACHE_HOME/proteus/verified``, else ``~/.cache/proteus/verified``; one file per knowledge base,
named by its resolved path -- so nobody who can write a knowledge base can vouch for it; a knowledge base
received from elsewhere is verified in full at its first open. ``PROTEUS_VERIFY=always`` verifies
everything at every open and remembers nothing; ``proteus kb verify`` always verifies everything. A record
that cannot be read or written is ignored (everything is verified).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from proteus._version import __version__

__all__ = ["ENV_DIR", "ENV_MODE", "Verified", "cache_dir", "state_key"]

#: where the records go (a directory; ``verified/`` is made under it)
ENV_DIR = "PROTEUS_CACHE_DIR"
#: ``always``: verify every object and state at every open, remember nothing
ENV_MODE = "PROTEUS_VERIFY"
#: the format of a record file
_FORMAT = 1
#: the states a record remembers as checked (the latest ones)
_STATES = 16
#: the record segments a record remembers as checked (the latest ones: a knowledge base of 131,072 tasks)
_SEGMENTS = 4096


def cache_dir() -> Path | None:
    """The directory of the records (module docstring); None when ``PROTEUS_VERIFY=always``."""
    if os.environ.get(ENV_MODE, "").strip().lower() == "always":
        return None
    base = os.environ.get(ENV_DIR)
    if base:
        return Path(base) / "verified"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "proteus" / "verified"


def state_key(manifest: dict[str, Any], learner: str) -> str | None:
    """What identifies a state checked under ``learner``'s rules (None: a manifest without a checksum)."""
    checksum = manifest.get("checksum")
    if not isinstance(checksum, str):
        return None
    return hashlib.sha256(f"{__version__}\0{learner}\0{checksum}".encode()).hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class Verified:
    """The record of the knowledge base at ``root`` (read when first needed, written by :meth:`save`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        directory = cache_dir()
        name = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:32]
        self.path = None if directory is None else directory / f"{name}.json"
        self._objects: dict[str, list[Any]] | None = None
        self._states: list[str] = []
        #: the sha256 of every record segment whose content passed its checks (in the order checked) -> its
        #: content digest
        self._segments: dict[str, str] = {}
        self.dirty = False

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _load(self) -> dict[str, list[Any]]:
        if self._objects is None:
            self._objects = {}
            data: Any = None
            if self.path is not None:
                with contextlib.suppress(OSError, ValueError):
                    data = json.loads(self.path.read_bytes())
            if (
                isinstance(data, dict)
                and data.get("format") == _FORMAT
                and data.get("proteus") == __version__
            ):
                objects, states = data.get("objects"), data.get("states")
                if isinstance(objects, dict):
                    self._objects = {k: v for k, v in objects.items() if isinstance(v, list) and len(v) == 6}
                if isinstance(states, list):
                    self._states = [s for s in states if isinstance(s, str)][-_STATES:]
                segments = data.get("segments")
                if isinstance(segments, dict):
                    items = [(k, v) for k, v in segments.items() if isinstance(k, str) and isinstance(v, str)]
                    self._segments = dict(items[-_SEGMENTS:])
        return self._objects

    def trusts(self, rel: str, sha: str, st: os.stat_result) -> bool:
        """Whether object ``rel``'s file, of identity ``st``, was hashed to ``sha`` and is unchanged since."""
        if not self.enabled:
            return False
        entry = self._load().get(rel)
        return entry is not None and entry[0] == sha and entry[1:] == _identity(st)

    def add(self, rel: str, sha: str, st: os.stat_result) -> None:
        """Object ``rel``'s file, of identity ``st``, holds content of sha256 ``sha``."""
        if self.enabled:
            entry = [sha, *_identity(st)]
            objects = self._load()
            if objects.get(rel) != entry:
                objects[rel] = entry
                self.dirty = True

    def added(self, rel: str, sha: str) -> None:
        """:meth:`add` for a file just written at ``rel``."""
        if self.enabled:
            with contextlib.suppress(OSError):
                self.add(rel, sha, os.stat(self.root / rel, follow_symlinks=False))

    def checked(self, key: str | None) -> bool:
        """Whether the state ``key`` (:func:`state_key`) passed the rules before."""
        self._load()
        return key is not None and self.enabled and key in self._states

    def check(self, key: str | None) -> None:
        """The state ``key`` passed the rules (or was written by this proteus)."""
        self._load()
        if key is not None and self.enabled and key not in self._states:
            self._states = [*self._states, key][-_STATES:]
            self.dirty = True

    def wrote(self, manifest: dict[str, Any], learner: str, rels: set[str]) -> None:
        """The state ``manifest`` was committed by this proteus: it passed ``learner``'s rules and the fields
        every manifest must have; the record keeps the objects ``rels`` it references (and is saved)."""
        self.check(state_key(manifest, learner))
        self.check(state_key(manifest, ""))
        self.save(rels)

    def segment_checked(self, sha: str, content: str) -> bool:
        """Whether the record segment whose bytes have sha256 ``sha`` passed its checks before (its fields,
        the records' count) with content digest ``content``: the same bytes need only be parsed."""
        self._load()
        return self.enabled and self._segments.get(sha) == content

    def segment_ok(self, sha: str, content: str) -> None:
        """The record segment whose bytes have sha256 ``sha`` passed its checks, its content digest
        ``content`` (or it was written here)."""
        self._load()
        if self.enabled and self._segments.get(sha) != content:
            self._segments[sha] = content
            while len(self._segments) > _SEGMENTS:
                del self._segments[next(iter(self._segments))]
            self.dirty = True

    def save(self, keep: set[str] | None = None) -> None:
        """Write the record (atomically), keeping only the objects ``keep`` (None: all) when it changed."""
        if not self.dirty or self.path is None or self._objects is None:
            return
        objects = self._objects if keep is None else {k: v for k, v in self._objects.items() if k in keep}
        body = {"format": _FORMAT, "proteus": __version__, "root": str(self.root), "objects": objects,
                "states": self._states, "segments": self._segments}  # fmt: skip
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
            self.dirty = False
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
