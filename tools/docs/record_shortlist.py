"""Keep what ``tools/studies/shortlist.py`` measured, for the docs:
``python tools/docs/record_shortlist.py RUN/shortlist.json [...] --name shortlist --command "..."`` writes
``docs/measured/shortlist/NAME.json``: per stream and seed, its tasks and test images, the share of them
the detector over every task rejects, and per shortlist length k the share of answers equal to it and the
share rejected; a stream is named by the folder of its file (the study's ``--out``), and one measured by
several files is taken from the last one given.
``tests/test_measured_docs.py`` checks that docs/predict.md shows each row in the section naming
`` `NAME` ``, so the page cannot drift from the runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from records import from_checkout, parser, write


def main() -> None:
    ap = parser(__doc__, "shortlist")
    ap.add_argument("runs", nargs="+", type=Path, help="shortlist.json files of the study")
    args = ap.parse_args()
    rows: dict[str, dict[str, object]] = {}
    for path in args.runs:
        for key, row in json.loads(path.read_text()).items():
            seed = key.split("/")[1]
            stream = path.parent.name  # the study's --out names the stream (its benchmark may be "folder")
            ks = {k: {"equal": round(100 * v["equal"], 2), "rejected": round(100 * v["rejected"], 2)}
                  for k, v in row.items() if isinstance(v, dict)}  # fmt: skip
            rows[key] = {"stream": stream, "seed": int(seed.removeprefix("seed")), "tasks": row["tasks"],
                         "images": row["images"], "rejected_full": round(100 * row["rejected_full"], 2),
                         "k": ks}  # fmt: skip
    record = {"name": args.name, "command": args.command, "rows": list(rows.values())}
    record["provenance"] = from_checkout(args.command)
    print(write(args.out, args.name, record, "shortlist"))


if __name__ == "__main__":
    main()
