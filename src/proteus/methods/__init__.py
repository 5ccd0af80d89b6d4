"""Registered methods: PROTEUS, its ablations and the baselines of Sec. 5 and the Appendix.

A method is configuration over the same parts (adapters, signatures, head, retrieval), so every
ablation is a few lines here rather than a copy of the learner (Mammoth style: methods register
themselves with a name; ``proteus run --method NAME``).
"""

from __future__ import annotations

from collections.abc import Callable

from proteus.config import RunConfig
from proteus.registry import Registry

METHODS: Registry[Callable[[RunConfig], None]] = Registry("method")


def apply_method(cfg: RunConfig, name: str) -> RunConfig:
    METHODS.get(name)(cfg)
    cfg.method = name
    return cfg


def _paper_signature(cfg: RunConfig) -> None:
    s = cfg.signature
    s.method, s.covariance, s.normalize, s.score, s.calibrate = "dpgmm", "full", "none", "nll", "none"


@METHODS.register("proteus", help="PROTEUS (Alg. 1-2): adaptive LoRA + DP-GMM signatures + LDA head")
def proteus(cfg: RunConfig) -> None:
    pass


@METHODS.register(
    "proteus-paper", help="PROTEUS exactly as the paper: raw embeddings, full-covariance DP-GMM NLL"
)
def proteus_paper(cfg: RunConfig) -> None:
    _paper_signature(cfg)


@METHODS.register(
    "proteus-flda", help="PROTEUS with frozen-feature LDA task retrieval (beyond the paper)"
)
def proteus_flda(cfg: RunConfig) -> None:
    cfg.signature.keys = "frozen-lda"


@METHODS.register(
    "proteus-lda",
    help="PROTEUS with LDA task keys on L2-normalised first-adapter embeddings (beyond the paper)",
)
def proteus_lda(cfg: RunConfig) -> None:
    cfg.signature.keys = "first-adapter-lda"
    cfg.signature.normalize = "l2"


@METHODS.register("ranpac", help="RanPAC: adapter trained on the first task only, LDA head, no retrieval")
def ranpac(cfg: RunConfig) -> None:
    cfg.train.tasks = "first"
    cfg.adapter.transfer = "zero"
    cfg.retrieval.mode = "first"


@METHODS.register(
    "last-lora", help="PROTEUS adapters without retrieval: the most recent adapter (InfLoRA/SD-LoRA)"
)
def last_lora(cfg: RunConfig) -> None:
    cfg.retrieval.mode = "last"


@METHODS.register("frozen", help="frozen backbone + LDA head (lower reference)")
def frozen(cfg: RunConfig) -> None:
    cfg.adapter.enabled = False
    cfg.train.tasks = "none"
    cfg.retrieval.mode = "none"


@METHODS.register(
    "proteus-s0", help="ablation: S = 0 and no orthogonality (no knowledge transfer; MELO-like)"
)
def proteus_s0(cfg: RunConfig) -> None:
    cfg.adapter.transfer = "zero"
    cfg.adapter.orthogonal = False


@METHODS.register("proteus-si", help="ablation: S = I (every old direction reused in full)")
def proteus_si(cfg: RunConfig) -> None:
    cfg.adapter.transfer = "identity"


@METHODS.register("proteus-lambda0", help="ablation: no elastic-net penalty on S (lambda = 0)")
def proteus_lambda0(cfg: RunConfig) -> None:
    cfg.adapter.lam = 0.0


@METHODS.register("proteus-kmeans", help="ablation: K-means signatures (K = 20) instead of the DP-GMM")
def proteus_kmeans(cfg: RunConfig) -> None:
    cfg.signature.method = "kmeans"
    cfg.signature.max_components = 20


@METHODS.register("proteus-top3", help="ablation: top-3 Gaussian retrieval")
def proteus_top3(cfg: RunConfig) -> None:
    cfg.retrieval.top_k = 3


@METHODS.register("proteus-top5", help="ablation: top-5 Gaussian retrieval")
def proteus_top5(cfg: RunConfig) -> None:
    cfg.retrieval.top_k = 5


@METHODS.register("proteus-all-units", help="ablation: S = 0, all units summed, no retrieval (O-LoRA-like)")
def proteus_all_units(cfg: RunConfig) -> None:
    cfg.adapter.transfer = "zero"
    cfg.retrieval.mode = "all-units"


@METHODS.register("proteus-budget", help="budget-constrained rank schedule r_m = r_0 exp(-0.05 (m-1))")
def proteus_budget(cfg: RunConfig) -> None:
    if cfg.adapter.budget_decay is None:
        cfg.adapter.budget_decay = 0.05
