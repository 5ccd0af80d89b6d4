"""Issue 25: a knowledge base that is safe to receive from someone else (docs/reliability.md, "A knowledge
base from someone else"; cases M03-M12, K10 of the newcomer review).

* object paths confined to ``objects/`` (M05, M06): ``..``, absolute paths and symlinks out are refused
  before the file is opened (an audit hook records every ``open``);
* the manifest's schema (M03, M09, wrong types), before any tensor is read;
* tensors: halved (M11) or NaN (M12) tensors named by task, file and tensor, in ``kb verify`` and when a
  learner is loaded;
* the optional HMAC signature: sign, verify, tamper, wrong key, ``$PROTEUS_KB_KEY_FILE``, re-signing commits;
* a full disk (ENOSPC, simulated) leaves no temporary file and no orphan, and names the path and the sizes;
  ``kb gc``; ``kb verify``'s warnings; ``kb undo``'s message; ``kb info``'s bytes on disk.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import proteus.kb as kbmod
import proteus.kb.files as kbfiles
from kbfiles import read_manifest, write_manifest
from proteus.cli import main
from proteus.kb import KEY_ENV, KBError, KnowledgeBase, manifest_checksum
from proteus.kb.signing import key_id
from tiny import TINY, folder_args

HEADER: dict[str, Any] = {
    "proteus_version": "test",
    "backbone": {"name": "b", "weights_sha256": "x"},
    "config": {"method": "proteus", "backbone": {"name": "b"}},
    "split": {"benchmark": "toy"},
}


# ====================================================================== helpers
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only inside opened_files()


class _Opened:
    """The paths this process opens inside the ``with`` block (``sys.audit``'s "open" events)."""

    def __enter__(self) -> list[str]:
        global _OPENED
        _OPENED = []
        return _OPENED

    def __exit__(self, *exc: object) -> None:
        global _OPENED
        _OPENED = None


def _manifest(kb: Path, name: str = "manifest.json") -> dict[str, Any]:
    """Manifest ``name`` with its task records (format 4: read from its record segments)."""
    return read_manifest(kb, name)


def _write_manifest(kb: Path, m: dict[str, Any], name: str = "manifest.json", checksum: bool = True) -> None:
    """Write a hand-edited manifest (format 4: its records in new record segments), its checksum recomputed
    (a hostile editor can)."""
    write_manifest(kb, m, name, checksum)


def _append(kb: KnowledgeBase, name: str) -> None:
    """A store-level commit: one more task (classes 2k, 2k+1) and a new head."""
    rel, sha = kb.write_object(f"task-{name}", {"w": torch.randn(3, 4)})
    tasks = list(kb.manifest["tasks"])
    k = len(tasks)
    tasks.append(
        {"index": k, "classes": [2 * k, 2 * k + 1], "class_names": [f"{name}-a", f"{name}-b"], "n_train": 4,
         "object": rel, "sha256": sha}
    )  # fmt: skip
    hrel, hsha = kb.write_object("head", {"n": torch.tensor([k + 1]), "x": torch.randn(8, 8)})
    kb.commit({**kb.manifest, "tasks": tasks, "head": {"meta": {"n": k + 1}, "object": hrel, "sha256": hsha}})


def _store_kb(root: Path, names: tuple[str, ...] = ("t0", "t1")) -> Path:
    """A store-level KB with ``names`` committed one by one (so manifest.prev.json holds all but the last)."""
    for i, name in enumerate(names):
        with KnowledgeBase.write_lock(root):
            _append(KnowledgeBase.new(root, HEADER) if i == 0 else KnowledgeBase.open(root), name)
    return root


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_object(
    kb: Path, index: int, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> Path:
    """Replace task ``index``'s object by ``edit`` of its tensors, named, hashed and recorded as the store
    would (manifest checksum recomputed): only the tensors' content can tell."""
    m = _manifest(kb)
    t = m["tasks"][index]
    data = st_save(edit(dict(st_load((kb / t["object"]).read_bytes()))))
    sha = hashlib.sha256(data).hexdigest()
    rel = f"objects/task{index:03d}-{sha[:16]}.safetensors"
    (kb / rel).write_bytes(data)
    t["object"], t["sha256"] = rel, sha
    _write_manifest(kb, m)
    return kb / rel


def _img(world: dict) -> str:
    return str(world["tree"] / "test" / "a" / "0.png")


@pytest.fixture(scope="module")
def kb2(world: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-task KB (the world's task 1, then task 2 through the CLI): copy it before writing to it."""
    kb = _copy(world["kb1"], tmp_path_factory.mktemp("kb2") / "kb")
    assert (
        main(["learn", "--kb", str(kb), "--task", "2", *folder_args(world["tree"], world["spec"]), *TINY])
        == 0
    )
    assert kbmod.problems(kb) == []
    return kb


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "kb.key"
    path.write_text("0123456789abcdef" * 4 + "\n")
    path.chmod(0o600)  # a private key, as ssh wants one
    return path


# ====================================================================== M05 / M06: paths confined
@pytest.mark.parametrize("attack", ["dotdot", "absolute", "symlink", "symlinked-objects"])
def test_object_paths_outside_the_kb_are_refused_unread(
    world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], attack: str
) -> None:
    """A valid safetensors outside the KB (a copy of task 1's own object: it would load and predict) named
    by ``..``, by an absolute path, by a symlink in objects/ or through a symlinked objects/: every command
    refuses it by name, and the file is never opened."""
    kb = _copy(world["kb1"], tmp_path / "kb")
    m = _manifest(kb)
    t = m["tasks"][0]
    outside = tmp_path / "outside" / "planted.safetensors"
    outside.parent.mkdir()
    shutil.copy(kb / t["object"], outside)
    if attack == "dotdot":
        t["object"] = "objects/../../outside/planted.safetensors"
    elif attack == "absolute":
        t["object"] = str(outside)
    elif attack == "symlink":
        (kb / t["object"]).unlink()
        (kb / t["object"]).symlink_to(outside)  # the name the store would give it: only resolve() tells
    else:
        elsewhere = tmp_path / "outside" / "objects"
        shutil.move(kb / "objects", elsewhere)
        (kb / "objects").symlink_to(elsewhere)
    _write_manifest(kb, m)
    before = _files(kb)
    capsys.readouterr()
    with _Opened() as opened:
        with pytest.raises(KBError) as e:
            KnowledgeBase.open(kb)
        report = kbmod.check(kb)
        rcs = [
            main(["kb", "verify", str(kb)]),
            main(["kb", "info", str(kb)]),
            main(["predict", "--kb", str(kb), _img(world), "-q"]),
            main(["kb", "undo", str(kb)]),
            main(["kb", "gc", str(kb)]),
        ]
    planted = {str(outside), str(outside.parent / "objects"), str(outside.resolve())}
    assert not [p for p in opened if any(p.startswith(x) for x in planted) or p.endswith(outside.name)], (
        opened
    )
    msg = str(e.value)
    # through a symlinked objects/ the first file refused is the record segment holding task 0's record; a
    # name refused is found in that segment (its tasks[0]), before the records are expanded
    named = (
        ("task index 0", "objects/records-")
        if attack == "symlinked-objects"
        else ("task index 0", "tasks[0].object")
    )
    assert msg.startswith(f"{kb / 'manifest.json'}: ") and any(n in msg for n in named), msg
    assert "object path" in msg and "refused: " in msg, msg
    assert any(any(n in p for n in named) and "refused" in p for p in report.errors), report.errors
    assert rcs == [1, 2, 2, 2, 2], rcs
    err = capsys.readouterr().err
    assert "refused" in err and "Traceback" not in err and "internal error" not in err, err
    assert _files(kb) == before  # nothing written, nothing deleted


def test_previous_manifest_paths_are_confined_too(tmp_path: Path) -> None:
    """An object path of manifest.prev.json outside objects/: verify names it, undo refuses it, and
    neither a commit's sweep nor gc touches the file."""
    kb = _store_kb(tmp_path / "kb")
    outside = tmp_path / "victim.safetensors"
    outside.write_bytes(st_save({"x": torch.ones(2)}))
    prev = _manifest(kb, "manifest.prev.json")
    prev["head"]["object"] = "../victim.safetensors"
    prev["head"]["sha256"] = hashlib.sha256(outside.read_bytes()).hexdigest()
    _write_manifest(kb, prev, "manifest.prev.json")
    with _Opened() as opened:
        problems = kbmod.problems(kb)
        with (
            KnowledgeBase.write_lock(kb),
            pytest.raises(KBError, match=r"manifest.prev.json: head.object: object path"),
        ):
            KnowledgeBase.open(kb).undo()
        with KnowledgeBase.write_lock(kb):
            _append(KnowledgeBase.open(kb), "t2")
    assert not [p for p in opened if "victim" in p], opened
    assert any(
        "manifest.prev.json: head.object: object path '../victim.safetensors' refused" in p for p in problems
    )
    assert outside.exists()


def test_object_names_must_be_the_stores(tmp_path: Path) -> None:
    kb = _store_kb(tmp_path / "kb", ("t0",))
    good = _manifest(kb)
    obj = good["tasks"][0]["object"]
    for bad, why in (
        ("objects/notes.txt", "not a name this proteus writes"),
        ("manifest.json", "not a name this proteus writes"),
        ("objects/sub/task-0123456789abcdef.safetensors", "not a name this proteus writes"),
        (obj.replace(obj[-28:-12], "0" * 16), "does not carry its sha256"),
    ):
        m = json.loads(json.dumps(good))
        m["tasks"][0]["object"] = bad
        _write_manifest(kb, m)
        with pytest.raises(KBError, match=why):
            KnowledgeBase.open(kb)


# ====================================================================== M03 / M09 / types: the schema
_GONE = object()
#: (id, where in the manifest, the value written there (_GONE: the key removed), what the error says)
SCHEMA_CASES = [
    ("M03-n_train", ("tasks", 0, "n_train"), "lots",
     "tasks[0] (task index 0).n_train: expected an integer >= 0, got 'lots'"),
    ("M03-classes", ("tasks", 0, "classes"), "2,3",
     "tasks[0] (task index 0).classes: expected a list of an integer >= 0, got '2,3'"),
    ("M09-classes-of-task-1", ("tasks", 1, "classes"), [0, 0],
     "tasks[1] (task index 1).classes: class 0 is also in task index 0"),
    ("duplicate-class", ("tasks", 1, "classes"), [2, 2],
     "tasks[1] (task index 1).classes: class 2 is earlier in its list"),
    ("class-names", ("tasks", 0, "class_names"), ["a"], "class_names: has 1 items, but classes has 2"),
    ("has-adapter-type", ("tasks", 0, "has_adapter"), "yes",
     ".has_adapter: expected true or false, got 'yes'"),
    ("has-adapter-gone", ("tasks", 0, "has_adapter"), _GONE,
     ".has_adapter: missing (a proteus learner's task record needs it)"),
    ("index", ("tasks", 1, "index"), 0,
     "tasks[1] (task index 1).index: is 0, but the record is at position 1"),
    ("sha256", ("tasks", 0, "sha256"), "X" * 64, ".sha256: expected 64 lowercase hex digits"),
    ("calibration", ("tasks", 0, "calibration"), {"scores": [], "tpr": 2, "threshold": 0},
     "calibration.tpr: expected a number in (0, 1], got 2"),
    ("forgotten", ("tasks", 0, "forgotten"), 1, ".forgotten: expected true or false, got 1"),
    ("train-stats", ("tasks", 0, "stats", "train", "extra"), 1, "stats.train.extra: not a field of"),
    ("M04-embed-dim", ("backbone", "embed_dim"), 10**30,
     "backbone.embed_dim: expected an integer in [0, 16777216] or null"),
    ("config-type", ("config",), [1, 2], "config: expected a mapping, got [1, 2]"),
    ("config-gone", ("config",), _GONE, "config: missing"),
    ("head-classes", ("head", "meta", "num_classes"), -1, "head.meta.num_classes: expected an integer >= 0"),
    ("head-gone", ("head",), None, "head: missing"),
    ("evaluation", ("evaluation",), {"row": 1}, "evaluation: expected a list of a mapping"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("where", "value", "expect"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_violations_are_named(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: tuple, value: Any,
    expect: str,
) -> None:  # fmt: skip
    """A hand edit with the checksum recomputed (M03, M09, wrong types and ranges): refused on open, before
    any object is read, naming the KB's manifest, the task and the field; `kb verify` lists it (exit 1), `kb
    info` and `predict` refuse it in one line (exit 2)."""
    kb = _copy(kb2, tmp_path / "kb")
    m = _manifest(kb)
    parent = m
    for key in where[:-1]:
        parent = parent[key]
    if value is _GONE:
        del parent[where[-1]]
    else:
        parent[where[-1]] = value
    _write_manifest(kb, m)
    with _Opened() as opened:
        with pytest.raises(KBError) as e:
            KnowledgeBase.open(kb)
    assert not [p for p in opened if "/objects/" in p], "an object was read before the manifest was checked"
    assert str(e.value).startswith(f"{kb / 'manifest.json'}: ") and expect in str(e.value), str(e.value)
    assert expect in " ".join(kbmod.check(kb).errors)
    capsys.readouterr()
    assert main(["kb", "verify", str(kb)]) == 1
    assert expect in capsys.readouterr().out
    for argv in (["kb", "info", str(kb)], ["predict", "--kb", str(kb), _img(world), "-q"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "internal error" not in err, err


def test_a_kb_written_by_the_current_code_validates(kb2: Path) -> None:
    from proteus.kb.schema import manifest_problems

    for name in ("manifest.json", "manifest.prev.json"):
        assert manifest_problems(_manifest(kb2, name)) == []
    assert kbmod.check(kb2).errors == [] and kbmod.check(kb2).warnings == []


def test_a_baselines_kb_validates_and_its_head_must_match_its_tasks(world: dict, tmp_path: Path) -> None:
    """A baseline's KB (records: index, classes, class_names, n_train; head meta: method, task_classes)."""
    out = tmp_path / "run"
    argv = ["run", "--out", str(out), "--method", "ncm", *folder_args(world["tree"], world["spec"]), *TINY]
    assert main(argv) == 0
    kb = out / "kb"
    assert kbmod.check(kb).errors == [] and kbmod.check(kb).warnings == []
    m = _manifest(kb)
    m["head"]["meta"]["task_classes"][1] = [3, 2]
    _write_manifest(kb, m)
    with pytest.raises(KBError, match=r"head.meta.task_classes: differs from the tasks' classes"):
        KnowledgeBase.open(kb)
    m["head"]["meta"]["task_classes"][1] = [2, 3]
    del m["tasks"][1]["n_train"]
    _write_manifest(kb, m)
    with pytest.raises(KBError, match=r"tasks\[1\] \(task index 1\).n_train: missing \(a baseline learner"):
        KnowledgeBase.open(kb)


# ====================================================================== M11 / M12: tensors
def _halve(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    a = next(n for n in out if n.startswith("adapter/") and n.endswith("/A"))
    s = a[:-1] + "s"
    out[a] = out[a][: out[a].shape[0] // 2].contiguous()
    out[s] = out[s][: out[s].shape[0] // 2].contiguous()
    out["expert/W"] = out["expert/W"][:, :1].contiguous()
    return out


def test_halved_tensors_are_caught_by_verify_and_on_load(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """M11: three tensors of task 2 halved, file and manifest re-hashed: verify names each (file, tensor,
    task, the rule), loading refuses with a KBError instead of a RuntimeError in the model."""
    kb = _copy(kb2, tmp_path / "kb")
    path = _rewrite_object(kb, 1, _halve)
    errors = kbmod.check(kb).errors
    a = next(e for e in errors if "/A'" in e)
    assert a.startswith(f"{path}: tensor 'adapter/") and "axis 0 should be" in a and "(task index 1)" in a
    assert "every task's A of a map has the same q" in a
    s = next(e for e in errors if "/s'" in e)
    assert "s has one entry per column of the earlier tasks' adapters" in s and "(task index 1)" in s
    w = next(e for e in errors if "'expert/W'" in e)
    assert "axis 1 should be 2 (the classes of task index 1)" in w
    capsys.readouterr()
    assert main(["kb", "verify", str(kb)]) == 1
    assert main(["predict", "--kb", str(kb), _img(world), "-q"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: {path}: tensor ") and "(task index 1)" in err and "internal error" not in err
    )
    with pytest.raises(KBError, match=r"no learner can be loaded from it"):
        KnowledgeBase.open(kb).read_state()


def test_nan_tensors_are_named_with_task_file_and_tensor(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """M12: task 2's object all NaN (re-hashed): verify and load name the task, the file and the tensor."""
    kb = _copy(kb2, tmp_path / "kb")
    path = _rewrite_object(
        kb,
        1,
        lambda ts: {
            n: torch.full_like(t, float("nan")) if t.is_floating_point() else t for n, t in ts.items()
        },
    )
    errors = kbmod.check(kb).errors
    assert errors and all(e.startswith(f"{path}: tensor '") for e in errors), errors
    assert any("'expert/W' holds 384 NaN and 0 infinite value(s) of 384 (task index 1)" in e for e in errors)
    with pytest.raises(KBError) as e:
        KnowledgeBase.open(kb).read_state()
    assert (
        str(e.value).startswith(f"{path}: tensor ")
        and "NaN" in str(e.value)
        and "(task index 1)" in str(e.value)
    )
    capsys.readouterr()
    assert main(["predict", "--kb", str(kb), _img(world), "-q"]) == 2
    err = capsys.readouterr().err
    assert "NaN" in err and "(task index 1)" in err and str(path) in err


def test_unknown_dtypes_and_bad_headers(tmp_path: Path) -> None:
    from proteus.kb.tensors import parse_header

    kb = _store_kb(tmp_path / "kb", ("t0",))
    m = _manifest(kb)
    data = bytearray(st_save({"w": torch.ones(2, dtype=torch.float32)}))
    data[data.index(b'"F32"') : data.index(b'"F32"') + 5] = b'"C64"'  # a dtype proteus never writes
    with pytest.raises(ValueError, match="dtype 'C64' is not one proteus writes"):
        parse_header(bytes(data))
    with pytest.raises(ValueError, match="header of"):
        parse_header(b"\xff" * 8 + b"{}")
    sha = hashlib.sha256(bytes(data)).hexdigest()
    rel = f"objects/task-c-{sha[:16]}.safetensors"
    (kb / rel).write_bytes(bytes(data))
    m["tasks"][0].update(object=rel, sha256=sha)
    _write_manifest(kb, m)
    assert any("not a valid safetensors file (tensor 'w': dtype 'C64'" in p for p in kbmod.check(kb).errors)


def test_tensors_that_come_together_and_unit_rules() -> None:
    from proteus.kb.tensors import Obj, check_objects

    f32, i64 = "F32", "I64"
    tasks = [{"index": 0, "classes": [0, 1], "signature": {"n_active": 2, "d": 8}, "has_adapter": True}]
    shapes = {
        "adapter/m/A": (f32, (8, 2)), "adapter/m/s": (f32, (0,)),  # no B
        "signature/means": (f32, (2, 8)), "signature/weights": (f32, (2,)), "signature/center": (f32, (8,)),
        "signature/logdet": (f32, (2,)), "signature/prior_evecs": (f32, (8, 8)),
        "signature/prior_evals": (f32, (8,)), "signature/lowrank": (f32, (5, 8)),
        "signature/ranks": (i64, (2,)), "signature/iso": (f32, (2,)), "signature/ridge": (f32, (2,)),
    }  # fmt: skip
    obj = Obj("task index 0", "objects/t.safetensors", tasks[0], 0, shapes, totals={"signature/ranks": 6})
    problems = check_objects(tasks, [obj])
    assert any("tensor 'adapter/m/B' missing, which 'adapter/m/A' comes with" in p for p in problems), (
        problems
    )
    assert any("'signature/lowrank' has shape (5, 8): axis 0 should be 6 (the sum of signature/ranks)" in p
               for p in problems), problems  # fmt: skip
    assert len(problems) == 2, problems


def test_dtype_and_missing_tensors_against_the_record(kb2: Path, tmp_path: Path) -> None:
    kb = _copy(kb2, tmp_path / "kb")
    _rewrite_object(kb, 0, lambda ts: {n: t for n, t in ts.items() if n != "expert/W"})
    assert any(
        "tensor 'expert/W' missing, which its record's expert needs (task index 0)" in e
        for e in kbmod.check(kb).errors
    )


# ====================================================================== the signature
def test_sign_verify_and_tamper(
    kb2: Path, world: dict, tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    kb = _copy(kb2, tmp_path / "kb")
    key = kbmod.read_key_file(key_file)
    assert key == b"0123456789abcdef" * 4  # the newline is not part of it
    other = tmp_path / "other.key"
    other.write_text("f" * 64)
    other.chmod(0o600)
    prev_before = _manifest(kb, "manifest.prev.json")
    assert main(["kb", "sign", str(kb), "--key-file", str(key_file)]) == 0
    assert f"signed (hmac-sha256, key id {key_id(key)})" in capsys.readouterr().out
    m = _manifest(kb)
    assert m["signature"]["alg"] == "hmac-sha256" and m["signature"]["key_id"] == key_id(key)
    assert m["checksum"] == manifest_checksum(m)  # the checksum covers the signature
    prev = _manifest(kb, "manifest.prev.json")
    assert prev["signature"]["key_id"] == key_id(key)  # the commit kept for undo is signed too
    assert {k: v for k, v in prev.items() if k not in ("signature", "checksum")} == {
        k: v for k, v in prev_before.items() if k != "checksum"
    }
    # checked with the key; without one the signature is shown, not checked
    assert KnowledgeBase.open(kb, key=key).key == key
    assert main(["kb", "verify", str(kb), "--key-file", str(key_file)]) == 0
    assert main(["kb", "verify", str(kb)]) == 0
    assert main(["kb", "info", str(kb)]) == 0
    assert f"signed (hmac-sha256, key id {key_id(key)}; not checked" in capsys.readouterr().out
    # the wrong key
    with pytest.raises(
        KBError, match=rf"^{re.escape(str(kb))}: signature mismatch: manifest.json was signed with key id"
    ):
        KnowledgeBase.open(kb, key=kbmod.read_key_file(other))
    capsys.readouterr()
    assert main(["kb", "verify", str(kb), "--key-file", str(other)]) == 1
    assert "signature mismatch" in capsys.readouterr().out
    # tampered: an edited class name with the checksum recomputed passes the checksum, not the signature
    m["tasks"][0]["class_names"] = ["zebra", "b"]
    _write_manifest(kb, m)
    assert KnowledgeBase.open(kb).manifest["tasks"][0]["class_names"] == ["zebra", "b"]
    with pytest.raises(
        KBError,
        match=rf"^{re.escape(str(kb))}: signature mismatch: manifest.json was edited after it was signed",
    ):
        KnowledgeBase.open(kb, key=key)
    # $PROTEUS_KB_KEY_FILE: every open checks
    monkeypatch.setenv(KEY_ENV, str(key_file))
    with pytest.raises(KBError, match="edited after it was signed"):
        KnowledgeBase.open(kb)
    assert main(["predict", "--kb", str(kb), _img(world)]) == 2
    assert "signature mismatch" in capsys.readouterr().err
    # an unsigned KB with a key
    plain = _copy(kb2, tmp_path / "plain")
    with pytest.raises(
        KBError,
        match=rf"^{re.escape(str(plain))}: manifest.json is not signed, and a key \(id {key_id(key)}\)",
    ):
        KnowledgeBase.open(plain)
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "missing.key"))
    with pytest.raises(KBError, match=rf"missing.key \(\${KEY_ENV}\): cannot read the key file"):
        KnowledgeBase.open(plain)
    short = tmp_path / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(KBError, match="too short"):
        kbmod.read_key_file(short)
    for mode in (0o644, 0o640, 0o666, 0o602):  # readable or writable by others than its owner: refused
        open_key = tmp_path / f"open-{mode:o}.key"
        open_key.write_text("0123456789abcdef" * 4)
        open_key.chmod(mode)
        with pytest.raises(KBError, match=rf"its mode {mode:04o} lets others .* chmod 600 "):
            kbmod.read_key_file(open_key)


def test_commits_with_a_key_sign_and_undo_checks_the_previous_signature(
    world: dict, tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    kb = _copy(world["kb1"], tmp_path / "kb")
    key = kbmod.read_key_file(key_file)
    assert main(["kb", "sign", str(kb), "--key-file", str(key_file)]) == 0
    monkeypatch.setenv(KEY_ENV, str(key_file))
    assert (
        main(["learn", "--kb", str(kb), "--task", "2", *folder_args(world["tree"], world["spec"]), *TINY])
        == 0
    )
    monkeypatch.delenv(KEY_ENV)
    m = KnowledgeBase.open(kb, key=key).manifest  # the learn's commit is signed
    assert len(m["tasks"]) == 2 and m["signature"]["key_id"] == key_id(key)
    # undo with the key: the previous commit's signature is checked, the restored state signed again
    assert main(["kb", "undo", str(kb), "--key-file", str(key_file)]) == 0
    assert len(KnowledgeBase.open(kb, key=key).manifest["tasks"]) == 1
    # a tampered previous commit is not restored (nor signed) by undo with the key
    prev = _manifest(kb, "manifest.prev.json")
    prev["tasks"][0]["class_names"] = ["zebra", "b"]
    _write_manifest(kb, prev, "manifest.prev.json")
    before = _files(kb)
    capsys.readouterr()
    assert main(["kb", "undo", str(kb), "--key-file", str(key_file)]) == 2
    err = capsys.readouterr().err
    assert (
        "manifest.prev.json was edited after it was signed" in err
        and "previous commit is not restored" in err
    )
    assert _files(kb) == before
    report = kbmod.check(kb, key)
    assert report.errors == [] and any("kb undo` with this key refuses it" in w for w in report.warnings)
    # format 4: manifest.json names its parent by hash, kept in history/: the edit is named
    assert any("manifest.prev.json: is not the parent manifest.json names" in w for w in report.warnings)
    # a commit without a key drops the signature (a stale one could not be checked) and says so
    with caplog.at_level("WARNING", logger="proteus"), KnowledgeBase.write_lock(kb):
        k = KnowledgeBase.open(kb)
        k.commit(k.manifest)
    assert "signature" not in _manifest(kb) and "this commit, made without a key, is not" in caplog.text


def test_a_new_kb_is_signed_with_the_env_key(
    tmp_path: Path, key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, str(key_file))
    kb = _store_kb(tmp_path / "kb")
    assert KnowledgeBase.open(kb).manifest["signature"]["key_id"] == key_id(kbmod.read_key_file(key_file))
    assert kbmod.problems(kb) == []


# ====================================================================== full disk, orphans, gc
@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """``os.write`` fails with ENOSPC for the files whose path holds ``state["match"]`` (after
    ``state["after"]`` such writes succeeded); ``shutil.disk_usage`` says 12345 bytes are free."""
    state: dict[str, Any] = {"match": "(nothing yet)", "after": 0, "seen": 0, "failed": []}
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if state["match"] in path:
            state["seen"] += 1
            if state["seen"] > state["after"]:
                state["failed"].append(path)
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(kbfiles.shutil, "disk_usage", lambda p: usage._replace(free=12345))
    yield state


def _no_leftovers(kb: Path) -> None:
    leftovers = [p for p in kb.rglob("*") if ".tmp-" in p.name]
    assert not leftovers, leftovers
    report = kbmod.check(kb)
    assert report.errors == [] and report.warnings == [], report


def test_full_disk_while_writing_objects(tmp_path: Path, full_disk: dict[str, Any]) -> None:
    """ENOSPC on the second object of a commit: the first one (written by this commit, referenced by
    none) is removed with the temporary file; the error names the path, the bytes and the space left."""
    kb = _store_kb(tmp_path / "kb")
    before = _files(kb)
    full_disk.update(match="/objects/.", after=1)
    with KnowledgeBase.write_lock(kb):
        k = KnowledgeBase.open(kb)
        tensors = {"w": torch.randn(300, 100)}
        size = len(st_save(tensors))
        with pytest.raises(KBError) as e:
            k.commit_state([(t, {"w": torch.randn(300, 100)}) for t in k.manifest["tasks"]], None)
    msg = str(e.value)
    failed = Path(full_disk["failed"][0])
    target = failed.parent / failed.name[1:].rsplit(".tmp-", 1)[0]
    assert msg.startswith(f"{kb / 'objects' / target.name}: no space left on device: writing {size} bytes ")
    assert "with 12345 bytes free on its file system" in msg and "nothing was committed" in msg
    assert _files(kb) == before
    _no_leftovers(kb)


def test_full_disk_while_writing_the_manifest(tmp_path: Path, full_disk: dict[str, Any]) -> None:
    """ENOSPC on manifest.json, after the new objects and manifest.prev.json were written: the objects are
    removed and manifest.prev.json is put back (undo still goes to the commit it went to)."""
    kb = _store_kb(tmp_path / "kb")
    before = _files(kb)
    full_disk["match"] = "/.manifest.json.tmp-"
    with KnowledgeBase.write_lock(kb):
        with pytest.raises(
            KBError,
            match=rf"^{re.escape(str(kb / 'manifest.json'))}: no space left on device: writing \d+ bytes",
        ):
            _append(KnowledgeBase.open(kb), "t2")
    assert _files(kb) == before
    _no_leftovers(kb)


def test_full_disk_at_the_first_commit_leaves_no_kb(tmp_path: Path, full_disk: dict[str, Any]) -> None:
    kb = tmp_path / "kb"
    full_disk["match"] = "/objects/.head"
    with KnowledgeBase.write_lock(kb):
        with pytest.raises(KBError, match="no space left on device"):
            _append(KnowledgeBase.new(kb, HEADER), "t0")
    assert sorted(p.name for p in kb.iterdir()) == [".lock"]
    full_disk["match"] = "nothing"
    _store_kb(kb, ("t0",))  # the directory is free for a new KB
    assert kbmod.problems(kb) == []


def test_full_disk_during_learn(
    world: dict, tmp_path: Path, full_disk: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """K10 through the CLI: one line naming the file and the sizes, exit 2, the KB as before, verify clean."""
    kb = _copy(world["kb1"], tmp_path / "kb")
    before = _files(kb)
    full_disk["match"] = "/objects/.head"
    capsys.readouterr()
    assert (
        main(["learn", "--kb", str(kb), "--task", "2", *folder_args(world["tree"], world["spec"]), *TINY])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"error: {kb / 'objects' / 'head-'}") and "no space left on device: writing " in err
    assert "12345 bytes free" in err and err.count("\n") == 1, err
    assert _files(kb) == before
    _no_leftovers(kb)


def test_verify_warns_about_leftovers_and_gc_removes_them(
    kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(A learner's KB: `kb verify` also loads what it holds, so a store-level KB would not pass it.)"""
    kb = _copy(kb2, tmp_path / "kb")
    keep = _files(kb)
    orphan = kb / "objects" / f"task-x-{'0' * 16}.safetensors"
    orphan.write_bytes(b"x" * 1000)
    tmp = kb / "objects" / ".task-y-0123456789abcdef.safetensors.tmp-4194304999"
    tmp.write_bytes(b"y" * 500)
    mtmp = kb / ".manifest.json.tmp-4194304999"
    mtmp.write_bytes(b"{")
    capsys.readouterr()
    assert main(["kb", "verify", str(kb)]) == 0  # the committed state is valid: warnings only
    out = capsys.readouterr().out
    assert out.count("warning: ") == 3 and f"warning: {orphan}: referenced by neither" in out
    assert out.strip().endswith(
        f"{kb}: OK, 3 warning(s) (1501 bytes of leftovers: `proteus kb gc {kb}` removes them)"
    )
    assert main(["kb", "gc", str(kb)]) == 0
    out = capsys.readouterr().out
    assert f"removed {orphan} (1000 bytes)" in out and f"removed {tmp} (500 bytes)" in out
    assert out.strip().endswith(f"{kb}: removed 3 file(s), 1501 bytes (0.00 MB) freed")
    assert _files(kb) == keep  # both commits kept: the state and what undo goes back to
    assert main(["kb", "verify", str(kb)]) == 0 and "warning" not in capsys.readouterr().out
    assert main(["kb", "gc", str(kb)]) == 0
    assert "removed 0 file(s), 0 bytes" in capsys.readouterr().out
    with KnowledgeBase.write_lock(kb):
        KnowledgeBase.open(kb).undo()
    assert [t["class_names"][0] for t in KnowledgeBase.open(kb).manifest["tasks"]] == ["a"]


def test_undo_says_which_way_it_went(kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kb = _copy(kb2, tmp_path / "kb")
    prev, cur = _manifest(kb, "manifest.prev.json"), _manifest(kb)
    capsys.readouterr()
    assert main(["kb", "undo", str(kb)]) == 0
    out = capsys.readouterr().out
    assert out == (
        f"{kb}: restored the commit of {prev['updated']} (1 task(s)); the state it replaced (the commit of "
        f"{cur['updated']} (2 task(s))) is now the previous commit: `proteus kb undo` again goes back to it\n"
    )
    assert main(["kb", "undo", str(kb)]) == 0
    again = capsys.readouterr().out
    assert f"restored the commit of {cur['updated']} (2 task(s))" in again
    assert len(_manifest(kb)["tasks"]) == 2


def test_info_reports_bytes_on_disk(kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kb = _copy(kb2, tmp_path / "kb")
    info = kbmod.info(KnowledgeBase.open(kb))

    def objects(m: dict[str, Any]) -> set[str]:  # its tasks', head's and record segments' objects
        return (
            {t["object"] for t in m["tasks"]} | {m["head"]["object"]} | {s["object"] for s in m["segments"]}
        )

    cur = objects(_manifest(kb))
    only_prev = objects(_manifest(kb, "manifest.prev.json")) - cur
    assert only_prev  # the previous head and record segment
    expect_prev = (kb / "manifest.prev.json").stat().st_size + sum((kb / r).stat().st_size for r in only_prev)
    assert info["previous_bytes"] == expect_prev
    assert info["total_bytes"] == (kb / "manifest.json").stat().st_size + sum(
        (kb / r).stat().st_size for r in cur
    )
    lock = (kb / ".lock").stat().st_size if (kb / ".lock").exists() else 0
    history = sum(p.stat().st_size for p in (kb / "history").iterdir()) if (kb / "history").is_dir() else 0
    assert info["history_bytes"] == history
    assert info["disk_bytes"] == info["total_bytes"] + info["previous_bytes"] + history + lock
    assert info["signature"] is None
    capsys.readouterr()
    assert main(["kb", "info", str(kb)]) == 0
    out = capsys.readouterr().out
    mb, disk, pb = info["total_bytes"] / 1e6, info["disk_bytes"] / 1e6, info["previous_bytes"] / 1e6
    assert f"{mb:.2f} MB ({disk:.2f} MB on disk, {pb:.2f} MB of it the previous commit kept for" in out
    assert "not signed" in out
