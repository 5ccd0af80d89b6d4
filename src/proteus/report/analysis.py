"""What a finished run measures besides accuracy: the paper's diagnostics, computed from the live learner.

* :func:`theory_analysis` -- Sec. 3.2 on the test sets after the final task: per (task k, component t)
  the empirical separation factor delta (Def. 3.3, Eq. delta), kappa and sigma^2 (Assumption A2), the
  bound of Theorem 3.5 and the minimum delta Theorem 3.6 requires for the measured retrieval error
  (Eq. epsrate); Fig. 2 and the Appendix table of the 50-task delta. Inputs are the evaluator's cached
  test embeddings ``h_i(x)`` for every (test set k, adapter i), so the cost is ``n^2`` Mahalanobis
  evaluations of the test sets, no new forward pass. ``sigma^2 = max_i trace(Var[h_i(x)]) / d`` over
  the other tasks' adapters i, as Assumption A2-3 states it, in the signature's space (after its L2
  normalisation where it normalises). The ``*_varz`` fields repeat sigma^2, the bound and the minimum
  delta with ``sigma^2 = max Var[Z_i^s] / d``, the variance bound ``V[Z] <= sigma^2 d`` that the proof
  of Theorem 3.5 actually uses (see :func:`proteus.signatures.theory.theory_report`). The
  sub-distribution ``D_k^t`` of an input is its nearest own component (Mahalanobis), and the error of
  Theorem 3.6 is the measured retrieval error of the component, floored at half an error.
* :func:`retrieval_confusion` -- true task x retrieved task counts of the final evaluation.
* :func:`transfer_matrices` -- the learned S per task and adapted map (Fig. 8 heatmaps).
* :func:`cosine_analysis` -- pairwise cosine of the tasks' own updates ``B_tau A_tau^T`` per map
  (Figs. 9-10) and the largest off-diagonal magnitude (the orthogonality check of Eq. 15).
* :func:`measure_latency` -- wall time of ``predict`` on one batch as a function of the number of tasks m
  (Appendix "Complexity of PROTEUS Inference", latency tables).

:func:`analyse_run` gathers them into results.json keys and the bulkier ``analysis.json`` content.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

import numpy as np
import torch

from proteus.config import ReportConfig
from proteus.core.estimator import Proteus
from proteus.metrics import confusion_matrix
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
    "cosine_analysis",
    "finite",
    "latency_points",
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
        self.H, self.l2 = H, getattr(sig, "normalize", "none") == "l2"

    @property
    def device(self) -> torch.device:
        return self.H.device

    @property
    def shape(self) -> torch.Size:
        return self.H.shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        rows = self.H.index_select(dim, index)
        return torch.nn.functional.normalize(rows, dim=1) if self.l2 else rows


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


@torch.no_grad()
def theory_analysis(clf: Proteus, evaluator: Evaluator) -> dict[str, Any] | None:
    """Theorem 3.5 / 3.6 quantities per (task, component) on the test sets; None without retrieval.

    Returns ``{"components": [...], "per_task": [...], "summary": {...}}``; tasks and components are
    0-based, ``min_delta`` / ``delta_ok`` are None where Theorem 3.6 gives no finite value. The theorems
    are about the adapter keys ``h_i(x)`` (``clf.keys_.adapter_signatures``); None when a task has none. With
    ``signature.keys`` other than "adapter", delta, kappa and sigma^2 are still those of the adapter keys
    while the error is the measured one of the rule that retrieved.
    """
    if not clf.parts_.retrieves:
        return None
    n = clf.num_tasks
    sigs = clf.keys_.adapter_signatures[:n]
    if n != clf.parts_.num_adapters or len(sigs) != n or any(s is None for s in sigs):
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
    rep_z = theory_report(maha, logdets, d, retrieved=retrieved)
    comps = []
    for (k, t), r in sorted(rep.items()):
        rz = rep_z[(k, t)]
        row = {"task": k, "component": t, **{key: finite(v) for key, v in r.items()}}
        row.update({f"{key}_varz": finite(rz[key]) for key in ("sigma2", "bound", "min_delta", "delta_ok")})
        comps.append(row)
    per_task = []
    for k in range(n):
        rows = [c for c in comps if c["task"] == k]
        if not rows:
            continue
        w = [float(c["n"]) for c in rows]
        ok = [c["delta_ok"] for c in rows if c["delta_ok"] is not None]
        own = maha[k][k].min(dim=1).values  # each own input's distance to its nearest own component
        per_task.append(
            {
                "task": k,
                "n_components": len(rows),
                # the bounds' premise: an own-task input's squared Mahalanobis distance is about d
                "own_distance_per_dim": finite(float(own.median()) / d),
                "bound_mean": _mean([c["bound"] for c in rows], w),
                # the task's inputs retrieved to another task (not floored, unlike the components' eps)
                "retrieval_error": float((retrieved[k] != k).double().mean()),
                "delta_mean": _mean([c["delta"] for c in rows], w),
                "delta_min": min((c["delta"] for c in rows if c["delta"] is not None), default=None),
                "min_delta_mean": _mean([c["min_delta"] for c in rows], w),
                "min_delta_max": max(
                    (c["min_delta"] for c in rows if c["min_delta"] is not None), default=None
                ),
                "error": _mean([c["error"] for c in rows], w),
                "frac_delta_ok": sum(ok) / len(ok) if ok else None,
            }
        )
    ok = [c["delta_ok"] for c in comps if c["delta_ok"] is not None]
    okz = [c["delta_ok_varz"] for c in comps if c["delta_ok_varz"] is not None]
    own = [t["own_distance_per_dim"] for t in per_task if t["own_distance_per_dim"] is not None]
    summary = {
        "premise": premise(own),
        "d": d,
        "num_tasks": n,
        "n_components": len(comps),
        "n_delta_ok": int(sum(ok)),
        "frac_delta_ok": sum(ok) / len(ok) if ok else None,
        "delta_median": finite(float(np.median([c["delta"] for c in comps]))) if comps else None,
        "min_delta_median": finite(
            float(np.median([c["min_delta"] for c in comps if c["min_delta"] is not None]))
        )
        if any(c["min_delta"] is not None for c in comps)
        else None,
        "bound_mean": _mean([c["bound"] for c in comps], [float(c["n"]) for c in comps]),
        "error_mean": _mean([c["error"] for c in comps], [float(c["n"]) for c in comps]),
        "frac_a21": sum(c["a21"] for c in comps) / len(comps) if comps else None,
        "frac_delta_ok_varz": sum(okz) / len(okz) if okz else None,
        "sigma2": "A2-3: max over other tasks i of trace(Var[h_i(x)]) / d, in the signature's space",
        "sigma2_varz": "*_varz fields: max Var[Z_i^s] / d over other-task components (the proof of Thm. 3.5)",
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
    """Fig. 8: per task k >= 2 (1-based) and adapted map, the S coefficients over older directions."""
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
    """Figs. 9-10: ``(summary, per-map (m, m) cosine matrices)``; (None, None) without adapters."""
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
def latency_points(n: int, points: int) -> list[int]:
    """Up to ``points`` values of m in 1..n, evenly spaced, always including 1 and n."""
    if n < 1:
        return []
    k = max(2, int(points)) if n > 1 else 1
    return sorted({int(round(v)) for v in np.linspace(1, n, min(k, n))})


def _batch(stream: TaskStream, clf: Proteus, size: int) -> torch.Tensor:
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
    ms = latency_points(n, rc.latency_points)
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


# ====================================================================== all of it
def analyse_run(
    clf: Proteus, evaluator: Evaluator, stream: TaskStream, rc: ReportConfig, latency: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(results.json keys, analysis.json content)`` for a finished run.

    results.json gets ``theory``, ``retrieval_confusion``, ``orthogonality`` and ``latency`` (each None
    where it does not apply or was switched off); analysis.json gets the per-map S vectors (``transfer``)
    and cosine matrices (``unit_cosines``). A failing part is logged and reported in ``report_errors``
    instead of losing the run.
    """
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
        said = ((keys["theory"] or {}).get("summary") or {}).get("premise")
        if said and not said["holds"]:  # plainly, in the log too (report.md says it with the table)
            log.warning("theory (Thm 3.5/3.6): %s", said["statement"])
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
