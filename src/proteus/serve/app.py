"""The Starlette application of ``proteus serve``: routes, request admission, body reading, JSON errors and
the access log (the package docstring describes the endpoints and the design)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.parser
import email.policy
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proteus.config import ConfigError
from proteus.core.estimator import Proteus
from proteus.images import ImageError, open_image
from proteus.serve.batching import Job, MicroBatcher
from proteus.serve.openapi import openapi_schema
from proteus.serve.state import ServedKB

log = logging.getLogger("proteus")

__all__ = ["ENDPOINTS", "Limits", "create_app"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: the largest request body accepted (bytes): 413 above it
MAX_BODY = 64 << 20
#: the most images one request may carry: 413 above it (split the batch)
MAX_IMAGES = 1024
#: endpoint -> the methods it answers (405 with ``Allow`` for the others)
ENDPOINTS = {
    "/predict": ("POST",),
    "/predict/batch": ("POST",),
    "/tasks": ("GET", "HEAD"),
    "/health": ("GET", "HEAD"),
    "/openapi.json": ("GET", "HEAD"),
}
#: methods some endpoint could answer; any other method is 501 (not implemented) on every path
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
_USE = "use POST /predict, POST /predict/batch, GET /tasks, GET /health or GET /openapi.json"
#: the scope key the HTTP protocol sets when the client closed its sending side mid-body (server.py)
CLIENT_EOF = "proteus.client_eof"


@dataclass(frozen=True)
class Limits:
    """The server's limits (``proteus serve`` flags of the same names).

    ``read_timeout``: seconds a request's body may stay silent (408, connection closed);
    ``request_timeout``: seconds for a whole prediction request, from its headers to its answer (408 while
    its body is still arriving, 504 after); ``max_concurrency``: prediction requests served at once (their
    images batched together); ``max_queue``: requests waiting for one of those slots, beyond which a
    request is refused at once with 503; ``max_batch``: the most images per forward.
    """

    read_timeout: float = 30.0
    request_timeout: float = 300.0
    max_concurrency: int = 32
    max_queue: int = 128
    max_batch: int = 32

    def __post_init__(self) -> None:
        for key in ("read_timeout", "request_timeout"):
            if not getattr(self, key) > 0:  # NaN too
                raise ConfigError(f"{key} must be a number of seconds > 0; got {getattr(self, key)!r}")
        for key, low in (("max_concurrency", 1), ("max_batch", 1), ("max_queue", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"{key} must be an integer >= {low}; got {getattr(self, key)!r}")


class Refusal(HTTPException):
    """A request refused with ``status`` and a message saying what to do; answered ``{"error": message}``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)


class _ClientGone(Exception):
    """The client disconnected before its request was read: nobody to answer."""


class Admission:
    """At most ``limit`` requests served at once, ``queue`` more waiting for a slot; :meth:`slot` refuses
    the next one at once (503) rather than letting a burst pile up without bound."""

    def __init__(self, limit: int, queue: int) -> None:
        self.limit, self.queue = limit, queue
        self.active = self.waiting = 0
        self._slots = asyncio.Semaphore(limit)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.active + self.waiting >= self.limit + self.queue:
            raise Refusal(
                503,
                f"the server is busy: {self.active} requests are being served and {self.waiting} are waiting "
                "(proteus serve --max-concurrency, --max-queue); retry in a moment",
                {"Retry-After": "1"},
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            self._slots.release()


@dataclass
class Runtime:
    """What the endpoints share: the knowledge base, the micro-batcher, the admission and the limits."""

    kb: ServedKB
    batcher: MicroBatcher
    admission: Admission
    limits: Limits
    watch: bool


def _json(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload).encode(), status, headers, media_type="application/json")


def _runtime(request: Request) -> Runtime:
    return request.app.state.proteus


# ------------------------------------------------------------------------------------------ reading
async def _read_body(request: Request, length: int | None, read_timeout: float) -> bytes:
    """The request's body: 408 when it stays silent for ``read_timeout`` s, 400 when the client closes its
    side early, 413 past :data:`MAX_BODY`."""
    chunks: list[bytes] = []
    got = 0
    promised = f" of the {length} B its Content-Length promised" if length is not None else " (chunked)"
    while True:
        with anyio.move_on_after(read_timeout) as silent:
            message = await request.receive()
        if silent.cancelled_caught:
            raise Refusal(
                408, f"the body ended after {got}{promised} (nothing more came in {read_timeout:g} s)"
            )
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if not chunk and more and request.scope.get(CLIENT_EOF):
            raise Refusal(400, f"the body ended after {got}{promised}")
        got += len(chunk)
        if got > MAX_BODY:
            raise Refusal(413, f"the body is over {MAX_BODY} B; send fewer or smaller images per request")
        chunks.append(chunk)
        if not more:
            return b"".join(chunks)


def _parts(body: bytes, ctype: str, batch: bool) -> list[tuple[str, bytes]]:
    """The (name, bytes) images of a body: a multipart body's files, a batch's JSON list, else the body."""
    if ctype.startswith("multipart/form-data"):
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            f"Content-Type: {ctype}\r\n\r\n".encode() + body
        )
        parts = [
            (
                p.get_filename() or p.get_param("name", header="content-disposition") or f"part{i}",
                p.get_payload(decode=True) or b"",
            )
            for i, p in enumerate(msg.iter_parts())
        ]
        if not parts:
            raise ValueError("multipart body without parts; send one or more image files")
    elif batch and ctype.split(";")[0].strip() == "application/json":
        parts = _json_images(body)
    else:
        parts = [("body", body)]
    if len(parts) > MAX_IMAGES:
        raise Refusal(413, f"{len(parts)} images in one request; send at most {MAX_IMAGES} per request")
    return parts


def _json_images(body: bytes) -> list[tuple[str, bytes]]:
    """``{"images": [{"name": "a.png", "data": "<base64>"}, ...]}`` (``name`` optional) as (name, bytes)."""
    use = 'send {"images": [{"name": "a.png", "data": "<base64 of the file>"}, ...]}'
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the body is not JSON ({e}); {use}") from None
    items = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"no images in the JSON body; {use}")
    out = []
    for i, item in enumerate(items):
        name = item.get("name", f"image{i}") if isinstance(item, dict) else None
        data = item.get("data") if isinstance(item, dict) else None
        if not isinstance(name, str) or not isinstance(data, str):
            raise ValueError(f"images[{i}] is not {{'name': str, 'data': base64 str}}; {use}")
        try:
            out.append((name, base64.b64decode(data, validate=True)))
        except (binascii.Error, ValueError):
            raise ValueError(f"images[{i}] ({name}): data is not base64; {use}") from None
    return out


def _decode(
    clf: Proteus, parts: list[tuple[str, bytes]], strict: bool
) -> tuple[torch.Tensor | None, list[str], dict[int, str]]:
    """Decode and transform the parts (in a worker thread): the batch tensor of the readable ones, their
    names and ``{position: message}`` for the others. ``strict``: the first unreadable part raises."""
    images, names, errors = [], [], {}
    for i, (name, data) in enumerate(parts):
        try:
            images.append(open_image(io.BytesIO(data), clf.config.eval.max_image_pixels, name=name))
            names.append(name)
        except ImageError as e:
            if strict:
                raise
            errors[i] = str(e)
    return (clf.transform_images(images) if images else None), names, errors


def _top_k(request: Request) -> int:
    raw = request.query_params.getlist("top_k")[-1:] or ["1"]
    try:
        top_k = int(raw[0])
    except ValueError:
        top_k = 0
    if top_k < 1:
        raise Refusal(400, f"top_k must be an integer >= 1; got {raw[0]!r}")
    return top_k


def _content_length(request: Request) -> int | None:
    """The declared body size (None: chunked); 400 without a body, 413 above :data:`MAX_BODY`."""
    raw = request.headers.get("content-length")
    if raw is None and "transfer-encoding" in request.headers:
        return None
    try:
        n = int(raw or "0")
    except ValueError:
        raise Refusal(400, f"bad Content-Length {raw!r}") from None
    if n <= 0 or n > MAX_BODY:
        raise Refusal(
            413 if n > MAX_BODY else 400, f"send one image or a multipart body of 1 B .. {MAX_BODY} B"
        )
    return n


# ---------------------------------------------------------------------------------------- endpoints
async def _predict(request: Request, batch: bool) -> Response:
    rt = _runtime(request)
    top_k = _top_k(request)
    length = _content_length(request)
    stage = "waiting for a slot"
    with anyio.move_on_after(rt.limits.request_timeout) as deadline:
        async with rt.admission.slot():
            stage = "reading"
            body = await _read_body(request, length, rt.limits.read_timeout)
            stage = "decoding"
            clf = rt.kb.clf  # this request's learner, even if a reload swaps in another meanwhile
            try:
                parts = await anyio.to_thread.run_sync(
                    _parts, body, request.headers.get("content-type", ""), batch
                )
                x, names, errors = await anyio.to_thread.run_sync(_decode, clf, parts, not batch)
            except (ImageError, ValueError) as e:
                raise Refusal(400, str(e)) from None
            stage = "predicting"
            rows = await _rows(rt.batcher, clf, x, names, top_k) if x is not None else []
    if deadline.cancelled_caught:
        timeout = rt.limits.request_timeout
        if stage == "reading":
            raise Refusal(408, f"the request's body did not arrive within {timeout:g} s (--request-timeout)")
        raise Refusal(
            504,
            f"no answer within {timeout:g} s ({stage}: the server is busy); retry later, send fewer images "
            "per request, or raise proteus serve --request-timeout",
        )
    if batch:  # every part in its place: a row, or {"file", "error"} for one that is not a readable image
        it = iter(rows)
        rows = [
            {"file": parts[i][0], "error": errors[i]} if i in errors else next(it) for i in range(len(parts))
        ]
        return _json(200, {"kb_tasks": clf.num_tasks, "predictions": rows, "errors": len(errors)})
    return _json(200, {"kb_tasks": clf.num_tasks, "predictions": rows})


async def _rows(
    batcher: MicroBatcher, clf: Proteus, x: torch.Tensor, names: list[str], top_k: int
) -> list[dict[str, Any]]:
    """The rows of ``x`` from the micro-batcher; a request that gives up leaves its job skipped."""
    loop = asyncio.get_running_loop()
    job = Job(clf, x, names, top_k, loop, loop.create_future())
    batcher.submit(job)
    try:
        return await job.future
    except asyncio.CancelledError:
        job.cancelled = True
        raise
    except Exception:  # logged by the batcher with its traceback; the client gets no internals
        raise Refusal(500, "internal error while predicting; the server's log has the details") from None


async def predict(request: Request) -> Response:
    """``POST /predict``: one image (the body) or a multipart body of images; every one must be readable."""
    return await _predict(request, batch=False)


async def predict_batch(request: Request) -> Response:
    """``POST /predict/batch``: many images (multipart or JSON); an unreadable one gets an error row."""
    return await _predict(request, batch=True)


async def tasks(request: Request) -> Response:
    return _json(200, await anyio.to_thread.run_sync(_runtime(request).kb.info))


async def health(request: Request) -> Response:
    rt = _runtime(request)
    b = rt.batcher
    return _json(
        200,
        {
            "status": "ok",
            "kb": rt.kb.name,
            "kb_tasks": rt.kb.clf.num_tasks,
            "reloads": rt.kb.reloads,
            "active": rt.admission.active,
            "waiting": rt.admission.waiting,
            "batches": b.batches,
            "images": b.images,
            "largest_batch": b.largest,
        },
    )


async def openapi(request: Request) -> Response:
    return _json(200, request.app.state.openapi)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Every refusal as ``{"error": ...}``: Starlette's own 404 and 405 reworded to say what to use."""
    assert isinstance(exc, HTTPException)
    path, status = request.scope["path"], exc.status_code
    headers = dict(exc.headers or {})
    message = str(exc.detail)
    if not isinstance(exc, Refusal) and status == 404:
        message = f"no such endpoint {path!r}; {_USE}"
    elif not isinstance(exc, Refusal) and status == 405:
        allowed = ENDPOINTS.get(path, ())
        use = " or ".join(f"{m} {path}" for m in allowed if m != "HEAD")
        message = f"{request.method} is not allowed on {path}; use {use}"
        headers["Allow"] = ", ".join(allowed)
    return _json(status, {"error": message}, headers)


# ------------------------------------------------------------------------------------------ frontend
class Frontend:
    """Pure ASGI middleware around the routes: the access log (one line per answer: client, method, path,
    status, bytes, milliseconds), 501 for a method no endpoint knows, ``Connection: close`` when a body was
    left unread (it would be taken for the next request), and a JSON 500 for anything unexpected (logged
    with its traceback; the answer says nothing of the server's internals)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = dict(scope["headers"])
        state = {"status": 0, "bytes": 0, "read": headers.get(b"content-length", b"0").strip() in (b"", b"0")}
        state["read"] = state["read"] and b"transfer-encoding" not in headers

        async def receive_(*_: Any) -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                state["read"] = True
            return message

        async def send_(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                if not state["read"]:
                    message = {**message, "headers": [*message.get("headers", []), (b"Connection", b"close")]}
            elif message["type"] == "http.response.body":
                state["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            if scope["method"] not in KNOWN_METHODS:
                error = f"method {scope['method']} is not supported; {_USE}"
                await _json(501, {"error": error})(scope, receive_, send_)
            else:
                await self.app(scope, receive_, send_)
        except _ClientGone:
            log.debug("serve: the client of %s %s went away", scope["method"], scope["path"])
        except Exception:  # noqa: BLE001 - one failed request must not stop the server
            log.exception("serve: %s %s failed", scope["method"], scope["path"])
            if not state["status"]:
                error = "internal error; the server's log has the details"
                await _json(500, {"error": error})(scope, receive_, send_)
        finally:
            client = (scope.get("client") or ("-",))[0]
            qs = scope.get("query_string", b"").decode("latin-1")
            path = scope["path"] + (f"?{qs}" if qs else "")
            ms = 1000 * (time.perf_counter() - t0)
            log.info(
                "%s %s %s %s %s %.1fms",
                client,
                scope["method"],
                path,
                state["status"] or "-",
                state["bytes"],
                ms,
            )


def create_app(
    kb: str | Path | ServedKB,
    *,
    device: str | None = None,
    precision: str | None = None,
    poll_seconds: float = 1.0,
    watch: bool = True,
    limits: Limits | None = None,
) -> Starlette:
    """The ASGI application serving the knowledge base ``kb`` (a directory, or a :class:`ServedKB` to
    share). ``watch``: its lifespan starts the reload watcher (``poll_seconds`` between checks). Run it
    with :func:`proteus.serve.serve`, or any ASGI server that runs the lifespan."""
    served = kb if isinstance(kb, ServedKB) else ServedKB(kb, device, precision, poll_seconds)
    limits = limits or Limits()
    rt = Runtime(
        served,
        MicroBatcher(limits.max_batch),
        Admission(limits.max_concurrency, limits.max_queue),
        limits,
        watch,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rt.batcher.start()
        if rt.watch:
            rt.kb.start_watching()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(rt.batcher.stop)
            if rt.watch:
                await anyio.to_thread.run_sync(rt.kb.stop_watching)

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/predict/batch", predict_batch, methods=["POST"]),
        Route("/tasks", tasks, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Frontend)],
        exception_handlers={HTTPException: _on_http_error},
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # /predict/ is 404, not a redirect without a JSON body
    app.state.proteus = rt
    app.state.openapi = openapi_schema(ENDPOINTS, MAX_BODY, MAX_IMAGES)
    return app
