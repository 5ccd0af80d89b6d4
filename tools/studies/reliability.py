"""How far to trust the confidence that ``proteus predict`` prints: reliability diagrams and ECE.

The confidence is the probability of the predicted class among the learned classes: the softmax of the
prediction's class scores over every learned class (``p_all``; for the default ``proteus``, whose scores
are ``log p(t|x) + log p(c|x, t)``, its posterior over the likeliest tasks' classes), divided by the
temperature of the class's task that the knowledge base stores (``confidence`` in the JSON rows;
:mod:`proteus.engine.confidence`). This script predicts every test image of the stream a knowledge base
learned, bins the inputs by confidence and compares each bin's mean confidence with its accuracy (perfect
calibration: the diagonal), before (``p_all``, no temperature) and after (the stored temperatures). It
reports the expected calibration error (ECE: the bins' |accuracy - confidence| weighted by their share of
inputs), writes the diagram of both as a PNG and the bins as JSON.

``--refit`` also fits the temperatures again from the stream's training images as learning fits them
(each task's calibration rows predicted among the tasks up to it), out-of-sample (``leave-out``: the keys
and the task's head without the rows, what learning does) or in-sample (``in-sample``: the rows scored by
the keys and head that learned them), and reports the ECE each gives: the choice learning makes.

    python tools/studies/reliability.py runs/cifar10/kb --out runs/reliability --refit leave-out,in-sample
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
from proteus.core.parts import task_seed  # noqa: E402
from proteus.engine.confidence import calibrated_probabilities, calibration_rows, fit_temperature  # noqa: E402
from proteus.streams import build_benchmark  # noqa: E402


def test_logits(clf: Proteus, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(class scores (N, C), true labels (N,)) of every test image of the knowledge base's stream."""
    stream = build_benchmark(clf.config.benchmark)
    logits, labels = [], []
    for task in stream.tasks[: clf.num_tasks]:
        items = [task.test[i] for i in range(len(task.test))]
        for i in range(0, len(items), batch):
            ims, ys = zip(*items[i : i + batch], strict=True)
            logits.append(clf.predict(clf.transform_images(list(ims))).logits.double())
            labels.append(torch.as_tensor(ys))
    return torch.cat(logits), torch.cat(labels)


def refit(clf: Proteus, how: str) -> list[float | None]:
    """Each task's temperature fitted again on its calibration rows of the stream's training images, as
    learning does (``leave-out``) or with the rows scored in-sample (``in-sample``), among the tasks up to
    it. (The keys' statistics then include the later tasks, which they did not when the task was learned.)"""
    parts, records = clf.parts_, clf.records_
    stream = build_benchmark(clf.config.benchmark)
    out: list[float | None] = []
    for k, task in enumerate(stream.tasks[: clf.num_tasks]):
        z, y = parts.embedder.prefix_dataset(task.train, f"task {k + 1}: training images")
        rows = calibration_rows(len(y), clf.config.retrieval.calibration_holdout, task_seed(clf.config, k))
        if how == "in-sample":
            pred = parts.predict_prefix(z[rows], k + 1, records)
        else:
            tasks, kind = parts.head_tasks(k)
            h = parts.embedder.embed_prefix(z, tasks, kind)[0]
            with parts.keys.without(parts.embedder, z[rows], y[rows]), parts.heads.without(k, h, y, rows):
                pred = parts.predict_prefix(z[rows], k + 1, records)
        out.append(fit_temperature(pred.logits, y[rows]))
    return out


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


def summary(logits: torch.Tensor, labels: torch.Tensor, temps: list[float | None], task_of: torch.Tensor,
            n_bins: int) -> dict:  # fmt: skip
    """Accuracy, mean confidence, ECE and bins of the confidence with temperatures ``temps``."""
    pred = logits.argmax(1)
    p, _ = calibrated_probabilities(logits, pred, temps, task_of)
    conf = p.gather(1, pred[:, None])[:, 0]
    correct = pred == labels
    table, ece = bins(conf, correct, n_bins)
    return {"temperatures": temps, "accuracy": float(correct.double().mean()),
            "mean_confidence": float(conf.mean()), "ece": ece, "bins": table}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kb", help="a knowledge base learned by `proteus run` or `proteus learn`")
    ap.add_argument("--out", default="runs/reliability", help="folder for reliability.png and .json")
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--refit", default="", help="comma-separated: leave-out, in-sample (see above)")
    ap.add_argument("--title", help="the diagram's title (default: the method and benchmark)")
    args = ap.parse_args()
    clf = Proteus.load(args.kb, progress=False)
    logits, labels = test_logits(clf)
    task_of = clf.records_.task_of()
    result = {"kb": str(args.kb), "method": clf.config.method, "n": len(labels), "variants": {}}
    variants = {"none (p_all)": [None] * clf.num_tasks, "stored": clf.records_.temperatures()}
    for how in filter(None, args.refit.split(",")):
        variants[f"refit {how}"] = refit(clf, how)
    for name, temps in variants.items():
        s = result["variants"][name] = summary(logits, labels, temps, task_of, args.bins)
        shown = ", ".join("-" if t is None else f"{t:.3g}" for t in temps)
        print(f"{name}: {len(labels)} test images, accuracy {s['accuracy']:.3f}, mean confidence "
              f"{s['mean_confidence']:.3f}, ECE {s['ece']:.4f}  (temperatures {shown})")  # fmt: skip
        for r in s["bins"]:
            lo, hi = r["bin"]
            print(f"  ({lo:.1f}, {hi:.1f}]  n={r['n']:5d}  confidence {r['confidence']:.3f}  "
                  f"accuracy {r['accuracy']:.3f}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(result, indent=1))
    fig, ax = plt.subplots(figsize=(3.6, 3.6))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    w = 1 / args.bins
    for name, color, shift in (("none (p_all)", "tab:gray", -0.2), ("stored", "tab:blue", 0.2)):
        s = result["variants"][name]
        label = f"{'before' if shift < 0 else 'after'}: ECE {s['ece']:.3f}"
        ax.bar([(r["bin"][0] + r["bin"][1]) / 2 + shift * w for r in s["bins"]],
               [r["accuracy"] for r in s["bins"]], width=w * 0.4, color=color, label=label)  # fmt: skip
    title = args.title or f"{clf.config.method} on {clf.config.benchmark.name}"
    ax.set(xlabel="confidence (bins of 0.1)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=80)
    print(f"wrote {out / 'reliability.png'} and {out / 'reliability.json'}")


if __name__ == "__main__":
    main()
