"""Results parity: every registered method's results.json on quickstart (seed 0), without timing fields.

A refactor must not change what any method computes. ``record`` runs every method through the public
command line and keeps its results.json minus wall-clock fields; ``compare`` checks two recordings key
by key (bit for bit: JSON numbers compared as written).

    python tools/parity/results_parity.py record runs/parity-before   # on the old code
    python tools/parity/results_parity.py record runs/parity-after    # on the new code
    python tools/parity/results_parity.py compare tools/parity runs/parity-after --ignore kb_bytes.manifest

One thread per run by default (so float reductions are ordered the same way every time; ``--threads N``
records with N); ``--jobs`` runs that many methods at once. The JSON files beside this script are the
recording of the methods the README's demo table and docs quote (``record --methods
proteus,proteus-lda,ranpac,frozen,proteus-paper,ranpac-accumulated``, 2-core AMD EPYC CPU, torch 2.14.1),
``threads2/`` the same with ``--threads 2 --jobs 1``; tests/test_readme.py checks the README's demo table
and the figures that move with the thread count against them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from proteus.experiment.results import computed


def methods() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "proteus", "list", "methods"], check=True, capture_output=True, text=True
    ).stdout
    return [line.split()[0] for line in out.splitlines()[1:] if line.strip()]


#: the settings of a prompt method (it needs a ViT's tokens) on quickstart: a random ViT-Ti at 32 px
VIT_SETS = ["backbone.name=vit_ti16", "backbone.pretrained=false", "backbone.img_size=32", "train.epochs=1"]


def run_one(method: str, out: Path, extra: list[str] | None = None, threads: int = 1) -> str:
    run_dir = out / "runs" / method
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [
        sys.executable,
        "-m",
        "proteus",
        "run",
        "--benchmark",
        "quickstart",
        "--method",
        method,
        "--seed",
        "0",
        "--out",
        str(run_dir),
        "--quiet",
        "--set",
        "report.latency=false",
        "--set",
        "report.figures=false",
        *(a for s in extra or [] for a in ("--set", s)),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode == 2 and "needs a backbone with tokens" in p.stderr and extra is None:
        return run_one(method, out, VIT_SETS, threads)
    if p.returncode != 0:
        return f"{method}: FAILED ({p.returncode})\n{p.stderr[-2000:]}"
    res = json.loads((run_dir / "results.json").read_text())
    (out / f"{method}.json").write_text(json.dumps(computed(res), indent=1, sort_keys=True))
    return f"{method}: final {res['final_avg_acc']:.2f}" + (" (random ViT-Ti, 32 px)" if extra else "")


def record(out: Path, jobs: int, only: list[str] | None, threads: int = 1) -> int:
    out.mkdir(parents=True, exist_ok=True)
    names = only or methods()
    with ThreadPoolExecutor(jobs) as pool:
        for line in pool.map(lambda m: run_one(m, out, threads=threads), names):
            print(line, flush=True)
    return 0


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> int:
    bad = 0
    for fa in sorted(a.glob("*.json")):
        fb = b / fa.name
        if not fb.is_file():
            print(f"{fa.stem}: missing in {b}")
            bad += 1
            continue
        ra, rb = (computed(json.loads(f.read_text())) for f in (fa, fb))
        d = [x for x in diff(ra, rb) if not any(x.startswith(f".{i}:") for i in ignore)]
        print(f"{fa.stem}: {'identical' if not d else f'{len(d)} differences'}")
        for line in d[:10]:
            print("   ", line)
        bad += bool(d)
    print(f"{bad} method(s) differ")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--methods", help="comma-separated subset")
    r.add_argument(
        "--threads", type=int, default=1, help="threads per run (OMP/MKL_NUM_THREADS); 1 by default"
    )
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument(
        "--ignore", default="", help="comma-separated key paths to leave out (e.g. kb_bytes.manifest)"
    )
    args = p.parse_args()
    if args.cmd == "record":
        only = args.methods.split(",") if args.methods else None
        return record(args.out, args.jobs, only, args.threads)
    return compare(args.a, args.b, tuple(k for k in args.ignore.split(",") if k))


if __name__ == "__main__":
    sys.exit(main())
