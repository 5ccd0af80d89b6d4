"""What a baseline leaves in a knowledge base, and how it is read back (``load``: ``proteus learn`` in a new
process, ``evaluate``, ``predict``, ``serve``).

Per task its record (a :class:`~proteus.engine.records.TaskRecord`, as PROTEUS's, timings left out) and an
empty object; one global object, the head's, with every learned tensor (each task's linear head
``head.<k>.{weight,bias}`` and the method's own state, :meth:`ContinualClassifier.state_tensors`: LoRA
branches, prompts, keys, statistics, generator states) and its meta: the method, every task's classes, the
stream's number of tasks and :data:`STATE_VERSION`, plus what a method adds (InfLoRA's DualGPM modes,
AdaPromptCL's groups). Everything that a later task reads is there, so a learner restored from it predicts
as the one that wrote it and learns the next task bit for bit as an uninterrupted run.

A knowledge base of an earlier release (no ``state_version``) lacks some of it (generator states, the
per-task ranks of the LoRA units, the DualGPM modes): it loads and predicts as before, and a method for which
it is not complete refuses to learn further tasks, by name (:attr:`ContinualClassifier.resumes_legacy`).
Reading is untrusted input: a failure names the object and the tensor (:class:`TaskError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from proteus.engine.errors import TaskError, need
from proteus.engine.records import TaskRecord, TaskRecords, without_timings
from proteus.learners import LearnerState

__all__ = [
    "STATE_VERSION", "generator_state", "learner_state", "linear", "load_generator", "need", "restore",
]  # fmt: skip

#: the head meta's ``state_version``: 2 since the state holds everything a later task reads (absent before)
STATE_VERSION = 2


class ContinualClassifier(Protocol):
    """What this module reads and sets of a baseline (:class:`proteus.baselines.learner.ContinualClassifier`,
    which imports this module: named here by what it holds, not imported back)."""

    name: str
    records_: TaskRecords
    heads_: nn.ModuleList
    task_classes_: list[list[int]]
    labels_: list[int]
    embed_dim: int
    device_: torch.device
    resumes_legacy: bool
    _stream_tasks: int | None
    _frozen_reason: str | None

    @property
    def num_tasks(self) -> int: ...

    def _build(self) -> None: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...


def learner_state(clf: ContinualClassifier) -> LearnerState:
    """Per task its record (without timings) and no tensors; the head's meta and every learned tensor."""
    tasks: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = [
        (without_timings(r.to_dict()), {}) for r in clf.records_
    ]
    meta = {
        "method": clf.name,
        "task_classes": [list(cs) for cs in clf.task_classes_],
        "stream_tasks": clf._stream_tasks,
        "state_version": STATE_VERSION,
    }
    return LearnerState(tasks, (meta, clf.state_tensors()))


def restore(clf: ContinualClassifier, state: LearnerState) -> None:
    """Load ``state`` (:func:`learner_state`'s form, or an earlier release's) into ``clf``, which holds no
    task yet: the records, the heads, the task classes, then the method's own state
    (:meth:`ContinualClassifier.load_state`). torch's global random stream is left as it was."""
    if clf.num_tasks:
        raise TaskError(f"{clf.name}: a learner is restored from a state only before it learns any task")
    clf._build()
    if state.head is None:
        if state.tasks:
            raise TaskError(f"{clf.name}: the knowledge base lists {len(state.tasks)} tasks, no head object")
        return
    meta, tensors = state.head
    with _loading(f"{clf.name}: the head object"), torch.random.fork_rng(devices=[]):
        if meta.get("method", clf.name) != clf.name:
            raise TaskError(f"holds the state of method {meta.get('method')!r}, not of {clf.name!r}")
        task_classes = [[int(c) for c in cs] for cs in meta["task_classes"]]
        if len(task_classes) != len(state.tasks):
            raise TaskError(f"task_classes lists {len(task_classes)} tasks, the manifest {len(state.tasks)}")
        width = getattr(clf, "head_in", clf.embed_dim)  # the heads' input (KLDA's: its random features)
        for k, (rec, _) in enumerate(state.tasks):
            record = TaskRecord.from_dict({"has_adapter": False, **rec})
            if record.index != k or record.classes != task_classes[k]:
                raise TaskError(f"task {k + 1}'s record does not match the head's task_classes")
            clf.records_.append(record)
            w, b = need(tensors, f"head.{k}.weight"), need(tensors, f"head.{k}.bias")
            if w.shape != (len(task_classes[k]), width) or b.shape != (len(task_classes[k]),):
                raise TaskError(
                    f"head.{k}: shapes {tuple(w.shape)}, {tuple(b.shape)}; expected "
                    f"({len(task_classes[k])}, {width}) and ({len(task_classes[k])},)"
                )
            clf.heads_.append(linear(w, b, clf.device_))
        clf.task_classes_ = task_classes
        clf.labels_ = [c for cs in task_classes for c in cs]
        stream_tasks = meta.get("stream_tasks")
        clf._stream_tasks = int(stream_tasks) if stream_tasks else None
        clf.load_state(meta, tensors)
    if "state_version" not in meta and not clf.resumes_legacy:
        clf._frozen_reason = (
            "its knowledge base was written by an earlier release, without the state a further task reads "
            "(generators, ranks); it still predicts, evaluates and serves: learn on from a new `proteus run`"
        )


def linear(weight: torch.Tensor, bias: torch.Tensor, device: torch.device) -> nn.Linear:
    """A frozen ``nn.Linear`` holding exactly ``weight`` and ``bias`` (float32), on ``device``."""
    head = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], device=device)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head.requires_grad_(False)


def generator_state(g: torch.Generator) -> torch.Tensor:
    """A CPU generator's state as a uint8 tensor (what :func:`load_generator` sets back)."""
    return g.get_state().clone()


def load_generator(g: torch.Generator, tensors: dict[str, torch.Tensor], name: str) -> None:
    """Set ``g`` to the state stored as ``name`` (left as it is when an earlier release stored none)."""
    t = tensors.get(name)
    if t is not None:
        if t.dtype != torch.uint8 or t.ndim != 1:
            raise TaskError(f"tensor {name!r}: a generator state is 1-D uint8, not {t.dtype} {t.ndim}-D")
        g.set_state(t.contiguous().clone())


@contextlib.contextmanager
def _loading(what: str) -> Iterator[None]:
    """Re-raise a failure to load a stored part (wrong shapes, types or values) as a TaskError naming it."""
    try:
        yield
    except TaskError as e:
        raise TaskError(f"{what}: {e}") from None
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, AttributeError) as e:
        msg = e.args[0] if e.args else type(e).__name__
        raise TaskError(f"{what}: cannot be loaded: {msg}") from None
