"""Fault injection in the manner of SQLite's I/O-error tests: every ``open``, ``write``, ``fsync`` and rename
of a commit fails in turn.

A commit (a new task), the commit that fills a record segment (it also writes the segment's pack) and an undo
run once with every such system call counted; then each runs again on a
fresh copy of the knowledge base once per call, with that call failing (ENOSPC, then EIO): once only
(a transient fault) and from that call on (a device that stays broken). After each run, with the faults
gone, ``kb verify`` must find no error, and the knowledge base must be byte for byte its old state (the
command failed) or its new one (it succeeded): at once for a transient fault, except when the commit went
through but its sweep could not read ``manifest.prev.json``; after ``kb gc`` when the device stayed broken
(the failed command could not remove what it wrote). Time stamps are fixed, so that the new state is the
same bytes in every run.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import proteus.kb as kbmod
from proteus.kb import KnowledgeBase
from proteus.kb.packs import is_pack
from proteus.kb.segments import SEGMENT_TASKS

HEADER: dict[str, Any] = {
    "proteus_version": "test",
    "backbone": {"name": "b"},
    "config": {"method": "proteus", "backbone": {"name": "b"}},
    "split": {"benchmark": "toy"},
}
OPS = ("open", "write", "fsync", "replace", "rename")
PREV = "manifest.prev.json"
ERRNOS = (errno.ENOSPC, errno.EIO)


def _append(kb: KnowledgeBase, name: str) -> None:
    rel, sha = kb.write_object(f"task-{name}", {"name": torch.tensor(list(name.encode()), dtype=torch.uint8)})
    tasks = [
        *kb.manifest["tasks"],
        {"index": len(kb.manifest["tasks"]), "name": name, "object": rel, "sha256": sha},
    ]
    hrel, hsha = kb.write_object("head", {"n": torch.tensor([len(tasks)])})
    kb.commit(
        {**kb.manifest, "tasks": tasks, "head": {"object": hrel, "sha256": hsha, "meta": {"n": len(tasks)}}}
    )


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


class Faults:
    """Counts the KB's system calls, and fails call number ``at`` of ``op`` (and, ``sticky``, every later
    one) with ``err``."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.op: str | None = None
        self.at = -1
        self.err = 0
        self.sticky = False

    def wrap(self, op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            n = self.calls[op]
            self.calls[op] += 1
            if op == self.op and (n == self.at or (self.sticky and n > self.at)):
                raise OSError(self.err, os.strerror(self.err))
            return real(*args, **kw)

        return call


@contextmanager
def injected(monkeypatch: pytest.MonkeyPatch, faults: Faults) -> Iterator[Faults]:
    with monkeypatch.context() as m:
        for op in OPS:
            m.setattr(os, op, faults.wrap(op, getattr(os, op)))
        yield faults


def _seed(root: Path, tasks: int = 2) -> None:
    kb = KnowledgeBase.new(root, HEADER)
    _append(kb, "a")
    for k in range(1, tasks):
        _append(KnowledgeBase.open(root), f"b{k}")


ACTIONS: dict[str, Callable[[Path], None]] = {
    "commit": lambda root: _append(KnowledgeBase.open(root), "c"),
    "undo": lambda root: KnowledgeBase.open(root).undo(),
    # the commit that fills a record segment: it also writes the segment's pack (format 5)
    "seal": lambda root: _append(KnowledgeBase.open(root), "c"),
}
#: the tasks each action's knowledge base holds before it
SEEDED = {"commit": 2, "undo": 2, "seal": SEGMENT_TASKS - 1}


@pytest.fixture
def fixed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import proteus.kb.commit
    import proteus.kb.files

    for mod in (proteus.kb.files, proteus.kb.commit):
        monkeypatch.setattr(mod, "_now", lambda: "2026-01-01T00:00:00Z")


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_every_system_call_of_a_commit_fails_in_turn(
    action: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed_time: None
) -> None:
    base = tmp_path / "base"
    _seed(base, SEEDED[action])
    old = _files(base)
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    with injected(monkeypatch, Faults()) as counted:
        ACTIONS[action](probe)
    new = _files(probe)
    assert new != old and all(counted.calls[op] for op in ("open", "write", "fsync", "replace"))
    if action == "seal":
        assert all(is_pack(t["object"]) for t in KnowledgeBase.open(probe).manifest["tasks"])
    runs = Counter()
    for op in OPS:
        for at in range(counted.calls[op]):
            for err in ERRNOS:
                for sticky in (False, True):
                    root = tmp_path / f"{op}-{at}-{err}-{sticky}"
                    shutil.copytree(base, root)
                    faults = Faults()
                    faults.op, faults.at, faults.err, faults.sticky = op, at, err, sticky
                    failed = True
                    with injected(monkeypatch, faults):
                        try:
                            ACTIONS[action](root)
                            failed = False
                        except (kbmod.KBError, OSError):
                            pass
                    after = " and after" if sticky else ""
                    where = f"{action}: {op} #{at} failing with {errno.errorcode[err]}{after}"
                    # `kb verify`'s checks of every task (a segment of them for "seal": every 8th run, each
                    # run's state verified by opening it and compared byte for byte)
                    full = action != "seal" or at % 8 == 0
                    if full:
                        assert kbmod.check(root).errors == [], where  # leftovers are warnings at most
                    else:
                        KnowledgeBase.open(root)
                    now = _files(root)
                    if now not in (old, new):  # leftovers: a commit's sweep, or a clean-up, could not run
                        assert sticky or not failed, f"{where}: a failed {action} left files behind"
                        KnowledgeBase.open(root, verify=False).gc()
                        now = _files(root)
                        runs["cleaned by gc"] += 1
                    expected = old if failed else new
                    assert now == expected, f"{where}: not the {'old' if failed else 'new'} state"
                    if full:
                        found = kbmod.check(root)
                        assert found.errors == [] and found.warnings == [], where
                    runs["new" if now == new else "old"] += 1
                    shutil.rmtree(root)
    total = sum(runs[k] for k in ("old", "new"))
    print(f"{action}: {total} runs with a failing call ({dict(counted.calls)} calls): {dict(runs)}")
    assert runs["old"] > 0 and total == 4 * sum(counted.calls[op] for op in OPS)
