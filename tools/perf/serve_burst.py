"""``proteus serve``'s resident memory with requests of large images in flight, and after them.

Starts ``proteus serve --kb KB`` on a free port, then for each count N in ``--in-flight`` sends N requests
at once to ``POST /predict/batch``, each holding ``--images`` grayscale PNGs of ``--side`` x ``--side``
pixels (a few hundred KB each, 64 megapixels at the default 7999: the per-image budget), samples the
server's VmRSS every 50 ms, and prints the idle size, the peak while the requests run and the size
``--settle`` seconds after the last answer. Extra ``KEY=VALUE`` arguments go into the server's environment
(``MALLOC_ARENA_MAX=8`` reproduces glibc's default arenas; :mod:`proteus.heap`).

    python tools/perf/serve_burst.py runs/kb --in-flight 1,4,8
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

BOUNDARY = "proteusburst"


def _body(png: bytes, n: int) -> bytes:
    part = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f"; filename="{{}}.png"\r\n'
            "Content-Type: image/png\r\n\r\n")  # fmt: skip
    parts = b"".join(part.format(i).encode() + png + b"\r\n" for i in range(n))
    return parts + f"--{BOUNDARY}--\r\n".encode()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kb")
    ap.add_argument("--in-flight", default="1,4,8", help="request counts, comma-separated")
    ap.add_argument("--images", type=int, default=4, help="images per request")
    ap.add_argument("--side", type=int, default=7999)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("env", nargs="*", help="KEY=VALUE for the server's environment")
    args = ap.parse_intermixed_args()
    buf = tempfile.SpooledTemporaryFile()
    ramp = (np.arange(args.side * args.side, dtype=np.int64) % 251).astype(np.uint8)
    Image.fromarray(ramp.reshape(args.side, args.side)).save(buf, format="PNG")
    buf.seek(0)
    body = _body(buf.read(), args.images)
    port = _free_port()
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
    cmd = [sys.executable, "-m", "proteus", "serve", "--kb", args.kb, "--port", str(port), "--threads", "1",
           "--request-timeout", "600"]  # fmt: skip
    srv = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        print(f"idle: {_rss_mb(srv.pid):.0f} MiB")
        for n in (int(v) for v in args.in_flight.split(",")):
            peak, done, answers = [0.0], threading.Event(), []

            def watch(peak: list[float] = peak, done: threading.Event = done) -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], _rss_mb(srv.pid))
                    time.sleep(0.05)

            def send(answers: list[object] = answers) -> None:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/predict/batch", data=body,
                    headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
                )  # fmt: skip
                try:
                    answers.append(urllib.request.urlopen(req, timeout=900).status)
                except OSError as e:
                    answers.append(str(e)[:80])

            w = threading.Thread(target=watch)
            w.start()
            t0 = time.perf_counter()
            senders = [threading.Thread(target=send) for _ in range(n)]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            seconds = time.perf_counter() - t0
            done.set()
            w.join()
            time.sleep(args.settle)
            after = _rss_mb(srv.pid)
            print(f"{n} in flight: peak {peak[0]:.0f} MiB, {args.settle:g} s after {after:.0f} MiB, "
                  f"{seconds:.0f} s, answers {answers}")  # fmt: skip
    finally:
        srv.terminate()
        srv.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
