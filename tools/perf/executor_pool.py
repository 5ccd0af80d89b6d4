"""The pool executor against the local one, side by side: one ``proteus reproduce`` command run with
``--executor local`` and with ``--executor pool --jobs N``, each into a fresh folder, timed in wall time,
alternating (local, pool, local, pool, ... ``--repeats`` times each); then the two tables compared: the CSV
byte for byte, the Markdown byte for byte but for its ``Made by:`` line (which names each folder).

    python tools/perf/executor_pool.py                      # ablationS on the quickstart, 2 jobs
    python tools/perf/executor_pool.py --jobs 2 --extra "--seeds 0 --set train.epochs=1" --out runs/pool.json

Prints each run's wall time, the ratio local / pool (above 1: the pool is faster) and whether the tables
are the same; exit 1 when they are not. The machine's load average is recorded around every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], out: Path) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "proteus", *argv, "--out", str(out), "-q"], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", default="ablationS")
    p.add_argument("--benchmark", default="quickstart")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--extra", default="", help="more arguments of the reproduce command (quoted)")
    p.add_argument("--out", help="write the record (JSON) here")
    p.add_argument("--keep", help="run into this folder (kept) instead of a temporary one")
    args = p.parse_args()
    base = ["reproduce", args.table, "--benchmark", args.benchmark, *shlex.split(args.extra)]
    runs: list[dict[str, object]] = []
    stem = f"{args.table}-{args.benchmark}"
    with tempfile.TemporaryDirectory(prefix="executor-pool-") as scratch:
        tmp = args.keep or scratch
        for i in range(args.repeats):
            for name, flags in (("local", ["--executor", "local"]),
                                ("pool", ["--executor", "pool", "--jobs", str(args.jobs)])):  # fmt: skip
                out = Path(tmp) / f"{name}{i}"
                load0 = os.getloadavg()[0]
                wall = _run([*base, *flags], out)
                runs.append({"executor": name, "wall_s": round(wall, 2), "load_before": load0,
                             "load_after": os.getloadavg()[0]})  # fmt: skip
                print(
                    f"{name:<6} run {i}: {wall:7.1f} s (load average {load0:.2f} -> {os.getloadavg()[0]:.2f})"
                )
        csv0 = (Path(tmp) / "local0" / f"{stem}.csv").read_bytes()
        same_csv = all(
            (Path(tmp) / f"{n}{i}" / f"{stem}.csv").read_bytes() == csv0
            for n in ("local", "pool")
            for i in range(args.repeats)
        )

        def md(folder: str) -> list[str]:
            text = (Path(tmp) / folder / f"{stem}.md").read_text()
            return [ln for ln in text.splitlines() if not ln.startswith("Made by:")]

        same_md = all(md(f"{n}{i}") == md("local0") for n in ("local", "pool") for i in range(args.repeats))
    local = sum(float(r["wall_s"]) for r in runs if r["executor"] == "local")  # type: ignore[arg-type]
    pool = sum(float(r["wall_s"]) for r in runs if r["executor"] == "pool")  # type: ignore[arg-type]
    record = {
        "command": "proteus " + " ".join(base),
        "jobs": args.jobs,
        "cores": len(os.sched_getaffinity(0)),
        "runs": runs,
        "ratio_local_over_pool": round(local / pool, 3),
        "same_csv": same_csv,
        "same_md": same_md,
    }
    print(f"wall time local / pool (--jobs {args.jobs}): {local / pool:.2f}; same CSV: {same_csv}, "
          f"same Markdown (but its Made-by line): {same_md}")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if same_csv and same_md else 1


if __name__ == "__main__":
    sys.exit(main())
