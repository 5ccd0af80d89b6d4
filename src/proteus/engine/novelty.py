"""Inputs from no learned task (beyond the paper): three detectors with calibrated thresholds.

Retrieval (Sec. 3.1) always names a task; an input from no learned task still gets one. A detector gives
every input a *novelty*: its score minus a threshold (> 0: rejected as unknown).

``retrieval.novelty = task-gaussian`` (the default with LDA keys: ``auto``): is the input like the inputs
of one learned task? Each task keeps one Gaussian (:class:`PPCA`: mean, OAS-shrunk covariance kept to its
:data:`RANK` leading directions) per *component*: the channel statistics (mean and standard deviation of
each channel over the positions) of the frozen prefix at three depths (``Backbone.tap_blocks``; the
multi-layer statistics of Lee et al., NeurIPS 2018, which tell image sources apart by resolution, colour
and texture) and the keys' features. The Gaussians are fitted on the task's training inputs less its
calibration rows (the same seeded share as below), so the rows' scores are out-of-sample. An input's score
is ``min_t sum_c (nll_{t,c} - a_c) / b_c``: under the task that fits it best, the components' negative
log-densities standardised by the pooled calibration rows (``a_c`` their median of ``min_t nll_{t,c}``,
``b_c`` its distance to their 95th percentile); one threshold, the score ``retrieval.reject_tpr`` of the
pooled calibration rows stay under. The rows keep their tap statistics, so ``kb calibrate --tpr`` and
``--images`` need no training data. A knowledge base whose tasks have no task Gaussians (learned before
they existed, or with ``class-gaussian``) scores with the class Gaussians:

``retrieval.novelty = class-gaussian``: class-conditional Gaussians
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

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from proteus.config import ConfigError
from proteus.engine.stored import TaskShares
from proteus.kb.packs import spans
from proteus.registry import Registry
from proteus.signatures import options
from proteus.signatures.fitting import oas_rho, oas_rho_of
from proteus.tensor_rules import TENSOR_RULES, F, Fields, NeedsRecord, Schema, ShapeRule, Together

__all__ = [
    "MAX_STORED",
    "MIN_PER_TASK",
    "NOVELTY",
    "Detector",
    "PPCA",
    "RANK",
    "TaskGaussians",
    "Calibration",
    "CalibrationRows",
    "ClassGaussians",
    "ClassNovelty",
    "check_tpr",
    "holdout_split",
    "shrunk_spectrum",
    "shrunk_spectrum_gram",
]

#: held-out scores (``retrieval.reject``) or calibration rows (``class-gaussian``) kept per task
MAX_STORED = 256
#: the most calibration rows the ``task-gaussian`` detector pools for its scale and threshold: beyond, a
#: seeded uniform sample of every task's rows (so that refitting it costs the same at task 1,000)
MAX_POOLED = 8192
#: the stored names of a task's calibration rows' candidate tasks and scores (:class:`ShortlistScores`)
_CAL_TASKS, _CAL_NLL = "novelty/cal_tasks", "novelty/cal_nll"
#: a task with fewer calibration rows is thresholded on the pooled rows of every task
MIN_PER_TASK = 20


@dataclass(frozen=True)
class Detector:
    """A ``retrieval.novelty`` choice: what it builds for keys that keep class statistics (the LDA keys),
    from the ``retrieval`` section (None: no detector), and whether it needs such keys."""

    build: Callable[[Any], ClassNovelty] | None
    needs_class_statistics: bool = False


def _gaussians(tasks: bool) -> Callable[[Any], ClassNovelty]:
    """The class-Gaussian detector (``tasks``: with each task's Gaussians) from a ``retrieval`` section."""
    return lambda rc: ClassNovelty(rc.calibration_holdout, rc.reject_tpr, tasks=tasks, shortlist=rc.shortlist)


#: ``retrieval.novelty``: which detector flags inputs from no learned task (``retrieval.reject = true``
#: adds the key-score thresholds on top, for any keys)
NOVELTY: Registry[Detector] = options.NOVELTY
NOVELTY.register("auto", help="task-gaussian with LDA keys (the default methods), none with other keys")(
    Detector(_gaussians(tasks=True))
)
NOVELTY.register(
    "task-gaussian",
    help="each task's Gaussians on the frozen prefix's channel statistics and the keys' features",
)(Detector(_gaussians(tasks=True)))
NOVELTY.register("class-gaussian", help="Mahalanobis distance to the nearest class in the LDA keys' space")(
    Detector(_gaussians(tasks=False), needs_class_statistics=True)
)
NOVELTY.register("none", help="no detector: every input is answered with a class, known is null")(
    Detector(None)
)


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
        "novelty": F("map|null", fields={
            "in_stats": F("bool", True), "tpr": F("rate", True),
            "tap_sizes": F("list[count]"), "noise": F("list[float]"),
        }),
    }),
    NeedsRecord("novelty/", "novelty"),
    ShapeRule(r"novelty/x", ("obj.novelty_n", "kb.novelty_d"), _ROWS),
    ShapeRule(r"novelty/y", ("obj.novelty_n",), _ROWS, "int"),
    ShapeRule(r"novelty/taps", ("obj.novelty_n", "kb.novelty_taps"),
              "novelty/taps (n, channel statistics) has a row per calibration row"),
    Together(r"novelty/(?:x|y)", ("novelty/x", "novelty/y")),
    ShapeRule(r"novelty/g(?P<c>\d+)/mean", ("kb.novelty_g[{c}]",), "task Gaussian {c}'s mean"),
    ShapeRule(r"novelty/g(?P<c>\d+)/basis", ("kb.novelty_g[{c}]", "obj.novelty_r[{c}]"),
              "task Gaussian {c}'s basis (features, rank)"),
    ShapeRule(r"novelty/g(?P<c>\d+)/var", ("obj.novelty_r[{c}]",), "task Gaussian {c}'s variances (rank)"),
    Together(r"novelty/g(?P<c>\d+)/.*", ("novelty/g{c}/mean", "novelty/g{c}/basis", "novelty/g{c}/var")),
    ShapeRule(r"novelty/cal_tasks", ("obj.novelty_n", "kb.novelty_k"),
              "novelty/cal_tasks (n, K): each calibration row's K candidate tasks", "int"),
    ShapeRule(r"novelty/cal_nll", ("obj.novelty_n", "kb.novelty_k", "kb.novelty_c"),
              "novelty/cal_nll (n, K, components): each calibration row's score under each candidate"),
    Together(r"novelty/cal_.*", ("novelty/cal_tasks", "novelty/cal_nll")),
)  # fmt: skip


@dataclass
class CalibrationRows:
    """A task's calibration rows in the keys' space: features X (n, d), labels y (n,), and whether they
    are part of the keys' statistics (held out at learn time: True; ``kb calibrate --images``: False)."""

    X: Tensor
    y: Tensor
    in_stats: bool
    #: the rows' tap statistics (n, D) for the ``task-gaussian`` detector; None for the class Gaussians
    taps: Tensor | None = None


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


#: the leading eigen-directions each task Gaussian of the ``task-gaussian`` detector keeps (:class:`PPCA`)
RANK = 64


@dataclass
class PPCA:
    """A Gaussian whose covariance keeps the ``rank`` leading eigen-directions ``basis`` (D, r) of an
    OAS-shrunk sample covariance with their variances ``var`` (r,) and gives every other direction one
    variance ``noise``, the mean of the remaining eigenvalues (probabilistic PCA, Tipping & Bishop, JRSS-B
    1999): r (D + 1) + D + 1 numbers instead of D^2, and a score in O(N D r). Fitted on n rows it keeps at
    most n - 1 directions: the sample covariance of n rows has rank n - 1 at most, so every further eigenvalue
    of the shrunk covariance is the shrinkage floor that ``noise`` already gives those directions (the same
    density, in fewer numbers per task)."""

    mean: Tensor
    basis: Tensor
    var: Tensor
    noise: float
    #: a Gaussian decoded from a knowledge base (:func:`_stored_gaussians`, its tensors views of the mapped
    #: files, in float32) keeps its basis in float64 once a shortlist has scored under it
    #: (:meth:`basis_f64`), within the decoded Gaussians' budget (:func:`_decoded_bytes`)
    stored: bool = field(default=False, repr=False, compare=False)
    _basis64: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def fit(cls, X: Tensor, rank: int = RANK) -> PPCA:
        """From rows X (n, D), n >= 2: the spectrum from the n x n Gram matrix of the centred rows when
        n <= D (:func:`shrunk_spectrum_gram`, O(n^2 D)), else from the (D, D) covariance
        (:func:`shrunk_spectrum`, O(D^3)); the same Gaussian to round-off."""
        X = X.double()
        n, dim = X.shape
        if n < 2:
            raise ValueError(f"a task Gaussian needs at least 2 rows, got {n}")
        mu = X.mean(0)
        r = min(int(rank), dim, n - 1)
        var, U, noise = (shrunk_spectrum_gram if n <= dim else shrunk_spectrum)(X - mu, r)
        return cls(mu.float(), U.float().contiguous(), var.float(), noise)

    def nll(self, Z: Tensor) -> Tensor:
        """(N,): each row's squared Mahalanobis distance plus the log-determinant (minus twice the log
        density, up to a constant shared by every task)."""
        D = Z.double() - self.mean.double().to(Z.device)
        P = D @ self.basis_f64().to(Z.device)
        var = self.var.double().to(Z.device)
        rest = ((D * D).sum(1) - (P * P).sum(1)).clamp_min(0.0)
        return (P * P / var).sum(1) + rest / self.noise + self.logdet

    def basis_f64(self, keep: bool = False) -> Tensor:
        """The basis in float64; ``keep``: a stored Gaussian keeps the copy for the next call (what a
        shortlist reads at every prediction; one held in memory, or a call over every task, converts anew)."""
        if self._basis64 is not None:
            return self._basis64
        b = self.basis.double()
        if keep and self.stored:
            self._basis64 = b
        return b

    @functools.cached_property
    def logdet(self) -> float:
        """The covariance's log-determinant: the kept variances, and ``noise`` for every other direction."""
        rest = self.mean.numel() - self.basis.shape[1]
        return float(torch.log(self.var.double()).sum()) + rest * math.log(self.noise)

    @functools.cached_property
    def inv_var(self) -> Tensor:
        """``1 / var`` in float64 (r numbers, kept: a shortlist scores the same tasks' Gaussians again)."""
        return 1.0 / self.var.double()

    @functools.cached_property
    def widest(self) -> float:
        """The covariance's largest variance (the kept ones', or ``noise``): ``||z - mean||^2 / widest +
        logdet`` is a lower bound of :meth:`nll` that needs no basis (every direction's variance is at most
        this), what :func:`shortlist_novelty` prunes with."""
        return max(float(self.var.max()) if self.var.numel() else 0.0, self.noise)


class TaskGaussians:
    """One component's Gaussians of many tasks, scored together: ``scores(Z)`` is ``(N, T)``, column t
    :meth:`PPCA.nll` under task t's Gaussian, to float64 round-off. Written as
    ``||d||^2 / noise + sum_j (P_j^2 (1 / var_j - 1 / noise)) + logdet`` with ``d = z - mean`` and
    ``P = d^T basis``: the squared distances to every task's mean come from one product with the stacked
    means and each task's projection from one product with its basis (``z`` and the means first centred on
    the means' average, so that the expanded squares keep their precision); what per-task arithmetic is
    left runs once over every task's columns together. Holds the Gaussians by reference: beside them, only
    the (T, D) centred means and a few numbers per direction."""

    def __init__(self, gaussians: list[PPCA]) -> None:
        means = torch.stack([g.mean for g in gaussians]).double()
        self.center = means.mean(0)
        self.means = means - self.center  # (T, D)
        self.norms = (self.means * self.means).sum(1)
        self.gaussians = gaussians
        ranks = torch.tensor([g.basis.shape[1] for g in gaussians])
        self.owner = torch.repeat_interleave(torch.arange(len(gaussians)), ranks)  # column -> task
        self.offsets = torch.cat(
            [self.means[t] @ g.basis_f64() for t, g in enumerate(gaussians)]
        )  # (sum r,): each mean's projection
        self.weights = torch.cat([1.0 / g.var.double() - 1.0 / g.noise for g in gaussians])
        self.inv_noise = torch.tensor([1.0 / g.noise for g in gaussians], dtype=torch.float64)
        self.logdet = torch.tensor([g.logdet for g in gaussians], dtype=torch.float64)

    def scores(self, Z: Tensor) -> Tensor:
        Zc = Z.cpu().double() - self.center
        d2 = (Zc * Zc).sum(1, keepdim=True) - 2.0 * (Zc @ self.means.T) + self.norms
        P = torch.cat([Zc @ g.basis_f64() for g in self.gaussians], 1) - self.offsets
        quad = torch.zeros_like(d2).index_add_(1, self.owner, P * P * self.weights)
        return d2 * self.inv_noise + quad + self.logdet


#: the most float64 numbers one block of :func:`pair_scores` holds (its pairs' centred rows)
PAIR_BLOCK = 2**21


def pair_scores(
    gaussians: Mapping[int, list[PPCA]],
    parts: list[Tensor],
    cand: Tensor,
    components: list[int] | None = None,
) -> list[Tensor]:
    """Per component, (n, K): each row's negative log-density (:meth:`PPCA.nll`) under each of its candidate
    tasks ``cand`` (n, K) (``gaussians``: each task's, per component; ``parts``: the rows' components, or
    those numbered ``components``); +inf for a candidate without Gaussians (forgotten, too few rows, or -1).
    The pairs are sorted by task, so that each task's rows are one slice: centring every pair's row on its
    task's mean, the squares and the weighting run once over a block of tasks together (:func:`_pair_block`),
    and what is left per task is the one product with its basis, read where it lies (no padded copy of the
    bases: a batch spread over hundreds of candidate tasks reads each basis once)."""
    n, K = cand.shape
    flat = cand.reshape(-1)
    order = torch.argsort(flat, stable=True)
    found, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    tasks = found.tolist()
    held = [i for i, t in enumerate(tasks) if t in gaussians]
    out = [torch.full((n * K,), float("inf"), dtype=torch.float64) for _ in parts]
    if not held:
        return [o.view(n, K) for o in out]
    of = {i: gaussians[tasks[i]] for i in held}
    sizes = counts.tolist()
    for c, (comp, part) in enumerate(zip(components or range(len(parts)), parts, strict=True)):
        Z = part.double()
        for block in _blocks(held, sizes, Z.shape[1]):
            idx = torch.as_tensor(block)
            ct = counts[idx]
            first = torch.repeat_interleave(starts[idx] - (torch.cumsum(ct, 0) - ct), ct)
            pairs = order[torch.arange(len(first)) + first]  # the block's pairs, task by task
            out[c][pairs] = _pair_block([of[i][comp] for i in block], Z, pairs // K, ct)
    return [o.view(n, K) for o in out]


def _blocks(items: list[int], counts: list[int], dim: int) -> Iterator[list[int]]:
    """``items`` (tasks) in consecutive blocks whose pairs' rows stay within :data:`PAIR_BLOCK` numbers (a
    task with more alone in its block)."""
    block: list[int] = []
    rows = 0
    for i in items:
        if block and (rows + counts[i]) * dim > PAIR_BLOCK:
            yield block
            block, rows = [], 0
        block.append(i)
        rows += counts[i]
    if block:
        yield block


def _pair_block(gs: list[PPCA], Z: Tensor, rows: Tensor, counts: Tensor) -> Tensor:
    """:meth:`PPCA.nll` of rows ``rows`` of Z (float64), the first ``counts[0]`` under Gaussian ``gs[0]``, the
    next ``counts[1]`` under ``gs[1]`` ...: the centred rows ``D`` in one gather, each task's projection
    ``D_t^T basis_t`` by one product, the projections of bases of lower rank padded with zero columns (which
    add nothing to either square)."""
    owner = torch.repeat_interleave(torch.arange(len(gs)), counts)
    D = Z[rows] - torch.stack([g.mean for g in gs]).double()[owner]
    ranks = [g.basis.shape[1] for g in gs]
    R = max(ranks)
    Ps = [d @ g.basis_f64(keep=True) for d, g in zip(D.split(counts.tolist()), gs, strict=True)]
    if min(ranks) == R:
        P, inv_var = torch.cat(Ps), torch.stack([g.inv_var for g in gs])
    else:
        P = torch.cat([torch.nn.functional.pad(p, (0, R - p.shape[1])) for p in Ps])
        inv_var = torch.nn.utils.rnn.pad_sequence([g.inv_var for g in gs], batch_first=True)
    P2 = P * P
    inv_noise = torch.tensor([1.0 / g.noise for g in gs], dtype=torch.float64)[owner]
    logdet = torch.tensor([g.logdet for g in gs], dtype=torch.float64)[owner]
    rest = ((D * D).sum(1) - P2.sum(1)).clamp_min(0.0)
    return (P2 * inv_var[owner]).sum(1) + rest * inv_noise + logdet


#: how far (in the combined score's units) a candidate's lower bound must exceed the best score found for
#: :func:`shortlist_novelty` to skip it: far above the bound's float64 round-off, far below any difference
#: that matters
PRUNE_MARGIN = 1e-6


def shortlist_novelty(
    gaussians: Mapping[int, list[PPCA]], parts: list[Tensor], cand: Tensor,
    loc: list[float], scale: list[float],
) -> Tensor:  # fmt: skip
    """(n,): each row's combined score (:meth:`TaskDetector.combined`) at its best candidate of ``cand``
    (n, K), without scoring every candidate: the first (the keys' best) is scored in full, every other is
    given a lower bound per component that needs only its mean (:attr:`PPCA.widest`), and the components
    are then scored in full, cheapest first, only for the candidates whose bound, with the components scored
    so far, does not already exceed the row's best score by :data:`PRUNE_MARGIN`. A candidate skipped
    cannot be the best, so the result is the full computation's: the same numbers where the best candidate
    is scored in the same blocks, float64 round-off otherwise. A batch spread over hundreds of tasks reads
    the bases of the few that can win instead of every shortlisted task's (the detector's memory traffic)."""
    first = pair_scores(gaussians, parts, cand[:, :1])
    best = TaskDetector.combined(first, loc, scale)
    rest = cand[:, 1:]
    if not rest.numel():
        return best
    bounds = _lower_bounds(gaussians, parts, rest)
    terms = [(lb - a) / b for lb, a, b in zip(bounds, loc, scale, strict=True)]
    for c in sorted(range(len(parts)), key=lambda c: parts[c].shape[1]):
        live = sum(terms) <= (best + PRUNE_MARGIN)[:, None]
        if not bool(live.any()):
            return best
        (nll,) = pair_scores(gaussians, [parts[c]], torch.where(live, rest, -1), [c])
        terms[c] = torch.where(live, (nll - loc[c]) / scale[c], terms[c])
    total = sum(terms)
    assert isinstance(total, Tensor)
    return torch.minimum(best, total.min(1).values)


def _lower_bounds(gaussians: Mapping[int, list[PPCA]], parts: list[Tensor], cand: Tensor) -> list[Tensor]:
    """Per component, (n, K): a lower bound of each row's :meth:`PPCA.nll` under each candidate task,
    ``||z - mean||^2 / widest + logdet`` (+inf for a candidate without Gaussians): the rows centred on
    their candidates' means, task by task as in :func:`pair_scores`, and no basis read."""
    n, K = cand.shape
    flat = cand.reshape(-1)
    order = torch.argsort(flat, stable=True)
    found, counts = torch.unique_consecutive(flat[order], return_counts=True)
    out = [torch.full((n * K,), float("inf"), dtype=torch.float64) for _ in parts]
    held = [(i, gaussians[t]) for i, t in enumerate(found.tolist()) if t in gaussians]
    if not held:
        return [o.view(n, K) for o in out]
    idx = torch.as_tensor([i for i, _ in held])
    ct = counts[idx]
    starts = (torch.cumsum(counts, 0) - counts)[idx]
    pairs = order[
        torch.repeat_interleave(starts - (torch.cumsum(ct, 0) - ct), ct) + torch.arange(int(ct.sum()))
    ]
    owner = torch.repeat_interleave(torch.arange(len(held)), ct)
    rows = pairs // K
    for c, part in enumerate(parts):
        gs = [g[c] for _, g in held]
        D = part.double()[rows] - torch.stack([g.mean for g in gs]).double()[owner]
        widest = torch.tensor([g.widest for g in gs], dtype=torch.float64)[owner]
        logdet = torch.tensor([g.logdet for g in gs], dtype=torch.float64)[owner]
        out[c][pairs] = (D * D).sum(1) / widest + logdet
    return [o.view(n, K) for o in out]


def _pooled(live: Mapping[int, CalibrationRows], tasks: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Every live task's calibration rows (key features, tap statistics) in task order (``tasks``: those of
    ``live``, sorted), or a seeded uniform sample of :data:`MAX_POOLED` of them (:func:`_sampled`)."""
    tasks = sorted(live) if tasks is None else tasks
    rows = [live[k] for k in tasks]
    X, taps = _sampled([[r.X for r in rows], [r.taps for r in rows]])
    return X, taps


def _sampled(fields: list[list[Any]]) -> list[Tensor]:
    """Per field, the tasks' rows (``fields[f][t]``: task t's rows of field f, the same number in every
    field) concatenated in task order, or a seeded uniform sample of :data:`MAX_POOLED` of them, gathered from
    the tasks holding the rows drawn (no concatenation of every task's rows first: a long stream's refit
    reads the rows it pools, not all of them)."""
    sizes = torch.as_tensor([len(x) for x in fields[0]], dtype=torch.long)
    n = int(sizes.sum())
    if n <= MAX_POOLED:
        return [torch.cat(list(f)) for f in fields]
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:MAX_POOLED].sort().values
    ends = sizes.cumsum(0)
    owner = torch.bucketize(keep, ends, right=True)
    out: list[list[Tensor]] = [[] for _ in fields]
    for i in owner.unique().tolist():
        rows = keep[owner == i] - (ends[i] - sizes[i])
        for o, f in zip(out, fields, strict=True):
            o.append(f[i][rows])
    return [torch.cat(o) for o in out]


class ShortlistScores:
    """The calibration of the ``task-gaussian`` detector under a shortlist (``retrieval.shortlist``), kept
    per task: each of a task's calibration rows scored once -- when the task is learned, or at the first
    fit after a knowledge base without them was read -- under the Gaussians of the K tasks the keys then
    rank highest for it (:func:`pair_scores`; (n, K) candidates, -1 beyond the tasks there were, and
    (n, K, components) scores, float32 as stored, 0 under a candidate without Gaussians). The detector's
    scales and threshold come from a seeded sample of these numbers (:func:`_sampled`): a fit reads them,
    not every task's Gaussians and rows, so it costs the same at task 1,000 as at task 10. A task learned
    later is no candidate of an earlier row (it could only lower a known row's best score: the threshold
    errs towards accepting); a candidate forgotten since counts as none; ``kb calibrate --images`` scores
    every row again, and so does a fit under a shortlist of another length."""

    def __init__(self) -> None:
        #: task -> its candidates and scores, for a task scored here (held)
        self.cand: dict[int, Tensor] = {}
        self.nll: dict[int, Tensor] = {}
        #: task -> its stored tensors, for a task read from a knowledge base (views made when needed)
        self._bound: dict[int, Mapping[str, Tensor]] = {}
        #: task -> the shortlist width its rows are scored under (either kind)
        self._widths: dict[int, int] = {}
        #: the pooled tasks' rows concatenated in task order (:meth:`_concat`): the tasks, how many rows of
        #: the buffers hold them, and the buffers (grown by half at a time)
        self._pool: tuple[list[int], int, Tensor, Tensor] | None = None

    def __contains__(self, k: int) -> bool:
        return k in self.nll or k in self._bound

    def _of(self, k: int) -> tuple[Tensor, Tensor]:
        if k in self.nll:
            return self.cand[k], self.nll[k]
        t = self._bound[k]
        return t[_CAL_TASKS].long(), t[_CAL_NLL].float()

    def unscored(self, tasks: list[int], width: int) -> list[int]:
        """Those of ``tasks`` whose rows are not scored under shortlists of ``width`` tasks (in order)."""
        widths = self._widths
        return [k for k in tasks if widths.get(k) != width]

    def score(self, k: int, cand: Tensor, per: Callable[[Tensor], list[Tensor]], width: int) -> None:
        """Task k's rows under their candidates ``cand`` (n, <= width), scored by ``per`` (per component,
        (n, width): :func:`pair_scores` of the padded candidates)."""
        padded = torch.full((cand.shape[0], width), -1, dtype=torch.long)
        padded[:, : cand.shape[1]] = cand
        self.drop(k)
        self.cand[k], self._widths[k] = padded, width
        nll = torch.stack(per(padded), 2).float()  # +inf where no Gaussians: kept as 0, read as +inf
        self.nll[k] = nll.masked_fill(~torch.isfinite(nll), 0.0)

    def drop(self, k: int) -> None:
        if k in self:
            self._pool = None if self._pool is None or k in self._pool[0] else self._pool
        self.cand.pop(k, None)
        self.nll.pop(k, None)
        self._bound.pop(k, None)
        self._widths.pop(k, None)

    def clear(self) -> None:
        self.cand, self.nll, self._bound, self._widths, self._pool = {}, {}, {}, {}, None

    def _concat(self, tasks: list[int]) -> tuple[Tensor, Tensor]:
        """The rows of ``tasks`` (in order) concatenated: kept from one call to the next, the rows of tasks
        added since appended (a long stream's refit copies the new task's rows, not every task's)."""
        pool = self._pool
        if pool is None or pool[0] != tasks[: len(pool[0])]:
            pool = ([], 0, torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0, 0))
        done, n, cand, nll = pool
        new = tasks[len(done) :]
        if new:
            parts = self._parts(new)
            rows = n + sum(len(c) for c, _ in parts)
            K, C = (parts[0][1].shape[1], parts[0][1].shape[2]) if n == 0 else nll.shape[1:]
            if rows > cand.shape[0] or cand.shape[1:] != (K,):
                size = max(rows, cand.shape[0] + cand.shape[0] // 2, 64)
                grown_c = torch.empty(size, K, dtype=torch.long)
                grown_n = torch.empty(size, K, C)
                if n:
                    grown_c[:n], grown_n[:n] = cand[:n], nll[:n]
                cand, nll = grown_c, grown_n
            pos = n
            for c, x in parts:
                cand[pos : pos + len(c)], nll[pos : pos + len(c)] = c, x
                pos += len(c)
            pool = (list(tasks), rows, cand, nll)
            self._pool = pool
        return pool[2][: pool[1]], pool[3][: pool[1]]

    def _parts(self, tasks: list[int]) -> list[tuple[Tensor, Tensor]]:
        """The (candidates, scores) of ``tasks`` in order: the tasks read from one pack at consecutive slots
        as one view of it per run (:func:`proteus.kb.packs.spans`; a reader's first fit reads a pack's
        tasks in one step, not one per task), any other task as its own."""
        items = [self._bound[k] if k in self._bound and k not in self.nll else {} for k in tasks]
        parts = []
        for first, _, blocks in spans(items, [_CAL_TASKS, _CAL_NLL]):
            if blocks is None:
                parts.append(self._of(tasks[first]))
            else:
                parts.append((blocks[_CAL_TASKS][0].long(), blocks[_CAL_NLL][0].float()))
        return parts

    def pooled(self, tasks: list[int], alive: Iterable[int]) -> list[Tensor]:
        """Per component, (rows, K) float64: the sampled rows' scores (the rows of ``tasks`` in order, or a
        seeded uniform sample of :data:`MAX_POOLED` of them, as :func:`_sampled` draws), +inf under a
        candidate not alive."""
        cand, nll = self._concat(tasks)
        if len(cand) > MAX_POOLED:
            keep = torch.randperm(len(cand), generator=torch.Generator().manual_seed(len(cand)))
            keep = keep[:MAX_POOLED].sort().values
            cand, nll = cand[keep], nll[keep]
        dead = ~_member(cand, torch.as_tensor(list(alive), dtype=torch.long))
        return list(nll.double().masked_fill(dead[:, :, None], float("inf")).unbind(2))

    def state(self, k: int) -> dict[str, Tensor]:
        if k not in self:
            return {}
        cand, nll = self._of(k)
        return {_CAL_TASKS: cand, _CAL_NLL: nll}

    def load(self, k: int, tensors: Mapping[str, Tensor], rows: int) -> None:
        """Task k's scores from its stored tensors (read when needed; none there: scored at the next fit)."""
        if _CAL_TASKS not in tensors or _CAL_NLL not in tensors:
            return self.drop(k)
        cand, nll = _shape(tensors, _CAL_TASKS), _shape(tensors, _CAL_NLL)
        if len(cand) != 2 or len(nll) != 3 or nll[:2] != cand or cand[0] != rows:
            raise ValueError(f"novelty: calibration scores {nll} do not fit {rows} rows")
        self.cand.pop(k, None)
        self.nll.pop(k, None)
        self._bound[k], self._widths[k] = tensors, cand[1]


def _member(cand: Tensor, tasks: Tensor) -> Tensor:
    """``torch.isin(cand, tasks)`` for task indices (``cand``'s -1, or any negative: no task), by a lookup
    table of the tasks: one gather, where isin sorts (a long stream's refit asks it of every pooled row)."""
    top = max(int(cand.max()) if cand.numel() else -1, int(tasks.max()) if tasks.numel() else -1)
    table = torch.zeros(top + 2, dtype=torch.bool)
    table[tasks + 1] = True
    return table[(cand + 1).clamp_min(0)]


def _shape(tensors: Mapping[str, Tensor], name: str) -> tuple[int, ...]:
    """A stored tensor's shape (from the header where it is stored: no view made)."""
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(tensors[name].shape)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _ppca_of(tensors: Mapping[str, Tensor], prefix: str, noise: float) -> PPCA:
    """The Gaussian stored under ``prefix`` (``mean``, ``basis``, ``var``) with noise variance ``noise``."""
    mean, basis, var = (tensors[f"{prefix}{name}"] for name in ("mean", "basis", "var"))
    return PPCA(mean, basis, var, noise, stored=True)


def _floors(m: float, rho: float) -> tuple[float, float]:
    """The OAS shift of every eigenvalue (``rho`` times the mean eigenvalue ``m``, plus a relative 1e-12)
    and the floor an eigenvalue is clamped to."""
    return rho * m + 1e-12 * max(m, 1e-300), 1e-12 * max(m, 1e-300)


def shrunk_spectrum(R: Tensor, r: int) -> tuple[Tensor, Tensor, float]:
    """The OAS-shrunk covariance of the centred rows R (n, D), float64: its ``r`` leading eigenvalues
    (descending), their eigenvectors (D, r) and the mean of the other eigenvalues, by one (D, D) ``eigh``."""
    n, dim = R.shape
    S = R.T @ R / n
    rho = oas_rho(S, n)
    m = float(S.diagonal().mean())
    shift, floor = _floors(m, rho)
    S = (1.0 - rho) * S
    S.diagonal().add_(shift)
    lam, U = torch.linalg.eigh((S + S.T) / 2)
    lam, U = lam.flip(0).clamp_min(floor), U.flip(1)
    noise = float(lam[r:].mean()) if r < dim else float(lam[-1])
    return lam[:r], U[:, :r], noise


def shrunk_spectrum_gram(R: Tensor, r: int) -> tuple[Tensor, Tensor, float]:
    """:func:`shrunk_spectrum` for n <= D rows from the Gram matrix ``K = R R^T / n``: the sample covariance
    ``R^T R / n`` has K's eigenvalues (its eigenvectors ``R^T v / sqrt(n kappa)``) and D - n zeros, and OAS
    shrinkage shifts every eigenvalue alike. Directions of no variance (degenerate rows) are not kept:
    their shrunk eigenvalue is the shift, which ``noise`` gives them."""
    n, dim = R.shape
    K = R @ R.T / n
    m = float(K.diagonal().sum()) / dim
    rho = oas_rho_of(m, float((K * K).sum()) / (dim * dim), dim, n)
    shift, floor = _floors(m, rho)
    kappa, V = torch.linalg.eigh((K + K.T) / 2)
    kappa, V = kappa.flip(0).clamp_min(0.0), V.flip(1)
    r = int((kappa[:r] > 1e-12 * max(float(kappa[0]), 1e-300)).sum())
    lam = ((1.0 - rho) * kappa + shift).clamp_min(floor)
    W = R.T @ V[:, :r]
    U = W / W.norm(dim=0).clamp_min(1e-300)
    noise = (float(lam[r:].sum()) + (dim - n) * max(shift, floor)) / (dim - r)
    return lam[:r], U, noise


def held_out_rows(
    X: Tensor, labels: Tensor, task_of: Tensor, statistics: tuple[Tensor, Tensor, Tensor],
    forgotten: set[int], taps: Tensor | None = None,
) -> dict[int, CalibrationRows]:  # fmt: skip
    """Calibration rows by task from held-out inputs with key features X (N, d) that were never part of the
    keys' ``statistics`` (G, Q, counts), ``taps`` their tap statistics (None: not kept); ``labels`` (N,) their
    global classes, -1 where unknown (the nearest class is taken), ``task_of`` each class's task (-1: none);
    no rows for a ``forgotten`` task."""
    X, labels = X.float().cpu(), labels.long().clone()
    if (labels < 0).any():
        g = ClassGaussians.from_statistics(*statistics)
        labels[labels < 0] = g.distances(X[labels < 0])[1].cpu()
    tasks = task_of[labels]
    return {
        k: CalibrationRows(
            X[tasks == k], labels[tasks == k], False, None if taps is None else taps[tasks == k].float()
        )
        for k in sorted(set(tasks.tolist()) - {-1} - forgotten)
    }


@dataclass
class TaskDetector:
    """The ``task-gaussian`` detector fitted (module doc): each component's location ``loc`` and scale
    ``scale`` from the calibration rows' best scores, and the one ``threshold`` of their combined score;
    ``stacked``: every task's Gaussians scored together, or None where each input is scored under its
    shortlist of candidate tasks (:func:`pair_scores`)."""

    stacked: list[TaskGaussians] | None
    loc: list[float]
    scale: list[float]
    threshold: float

    @classmethod
    def fit(cls, per: list[Tensor], tpr: float, stacked: list[TaskGaussians] | None) -> TaskDetector:
        """From the calibration rows' scores ``per`` (per component, (rows, candidates))."""
        loc, scale = [], []
        for nll in per:
            best = nll.min(1).values
            a = float(best.median())
            b = float(torch.quantile(best, 0.95)) - a
            loc.append(a)
            scale.append(b if b > 0 else 1.0)
        return cls(stacked, loc, scale, threshold_at(cls.combined(per, loc, scale), tpr))

    @staticmethod
    def combined(per: list[Tensor], loc: list[float], scale: list[float]) -> Tensor:
        """Each row's combined score: its components' standardised scores summed, at its best candidate."""
        total = sum((nll - a) / b for nll, a, b in zip(per, loc, scale, strict=True))
        assert isinstance(total, Tensor)
        return total.min(1).values

    def novelty(
        self, gaussians: Mapping[int, list[PPCA]], parts: list[Tensor], cand: Tensor | None
    ) -> Tensor:
        if self.stacked is not None:
            per = [t.scores(part) for t, part in zip(self.stacked, parts, strict=True)]
        elif cand is None:
            raise ValueError("the detector scores under a shortlist: give each row's candidate tasks")
        else:
            return shortlist_novelty(gaussians, parts, cand.cpu(), self.loc, self.scale) - self.threshold
        return self.combined(per, self.loc, self.scale) - self.threshold

    def state(self, tpr: float) -> dict[str, Any] | None:
        """What a knowledge base keeps of a detector fitted under a shortlist (None: one over every task,
        refitted from its few tasks when read)."""
        if self.stacked is not None:
            return None
        return {"tpr": tpr, "loc": self.loc, "scale": self.scale, "threshold": self.threshold}

    @classmethod
    def restore(cls, state: Any, tpr: float, width: int) -> TaskDetector | None:
        """The detector :meth:`state` kept, unless ``state`` is for another rate or not what it writes."""
        if not isinstance(state, dict) or state.get("tpr") != tpr:
            return None
        loc, scale, thr = state.get("loc"), state.get("scale"), state.get("threshold")
        if not (isinstance(loc, list) and isinstance(scale, list) and len(loc) == len(scale) == width):
            return None
        numbers = [*loc, *scale, thr]
        if not all(_finite(v) for v in numbers):
            return None
        return cls(None, [float(v) for v in loc], [float(v) for v in scale], float(numbers[-1]))


class TaskCounts(dict[int, tuple[int, bool]]):
    """Task -> (its calibration rows, whether they keep tap statistics), with what is derived from every task
    (:meth:`derived`) kept until an entry is set or removed: a prediction reads it without a pass over every
    task."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._derived: dict[str, Any] = {}

    def __setitem__(self, k: int, v: tuple[int, bool]) -> None:
        self._derived.clear()
        super().__setitem__(k, v)

    def __delitem__(self, k: int) -> None:
        self._derived.clear()
        super().__delitem__(k)

    def pop(self, k: int, *default: Any) -> Any:
        self._derived.clear()
        return super().pop(k, *default)

    def derived(self, name: str, fn: Callable[[], Any]) -> Any:
        if name not in self._derived:
            self._derived[name] = fn()
        return self._derived[name]


def _all_with_taps(counts: Mapping[int, tuple[int, bool]], gaussians: Iterable[int]) -> bool:
    """Whether every task with calibration rows keeps their tap statistics and has its Gaussians (one set
    operation over the tasks with Gaussians, not one test per task)."""
    live = [(k, taps) for k, (n, taps) in counts.items() if n]
    return bool(live) and all(taps for _, taps in live) and not {k for k, _ in live}.difference(gaussians)


@dataclass
class ClassNovelty:
    """The ``class-gaussian`` detector's state: each task's :class:`CalibrationRows` and the rate
    ``tpr``; :meth:`novelty` needs the keys' statistics (module doc)."""

    holdout: float
    tpr: float
    #: task -> its calibration rows (held until the task is stored; then read from its stored tensors)
    rows: MutableMapping[int, CalibrationRows] = field(default_factory=lambda: TaskShares(_stored_rows, None))
    _fitted: tuple[Any, Any, Tensor] | None = None
    #: ``task-gaussian`` wanted (``retrieval.novelty`` auto or task-gaussian): tasks learned with tap
    #: statistics get their Gaussians; a knowledge base whose tasks lack them keeps the class Gaussians
    tasks: bool = False
    #: task -> its Gaussian per component (each tap block's statistics, then the key features): held while
    #: the task is not stored, then decoded from its stored tensors when a shortlist needs it (the tasks used
    #: last kept within :data:`GAUSSIANS_BUDGET`)
    gaussians: MutableMapping[int, list[PPCA]] = field(
        default_factory=lambda: TaskShares(_stored_gaussians, GAUSSIANS_BUDGET, _decoded_bytes)
    )
    #: the widths of the tap blocks' statistics (the components before the key features)
    tap_sizes: list[int] | None = None
    #: bumped when the stored tasks' rows or rate change (:meth:`replace`, :meth:`set_tpr`)
    generation: int = 0
    #: ``retrieval.shortlist``: score an input under the Gaussians of only the ``shortlist`` tasks the keys
    #: rank highest for it (None: every task), its calibration rows alike (:class:`ShortlistScores`)
    shortlist: int | None = None
    #: each task's calibration rows scored under their shortlist (with ``shortlist``)
    scores: ShortlistScores = field(default_factory=ShortlistScores)
    #: task -> (its calibration rows, whether they keep tap statistics): what the detector needs of every
    #: task without reading its rows (set where a task's Gaussians come or go)
    counts: TaskCounts = field(default_factory=lambda: TaskCounts())
    #: a stored task's Gaussians' noise variances (its record's; the rest of them is in its tensors)
    _noises: dict[int, list[float]] = field(default_factory=dict)

    def draw(
        self, k: int, X: Tensor, y: Tensor, seed: int, taps: Tensor | None = None,
        tap_sizes: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Keep a seeded ``holdout`` share of task k's key features (at most :data:`MAX_STORED` rows); with
        the inputs' tap statistics (and :attr:`tasks`) also fit the task's Gaussians on its other rows."""
        _, held = holdout_split(len(y), self.holdout, seed)
        held = held[:MAX_STORED]
        kept_taps = None if taps is None or not self.tasks else taps[held].float().cpu().clone()
        self.rows[k] = CalibrationRows(
            X[held].float().cpu().clone(), y[held].long().cpu().clone(), True, kept_taps
        )
        self.gaussians.pop(k, None)
        self.scores.drop(k)
        if kept_taps is not None and taps is not None and tap_sizes is not None:
            rest = torch.ones(len(y), dtype=torch.bool)
            rest[held] = False
            if int(rest.sum()) >= 2:
                self.tap_sizes = [int(v) for v in tap_sizes]
                parts = [*taps.float().cpu().split(self.tap_sizes, 1), X.float().cpu()]
                self.gaussians[k] = [PPCA.fit(c[rest]) for c in parts]
        self.counts[k] = (len(self.rows[k].y), kept_taps is not None)
        self._fitted = None

    def calibrate(
        self, X: Tensor, labels: Tensor, task_of: Tensor, statistics: tuple[Tensor, Tensor, Tensor],
        forgotten: set[int], tpr: float | None, taps: Tensor | None = None,
    ) -> None:  # fmt: skip
        """New calibration rows from held-out inputs (:func:`held_out_rows`; ``kb calibrate --images``), their
        tap statistics ``taps`` kept for the task Gaussians; ``tpr`` a new rate."""
        self.replace(held_out_rows(X, labels, task_of, statistics, forgotten, taps if self.tasks else None))
        if tpr is not None:
            self.set_tpr(tpr)

    def replace(self, rows: dict[int, CalibrationRows]) -> None:
        """New calibration rows for every task (``kb calibrate --images``); tasks absent get none."""
        self.rows.clear()
        self.counts = TaskCounts({k: (len(r.y), r.taps is not None) for k, r in rows.items()})
        self.rows.update(rows)
        self._fitted = None
        self.scores.clear()
        self.generation += 1

    def drop(self, k: int) -> None:
        self.rows.pop(k, None)
        self.gaussians.pop(k, None)
        self.counts.pop(k, None)
        self._noises.pop(k, None)
        self.scores.drop(k)
        self._fitted = None

    @property
    def uses_taps(self) -> bool:
        """Whether the detector scores with the task Gaussians (every task with calibration rows has its
        Gaussians and its rows' tap statistics), and so needs the inputs' tap statistics."""
        return self.counts.derived("uses_taps", lambda: _all_with_taps(self.counts, self.gaussians))

    def _live(self) -> list[int]:
        """The tasks with calibration rows, in order."""
        return sorted(k for k, c in self.counts.items() if c[0])

    def _components(self, X: Tensor, taps: Tensor) -> list[Tensor]:
        assert self.tap_sizes is not None
        return [*taps.float().split(self.tap_sizes, 1), X.float()]

    def _stacked(self, tasks: list[int]) -> list[TaskGaussians]:
        """Per component, ``tasks``' Gaussians scored together."""
        return [
            TaskGaussians([self.gaussians[k][c] for k in tasks]) for c in range(len(self.gaussians[tasks[0]]))
        ]

    def shortlisted(self, m: int) -> bool:
        """Whether inputs are scored under a shortlist of the ``m`` tasks rather than under every task."""
        return self.shortlist is not None and self.shortlist < m

    def _fit_tasks(
        self, tasks: list[int], stamp: Any, shortlist_of: Callable[[Tensor], Tensor] | None
    ) -> None:
        """The ``task-gaussian`` detector (module doc) from the calibration rows of ``tasks`` (those with
        rows, in order): each component's scale from the pooled calibration rows, the combined score, and one
        threshold at ``tpr`` of the pooled rows; with a shortlist, each row scored under its own
        ``shortlist_of`` candidates (as an input is), from the scores kept per task (no task's rows or
        Gaussians read but those of a task not scored yet)."""
        n = max(tasks) + 1
        if shortlist_of is not None and self.shortlisted(n):
            for k in self.scores.unscored(tasks, self.shortlist or 0):
                self.score_task(k, shortlist_of)
            per = self.scores.pooled(tasks, self.gaussians)
            stacked: list[TaskGaussians] | None = None
        else:
            X, taps = _pooled(self.rows, tasks)
            stacked = self._stacked(tasks)
            per = [g.scores(part) for g, part in zip(stacked, self._components(X, taps), strict=True)]
        fitted = TaskDetector.fit(per, self.tpr, stacked)
        self._fitted = (stamp, fitted, torch.full((n,), fitted.threshold, dtype=torch.float64))

    def score_task(self, k: int, shortlist_of: Callable[[Tensor], Tensor]) -> None:
        """Score task k's calibration rows under their candidates ``shortlist_of`` (:class:`ShortlistScores`;
        nothing without a shortlist, or for a task without its Gaussians)."""
        r = self.rows.get(k)
        if self.shortlist is None or r is None or r.taps is None or k not in self.gaussians or not len(r.y):
            return
        parts = self._components(r.X, r.taps)
        self.scores.score(
            k, shortlist_of(r.X), lambda c: pair_scores(self.gaussians, parts, c), self.shortlist
        )

    def fitted_state(self) -> dict[str, Any] | None:
        """What the knowledge base keeps of the ``task-gaussian`` detector fitted under a shortlist
        (:meth:`TaskDetector.state`, with the number of tasks), so that a reader need not fit it again."""
        if self._fitted is None or not isinstance(self._fitted[1], TaskDetector):
            return None
        state = self._fitted[1].state(self.tpr)
        return None if state is None else {**state, "tasks": len(self._fitted[2])}

    def restore_fitted(self, state: Any, stamp: Any) -> None:
        """The detector as :meth:`fitted_state` kept it, for statistics ``stamp`` (else fitted when used)."""
        self._fitted = None
        n = state.get("tasks") if isinstance(state, dict) else None
        if self.tap_sizes is None or not isinstance(n, int) or not _count(n):
            return
        fitted = TaskDetector.restore(state, self.tpr, len(self.tap_sizes) + 1)
        if fitted is not None:
            self._fitted = (stamp, fitted, torch.full((n,), fitted.threshold, dtype=torch.float64))

    def invalidate(self) -> None:
        """The statistics changed: rebuild the Gaussians and thresholds on next use."""
        self._fitted = None

    def set_tpr(self, tpr: float) -> None:
        self.tpr, self._fitted = check_tpr(tpr), None
        self.generation += 1

    def fit(
        self, G: Tensor, Q: Tensor, counts: Tensor, task_of: Tensor, stamp: Any,
        shortlist_of: Callable[[Tensor], Tensor] | None = None,
    ) -> bool:  # fmt: skip
        """(Re)build the Gaussians and each task's threshold when ``stamp`` (the statistics' version)
        changed; False when there is nothing to calibrate on. ``shortlist_of``: a row's candidate tasks
        (n, K) from its key features (the task Gaussians with a shortlist)."""
        if self._fitted is not None and self._fitted[0] == stamp:
            return True
        tasks = self._live()
        if not tasks:
            return False
        if self.uses_taps:
            self._fit_tasks(tasks, stamp, shortlist_of)
            return True
        live = {k: self.rows[k] for k in tasks}
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

    def novelty(
        self, X: Tensor, task_of: Tensor, taps: Tensor | None = None, cand: Tensor | None = None
    ) -> Tensor | None:
        """Each row's score minus its threshold (after :meth:`fit`): the class Gaussians' distance to the
        nearest class minus that class's task's threshold, or the task Gaussians' combined score minus
        the pooled threshold (None when the inputs' tap statistics ``taps`` are missing); ``cand`` (N, K):
        each row's shortlisted tasks, when the detector was fitted with a shortlist."""
        assert self._fitted is not None
        _, g, thr = self._fitted
        if isinstance(g, TaskDetector):
            return (
                None
                if taps is None
                else g.novelty(self.gaussians, self._components(X.cpu(), taps.cpu()), cand)
            )
        d2, cls = g.distances(X)
        return (d2 - thr[task_of.to(cls.device)[cls]]).cpu()

    def thresholds(self) -> list[float] | None:
        return None if self._fitted is None else [float(t) for t in self._fitted[2]]

    def task_state(self, k: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        r = self.rows.get(k)
        if r is None:
            return {}, {}
        info: dict[str, Any] = {"in_stats": r.in_stats, "tpr": self.tpr}
        tensors = {"novelty/x": r.X, "novelty/y": r.y}
        if r.taps is not None:
            tensors["novelty/taps"] = r.taps
        tensors.update(self.scores.state(k))
        gs = self.gaussians.get(k)
        if gs is not None and self.tap_sizes is not None:
            info["tap_sizes"] = list(self.tap_sizes)
            info["noise"] = [g.noise for g in gs]
            for c, g in enumerate(gs):
                tensors.update({f"novelty/g{c}/mean": g.mean, f"novelty/g{c}/basis": g.basis,
                                f"novelty/g{c}/var": g.var})  # fmt: skip
        return {"novelty": info}, tensors

    def adopt(self, k: int, tensors: Mapping[str, Tensor]) -> None:
        """Task k is stored as ``tensors`` (its committed object's, memory-mapped): its rows and Gaussians are
        read from them when needed, no longer held (the same values), so that they live in the page cache,
        not in this process; its calibration scores are kept (a few numbers per row)."""
        _stored(self, k, tensors, None)

    def load_task(self, k: int, meta: dict[str, Any], tensors: Mapping[str, Tensor]) -> None:
        """Task k's share from its stored ``tensors`` (record ``meta``): its calibration scores and what the
        detector needs of every task; its rows and Gaussians are read when needed."""
        info = meta.get("novelty")
        if isinstance(info, dict) and "novelty/x" in tensors:
            _stored(self, k, tensors, info)
        self._fitted = None


def _stored(nov: ClassNovelty, k: int, tensors: Mapping[str, Tensor], info: dict[str, Any] | None) -> None:
    """Task k of ``nov`` is stored as ``tensors``: its rows and Gaussians bound to them (decoded when
    needed), its calibration scores read from them; ``info``: its record's ``novelty`` (None: a task this
    process learned, which ``nov`` holds)."""
    if info is None:  # (ClassNovelty.adopt)
        if k not in nov.rows or "novelty/x" not in tensors:
            return
        in_stats = nov.rows[k].in_stats
        width = 0 if nov.tap_sizes is None else len(nov.tap_sizes) + 1
        noise = None
        if k in nov.gaussians and all(f"novelty/g{c}/basis" in tensors for c in range(width)):
            gs = nov.gaussians[k] if _held(nov.gaussians, k) else None
            noise = [g.noise for g in gs] if gs is not None else nov._noises.get(k)
    else:
        in_stats, noise, taps = bool(info["in_stats"]), info.get("noise"), info.get("tap_sizes")
        nov.tpr = float(info["tpr"])
        if not (isinstance(noise, list) and isinstance(taps, list)):
            noise = None
        else:
            sizes = nov.tap_sizes if taps == nov.tap_sizes else [int(v) for v in taps]
            if nov.tap_sizes is not None and sizes != nov.tap_sizes:
                raise ValueError(f"novelty: tap_sizes {sizes}, but an earlier task's are {nov.tap_sizes}")
            nov.tap_sizes = sizes
            if len(noise) != len(sizes) + 1 or not all(float(v) > 0 for v in noise):
                raise ValueError(f"novelty: {len(noise)} task Gaussians for {len(sizes)} taps")
            if (bad := _misfit(tensors, sizes)) is not None:
                name, want, has = bad
                raise ValueError(f"novelty: tap_sizes {sizes} give {name} {want} features, it has {has}")
    n = _rows_of(tensors)
    _bind(nov.rows, k, tensors, in_stats)
    if noise is not None:
        nov._noises[k] = [float(v) for v in noise]
        _bind(nov.gaussians, k, tensors, nov._noises[k])
    if info is not None or k in nov.scores:
        nov.scores.load(k, tensors, n)
    nov.counts[k] = (n, "novelty/taps" in tensors)


def _misfit(tensors: Mapping[str, Tensor], sizes: list[int]) -> tuple[str, int, int] | None:
    """Where the record's split ``sizes`` of the tap statistics does not fit a task's stored tensors: (name,
    features the split gives, features the tensor has), or None."""
    widths = [("novelty/taps", -1, sum(sizes))]
    widths += [(f"novelty/g{c}/mean", 0, n) for c, n in enumerate(sizes)]
    for name, axis, n in widths:
        if name in tensors and (shape := _shape(tensors, name)) and shape[axis] != n:
            return name, n, shape[axis]
    return None


def _held(shares: MutableMapping[int, Any], k: int) -> bool:
    """Whether task k's value is held in memory (a plain dict holds every value)."""
    return shares.held(k) if isinstance(shares, TaskShares) else k in shares


def _rows_of(tensors: Mapping[str, Tensor]) -> int:
    """The calibration rows a task's stored tensors hold (from the header where they are stored)."""
    return int(_shape(tensors, "novelty/y")[0])


def _bind(shares: MutableMapping[int, Any], k: int, tensors: Mapping[str, Tensor], info: Any) -> None:
    """Task k of ``shares`` read from its stored ``tensors`` when needed (a plain dict: decoded now);
    ``info``: what the decoder needs beside the tensors (the rows' ``in_stats``, the Gaussians' noises)."""
    stored = _Share(tensors, info)
    if isinstance(shares, TaskShares):
        shares.bind(k, stored)
    else:
        shares[k] = (_stored_rows if isinstance(info, bool) else _stored_gaussians)(k, stored)


class _Share(Mapping[str, Tensor]):
    """A stored task's tensors with what its record adds (:func:`_bind`)."""

    def __init__(self, tensors: Mapping[str, Tensor], info: Any) -> None:
        self.tensors, self.info = tensors, info

    def shape(self, name: str) -> tuple[int, ...]:
        return _shape(self.tensors, name)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def _stored_rows(k: int, tensors: Mapping[str, Tensor]) -> CalibrationRows:
    """Task k's calibration rows from its stored tensors."""
    in_stats = tensors.info if isinstance(tensors, _Share) else True
    taps = tensors["novelty/taps"] if "novelty/taps" in tensors else None
    return CalibrationRows(
        tensors["novelty/x"].float(), tensors["novelty/y"].long(), bool(in_stats),
        None if taps is None else taps.float(),
    )  # fmt: skip


#: the bytes of the stored tasks' Gaussians a detector keeps decoded (:func:`_decoded_bytes`, least recently
#: used out first): 128 MiB keep the float64 bases of about 350 tasks at the 1,280 key features and three
#: tap blocks of MobileNetV2, more than the distinct tasks a batch of 32 inputs shortlists (at most 32 x 8)
GAUSSIANS_BUDGET = 128 << 20


def _decoded_bytes(gs: list[PPCA]) -> int:
    """What a stored task's decoded Gaussians cost the process: the float64 copies of their bases and
    inverse variances (kept once a shortlist scores under them); their float32 tensors are views of the
    knowledge base's mapped files, the page cache."""
    return sum(8 * (g.basis.numel() + g.var.numel()) for g in gs)


def held_bytes(gs: list[PPCA]) -> int:
    """What a decoded task's Gaussians hold now: the float64 copies of the bases and inverse variances made
    so far (at most :func:`_decoded_bytes`: a task whose candidates were only bounded made none)."""
    return sum(
        8 * ((g._basis64.numel() if g._basis64 is not None else 0) + ("inv_var" in vars(g)) * g.var.numel())
        for g in gs
    )


def _stored_gaussians(k: int, tensors: Mapping[str, Tensor]) -> list[PPCA]:
    """Task k's Gaussians from its stored tensors (their noise variances from its record)."""
    noise = tensors.info if isinstance(tensors, _Share) else None
    if not isinstance(noise, list):
        raise ValueError(f"task {k + 1}: its Gaussians' noise variances are unknown")
    return [_ppca_of(tensors, f"novelty/g{c}/", float(v)) for c, v in enumerate(noise)]
