"""Keep what ``proteus reproduce`` measured, for the docs:
``python tools/docs/record_reproduce.py OUT/NAME-BENCH.json ... --command "proteus reproduce ..."``
writes ``docs/measured/NAME-BENCH.json`` (the table's name, title,
seeds, the command and its rows: variant, method, metric, our mean and sample std, the paper's number).
``tests/test_measured_docs.py`` checks that every number of every record is the one docs/experiments.md
shows in that table's section, so the page cannot drift from what the runs gave.
"""

from __future__ import annotations

import json
from pathlib import Path

from records import parser, write

KEEP = ("variant", "method", "metric", "benchmark", "ours_mean", "ours_std", "seeds", "paper", "skip")


def record(path: Path, command: str, out_dir: Path) -> Path:
    d = json.loads(path.read_text())
    rows = [{k: r.get(k) for k in KEEP} for r in d["rows"]]
    kept = {"table": d["table"], "title": d["title"], "seeds": d["seeds"], "command": command, "rows": rows}
    return write(out_dir, path.stem, kept)


def main() -> None:
    ap = parser(__doc__, named=False)
    ap.add_argument("tables", nargs="+", type=Path, help="OUT/NAME-BENCH.json of proteus reproduce")
    args = ap.parse_args()
    for p in args.tables:
        print(record(p, args.command, args.out))


if __name__ == "__main__":
    main()
