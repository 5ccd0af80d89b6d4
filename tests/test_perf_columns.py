"""``tools/perf/perf_columns.py``: both composition forms of a batch spread over many tasks, side by side.
No timing is asserted (the figures depend on the machine): both forms give the same update, every row names
the form the rule picks, and the rule picks the union for groups of one position and each group's own
columns for groups of many."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "perf"))
import perf_columns  # noqa: E402


def test_both_forms_are_timed_and_the_rule_names_its_pick() -> None:
    threads = torch.get_num_threads()
    try:
        rows = perf_columns.measure(1, 1, 16, 0, maps=[("small", 64, 96)], positions_list=[1, 4096])
    finally:
        torch.set_num_threads(threads)
    assert [r["positions"] for r in rows] == [1, 4096]
    assert all(r["own_ms"] > 0 and r["union_ms"] > 0 and r["own_columns"] < r["union_columns"] for r in rows)
    assert [r["picked"] for r in rows] == ["union", "own"]


def test_the_two_forms_compute_the_same_update() -> None:
    w, u = perf_columns._unit(64, 96, tasks=32, rank=2, kept=8, seed=0)
    tasks = list(range(1, 32, 2))  # (the last task composes all 64 columns)
    coef = u.coefficients(tasks)[:, : u.used_columns(tasks)]
    perf_columns.set_composition(u, coef, [1] * len(tasks))
    composed = u.composed
    assert composed is not None and composed.union is not None
    assert composed.cols is not None and composed.cols.ndim == 2
    w.groups, w.sizes = len(tasks), [1] * len(tasks)
    x = torch.randn(len(tasks), 3, 64)
    with torch.no_grad():
        u.composed = perf_columns.Composed(composed.coef, composed.cols)  # each group's own columns
        a = w(x)
        u.composed = perf_columns.Composed(*composed.union)  # the union's
        b = w(x)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
