"""Images per forward on a CPU: ``predict_vs_limit``'s state (m tasks, the paper's m-forward route) predicted
with several values of ``Embedder.cpu_chunk_bytes`` beside m plain forwards of the batch, interleaved in one
process. Prints, per budget, the images per forward it gives and the throughput ratio (limit / predict).

    python tools/perf/chunk_sweep.py --backbone mobilenet_v2 --img 96 --mib 4,8,16,32,0
    python tools/perf/chunk_sweep.py --backbone vit_ti16 --img 224 --mib 8,16,32,0 --reps 3

``0`` switches the cap off (``eval.batch_size`` images per forward, the behaviour before the cap).
"""

from __future__ import annotations

import argparse

import torch
from perf_settings import Case, Settings
from perf_state import _State
from perf_timing import _median, interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="mobilenet_v2")
    ap.add_argument("--img", type=int, default=96)
    ap.add_argument("--m", type=int, default=10)
    ap.add_argument("--mib", default="4,8,16,32,0", help="budgets in MiB, comma-separated; 0: no cap")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cpu")
    st = _State(Case(args.backbone, args.img), dev, Settings.for_mode("full", dev), args.m)
    st.grow(args.m)
    L = st.learner
    L.model_.prepare_merged()
    E = L.embedder_
    z1 = E.prefix(st.x[:1])
    budgets = [float(v) for v in args.mib.split(",")]

    def predict_with(mib: float):  # type: ignore[no-untyped-def]
        def run() -> None:
            E.cpu_chunk_bytes = int(mib * 2**20) if mib > 0 else 2**62
            st.predict("m_forward")

        return run

    fns = {f"{b:g} MiB": predict_with(b) for b in budgets}
    fns["limit"] = lambda: st.plain_forward(args.m)
    t = interleaved(fns, dev, args.reps, warmup=1)
    limit = _median(t.pop("limit"))
    print(
        f"{args.backbone}@{args.img}, m = {args.m}, batch {len(st.x)}, {torch.get_num_threads()} threads: "
        f"limit ({args.m} plain forwards) {limit:.3f} s"
    )
    for b, (name, times) in zip(budgets, t.items()):
        E.cpu_chunk_bytes = int(b * 2**20) if b > 0 else 2**62
        print(
            f"  {name if b > 0 else 'no cap':>8s}: {E.images_per_forward(z1):3d} images per forward, "
            f"predict {_median(times):.3f} s, ratio {limit / _median(times):.3f}"
        )


if __name__ == "__main__":
    main()
