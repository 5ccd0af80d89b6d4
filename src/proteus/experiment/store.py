"""The persistence layer of every learner (:mod:`proteus.learners`): a method resolved to its learner
(:func:`build_learner`), a learner written to a knowledge base (:func:`commit`: its
:meth:`~proteus.learners.ContinualLearner.state`) and read back (:func:`load_learner`, for learners
that support ``load``), the header a run's KB records (the learner's, plus the split), the check that a
stream is the one a KB was built on, and the run's log file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from proteus.config import METHODS, RunConfig
from proteus.kb import KBError, KnowledgeBase
from proteus.learners import LEARNERS, ContinualLearner, load_from_kb
from proteus.streams import TaskStream

__all__ = ["build_learner", "check_split", "commit", "kb_header", "load_learner", "setup_run_log"]


def build_learner(cfg: RunConfig, *, progress: bool = True) -> ContinualLearner:
    """The learner of ``cfg.method`` (its declaration's ``learner``, from :data:`LEARNERS`) on ``cfg``."""
    return LEARNERS.get(METHODS.get(cfg.method).learner)(cfg, progress=progress)


def commit(kb: KnowledgeBase, clf: ContinualLearner, evaluation: list[dict[str, Any]] | None = None) -> None:
    """Write the learner's state as the KB's next state (atomic: the old state or the new one), with the
    evaluation rows to keep (None: the stored rows of the tasks kept)."""
    state = clf.state()
    kb.commit_state(state.tasks, state.head, evaluation)
    adopt = getattr(clf, "adopt", None)  # a learner that holds its tasks from the knowledge base
    if adopt is not None:
        adopt(kb)


def load_learner(
    kb: KnowledgeBase,
    command: str,
    *,
    device: str | None = None,
    precision: str | None = None,
    progress: bool = False,
) -> ContinualLearner:
    """The learner a knowledge base holds, for ``command`` (:func:`proteus.learners.load_from_kb`: refused by
    name when its method's learner does not support ``load``)."""
    return load_from_kb(kb, command, device=device, precision=precision, progress=progress)


def kb_header(clf: ContinualLearner, stream: TaskStream) -> dict[str, Any]:
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
