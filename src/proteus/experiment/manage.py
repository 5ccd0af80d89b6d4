"""Managing a knowledge base after the fact: ``proteus kb calibrate`` (a new true-positive rate for the
rejection of inputs from no learned task, from the held-out scores each task stored). A commit like any
other: under the write lock, atomic, the previous state kept in ``manifest.prev.json``."""

from __future__ import annotations

from pathlib import Path

from proteus.engine.novelty import Calibration
from proteus.kb import KBError, KnowledgeBase, write_lock

__all__ = ["recalibrate"]


def recalibrate(kb_dir: str | Path, tpr: float, wait: float | None = 0.0) -> list[float]:
    """Set every task's rejection threshold to the true-positive rate ``tpr``; returns the thresholds."""
    with write_lock(kb_dir, wait=wait):
        kb = KnowledgeBase.open(kb_dir)
        manifest = dict(kb.manifest)
        tasks = [dict(t) for t in manifest["tasks"]]
        missing = [t["index"] + 1 for t in tasks if not t.get("calibration")]
        if missing or not tasks:
            raise KBError(
                f"{kb_dir}: task(s) {missing} were learned without calibration scores; learn with "
                "--set retrieval.reject=true to flag inputs from no learned task"
            )
        for t in tasks:
            t["calibration"] = Calibration.from_dict(t["calibration"]).at(tpr).to_dict()
        manifest["tasks"] = tasks
        kb.commit(manifest)
        return [float(t["calibration"]["threshold"]) for t in tasks]
