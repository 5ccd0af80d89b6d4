"""results.json, the run contract (docs/architecture.md): keys are never renamed without a deprecation path.

``benchmark, method, backbone, seed, num_tasks, acc_matrix, avg_acc, final_avg_acc, forgetting,
forgetting_per_step, retrieval_acc, oracle_avg_acc, oracle_acc_matrix, seconds, proteus_version`` plus
what a run adds (``tasks``, ``kb_bytes``, the report's keys).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from proteus._version import __version__
from proteus.config import RunConfig
from proteus.metrics import average_accuracy, forgetting
from proteus.streams import TaskStream

__all__ = [
    "MEASUREMENT_KEYS", "TRAIN_LOG_COLUMNS", "append_train_log", "build_results", "computed", "format_table",
    "write_acc_matrix",
]  # fmt: skip

#: results.json keys (at any depth, by substring) that measure the process rather than compute the model's
#: results: wall-clock times, memory, and how the run was made (``provenance``: the commit, the versions,
#: the device, the time)
MEASUREMENT_KEYS = ("seconds", "latency", "figures", "peak_gpu_mb", "provenance")


def computed(results: Any) -> Any:
    """``results`` (a results.json value) without its :data:`MEASUREMENT_KEYS`: what two runs of the same
    settings must agree on (a run under ``torchrun`` and a plain one, a run before and after a refactor)."""
    if isinstance(results, dict):
        return {k: computed(v) for k, v in results.items() if not any(m in k for m in MEASUREMENT_KEYS)}
    if isinstance(results, list):
        return [computed(v) for v in results]
    return results


def build_results(
    cfg: RunConfig,
    stream: TaskStream,
    evaluation: list[dict[str, Any]],
    seconds: float,
    extra: dict | None = None,
) -> dict[str, Any]:
    m = len(stream.tasks)
    rows = [e["row"] for e in evaluation]
    matrix = [list(r) + [None] * (m - len(r)) for r in rows]
    avg = average_accuracy(rows) if evaluation else []
    forg = forgetting(rows) if evaluation else []
    ret = [e["retrieval_acc"] for e in evaluation]
    oracle = [sum(e["oracle_row"]) / len(e["oracle_row"]) if e["oracle_row"] else None for e in evaluation]
    res = {
        "benchmark": stream.name,
        "method": cfg.method,
        "backbone": cfg.backbone.name,
        "seed": cfg.seed,
        "num_tasks": m,
        "acc_matrix": matrix,
        "avg_acc": avg,
        "final_avg_acc": avg[-1] if avg else None,
        "forgetting": forg[-1] if forg else None,
        "forgetting_per_step": forg,
        "retrieval_acc": ret if any(r is not None for r in ret) else None,
        "oracle_avg_acc": oracle if any(o is not None for o in oracle) else None,
        "oracle_acc_matrix": [e["oracle_row"] for e in evaluation]
        if evaluation and evaluation[0]["oracle_row"]
        else None,
        "seconds": seconds,
        "proteus_version": __version__,
    }
    res.update(extra or {})
    return res


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_table(res: dict[str, Any]) -> str:
    lines = [f"{res['method']} on {res['benchmark']} ({res['backbone']}, seed {res['seed']})"]
    hdr = f"{'after task':>10} | {'avg acc':>8} | {'retrieval':>9} | {'oracle':>7}"
    lines += [hdr, "-" * len(hdr)]
    ret = res.get("retrieval_acc") or [None] * len(res["avg_acc"])
    orc = res.get("oracle_avg_acc") or [None] * len(res["avg_acc"])
    steps = res.get("evaluated_after") or list(range(1, len(res["avg_acc"]) + 1))
    for i, a in enumerate(res["avg_acc"]):
        lines.append(f"{steps[i]:>10} | {_f(a):>8} | {_f(ret[i]):>9} | {_f(orc[i]):>7}")
    lines.append(
        f"final average accuracy {_f(res['final_avg_acc'])}%, forgetting {_f(res['forgetting'])}, "
        f"{res['seconds']:.1f} s"
    )
    return "\n".join(lines)


#: the columns of a run's train_log.csv (docs/experiments.md)
TRAIN_LOG_COLUMNS = ("task", "epoch", "step", "loss", "lr", "penalty")


def append_train_log(path: Path, task: int, rows: Iterable[dict[str, Any]]) -> None:
    """Append task ``task``'s (1-based) training curve to train_log.csv at ``path`` (the header first,
    when the file is new): one row per optimisation step, columns :data:`TRAIN_LOG_COLUMNS`."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(TRAIN_LOG_COLUMNS)
        for r in rows:
            w.writerow([task, *(r.get(c, "") for c in TRAIN_LOG_COLUMNS[1:])])


def write_acc_matrix(path: Path, res: dict[str, Any]) -> None:
    """results.json's ``acc_matrix`` as a CSV at ``path``: a row per evaluation (``after_task``, 1-based),
    a column per task (``task_1`` ...), empty above the diagonal; floats as Python writes them (exact)."""
    matrix = res["acc_matrix"]
    after = res.get("evaluated_after") or list(range(1, len(matrix) + 1))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["after_task", *(f"task_{t + 1}" for t in range(res["num_tasks"]))])
        for k, row in zip(after, matrix):
            w.writerow([k, *("" if a is None else a for a in row)])
