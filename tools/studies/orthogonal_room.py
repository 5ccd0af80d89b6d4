"""How many tasks fit before an adapted map runs out of orthogonal room, for every packaged preset.

Eq. 15 keeps each task's new directions of a map orthogonal to every older task's (``adapter.orthogonal``):
a map with input dimension q holds at most q directions in all, so with rank r per task the first
``floor(q / r)`` tasks get their full rank and later ones fewer, then none (``proteus run`` says so when it
happens). The rank budget (``adapter.budget_decay``) shrinks r_m = round(r_0 exp(-decay (m - 1))), floored
at ``adapter.min_rank``, and so stretches the room. This script resolves each preset (as ``proteus run
--benchmark NAME`` does, and with ``--config mobilenet_cpu``), builds its backbone with random weights (no
download), reads the adapted maps' input dimensions and counts:

* ``full``: tasks learned with the full rank on every map;
* ``room``: tasks that still add at least one direction on the narrowest map;
* the stream's length (``benchmark.num_tasks``, else the benchmark's default), and whether it fits. A stream
  whose tasks come from its data (one per domain or source dataset: ``domains5``, ``domains-sim``,
  ``domains-mixed``, ``vtab-sim50``) is built from ``--data`` to count them; without that data its length
  shows as ``?``.

    python tools/studies/orthogonal_room.py --data ../shared/data   # a Markdown table (docs/performance.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from proteus.adapters import AdaptedBackbone
from proteus.backbones import build_backbone
from proteus.config import packaged_configs, resolve_config
from proteus.streams import BenchmarkError, build_benchmark
from proteus.streams.builtin import DEFAULT_NUM_TASKS
from proteus.streams.options import BenchmarkConfig

#: the rank budget of ``--method proteus-budget`` (r_m = r_0 exp(-0.05 (m - 1)), at least 1)
BUDGET = 0.05


def schedule(rank: int, decay: float | None, min_rank: int, m: int) -> int:
    """Task m's rank (1-based), as :meth:`proteus.engine.trainer.AdapterTrainer.rank_for` draws it."""
    if decay is None:
        return rank
    return max(min_rank, int(round(rank * math.exp(-decay * (m - 1)))))


def room(q: int, rank: int, decay: float | None, min_rank: int, limit: int = 100_000) -> tuple[int, int]:
    """(tasks with their full rank, tasks with any new direction) on a map of input dimension q."""
    used, full, any_room = 0, 0, 0
    for m in range(1, limit + 1):
        r = schedule(rank, decay, min_rank, m)
        if used + r <= q and full == m - 1:
            full = m
        if used < q:
            any_room = m
        used += r
        if used >= q and m > full:
            break
    return full, any_room


def stream_length(b: BenchmarkConfig, data: Path | None) -> int | None:
    """The preset's number of tasks: ``num_tasks``, the benchmark's default, or (a stream made from its
    data) the tasks its data gives when ``data`` holds it; None when unknown."""
    if b.num_tasks is not None or b.name in DEFAULT_NUM_TASKS:
        return b.num_tasks or DEFAULT_NUM_TASKS[b.name]
    if data is None:
        return None
    try:
        return build_benchmark(dataclasses.replace(b, data=str(data))).num_tasks
    except BenchmarkError:  # the data for this stream is not there
        return None


def rows(data: Path | None = None) -> list[tuple[str, ...]]:
    out = []
    for name in sorted(packaged_configs("benchmarks")):
        for extra in ([], ["mobilenet_cpu"]):
            cfg = resolve_config(name, config_files=extra)
            b, a = cfg.backbone, cfg.adapter
            bb = build_backbone(b.name, pretrained=False, img_size=b.img_size, adapt_last=b.adapt_last)
            qs = sorted({u.in_features for u in AdaptedBackbone(bb).units.values()})
            full, any_room = room(qs[0], a.rank, a.budget_decay, a.min_rank)
            b_full, b_room = room(qs[0], a.rank, BUDGET, 1)
            n = stream_length(cfg.benchmark, data)
            budget = f"budget {a.budget_decay}" if a.budget_decay is not None else "fixed"
            fits = "?" if n is None else "yes" if n <= full else ("partly" if n <= any_room else "no")
            out.append((
                name + (" + mobilenet_cpu" if extra else ""), b.name, f"{a.rank} ({budget})",
                f"{qs[0]}-{qs[-1]}", str(full), str(any_room), str(n or "?"), fits, f"{b_full} / {b_room}",
            ))  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="the data root of the streams made from their data")
    args = ap.parse_args()
    head = ("preset", "backbone", "rank", "map inputs q", "tasks at full rank", "tasks with room", "stream",
            "fits", "proteus-budget: full / room")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows(args.data):
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
