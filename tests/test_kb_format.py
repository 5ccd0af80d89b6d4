"""Format 4 of a knowledge base (:mod:`proteus.kb.segments`, :mod:`proteus.kb.chain`): a commit writes what
changed (the new task's object, the head, the last record segment, a manifest of one reference per segment),
so a commit at task 100 writes as many files as at task 10; every manifest names its parent by hash, and
``kb verify`` follows the chain; a knowledge base of the released format (3) opens and predicts unchanged and
``kb upgrade`` converts it in place; a newer format is refused naming both versions."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import proteus.kb as kbmod
import proteus.kb.objects
from kbfiles import as_released, read_manifest
from proteus.cli import main
from proteus.kb import KBError, KnowledgeBase
from proteus.kb.chain import walk
from proteus.kb.segments import SEGMENT_TASKS
from tiny import TINY, folder_args

HEADER: dict[str, Any] = {
    "proteus_version": "test",
    "backbone": {"name": "b"},
    "config": {"method": "proteus", "backbone": {"name": "b"}},
    "split": {"benchmark": "toy"},
}


def _append(kb: KnowledgeBase, k: int) -> None:
    """A store-level commit of one more task (with a record of a realistic size) and a new head."""
    rel, sha = kb.write_object(f"task{k:03d}", {"w": torch.full((16,), float(k))})
    record = {"index": k, "classes": [2 * k, 2 * k + 1], "class_names": [f"c{2 * k}", f"c{2 * k + 1}"],
              "n_train": 32, "settings": {"train.epochs": 1}, "object": rel, "sha256": sha}  # fmt: skip
    hrel, hsha = kb.write_object("head", {"G": torch.full((8, 8), float(k))}, reuse=False)
    tasks = [*kb.manifest["tasks"], record]
    kb.commit({**kb.manifest, "tasks": tasks, "head": {"meta": {"n": k + 1}, "object": hrel, "sha256": hsha}})


def test_a_commit_writes_the_same_files_at_task_100_as_at_task_10(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "kb"
    kb = KnowledgeBase.new(root, HEADER)
    written: list[tuple[str, int]] = []
    real = proteus.kb.objects.ObjectStore.write_new

    def record(self: Any, rel: str, data: bytes, sha: str | None = None) -> None:
        written.append((rel.split("/")[1].split("-")[0], len(data)))
        real(self, rel, data, sha)

    monkeypatch.setattr(proteus.kb.objects.ObjectStore, "write_new", record)
    sizes = {}
    for k in range(100):
        written.clear()
        _append(kb, k)
        if k in (9, 99):
            sizes[k + 1] = ((root / "manifest.json").stat().st_size, sorted(written))
    (m10, w10), (m100, w100) = sizes[10], sizes[100]
    # the new task's object, the head, and the one record segment that changed: at task 10 as at task 100
    assert [kind for kind, _ in w10] == ["head", "records", "task009"]
    assert [kind for kind, _ in w100] == ["head", "records", "task099"]
    segment10, segment100 = dict(w10)["records"], dict(w100)["records"]  # tasks 1-10; tasks 97-100
    assert segment100 < segment10 and SEGMENT_TASKS < 100
    # the manifest holds one reference per segment of SEGMENT_TASKS tasks, not one record per task
    m = json.loads((root / "manifest.json").read_text())
    assert "tasks" not in m and len(m["segments"]) == -(-100 // SEGMENT_TASKS) and m["num_tasks"] == 100
    assert m100 - m10 < 300 * (len(m["segments"]) - 1)  # a reference: names, two sha256, first, count
    assert [t["index"] for t in KnowledgeBase.open(root).manifest["tasks"]] == list(range(100))
    assert kbmod.problems(root) == []


def test_a_commit_checks_the_records_of_a_segment_it_keeps_only_against_the_new_ones(tmp_path: Path) -> None:
    """A commit re-checks the fields of the records it writes, not those of a segment it references again
    (a long stream's commit stays flat); a new task's class already held by a task of a kept segment is
    still refused."""
    kb = KnowledgeBase.new(tmp_path / "kb", HEADER)
    for k in range(SEGMENT_TASKS + 2):
        _append(kb, k)
    _append(kb, SEGMENT_TASKS + 2)
    assert kb.segments.reused == set(range(SEGMENT_TASKS))  # the first segment, referenced again unchecked
    rel, sha = kb.write_object("clash", {"w": torch.zeros(16)})
    clash = {"index": SEGMENT_TASKS + 3, "classes": [5, 999], "class_names": ["c5", "c999"], "n_train": 32,
             "settings": {"train.epochs": 1}, "object": rel, "sha256": sha}  # fmt: skip
    with pytest.raises(KBError, match=r"tasks\[35\].*class 5 is also in task index 2"):
        kb.commit({**kb.manifest, "tasks": [*kb.manifest["tasks"], clash]})


def test_every_commit_names_its_parent_and_verify_follows_the_chain(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    kb = KnowledgeBase.new(root, HEADER)
    for k in range(5):
        _append(kb, k)
    m = json.loads((root / "manifest.json").read_text())
    chain = list(walk(root, m))
    assert [p["sequence"] for _, _, p in chain] == [4, 3, 2, 1]
    assert chain[0][0] == "manifest.prev.json" and all(n.startswith("history/") for n, _, _ in chain[1:])
    assert json.loads((root / chain[-1][0]).read_text())["parent"] is None  # the first commit
    assert kbmod.problems(root) == []
    # a link of the chain removed: verify names it (the state itself still loads)
    history = root / chain[2][0]
    saved = history.read_bytes()
    history.unlink()
    problems = kbmod.check(root).errors
    assert len(problems) == 1 and f"{history}: missing" in problems[0] and "history" in problems[0], problems
    history.write_bytes(saved)
    # the previous state put back: the newer commit is still in history/ (every commit is kept there)
    shutil.copy(root / chain[0][0], root / "manifest.json")
    problems = kbmod.check(root).errors
    assert any("rollback" in p and "is commit 5" in p for p in problems), problems


def test_undo_and_gc_keep_the_chain(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    kb = KnowledgeBase.new(root, HEADER)
    for k in range(3):
        _append(kb, k)
    before = read_manifest(root, "manifest.prev.json")["tasks"]
    with KnowledgeBase.write_lock(root):
        KnowledgeBase.open(root).undo()
    now = KnowledgeBase.open(root).manifest
    assert now["tasks"] == before and now["sequence"] == 4
    assert [p["sequence"] for _, _, p in walk(root, json.loads((root / "manifest.json").read_text()))] == [
        3, 2, 1
    ]  # fmt: skip
    (root / "objects" / "orphan-0123456789abcdef.safetensors").write_bytes(b"x")
    with KnowledgeBase.write_lock(root):
        removed = KnowledgeBase.open(root).gc()
    assert [p.name for p, _ in removed] == ["orphan-0123456789abcdef.safetensors"]
    assert kbmod.problems(root) == []


@pytest.fixture(scope="module")
def kb2(world: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kb = tmp_path_factory.mktemp("kb2") / "kb"
    shutil.copytree(world["kb1"], kb)
    assert (
        main(["learn", "--kb", str(kb), "--task", "2", *folder_args(world["tree"], world["spec"]), *TINY])
        == 0
    )
    return kb


@pytest.fixture
def released(kb2: Path, tmp_path: Path) -> Path:
    """A 2-task knowledge base as the released format (3) wrote it: both manifests with their records
    inline, no record segment, no history."""
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    for name in ("manifest.json", "manifest.prev.json"):
        if (kb / name).exists():
            (kb / name).write_text(json.dumps(as_released(read_manifest(kb, name), 3), indent=1))
    shutil.rmtree(kb / "history", ignore_errors=True)
    for p in (kb / "objects").glob("records-*.json"):
        p.unlink()
    return kb


def _predict(kb: Path, img: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    assert main(["predict", "--kb", str(kb), str(img), "--json", "-q"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_released_kb_opens_predicts_and_upgrades_in_place(
    world: dict, kb2: Path, released: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    img = world["tree"] / "test" / "a" / "0.png"
    kb = released
    before = _predict(kb2, img, capsys)
    assert json.loads((kb / "manifest.json").read_text())["format_version"] == 3
    assert _predict(kb, img, capsys) == before
    assert main(["kb", "verify", str(kb)]) == 0
    tasks = KnowledgeBase.open(kb).manifest["tasks"]
    capsys.readouterr()
    assert main(["kb", "upgrade", str(kb)]) == 0
    assert "upgraded from format 3 to format 5" in capsys.readouterr().out
    m = json.loads((kb / "manifest.json").read_text())
    assert m["format_version"] == 5 and "tasks" not in m and m["parent"] is not None
    assert KnowledgeBase.open(kb).manifest["tasks"] == tasks
    assert _predict(kb, img, capsys) == before
    assert main(["kb", "verify", str(kb)]) == 0 and "OK" in capsys.readouterr().out
    assert main(["kb", "upgrade", str(kb)]) == 0 and "already in format 5" in capsys.readouterr().out
    assert main(["kb", "undo", str(kb)]) == 0  # back to the format-3 commit's content, written in format 4
    assert "restored" in capsys.readouterr().out
    assert KnowledgeBase.open(kb).manifest["tasks"] == tasks and _predict(kb, img, capsys) == before


def test_a_newer_format_is_refused_naming_both_versions(
    world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    m = json.loads((kb / "manifest.json").read_text())
    m["format_version"] = 6
    (kb / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError) as e:
        KnowledgeBase.open(kb)
    text = str(e.value)
    assert "format version 6" in text and "reads versions 1, 2, 3, 4, 5" in text and text.count("\n") == 0
    img = world["tree"] / "test" / "a" / "0.png"
    assert main(["predict", "--kb", str(kb), str(img), "-q"]) == 2
    err = capsys.readouterr().err
    assert "format version 6" in err and "1, 2, 3, 4, 5" in err and err.count("\n") == 1
    assert os.path.getsize(kb / "manifest.json") == len(json.dumps(m))  # refused, not rewritten


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose memory mapping holds ``t``'s data (Linux: /proc/self/maps), or None (anonymous)."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= address < hi:
            return parts[5] if len(parts) == 6 and parts[5].startswith("/") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_a_committed_or_loaded_task_is_held_from_its_mapped_object(tmp_path: Path) -> None:
    """After a commit, a learner holds each task's detector rows and Gaussians, its expert and its adapters'
    rows of S as views of its committed object, memory-mapped (the page cache, not the process's memory),
    and predicts the same; a learner loaded from the knowledge base holds them so from the start."""
    from proteus import Proteus
    from proteus.streams import build_benchmark

    tiny = {"backbone.pretrained": False, "backbone.img_size": 32, "train.epochs": 1}
    clf = Proteus.from_method("proteus", benchmark="quickstart", progress=False, **tiny)
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:2]:
        clf.fit_task(task)
    x = clf.transform_images([stream.tasks[1].test[i][0] for i in range(8)])
    before = clf.predict(x)
    expert = clf.heads_.experts.experts[1].W
    units = [u for u in clf.model_.units.values() if u.row(1).numel()]
    assert _mapped_file(expert) is None and units and _mapped_file(units[0].row(1)) is None  # learned: held
    clf.save(tmp_path / "kb")
    kb = KnowledgeBase.open(tmp_path / "kb")
    loaded = Proteus.load(tmp_path / "kb", progress=False)
    for k, learner in ((1, clf), (0, loaded)):
        obj = kb.manifest["tasks"][k]["object"]
        w = learner.heads_.experts.experts[k].W
        basis = learner.keys_.novelty.gaussians[k][0].basis
        assert str(_mapped_file(w)).endswith(obj) and str(_mapped_file(basis)).endswith(obj)
    for learner in (clf, loaded):  # task 2's rows of S (task 1 composes no older direction)
        rows = [u.row(1) for u in learner.model_.units.values() if u.row(1).numel()]
        assert len(rows) == len(units)
        assert all(str(_mapped_file(r)).endswith(kb.manifest["tasks"][1]["object"]) for r in rows)
    for learner in (clf, loaded):
        after = learner.predict(x)
        assert torch.equal(after.label, before.label) and torch.equal(after.known, before.known)
        assert torch.allclose(after.logits, before.logits) and not torch.equal(
            expert, torch.zeros_like(expert)
        )


def test_a_shortlisted_detector_is_read_back_fitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a shortlist shorter than the tasks, each task's calibration rows are scored under their
    candidates when it is learned (kept in its object); the detector is fitted from those numbers at the
    commit and kept with the keys in the head's object: a reader predicts the same, without scoring a
    row or fitting the detector again."""
    from proteus import Proteus
    from proteus.engine.novelty import ClassNovelty
    from proteus.streams import build_benchmark

    tiny = {"backbone.pretrained": False, "backbone.img_size": 32, "train.epochs": 1}
    tiny["retrieval.shortlist"] = 1
    clf = Proteus.from_method("proteus", benchmark="quickstart", progress=False, **tiny)
    stream = build_benchmark(clf.config.benchmark)
    for task in stream.tasks[:3]:
        clf.fit_task(task)
    novelty = clf.keys_.novelty
    assert all(k in novelty.scores for k in range(3))  # scored when learned
    clf.save(tmp_path / "kb")
    fitted = read_manifest(tmp_path / "kb")["head"]["meta"]["task_head"]["novelty_fit"]
    assert fitted["tpr"] == novelty.tpr and fitted["tasks"] == 3 and len(fitted["loc"]) == 4
    x = clf.transform_images([t.test[i][0] for t in stream.tasks[:3] for i in range(3)])
    before = clf.predict(x)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the reader scored calibration rows or fitted the detector again")

    monkeypatch.setattr(ClassNovelty, "score_task", refuse)
    monkeypatch.setattr(ClassNovelty, "_fit_tasks", refuse)
    back = Proteus.load(tmp_path / "kb", progress=False)
    after = back.predict(x)
    assert torch.equal(after.label, before.label) and torch.equal(after.known, before.known)
    assert back.keys_.novelty.thresholds() == novelty.thresholds()


def test_objects_are_the_bytes_safetensors_writes_without_a_ctypes_type_per_size() -> None:
    """:func:`proteus.kb.tensors.serialize` writes what ``safetensors.torch.save`` writes (every dtype a
    knowledge base stores, empty and 0-d tensors, non-contiguous ones), byte for byte: objects keep their
    names; and it leaves no ctypes array type behind per distinct tensor size (the library's ``save`` keeps
    one, so a learner committing after every task grew by them)."""
    import ctypes
    import gc
    import random

    from safetensors.torch import save

    from proteus.kb.tensors import TORCH_DTYPES, serialize

    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    dtypes = list(TORCH_DTYPES)
    for _ in range(100):
        d = {}
        for i in range(rng.randint(0, 8)):
            shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
            t = (torch.rand(shape, generator=g) * 100).to(rng.choice(dtypes))
            d[f"{rng.choice(['a', 'adapter/m/A', 'novelty/g0/basis', '@meta', 'Q'])}{i}"] = t
        d["strided"] = torch.arange(12.0).view(3, 4).T
        assert serialize(d) == save({k: v.contiguous() for k, v in d.items()})

    array_type = type(ctypes.c_char * 1)  # the metaclass of every ctypes array type

    def array_types() -> int:  # by metaclass: an object that only claims to be a type cannot fool type()
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is array_type)

    before = array_types()
    for n in range(1000, 1040):  # 40 sizes never written before
        serialize({"x": torch.zeros(n, dtype=torch.uint8)})
    assert array_types() == before


def test_kept_records_that_share_a_class_are_still_named() -> None:
    """The kept records' classes are gathered in one pass when they are a prefix with distinct classes; a
    class two kept records share sends the check back to the record-by-record walk, which names it."""
    from proteus.kb.schema import _kept_owners, manifest_problems

    tasks = [{"index": i, "classes": [2 * i, 2 * i + 1]} for i in range(4)]
    assert _kept_owners(tasks, {0, 1, 2}) == ({0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}, 3)
    assert _kept_owners(tasks, {1, 2}) == ({}, 0)  # not a prefix: walked
    tasks[2]["classes"] = [1, 5]
    assert _kept_owners(tasks, {0, 1, 2}) == ({}, 0)
    problems = manifest_problems({"tasks": tasks}, kept={0, 1, 2})
    assert any("tasks[2] (task index 2).classes: class 1 is also in task index 0" in p for p in problems)


def test_the_kept_records_classes_remembered_from_commit_to_commit_equal_a_fresh_walk() -> None:
    """:class:`ClassOwners` extends, shortens (a segment that changed) or restarts (other records) the map of
    the previous call, and gives what a walk of the same records gives, a shared class included."""
    from proteus.kb.schema import ClassOwners, _kept_owners

    def fresh(prefix: list) -> dict | None:
        owner = {c: i for i, t in enumerate(prefix) for c in t["classes"]}
        return owner if len(owner) == sum(len(t["classes"]) for t in prefix) else None

    tasks = [{"index": i, "classes": [2 * i, 2 * i + 1]} for i in range(40)]
    cache = ClassOwners()
    for m in (32, 40, 33, 8, 40, 40):  # first, longer, shorter, much shorter, longer again, the same
        got = cache.of(tasks[:m])
        assert got == fresh(tasks[:m]) and got is not cache.of(tasks[:m])  # a copy the caller may change
        got[-1] = 0  # (changing it leaves the remembered map as it was)
        assert -1 not in cache.of(tasks[:m])
    other = [dict(t) for t in tasks]  # equal records, other objects: walked again
    other[5] = {"index": 5, "classes": [0]}  # class 0 is task 0's
    assert cache.of(other[:10]) is None and fresh(other[:10]) is None
    assert cache.of(tasks[:3]) == fresh(tasks[:3])
    assert _kept_owners(tasks, set(range(12)), cache) == (fresh(tasks[:12]), 12)
    assert cache.of([{"classes": [[1]]}]) is None  # an unhashable class: walked, named there


def test_a_rule_within_each_record_names_its_task_and_skips_the_records_checked() -> None:
    """``source_classes`` must name one source per class: a record that breaks it is named by its position;
    a commit's check asks it only of the records not checked before (``checked``, ``first``)."""
    import proteus.core.codec  # noqa: F401  (the learner's parts declare their rules)
    from proteus.kb.schema import manifest_problems
    from proteus.tensor_rules import TENSOR_RULES, record_problems

    tasks = [{"index": i, "classes": [i], "source_classes": [i]} for i in range(6)]
    tasks[4]["source_classes"] = [4, 9]
    rules = TENSOR_RULES.rules("proteus")

    def where(i: int) -> str:
        return f"tasks[{i}]"

    def found(**kw: object) -> list[str]:
        return [p for p in record_problems(tasks, None, rules, "proteus", where, **kw) if "source" in p]

    assert found() == ["tasks[4].source_classes: has 2 items, but classes has 1"]
    assert found(checked=lambda i: i == 4) == [] and found(first=5) == []
    problems = manifest_problems({"tasks": tasks}, learner="proteus")
    assert any(p.startswith("tasks[4] (task index 4).source_classes: has 2 items") for p in problems)


def test_a_class_outside_the_head_is_named_whichever_task_holds_it() -> None:
    """Every class of every record is checked against the head's classes in one pass; one outside sends the
    check to the record-by-record walk, which names the task and the class."""
    from proteus.heads.persist import classes_outside

    head = {"embed_dim": 8, "num_classes": 6}
    tasks = [{"classes": [0, 1]}, {"classes": [2, 3]}, "not a record", {"classes": "not a list"}]
    where = "tasks[{}]".format
    assert classes_outside(tasks, head, where) == []
    tasks.append({"classes": [4, 6]})
    assert classes_outside(tasks, head, where) == [
        "tasks[4].classes: class 6 is not one of the head's 6 classes (head.meta.num_classes: the head "
        "scores the global labels 0 .. num_classes - 1)"
    ]
    tasks[0]["classes"] = [-1, "x"]  # not numbers only: each record looked at
    assert [p.split(".")[0] for p in classes_outside(tasks, head, where)] == ["tasks[0]", "tasks[4]"]
