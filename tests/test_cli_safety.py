"""Issue 12 through the real command line: one writer at a time, nothing lost, conflicting options refused,
values checked before any work, and one line (never a traceback) for bad input.

Every KB here is a tiny folder benchmark (ViT-Ti with random weights, 32 px, one epoch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kbfiles import as_released, read_manifest
from proteus.cli import main
from proteus.kb import KnowledgeBase
from tiny import TINY, folder_args, write_spec

pytestmark = pytest.mark.slow


def _copy_kb(world: dict, tmp_path: Path) -> Path:
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    return kb


def _learn(world: dict, kb: Path, task: int, *extra: str, spec: Path | None = None) -> int:
    args = folder_args(world["tree"], spec or world["spec"])
    return main(["learn", "--kb", str(kb), "--task", str(task), *args, *TINY, *extra])


def test_two_learn_processes_one_writer(world: dict, tmp_path: Path) -> None:
    """Two real ``proteus learn --task 2`` processes at once: one learns it; the other is refused at once
    naming the holder, or (if it came second) finds the task learned. The KB loads with 2 tasks."""
    kb = _copy_kb(world, tmp_path)
    cmd = [sys.executable, "-m", "proteus", "learn", "--kb", str(kb), "--task", "2",
           *folder_args(world["tree"], world["spec"]), *TINY]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    outs = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    learned = [o for o in outs if o[0] == 0 and "learned task 2/2" in o[1]]
    assert len(learned) == 1, outs
    other = next(o for o in outs if o is not learned[0])
    assert (other[0] == 2 and "another proteus process is writing" in other[2] and "pid " in other[2]) or (
        other[0] == 0 and "already learned" in other[1]
    ), other
    assert "Traceback" not in other[2]
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 2


def test_deleted_manifest_is_refused_and_nothing_is_deleted(world: dict, tmp_path: Path, capsys) -> None:
    kb = _copy_kb(world, tmp_path)
    (kb / "manifest.json").unlink()
    before = sorted(p.name for p in (kb / "objects").iterdir())
    assert _learn(world, kb, 1) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert sorted(p.name for p in (kb / "objects").iterdir()) == before


def test_a_failed_first_learn_leaves_no_kb_and_a_retry_works(world: dict, tmp_path: Path, capsys) -> None:
    kb = tmp_path / "kb"
    for bad, key in (("train.batch_size=0", "train.batch_size"), ("train.lr=-1", "train.lr"),
                     ("eval.batch_size=0", "eval.batch_size"), ("train.epochs=0", "train.epochs"),
                     ("train.epochs=-2", "train.epochs"), ("train.epochs=1.5", "train.epochs")):  # fmt: skip
        assert _learn(world, kb, 1, "--set", bad) == 2
        err = capsys.readouterr().err
        assert key in err and "Traceback" not in err, err
        assert not KnowledgeBase.exists(kb)
    assert _learn(world, kb, 1) == 0  # the corrected command works
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 1


def test_conflicting_options_are_refused_per_task_ones_recorded(world: dict, tmp_path: Path, capsys) -> None:
    kb = _copy_kb(world, tmp_path)
    capsys.readouterr()
    assert _learn(world, kb, 2, "--set", "adapter.rank=8", "--method", "ranpac") == 2
    err = capsys.readouterr().err
    assert "adapter.rank: knowledge base has 4, given 8" in err
    assert "method: knowledge base has 'proteus'" in err
    argv = ["learn", "--kb", str(kb), "--task", "2", "--benchmark", "quickstart", *TINY]
    assert main(argv) == 2
    assert "benchmark.name: knowledge base has 'folder', given 'quickstart'" in capsys.readouterr().err
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 1  # nothing learned
    assert _learn(world, kb, 2, "--set", "train.lr=0.002", "--set", "train.batch_size=7") == 0
    tasks = KnowledgeBase.open(kb).manifest["tasks"]
    assert tasks[0]["settings"]["train.lr"] == 0.001 and tasks[1]["settings"]["train.lr"] == 0.002
    assert tasks[1]["settings"]["train.batch_size"] == 7 and tasks[1]["learned"]


def test_changed_class_order_is_refused(world: dict, tmp_path: Path, capsys) -> None:
    kb = _copy_kb(world, tmp_path)
    spec = write_spec(tmp_path / "spec.yaml", [["b", "a"], ["c", "d"]])
    assert _learn(world, kb, 2, spec=spec) == 2
    assert "class order of learned tasks cannot change" in capsys.readouterr().err
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 1


def test_task_numbers_and_no_eval(world: dict, tmp_path: Path, capsys) -> None:
    kb = tmp_path / "kb"
    for t in (0, -1):
        assert _learn(world, kb, t) == 2
        assert "--task must be 1 or more" in capsys.readouterr().err
    for t in (1, 2):
        assert _learn(world, kb, t, "--no-eval") == 0
        out = capsys.readouterr().out
        assert "not evaluated" in out and "accuracy per task" not in out
    assert main(["evaluate", "--kb", str(kb), "-q"]) == 0
    table = capsys.readouterr().out
    assert "\n         2 |" in table and "\n         1 |" not in table  # the one row is "after task 2"


def test_evaluate_checks_the_benchmark_and_out_before_work(world: dict, tmp_path: Path, capsys) -> None:
    assert main(["evaluate", "--kb", str(world["kb1"]), "--benchmark", "cifar10"]) == 2
    assert "built on benchmark 'folder', not 'cifar10'" in capsys.readouterr().err
    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("keep")
    assert main(["evaluate", "--kb", str(world["kb1"]), "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["manifest-list", "kb-is-file", "empty-kb-dir", "device-tpu", "device-cuda",
                                  "out-is-file", "weights-unreadable"])  # fmt: skip
def test_bad_input_is_one_line(world: dict, tmp_path: Path, capsys, case: str) -> None:
    img = world["tree"] / "test" / "a" / "0.png"
    if case == "manifest-list":
        kb = _copy_kb(world, tmp_path)
        (kb / "manifest.json").write_text("[]")
        argv, expect = ["predict", "--kb", str(kb), str(img)], "manifest"
    elif case == "kb-is-file":
        f = tmp_path / "kbfile"
        f.write_text("x")
        argv, expect = ["predict", "--kb", str(f), str(img)], "kbfile"
    elif case == "empty-kb-dir":
        (tmp_path / "empty").mkdir()
        argv, expect = ["predict", "--kb", str(tmp_path / "empty"), str(img)], "no knowledge base here"
    elif case == "device-tpu":
        argv = ["predict", "--kb", str(world["kb1"]), "--device", "tpu", str(img)]
        expect = "unknown device 'tpu'"
    elif case == "device-cuda":
        if torch.cuda.is_available():
            pytest.skip("a CUDA GPU is visible: --device cuda is valid here")
        argv, expect = ["predict", "--kb", str(world["kb1"]), "--device", "cuda", str(img)], "no CUDA GPU"
    elif case == "out-is-file":
        f = tmp_path / "out"
        f.write_text("x")
        argv = ["run", "--out", str(f), *folder_args(world["tree"], world["spec"]), *TINY]
        expect = "is a file"
    else:
        w = tmp_path / "w.safetensors"
        w.write_bytes(b"not weights")
        argv = ["learn", "--kb", str(tmp_path / "k"), "--task", "1", "--weights", str(w),
                *folder_args(world["tree"], world["spec"]), *TINY]  # fmt: skip
        expect = "w.safetensors"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expect in err and "Traceback" not in err, err


def test_ctrl_c_is_130_and_names_the_task_count(world: dict, tmp_path: Path, capsys, monkeypatch) -> None:
    from proteus.core.estimator import Proteus

    kb = _copy_kb(world, tmp_path)

    def interrupted(self, task):
        raise KeyboardInterrupt

    monkeypatch.setattr(Proteus, "fit_task", interrupted)
    assert _learn(world, kb, 2) == 130
    assert "interrupted; the knowledge base is unchanged at 1 task" in capsys.readouterr().err
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 1


def test_kb_verify_and_info(world: dict, tmp_path: Path, capsys) -> None:
    kb = _copy_kb(world, tmp_path)
    assert main(["kb", "verify", str(kb)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["kb", "info", str(kb)]) == 0
    out = capsys.readouterr().out
    assert "1 task(s)" in out and "task 1: 2 classes ['a', 'b']" in out and "train.epochs=1" in out
    assert main(["kb", "list", str(kb), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tasks"] == 1
    segment = kb / json.loads((kb / "manifest.json").read_text())["segments"][0]["object"]
    text = segment.read_text()  # an edited class name would change what predict reports
    segment.write_text(text.replace('"class_names": ["a"', '"class_names": ["z"', 1))
    obj = next(p for p in (kb / "objects").iterdir() if p.suffix == ".safetensors")
    obj.write_bytes(obj.read_bytes()[:100])
    assert main(["kb", "verify", str(kb)]) == 1
    out = capsys.readouterr().out
    assert "checksum mismatch" in out and f"{segment}: checksum mismatch" in out and "edited" in out
    img = world["tree"] / "test" / "a" / "0.png"
    assert main(["predict", "--kb", str(kb), str(img)]) == 2
    assert f"{segment}: checksum mismatch" in capsys.readouterr().err


def test_predict_skip_unreadable_and_size_limit(world: dict, tmp_path: Path, capsys) -> None:
    good = world["tree"] / "test" / "a" / "0.png"
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    assert main(["predict", "--kb", str(world["kb1"]), str(good), str(bad)]) == 2
    assert "bad.png" in capsys.readouterr().err
    argv = ["predict", "--kb", str(world["kb1"]), str(good), str(bad), "--skip-unreadable", "--json"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert [r["file"] for r in json.loads(cap.out)] == [str(good)] and "bad.png" in cap.err
    assert main(["predict", "--kb", str(world["kb1"]), str(good), "--max-pixels", "10"]) == 2
    assert "above the limit" in capsys.readouterr().err


def test_previous_release_kb_loads_and_upgrades(world: dict, tmp_path: Path, capsys) -> None:
    """Format 1 (an early release: no manifest checksum, no per-task settings) still loads, predicts the
    same, and its next commit writes format 4. (Checked by hand against a KB written by that release
    itself, too: identical predictions and scores.)"""
    kb = _copy_kb(world, tmp_path)
    img = world["tree"] / "test" / "a" / "0.png"
    assert main(["predict", "--kb", str(kb), str(img), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    m = as_released(read_manifest(kb), 1)
    for t in m["tasks"]:
        t.pop("settings"), t.pop("learned")
    (kb / "manifest.json").write_text(json.dumps(m, indent=1))
    (kb / "manifest.prev.json").unlink(missing_ok=True)
    shutil.rmtree(kb / "history", ignore_errors=True)
    assert main(["predict", "--kb", str(kb), str(img), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == before
    assert _learn(world, kb, 2) == 0
    m = read_manifest(kb)
    assert m["format_version"] == 5 and m["checksum"] and len(m["tasks"]) == 2 and m["sequence"] == 1
