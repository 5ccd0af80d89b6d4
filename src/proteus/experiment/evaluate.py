"""Evaluation after each task (Sec. 5.1 metrics): the accuracy row acc(tau, k), retrieval accuracy and the
oracle accuracy (the true task's adapter), through the estimator's public steps.

An adapter never changes after its task, so the embedding of test set tau under adapter j is computed
once and reused at every later step: evaluating after task k costs the new adapter on the old test sets
plus every adapter on the new test set, not k^2 passes. Embeddings are computed one adapter per forward,
so a cached value is bit-identical to a fresh one and ``proteus learn`` in a new process reproduces
``proteus run``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, cast

import torch

from proteus.learners import ContinualLearner
from proteus.metrics import accuracy
from proteus.progress import bar as progress_bar
from proteus.streams import TaskStream

if TYPE_CHECKING:
    from proteus.learners import RetrievalLearner

__all__ = ["Evaluation", "Evaluator"]


@dataclass
class Evaluation:
    """One evaluation after task k: accuracy (%) per seen task, retrieval and oracle accuracy."""

    row: list[float]
    retrieval_acc: float | None
    oracle_row: list[float] | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class Evaluator:
    """Accuracy rows of any learner (:class:`~proteus.learners.ContinualLearner`), with the test
    sets' prefix outputs and per-adapter embeddings cached (``cache_bytes`` bounds the prefix cache): the
    learner's :meth:`predict_test` reads them through this object (a
    :class:`~proteus.learners.TestCache`)."""

    def __init__(
        self, clf: ContinualLearner, stream: TaskStream, cache_bytes: int = 2 << 30, hint: str = ""
    ) -> None:
        self.clf = clf
        #: said beside the evaluation's progress (``proteus learn``: how to skip it)
        self.hint = hint
        self.stream = stream
        self.cache_bytes = cache_bytes
        self._z: dict[int, torch.Tensor] = {}
        self._y: dict[int, torch.Tensor] = {}
        self._emb: dict[tuple[int, str, int], torch.Tensor] = {}
        #: the last evaluation's retrieved task per input of each test set (retrieval learners)
        self.last_task: dict[int, torch.Tensor] = {}

    def prefix(self, tau: int) -> torch.Tensor:
        """The frozen-prefix outputs of test set tau (cached while they fit in ``cache_bytes``)."""
        if tau not in self._z:
            z, y = self.clf.prefix_dataset(
                self.stream.tasks[tau].test, f"evaluating: embedding the test images of task {tau + 1}"
            )
            self._y[tau] = y
            used = sum(v.numel() * v.element_size() for v in self._z.values())
            if used + z.numel() * z.element_size() > self.cache_bytes:
                return z
            self._z[tau] = z
        return self._z[tau]

    def embedding(self, tau: int, kind: str, j: int | None) -> torch.Tensor:
        """Test set tau under adapter j's composition ``kind`` (None: the frozen backbone), cached."""
        key = (tau, kind, -1 if j is None else j)
        if key not in self._emb:
            clf = cast("RetrievalLearner", self.clf)  # only a retrieval learner's predict_test reads them
            self._emb[key] = clf.embed_prefix(self.prefix(tau), None if j is None else [j], kind)[0]
        return self._emb[key]

    def labels(self, tau: int) -> torch.Tensor:
        self.prefix(tau)
        return self._y[tau]

    def retrieved(self, tau: int) -> torch.Tensor:
        """The task the current learner retrieves for each input of test set tau (retrieval learners): the
        last evaluation's, else a new prediction from the caches."""
        task = self.last_task.get(tau)
        if task is None or task.numel() != self.labels(tau).numel():
            task = self.clf.predict_test(self, tau, len(self.stream.tasks) - 1).task
            assert task is not None, "retrieved: the learner does not retrieve tasks"
        return task.cpu()

    def evaluate(self, k: int) -> Evaluation:
        """Evaluate on the test sets of tasks 0..k after learning task k."""
        row: list[float] = []
        oracle_row: list[float] = []
        n_correct_ret = n_total = 0
        retrieval = False
        desc = f"task {k + 1}: evaluating tasks 1-{k + 1}{self.hint}"
        for tau in progress_bar(range(k + 1), desc=desc, enabled=bool(getattr(self.clf, "progress", False))):
            y = self.labels(tau)
            out = self.clf.predict_test(self, tau, k)
            row.append(accuracy(out.label, y))
            if out.task is not None:
                retrieval = True
                self.last_task[tau] = out.task
                n_correct_ret += int((out.task == tau).sum())
                n_total += len(y)
            if out.oracle is not None:
                oracle_row.append(accuracy(out.oracle, y))
        return Evaluation(
            row=row,
            retrieval_acc=100.0 * n_correct_ret / n_total if retrieval else None,
            oracle_row=oracle_row or None,
        )
