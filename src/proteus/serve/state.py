"""The served knowledge base: its learner, swapped for a new one when ``proteus learn`` commits.

The watcher never stops and never blocks: ``manifest.json`` is read like every file of a knowledge base
(:func:`~proteus.kb.files.read_kb_file`: no FIFO, no link, within its budget), and any manifest it cannot
read or load (a torn or hostile one, a FIFO, a missing file) is logged once, the last good state is kept
and served, ``/health`` reports the knowledge base as stale (since when, and why), and the watcher tries
again: at once when the manifest changes again, and every :data:`RETRY_SECONDS` otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

from proteus.experiment.store import load_learner
from proteus.kb import KnowledgeBase, info
from proteus.kb.files import MANIFEST, read_kb_file
from proteus.learners import ContinualLearner

log = logging.getLogger("proteus")

__all__ = ["ServedKB"]

#: seconds between two attempts to load the same manifest that failed to load
RETRY_SECONDS = 30.0


def _manifest_stamp(kb_dir: Path) -> tuple[str | None, str | None]:
    """(sha256 of manifest.json's bytes, None), or (None, why it cannot be read)."""
    try:
        data = read_kb_file(kb_dir, MANIFEST)
    except Exception as e:  # noqa: BLE001 - whatever it is, the watcher goes on
        return None, str(e)
    if data is None:
        return None, f"{kb_dir / MANIFEST}: missing"
    return hashlib.sha256(data).hexdigest(), None


class ServedKB:
    """The learner of ``kb_dir`` (:attr:`clf`) and a watcher thread that polls ``manifest.json`` every
    ``poll_seconds`` and, when it changed, loads the new state completely and verified before swapping it in
    (one attribute assignment: a request keeps the learner it started with). :attr:`stale` is None while
    the served state is the one on disk, else ``{"since", "reason"}``."""

    def __init__(
        self,
        kb_dir: str | Path,
        device: str | None = None,
        precision: str | None = None,
        poll_seconds: float = 1.0,
    ) -> None:
        self.kb_dir, self.device, self.precision = Path(kb_dir), device, precision
        self.poll_seconds = poll_seconds
        self.stamp, _ = _manifest_stamp(self.kb_dir)
        kb = KnowledgeBase.open(self.kb_dir)
        self.clf: ContinualLearner = load_learner(kb, "proteus serve", device=device, precision=precision)
        self._info = self._describe(kb)
        self.reloads = 0
        self.stale: dict[str, Any] | None = None
        self._failed: tuple[str, float] | None = None  # (the stamp or error that failed, when)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The knowledge base's directory name: what answers show instead of its path on the server."""
        return self.kb_dir.resolve().name

    def _hide(self, text: str) -> str:
        """``text`` with the knowledge base's path on the server replaced by its name."""
        for path in sorted(
            {str(self.kb_dir.resolve()), str(self.kb_dir.absolute()), str(self.kb_dir)}, key=len
        )[::-1]:
            text = text.replace(path, self.name)
        return text

    def _describe(self, kb: KnowledgeBase) -> dict[str, Any]:
        return {**info(kb), "root": self.name}

    def info(self) -> dict[str, Any]:
        """``proteus kb info --json`` of the served state, its ``root`` the directory's name only (computed
        when the state was loaded)."""
        return self._info

    def _failed_again(self, what: str, reason: str) -> bool:
        """Mark the served state stale because of ``what`` (a stamp or an error); True when the same failure
        was tried less than :data:`RETRY_SECONDS` ago (do not load again yet)."""
        now = time.monotonic()
        if self._failed is not None and self._failed[0] == what and now - self._failed[1] < RETRY_SECONDS:
            return True
        if self._failed is None or self._failed[0] != what:
            log.warning("serve: %s; still serving the last good state (%d tasks)", reason, self.clf.num_tasks)
        self._failed = (what, now)
        if self.stale is None:
            self.stale = {"since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.stale["reason"] = self._hide(reason)
        return False

    def reload_if_changed(self) -> bool:
        """Load and swap in the knowledge base's new state if ``manifest.json`` changed; a failed load keeps
        the old state (logged once, :attr:`stale` set, tried again later). Never raises."""
        stamp, error = _manifest_stamp(self.kb_dir)
        if stamp is None:
            self._failed_again(error or "", f"manifest.json cannot be read ({error})")
            return False
        if stamp == self.stamp:
            self.stale, self._failed = None, None
            return False
        if self._failed is not None and self._failed[0] == stamp:
            if time.monotonic() - self._failed[1] < RETRY_SECONDS:
                return False
        try:
            kb = KnowledgeBase.open(self.kb_dir)
            clf = load_learner(kb, "proteus serve", device=self.device, precision=self.precision)
            described = self._describe(kb)
        except Exception as e:  # noqa: BLE001 - keep serving the old state
            self._failed_again(stamp, f"reloading {self.kb_dir} failed: {e}")
            return False
        self.clf, self.stamp, self._info = clf, stamp, described
        self.stale, self._failed = None, None
        self.reloads += 1
        log.info("serve: reloaded %s: %d tasks", self.kb_dir, clf.num_tasks)
        return True

    def start_watching(self) -> None:
        """Start the watcher thread (once; :meth:`stop_watching` ends it)."""
        if self._watcher is None:
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, name="proteus-serve-watcher", daemon=True)
            self._watcher.start()

    def stop_watching(self, timeout: float = 10.0) -> None:
        """Stop the watcher (waiting at most ``timeout`` s for a reload in progress: it is a daemon)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=timeout)
            self._watcher = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.reload_if_changed()
            except Exception:  # noqa: BLE001 - the watcher must outlive anything
                log.exception("serve: the reload watcher failed; it goes on")
