"""What ``make demo`` costs on a quiet machine and on one loaded by other work: its two commands (the
quickstart, then ``compare`` of four methods reusing it, as the Makefile runs them) in a fresh folder, once
per setting, each timed in wall time and in CPU time (user + system of every process it ran, from
``wait4``). A loaded setting first starts that many busy processes (each a Python loop spinning on a core,
at this script's own priority) and stops them after.

    python tools/perf/busy_demo.py --record tools/perf/records/demo-load.json      # quiet, then 2 busy
    python tools/perf/busy_demo.py --runs passive:0,passive:2,spinning:2 --out runs/demo-load.json

A setting is ``POLICY:BUSY``: ``passive`` runs the command line as it is (OpenMP's threads wait passively:
:mod:`proteus.cli.threads`); ``spinning`` runs it with that module's start-up choice switched off, as the
releases before it ran (libgomp's own default: a waiting thread spins before it sleeps), to show what the
passive policy saves. The record keeps each run's figures, the machine's load average around it, the
cores and the final accuracies (the same in every setting: threads change when, not what); the README's
sentence on the demo's time quotes it (tests/test_readme.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: what the demo's processes do not inherit from this one: the user's thread settings
OMP_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
METHODS = "proteus,proteus-lda,ranpac,frozen"
#: the command line, with :func:`proteus.cli.threads.prepare` switched off for the ``spinning`` policy
LAUNCH = {
    "passive": "import sys\nfrom proteus.cli import main\nsys.exit(main())",
    "spinning": "import sys\nimport proteus.cli.threads as t\nt.prepare = lambda threads: None\n"
    "from proteus.cli import main\nsys.exit(main())",
}


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes each spinning on a core until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _run(argv: list[str], policy: str, env: dict[str, str]) -> tuple[float, float, float]:
    """(wall, user, system) seconds of ``proteus argv`` under ``policy``, its children included."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", LAUNCH[policy], *argv], env=env, cwd=ROOT)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"proteus {' '.join(argv)} failed (exit {p.returncode})")
    return wall, usage.ru_utime, usage.ru_stime


def demo(policy: str, busy: int, work: Path) -> dict[str, Any]:
    """One ``make demo`` (without the install and the weights) in ``work`` with ``busy`` busy processes."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    quick, compared = work / "quickstart", work / "demo-compare"
    steps = {
        "quickstart": ["quickstart", "--out", str(quick), "-q"],
        "compare": ["compare", "--benchmark", "quickstart", "--seeds", "0", "--out", str(compared),
                    "--methods", METHODS, "--set", "report.figures=false", "--set", "report.latency=false",
                    "-q"],
    }  # fmt: skip
    load0 = os.getloadavg()[0]
    spinners = _busy(busy)
    try:
        time.sleep(2 if busy else 0)  # the busy processes running before the clock starts
        figures: dict[str, Any] = {}
        for name, argv in steps.items():
            if name == "compare":  # the Makefile's link: the quickstart is compare's proteus run
                (compared / "proteus").mkdir(parents=True)
                (compared / "proteus" / "seed0").symlink_to(quick.resolve())
            wall, user, system = _run(argv, policy, env)
            figures[name] = {"wall_s": round(wall, 2), "user_s": round(user, 2), "system_s": round(system, 2)}
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    total = {k: round(sum(f[k] for f in figures.values()), 2) for k in ("wall_s", "user_s", "system_s")}
    finals = {
        m: json.loads((compared / m / "seed0" / "results.json").read_text())["final_avg_acc"]
        for m in METHODS.split(",")
    }
    return {
        "policy": policy,
        "busy": busy,
        **total,
        "cpu_s": round(total["user_s"] + total["system_s"], 2),
        "steps": figures,
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "final_avg_acc": {m: round(v, 2) for m, v in finals.items()},
    }


def _write(record: dict[str, Any], path: Path) -> None:
    """The record at ``path``, each run's CPU and wall time also as a ratio to the quiet run's."""
    quiet = next((r for r in record["runs"] if r["busy"] == 0 and r["policy"] == "passive"), None)
    if quiet is not None:
        for r in record["runs"]:
            r["cpu_vs_quiet"] = round(r["cpu_s"] / quiet["cpu_s"], 3)
            r["wall_vs_quiet"] = round(r["wall_s"] / quiet["wall_s"], 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="passive:0,passive:2", help="POLICY:BUSY settings, in order")
    ap.add_argument("--record", "--out", dest="out", help="write the JSON record here")
    args = ap.parse_args(argv)
    runs = [(p, int(b)) for p, b in (r.split(":") for r in args.runs.split(","))]
    for policy, _ in runs:
        if policy not in LAUNCH:
            ap.error(f"unknown policy {policy!r}; choose {', '.join(LAUNCH)}")
    sys.path.insert(0, str(ROOT / "src"))
    from proteus.cli.threads import usable_cores
    from proteus.experiment.provenance import provenance

    fetch = [sys.executable, "-m", "proteus", "weights", "fetch", "mobilenet_v2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(fetch, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    record: dict[str, Any] = {
        "name": "demo-load",
        "command": "python tools/perf/busy_demo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "nice": os.nice(0),
        "date": time.strftime("%Y-%m-%d"),
        "provenance": provenance("cpu"),  # this checkout's commit and versions: the demo runs from it
        "runs": [],
    }
    for policy, busy in runs:
        with tempfile.TemporaryDirectory(prefix="proteus-busy-demo-") as work:
            run = demo(policy, busy, Path(work))
        record["runs"].append(run)
        print(json.dumps(run), flush=True)
        if args.out:  # after each run: an interrupted measurement keeps the runs it finished
            _write(record, Path(args.out))
    for r in record["runs"]:
        vs = f" ({r['cpu_vs_quiet']:.2f}x the quiet CPU time)" if "cpu_vs_quiet" in r else ""
        print(f"{r['policy']:>8}, {r['busy']} busy: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU{vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
