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
    #: the learner that runs it: "proteus" (:class:`proteus.Proteus`) or a trained-classifier baseline
    #: of :data:`proteus.baselines.BASELINES`
    learner: str = "proteus"

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in self.overrides.items():
            section, _, name = key.partition(".")
            out.setdefault(section, {})[name] = value
        return out


METHODS: Registry[Method] = Registry("method")


def declare(name: str, help: str, learner: str = "proteus", **overrides: Any) -> Method:
    """Register a method; keyword names are config keys with ``__`` for the dot (``train__tasks``)."""
    m = Method(name, help, {k.replace("__", "."): v for k, v in overrides.items()}, learner)
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

#: Alg. 2's retrieval as the paper writes it: DP-GMM keys under each task's own adapter, the best task,
#: then Eq. 23's head over every class (``proteus``'s default before issue 23)
_GAUSSIAN = dict(signature__keys="adapter", head__scope="global", retrieval__combine="hard")
#: methods that retrieve no task classify with Eq. 23's head alone
_NO_RETRIEVAL = dict(head__scope="global", retrieval__combine="hard")

declare(
    "proteus",
    "PROTEUS (Alg. 1): adaptive LoRA per task; retrieval by LDA task keys under the first adapter, each "
    "task's own head, the two likeliest tasks weighed (beyond the paper, docs/retrieval.md)",
)
declare(
    "proteus-paper",
    "PROTEUS exactly as the paper: raw embeddings, full-covariance DP-GMM NLL, RanPAC's gamma rule",
    **_PAPER, **_GAUSSIAN,
)  # fmt: skip
declare(
    "proteus-dpgmm",
    "PROTEUS with the paper's DP-GMM keys (L2-normalised, shrinkage prior; the default before issue 23)",
    **_GAUSSIAN,
)
declare(
    "proteus-flda",
    "proteus with its LDA task keys on the frozen backbone's features",
    signature__keys="frozen-lda",
)
declare(
    "proteus-lda",
    "ablation: proteus's LDA keys (best class score) with Alg. 2's hard retrieval and Eq. 23's head",
    signature__task_score="max", head__scope="global", retrieval__combine="hard",
)  # fmt: skip
declare(
    "proteus-max-key",
    "ablation: proteus with a task scored by its best class (signature.task_score=max)",
    signature__task_score="max", retrieval__key_temperature=0.1,
)  # fmt: skip
declare(
    "proteus-global-head",
    "ablation: proteus with Eq. 23's head over every class instead of each task's own (head.scope=global)",
    head__scope="global",
)
declare(
    "proteus-hard",
    "ablation: proteus with Alg. 2's hard retrieval (the best task only, retrieval.combine=hard)",
    retrieval__combine="hard",
)
declare(
    "ranpac",
    "RanPAC: adapter trained on the first task only, LDA head, no retrieval",
    train__tasks="first",
    adapter__transfer="zero",
    retrieval__mode="first",
    **_NO_RETRIEVAL,
)
declare(
    "last-lora",
    "PROTEUS adapters without retrieval: the most recent adapter (InfLoRA/SD-LoRA)",
    retrieval__mode="last",
    **_NO_RETRIEVAL,
)
declare(
    "frozen",
    "frozen backbone + LDA head (lower reference)",
    adapter__enabled=False,
    train__tasks="none",
    retrieval__mode="none",
    **_NO_RETRIEVAL,
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
    **_GAUSSIAN,
)
declare("proteus-top3", "ablation: top-3 Gaussian retrieval", retrieval__top_k=3, **_GAUSSIAN)
declare("proteus-top5", "ablation: top-5 Gaussian retrieval", retrieval__top_k=5, **_GAUSSIAN)
declare(
    "proteus-all-units",
    "ablation: S = 0, all units summed, no retrieval (O-LoRA-like)",
    adapter__transfer="zero",
    retrieval__mode="all-units",
    **_NO_RETRIEVAL,
)
declare(
    "proteus-budget",
    "budget-constrained rank schedule r_m = r_0 exp(-0.05 (m-1))",
    adapter__budget_decay=0.05,
)

# ---------------------------------------------------------------------------- Table 1 baselines
# Trained-classifier learners (proteus.baselines) on the same streams, seeds and metrics. The values are
# the authors' released code's (docs/experiments.md, "Baselines": official setting / ours / why).
declare(
    "inflora",
    "InfLoRA (Liang & Li, CVPR 2024): LoRA on k, v with a designed frozen A off the DualGPM space",
    learner="inflora",
    baseline__optimizer="adam", baseline__lr=5e-4, baseline__schedule="cosine", baseline__rank=10,
)  # fmt: skip
declare(
    "sd-lora",
    "SD-LoRA (Wu et al., ICLR 2025): frozen normalised old directions with learned magnitudes",
    learner="sd-lora",
    baseline__optimizer="sgd", baseline__lr=8e-3, baseline__schedule="constant", baseline__rank=10,
)  # fmt: skip
declare(
    "l2p",
    "L2P (Wang et al., CVPR 2022): a prompt pool chosen by key-query matching, prompt tuning",
    learner="l2p",
    baseline__optimizer="adam", baseline__lr=1.875e-3, baseline__schedule="constant",
    baseline__pool_size=10, baseline__prompt_length=5, baseline__top_k=5, baseline__match_weight=0.1,
    baseline__prompt_layers=[0], baseline__clip_grad=1.0,
)  # fmt: skip
declare(
    "dualprompt",
    "DualPrompt (Wang et al., ECCV 2022): shared g-prompts and per-task e-prompts, prefix tuning",
    learner="dualprompt",
    baseline__optimizer="adam", baseline__lr=2.8125e-3, baseline__schedule="constant",  # 0.03 * 24 / 256
    baseline__prompt_length=5, baseline__g_length=5, baseline__g_layers=[0, 1],
    baseline__prompt_layers=[2, 3, 4], baseline__match_weight=1.0, baseline__clip_grad=1.0,
)  # fmt: skip
declare(
    "coda-prompt",
    "CODA-Prompt (Smith et al., CVPR 2023): attention-weighted prompt components, prefix tuning",
    learner="coda-prompt",
    baseline__optimizer="adam", baseline__lr=1e-3, baseline__schedule="cosine",
    baseline__pool_size=100, baseline__prompt_length=8, baseline__prompt_layers=[0, 1, 2, 3, 4],
    baseline__ortho_weight=0.0,
)  # fmt: skip
