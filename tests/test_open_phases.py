"""``tools/perf/open_phases.py``: the phases of opening a knowledge base and predicting one image, side by
side for several knowledge bases. No timing is asserted (the figures depend on the machine): the phases it
names are the functions a load calls, every one of them is timed, and the table and JSON say so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "perf"))
import open_phases  # noqa: E402


def test_every_phase_is_timed_for_each_knowledge_base(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proteus import Proteus

    before = dict(vars(Proteus))
    out = tmp_path / "phases.json"
    kb = world["kb1"]
    assert open_phases.main([str(kb), str(kb), "--turns", "1", "--threads", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert list(got) == [str(kb)]  # (one knowledge base named twice: one column of it)
    med = got[str(kb)]
    phases = [p for _, _, p in open_phases.PHASES]
    assert set(med) == {*phases, "rest", "total"}
    # each phase ran (a renamed function would not be patched: its phase would stay 0)
    assert all(med[p] > 0 for p in phases), med
    assert med["total"] >= med["predict"] + med["open the store"]
    table = capsys.readouterr().out
    assert all(f"| {p} |" in table for p in [*phases, "rest", "total"]), table
    # the functions are put back after the run
    assert all(vars(Proteus)[n] is f for n, f in before.items())


def test_a_folder_that_is_no_knowledge_base_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        open_phases.main([str(tmp_path)])
