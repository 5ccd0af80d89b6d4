"""Typed records of the continual learner: what a learned task leaves behind, and what a prediction says.

:class:`TaskRecord` is what the knowledge base keeps of a task besides its tensors (Algorithm 1 line 7:
the key-value entry's description); :class:`TaskStats` and :class:`TrainStats` are what ``fit_task``
measured; :class:`Prediction` is the answer of Algorithm 2 for a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from proteus.engine.confidence import Confidence
from proteus.tensor_rules import TENSOR_RULES, Check, F, Fields, Schema

__all__ = [
    "Prediction", "TaskRecord", "TaskRecords", "TaskStats", "TrainStats", "loss_summary", "without_timings",
]  # fmt: skip


def loss_summary(losses: Sequence[float]) -> tuple[float | None, float | None]:
    """The mean loss of a task's first and last tenth of steps (None without a step): every learner's
    ``loss_first`` / ``loss_last``."""
    if not losses:
        return None, None
    tenth = max(1, len(losses) // 10)
    return float(np.mean(losses[:tenth])), float(np.mean(losses[-tenth:]))


def without_timings(d: Any) -> Any:
    """``d`` without the keys that hold measurements of the run rather than of the model (wall-clock
    seconds, peak GPU memory), recursively: what a knowledge base keeps (same seed, same bytes)."""
    if isinstance(d, dict):
        return {k: without_timings(v) for k, v in d.items() if "seconds" not in k and k != "peak_gpu_mb"}
    if isinstance(d, list):
        return [without_timings(v) for v in d]
    return d


@dataclass
class TrainStats:
    """The adapter training of one task (Eq. 15)."""

    rank: int
    ranks_min: int
    #: the elastic-net weight lambda of this task (decayed per task)
    lam: float
    loss_first: float | None
    loss_last: float | None
    steps: int
    s_mean_abs: float | None
    s_nonzero_frac: float | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lambda"] = d.pop("lam")
        # the order results.json has always had
        keys = ("rank", "ranks_min", "lambda", "loss_first", "loss_last", "steps", "s_mean_abs",
                "s_nonzero_frac")  # fmt: skip
        return {k: d[k] for k in keys}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainStats:
        d = dict(d)
        d["lam"] = d.pop("lambda")
        return cls(**d)


@dataclass
class TaskStats:
    """What learning one task measured (results.json ``tasks[k]``; the KB keeps it without timings)."""

    task: int
    train: TrainStats | None = None
    #: the retrieval keys' own numbers (for Gaussian signatures: active components)
    signature: dict[str, int] | None = None
    gamma: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: peak GPU memory (MiB, ``torch.cuda.max_memory_allocated``) while learning and evaluating the task;
    #: None on other devices
    peak_gpu_mb: float | None = None
    #: a learner's own numbers besides these (a baseline's ``steps``, ``loss_first``, ``loss_last``,
    #: ``trainable_params``, ...), written after ``task``
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Each step's numbers, then its time (``seconds_<step>``), in the order the steps run."""
        out: dict[str, Any] = {"task": self.task, **self.extra}

        def timed(step: str) -> None:
            if step in self.seconds:
                out[f"seconds_{step}"] = self.seconds[step]

        timed("prefix")
        if self.train is not None:
            out["train"] = self.train.to_dict()
        timed("train")
        if self.signature is not None:
            out["signature"] = dict(self.signature)
        timed("signature")
        timed("head")
        if self.gamma is not None:
            out["gamma"] = self.gamma
        timed("confidence")
        timed("evaluate")
        timed("task")
        if self.peak_gpu_mb is not None:
            out["peak_gpu_mb"] = self.peak_gpu_mb
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskStats:
        seconds = {k[len("seconds_") :]: v for k, v in d.items() if k.startswith("seconds_")}
        train = TrainStats.from_dict(d["train"]) if d.get("train") else None
        extra = {k: v for k, v in d.items() if k not in _STATS_KEYS and not k.startswith("seconds_")}
        return cls(
            int(d["task"]), train, d.get("signature"), d.get("gamma"), seconds, d.get("peak_gpu_mb"), extra
        )


#: the keys of :meth:`TaskStats.to_dict` that are its own fields (the others are ``extra``)
_STATS_KEYS = frozenset({"task", "train", "signature", "gamma", "peak_gpu_mb"})


@dataclass
class TaskRecord:
    """A learned task: its index (0-based), its classes (global labels) and names, and how it was learned.

    ``settings`` holds the options that may change from task to task (epochs, learning rate, batch size,
    device) as they were when this task was learned; ``learned`` is when (UTC, ISO 8601).
    """

    index: int
    classes: list[int]
    class_names: list[str]
    n_train: int
    has_adapter: bool
    stats: TaskStats
    settings: dict[str, Any] = field(default_factory=dict)
    learned: str | None = None
    #: held-out key scores and the rejection threshold (``retrieval.reject``; proteus.engine.novelty)
    calibration: dict[str, Any] | None = None
    #: removed by ``proteus kb forget``: its classes are never predicted, the task never retrieved
    forgotten: bool = False
    #: each class's index in its source dataset (None: not known, e.g. a knowledge base of an older release)
    source_classes: list[int] | None = None
    #: the temperature that calibrates the confidence of this task's classes (None: a knowledge base
    #: learned before it was fitted, or too few rows; :mod:`proteus.engine.confidence`)
    confidence: Confidence | None = None
    #: the record this task was last committed as or read from, while the task has not changed since (a
    #: knowledge base keeps it without rebuilding the task's part: :class:`proteus.learners.TaskParts`);
    #: not part of the record itself
    stored: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    #: the learner's :attr:`~proteus.core.parts.ProteusParts.generation` when :attr:`stored` was set
    stored_at: int = field(default=-1, repr=False, compare=False)
    #: the stored record whose object the learner holds the task's share from (``Proteus.adopt``)
    adopted: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    #: bumped by every change of any record's fields (what :class:`TaskRecords` derives is then redone)
    changes: ClassVar[int] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        """Any change of the record itself (``forgotten``, ``confidence`` ...) forgets :attr:`stored`."""
        if name not in ("stored", "stored_at", "adopted"):
            TaskRecord.changes += 1
            if getattr(self, "stored", None) is not None:
                object.__setattr__(self, "stored", None)
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "classes": list(self.classes),
            "class_names": list(self.class_names),
            "n_train": self.n_train,
            "has_adapter": self.has_adapter,
            "stats": self.stats.to_dict(),
        }
        if self.settings:
            out["settings"] = dict(self.settings)
        if self.learned is not None:
            out["learned"] = self.learned
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        if self.forgotten:
            out["forgotten"] = True
        if self.source_classes is not None:
            out["source_classes"] = list(self.source_classes)
        if self.confidence is not None:
            out["confidence"] = self.confidence.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskRecord:
        confidence = d.get("confidence")
        rec = cls.__new__(cls)  # the fields set at once (a long stream's load builds one per task)
        rec.__dict__.update(
            index=int(d["index"]),
            classes=[int(c) for c in d["classes"]],
            class_names=[str(c) for c in d["class_names"]],
            n_train=int(d["n_train"]),
            has_adapter=bool(d["has_adapter"]),
            stats=TaskStats.from_dict(d.get("stats") or {"task": d["index"]}),
            settings=dict(d.get("settings") or {}),
            learned=d.get("learned"),
            calibration=d.get("calibration"),
            forgotten=bool(d.get("forgotten", False)),
            source_classes=None if d.get("source_classes") is None else [int(c) for c in d["source_classes"]],
            confidence=None if confidence is None else Confidence.from_dict(confidence, int(d["index"])),
            stored=None,
            stored_at=-1,
            adopted=None,
        )
        TaskRecord.changes += 1
        return rec


#: ``TrainStats.from_dict`` passes these as keyword arguments: all of them, nothing else
TRAIN: Schema = {
    "rank": F("count", True),
    "ranks_min": F("count", True),
    "lambda": F("float", True),
    "loss_first": F("float|null", True),
    "loss_last": F("float|null", True),
    "steps": F("count", True),
    "s_mean_abs": F("float|null", True),
    "s_nonzero_frac": F("float|null", True),
}
#: :meth:`TaskStats.to_dict` without its timings
STATS: Schema = {
    "task": F("count", True),
    "train": F("map|null", fields=TRAIN, closed=True),
    "signature": F("map|null"),
    "gamma": F("float|null"),
    "peak_gpu_mb": F("float|null"),
}

#: :meth:`Confidence.to_dict`: the task's temperature and the rows it was fitted on
CONFIDENCE: Schema = {"temperature": F("float", True), "rows": F("count", True)}


def _source_classes(tasks: list[Any], meta: Any, where: Any) -> list[str]:
    """A task's ``source_classes`` name one source index per class."""
    return [
        f"{where(i)}.source_classes: has {len(t['source_classes'])} items, but classes has "
        f"{len(t['classes'])}"
        for i, t in enumerate(tasks)
        if isinstance(t, dict)
        and isinstance(t.get("source_classes"), list)
        and isinstance(t.get("classes"), list)
        and len(t["source_classes"]) != len(t["classes"])
    ]


#: what :meth:`TaskRecord.from_dict` reads (the fields the store itself reads, ``classes`` ... ``settings``,
#: are typed by :data:`proteus.kb.schema.TASK`; the keys' and heads' fields by their own declarations)
TENSOR_RULES.declare(
    "proteus", "TaskRecord",
    Fields(
        {
            "has_adapter": F("bool"),
            "source_classes": F("list[count]|null"),
            "stats": F("map|null", fields=STATS),
            "confidence": F("map|null", fields=CONFIDENCE, closed=True),
        },
        required=("classes", "class_names", "n_train", "has_adapter"),
    ),
    Check(_source_classes, each=True),
)  # fmt: skip


class TaskRecords(list[TaskRecord]):
    """The learned tasks' records, in order, with what follows from them: every task's classes, the class
    names by global label, the classes never to predict again and each task's rejection threshold. Each is
    derived once and kept while no task is added and no record changes (:attr:`TaskRecord.changes`): a
    prediction reads them without a pass over every task. What they return is shared: not to be modified."""

    def _derived(self, name: str, fn: Callable[[], Any]) -> Any:
        key = (len(self), TaskRecord.changes)
        memo: tuple[tuple[int, int], dict[str, Any]] | None = self.__dict__.get("_memo")
        if memo is None or memo[0] != key:
            memo = (key, {})
            self.__dict__["_memo"] = memo
        if name not in memo[1]:
            memo[1][name] = fn()
        return memo[1][name]

    def classes(self) -> list[list[int]]:
        return self._derived("classes", lambda: [t.classes for t in self])

    @property
    def num_classes(self) -> int:
        return self._derived("num_classes", lambda: 1 + max((max(t.classes) for t in self), default=-1))

    def class_names(self) -> list[str]:
        """The learned classes' names, indexed by global label."""

        def names() -> list[str]:
            found: dict[int, str] = {}
            for t in self:
                found.update(zip(t.classes, t.class_names))
            return [found.get(c, str(c)) for c in range(self.num_classes)]

        return self._derived("class_names", names)

    def task_of(self) -> torch.Tensor:
        """(C,) the task of each global class."""

        def task_of() -> torch.Tensor:  # (one scatter for every task: the tasks' classes are disjoint)
            out = torch.zeros(self.num_classes, dtype=torch.long)
            classes = self.classes()
            sizes = torch.as_tensor([len(c) for c in classes], dtype=torch.long)
            owner = torch.repeat_interleave(torch.as_tensor([t.index for t in self], dtype=torch.long), sizes)
            out[torch.as_tensor([c for cs in classes for c in cs], dtype=torch.long)] = owner
            return out

        return self._derived("task_of", task_of)

    def forgotten_classes(self) -> list[int]:
        return self._derived("forgotten", lambda: [c for t in self if t.forgotten for c in t.classes])

    def temperatures(self) -> list[float | None]:
        """Each task's confidence temperature (None for a task without one: its answers show ``p_all``)."""
        return self._derived(
            "temperatures", lambda: [None if t.confidence is None else t.confidence.temperature for t in self]
        )

    def thresholds(self) -> torch.Tensor | None:
        """Each task's rejection threshold on its key score (``retrieval.reject``), or None unless every
        task is calibrated."""

        def thresholds() -> torch.Tensor | None:
            cals = [t.calibration for t in self]
            if not cals or any(c is None for c in cals):
                return None
            return torch.tensor([float(c["threshold"]) for c in cals if c is not None])

        return self._derived("thresholds", thresholds)


@dataclass
class Prediction:
    """Algorithm 2's answer for a batch of N inputs.

    ``label`` (N,) global class (its name: ``clf.classes_[label]``); ``task`` / ``component`` (N,)
    retrieved task and signature component, **0-based** (they index the learner's tensors and
    ``clf.records_``; None for a method without retrieval) -- :attr:`task_number` and
    :attr:`component_number` are the 1-based numbers that the CLI, the JSON rows and ``proteus kb`` show;
    ``score`` (N,) the retrieved task's key score (lower is better); ``logits`` (N, C) the head's scores
    over every class learned so far; ``known`` (N,) bool and ``novelty`` (N,) the score minus the
    retrieved task's rejection threshold (> 0: from no learned task), where the tasks are calibrated
    (``retrieval.reject``), else None.
    """

    label: torch.Tensor
    task: torch.Tensor | None
    component: torch.Tensor | None
    score: torch.Tensor | None
    logits: torch.Tensor
    known: torch.Tensor | None = None
    novelty: torch.Tensor | None = None

    @property
    def task_number(self) -> torch.Tensor | None:
        """``task + 1``: the retrieved task as the CLI and the JSON rows number it (task 1 is the first)."""
        return None if self.task is None else self.task + 1

    @property
    def component_number(self) -> torch.Tensor | None:
        """``component + 1``: the retrieved component as the CLI and the JSON rows number it."""
        return None if self.component is None else self.component + 1
