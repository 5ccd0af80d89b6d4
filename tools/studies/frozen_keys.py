"""How far can fixed-space task keys go on this backbone? (issue 6, docs/retrieval.md)

Learns nothing: embeds every task's training and test images with the frozen backbone at each input
size, fits one LDA over all classes (class means, one covariance tied across classes and shrunk 10%
towards its mean eigenvalue, on L2-normalised features) and reports the 10-class accuracy and the task
retrieval accuracy (the predicted class's task), with and without flip test-time augmentation (the
test embedding averaged with its mirror's, the statistics fitted on both). Retrieval with any key in
the frozen space is bounded by how well this space separates classes of different tasks.

    python tools/studies/frozen_keys.py --benchmark cifar10 --data ../shared/data/cifar10-subset \\
        --config mobilenet_cpu --sizes 96,128,160
"""

from __future__ import annotations

import json
import time

import torch
from study import TiedLDA, mirrored_prefix, parser, resolve

from proteus import Proteus
from proteus.streams import build_benchmark


def features(learner: Proteus, ds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frozen features of ``ds`` and of its mirrored images, and the labels."""
    z, y = learner.prefix_dataset(ds)
    f = learner.embed_prefix(z, None)[0]
    return f, learner.embed_prefix(mirrored_prefix(learner, ds), None)[0], y


def lda_scores(train: list, test: list, classes: list[list[int]], tta: bool) -> dict[str, float]:
    lda = TiedLDA().fit(
        [torch.cat([f, ff]) if tta else f for f, ff, _ in train],
        [torch.cat([y, y]) if tta else y for _, _, y in train],
    )
    task_of = torch.zeros(int(lda.labels_.max()) + 1, dtype=torch.long)
    for k, cs in enumerate(classes):
        task_of[cs] = k
    right_class = right_task = n = 0
    for t, (f, ff, y) in enumerate(test):
        pred = lda.predict((f.double() + ff.double()) / 2 if tta else f)
        right_class += int((pred == y).sum())
        right_task += int((task_of[pred] == t).sum())
        n += len(y)
    return {"class_acc": 100.0 * right_class / n, "task_retrieval": 100.0 * right_task / n}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", default="96", help="comma-separated input sizes (px)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for px in (int(s) for s in args.sizes.split(",")):
        cfg = resolve(args, "frozen", (f"backbone.img_size={px}",))
        stream = build_benchmark(cfg.benchmark)
        learner = Proteus(cfg, progress=False)
        t0 = time.time()
        train = [features(learner, t.train) for t in stream.tasks]
        test = [features(learner, t.test) for t in stream.tasks]
        classes = [sorted(y.unique().tolist()) for _, _, y in test]
        for tta in (False, True):
            r = {"img_size": px, "flip_tta": tta, **lda_scores(train, test, classes, tta)}
            rows.append(r)
            print(
                f"{px:>4} px  flip TTA {str(tta):<5}  class acc {r['class_acc']:6.2f}  "
                f"task retrieval {r['task_retrieval']:6.2f}  ({time.time() - t0:.0f} s)",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
