"""Accuracy of the candidate shortlist (``retrieval.candidates = c``) against the paper's retrieval over
every task, on one knowledge base's test sets (docs/performance.md, "Prediction cost and m").

The knowledge base must hold the cheap keys (learned with ``--set retrieval.candidates=C``, any C): the
adapters, Gaussian keys and head do not depend on them, so the same knowledge base gives the paper's
numbers with the shortlist off. Every test image is embedded once under every adapter (the evaluator's
caches), then retrieval and Eq. 23 run for c = 1 .. m and for the full path::

    proteus run --benchmark cifar10 --data ../shared/data/cifar10-subset --config mobilenet_cpu \\
        --set benchmark.max_train_per_class=300 --set retrieval.candidates=3 --out runs/cand
    python tools/perf/candidates_accuracy.py runs/cand/kb --out runs/cand/candidates.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from proteus import Proteus
from proteus.experiment.evaluate import Evaluator
from proteus.streams import build_benchmark


def measure(kb: str, data: str | None = None, cs: list[int] | None = None) -> dict:
    """Final-step accuracy (mean over the test sets), retrieval accuracy and shortlist recall per c."""
    clf = Proteus.load(kb)
    if data:
        clf.config.benchmark.data = data
    stream = build_benchmark(clf.config.benchmark)
    m = clf.num_tasks
    clf.keys_.candidates = 1
    if not getattr(clf.keys_, "shortlists", False):
        raise SystemExit(f"{kb}: no cheap keys stored (learn with --set retrieval.candidates=C)")
    ev = Evaluator(clf, stream)
    rows = []
    for c in [None, *(cs or range(1, m + 1))]:
        clf.keys_.candidates = c
        e = ev.evaluate(m - 1)
        recall = None
        if c is not None:  # the true task among the shortlist (what c = m would retrieve at most)
            hits = total = 0
            for tau in range(m):
                H, F = ev.embedded(tau)
                X = clf.keys_.candidate_space.select(H, F)
                cand = clf.keys_.shortlist(X, m, [t.classes for t in clf.records_])
                hits += int((cand == tau).any(1).sum())
                total += cand.shape[0]
            recall = 100.0 * hits / total
        rows.append({"candidates": c, "final_avg_acc": sum(e.row) / len(e.row), "acc_row": e.row,
                     "retrieval_acc": e.retrieval_acc, "shortlist_recall": recall})  # fmt: skip
    full = rows[0]
    for r in rows:
        r["acc_delta_vs_full"] = r["final_avg_acc"] - full["final_avg_acc"]
        r["retrieval_delta_vs_full"] = r["retrieval_acc"] - full["retrieval_acc"]
    return {"kb": kb, "tasks": m, "benchmark": clf.config.benchmark.name, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kb", help="a knowledge base learned with retrieval.candidates set")
    ap.add_argument("--data", help="dataset root (default: the one the knowledge base was learned from)")
    ap.add_argument("--cs", help="comma-separated c values (default 1..m)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cs = [int(c) for c in args.cs.split(",")] if args.cs else None
    rep = measure(args.kb, args.data, cs)
    print("candidates  final avg acc  (vs full)  retrieval acc  (vs full)  shortlist recall")
    for r in rep["rows"]:
        c = "full" if r["candidates"] is None else str(r["candidates"])
        rec = "" if r["shortlist_recall"] is None else f"{r['shortlist_recall']:.2f}"
        print(f"{c:>10}  {r['final_avg_acc']:13.2f}  {r['acc_delta_vs_full']:+9.2f}  "
              f"{r['retrieval_acc']:13.2f}  {r['retrieval_delta_vs_full']:+9.2f}  {rec:>16}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
