"""tools/studies/past_room.py: tasks split at the first run's first task short of its rank (no run needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "studies"))
from past_room import first_short, main, summary  # noqa: E402


def _run(d: Path, ranks: list[int], acc: list[float]) -> Path:
    d.mkdir()
    tasks = [{"train": {"rank": 8, "ranks_min": r}} for r in ranks]
    res = {"tasks": tasks, "acc_matrix": [acc], "oracle_acc_matrix": [[a + 1 for a in acc]],
           "final_avg_acc": sum(acc) / len(acc), "retrieval_acc": [90.0]}  # fmt: skip
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_runs_are_split_where_the_first_run_ran_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plain = _run(tmp_path / "plain", [8, 8, 3, 0], [80.0, 70.0, 60.0, 50.0])
    small = _run(tmp_path / "small", [8, 8, 8, 8], [81.0, 71.0, 65.0, 61.0])
    assert first_short(plain) == 2 and first_short(small) is None
    s = summary(small, 2)
    assert s["acc_full"] == 76.0 and s["acc_past"] == 63.0 and s["oracle_past"] == 64.0
    assert s["first_short"] is None
    assert main([f"plain={plain}", f"small={small}"]) == 0
    out = capsys.readouterr().out
    assert "Split at task 3" in out and "| small | 69.50 | none | 76.00 / 77.00 | 63.00 / 64.00 |" in out
    assert main([f"small={small}"]) == 1
