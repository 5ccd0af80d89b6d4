"""One writer at a time: an exclusive ``fcntl.flock`` on ``<kb>/.lock`` held for the whole
learn-and-commit; a killed holder's lock is released by the kernel and taken over with a log line."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.kb.files import (
    LOCK,
    KBError,
    KBLockedError,
    _is_file_error,
    _not_writable,
    _now,
    _pid_running,
    log,
    open_kb_file,
    read_kb_file,
)
from proteus.untrusted import load_json


def _read_record(path: Path) -> dict[str, Any] | None:
    """The holder record in the lock file ``path`` (None when there is none or it cannot be used: the lock
    file is read like every file of a knowledge base, :func:`~proteus.kb.files.read_kb_file`)."""
    try:
        data = read_kb_file(path.parent, path.name, "side_file_bytes")
        record = load_json(data, str(path)) if data and data.strip() else None
    except ProteusError:
        return None
    return record if isinstance(record, dict) else None


def _holder_gone(record: dict[str, Any]) -> bool:
    """Whether the record names a process of this host that no longer runs."""
    pid = record.get("pid")
    return isinstance(pid, int) and record.get("host") == socket.gethostname() and not _pid_running(pid)


def _describe(record: dict[str, Any]) -> str:
    argv = record.get("argv")
    cmd = shlex.join(str(a) for a in argv) if isinstance(argv, list) else "unknown"
    return (
        f"pid {record.get('pid')} on host {record.get('host')}, since {record.get('since')}, command: {cmd}"
    )


def lock_holder(root: str | Path) -> dict[str, Any] | None:
    """The record (pid, host, since, argv) of the process that holds the write lock of ``root``, or None when
    none does. Only reads ``.lock``, never takes the lock (a record of a process of this host that no longer
    runs is a stale one: None)."""
    record = _read_record(Path(root) / LOCK)
    if record is None or _holder_gone(record):
        return None
    return record


def _locked_error(root: Path, wait: float, record: dict[str, Any] | None) -> KBLockedError:
    who = _describe(record) if record else f"its record in {root / LOCK} is not written yet"
    if wait > 0:
        return KBLockedError(
            f"{root}: another proteus process is writing to this knowledge base ({who}); still locked after "
            f"waiting {wait:g} s; wait for it to finish, or pass a longer --wait"
        )
    return KBLockedError(
        f"{root}: another proteus process is writing to this knowledge base ({who}); wait for it to finish, "
        "or pass --wait"
    )


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _refuse(fd: int, root: Path, wait: float) -> None:
    """Fail naming the holder, unless the lock frees up meanwhile: the holder writes its record right
    after it takes the lock and empties it when it releases, so an empty record means "just taken" or
    "just released"; look again for up to a second (and take the lock if it was released)."""
    deadline = time.monotonic() + 1.0
    while True:
        record = lock_holder(root)
        if record or time.monotonic() > deadline:
            raise _locked_error(root, wait, record)
        time.sleep(0.01)
        if _try(fd):
            return


def _acquire(fd: int, root: Path, wait: float | None) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    except OSError as e:
        raise KBError(
            f"{root / LOCK}: cannot lock ({e.strerror}); use a local file system for --kb"
        ) from None
    if wait is not None and wait <= 0:
        _refuse(fd, root, 0.0)
        return
    record = lock_holder(root)
    log.info("%s: waiting for the write lock (%s)", root, _describe(record) if record else "holder unknown")
    if wait is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + wait
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            _refuse(fd, root, wait)
            return
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.1)
        if _try(fd):
            return


_HELD: dict[tuple[int, str], dict[str, Any]] = {}  # (pid, lock path) -> record, for re-entrant use
#: (pid, lock path) -> the held lock file's (device, inode): the directory a writer locked (:func:`moved`)
_FILES: dict[tuple[int, str], tuple[int, int]] = {}


def _key(root: str | Path) -> tuple[int, str]:
    return os.getpid(), str((Path(root) / LOCK).resolve())


def check_not_moved(root: str | Path) -> None:
    """Raise :class:`KBError` when a writer of this process may not commit to ``root``: its directory is no
    longer the one whose write lock this process holds (moved or removed, another put in its place), so that
    a commit would create a new knowledge base at the old path. Nothing when it is, or when no lock of
    ``root`` is held here."""
    held = _FILES.get(_key(root))
    if held is None:
        return
    try:
        st = os.stat(Path(root) / LOCK)
        if (st.st_dev, st.st_ino) == held:
            return
    except OSError:
        pass
    raise KBError(
        f"{root}: the knowledge base was moved, removed or replaced while this process held its write lock; "
        "nothing was committed (the knowledge base it was writing to is wherever it was moved, unchanged "
        "by this commit): open it at its new path and learn again"
    )


@contextlib.contextmanager
def write_lock(root: str | Path, wait: float | None = 0.0) -> Iterator[dict[str, Any]]:
    """Hold the exclusive write lock of the knowledge base at ``root`` (created with its parents if needed)
    for the ``with`` block; yields the holder record written into ``root/.lock`` (pid, host, since, argv).

    ``wait=0``: raise :class:`KBLockedError` at once when another process holds it (the message names the
    holder); ``wait=None``: block until it is free; ``wait=N``: try for N seconds. The lock is an
    ``fcntl.flock``: the kernel releases it when its holder dies, and the next writer takes it over (logging
    "took over a stale lock of pid N (not running)"). Re-entrant within one process; a child forked inside
    the block shares the parent's lock and must not take it again."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise _is_file_error(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _not_writable(root, e) from None
    path = root / LOCK
    key = _key(root)
    if key in _HELD:
        yield _HELD[key]
        return
    try:
        fd = open_kb_file(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise KBError(
            f"{path}: cannot open the write lock ({e.strerror}); it must be a regular file inside the "
            "knowledge base (remove it if it is something else), or choose another --kb"
        ) from None
    try:
        _acquire(fd, root, wait)
        previous = _read_record(path)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now(), "argv": list(sys.argv)}
        try:  # best effort: the flock is the lock, the record only names its holder to a waiting writer
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except OSError as e:  # a full disk: `kb gc` must still run, the command the docs give for it
            log.warning(
                "%s: the lock is held, but its holder record cannot be written (%s)", root, e.strerror
            )
        if previous is not None:  # a holder that did not release cleanly (a clean release clears the record)
            pid = previous.get("pid")
            if _holder_gone(previous):
                log.warning("%s: took over a stale lock of pid %s (not running)", root, pid)
            else:
                log.warning(
                    "%s: took over a lock that was not released cleanly (pid %s on host %s, since %s)",
                    root,
                    pid,
                    previous.get("host"),
                    previous.get("since"),
                )
        _HELD[key] = record
        st = os.fstat(fd)
        _FILES[key] = (st.st_dev, st.st_ino)
        try:
            yield record
        finally:
            del _HELD[key]
            _FILES.pop(key, None)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a clean release leaves no holder record
    finally:
        os.close(fd)  # releases the flock


# ====================================================================== the knowledge base
