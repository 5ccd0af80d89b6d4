"""The detector's shortlist (``retrieval.shortlist``) against the detector over every task, on real streams.

The detector of inputs from no learned task scores an input under the Gaussians of only the ``k`` tasks its
LDA keys rank highest (its calibration rows alike), so that its cost does not grow with the tasks learned.
This study learns a stream's knowledge base once per seed (the settings of ``proteus run``; a finished one
is reused), then scores every test image of every learned task -- as ``proteus predict`` does: the keys'
features, the prefix's tap statistics, the keys' task scores -- with the detector over every task and with
shortlists of each ``--k``. The class a prediction names does not depend on the detector, so two answers
are equal when they agree on whether the input is known; each row gives that agreement and the share of
(known) test images rejected as unknown, with and without the shortlist.

    python tools/studies/shortlist.py --benchmark domains-mixed --data ../shared/data \\
        --config mobilenet_cpu --seeds 0,1,2 --k 2,4,8 --out runs/shortlist/domains-mixed
    python tools/studies/shortlist.py --long18 ../shared/data --config mobilenet_cpu --seeds 0,1,2 \\
        --set benchmark.max_train_per_class=100 --out runs/shortlist/long18

``--long18 DATA`` builds the 18-task stream of docs/performance.md ("Accuracy past that point") from the four
image domains of ``DATA`` (class folders linked as ``<domain>_<class>`` under ``--out/long18-data``; tasks
from ``tools/studies/long18_tasks.yaml``). Results go to ``--out/shortlist.json``; a markdown table is
printed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from study import parser, resolve

from proteus import Proteus
from proteus.kb import KnowledgeBase
from proteus.streams import build_benchmark

LONG18 = Path(__file__).with_name("long18_tasks.yaml")
DOMAINS = {"cifar": "cifar10-subset", "inet": "imagenette", "dtd": "dtd", "fmnist": "fashion-mnist"}


def long18_tree(data: Path, out: Path) -> Path:
    """``out`` holding ``train/`` and ``test/`` of the four domains' class folders as ``<domain>_<class>``
    (symbolic links into ``data``)."""
    for split in ("train", "test"):
        (out / split).mkdir(parents=True, exist_ok=True)
        for short, name in DOMAINS.items():
            for cls in sorted(p.name for p in (data / name / split).iterdir() if p.is_dir()):
                link = out / split / f"{short}_{cls}"
                if not link.exists():
                    os.symlink((data / name / split / cls).resolve(), link)
    return out


def learn(cfg, kb: Path) -> Proteus:  # noqa: ANN001 - a RunConfig
    """The knowledge base of ``cfg``'s stream at ``kb`` (reused when it holds every task)."""
    stream = build_benchmark(cfg.benchmark)
    clf = Proteus.load(kb, progress=False) if KnowledgeBase.exists(kb) else Proteus(cfg, progress=False)
    for task in stream.tasks[clf.num_tasks :]:
        t0 = time.perf_counter()
        clf.fit_task(task)
        clf.save(kb)
        print(
            f"  {kb}: task {task.index + 1}/{len(stream.tasks)} in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    return clf


def inputs(clf: Proteus, cfg, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Every test image's key features X, tap statistics and task scores, as ``predict`` computes them."""
    keys, classes = clf.keys_, clf.records_.classes()
    images = [im for task in build_benchmark(cfg.benchmark).tasks[: clf.num_tasks] for im, _ in task.test]
    Xs, taps, scores = [], [], []
    with torch.no_grad():
        for i in range(0, len(images), batch):
            z, t = clf.embedder_.prefix_taps(clf.transform_images(images[i : i + batch]))
            X = keys.space.embed(clf.embedder_, z, shard=False)
            Xs.append(X)
            taps.append(t)
            scores.append(keys.retrieve_space(X, len(classes), classes).task_scores)
    return torch.cat(Xs), torch.cat(taps), torch.cat(scores)


def novelty(
    clf: Proteus, X: torch.Tensor, taps: torch.Tensor, scores: torch.Tensor, k: int | None
) -> torch.Tensor:
    """The detector's novelty of the inputs (> 0: unknown) with a shortlist of ``k`` tasks (None: every task),
    its thresholds fitted again for it."""
    keys = clf.keys_
    keys.novelty.shortlist = k
    keys.novelty.invalidate()
    return keys.novelty_of(X, clf.records_.classes(), taps, scores)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--long18", metavar="DATA", help="the 18-task stream of the four domains of DATA")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--k", default="2,4,8", help="the shortlists compared with every task")
    ap.add_argument("--out", required=True)
    for action in ap._actions:  # --benchmark is optional here (--long18 sets it)
        if action.dest == "benchmark":
            action.required = False
    args = ap.parse_args()
    out = Path(args.out)
    if args.long18:
        tree = long18_tree(Path(args.long18), out / "long18-data")
        args.benchmark, args.data, args.tasks_file = "folder", str(tree), str(LONG18)
    name = "long18" if args.long18 else args.benchmark
    ks = [int(k) for k in args.k.split(",")]
    path = out / "shortlist.json"
    table: dict = json.loads(path.read_text()) if path.is_file() else {}
    for seed in (int(s) for s in args.seeds.split(",")):
        args.seed = seed
        cfg = resolve(args, "proteus")
        clf = learn(cfg, out / f"seed{seed}" / "kb")
        X, taps, scores = inputs(clf, cfg)
        full = novelty(clf, X, taps, scores, None)
        row = {"tasks": clf.num_tasks, "images": len(X), "rejected_full": float((full > 0).double().mean())}
        for k in ks:
            t0 = time.perf_counter()
            short = novelty(clf, X, taps, scores, k)
            row[str(k)] = {
                "equal": float(((short > 0) == (full > 0)).double().mean()),
                "rejected": float((short > 0).double().mean()),
                "seconds": time.perf_counter() - t0,
            }
        table[f"{name}/seed{seed}"] = row
        path.write_text(json.dumps(table, indent=1))
        cells = ", ".join(
            f"k={k}: equal {row[str(k)]['equal']:.2%}, rejected {row[str(k)]['rejected']:.2%}" for k in ks
        )
        print(f"{name} seed {seed}: {row['tasks']} tasks, {row['images']} images, rejected "
              f"{row['rejected_full']:.2%} with every task; {cells}", flush=True)  # fmt: skip
    print("\n| stream | seed | tasks | images | rejected, every task | "
          + " | ".join(f"k = {k}: equal / rejected" for k in ks) + " |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in ks) + " |")
    for key, row in table.items():
        stream, seed = key.split("/")
        cells = " | ".join(
            f"{row[str(k)]['equal']:.2%} / {row[str(k)]['rejected']:.2%}" for k in ks if str(k) in row
        )
        head = f"| {stream} | {seed[4:]} | {row['tasks']} | {row['images']} | {row['rejected_full']:.2%}"
        print(f"{head} | {cells} |")


if __name__ == "__main__":
    main()
