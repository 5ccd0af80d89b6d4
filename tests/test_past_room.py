"""tools/studies/past_room.py: runs split at the first schedule's first task short of its rank, a schedule's
seeds averaged (no run needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "studies"))
from past_room import first_short, main, summary  # noqa: E402


def _results(ranks: list[int], acc: list[float]) -> dict:
    return {"tasks": [{"train": {"rank": 8, "ranks_min": r}} for r in ranks], "acc_matrix": [acc],
            "oracle_acc_matrix": [[a + 1 for a in acc]], "final_avg_acc": sum(acc) / len(acc),
            "retrieval_acc": [90.0]}  # fmt: skip


def _run(d: Path, ranks: list[int], acc: list[float]) -> str:
    d.mkdir()
    (d / "results.json").write_text(json.dumps(_results(ranks, acc)))
    return str(d)


def test_runs_are_split_where_the_first_run_ran_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plain = _results([8, 8, 3, 0], [80.0, 70.0, 60.0, 50.0])
    assert first_short(plain) == 2 and first_short(_results([8, 8], [1.0, 2.0])) is None
    s = summary(_results([8, 8, 8, 8], [81.0, 71.0, 65.0, 61.0]), 2)
    assert s["acc_before"] == 76.0 and s["acc_past"] == 63.0 and s["oracle_past"] == 64.0
    p = _run(tmp_path / "plain", [8, 8, 3, 0], [80.0, 70.0, 60.0, 50.0])
    s0 = _run(tmp_path / "s0", [8, 8, 8, 8], [81.0, 71.0, 65.0, 61.0])
    s1 = _run(tmp_path / "s1", [8, 8, 8, 8], [83.0, 73.0, 67.0, 63.0])
    assert main([f"plain={p}", f"small={s0},{s1}"]) == 0
    out = capsys.readouterr().out
    assert "Split at task 3" in out and "| small | 2 | 70.50 | 77.00 / 78.00 | 64.00 / 65.00 | 90.00 |" in out
    assert main([f"small={s0}"]) == 1
