"""Experiment tracking (one event stream: CSV always, TensorBoard and W&B when asked for) and progress that
stays plain off a terminal.

Two tiny runs of the same configuration, built once for the module: one with ``--track
tensorboard,wandb`` (a stand-in ``wandb`` module in ``sys.modules``; the real one is never needed) and
one without tracking and without ``-q``, its stderr captured as a batch job's log would be. The event
files are read back with TensorBoard's own ``EventAccumulator``, the CSVs with pandas, and everything is
checked against results.json; tracking must leave results.json as it is.
"""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from proteus import progress
from proteus.cli import main
from proteus.cli.parser import build_parser
from proteus.config import ConfigError
from proteus.experiment.tracking import SINKS, Sink, Step, TaskEnd, Tracker, TrackingError, parse_sinks
from proteus.progress import PLAIN_INTERVAL, PlainBar, bar
from runresults import computed
from tiny import sets

EventAccumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator"
).EventAccumulator

ARGS = ["run", "--benchmark", "quickstart", "--device", "cpu",
        *sets("benchmark.max_train_per_class=16", "benchmark.num_tasks=2", "report.figures=false",
              "report.latency=false")]  # fmt: skip


class FakeRun:
    """What the W&B sink calls on ``wandb.init``'s run, recorded."""

    def __init__(self, **init: Any) -> None:
        self.init, self.logged, self.metrics, self.summary = init, [], {}, {}
        self.finished: int | None = None

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics[name] = step_metric

    def log(self, data: dict[str, Any]) -> None:
        self.logged.append(dict(data))

    def finish(self, exit_code: int = 0) -> None:
        self.finished = exit_code


def fake_wandb() -> types.ModuleType:
    mod = types.ModuleType("wandb")
    mod.runs = []  # type: ignore[attr-defined]

    def init(**kw: Any) -> FakeRun:
        run = FakeRun(**kw)
        mod.runs.append(run)  # type: ignore[attr-defined]
        return run

    mod.init = init  # type: ignore[attr-defined]
    return mod


class LiveProbe(Sink):
    """Registered for the tracked run after csv and tensorboard: at each task's end it reads back what the
    other sinks have written so far (events must stream, not wait for the run's end)."""

    name = "probe"
    seen: list[dict[str, Any]] = []

    def task_end(self, event: TaskEnd) -> None:
        ea = EventAccumulator(str(self.run_dir / "tensorboard"))
        ea.Reload()
        rows = len(pd.read_csv(self.run_dir / "train_log.csv"))
        LiveProbe.seen.append(
            {"task": event.task, "csv_rows": rows, "tb_steps": len(ea.Scalars("train/loss")),
             "tb_acc": [e.value for e in ea.Scalars("eval/avg_acc")], "global_step": event.global_step,
             "acc_rows": len(pd.read_csv(self.run_dir / "acc_matrix.csv"))}
        )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tracking")
    wandb = fake_wandb()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", wandb)
        SINKS.register("probe")(LiveProbe)
        try:
            assert main([*ARGS, "-q", "--track", "tensorboard,wandb,probe", "--out", str(root / "t")]) == 0
        finally:
            SINKS.unregister("probe")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(progress, "PLAIN_MIN_GAP", 0.0)  # a tiny run is fast: let every quarter write its line
        mp.setattr(sys, "stderr", err)
        assert main([*ARGS, "--out", str(root / "plain")]) == 0
    return {"tracked": root / "t", "plain": root / "plain", "wandb": wandb.runs, "stderr": err.getvalue()}


def _results(run: Path) -> dict[str, Any]:
    return json.loads((run / "results.json").read_text())


def _same_training(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """results.json without wall-clock times and the manifest's size (the stored config records the run's
    report.tracking as it records every report key)."""

    return computed(a, drop=lambda k: k == "manifest") == computed(b, drop=lambda k: k == "manifest")


def _values(ea: Any, tag: str) -> list[float]:
    return [e.value for e in ea.Scalars(tag)]


def test_tensorboard_events_match_the_csvs_and_results(runs: dict[str, Any]) -> None:
    out = runs["tracked"]
    res = _results(out)
    log = pd.read_csv(out / "train_log.csv")
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    loss = ea.Scalars("train/loss")
    assert len(loss) == len(log) > 0
    assert [e.step for e in loss] == list(range(1, len(log) + 1))  # one global step per CSV row
    assert [e.value for e in loss] == pytest.approx(log["loss"].tolist(), rel=1e-6)  # float32 in events
    assert [e.value for e in ea.Scalars("train/lr")] == pytest.approx(log["lr"].tolist(), rel=1e-6)
    assert len(ea.Scalars("train/penalty")) == len(log)
    assert [e.step for e in ea.Scalars("eval/avg_acc")] == [1, 2]
    assert _values(ea, "eval/avg_acc") == pytest.approx(res["avg_acc"], rel=1e-6)
    for t in range(1, res["num_tasks"] + 1):
        column = [row[t - 1] for row in res["acc_matrix"] if row[t - 1] is not None]
        assert _values(ea, f"eval/acc/task_{t}") == pytest.approx(column, rel=1e-6)
    assert _values(ea, "eval/forgetting") == pytest.approx([res["forgetting"]], abs=1e-5)
    assert _values(ea, "eval/retrieval_acc") == pytest.approx(res["retrieval_acc"], rel=1e-6)
    assert "config/text_summary" in ea.Tags()["tensors"]


def test_csvs_open_in_pandas_and_match_results(runs: dict[str, Any]) -> None:
    out = runs["tracked"]
    res = _results(out)
    log = pd.read_csv(out / "train_log.csv")
    assert list(log.columns) == ["task", "epoch", "step", "loss", "lr", "penalty"]
    assert log.groupby("task").size().tolist() == [t["train"]["steps"] for t in res["tasks"]]
    acc = pd.read_csv(out / "acc_matrix.csv", index_col="after_task")
    assert acc.index.tolist() == [1, 2] and acc.columns.tolist() == ["task_1", "task_2"]
    want = [[float("nan") if v is None else v for v in row] for row in res["acc_matrix"]]
    pd.testing.assert_frame_equal(acc, pd.DataFrame(want, index=acc.index, columns=acc.columns))


def test_tracking_leaves_results_and_csvs_as_they_are(runs: dict[str, Any]) -> None:
    a, b = runs["tracked"], runs["plain"]
    assert _same_training(_results(a), _results(b))
    for name in ("train_log.csv", "acc_matrix.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert not (b / "tensorboard").exists() and (a / "tensorboard").is_dir()


def test_events_stream_task_by_task(runs: dict[str, Any]) -> None:
    seen = LiveProbe.seen
    assert [s["task"] for s in seen] == [1, 2]
    for s in seen:  # at each task's end the CSV, the event file and acc_matrix.csv hold that task already
        assert s["csv_rows"] == s["tb_steps"] == s["global_step"] > 0
        assert len(s["tb_acc"]) == s["acc_rows"] == s["task"]
    assert seen[0]["global_step"] < seen[1]["global_step"]


def test_wandb_sink_logs_the_same_numbers(runs: dict[str, Any]) -> None:
    out = runs["tracked"]
    res = _results(out)
    (run,) = runs["wandb"]
    assert run.init["dir"] == str(out) and run.init["config"]["method"] == "proteus"
    assert run.init["config"]["report"]["tracking"] == "tensorboard,wandb,probe"
    assert run.metrics["train/*"] == "train/global_step" and run.metrics["eval/*"] == "task"
    train = [r for r in run.logged if "train/loss" in r]
    log = pd.read_csv(out / "train_log.csv")
    assert [r["train/loss"] for r in train] == log["loss"].tolist()  # exact: the same Python floats
    assert [r["train/global_step"] for r in train] == list(range(1, len(log) + 1))
    evals = [r for r in run.logged if "eval/avg_acc" in r]
    assert [r["task"] for r in evals] == [1, 2]
    assert [r["eval/avg_acc"] for r in evals] == res["avg_acc"]
    assert [evals[-1][f"eval/acc/task_{t}"] for t in (1, 2)] == res["acc_matrix"][-1]
    assert run.summary["final_avg_acc"] == res["final_avg_acc"] and run.finished == 0


def test_plain_progress_off_a_terminal(runs: dict[str, Any]) -> None:
    text = runs["stderr"]
    assert "\r" not in text and "\x1b" not in text  # no carriage returns, no terminal codes
    train = [ln for ln in text.splitlines() if ": training its adapter:" in ln]
    assert train and all(ln.startswith("task ") and "%)" in ln and ln.endswith("s]") for ln in train)
    for task in ("task 1:", "task 2:"):  # per bar: a line per quarter, one per PLAIN_INTERVAL, a last one
        lines = [ln for ln in train if ln.startswith(task)]
        seconds = float(lines[-1].rsplit("[", 1)[1].removesuffix(" s]")) if lines else 0.0
        assert len(lines) <= 5 + seconds / PLAIN_INTERVAL, lines
    assert len(text) < 20_000


def test_plain_bar_lines_are_few_and_timed() -> None:
    now = [0.0]
    out = io.StringIO()
    b = PlainBar(range(120), desc="task 2: train", file=out, clock=lambda: now[0])
    for i in b:
        now[0] += 1.0  # a second per step: a line every PLAIN_INTERVAL (10 s) over its 120 s
        if (i + 1) % 10 == 0:
            b.set_postfix(loss=f"{0.5:.3f}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "task 2: train: 10/120 (8%) loss=0.500 [10 s]"
    assert len(lines) == 12 and lines[-1].startswith("task 2: train: 120/120 (100%)")
    # a long pass: a line every PLAIN_INTERVAL seconds between the quarters, and a last one at close
    now[0], out = 0.0, io.StringIO()
    slow = PlainBar(total=4, desc="prefix", file=out, clock=lambda: now[0])
    now[0] = 100.0
    slow.update(0.5)
    slow.close()
    assert out.getvalue().splitlines() == ["prefix: 0.5/4 (12%) [100 s]"]
    # a short pass writes nothing; -q (enabled=False) gives no plain bar at all
    quick = bar(range(10), desc="x", file=io.StringIO())
    assert isinstance(quick, PlainBar) and list(quick) == list(range(10)) and quick.file.getvalue() == ""
    assert not isinstance(bar(range(3), file=io.StringIO(), enabled=False), PlainBar)


def test_wandb_asked_for_but_missing_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert main([*ARGS, "-q", "--track", "tensorboard,wandb", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "pip install wandb" in err and "report.tracking" in err
    for name in ("kb", "config.yaml", "tensorboard", "train_log.csv"):  # refused before anything is written
        assert not (tmp_path / "w" / name).exists()
    with pytest.raises(TrackingError, match="pip install wandb"):
        Tracker.for_run(tmp_path / "x", "wandb")


def test_sink_names_and_the_track_flag() -> None:
    assert parse_sinks("none") == parse_sinks("") == parse_sinks(None) == ["csv"]
    assert parse_sinks(" TensorBoard, wandb,tensorboard,csv") == ["csv", "tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="unknown sink 'mlflow'; choose from csv, tensorboard, wandb"):
        parse_sinks("mlflow")
    args = build_parser().parse_args(["run", "--benchmark", "b", "--set", "a.b=1", "--track", "tensorboard"])
    assert args.set == ["a.b=1", "report.tracking=tensorboard"]
    args = build_parser().parse_args(["compare", "--benchmark", "b", "--methods", "x", "--track", "wandb"])
    assert args.set == ["report.tracking=wandb"]


class Broken(Sink):
    name = "broken"

    def steps(self, task: int, steps: list[Step]) -> None:
        raise OSError("disk full")


class Recorder(Sink):
    name = "recorder"

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.events: list[Any] = []

    def steps(self, task: int, steps: list[Step]) -> None:
        self.events += steps

    def task_end(self, event: TaskEnd) -> None:
        self.events.append(event)


def test_a_failing_optional_sink_is_dropped_and_the_run_goes_on(tmp_path: Path, caplog) -> None:
    rec = Recorder(tmp_path)
    with Tracker([Broken(tmp_path), rec]) as tracker:
        tracker.steps(1, [{"epoch": 1, "step": 1, "loss": 0.5, "lr": 0.1, "penalty": 0.0}, {"step": 2}])
        tracker.task_end(1, 2, {"row": [50.0], "retrieval_acc": None}, 1.5)
        tracker.steps(2, [{"epoch": 1, "step": 1, "loss": 0.4, "lr": 0.1, "penalty": 0.1}])
        end = tracker.task_end(2, 2, {"row": [40.0, 60.0], "retrieval_acc": 90.0}, 2.0)
    assert "the broken sink failed (OSError: disk full)" in caplog.text and tracker.names == []
    assert [e.global_step for e in rec.events if isinstance(e, Step)] == [1, 2, 3]
    assert rec.events[1].loss is None  # a key the learner did not log stays empty
    assert (end.average_acc, end.forgetting, end.global_step) == (50.0, 10.0, 3)
    assert end.matrix == [[50.0], [40.0, 60.0]]
