"""Knowledge base storage: atomic commits, checksums, format and backbone checks, no pickle."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from proteus.kb import FORMAT_VERSION, KBError, KnowledgeBase


def _kb(tmp_path):
    return KnowledgeBase.create(tmp_path / "kb", {"backbone": {"name": "b", "weights_sha256": "x"}})


def test_commit_roundtrip_bit_exact(tmp_path) -> None:
    kb = _kb(tmp_path)
    t = {"a": torch.randn(5, 3, dtype=torch.float64), "b": torch.randn(7).half()}
    rel, sha = kb.write_object("task000", t)
    kb.commit({**kb.manifest, "tasks": [{"index": 0, "object": rel, "sha256": sha}]})
    kb2 = KnowledgeBase.open(tmp_path / "kb")
    back = kb2.read(rel, sha)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_truncated_or_edited_object_is_detected(tmp_path) -> None:
    kb = _kb(tmp_path)
    rel, sha = kb.write_object("task000", {"a": torch.ones(100)})
    kb.commit({**kb.manifest, "tasks": [{"index": 0, "object": rel, "sha256": sha}]})
    path = tmp_path / "kb" / rel
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(KBError, match="size mismatch .*472 bytes, the file has 462"):
        KnowledgeBase.open(tmp_path / "kb")
    path.write_bytes(data[:-10] + b"x" * 10)  # the same size, other bytes
    with pytest.raises(KBError, match="checksum mismatch"):
        KnowledgeBase.open(tmp_path / "kb")
    path.unlink()
    with pytest.raises(KBError, match="missing"):
        KnowledgeBase.open(tmp_path / "kb")


def test_uncommitted_objects_are_invisible_and_swept(tmp_path) -> None:
    kb = _kb(tmp_path)
    rel0, sha0 = kb.write_object("task000", {"a": torch.zeros(3)})
    kb.commit({**kb.manifest, "tasks": [{"index": 0, "object": rel0, "sha256": sha0}]})
    # a crash after writing an object but before the manifest: the KB is still the old state
    orphan, _ = kb.write_object("task001", {"a": torch.ones(3)})
    (tmp_path / "kb" / ".manifest.json.tmp-999").write_text("{partial")
    kb2 = KnowledgeBase.open(tmp_path / "kb")
    assert len(kb2.manifest["tasks"]) == 1
    kb2.commit(kb2.manifest)
    assert not (tmp_path / "kb" / orphan).exists()
    assert not list((tmp_path / "kb").glob(".manifest.json.tmp-*"))


def test_format_version_and_backbone_mismatch_are_named(tmp_path) -> None:
    kb = _kb(tmp_path)
    with pytest.raises(KBError, match="weights_sha256"):
        kb.check_backbone({"name": "b", "weights_sha256": "y"})
    m = json.loads((tmp_path / "kb" / "manifest.json").read_text())
    m["format_version"] = FORMAT_VERSION + 1
    (tmp_path / "kb" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError, match="format version"):
        KnowledgeBase.open(tmp_path / "kb")
    (tmp_path / "kb" / "manifest.json").write_text("{not json")
    with pytest.raises(KBError, match="corrupt manifest"):
        KnowledgeBase.open(tmp_path / "kb")


def test_no_pickle_in_kb(tmp_path) -> None:
    kb = _kb(tmp_path)
    rel, sha = kb.write_object("head", {"G": torch.eye(3)})
    kb.commit({**kb.manifest, "head": {"object": rel, "sha256": sha, "meta": {}}})
    for p in (tmp_path / "kb").rglob("*"):
        if p.is_file():
            assert p.suffix in {".json", ".safetensors"}, p
            assert not p.read_bytes().startswith(b"\x80"), f"{p} looks like a pickle"


def test_commit_serialises_only_the_objects_whose_content_changed(tmp_path, monkeypatch) -> None:
    """A long stream re-commits k tasks per task: unchanged objects are found by their content key, never
    serialised again; a change in place (same shape) or a deleted file is always written."""
    import proteus.kb.objects as objects

    saved: list[set[str]] = []
    real_save = objects.serialize_chunks
    monkeypatch.setattr(objects, "serialize_chunks", lambda t: saved.append(set(t)) or real_save(t))
    kb = _kb(tmp_path)
    tensors = [{"a": torch.randn(4, 3), "n": torch.tensor([k])} for k in range(3)]
    head = ({"m": 1}, {"G": torch.randn(3, 3, dtype=torch.float64)})
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)], head)
    assert len(saved) == 4
    saved.clear()
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)], head)  # nothing changed
    assert saved == [{"G"}]  # the head (it changes at every task: never looked up)
    saved.clear()
    before = [t["object"] for t in kb.manifest["tasks"]]
    tensors[1]["a"][0, 0] += 1.0  # in place: same tensor, same shape, other bytes
    tensors[2]["a"].view(torch.int32)[1, 1] ^= 1  # one bit
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)], head)
    assert saved == [{"a", "n"}, {"a", "n"}, {"G"}]  # tasks 2 and 3, then the head
    after = [t["object"] for t in kb.manifest["tasks"]]
    assert after[0] == before[0] and after[1] != before[1] and after[2] != before[2]
    saved.clear()
    (tmp_path / "kb" / after[0]).unlink()  # an object gone from disk is written again, not assumed
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)], head)
    assert len(saved) == 2 and (tmp_path / "kb" / after[0]).is_file()
    back = KnowledgeBase.open(tmp_path / "kb")
    assert all(
        torch.equal(back.read(r["object"], r["sha256"])["a"], tensors[k]["a"])
        for k, r in enumerate(back.manifest["tasks"])
    )


def test_commit_hashes_each_unchanged_tensor_object_once(tmp_path, monkeypatch) -> None:
    """Re-committing the same tensor objects hashes none of them again (a long stream's commit stays flat);
    a tensor changed in place (its version moves), a new object of equal content, and a tensor that requires
    a gradient (an optimiser may write it through ``.data``, unseen by the version counter) are hashed."""
    import proteus.kb.content as content

    hashed: list[tuple[int, ...]] = []
    real = content.tensor_digest
    monkeypatch.setattr(content, "tensor_digest", lambda t: hashed.append(tuple(t.shape)) or real(t))
    kb = _kb(tmp_path)
    tensors = [{"a": torch.randn(4, 3), "n": torch.tensor([k])} for k in range(3)]
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)], None)
    assert len(hashed) == 6
    hashed.clear()
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)], None)
    assert hashed == []
    tensors[0]["a"].view(torch.int32)[0, 0] ^= 1  # in place, through a view
    tensors[1] = {"a": tensors[1]["a"].clone(), "n": tensors[1]["n"]}  # equal content, a new object
    p = torch.nn.Parameter(torch.randn(2, 2))
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)] + [({"index": 3}, {"p": p})], None)
    assert sorted(hashed) == [(2, 2), (4, 3), (4, 3)]
    objects = [t["object"] for t in kb.manifest["tasks"]]
    with torch.no_grad():
        p.data.add_(1.0)  # not counted by the version counter
    kb.commit_state([({"index": k}, t) for k, t in enumerate(tensors)] + [({"index": 3}, {"p": p})], None)
    assert kb.manifest["tasks"][3]["object"] != objects[3]
    back = KnowledgeBase.open(tmp_path / "kb")
    got = [back.read(r["object"], r["sha256"]) for r in back.manifest["tasks"]]
    assert all(torch.equal(got[k]["a"], tensors[k]["a"]) for k in range(3)) and torch.equal(got[3]["p"], p)


def test_commit_keys_each_unchanged_object_once(tmp_path, monkeypatch) -> None:
    """An object whose kind comes back with the same tensor objects, unmodified, keeps its content key (no
    key rebuilt: a commit of a long stream checks its old tasks by identity); one tensor changed in place,
    replaced, or one more tensor, and the key is built again."""
    import proteus.kb.content as content

    built: list[str] = []
    real = content.content_key
    monkeypatch.setattr(content, "content_key", lambda kind, *a: built.append(kind) or real(kind, *a))
    kb = _kb(tmp_path)
    tensors = [{"a": torch.randn(4, 3), "n": torch.tensor([k])} for k in range(4)]
    kb.commit_state([({"index": k}, dict(t)) for k, t in enumerate(tensors)], None)
    assert built == ["task000", "task001", "task002", "task003"]
    built.clear()
    kb.commit_state([({"index": k}, dict(t)) for k, t in enumerate(tensors)], None)  # new dicts, same tensors
    assert built == []
    tensors[1]["a"][0, 0] += 1.0
    tensors[2]["n"] = tensors[2]["n"].clone()
    tensors[3]["b"] = torch.zeros(1)
    kb.commit_state([({"index": k}, dict(t)) for k, t in enumerate(tensors)], None)
    assert built == ["task001", "task002", "task003"]
    objects = [t["object"] for t in kb.manifest["tasks"]]
    assert len(set(objects)) == 4 and KnowledgeBase.open(tmp_path / "kb").read(
        kb.manifest["tasks"][1]["object"], kb.manifest["tasks"][1]["sha256"]
    )["a"].equal(tensors[1]["a"])


def test_commit_refuses_a_changed_record_the_schema_rejects(tmp_path) -> None:
    """A commit re-validates only the task records that differ from the committed ones: a changed record
    that breaks the schema is refused, whether it is a new dict or the committed record edited in place."""
    kb = _kb(tmp_path)
    tensors = [{"a": torch.randn(2, 2)} for _ in range(3)]
    kb.commit_state([({"index": k, "classes": [k]}, t) for k, t in enumerate(tensors)], None)
    bad = [dict(r) for r in kb.manifest["tasks"]]
    bad[1]["classes"] = "not a list"
    with pytest.raises(KBError, match=r"tasks\[1\].*classes"):
        kb.commit({**kb.manifest, "tasks": bad})
    kb.manifest["tasks"][2]["classes"] = "not a list"  # the committed record itself, edited in place
    with pytest.raises(KBError, match=r"tasks\[2\].*classes"):
        kb.commit(dict(kb.manifest))
    kb.manifest["tasks"][2]["classes"] = [2]
    kb.commit(dict(kb.manifest))  # unchanged records pass


def test_a_task_unchanged_since_its_record_was_stored_is_not_built(tmp_path) -> None:
    """A learner hands its tasks over as :class:`~proteus.learners.TaskParts`: a task whose token is the
    record the knowledge base holds for it (the one committed, or read: an equal record in another
    :class:`KnowledgeBase` of the same directory) keeps that record without its part being built; a task
    whose token was dropped (it changed) is built and written again."""
    from proteus.learners import TaskParts

    kb = _kb(tmp_path)
    built: list[int] = []
    tokens: dict[int, Any] = {}

    def parts(n: int, offset: float = 0.0) -> TaskParts:
        def build(k: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            built.append(k)
            return {"index": k}, {"a": torch.full((2,), k + offset)}

        return TaskParts(n, build, tokens.get, tokens.__setitem__)

    kb.commit_state(parts(3), None)
    assert built == [0, 1, 2] and [tokens[k] for k in range(3)] == kb.manifest["tasks"]
    built.clear()
    kb.commit_state(parts(4), None)
    assert built == [3]
    del tokens[1]  # task 2 changed
    built.clear()
    kb.commit_state(parts(4, offset=0.5), None)
    second = kb.manifest["tasks"][1]
    assert built == [1] and float(kb.read(second["object"], second["sha256"])["a"][0]) == 1.5
    built.clear()
    again = KnowledgeBase.open(tmp_path / "kb")  # records read again: equal to the tokens, not the same dicts
    again.commit_state(parts(5), None)
    assert built == [4] and len(again.manifest["tasks"]) == 5
    other = _kb(tmp_path / "other")  # another knowledge base holds other records: every part is built
    built.clear()
    other.commit_state(parts(2), None)
    assert built == [0, 1]
