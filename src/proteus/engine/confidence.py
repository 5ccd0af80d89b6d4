"""Calibrated confidence (beyond the paper): one temperature per task, fitted when the task is learned.

What ``proteus predict`` shows as an answer's confidence is the softmax of the prediction's class scores
over every learned class (``p_all``). For the default ``proteus`` those scores are ``log p(t|x) +
log p(c|x, t)`` (:mod:`proteus.engine.experts`), for the other PROTEUS methods the ridge head's scores
(Eq. 23): neither is trained as a log-probability, and the softmax reads flat (under-confident: a right
answer of a 10-class task at 0.15). *Temperature scaling* (Guo et al., "On Calibration of Modern Neural
Networks", ICML 2017) divides the scores by one number T > 0 fitted to minimise the negative
log-likelihood of labelled inputs that were not used to fit them; dividing by a positive number changes
no argmax, so no label changes.

Here each task gets its own T, fitted when it is learned on its *calibration rows*: the seeded
``retrieval.calibration_holdout`` share (at most :data:`~proteus.engine.novelty.MAX_STORED` = 256) of its
training inputs that the class-Gaussian detector of inputs from no learned task draws too
(:func:`calibration_rows`, the same rows by the same seed). They are predicted by the whole learner as it
stands after the task (every task so far: retrieval, the combination of tasks and the head), with the
keys and the task's head fitted *without those rows* (``RetrievalKeys.without``: the LDA keys' ridge
statistics are sums, so the rows are subtracted exactly, as the detector subtracts them from its
Gaussians; ``ClassHeads.without``: the task's own head refitted on its other rows with its γ, or the rows
subtracted from the head over every class), so the scores T is fitted on are out-of-sample for the keys
and the head. (On the CIFAR-10 subset the same rows predicted in-sample fit temperatures that leave an
ECE of 0.082 on the test images; out-of-sample, 0.039: docs/predict.md.) The adapter did see the rows in
training; no data is held out of training, so no accuracy is lost. T is stored in the task's record
(``confidence: {temperature, rows}``); a knowledge base learned before has none and shows ``p_all`` as
before until ``proteus kb calibrate --images`` fits temperatures on held-out images in class folders.

An answer's calibrated confidence uses the T of the task its class belongs to
(:func:`calibrated_probabilities`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from proteus.engine.errors import TaskError
from proteus.engine.novelty import MAX_STORED, holdout_split

__all__ = [
    "MIN_ROWS",
    "T_RANGE",
    "Confidence",
    "calibrated_probabilities",
    "calibration_rows",
    "fit_temperature",
    "nll",
]

#: fewer labelled rows than this fit no temperature (the task shows the uncalibrated ``p_all``)
MIN_ROWS = 10
#: the temperatures searched (log-spaced), relative to the scores' scale: far beyond any fitted value
T_RANGE = (1e-3, 1e3)


@dataclass(frozen=True)
class Confidence:
    """A task's fitted temperature ``temperature`` and the number of labelled ``rows`` it was fitted on."""

    temperature: float
    rows: int

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "rows": self.rows}

    @classmethod
    def from_dict(cls, d: Any, task: int) -> Confidence:
        """Read back from a task record (untrusted: a :class:`TaskError` names the task and the field)."""
        t = d.get("temperature") if isinstance(d, dict) else None
        rows = d.get("rows") if isinstance(d, dict) else None
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise TaskError(f"task {task + 1}: confidence.temperature must be a positive number; got {t!r}")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise TaskError(f"task {task + 1}: confidence.rows must be a count; got {rows!r}")
        return cls(float(t), rows)


def calibration_rows(n: int, holdout: float, seed: int) -> Tensor:
    """The indices of a task's calibration rows among its n training inputs: the seeded ``holdout`` share
    (at most :data:`MAX_STORED`) that :meth:`proteus.engine.novelty.ClassNovelty.draw` keeps with the same
    seed (the task's seed + 3)."""
    return holdout_split(n, holdout, seed + 3)[1][:MAX_STORED]


def nll(logits: Tensor, y: Tensor, temperature: float, smoothing: float = 0.0) -> float:
    """The mean negative log-likelihood of labels y (N,) under ``softmax(logits / temperature)``, over the
    rows whose label has a finite score (a label scored -inf is outside the classes the prediction
    weighed: no temperature changes its probability, 0). With ``smoothing`` = ε the target of a row is
    ``(1 - ε)`` on its label and ε spread evenly over its finite classes (label smoothing)."""
    logits, y = logits.double(), y.long()
    logp = torch.log_softmax(logits / temperature, dim=1)
    own = logp.gather(1, y[:, None])[:, 0]
    keep = torch.isfinite(own)
    if not bool(keep.any()):
        return 0.0
    loss = -own[keep]
    if smoothing > 0.0:
        finite = torch.isfinite(logp[keep])
        spread = torch.where(finite, logp[keep], torch.zeros_like(logp[keep])).sum(1) / finite.sum(1)
        loss = (1.0 - smoothing) * loss - smoothing * spread
    return float(loss.mean())


def fit_temperature(logits: Tensor, y: Tensor, steps: int = 60) -> float | None:
    """The temperature T minimising :func:`nll` of labels y (N,) given class scores (N, C), with label
    smoothing ε = 1 / (n + 1) for n rows whose label has a finite score (after Laplace's rule of
    succession), so that rows all answered right (the usual case on an easy task) give a finite T, not
    T -> 0 and certainty. Searched in :data:`T_RANGE` times the scores' scale (the mean gap between a row's
    best and mean score) on a log scale (a grid of 121 points, then a golden-section search around the
    best; the loss is unimodal in log T). None with fewer than :data:`MIN_ROWS` such rows, or when every
    such row's finite scores are all equal."""
    logits, y = logits.double().cpu(), y.long().cpu()
    finite = torch.isfinite(logits.gather(1, y[:, None])[:, 0])
    logits, y = logits[finite], y[finite]
    if len(y) < MIN_ROWS:
        return None
    finite = torch.isfinite(logits)
    lo_s = torch.where(finite, logits, logits.new_tensor(math.inf)).amin(1)
    if not bool((logits.amax(1) > lo_s).any()):
        return None
    # the scores' own scale (heads differ by orders of magnitude): the mean gap between a row's best score
    # and its mean finite score; T is searched relative to it
    mean_s = torch.where(finite, logits, torch.zeros_like(logits)).sum(1) / finite.sum(1)
    scale = float((logits.amax(1) - mean_s).mean())
    eps = 1.0 / (len(y) + 1)

    def loss(log_t: float) -> float:
        return nll(logits, y, math.exp(log_t), eps)

    lo, hi = math.log(T_RANGE[0] * scale), math.log(T_RANGE[1] * scale)
    grid = torch.linspace(lo, hi, 121, dtype=torch.float64).tolist()
    values = [loss(g) for g in grid]
    best = min(range(len(grid)), key=values.__getitem__)
    a, b = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    r = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - r * (b - a), a + r * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - r * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + r * (b - a)
            fd = loss(d)
    return float(math.exp((a + b) / 2.0))


def calibrated_probabilities(
    logits: Tensor, label: Tensor, temperatures: list[float | None], task_of: Tensor
) -> tuple[Tensor, Tensor]:
    """``(p, T)``: p (N, C) the softmax of each row's class scores divided by the temperature of the task
    of its predicted class ``label`` (N,); T (N,) that temperature, NaN where the task has none (its row
    is the plain softmax, ``p_all``). ``task_of`` (C,) is each class's task (0-based)."""
    t = torch.tensor([math.nan if v is None else float(v) for v in temperatures], dtype=torch.float64)
    T = t[task_of[label.cpu()]] if len(t) else torch.full((len(label),), math.nan, dtype=torch.float64)
    scale = torch.where(torch.isnan(T), torch.ones_like(T), T)
    return torch.softmax(logits.double().cpu() / scale[:, None], dim=1), T
