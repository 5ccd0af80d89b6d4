"""Managing a knowledge base after the fact, each a commit like any other (under the write lock, atomic,
the previous state kept in ``manifest.prev.json``):

* ``proteus kb calibrate``: a new true-positive rate for the rejection of inputs from no learned task,
  from the held-out scores each task stored;
* ``proteus kb forget``: remove a task from what can be predicted (:meth:`proteus.Proteus.forget_task`);
* ``proteus kb undo``: go back to the previous commit (what the last learn, forget or calibrate changed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proteus.engine.learner import check_supports
from proteus.engine.novelty import Calibration
from proteus.kb import KBError, KnowledgeBase, write_lock

__all__ = ["forget", "recalibrate", "undo"]


def recalibrate(
    kb_dir: str | Path, tpr: float, wait: float | None = 0.0, key: bytes | None = None
) -> list[float]:
    """Set every task's rejection threshold to the true-positive rate ``tpr``; returns the thresholds.
    ``key``: the KB's signing key (checked on open, the new commit signed; docs/reliability.md)."""
    with write_lock(kb_dir, wait=wait):
        kb = KnowledgeBase.open(kb_dir, key=key)
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


def forget(kb_dir: str | Path, task: int, wait: float | None = 0.0, key: bytes | None = None) -> list[str]:
    """Forget task ``task`` (1-based, as in the CLI); returns its class names."""
    from proteus.experiment.store import commit, load_learner

    with write_lock(kb_dir, wait=wait):
        kb = KnowledgeBase.open(kb_dir, key=key)
        clf = load_learner(kb, "proteus kb forget")
        check_supports(clf, "retrieval", "proteus kb forget")
        clf.forget_task(task - 1)
        commit(kb, clf)
        return list(clf.records_[task - 1].class_names)


def undo(kb_dir: str | Path, wait: float | None = 0.0, key: bytes | None = None) -> dict[str, Any]:
    """Make the previous commit the current state again (itself a commit, so ``undo`` twice redoes);
    returns what was restored and what it replaced (:meth:`KnowledgeBase.undo`)."""
    with write_lock(kb_dir, wait=wait):
        return KnowledgeBase.open(kb_dir, key=key).undo()
