"""End-to-end: the real CLI with tiny settings (random backbone weights, so no download is needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from proteus.cli import main
from proteus.kb import KnowledgeBase
from tiny import sets

TINY = sets("benchmark.max_train_per_class=40")


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["run", "--benchmark", "quickstart", "--out", str(out), "-q", *TINY]) == 0
    return out


def test_run_writes_the_contract(run_dir: Path) -> None:
    res = _results(run_dir)
    for key in (
        "benchmark",
        "method",
        "backbone",
        "num_tasks",
        "acc_matrix",
        "avg_acc",
        "final_avg_acc",
        "forgetting",
        "retrieval_acc",
        "oracle_avg_acc",
        "seconds",
    ):
        assert key in res, key
    m = res["num_tasks"]
    assert m == 5 and len(res["acc_matrix"]) == m and len(res["avg_acc"]) == m
    for k, row in enumerate(res["acc_matrix"]):
        assert all(v is not None for v in row[: k + 1]) and all(v is None for v in row[k + 1 :])
    assert len(res["retrieval_acc"]) == m and all(0 <= r <= 100 for r in res["retrieval_acc"])
    assert res["retrieval_acc"][0] == 100.0  # one task: retrieval cannot fail
    assert res["final_avg_acc"] == pytest.approx(np.mean(res["acc_matrix"][-1]))
    for f in ("config.yaml", "split.json", "log.txt", "kb/manifest.json"):
        assert (run_dir / f).is_file(), f
    split = json.loads((run_dir / "split.json").read_text())
    assert split["class_order"] and split["splits"]["train"]["sha256"]


def test_learn_task_by_task_equals_run(run_dir: Path, tmp_path: Path) -> None:
    kb = tmp_path / "kb"
    for k in range(1, 6):
        argv = ["learn", "--kb", str(kb), "--benchmark", "quickstart", "--task", str(k), "-q", *TINY]
        assert main(argv) == 0
    a = KnowledgeBase.open(run_dir / "kb").manifest
    b = KnowledgeBase.open(kb).manifest
    assert [t["sha256"] for t in a["tasks"]] == [t["sha256"] for t in b["tasks"]]
    assert a["head"]["sha256"] == b["head"]["sha256"]
    assert a["evaluation"] == b["evaluation"]
    # rerunning a learned task is a no-op; skipping one is an error naming it
    assert main(["learn", "--kb", str(kb), "--benchmark", "quickstart", "--task", "3", "-q", *TINY]) == 0
    assert KnowledgeBase.open(kb).manifest["tasks"] == b["tasks"]


def test_learn_refuses_to_skip_a_task(tmp_path: Path, capsys) -> None:
    kb = tmp_path / "kb"
    assert main(["learn", "--kb", str(kb), "--benchmark", "quickstart", "--task", "2", "-q", *TINY]) == 2
    assert "learn task 1 first" in capsys.readouterr().err


def test_kb_roundtrip_is_bit_exact(run_dir: Path) -> None:
    from proteus import Proteus

    kb = KnowledgeBase.open(run_dir / "kb")
    clf = Proteus.load(run_dir / "kb")
    state = clf.state()
    for k, entry in enumerate(kb.manifest["tasks"]):
        tensors = state.tasks[k][1]
        stored = kb.read(entry["object"], entry["sha256"])
        assert set(stored) == set(tensors)
        for n, v in tensors.items():
            assert torch.equal(stored[n], v.cpu()), n
    head = kb.read(kb.manifest["head"]["object"], kb.manifest["head"]["sha256"])
    head_state = state.head
    assert head_state is not None
    for k, v in head_state[1].items():
        assert torch.equal(head[k], v.cpu()), k


def test_evaluate_reproduces_the_final_row(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    assert main(["evaluate", "--kb", str(run_dir / "kb"), "--out", str(out), "-q"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["acc_matrix"][-1] == _results(run_dir)["acc_matrix"][-1]
    assert res["retrieval_acc"][-1] == _results(run_dir)["retrieval_acc"][-1]


def test_predict_on_image_files(run_dir: Path, tmp_path: Path, capsys) -> None:
    from sklearn.datasets import load_digits

    d = load_digits()
    files = []
    for i in range(3):
        p = tmp_path / f"digit{i}.png"
        Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).save(p)
        files.append(str(p))
    rgba = tmp_path / "rgba.png"
    Image.new("RGBA", (20, 12), (10, 200, 30, 128)).save(rgba)
    files.append(str(rgba))
    assert main(["predict", "--kb", str(run_dir / "kb"), *files, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in rows] == files
    for r in rows:
        assert r["nearest_class"].startswith("digit") or r["nearest_class"].isdigit()
        assert r["class"] == (None if r["known"] is False else r["nearest_class"])
        assert 1 <= r["task"] <= 5 and r["component"] >= 0 and np.isfinite(r["signature_score"])

    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    assert main(["predict", "--kb", str(run_dir / "kb"), str(bad)]) == 2
    assert "notes.txt: not an image" in capsys.readouterr().err


def test_real_cli_subprocess_help_and_list() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "proteus", "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "quickstart" in out.stdout and "examples:" in out.stdout
    out = subprocess.run([sys.executable, "-m", "proteus", "list", "methods"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in ("proteus", "proteus-paper", "ranpac", "last-lora", "frozen", "proteus-s0", "proteus-budget"):
        assert f"  {name} " in out.stdout


def test_bad_config_key_is_named(capsys) -> None:
    assert main(["run", "--benchmark", "quickstart", "--set", "adapter.rnak=3"]) == 2
    assert "adapter.rnak" in capsys.readouterr().err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_quickstart_replaces_only_its_own_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``quickstart --out`` on a folder holding another run's knowledge base refuses (exit 2) and leaves it
    byte for byte; on its own earlier output it runs again."""
    other = tmp_path / "ncm"
    assert (
        main(["run", "--benchmark", "quickstart", "--method", "ncm", "--out", str(other), "-q", *TINY]) == 0
    )
    before = _tree(other)
    assert main(["quickstart", "--out", str(other), "-q", *TINY]) == 2
    assert "no quickstart wrote" in capsys.readouterr().err
    assert _tree(other) == before
    own = tmp_path / "q"
    for _ in range(2):  # the second run replaces the first's output
        assert main(["quickstart", "--out", str(own), "-q", *TINY]) == 0
    assert (own / ".quickstart").is_file() and KnowledgeBase.open(own / "kb").manifest["tasks"]


def test_a_closed_pipe_is_a_normal_end(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Output into a pipe whose reader went away (``proteus list methods | head -1``) exits 0, quietly."""

    class Closed:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            raise ValueError("no file")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["list", "methods"]) == 0
    assert "internal error" not in capsys.readouterr().err


def test_a_run_with_gpu_settings_on_a_cpu_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Training with every block adapted (a paper preset, ``folder``'s defaults) on a CPU warns and names
    --config mobilenet_cpu; with it, no warning."""
    from proteus.cli.commands import _warn_full_backbone_on_cpu
    from proteus.config import resolve_config

    for bench, config, warns in (
        ("folder", [], True),
        ("cifar10", [], True),
        ("folder", ["mobilenet_cpu"], False),
    ):
        caplog.clear()
        cfg = resolve_config(benchmark=bench, method="proteus", config_files=config, sets=["device=cpu"])
        with caplog.at_level("WARNING", logger="proteus"):
            _warn_full_backbone_on_cpu(cfg)
        assert ("--config mobilenet_cpu" in caplog.text) is warns, (bench, config, caplog.text)


def test_a_message_of_several_lines_prints_as_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error whose text has several lines (here: data not found, with the layouts it looks for) prints
    them as lines, the later ones indented, with no literal ``\\n``; a control character in a path stays
    escaped."""
    data = tmp_path / "no\x1bdata"
    argv = ["run", "--benchmark", "cifar10", "--data", str(data), "--config", "mobilenet_cpu"]
    assert main([*argv, "--out", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) > 2 and lines[0].startswith("error: cifar10: no data found")
    assert all(line.startswith("  ") for line in lines[1:]) and "\\n" not in err
    assert "\x1b" not in err and "no\\x1bdata" in err


def test_an_interrupted_run_says_how_to_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during ``proteus run`` exits 130 and names the ``--resume`` command of its run folder."""
    import proteus.experiment

    def interrupted(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(proteus.experiment, "run", interrupted)
    out = tmp_path / "r"
    assert main(["run", "--benchmark", "quickstart", "--out", str(out), "-q", *TINY]) == 130
    assert f"proteus run --resume {out}" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "waits"), [([], 0.0), (["--wait", "5"], 5.0), (["--wait"], None)])
def test_learn_passes_its_wait_to_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: list[str], waits: float | None
) -> None:
    """``learn --wait [SECONDS]`` waits for another writer as the other writing commands do (it used to fail
    at once whatever --wait said)."""
    import proteus.experiment.learn as learn

    seen: dict[str, object] = {}

    def fake(*a: object, **k: object) -> object:
        seen.update(k)
        raise SystemExit(0)

    monkeypatch.setattr(learn, "learn_task", fake)
    with pytest.raises(SystemExit):
        main(["learn", "--kb", str(tmp_path / "kb"), "--task", "1", "--benchmark", "quickstart", *given])
    assert seen["wait"] == waits
