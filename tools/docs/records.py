"""What the ``record_*`` scripts share: their command line (``--command``, ``--out``, and ``--name`` where a
record is named) and writing a record as JSON under ``docs/measured/`` for ``tests/test_measured_docs.py``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: where the records live
MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measured"


def parser(doc: str | None, folder: str = "", named: bool = True) -> argparse.ArgumentParser:
    """A recorder's argument parser (the caller adds its inputs); records go to ``MEASURED/folder``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if named:
        ap.add_argument("--name", required=True, help="the record's name: the page's section names it")
    ap.add_argument("--command", required=True, help="the command that made it (shown in the docs)")
    ap.add_argument("--out", type=Path, default=MEASURED / folder, help="the folder of the records")
    return ap


def write(out_dir: Path, name: str, record: dict[str, Any]) -> Path:
    """Write ``record`` as ``out_dir/name.json``; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out
