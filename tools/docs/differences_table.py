"""Write the differences tables of docs/experiments.md from the paper's stated settings and our choices as
data (``proteus.experiment.paper_settings``): ``python tools/docs/differences_table.py`` replaces each
generated block of the page (between ``<!-- NAME: generated ... -->`` and ``<!-- end NAME -->``);
``--check`` only says whether the page is up to date. ``tests/test_paper_settings.py`` checks the page
against the same function, so the tables cannot drift from the code.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "experiments.md"


def rewrite(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each block ``NAME`` replaced by ``blocks[NAME]``; a block missing from the page is an
    error naming it."""
    for name, body in blocks.items():
        pattern = re.compile(
            rf"(<!-- {re.escape(name)}: generated[^\n]*-->\n)(.*?)(<!-- end {re.escape(name)} -->)", re.S
        )
        if not pattern.search(text):
            raise SystemExit(f"{PAGE}: no generated block {name!r}")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(3), text, count=1)
    return text


def main() -> int:
    from proteus.experiment.paper_settings import differences_tables

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not up to date")
    args = ap.parse_args()
    old = PAGE.read_text()
    new = rewrite(old, differences_tables())
    if args.check:
        print("up to date" if new == old else f"{PAGE} is out of date: run {Path(__file__).name}")
        return int(new != old)
    PAGE.write_text(new)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
