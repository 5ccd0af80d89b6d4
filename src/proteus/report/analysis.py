"""What a finished run measures besides accuracy: the paper's diagnostics, computed from the live learner.

* :func:`theory_analysis` -- Sec. 3.2 on the test sets after the final task: per (task k, component t)
  the empirical separation factor delta (Def. 3.3, Eq. delta), kappa and sigma^2 (Assumption A2), the
  bound of Theorem 3.5 and the minimum delta Theorem 3.6 requires for the measured retrieval error
  (Eq. epsrate); Fig. 2 and the Appendix table of the 50-task delta. Inputs are the evaluator's cached
  test embeddings ``h_i(x)`` for every (test set k, adapter i), so the cost is ``n^2`` Mahalanobis
  evaluations of the test sets, no new forward pass. The headline ``sigma^2 = max V[Z_i^s] / d`` is the
  variance bound ``V[Z] <= sigma^2 d`` that the proof of Theorem 3.5 uses; the ``*_a23`` fields repeat
  the bound and the minimum delta with Assumption A2-3's ``sigma^2 = max_i trace(Var[h_i(x)]) / d`` (in
  the signature's space, after its L2 normalisation where it normalises), as the paper states it (see
  :func:`proteus.signatures.theory.theory_report`). Every pair lists what fails for it (A2-1, A2-3,
  Theorem 3.5's condition, a bound below the measured error); a pair outside Theorem 3.5's condition has
  no bound (None), not a bound of 1. The sub-distribution ``D_k^t`` of an input is its nearest own
  component (Mahalanobis), and the error of Theorem 3.6 is the measured retrieval error of the
  component, floored at half an error.
* :func:`retrieval_confusion` -- true task x retrieved task counts of the final evaluation.
* :func:`transfer_matrices` -- the learned S per task and adapted map (Fig. 5 heatmaps).
* :func:`cosine_analysis` -- pairwise cosine of the tasks' own updates ``B_tau A_tau^T`` per map
  (Figs. 6-7) and the largest off-diagonal magnitude (the orthogonality check of Eq. 15).
* :func:`measure_latency` -- wall time of ``predict`` on one batch as a function of the number of tasks m
  (Appendix "Complexity of PROTEUS Inference", latency tables).

:func:`analyse_run` gathers them into results.json keys and the bulkier ``analysis.json`` content.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol, cast

import numpy as np
import torch

from proteus.config import ReportConfig
from proteus.core.estimator import Proteus
from proteus.learners import ContinualLearner, check_supports
from proteus.metrics import confusion_matrix
from proteus.signatures.signature import NORMALIZATIONS
from proteus.signatures.theory import theory_report
from proteus.streams import TaskStream

log = logging.getLogger("proteus")


class Evaluator(Protocol):
    """What the analyses read of an evaluation (:class:`proteus.experiment.evaluate.Evaluator`): cached
    test embeddings and the last retrieval."""

    def embedding(self, tau: int, kind: str, j: int | None) -> torch.Tensor: ...

    def labels(self, tau: int) -> torch.Tensor: ...

    def retrieved(self, tau: int) -> torch.Tensor: ...


__all__ = [
    "analyse_run",
    "assumptions_statement",
    "cosine_analysis",
    "finite",
    "latency_points",
    "measure_inference",
    "measure_latency",
    "retrieval_confusion",
    "premise",
    "theory_analysis",
    "transfer_matrices",
]


def finite(v: Any) -> Any:
    """JSON-safe number: non-finite floats become None (strict JSON has no NaN or Infinity)."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(float(v)) else None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return v


def _mean(values: list[float], weights: list[float] | None = None) -> float | None:
    vals = [(v, 1.0 if weights is None else w) for v, w in zip(values, weights or values) if v is not None]
    vals = [(v, w) for v, w in vals if math.isfinite(v)]
    if not vals:
        return None
    return float(sum(v * w for v, w in vals) / sum(w for _, w in vals))


# ====================================================================== Sec. 3.2
class _SignatureSpace:
    """Rows of a cached embedding matrix in the signature's space (L2-normalised where it normalises),
    normalised only when selected, so the n^2 cached test embeddings are not copied."""

    def __init__(self, H: torch.Tensor, sig: Any) -> None:
        self.H = H
        self.normalize = NORMALIZATIONS.get(getattr(sig, "normalize", "none"))  # (signature.normalize)

    @property
    def device(self) -> torch.device:
        return self.H.device

    @property
    def shape(self) -> torch.Size:
        return self.H.shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        rows = self.H.index_select(dim, index)
        return self.normalize(rows)


#: the bounds' premise holds where own-task inputs lie within this factor of d (squared Mahalanobis)
PREMISE_FACTOR = 2.0


def premise(own_per_dim: list[float]) -> dict[str, Any]:
    """Whether Theorems 3.5/3.6's premise holds: an input's squared Mahalanobis distance to its own
    task's components is about d (``E[Z_own] ~ d``), given each task's median distance / d. Holds when
    every task is within :data:`PREMISE_FACTOR` of d; the statement says which tasks are not."""
    off = [(k, v) for k, v in enumerate(own_per_dim) if not 1 / PREMISE_FACTOR <= v <= PREMISE_FACTOR]
    holds = bool(own_per_dim) and not off
    if not own_per_dim:
        text = "no own-task distances measured"
    elif holds:
        text = (
            f"the premise holds: own-task test inputs lie at {min(own_per_dim):.2g}-{max(own_per_dim):.2g} d "
            "from their nearest own component (squared Mahalanobis)"
        )
    else:
        worst = ", ".join(f"task {k + 1}: {v:.3g} d" for k, v in off[:5])
        text = (
            f"the premise does not hold: own-task test inputs should lie at about d (squared Mahalanobis) "
            f"from their own components, but they lie at {worst}; the bounds then say nothing about "
            "this run's retrieval, whose measured error is reported beside them"
        )
    return {"holds": holds, "factor": PREMISE_FACTOR, "statement": text}


def _side(rows: list[dict[str, Any]], w: list[float], suffix: str) -> dict[str, Any]:
    """The bound, minimum delta and assumptions of ``rows`` with one sigma^2 (``suffix`` "" for the
    proof's, "_a23" for A2-3's): means over the pairs that have a value, counts of the ones that do not;
    a pair that is not tested (fewer than two test inputs) is in neither."""
    rows = [c for c in rows if c.get("tested") is not False]
    w = [float(c["n"]) for c in rows]
    bounds = [(c[f"bound{suffix}"], wi) for c, wi in zip(rows, w) if c.get(f"bound{suffix}") is not None]
    ok = [c[f"delta_ok{suffix}"] for c in rows if c.get(f"delta_ok{suffix}") is not None]
    a21 = [c[f"a21{suffix}"] for c in rows if c.get(f"a21{suffix}") is not None]
    md = [c[f"min_delta{suffix}"] for c in rows if c.get(f"min_delta{suffix}") is not None]
    out = {
        f"bound_mean{suffix}": _mean([b for b, _ in bounds], [wi for _, wi in bounds]) if bounds else None,
        f"n_no_bound{suffix}": sum(1 for c in rows if c.get(f"sigma2{suffix}") is not None
                                   and c.get(f"bound{suffix}") is None),
        f"min_delta_mean{suffix}": _mean([c[f"min_delta{suffix}"] for c in rows], w) if md else None,
        f"min_delta_max{suffix}": max(md, default=None),
        f"min_delta_median{suffix}": finite(float(np.median(md))) if md else None,
        f"frac_delta_ok{suffix}": sum(ok) / len(ok) if ok else None,
        f"frac_a21{suffix}": sum(a21) / len(a21) if a21 else None,
    }  # fmt: skip
    if suffix == "_a23":
        a23 = [c["a23"] for c in rows if c.get("a23") is not None]
        out["frac_a23"] = sum(a23) / len(a23) if a23 else None
    return out


def _failed_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in rows:
        for name in c.get("failed") or []:
            counts[name] = counts.get(name, 0) + 1
    return counts


def assumptions_statement(comps: list[dict[str, Any]]) -> str:
    """What fails, in words: each assumption or condition with the (task, component) pairs it fails for."""
    if not comps:
        return "no (task, component) pair measured"
    untested = [c for c in comps if c.get("tested") is False]
    comps = [c for c in comps if c.get("tested") is not False]
    apart = (
        f" ({len(untested)} pairs of fewer than two test inputs not tested, counted apart)"
        if untested
        else ""
    )
    if not comps:
        return "no (task, component) pair tested" + apart
    what = {
        "A2-1": "A2-1 (|Lambda_i^s| <= e^(d sigma^2) |Lambda_k^t|, the proof's sigma^2)",
        "A2-1 (A2-3's sigma^2)": "A2-1 with A2-3's sigma^2",
        "A2-3": "A2-3 as the proof uses it (V[Z] <= d sigma^2 with A2-3's sigma^2)",
        "Thm 3.5 condition": "Theorem 3.5's condition delta >= max(0, -2 kappa / d) (no bound)",
        "bound < error": "the bound (it lies below the measured retrieval error)",
        "bound < error (A2-3's sigma^2)": "the bound with A2-3's sigma^2 (it lies below the measured error)",
    }
    parts = []
    for name, text in what.items():
        pairs = [f"{c['task'] + 1}.{c['component'] + 1}" for c in comps if name in (c.get("failed") or [])]
        if pairs:
            shown = ", ".join(pairs[:8]) + (f" and {len(pairs) - 8} more" if len(pairs) > 8 else "")
            parts.append(f"{text} fails for {len(pairs)} of {len(comps)} pairs (task.component {shown})")
    return ("; ".join(parts) if parts else f"every assumption holds for all {len(comps)} pairs") + apart


@torch.no_grad()
def theory_analysis(clf: Proteus, evaluator: Evaluator) -> dict[str, Any] | None:
    """Theorem 3.5 / 3.6 quantities per (task, component) on the test sets; None without retrieval.

    Returns ``{"components": [...], "per_task": [...], "summary": {...}}``; tasks and components are
    0-based, ``min_delta`` / ``delta_ok`` are None where Theorem 3.6 gives no finite value, ``bound`` is
    None where Theorem 3.5's condition fails (``bound_reason`` says why) and ``failed`` names what fails
    for the pair; ``summary["assumptions"]`` says it in words. The theorems
    are about the adapter keys ``h_i(x)`` (``clf.keys_.adapter_signatures``); None when a task has none. With
    ``signature.keys`` other than "adapter", delta, kappa and sigma^2 are still those of the adapter keys
    while the error is the measured one of the rule that retrieved.
    """
    if not clf.parts_.retrieves:
        return None
    n = clf.num_tasks
    sigs = [s for s in clf.keys_.adapter_signatures[:n] if s is not None]
    if n != clf.parts_.num_adapters or len(sigs) != n:  # one signature for each of the n tasks
        return None
    d = int(sigs[0].d)
    maha = [
        [sigs[i].mahalanobis(evaluator.embedding(k, "task", i)).double().cpu() for i in range(n)]
        for k in range(n)
    ]
    logdets = [s.logdets().double().cpu() for s in sigs]
    retrieved = [evaluator.retrieved(k) for k in range(n)]
    emb = [[_SignatureSpace(evaluator.embedding(k, "task", i), sigs[i]) for i in range(n)] for k in range(n)]
    rep = theory_report(maha, logdets, d, retrieved=retrieved, embeddings=emb)  # type: ignore[arg-type]
    comps = []
    for (k, t), r in sorted(rep.items()):
        comps.append({"task": k, "component": t, **{key: finite(v) for key, v in r.items()}})
    per_task = []
    for k in range(n):
        rows = [c for c in comps if c["task"] == k]
        if not rows:
            continue
        w = [float(c["n"]) for c in rows]
        own = maha[k][k].min(dim=1).values  # each own input's distance to its nearest own component
        per_task.append(
            {
                "task": k,
                "n_components": len(rows),
                "n_untested": sum(1 for c in rows if c.get("tested") is False),
                # the bounds' premise: an own-task input's squared Mahalanobis distance is about d
                "own_distance_per_dim": finite(float(own.median()) / d),
                # the task's inputs retrieved to another task (not floored, unlike the components' eps)
                "retrieval_error": float((retrieved[k] != k).double().mean()),
                "delta_mean": _mean([c["delta"] for c in rows], w),
                "delta_min": min((c["delta"] for c in rows if c["delta"] is not None), default=None),
                "error": _mean([c["error"] for c in rows], w),
                **_side(rows, w, ""),
                **_side(rows, w, "_a23"),
                "failed": _failed_counts(rows),
            }
        )
    own = [t["own_distance_per_dim"] for t in per_task if t["own_distance_per_dim"] is not None]
    weights = [float(c["n"]) for c in comps]
    summary = {
        "premise": premise(own),
        "d": d,
        "num_tasks": n,
        "n_components": len(comps),
        # pairs of fewer than two test inputs: no V[Z], so neither a pass nor a failure (counted apart)
        "n_untested": sum(1 for c in comps if c.get("tested") is False),
        "sigma2_headline": "V[Z]",
        "delta_median": finite(float(np.median([c["delta"] for c in comps]))) if comps else None,
        "error_mean": _mean([c["error"] for c in comps], weights),
        **_side(comps, weights, ""),
        **_side(comps, weights, "_a23"),
        "n_delta_ok": int(sum(bool(c["delta_ok"]) for c in comps)),
        "failed": _failed_counts(comps),
        "assumptions": assumptions_statement(comps),
        "sigma2": "the proof's: max Var[Z_i^s] / d over other-task components (V[Z] <= sigma^2 d, Thm 3.5)",
        "sigma2_a23": "*_a23 fields: A2-3's max over other tasks i of trace(Var[h_i(x)]) / d, in the "
        "signature's space",
        "components_of_inputs": "nearest own component (Mahalanobis)",
        "eps": "measured retrieval error of the component, floored at 0.5 / n",
    }
    return {"components": comps, "per_task": per_task, "summary": summary}


# ====================================================================== retrieval
def retrieval_confusion(clf: Proteus, evaluator: Evaluator) -> list[list[int]] | None:
    """(m, m) counts of the final evaluation: row = true task, column = retrieved task; None without
    retrieval."""
    if not clf.parts_.retrieves:
        return None
    n = clf.num_tasks
    retrieved = [evaluator.retrieved(k) for k in range(n)]
    true = [torch.full_like(r, k) for k, r in enumerate(retrieved)]
    cm = confusion_matrix(torch.cat(retrieved), torch.cat(true), n)
    return cm.tolist()


# ====================================================================== adapters
def transfer_matrices(clf: Proteus) -> dict[str, Any] | None:
    """Fig. 5: per task k >= 2 (1-based) and adapted map, the S coefficients over older directions."""
    model = clf.model_
    if not model.units or model.num_tasks < 2:
        return None
    names = list(model.units)
    per_task = []
    for k in range(1, model.num_tasks):
        S = model.transfer_matrix(k)
        per_task.append({"task": k, "S": [[float(v) for v in S[n].tolist()] for n in names]})
    ranks = {n: list(map(int, u.ranks)) for n, u in model.units.items()}
    return {"units": names, "ranks": ranks, "tasks": per_task}


def cosine_analysis(clf: Proteus) -> tuple[dict[str, Any] | None, dict[str, list[list[float]]] | None]:
    """Figs. 6-7: ``(summary, per-map (m, m) cosine matrices)``; (None, None) without adapters."""
    model = clf.model_
    if not model.units or model.num_tasks < 1:
        return None, None
    cos = model.unit_cosines()
    mats = {n: [[float(v) for v in row] for row in c.tolist()] for n, c in cos.items()}
    m = model.num_tasks
    per_unit: dict[str, float | None] = {}
    for n, c in cos.items():
        off = c[~torch.eye(m, dtype=torch.bool)] if m > 1 else c.new_zeros(0)
        per_unit[n] = float(off.abs().max()) if off.numel() else None
    vals = [v for v in per_unit.values() if v is not None]
    summary = {"max_abs_offdiag": max(vals) if vals else None, "per_unit_max_abs_offdiag": per_unit}
    return summary, mats


# ====================================================================== latency
def latency_points(n: int, points: int, ms: list[int] | None = None) -> list[int]:
    """Up to ``points`` values of m in 1..n, evenly spaced, always including 1 and n; or the values of
    ``ms`` within 1..n (``report.latency_m``: the paper's own m values)."""
    if n < 1:
        return []
    if ms is not None:
        return sorted({int(m) for m in ms if 1 <= int(m) <= n})
    k = max(2, int(points)) if n > 1 else 1
    return sorted({int(round(v)) for v in np.linspace(1, n, min(k, n))})


def _batch(stream: TaskStream, clf: Any, size: int) -> torch.Tensor:
    images = []
    for task in stream.tasks:
        for i in range(len(task.test)):
            images.append(task.test[i][0])
            if len(images) >= size:
                return clf.transform_images(images)
    return clf.transform_images(images)


#: seconds of repetitions per m after which no further repetition is timed
_LATENCY_BUDGET_S = 2.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_latency(clf: Proteus, stream: TaskStream, rc: ReportConfig) -> dict[str, Any] | None:
    """Seconds per ``predict`` on one batch with the first m tasks: the median of ``rc.latency_repeats``
    calls, fewer when they add up to more than 2 s (at least one), after one warm-up call."""
    n = clf.num_tasks
    if n == 0 or clf.head_ is None:
        return None
    x = _batch(stream, clf, rc.latency_batch)
    ms = latency_points(n, rc.latency_points, rc.latency_m)
    if not ms:
        return None
    clf.predict(x, num_tasks=ms[-1])  # warm-up (allocations, kernels)
    seconds = []
    for m in ms:
        times: list[float] = []
        # repeat while cheap: slow calls (a ViT-B on a CPU) are timed fewer times, at least once
        while len(times) < max(1, rc.latency_repeats) and sum(times) < _LATENCY_BUDGET_S:
            _sync(clf.device_)
            t0 = time.perf_counter()
            clf.predict(x, num_tasks=m)
            _sync(clf.device_)
            times.append(time.perf_counter() - t0)
        seconds.append(float(np.median(times)))
    return {
        "batch_size": int(x.shape[0]),
        "device": str(clf.device_),
        "threads": torch.get_num_threads(),
        "retrieval": bool(clf.parts_.retrieves),
        "m": ms,
        "seconds": seconds,
    }


@torch.no_grad()
def measure_inference(clf: Any, stream: TaskStream, rc: ReportConfig) -> dict[str, Any] | None:
    """Seconds per ``predict`` on one batch of ``rc.latency_batch`` test images with every task learned, for
    any learner (PROTEUS and the baselines alike: the inference time of the paper's retrieval-overhead
    table): the median of ``rc.latency_repeats`` calls (fewer past 2 s) after a warm-up call."""
    x = _batch(stream, clf, rc.latency_batch)
    if not len(x):
        return None
    clf.predict(x)  # warm-up
    times: list[float] = []
    while len(times) < max(1, rc.latency_repeats) and sum(times) < _LATENCY_BUDGET_S:
        _sync(clf.device_)
        t0 = time.perf_counter()
        clf.predict(x)
        _sync(clf.device_)
        times.append(time.perf_counter() - t0)
    return {
        "batch_size": int(x.shape[0]),
        "device": str(clf.device_),
        "threads": torch.get_num_threads(),
        "seconds": float(np.median(times)),
    }


# ====================================================================== all of it
def analyse_run(
    learner: ContinualLearner,
    evaluator: Evaluator,
    stream: TaskStream,
    rc: ReportConfig,
    latency: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(results.json keys, analysis.json content)`` for a finished run of a learner that supports
    ``"analysis"`` (:data:`proteus.learners.CAPABILITIES`: a :class:`Proteus`, whose adapters, keys and
    heads the analyses read).

    results.json gets ``theory``, ``retrieval_confusion``, ``orthogonality`` and ``latency`` (each None
    where it does not apply or was switched off); analysis.json gets the per-map S vectors (``transfer``)
    and cosine matrices (``unit_cosines``). A failing part is logged and reported in ``report_errors``
    instead of losing the run.
    """
    check_supports(learner, "analysis", "the run's analysis")
    clf = cast(Proteus, learner)
    keys: dict[str, Any] = dict.fromkeys(("theory", "retrieval_confusion", "orthogonality", "latency"))
    bulky: dict[str, Any] = {"transfer": None, "unit_cosines": None}
    errors: list[str] = []

    def attempt(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a diagnostic must not lose a finished run
            log.warning("report: %s failed: %s", name, e, exc_info=True)
            errors.append(f"{name}: {type(e).__name__}: {e}")
            return None
        finally:
            log.info("report: %s took %.2f s", name, time.perf_counter() - t0)

    if rc.theory:
        keys["theory"] = attempt("theory", lambda: theory_analysis(clf, evaluator))
        summary = (keys["theory"] or {}).get("summary") or {}
        said = summary.get("premise")
        if said and not said["holds"]:  # plainly, in the log too (report.md says it with the table)
            log.warning("theory (Thm 3.5/3.6): %s", said["statement"])
        if summary.get("failed"):
            log.warning("theory (Thm 3.5/3.6): %s", summary.get("assumptions"))
    keys["retrieval_confusion"] = attempt("confusion", lambda: retrieval_confusion(clf, evaluator))
    bulky["transfer"] = attempt("transfer matrices", lambda: transfer_matrices(clf))
    cos = attempt("unit cosines", lambda: cosine_analysis(clf))
    if cos is not None:
        keys["orthogonality"], bulky["unit_cosines"] = cos
    if rc.latency and latency:
        keys["latency"] = attempt("latency", lambda: measure_latency(clf, stream, rc))
    if errors:
        keys["report_errors"] = errors
    return keys, bulky
