"""Continual-learning metrics (paper Sec. 5.1 "Baselines and Metrics" and Appendix "Forgetting metric").

The accuracy matrix is a list of rows: row ``kappa`` (0-based here, task ``kappa + 1`` in the paper) holds the
accuracies after learning task ``kappa``: entry ``tau`` is ``acc(tau, kappa)``, the accuracy on task ``tau``'s
test set, defined for ``tau <= kappa``. Entries above the diagonal (``tau > kappa``) are ``None`` or absent
(a row may be of length ``kappa + 1``). This is the ``acc_matrix`` of results.json (percent, null above the
diagonal).

* Average accuracy (Sec. 5.1): ``ACC_kappa = (1 / kappa) * sum_{tau=1..kappa} acc(tau, kappa)``.
* Forgetting (Appendix): ``F_kappa = (1 / (kappa - 1)) * sum_{tau=1..kappa-1} max_{tau' in 1..kappa-1}
  (acc(tau, tau') - acc(tau, kappa))``, undefined (``None``) for ``kappa = 1``. ``acc(tau, tau')`` does not
  exist for ``tau' < tau`` (task ``tau`` had not been learned yet), so the max effectively ranges over
  ``tau' in tau..kappa-1``: the best accuracy task ``tau`` ever had before task ``kappa`` was learned, as in
  the usual definition (Chaudhry et al., 2018). It can be negative (backward transfer).
* Retrieval accuracy (Sec. 5.2): the percentage of test inputs whose retrieved task is their true task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: rows = after learning task kappa; entry tau = acc(tau, kappa) for tau <= kappa, None (or absent) above
AccMatrix = Sequence[Sequence[float | None]]


def _entry(matrix: AccMatrix, tau: int, kappa: int) -> float:
    """``acc(tau, kappa)`` (0-based); raises ValueError when missing on or below the diagonal."""
    row = matrix[kappa]
    v = row[tau] if tau < len(row) else None
    if v is None:
        raise ValueError(f"accuracy matrix: acc(task {tau + 1}, after task {kappa + 1}) is missing")
    return float(v)


def validate_matrix(matrix: AccMatrix) -> None:
    """Check that every entry on and below the diagonal is a number (rows may be ragged above it)."""
    for kappa in range(len(matrix)):
        for tau in range(kappa + 1):
            _entry(matrix, tau, kappa)


def average_accuracy(matrix: AccMatrix) -> list[float]:
    """``[ACC_1, ..., ACC_m]``: after each task, the mean accuracy over the tasks learned so far."""
    return [float(np.mean([_entry(matrix, tau, k) for tau in range(k + 1)])) for k in range(len(matrix))]


def forgetting(matrix: AccMatrix) -> list[float | None]:
    """``[F_1, ..., F_m]`` with ``F_1 = None`` (see the module docstring for the range of the max)."""
    out: list[float | None] = []
    for k in range(len(matrix)):
        if k == 0:
            out.append(None)
            continue
        drops = []
        for tau in range(k):
            best = max(_entry(matrix, tau, t) for t in range(tau, k))
            drops.append(best - _entry(matrix, tau, k))
        out.append(float(np.mean(drops)))
    return out


def final_forgetting(matrix: AccMatrix) -> float | None:
    """``F_m`` after the last task (``None`` with fewer than two tasks)."""
    return forgetting(matrix)[-1] if len(matrix) else None


def final_average_accuracy(matrix: AccMatrix) -> float | None:
    """``ACC_m`` after the last task (``None`` for an empty matrix)."""
    return average_accuracy(matrix)[-1] if len(matrix) else None


def _as_int_array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1:
        a = a.reshape(-1)
    return a.astype(np.int64, copy=False)


def accuracy(pred: Any, target: Any) -> float:
    """Percentage of ``pred == target`` (sequences, numpy arrays or torch tensors of integer labels). The
    fraction is rounded to float32 before the percentage, as every release has written it to results.json
    (a float32 mean of the match mask): the same seed gives the same bytes across releases."""
    p, t = _as_int_array(pred), _as_int_array(target)
    if p.shape != t.shape:
        raise ValueError(f"accuracy: {p.size} predictions for {t.size} targets")
    if p.size == 0:
        raise ValueError("accuracy: no predictions (empty test set?)")
    return 100.0 * float(np.mean(p == t, dtype=np.float32))


def retrieval_accuracy(retrieved_task: Any, true_task: Any) -> float:
    """Percentage of inputs whose retrieved task index equals their true task index."""
    return accuracy(retrieved_task, true_task)


def confusion_matrix(retrieved: Any, true: Any, m: int) -> np.ndarray:
    """``(m, m)`` int64 counts: row = true task, column = retrieved task (0-based indices)."""
    r, t = _as_int_array(retrieved), _as_int_array(true)
    if r.shape != t.shape:
        raise ValueError(f"confusion_matrix: {r.size} retrieved for {t.size} true tasks")
    bad = (r < 0) | (r >= m) | (t < 0) | (t >= m)
    if bad.any():
        raise ValueError(f"confusion_matrix: task indices must be in 0..{m - 1}")
    cm = np.zeros((m, m), dtype=np.int64)
    np.add.at(cm, (t, r), 1)
    return cm
