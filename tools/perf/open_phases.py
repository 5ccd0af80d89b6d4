"""Where opening a knowledge base and predicting one image spends its time, phase by phase, for several
knowledge bases side by side: what grows between a short stream's knowledge base and a long one's.

A reader as ``proteus predict`` or a starting server is one: ``Proteus.load(KB).predict(image)``. Each
phase is the wall time spent inside one function of the load (the store's opening, the state's reading,
each task's record and parts, the adapters' directions, the head, the prediction), summed over its calls;
*rest* is what no phase covers. The knowledge bases are opened in turns (one of each per turn, after one
opening of each that pays the imports and the kernels' first use), medians over the turns; the last column
is the last knowledge base's phase over the first one's::

    python tools/perf/open_phases.py /tmp/kb1000h-10 /tmp/kb1000h --turns 9
    python tools/perf/open_phases.py KB_A KB_B --json runs/open_phases.json

The knowledge bases of ``tools/perf/perf_long.py --keep-kb DIR`` (DIR and DIR-10) are such a pair. The
phases are found by patching the functions named in :data:`PHASES` for the duration of the run (a profiler's
business, not the library's): a renamed function fails here by name.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

#: (module, attribute path, phase): the functions timed, in the order a load calls them
PHASES = (
    ("proteus.kb.store", "KnowledgeBase.open", "open the store"),
    ("proteus.kb.store", "KnowledgeBase.read_state", "read the state"),
    ("proteus.core.estimator", "Proteus._build", "build the learner"),
    ("proteus.engine.records", "TaskRecord.from_dict", "records"),
    ("proteus.core.codec", "_load_task", "tasks' parts (records included)"),
    ("proteus.adapters.model", "AdaptedBackbone.append_tasks_tensors", "adapters' directions"),
    ("proteus.core.codec", "load_head", "head"),
    ("proteus.core.estimator", "Proteus.predict", "predict"),
)


def _patch(spent: dict[str, float]) -> list[tuple[Any, str, Any]]:
    """Wrap every function of :data:`PHASES` so that its wall time adds to ``spent[phase]``; returns what to
    put back."""
    undo = []
    for module, path, phase in PHASES:
        owner: Any = importlib.import_module(module)
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        fn = real.__func__ if isinstance(real, (classmethod, staticmethod)) else real

        def timed(*a: Any, _fn: Any = fn, _phase: str = phase, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_phase] += time.perf_counter() - t0

        functools.update_wrapper(timed, fn)
        wrapped = classmethod(timed) if isinstance(real, classmethod) else timed
        setattr(owner, name, wrapped)
        undo.append((owner, name, real))
    return undo


def measure(kbs: list[Path], turns: int, image: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per knowledge base, the median seconds of each phase and of the whole (``total``), and ``rest``."""
    from proteus import Proteus

    for kb in kbs:  # the imports, the kernels' first use
        Proteus.load(kb, device="cpu").predict(image)
    spent: dict[str, float] = defaultdict(float)
    undo = _patch(spent)
    got: dict[str, dict[str, list[float]]] = {str(kb): defaultdict(list) for kb in kbs}
    try:
        for _ in range(turns):
            for kb in kbs:
                spent.clear()
                t0 = time.perf_counter()
                Proteus.load(kb, device="cpu").predict(image)
                total = time.perf_counter() - t0
                for _, _, phase in PHASES:
                    got[str(kb)][phase].append(spent.get(phase, 0.0))
                got[str(kb)]["total"].append(total)
    finally:
        for owner, name, real in undo:
            setattr(owner, name, real)
    out: dict[str, dict[str, float]] = {}
    for kb, phases in got.items():
        med = {phase: statistics.median(v) for phase, v in phases.items()}
        # the tasks' parts include the records; the rest is the total less the phases that do not nest
        outer = [p for _, _, p in PHASES if p != "records"]
        med["rest"] = med["total"] - sum(med[p] for p in outer)
        out[kb] = med
    return out


def table(result: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one row per phase, one column per knowledge base (ms), and last / first."""
    kbs = list(result)
    rows = [p for _, _, p in PHASES] + ["rest", "total"]
    head = "| phase | " + " | ".join(f"`{Path(kb).name}` (ms)" for kb in kbs) + " | last / first |"
    lines = [head, "| --- |" + " ---: |" * (len(kbs) + 1)]
    for phase in rows:
        first, last = result[kbs[0]][phase], result[kbs[-1]][phase]
        ratio = f"{last / first:.2f}" if first > 1e-4 else "-"
        cells = " | ".join(f"{result[kb][phase] * 1e3:.1f}" for kb in kbs)
        lines.append(f"| {phase} | {cells} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kbs", nargs="+", type=Path, help="knowledge bases, the reference first")
    ap.add_argument("--turns", type=int, default=7, help="openings of each knowledge base (medians)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--size", type=int, default=32, help="the image's side in pixels")
    ap.add_argument("--json", type=Path, default=None, help="also write the medians (seconds) here")
    args = ap.parse_args(argv)
    missing = [str(kb) for kb in args.kbs if not (kb / "manifest.json").is_file()]
    if missing:
        ap.error(f"not a knowledge base (no manifest.json): {', '.join(missing)}")
    if args.turns < 1:
        ap.error("--turns must be at least 1")
    torch.set_num_threads(args.threads)
    image = torch.randn(1, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    result = measure(args.kbs, args.turns, image)
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
