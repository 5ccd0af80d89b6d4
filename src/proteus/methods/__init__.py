"""Registered methods: PROTEUS, its ablations and the baselines of Sec. 5 and the Appendix.

A method is a declaration: which strategies it uses and which settings it overrides, as dotted config
keys (the strategies are resolved from their registries when the estimator is built:
``retrieval.mode`` -> :data:`~proteus.engine.compositions.COMPOSITIONS`, ``signature.keys`` ->
:data:`~proteus.engine.keys.KEYS`, ``adapter.s_update`` -> :data:`~proteus.engine.trainer.S_UPDATES`,
``train.tasks`` -> :data:`~proteus.engine.compositions.TRAIN_SCHEDULES`). ``proteus run --method NAME``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proteus.config import RunConfig, merge
from proteus.registry import Registry

__all__ = ["METHODS", "Method", "apply_method", "declare"]


@dataclass(frozen=True)
class Method:
    """A method: its name, a one-line description and its config overrides (dotted keys)."""

    name: str
    help: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self.overrides.items():
            section, _, name = key.partition(".")
            out.setdefault(section, {})[name] = value
        return out


METHODS: Registry[Method] = Registry("method")


def declare(name: str, help: str, **overrides: Any) -> Method:
    """Register a method; keyword names are config keys with ``__`` for the dot (``train__tasks``)."""
    m = Method(name, help, {k.replace("__", "."): v for k, v in overrides.items()})
    METHODS.register(name, help=help)(m)
    return m


def apply_method(cfg: RunConfig, name: str) -> RunConfig:
    merge(cfg, METHODS.get(name).nested())
    cfg.method = name
    return cfg


#: the paper's recipe (docs/experiments.md, "paper says / we do"): raw embeddings, full covariances, the
#: DP-GMM as scikit-learn's BayesianGaussianMixture defaults it (ridge 1e-3 tr/d on the covariance prior),
#: gamma by RanPAC's rule (Appendix), class prototypes as Algorithm 1 line 11 writes them
_PAPER = dict(
    signature__method="dpgmm", signature__covariance="full", signature__normalize="none",
    signature__score="nll", signature__calibrate="none", signature__prior="ridge",
    signature__prior_scale="sklearn", head__gamma_selection="task", head__prototypes="task-mean",
)  # fmt: skip

declare(
    "proteus",
    "PROTEUS (Alg. 1-2): adaptive LoRA + DP-GMM signatures (L2-normalised, shrinkage prior) + LDA head",
)
declare(
    "proteus-paper",
    "PROTEUS exactly as the paper: raw embeddings, full-covariance DP-GMM NLL, RanPAC's gamma rule",
    **_PAPER,
)
declare(
    "proteus-flda",
    "PROTEUS with frozen-feature LDA task retrieval (beyond the paper)",
    signature__keys="frozen-lda",
)
declare(
    "proteus-lda",
    "PROTEUS with LDA task keys on L2-normalised first-adapter embeddings (beyond the paper)",
    signature__keys="first-adapter-lda",
    signature__normalize="l2",
)
declare(
    "ranpac",
    "RanPAC: adapter trained on the first task only, LDA head, no retrieval",
    train__tasks="first",
    adapter__transfer="zero",
    retrieval__mode="first",
)
declare(
    "last-lora",
    "PROTEUS adapters without retrieval: the most recent adapter (InfLoRA/SD-LoRA)",
    retrieval__mode="last",
)
declare(
    "frozen",
    "frozen backbone + LDA head (lower reference)",
    adapter__enabled=False,
    train__tasks="none",
    retrieval__mode="none",
)
declare(
    "proteus-s0",
    "ablation: S = 0 and no orthogonality (no knowledge transfer; MELO-like)",
    adapter__transfer="zero",
    adapter__orthogonal=False,
)
declare("proteus-si", "ablation: S = I (every old direction reused in full)", adapter__transfer="identity")
declare("proteus-lambda0", "ablation: no elastic-net penalty on S (lambda = 0)", adapter__lam=0.0)
declare(
    "proteus-kmeans",
    "ablation: K-means signatures (K = 20) instead of the DP-GMM",
    signature__method="kmeans",
    signature__max_components=20,
)
declare("proteus-top3", "ablation: top-3 Gaussian retrieval", retrieval__top_k=3)
declare("proteus-top5", "ablation: top-5 Gaussian retrieval", retrieval__top_k=5)
declare(
    "proteus-all-units",
    "ablation: S = 0, all units summed, no retrieval (O-LoRA-like)",
    adapter__transfer="zero",
    retrieval__mode="all-units",
)
declare(
    "proteus-budget",
    "budget-constrained rank schedule r_m = r_0 exp(-0.05 (m-1))",
    adapter__budget_decay=0.05,
)
