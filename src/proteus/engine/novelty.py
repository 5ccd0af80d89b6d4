"""Inputs from no learned task (beyond the paper): two detectors with per-task thresholds.

Retrieval (Sec. 3.1) always names a task; an input from no learned task still gets one. A detector gives
every input a *novelty*: its score minus a threshold (> 0: rejected as unknown).

``retrieval.novelty = class-gaussian`` (the default with LDA keys: ``auto``): class-conditional Gaussians
with one shared covariance in the keys' space, built from the statistics the LDA keys already keep (the
class sums Q, counts n and Gram matrix G of Algorithm 1's lines 9-10, applied to the key features): class
means ``mu_c = Q_c / n_c``, within-class covariance ``S = (G - sum_c Q_c Q_c^T / n_c) / N`` shrunk by OAS
towards ``tr(S) / d I``; an input's score is its squared Mahalanobis distance to the nearest learned class.
Nothing is held out of the keys: each task keeps a seeded ``retrieval.calibration_holdout`` share of its
key features (at most :data:`MAX_STORED` rows) in its record, and the Gaussians that score them are the
keys' statistics *minus every stored calibration row* (an exact downdate), so the calibration scores are
out-of-sample while the keys, the head and every accuracy stay as they were. A task's threshold is the
score that ``retrieval.reject_tpr`` of its calibration rows stay under (fewer than :data:`MIN_PER_TASK`
rows: the pooled rows of every task), recomputed whenever the statistics change; the novelty of an input
is its score minus the threshold of its nearest class's task. ``proteus kb calibrate --images DIR``
replaces the calibration rows with the user's own held-out images (never part of the statistics).

``retrieval.reject = true`` (any keys; required for the paper's Gaussian keys): each task keeps a fraction
``retrieval.calibration_holdout`` of its training inputs out of its key fit, scores them with its own key
after the fit, and stores the sorted scores (quantiles, at most :data:`MAX_STORED`) in its record. The
threshold is the score that ``retrieval.reject_tpr`` of those held-out inputs stays under (key scores are
"lower is better"); the novelty is the retrieved task's key score minus it. Recalibrating at another rate
needs no data: the stored scores suffice (``proteus kb calibrate --tpr``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from proteus.config import ConfigError
from proteus.registry import Registry
from proteus.signatures.fitting import oas_rho
from proteus.tensor_rules import TENSOR_RULES, F, Fields, NeedsRecord, Schema, ShapeRule, Together

__all__ = [
    "MAX_STORED",
    "MIN_PER_TASK",
    "NOVELTY",
    "Calibration",
    "CalibrationRows",
    "ClassGaussians",
    "ClassNovelty",
    "check_tpr",
    "holdout_split",
]

#: held-out scores (``retrieval.reject``) or calibration rows (``class-gaussian``) kept per task
MAX_STORED = 256
#: a task with fewer calibration rows is thresholded on the pooled rows of every task
MIN_PER_TASK = 20

#: ``retrieval.novelty``: which detector flags inputs from no learned task (``retrieval.reject = true``
#: adds the key-score thresholds on top, for any keys)
NOVELTY: Registry[str] = Registry("retrieval.novelty")
NOVELTY.register("auto", help="class-gaussian with LDA keys (the default methods), none with other keys")(
    "auto"
)
NOVELTY.register("class-gaussian", help="Mahalanobis distance to the nearest class in the LDA keys' space")(
    "class-gaussian"
)
NOVELTY.register("none", help="no detector: every input is answered with a class, known is null")("none")


@dataclass
class Calibration:
    """A task's held-out key scores (sorted) and the threshold at ``tpr``."""

    scores: list[float]
    tpr: float
    threshold: float

    @classmethod
    def from_scores(cls, scores: torch.Tensor, tpr: float) -> Calibration:
        s = scores.double().flatten().sort().values
        if len(s) > MAX_STORED:
            s = torch.quantile(s, torch.linspace(0, 1, MAX_STORED, dtype=torch.float64))
        return cls([float(v) for v in s], tpr, threshold_at(s, tpr))

    def at(self, tpr: float) -> Calibration:
        """The same scores with the threshold of another true-positive rate."""
        return Calibration(
            self.scores, tpr, threshold_at(torch.tensor(self.scores, dtype=torch.float64), tpr)
        )

    def to_dict(self) -> dict[str, object]:
        return {"scores": self.scores, "tpr": self.tpr, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls([float(v) for v in d["scores"]], float(d["tpr"]), float(d["threshold"]))


def check_tpr(tpr: float) -> float:
    """``tpr`` if it is a true-positive rate in (0, 1], else a :class:`ConfigError`."""
    if not 0.0 < tpr <= 1.0:
        raise ConfigError(f"the true-positive rate must be in (0, 1], got {tpr}")
    return float(tpr)


def threshold_at(sorted_scores: torch.Tensor, tpr: float) -> float:
    """The smallest score that a fraction ``tpr`` of the held-out scores is at or under."""
    check_tpr(tpr)
    s = sorted_scores.double().sort().values
    return float(s[max(0, math.ceil(tpr * len(s) - 1e-9) - 1)])


def holdout_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, held-out) indices of n training inputs: a seeded ``fraction`` held out (at least 1 and at
    most n - 2, so that a key can still be fitted)."""
    n_out = min(max(1, int(round(fraction * n))), max(0, n - 2))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_out:].sort().values, perm[:n_out].sort().values


#: a task record's ``calibration`` (:meth:`Calibration.to_dict`)
CALIBRATION: Schema = {
    "scores": F("list[float]", True),
    "tpr": F("rate", True),
    "threshold": F("float", True),
}
_ROWS = "novelty/x (n, d) and novelty/y (n) have n rows"
#: what a task keeps for rejection: its calibration (the keys' own scores), or (``class-gaussian``) its
#: held-out rows under ``novelty/`` with their record (:meth:`ClassNovelty.task_state`)
TENSOR_RULES.declare(
    "proteus", "novelty",
    Fields({
        "calibration": F("map|null", fields=CALIBRATION),
        "novelty": F("map|null", fields={"in_stats": F("bool", True), "tpr": F("rate", True)}),
    }),
    NeedsRecord("novelty/", "novelty"),
    ShapeRule(r"novelty/x", ("obj.novelty_n", "kb.novelty_d"), _ROWS),
    ShapeRule(r"novelty/y", ("obj.novelty_n",), _ROWS, "int"),
    Together(r"novelty/(?:x|y)", ("novelty/x", "novelty/y")),
)  # fmt: skip


@dataclass
class CalibrationRows:
    """A task's calibration rows in the keys' space: features X (n, d), labels y (n,), and whether they
    are part of the keys' statistics (held out at learn time: True; ``kb calibrate --images``: False)."""

    X: Tensor
    y: Tensor
    in_stats: bool


@dataclass
class ClassGaussians:
    """Class-conditional Gaussians with one shared OAS-shrunk covariance (module doc): ``means`` (C, d) and
    ``present`` (C,) the classes with at least one input, ``precision`` (d, d) the inverse covariance."""

    means: Tensor
    present: Tensor
    precision: Tensor
    #: each mean's squared norm under ``precision``, (C,): computed once, not per batch (O(C d^2))
    mean_norms: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.mean_norms = ((self.means @ self.precision) * self.means).sum(1)

    @classmethod
    def from_statistics(
        cls, G: Tensor, Q: Tensor, counts: Tensor, minus: Iterable[tuple[Tensor, Tensor]] = ()
    ) -> ClassGaussians:
        """From the Gram matrix G (d, d), class sums Q (d, C) and counts (C,) of some features, less the
        rows ``(X, y)`` of ``minus`` (subtracted exactly)."""
        G, Q, n = G.double().clone(), Q.double().clone(), counts.double().clone()
        for X, y in minus:
            X = X.to(G.device, torch.float64)
            G -= X.T @ X
            Q.index_add_(1, y.to(G.device), -X.T)
            n -= torch.bincount(y.to(G.device), minlength=n.shape[0]).double()
        present = n > 0.5
        N = float(n[present].sum())
        if N <= present.sum():
            raise ValueError("too few inputs for a within-class covariance")
        means = torch.zeros_like(Q.T)
        means[present] = (Q[:, present] / n[present]).T
        S = (G - (Q[:, present] / n[present]) @ Q[:, present].T) / N
        S = (S + S.T) / 2
        rho = oas_rho(S, int(N))
        mu = float(S.diagonal().sum()) / S.shape[0]
        S = (1.0 - rho) * S
        S.diagonal().add_(rho * mu + 1e-12 * max(mu, 1e-300))
        return cls(means, present, torch.linalg.inv(S))

    def distances(self, X: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's squared Mahalanobis distance to its nearest present class and that class, (N,) each."""
        X = X.to(self.precision.device, torch.float64)
        M = self.means
        XP = X @ self.precision
        d2 = (XP * X).sum(1, keepdim=True) - 2.0 * XP @ M.T + self.mean_norms[None]
        d2 = d2.masked_fill(~self.present[None], float("inf"))
        best, cls = d2.min(1)
        return best.clamp_min(0.0), cls


@dataclass
class ClassNovelty:
    """The ``class-gaussian`` detector's state: each task's :class:`CalibrationRows` and the rate
    ``tpr``; :meth:`novelty` needs the keys' statistics (module doc)."""

    holdout: float
    tpr: float
    rows: dict[int, CalibrationRows] = field(default_factory=dict)
    _fitted: tuple[Any, ClassGaussians, Tensor] | None = None

    def draw(self, k: int, X: Tensor, y: Tensor, seed: int) -> None:
        """Keep a seeded ``holdout`` share of task k's key features (at most :data:`MAX_STORED` rows)."""
        _, held = holdout_split(len(y), self.holdout, seed)
        held = held[:MAX_STORED]
        self.rows[k] = CalibrationRows(X[held].float().cpu().clone(), y[held].long().cpu().clone(), True)
        self._fitted = None

    def replace(self, rows: dict[int, CalibrationRows]) -> None:
        """New calibration rows for every task (``kb calibrate --images``); tasks absent get none."""
        self.rows, self._fitted = dict(rows), None

    def drop(self, k: int) -> None:
        self.rows.pop(k, None)
        self._fitted = None

    def invalidate(self) -> None:
        """The statistics changed: rebuild the Gaussians and thresholds on next use."""
        self._fitted = None

    def set_tpr(self, tpr: float) -> None:
        self.tpr, self._fitted = check_tpr(tpr), None

    def fit(self, G: Tensor, Q: Tensor, counts: Tensor, task_of: Tensor, stamp: Any) -> bool:
        """(Re)build the Gaussians and each task's threshold when ``stamp`` (the statistics' version)
        changed; False when there is nothing to calibrate on."""
        if self._fitted is not None and self._fitted[0] == stamp:
            return True
        live = {k: r for k, r in self.rows.items() if len(r.y)}
        if not live:
            return False
        g = ClassGaussians.from_statistics(G, Q, counts, [(r.X, r.y) for r in live.values() if r.in_stats])
        scores = {k: g.distances(r.X)[0] for k, r in live.items()}
        pooled = torch.cat(list(scores.values()))
        m = int(task_of.max()) + 1 if len(task_of) else 0
        thr = torch.full((max(m, max(live) + 1),), threshold_at(pooled, self.tpr), dtype=torch.float64)
        for k, s in scores.items():
            if len(s) >= MIN_PER_TASK:
                thr[k] = threshold_at(s, self.tpr)
        self._fitted = (stamp, g, thr)
        return True

    def novelty(self, X: Tensor, task_of: Tensor) -> Tensor:
        """Each row's score minus the threshold of its nearest class's task (after :meth:`fit`)."""
        assert self._fitted is not None
        _, g, thr = self._fitted
        d2, cls = g.distances(X)
        return (d2 - thr[task_of.to(cls.device)[cls]]).cpu()

    def thresholds(self) -> list[float] | None:
        return None if self._fitted is None else [float(t) for t in self._fitted[2]]

    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        r = self.rows.get(k)
        if r is None:
            return {}, {}
        meta = {"novelty": {"in_stats": r.in_stats, "tpr": self.tpr}}
        return meta, {"novelty/x": r.X, "novelty/y": r.y}

    def load_task(self, k: int, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        info = meta.get("novelty")
        if isinstance(info, dict) and "novelty/x" in tensors:
            self.rows[k] = CalibrationRows(
                tensors["novelty/x"].float(), tensors["novelty/y"].long(), bool(info["in_stats"])
            )
            self.tpr = float(info["tpr"])
        self._fitted = None
