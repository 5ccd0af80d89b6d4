"""``signature.*`` and ``retrieval.*``: a task's multi-key signature (Eq. 18: a DP-GMM over its embeddings)
and how an input finds its task again (Sec. 3.1, Alg. 2), with the choices beyond the paper
(docs/retrieval.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proteus.options import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Interval, option
from proteus.registry import Registry

__all__ = [
    "COMBINATIONS", "COMPOSITIONS", "KEYS", "NOVELTY", "SPACES", "STORAGE_DTYPES", "TASK_SCORES",
    "RetrievalConfig", "SignatureConfig",
]  # fmt: skip

# The registries of the strategies these options choose, created beside the options that name them (so an
# option's choices are a registry at its own floor); the engine, which reads the options, registers their
# factories where they are defined (the ``plugins``, imported the first time a name is missing).
#: ``signature.keys``: every key strategy (:data:`proteus.engine.keys.base.KEYS`; RanPAC + HiDe's
#: task-identity keys are registered by :mod:`proteus.core.tii_keys`)
KEYS: Registry[Any] = Registry("signature.keys", plugins=("proteus.engine.keys", "proteus.core.tii_keys"))
#: ``signature.task_score`` (:data:`proteus.engine.keys.lda.TASK_SCORES`)
TASK_SCORES: Registry[Any] = Registry("signature.task_score", plugins=("proteus.engine.keys.lda",))
#: ``retrieval.mode`` (:data:`proteus.engine.compositions.COMPOSITIONS`)
COMPOSITIONS: Registry[Any] = Registry("retrieval.mode", plugins=("proteus.engine.compositions",))
#: ``retrieval.novelty`` (:data:`proteus.engine.novelty.NOVELTY`)
NOVELTY: Registry[Any] = Registry("retrieval.novelty", plugins=("proteus.engine.novelty",))
#: ``retrieval.candidate_space`` (:data:`proteus.engine.keys.space.SPACES`)
SPACES: Registry[Any] = Registry("retrieval.candidate_space", plugins=("proteus.engine.keys.space",))
#: ``retrieval.combine`` (:data:`proteus.engine.experts.COMBINATIONS`)
COMBINATIONS: Registry[Any] = Registry("retrieval.combine", plugins=("proteus.engine.experts",))

#: ``signature.storage_dtype``
STORAGE_DTYPES = ("auto", "float32", "float16")


@dataclass
class SignatureConfig:
    """Eq. 18: the multi-key signature of a task, a DP-GMM over its embeddings under its own adapter."""

    method: str = option(
        "dpgmm",
        help="the clustering: dpgmm (Eq. 18), kmeans (the ablation), gaussian (one component, Eq. 2)",
        choices="signature.method",
    )
    max_components: int = option(
        20, help="T: the DP-GMM's truncation (components per task)", range=AT_LEAST_1
    )
    covariance: str = option(
        "shared",
        help="the component covariance kept for scoring: full, ppca (low rank + isotropic) or shared (the "
        "task's prior once plus each component's low-rank rows: exact for the DP-GMM posterior)",
        choices="signature.covariance",
    )
    rank: int | None = option(
        None,
        help="the ppca rank (null: 128); for shared the rows kept per component (null: every row, exact)",
        range=AT_LEAST_1,
    )
    normalize: str = option(
        "l2",
        help="embedding normalisation before fitting and scoring: none (the paper) or l2",
        choices="signature.normalize",
    )
    score: str = option(
        "nll",
        help="score per (input, component): nll (Gaussian NLL with log-det) or mahalanobis (Eq. 2)",
        choices="signature.score",
    )
    calibrate: str = option(
        "none",
        help="per-task score calibration: none or standardize (by the task's own training scores)",
        choices="signature.calibrate",
    )
    prior: str = option(
        "oas",
        help="the task covariance (the DP-GMM's covariance prior): ridge (cov + 1e-3 tr/d I), oas or "
        "ledoit-wolf (shrinkage towards tr/d I)",
        choices="signature.prior",
        legacy="ridge",
    )
    prior_scale: str = option(
        "expected",
        help="the Wishart prior: sklearn (covariance_prior = C, expected covariance C / dof) or expected "
        "(covariance_prior = dof C: the prior expects C)",
        choices="signature.prior_scale",
        legacy="sklearn",
    )
    prior_dof: float | None = option(
        None, help="the Wishart prior's degrees of freedom (its weight in points; null: d)", legacy=None
    )
    keys: str = option(
        "first-adapter-lda",
        help="where a task's keys live: first-adapter-lda (LDA keys under task 1's adapter, beyond the "
        "paper), adapter (the paper: DP-GMM under the task's own adapter), frozen, adapter+frozen or "
        "frozen-lda",
        choices="signature.keys",
    )
    task_score: str = option(
        "mean",
        help="how LDA keys turn class scores into a task's score: mean (minus the log of the task's mean "
        "class probability) or max (its best class score)",
        choices="signature.task_score",
        legacy="max",
    )
    class_temperature: float = option(
        0.1, help="the temperature of the class softmax of task_score=mean", range=POSITIVE, legacy=0.1
    )
    max_iter: int = option(100, help="the DP-GMM's EM iterations at most", range=AT_LEAST_1)
    tol: float = option(1e-3, help="the DP-GMM's convergence tolerance on the lower bound", range=POSITIVE)
    reg_covar: float = option(1e-6, help="added to every component covariance's diagonal", range=NON_NEGATIVE)
    storage_dtype: str = option(
        "auto",
        help="the stored signature factors: auto (float16 rows for covariance=shared, float32 otherwise), "
        "float32 (exact) or float16",
        choices=STORAGE_DTYPES,
    )


@dataclass
class RetrievalConfig:
    """How an input's task is found again (Sec. 3.1, Alg. 2) and how its answer is combined."""

    mode: str = option(
        "signature",
        help="which adapter embeds an input: signature (Alg. 2, task retrieval), first (RanPAC), last "
        "(InfLoRA, SD-LoRA), all-units (O-LoRA-like sum) or none",
        choices="retrieval.mode",
    )
    top_k: int = option(
        1, help="the Gaussian keys' components summed per task (the top-K ablation)", range=AT_LEAST_1
    )
    oracle: bool = option(True, help="also report the accuracy with the true task's adapter (oracle)")
    reject: bool = option(
        False,
        help="flag inputs from no learned task: each task's key leaves out a held-out part of its inputs "
        "whose scores calibrate a threshold",
    )
    novelty: str = option(
        "auto",
        help="the detector of inputs from no learned task: auto (task-gaussian on LDA keys), task-gaussian "
        "(each task's Gaussians on the frozen prefix's channel statistics and the keys' features), "
        "class-gaussian (the class Gaussians of the LDA keys' statistics) or none",
        choices="retrieval.novelty",
    )
    shortlist: int | None = option(
        8,
        help="the detector of inputs from no learned task scores an input under the Gaussians of only the "
        "shortlist tasks its keys rank highest (its calibration rows alike), so that its cost does not grow "
        "with the tasks learned; null: every task",
        range=AT_LEAST_1,
        legacy=None,
    )
    calibration_holdout: float = option(
        0.1,
        help="the share of a task's inputs that calibrates its threshold",
        range=Interval(0, 0.5, "neither"),
    )
    reject_tpr: float = option(
        0.95,
        help="the fraction of a task's held-out inputs its threshold accepts",
        range=Interval(0, 1, "right"),
    )
    candidates: int | None = option(
        None,
        help="Gaussian keys: score only the c tasks shortlisted by cheap LDA keys in one space (c + 1 "
        "forwards per input instead of m); null: every task (the paper)",
        range=AT_LEAST_1,
        legacy=None,
    )
    candidate_space: str = option(
        "first-adapter",
        help="the shortlist's space: first-adapter (task 1's adapter) or frozen",
        choices="retrieval.candidate_space",
    )
    combine: str = option(
        "soft",
        help="how task posterior and head combine: hard (Alg. 2: the best task, then its head) or soft "
        "(argmax of log p(t|x) + log p(c|x, t) over the soft_top likeliest tasks; beyond the paper)",
        choices="retrieval.combine",
        legacy="hard",
    )
    soft_top: int = option(2, help="the tasks weighed by combine=soft", range=AT_LEAST_1)
    key_temperature: float = option(
        1.0, help="p(t|x) = softmax(-task scores / key_temperature)", range=POSITIVE, legacy=0.1
    )
    head_temperature: float = option(
        1.0,
        help="p(c|x, t) = softmax over task t's classes of the head's scores / head_temperature",
        range=POSITIVE,
    )
