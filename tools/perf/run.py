"""Performance harness: the command line of ``harness.py`` (``proteus bench`` from a checkout).

    python tools/perf/run.py --out runs/bench.json              # default sizes (2 CPU cores: < 10 min)
    python tools/perf/run.py --quick --out runs/bench-quick.json  # about 90 s
    python tools/perf/run.py --tiny --only predict,latency        # smoke test of some sections
    python tools/perf/run.py --device cuda --out runs/bench-gpu.json

Every figure is a ratio measured side by side in one process (interleaved repetitions, medians); see
``docs/performance.md`` for what each figure compares and its target. ``--out FILE`` writes the JSON
report and ``FILE`` with the suffix ``.png`` (latency against the number of tasks).
"""

from __future__ import annotations

import argparse
import sys

from harness import SECTIONS  # type: ignore[import-not-found]
from harness import main as bench_main  # type: ignore[import-not-found]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the JSON report here (and the latency figure next to it)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (about 90 s on 2 cores)")
    ap.add_argument("--tiny", action="store_true", help="smoke-test sizes (what the test suite runs)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto")
    ap.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)} (default: all)")
    return bench_main(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
