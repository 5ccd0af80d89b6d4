"""``latency_vs_m``: seconds per batch against the number of tasks m for three prediction routes, beside the
compute limit (m plain forwards), as the paper's latency tables (App. "Complexity of PROTEUS Inference":
0.41 s per batch at 1 task, 3.29 s at 10, 9.59 s at 50 on an A40).

Routes (:data:`perf_state.ROUTES`, all through ``Proteus.predict`` on the same learner and batch):
``m_forward`` -- Alg. 2, every input under every adapter (the paper's Gaussian keys); ``two_stage`` --
LDA keys in the first adapter's space: one forward there, one under the retrieved adapter; ``candidates``
-- the Gaussian keys scored on the LDA keys' shortlist of c tasks (c + 1 forwards). The limit is m times
one plain forward of the frozen backbone, interleaved with them. Merged weights are built before each
point (``AdaptedBackbone.prepare_merged``; their size and build time are reported).

``beyond_paper.two_stage_speedup_m50`` (>= 10) and ``..._m100`` (>= 20): the m-forward time over the
two-stage time at m = 50 and 100, the worst of the backbones measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from perf_settings import FIGURES, PAPER_LATENCY, Case, Settings, _figure
from perf_state import ROUTES, _State
from perf_timing import _median, interleaved


def _latency_case(case: Case, dev: torch.device, s: Settings, log: Callable[[str], None]) -> list[dict]:
    ms = sorted(set(s.latency_ms))
    st = _State(case, dev, s, max(ms))
    st.grow(ms[0])
    for route in ROUTES:  # first-call costs (allocations, lazy initialisation) stay out of the first point
        st.predict(route)
    st.plain_forward(1)
    rows = []
    for m in ms:
        st.grow(m)
        t0 = time.perf_counter()
        cache = st.learner.model_.prepare_merged()
        build = time.perf_counter() - t0
        fns: dict[str, Callable[[], Any]] = {r: (lambda r=r: st.predict(r)) for r in ROUTES}
        fns["plain"] = lambda: st.plain_forward(1)
        fast = s.latency_fast_reps
        reps = {"m_forward": s.latency_reps, "two_stage": fast, "candidates": fast, "plain": fast}
        warm = {"m_forward": s.latency_warmup, "two_stage": 1, "candidates": 1, "plain": 1}
        t = interleaved(fns, dev, reps, warm)
        mf, ts, cs, plain = (_median(t[k]) for k in ("m_forward", "two_stage", "candidates", "plain"))
        task = st.predict("two_stage").task
        rows.append({
            "m": m, "ours_s": mf, "two_stage_s": ts, "candidates_s": cs, "plain_forward_s": plain,
            "limit_s": m * plain, "ratio": m * plain / mf, "two_stage_speedup": mf / ts,
            "candidates_speedup": mf / cs,
            "two_stage_forwards_per_input": 1.0 + float((task != 0).double().mean()),
            "candidates_forwards_per_input": 1 + min(s.candidates, m),
            "merged_cache_mb": cache / 2**20, "merged_cache_build_s": build,
        })  # fmt: skip
        log(f"  {case.label} m={m:3d}: m-forward {mf:.3f} s (limit {m * plain:.3f} s, ratio "
            f"{m * plain / mf:.3f}), two-stage {ts:.3f} s (x{mf / ts:.1f}), candidates {cs:.3f} s "
            f"(x{mf / cs:.1f}), merged cache {cache / 2**20:.0f} MiB")  # fmt: skip
    return rows


def _speedup(key: str, m: int, cases: list[dict]) -> dict:
    pts = [(c["case"], r["two_stage_speedup"]) for c in cases for r in c["rows"] if r["m"] == m]
    if not pts:
        return _figure(key, None, reason=f"m = {m} is not among the measured m (quick and tiny sizes)")
    case, worst = min(pts, key=lambda p: p[1])
    return _figure(
        key, worst, measured=f"m-forward predict time / two-stage predict time at m = {m}; worst case",
        case=case, per_case=dict(pts),
    )  # fmt: skip


def section_latency(
    dev: torch.device, s: Settings, log: Callable[[str], None], out_path: Path | None
) -> dict:
    cases = [{"case": c.label, "rows": _latency_case(c, dev, s, log)} for c in s.latency_cases]
    fig = _plot_latency(cases, s, out_path) if out_path is not None else None
    return {
        "latency_vs_m": {
            "value": cases[0]["rows"],
            "reason": None,
            "case": cases[0]["case"],
            "cases": cases,
            "batch": s.batch,
            "candidates": s.candidates,
            "measured": "Proteus.predict with the first m tasks by three routes on the same learner and "
            "batch: ours_s = every adapter (Alg. 2), two_stage_s = LDA keys in the first adapter's space "
            "(a forward there, one under the retrieved adapter), candidates_s = Gaussian keys on the LDA "
            "keys' shortlist of c tasks; limit = m x one plain forward (interleaved with them); "
            "ratio = limit / ours",
            "paper": PAPER_LATENCY,
            "figure": fig,
        },
        "beyond_paper": {
            "two_stage_speedup_m50": _speedup("two_stage_speedup_m50", 50, cases),
            "two_stage_speedup_m100": _speedup("two_stage_speedup_m100", 100, cases),
        },
    }


def _plot_latency(cases: list[dict], s: Settings, out_path: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    png = out_path.with_suffix(".png")
    fig, axes = plt.subplots(len(cases), 3, figsize=(15, 4 * len(cases)), squeeze=False)
    for (a1, a2, a3), c in zip(axes, cases):
        rows = c["rows"]
        m = [r["m"] for r in rows]
        a1.plot(m, [r["ours_s"] for r in rows], "o-", label="m-forward path (Alg. 2)")
        a1.plot(m, [r["two_stage_s"] for r in rows], "^-", label="two-stage (keys in one space)")
        a1.plot(m, [r["candidates_s"] for r in rows], "v-", label=f"candidates (c = {s.candidates})")
        a1.plot(m, [r["limit_s"] for r in rows], "s--", label="limit: m plain forwards")
        for key, p in PAPER_LATENCY.items():
            a1.plot(p["m"], p["seconds"], ":", marker="x", label=f"paper, {key} (A40, ViT-B/16)")
        a1.set_yscale("log")
        a1.set_xlabel("number of tasks m")
        a1.set_ylabel(f"seconds per batch of {s.batch}")
        a1.set_title(f"latency vs m ({c['case']})", fontsize=9)
        a1.legend(fontsize=7)
        a2.plot(m, [r["two_stage_speedup"] for r in rows], "^-", label="two-stage")
        a2.plot(m, [r["candidates_speedup"] for r in rows], "v-", label=f"candidates (c = {s.candidates})")
        a2.plot([50, 100], [10, 20], "r*", ms=10, label="targets (two-stage)")
        a2.set_xlabel("number of tasks m")
        a2.set_ylabel("speed-up over the m-forward path")
        a2.legend(fontsize=7)
        a3.plot(m, [r["ratio"] for r in rows], "o-", label="m-forward path")
        a3.axhline(
            FIGURES["predict_vs_limit"][1],
            color="r",
            ls="--",
            label=f"target {FIGURES['predict_vs_limit'][1]}",
        )
        a3.set_xlabel("number of tasks m")
        a3.set_ylabel("throughput / compute limit")
        a3.set_ylim(bottom=0)
        a3.legend(fontsize=7)
        for a in (a1, a2, a3):
            a.set_xscale("log")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)
