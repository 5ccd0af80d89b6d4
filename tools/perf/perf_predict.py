"""Prediction sections: ``predict_vs_limit`` (with ``beyond_paper.predict_vs_limit_adapt_last6``) and
``predict_vs_peft_mixed_batch``. ``latency_vs_m`` is in :mod:`perf_latency`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from perf_settings import Settings, _figure
from perf_state import _add_adapters, _predict_case
from perf_timing import _autocast, _median, interleaved

from proteus.adapters import AdaptedBackbone
from proteus.backbones import build_backbone


def section_predict(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    cases = []
    for i, case in enumerate(s.predict_cases):
        reps = s.predict_reps_vit if case.backbone.startswith("vit") else s.predict_reps
        r = _predict_case(case, dev, s, reps, memory=(i == len(s.predict_cases) - 1))
        log(
            f"  {case.label}: ours {r['ours_s']:.3f} s, limit {r['limit_s']:.3f} s, ratio {r['ratio']:.3f}"
            f" (in predict's chunks of {r['images_per_forward']} images: {r['ratio_chunked']:.3f})"
        )
        cases.append(r)
    worst = min(cases, key=lambda c: c["ratio"])
    out: dict[str, Any] = {
        "predict_vs_limit": _figure(
            "predict_vs_limit",
            worst["ratio"],
            measured="Proteus.predict (prefix once, one batched forward of all m compositions, "
            "Signature.score per task, retrieve, RanPAC head) vs m plain forwards of the frozen backbone "
            "(no LoRA) on the same batch; throughput ratio = limit time / ours time; value = worst case; "
            "cases[*].ratio_chunked: the plain forwards in predict's chunks (images_per_forward)",
            cases=cases,
        ),
        "memory": {"predict": {"case": cases[-1]["case"], **cases[-1].get("memory", {})}},
    }
    if s.beyond_case is not None:
        r = _predict_case(s.beyond_case, dev, s, s.predict_reps)
        log(f"  {s.beyond_case.label}: ratio {r['ratio']:.3f} (beyond the paper)")
        out["beyond_paper"] = {
            "predict_vs_limit_adapt_last6": _figure(
                "predict_vs_limit",
                r["ratio"],
                measured="as predict_vs_limit with only the last blocks adapted: the frozen prefix runs "
                "once for all m tasks (not the paper's setting; its accuracy cost is measured elsewhere)",
                cases=[r],
            )
        }
    return out


def section_peft(dev: torch.device, s: Settings, log: Callable[[str], None]) -> dict:
    key = "predict_vs_peft_mixed_batch"
    try:
        from peft import LoraConfig, get_peft_model
    except Exception as e:  # noqa: BLE001 - any import failure is reported
        return {key: _figure(key, None, reason=f"peft is not importable ({type(e).__name__}: {e}); "
                             "install the bench extra: pip install -e '.[bench]'")}  # fmt: skip
    case, n, gen = s.peft_case, s.peft_adapters, torch.Generator().manual_seed(s.seed)
    bb = build_backbone(case.backbone, pretrained=False, img_size=case.img)
    vit = copy.deepcopy(bb.vit)  # the same weights, before any adapter is injected
    ours = AdaptedBackbone(bb).to(dev)
    _add_adapters(ours, n, s, gen)
    cfg = LoraConfig(r=s.rank, lora_alpha=s.rank, target_modules=["qkv"], lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(vit, cfg, adapter_name="task0")
        for k in range(1, n):
            pm.add_adapter(f"task{k}", cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(tuple(p.shape), generator=gen) * s.lora_b_std)
    pm = pm.to(dev).eval()
    x = torch.randn(s.batch, 3, case.img, case.img, generator=gen).to(dev)
    names = [f"task{k}" for k in range(n) for _ in range(s.batch)]
    tasks = list(range(n))

    @torch.no_grad()
    def run_ours() -> torch.Tensor:
        with _autocast(dev):
            return ours.embed(x, tasks)

    @torch.no_grad()
    def run_peft() -> torch.Tensor:
        with _autocast(dev):
            return pm(x.repeat(n, 1, 1, 1), adapter_names=names)

    a, b = run_ours(), run_peft()
    assert a.shape[0] * a.shape[1] == b.shape[0] and a.shape[-1] == b.shape[-1], (a.shape, b.shape)
    t = interleaved({"ours": run_ours, "peft": run_peft}, dev, s.peft_reps, warmup=1)
    to, tp = _median(t["ours"]), _median(t["peft"])
    log(f"  ours {to:.3f} s, peft {tp:.3f} s, speedup {tp / to:.3f}")
    import peft as _peft

    return {
        key: _figure(
            key,
            tp / to,
            compared=(
                f"same {case.label} (timm), same batch of {s.batch}, {n} adapters of rank {s.rank}. "
                f"PEFT {_peft.__version__}: {n} independent LoRA adapters (rank {s.rank}, alpha = rank) on "
                "the fused qkv projection (PEFT adapts the whole qkv output; ours the q and v rows), "
                f"input = the batch repeated {n} times (the repeat is timed) with adapter_names per sample "
                f"(mixed-batch forward, a Python loop over adapters in every LoRA layer). Ours: "
                f"AdaptedBackbone.embed(x, tasks=range({n})): one batched forward where group k applies "
                f"task k's composition (its own rank-{s.rank} directions plus S over all older ones)"
            ),
            ours_s=to,
            peft_s=tp,
            ours_times_s=t["ours"],
            peft_times_s=t["peft"],
            peft_version=_peft.__version__,
        )
    }
