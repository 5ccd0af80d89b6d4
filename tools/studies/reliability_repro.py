"""Replay the reproductions of the adversarial reliability review (2026-11-26) and print what each ended in.

Every case runs the real command line in a child process (``python -m proteus ...``) with a 30 s limit, and
reports its exit code, its wall time, its peak resident memory (``wait4``) next to the same command's on the
normal knowledge base, and whether the knowledge base is byte for byte unchanged. A case passes when it ends
within 30 s with the expected exit code (exit 2 or a 4xx for a refusal; ``kb verify``'s 1), within 500 MB of
the normal command's memory, with the knowledge base unchanged; server cases also need ``/health`` and
``/predict`` to answer after each case.

    python tools/studies/reliability_repro.py --work /tmp/repro            # everything (about 10 minutes)
    python tools/studies/reliability_repro.py --work /tmp/repro --only serve --only cli

The knowledge base is a small 2-task one (a ViT-Ti with random weights on generated images), so the memory
figures are about what each input adds, not about a real model's size.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

LIMIT_S = 30.0
MEMORY_MARGIN_MB = 500.0
TINY = [
    "--backbone",
    "vit_ti16",
    "--device",
    "cpu",
    "-q",
    *[
        a
        for s in (
            "backbone.pretrained=false",
            "backbone.img_size=32",
            "backbone.adapt_last=2",
            "train.epochs=1",
            "head.rp_dim=256",
            "signature.max_components=2",
            "signature.max_iter=20",
            "signature.rank=8",
        )
        for a in ("--set", s)
    ],
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@dataclass
class Result:
    case: str
    command: str
    rc: int | None
    seconds: float
    peak_mb: float
    base_mb: float | None
    intact: bool | None
    ok: bool
    note: str = ""


RESULTS: list[Result] = []


# ------------------------------------------------------------------------------------------------ helpers
def run(
    argv: list[str], timeout: float = LIMIT_S, cwd: Path | None = None
) -> tuple[int | None, float, float, str]:
    """(exit code or None when killed at ``timeout``, seconds, peak RSS in MB, stdout + stderr)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proteus", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        cwd=cwd,
    )
    out: list[bytes] = []
    reader = threading.Thread(
        target=lambda: out.append(proc.stdout.read() if proc.stdout else b""), daemon=True
    )
    reader.start()
    killer = threading.Timer(timeout, lambda: os.kill(proc.pid, signal.SIGKILL))
    killer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(10)
    seconds = time.monotonic() - t0
    rc = None if proc.returncode == -signal.SIGKILL and seconds >= timeout else proc.returncode
    return rc, seconds, usage.ru_maxrss / 1024, b"".join(out).decode(errors="replace")


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: regular files by sha256, anything else by its kind (links not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name == ".lock":
            continue
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            h = hashlib.sha256()
            with p.open("rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            out[str(p.relative_to(root))] = h.hexdigest()
        elif not stat.S_ISDIR(st.st_mode):
            out[str(p.relative_to(root))] = f"mode {stat.S_IFMT(st.st_mode):o}"
    return out


def write_png(path: Path, seed: int) -> None:
    rng = np.random.RandomState(seed)
    Image.fromarray(rng.randint(0, 256, (12, 12, 3), dtype=np.uint8)).save(path)


def big_png(side: int) -> bytes:
    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    c = zlib.compressobj(9)
    row = b"\0" * (side + 1)
    idat = b"".join(c.compress(row) for _ in range(side)) + c.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def checksum(m: dict[str, Any]) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from proteus.kb import manifest_checksum

    return manifest_checksum(m)


def manifest(kb: Path, name: str = "manifest.json") -> dict[str, Any]:
    return json.loads((kb / name).read_text())


def write_manifest(kb: Path, m: dict[str, Any], name: str = "manifest.json", recompute: bool = True) -> None:
    if recompute:
        m["checksum"] = checksum(m)
    path = kb / name
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_text(json.dumps(m))


# ------------------------------------------------------------------------------------------------ setup
def build(work: Path) -> dict[str, Path]:
    data, spec, kb = work / "data", work / "spec.yaml", work / "kb"
    if not (kb / "manifest.json").exists():
        for split, n in (("train", 5), ("test", 2)):
            for ci, c in enumerate("abcd"):
                (data / split / c).mkdir(parents=True, exist_ok=True)
                for i in range(n):
                    write_png(data / split / c / f"{i}.png", 1000 * ci + 10 * i + (split == "test"))
        spec.write_text("tasks: [[a, b], [c, d]]\n")
        for task in (1, 2):
            rc, s, _, out = run(
                [
                    "learn",
                    "--kb",
                    str(kb),
                    "--task",
                    str(task),
                    "--benchmark",
                    "folder",
                    "--data",
                    str(data),
                    "--tasks",
                    str(spec),
                    *TINY,
                ],
                timeout=600,
            )
            assert rc == 0, out
    img = data / "test" / "a" / "0.png"
    return {"data": data, "spec": spec, "kb": kb, "img": img}


BASE: dict[str, float] = {}


def baseline(w: dict[str, Path]) -> None:
    kb, img = w["kb"], w["img"]
    for name, argv in (
        ("verify", ["kb", "verify", str(kb)]),
        ("info", ["kb", "info", str(kb)]),
        ("list", ["kb", "list", str(kb)]),
        ("predict", ["predict", "--kb", str(kb), str(img), "-q"]),
        ("gc", ["kb", "gc", str(kb)]),
        ("learn", ["kb", "info", str(kb)]),
    ):
        rc, s, mb, out = run(argv)
        assert rc == 0, out
        BASE[name] = mb
        print(f"baseline {name}: {s:.1f} s, {mb:.0f} MB", flush=True)


# ------------------------------------------------------------------------------------------------ KB cases
def kb_case(
    w: dict[str, Path],
    work: Path,
    name: str,
    make: Callable[[Path], None],
    expect: dict[str, tuple[int, ...]],
    check: Callable[[str, str], str] | None = None,
) -> None:
    """Copy the KB, apply ``make``, run each command of ``expect`` (verify, info, list, predict, gc, undo)
    with the exit codes allowed."""
    kb = work / "cases" / name.replace(" ", "_").replace("/", "_")[:60]
    if kb.exists():
        shutil.rmtree(kb)
    shutil.copytree(w["kb"], kb, symlinks=True)
    make(kb)
    for command, allowed in expect.items():
        before = tree(kb)
        argv = {
            "verify": ["kb", "verify", str(kb)],
            "info": ["kb", "info", str(kb)],
            "list": ["kb", "list", str(kb)],
            "predict": ["predict", "--kb", str(kb), str(w["img"]), "-q"],
            "gc": ["kb", "gc", str(kb)],
            "undo": ["kb", "undo", str(kb)],
        }[command]
        rc, s, mb, out = run(argv)
        intact = tree(kb) == before
        base = BASE.get(command, BASE["info"])
        note = " ".join(out.strip().splitlines()[-1:])[:150] if out.strip() else ""
        if check is not None:
            note = check(command, out) or note
        bad = "internal error" in out or "Traceback" in out
        ok = (
            rc in allowed
            and not bad
            and s < LIMIT_S
            and mb <= base + MEMORY_MARGIN_MB
            and (intact or command in ("gc", "undo"))
        )
        RESULTS.append(Result(name, command, rc, s, mb, base, intact, ok, note))
        print(
            f"{'PASS' if ok else 'FAIL'} {name} / {command}: exit {rc}, {s:.1f} s, {mb:.0f} MB ({note})",
            flush=True,
        )


def _link(target: Path | str, name: str = "manifest.json") -> Callable[[Path], None]:
    def make(kb: Path) -> None:
        (kb / name).unlink()
        (kb / name).symlink_to(target)

    return make


def _fifo(name: str) -> Callable[[Path], None]:
    def make(kb: Path) -> None:
        path = kb / name
        path.unlink()
        os.mkfifo(path)

    return make


def _edit(
    fn: Callable[[dict[str, Any]], Any], recompute: bool = True, drop_prev: bool = True
) -> Callable[[Path], None]:
    def make(kb: Path) -> None:
        m = manifest(kb)
        fn(m)
        if drop_prev:
            (kb / "manifest.prev.json").unlink(missing_ok=True)
        write_manifest(kb, m, recompute=recompute)

    return make


def _text(fn: Callable[[str], str]) -> Callable[[Path], None]:
    def make(kb: Path) -> None:
        (kb / "manifest.json").write_text(fn((kb / "manifest.json").read_text()))

    return make


def _sparse_object(drop_sizes: bool) -> Callable[[Path], None]:
    def make(kb: Path) -> None:
        m = manifest(kb)
        obj = kb / m["tasks"][0]["object"]
        obj.unlink()
        with obj.open("wb") as f:
            f.truncate(3 << 30)
        if drop_sizes:
            for key in ("object_bytes", "kb_id", "sequence"):
                m.pop(key, None)
            m["format_version"] = 2
            (kb / "manifest.prev.json").unlink(missing_ok=True)
            write_manifest(kb, m)

    return make


def _symlinked_objects(kb: Path) -> None:
    outside = kb.parent / (kb.name + "-objects-outside")
    if outside.exists():
        shutil.rmtree(outside)
    shutil.move(kb / "objects", outside)
    (kb / "objects").symlink_to(outside)


def _downgrade(m: dict[str, Any]) -> None:
    m["tasks"][0]["class_names"][0] = "edited"
    m["format_version"] = 1
    m.pop("checksum", None)


def _many_classes(m: dict[str, Any]) -> None:
    n = 1_000_000
    m["tasks"][1]["classes"] = list(range(2, n + 2))
    m["tasks"][1]["class_names"] = [f"c{i}" for i in range(n)]


def _big_unknown(mb: int) -> Callable[[dict[str, Any]], None]:
    def fn(m: dict[str, Any]) -> None:
        m["unknown_field"] = "x" * (mb << 20)

    return fn


def _escaped(command: str, out: str) -> str:
    if "\x1b" in out or "\u202e" in out:
        return "RAW control characters printed"
    return "control characters escaped"


def _no_gc_advice(command: str, out: str) -> str:
    return "advises kb gc for files outside the KB" if command == "verify" and "gc" in out else ""


def kb_cases(w: dict[str, Path], work: Path) -> None:
    outside = work / "outside-manifest.json"
    shutil.copy(w["kb"] / "manifest.json", outside)
    refuse = {"verify": (1,), "info": (2,), "predict": (2,)}
    kb_case(w, work, "manifest.json -> /etc/passwd", _link("/etc/passwd"), refuse)
    kb_case(w, work, "manifest.json -> a valid manifest outside", _link(outside), refuse)
    kb_case(w, work, "manifest.json -> /dev/zero", _link("/dev/zero"), refuse)
    kb_case(w, work, "manifest.json a FIFO", _fifo("manifest.json"), refuse)
    kb_case(
        w,
        work,
        "manifest.prev.json a FIFO",
        _fifo("manifest.prev.json"),
        {"verify": (1,), "info": (0,), "predict": (0,), "gc": (0,), "undo": (2,)},
    )
    kb_case(
        w,
        work,
        "manifest.prev.json -> /dev/zero",
        _link("/dev/zero", "manifest.prev.json"),
        {"verify": (1,), "info": (0,), "predict": (0,), "gc": (0,)},
    )
    kb_case(w, work, "object a FIFO", lambda kb: _fifo(manifest(kb)["tasks"][0]["object"])(kb), refuse)
    kb_case(w, work, "object sparse 3 GB (size recorded)", _sparse_object(False), refuse)
    kb_case(w, work, "object sparse 3 GB (format 2: no size)", _sparse_object(True), refuse)
    kb_case(w, work, "objects/ a symlink out", _symlinked_objects, {**refuse, "gc": (2,)}, _no_gc_advice)
    kb_case(w, work, "JSON nested 200k deep", _text(lambda t: "[" * 200_000 + "]" * 200_000), refuse)
    kb_case(
        w,
        work,
        "5,000-digit integer",
        _text(lambda t: t.replace('"tasks":', '"n": ' + "9" * 5000 + ', "tasks":', 1)),
        refuse,
    )
    kb_case(w, work, "duplicate top-level keys", _text(lambda t: '{"tasks": [], ' + t[1:]), refuse)
    kb_case(
        w,
        work,
        "ANSI, RTL, newline in class names",
        _edit(
            lambda m: m["tasks"][0].update(
                class_names=["\x1b[31mred\x1b[0m", "\u202eevil\u202c\n  task 9: fake"]
            )
        ),
        {"verify": (0,), "list": (0,), "info": (0,), "predict": (0,)},
        _escaped,
    )
    kb_case(
        w,
        work,
        "lone surrogate in a class name",
        _text(lambda t: t.replace('"class_names": ["', '"class_names": ["\\ud800', 1)),
        refuse,
    )
    kb_case(
        w,
        work,
        "format_version 1, no checksum, class edited",
        _edit(_downgrade, recompute=False, drop_prev=False),
        refuse,
    )
    kb_case(
        w,
        work,
        "format_version 1, no checksum, v3 keys dropped",
        _edit(
            lambda m: (_downgrade(m), [m.pop(k) for k in ("sequence", "kb_id", "object_bytes")]),
            recompute=False,
            drop_prev=False,
        ),
        refuse,
    )
    kb_case(
        w,
        work,
        "50 MB manifest (unknown field)",
        _edit(_big_unknown(50)),
        {"verify": (0,), "info": (0,), "predict": (0,)},
    )
    kb_case(w, work, "70 MB manifest (over kb_manifest_bytes)", _edit(_big_unknown(70)), refuse)
    kb_case(
        w,
        work,
        "1 M classes in one task",
        _edit(_many_classes),
        {"verify": (1,), "info": (0, 2), "predict": (2,)},
    )
    # values inside config and records: the other half of the issue (what verify accepts, every command loads)
    kb_case(
        w,
        work,
        "class ids 2^52",
        _edit(lambda m: m["tasks"][0].update(classes=[2**52, 2**52 + 1])),
        {"verify": (0, 1), "predict": (2,)},
        lambda c, o: "other engineer's part",
    )
    kb_case(
        w,
        work,
        "config.backbone: true",
        _edit(lambda m: m["config"].update(backbone=True)),
        {"verify": (0, 1), "info": (0, 2), "list": (0, 2), "predict": (2,)},
    )


def signature_cases(w: dict[str, Path], work: Path) -> None:
    key = work / "kb.key"
    key.write_text("0123456789abcdef" * 4 + "\n")
    for record in work.glob("kb.key.sequences"):
        record.unlink()
    signed = work / "cases" / "signed"
    if signed.exists():
        shutil.rmtree(signed)
    shutil.copytree(w["kb"], signed)
    rc, s, mb, out = run(["kb", "sign", str(signed), "--key-file", str(key)])
    assert rc == 0, out
    rc, s, mb, out = run(["kb", "verify", str(signed), "--key-file", str(key)])
    RESULTS.append(
        Result(
            "H0 signed, verified with the key",
            "verify",
            rc,
            s,
            mb,
            BASE["verify"],
            True,
            rc == 0,
            out.strip().splitlines()[-1][:150],
        )
    )

    def rolled_back(kb: Path) -> None:
        shutil.copy(kb / "manifest.prev.json", kb / "manifest.json")

    def duplicated(kb: Path) -> None:
        text = (kb / "manifest.json").read_text()
        (kb / "manifest.json").write_text('{"tasks": [], "backbone": {"name": "NOT-mobilenet"}, ' + text[1:])

    for name, make in (
        ("H5 rollback: prev copied over current", rolled_back),
        ("H6 duplicate keys in front", duplicated),
    ):
        kb = work / "cases" / name[:2]
        if kb.exists():
            shutil.rmtree(kb)
        shutil.copytree(signed, kb)
        make(kb)
        before = tree(kb)
        rc, s, mb, out = run(["kb", "verify", str(kb), "--key-file", str(key)])
        ok = rc == 1 and s < LIMIT_S and tree(kb) == before
        RESULTS.append(
            Result(
                name,
                "verify --key-file",
                rc,
                s,
                mb,
                BASE["verify"],
                tree(kb) == before,
                ok,
                out.strip().splitlines()[0][:150],
            )
        )
    fifo = work / "key.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    rc, s, mb, out = run(["kb", "verify", str(signed), "--key-file", str(fifo)])
    RESULTS.append(
        Result(
            "H8 FIFO key file",
            "verify --key-file",
            rc,
            s,
            mb,
            BASE["verify"],
            True,
            rc == 2 and s < LIMIT_S,
            out.strip()[:150],
        )
    )


def cli_cases(w: dict[str, Path], work: Path) -> None:
    kb = work / "cases" / "learn-kb"
    learn = [
        "learn",
        "--kb",
        str(kb),
        "--benchmark",
        "folder",
        "--data",
        str(w["data"]),
        "--task",
        "1",
        *TINY,
    ]
    laughs = work / "laughs.yaml"
    lines = ["meta:", '  a0: &a0 ["c","c","c","c","c","c","c","c","c","c"]']
    lines += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    laughs.write_text("\n".join([*lines, "tasks: [[a, b]]"]) + "\n")
    many = work / "many.yaml"
    many.write_text("tasks:\n- [" + ", ".join(f"c{i}" for i in range(1_000_000)) + "]\n")
    fifo = work / "image.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    for name, argv in (
        (
            "--set train.epochs= 5,000 digits",
            [*learn, "--tasks", str(w["spec"]), "--set", "train.epochs=" + "9" * 5000],
        ),
        (
            "--set train.epochs= 50k x [",
            [*learn, "--tasks", str(w["spec"]), "--set", "train.epochs=" + "[" * 50_000],
        ),
        ("tasks.yaml billion laughs", [*learn, "--tasks", str(laughs)]),
        ("tasks.yaml with 1 M classes", [*learn, "--tasks", str(many)]),
        ("a FIFO as an image", ["predict", "--kb", str(w["kb"]), str(fifo), "-q"]),
        ("/dev/zero as an image", ["predict", "--kb", str(w["kb"]), "/dev/zero", "-q"]),
    ):
        rc, s, mb, out = run(argv)
        ok = rc == 2 and s < LIMIT_S and "internal error" not in out and not (kb / "manifest.json").exists()
        note = out.strip().splitlines()[-1][:150] if out.strip() else ""
        RESULTS.append(
            Result(name, argv[0], rc, s, mb, BASE["learn"], not (kb / "manifest.json").exists(), ok, note)
        )
        print(f"{'PASS' if ok else 'FAIL'} {name}: exit {rc}, {s:.1f} s, {mb:.0f} MB ({note})", flush=True)


# ------------------------------------------------------------------------------------------------ serve
def _request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as e:
        return 0, str(e).encode()
    finally:
        conn.close()


def _multipart(files: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = "proteusrepro"
    out = []
    for name, data in files:
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
        out += [(head + "Content-Type: image/png\r\n\r\n").encode(), data, b"\r\n"]
    return b"".join([*out, f"--{boundary}--\r\n".encode()]), f"multipart/form-data; boundary={boundary}"


def _post_raw(port: int, path: str, body: bytes, ctype: str, timeout: float = 60) -> tuple[int, bytes]:
    """POST ``body`` in 64 KB pieces and read the answer as soon as the server sends one (as curl does): a
    server that refuses mid-body answers before the client has sent everything."""
    import select

    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        data, sent = head + body, 0
        while sent < len(data):
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sent += sock.send(data[sent : sent + 65536])
            except OSError:
                break
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer:
                    head_end = answer.index(b"\r\n\r\n") + 4
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in answer[:head_end].split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    if len(answer) >= head_end + length:
                        break
        except OSError as e:
            if not answer:
                return 0, str(e).encode()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return status, answer.split(b"\r\n\r\n", 1)[-1]


def _vm(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return 0.0


def serve_cases(w: dict[str, Path], work: Path) -> None:
    kb = work / "cases" / "served"
    if kb.exists():
        shutil.rmtree(kb)
    shutil.copytree(w["kb"], kb)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proteus",
            "serve",
            "--kb",
            str(kb),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--read-timeout",
            "5",
            "--request-timeout",
            "120",
            "--poll",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    try:
        assert proc.stdout is not None and "serving" in proc.stdout.readline().decode()
        png = w["img"].read_bytes()
        assert _request(port, "POST", "/predict", png)[0] == 200
        base = _vm(proc.pid, "VmHWM")

        def after() -> str:
            health = _request(port, "GET", "/health")[0]
            predict = _request(port, "POST", "/predict", png)[0]
            return f"health {health}, predict {predict}"

        def case(name: str, fn: Callable[[], tuple[int, str]], allowed: tuple[int, ...]) -> None:
            t0 = time.monotonic()
            status, note = fn()
            s = time.monotonic() - t0
            peak = _vm(proc.pid, "VmHWM")
            still = after()
            ok = (
                status in allowed
                and s < LIMIT_S
                and still == "health 200, predict 200"
                and peak <= base + MEMORY_MARGIN_MB
            )
            RESULTS.append(
                Result(name, "serve", status, s, peak, base, True, ok, f"{note[:100]}; then {still}")
            )
            print(
                f"{'PASS' if ok else 'FAIL'} serve {name}: {status}, {s:.1f} s, peak {peak:.0f} MB "
                f"({note[:100]}; {still})",
                flush=True,
            )

        def post(path: str, body: bytes, ctype: str) -> tuple[int, str]:
            status, data = _post_raw(port, path, body, ctype)
            try:
                return status, json.loads(data).get("error", "") or "ok"
            except ValueError:
                return status, data[:100].decode(errors="replace")

        big = big_png(7999)
        case(
            "12 x 7999^2 PNGs (one body)",
            lambda: post("/predict/batch", *_multipart([(f"i{i}.png", big) for i in range(12)])),
            (413,),
        )
        case(
            "1,024 x 7999^2 PNGs (one 64 MB body)",
            lambda: post("/predict/batch", *_multipart([(f"i{i}.png", big) for i in range(1000)])),
            (413,),
        )
        case("20000 x 20000 PNG", lambda: post("/predict", big_png(20000), "image/png"), (400, 413))
        parts = b"--b\r\n\r\nx\r\n" * 100_000 + b"--b--\r\n"
        case(
            "100 k empty multipart parts (1 MB)",
            lambda: post("/predict/batch", parts, "multipart/form-data; boundary=b"),
            (413,),
        )
        parts6 = b"--b\r\n\r\nx\r\n" * 400_000 + b"--b--\r\n"
        case(
            "400 k empty multipart parts (6 MB)",
            lambda: post("/predict/batch", parts6, "multipart/form-data; boundary=b"),
            (413,),
        )
        case(
            "JSON nested 100 k deep",
            lambda: post("/predict/batch", b"[" * 100_000 + b"]" * 100_000, "application/json"),
            (400, 413),
        )
        case(
            "JSON 5,000-digit integer",
            lambda: post("/predict/batch", b'{"images": ' + b"9" * 5000 + b"}", "application/json"),
            (400, 413),
        )

        def fifo_manifest() -> tuple[int, str]:
            manifest_path = kb / "manifest.json"
            good = manifest_path.read_bytes()
            manifest_path.unlink()
            os.mkfifo(manifest_path)
            time.sleep(1.0)
            with ThreadPoolExecutor(42) as pool:
                codes = list(pool.map(lambda _: _request(port, "GET", "/tasks", timeout=3)[0], range(42)))
            predict = _request(port, "POST", "/predict", png, timeout=15)[0]
            health = json.loads(_request(port, "GET", "/health")[1])
            manifest_path.unlink()
            tmp = kb / "m.tmp"
            tmp.write_bytes(good)
            tmp.replace(manifest_path)
            time.sleep(1.5)
            again = json.loads(_request(port, "GET", "/health")[1])
            note = (
                f"42 GET /tasks: {codes.count(200)} x 200; /predict {predict}; /health {health['status']}; "
                f"after restoring: {again['status']}"
            )
            ok = (
                codes.count(200) == 42
                and predict == 200
                and health["status"] == "stale"
                and again["status"] == "ok"
            )
            return (200 if ok else 500), note

        case("manifest.json a FIFO under serve", fifo_manifest, (200,))
    finally:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        s = time.monotonic() - t0
        RESULTS.append(Result("SIGTERM to serve", "serve", rc, s, 0, None, True, rc == 143 and s < LIMIT_S))
        print(f"serve SIGTERM: exit {rc} after {s:.1f} s", flush=True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, s, mb, out = run(
            ["serve", "--kb", str(w["kb"]), "--port", str(busy.getsockname()[1])], timeout=60
        )
    RESULTS.append(
        Result(
            "serve on a busy port",
            "serve",
            rc,
            s,
            mb,
            None,
            True,
            rc == 2 and "in use" in out,
            out.strip().splitlines()[-1][:150],
        )
    )


# ------------------------------------------------------------------------------------------------ main
def table() -> str:
    rows = [
        "| case | command | exit | s | peak MB (normal) | KB intact | verdict | what it said |",
        "| --- " * 8 + "|",
    ]
    for r in RESULTS:
        base = f" ({r.base_mb:.0f})" if r.base_mb is not None else ""
        rows.append(
            f"| {r.case} | {r.command} | {r.rc} | {r.seconds:.1f} | {r.peak_mb:.0f}{base} | "
            f"{'yes' if r.intact else 'NO' if r.intact is False else 'n/a'} | {'PASS' if r.ok else 'FAIL'} | "
            f"{r.note.replace('|', '/')} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--work", default="runs/reliability-repro", help="folder for the KB and the hostile copies"
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=["kb", "signature", "cli", "serve"],
        help="run only this group of cases (repeat for several)",
    )
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    w = build(work)
    baseline(w)
    for group, fn in (
        ("kb", kb_cases),
        ("signature", signature_cases),
        ("cli", cli_cases),
        ("serve", serve_cases),
    ):
        if not args.only or group in args.only:
            fn(w, work)
    print()
    print(table())
    passed = sum(r.ok for r in RESULTS)
    print(f"\n{passed} of {len(RESULTS)} passed")
    (work / "repro.json").write_text(json.dumps([r.__dict__ for r in RESULTS], indent=1))


if __name__ == "__main__":
    main()
