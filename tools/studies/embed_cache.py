"""Learn a stream once and keep every embedding a prediction rule can read (issue 23's study).

For every task t it stores, as safetensors under ``--out``:
``train/{t}/own`` (task t's training inputs under adapter t), ``train/{t}/first`` (under adapter 1),
``train/{t}/frozen``, ``train/{t}/y``; ``test/{t}/{j}`` (test set t under adapter j, every j),
``test/{t}/frozen``, ``test/{t}/y``; plus ``meta.json`` (config, classes per task, timings).
``domain_rules.py`` then scores prediction rules on these tensors in seconds, all on the same adapters.

    python tools/studies/embed_cache.py --benchmark domains5 --data ../shared/data --config mobilenet_cpu \
        --seed 0 --out runs/cache/domains5-s0
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from study import parser, resolve

from proteus import Proteus
from proteus.experiment import Evaluator
from proteus.streams import build_benchmark


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", default="proteus-lda", help="the method whose adapters are learned")
    args = ap.parse_args()
    out = Path(args.out)
    if (out / "meta.json").is_file():
        print(f"{out}: cached")
        return
    cfg = resolve(args, args.method)
    torch.set_num_threads(int(os.environ.get("PROTEUS_STUDY_THREADS", "2")))
    from proteus.engine.trainer import AdapterTrainer

    classifiers: dict[str, torch.Tensor] = {}
    close = AdapterTrainer.close_task

    def keep_classifier(self, t, losses, steps):  # the adapter's own trained linear classifier
        classifiers[f"clf/{t.k}/weight"] = t.clf.weight.detach().cpu().clone()
        classifiers[f"clf/{t.k}/bias"] = t.clf.bias.detach().cpu().clone()
        return close(self, t, losses, steps)

    AdapterTrainer.close_task = keep_classifier
    stream = build_benchmark(cfg.benchmark)
    learner = Proteus(cfg, progress=False)
    ev = Evaluator(learner, stream)
    m = len(stream.tasks)
    tensors: dict[str, torch.Tensor] = {}
    seconds = []
    t0 = time.time()
    for k in range(m):
        t1 = time.time()
        learner.fit_task(stream.tasks[k])
        seconds.append(time.time() - t1)
        z, y = learner.prefix_dataset(stream.tasks[k].train)
        tensors[f"train/{k}/own"] = learner.embed_prefix(z, [k])[0]
        tensors[f"train/{k}/first"] = learner.embed_prefix(z, [0])[0]
        tensors[f"train/{k}/frozen"] = learner.embed_prefix(z, None)[0]
        tensors[f"train/{k}/y"] = y
        print(f"task {k + 1}/{m} learned in {seconds[-1]:.0f} s ({time.time() - t0:.0f} s)", flush=True)
    for t in range(m):
        for j in range(m):
            tensors[f"test/{t}/{j}"] = ev.embedding(t, "task", j)
        tensors[f"test/{t}/frozen"] = ev.embedding(t, "task", None)
        tensors[f"test/{t}/y"] = ev.labels(t)
    tensors.update(classifiers)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous().float() if v.is_floating_point() else v.contiguous() for k, v in tensors.items()},
        str(out / "tensors.safetensors"),
    )
    meta = {
        "config": cfg.to_dict(),
        "classes": [list(t.classes) for t in learner.records_],
        "class_names": learner.classes_,
        "learn_seconds": seconds,
        "total_seconds": time.time() - t0,
        "manifest_tasks": stream.manifest.get("task_domains"),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"{out}: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
