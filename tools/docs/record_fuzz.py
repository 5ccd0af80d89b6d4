"""Keep what a run of the fuzz profile did, for the docs:
``python tools/docs/record_fuzz.py RUN.xml --examples N --name NAME --command "..."`` reads the JUnit XML of
``HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=N python -m pytest tests/test_fuzz.py --junitxml RUN.xml`` and writes
``docs/measured/fuzz/NAME.json``: per target (a test of ``tests/test_fuzz.py``; a parametrized one counted
once) its cases, how many passed and its seconds, and the run's total. ``tests/test_measured_docs.py`` checks
that docs/reliability.md shows each target's line in the section naming `` `NAME` ``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET  # noqa: S405 - the run's own report, written by pytest on this machine
from pathlib import Path
from typing import Any

from records import from_checkout, parser, write


def targets(xml: Path) -> dict[str, dict[str, Any]]:
    """Per test function of the report: its cases, those that passed (no failure, error or skip) and its
    seconds."""
    out: dict[str, dict[str, Any]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):  # noqa: S314
        name = case.get("name", "").split("[")[0]
        t = out.setdefault(name, {"cases": 0, "passed": 0, "seconds": 0.0})
        t["cases"] += 1
        t["passed"] += not any(case.find(tag) is not None for tag in ("failure", "error", "skipped"))
        t["seconds"] += float(case.get("time", 0.0))
    return {n: {**t, "seconds": round(t["seconds"], 1)} for n, t in out.items()}


def table(rec: dict[str, Any]) -> str:
    """The page's table of a record, in Markdown."""
    lines = ["| target | cases | passed | seconds |", "| --- | ---: | ---: | ---: |"]
    for name, t in rec["targets"].items():
        lines.append(f"| `{name}` | {t['cases']} | {t['passed']} | {t['seconds']:.1f} |")
    runs = rec["targets"].values()
    cases, passed = sum(t["cases"] for t in runs), sum(t["passed"] for t in runs)
    total = rec["seconds_total"]
    lines.append(f"| all, {rec['examples']:,} inputs per target | {cases} | {passed} | {total:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, "fuzz")
    ap.add_argument("run", type=Path, help="the JUnit XML report of the fuzz run")
    ap.add_argument("--examples", type=int, required=True, help="FUZZ_EXAMPLES of the run")
    ap.add_argument("--threads", default="unknown", help="the threads the run used")
    args = ap.parse_args()
    found = targets(args.run)
    record = {
        "name": args.name, "command": args.command, "examples": args.examples, "targets": found,
        "seconds_total": round(sum(t["seconds"] for t in found.values()), 1),
    }  # fmt: skip
    record["provenance"] = from_checkout(args.command, device="cpu", threads=args.threads)
    print(write(args.out, args.name, record, "fuzz"))
    print(table(record))


if __name__ == "__main__":
    main()
