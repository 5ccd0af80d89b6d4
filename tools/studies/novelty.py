"""Inputs from no learned task (issue 15): how well each score separates them from the learned tasks' inputs.

Three settings, each a knowledge base learned on one stream and shown test images from another:

* ``cifar-vs-digits``: learned the CIFAR-10 subset (5 tasks), shown handwritten digits;
* ``digits-vs-cifar``: learned the quickstart digits (5 tasks), shown CIFAR-10 test images;
* ``cifar-disjoint``: learned CIFAR-10 tasks 1-3, shown the test images of tasks 4-5.

Scores (higher = "from no learned task"): the retrieved task's key score minus its calibrated threshold
(``novelty``, for the paper's Gaussian keys and for the LDA keys); a two-sided ``typicality`` score, the
distance of the key score from the median of the task's held-out scores in interquartile ranges (an input
whose likelihood is unusually *high* is as suspect as one whose likelihood is low: simple images such as
digits can be denser under natural-image Gaussians than natural images are); and 1 - the head's maximum
softmax over all classes (the usual baseline). Reported: AUROC, the false-positive rate at 95% true positives
(the share of unknown inputs accepted when 95% of known ones are), and the share of known / unknown test
inputs that the stored thresholds (``retrieval.reject_tpr``) accept.

    python tools/studies/novelty.py --cifar ../shared/data/cifar10-subset --out runs/novelty.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.metrics import roc_auc_score, roc_curve

from proteus import Proteus
from proteus.experiment import resolve_config
from proteus.streams import build_benchmark

#: the key each method retrieves with (``--methods``)
KEYS = {"proteus": "gaussian keys", "proteus-paper": "gaussian keys, paper", "proteus-lda": "LDA keys"}


def _scores(clf: Proteus, images: list[Any]) -> dict[str, np.ndarray]:
    out: dict[str, list[np.ndarray]] = {"novelty": [], "known": [], "maxsoftmax": [], "typicality": []}
    cal = [torch.tensor(t.calibration["scores"], dtype=torch.float64) for t in clf.records_]  # type: ignore[index]
    med = torch.stack([c.median() for c in cal])
    iqr = torch.stack([(c.quantile(0.75) - c.quantile(0.25)).clamp_min(1e-9) for c in cal])
    for i in range(0, len(images), 64):
        pred = clf.predict(clf.transform_images(images[i : i + 64]))
        assert pred.novelty is not None and pred.known is not None
        out["novelty"].append(pred.novelty.numpy())
        out["known"].append(pred.known.numpy())
        out["maxsoftmax"].append(1 - torch.softmax(pred.logits.double(), 1).max(1).values.numpy())
        t = pred.task
        assert t is not None and pred.score is not None
        out["typicality"].append(((pred.score.double() - med[t]).abs() / iqr[t]).numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def _metrics(known: np.ndarray, unknown: np.ndarray) -> dict[str, float]:
    y = np.r_[np.zeros(len(known)), np.ones(len(unknown))]
    s = np.r_[known, unknown]
    fpr, tpr, _ = roc_curve(1 - y, -s)  # "known" is the positive class at 95% true positives
    return {"auroc": float(roc_auc_score(y, s)), "fpr_at_95tpr": float(fpr[np.searchsorted(tpr, 0.95)])}


def _images(stream: Any, tasks: range, split: str, per_task: int | None) -> list[Any]:
    out = []
    for t in tasks:
        ds = getattr(stream.tasks[t], split)
        n = len(ds) if per_task is None else min(per_task, len(ds))
        out += [ds[i][0] for i in range(n)]
    return out


def run_setting(name: str, learned: dict[str, Any], tasks: range, unknown: list[Any], args: Any) -> dict:
    rows: dict[str, Any] = {}
    for method in args.methods:
        label = f"{KEYS.get(method, method)} ({method})"
        cfg = resolve_config(learned["benchmark"], method=method, config_files=["mobilenet_cpu"], sets=[
            "retrieval.reject=true", f"benchmark.max_train_per_class={args.max_train}", f"seed={args.seed}",
            *learned.get("sets", [])])  # fmt: skip
        t0 = time.time()
        clf = Proteus(cfg, progress=False)
        stream = build_benchmark(cfg.benchmark)
        for t in tasks:
            clf.fit_task(stream.tasks[t])
        known = _images(stream, tasks, "test", args.max_test)
        sk, su = _scores(clf, known), _scores(clf, unknown)
        rows[label] = {
            "novelty": _metrics(sk["novelty"], su["novelty"]),
            "max softmax": _metrics(sk["maxsoftmax"], su["maxsoftmax"]),
            "typicality": _metrics(sk["typicality"], su["typicality"]),
            "accepted_known": float(sk["known"].mean()),
            "accepted_unknown": float(su["known"].mean()),
            "n_known": len(known),
            "n_unknown": len(unknown),
            "seconds": time.time() - t0,
        }
        print(name, label, json.dumps(rows[label]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cifar", required=True, help="CIFAR-10 ImageFolder root (train/ and test/)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--max-train", type=int, default=300, help="training images per class")
    ap.add_argument("--max-test", type=int, default=200, help="test images per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", type=lambda v: v.split(","), default=["proteus", "proteus-lda"])
    args = ap.parse_args()
    cifar = {"benchmark": "cifar10", "sets": [f"benchmark.data={args.cifar}"]}
    digits = {"benchmark": "quickstart"}
    c_stream = build_benchmark(resolve_config("cifar10", sets=[f"benchmark.data={args.cifar}"]).benchmark)
    d_stream = build_benchmark(resolve_config("quickstart").benchmark)
    settings = {
        "cifar-vs-digits": (cifar, range(5), _images(d_stream, range(5), "test", 100)),
        "digits-vs-cifar": (digits, range(5), _images(c_stream, range(5), "test", 100)),
        "cifar-disjoint": (cifar, range(3), _images(c_stream, range(3, 5), "test", 200)),
    }
    res = {name: run_setting(name, *setting, args) for name, setting in settings.items()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    head = (
        f"{'AUROC novelty':>13} {'FPR@95':>7} {'AUROC typical':>13} {'AUROC max-softmax':>17} {'FPR@95':>7}"
    )
    print(f"{'setting':<16} {'keys':<24} {head}")
    for s, rows in res.items():
        for label, r in rows.items():
            print(f"{s:<16} {label:<24} {r['novelty']['auroc']:>13.3f} {r['novelty']['fpr_at_95tpr']:>7.3f} "
                  f"{r['typicality']['auroc']:>13.3f} "
                  f"{r['max softmax']['auroc']:>17.3f} {r['max softmax']['fpr_at_95tpr']:>7.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
