"""docs/experiments.md shows what `proteus reproduce` measured: every number of every record in docs/measured/
(tools/docs/record_reproduce.py) is the one the page shows in that table's section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "docs" / "measured").glob("*.json"))
PAGE = (ROOT / "docs" / "experiments.md").read_text()


def _section(table: str, bench: str) -> list[str]:
    """The lines of the page's section headed by ``table`` on ``bench`` (up to the next heading)."""
    lines = PAGE.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("#") and f"`{table}` on {bench}" in line]
    assert head, f"docs/experiments.md has no heading for `{table}` on {bench}"
    end = next((j for j in range(head[0] + 1, len(lines)) if lines[j].startswith("#")), len(lines))
    return lines[head[0] + 1 : end]


def test_there_are_records() -> None:
    assert RECORDS, "docs/measured/ holds no record of a reproduce run"


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_the_page_shows_every_measured_number(path: Path) -> None:
    rec = json.loads(path.read_text())
    bench = path.stem.removeprefix(f"{rec['table']}-")
    section = _section(rec["table"], bench)
    for row in rec["rows"]:
        first = (f"| {row['variant']}", f"| {row['benchmark']} |")
        cells = [line for line in section if line.startswith(first)]
        assert cells, f"{path.name}: no table line for {row['variant']!r} in the section of {rec['table']}"
        if row["ours_mean"] is None:
            assert any("n/a" in line for line in cells), f"{path.name}: {row['variant']} should read n/a"
            continue
        value = f"{row['ours_mean']:.2f} ± {row['ours_std']:.2f}"
        assert any(value in line for line in cells), f"{path.name}: {row['variant']} {row['metric']} {value}"
