"""``proteus bench``: the performance harness (issue 7). One process, one run, every figure a ratio.

Each figure compares a measured quantity with its reference *side by side in the same process*: the
measured and the reference repetitions are interleaved (A B, B A, A B, ...; the order alternates each
round so that neither side always runs on a warmer cache), and the medians are compared. Absolute
times are reported as well, but only the ratios are meant to be compared across machines: the ratios
cancel most of the noise of a shared machine, absolute times do not.

Figures (the JSON keys; each record holds ``value``, ``target``, ``op``, ``pass``, ``reason`` and
``details``; ``value`` is ``null`` with a ``reason`` when a figure could not be measured):

``predict_vs_limit`` (>= 0.8)
    Throughput of Algorithm 2 as the learner runs it (:meth:`Proteus.predict`: prefix once,
    one batched forward of all m task compositions, signature scores, retrieval, RanPAC head) divided by
    the compute limit, m plain forwards of the frozen backbone (no LoRA) on the same batch. m = 10,
    batch 32, every block adapted (``adapt_last = None``, the paper's setting). The value is the worst
    of the backbones measured; ``beyond_paper.predict_vs_limit_adapt_last6`` repeats it with a shared
    frozen prefix (MobileNetV2, last 6 blocks adapted).
``latency_vs_m`` (a table and ``<out>.png``; ``beyond_paper.two_stage_speedup_m50`` >= 10, ``_m100`` >= 20)
    The same measurement for m = 1..100 (the paper's two latency tables) by three routes: every adapter
    (Alg. 2), two stages with keys in one space, and a shortlist of c = 3 candidates.
``predict_vs_peft_mixed_batch`` (>= 1.5)
    HuggingFace PEFT's mixed-batch LoRA forward (``adapter_names`` per sample, one Python loop over the
    adapters in every LoRA layer) over the batch repeated once per adapter, divided by our one batched
    forward over the same number of task compositions, same timm ViT, same batch.
``dpgmm_speedup_vs_sklearn`` (>= 10), ``dpgmm_heldout_loglik_rel_diff`` (<= 0.01)
    :class:`proteus.signatures.DPGMM` against scikit-learn's ``BayesianGaussianMixture`` (Dirichlet
    process, full covariances), same data, truncation, priors, ``max_iter``, ``tol`` and seed; held-out
    mean log-likelihood (``score_samples``) relative difference.
``train_step_overhead`` (<= 1.25)
    A PROTEUS training step at task 10 (nine tasks of frozen directions, learned S with its proximal
    step, orthogonal new directions) over a plain LoRA step of the same rank on the same maps (a fresh
    adapter at task 1): forward, backward and optimiser step on the same cached-prefix batch.
``kb_mb_per_task`` (<= 10 MB), ``kb_retrieval_acc_delta`` (<= 0.5 points)
    The scale check (tools/studies/scale_check.py: d = 768, 10 tasks, 5,000 training embeddings per
    task): bytes per task of ``proteus``'s fitted signatures in the default storage plus the adapter
    tensors of a ViT-B (12 blocks x q, v x rank 4); and the retrieval accuracy of float32 full
    covariances of the same fits minus that of the default storage.
``ridge_sweep_speedup`` (>= 10)
    :meth:`RanPACHead.select_gamma` (one eigendecomposition for all gamma candidates) against
    ``RanPACHead.select_gamma(reference=True)`` (RanPAC's one solve per candidate).
``beyond_paper.compile_speedup`` (>= 1, informative)
    :meth:`Proteus.predict` eager over the same with ``compile=default`` (``torch.compile`` of the
    backbone's forwards), interleaved after warm-up; compile time, graphs built and the logits' largest
    difference in ``details`` (:mod:`perf_compile`).

Peak memory of prediction and of a training step is reported under ``memory`` (CUDA:
``max_memory_allocated``; CPU: the peak resident set size sampled every 2 ms by a thread, minus the
resident size at entry, and the ``ru_maxrss`` increase).

Code: this module drives the sections and prints the table; :mod:`perf_settings` (figures, sizes),
:mod:`perf_timing` (interleaving, memory), :mod:`perf_state` (the m-task learner built without training),
:mod:`perf_predict`, :mod:`perf_latency`, :mod:`perf_fits` (DP-GMM, training step), :mod:`perf_kb`
(storage, ridge sweep) hold the rest.

Sizes: the default run targets 2 CPU cores in about 15 minutes, ``--quick`` in a few minutes, and the
environment variable ``PROTEUS_BENCH_TINY=1`` (or ``--tiny`` of ``benchmarks/perf.py``) shrinks
everything to a smoke test. ``PROTEUS_BENCH_ONLY=predict,dpgmm`` runs some sections only (the others
are reported as skipped); ``PROTEUS_BENCH_THREADS=N`` sets torch's intra-op threads (on a shared,
busy machine one thread avoids OpenMP barrier stalls that can slow small operations tenfold). The same
code serves ``--device cuda``: settings switch to the paper's ViT-B/16 there, timed regions
synchronise the device, and backbone forwards run under bfloat16 autocast as in the learner.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from perf_compile import section_compile
from perf_fits import section_dpgmm, section_train
from perf_kb import section_kb, section_ridge
from perf_latency import section_latency
from perf_predict import section_peft, section_predict
from perf_settings import FIGURES, SECTIONS, Settings, _figure
from perf_timing import PeakMemory, interleaved

from proteus.distributed import device_for_rank as resolve_device

__all__ = ["Settings", "main", "run", "interleaved", "PeakMemory", "FIGURES"]


# ====================================================================== driver
def describe_device(dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": dev.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        out["cpu"] = platform.processor() or None
    if hasattr(os, "getloadavg"):
        out["load_average_at_start"] = [round(v, 2) for v in os.getloadavg()]
    if dev.type == "cuda":
        out["name"] = torch.cuda.get_device_name(dev)
        out["cuda"] = torch.version.cuda
    else:
        out["name"] = out.get("cpu") or "cpu"
    return out


def _mode(quick: bool, tiny: bool) -> str:
    return "tiny" if tiny else "quick" if quick else "full"


def run(
    device: str = "auto",
    quick: bool = False,
    tiny: bool = False,
    out: str | Path | None = None,
    only: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the harness and return the report (also written to ``out`` as JSON, with ``out``.png)."""
    log = log or (lambda msg: print(msg, flush=True))
    dev = resolve_device(device)
    s = Settings.for_mode(_mode(quick, tiny), dev)
    unknown = set(only or []) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    out_path = Path(out) if out else None
    report: dict[str, Any] = {
        "proteus_bench": 1,
        "device": describe_device(dev),
        "settings": asdict(s),
        "memory": {},
        "beyond_paper": {},
        "latency_vs_m": {"value": None, "reason": "not run"},
        "section_seconds": {},
    }
    for key in FIGURES:
        report[key] = _figure(key, None, reason="not run")
    t_all = time.perf_counter()
    threads0 = torch.get_num_threads()
    env_threads = os.environ.get("PROTEUS_BENCH_THREADS", "")
    if env_threads.strip():
        s.threads = int(env_threads)
    if s.threads:
        torch.set_num_threads(s.threads)
    report["device"]["threads"] = torch.get_num_threads()
    report["settings"]["threads"] = s.threads
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if dev.type == "cpu" and torch.get_num_threads() > 1 and load > (os.cpu_count() or 1):
        log(f"[bench] load average {load:.1f} exceeds {os.cpu_count()} cores: timings will be noisy; "
            "PROTEUS_BENCH_THREADS=1 avoids OpenMP stalls on a busy machine")  # fmt: skip
    try:
        _run_sections(report, dev, s, only, out_path, log)
    finally:
        torch.set_num_threads(threads0)
    report["total_seconds"] = time.perf_counter() - t_all
    if hasattr(os, "getloadavg"):
        report["device"]["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    return report


def _run_sections(
    report: dict[str, Any],
    dev: torch.device,
    s: Settings,
    only: list[str] | None,
    out_path: Path | None,
    log: Callable[[str], None],
) -> None:
    for name, keys in SECTIONS.items():
        # tracing and compiling take minutes on a CPU (170 s at the tiny sizes with the eager backend): the
        # compile section runs there only when named (tests/test_compile.py checks compiled prediction)
        opt_in = name == "compile" and dev.type == "cpu"
        if (only and name not in only) or (opt_in and not only):
            reason = f"section {name!r} skipped (PROTEUS_BENCH_ONLY / --only)"
            if opt_in and not only:
                reason = (
                    "section 'compile' runs on a CPU only when named (--only compile): minutes to compile"
                )
            for key in keys:
                report[key]["reason"] = reason
            if name == "latency":
                report["latency_vs_m"]["reason"] = reason
            continue
        log(f"[bench] {name} ...")
        t0 = time.perf_counter()
        try:
            if name == "predict":
                res = section_predict(dev, s, log)
            elif name == "latency":
                res = section_latency(dev, s, log, out_path)
            elif name == "peft":
                res = section_peft(dev, s, log)
            elif name == "dpgmm":
                res = section_dpgmm(dev, s, log)
            elif name == "train":
                res = section_train(dev, s, log)
            elif name == "kb":
                res = section_kb(dev, s, log)
            elif name == "compile":
                res = section_compile(dev, s, log)
            else:
                res = section_ridge(dev, s, log)
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            reason = f"{type(e).__name__}: {e}"
            log(f"[bench] {name} failed: {reason}")
            res = {key: _figure(key, None, reason=reason) for key in keys}
            if name == "latency":
                res = {"latency_vs_m": {"value": None, "reason": reason}}
        for key, val in res.items():
            if key in ("memory", "beyond_paper"):
                report[key].update(val)
            else:
                report[key] = val
        report["section_seconds"][name] = time.perf_counter() - t0
        if out_path is not None:  # what is measured so far survives a run stopped by a time limit
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _fmt(v: float | None) -> str:
    if v is None:
        return "null"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.3f}"


def format_table(report: dict[str, Any]) -> str:
    """The printed summary: figure, measured, target, pass/fail (and the reason of a null)."""
    rows = [("figure", "measured", "target", "result")]
    recs = [(k, report[k]) for k in FIGURES]
    recs += [(f"beyond: {k}", v) for k, v in report.get("beyond_paper", {}).items()]
    for key, r in recs:
        res = "n/a" if r["pass"] is None else "pass" if r["pass"] else "FAIL"
        rows.append((key, _fmt(r["value"]), f"{r['op']} {r['target']:g}", res))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    for key, r in recs:
        if r["value"] is None:
            lines.append(f"  {key}: {r['reason']}")
    lat = report.get("latency_vs_m", {})
    for case in lat.get("cases") or (
        [{"case": lat.get("case"), "rows": lat["value"]}] if lat.get("value") else []
    ):
        lines.append(
            f"latency_vs_m [{case['case']}] s per batch: m-forward (limit/ours) | two-stage | candidates"
        )
        for p in case["rows"]:
            extra = ""
            if "two_stage_s" in p:
                extra = f" | {p['two_stage_s']:.3f} (x{p['two_stage_speedup']:.1f})"
                extra += f" | {p['candidates_s']:.3f} (x{p['candidates_speedup']:.1f})"
            lines.append(f"  m={p['m']:3d}: {p['ours_s']:.3f} ({p['ratio']:.2f}){extra}")
    dv = report["device"]
    total = report.get("total_seconds", 0.0)
    lines.append(f"device: {dv.get('name')} ({dv['type']}, {dv['threads']} threads); total {total:.1f} s")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``proteus bench`` (``args.out``, ``args.quick``, ``args.device``; optional
    ``args.tiny`` and ``args.only``, else the environment variables ``PROTEUS_BENCH_TINY`` and
    ``PROTEUS_BENCH_ONLY``)."""
    tiny = bool(getattr(args, "tiny", False)) or os.environ.get("PROTEUS_BENCH_TINY", "") not in ("", "0")
    only = getattr(args, "only", None) or os.environ.get("PROTEUS_BENCH_ONLY") or None
    if isinstance(only, str):
        only = [x.strip() for x in only.split(",") if x.strip()]
    report = run(
        device=getattr(args, "device", "auto") or "auto",
        quick=bool(getattr(args, "quick", False)),
        tiny=tiny,
        out=getattr(args, "out", None),
        only=only,
    )
    print(format_table(report))
    if getattr(args, "out", None):
        print(f"report written to {args.out}")
    return 0
