"""Training curves and the accuracy matrix beside results.json (issue 26), and progress bars that stay out
of logs: a run directory holds train_log.csv (one row per optimisation step of every task) and
acc_matrix.csv (results.json's acc_matrix); a bar whose stream is not a terminal is disabled."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from proteus.cli import main
from proteus.experiment.results import TRAIN_LOG_COLUMNS
from proteus.progress import bar, is_tty
from tiny import sets


def _csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


def _check_run(out: Path) -> None:
    res = json.loads((out / "results.json").read_text())
    rows = _csv(out / "train_log.csv")
    assert tuple(rows[0]) == TRAIN_LOG_COLUMNS
    body = [dict(zip(rows[0], r)) for r in rows[1:]]
    for k, task in enumerate(res["tasks"], 1):
        mine = [r for r in body if int(r["task"]) == k]
        steps = task["train"]["steps"] if "train" in task else task["steps"]
        assert steps > 0 and len(mine) == steps
        assert [int(r["step"]) for r in mine] == list(range(1, steps + 1))
        assert all(int(r["epoch"]) >= 1 and float(r["lr"]) > 0 for r in mine)
        losses = [float(r["loss"]) for r in mine]
        assert all(v >= 0 for v in losses)
        tenth = max(1, steps // 10)  # the curve is the one results.json summarises
        assert sum(losses[:tenth]) / tenth == pytest.approx(
            task["train"]["loss_first"] if "train" in task else task["loss_first"]
        )
    assert {int(r["task"]) for r in body} == set(range(1, res["num_tasks"] + 1))

    acc = _csv(out / "acc_matrix.csv")
    assert acc[0] == ["after_task", *(f"task_{t}" for t in range(1, res["num_tasks"] + 1))]
    matrix = [[None if v == "" else float(v) for v in r[1:]] for r in acc[1:]]
    assert matrix == res["acc_matrix"]  # exact: floats are written as Python reprs them
    assert [int(r[0]) for r in acc[1:]] == list(range(1, len(matrix) + 1))
    assert all(matrix[k][t] is None for k in range(len(matrix)) for t in range(k + 1, res["num_tasks"]))


def test_proteus_run_writes_curves(tmp_path: Path) -> None:
    out = tmp_path / "p"
    argv = ["run", "--benchmark", "quickstart", "--out", str(out), "-q",
            *sets("benchmark.max_train_per_class=16", "benchmark.num_tasks=2")]  # fmt: skip
    assert main(argv) == 0
    _check_run(out)
    rows = _csv(out / "train_log.csv")[1:]
    # the first task has no old directions, so no transfer coefficients and no penalty
    assert all(float(r[5]) == 0 for r in rows if r[0] == "1")


def test_baseline_run_writes_curves(tmp_path: Path) -> None:
    out = tmp_path / "b"
    argv = ["run", "--benchmark", "quickstart", "--method", "l2p", "--backbone", "vit_ti16", "--out",
            str(out), "-q", *sets("benchmark.max_train_per_class=8", "benchmark.num_tasks=2",
                                  "baseline.pool_size=20")]  # fmt: skip
    assert main(argv) == 0
    _check_run(out)


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_bar_is_disabled_off_a_terminal() -> None:
    pipe, term = _Stream(False), _Stream(True)
    assert not is_tty(pipe) and is_tty(term) and not is_tty(None)
    b = bar(range(50), desc="x", file=pipe)
    assert b.disable and list(b) == list(range(50))
    b.set_postfix(loss="1")
    b.close()
    assert pipe.getvalue() == ""
    manual = bar(total=3, file=pipe)
    manual.update(3)
    manual.close()
    assert pipe.getvalue() == ""
    shown = bar(range(5), desc="x", file=term)
    assert not shown.disable and list(shown) == list(range(5))
    shown.close()
    assert "x" in term.getvalue()
    off = bar(range(5), file=term, enabled=False)  # -q
    assert off.disable


def test_closed_stream_is_no_tty() -> None:
    s = io.StringIO()
    s.close()
    assert not is_tty(s)
