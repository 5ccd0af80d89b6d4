"""Knowledge-base files: layout constants, errors, atomic writes, checksums, and the checks shared by
the store, the lock and the inspection (:mod:`proteus.kb`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.faults import crash_point

log = logging.getLogger("proteus")

FORMAT = "proteus-kb"
#: the format this proteus writes
FORMAT_VERSION = 2
#: the formats this proteus reads (1: no manifest checksum)
READABLE_VERSIONS = (1, 2)

MANIFEST = "manifest.json"
PREV_MANIFEST = "manifest.prev.json"
OBJECTS = "objects"
LOCK = ".lock"
FIRST_COMMIT = ".first-commit"
#: keys the manifest checksum leaves out (besides itself): timestamps, which change no prediction
UNCHECKED_KEYS = ("checksum", "created", "updated")
#: how many times ``open`` starts again when a concurrent commit swept an object while it read
OPEN_ATTEMPTS = 10
_TMP_PREFIXES = (f".{MANIFEST}.tmp-", f".{PREV_MANIFEST}.tmp-")
_WRITE_PROBE = ".write-check-"


class KBError(ProteusError, RuntimeError):
    """A knowledge base that cannot be opened or used as asked (the message names file, task or key)."""


class KBLockedError(KBError):
    """Another process holds the knowledge base's write lock (the message names it and says what to do)."""


class _MissingObject(KBError):
    """An object the manifest references is not on disk (``open`` retries when a commit ran meanwhile)."""


# ====================================================================== small helpers
def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _atomic_write(path: Path, data: bytes, point: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically (a temporary name, fsync, rename, fsync of the directory). On
    any failure the temporary file is removed; an ``OSError`` becomes a :class:`KBError` naming ``path``
    (:func:`_write_error`)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
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
            raise _write_error(path, len(data), e) from None
        raise
    _fsync_dir(path.parent)


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of ``manifest`` without the keys
    :data:`UNCHECKED_KEYS`. The manifest is round-tripped through JSON first, so that what is checked is what
    a reader parses (integer dict keys become strings, tuples lists)."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in UNCHECKED_KEYS}))
    return _sha(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


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
    """The pid in a temporary file's name (``.<name>.tmp-<pid>``), or None."""
    tail = name.rsplit(".tmp-", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


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
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(probe)
    except OSError as e:
        raise _not_writable(where, e) from None
