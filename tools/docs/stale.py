"""Say which records of ``docs/measured/`` are stale, in the records and on their pages:
``python tools/docs/stale.py`` sets each record's ``stale`` note (or removes it) from
``records.staleness`` (its commit against the last commits that changed the code it measured) and puts the
line ``**Stale record.** ...`` at the top of the record's section of its page (or removes it);
``--check`` only reports. ``tests/test_measured_docs.py`` holds records and pages to the same rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from records import MEASURED, PAGES, STALE_MARK, staleness

ROOT = MEASURED.parents[1]


def kind(path: Path) -> str:
    return path.parent.name if path.parent != MEASURED else "reproduce"


def heading(path: Path, rec: dict) -> str:
    """What the heading of the record's section contains."""
    if kind(path) == "reproduce":
        return f"`{rec['table']}` on {path.stem.removeprefix(rec['table'] + '-')}"
    return f"`{rec['name']}`"


def mark_page(text: str, head: str, note: str | None) -> str:
    """``text`` with the section headed by ``head`` starting with the stale line ``note`` (None: without
    one)."""
    lines = text.split("\n")
    i = next(k for k, line in enumerate(lines) if line.startswith("#") and head in line)
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if lines[j].startswith(STALE_MARK):
        del lines[j : j + 2]  # the line and the blank after it
    if note is not None:
        lines[j:j] = [f"{STALE_MARK} {note}", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="report only; exit 1 if anything would change")
    args = ap.parse_args()
    changed = False
    for path in sorted(MEASURED.rglob("*.json")):
        rec = json.loads(path.read_text())
        why = staleness(rec)
        note = (
            None
            if why is None
            else f"{why[0].upper()}{why[1:]}; the numbers stay until it is measured again."
        )
        print(f"{path.relative_to(ROOT)}: {'fresh' if why is None else why}")
        new = {k: v for k, v in rec.items() if k != "stale"} | ({} if why is None else {"stale": why})
        if new != rec:
            changed = True
            if not args.check:
                path.write_text(json.dumps(new, indent=1) + "\n")
        page = PAGES.get(kind(path))
        if page is not None:
            text = (ROOT / page).read_text()
            marked = mark_page(text, heading(path, rec), note)
            if marked != text:
                changed = True
                if not args.check:
                    (ROOT / page).write_text(marked)
    return int(args.check and changed)


if __name__ == "__main__":
    sys.exit(main())
