"""``proteus predict``'s text line (issue 26): the class, one confidence and the task; ``unknown`` for an
input from no learned task; the raw retrieval numbers only with ``--verbose``."""

from __future__ import annotations

from proteus.experiment.predictions import format_row

ROW = {"file": "a.png", "class": "cat", "nearest_class": "cat", "p_all": 0.8, "p_task": 0.9, "task": 2,
       "component": 3, "signature_score": -12.5, "known": None, "novelty": None,
       "top_k": [{"class": "cat", "p_task": 0.9}]}  # fmt: skip


def test_one_confidence_and_the_task() -> None:
    assert format_row(ROW) == "a.png: cat  confidence 0.80  task 2"


def test_unknown_when_rejected() -> None:
    line = format_row({**ROW, "class": None, "known": False, "novelty": 1.5})
    assert line.startswith("a.png: unknown (from no learned task; nearest class cat)")
    assert "confidence" not in line


def test_verbose_adds_the_raw_numbers() -> None:
    line = format_row({**ROW, "known": True, "novelty": -0.25}, verbose=True)
    assert "component 3, signature score -12.50, novelty -0.25" in line and "p_task 0.90" in line


def test_no_task_for_a_method_without_retrieval() -> None:
    row = {**ROW, "task": None, "component": None, "p_task": None}
    assert format_row(row) == "a.png: cat  confidence 0.80"
