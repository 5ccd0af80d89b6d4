"""Harness settings: the figures and their targets, the sections, the paper's latency tables, and
every size a run uses (full, quick, tiny; CUDA switches to the paper's ViT-B/16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: figure key -> (comparison, target); ``value op target`` passes
FIGURES: dict[str, tuple[str, float]] = {
    "predict_vs_limit": (">=", 0.8),
    "predict_vs_peft_mixed_batch": (">=", 1.5),
    "dpgmm_speedup_vs_sklearn": (">=", 10.0),
    "dpgmm_heldout_loglik_rel_diff": ("<=", 0.01),
    "train_step_overhead": ("<=", 1.25),
    "kb_mb_per_task": ("<=", 10.0),
    "kb_retrieval_acc_delta": ("<=", 0.5),
    "ridge_sweep_speedup": (">=", 10.0),
}

#: beyond-the-paper figures (``beyond_paper`` in the JSON) -> (comparison, target)
BEYOND_FIGURES: dict[str, tuple[str, float]] = {
    "predict_vs_limit_adapt_last6": (">=", 0.7),
    "two_stage_speedup_m50": (">=", 10.0),
    "two_stage_speedup_m100": (">=", 20.0),
    "compile_speedup": (">=", 1.0),
}

#: section -> the figure keys it fills
SECTIONS: dict[str, tuple[str, ...]] = {
    "predict": ("predict_vs_limit",),
    "latency": (),
    "peft": ("predict_vs_peft_mixed_batch",),
    "dpgmm": ("dpgmm_speedup_vs_sklearn", "dpgmm_heldout_loglik_rel_diff"),
    "train": ("train_step_overhead",),
    "kb": ("kb_mb_per_task", "kb_retrieval_acc_delta"),
    "ridge": ("ridge_sweep_speedup",),
    "compile": (),
}

#: the paper's inference latency tables (App., "Complexity of PROTEUS Inference"), seconds per batch
PAPER_LATENCY = {
    "imagenet_r": {
        "m": list(range(1, 11)),
        "seconds": [0.41, 0.77, 1.03, 1.31, 1.66, 2.13, 2.42, 2.60, 2.97, 3.29],
        "setting": "ImageNet-R, ViT-B/16, T = 100, per batch, NVIDIA A40",
    },
    "cifar100": {
        "m": [2, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50],
        "seconds": [0.27, 0.64, 1.33, 2.08, 2.93, 3.86, 4.89, 5.91, 7.18, 8.26, 9.59],
        "setting": "CIFAR-100, 50 tasks, batch 32, NVIDIA A40",
    },
}


# ====================================================================== settings
@dataclass
class Case:
    """One backbone configuration timed by ``predict``."""

    backbone: str
    img: int
    adapt_last: int | None = None

    @property
    def label(self) -> str:
        return f"{self.backbone}@{self.img} adapt_last={self.adapt_last}"


@dataclass
class Settings:
    """Every size the harness uses (written to the JSON as ``settings``)."""

    mode: str = "full"
    device: str = "cpu"
    seed: int = 0
    #: torch intra-op threads for the run (None: torch's default, restored afterwards)
    threads: int | None = None
    # shared state of the prediction figures
    batch: int = 32
    m: int = 10
    rank: int = 4
    lora_b_std: float = 0.02
    sig_components: int = 20
    sig_rank: int = 64
    rp_dim: int = 10000
    classes_per_task: int = 2
    # predict_vs_limit
    predict_cases: list[Case] = field(
        default_factory=lambda: [Case("mobilenet_v2", 96), Case("vit_ti16", 224)]
    )
    beyond_case: Case | None = field(default_factory=lambda: Case("mobilenet_v2", 96, 6))
    predict_reps: int = 3
    predict_reps_vit: int = 2
    # latency_vs_m: the m-forward path, the two-stage path and the candidate path against m plain forwards
    # (ViT-Ti at 96 px: at 224 px the m-forward path alone would take ~8 minutes on 2 cores up to m = 100)
    latency_cases: list[Case] = field(
        default_factory=lambda: [Case("mobilenet_v2", 96), Case("vit_ti16", 96)]
    )
    latency_ms: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 25, 50, 100])
    latency_reps: int = 1
    latency_warmup: int = 0
    #: repetitions of the routes that cost a few forwards (two-stage, candidates, one plain forward)
    latency_fast_reps: int = 3
    #: c of the candidate path (``retrieval.candidates``)
    candidates: int = 3
    # predict_vs_peft_mixed_batch
    peft_case: Case = field(default_factory=lambda: Case("vit_ti16", 224))
    peft_adapters: int = 10
    peft_reps: int = 2
    # DP-GMM
    dpgmm_d: int = 768
    dpgmm_n: int = 5000
    dpgmm_heldout: int = 1000
    dpgmm_T: int = 20
    dpgmm_true_clusters: int = 8
    dpgmm_max_iter: int = 100
    dpgmm_tol: float = 1e-3
    dpgmm_ours_reps: int = 3
    dpgmm_sklearn_reps: int = 1
    # training step
    train_case: Case = field(default_factory=lambda: Case("vit_ti16", 224))
    train_batch: int = 32
    train_task: int = 10
    #: further tasks timed against the same plain LoRA step (the growth with k, issue 28), details only
    train_later_tasks: tuple[int, ...] = (50, 100)
    train_classes: int = 10
    train_reps: int = 3
    # knowledge base
    kb_d: int = 768
    kb_vit_blocks: int = 12
    kb_tasks: int = 10
    # the scale check (tools/studies/scale_check.py): CIFAR-100 on ViT-B/16 features
    kb_retrieval_d: int = 768
    kb_classes: int = 10
    kb_train_per_task: int = 5000
    kb_test_per_task: int = 1000
    kb_rp_dim: int = 2000
    # ridge sweep
    ridge_rp_dim: int = 5000
    ridge_n: int = 2000
    ridge_d: int = 768
    ridge_classes: int = 10
    ridge_fast_reps: int = 3
    ridge_naive_reps: int = 1
    # compile_speedup: eager against compile=default predict (the backend: "eager" is dynamo alone)
    compile_case: Case = field(default_factory=lambda: Case("vit_ti16", 96))
    compile_backend: str = "inductor"
    compile_reps: int = 5

    @classmethod
    def for_mode(cls, mode: str, device: torch.device) -> Settings:
        """``full`` (default), ``quick`` or ``tiny``; CUDA switches the backbones to the paper's ViT-B/16."""
        s = cls(mode=mode, device=str(device))
        if mode == "quick":
            s.predict_cases = [Case("mobilenet_v2", 64), Case("vit_ti16", 96)]
            s.beyond_case = Case("mobilenet_v2", 64, 6)
            s.predict_reps = s.predict_reps_vit = 2
            s.latency_cases = [Case("mobilenet_v2", 64)]
            s.latency_ms = [1, 2, 5, 10, 25]
            s.peft_case = Case("vit_ti16", 96)
            s.dpgmm_d, s.dpgmm_n, s.dpgmm_heldout, s.dpgmm_T = 128, 1000, 500, 10
            s.train_case, s.train_batch = Case("vit_ti16", 96), 16
            s.kb_retrieval_d, s.kb_tasks, s.kb_train_per_task, s.kb_test_per_task = 256, 5, 1500, 300
            s.ridge_rp_dim = 1000
            s.compile_case, s.compile_reps = Case("vit_ti16", 64), 3
        elif mode == "tiny":  # a smoke test of every code path (the test suite), not a measurement
            s.threads = 1  # tiny ops on a busy machine: OpenMP barriers would dominate
            s.batch, s.m, s.rp_dim = 4, 3, 256
            s.sig_components, s.sig_rank = 4, 8
            s.predict_cases = [Case("mobilenet_v2", 32)]
            s.beyond_case = Case("mobilenet_v2", 32, 6)
            s.predict_reps = s.predict_reps_vit = 1
            s.latency_cases, s.latency_ms, s.latency_fast_reps = [Case("mobilenet_v2", 32)], [1, 2], 1
            s.peft_case, s.peft_adapters, s.peft_reps = Case("vit_ti16", 32), 2, 1
            s.dpgmm_d, s.dpgmm_n, s.dpgmm_heldout, s.dpgmm_T, s.dpgmm_true_clusters = 8, 100, 50, 3, 2
            s.dpgmm_max_iter, s.dpgmm_ours_reps = 10, 1
            s.train_case, s.train_batch, s.train_task, s.train_reps = Case("mobilenet_v2", 32), 4, 3, 1
            s.train_later_tasks = (6,)
            s.kb_tasks, s.kb_retrieval_d, s.kb_classes, s.kb_rp_dim = 3, 32, 4, 128
            s.kb_train_per_task, s.kb_test_per_task = 240, 60
            s.ridge_rp_dim, s.ridge_n, s.ridge_d, s.ridge_fast_reps = 200, 300, 64, 1
            s.compile_case, s.compile_backend, s.compile_reps = Case("mobilenet_v2", 32), "eager", 1
        elif mode != "full":
            raise ValueError(f"unknown bench mode {mode!r}")
        if device.type == "cuda" and mode != "tiny":
            img = 224 if mode == "full" else 96
            s.predict_cases = [Case("mobilenet_v2", img), Case("vit_b16", img)]
            s.beyond_case = Case("mobilenet_v2", img, 6)
            s.predict_reps = s.predict_reps_vit = 10
            s.latency_cases = [Case("vit_b16", img)]
            if mode == "full":
                s.latency_ms = list(range(1, 11)) + list(range(15, 51, 5))
            s.latency_reps, s.latency_warmup, s.latency_fast_reps = 10, 2, 10  # GPU timings jitter
            s.peft_case, s.peft_reps = Case("vit_b16", img), 10
            s.train_case, s.train_batch, s.train_reps = Case("vit_b16", img), 32, 10
            s.dpgmm_ours_reps = 5
            s.ridge_fast_reps = 5
            s.compile_case, s.compile_reps = Case("vit_b16", img), 10
        return s


def _figure(key: str, value: float | None, reason: str | None = None, **details: Any) -> dict:
    op, target = FIGURES[key] if key in FIGURES else BEYOND_FIGURES[key]
    ok = None
    if value is not None:
        ok = bool(value >= target) if op == ">=" else bool(value <= target)
    return {"value": value, "target": target, "op": op, "pass": ok, "reason": reason, "details": details}
