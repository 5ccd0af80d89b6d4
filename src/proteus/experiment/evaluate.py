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

import torch

from proteus.estimator import Prediction, Proteus
from proteus.streams import TaskStream

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
    """Accuracy rows with per-adapter embedding caches (``cache_bytes`` bounds the prefix cache)."""

    def __init__(self, clf: Proteus, stream: TaskStream, cache_bytes: int = 2 << 30) -> None:
        self.clf = clf
        self.stream = stream
        self.cache_bytes = cache_bytes
        self._z: dict[int, torch.Tensor] = {}
        self._y: dict[int, torch.Tensor] = {}
        self._emb: dict[tuple[int, str, int], torch.Tensor] = {}
        #: the last evaluation's prediction per test set (retrieval methods)
        self.last_prediction: dict[int, Prediction] = {}

    def _prefix(self, tau: int) -> torch.Tensor:
        if tau not in self._z:
            z, y = self.clf.prefix_dataset(self.stream.tasks[tau].test, f"test {tau + 1}: prefix")
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
            self._emb[key] = self.clf.embed_prefix(self._prefix(tau), None if j is None else [j], kind)[0]
        return self._emb[key]

    def labels(self, tau: int) -> torch.Tensor:
        self._prefix(tau)
        return self._y[tau]

    def embedded(self, tau: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(H, F)`` of test set tau, as :meth:`Proteus.embed` gives them, from the caches."""
        H = torch.stack([self.embedding(tau, "task", j) for j in range(self.clf.num_adapters)])
        F = self.embedding(tau, "task", None) if self.clf.needs_frozen else None
        return H, F

    def retrieved(self, tau: int) -> torch.Tensor:
        """The task retrieved for each input of test set tau by the current learner."""
        pred = self.last_prediction.get(tau)
        if pred is None or pred.task is None or pred.task.numel() != self.labels(tau).numel():
            return self.clf.retrieve(*self.embedded(tau)).task.cpu()
        return pred.task.cpu()

    def evaluate(self, k: int) -> Evaluation:
        """Evaluate on the test sets of tasks 0..k after learning task k."""
        clf = self.clf
        row, oracle_row = [], []
        n_correct_ret = n_total = 0
        retrieval = clf.uses_retrieval
        for tau in range(k + 1):
            y = self.labels(tau)
            if retrieval:
                pred = clf.predict_embedded(*self.embedded(tau))
                assert pred.task is not None
                self.last_prediction[tau] = pred
                n_correct_ret += int((pred.task == tau).sum())
                n_total += len(y)
                own = torch.full_like(y, tau)
                oracle = clf.classify(self.embedding(tau, "task", tau), own).argmax(1)
                oracle_row.append(100.0 * float((oracle == y).float().mean()))
                label = pred.label
            else:
                tasks, kind = clf.head_composition(k)
                label = clf.classify(self.embedding(tau, kind, None if tasks is None else tasks[0])).argmax(1)
            row.append(100.0 * float((label == y).float().mean()))
        return Evaluation(
            row=row,
            retrieval_acc=100.0 * n_correct_ret / n_total if retrieval else None,
            oracle_row=oracle_row if retrieval else None,
        )
