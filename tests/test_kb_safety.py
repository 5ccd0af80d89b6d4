"""Knowledge-base safety: one writer at a time (real processes racing for the lock), readers that never see a
half-committed state, no deletion of what a knowledge base holds, manifest checksum, problems() and info().

Processes are forked (``multiprocessing.get_context("fork")``): a child starts in milliseconds, without
importing torch again. Crashes inside a commit use the crash points of :mod:`proteus.faults` in a forked
child (it sends itself SIGKILL, holding the write lock).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import proteus.kb as kbmod
from kbfiles import read_manifest, write_manifest
from proteus.cli import main
from proteus.faults import ENV
from proteus.kb import (
    FORMAT_VERSION,
    KBError,
    KBLockedError,
    KnowledgeBase,
    manifest_checksum,
)
from proteus.kb.files import FIRST_COMMIT
from proteus.kb.objects import ObjectStore

CTX = multiprocessing.get_context("fork")
HEADER: dict[str, Any] = {
    "proteus_version": "test",
    "backbone": {"name": "b", "weights_sha256": "x"},
    "config": {"method": "proteus", "backbone": {"name": "b"}},
    "split": {"benchmark": "toy"},
}
SEEDS = ["s0", "s1"]


# ====================================================================== helpers (also run in forked children)
def _encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode()


def _append(kb: KnowledgeBase, name: str) -> None:
    """Add the task ``name`` (an object named after it) and a new head (listing every task), then commit."""
    rel, sha = kb.write_object(f"task-{name}", {"name": _encode(name)})
    tasks = list(kb.manifest["tasks"])
    tasks.append(
        {
            "index": len(tasks),
            "name": name,
            "classes": [2 * len(tasks), 2 * len(tasks) + 1],
            "class_names": [f"{name}-a", f"{name}-b"],
            "n_train": 10,
            "object": rel,
            "sha256": sha,
        }
    )
    names = ",".join(t["name"] for t in tasks)
    hrel, hsha = kb.write_object("head", {"n": torch.tensor([len(tasks)]), "names": _encode(names)})
    head = {"object": hrel, "sha256": hsha, "meta": {"n": len(tasks)}}
    kb.commit({**kb.manifest, "tasks": tasks, "head": head})


def _names(kb: KnowledgeBase) -> list[str]:
    """The task names of an opened KB, checked against its objects (a consistent snapshot)."""
    names = [t["name"] for t in kb.manifest["tasks"]]
    for t in kb.manifest["tasks"]:
        assert _decode(kb.read(t["object"], t["sha256"])["name"]) == t["name"]
    head = kb.manifest["head"]
    tensors = kb.read(head["object"], head["sha256"])
    assert int(tensors["n"]) == len(names) == head["meta"]["n"]
    assert _decode(tensors["names"]) == ",".join(names)
    return names


def _seed(root: Path) -> None:
    """A KB holding the tasks SEEDS."""
    with KnowledgeBase.write_lock(root):
        _append(KnowledgeBase.new(root, HEADER), SEEDS[0])
    with KnowledgeBase.write_lock(root):
        _append(KnowledgeBase.open(root), SEEDS[1])


def _writer(root: str, name: str, wait: float | None, start: Any, results: Any, kill_at: str = "") -> None:
    """One writer process: take the lock, open (or start) the KB, append task ``name``, commit, release."""
    if kill_at:
        os.environ[ENV] = kill_at
    start.wait(30)
    try:
        with KnowledgeBase.write_lock(root, wait=wait):
            kb = KnowledgeBase.open(root) if KnowledgeBase.exists(root) else KnowledgeBase.new(root, HEADER)
            _append(kb, name)
        results.put((name, "ok", ""))
    except KBLockedError as e:
        results.put((name, "locked", str(e)))
    except BaseException:
        results.put((name, "error", traceback.format_exc()))


def _reader(root: str, stop: Any, results: Any) -> None:
    """A reader process: open with verification and check the snapshot, again and again until ``stop``."""
    n = 0
    try:
        while True:
            _names(KnowledgeBase.open(root, verify=True))
            n += 1
            if stop.is_set():
                break
        results.put(("reader", "ok", n))
    except BaseException:
        results.put(("reader", "error", traceback.format_exc()))


def _hold(root: str, ready: Any, release: Any) -> None:
    """Hold the write lock until ``release`` is set."""
    with KnowledgeBase.write_lock(root):
        ready.set()
        release.wait(60)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ====================================================================== concurrency
def _trial(root: Path, n_writers: int, wait: float | None, n_readers: int) -> int:
    _seed(root)
    start, stop, results = CTX.Event(), CTX.Event(), CTX.Queue()
    readers = [CTX.Process(target=_reader, args=(str(root), stop, results)) for _ in range(n_readers)]
    writers = [
        CTX.Process(target=_writer, args=(str(root), f"w{i}", wait, start, results)) for i in range(n_writers)
    ]
    for p in readers + writers:
        p.start()
    start.set()
    outcomes = {}
    for _ in writers:
        name, outcome, detail = results.get(timeout=60)
        outcomes[name] = (outcome, detail)
    stop.set()
    opens = []
    for _ in readers:
        name, outcome, detail = results.get(timeout=60)
        assert outcome == "ok", f"a reader failed:\n{detail}"
        opens.append(detail)
    for p in readers + writers:
        p.join(30)
        assert p.exitcode == 0
    for name, (outcome, detail) in outcomes.items():
        assert outcome in ("ok", "locked"), f"{name}: {detail}"
        if outcome == "locked":
            assert wait == 0
            assert "pid " in detail and f"host {socket.gethostname()}" in detail and "since " in detail
            assert "wait for it to finish, or pass --wait" in detail
    won = [name for name, (outcome, _) in outcomes.items() if outcome == "ok"]
    assert won, "no writer got the lock"
    if wait is None:
        assert len(won) == n_writers
    names = _names(KnowledgeBase.open(root, verify=True))
    assert names[: len(SEEDS)] == SEEDS
    assert sorted(names[len(SEEDS) :]) == sorted(won), "the KB does not hold exactly the successful writers"
    assert kbmod.problems(root) == []
    assert KnowledgeBase.lock_holder(root) is None
    assert all(n >= 1 for n in opens)
    return len(won)


@pytest.mark.slow
def test_racing_writers_and_readers(tmp_path: Path) -> None:
    """50 trials, each on a fresh KB holding 2 tasks: 2 then 8 writer processes race for the lock (failing
    fast, or waiting), 2 reader processes open and verify the KB all along (in the 8-writer trials)."""
    t0 = time.perf_counter()
    plan = [(2, 0.0, 0)] * 15 + [(2, None, 0)] * 15 + [(8, 0.0, 2)] * 10 + [(8, None, 2)] * 10
    won_fast = []
    for i, (n_writers, wait, n_readers) in enumerate(plan):
        won = _trial(tmp_path / f"kb{i}", n_writers, wait, n_readers)
        if wait == 0:
            won_fast.append(won)
    assert len(plan) >= 50
    # the fail-fast trials did race: in some of them a writer was refused (the lock was held)
    assert any(w < n for w, (n, wait, _) in zip(won_fast, [p for p in plan if p[1] == 0])), won_fast
    assert time.perf_counter() - t0 < 120


def test_readers_never_wait_for_the_writer(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)
    ready, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_hold, args=(str(root), ready, release))
    p.start()
    try:
        assert ready.wait(30)
        t0 = time.perf_counter()
        assert _names(KnowledgeBase.open(root)) == SEEDS
        assert kbmod.problems(root) == []
        assert time.perf_counter() - t0 < 2
    finally:
        release.set()
        p.join(30)


# ====================================================================== the lock
def test_locked_error_names_the_holder_and_waiting_works(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    assert KnowledgeBase.lock_holder(root) is None
    ready, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_hold, args=(str(root), ready, release))
    p.start()
    try:
        assert ready.wait(30)
        holder = KnowledgeBase.lock_holder(root)
        assert holder is not None and holder["pid"] == p.pid and holder["host"] == socket.gethostname()
        with pytest.raises(KBLockedError) as e:
            with KnowledgeBase.write_lock(root, wait=0):
                pass
        msg = str(e.value)
        assert str(root) in msg
        assert f"pid {p.pid} on host {socket.gethostname()}, since {holder['since']}" in msg
        assert holder["since"].endswith("Z") and "command: " in msg
        assert msg.endswith("wait for it to finish, or pass --wait")
        assert isinstance(e.value, KBError)
        t0 = time.perf_counter()
        with pytest.raises(KBLockedError, match=r"still locked after waiting 0.3 s"):
            with KnowledgeBase.write_lock(root, wait=0.3):
                pass
        assert time.perf_counter() - t0 >= 0.3
        releaser = CTX.Process(target=_release_later, args=(release,))
        releaser.start()
        with KnowledgeBase.write_lock(root, wait=None) as record:  # blocks until the holder lets go
            assert record["pid"] == os.getpid() and KnowledgeBase.lock_holder(root) == record
            with KnowledgeBase.write_lock(root) as again:  # re-entrant in one process
                assert again == record
        releaser.join(30)
    finally:
        release.set()
        p.join(30)
    assert KnowledgeBase.lock_holder(root) is None
    assert not KnowledgeBase.exists(root) and _files(root) == [".lock"]


def _release_later(release: Any) -> None:
    time.sleep(0.2)
    release.set()


def test_writer_killed_inside_its_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A writer SIGKILLed (at a crash point, holding the lock, its new manifest in a temporary file): the
    next writer gets the lock at once, logs the takeover, sees the old state and commits cleanly."""
    root = tmp_path / "kb"
    _seed(root)
    start, results = CTX.Event(), CTX.Queue()
    start.set()
    p = CTX.Process(target=_writer, args=(str(root), "killed", 0.0, start, results, "commit:manifest-tmp"))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert KnowledgeBase.lock_holder(root) is None  # its record names a process that no longer runs
    problems = kbmod.problems(root)
    assert problems and all("interrupted commit" in x for x in problems), problems
    assert _names(KnowledgeBase.open(root)) == SEEDS
    with caplog.at_level(logging.INFO, logger="proteus"):
        with KnowledgeBase.write_lock(root, wait=0):
            _append(KnowledgeBase.open(root), "next")
    assert f"took over a stale lock of pid {p.pid} (not running)" in caplog.text
    assert _names(KnowledgeBase.open(root)) == [*SEEDS, "next"]
    assert kbmod.problems(root) == []


def test_killed_holder_not_yet_reaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL a holder and take the lock before its parent reaps it (a zombie does not run)."""
    root = tmp_path / "kb"
    ready, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_hold, args=(str(root), ready, release))
    p.start()
    assert ready.wait(30)
    os.kill(p.pid, signal.SIGKILL)
    with caplog.at_level(logging.INFO, logger="proteus"):
        with KnowledgeBase.write_lock(root, wait=10) as record:
            assert record["pid"] == os.getpid()
    p.join(30)
    assert f"took over a stale lock of pid {p.pid} (not running)" in caplog.text


# ====================================================================== snapshots and sweeping
def test_open_is_a_snapshot_that_survives_later_commits(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)
    reader = KnowledgeBase.open(root, verify=True)
    head = reader.manifest["head"]
    writer = KnowledgeBase.open(root)
    _append(writer, "a")
    _append(writer, "b")  # sweeps the head the reader holds
    assert not (root / head["object"]).exists()
    assert _names(reader) == SEEDS  # served from the verified bytes, no second disk read
    assert _names(KnowledgeBase.open(root)) == [*SEEDS, "a", "b"]


def test_open_starts_again_after_a_concurrent_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "kb"
    _seed(root)
    writer = KnowledgeBase.open(root)
    original = ObjectStore.mapped
    calls = {"n": 0}

    def commit_twice_first(self: ObjectStore, manifest: dict, rel: str, sha: str, *rest: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:  # between the reader's manifest and its first object: two commits
            _append(writer, "a")
            _append(writer, "b")
        return original(self, manifest, rel, sha, *rest)

    monkeypatch.setattr(ObjectStore, "mapped", commit_twice_first)
    kb = KnowledgeBase.open(root, verify=True)
    monkeypatch.undo()
    assert _names(kb) == [*SEEDS, "a", "b"]


def test_open_starts_again_when_a_commit_sweeps_the_records_it_was_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two commits between the reader's manifest and its first record segment sweep that segment: the reader
    reads the new manifest, where a missing segment of an unchanged manifest stays an error naming it."""
    import proteus.kb.manifests as manifests

    root = tmp_path / "kb"
    _seed(root)
    writer = KnowledgeBase.open(root)
    original = manifests.read_segment
    calls = {"n": 0}

    def commit_twice_first(root_: Path, rel: str, sha: str, size: int, *dirs: Any) -> bytes:
        calls["n"] += 1
        if calls["n"] == 1:
            _append(writer, "a")
            _append(writer, "b")
            assert not (root_ / rel).exists()  # the segment the reader's manifest names: swept
        return original(root_, rel, sha, size, *dirs)

    monkeypatch.setattr(manifests, "read_segment", commit_twice_first)
    kb = KnowledgeBase.open(root, verify=True)
    monkeypatch.undo()
    assert calls["n"] > 1 and _names(kb) == [*SEEDS, "a", "b"]
    segment = next(p for p in (root / "objects").glob("records-*.json"))
    segment.unlink()
    with pytest.raises(KBError, match=rf"manifest\.json: .*{segment.name}: missing from the knowledge base"):
        KnowledgeBase.open(root)


def test_sweep_keeps_the_previous_commit(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)  # commits A (s0) and B (s0, s1)
    heads = [KnowledgeBase.open(root).manifest["head"]["object"]]
    for name in ("c", "d"):
        _append(KnowledgeBase.open(root), name)
        heads.append(KnowledgeBase.open(root).manifest["head"]["object"])
    prev = read_manifest(root, "manifest.prev.json")
    assert [t["name"] for t in prev["tasks"]] == [*SEEDS, "c"]
    assert not (root / heads[0]).exists()  # referenced two commits ago: swept
    assert (root / heads[1]).exists() and (root / heads[2]).exists()  # previous and current
    assert kbmod.problems(root) == []
    # the previous commit is complete: restoring it gives a KB that opens and verifies
    (root / "manifest.json").write_bytes((root / "manifest.prev.json").read_bytes())
    assert _names(KnowledgeBase.open(root)) == [*SEEDS, "c"]


@pytest.mark.parametrize("how", ["renamed", "replaced"])
def test_a_knowledge_base_moved_under_its_writer_is_not_re_created(tmp_path: Path, how: str) -> None:
    """A writer whose knowledge base was renamed away (or replaced by another directory) while it held the
    write lock fails its next write by name; nothing appears at the old path, the moved one is unchanged."""
    root = tmp_path / "kb"
    _seed(root)
    with KnowledgeBase.write_lock(root):
        kb = KnowledgeBase.open(root)
        root.rename(tmp_path / "moved")
        if how == "replaced":
            root.mkdir()
            (root / "note").write_text("someone else's folder")
        with pytest.raises(
            KBError, match="moved, removed or replaced while this process held its write lock"
        ):
            _append(kb, "c")
        with pytest.raises(KBError, match="moved, removed or replaced"):
            kb.commit(kb.manifest)
    assert (not root.exists()) if how == "renamed" else sorted(p.name for p in root.iterdir()) == ["note"]
    assert _names(KnowledgeBase.open(tmp_path / "moved")) == SEEDS
    with KnowledgeBase.write_lock(tmp_path / "moved"):  # at its new path it takes new tasks
        _append(KnowledgeBase.open(tmp_path / "moved"), "c")
    assert _names(KnowledgeBase.open(tmp_path / "moved")) == [*SEEDS, "c"]


# ====================================================================== never delete what a KB holds
def test_new_writes_nothing_before_its_first_commit(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "kb"
    kb = KnowledgeBase.new(root, HEADER)
    kb.write_object("task-x", {"a": torch.ones(2)})
    assert not (tmp_path / "deep").exists()
    assert kbmod.info(kb)["committed"] is False
    _append(kb, "x")
    assert KnowledgeBase.exists(root) and (root / "objects").is_dir()
    assert _names(KnowledgeBase.open(root)) == ["x"]
    assert not (root / FIRST_COMMIT).exists() and kbmod.problems(root) == []
    # the task's object, the head's and the record segment: the unreferenced pending object was never written
    assert len(list((root / "objects").iterdir())) == 3
    with pytest.raises(KBError, match="already exists"):
        KnowledgeBase.new(root, HEADER)


def test_damaged_directory_is_refused_and_kept(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)
    (root / "manifest.json").unlink()
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for make in (KnowledgeBase.new, KnowledgeBase.create):
        with pytest.raises(KBError) as e:
            make(root, HEADER)
        msg = str(e.value)
        assert (
            msg.startswith(f"{root}: holds knowledge-base files (objects/") and "but no manifest.json" in msg
        )
        assert "refusing to start a new knowledge base over them" in msg
        assert "manifest.prev.json holds the previous commit" in msg and "choose another --kb" in msg
    with pytest.raises(
        KBError, match="holds knowledge-base files .* but no manifest.json; the knowledge base"
    ):
        KnowledgeBase.open(root)
    assert not KnowledgeBase.exists(root)
    assert any("but no manifest.json" in p for p in kbmod.problems(root))
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before  # nothing deleted, nothing written
    # objects/ alone (no manifest.prev.json) is refused too
    (root / "manifest.prev.json").unlink()
    with pytest.raises(KBError, match="there is no manifest.prev.json"):
        KnowledgeBase.new(root, HEADER)


def test_lock_only_directory_and_file_root(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    with KnowledgeBase.write_lock(root):
        pass  # a first learn that failed before its commit leaves only the lock file
    assert _files(root) == [".lock"] and not KnowledgeBase.exists(root)
    with pytest.raises(KBError, match="no knowledge base here"):
        KnowledgeBase.open(root)
    _append(KnowledgeBase.new(root, HEADER), "x")
    assert _names(KnowledgeBase.open(root)) == ["x"]
    f = tmp_path / "file"
    f.write_text("data")
    for call in (
        lambda: KnowledgeBase.new(f, HEADER),
        lambda: KnowledgeBase.create(f, HEADER),
        lambda: KnowledgeBase.open(f),
        lambda: KnowledgeBase.check_writable(f),
        lambda: KnowledgeBase.write_lock(f).__enter__(),
    ):
        with pytest.raises(KBError, match=f"{f}: is a file, not a knowledge-base directory"):
            call()
    assert f.read_text() == "data"
    assert kbmod.problems(f) == [f"{f}: is a file, not a knowledge-base directory; choose another --kb"]


def test_interrupted_first_commit_can_start_over(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    start, results = CTX.Event(), CTX.Queue()
    start.set()
    p = CTX.Process(target=_writer, args=(str(root), "x", 0.0, start, results, "commit:manifest-tmp"))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert (root / FIRST_COMMIT).exists() and list((root / "objects").iterdir())
    assert not KnowledgeBase.exists(root)
    with pytest.raises(KBError, match="first commit was interrupted"):
        KnowledgeBase.open(root)
    with KnowledgeBase.write_lock(root):
        _append(KnowledgeBase.new(root, HEADER), "y")
    assert _names(KnowledgeBase.open(root)) == ["y"]
    assert kbmod.problems(root) == []
    history = [f"history/{p.name}" for p in (root / "history").iterdir()]  # the first commit's manifest
    assert (
        _files(root)
        == sorted(
            [
                ".lock",
                "manifest.json",
                "objects",
                *(f"objects/{n}" for n in _objnames(root)),
                "history",
                *history,
            ]
        )
        and len(history) == 1
    )


def _objnames(root: Path) -> list[str]:
    return [p.name for p in (root / "objects").iterdir()]


# ====================================================================== manifest checksum
def test_edited_manifest_is_detected(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)
    m = json.loads((root / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION == 5 and m["checksum"] == manifest_checksum(m)
    m["config"]["method"] = "edited"
    (root / "manifest.json").write_text(json.dumps(m, indent=1))
    with pytest.raises(KBError) as e:
        KnowledgeBase.open(root)
    msg = str(e.value)
    assert msg.startswith(f"{root / 'manifest.json'}: checksum mismatch: manifest.json was edited")
    assert msg.endswith("restore it or manifest.prev.json")
    assert any("checksum mismatch: manifest.json was edited" in p for p in kbmod.problems(root))
    del m["checksum"]
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError, match="has no checksum"):
        KnowledgeBase.open(root)
    m["format_version"] = 7
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError, match=r"format version 7 is not supported .*reads versions 1, 2, 3, 4, 5"):
        KnowledgeBase.open(root)


def test_an_edited_record_segment_is_detected(tmp_path: Path) -> None:
    """A task record is edited in its record segment (format 4): the segment no longer has the sha256 the
    manifest names; a segment renamed to its new hash and named in a manifest whose checksum was recomputed
    is read, and the record checked."""
    root = tmp_path / "kb"
    _seed(root)
    m = json.loads((root / "manifest.json").read_text())
    segment = root / m["segments"][0]["object"]
    body = json.loads(segment.read_text())
    body["tasks"][0]["class_names"][0] = "edited"
    segment.write_text(json.dumps(body))
    with pytest.raises(KBError, match=r"records-.*\.json: (size|checksum) mismatch"):
        KnowledgeBase.open(root)
    assert any("records-" in p and "mismatch" in p for p in kbmod.problems(root))
    edited = read_manifest(root)
    edited["tasks"][0]["classes"] = "zero"
    write_manifest(root, edited)
    with pytest.raises(KBError, match=r"tasks\[0\] \(task index 0\)\.classes: expected"):
        KnowledgeBase.open(root)


def test_version_1_manifest_opens_and_gets_a_checksum(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    (root / "objects").mkdir(parents=True)
    scratch = KnowledgeBase.new(tmp_path / "scratch", HEADER)
    rel, sha = scratch.write_object("task-v1", {"name": _encode("v1")})
    (root / rel).write_bytes(scratch.objects.pending[rel])
    hrel, hsha = scratch.write_object("head", {"n": torch.tensor([1]), "names": _encode("v1")})
    (root / hrel).write_bytes(scratch.objects.pending[hrel])
    v1 = {
        "format": "proteus-kb",
        "format_version": 1,
        "created": "2024-01-01T00:00:00Z",
        **HEADER,
        "tasks": [
            {"index": 0, "name": "v1", "classes": [0], "class_names": ["a"], "object": rel, "sha256": sha}
        ],
        "head": {"object": hrel, "sha256": hsha, "meta": {"n": 1}},
        "updated": "2024-01-01T00:00:00Z",
    }
    (root / "manifest.json").write_text(json.dumps(v1, indent=1))
    kb = KnowledgeBase.open(root)
    assert _names(kb) == ["v1"] and kbmod.problems(root) == []
    _append(kb, "v2")
    m = read_manifest(root)
    assert m["format_version"] == FORMAT_VERSION and m["checksum"] == manifest_checksum(m)
    assert (
        m["sequence"] == 1
        and len(m["kb_id"]) == 32
        and set(m["object_bytes"]) == {t["object"] for t in m["tasks"]} | {m["head"]["object"]}
    )
    assert json.loads((root / "manifest.prev.json").read_text()) == v1
    assert _names(KnowledgeBase.open(root)) == ["v1", "v2"]


# ====================================================================== problems, info, check_writable
def test_problems_lists_every_problem(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)
    assert kbmod.problems(root) == []
    m = read_manifest(root)
    t0, t1 = (root / t["object"] for t in m["tasks"])
    t0.unlink()
    t1.write_bytes(t1.read_bytes()[:-3])
    bad_sha = hashlib.sha256(b"not safetensors").hexdigest()
    bad = root / "objects" / f"task-bad-{bad_sha[:16]}.safetensors"  # named as the store names objects
    bad.write_bytes(b"not safetensors")
    m_head_before = m["head"]["object"]
    m["head"]["object"] = f"objects/{bad.name}"
    m["head"]["sha256"] = bad_sha
    write_manifest(root, m)
    (root / ".manifest.json.tmp-4194304999").write_text("{partial")
    (root / "objects" / "orphan-0.safetensors").write_bytes(b"x")
    old_head = root / m_head_before
    problems = kbmod.problems(root)
    assert len(problems) == 6, problems
    assert any(p.startswith(f"{old_head}: referenced by neither") for p in problems)
    assert any(p.startswith(f"{t0}: missing from the knowledge base (task index 0)") for p in problems)
    assert any(p.startswith(f"{t1}: size mismatch") and "(task index 1)" in p for p in problems)
    assert any(p.startswith(f"{bad}: not a valid safetensors file") for p in problems)
    assert any(p.startswith(f"{root / '.manifest.json.tmp-4194304999'}: temporary file") for p in problems)
    assert any(
        p.startswith(f"{root / 'objects' / 'orphan-0.safetensors'}: referenced by neither") for p in problems
    )
    assert kbmod.problems(tmp_path / "none") == [
        f"{tmp_path / 'none'}: no knowledge base here (no such directory)"
    ]


def test_info_reports_tasks_and_sizes(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    _seed(root)
    kb = KnowledgeBase.open(root)
    m = dict(kb.manifest)
    m["tasks"] = [{**m["tasks"][0], "settings": {"rank": 4}, "learned": {"epochs": 2}}, m["tasks"][1]]
    kb.commit(m)
    info = kbmod.info(KnowledgeBase.open(root))
    assert (
        info["format_version"] == FORMAT_VERSION and info["created"] and info["updated"] and info["committed"]
    )
    assert (info["proteus_version"], info["method"], info["backbone_name"], info["benchmark"]) == (
        "test",
        "proteus",
        "b",
        "toy",
    )
    assert info["backbone"] == HEADER["backbone"] and info["num_tasks"] == 2
    t0, t1 = info["tasks"]
    assert t0["index"] == 0 and t0["classes"] == [0, 1] and t0["class_names"] == ["s0-a", "s0-b"]
    assert t0["n_train"] == 10 and t0["settings"] == {"rank": 4} and t0["learned"] == {"epochs": 2}
    assert "settings" not in t1 and t1["index"] == 1
    sizes = [(root / t["object"]).stat().st_size for t in kb.manifest["tasks"]]
    assert [t0["bytes"], t1["bytes"]] == sizes
    head = (root / kb.manifest["head"]["object"]).stat().st_size
    assert info["head_bytes"] == head
    assert info["manifest_bytes"] == (root / "manifest.json").stat().st_size
    segments = sum((root / s["object"]).stat().st_size for s in kb.manifest["segments"])
    assert info["total_bytes"] == info["manifest_bytes"] + sum(sizes) + head + segments


def test_info_shows_each_tasks_rank_per_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A task whose adapter got fewer directions on a map (no orthogonal room left) says so in `kb info`."""
    root = tmp_path / "kb"
    _seed(root)
    with KnowledgeBase.write_lock(root):
        kb = KnowledgeBase.open(root)
        adapter = {"adapter/m1/A": torch.zeros(6, 4), "adapter/m1/B": torch.zeros(3, 4),
                   "adapter/m2/A": torch.zeros(6, 1), "adapter/m2/B": torch.zeros(3, 1)}  # fmt: skip
        rel, sha = kb.write_object("task-r", adapter)
        tasks = [*kb.manifest["tasks"][:1], {**kb.manifest["tasks"][1], "object": rel, "sha256": sha}]
        kb.commit({**kb.manifest, "tasks": tasks})
    assert main(["kb", "info", "--json", str(root)]) == 0
    tasks = json.loads(capsys.readouterr().out)["tasks"]
    assert "ranks" not in tasks[0] and tasks[1]["ranks"] == {"m1": 4, "m2": 1}
    assert main(["kb", "info", str(root)]) == 0
    out = capsys.readouterr().out
    assert "rank 4 on 1 of 2 maps (no orthogonal room left: m2 1)" in out
    assert main(["kb", "list", str(root)]) == 0
    assert "rank" not in capsys.readouterr().out


def test_check_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "kb"
    _seed(root)
    KnowledgeBase.check_writable(root)
    KnowledgeBase.check_writable(tmp_path / "fresh" / "kb")  # created, like the lock does
    assert not [p for p in root.rglob(".write-check-*")]
    # a place nobody may write, not even root (these tests run as root: chmod would not stop them)
    if Path("/sys/kernel").is_dir():
        with pytest.raises(KBError, match=r"^/sys/kernel: not writable \((Permission denied|Read-only)"):
            KnowledgeBase.check_writable("/sys/kernel")
        with pytest.raises(KBError, match=r"^/sys/kernel/proteus-kb-test/kb: not writable"):
            KnowledgeBase.check_writable("/sys/kernel/proteus-kb-test/kb")
    # a full disk, seen when the probe in objects/ is synced
    real_fsync = os.fsync

    def full(fd: int) -> None:
        if "objects" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(KBError) as e:
        KnowledgeBase.check_writable(root)
    assert str(e.value).startswith(f"{root / 'objects'}: not writable (No space left on device); ")
    assert "choose another --kb" in str(e.value)
    monkeypatch.undo()
    assert not [p for p in root.rglob(".write-check-*")]
