"""What prediction costs each method as its tasks grow: seconds per batch of ``--batch`` held-out images at
m = 5 and m = 50 learned tasks (``--m``), the methods side by side in one run, interleaved.

PROTEUS's default route scores the LDA keys once (one forward under the first adapter), then embeds each
input under the adapters of its two likeliest tasks and runs its task detector on the keys' shortlist;
TOSCA runs the backbone once and every task's module on its last embedding, then picks the task of least
entropy; MOS refines its choice with forwards under the chosen adapters; TUNA weighs every task's adapter by
the entropy of its head; MoAL runs one adapter (momentum-merged) and its analytic head; KLDA runs the frozen
backbone and one LDA over random Fourier features; RanPAC has one adapter and no retrieval (the floor). The
cost each method adds per task is the growth from m = 5 to m = 50 (the ``ratio`` column).

Each method learns the same synthetic tasks (:func:`perf_long.synthetic_task`: 2 classes of random patterns,
``--per-class`` training images each) on the same randomly initialised MobileNetV2 (``--img`` px, the
last 6 blocks adapted, one epoch), then predicts the same batch (images of the first m tasks' test sets):
the methods are timed in turns (:func:`perf_timing.interleaved`, ``--reps`` each, medians).

    cd tools/perf && python perf_rivals_predict.py --methods proteus,tosca,moal,klda,mos,tuna,ranpac \
        --m 5,50 --out ../../runs/rivals_predict.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from proteus.config import resolve_config
from proteus.experiment.store import build_learner

sys.path.insert(0, str(Path(__file__).parent))
from perf_long import held_out, synthetic_task  # noqa: E402
from perf_timing import _median, interleaved  # noqa: E402

#: the settings every method learns with (the long-stream harness's, beside each method's own recipe)
COMMON = [
    "backbone.name=mobilenet_v2", "backbone.pretrained=false", "backbone.adapt_last=6", "train.epochs=1",
    "train.batch_size=16", "device=cpu", "report.figures=false", "report.latency=false",
]  # fmt: skip
#: what only some methods read (``moal`` as its rows in docs/retrieval.md run it: without the drift map)
OWN = {
    "proteus": ["adapter.rank=2", "head.rp_dim=256"], "ranpac": ["adapter.rank=2", "head.rp_dim=256"],
    "moal": ["baseline.drift_epochs=0"],
}  # fmt: skip


def learner(method: str, img: int, seed: int) -> Any:
    sets = [*COMMON, f"backbone.img_size={img}", f"seed={seed}", *OWN.get(method, [])]
    return build_learner(resolve_config("quickstart", method=method, sets=sets), progress=False)


def run(methods: list[str], ms: list[int], *, batch: int, per_class: int, img: int, reps: int,
        seed: int, log: Any = print) -> dict[str, Any]:  # fmt: skip
    clfs = {m: learner(m, img, seed) for m in methods}
    learned, fit_s = 0, {m: 0.0 for m in methods}
    rows: list[dict[str, Any]] = []
    for m in sorted(ms):
        for k in range(learned, m):
            task = synthetic_task(k, per_class, img, seed)
            for name, clf in clfs.items():
                t0 = time.perf_counter()
                clf.fit_task(task)
                fit_s[name] += time.perf_counter() - t0
        learned = m
        refs = [(i % m, (i // m) % 8) for i in range(batch)]  # images of every learned task, in turn
        images = [x for x, _ in held_out(refs, per_class, img, seed)]
        xs = {name: clf.transform_images(images) for name, clf in clfs.items()}
        fns = {name: (lambda c=clf, x=xs[name]: c.predict(x)) for name, clf in clfs.items()}
        times = interleaved(fns, torch.device("cpu"), reps)
        row = {"m": m, "seconds": {name: _median(t) for name, t in times.items()}}
        rows.append(row)
        log(f"m = {m}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in row["seconds"].items()))
    first, last = rows[0]["seconds"], rows[-1]["seconds"]
    return {
        "methods": methods, "m": sorted(ms), "batch": batch, "per_class": per_class, "img": img, "reps": reps,
        "threads": torch.get_num_threads(), "rows": rows,
        "ratio_last_vs_first": {n: last[n] / first[n] for n in methods},
        "fit_seconds_total": fit_s,
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    """The report as the page's table: seconds per batch at each m, and the growth."""
    ms = report["m"]
    head = "| method | " + " | ".join(f"m = {m} (ms)" for m in ms) + f" | m = {ms[-1]} / m = {ms[0]} |"
    lines = [head, "| --- |" + " ---: |" * (len(ms) + 1)]
    for n in report["methods"]:
        cells = [f"{r['seconds'][n] * 1e3:.1f}" for r in report["rows"]]
        lines.append(f"| `{n}` | " + " | ".join(cells) + f" | {report['ratio_last_vs_first'][n]:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="proteus,tosca,moal,klda,mos,tuna,ranpac")
    ap.add_argument("--m", default="5,50", help="numbers of learned tasks to time prediction at")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--per-class", type=int, default=16)
    ap.add_argument("--img", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="the report (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = run(
        args.methods.split(","), [int(m) for m in args.m.split(",")], batch=args.batch,
        per_class=args.per_class, img=args.img, reps=args.reps, seed=args.seed,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
