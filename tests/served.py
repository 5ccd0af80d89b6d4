"""``proteus serve`` in a process of its own, for the tests that measure its memory under concurrent requests
(tests/test_serve_bounded.py, tests/test_fuzz.py): the server with budgets in its environment, multipart
bodies, and the server's peak resident memory while requests are answered."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BOUNDARY = "burst"


def rss(pid: int) -> int:
    """A process's resident bytes now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def multipart(images: list[bytes]) -> bytes:
    """A multipart body of ``images``, one part each (boundary :data:`BOUNDARY`)."""
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f"; filename="x.png"\r\n\r\n'.encode()
    return b"".join(head + png + b"\r\n" for png in images) + f"--{BOUNDARY}--\r\n".encode()


@contextlib.contextmanager
def server(kb: Path, *options: str, **limits: int) -> Iterator[tuple[int, str]]:
    """``proteus serve`` on ``kb`` in a process of its own, ``options`` on its command line, ``limits``
    (``PROTEUS_LIMIT_*``) in its environment: (its pid, its URL); stopped (SIGTERM, else killed) after. Its
    log goes to a file and its output is read to the end: a pipe nobody reads fills after 64 KiB of log
    lines, and the server's next line then blocks its event loop (every request unanswered)."""
    env = {**os.environ, **{k: str(v) for k, v in limits.items()}, "OMP_NUM_THREADS": "1"}
    argv = ["serve", "--kb", str(kb), "--port", "0", "--device", "cpu", "--threads", "1", *options]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proteus", *argv], stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if "serving" not in line:
                log.seek(0)
                raise AssertionError(f"{line}{log.read()[-3000:]}")
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
            yield proc.pid, line.split(" on ")[1].split()[0]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def peak_during(pid: int, url: str, bodies: list[bytes]) -> tuple[int, list[httpx.Response]]:
    """Send ``bodies`` (multipart, :func:`multipart`) to ``/predict/batch`` all at once; returns the server's
    peak resident bytes meanwhile and the answers, in order."""
    peak, done = [rss(pid)], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.02)

    def send(body: bytes) -> httpx.Response:
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        return httpx.post(url + "/predict/batch", content=body, headers=headers, timeout=300)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(send, bodies))
    finally:
        done.set()
        watcher.join()
    return peak[0], answers
