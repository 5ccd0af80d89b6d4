"""Keep what ``proteus compare`` measured, for the docs:
``python tools/docs/record_compare.py OUT/compare.json --name NAME --command "proteus compare ..."``
writes ``docs/measured/compare/NAME.json`` (the stream, the seeds, the command and, per method, the mean and
sample std of each final figure). ``tests/test_measured_docs.py`` checks that the page section headed
`` `NAME` `` (docs/retrieval.md) shows every one of them, so the page cannot drift from what the runs gave.
"""

from __future__ import annotations

import json
from pathlib import Path

from records import parser, write

#: the final figures kept, in the order of compare's table
KEEP = ("final_avg_acc", "forgetting", "retrieval_acc", "oracle_acc")


def record(path: Path, name: str, command: str, out_dir: Path) -> Path:
    d = json.loads(path.read_text())
    seeds = sorted({int(s) for runs in d["runs"].values() for s in runs})
    methods = {
        m: {k: [s[k]["mean"], s[k]["std"], s[k]["n"]] for k in KEEP if s[k]["n"]}
        for m, s in d["summary"].items()
    }
    kept = {"name": name, "benchmark": d["benchmark"], "seeds": seeds, "command": command, "methods": methods}
    return write(out_dir, name, kept)


def main() -> None:
    ap = parser(__doc__, "compare")
    ap.add_argument("compare_json", type=Path, help="OUT/compare.json of proteus compare")
    args = ap.parse_args()
    print(record(args.compare_json, args.name, args.command, args.out))


if __name__ == "__main__":
    main()
