"""Format 5 (:mod:`proteus.kb.packs`): the commit that fills a record segment writes its tasks' tensors as one
pack, each name stacked over the tasks; a reader gets a task's tensors as views of the pack made when asked
for, and a segment's block of a name in one view; a knowledge base of format 4 opens unchanged and
``kb upgrade`` packs it; a commit that packs, killed at any moment, leaves the old state or the new one."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import proteus.kb as kbmod
import proteus.kb.commit
import proteus.kb.segments
from proteus.kb import KnowledgeBase
from proteus.kb.packs import Pack, is_pack, pack_tasks, spans
from proteus.kb.segments import SEGMENT_TASKS

HEADER: dict[str, Any] = {
    "proteus_version": "test",
    "backbone": {"name": "b"},
    "config": {"method": "proteus", "backbone": {"name": "b"}},
    "split": {"benchmark": "toy"},
}


def _tensors(k: int, size: int = 8) -> dict[str, torch.Tensor]:
    """Task k's tensors: a fixed-size row, a matrix of k % 3 columns, a table of k % 4 + 1 rows, a tensor of
    a shape of its own (flattened in a pack) and, for even k only, an integer vector."""
    g = torch.Generator().manual_seed(k)
    out = {
        "row": torch.randn(size, generator=g),
        "cols": torch.randn(size, k % 3, generator=g),
        "rows": torch.randn(k % 4 + 1, 5, generator=g, dtype=torch.float64),
        "odd": torch.randn(k % 2 + 1, k % 5 + 1, generator=g),
    }
    if k % 2 == 0:
        out["even"] = torch.arange(k, k + 3)
    return out


def test_a_pack_gives_back_every_task_s_tensors_and_its_blocks() -> None:
    """Every task's tensors come back; the names a part reads a pack's tasks of at once (``together``: the
    learner's :class:`~proteus.tensor_rules.SideBySide` rules) lie side by side, one view per block; every
    other name lies whole per task, each task's tensor one contiguous piece."""
    tasks = [_tensors(k) for k in range(40, 50)]
    data = pack_tasks(40, tasks, lambda n: n == "cols")
    assert pack_tasks(40, [dict(t) for t in tasks], lambda n: n == "cols") == data  # deterministic
    apart = Pack(pack_tasks(40, tasks))
    assert apart.span("cols", 0, 10) is None
    for slot, want in enumerate(tasks):
        got = apart.task(slot)
        assert all(got[n].is_contiguous() and torch.equal(got[n], t) for n, t in want.items())
    pack = Pack(data)
    assert (pack.first, pack.count) == (40, 10)
    for slot, want in enumerate(tasks):
        got = pack.task(slot)
        assert sorted(got) == sorted(want) and len(got) == len(want) and ("even" in got) == ("even" in want)
        for name, t in want.items():
            assert got.shape(name) == tuple(t.shape) and torch.equal(got[name], t), name
    # a block: the tasks' columns side by side in one view, each task's extent
    cols, lengths = pack.span("cols", 0, 10) or (None, None)
    assert cols is not None and torch.equal(cols, torch.cat([t["cols"] for t in tasks], 1))
    assert lengths == [k % 3 for k in range(40, 50)]
    assert pack.span("even", 0, 10) is None and pack.span("odd", 0, 10) is None  # one missing; flattened
    runs = spans([pack.task(s) for s in range(10)], ["cols", "rows"])
    assert [(a, b) for a, b, blocks in runs] == [(0, 10)] and runs[0][2] is not None
    with pytest.raises(ValueError, match="not a pack"):
        Pack(
            pack_tasks(0, tasks, lambda n: n == "cols")[:8]
            + b"\x00" * 0
            + data[8:].replace(b"proteus-kb-pack", b"proteus-kb-pick")
        )


#: how the pages name the segment's size (a pack's tasks, a manifest's reference)
SEGMENT_PHRASES = re.compile(
    r"(?:per|every|its|segment of|pack every) (\d+) tasks|(\d+)-task (?:record )?segment"
)


def test_the_pages_give_the_segment_size_the_code_has() -> None:
    """docs/architecture.md, reliability.md and performance.md say how many tasks a segment and a pack hold:
    the number is :data:`SEGMENT_TASKS`."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    said = {
        (page, int(a or b))
        for page in ("architecture.md", "reliability.md", "performance.md")
        for a, b in SEGMENT_PHRASES.findall((docs / page).read_text())
    }
    assert {page for page, _ in said} == {"architecture.md", "reliability.md", "performance.md"}, said
    assert all(n == SEGMENT_TASKS for _, n in said), said


def test_a_pack_refuses_what_does_not_add_up() -> None:
    data = bytearray(pack_tasks(0, [_tensors(k) for k in range(3)]))
    pack = Pack(bytes(data))
    name, (_, _, start) = "@lengths", pack.entries["@lengths"]
    lengths = torch.frombuffer(bytes(data[start : start + 8]), dtype=torch.long).clone()
    data[start : start + 8] = (lengths + 1).numpy().tobytes()  # task 0 claims one more than the block holds
    with pytest.raises(ValueError, match="extents do not add up"):
        Pack(bytes(data))
    assert name in pack.entries


def _commit(kb: KnowledgeBase, k: int, size: int = 8) -> None:
    """A store-level commit of task k (a record and its object) and a new head."""
    rel, sha = kb.write_object(f"task{k:03d}", _tensors(k, size))
    record = {
        "index": k,
        "classes": [k],
        "class_names": [f"c{k}"],
        "n_train": 1,
        "object": rel,
        "sha256": sha,
    }
    hrel, hsha = kb.write_object("head", {"n": torch.tensor([k])}, reuse=False)
    tasks = [*kb.manifest["tasks"], record]
    kb.commit({**kb.manifest, "tasks": tasks, "head": {"meta": {"n": k + 1}, "object": hrel, "sha256": hsha}})


def test_the_commit_that_fills_a_segment_packs_it(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    kb = KnowledgeBase.new(root, HEADER)
    n = 2 * SEGMENT_TASKS + 5
    for k in range(n):
        _commit(kb, k)
        if k == SEGMENT_TASKS - 2:
            assert not any(is_pack(t["object"]) for t in kb.manifest["tasks"])
    tasks = KnowledgeBase.open(root).manifest["tasks"]
    packs = [t["object"] for t in tasks]
    assert all(is_pack(p) for p in packs[: 2 * SEGMENT_TASKS]) and not any(is_pack(p) for p in packs[-5:])
    assert len(set(packs[:SEGMENT_TASKS])) == 1 and len(set(packs[: 2 * SEGMENT_TASKS])) == 2
    # the packed tasks' own objects are swept; every task reads back as it was written
    names = {p.name for p in (root / "objects").iterdir()}
    loose = sorted(int(name[4:7]) for name in names if name.startswith("task"))
    assert loose == list(range(2 * SEGMENT_TASKS, n)), loose
    reader = KnowledgeBase.open(root)
    for k, t in enumerate(reader.manifest["tasks"]):
        got, want = reader.read_task(t), _tensors(k)
        assert sorted(got) == sorted(want) and all(torch.equal(got[m], want[m]) for m in want)
    assert kbmod.check(root).errors == [] and kbmod.problems(root) == []
    # undo goes back to the state before the last commit; undo again redoes it
    before = reader.manifest["tasks"]
    KnowledgeBase.open(root).undo()
    assert len(KnowledgeBase.open(root).manifest["tasks"]) == n - 1
    KnowledgeBase.open(root).undo()
    assert KnowledgeBase.open(root).manifest["tasks"] == before


def test_a_format_4_knowledge_base_opens_and_upgrade_packs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A knowledge base written by the release before packs (format 4: one object per task) reads the same
    tasks; ``upgrade`` packs its full segments (a commit), after which every task reads the same."""
    root = tmp_path / "kb"
    with monkeypatch.context() as m:  # the previous release: format 4, no packs
        m.setattr(proteus.kb.commit, "FORMAT_VERSION", 4)
        m.setattr(proteus.kb.commit, "packed", lambda manifest, objects: manifest)
        kb = KnowledgeBase.new(root, HEADER)
        for k in range(SEGMENT_TASKS + 3):
            _commit(kb, k)
    assert json.loads((root / "manifest.json").read_text())["format_version"] == 4
    old = KnowledgeBase.open(root)
    assert not any(is_pack(t["object"]) for t in old.manifest["tasks"])
    want = [{n: t.clone() for n, t in old.read_task(r).items()} for r in old.manifest["tasks"]]
    assert old.upgrade() == 4 and KnowledgeBase.open(root).upgrade() is None
    new = KnowledgeBase.open(root)
    assert json.loads((root / "manifest.json").read_text())["format_version"] == 5
    assert all(is_pack(t["object"]) for t in new.manifest["tasks"][:SEGMENT_TASKS])
    for r, w in zip(new.manifest["tasks"], want, strict=True):
        got = new.read_task(r)
        assert sorted(got) == sorted(w) and all(torch.equal(got[n], w[n]) for n in w)
    assert kbmod.check(root).errors == []


#: imports once, then per line (a knowledge base's folder) forks a child that opens it, says "ready", and at
#: the next line commits the task that fills its segment, then says "done" (the parent kills it meanwhile)
ZYGOTE = r"""
import os, sys
sys.path.insert(0, {tests!r})
import proteus.kb.commit, proteus.kb.files
for mod in (proteus.kb.files, proteus.kb.commit):
    mod._now = lambda: "2026-01-01T00:00:00Z"  # the same bytes in every run
import tempfile
from test_kb_packs import HEADER, _commit
from proteus.kb import KnowledgeBase
_commit(KnowledgeBase.new(tempfile.mkdtemp() + "/kb", HEADER), 0)  # every module a commit needs imported
print("warm", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        kb = KnowledgeBase.open(line.strip())
        print("ready", flush=True)
        sys.stdin.readline()
        _commit(kb, {k}, {size})
        print("done", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("exited", flush=True)
"""


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.slow
def test_a_commit_that_packs_killed_at_20_moments_leaves_the_old_state_or_the_new(tmp_path: Path) -> None:
    """SIGKILL at 20 seeded moments of the commit that fills a segment (it writes the pack, the segment, the
    manifest and sweeps): the knowledge base then opens verified and is its old state or its new one, byte
    for byte in what it references (the old state's files, or the new state's)."""
    size = 40_000  # each task about 0.5 MB: the pack's write takes a while
    base = tmp_path / "base"
    kb = KnowledgeBase.new(base, HEADER)
    for k in range(SEGMENT_TASKS - 1):
        _commit(kb, k, size)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    code = ZYGOTE.format(tests=str(Path(__file__).parent), k=SEGMENT_TASKS - 1, size=size)
    zygote = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    assert zygote.stdout.readline().strip() == b"warm"

    def say(line: str) -> None:
        zygote.stdin.write(f"{line}\n".encode())  # type: ignore[union-attr]
        zygote.stdin.flush()  # type: ignore[union-attr]

    def run(root: Path, kill_after: float | None) -> float:
        say(str(root))
        assert zygote.stdout.readline().strip() == b"ready"  # type: ignore[union-attr]
        t0 = time.perf_counter()
        say("go")
        if kill_after is None:
            assert zygote.stdout.readline().strip() == b"done"  # type: ignore[union-attr]
            took = time.perf_counter() - t0
        else:
            time.sleep(kill_after)
            subprocess.run(["pkill", "-KILL", "-P", str(zygote.pid)], check=False)
            took = kill_after
        line = zygote.stdout.readline().strip()  # type: ignore[union-attr]
        while line == b"done":
            line = zygote.stdout.readline().strip()  # type: ignore[union-attr]
        assert line.removeprefix(b"done") == b"exited"  # (killed in print: "done" alone)
        return took

    old = _files(base)
    ref = tmp_path / "ref"
    subprocess.run(["cp", "-a", str(base), str(ref)], check=True)
    duration = run(ref, None)
    new = _files(ref)
    assert is_pack(KnowledgeBase.open(ref).manifest["tasks"][0]["object"]) and new != old
    rng = random.Random(51)
    outcomes = {"old": 0, "new": 0, "cleaned by gc": 0}
    for i in range(20):
        root = tmp_path / f"kill{i}"
        subprocess.run(["cp", "-a", str(base), str(root)], check=True)
        at = run(root, rng.uniform(0.0, 1.2 * duration))
        where = f"killed {at * 1e3:.1f} ms into a commit of {duration * 1e3:.1f} ms"
        KnowledgeBase.open(root)  # every object it references verified
        now = _files(root)
        if now not in (old, new):  # what the killed commit left (its pack, an orphan) goes at the next sweep
            KnowledgeBase.open(root, verify=False).gc()
            now = _files(root)
            outcomes["cleaned by gc"] += 1
        assert now in (old, new), f"{where}: neither the old state nor the new one, byte for byte"
        outcomes["new" if now == new else "old"] += 1
        if i:
            subprocess.run(["rm", "-rf", str(root)], check=True)
    assert kbmod.check(tmp_path / "kill0").errors == []
    zygote.stdin.close()  # type: ignore[union-attr]
    zygote.wait()
    print(f"sealing commit ({duration * 1e3:.0f} ms) killed 20 times: {outcomes}")
    assert outcomes["old"] > 0


def _task(k: int) -> Any:
    """Task k of a synthetic stream: classes 2k and 2k + 1, each a fixed random pattern plus noise."""
    import numpy as np

    from proteus.streams.base import Task
    from proteus.streams.datasets import ArrayImageDataset

    rng = np.random.RandomState(k)
    images, labels = [], []
    for c in (2 * k, 2 * k + 1):
        pattern = np.random.RandomState(10_000 + c).randint(0, 256, (32, 32, 3))
        for _ in range(12):
            images.append(np.clip(pattern + rng.randint(-40, 41, (32, 32, 3)), 0, 255).astype(np.uint8))
            labels.append(c)
    arr, y = np.stack(images), np.array(labels)
    test = np.r_[np.arange(8, 12), np.arange(20, 24)]
    train = np.setdiff1d(np.arange(len(y)), test)
    return Task(k, [2 * k, 2 * k + 1], [f"c{2 * k}", f"c{2 * k + 1}"],
                ArrayImageDataset(arr, y[train], train), ArrayImageDataset(arr, y[test], test))  # fmt: skip


#: a small learner of real fits (random weights, 32 px, 2 adapted blocks, rank 2, one epoch)
_TINY = {"backbone.pretrained": False, "backbone.img_size": 32, "backbone.adapt_last": 2,
         "adapter.rank": 2, "train.epochs": 1, "head.rp_dim": 64}  # fmt: skip


@pytest.mark.slow
def test_a_learner_past_a_segment_predicts_the_same_from_its_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner committing every task: once a segment is full its tasks are read from the pack (their
    Gaussians and heads no longer held), it predicts as before, and a learner loaded from the knowledge base
    predicts the same, holding no task's Gaussians until a prediction shortlists it. Segments of 4 tasks
    here (the writer's size; a reader takes any): each task is a real fit, and the packing is the same."""
    from proteus import Proteus
    from proteus.engine.stored import TaskShares
    from proteus.experiment.store import commit

    sets = {**_TINY, "retrieval.shortlist": 4}
    segment = 4
    monkeypatch.setattr(proteus.kb.commit, "SEGMENT_TASKS", segment)
    monkeypatch.setattr(proteus.kb.segments, "SEGMENT_TASKS", segment)
    clf = Proteus.from_method("proteus", progress=False, **sets)
    root = tmp_path / "kb"
    n = 2 * segment + 2
    kb: KnowledgeBase | None = None
    for k in range(n):
        clf.fit_task(_task(k))
        kb = kb or KnowledgeBase.new(root, clf.kb_header())
        commit(kb, clf)
    tasks = KnowledgeBase.open(root).manifest["tasks"]
    assert all(is_pack(t["object"]) for t in tasks[: 2 * segment]) and not is_pack(tasks[-1]["object"])
    assert len({t["object"] for t in tasks[: 2 * segment]}) == 2  # one pack per full segment
    gaussians = clf.keys_.novelty.gaussians
    assert isinstance(gaussians, TaskShares) and not any(gaussians.held(k) for k in range(n))
    C = {name: u.C for name, u in clf.model_.units.items()}
    for u in clf.model_.units.values():  # a pack's rows of S: one view of it per map, the tasks' own let go
        views = {u.row(k).data_ptr() - 4 * sum(u.columns(j).start for j in range(k // segment * segment, k))
                 for k in range(1, 2 * segment)}  # fmt: skip  # (task 1 composes no older direction)
        assert len(views) == 2 and sum(b.numel() > 0 for b in u.rows.blocks) == 2 + 2
    x = clf.transform_images([_task(k).test[0][0] for k in range(n)])
    before = clf.predict(x)
    loaded = Proteus.load(root, progress=False)
    shares = loaded.keys_.novelty.gaussians
    assert isinstance(shares, TaskShares) and shares.decoded_bytes == 0  # nothing decoded at load
    after = loaded.predict(x)
    assert all(torch.equal(u.C, C[name]) for name, u in loaded.model_.units.items())
    assert torch.equal(after.label, before.label) and torch.equal(after.task, before.task)
    assert torch.equal(after.known, before.known) and torch.allclose(after.novelty, before.novelty)
    assert 0 < shares.decoded_bytes <= shares.budget  # type: ignore[operator]  # the shortlisted tasks'
    assert kbmod.problems(root) == []


def test_a_save_reads_again_only_the_tasks_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Proteus.save`` opens its knowledge base anew each time: a task whose record there equals the one its
    tensors were read from, in the same folder, keeps them (the adoption of a save costs the new task, not
    every task learned); saved to another folder, every task is read from that folder's objects."""
    from proteus import Proteus

    clf = Proteus.from_method("proteus", progress=False, **_TINY)
    root = tmp_path / "kb"
    for k in range(3):
        clf.fit_task(_task(k))
        clf.save(root)
    loaded = Proteus.load(root, progress=False)
    read: list[int] = []
    adopt = loaded.parts_.adopt
    monkeypatch.setattr(loaded.parts_, "adopt", lambda k, t: read.append(k) or adopt(k, t))
    x = loaded.transform_images([_task(k).test[0][0] for k in range(3)])
    loaded.fit_task(_task(3))
    loaded.save(root)
    assert read == [3]  # the new task only
    before = loaded.predict(x)
    read.clear()
    loaded.save(tmp_path / "other")
    assert read == [0, 1, 2, 3]  # another folder: its objects
    after = loaded.predict(x)
    assert torch.equal(after.label, before.label) and torch.allclose(after.novelty, before.novelty)


def test_a_save_commits_through_the_last_opening_while_the_folder_is_unchanged(tmp_path: Path) -> None:
    """A learner's saves to one folder commit through one opening of it (a save costs the commit, not a new
    opening of every record) until another opening commits there: then the folder is opened anew (its
    state replaced by this learner's, as a save always did). A copy of the learner holds no opening."""
    import copy

    from proteus import Proteus

    clf = Proteus.from_method("proteus", progress=False, **_TINY)
    root = tmp_path / "kb"
    clf.fit_task(_task(0))
    clf.save(root)
    opened = clf._kb
    clf.fit_task(_task(1))
    clf.save(root)
    assert clf._kb is opened and opened.is_current()
    loaded = Proteus.load(root, progress=False)
    assert loaded._kb.is_current() and "_kb" not in vars(copy.deepcopy(loaded))
    loaded.fit_task(_task(2))
    loaded.save(root)  # another opening commits: the learner's is stale now
    assert not opened.is_current()
    clf.save(root)  # opened anew; its two tasks are the state
    assert clf._kb is not opened and len(KnowledgeBase.open(root).manifest["tasks"]) == 2
    assert kbmod.problems(root) == []
