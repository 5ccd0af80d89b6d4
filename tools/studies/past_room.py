"""Accuracy past the orthogonal room: for finished runs of one stream (``proteus run`` or ``compare`` run
folders holding ``results.json``), each task's accuracy after the last task, split at the first task of
the first schedule's first run that got fewer directions than its rank on some map (``train.ranks_min`` of
its record: Eq. 15 had no room left), so that every run is split at the same task. A schedule may name
several runs (seeds), comma-separated: its row is their mean.

    python tools/studies/past_room.py rank8=out/plain/proteus/seed0,out/plain/proteus/seed1 \\
        rank5=out/rank5/proteus/seed0,out/rank5/proteus/seed1

Prints a Markdown table: per schedule, the final average accuracy, the mean final accuracy of the tasks
before the split and from it on, the same with the true task's adapter (oracle), and retrieval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: the figures of a row, each averaged over the schedule's runs
FIGURES = ("final", "acc_before", "oracle_before", "acc_past", "oracle_past", "retrieval")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def first_short(results: dict[str, Any]) -> int | None:
    """The index of the first task learned with fewer directions than its rank on some map (None: none)."""
    tasks = results["tasks"]
    return next((i for i, t in enumerate(tasks) if t["train"]["ranks_min"] < t["train"]["rank"]), None)


def summary(results: dict[str, Any], split: int) -> dict[str, Any]:
    """One run's figures, its tasks split at index ``split``."""
    acc, oracle = results["acc_matrix"][-1], (results.get("oracle_acc_matrix") or [[]])[-1]
    return {
        "final": results["final_avg_acc"],
        "acc_before": _mean(acc[:split]),
        "acc_past": _mean(acc[split:]),
        "oracle_before": _mean(oracle[:split]),
        "oracle_past": _mean(oracle[split:]),
        "retrieval": results["retrieval_acc"][-1] if results.get("retrieval_acc") else None,
        "ranks": [t["train"]["ranks_min"] for t in results["tasks"]],
    }


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    schedules = [(name or paths, paths.split(",")) for name, _, paths in (a.rpartition("=") for a in argv)]
    results = {p: json.loads((Path(p) / "results.json").read_text()) for _, ps in schedules for p in ps}
    split = first_short(results[schedules[0][1][0]])
    if split is None:
        print(f"{schedules[0][1][0]}: every task got its full rank; nothing to split at")
        return 1
    print(f"Split at task {split + 1}, the first task of {schedules[0][0]} short of its rank.\n")
    print("| schedule | runs | final avg acc | tasks before: acc / oracle | from it on: acc / oracle "
          "| retrieval | rank of each task (fewest over maps, first run) |")  # fmt: skip
    print("|---|---:|---:|---|---|---:|---|")
    for name, paths in schedules:
        rows = [summary(results[p], split) for p in paths]
        m = {k: _mean([r[k] for r in rows if r[k] is not None]) for k in FIGURES}
        print(
            f"| {name} | {len(rows)} | {_f(m['final'])} | {_f(m['acc_before'])} / {_f(m['oracle_before'])} | "
            f"{_f(m['acc_past'])} / {_f(m['oracle_past'])} | {_f(m['retrieval'])} | "
            f"{' '.join(map(str, rows[0]['ranks']))} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
