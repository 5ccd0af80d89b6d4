"""Run-directory glue: the header a run's KB records (the learner's, plus the split), the check that a
stream is the one a KB was built on, and the run's log file. Writing and reading the learner itself is
:meth:`proteus.Proteus.commit` / :meth:`proteus.Proteus.from_kb`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from proteus.estimator import Proteus
from proteus.kb import KBError, KnowledgeBase
from proteus.streams import TaskStream

__all__ = ["check_split", "kb_header", "setup_run_log"]


def kb_header(clf: Proteus, stream: TaskStream) -> dict[str, Any]:
    header = clf.kb_header()
    header["split"] = {
        "benchmark": stream.name,
        "sha256": stream.manifest.get("sha256"),
        "class_order": stream.manifest.get("class_order"),
    }
    return header


def check_split(kb: KnowledgeBase, stream: TaskStream) -> None:
    split = kb.manifest.get("split", {})
    if split.get("sha256") != stream.manifest.get("sha256") or split.get("benchmark") != stream.name:
        raise KBError(
            f"{kb.root}: knowledge base was built on split {split.get('benchmark')!r} "
            f"(sha256 {str(split.get('sha256'))[:12]}…), but the data given is {stream.name!r} "
            f"(sha256 {str(stream.manifest.get('sha256'))[:12]}…)"
        )


def setup_run_log(out: Path) -> logging.Handler:
    """Log the "proteus" logger to ``out/log.txt`` (the caller removes the handler when the run ends)."""
    out.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(out / "log.txt")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("proteus").addHandler(h)
    logging.getLogger("proteus").setLevel(logging.INFO)
    return h
