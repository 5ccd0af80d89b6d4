"""Markdown table from retrieval_ablation.py outputs (one column pair per sequence).

python tools/studies/retrieval_table.py runs/ra_cifar10.json runs/ra_abrupt.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    runs = [(Path(p).stem, json.loads(Path(p).read_text())["results"]) for p in paths]
    names: list[str] = []
    for _, res in runs:
        names += [n for n in res if n not in names]
    head = "| variant | " + " | ".join(f"{s}: retrieval | {s}: final acc" for s, _ in runs) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(runs)))
    for n in names:
        cells = []
        for _, res in runs:
            r = res.get(n)
            if r is None or "error" in r:
                cells += ["-", "-"]
            else:
                cells += [f"{r['retrieval_acc']:.2f}", f"{r['final_avg_acc']:.2f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
