"""Keep what ``proteus reproduce`` measured, for the docs:
``python tools/docs/record_reproduce.py OUT/NAME-BENCH.json ...`` writes ``docs/measured/NAME-BENCH.json``:
the table's name, title and seeds, its provenance (the commit, package versions, device and threads of the
runs, as their results.json recorded them, and the command ``proteus reproduce`` ran; ``--command`` replaces
the command) and its rows (variant, method, metric, our mean, sample std and each seed's value, the paper's
number). ``tests/test_measured_docs.py`` checks that every number of every record is the one
docs/experiments.md shows in that table's section, cell by column name (``table`` writes the section's
table), and that the page says so when the code the record measured has changed since its commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from records import parser, write

KEEP = (
    "variant", "method", "metric", "benchmark", "ours_mean", "ours_std", "seeds", "ours_by_seed", "paper",
    "skip",
)  # fmt: skip

#: metric -> the title of its columns on the page (``<title>: ours``, ``<title>: paper``)
TITLES = {"acc": "final avg acc", "retrieval": "retrieval", "forgetting": "forgetting", "oracle": "oracle"}


def record(path: Path, command: str | None, out_dir: Path) -> Path:
    d = json.loads(path.read_text())
    rows = [{k: r.get(k) for k in KEEP} for r in d["rows"]]
    prov = dict(d.get("provenance") or {})
    if command:
        prov["command"] = command
    kept = {"table": d["table"], "title": d["title"], "seeds": d["seeds"], "provenance": prov, "rows": rows}
    return write(out_dir, path.stem, kept, "reproduce")


def _fmt(v: float | None, std: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" + ("" if std is None else f" ± {std:.2f}")


def _paper(p: Any) -> str:
    if p is None:
        return "-"
    if isinstance(p, str):
        return p
    return _fmt(p[0], p[1])


def table(rec: dict[str, Any]) -> str:
    """The page's table of a record: a line per variant (its label, then its method), two columns per
    metric (``<metric>: ours``, ``<metric>: paper``); a cell that could not run reads ``n/a``."""
    metrics = list(dict.fromkeys(r["metric"] for r in rec["rows"]))
    variants = list(dict.fromkeys(r["variant"] for r in rec["rows"]))
    by = {(r["variant"], r["metric"]): r for r in rec["rows"]}
    head = ["variant"] + [f"{TITLES.get(m, m)}: {who}" for m in metrics for who in ("ours", "paper")]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for v in variants:
        first = next(r for r in rec["rows"] if r["variant"] == v)
        cells = [f"{v} (`{first['method']}`)"]
        for m in metrics:
            r = by.get((v, m))
            if r is None:
                cells += ["-", "-"]
                continue
            ours = "n/a" if r["skip"] else _fmt(r["ours_mean"], r["ours_std"])
            cells += [ours, _paper(r["paper"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, named=False, command=False)
    ap.add_argument("tables", nargs="+", type=Path, help="OUT/NAME-BENCH.json of proteus reproduce")
    args = ap.parse_args()
    for p in args.tables:
        out = record(p, args.command, args.out)
        print(out)
        print(table(json.loads(out.read_text())))


if __name__ == "__main__":
    main()
