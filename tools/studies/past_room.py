"""Accuracy past the orthogonal room: for finished runs of one stream (``proteus run`` or ``compare`` run
folders holding ``results.json``), each task's accuracy after the last task, split at the first task of
the first run that got fewer directions than its rank on some map (``train.ranks_min`` of its record: Eq. 15
had no room left), so that every run is split at the same task.

    python tools/studies/past_room.py plain=runs/room/plain/proteus/seed0 rank5=runs/room/rank5/proteus/seed0

Prints a Markdown table: per run, the final average accuracy, the mean final accuracy of the tasks learned
with their full rank and of the later ones, the same with the true task's adapter (oracle), and retrieval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def first_short(run: Path) -> int | None:
    """The index of the first task learned with fewer directions than its rank on some map (None: none)."""
    tasks = json.loads((run / "results.json").read_text())["tasks"]
    return next((i for i, t in enumerate(tasks) if t["train"]["ranks_min"] < t["train"]["rank"]), None)


def summary(run: Path, first: int) -> dict:
    r = json.loads((run / "results.json").read_text())
    tasks = r["tasks"]
    short = first_short(run)
    acc, oracle = r["acc_matrix"][-1], (r.get("oracle_acc_matrix") or [[]])[-1]
    return {
        "final": r["final_avg_acc"],
        "first_short": None if short is None else short + 1,
        "ranks": [t["train"]["ranks_min"] for t in tasks],
        "acc_full": _mean(acc[:first]),
        "acc_past": _mean(acc[first:]),
        "oracle_full": _mean(oracle[:first]) if oracle else None,
        "oracle_past": _mean(oracle[first:]) if oracle else None,
        "retrieval": r["retrieval_acc"][-1] if r.get("retrieval_acc") else None,
    }


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    runs = [(name, Path(path)) for name, _, path in (a.rpartition("=") for a in argv)]
    first = first_short(runs[0][1])
    if first is None:
        print(f"{runs[0][1]}: every task got its full rank; nothing to split at")
        return 1
    print(f"Split at task {first + 1}, the first task of {runs[0][0] or runs[0][1]} short of its rank.\n")
    print("| run | final avg acc | first task short of its rank | tasks before: acc / oracle "
          "| from it on: acc / oracle | retrieval | rank of each task (fewest over maps) |")  # fmt: skip
    print("|---|---:|---:|---|---|---:|---|")
    for name, path in runs:
        s = summary(path, first)
        print(
            f"| {name or path} | {_f(s['final'])} | {s['first_short'] or 'none'} | {_f(s['acc_full'])} / "
            f"{_f(s['oracle_full'])} | {_f(s['acc_past'])} / {_f(s['oracle_past'])} | {_f(s['retrieval'])} | "
            f"{' '.join(map(str, s['ranks']))} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
