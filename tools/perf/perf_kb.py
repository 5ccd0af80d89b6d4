"""Storage and head sections: ``kb_mb_per_task`` / ``kb_retrieval_acc_delta`` and ``ridge_sweep_speedup``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from perf_settings import Settings, _figure
from perf_timing import _median, interleaved

from proteus.adapters import LoRAUnit
from proteus.config import resolve_config
from proteus.heads import RanPACHead


def _scale_check() -> Any:
    """tools/studies/scale_check.py: the synthetic CIFAR-100-on-ViT-B/16 stream through the learner's code."""
    studies = str(Path(__file__).resolve().parents[1] / "studies")
    if studies not in sys.path:
        sys.path.insert(0, studies)
    import scale_check

    return scale_check


def section_kb(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    """Bytes per task and the retrieval cost of the default storage, measured by the scale check (issue 13):
    ``proteus``'s signatures fitted on a stream shaped like CIFAR-100 on ViT-B/16 features (d = 768, 10 tasks
    of 10 classes, 5,000 training and 1,000 test embeddings per task, multi-modal classes), stored as the
    default stores them and as full float32 covariances of the same fits."""
    sc = _scale_check()
    mb = 1e6
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

    shape = sc.Shape(
        d=s.kb_retrieval_d, tasks=s.kb_tasks, classes=s.kb_classes, train=s.kb_train_per_task,
        test=s.kb_test_per_task, rank=min(32, s.kb_retrieval_d), seed=s.seed,
    )  # fmt: skip
    default = resolve_config(None, "proteus").signature
    storages = {
        "full": sc.STORAGES["full"],
        "default": {
            "covariance": default.covariance,
            "rank": default.rank,
            "storage_dtype": default.storage_dtype,
        },
    }
    r = sc.run_recipe(sc.SyntheticStream(shape), "proteus", s.kb_rp_dim, storages)
    full, dflt = r["options"]["full"], r["options"]["default"]
    total, total_full = (dflt["bytes_per_task"] + adapter) / mb, (full["bytes_per_task"] + adapter) / mb
    delta = full["retrieval"] - dflt["retrieval"]
    what = f"proteus's default storage ({default.covariance}, rank {default.rank}, {default.storage_dtype})"
    log(f"  per task: {total:.2f} MB ({what}) vs {total_full:.2f} MB (float32 full covariances)")
    log(f"  retrieval: full {full['retrieval']:.2f} %, default {dflt['retrieval']:.2f} %, "
        f"agreement {dflt['agreement']:.2f} % (components per task {r['n_active']})")  # fmt: skip
    common = dict(shape=vars(shape), n_active=r["n_active"], fit_seconds=r["fit_seconds"])
    return {
        "kb_mb_per_task": _figure(
            "kb_mb_per_task",
            total,
            measured=f"Signature.nbytes of fitted signatures ({what}; scale check, d = {shape.d}, "
            f"{shape.train} training embeddings per task) + LoRAUnit.task_tensors bytes of "
            f"{2 * s.kb_vit_blocks} maps (ViT-B q, v) at rank {s.rank}, mean over {s.kb_tasks} tasks; "
            "MB = 1e6 bytes",
            signature_bytes=dflt["bytes_per_task"],
            adapter_bytes_mean=adapter,
            adapter_bytes_first_task=per_task[0],
            adapter_bytes_last_task=per_task[-1],
            full_covariance_mb_per_task=total_full,
            full_covariance_signature_bytes=full["bytes_per_task"],
            paper_estimate_mb=48.0,
            **common,
        ),
        "kb_retrieval_acc_delta": _figure(
            "kb_retrieval_acc_delta",
            delta,
            measured="scale check (tools/studies/scale_check.py): retrieval accuracy (percent) of proteus's "
            "signatures stored as float32 full covariances minus that of the default storage, same DP-GMM "
            "fits; positive = the default storage loses accuracy",
            acc_full=full["retrieval"],
            acc_default=dflt["retrieval"],
            agreement=dflt["agreement"],
            final_full=full["final"],
            final_default=dflt["final"],
            **common,
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
        got["naive"] = head.select_gamma(H, y, reference=True)

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
            measured="RanPACHead.select_gamma (one eigh for all candidates) vs select_gamma(reference=True) "
            "(one solve per candidate), both including the random projection",
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
