"""Keep what ``proteus compare`` measured, for the docs:
``python tools/docs/record_compare.py OUT/compare.json [OUT2/compare.json ...] --name NAME --command "proteus
compare ..."`` writes ``docs/measured/compare/NAME.json`` (the stream, the seeds, the command, the runs'
provenance as their results.json recorded it and, per method, the mean and sample std of each final
figure). Several comparisons of the same stream make one record;
``--add`` adds methods measured later by another ``proteus compare`` of the same stream and seeds to the
record NAME, its command shown after the record's. ``tests/test_measured_docs.py`` checks that the page
section headed `` `NAME` `` (docs/retrieval.md) shows every one of them, so the page cannot drift from
what the runs gave.
"""

from __future__ import annotations

import json
from pathlib import Path

from records import parser, write

from proteus.experiment.provenance import merged

#: the final figures kept, in the order of compare's table
KEEP = ("final_avg_acc", "forgetting", "retrieval_acc", "oracle_acc")


def record(paths: list[Path], name: str, command: str, out_dir: Path, add: bool = False) -> Path:
    summary: dict[str, dict[str, dict[str, float]]] = {}
    benchmarks, seeds = set(), set()
    runs: list[dict[str, object] | None] = []
    for path in paths:
        d = json.loads(path.read_text())
        runs += [r.get("provenance") for by in d["runs"].values() for r in by.values()]
        benchmarks.add(d["benchmark"])
        seeds |= {int(s) for r in d["runs"].values() for s in r}
        _no_twice(path, summary, d["summary"])
        summary.update(d["summary"])
    methods = {
        m: {k: [s[k]["mean"], s[k]["std"], s[k]["n"]] for k in KEEP if s[k]["n"]} for m, s in summary.items()
    }
    if add:
        old = json.loads((out_dir / f"{name}.json").read_text())
        if {old["benchmark"]} != benchmarks or set(old["seeds"]) != seeds:
            raise SystemExit(f"{name}: recorded on {old['benchmark']}, seeds {old['seeds']}: not those added")
        _no_twice(out_dir / f"{name}.json", methods, old["methods"])
        methods = {**old["methods"], **methods}
        command = f"{old['command']}\n{command}"
    if len(benchmarks) != 1:
        raise SystemExit(f"the comparisons are of different streams: {', '.join(sorted(benchmarks))}")
    prov = {**merged(runs), "command": command}
    if add:  # what the record said of its earlier runs' unknown fields stays
        was = old.get("provenance") or {}
        said = {k: was[k] for k in ("committed_in", "source") if k in was}
        prov = {**merged([was, prov]), **said, "command": command}
    kept = {"name": name, "benchmark": benchmarks.pop(), "seeds": sorted(seeds), "command": command}
    kept["provenance"] = prov
    kept["methods"] = methods
    return write(out_dir, name, kept, "compare")


def _no_twice(path: Path, have: dict[str, object], new: dict[str, object]) -> None:
    twice = sorted(set(have) & set(new))
    if twice:
        raise SystemExit(f"{path}: {', '.join(twice)} measured twice")


def main() -> None:
    ap = parser(__doc__, "compare")
    ap.add_argument("compare_json", type=Path, nargs="+", help="OUT/compare.json of proteus compare")
    ap.add_argument("--add", action="store_true", help="add the methods to the record NAME")
    args = ap.parse_args()
    print(record(args.compare_json, args.name, args.command, args.out, args.add))


if __name__ == "__main__":
    main()
