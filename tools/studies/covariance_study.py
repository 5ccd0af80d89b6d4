"""Covariance estimation of the Gaussian signatures (issue 13): learn a sequence once, cache every embedding
the retrieval sees, then fit and score signature variants offline on the same adapters and head.

    # 1. learn once (3-5 min on 2 CPU cores with --config mobilenet_cpu) and cache the embeddings
    python tools/studies/covariance_study.py cache --benchmark folder --data /tmp/abrupt \
        --tasks /tmp/abrupt/tasks.yaml --config mobilenet_cpu --out runs/cache-abrupt.pt
    # 2. score variants on the cache (seconds to minutes each)
    python tools/studies/covariance_study.py score runs/cache-abrupt.pt --variants paper,proteus \
        --set normalize=l2 ...

A variant is a set of ``signature.*`` overrides (``--variant NAME:key=value,key=value``, or a preset
name from :data:`PRESETS`). For every variant the report gives retrieval accuracy, final average
accuracy (head on the retrieved adapter's embedding, as the learner predicts), the retrieval confusion
and, per task, the mean own-task Mahalanobis term divided by d (1 for a calibrated covariance) and the
share of each task's test inputs that every task's signature wins.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from proteus.config import SignatureConfig
from proteus.signatures import fit_signature, retrieve

#: named variants (signature.* overrides on top of the cached run's signature config)
PRESETS: dict[str, dict[str, Any]] = {
    # the paper's recipe as proteus-paper runs it (scikit-learn's Wishart prior, ridge 1e-3 tr/d)
    "paper": {"covariance": "full", "normalize": "none", "prior": "ridge", "prior_scale": "sklearn"},
    # the shipped default before issue 13 (shared storage with a budget of 128 rows per component)
    "old-default": {"covariance": "shared", "rank": 128, "normalize": "none", "prior": "ridge"},
    "l2": {"covariance": "full", "normalize": "l2", "prior": "ridge", "prior_scale": "sklearn"},
    "gaussian": {"method": "gaussian", "covariance": "full", "normalize": "none", "prior": "ridge"},
    "expected": {"covariance": "full", "normalize": "none", "prior": "ridge", "prior_scale": "expected"},
    "expected-oas": {"covariance": "full", "normalize": "none", "prior": "oas", "prior_scale": "expected"},
    "expected-lw": {
        "covariance": "full",
        "normalize": "none",
        "prior": "ledoit-wolf",
        "prior_scale": "expected",
    },
    "expected-l2": {"covariance": "full", "normalize": "l2", "prior": "ridge", "prior_scale": "expected"},
    "expected-l2-oas": {"covariance": "full", "normalize": "l2", "prior": "oas", "prior_scale": "expected"},
    "expected-l2-lw": {
        "covariance": "full",
        "normalize": "l2",
        "prior": "ledoit-wolf",
        "prior_scale": "expected",
    },
    "oas": {"covariance": "full", "normalize": "none", "prior": "oas", "prior_scale": "sklearn"},
}


def cache(args: argparse.Namespace) -> None:
    """Learn the sequence with ``proteus`` and save what retrieval and the head read."""
    sys.path.insert(0, str(Path(__file__).parent))
    from study import resolve

    from proteus import Proteus
    from proteus.experiment import Evaluator
    from proteus.streams import build_benchmark

    cfg = resolve(args, args.method)
    stream = build_benchmark(cfg.benchmark)
    learner = Proteus(cfg, progress=False)
    ev = Evaluator(learner, stream)
    m = len(stream.tasks)
    own_train, frozen_train, y_train = [], [], []
    t0 = time.time()
    for k in range(m):
        learner.fit_task(stream.tasks[k])
        z, y = learner.prefix_dataset(stream.tasks[k].train)
        own_train.append(learner.embed_prefix(z, [k])[0].float())
        frozen_train.append(learner.embed_prefix(z, None)[0].float())
        y_train.append(y)
        print(f"task {k + 1} learned ({time.time() - t0:.0f} s)", flush=True)
    E = [[ev.embedding(t, "task", j).float() for j in range(m)] for t in range(m)]
    head = learner.head_
    logits = [[head.decision_function(E[t][j]).float() for j in range(m)] for t in range(m)]
    out = {
        "config": cfg.to_dict(),
        "own_train": own_train,
        "frozen_train": frozen_train,
        "y_train": y_train,
        "test": E,
        "frozen_test": [ev.embedding(t, "task", None).float() for t in range(m)],
        "y_test": [ev.labels(t) for t in range(m)],
        "logits": logits,
        "classes": [list(t.classes) for t in learner.records_],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, args.out)
    print(f"cached {m} tasks to {args.out} ({time.time() - t0:.0f} s)")


def evaluate_tasks(c: dict[str, Any], task_of: list[torch.Tensor]) -> dict[str, Any]:
    """Retrieval and final accuracy (head on the retrieved adapter) of per-input retrieved tasks."""
    m = len(task_of)
    rows, ok, n = [], 0, 0
    conf = torch.zeros(m, m, dtype=torch.long)
    for t in range(m):
        r = task_of[t]
        lg = torch.stack(c["logits"][t])[r, torch.arange(len(r))]
        rows.append(100.0 * float((lg.argmax(1) == c["y_test"][t]).float().mean()))
        ok += int((r == t).sum())
        n += len(r)
        conf[t] = torch.bincount(r, minlength=m)
    return {"retrieval": 100.0 * ok / n, "final": sum(rows) / m, "acc": rows, "confusion": conf.tolist()}


def score_variant(c: dict[str, Any], sc: SignatureConfig, space: str = "own") -> dict[str, Any]:
    m = len(c["test"])
    t0 = time.time()
    train = c["own_train"] if space == "own" else c["frozen_train"]
    sigs = [fit_signature(train[k], sc, seed=k) for k in range(m)]
    fit_s = time.time() - t0
    task_of, calib = [], []
    for t in range(m):
        test = [c["test"][t][j] if space == "own" else c["frozen_test"][t] for j in range(m)]
        scores = [sigs[j].score(test[j]) for j in range(m)]
        task_of.append(retrieve(scores).task)
        d = test[t].shape[1]
        calib.append(float(sigs[t].mahalanobis(test[t]).min(1).values.mean()) / d)
    res = evaluate_tasks(c, task_of)
    res.update(
        fit_seconds=fit_s,
        n_active=[s.n_active for s in sigs],
        own_maha_over_d=calib,
        bytes_per_task=sum(s.nbytes() for s in sigs) / m,
    )
    return res


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    import yaml

    if spec in PRESETS:
        return spec, dict(PRESETS[spec])
    name, _, rest = spec.partition(":")
    over: dict[str, Any] = dict(PRESETS.get(name, {}))
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        over[k] = yaml.safe_load(v)
    return spec, over


def score(args: argparse.Namespace) -> None:
    c = torch.load(args.cache, weights_only=False)
    base = SignatureConfig(
        **{k: v for k, v in c["config"]["signature"].items() if hasattr(SignatureConfig, k)}
    )
    out: dict[str, Any] = {}
    if Path(args.out or "").is_file():
        out = json.loads(Path(args.out).read_text())
    print(f"{'variant':<58} {'retr':>6} {'final':>6} {'fit s':>6}  own maha/d per task")
    for spec in args.variants:
        name, over = parse_variant(spec)
        space = over.pop("space", "own")
        sc = replace(base, **over)
        try:
            r = score_variant(c, sc, space)
        except Exception as e:  # report and go on
            print(f"{name:<58} error: {e}")
            continue
        out[name] = r
        cal = " ".join(f"{v:.2f}" for v in r["own_maha_over_d"])
        print(
            f"{name:<58} {r['retrieval']:6.2f} {r['final']:6.2f} {r['fit_seconds']:6.1f}  {cal}", flush=True
        )
        if args.confusion:
            print("   confusion:", r["confusion"], " n_active:", r["n_active"])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def heads(args: argparse.Namespace) -> None:
    """Refit the head on the cached training embeddings with each head variant (``head.*`` overrides,
    ``--head NAME:key=value,...``) and report the final accuracy with the true task's adapter (oracle)
    and with the tasks retrieved by the signature variant ``--retrieval``."""
    from proteus.heads import RanPACHead

    c = torch.load(args.cache, weights_only=False)
    m = len(c["test"])
    base = SignatureConfig(
        **{k: v for k, v in c["config"]["signature"].items() if hasattr(SignatureConfig, k)}
    )
    _, over = parse_variant(args.retrieval)
    over.pop("space", None)
    sc = replace(base, **over)
    sigs = [fit_signature(c["own_train"][k], sc, seed=k) for k in range(m)]
    task_of = [retrieve([sigs[j].score(c["test"][t][j]) for j in range(m)]).task for t in range(m)]
    hc = c["config"]["head"]
    print(f"retrieval by {args.retrieval!r}")
    for spec in args.heads:
        name, _, rest = spec.partition(":")
        kw = dict(hc)
        for kv in filter(None, rest.split(",")):
            k, _, v = kv.partition("=")
            kw[k] = v if not v.lstrip("-").isdigit() else int(v)
        head = RanPACHead(
            c["own_train"][0].shape[1], rp_dim=int(kw["rp_dim"]), gamma_min_exp=int(kw["gamma_min_exp"]),
            gamma_max_exp=int(kw["gamma_max_exp"]), holdout=float(kw["holdout"]),
            selection=kw["gamma_selection"], prototypes=kw.get("prototypes", "sum"),
            seed=int(c["config"]["seed"]),
        )  # fmt: skip
        gammas = []
        for k in range(m):
            head.update(c["own_train"][k].double(), c["y_train"][k], num_classes=max(c["classes"][k]) + 1)
            gammas.append(head.gamma_)
        c2 = dict(
            c,
            logits=[
                [head.decision_function(c["test"][t][j].double()).float() for j in range(m)] for t in range(m)
            ],
        )
        oracle = evaluate_tasks(c2, [torch.full((len(c["y_test"][t]),), t) for t in range(m)])
        ret = evaluate_tasks(c2, task_of)
        print(
            f"{name:<40} oracle {oracle['final']:6.2f}  retrieved {ret['final']:6.2f}  gammas {gammas}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("cache")
    a.add_argument("--benchmark", required=True)
    a.add_argument("--data")
    a.add_argument("--tasks", dest="tasks_file")
    a.add_argument("--config", action="append", default=[])
    a.add_argument("--set", action="append", default=[])
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--method", default="proteus")
    a.add_argument("--out", required=True)
    s = sub.add_parser("score")
    s.add_argument("cache")
    s.add_argument("--variants", type=lambda v: v.split(";"), default=list(PRESETS))
    s.add_argument("--out")
    s.add_argument("--confusion", action="store_true")
    h = sub.add_parser("heads")
    h.add_argument("cache")
    h.add_argument("--retrieval", default="paper")
    h.add_argument("--heads", type=lambda v: v.split(";"), required=True)
    args = ap.parse_args()
    {"cache": cache, "score": score, "heads": heads}[args.cmd](args)


if __name__ == "__main__":
    main()
