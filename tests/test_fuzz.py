"""Generated bad input: manifests (their values, their text, the kind of each file), ``--set`` options,
tasks files, HTTP requests and images (formats, modes, bit depths and shapes at the pixel budget, each
decoded in a child process whose memory is held to the budget's bytes).

Every generated input must end in success or in one of proteus's own errors (exit code 2 with one
``error:`` line from the CLI, a 4xx JSON answer from the server) -- never a traceback, an "internal
error", a hang or a 5xx -- and a command that refuses must leave the knowledge base byte-identical.

The suite (``make test``) runs each target on the inputs the adversarial review found by hand
(``@example``: ``config.backbone = true``, JSON nested 200,000 deep, a 5,000-digit integer, duplicate keys,
a lone surrogate, class names with terminal controls, a manifest that is a FIFO, a link to ``/dev/zero``,
a sparse 3 GB object ...) and :data:`CI_EXAMPLES` more drawn at random (the ``ci`` profile, the default).
The fuzz run is the same tests under the ``fuzz`` profile, ``FUZZ_EXAMPLES`` inputs per target (2,000 by
default: 12,000 inputs over the six targets with more inputs than that, and the 48 of the special files)::

    HYPOTHESIS_PROFILE=fuzz python -m pytest tests/test_fuzz.py --hypothesis-show-statistics
"""

from __future__ import annotations

import copy
import hashlib
import http.client
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import proteus.core  # noqa: E402, F401 - before presets (an import cycle when presets comes first)
from kbfiles import read_manifest, write_manifest  # noqa: E402
from proteus.budgets import IMAGE_BYTES_PER_PIXEL  # noqa: E402
from proteus.cli import main  # noqa: E402
from proteus.config import (  # noqa: E402
    RunConfig,
    flatten,
    resolve_config,  # noqa: E402
)
from proteus.errors import ProteusError  # noqa: E402
from tiny import write_image  # noqa: E402

#: random inputs per target in the suite, besides the @example cases (fewer for the two targets whose every
#: input takes seconds: the knowledge-base objects, the concurrent requests)
CI_EXAMPLES, CI_OBJECT_EXAMPLES, CI_REQUEST_EXAMPLES = 20, 4, 2
_SLOW = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=_SLOW, derandomize=True
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 2000)),
    deadline=None,
    suppress_health_check=_SLOW,
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def _examples(ci: int) -> int:
    """A target's random inputs: ``ci`` in the suite (a target whose every input takes seconds), the
    profile's count otherwise."""
    return ci if PROFILE == "ci" else settings().max_examples


pytestmark = pytest.mark.slow

#: values a hostile or careless hand writes
JSONISH = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
        st.text(max_size=12),
        st.sampled_from(["../../../../etc/passwd", "/etc/passwd", "objects/x", "0" * 64]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)  # fmt: skip


def _files(root: Path) -> dict[str, str]:
    """Regular files by sha256 (by size and time stamp above 64 MB: a sparse 3 GB file), anything else by
    its kind; links are not followed."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name == ".lock":
            continue
        if p.is_symlink() or not p.is_file():
            out[str(p.relative_to(root))] = "link" if p.is_symlink() else "dir" if p.is_dir() else "special"
            continue
        st = p.stat()
        if st.st_size > 64 << 20:
            out[str(p.relative_to(root))] = f"{st.st_size} bytes, {st.st_mtime_ns}"
            continue
        h = hashlib.sha256()
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        out[str(p.relative_to(root))] = h.hexdigest()
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, err


def _no_traceback(rc: int, err: str, allowed: tuple[int, ...]) -> None:
    assert "internal error" not in err and "Traceback" not in err, err
    assert rc in allowed, (rc, err)
    if rc == 2:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert lines and lines[0].startswith("error:"), err


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A hang fails the test (120 s for a whole target's examples is not a bound; each command is)."""

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError("no answer within 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _bounded(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    signal.alarm(60)
    try:
        return _run(argv, capsys)
    finally:
        signal.alarm(0)


# ------------------------------------------------------------------ manifests
def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set_path(obj: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    elif delete and isinstance(parent, list):
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return obj


@pytest.fixture(scope="module")
def fuzz_kb(world: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzzkb")
    kb = root / "kb"
    shutil.copytree(world["kb1"], kb)
    img = root / "x.png"
    write_image(img, 3)
    manifest = read_manifest(kb)  # format 4: with its records, which write_manifest packs into segments
    text = (kb / "manifest.json").read_text()
    return {"kb": kb, "img": img, "manifest": manifest, "paths": _paths(manifest), "text": text}


def _commands(kb: Path, img: Path) -> list[tuple[list[str], tuple[int, ...]]]:
    return [
        (["kb", "verify", str(kb)], (0, 1, 2)),
        (["kb", "info", str(kb)], (0, 2)),
        (["kb", "list", str(kb), "--json"], (0, 2)),
        (["predict", "--kb", str(kb), str(img), "--json", "-q"], (0, 2)),
    ]


def _check_commands(fuzz_kb: dict, capsys: pytest.CaptureFixture[str]) -> None:
    kb = fuzz_kb["kb"]
    before = _files(kb)
    for argv, allowed in _commands(kb, fuzz_kb["img"]):
        rc, err = _bounded(argv, capsys)
        _no_traceback(rc, err, allowed)
        assert _files(kb) == before, f"{argv[:2]} changed the knowledge base"


#: one edit of the manifest: (path into it, new value, delete instead, checksum recomputed, valid JSON)
EDIT = st.tuples(st.integers(0, 10**6), JSONISH, st.booleans(), st.booleans(), st.booleans())


@given(EDIT)
@example((("config", "backbone"), True, False, True, True))  # found by the fuzz profile of the review
@example((("config", "backbone"), {"name": None}, False, True, True))
@example(
    (
        ("tasks", 0, "class_names"),
        ["\x1b[31mred\x1b[0m", "\u202eevil\u202c\n  task 9: fake"],
        False,
        True,
        True,
    )
)
@example((("format_version",), 1, False, False, True))
@example((("checksum",), None, True, False, True))
@example((("tasks", 0, "object"), [None], False, True, True))  # found by the fuzz profile (the tests' writer)
def test_generated_manifests_never_end_in_a_traceback(fuzz_kb: dict, capsys, edit: tuple) -> None:
    kb, good = fuzz_kb["kb"], fuzz_kb["manifest"]
    where, value, delete, hostile, valid = edit
    path = where if isinstance(where, tuple) else fuzz_kb["paths"][where % len(fuzz_kb["paths"])]
    delete = delete and bool(path)
    bad = _set_path(copy.deepcopy(good), path, value, delete)
    if isinstance(bad, dict):  # format 4: its records into new record segments, as an editor can
        write_manifest(kb, bad, checksum=hostile)
    else:
        (kb / "manifest.json").write_text(json.dumps(bad))
    if not valid:
        (kb / "manifest.json").write_text((kb / "manifest.json").read_text()[:-3])
    try:
        _check_commands(fuzz_kb, capsys)
    finally:
        (kb / "manifest.json").write_text(fuzz_kb["text"])


#: text edits of a manifest that no JSON value can express: nesting, integer size, duplicate keys, escapes
TEXT_EDITS = {
    "nest": lambda t, n: "[" * n + "]" * n,
    "nest-inside": lambda t, n: t.replace('"segments":', '"x": ' + "[" * n + "]" * n + ', "segments":', 1),
    "digits": lambda t, n: t.replace('"segments":', '"n": ' + "9" * n + ', "segments":', 1),
    "duplicate": lambda t, n: '{"segments": [], ' + t[1:],
    "surrogate": lambda t, n: t.replace('"kb_id": "', '"kb_id": "\\ud800', 1),
    "truncate": lambda t, n: t[: n % max(len(t), 1)],
    "bom": lambda t, n: "\ufeff" + t,
}


@given(st.sampled_from(sorted(TEXT_EDITS)), st.integers(0, 300_000))
@example("nest", 200_000)
@example("digits", 5000)
@example("duplicate", 0)
@example("surrogate", 0)
def test_generated_manifest_texts_never_end_in_a_traceback(fuzz_kb: dict, capsys, edit: str, n: int) -> None:
    kb, good = fuzz_kb["kb"], fuzz_kb["text"]
    (kb / "manifest.json").write_text(TEXT_EDITS[edit](good, n))
    try:
        _check_commands(fuzz_kb, capsys)
    finally:
        (kb / "manifest.json").write_text(good)


#: what a file of the knowledge base may be replaced by
KINDS = ("fifo", "dev-zero", "outside-copy", "directory", "empty", "sparse-3g", "half", "etc-passwd")
FILES = ("manifest.json", "manifest.prev.json", "object", "head", "segment", ".lock", "objects")


@given(st.sampled_from(FILES), st.sampled_from(KINDS))
@example("manifest.json", "fifo")
@example("manifest.json", "dev-zero")
@example("manifest.json", "outside-copy")
@example("manifest.prev.json", "fifo")
@example("manifest.prev.json", "dev-zero")
@example("object", "sparse-3g")
def test_special_files_never_hang_or_end_in_a_traceback(
    fuzz_kb: dict, capsys, tmp_path_factory: pytest.TempPathFactory, name: str, kind: str
) -> None:
    good = fuzz_kb["kb"]
    kb = tmp_path_factory.mktemp("special") / "kb"
    shutil.copytree(good, kb)
    m = fuzz_kb["manifest"]
    named = {
        "object": m["tasks"][0]["object"],
        "head": m["head"]["object"],
        "segment": m["segments"][0]["object"],
    }
    rel = named.get(name, name)
    target = kb / rel
    if name == "manifest.prev.json" and not target.exists():
        target.write_bytes((kb / "manifest.json").read_bytes())
    outside = kb.parent / "outside"
    if target.is_dir():
        shutil.move(target, outside)
    else:
        shutil.copy(target, outside)
        target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind in ("dev-zero", "etc-passwd", "outside-copy"):
        target.symlink_to({"dev-zero": "/dev/zero", "etc-passwd": "/etc/passwd"}.get(kind, str(outside)))
    elif kind == "directory":
        target.mkdir()
    elif kind == "sparse-3g":
        with target.open("wb") as f:
            f.truncate(3 << 30)
    else:
        data = b"" if kind == "empty" or outside.is_dir() else outside.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    before = _files(kb)
    for argv, allowed in [*_commands(kb, fuzz_kb["img"]), (["kb", "gc", str(kb)], (0, 2))]:
        rc, err = _bounded(argv, capsys)
        _no_traceback(rc, err, allowed)
        if argv[1] != "gc":
            assert _files(kb) == before, f"{argv[:2]} changed the knowledge base"
    shutil.rmtree(kb.parent)


# ------------------------------------------------------------------ --set options
KEYS = sorted(flatten(RunConfig().to_dict()))
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(["train", "train.epoch", "", ".", "a.b.c", "seed.x"]))
VALUE = st.one_of(
    st.integers(-(2**40), 2**40).map(str), st.floats(allow_nan=True).map(repr), st.text(max_size=10),
    st.sampled_from(["1e-3", "2.5", "-1", "0", "true", "null", "~", "[1, 2]", "{a: 1}", "inf", "nan",
                     "!!python/object/apply:os.system ['true']", "!!binary aGVsbG8=", "'", "[", "&a x",
                     "*a"]),
)  # fmt: skip


@given(st.lists(st.tuples(KEY, VALUE), max_size=4), st.sampled_from(["proteus", "ranpac", "inflora", "ncm"]))
def test_generated_options_resolve_or_say_which_key(items: list[tuple[str, str]], method: str) -> None:
    sets = [f"{k}={v}" for k, v in items]
    try:
        cfg = resolve_config(method=method, sets=sets)
    except ProteusError as e:
        assert str(e) and "\n" not in str(e).strip().splitlines()[0]
        return
    ints = {
        k for k, v in flatten(RunConfig().to_dict()).items() if isinstance(v, int) and not isinstance(v, bool)
    }
    for key, value in flatten(cfg.to_dict()).items():
        if key in ints and value is not None:
            assert isinstance(value, int) and not isinstance(value, bool), (key, value)


# ------------------------------------------------------------------ tasks files
CLASS = st.one_of(
    st.sampled_from(["a", "b", "c", "d", "../../etc", "", "unicorn", "a/b"]), st.text(max_size=6)
)
SPEC = st.one_of(
    st.lists(st.lists(CLASS, max_size=4), max_size=5),
    st.dictionaries(st.text(max_size=5), st.lists(CLASS, max_size=3), max_size=3),
    JSONISH,
)


@given(SPEC)
def test_generated_tasks_files_build_or_say_why(world: dict, tmp_path_factory, spec: Any) -> None:
    path = tmp_path_factory.mktemp("spec") / "tasks.yaml"
    import yaml

    path.write_text(yaml.safe_dump(spec))
    from proteus.streams import build_benchmark

    try:
        cfg = resolve_config(
            "folder", dotted={"benchmark.data": str(world["tree"]), "benchmark.tasks_file": str(path)}
        )
        build_benchmark(cfg.benchmark)
    except ProteusError as e:
        assert str(e)


# ------------------------------------------------------------------ HTTP requests
@pytest.fixture(scope="module")
def fuzz_server(world: dict, tmp_path_factory: pytest.TempPathFactory):
    from proteus.serve import KBServer

    kb = tmp_path_factory.mktemp("fuzzserve") / "kb"
    shutil.copytree(world["kb1"], kb)
    srv = KBServer(("127.0.0.1", 0), kb, device="cpu", poll_seconds=60)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, kb, None
    srv.shutdown()
    srv.server_close()


METHOD = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
PATH = st.one_of(
    st.sampled_from(["/predict", "/tasks", "/health", "/", "/predict?top_k=abc", "/predict?top_k=-5",
                     "/predict?top_k=2", "/../../etc/passwd", "/predict/../manifest.json", "/%00"]),
    st.text(alphabet="abc/?=&%.", max_size=12).map(lambda s: "/" + s),
)  # fmt: skip


def _png() -> bytes:
    import numpy as np
    from PIL import Image

    out = __import__("io").BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (12, 12, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


PNG = _png()
BODY = st.one_of(
    st.binary(max_size=2048), st.just(b""), st.just(PNG), st.binary(max_size=64).map(lambda b: PNG + b)
)
CTYPE = st.sampled_from(
    ["application/octet-stream", "multipart/form-data", "multipart/form-data; boundary=xyz", "image/png",
     "text/plain", ""]
)  # fmt: skip


@given(METHOD, PATH, BODY, CTYPE)
def test_generated_http_requests_get_an_answer_not_a_crash(fuzz_server, method, path, body, ctype) -> None:
    srv, kb, _ = fuzz_server
    before = _files(kb)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    try:
        headers = {"Content-Type": ctype} if ctype else {}
        conn.request(method, path, body=body if method not in ("GET", "HEAD") else None, headers=headers)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    assert r.status < 500, (r.status, data[:200])
    if method != "HEAD" and r.status != 200:
        json.loads(data)  # every refusal is a JSON answer
    assert _files(kb) == before


# ------------------------------------------------------------------ images at the pixel budget
#: the pixel budget of the image target (small, so that each input decodes in well under a second: the rule
#: it checks is per pixel of the budget)
IMAGE_BUDGET = 6_000_000
#: what decoding one image within the pixel budget may cost, per pixel of the budget
#: (:data:`proteus.budgets.IMAGE_BYTES_PER_PIXEL`): its samples as decoded (at most 4 bytes per pixel: 32-bit
#: float or integer, RGBA, CMYK), the decoder's buffer of a strip of the file (as much again for a file of
#: one strip), a high-bit-depth image's 8-bit plane and its image (1 + 1) and the 8-bit RGB image (3)
BYTES_PER_BUDGET_PIXEL = IMAGE_BYTES_PER_PIXEL
#: besides, a fixed allowance: a high-bit-depth conversion's strips (proteus.images.STRIP_SAMPLES samples in
#: float64, a few of them at once) and the allocator's own rounding
FIXED_ALLOWANCE = 32 << 20
#: (format, mode) pairs PIL writes, with the suffix of the file
IMAGE_KINDS = [
    ("PNG", "1"), ("PNG", "L"), ("PNG", "P"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "LA"),
    ("PNG", "I;16"), ("TIFF", "F"), ("TIFF", "I"), ("TIFF", "I;16"), ("TIFF", "CMYK"),
    ("TIFF", "RGB"), ("GIF", "P"), ("BMP", "RGB"), ("JPEG", "L"), ("JPEG", "RGB"), ("JPEG", "CMYK"),
    ("WEBP", "RGB"), ("WEBP", "RGBA"),
]  # fmt: skip
_SUFFIX = {"PNG": ".png", "TIFF": ".tif", "GIF": ".gif", "BMP": ".bmp", "JPEG": ".jpg", "WEBP": ".webp"}


#: what the measuring processes below start with: ``status(KEY)``, a /proc/self/status figure in bytes (their
#: resident memory, ``VmRSS:``, and its peak since the last reset, ``VmHWM:``)
_PROC_STATUS = r"""
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
"""

#: a process that measures decodes sent as JSON lines (``[path, warm, budget]``) on its stdin: each in a
#: child forked from it, which decodes ``warm`` (a small file of the same kind, so that what the first use of
#: a format or a transform loads, PIL's plugin, is not counted), resets its peak (``/proc/self/clear_refs``),
#: then decodes the image as ``proteus predict`` does (:func:`proteus.images.open_image` within ``budget``
#: pixels, then the evaluation transform's resize and crop to 224 px, PIL's part: torch's thread pool is not
#: safe to use after a fork, and its part, a 224 px tensor, is the same for every image). It answers how the
#: decode ended (``ok``, the error's class, ``crash`` or ``hung``) and the child's peak resident memory beyond
#: what it held before it. The process itself only imports and forks, so every child starts from the same
#: heap: a child forked from a test worker would inherit whatever the worker's earlier tests left there (free
#: pages a decode reuses without growing, or a heap whose free pages were handed back).
_DECODE_WORKER = (
    _PROC_STATUS
    + r"""
import json, os, signal, sys, time
from proteus.backbones.base import DataConfig
from proteus.backbones.transforms import build_transform
from proteus.images import ImageError, open_image

resize = build_transform(DataConfig(input_size=224)).transforms[0]
for line in sys.stdin:
    path, warm, budget = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            resize(open_image(warm, budget))
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = status("VmRSS:")
            try:
                resize(open_image(path, budget))
                how = "ok"
            except ImageError as e:
                how = type(e).__name__
            os.write(write, json.dumps([how, status("VmHWM:") - base]).encode())
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            done = None
            break
        time.sleep(0.02)
    with os.fdopen(read) as f:
        answer = f.read()
    if done is None:
        answer = json.dumps(["hung", 0])
    elif os.waitstatus_to_exitcode(done[1]) != 0 or not answer:
        answer = json.dumps(["crash", os.waitstatus_to_exitcode(done[1])])
    print(answer, flush=True)
"""
)


@pytest.fixture(scope="module")
def decode_cost() -> Iterator[Any]:
    """Measure a decode in the process of :data:`_DECODE_WORKER`: ``decode_cost(path, warm, budget)`` returns
    how it ended and its cost in bytes; a crash or a hang fails the test."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _DECODE_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def run(path: Path, warm: Path, budget: int) -> tuple[str, int]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([str(path), str(warm), budget]) + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        assert answer, f"{path.name}: the decoding process ended (exit {proc.poll()})"
        how, cost = json.loads(answer)
        assert how != "hung", f"{path.name}: decoding did not end in 120 s"
        assert how != "crash", f"{path.name}: decoding ended in a crash (exit {cost})"
        return how, int(cost)

    yield run
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(timeout=60)


@given(
    st.sampled_from(IMAGE_KINDS),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["square", "wide", "tall", "thin", "line"]),
    st.floats(0.05, 1.0),
)
@example(("PNG", "L"), 0, "line", 1.0)  # the review's 8,000,000 x 8 PNG, at this budget
@example(("TIFF", "F"), 0, "square", 1.0)  # the review's 7999^2 float TIFF, at this budget
@example(("TIFF", "I"), 0, "square", 1.0)
@example(("TIFF", "F"), 0, "line", 1.0)  # one row longer than a conversion's tile
@example(("PNG", "I;16"), 0, "tall", 1.0)
def test_generated_images_decode_within_their_bytes(
    tmp_path_factory: pytest.TempPathFactory,
    decode_cost: Any,
    kind: tuple[str, str],
    seed: int,
    shape: str,
    fill: float,
) -> None:
    """Any format, mode, bit depth and aspect ratio within the pixel budget decodes (or is refused by name)
    within :data:`BYTES_PER_BUDGET_PIXEL` bytes per pixel of the budget, plus :data:`FIXED_ALLOWANCE`:
    no image within the budget costs gigabytes."""
    from PIL import Image

    fmt, mode = kind
    n = max(1, int(IMAGE_BUDGET * fill))
    short = {"square": int(n**0.5), "wide": int((n / 3) ** 0.5), "tall": int((n / 3) ** 0.5), "thin": 16,
             "line": 1}[shape]  # fmt: skip
    long = max(1, n // max(1, short))
    if fmt in ("WEBP", "JPEG", "GIF") and long > 16383:  # these formats cannot hold a longer side
        long = 16383
    w, h = (short, long) if shape == "tall" else (long, short)
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (min(h, 64), min(w, 64), 3), dtype=np.uint8))
    img = base.resize((w, h), Image.NEAREST).convert(mode if mode not in ("I;16",) else "I")
    if mode == "I;16":
        img = img.point(lambda v: v * 257).convert("I;16")
    folder = tmp_path_factory.mktemp("img")
    path, warm = folder / f"x{_SUFFIX[fmt]}", folder / f"warm{_SUFFIX[fmt]}"
    img.save(path, format=fmt)
    img.crop((0, 0, min(w, 300), min(h, 300))).save(warm, format=fmt)
    del img, base
    how, cost = decode_cost(path, warm, IMAGE_BUDGET)
    ceiling = BYTES_PER_BUDGET_PIXEL * IMAGE_BUDGET + FIXED_ALLOWANCE
    assert how in ("ok", "ImageError", "ImageTooLargeError"), how
    assert cost <= ceiling, (
        f"{fmt} {mode} {w} x {h}: decoding cost {cost / 2**20:.0f} MiB > {ceiling / 2**20:.0f}"
    )
    shutil.rmtree(folder)


# ------------------------------------------------------------------ KB objects at the byte budgets
#: the object target's byte budgets, scaled down (the rule it checks does not depend on their size: no
#: command holds an object it checks or opens, so its memory does not grow with the objects' bytes)
KB_OBJECT_BUDGET = 256 << 20
KB_TOTAL_BUDGET = KB_OBJECT_BUDGET + (KB_OBJECT_BUDGET >> 1)
#: what a command may hold above its process before the command (the objects are hashed as a stream and
#: memory-mapped; what is checked of them is read a block at a time)
KB_OBJECT_ALLOWANCE = 128 << 20
#: the resident memory no CLI command may pass, whatever it is given (the reliability review's ceiling)
CLI_CEILING = 1_600_000_000

#: a process that runs CLI commands sent as JSON lines on its stdin and answers each with its exit code, its
#: stderr and its peak resident memory above what it held before the command (``/proc/self/clear_refs``
#: resets the peak), and the peak itself: one process for every input (no import per command)
_CLI_WORKER = (
    _PROC_STATUS
    + r"""
import contextlib, io, json, sys
from proteus.cli import main

for line in sys.stdin:
    argv = json.loads(line)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, err = status("VmRSS:"), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    peak = status("VmHWM:")
    print(json.dumps([rc, err.getvalue()[-4000:], peak - before, peak]), flush=True)
"""
)


@pytest.fixture(scope="module")
def cli_worker(world: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Send a command (argv) to a CLI process of its own under the object target's budgets; returns (exit
    code, stderr, peak bytes above the process before the command, peak bytes). Each command was run once
    before on the untouched knowledge base, so that what a first use loads is not counted."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROTEUS_LIMIT_KB_OBJECT_BYTES": str(KB_OBJECT_BUDGET),
           "PROTEUS_LIMIT_KB_TOTAL_BYTES": str(KB_TOTAL_BUDGET)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip

    def run(argv: list[str]) -> tuple[int, str, int, int]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(argv) + "\n")
        proc.stdin.flush()
        signal.alarm(120)
        try:
            answer = proc.stdout.readline()
        finally:
            signal.alarm(0)
        assert answer, f"{argv[:2]}: the CLI process ended (exit {proc.poll()})"
        rc, err, rise, peak = json.loads(answer)
        return rc, err, rise, peak

    img = tmp_path_factory.mktemp("objimg") / "x.png"
    write_image(img, 3)
    run.img = img  # type: ignore[attr-defined]
    for argv, _ in _commands(world["kb1"], img):
        run(argv)
    yield run
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(timeout=60)


def _zeros_sha(size: int, _known: dict[int, str] = {}) -> str:  # noqa: B006 - a cache by design
    """The sha256 of ``size`` zero bytes (what a sparse file of that size reads as)."""
    if size not in _known:
        h, block = hashlib.sha256(), bytes(1 << 22)
        for _ in range(size // len(block)):
            h.update(block)
        h.update(bytes(size % len(block)))
        _known[size] = h.hexdigest()
    return _known[size]


def _object_at(
    kb: Path, ref: dict[str, Any], sizes: dict[str, Any], content: str, size: int, told: str
) -> None:
    """Replace the object ``ref`` names by one of ``size`` bytes: all zeros (a sparse file), or its own
    bytes then zeros, or a valid safetensors file whose one tensor fills it; the manifest told its true size
    and sha256, or only its size, or neither."""
    old = kb / ref["object"]
    own = old.read_bytes()
    name = f"objects/{old.name.split('-')[0]}-fuzz{size:x}.safetensors"
    path = kb / name
    with path.open("wb") as f:
        if content == "own-then-zeros":
            f.write(own[:size])
        elif content == "one-tensor":
            numel = max(0, size - 128)
            head = json.dumps({"x": {"dtype": "U8", "shape": [numel], "data_offsets": [0, numel]}}).encode()
            head += b" " * (-(len(head) + 8) % 8)
            f.write(len(head).to_bytes(8, "little") + head)
        f.truncate(max(size, f.tell()))
    true = path.stat().st_size
    h = hashlib.sha256()
    if content == "zeros":
        digest = _zeros_sha(true)
    else:  # (a few bytes, then a sparse tail)
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        digest = h.hexdigest()
    recorded = sizes.pop(ref["object"], None)
    ref["object"] = name
    sizes[name] = true if told != "neither" else recorded
    if "bytes" in ref:  # (the head's size is in its reference)
        ref["bytes"] = sizes[name]
    if told == "size and sha256":
        ref["sha256"] = digest


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["task", "head"]),
            st.sampled_from(["zeros", "own-then-zeros", "one-tensor"]),
            st.integers(1, KB_OBJECT_BUDGET + 8192),
            st.sampled_from(["size and sha256", "size", "neither"]),
        ),
        min_size=1,
        max_size=2,
        unique_by=lambda t: t[0],
    )
)
@example([("task", "zeros", KB_OBJECT_BUDGET - 4096, "size and sha256")])  # the review's 2 GiB - 4 KiB
@example([("task", "one-tensor", KB_OBJECT_BUDGET, "size and sha256"),
          ("head", "zeros", KB_OBJECT_BUDGET, "size and sha256")])  # together over the total  # fmt: skip
@example([("head", "own-then-zeros", KB_OBJECT_BUDGET + 4096, "size and sha256")])  # over the object budget
@settings(max_examples=_examples(CI_OBJECT_EXAMPLES))
def test_objects_at_the_byte_budgets_are_checked_without_being_held(
    cli_worker: Any, world: dict, tmp_path_factory: pytest.TempPathFactory, objects: list[tuple]
) -> None:
    """Task and head objects of up to the object budget (and beyond it), together up to the total budget
    (and beyond it): zeros (a sparse file), an object's own bytes then zeros, or a valid safetensors file of
    one tensor filling them, the manifest telling their true size and sha256 (as an attacker can), their size
    only, or neither. `kb verify`, `kb info`, `kb list` and `predict` end in success or one line, leave the
    knowledge base byte-identical and hold no object: their peak resident memory rises at most
    :data:`KB_OBJECT_ALLOWANCE` above what the process held before, and stays under :data:`CLI_CEILING`."""
    kb = tmp_path_factory.mktemp("objkb") / "kb"
    shutil.copytree(world["kb1"], kb)
    m = read_manifest(kb)
    sizes = m["object_bytes"]
    for which, content, size, told in objects:
        _object_at(kb, m["tasks"][0] if which == "task" else m["head"], sizes, content, size, told)
    write_manifest(kb, m)
    before = _files(kb)
    for argv, allowed in _commands(kb, cli_worker.img):
        rc, err, rise, peak = cli_worker(argv)
        _no_traceback(rc, err, allowed)
        assert rise <= KB_OBJECT_ALLOWANCE, f"{argv[:2]}: rose {rise >> 20} MiB for objects {objects}"
        assert peak <= CLI_CEILING, f"{argv[:2]}: {peak >> 20} MiB resident for objects {objects}"
        assert _files(kb) == before, f"{argv[:2]} changed the knowledge base"
    shutil.rmtree(kb.parent)


# ------------------------------------------------------------------ concurrent requests at serve's budgets
#: serve's budgets in the concurrent-request target, scaled down (its rule is per pixel and byte of them)
SERVE_LIMITS = {
    "PROTEUS_LIMIT_DECODING_PIXELS": 4_000_000, "PROTEUS_LIMIT_INPUT_BYTES": 16 << 20,
    "PROTEUS_LIMIT_BODY_BYTES": 8 << 20, "PROTEUS_LIMIT_REQUEST_BYTES": 4 << 20,
}  # fmt: skip
SERVE_REQUEST_PIXELS = 16_000_000
#: what the server may hold above what it held before the requests besides what its budgets declare (the
#: model's activations for a micro-batch, the answers, the allocator's rounding): as the burst test's
SERVE_ALLOWANCE = 160 << 20
#: (format, mode) pairs of the target's images, each file compressed as its format allows
SERVE_KINDS = [("PNG", "L"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"), ("TIFF", "F"), ("JPEG", "RGB"),
               ("GIF", "P"), ("WEBP", "RGB")]  # fmt: skip


def _declared_bytes() -> int:
    """What serve's budgets declare it may hold above idle for concurrent requests: the pixels decoded at
    once (each costs :data:`~proteus.budgets.IMAGE_BYTES_PER_PIXEL`), the model inputs held, the bodies."""
    lim = SERVE_LIMITS
    decoding = lim["PROTEUS_LIMIT_DECODING_PIXELS"] * BYTES_PER_BUDGET_PIXEL
    return decoding + lim["PROTEUS_LIMIT_INPUT_BYTES"] + lim["PROTEUS_LIMIT_BODY_BYTES"]


@pytest.fixture(scope="module")
def busy_server(world: dict) -> Iterator[tuple[int, str]]:
    """``proteus serve`` on the test knowledge base in a process of its own, under :data:`SERVE_LIMITS`."""
    from served import server

    with server(world["kb1"], "--max-request-pixels", str(SERVE_REQUEST_PIXELS), **SERVE_LIMITS) as (
        pid,
        url,
    ):
        yield pid, url


def _encoded(kind: tuple[str, str], pixels: int, shape: str, seed: int, _made: dict = {}) -> bytes:  # noqa: B006
    """An image file of ``kind`` with about ``pixels`` pixels (kept: the target draws the same ones often)."""
    import io

    from PIL import Image

    key = (kind, pixels, shape, seed)
    if key not in _made:
        fmt, mode = kind
        short = {"square": int(pixels**0.5), "wide": int((pixels / 4) ** 0.5), "line": 1}[shape]
        long = min(max(1, pixels // max(1, short)), 16383 if fmt in ("WEBP", "JPEG", "GIF") else 1 << 30)
        rng = np.random.default_rng(seed)
        base = Image.fromarray(rng.integers(0, 256, (min(short, 32), min(long, 32), 3), dtype=np.uint8))
        img = base.resize((long, short), Image.NEAREST).convert("I" if mode == "I;16" else mode)
        if mode == "I;16":
            img = img.point(lambda v: v * 257).convert("I;16")
        out = io.BytesIO()
        img.save(out, format=fmt, **({"compression": "tiff_deflate"} if fmt == "TIFF" else {}))
        _made[key] = out.getvalue()
    return _made[key]


REQUEST = st.lists(
    st.tuples(
        st.sampled_from(SERVE_KINDS),
        st.sampled_from([4_000_000, 2_000_000, 250_000, 4096]),
        st.sampled_from(["square", "wide", "line"]),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=4,
)


@given(st.lists(REQUEST, min_size=1, max_size=8))
@example([[(("PNG", "L"), 4_000_000, "square", 0)] * 4] * 8)  # the review's eight requests at the budgets
@example([[(("TIFF", "F"), 4_000_000, "square", 1)] * 2] * 4)  # high bit depth, decoded in strips
@settings(max_examples=_examples(CI_REQUEST_EXAMPLES))
def test_concurrent_requests_at_the_budgets_stay_within_what_they_declare(
    busy_server: tuple[int, str], requests: list[list[tuple]]
) -> None:
    """Up to eight requests at once, each of up to four images of any format, mode and shape at serve's
    budgets (an image at the decoding budget, requests over the request pixels or bytes): every request is
    answered (200, or a 4xx JSON refusal), the server's peak resident memory above what it held before stays
    within what its budgets declare (:func:`_declared_bytes`) plus :data:`SERVE_ALLOWANCE`, and it still
    answers ``/health`` and predicts after."""
    import httpx

    from served import multipart, peak_during, rss

    pid, url = busy_server
    bodies = [multipart([_encoded(*image) for image in images]) for images in requests]
    idle = rss(pid)
    signal.alarm(300)
    try:
        peak, answers = peak_during(pid, url, bodies)
    finally:
        signal.alarm(0)
    for r in answers:
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        if r.status_code != 200:
            assert "error" in r.json(), r.text[:300]
    assert peak - idle <= _declared_bytes() + SERVE_ALLOWANCE, (
        f"{(peak - idle) >> 20} MiB above the server's memory before {len(requests)} requests; its budgets "
        f"declare {_declared_bytes() >> 20} MiB"
    )
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    small = _encoded(("PNG", "RGB"), 4096, "square", 0)
    assert httpx.post(url + "/predict", content=small, timeout=60).status_code == 200


def test_the_reliability_page_states_what_the_targets_hold() -> None:
    """docs/reliability.md's words on the fuzz profile are this file's numbers."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    text = " ".join(page.split("### `fuzz`")[1].split("\n##")[0].split())
    decoding = SERVE_LIMITS["PROTEUS_LIMIT_DECODING_PIXELS"]
    for words in (
        f"may not rise {KB_OBJECT_ALLOWANCE >> 20} MiB above what their process held, nor pass "
        f"{CLI_CEILING / 1e9:g} GB",
        f"`input_bytes` + `body_bytes` + {SERVE_ALLOWANCE >> 20} MiB",
        f"({KB_OBJECT_BUDGET >> 20} MiB objects; {decoding // 1_000_000}-megapixel decodes)",
        f"and {CI_EXAMPLES} more drawn at random ({CI_OBJECT_EXAMPLES} for the objects, "
        f"{CI_REQUEST_EXAMPLES} for the concurrent requests)",
        f"`image_pixels` x {BYTES_PER_BUDGET_PIXEL} bytes",
        f"`decoding_pixels` x {BYTES_PER_BUDGET_PIXEL} bytes",
    ):
        assert words in text, words
