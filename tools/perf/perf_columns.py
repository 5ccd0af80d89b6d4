"""Each group's own columns or the union of the groups' columns: which composition form a batch spread over
many tasks should run, side by side.

A batch whose inputs were retrieved to many different tasks composes each group (a task's inputs) with its
own row of S (Eq. 9). Where the elastic net (Eq. 15) leaves each row few nonzero columns, a group can run
only its own columns (:func:`proteus.adapters.lora.sparse_columns`: A and B gathered per group, a copy of
the group's columns of both) or every group can run the union of the groups' columns (A and B read once,
more multiply-adds per row). The first pays only when a group has enough positions to use what it copies:
:meth:`proteus.adapters.lora.Composed.form` runs the union when the positions times the columns the own
form saves are under ``OWN_COLUMNS_MIN_WORK`` times its own columns. This script times both forms of one
adapted map, interleaved (medians), for maps of MobileNetV2's and ViT-B's shapes and groups of 1 to 1,024
positions, and prints which form the rule picks beside the faster one::

    python tools/perf/perf_columns.py --threads 2
    python tools/perf/perf_columns.py --threads 2 --json runs/columns.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from perf_timing import _median, interleaved
from torch import nn

from proteus.adapters import LoRAWrapper
from proteus.adapters.lora import OWN_COLUMNS_MIN_WORK, Composed, LoRAUnit, set_composition

#: (name, q, p): maps of the shapes the default backbones adapt
MAPS = [("mobilenet_v2 expand 160->960", 160, 960), ("mobilenet_v2 last 320->1280", 320, 1280),
        ("vit_b16 qkv 768->2304", 768, 2304)]  # fmt: skip
POSITIONS = [1, 4, 16, 64, 197, 1024]


def _unit(q: int, p: int, tasks: int, rank: int, kept: int, seed: int) -> tuple[LoRAWrapper, LoRAUnit]:
    """A wrapped linear map with ``tasks`` tasks of ``rank`` directions, each keeping ``kept`` older columns
    in its row of S (the elastic net's sparsity)."""
    g = torch.Generator().manual_seed(seed)
    w = LoRAWrapper(nn.Linear(q, p), {}, 1.0)
    u = w.unit_list()[0]
    for _ in range(tasks):
        u.begin_task(rank, "learned", True, g)
        with torch.no_grad():
            assert u.B_new is not None
            u.B_new.normal_(generator=g)
            if u.s is not None and u.s.numel():
                keep = torch.randperm(u.s.numel(), generator=g)[:kept]
                u.s[keep] = torch.randn(len(keep), generator=g)
        u.end_task()
    return w, u


def _runner(
    w: LoRAWrapper, u: LoRAUnit, form: tuple[torch.Tensor, torch.Tensor | None], x: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """A forward of ``x`` through ``w`` with its unit composed in ``form`` (no other form beside it)."""

    def run() -> torch.Tensor:
        u.composed = Composed(*form)
        return w(x)

    return run


def measure(
    threads: int, reps: int, groups: int, seed: int, maps: list[tuple[str, int, int]] = MAPS,
    positions_list: list[int] = POSITIONS,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per map of ``maps`` and group size of ``positions_list``: both forms timed, interleaved."""
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    rows = []
    for name, q, p in maps:
        rank = 2
        w, u = _unit(q, p, tasks=q // rank, rank=rank, kept=8, seed=seed)  # the map's room full
        tasks = torch.randperm(u.num_tasks, generator=torch.Generator().manual_seed(seed))[:groups].tolist()
        coef = u.coefficients(tasks)[:, : u.used_columns(tasks)]
        sizes = [1] * len(tasks)
        set_composition(u, coef, sizes)
        composed = u.composed
        if composed is None or composed.union is None:
            raise SystemExit(f"{name}: the groups keep no columns of their own to compare (a denser S?)")
        own_form, union_form = (composed.coef, composed.cols), composed.union
        w.groups, w.sizes = len(tasks), sizes
        for positions in positions_list:
            x = torch.randn(len(tasks), positions, q)
            run = {"own": _runner(w, u, own_form, x), "union": _runner(w, u, union_form, x)}
            with torch.no_grad():
                t = interleaved(run, dev, reps)
            picked = "union" if composed.form(positions) is union_form else "own"
            o, un = _median(t["own"]), _median(t["union"])
            rows.append({
                "map": name, "positions": positions, "groups": len(tasks),
                "own_columns": own_form[0].shape[1], "union_columns": union_form[0].shape[1],
                "own_ms": 1e3 * o, "union_ms": 1e3 * un,
                "own_over_union": o / un, "picked": picked, "faster": "own" if o < un else "union",
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("::")[-1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="timed calls of each form, interleaved")
    ap.add_argument("--groups", type=int, default=32, help="groups (tasks) in the batch, one image each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    rows = measure(args.threads, args.reps, args.groups, args.seed)
    print(f"OWN_COLUMNS_MIN_WORK = {OWN_COLUMNS_MIN_WORK:g}")
    print("| map | positions | own / union columns | own (ms) | union (ms) | own / union | picked | faster |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        print(f"| {r['map']} | {r['positions']} | {r['own_columns']} / {r['union_columns']} | "
              f"{r['own_ms']:.2f} | {r['union_ms']:.2f} | {r['own_over_union']:.2f} | {r['picked']} | "
              f"{r['faster']} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
