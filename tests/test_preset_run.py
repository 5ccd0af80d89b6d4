"""``tools/perf/preset_run.py``: a paper preset on generated images of its shape. The run itself takes minutes
(its CPU dry run: ``STEPS=preset DEVICE=cpu bash tools/perf/gpu_session.sh``); here, what it builds
around the run: the generated folder and its tasks file, the preset's settings, the per-task table from a
results.json."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "perf"))
import preset_run  # noqa: E402


def test_the_generated_folder_has_the_presets_tasks_of_its_classes(tmp_path: Path) -> None:
    data, spec = preset_run.make_folder(tmp_path, classes=12, per_class=3, size=8, per_task=4)
    assert yaml.safe_load(spec.read_text()) == {
        "tasks": [[f"c{4 * t + i}" for i in range(4)] for t in range(3)]
    }
    assert all(len(list((data / "train" / f"c{c}").glob("*.jpg"))) == 3 for c in range(12))


def test_a_preset_is_read_from_the_package_and_an_unknown_one_is_named() -> None:
    cfg = preset_run.preset("imagenet-r")
    assert cfg["benchmark"] == {"name": "imagenet-r", "num_tasks": 10} and cfg["head"]["rp_dim"] == 10000
    with pytest.raises(SystemExit, match="no preset 'nope'; one of: .*imagenet-r"):
        preset_run.preset("nope")


def test_each_task_gets_its_phases_seconds_and_peak_memory() -> None:
    first = {"seconds_prefix": 0.5, "seconds_train": 2.0, "seconds_signature": 1.0, "seconds_head": 3.0,
             "seconds_evaluate": 0.25, "seconds_task": 6.75, "peak_gpu_mb": 512.0}  # fmt: skip
    res = {"tasks": [first, {"seconds_train": 1.0}]}
    rows = preset_run.summary(res)
    assert rows[0] == {"task": 1, "prefix": 0.5, "train": 2.0, "signature": 1.0, "head": 3.0,
                       "evaluate": 0.25, "task_s": 6.75, "peak_gpu_mb": 512.0}  # fmt: skip
    assert rows[1]["task"] == 2 and rows[1]["head"] is None and rows[1]["peak_gpu_mb"] is None
    lines = preset_run.table(rows).splitlines()
    assert lines[0] == "| task | prefix | train | signature | head | evaluate | task_s | peak_gpu_mb |"
    assert lines[2] == "| 1 | 0.50 | 2.00 | 1.00 | 3.00 | 0.25 | 6.75 | 512.00 |" and lines[3].count("-") == 6
