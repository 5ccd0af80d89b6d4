"""What a PROTEUS learner leaves in a knowledge base, and how it is read back: per task its record and
tensors (the adapter's directions and its row of S (Eq. 9), its keys (Eq. 18), its own head), and one
global object, the head's statistics G, e(c) (Alg. 1 lines 8-12) with any keys that live there.

Each part writes and reads its own share (``model.task_tensors``, ``keys.task_state``,
``heads.task_state`` ...), and declares what it may hold (:data:`proteus.tensor_rules.TENSOR_RULES`, the
role :data:`KB_LAYOUT`); this module composes them. Reading is untrusted input: a failure names the task
and its object (:class:`~proteus.engine.errors.TaskError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from proteus.core.parts import ProteusParts
from proteus.engine.errors import TaskError
from proteus.engine.keys.base import GLOBAL_PREFIX as KEYS_PREFIX
from proteus.engine.records import TaskRecord, TaskRecords, without_timings
from proteus.heads.persist import is_head_meta
from proteus.learners import LearnerState, TaskParts
from proteus.tensor_rules import TENSOR_RULES, Claim

__all__ = ["KB_LAYOUT", "learner_state", "load_head", "restore"]

#: the role of :data:`~proteus.tensor_rules.TENSOR_RULES` its parts declare their stored state under (the
#: adapters, keys, class heads and records); a knowledge base whose head meta is a RanPAC head's is one
KB_LAYOUT = "proteus"
TENSOR_RULES.declare(KB_LAYOUT, "Proteus", Claim(is_head_meta))


def learner_state(parts: ProteusParts, records: TaskRecords) -> LearnerState:
    """Everything learned: per task its record (timings left out) and tensors, built when a knowledge base
    asks for it (a task unchanged since it was stored is not: :class:`~proteus.learners.TaskParts`), and
    the head's object."""

    def build(k: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        rec = records[k]
        tensors = parts.model.task_tensors(k) if rec.has_adapter else {}
        key_meta, key_tensors = parts.keys.task_state(k, rec.classes)
        head_meta, head_tensors = parts.heads.task_state(k, rec.classes)
        meta = without_timings({**rec.to_dict(), **key_meta, **head_meta})
        return meta, {**tensors, **key_tensors, **head_tensors}

    generation = parts.generation  # a state is committed before any task changes again

    def stored(k: int) -> Any:
        rec = records[k]
        return rec.stored if rec.stored_at == generation else None

    def committed(k: int, record: Any) -> None:
        records[k].stored, records[k].stored_at = record, generation

    def tokens() -> list[Any]:  # every task's stored(k), in one pass (a long stream's commit asks for all)
        return [r.stored if r.stored_at == generation else None for r in records]

    tasks = TaskParts(len(records), build, stored, committed, tokens)
    return LearnerState(tasks, _head_state(parts, records.classes()))


def _head_state(
    parts: ProteusParts, classes: list[list[int]]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    state = parts.heads.state()
    if state is None:
        return None
    meta, tensors = state
    kmeta, ktensors = parts.keys.global_state(classes)
    if kmeta is not None:  # global keys (LDA key heads) ride in the head's object, under task_head/
        meta = {**meta, "task_head": kmeta}
        tensors.update({f"{KEYS_PREFIX}{n}": v for n, v in ktensors.items()})
    return meta, tensors


def restore(parts: ProteusParts, records: TaskRecords, state: LearnerState) -> None:
    """Load ``state`` into parts that hold no task yet, appending each task's record to ``records``."""
    if records:
        raise TaskError("a learner is restored from a state only before it learns any task")
    adapters: list[tuple[Mapping[str, torch.Tensor], str]] = []  # appended together (append_tasks_tensors)
    for meta, tensors in state.tasks:
        try:
            if _load_task(parts, records, meta, tensors):
                adapters.append((tensors, f"task {len(records)} ({meta.get('object', 'no object')})"))
        except (TaskError, ValueError, TypeError, KeyError, IndexError, RuntimeError):
            with _loading(f"task {len(records) + 1} ({meta.get('object', 'no object')})"):
                raise  # named as the loading of this task
    try:
        parts.model.append_tasks_tensors(adapters)
    except (KeyError, ValueError) as e:  # names the task and its object
        raise TaskError(f"{e.args[0]}" if isinstance(e, KeyError) else str(e)) from None
    if state.head is not None:
        with _loading(f"the head ({state.head[0].get('object', 'its object')})"):
            load_head(parts, *state.head)
    head = parts.heads.head
    if head is not None and records.num_classes != head.num_classes_:  # the head learned every class
        raise TaskError(
            f"the head scores {head.num_classes_} classes (0 .. num_classes - 1), but the tasks hold "
            f"{records.num_classes} (classes up to {records.num_classes - 1}): the records do not belong "
            "to this head"
        )


def load_head(parts: ProteusParts, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Load the head's statistics and any global keys (stored under ``task_head/``) into ``parts``."""
    own = {k: v for k, v in tensors.items() if not k.startswith(KEYS_PREFIX)}
    parts.heads.load({k: v for k, v in meta.items() if k != "task_head"}, own)
    sub = {k[len(KEYS_PREFIX) :]: v for k, v in tensors.items() if k.startswith(KEYS_PREFIX)}
    parts.keys.load_global(meta.get("task_head"), sub)


def _load_task(
    parts: ProteusParts, records: TaskRecords, meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]
) -> bool:
    """Task ``meta``'s record, keys and head share; True when it has an adapter (appended by the caller)."""
    k = len(records)
    if meta["index"] != k:
        raise TaskError(f"knowledge base task {meta['index'] + 1} is out of order (expected {k + 1})")
    if meta["has_adapter"] != parts.trains_adapter(k):  # adapter.enabled and train.tasks fix which tasks
        raise TaskError(
            f"task {k + 1}: its record says has_adapter={meta['has_adapter']}, but under this config "
            f"(adapter.enabled, train.tasks) it {'has' if parts.trains_adapter(k) else 'has no'} adapter"
        )
    parts.keys.load_task(meta, tensors)
    parts.heads.load_task(k, meta, tensors)
    records.append(TaskRecord.from_dict(meta))
    records[-1].stored, records[-1].stored_at = meta, parts.generation  # kept while the task is unchanged
    records[-1].adopted = meta  # its share read from its object (a knowledge base's mapping)
    return bool(meta["has_adapter"])


@contextlib.contextmanager
def _loading(what: str) -> Iterator[None]:
    """Re-raise a failure to load a stored part (wrong shapes, types or values) as a TaskError naming it."""
    try:
        yield
    except TaskError as e:  # already names the task ("task 2: ..."): add the file once
        raise TaskError(f"{what}: {str(e).removeprefix(what.split(' (')[0] + ': ')}") from None
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        msg = e.args[0] if e.args else type(e).__name__
        raise TaskError(f"{what}: cannot be loaded: {msg}") from None
