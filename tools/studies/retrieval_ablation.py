"""Retrieval ablation (issue 6): learn a sequence once, then score many retrieval variants on the same
adapters, head and test embeddings, so that every variant is compared on identical models.

    python tools/studies/retrieval_ablation.py --benchmark cifar10 --data ../shared/data/cifar10-subset \
        --config mobilenet_cpu --out runs/retrieval-cifar10.json

For each variant it reports retrieval accuracy, final average accuracy (head on the retrieved
adapter's embedding) and the oracle accuracy (true task's adapter). Variants only change how a task is
retrieved; the adapters and the head are the learner's own.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from study import TiedLDA, mirrored_prefix, parser, resolve

from proteus import Proteus
from proteus.config import SignatureConfig
from proteus.experiment import Evaluator
from proteus.signatures import fit_signature, retrieve


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--groups",
        default="signatures,lda",
        help="comma-separated variant groups: signatures (Gaussian keys, fusions), lda (LDA keys, TTA)",
    )
    args = ap.parse_args()
    groups = set(args.groups.split(","))
    cfg = resolve(args, "proteus")
    from proteus.streams import build_benchmark

    stream = build_benchmark(cfg.benchmark)
    learner = Proteus(cfg, progress=False)
    ev = Evaluator(learner, stream)
    m = len(stream.tasks)
    own_train: list[torch.Tensor] = []
    frozen_train: list[torch.Tensor] = []
    first_train: list[torch.Tensor] = []  # every task's training inputs under the first task's adapter
    cross_train: list[torch.Tensor] = []  # task k's training inputs under adapters 0..k: (k + 1, N, d)
    y_train: list[torch.Tensor] = []
    t0 = time.time()
    for k in range(m):
        learner.fit_task(stream.tasks[k])
        z, y = learner.prefix_dataset(stream.tasks[k].train)
        cross_train.append(learner.embed_prefix(z, list(range(k + 1))))
        own_train.append(cross_train[k][k])
        first_train.append(cross_train[k][0])
        frozen_train.append(learner.embed_prefix(z, None)[0])
        y_train.append(y)
        print(f"task {k + 1} learned ({time.time() - t0:.0f} s)", flush=True)
    ys = [ev.labels(t) for t in range(m)]
    E = [[ev.embedding(t, "task", j) for j in range(m)] for t in range(m)]  # E[tau][j]
    F = [ev.embedding(t, "task", None) for t in range(m)]
    head = learner.head_
    logits_all = [[head.decision_function(E[t][j]).float() for j in range(m)] for t in range(m)]
    task_classes = [torch.as_tensor(t.classes) for t in learner.records_]

    def evaluate(task_of: list[torch.Tensor]) -> dict:
        rows, ret_ok, n = [], 0, 0
        for t in range(m):
            r = task_of[t]
            logits = torch.stack(logits_all[t])[r, torch.arange(len(r))]
            rows.append(100.0 * float((logits.argmax(1) == ys[t]).float().mean()))
            ret_ok += int((r == t).sum())
            n += len(r)
        return {"final_avg_acc": sum(rows) / m, "retrieval_acc": 100.0 * ret_ok / n, "acc": rows}

    oracle = evaluate([torch.full((len(ys[t]),), t) for t in range(m)])
    results: dict[str, dict] = {"oracle (true task)": oracle}

    def sig_scores(base: SignatureConfig, train: list[torch.Tensor], test_under) -> list[torch.Tensor]:
        sigs = [fit_signature(train[j], base, seed=j) for j in range(m)]
        out = []
        for t in range(m):
            out.append([sigs[j].score(test_under(t, j)) for j in range(m)])
        return out

    def task_from(scores: list[list[torch.Tensor]], top_k: int = 1) -> list[torch.Tensor]:
        return [retrieve(scores[t], top_k=top_k).task for t in range(m)]

    def reduced(scores: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.stack([s.min(1).values for s in scores[t]], 1) for t in range(m)]  # (N, m)

    base = cfg.signature
    variants = {
        "paper: raw, full cov, NLL": replace(base, normalize="none", covariance="full", calibrate="none"),
        "raw, full cov, NLL, standardized": replace(
            base, normalize="none", covariance="full", calibrate="standardize"
        ),
        "l2, full cov, NLL": replace(base, normalize="l2", covariance="full", calibrate="none"),
        "raw, full cov, 1 Gaussian": replace(
            base, normalize="none", covariance="full", method="gaussian", calibrate="none"
        ),
    }
    if "signatures" not in groups:
        variants = {}
    adapter_scores: dict[str, list] = {}
    for name, sc in variants.items():
        t1 = time.time()
        try:
            s = sig_scores(sc, own_train, lambda t, j: E[t][j])
        except Exception as e:  # report, keep going
            results[name] = {"error": str(e)}
            continue
        adapter_scores[name] = s
        results[name] = {**evaluate(task_from(s)), "fit_seconds": time.time() - t1}
        print(name, {k: round(v, 2) for k, v in results[name].items() if k != "acc"}, flush=True)

    n_before = len(results)
    diagnostics: dict[str, float] = {}
    if "lda" in groups:
        diagnostics = key_space_diagnostics(learner, E, F, frozen_train, cross_train, y_train, ys)
        for name, v in diagnostics.items():
            print(f"diagnostic: {name}: {v:.2f}", flush=True)
        results.update(
            lda_variants(learner, stream, E, F, own_train, frozen_train, first_train, y_train, evaluate)
        )
    if "signatures" not in groups:
        _finish(args, cfg, results, n_before, diagnostics)
        return

    # keys on the frozen backbone's features: every task's score lives in the same space
    fz = sig_scores(
        replace(base, normalize="none", covariance="full", calibrate="none"), frozen_train, lambda t, j: F[t]
    )
    results["frozen keys: raw, full cov, NLL"] = evaluate(task_from(fz))
    fz_std = sig_scores(
        replace(base, normalize="none", covariance="full", calibrate="standardize"),
        frozen_train,
        lambda t, j: F[t],
    )
    results["frozen keys, standardized"] = evaluate(task_from(fz_std))

    # head consistency: class score of each task's classes under that task's own adapter
    def head_task(t: int) -> torch.Tensor:
        cols = [logits_all[t][j][:, task_classes[j]].max(1).values for j in range(m)]
        return torch.stack(cols, 1)  # (N, m) higher = better

    results["head margin (own classes, own adapter)"] = evaluate([head_task(t).argmax(1) for t in range(m)])

    def zs(x: torch.Tensor) -> torch.Tensor:  # per-input standardisation across tasks
        return (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-9)

    best_adapter = "paper: raw, full cov, NLL" if "paper: raw, full cov, NLL" in adapter_scores else None
    if best_adapter:
        a = reduced(adapter_scores[best_adapter])
        f = reduced(fz)
        results["adapter + frozen"] = evaluate([(a[t] + f[t]).argmin(1) for t in range(m)])
        results["adapter + frozen (z-scored)"] = evaluate([(zs(a[t]) + zs(f[t])).argmin(1) for t in range(m)])
        results["adapter + frozen - head (z-scored)"] = evaluate(
            [(zs(a[t]) + zs(f[t]) - zs(head_task(t))).argmin(1) for t in range(m)]
        )
        results["frozen - head (z-scored)"] = evaluate(
            [(zs(f[t]) - zs(head_task(t))).argmin(1) for t in range(m)]
        )
        results["adapter - head (z-scored)"] = evaluate(
            [(zs(a[t]) - zs(head_task(t))).argmin(1) for t in range(m)]
        )

    _finish(args, cfg, results, n_before, diagnostics)


def _finish(
    args: argparse.Namespace, cfg, results: dict[str, dict], n_before: int, diagnostics: dict[str, float]
) -> None:
    for name in list(results)[n_before:]:
        print(name, {k: round(v, 2) for k, v in results[name].items() if k != "acc"}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "benchmark": args.benchmark,
                "config": cfg.to_dict(),
                "results": results,
                "diagnostics": diagnostics,
            },
            indent=1,
        )
    )
    print(f"{'variant':<42} {'retrieval':>9} {'final acc':>9}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<42} error: {r['error'][:60]}")
        else:
            print(f"{name:<42} {r['retrieval_acc']:>9.2f} {r['final_avg_acc']:>9.2f}")


def key_space_diagnostics(learner, E, F, frozen_train, cross_train, y_train, ys) -> dict[str, float]:
    """Two upper-bound checks on what adapters can add to retrieval (docs/retrieval.md):

    - within-task accuracy of a frozen-feature LDA when the true task is given, next to the adapters'
      oracle: what the adapters add once the task is known;
    - task-vs-task accuracy for every pair j < k, from an LDA fitted on both tasks' training data in
      the frozen space, and in adapter j's space (task k's data embedded under adapter j when task k was
      learned): how much more an adapter's space separates its task from another one."""
    m = len(E)
    classes = [t.classes for t in learner.records_]
    frozen = TiedLDA().fit(frozen_train, y_train)  # over all classes, restricted to the true task's
    within_ok = n = 0
    for t in range(m):
        pred = frozen.predict(F[t], classes[t])
        within_ok += int((pred == ys[t]).sum())
        n += len(pred)
    out = {"frozen LDA, true task given: within-task accuracy": 100.0 * within_ok / n}
    ok = {"frozen": 0, "adapter": 0}
    n = 0
    for j in range(m):
        for k in range(j + 1, m):
            spaces = {
                "frozen": ([frozen_train[j], frozen_train[k]], [F[j], F[k]]),
                "adapter": ([cross_train[j][j], cross_train[k][j]], [E[j][j], E[k][j]]),
            }
            for name, (train, test) in spaces.items():
                model = TiedLDA().fit(train, [y_train[j], y_train[k]])
                for t, Z in zip((j, k), test):
                    in_j = torch.isin(model.predict(Z), torch.as_tensor(classes[j]))
                    ok[name] += int((in_j == (t == j)).sum())
            n += len(ys[j]) + len(ys[k])
    out["task-vs-task accuracy, frozen space"] = 100.0 * ok["frozen"] / n
    out["task-vs-task accuracy, the earlier task's adapter space"] = 100.0 * ok["adapter"] / n
    return out


def lda_variants(learner, stream, E, F, own_train, frozen_train, first_train, y_train, evaluate) -> dict:
    """LDA keys (a ridge head over all classes, accumulated like G) in a fixed key space, the effect of
    L2 normalisation and of flip test-time augmentation, and class keys under each task's own adapter
    with one covariance tied across all tasks (Mahalanobis; the negative control: own-adapter spaces are
    not comparable even with a shared metric)."""
    import torch.nn.functional as nnf

    from proteus.heads import RanPACHead

    m = len(stream.tasks)
    classes = [t.classes for t in learner.records_]
    zflip = [mirrored_prefix(learner, stream.tasks[t].test) for t in range(m)]
    F_flip = [learner.embed_prefix(z, None)[0] for z in zflip]
    A_flip = [learner.embed_prefix(z, [0])[0] for z in zflip]

    def lda(train: list[torch.Tensor], test: list[torch.Tensor], l2: bool) -> list[torch.Tensor]:
        norm = (lambda x: nnf.normalize(x.double(), dim=1)) if l2 else (lambda x: x.double())
        head = RanPACHead(train[0].shape[1], rp_dim=0, seed=0)
        for k in range(m):
            head.update(norm(train[k]), y_train[k], num_classes=max(classes[k]) + 1)
        out = []
        for t in range(m):
            logits = head.decision_function(norm(test[t])).double()
            out.append(torch.stack([logits[:, classes[k]].max(1).values for k in range(m)], 1).argmax(1))
        return out

    res: dict[str, dict] = {}
    A = [E[t][0] for t in range(m)]
    mean = lambda a, b: [(x + y) / 2 for x, y in zip(a, b)]  # noqa: E731
    for label, train, test, flip in (
        ("frozen", frozen_train, F, F_flip),
        ("first adapter", first_train, A, A_flip),
    ):
        res[f"LDA keys, {label}, raw"] = evaluate(lda(train, test, False))
        res[f"LDA keys, {label}, l2"] = evaluate(lda(train, test, True))
        res[f"LDA keys, {label}, l2, flip TTA"] = evaluate(lda(train, mean(test, flip), True))

    # class keys under each task's own adapter, one covariance tied across all tasks
    own = TiedLDA().fit(own_train, y_train)
    ret = [
        torch.stack([own.distances(E[t][k], classes[k]).min(1).values for k in range(m)], 1).argmin(1)
        for t in range(m)
    ]
    res["class keys, own adapter, l2, tied covariance"] = evaluate(ret)
    return res


if __name__ == "__main__":
    main()
