"""``proteus serve``: a knowledge base behind HTTP (Starlette under uvicorn), reloaded when ``proteus learn``
commits a new task. Install the ``serve`` extra (``pip install 'proteus-cl[serve]'``).

Endpoints (JSON answers; docs/predict.md has the row schema, the same as ``proteus predict --json``):

``POST /predict``        the body is one image (any ``Content-Type``), or ``multipart/form-data`` with one
                         or more files; ``?top_k=3`` as in ``predict --top-k``. Answers ``{"kb_tasks": N,
                         "predictions": [row, ...]}``. A part that is not a readable image: 400 naming it.
``POST /predict/batch``  many images, multipart or JSON ``{"images": [{"name": "a.png", "data": base64}]}``;
                         every part gets its row in order, an unreadable one ``{"file", "error"}`` instead
                         of failing the batch (``"errors"`` counts them).
``GET /tasks``           the knowledge base's tasks, classes and settings (``proteus kb info --json``).
``GET /health``          ``{"status": "ok", "kb_tasks": N, ...}`` with the load and batching counters.
``GET /openapi.json``    the OpenAPI 3.1 document of these endpoints, error answers included.

Every answer is JSON, errors included (``{"error": "..."}``, saying what to do): an unknown path 404, a
known path with another method 405 with an ``Allow`` header, a method no endpoint knows 501, a bad
``?top_k`` or an unreadable image 400, a body over 64 MiB, over 1024 images or over 256 megapixels in all
(read from the images' headers before any is decoded; ``--max-body``, ``--max-images``,
``--max-request-pixels``: the budgets of :mod:`proteus.budgets`) 413, a body that stays silent
for ``--read-timeout`` seconds 408 (then the connection is closed), a prediction request not answered within
``--request-timeout`` 504 (408 while its body was still arriving), a request beyond ``--max-concurrency``
served plus ``--max-queue`` waiting 503 with ``Retry-After``, a knowledge base that cannot be used 503 with
``Retry-After``, and anything unexpected 500 with a generic
message (the traceback goes to the log). No answer holds a path of the server: the knowledge base is named
by its directory's name. The access log is one line per answer on stderr (client, method, path, status,
bytes, milliseconds).

Throughput: dynamic micro-batching (:mod:`proteus.serve.batching`). One learner cannot run two forwards
at once (the adapted backbone holds per-call composition state), so requests cannot simply run side by
side. The event loop reads bodies; worker threads decode and transform the images; one batching thread
takes every request waiting and predicts their images together, in forwards of up to ``--max-batch``
images, and hands each request its own rows. A forward's fixed cost is then paid once per batch, not once
per request: N clients at once are answered in little more than the time of one batch of N images, much
faster than N requests in turn (tested). A row depends on its own image only, so sharing a batch changes
nothing beyond float round-off.

Memory: a request waits for room for its body in the server-wide ``body_bytes`` budget before reading it
(given back once its images are decoded); a multipart body is parsed as it arrives
(:mod:`proteus.serve.multipart`) and refused at the first part over the image budget; each image is
decoded alone, within the server-wide ``decoding_pixels`` budget, and resized by the backbone's transform
right after it is decoded (the full-size image is not kept) into the request's one batch tensor, whose
bytes the server-wide ``input_bytes`` budget holds until the request's images are predicted (a request
waits for room for all of them before decoding any). A decoding thread stops between two images once its
request has timed out or its client left.

Reloading: a watcher thread polls ``manifest.json`` (its bytes' sha256; read without blocking, never
through a link) and, when another process commits, loads the new state with the same verified loader as
``proteus predict`` and only then swaps it in. A request uses the learner it started with, so none is
dropped and none sees a half-committed state; a failed reload keeps serving the old state, logs why once,
and is tried again; ``/health`` says ``"status": "stale"`` meanwhile (:mod:`proteus.serve.state`).
``GET /tasks`` answers from the loaded state, without a disk access or a worker thread. SIGTERM stops the
server (running requests get 10 s) and the process ends within 10 s more, whatever its threads do; a port
in use is an error naming it (exit code 2).
"""

from __future__ import annotations

from proteus.errors import ProteusError

__all__ = ["ENDPOINTS", "MAX_BODY", "KBServer", "Limits", "ServeExtraMissingError", "create_app", "serve"]


class ServeExtraMissingError(ProteusError, ImportError):
    """``proteus serve`` without its dependencies (Starlette, uvicorn)."""


try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:
    raise ServeExtraMissingError(
        f"proteus serve needs Starlette and uvicorn ({e.name} is not installed): "
        "pip install 'proteus-cl[serve]'"
    ) from e

from proteus.serve.app import ENDPOINTS, MAX_BODY, Limits, create_app  # noqa: E402
from proteus.serve.server import KBServer, serve  # noqa: E402
