"""Where ``Proteus.predict`` spends its time at m tasks: ``torch.profiler`` over a few calls of the m-forward
route (the paper's Gaussian keys), the same state as ``predict_vs_limit`` (``perf_state._State``), beside m
plain forwards of the frozen backbone. Prints the costliest operators (device time on CUDA, CPU time
elsewhere) and the wall time of each part of the prediction.

    python tools/perf/profile_predict.py --device cuda                   # ViT-B/16 at 224 px, m = 10
    python tools/perf/profile_predict.py --device cpu --backbone vit_ti16 --img 96 --m 5
"""

from __future__ import annotations

import argparse
import time

import torch
from perf_settings import Case, Settings
from perf_state import _State
from torch.profiler import ProfilerActivity, profile

from proteus.distributed import device_for_rank


def _timed(fn, dev: torch.device, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backbone", default="vit_b16")
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--m", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    dev = device_for_rank(args.device)
    s = Settings.for_mode("full", dev)
    st = _State(Case(args.backbone, args.img), dev, s, args.m)
    st.grow(args.m)
    L = st.learner
    L.model_.prepare_merged()
    for _ in range(3):
        st.predict("m_forward")
        st.plain_forward(args.m)
    H, F = L.embed(st.x)
    res = L.retrieve(H, F)
    parts = {
        "predict (m-forward route)": lambda: st.predict("m_forward"),
        "  embed: prefix + m compositions": lambda: L.embed(st.x),
        "  retrieve: m signatures scored": lambda: L.retrieve(H, F),
        "  classify: RanPAC head": lambda: L.classify(H[res.task, torch.arange(H.shape[1])]),
        f"limit: {args.m} plain forwards": lambda: st.plain_forward(args.m),
        "one plain forward": lambda: st.plain_forward(1),
    }
    print(f"{args.backbone}@{args.img}, batch {s.batch}, m = {args.m}, {dev}: median of {args.reps}")
    for name, fn in parts.items():
        print(f"  {name:<36s} {_timed(fn, dev, args.reps) * 1000:8.2f} ms")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            st.predict("m_forward")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
