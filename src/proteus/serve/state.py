"""The served knowledge base: its learner, swapped for a new one when ``proteus learn`` commits."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from proteus.core.estimator import Proteus
from proteus.experiment.store import load_learner
from proteus.kb import KnowledgeBase, info

log = logging.getLogger("proteus")

__all__ = ["ServedKB"]


def _manifest_stamp(kb_dir: Path) -> str | None:
    try:
        return hashlib.sha256((kb_dir / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


class ServedKB:
    """The learner of ``kb_dir`` (:attr:`clf`) and a watcher thread that polls ``manifest.json`` every
    ``poll_seconds`` and, when it changed, loads the new state completely and verified before swapping it in
    (one attribute assignment: a request keeps the learner it started with)."""

    def __init__(
        self,
        kb_dir: str | Path,
        device: str | None = None,
        precision: str | None = None,
        poll_seconds: float = 1.0,
    ) -> None:
        self.kb_dir, self.device, self.precision = Path(kb_dir), device, precision
        self.poll_seconds = poll_seconds
        self.stamp = _manifest_stamp(self.kb_dir)
        self.clf: Proteus = load_learner(
            KnowledgeBase.open(self.kb_dir), "proteus serve", device=device, precision=precision
        )
        self.reloads = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The knowledge base's directory name: what answers show instead of its path on the server."""
        return self.kb_dir.resolve().name

    def info(self) -> dict[str, Any]:
        """``proteus kb info --json`` of the knowledge base, its ``root`` the directory's name only."""
        return {**info(KnowledgeBase.open(self.kb_dir, verify=False)), "root": self.name}

    def reload_if_changed(self) -> bool:
        """Load and swap in the knowledge base's new state if ``manifest.json`` changed; a failed load keeps
        the old state (and logs why)."""
        stamp = _manifest_stamp(self.kb_dir)
        if stamp is None or stamp == self.stamp:
            return False
        try:
            kb = KnowledgeBase.open(self.kb_dir)
            clf = load_learner(kb, "proteus serve", device=self.device, precision=self.precision)
        except Exception as e:  # noqa: BLE001 - keep serving the old state
            log.warning(
                "serve: reloading %s failed, still serving %d tasks: %s", self.kb_dir, self.clf.num_tasks, e
            )
            return False
        self.clf, self.stamp = clf, stamp
        self.reloads += 1
        log.info("serve: reloaded %s: %d tasks", self.kb_dir, clf.num_tasks)
        return True

    def start_watching(self) -> None:
        """Start the watcher thread (once; :meth:`stop_watching` ends it)."""
        if self._watcher is None:
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, name="proteus-serve-watcher", daemon=True)
            self._watcher.start()

    def stop_watching(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=60)
            self._watcher = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.reload_if_changed()
