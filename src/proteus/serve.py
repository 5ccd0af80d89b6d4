"""``proteus serve``: a knowledge base behind HTTP, reloaded when ``proteus learn`` commits a new task.

Endpoints (JSON answers; docs/predict.md has the row schema, the same as ``proteus predict --json``):

``POST /predict``  the body is one image (any ``Content-Type``), or ``multipart/form-data`` with one or
                   more files; ``?top_k=3`` as in ``predict --top-k``. Answers ``{"kb_tasks": N,
                   "predictions": [row, ...]}``. A body that is not a readable image: 400 naming the part.
``GET /tasks``     the knowledge base's tasks, classes and settings (``proteus kb info --json``).
``GET /health``    ``{"status": "ok", "kb_tasks": N}``.

Every answer is JSON, errors included (``{"error": "..."}``): an unknown path 404, a known path with
another method 405 with an ``Allow`` header (``GET /predict``: ``Allow: POST``), ``?top_k`` that is not an
integer >= 1 400 naming ``top_k``, a body shorter than its ``Content-Length`` 408 once the connection has
been silent for ``read_timeout`` seconds (``proteus serve --read-timeout``, default 30), then the
connection is closed. A client that goes away mid-answer is logged in one line (debug), not a traceback.

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
import sys
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
#: seconds a connection may stay silent (a body shorter than its Content-Length, an idle keep-alive
#: connection) before it is answered 408 or closed (``proteus serve --read-timeout``)
READ_TIMEOUT = 30.0
#: endpoint -> the methods it answers
ENDPOINTS = {"/predict": ("POST",), "/tasks": ("GET", "HEAD"), "/health": ("GET", "HEAD")}
_USE = "use POST /predict, GET /tasks or GET /health"


def _manifest_stamp(kb_dir: Path) -> str | None:
    try:
        return hashlib.sha256((kb_dir / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


class KBServer(ThreadingHTTPServer):
    """An HTTP server holding the learner of ``kb_dir``; :meth:`reload_if_changed` swaps in new commits."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], kb_dir: str | Path, device: str | None = None,
                 poll_seconds: float = 1.0, precision: str | None = None,
                 read_timeout: float = READ_TIMEOUT) -> None:  # fmt: skip
        super().__init__(address, _Handler)
        self.kb_dir, self.device, self.poll_seconds = Path(kb_dir), device, poll_seconds
        self.read_timeout = read_timeout
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

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or fell silent: one debug line; anything else: logged with its traceback
        (the standard library prints it to stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("serve: connection from %s ended: %s", client_address, exc)
        else:
            log.error("serve: a request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: KBServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT  # the server's read_timeout replaces it (setup)
    _body_read = False  # whether this request's body was read (otherwise the connection closes after it)

    def setup(self) -> None:
        self.timeout = self.server.read_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("serve: " + format, *args)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """The access log: one line per answer (client, method, path, status, bytes) on the ``proteus``
        logger, which ``serve`` prints (``--quiet`` silences it)."""
        code = getattr(code, "value", code)
        log.info("%s %s %s %s %s", self.address_string(), self.command, self.path, code, size)

    def _has_body(self) -> bool:
        return self.headers.get("Content-Length", "0").strip() not in ("", "0") or (
            "Transfer-Encoding" in self.headers
        )

    def _send(self, status: int, payload: dict[str, Any], allow: tuple[str, ...] = ()) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if allow:
            self.send_header("Allow", ", ".join(allow))
        headers = getattr(self, "headers", None)
        if self.close_connection or (headers is not None and not self._body_read and self._has_body()):
            # a body left unread would be taken for the next request: close the connection instead
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD" and status >= 200 and status not in (204, 304):
            self.wfile.write(body)

    def _error(self, status: int, message: str, allow: tuple[str, ...] = ()) -> None:
        self._send(status, {"error": message}, allow)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own errors (a malformed request line, headers too long, a method no
        endpoint knows) as JSON too; the connection is closed."""
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        if code == HTTPStatus.NOT_IMPLEMENTED and self.command:
            message = f"method {self.command} is not supported; {_USE}"
        self._error(code, message or explain or HTTPStatus(code).phrase)

    def _route(self, method: str) -> str | None:
        """The endpoint of this request if it answers ``method``; otherwise a 404 or 405 is sent: None."""
        self._body_read = False
        path = urlparse(self.path).path
        allowed = ENDPOINTS.get(path)
        if allowed is None:
            self._error(404, f"no such endpoint {path!r}; {_USE}")
            return None
        if method not in allowed:
            use = " or ".join(f"{m} {path}" for m in allowed if m != "HEAD")
            self._error(405, f"{method} is not allowed on {path}; use {use}", allow=allowed)
            return None
        return path

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        path = self._route(self.command)
        if path == "/health":
            self._send(200, {"status": "ok", "kb_tasks": self.server.clf.num_tasks})
        elif path == "/tasks":  # the KB's directory name, not where it lives on the server
            self._send(
                200,
                {
                    **info(KnowledgeBase.open(self.server.kb_dir, verify=False)),
                    "root": self.server.kb_dir.name,
                },
            )

    do_HEAD = do_GET  # noqa: N815 - the same answers without their bodies (_send)

    def _refuse(self) -> None:
        self._route(self.command)  # 404 or 405: no endpoint answers PUT, DELETE, PATCH or OPTIONS

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def _read_body(self, n: int) -> bytes | None:
        """The request's ``n`` body bytes; None (an error sent, the connection closed) when the client sends
        fewer: it closed its side (400) or stayed silent for ``read_timeout`` seconds (408)."""
        chunks, got = [], 0
        try:
            while got < n:
                chunk = self.rfile.read1(min(n - got, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        except TimeoutError:
            self._error(
                408,
                f"the body ended after {got} of the {n} B its Content-Length promised (nothing more came "
                f"in {self.timeout:g} s)",
            )
            return None
        if got < n:
            self._error(400, f"the body ended after {got} of the {n} B its Content-Length promised")
            return None
        self._body_read = True
        return b"".join(chunks)

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
        if self._route("POST") is None:
            return
        raw = parse_qs(urlparse(self.path).query, keep_blank_values=True).get("top_k", ["1"])[-1]
        try:
            top_k = int(raw)
        except ValueError:
            top_k = 0
        if top_k < 1:
            self._error(400, f"top_k must be an integer >= 1; got {raw!r}")
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._error(400, f"bad Content-Length {self.headers.get('Content-Length')!r}")
            return
        if n <= 0 or n > MAX_BODY:
            self._error(
                413 if n > MAX_BODY else 400, f"send one image or a multipart body of 1 B .. {MAX_BODY} B"
            )
            return
        body = self._read_body(n)
        if body is None:
            return
        try:
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
          poll_seconds: float = 1.0, precision: str | None = None,
          read_timeout: float = READ_TIMEOUT) -> None:  # fmt: skip
    """Serve until interrupted (Ctrl-C or SIGTERM)."""
    server = KBServer((host, port), kb_dir, device=device, poll_seconds=poll_seconds, precision=precision,
                      read_timeout=read_timeout)  # fmt: skip
    server.start_watching()
    if not log.handlers:  # the access log and reloads on stderr, one line each
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    print(
        f"serving {kb_dir} ({server.clf.num_tasks} tasks) on http://{host}:{server.server_address[1]}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
