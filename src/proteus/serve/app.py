"""The Starlette application of ``proteus serve``: routes, request admission, body reading, JSON errors and
the access log (the package docstring describes the endpoints and the design)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proteus import heap
from proteus.budgets import BUDGETS, BudgetError, limit
from proteus.config import ConfigError
from proteus.errors import ProteusError
from proteus.images import ImageError, ImageTooLargeError, image_info, open_image, within_limit
from proteus.learners import ContinualLearner
from proteus.serve.batching import Job, MicroBatcher
from proteus.serve.multipart import MultipartError, MultipartParser, TooManyParts, boundary_of
from proteus.serve.openapi import openapi_schema
from proteus.serve.state import ServedKB
from proteus.untrusted import load_json

log = logging.getLogger("proteus")

__all__ = ["ENDPOINTS", "Limits", "create_app"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: the largest request body accepted by default (bytes; budget ``request_bytes``, ``--max-body``): 413
#: above it
MAX_BODY = BUDGETS["request_bytes"].default
#: the most images one request may carry by default (budget ``request_images``, ``--max-images``): 413 above
MAX_IMAGES = BUDGETS["request_images"].default
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
    request is refused at once with 503; ``max_batch``: the most images per forward. The budgets of
    :mod:`proteus.budgets` (``$PROTEUS_LIMIT_<NAME>`` or these flags): ``max_body`` bytes per body
    (``request_bytes``), ``max_images`` images per request (``request_images``) and ``max_request_pixels``
    (``request_pixels``), all 413 above them.
    """

    read_timeout: float = 30.0
    request_timeout: float = 300.0
    max_concurrency: int = 32
    max_queue: int = 128
    max_batch: int = 32
    max_body: int = 0  # 0: the budget in force
    max_images: int = 0
    max_request_pixels: int = 0

    def __post_init__(self) -> None:
        for key in ("read_timeout", "request_timeout"):
            if not getattr(self, key) > 0:  # NaN too
                raise ConfigError(f"{key} must be a number of seconds > 0; got {getattr(self, key)!r}")
        for key, budget in (
            ("max_body", "request_bytes"),
            ("max_images", "request_images"),
            ("max_request_pixels", "request_pixels"),
        ):
            if not getattr(self, key):
                object.__setattr__(self, key, limit(budget))
        for key, low in (("max_concurrency", 1), ("max_batch", 1), ("max_queue", 0), ("max_images", 1),
                         ("max_body", 1), ("max_request_pixels", 1)):  # fmt: skip
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
    decoding: PixelBudget
    inputs: SharedBudget
    bodies: BodyBudget


#: pixels decoded, as a burst, before the heap is trimmed once no decode runs (:func:`proteus.heap.trim`):
#: requests of small images do not pay for a walk over the heap each
TRIM_AFTER_PIXELS = 16_000_000


class SharedBudget:
    """An amount shared by all requests (pixels being decoded, bytes of inputs held): :meth:`acquire` waits
    until ``n`` more fit within ``total`` (``n`` alone always fits: a request is never refused for its own
    size here), so what the server holds of it is bounded whatever the number of requests. A request takes
    all it needs at once and gives it back (:meth:`release`) before taking more, so none waits holding a
    share another needs."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._cond = threading.Condition()

    def acquire(self, n: int, cancelled: threading.Event) -> bool:
        """Wait for room for ``n``; False if ``cancelled`` is set meanwhile."""
        with self._cond:
            while self.used and self.used + n > self.total:
                if cancelled.is_set():
                    return False
                self._cond.wait(0.1)
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            drained = self._released(n)
            self._cond.notify_all()
        if drained:
            self._drained()

    def _released(self, n: int) -> bool:
        """Called with the lock held after ``n`` was given back: whether to call :meth:`_drained` after."""
        return False

    def _drained(self) -> None:
        """Called without the lock when :meth:`_released` asked for it."""


class PixelBudget(SharedBudget):
    """Pixels being decoded at once by all requests (budget ``decoding_pixels``): a decode waits until its
    image fits (one image alone always fits), so the server's memory for decoding is bounded whatever the
    number of requests; once no decode runs after a burst, the heap is trimmed."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.since_trim = 0  # pixels decoded since the heap was last trimmed

    def _released(self, n: int) -> bool:
        self.since_trim += n
        if self.used or self.since_trim < TRIM_AFTER_PIXELS:
            return False
        self.since_trim = 0
        return True

    def _drained(self) -> None:  # a burst of large decodes is over: their freed pages back to the system
        heap.trim()


class BodyBudget:
    """Bytes of request bodies held by all requests at once (budget ``body_bytes``): a request waits, on the
    event loop, for room for its body before reading any of it (one alone always fits) and gives it back
    once its images are decoded, so the bodies a server holds are bounded whatever the number of requests
    (``request_bytes`` bounds one). Not a :class:`SharedBudget`: its waits block a thread, and requests
    waiting to read would hold the worker threads that decode. Every call runs on the event loop's thread:
    :meth:`release` needs no ``await``, so a request cancelled meanwhile always gives its share back."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._waiting: list[asyncio.Future[None]] = []

    async def acquire(self, n: int) -> None:
        while self.used and self.used + n > self.total:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
        self.used += n

    def release(self, n: int) -> None:
        if not n:
            return
        self.used -= n
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)


def _json(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload).encode(), status, headers, media_type="application/json")


def _runtime(request: Request) -> Runtime:
    return request.app.state.proteus


# ------------------------------------------------------------------------------------------ reading
async def _read_body(
    request: Request, length: int | None, limits: Limits, sink: Callable[[bytes], None] | None = None
) -> bytes:
    """The request's body (or, with ``sink``, each chunk handed to it as it arrives: a streaming parser that
    may refuse the request before the rest is read): 408 when it stays silent for ``read_timeout`` s, 400
    when the client closes its side early, 413 past ``max_body``."""
    chunks: list[bytes] = []
    got = 0
    promised = f" of the {length} B its Content-Length promised" if length is not None else " (chunked)"
    while True:
        with anyio.move_on_after(limits.read_timeout) as silent:
            message = await request.receive()
        if silent.cancelled_caught:
            raise Refusal(
                408, f"the body ended after {got}{promised} (nothing more came in {limits.read_timeout:g} s)"
            )
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if not chunk and more and request.scope.get(CLIENT_EOF):
            raise Refusal(400, f"the body ended after {got}{promised}")
        got += len(chunk)
        if got > limits.max_body:
            raise _too_large("request_bytes", f"the body is over {limits.max_body} B", "--max-body")
        if sink is None:
            chunks.append(chunk)
        else:
            try:
                sink(chunk)
            except TooManyParts as e:
                raise _too_large(e.budget, str(e), "--max-images") from None
            except MultipartError as e:
                raise Refusal(400, str(e)) from None
        if not more:
            return b"".join(chunks)


def _too_large(budget: str, what: str, flag: str | None) -> Refusal:
    """413 naming the budget and how to raise it."""
    how = f"proteus serve {flag} or ${BUDGETS[budget].env}" if flag else f"${BUDGETS[budget].env}"
    return Refusal(413, f"{what} (budget {budget}); send fewer or smaller images per request, or raise {how}")


async def _read_parts(
    request: Request, length: int | None, limits: Limits, batch: bool
) -> list[tuple[str, bytes]]:
    """The (name, bytes) images of a request: a multipart body's files (parsed as they arrive, stopped at
    the first part over ``max_images``), a batch's JSON list, else the body."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:
            parser = MultipartParser(boundary_of(ctype), limits.max_images, limit("part_header_bytes"))
        except MultipartError as e:
            raise Refusal(400, str(e)) from None
        await _read_body(request, length, limits, parser.feed)
        try:
            return parser.finish()
        except MultipartError as e:
            raise Refusal(400, str(e)) from None
    body = await _read_body(request, length, limits)
    if batch and ctype.split(";")[0].strip() == "application/json":  # parsed in a thread: up to max_body
        parts = await anyio.to_thread.run_sync(_json_images, body)
    else:
        parts = [("body", body)]
    if len(parts) > limits.max_images:
        raise _too_large("request_images", f"{len(parts)} images in one request", "--max-images")
    return parts


def _json_images(body: bytes) -> list[tuple[str, bytes]]:
    """``{"images": [{"name": "a.png", "data": "<base64>"}, ...]}`` (``name`` optional) as (name, bytes)."""
    use = 'send {"images": [{"name": "a.png", "data": "<base64 of the file>"}, ...]}'
    try:
        doc = load_json(body, "the JSON body")
    except BudgetError as e:
        raise Refusal(413, str(e)) from None
    except ProteusError as e:
        raise Refusal(400, f"{e}; {use}") from None
    items = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise Refusal(400, f"no images in the JSON body; {use}")
    out = []
    for i, item in enumerate(items):
        name = item.get("name", f"image{i}") if isinstance(item, dict) else None
        data = item.get("data") if isinstance(item, dict) else None
        if not isinstance(name, str) or not isinstance(data, str):
            raise Refusal(400, f"images[{i}] is not {{'name': str, 'data': base64 str}}; {use}")
        try:
            out.append((name, base64.b64decode(data, validate=True)))
        except (binascii.Error, ValueError):
            raise Refusal(400, f"images[{i}] ({name}): data is not base64; {use}") from None
    return out


def _sizes(parts: list[tuple[str, bytes]], max_pixels: int | None, limits: Limits, strict: bool) -> list[Any]:
    """Each part's pixels of the budgets from its header (its format's weight included:
    :func:`proteus.images.budget_pixels`; an :class:`ImageError` instead for an unreadable or too large one;
    raised when ``strict``), refused with 413 when their sum is over ``max_request_pixels``, all before any
    image is decoded."""
    out: list[Any] = []
    for name, data in parts:
        try:
            info = image_info(io.BytesIO(data), name)
            hint = " per image (budget image_pixels: the knowledge base's eval.max_image_pixels)"
            out.append(within_limit(name, info.width, info.height, max_pixels, info.format, hint))
        except ImageError as e:
            if strict:
                raise
            out.append(e)
    total = sum(n for n in out if isinstance(n, int))
    if total > limits.max_request_pixels:
        raise _too_large(
            "request_pixels",
            f"the request's {len(parts)} images hold {total} pixels (width x height from their headers, "
            "times their formats' weights: proteus.images.PIXEL_WEIGHT), "
            f"over {limits.max_request_pixels}",
            "--max-request-pixels",
        )
    return out


#: the model input a served learner makes of one image (:func:`_input_of`)
_INPUTS: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], torch.dtype, int]] = (
    weakref.WeakKeyDictionary()
)


def _input_of(clf: ContinualLearner) -> tuple[tuple[int, ...], torch.dtype, int]:
    """The shape, dtype and bytes of the model input ``clf`` makes of one image (its transform's output: the
    same for every image), found once per learner from a one-pixel image."""
    found = _INPUTS.get(clf)
    if found is None:
        x = clf.transform_images([Image.new("RGB", (1, 1))])
        found = (tuple(x.shape[1:]), x.dtype, x[:1].numel() * x.element_size())
        with contextlib.suppress(TypeError):  # (a learner that cannot be weakly referenced: found each time)
            _INPUTS[clf] = found
    return found


def _decode(
    clf: ContinualLearner,
    parts: list[tuple[str, bytes]],
    strict: bool,
    limits: Limits,
    budgets: tuple[PixelBudget, SharedBudget],
    cancelled: threading.Event,
    held: list[int],
) -> tuple[torch.Tensor | None, list[str], dict[int, str]]:
    """Check the parts' headers (:func:`_sizes`), take room in the server's input budget for the model inputs
    of all the readable ones (added to ``held``: the caller gives it back once they are predicted), then
    decode and transform them one at a time (in a worker thread) into one batch tensor, each resized by the
    backbone's transform right after it is decoded (the full-size image is not kept) and within the server's
    :class:`PixelBudget`: the batch tensor of the readable ones, their names and ``{position: message}`` for
    the others. ``strict``: the first unreadable part raises. Stops early (returns nothing) when
    ``cancelled`` is set: the request timed out or its client left."""
    pixels, inputs = budgets
    max_pixels = clf.config.eval.max_image_pixels
    sizes = _sizes(parts, max_pixels, limits, strict)
    readable = sum(not isinstance(n, ImageError) for n in sizes)
    shape, dtype, each = _input_of(clf)
    if not inputs.acquire(readable * each, cancelled):
        return None, [], {}
    held[0] += readable * each
    x = torch.empty((readable, *shape), dtype=dtype)
    names: list[str] = []
    errors: dict[int, str] = {}
    for i, ((name, data), n) in enumerate(zip(parts, sizes)):
        if isinstance(n, ImageError):
            errors[i] = str(n)
            continue
        if not pixels.acquire(n, cancelled):
            return None, [], {}
        try:
            image = open_image(io.BytesIO(data), max_pixels, name=name)
            x[len(names)] = clf.transform_images([image])[0]
            del image
            names.append(name)
        except ImageError as e:
            if strict:
                raise
            errors[i] = str(e)
        finally:
            pixels.release(n)
    return (x[: len(names)] if names else None), names, errors


def _top_k(request: Request) -> int:
    raw = request.query_params.getlist("top_k")[-1:] or ["1"]
    try:
        top_k = int(raw[0])
    except ValueError:
        top_k = 0
    if top_k < 1:
        raise Refusal(400, f"top_k must be an integer >= 1; got {raw[0]!r}")
    return top_k


def _content_length(request: Request, limits: Limits) -> int | None:
    """The declared body size (None: chunked); 400 without a body, 413 above ``max_body``."""
    raw = request.headers.get("content-length")
    if raw is None and "transfer-encoding" in request.headers:
        return None
    try:
        n = int(raw or "0") if len(raw or "") <= 20 else -1
    except ValueError:
        n = -1
    if n < 0:
        raise Refusal(400, f"bad Content-Length {raw[:30] if raw else raw!r}")
    if n > limits.max_body:
        raise _too_large("request_bytes", f"a body of {n} B is over {limits.max_body} B", "--max-body")
    if n == 0:
        raise Refusal(400, f"send one image or a multipart body of 1 B .. {limits.max_body} B")
    return n


# ---------------------------------------------------------------------------------------- endpoints
async def _predict(request: Request, batch: bool) -> Response:
    rt = _runtime(request)
    top_k = _top_k(request)
    length = _content_length(request, rt.limits)
    stage = "waiting for a slot"
    cancelled = threading.Event()  # tells a decoding thread to stop: the request has given up
    held = [0]  # bytes of the server's input budget this request holds
    body = 0  # bytes of the server's body budget this request holds
    try:
        with anyio.move_on_after(rt.limits.request_timeout) as deadline:
            async with rt.admission.slot():
                stage = "waiting for room to read its body"
                await rt.bodies.acquire(want := length if length is not None else rt.limits.max_body)
                body = want
                stage = "reading"
                parts = await _read_parts(request, length, rt.limits, batch)
                stage = "decoding"
                clf = rt.kb.clf  # this request's learner, even if a reload swaps in another meanwhile
                try:
                    x, names, errors = await anyio.to_thread.run_sync(
                        _decode, clf, parts, not batch, rt.limits, (rt.decoding, rt.inputs), cancelled, held
                    )
                except ImageTooLargeError as e:
                    raise Refusal(413, f"{e}; send a smaller image") from None
                except ImageError as e:
                    raise Refusal(400, str(e)) from None
                files = [name for name, _ in parts]
                del parts  # the body is decoded: its bytes go, and its room in the body budget
                rt.bodies.release(body)
                body = 0
                stage = "predicting"
                rows = await _rows(rt.batcher, clf, x, names, top_k) if x is not None else []
                del x
    finally:
        cancelled.set()
        rt.inputs.release(held[0])
        rt.bodies.release(body)
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
            {"file": files[i], "error": errors[i]} if i in errors else next(it) for i in range(len(files))
        ]
        return _json(200, {"kb_tasks": clf.num_tasks, "predictions": rows, "errors": len(errors)})
    return _json(200, {"kb_tasks": clf.num_tasks, "predictions": rows})


async def _rows(
    batcher: MicroBatcher, clf: ContinualLearner, x: torch.Tensor, names: list[str], top_k: int
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
    """``GET /tasks``: what the served state holds (computed when it was loaded: no disk access, no worker
    thread, so no request can pin one)."""
    return _json(200, _runtime(request).kb.info())


async def health(request: Request) -> Response:
    """``GET /health``: ``status`` "ok", or "stale" when manifest.json changed on disk and the new state
    could not be loaded (``stale`` says since when and why; the last good state is served meanwhile)."""
    rt = _runtime(request)
    b = rt.batcher
    stale = rt.kb.stale
    return _json(
        200,
        {
            "status": "stale" if stale else "ok",
            "kb": rt.kb.name,
            "kb_tasks": rt.kb.clf.num_tasks,
            "stale": stale,
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
        except ProteusError as e:  # the knowledge base (or another input of the server) is not usable now
            log.warning("serve: %s %s: %s", scope["method"], scope["path"], e)
            if not state["status"]:
                error = "the knowledge base cannot be used right now; retry later (the server's log says why)"
                await _json(503, {"error": error}, {"Retry-After": "5"})(scope, receive_, send_)
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
        PixelBudget(limit("decoding_pixels")),
        SharedBudget(limit("input_bytes")),
        BodyBudget(limit("body_bytes")),
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
    app.state.openapi = openapi_schema(ENDPOINTS, limits.max_body, limits.max_images)
    return app
