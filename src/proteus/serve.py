"""``proteus serve``: a knowledge base behind HTTP, reloaded when ``proteus learn`` commits a new task.

Endpoints (JSON answers; docs/predict.md has the row schema, the same as ``proteus predict --json``):

``POST /predict``  the body is one image (any ``Content-Type``), or ``multipart/form-data`` with one or
                   more files; ``?top_k=3`` as in ``predict --top-k``. Answers ``{"kb_tasks": N,
                   "predictions": [row, ...]}``. A body that is not a readable image: 400 naming the part.
``GET /tasks``     the knowledge base's tasks, classes and settings (``proteus kb info --json``).
``GET /health``    ``{"status": "ok", "kb_tasks": N}``.

Reloading: a watcher thread polls ``manifest.json`` (its size, time and bytes' sha256) and, when another
process commits, loads the new state with :meth:`proteus.Proteus.load` -- a consistent, fully verified
snapshot -- and only then swaps it in. A request uses the learner it started with, so none is dropped and
none sees a half-committed state; a failed reload keeps serving the old state and logs why.

The standard library's threading HTTP server is enough here: one learner serves one request at a time
(the adapted backbone's batched forward holds per-call composition state), so a production front end
(FastAPI behind uvicorn, or a reverse proxy) would add routing, not throughput; it is not a dependency.
"""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
import io
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from proteus.experiment.predictions import prediction_rows
from proteus.experiment.store import load_learner
from proteus.images import ImageError, open_image
from proteus.kb import KnowledgeBase, info

log = logging.getLogger("proteus")

__all__ = ["KBServer", "serve"]

#: the largest request body accepted (bytes)
MAX_BODY = 64 << 20


def _manifest_stamp(kb_dir: Path) -> str | None:
    try:
        return hashlib.sha256((kb_dir / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


class KBServer(ThreadingHTTPServer):
    """An HTTP server holding the learner of ``kb_dir``; :meth:`reload_if_changed` swaps in new commits."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], kb_dir: str | Path, device: str | None = None,
                 poll_seconds: float = 1.0, precision: str | None = None) -> None:  # fmt: skip
        super().__init__(address, _Handler)
        self.kb_dir, self.device, self.poll_seconds = Path(kb_dir), device, poll_seconds
        self.precision = precision
        self.stamp = _manifest_stamp(self.kb_dir)
        self.clf = load_learner(
            KnowledgeBase.open(self.kb_dir), "proteus serve", device=device, precision=precision
        )
        self.predict_lock = threading.Lock()
        self.reloads = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start_watching(self) -> None:
        self._watcher.start()

    def reload_if_changed(self) -> bool:
        """Load and swap in the knowledge base's new state if ``manifest.json`` changed."""
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

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.reload_if_changed()

    def server_close(self) -> None:
        self._stop.set()
        super().server_close()


class _Handler(BaseHTTPRequestHandler):
    server: KBServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("serve: " + format, *args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": message})

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        path = urlparse(self.path).path
        clf = self.server.clf
        if path == "/health":
            self._send(200, {"status": "ok", "kb_tasks": clf.num_tasks})
        elif path == "/tasks":
            self._send(200, info(KnowledgeBase.open(self.server.kb_dir, verify=False)))
        else:
            self._error(404, f"no such endpoint {path!r}; use POST /predict, GET /tasks or GET /health")

    def _images(self, body: bytes) -> list[tuple[str, bytes]]:
        ctype = self.headers.get("Content-Type", "")
        if not ctype.startswith("multipart/form-data"):
            return [("body", body)]
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            f"Content-Type: {ctype}\r\n\r\n".encode() + body
        )
        parts = [(p.get_filename() or p.get_param("name", header="content-disposition") or f"part{i}",
                  p.get_payload(decode=True) or b"") for i, p in enumerate(msg.iter_parts())]  # fmt: skip
        if not parts:
            raise ValueError("multipart body without parts; send one or more image files")
        return parts

    def do_POST(self) -> None:  # noqa: N802 - the base class's name
        url = urlparse(self.path)
        if url.path != "/predict":
            self._error(404, f"no such endpoint {url.path!r}; POST images to /predict")
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._error(400, "bad Content-Length")
            return
        if n <= 0 or n > MAX_BODY:
            self._error(
                413 if n > MAX_BODY else 400, f"send one image or a multipart body of 1 B .. {MAX_BODY} B"
            )
            return
        body = self.rfile.read(n)
        try:
            top_k = int(parse_qs(url.query).get("top_k", ["1"])[0])
            clf = self.server.clf  # this request's learner, even if a reload swaps in another meanwhile
            names, images = [], []
            for name, data in self._images(body):
                images.append(open_image(io.BytesIO(data), clf.config.eval.max_image_pixels, name=name))
                names.append(name)
        except (ImageError, ValueError) as e:
            self._error(400, str(e))
            return
        try:
            with self.server.predict_lock:
                pred = clf.predict(clf.transform_images(images))
                rows = prediction_rows(clf, pred, names, top_k=top_k)
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
            log.exception("serve: prediction failed")
            self._error(int(HTTPStatus.INTERNAL_SERVER_ERROR), f"{type(e).__name__}: {e}")
            return
        self._send(200, {"kb_tasks": clf.num_tasks, "predictions": rows})


def serve(kb_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
          poll_seconds: float = 1.0, precision: str | None = None) -> None:  # fmt: skip
    """Serve until interrupted (Ctrl-C)."""
    server = KBServer((host, port), kb_dir, device=device, poll_seconds=poll_seconds, precision=precision)
    server.start_watching()
    print(
        f"serving {kb_dir} ({server.clf.num_tasks} tasks) on http://{host}:{server.server_address[1]}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
