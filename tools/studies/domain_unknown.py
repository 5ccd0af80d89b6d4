"""``unknown`` across domains (issue 39): domains5 learned with one domain left out, that domain shown.

For each domain of domains5 in turn (``--data``: one ImageFolder tree per domain, plus scikit-learn's
digits), a knowledge base learns the other four (a groups file lists them in the stream's order; the
settings of ``proteus run --benchmark domains5 --config mobilenet_cpu``), then scores every test image of
the four learned domains (known: the share rejected as unknown should stay <= 5%) and every test image of
the left-out domain (unknown: the share flagged should be >= 95%) with the detector and thresholds the
knowledge base stores (fitted when its tasks were learned), exactly as ``proteus predict`` scores an
input (``keys_.novelty_of`` on the keys' features and the prefix's tap statistics). It also gives the
AUROC of the novelty score (known against unknown: 1 separates them perfectly at some threshold).

Each row is measured twice on the same knowledge base: with the ``task-gaussian`` detector (the default,
``retrieval.novelty=auto``) and with the ``class-gaussian`` one (the default before issue 39; the same
knowledge base without its task Gaussians scores with it, as an older knowledge base does).

The detector reads the frozen prefix and the keys' space (the first task's adapter), never the later
tasks' adapters, so by default the later tasks train no adapter (``--set train.tasks=first``: the same
detector as ``proteus``'s, in a fifth of the time; ``--full`` trains every adapter).

The knowledge bases share what they can: leaving out the domain at place j of the stream, the first j
tasks are those of every knowledge base that leaves out a later domain, so they are learned once (the
learner copied where the streams part). Every test image is scored, at most ``--max-test`` (500) of each
domain (a seeded sample: 2,000 known and up to 500 unknown per row); the frozen prefix of those images is
computed once for all knowledge bases.

A finished knowledge base is reused (its task count is checked), so the study resumes; ``--relearn``
starts over. Each KB is under ``--out/without-<domain>/kb``; the rates go to ``--out/rates.json`` and a
markdown table is printed.

    python tools/studies/domain_unknown.py --benchmark domains5 --data ../shared/data \\
        --config mobilenet_cpu --seed 0 --out runs/domain-unknown
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import torch
import yaml
from study import parser, resolve

from proteus import Proteus
from proteus.kb import KnowledgeBase
from proteus.streams import Task, build_benchmark


def learn(cfg, kb: Path, relearn: bool, start: Proteus | None = None,
          keep: dict[int, Proteus] | None = None) -> Proteus:  # noqa: ANN001 - a RunConfig  # fmt: skip
    """The knowledge base of ``cfg``'s stream at ``kb``: reused when it holds every task, else learned
    from what it holds, or from ``start`` (a learner of the stream's first tasks, copied), or from scratch;
    ``keep[n]`` receives a copy of the learner after its first n tasks."""
    stream = build_benchmark(cfg.benchmark)
    if kb.exists() and (relearn or not KnowledgeBase.exists(kb)):
        shutil.rmtree(kb)
    if KnowledgeBase.exists(kb):
        clf = Proteus.load(kb, progress=False)
        if keep is not None and 0 < clf.num_tasks < len(stream.tasks):
            keep[clf.num_tasks] = copy.deepcopy(clf)
    elif start is not None:
        clf = copy.deepcopy(start).set_params(config=cfg)
        print(f"  {kb}: tasks 1-{clf.num_tasks} shared with the stream before", flush=True)
    else:
        clf = Proteus(cfg, progress=False)
    for task in stream.tasks[clf.num_tasks :]:
        t0 = time.perf_counter()
        clf.fit_task(task)
        clf.save(kb)
        took = time.perf_counter() - t0
        print(f"  {kb}: task {task.index + 1}/{len(stream.tasks)} in {took:.0f} s", flush=True)
        if keep is not None and clf.num_tasks < len(stream.tasks):
            keep[clf.num_tasks] = copy.deepcopy(clf)
    if clf.num_tasks and not KnowledgeBase.exists(kb):
        clf.save(kb)
    return clf


def sample(task: Task, n: int, seed: int = 0) -> list:
    """At most n test images of ``task`` (a seeded sample, in order)."""
    idx = torch.randperm(len(task.test), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return [task.test[int(i)][0] for i in idx]


def prefixes(clf: Proteus, images: list, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen prefix outputs and tap statistics of ``images`` (the same for every knowledge base)."""
    zs, ts = [], []
    for i in range(0, len(images), batch):
        z, t = clf.embedder_.prefix_taps(clf.transform_images(images[i : i + batch]))
        zs.append(z)
        ts.append(t)
    return torch.cat(zs), torch.cat(ts)


def novelty(clf: Proteus, z: torch.Tensor, taps: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, ...]:
    """(task-gaussian novelty, class-gaussian novelty) of inputs with prefix outputs z and tap statistics
    ``taps`` (> 0: unknown), as ``proteus predict`` computes it (:meth:`LDAKeys.novelty_of`)."""
    keys, classes = clf.keys_, clf.records_.classes()
    space = keys.space
    X = torch.cat(
        [space.embed(clf.embedder_, z[i : i + batch], shard=False) for i in range(0, len(z), batch)]
    )
    after = keys.novelty_of(X, classes, taps)
    gaussians, keys.novelty.gaussians = keys.novelty.gaussians, {}  # as a KB without them
    keys.novelty.invalidate()
    try:
        before = keys.novelty_of(X, classes)
    finally:
        keys.novelty.gaussians = gaussians
        keys.novelty.invalidate()
    return after, before


def auroc(known: torch.Tensor, unknown: torch.Tensor) -> float:
    """P(an unknown input's score > a known one's), ties counted half (the Mann-Whitney statistic)."""
    s = torch.cat([known, unknown]).double()
    ranks = torch.empty_like(s)
    order = s.argsort()
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    for v in s.unique():  # average ranks of ties
        tie = s == v
        if int(tie.sum()) > 1:
            ranks[tie] = ranks[tie].mean()
    n0, n1 = len(known), len(unknown)
    return float((ranks[n0:].sum() - n1 * (n1 + 1) / 2) / (n0 * n1))


def rates(known: torch.Tensor, unknown: torch.Tensor) -> dict[str, float]:
    """Known test images rejected, unknown ones flagged (novelty > 0), and the AUROC."""
    return {
        "known_rejected": float((known > 0).double().mean()),
        "unknown_flagged": float((unknown > 0).double().mean()),
        "auroc": auroc(known, unknown),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--method", default="proteus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--domains", help="comma-separated: leave out only these (default: each in turn)")
    ap.add_argument("--relearn", action="store_true", help="learn every knowledge base again")
    ap.add_argument("--full", action="store_true", help="train every task's adapter (default: the first)")
    ap.add_argument("--max-test", type=int, default=500, help="test images scored per domain at most")
    args = ap.parse_args()
    if not args.full:
        args.set = [*args.set, "train.tasks=first"]
    out = Path(args.out)
    full = build_benchmark(resolve(args, args.method).benchmark)  # every domain, the stream's order
    order = [t.class_names[0].split("/", 1)[0] for t in full.tasks]
    chosen = args.domains.split(",") if args.domains else order[::-1]  # the longest shared stream first
    path = out / "rates.json"
    table: dict[str, dict] = json.loads(path.read_text()) if path.is_file() else {}
    kept: dict[int, Proteus] = {}  # the learner after the stream's first n tasks (every domain learned)
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for left in chosen:
        j = order.index(left)
        where = out / f"without-{left}"
        where.mkdir(parents=True, exist_ok=True)
        groups = where / "groups.yaml"
        learned = [d for d in order if d != left]
        groups.write_text(yaml.safe_dump({"domains": learned}))
        args.tasks_file = str(groups)
        cfg = resolve(args, args.method)
        print(f"without {left}: learning {', '.join(learned)}", flush=True)
        clf = learn(cfg, where / "kb", args.relearn, kept.get(j), kept if j == len(order) - 1 else None)
        t0 = time.perf_counter()
        for d, task in zip(order, full.tasks, strict=True):
            if d not in cache:
                cache[d] = prefixes(clf, sample(task, args.max_test))
        kn = [novelty(clf, *cache[d]) for d in learned]
        un = novelty(clf, *cache[left])
        row: dict = {"learned": learned, "n_known": sum(len(cache[d][0]) for d in learned),
                     "n_unknown": len(cache[left][0])}  # fmt: skip
        for i, name in enumerate(("task-gaussian", "class-gaussian")):
            row[name] = rates(torch.cat([n[i] for n in kn]), un[i])
            row[name]["known_rejected_per_domain"] = {
                d: float((n[i] > 0).double().mean()) for d, n in zip(learned, kn, strict=True)
            }
        table[left] = row
        for name in ("task-gaussian", "class-gaussian"):
            r = row[name]
            print(f"  {name}: known rejected {r['known_rejected']:.1%} of {row['n_known']}, {left} flagged "
                  f"{r['unknown_flagged']:.1%} of {row['n_unknown']}, AUROC {r['auroc']:.4f}")  # fmt: skip
        print(f"  scored in {time.perf_counter() - t0:.0f} s", flush=True)
        path.write_text(json.dumps(table, indent=1))
    print(
        "\n| left out (unknown) | flagged unknown | known test images rejected | AUROC | before: flagged "
        "| before: rejected | before: AUROC |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for left, row in table.items():
        a, b = row["task-gaussian"], row["class-gaussian"]
        print(f"| {left} | {a['unknown_flagged']:.1%} of {row['n_unknown']} | {a['known_rejected']:.1%} of "
              f"{row['n_known']} | {a['auroc']:.4f} | {b['unknown_flagged']:.1%} | {b['known_rejected']:.1%} "
              f"| {b['auroc']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
