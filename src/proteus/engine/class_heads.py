"""The class heads of a learner (Algorithm 1 lines 8-12, Eq. 23): "which class, given the task".

Beside the retrieval keys ("which task", :mod:`proteus.engine.keys`) a learner keeps the RanPAC head over
every class (G and e(c) accumulated task by task, :class:`~proteus.heads.RanPACHead`), with
``head.scope=task`` each task's own ridge head (:class:`~proteus.engine.experts.TaskExperts`), and with
``head.forgettable`` each task's head inputs, so that ``proteus kb forget`` can subtract the task exactly
(:meth:`RanPACHead.downdate`). :class:`ClassHeads` owns the three: the update of a task, its rollback, the
scores, the forgetting and their share of the knowledge base -- as each adapter unit and each key
strategy owns its own -- and declares what that share may hold (:data:`proteus.tensor_rules.TENSOR_RULES`):
the head over every class is the head object's RanPAC head, every learned class one of its classes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from proteus.engine.errors import TaskError
from proteus.engine.experts import HEAD_SCOPES, TaskExpert, TaskExperts
from proteus.engine.stored import TaskShares
from proteus.heads import PROTOTYPES, RanPACHead
from proteus.heads.persist import assemble_columns, classes_outside, column_pieces
from proteus.tensor_rules import TENSOR_RULES, Check, Mount, ShapeRule, Together

__all__ = ["ClassHeads"]


def _under(prefix: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors named ``prefix<name>``, by ``<name>``."""
    return {n[len(prefix) :]: tensors[n] for n in tensors if n.startswith(prefix)}


def _stored_inputs(x: str, y: str) -> Callable[[int, Mapping[str, Tensor]], tuple[Tensor, Tensor]]:
    """Decodes a stored task's kept inputs (features ``x``, labels ``y``)."""
    return lambda k, tensors: (tensors[x].float(), tensors[y].long())


#: a task's part of the knowledge base: its record's keys (JSON) and its tensors
Part = tuple[dict[str, Any], dict[str, Tensor]]


TENSOR_RULES.declare(
    "proteus", "ClassHeads",
    Mount("ranpac", on="head"),  # the head over every class (state(): its meta and tensors)
    Mount("ranpac columns", prefix="head/", on="task"),  # its columns of each task's classes (task_state)
    Check(classes_outside),  # every learned class is one the head scores
    ShapeRule(r"forget/h", ("obj.forget_n", "kb.forget_d"), "forget/h (n, d) and forget/y (n) have n rows"),
    ShapeRule(r"forget/y", ("obj.forget_n",), "forget/h (n, d) and forget/y (n) have n rows", "int"),
    Together(r"forget/(?:h|y)", ("forget/h", "forget/y")),
)  # fmt: skip


class ClassHeads:
    """The head over every class, the per-task heads (``scope``) and the forgettable inputs."""

    def __init__(
        self, new_head: Callable[..., RanPACHead], scope: str, forgettable: bool, device: torch.device
    ) -> None:
        self.new_head, self.device, self.forgettable = new_head, device, forgettable
        #: the RanPAC head over every class (None before the first task)
        self.head: RanPACHead | None = None
        #: ``head.scope=task``: each task's own head; None for Eq. 23's head alone
        self.experts: TaskExperts | None = HEAD_SCOPES.get(scope).experts(new_head)
        #: ``head.forgettable``: task -> (its head inputs, labels), what :meth:`forget` subtracts (read from
        #: its stored tensors once it is stored)
        self.inputs: TaskShares[tuple[Tensor, Tensor]] = TaskShares(_stored_inputs("forget/h", "forget/y"), 0)
        self._before: RanPACHead | None = None
        #: bumped when a learned task's stored share changes after its task (:meth:`forget`)
        self.generation = 0
        #: each loaded task's classes and stored tensors, its columns of the head under ``head/``
        #: (:meth:`load_task`), until :meth:`load`
        self._columns: list[tuple[list[int], Mapping[str, Tensor]]] = []

    def update(self, k: int, h: Tensor, y: Tensor, classes: list[int], num_classes: int) -> float:
        """Task k's embeddings h (N, d) and labels y into the heads; returns the γ chosen. Atomic for the
        head over every class (:meth:`RanPACHead.update` raises before changing it); :meth:`truncate`
        undoes the whole update."""
        if not torch.isfinite(h).all():
            n_bad = int((~torch.isfinite(h)).any(1).sum())
            raise TaskError(f"task {k + 1}: embeddings contain NaN or inf ({n_bad} of {len(h)} images)")
        head = self.head if self.head is not None else self.new_head()
        try:
            head.update(h.to(self.device), y.to(self.device), num_classes=num_classes)
        except (ValueError, FloatingPointError) as e:
            raise TaskError(f"task {k + 1}: head update failed: {e}") from None
        self._before, self.head = self.head, head
        if self.experts is not None:  # the task's own head over its own classes
            self.experts.add_task(h.to(self.device), y, classes)
        if self.forgettable:
            self.inputs[k] = (h.float().cpu().clone(), y.cpu().clone())
        assert head.gamma_ is not None
        return float(head.gamma_)

    def truncate(self, k: int, head: RanPACHead | None) -> None:
        """Back to the state before task k, whose head over every class was ``head``."""
        self.head = head
        if self.experts is not None:
            self.experts.truncate(k)
        self.inputs.pop(k, None)

    def logits(self, h: Tensor, tasks: Tensor | None, num_classes: int, gone: list[int]) -> Tensor:
        """Eq. 23: scores (N, C) of embeddings h (N, d) under the adapters of ``tasks`` (N,); with per-task
        heads each row is scored by its task's own head (-inf outside its classes, ``tasks`` needed).
        Classes in ``gone`` (forgotten tasks') score -inf."""
        assert self.head is not None
        if self.experts is not None:
            if tasks is None:
                raise ValueError("head.scope=task scores an embedding with its task's head: pass tasks")
            logits = self.experts.logits(h, tasks, num_classes)
        else:
            logits = self.head.decision_function(h.to(self.device)).float().cpu()
        gone = [c for c in gone if c < logits.shape[1]]
        if gone:
            logits[:, gone] = float("-inf")
        return logits

    @contextlib.contextmanager
    def without(self, k: int, h: Tensor, y: Tensor, rows: Tensor) -> Iterator[None]:
        """Within the block, the heads that score task k's inputs are fitted as if ``rows`` of its training
        embeddings h (N, d) / labels y were never seen: task k's own head (``head.scope=task``) refitted on
        the other rows with its γ, or the head over every class with the rows subtracted exactly
        (:meth:`RanPACHead.downdate`, γ kept; with ``head.prototypes=task-mean`` the rows stay in). Their
        scores are then out-of-sample (the calibration of the confidence, :mod:`proteus.engine.confidence`);
        the heads are restored after the block."""
        keep = torch.ones(len(y), dtype=torch.bool)
        keep[rows] = False
        if self.experts is not None:
            old = self.experts.experts[k]
            local = {c: i for i, c in enumerate(old.classes)}
            y_local = torch.as_tensor([local[int(c)] for c in y[keep].tolist()], dtype=torch.long)
            head = self.new_head(rp_dim=0)
            head.gamma = old.gamma  # refit with the chosen γ, no new search
            head.update(h[keep].to(self.device), y_local.to(self.device), num_classes=len(old.classes))
            assert head.W_out_ is not None
            self.experts.experts[k] = TaskExpert(old.classes, head.W_out_.detach(), old.gamma)
            try:
                yield
            finally:
                self.experts.experts[k] = old
            return
        assert self.head is not None
        before = self.head
        if PROTOTYPES.get(before.prototypes).stored:  # task means: a few rows cannot be taken out exactly
            yield  # (the head scores them in-sample)
            return
        head = copy.copy(before)  # downdate assigns new statistics: the learner's head keeps its own
        head.downdate(h[rows].to(self.device), y[rows].to(self.device), [])
        self.head = head
        try:
            yield
        finally:
            self.head = before

    def check_forget(self, k: int) -> None:
        if k not in self.inputs:
            raise TaskError(
                f"task {k + 1}: learned without head.forgettable=true, so its contribution to the head "
                "cannot be subtracted exactly; learn with --set head.forgettable=true to be able to forget"
            )

    def forget(self, k: int, classes: list[int]) -> None:
        """Subtract task k's contribution from the head over every class exactly (atomic)."""
        self.check_forget(k)
        assert self.head is not None
        h, y = self.inputs[k]
        self.head.downdate(h.to(self.device), y.to(self.device), classes)
        del self.inputs[k]
        self.generation += 1

    # knowledge base: per task (in the task's object: its expert, its inputs, the head's columns of its
    # classes) and the head over every class (the head's object: the statistics of a fixed size)
    def task_state(self, k: int, classes: list[int]) -> Part:
        meta, tensors = self.experts.task_state(k) if self.experts is not None else ({}, {})
        if k in self.inputs:
            tensors = {**tensors, "forget/h": self.inputs[k][0], "forget/y": self.inputs[k][1]}
        if self.head is not None:
            tensors = {**tensors, **{f"head/{n}": t for n, t in self.head.columns(classes).items()}}
        return meta, tensors

    def adopt(self, k: int, tensors: Mapping[str, Tensor]) -> None:
        """Task k is stored as ``tensors`` (its committed object's, memory-mapped): its expert and inputs are
        read from them when used (the page cache instead of this process's memory)."""
        if self.experts is not None:
            self.experts.adopt(k, tensors)
        if k in self.inputs and "forget/h" in tensors:
            self.inputs.bind(k, tensors)

    def load_task(self, k: int, meta: dict[str, Any], tensors: Mapping[str, Tensor]) -> None:
        if self.experts is not None:
            self.experts.load_task(meta, tensors, self.device)
        if "forget/h" in tensors:
            self.inputs.bind(k, tensors)
        self._columns.append(([int(c) for c in meta["classes"]], tensors))

    def state(self) -> Part | None:
        if self.head is None:
            return None
        return self.head.meta(columns=False), dict(self.head.state_tensors(columns=False))

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """Load the head over every class: its object's tensors, with the columns its tasks hold (read by
        :meth:`load_task`) when its meta says they live there."""
        if meta.get("columns") == "tasks":
            tensors = {**tensors, **assemble_columns(meta, column_pieces(self._columns, "head/"))}
        self._columns = []
        self.head = self.new_head()
        self.head.load_state_tensors({k: v.to(self.device) for k, v in tensors.items()}, meta)
