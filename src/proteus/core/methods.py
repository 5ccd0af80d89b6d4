"""PROTEUS's methods: the paper (``proteus-paper``), the default ``proteus``, RanPAC and the reference
points on the same learner, and the ablations -- each declared against an explicit base.

The paper's ablations (Sec. 5 and the Appendix: S = 0, S = I, no elastic net, K-means keys, top-K
retrieval, the O-LoRA-like sum, the rank budget, the last adapter) derive from ``proteus-paper``: they
change one thing of the paper's recipe. ``ranpac`` is RanPAC with its own gamma rule (the Appendix:
"gamma follows RanPAC"); ``ranpac-accumulated`` keeps proteus's rule for a like-for-like head;
``ranpac-hide`` is RanPAC with a LoRA unit per task retrieved by HiDe-Prompt's parametric task-identity
inference (the Appendix table "retrieve_significant"; :mod:`proteus.core.tii_keys`). The ablations of the
default (``proteus-hard``, ``-max-key``, ``-global-head``, ``-flda``, ``-lda``) derive from ``proteus``.
"""

from __future__ import annotations

from proteus.config import declare
from proteus.core import tii_keys  # noqa: F401 - registers signature.keys=hide-tii (ranpac-hide)

__all__: list[str] = []

#: methods that retrieve no task classify with Eq. 23's head alone
_NO_RETRIEVAL = dict(head__scope="global", retrieval__combine="hard")

declare(
    "proteus",
    "PROTEUS (Alg. 1): adaptive LoRA per task; retrieval by LDA task keys under the first adapter, each "
    "task's own head, the two likeliest tasks weighed (beyond the paper, docs/retrieval.md)",
    base=None,
    reading="default",
)
# the paper's recipe (docs/experiments.md, "paper says / we do"): Alg. 2's retrieval as the paper writes it
# (DP-GMM keys under each task's own adapter, the best task, then Eq. 23's head over every class) on raw
# embeddings with full covariances, the DP-GMM as scikit-learn's BayesianGaussianMixture defaults it (ridge
# 1e-3 tr/d on the covariance prior), gamma by RanPAC's rule (Appendix), class prototypes as Algorithm 1
# line 11 writes them
declare(
    "proteus-paper",
    "PROTEUS exactly as the paper: raw embeddings, full-covariance DP-GMM NLL, RanPAC's gamma rule",
    base=None, reading="paper",
    signature__keys="adapter", head__scope="global", retrieval__combine="hard",
    signature__method="dpgmm", signature__covariance="full", signature__normalize="none",
    signature__score="nll", signature__calibrate="none", signature__prior="ridge",
    signature__prior_scale="sklearn", head__gamma_selection="task", head__prototypes="task-mean",
)  # fmt: skip
declare(
    "proteus-dpgmm",
    "PROTEUS with the paper's DP-GMM keys (L2-normalised, shrinkage prior; an earlier default)",
    base="proteus",
    signature__keys="adapter", head__scope="global", retrieval__combine="hard",
)  # fmt: skip

# ---------------------------------------------------------------------------- ablations of the default
declare(
    "proteus-flda",
    "proteus with its LDA task keys on the frozen backbone's features",
    base="proteus",
    signature__keys="frozen-lda",
)
declare(
    "proteus-lda",
    "ablation: proteus's LDA keys (best class score) with Alg. 2's hard retrieval and Eq. 23's head",
    base="proteus",
    signature__task_score="max", head__scope="global", retrieval__combine="hard",
)  # fmt: skip
declare(
    "proteus-max-key",
    "ablation: proteus with a task scored by its best class (signature.task_score=max)",
    base="proteus",
    signature__task_score="max", retrieval__key_temperature=0.1,
)  # fmt: skip
declare(
    "proteus-global-head",
    "ablation: proteus with Eq. 23's head over every class instead of each task's own (head.scope=global)",
    base="proteus",
    head__scope="global",
)
declare(
    "proteus-hard",
    "ablation: proteus with Alg. 2's hard retrieval (the best task only, retrieval.combine=hard)",
    base="proteus",
    retrieval__combine="hard",
)

# ---------------------------------------------------------------------------- reference points
declare(
    "ranpac",
    "RanPAC: adapter trained on the first task only, LDA head with RanPAC's gamma rule, no retrieval",
    base=None,
    train__tasks="first",
    adapter__transfer="zero",
    retrieval__mode="first",
    head__gamma_selection="task",
    **_NO_RETRIEVAL,
)
declare(
    "ranpac-accumulated",
    "RanPAC with proteus's gamma rule (ridge on all statistics so far, scored on the task's held-out part)",
    base="ranpac",
    head__gamma_selection="accumulated",
)
declare(
    "ranpac-hide",
    "RanPAC with HiDe's parametric retrieval: a LoRA unit per task (S = 0, no orthogonality), the task of an "
    "input from HiDe-Prompt's task-identity inference on frozen features, RanPAC's head",
    base="ranpac",
    train__tasks="all",
    retrieval__mode="signature",
    signature__keys="hide-tii",
    adapter__orthogonal=False,
)
declare(
    "frozen",
    "frozen backbone + LDA head (lower reference)",
    base=None,
    adapter__enabled=False,
    train__tasks="none",
    retrieval__mode="none",
    **_NO_RETRIEVAL,
)

# ---------------------------------------------------------------------------- the paper's ablations
declare(
    "last-lora",
    "PROTEUS adapters without retrieval: the most recent adapter (InfLoRA/SD-LoRA)",
    base="proteus-paper",
    retrieval__mode="last",
    **_NO_RETRIEVAL,
)
declare(
    "proteus-s0",
    "ablation: S = 0 and no orthogonality (no knowledge transfer; MELO-like)",
    base="proteus-paper",
    adapter__transfer="zero",
    adapter__orthogonal=False,
)
declare(
    "proteus-si",
    "ablation: S = I (every old direction reused in full)",
    base="proteus-paper",
    adapter__transfer="identity",
)
declare(
    "proteus-lambda0",
    "ablation: no elastic-net penalty on S (lambda = 0)",
    base="proteus-paper",
    adapter__lam=0.0,
)
declare(
    "proteus-kmeans",
    "ablation: K-means signatures (K = 20) instead of the DP-GMM",
    base="proteus-paper",
    signature__method="kmeans",
    signature__max_components=20,
)
declare("proteus-top3", "ablation: top-3 Gaussian retrieval", base="proteus-paper", retrieval__top_k=3)
declare("proteus-top5", "ablation: top-5 Gaussian retrieval", base="proteus-paper", retrieval__top_k=5)
declare(
    "proteus-all-units",
    "ablation: S = 0, all units summed, no retrieval (O-LoRA-like)",
    base="proteus-paper",
    adapter__transfer="zero",
    retrieval__mode="all-units",
    **_NO_RETRIEVAL,
)
declare(
    "proteus-budget",
    "budget-constrained rank schedule r_m = r_0 exp(-0.05 (m-1))",
    base="proteus-paper",
    adapter__budget_decay=0.05,
)
