"""How far to trust the confidence that ``proteus predict`` prints: a reliability diagram.

The confidence is ``p_all``, the softmax of the prediction's class scores over every learned class (for the
default ``proteus``, whose scores are ``log p(t|x) + log p(c|x, t)``, that is its posterior over the
likeliest tasks' classes; docs/predict.md). This script predicts every test image of the stream a knowledge
base learned, bins the inputs by confidence and compares each bin's mean confidence with its accuracy
(perfect calibration: the diagonal). It reports the expected calibration error (ECE: the bins' |accuracy -
confidence| weighted by their share of inputs), the known / unknown split of the default rejection, and
writes the diagram as a PNG and the bins as JSON.

    python tools/studies/reliability.py runs/cifar10/kb --out runs/reliability
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from proteus import Proteus  # noqa: E402
from proteus.streams import build_benchmark  # noqa: E402


def confidences(clf: Proteus, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(confidence, correct, known) of every test image of the knowledge base's stream."""
    stream = build_benchmark(clf.config.benchmark)
    conf, correct, known = [], [], []
    for task in stream.tasks[: clf.num_tasks]:
        items = [task.test[i] for i in range(len(task.test))]
        for i in range(0, len(items), batch):
            ims, ys = zip(*items[i : i + batch], strict=True)
            pred = clf.predict(clf.transform_images(list(ims)))
            p = torch.softmax(pred.logits.double(), 1)
            conf.append(p.max(1).values)
            correct.append(pred.label == torch.as_tensor(ys))
            if pred.known is not None:
                known.append(pred.known)
    return torch.cat(conf), torch.cat(correct), torch.cat(known) if known else None


def bins(conf: torch.Tensor, correct: torch.Tensor, n_bins: int = 10) -> tuple[list[dict], float]:
    """Equal-width confidence bins (count, mean confidence, accuracy) and the expected calibration error."""
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    rows, ece = [], 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi)
        n = int(inside.sum())
        if n == 0:
            continue
        c, a = float(conf[inside].mean()), float(correct[inside].double().mean())
        edge = [round(float(lo), 2), round(float(hi), 2)]
        rows.append({"bin": edge, "n": n, "confidence": c, "accuracy": a})
        ece += n / len(conf) * abs(a - c)
    return rows, ece


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kb", help="a knowledge base learned by `proteus run` or `proteus learn`")
    ap.add_argument("--out", default="runs/reliability", help="folder for reliability.png and .json")
    ap.add_argument("--bins", type=int, default=10)
    args = ap.parse_args()
    clf = Proteus.load(args.kb, progress=False)
    conf, correct, known = confidences(clf)
    table, ece = bins(conf, correct, args.bins)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "kb": str(args.kb), "method": clf.config.method, "n": len(conf),
        "accuracy": float(correct.double().mean()), "mean_confidence": float(conf.mean()), "ece": ece,
        "known_accepted": None if known is None else float(known.double().mean()),
        "accuracy_of_known": None if known is None else float(correct[known].double().mean()),
        "bins": table,
    }  # fmt: skip
    (out / "reliability.json").write_text(json.dumps(summary, indent=1))
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.bar([r["confidence"] for r in table], [r["accuracy"] for r in table], width=1 / args.bins * 0.8,
           alpha=0.7, label="accuracy per confidence bin")  # fmt: skip
    ax.set(xlabel="confidence (p_all of the predicted class)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
           title=f"{clf.config.method}: ECE {ece:.3f}")  # fmt: skip
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=100)
    print(f"{len(conf)} test images: accuracy {summary['accuracy']:.3f}, mean confidence "
          f"{summary['mean_confidence']:.3f}, ECE {ece:.3f}")  # fmt: skip
    for r in table:
        print(f"  ({r['bin'][0]:.1f}, {r['bin'][1]:.1f}]  n={r['n']:5d}  confidence {r['confidence']:.3f}  "
              f"accuracy {r['accuracy']:.3f}")  # fmt: skip
    print(f"wrote {out / 'reliability.png'} and {out / 'reliability.json'}")


if __name__ == "__main__":
    main()
