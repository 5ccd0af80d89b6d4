"""The docs show what the runs measured: every number of every record of `proteus reproduce` in docs/measured/
(tools/docs/record_reproduce.py) is the one docs/experiments.md shows in that table's section, and every
number of every record of `proteus compare` in docs/measured/compare/ (tools/docs/record_compare.py) the one
docs/retrieval.md shows in the section headed by the record's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "docs" / "measured").glob("*.json"))
PAGE = (ROOT / "docs" / "experiments.md").read_text()
COMPARED = sorted((ROOT / "docs" / "measured" / "compare").glob("*.json"))


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


@pytest.mark.parametrize("path", COMPARED, ids=[p.stem for p in COMPARED])
def test_the_retrieval_page_shows_every_compared_number(path: Path) -> None:
    rec = json.loads(path.read_text())
    lines = (ROOT / "docs" / "retrieval.md").read_text().splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("#") and f"`{rec['name']}`" in line]
    assert head, f"docs/retrieval.md has no heading naming `{rec['name']}`"
    end = next((j for j in range(head[0] + 1, len(lines)) if lines[j].startswith("#")), len(lines))
    section = lines[head[0] + 1 : end]
    for method, figures in rec["methods"].items():
        row = [line for line in section if line.startswith(f"| {method} |")]
        assert len(row) == 1, f"{path.name}: one table line for {method} expected in `{rec['name']}`"
        for key, (mean, std, n) in figures.items():
            value = f"{mean:.2f}" + (f" ± {std:.2f}" if n > 1 else "")
            assert value in row[0], f"{path.name}: {method} {key} {value} is not on the page"


@pytest.mark.parametrize("path", COMPARED, ids=[p.stem for p in COMPARED])
def test_the_readme_shows_each_rivals_final_accuracy(path: Path) -> None:
    """The README's table of the newer rivals shows each recorded method's mean final accuracy."""
    rec = json.loads(path.read_text())
    if not rec["name"].startswith("rivals-"):
        pytest.skip("not a record of the rivals' comparison")
    readme = (ROOT / "README.md").read_text().splitlines()
    row = [line for line in readme if line.startswith(f"| {rec['benchmark']} |")]
    assert len(row) == 1, f"the README has no single line for {rec['benchmark']} in the rivals' table"
    for method, figures in rec["methods"].items():
        value = f"{figures['final_avg_acc'][0]:.2f}"
        assert value in row[0], f"README: {method} on {rec['benchmark']} should read {value}"
