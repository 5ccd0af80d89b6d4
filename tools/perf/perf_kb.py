"""Storage and head sections: ``kb_mb_per_task`` / ``kb_retrieval_acc_delta`` and ``ridge_sweep_speedup``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from perf_settings import Settings, _figure
from perf_state import synthetic_signature
from perf_timing import _median, interleaved

from proteus.adapters import LoRAUnit
from proteus.config import SignatureConfig
from proteus.heads import RanPACHead
from proteus.signatures import Signature, fit_signature, retrieve


def _retrieval_problem(
    s: Settings, gen: torch.Generator
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``kb_tasks`` tasks in d dimensions: each a mixture of ``kb_clusters_per_task`` Gaussians that share
    one rank-8 covariance direction set; tasks differ by their centres and cluster offsets (separation
    ``kb_task_separation`` in units of the noise level, independent of d)."""
    d, K, nc = s.kb_retrieval_d, s.kb_tasks, s.kb_clusters_per_task
    noise = 0.5 / math.sqrt(d)
    base = 2.0 * torch.randn(d, generator=gen) / math.sqrt(d)
    W = 2.0 * torch.randn(d, 8, generator=gen) / math.sqrt(d)
    train, test = [], []
    for _ in range(K):
        c = torch.randn(d, generator=gen) * (s.kb_task_separation * noise / math.sqrt(d))
        mus = base + c + torch.randn(nc, d, generator=gen) * (2.0 * noise / math.sqrt(d))

        def sample(n: int, mus: torch.Tensor = mus) -> torch.Tensor:
            j = torch.randint(nc, (n,), generator=gen)
            return mus[j] + torch.randn(n, 8, generator=gen) @ W.T + noise * torch.randn(n, d, generator=gen)

        train.append(sample(s.kb_train_per_task))
        test.append(sample(s.kb_test_per_task))
    y = torch.arange(K).repeat_interleave(s.kb_test_per_task)
    return train, torch.cat(test), y


def _stored(sig: Signature) -> Signature:
    """The signature as a knowledge base returns it (through its storage dtype)."""
    t, meta = sig.to_tensors()
    return Signature.from_tensors(t, meta).to(sig.device)


def section_kb(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    gen = torch.Generator().manual_seed(s.seed)
    mb = 1e6
    # signature bytes per task at d = kb_d, T = kb_T (storage depends on shapes only)
    small = synthetic_signature(s.kb_d, s.kb_T, s.kb_rank, "ppca", gen, storage_dtype="float16")
    full = synthetic_signature(s.kb_d, s.kb_T, s.kb_rank, "full", gen, storage_dtype="float32")
    sig_small, sig_full = small.nbytes(), full.nbytes()
    del full
    # adapter bytes per task: ViT-B's 12 blocks x (q, v), rank 4 per task, through LoRAUnit.task_tensors
    units = [LoRAUnit(s.kb_d, s.kb_d) for _ in range(2 * s.kb_vit_blocks)]
    g = torch.Generator().manual_seed(s.seed)
    for _ in range(s.kb_tasks):
        for u in units:
            u.begin_task(s.rank, "learned", True, g)
            u.end_task()
    per_task = [sum(v.numel() * v.element_size() for u in units for v in u.task_tensors(k).values())
                for k in range(s.kb_tasks)]  # fmt: skip
    adapter = float(np.mean(per_task))
    total_small, total_full = (sig_small + adapter) / mb, (sig_full + adapter) / mb

    # retrieval accuracy with compressed vs full signatures (both from the same DP-GMM fit: same seed)
    train, test, y = _retrieval_problem(s, gen)
    acc, n_active, nbytes = {}, {}, {}
    Xt = test.to(dev)

    def accuracy(sigs: list[Signature]) -> float:
        res = retrieve([sg.score(Xt).cpu() for sg in sigs])
        return float((res.task == y).double().mean()) * 100.0

    default = SignatureConfig()  # the project's default storage: shared + low-rank, float16 factors
    for name, cov, sd, rank in (
        ("compressed", default.covariance, "float16", default.rank),
        ("full", "full", "float32", s.kb_rank),
    ):
        cfg = SignatureConfig(max_components=s.kb_retrieval_T, covariance=cov, rank=rank, storage_dtype=sd)
        fitted = [fit_signature(H.to(dev), cfg, seed=k) for k, H in enumerate(train)]
        if name == "compressed":  # the same signatures before the float16 round trip
            acc["ppca_float32"] = accuracy(fitted)
        sigs = [_stored(sg) for sg in fitted]
        acc[name] = accuracy(sigs)
        n_active[name] = [sg.n_active for sg in sigs]
        nbytes[name] = float(np.mean([sg.nbytes() for sg in sigs]))
    delta = acc["full"] - acc["compressed"]
    if (s.kb_retrieval_d, s.kb_retrieval_T) == (s.kb_d, s.kb_T):  # real fits at the figure's size
        total_small = (nbytes["compressed"] + adapter) / mb
        sig_small = nbytes["compressed"]
        what = f"fitted default signatures ({default.covariance}, rank {default.rank}, float16 factors)"
    else:
        what = f"PPCA rank {s.kb_rank}, float16 factors (synthetic)"
    log(f"  per task: {total_small:.2f} MB ({what}) vs {total_full:.2f} MB (float32 full covariance)")
    log(f"  retrieval accuracy: full {acc['full']:.2f} %, compressed {acc['compressed']:.2f} % "
        f"(PPCA before the float16 round trip: {acc['ppca_float32']:.2f} %)")  # fmt: skip
    return {
        "kb_mb_per_task": _figure(
            "kb_mb_per_task",
            total_small,
            measured=f"Signature.nbytes (T = {s.kb_T}, d = {s.kb_d}, {what}) "
            f"+ LoRAUnit.task_tensors bytes of {2 * s.kb_vit_blocks} maps (ViT-B q, v) at rank {s.rank}, "
            f"mean over {s.kb_tasks} tasks; MB = 1e6 bytes",
            signature_bytes=sig_small,
            adapter_bytes_mean=adapter,
            adapter_bytes_first_task=per_task[0],
            adapter_bytes_last_task=per_task[-1],
            uncompressed_mb_per_task=total_full,
            uncompressed_signature_bytes=sig_full,
            paper_estimate_mb=48.0,
        ),
        "kb_retrieval_acc_delta": _figure(
            "kb_retrieval_acc_delta",
            delta,
            measured="retrieval accuracy (percent) with float32 full-covariance signatures minus that with "
            "the default compressed signatures (shared + low-rank, float16 factors; each stored and "
            "reloaded), same DP-GMM fits; "
            "positive = the compression loses accuracy",
            acc_full=acc["full"],
            acc_compressed=acc["compressed"],
            acc_ppca_float32=acc["ppca_float32"],
            delta_float16_storage=acc["ppca_float32"] - acc["compressed"],
            tasks=s.kb_tasks,
            d=s.kb_retrieval_d,
            T=s.kb_retrieval_T,
            train_per_task=s.kb_train_per_task,
            test_per_task=s.kb_test_per_task,
            n_active=n_active,
            signature_bytes_mean=nbytes,
        ),
    }


def section_ridge(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    gen = torch.Generator().manual_seed(s.seed)
    centers = torch.randn(s.ridge_classes, s.ridge_d, generator=gen)
    y = torch.randint(s.ridge_classes, (s.ridge_n,), generator=gen)
    H = (centers[y] + 2.0 * torch.randn(s.ridge_n, s.ridge_d, generator=gen)).to(dev)
    y = y.to(dev)
    head = RanPACHead(s.ridge_d, rp_dim=s.ridge_rp_dim, seed=s.seed, device=dev)
    got: dict[str, Any] = {}

    def fast() -> None:
        got["fast"] = head.select_gamma(H, y)

    def naive() -> None:
        got["naive"] = head.select_gamma_naive(H, y)

    t = interleaved(
        {"fast": fast, "naive": naive}, dev, {"fast": s.ridge_fast_reps, "naive": s.ridge_naive_reps},
        {"fast": 1, "naive": 0},
    )  # fmt: skip
    tf, tn = _median(t["fast"]), _median(t["naive"])
    a, b = got["fast"], got["naive"]
    rel = float(((a.losses - b.losses).abs() / b.losses.abs().clamp_min(1e-300)).max())
    same = a.gamma == b.gamma
    log(f"  select_gamma {tf:.3f} s, naive {tn:.3f} s, speedup {tn / tf:.2f}; same gamma: {same}")
    return {
        "ridge_sweep_speedup": _figure(
            "ridge_sweep_speedup",
            tn / tf,
            measured="RanPACHead.select_gamma (one eigh for all candidates) vs select_gamma_naive (one "
            "solve per candidate), both including the random projection",
            rp_dim=s.ridge_rp_dim,
            n=s.ridge_n,
            d=s.ridge_d,
            classes=s.ridge_classes,
            candidates=len(a.gammas),
            method=a.method,
            fast_s=tf,
            naive_s=tn,
            fast_times_s=t["fast"],
            naive_times_s=t["naive"],
            same_gamma=bool(a.gamma == b.gamma),
            gamma=a.gamma,
            max_rel_loss_diff=rel,
        )
    }
