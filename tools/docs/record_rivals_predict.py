"""Keep what ``tools/perf/perf_rivals_predict.py`` measured, for the docs:
``python tools/docs/record_rivals_predict.py RUN.json --name NAME --command "..."`` writes
``docs/measured/rivals_predict/NAME.json``: the methods, the numbers of tasks m, the seconds per batch of
each method at each m (medians of its turns) and the growth from the first m to the last.
``tests/test_measured_docs.py`` checks that docs/performance.md shows each figure in the section naming
`` `NAME` ``, so the page cannot drift from the run.
"""

from __future__ import annotations

import json
from pathlib import Path

from records import from_checkout, parser, write


def main() -> None:
    ap = parser(__doc__, "rivals_predict")
    ap.add_argument("run", type=Path, help="the report of perf_rivals_predict.py")
    args = ap.parse_args()
    run = json.loads(args.run.read_text())
    keep = ("methods", "m", "batch", "per_class", "img", "reps", "rows", "ratio_last_vs_first")
    record = {"name": args.name, "command": args.command, **{k: run[k] for k in keep}}
    record["provenance"] = from_checkout(args.command, device="cpu", threads=run["threads"])
    print(write(args.out, args.name, record, "rivals_predict"))


if __name__ == "__main__":
    main()
