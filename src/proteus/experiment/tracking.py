"""Experiment tracking: one stream of typed events feeds every sink a run writes to.

The experiment loop (:func:`proteus.experiment.loop.run`) emits, in this order, :class:`RunStart` (the
resolved config), a batch of :class:`Step` per task (one per optimisation step: the learner's
``train_log_``), :class:`TaskEnd` after each task's evaluation (its row of the accuracy matrix, ACC,
forgetting, retrieval accuracy, seconds) and :class:`RunEnd` (results.json). A :class:`Tracker` hands each
event to its sinks, registered by name in :data:`SINKS`:

* ``csv`` (always): ``train_log.csv`` (appended task by task) and ``acc_matrix.csv`` (rewritten after each
  task; at the end it is results.json's ``acc_matrix``), the bytes they have always had;
* ``tensorboard`` (``report.tracking``): scalars under ``<run>/tensorboard/`` through torch's own
  ``SummaryWriter``, flushed after every task so that TensorBoard shows a run while it trains;
* ``wandb``: the same numbers through ``wandb.log`` (imported only when asked for; never required).

Sinks only read the events; nothing here feeds back into training, so results.json is the same with or
without tracking. A failing optional sink (a full disk under ``tensorboard/``, a W&B network error) is
dropped with a warning and the run goes on; the CSV sink's errors stop the run as they always have.
"""

from __future__ import annotations

import csv
import importlib
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from proteus.config import ConfigError
from proteus.errors import ProteusError
from proteus.experiment.results import append_train_log, write_acc_matrix
from proteus.metrics import average_accuracy, forgetting
from proteus.registry import Registry

log = logging.getLogger("proteus")

__all__ = [
    "SINKS", "CsvSink", "RunEnd", "RunStart", "Sink", "Step", "TaskEnd", "TensorBoardSink", "Tracker",
    "TrackingError", "WandbSink", "parse_sinks",
]  # fmt: skip


class TrackingError(ProteusError):
    """A tracking sink that was asked for cannot run (its package is missing); the message says the fix."""


# ---------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class RunStart:
    """A run begins: its directory, resolved config (nested dict), method, benchmark and number of tasks."""

    run_dir: Path
    config: dict[str, Any]
    method: str
    benchmark: str
    num_tasks: int


@dataclass(frozen=True)
class Step:
    """One optimisation step of task ``task`` (1-based): ``epoch`` and ``step`` (1-based, within the task),
    the step's ``loss``, ``lr`` and ``penalty`` as the learner logged them (None where it logged nothing),
    and ``global_step``, the 1-based count of steps over the whole run (TensorBoard's x axis)."""

    task: int
    epoch: Any
    step: Any
    loss: Any
    lr: Any
    penalty: Any
    global_step: int

    #: the learner's row keys a step carries (train_log.csv's columns after ``task``)
    KEYS: ClassVar[tuple[str, ...]] = ("epoch", "step", "loss", "lr", "penalty")

    def row(self) -> dict[str, Any]:
        """The learner's row again (what train_log.csv writes)."""
        return {k: getattr(self, k) for k in self.KEYS}


@dataclass(frozen=True)
class TaskEnd:
    """Task ``task`` (1-based) of ``num_tasks`` is learned and evaluated: ``accuracies`` is its row of the
    accuracy matrix (percent on tasks 1..task; None without an evaluation), ``average_acc`` and
    ``forgetting`` as results.json's ``avg_acc`` / ``forgetting_per_step`` entries, ``retrieval_acc``
    (None for methods without retrieval), ``seconds`` (the task's wall clock) and ``global_step`` (the
    steps trained so far)."""

    task: int
    num_tasks: int
    accuracies: list[float] | None
    average_acc: float | None
    forgetting: float | None
    retrieval_acc: float | None
    seconds: float | None
    global_step: int
    #: every evaluated row so far (the accuracy matrix up to this task, ragged)
    matrix: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class RunEnd:
    """The run finished: ``results`` is what results.json holds."""

    results: dict[str, Any]


# ----------------------------------------------------------------------------------------------- sinks
class Sink:
    """Where events go. A sink overrides the events it writes; the others are ignored. Its constructor
    only checks that it can run (a missing package is a :class:`TrackingError`) and writes nothing;
    :meth:`start` opens its files. ``required`` sinks stop the run on an error; the others are dropped
    with a warning."""

    name: ClassVar[str] = ""
    required: ClassVar[bool] = False

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def start(self, event: RunStart) -> None:
        """The run begins."""

    def steps(self, task: int, steps: Sequence[Step]) -> None:
        """Task ``task``'s optimisation steps (possibly none)."""

    def task_end(self, event: TaskEnd) -> None:
        """Task ``event.task`` is learned and evaluated."""

    def run_end(self, event: RunEnd) -> None:
        """The run finished and results.json is written."""

    def close(self, ok: bool = True) -> None:
        """Release files and connections (``ok``: the run finished)."""

    def resume(self, tasks_done: int) -> int:
        """An interrupted run goes on after ``tasks_done`` tasks: drop what the sink holds of later tasks;
        returns the steps it keeps (0 when it keeps none)."""
        return 0


SINKS: Registry[type[Sink]] = Registry("report.tracking sink")


def _import(module: str, sink: str, fix: str) -> Any:
    """``module`` imported, or a :class:`TrackingError` that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackingError(
            f"report.tracking asks for {sink}, but {module.split('.')[0]} cannot be imported ({e}): {fix}, "
            f"or drop {sink} from report.tracking (--track)"
        ) from None


@SINKS.register("csv", help="train_log.csv and acc_matrix.csv in the run directory (always on)")
class CsvSink(Sink):
    name = "csv"
    required = True

    def steps(self, task: int, steps: Sequence[Step]) -> None:
        append_train_log(self.run_dir / "train_log.csv", task, (s.row() for s in steps))

    def resume(self, tasks_done: int) -> int:
        path = self.run_dir / "train_log.csv"
        if not path.is_file():
            return 0
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
        keep = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= tasks_done]
        with path.open("w", newline="") as f:
            csv.writer(f).writerows([rows[0], *keep])
        return len(keep)

    def task_end(self, event: TaskEnd) -> None:
        if event.matrix:  # the matrix so far, so a running job's acc_matrix.csv opens in pandas
            m = event.num_tasks
            rows = [list(r) + [None] * (m - len(r)) for r in event.matrix]
            write_acc_matrix(self.run_dir / "acc_matrix.csv", {"acc_matrix": rows, "num_tasks": m})

    def run_end(self, event: RunEnd) -> None:
        write_acc_matrix(self.run_dir / "acc_matrix.csv", event.results)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@SINKS.register("tensorboard", help="TensorBoard scalars under <run>/tensorboard/ (torch's SummaryWriter)")
class TensorBoardSink(Sink):
    """Scalars: ``train/loss``, ``train/lr``, ``train/penalty`` per global step; ``eval/avg_acc``,
    ``eval/forgetting``, ``eval/retrieval_acc``, ``eval/task_seconds`` and ``eval/acc/task_<t>`` per task
    (x = tasks learned); the config as text."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self._tb = _import(
            "torch.utils.tensorboard", "tensorboard", "pip install 'proteus-cl[track]' (tensorboard)"
        )
        self.writer: Any = None

    def start(self, event: RunStart) -> None:
        self.writer = self._tb.SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        text = yaml.safe_dump(event.config, sort_keys=False)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "))  # markdown code block
        self.writer.flush()

    def steps(self, task: int, steps: Sequence[Step]) -> None:
        for s in steps:
            for key in ("loss", "lr", "penalty"):
                v = getattr(s, key)
                if _finite(v):
                    self.writer.add_scalar(f"train/{key}", v, s.global_step)

    def task_end(self, event: TaskEnd) -> None:
        w, k = self.writer, event.task
        for key in ("average_acc", "forgetting", "retrieval_acc"):
            v = getattr(event, key)
            if _finite(v):
                w.add_scalar(f"eval/{key.replace('average', 'avg')}", v, k)
        if _finite(event.seconds):
            w.add_scalar("eval/task_seconds", event.seconds, k)
        for t, a in enumerate(event.accuracies or [], 1):
            if _finite(a):
                w.add_scalar(f"eval/acc/task_{t}", a, k)
        w.flush()

    def run_end(self, event: RunEnd) -> None:
        res = event.results
        for key in ("final_avg_acc", "forgetting", "seconds"):
            if _finite(res.get(key)):
                self.writer.add_scalar(f"summary/{key}", res[key], res.get("num_tasks", 0))
        self.writer.flush()

    def close(self, ok: bool = True) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@SINKS.register("wandb", help="Weights & Biases (wandb.init / wandb.log); needs `pip install wandb`")
class WandbSink(Sink):
    """``wandb.init(project=$WANDB_PROJECT or "proteus", dir=<run>, name=<run dir name>, config=...)``;
    training scalars against ``train/global_step``, evaluation against ``task``; results.json's headline
    numbers in the run summary."""

    name = "wandb"

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.wandb = _import("wandb", "wandb", "pip install wandb (then `wandb login`)")
        self.run: Any = None

    def start(self, event: RunStart) -> None:
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "proteus"),
            dir=str(self.run_dir),
            name=self.run_dir.name,
            config=event.config,
        )
        self.run.define_metric("train/global_step")
        self.run.define_metric("train/*", step_metric="train/global_step")
        self.run.define_metric("task")
        self.run.define_metric("eval/*", step_metric="task")

    def steps(self, task: int, steps: Sequence[Step]) -> None:
        for s in steps:
            data = {f"train/{k}": getattr(s, k) for k in ("loss", "lr", "penalty") if _finite(getattr(s, k))}
            self.run.log({"train/global_step": s.global_step, "train/task": task, **data})

    def task_end(self, event: TaskEnd) -> None:
        data: dict[str, Any] = {"task": event.task}
        for key in ("average_acc", "forgetting", "retrieval_acc"):
            v = getattr(event, key)
            if _finite(v):
                data[f"eval/{key.replace('average', 'avg')}"] = v
        for t, a in enumerate(event.accuracies or [], 1):
            if _finite(a):
                data[f"eval/acc/task_{t}"] = a
        if _finite(event.seconds):
            data["eval/task_seconds"] = event.seconds
        self.run.log(data)

    def run_end(self, event: RunEnd) -> None:
        keys = ("final_avg_acc", "forgetting", "seconds", "num_tasks")
        self.run.summary.update({k: event.results[k] for k in keys if event.results.get(k) is not None})

    def close(self, ok: bool = True) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if ok else 1)
            self.run = None


# ----------------------------------------------------------------------------------------------- tracker
def parse_sinks(spec: str | Iterable[str] | None) -> list[str]:
    """The sink names of ``report.tracking`` (a comma-separated string, or a list): ``csv`` first and
    always, then the others in the order given, each once; empty and ``none`` ask for nothing more.
    An unknown name is a :class:`ConfigError` listing the known ones."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or [])
    names = ["csv"]
    for raw in items:
        name = str(raw).strip().lower()
        if name in ("", "none") or name in names:
            continue
        if name not in SINKS:
            raise ConfigError(
                f"report.tracking: unknown sink {name!r}; choose from {', '.join(SINKS.names())} "
                "(comma-separated, e.g. --track tensorboard,wandb; csv is always written)"
            )
        names.append(name)
    return names


class Tracker:
    """The run's event stream: each event goes to every sink, in order. ``Tracker.for_run(run_dir, spec)``
    builds the sinks ``spec`` names (:func:`parse_sinks`); with ``enabled=False`` (the non-zero ranks of
    a torchrun launch) there are none. Use it as a context manager (or call :meth:`close`)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)
        self.global_step = 0
        self._matrix: list[list[float]] = []

    @classmethod
    def for_run(cls, run_dir: Path, spec: str | Iterable[str] | None, *, enabled: bool = True) -> Tracker:
        names = parse_sinks(spec)  # unknown names are refused even where nothing is written
        if not enabled:
            return cls([])
        sinks: list[Sink] = []
        try:
            for name in names:
                sinks.append(SINKS.get(name)(Path(run_dir)))
        except BaseException:
            for s in sinks:
                s.close(ok=False)
            raise
        return cls(sinks)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sinks]

    def _emit(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                if sink.required:
                    raise
                log.warning("tracking: the %s sink failed (%s: %s); the run goes on without it",
                            sink.name, type(e).__name__, e)  # fmt: skip
                self.sinks.remove(sink)
                try:
                    sink.close(ok=False)
                except Exception:  # noqa: BLE001 - it failed already; the warning above says so
                    pass

    def start(
        self, run_dir: Path, config: dict[str, Any], method: str, benchmark: str, num_tasks: int
    ) -> None:
        self._emit("start", RunStart(Path(run_dir), config, method, benchmark, num_tasks))

    def steps(self, task: int, rows: Iterable[dict[str, Any]]) -> list[Step]:
        """Task ``task``'s (1-based) training curve, a learner's ``train_log_`` rows; returns the events."""
        steps = []
        for r in rows:
            self.global_step += 1
            epoch, step, loss, lr, penalty = (r.get(k) for k in Step.KEYS)
            steps.append(Step(task, epoch, step, loss, lr, penalty, global_step=self.global_step))
        self._emit("steps", task, steps)
        return steps

    def task_end(
        self, task: int, num_tasks: int, evaluation: dict[str, Any] | None, seconds: float | None
    ) -> TaskEnd:
        """Task ``task`` (1-based) is done; ``evaluation`` is its KB evaluation entry (``row``,
        ``retrieval_acc``; None: not evaluated). Returns the event."""
        row = list(evaluation["row"]) if evaluation else None
        if row is not None:
            self._matrix.append(row)
        acc = average_accuracy(self._matrix)[-1] if row is not None else None
        forg = forgetting(self._matrix)[-1] if row is not None else None
        ret = evaluation.get("retrieval_acc") if evaluation else None
        event = TaskEnd(task, num_tasks, row, acc, forg, ret, seconds, self.global_step,
                        [list(r) for r in self._matrix])  # fmt: skip
        self._emit("task_end", event)
        return event

    def run_end(self, results: dict[str, Any]) -> None:
        self._emit("run_end", RunEnd(results))

    def resume(self, evaluation: Sequence[dict[str, Any]]) -> None:
        """Go on with an interrupted run whose first ``len(evaluation)`` tasks are committed (their
        evaluation entries): the accuracy matrix so far, and each sink without what it held of later
        tasks."""
        self._matrix = [list(e["row"]) for e in evaluation if e]
        self.global_step = max((s.resume(len(evaluation)) for s in self.sinks), default=0)

    def close(self, ok: bool = True) -> None:
        """Close every sink, each once. After a finished run (``ok``) a CSV error is raised once all are
        closed; any other error is logged, so a failed run's own error is the one reported."""
        sinks, self.sinks = self.sinks, []
        first: Exception | None = None
        for s in sinks:
            try:
                s.close(ok)
            except Exception as e:  # noqa: BLE001 - close the others first
                if s.required and ok and first is None:
                    first = e
                else:
                    log.warning("tracking: closing the %s sink failed (%s: %s)", s.name, type(e).__name__, e)
        if first is not None:
            raise first

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(ok=exc_type is None)
