"""Knowledge-base files: layout constants, errors, atomic writes, checksums, and the checks shared by
the store, the lock and the inspection (:mod:`proteus.kb`).

Every file of a knowledge base is opened like an object: relative to the directory's own descriptor (so it
is inside the knowledge base), with ``O_NOFOLLOW`` (a symbolic link is refused, never followed), without
blocking (a FIFO never hangs a command), and used only when ``fstat`` on the open file says it is a regular
file no larger than its budget (:mod:`proteus.budgets`): :func:`read_kb_file` for both manifests and the
lock's record, :func:`read_object` for objects (compared with the size the manifest records before they
are read), :func:`_atomic_write` and :func:`open_kb_file` for every file written (temporaries created with
``O_EXCL``)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import mmap
import os
import shutil
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proteus.budgets import limit, over
from proteus.errors import ProteusError
from proteus.faults import crash_point
from proteus.untrusted import SpecialFileError, file_kind, read_fd

log = logging.getLogger("proteus")

FORMAT = "proteus-kb"
#: the format this proteus writes (5: the tasks of every full record segment in one pack, read on demand,
#: :mod:`.packs`)
FORMAT_VERSION = 5
#: the formats this proteus reads (1: no manifest checksum; 2: the checksum covers each task's ``learned``;
#: 3: one manifest holding every task's record, with a commit sequence number, the knowledge base's
#: identity, each object's size, and a checksum that leaves out every time stamp; 4: written incrementally
#: -- the task records in segments of :data:`~proteus.kb.segments.SEGMENT_TASKS`, each manifest naming its
#: parent by hash, :mod:`.segments` -- with one object per task)
READABLE_VERSIONS = (1, 2, 3, 4, 5)
#: the keys only format 3 and later write: a manifest of an older version holding one was downgraded by hand
V3_KEYS = ("sequence", "kb_id", "object_bytes")
#: the keys only format 4 writes (a manifest of format 3 holding one was downgraded by hand)
V4_KEYS = ("segments", "parent", "num_tasks")

MANIFEST = "manifest.json"
PREV_MANIFEST = "manifest.prev.json"
OBJECTS = "objects"
#: every earlier commit's manifest, named by the sha256 of its bytes (:mod:`.chain`)
HISTORY = "history"
LOCK = ".lock"
FIRST_COMMIT = ".first-commit"
#: keys the manifest checksum leaves out (besides itself): time stamps, which change no prediction, and
#: (format 3) the knowledge base's random identity; format 3 also leaves out each task's ``learned``
UNCHECKED_KEYS = ("checksum", "created", "updated")
UNCHECKED_KEYS_V3 = (*UNCHECKED_KEYS, "kb_id")
UNCHECKED_TASK_KEYS_V3 = ("learned",)
#: what an expanded manifest of format 4 holds beside the fields of its manifest.json: its segments'
#: records and rows, and every object's size (:mod:`proteus.kb.segments`)
EXPANDED_KEYS = ("tasks", "evaluation", "object_bytes")
#: how many times ``open`` starts again when a concurrent commit swept an object while it read
OPEN_ATTEMPTS = 10
_TMP_PREFIXES = (f".{MANIFEST}.tmp-", f".{PREV_MANIFEST}.tmp-")
_WRITE_PROBE = ".write-check-"


class KBError(ProteusError, RuntimeError):
    """A knowledge base that cannot be opened or used as asked (the message names file, task or key)."""


class KBLockedError(KBError):
    """Another process holds the knowledge base's write lock (the message names it and says what to do)."""


class _MissingObject(KBError):
    """An object the manifest references is not on disk (``open`` retries when a commit ran meanwhile);
    ``manifest``: the manifest's bytes that referenced it, where the raiser knows them."""

    manifest: bytes | None = None


# ====================================================================== small helpers
def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: a file's bytes: one buffer, or several written in turn (:func:`proteus.kb.tensors.serialize_chunks`)
Data = bytes | Sequence[memoryview]


def _parts(data: Data) -> Sequence[bytes | memoryview]:
    return (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data


def data_sha(data: Data) -> str:
    """sha256 of ``data``'s bytes (several buffers hashed in turn: never joined)."""
    h = hashlib.sha256()
    for part in _parts(data):
        h.update(part)
    return h.hexdigest()


def data_size(data: Data) -> int:
    return sum(memoryview(part).nbytes for part in _parts(data))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _shown_bytes(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    return f"{n} bytes ({n / 1e6:.1f} MB)" if n >= 100_000 else f"{n} bytes"


def _write_error(path: Path, nbytes: int, e: OSError) -> KBError:
    """The error of a failed write of ``nbytes`` to ``path``: for a full disk, what it tried to write and
    the space left (``shutil.disk_usage``)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free: int | None = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        return KBError(
            f"{path}: no space left on device: writing {_shown_bytes(nbytes)} with {_shown_bytes(free)} free "
            "on its file system; nothing was committed and this commit's files were removed: free some "
            "space and run the command again"
        )
    reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return KBError(
        f"{path}: cannot write {_shown_bytes(nbytes)} ({reason}); nothing was committed and this commit's "
        "files were removed"
    )


def _write_all(fd: int, data: Data) -> None:
    for part in _parts(data):
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view) :]


def open_kb_file(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode: int = 0o666) -> int:
    """Open a file of a knowledge base for writing: never through a symbolic link, never blocking, and
    only a regular file (``fstat`` on the open file); with ``O_EXCL`` a leftover of the same name (a
    temporary of a killed process with this pid) is removed first."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        if not flags & os.O_EXCL:
            raise
        os.unlink(path)
        fd = os.open(path, flags, mode)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SpecialFileError(errno.EINVAL, f"not a regular file ({file_kind(st.st_mode)})", str(path))
    return fd


def _atomic_write(path: Path, data: Data, point: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically (a temporary name created with ``O_EXCL | O_NOFOLLOW``, fsync,
    rename, fsync of the directory). On any failure the temporary file is removed; an ``OSError`` becomes a
    :class:`KBError` naming ``path`` (:func:`_write_error`)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = open_kb_file(tmp)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if point:
            crash_point(point)  # tests: killed with the data in its temporary file (proteus.faults)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _write_error(path, data_size(data), e) from None
        raise
    _fsync_dir(path.parent)


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of ``manifest`` without its time stamps.
    Format 3 (and later) leaves out :data:`UNCHECKED_KEYS_V3` and each task's ``learned``: the checksum
    covers content only, so two identical runs have the same checksum. Formats 1 and 2 leave out
    :data:`UNCHECKED_KEYS` only (each task's ``learned`` is inside). The manifest is round-tripped through
    JSON first, so that what is checked is what a reader parses (integer dict keys become strings, tuples
    lists)."""
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 4:
        # format 4: what manifest.json holds (an expanded manifest's records are in its segments, which the
        # manifest names by hash)
        # (``parent`` is the hash of the parent's bytes, time stamps included: the signature covers it)
        body = {k: v for k, v in manifest.items() if k not in (*UNCHECKED_KEYS_V3, "parent", *EXPANDED_KEYS)}
        segments = body.get("segments")
        if isinstance(segments, list):  # a segment by its content (time stamps left out), not its bytes
            body["segments"] = [s.get("content") if isinstance(s, dict) else s for s in segments]
    elif isinstance(version, int) and not isinstance(version, bool) and version >= 3:
        body = {k: v for k, v in manifest.items() if k not in UNCHECKED_KEYS_V3}
        tasks = body.get("tasks")
        if isinstance(tasks, list):
            body["tasks"] = [
                {k: v for k, v in t.items() if k not in UNCHECKED_TASK_KEYS_V3} if isinstance(t, dict) else t
                for t in tasks
            ]
    else:
        body = {k: v for k, v in manifest.items() if k not in UNCHECKED_KEYS}
    body = json.loads(json.dumps(body))
    return _sha(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# ====================================================================== confined reads
def _dir_fd(path: Path, follow: bool = True) -> int:
    """A descriptor of directory ``path`` (``follow=False``: refused when it is a symbolic link)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    return os.open(path, flags)


def _refused_file(path: Path, e: OSError) -> KBError:
    what = e.strerror or str(e)
    return KBError(
        f"{path}: {what}; every file of a knowledge base must be a regular file inside it: restore it "
        "(or remove it) and run the command again"
    )


def read_kb_file(root: Path, name: str, budget: str = "kb_manifest_bytes") -> bytes | None:
    """The bytes of file ``name`` (no ``/``) of the knowledge base at ``root``, or None when it is missing:
    opened relative to the directory, without following a symbolic link, without blocking, and refused
    (:class:`KBError`) unless it is a regular file; over ``budget`` bytes: a
    :class:`~proteus.budgets.BudgetError` before anything is read."""
    path = root / name
    try:
        dfd = _dir_fd(root)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise _is_file_error(root) from None
    except OSError as e:
        raise KBError(f"{root}: cannot be read ({e.strerror or e})") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused_file(path, SpecialFileError(errno.ELOOP, "a symbolic link")) from None
        raise KBError(f"{path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(dfd)
    try:
        return read_fd(fd, budget, str(path))
    except SpecialFileError as e:
        raise _refused_file(path, e) from None
    except OSError as e:
        raise KBError(f"{path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def kb_file_kind(root: Path, name: str) -> str | None:
    """What ``root/name`` is ("a regular file", "a FIFO (named pipe)", "a symbolic link" ...) without
    following a link; None when it does not exist."""
    try:
        return file_kind(os.lstat(root / name).st_mode)
    except OSError:
        return None


_CHUNK = 1 << 20


def read_object(root: Path, rel: str, sha: str, size: int | None, budget: str = "kb_object_bytes") -> bytes:
    """The bytes of object ``rel`` (``objects/<name>``, a name :func:`~proteus.kb.schema.object_path`
    accepted) checked against ``sha``: ``objects/`` and the file opened without following a symbolic link
    and without blocking; refused unless it is a regular file whose size is the one its manifest records
    (``size``; None for a manifest of format 2 or older) and at most ``kb_object_bytes``, all before any
    byte is read. An object of unknown size is hashed as a stream first, and read only when its sha256
    matches. :class:`KBError` naming the file (:class:`_MissingObject` when it does not exist)."""
    shown = root / rel
    objects, name = rel.split("/", 1)
    try:
        dfd = _dir_fd(root / objects, follow=False)
    except FileNotFoundError:
        raise _MissingObject(f"{shown}: missing from the knowledge base") from None
    except OSError as e:
        raise KBError(f"{root / objects}: cannot be read ({e.strerror or e})") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise _MissingObject(f"{shown}: missing from the knowledge base") from None
    except OSError as e:
        what = "a symbolic link, which is not followed" if e.errno == errno.ELOOP else e.strerror or str(e)
        raise KBError(f"{shown}: cannot be read ({what})") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KBError(f"{shown}: not a regular file ({file_kind(st.st_mode)})")
        if size is not None and st.st_size != size:
            raise KBError(
                f"{shown}: size mismatch (the manifest records {size} bytes, the file has {st.st_size}): the "
                "file was truncated or replaced"
            )
        cap = limit(budget)
        if st.st_size > cap:
            raise over(budget, str(shown), st.st_size, cap)
        if size is None:
            _check_sha(shown, sha, _stream_sha(fd))
            os.lseek(fd, 0, os.SEEK_SET)
        data = _read_exactly(fd, st.st_size, shown)
    except OSError as e:
        raise KBError(f"{shown}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    _check_sha(shown, sha, _sha(data))
    return data


def map_object(root: Path, rel: str, sha: str, size: int | None, trusted: Any = None) -> mmap.mmap:
    """Object ``rel`` memory-mapped (private, copy-on-write: its tensors are views of the page cache, not
    copies, and a write to one never reaches the file) and checked against ``sha``: opened, compared with
    its recorded size and its budget and hashed as :func:`read_object` does, before any tensor is made of
    it (hashed as a stream, so that checking it holds one chunk, not the file). An object unlinked later (a
    sweep) stays readable through its mapping. ``trusted``: a :class:`~proteus.kb.verified.Verified`
    record; a file it trusts is not hashed, one hashed is added."""
    shown = root / rel
    objects, name = rel.split("/", 1)
    try:
        dfd = _dir_fd(root / objects, follow=False)
    except FileNotFoundError:
        raise _MissingObject(f"{shown}: missing from the knowledge base") from None
    except OSError as e:
        raise KBError(f"{root / objects}: cannot be read ({e.strerror or e})") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise _MissingObject(f"{shown}: missing from the knowledge base") from None
    except OSError as e:
        what = "a symbolic link, which is not followed" if e.errno == errno.ELOOP else e.strerror or str(e)
        raise KBError(f"{shown}: cannot be read ({what})") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KBError(f"{shown}: not a regular file ({file_kind(st.st_mode)})")
        if size is not None and st.st_size != size:
            raise KBError(
                f"{shown}: size mismatch (the manifest records {size} bytes, the file has {st.st_size}): the "
                "file was truncated or replaced"
            )
        cap = limit("kb_object_bytes")
        if st.st_size > cap:
            raise over("kb_object_bytes", str(shown), st.st_size, cap)
        if st.st_size == 0:
            raise KBError(f"{shown}: empty, not a safetensors file")
        hashed = trusted is None or not trusted.trusts(rel, sha, st)
        if hashed:  # read as a stream, a chunk at a time: the whole file never resident for the check
            _check_sha(shown, sha, _stream_sha(fd))
        mapped = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise KBError(f"{shown}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if hashed and trusted is not None:
        trusted.add(rel, sha, st)
    return mapped


def _stream_sha(fd: int) -> str:
    h = hashlib.sha256()
    while chunk := os.read(fd, _CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _read_exactly(fd: int, n: int, shown: Path) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 30))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got != n or os.read(fd, 1):
        raise KBError(f"{shown}: changed size while it was read; run the command again")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def recorded_size(manifest: dict[str, Any], rel: str) -> int | None:
    """The size ``manifest`` records for object ``rel`` (``object_bytes``, format 3), or None."""
    sizes = manifest.get("object_bytes")
    n = sizes.get(rel) if isinstance(sizes, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _check_sha(shown: Path, expected: str, actual: str) -> None:
    if actual != expected:
        raise KBError(
            f"{shown}: checksum mismatch (expected {expected[:16]}…, found {actual[:16]}…): "
            "the file was truncated or edited"
        )


def _pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (a zombie, killed but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return not (fields and fields[0] == "Z")


def _tmp_pid(name: str) -> int | None:
    """The pid in a temporary file's name (``.<name>.tmp-<pid>``, ``.<name>.tmp-<pid>.kept``), or None."""
    tail = name.rsplit(".tmp-", 1)
    pid = tail[1].split(".", 1)[0] if len(tail) == 2 else ""
    return int(pid) if pid.isdigit() else None


def kept_name(pid: int) -> str:
    """The hard link to manifest.prev.json that a commit keeps while it replaces it (so that putting it
    back is one rename, which needs no file to be opened)."""
    return f".{PREV_MANIFEST}.tmp-{pid}.kept"


def _kb_files(root: Path) -> list[str]:
    """The knowledge-base files in ``root`` other than ``manifest.json`` (the lock file is not one)."""
    if not root.is_dir():
        return []
    found = [f"{OBJECTS}/"] if (root / OBJECTS).is_dir() else []
    for name in sorted(p.name for p in root.iterdir()):
        if (
            name.endswith(".safetensors")
            or name in (PREV_MANIFEST, FIRST_COMMIT)
            or name.startswith(_TMP_PREFIXES)
        ):
            found.append(name)
    return found


def _interrupted_first_commit(root: Path, files: list[str]) -> bool:
    """Whether ``files`` (no manifest.json) are only what an interrupted first commit leaves."""
    allowed = {f"{OBJECTS}/", FIRST_COMMIT}
    return FIRST_COMMIT in files and all(f in allowed or f.startswith(f".{MANIFEST}.tmp-") for f in files)


def _shown(files: list[str]) -> str:
    return ", ".join(files[:4]) + (", …" if len(files) > 4 else "")


def _damaged(root: Path, files: list[str], action: str) -> KBError:
    if (root / PREV_MANIFEST).is_file():
        fix = (
            f"Restore manifest.json (manifest.prev.json holds the previous commit: copy it to "
            f"{root / MANIFEST}) or choose another --kb"
        )
    else:
        fix = "Restore manifest.json (there is no manifest.prev.json) or choose another --kb"
    return KBError(
        f"{root}: holds knowledge-base files ({_shown(files)}) but no manifest.json; {action}. {fix}"
    )


def _not_writable(where: Path, e: OSError) -> KBError:
    reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return KBError(
        f"{where}: not writable ({reason}); free some space, fix its permissions, or choose another --kb"
    )


def _is_file_error(root: Path) -> KBError:
    return KBError(f"{root}: is a file, not a knowledge-base directory; choose another --kb")


def _refs(manifest: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, relative path, sha256) of every object ``manifest`` references (malformed records skipped)."""
    out = []
    tasks = manifest.get("tasks")
    for i, t in enumerate(tasks if isinstance(tasks, list) else []):
        if isinstance(t, dict) and isinstance(t.get("object"), str) and isinstance(t.get("sha256"), str):
            out.append((f"task index {i}", t["object"], t["sha256"]))
    head = manifest.get("head")
    if isinstance(head, dict) and isinstance(head.get("object"), str) and isinstance(head.get("sha256"), str):
        out.append(("head", head["object"], head["sha256"]))
    return out


def _segment_refs(manifest: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, relative path, sha256) of every record segment a manifest of format 4 references."""
    segments = manifest.get("segments")
    out = []
    for i, s in enumerate(segments if isinstance(segments, list) else []):
        if isinstance(s, dict) and isinstance(s.get("object"), str) and isinstance(s.get("sha256"), str):
            out.append((f"record segment {i}", s["object"], s["sha256"]))
    return out


def _object_names(manifest: dict[str, Any]) -> set[str]:
    """The file names of every object ``manifest`` references, its record segments included (what a sweep
    keeps)."""
    return _ref_names(_refs(manifest) + _segment_refs(manifest))


def _ref_names(refs: list[tuple[str, str, str]]) -> set[str]:
    """The file names of the objects ``refs`` (:func:`_refs`, :func:`_segment_refs`) reference."""
    return {rel.rpartition("/")[2] for _, rel, _ in refs}


# ====================================================================== the writers' lock


def check_writable(root: str | Path) -> None:
    """Raise :class:`KBError` unless a file can be created, written, synced and removed in ``root``
    (created with its parents if missing) and in its ``objects/``: a writer calls it before any expensive
    work."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise _is_file_error(root)
    where = root
    try:
        root.mkdir(parents=True, exist_ok=True)
        for where in [root, root / OBJECTS] if (root / OBJECTS).is_dir() else [root]:
            probe = where / f"{_WRITE_PROBE}{os.getpid()}"
            fd = open_kb_file(probe, mode=0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(probe)
    except OSError as e:
        raise _not_writable(where, e) from None
