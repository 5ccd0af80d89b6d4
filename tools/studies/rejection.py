"""Does the default rejection say "unknown" for inputs from no learned task? Known / unknown rates.

Loads a knowledge base, predicts the test images of the stream it learned (its known inputs: the share
flagged known should be near ``retrieval.reject_tpr``) and the test images of other ImageFolder datasets
(unknown inputs: the share flagged unknown), with the thresholds the KB holds (fitted at learn time, or by
``proteus kb calibrate --images``). ``--unknown DIR[:class,class]`` picks some classes of a folder (for
example the CIFAR-10 classes a KB did not learn).

    python tools/studies/rejection.py runs/nodog/kb --unknown ../shared/data/cifar10-subset:dog \\
        --unknown ../shared/data/dtd --unknown ../shared/data/fashion-mnist --per-class 50
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from PIL import Image

from proteus import Proteus
from proteus.streams import build_benchmark


def known_share(clf: Proteus, images: list[Image.Image], batch: int = 128) -> float:
    """The share of ``images`` that the KB's thresholds accept as from a learned task."""
    flags = []
    for i in range(0, len(images), batch):
        pred = clf.predict(clf.transform_images(images[i : i + batch]))
        if pred.known is None:
            raise SystemExit("the knowledge base has no rejection thresholds: proteus kb calibrate --images")
        flags.append(pred.known)
    return float(torch.cat(flags).double().mean())


def folder_images(spec: str, per_class: int) -> tuple[str, list[Image.Image]]:
    """``DIR[:a,b]``: the first ``per_class`` test images of each (chosen) class of an ImageFolder."""
    root, _, chosen = spec.partition(":")
    split = Path(root) / "test" if (Path(root) / "test").is_dir() else Path(root)
    classes = chosen.split(",") if chosen else sorted(p.name for p in split.iterdir() if p.is_dir())
    files = [f for c in classes for f in sorted((split / c).iterdir())[:per_class]]
    return spec, [Image.open(f).convert("RGB") for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kb")
    ap.add_argument("--unknown", action="append", default=[], help="DIR[:class,...] of unknown inputs")
    ap.add_argument("--per-class", type=int, default=50, help="test images per class of each --unknown")
    ap.add_argument("--out", help="write the rates as JSON here")
    args = ap.parse_args()
    clf = Proteus.load(args.kb, progress=False)
    stream = build_benchmark(clf.config.benchmark)
    known = [t.test[i][0] for t in stream.tasks[: clf.num_tasks] for i in range(len(t.test))]
    rates = {"kb": args.kb, "known_accepted": known_share(clf, known), "n_known": len(known), "unknown": {}}
    print(f"{args.kb}: {rates['known_accepted']:.1%} of {len(known)} known test images accepted")
    for spec in args.unknown:
        name, images = folder_images(spec, args.per_class)
        rejected = 1.0 - known_share(clf, images)
        rates["unknown"][name] = {"rejected": rejected, "n": len(images)}
        print(f"  {name}: {rejected:.1%} of {len(images)} rejected as unknown")
    if args.out:
        Path(args.out).write_text(json.dumps(rates, indent=1))


if __name__ == "__main__":
    main()
