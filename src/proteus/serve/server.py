"""uvicorn under ``proteus serve``: the HTTP protocol, the server's settings, :func:`serve` and
:class:`KBServer` (a server on its own socket, to run in a thread: tests and embedding code)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from proteus import heap
from proteus.errors import ProteusError
from proteus.learners import ContinualLearner
from proteus.serve.app import CLIENT_EOF, Limits, create_app
from proteus.serve.state import ServedKB

log = logging.getLogger("proteus")

__all__ = ["KBServer", "ServeError", "serve"]

#: seconds that running requests get to finish once the server is told to stop
GRACEFUL_SHUTDOWN = 10.0
#: seconds after the server stopped within which the process must have ended (else it ends at once: a
#: worker thread still decoding or predicting cannot be cancelled)
EXIT_GRACE = 10.0


class ServeError(ProteusError, RuntimeError):
    """The server cannot start (its address is in use, not available, not allowed): exit code 2."""


def _raw_json(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with the answers ``proteus serve`` promises where uvicorn has its own:

    - a connection with no request in progress that stays silent for ``--read-timeout`` seconds is closed
      (uvicorn times out idle keep-alive connections only after a first answer); headers that have not
      ended ``--read-timeout`` seconds after their first byte (cut short, or dripped) are answered 408 JSON
      first;
    - a client that closes its sending side mid-body (a body shorter than its Content-Length) is answered
      400 JSON rather than dropped (the app sees :data:`~proteus.serve.app.CLIENT_EOF`), and one that does
      so while its request is being answered still gets the answer;
    - a request that is not HTTP/1.1 is answered 400 JSON rather than plain text.
    """

    _idle: asyncio.TimerHandle | None = None

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if not self._busy():
            self._idle = self.loop.call_later(self.timeout_keep_alive, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self._idle = None
        if self._busy() or self.transport.is_closing():
            return
        if self._heading():  # headers started, never ended
            self.transport.write(
                _raw_json(
                    408,
                    "Request Timeout",
                    f"the request's headers did not end within {self.timeout_keep_alive:g} s",
                )
            )
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        # a request's headers have --read-timeout seconds from their first byte, however they trickle in (a
        # client dripping a byte at a time would otherwise hold its connection, and a descriptor, for ever)
        heading = self._idle is not None and self._heading()
        super().data_received(data)
        if not self.transport.is_closing() and not (heading and self._heading()):
            self._arm_idle()

    def _heading(self) -> bool:
        """Whether a request's headers have begun and not ended."""
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if not self._busy():
            return None  # nothing to answer: close
        self.cycle.keep_alive = False  # answer, then close
        if self.cycle.more_body:
            self.cycle.scope[CLIENT_EOF] = True  # type: ignore[literal-required]
            self.cycle.message_event.set()
        return True  # keep the transport open to write the answer

    def send_400_response(self, msg: str) -> None:
        self.transport.write(
            _raw_json(400, "Bad Request", f"not a valid HTTP/1.1 request ({msg.rstrip('.')})")
        )
        self.transport.close()


def _config(app: Any, host: str, port: int, limits: Limits) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=Protocol,
        ws="none",
        lifespan="on",
        log_config=None,  # proteus's logger prints the access log and the reloads
        access_log=False,
        server_header=False,
        timeout_keep_alive=limits.read_timeout,  # type: ignore[arg-type] # seconds, a float is fine
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN),
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "the port is in use (another server?); stop it or choose another --port"
        elif e.errno == errno.EACCES:
            why = "not allowed (a port below 1024 needs privileges); choose another --port"
        else:
            why = f"{e.strerror or e}; check --host and --port"
        raise ServeError(f"cannot listen on {host}:{port}: {why}") from None
    except (socket.gaierror, OverflowError, UnicodeError) as e:
        raise ServeError(f"cannot listen on {host}:{port}: {e}; check --host") from None
    sock.setblocking(False)
    return sock


class KBServer:
    """``proteus serve``'s application under uvicorn, bound at construction (``server_address`` is known
    before :meth:`serve_forever` runs, port 0 picks a free one). :meth:`serve_forever` blocks (run it in a
    thread), :meth:`shutdown` stops it from another thread, :meth:`server_close` releases the socket and the
    watcher; the same interface as the standard library's servers."""

    def __init__(
        self,
        address: tuple[str, int],
        kb_dir: str | Path,
        device: str | None = None,
        poll_seconds: float = 1.0,
        precision: str | None = None,
        **limits: float,
    ) -> None:
        """``limits``: the fields of :class:`Limits` (``read_timeout``, ``max_concurrency``, ...), its
        defaults for those not given."""
        self.limits = Limits(**limits)  # type: ignore[arg-type]
        self.kb = ServedKB(kb_dir, device, precision, poll_seconds)
        self.app = create_app(self.kb, watch=False, limits=self.limits)
        self.socket = _bind(*address)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.server = uvicorn.Server(_config(self.app, address[0], self.server_address[1], self.limits))
        self._running = threading.Lock()
        self._stopped = threading.Event()

    @property
    def clf(self) -> ContinualLearner:
        return self.kb.clf

    @property
    def reloads(self) -> int:
        return self.kb.reloads

    @property
    def kb_dir(self) -> Path:
        return self.kb.kb_dir

    def reload_if_changed(self) -> bool:
        return self.kb.reload_if_changed()

    def start_watching(self) -> None:
        self.kb.start_watching()

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (or, in the main thread, Ctrl-C / SIGTERM)."""
        with self._running:
            self._stopped.clear()
            try:
                self.server.run(sockets=[self.socket])
            finally:
                self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (running requests get :data:`GRACEFUL_SHUTDOWN` s) and wait for it."""
        self.server.should_exit = True
        if self._running.locked():
            self._stopped.wait(GRACEFUL_SHUTDOWN + 30)

    def server_close(self) -> None:
        self.kb.stop_watching()
        self.socket.close()


def serve(
    kb_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str | None = None,
    poll_seconds: float = 1.0,
    precision: str | None = None,
    **limits: float,
) -> None:
    """Serve ``kb_dir`` until interrupted (Ctrl-C or SIGTERM: running requests get
    :data:`GRACEFUL_SHUTDOWN` s, and the process ends within :data:`EXIT_GRACE` s more whatever a worker
    thread is doing);
    ``limits``: the fields of :class:`Limits`."""
    heap.bound_arenas()  # where the command line has not (an embedding program), before the workers start
    server = KBServer(
        (host, port), kb_dir, device=device, poll_seconds=poll_seconds, precision=precision, **limits
    )
    server.start_watching()
    if not log.handlers:  # the access log and reloads on stderr, one line each
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        uv = logging.getLogger("uvicorn.error")  # uvicorn's own warnings (a malformed request) the same way
        if not uv.handlers:
            uv.addHandler(handler)
            uv.setLevel(logging.WARNING)
            uv.propagate = False
    print(
        f"serving {kb_dir} ({server.clf.num_tasks} tasks) on http://{host}:{server.server_address[1]} "
        f"(up to {server.limits.max_concurrency} requests at once, batches of up to "
        f"{server.limits.max_batch} images)",
        flush=True,
    )
    handle_exit = server.server.handle_exit

    def on_signal(sig: int, frame: Any) -> None:  # stopping waits for the worker threads: bound it from here
        handle_exit(sig, frame)
        _exit_within(GRACEFUL_SHUTDOWN + EXIT_GRACE)

    server.server.handle_exit = on_signal  # type: ignore[method-assign]
    try:
        server.serve_forever()
    finally:
        server.server_close()
        _exit_within(EXIT_GRACE)


def _exit_within(seconds: float) -> None:
    """After the server stopped: make sure the process ends within ``seconds`` even if a worker thread
    (decoding or predicting a request, which cannot be cancelled) would keep the interpreter waiting."""

    def force() -> None:
        log.warning("serve: worker threads still busy %g s after the server stopped; exiting now", seconds)
        os._exit(128 + signal.SIGTERM)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()
