"""``proteus serve`` (Starlette under uvicorn) with a real HTTP client on localhost (issue 15 and the ASGI
issue): predictions equal ``proteus predict``, a commit by ``proteus learn`` in another process during a
stream of requests is picked up without dropping any, bad uploads get a 4xx JSON answer and the server goes
on, every error is JSON (404, 405 with ``Allow``, 400, 413, 501, a malformed request), a stalled body or
stalled headers get 408 within ``--read-timeout``, a slow prediction 504 within ``--request-timeout``, a
burst beyond ``--max-concurrency`` + ``--max-queue`` 503, the OpenAPI document holds together, the batch
endpoint's rows equal single requests', and 20 parallel requests finish sooner than 20 in turn (their
images are predicted together)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from proteus.cli import main
from proteus.serve import KBServer
from proteus.serve.app import ENDPOINTS, MAX_BODY
from tiny import TINY, folder_args

pytestmark = pytest.mark.slow

Server = tuple[KBServer, str, Path]


@pytest.fixture
def make_server(world: dict, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start servers on copies of the world's KB in threads (``KBServer`` keyword arguments: its limits)."""
    started: list[tuple[KBServer, threading.Thread]] = []

    def make(**kw: Any) -> Server:
        kb = tmp_path / f"kb{len(started)}"
        shutil.copytree(world["kb1"], kb)
        srv = KBServer(("127.0.0.1", 0), kb, device="cpu", **{"poll_seconds": 0.2, **kw})
        srv.start_watching()
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        started.append((srv, t))
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        _wait_until(lambda: httpx.get(url + "/health").status_code == 200)
        return srv, url, kb

    yield make
    for srv, t in started:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=30)


@pytest.fixture
def server(make_server: Callable[..., Server]) -> Server:
    return make_server()


def _wait_until(ok: Callable[[], Any], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if ok():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.02)


def _post(url: str, data: bytes, ctype: str = "application/octet-stream") -> tuple[int, dict]:
    r = httpx.post(url, content=data, headers={"Content-Type": ctype}, timeout=60)
    assert r.headers["content-type"] == "application/json", r.headers
    return r.status_code, r.json()


def _multipart(files: dict[str, bytes]) -> tuple[bytes, str]:
    b = uuid.uuid4().hex
    body = (
        b"".join(
            f'--{b}\r\nContent-Disposition: form-data; name="{n}"; filename="{n}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
            + data
            + b"\r\n"
            for n, data in files.items()
        )
        + f"--{b}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={b}"


def _raw(port: int, data: bytes, shut: bool = False) -> tuple[bytes, float]:
    """Send ``data`` on a new connection, read until the server closes it: (all it sent, seconds)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - t0


def _split(answer: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lower-case names) and JSON body of a raw HTTP answer."""
    head, body = answer.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def _same_rows(a: list[dict], b: list[dict]) -> None:
    """Rows equal up to float round-off at any depth (a row does not depend on the rest of its batch; the
    batch changes which kernels run, e.g. merged or factored adapters, so floats agree to round-off)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        _same(x, y, f"row {i}")


def _same(x: object, y: object, where: str) -> None:
    if isinstance(x, float):
        assert isinstance(y, float) and y == pytest.approx(x, rel=1e-4, abs=1e-5), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            _same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, list):
        assert isinstance(y, list) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _same(u, v, f"{where}[{i}]")
    else:
        assert x == y, where


def _images(world: dict, n: int) -> list[tuple[str, bytes]]:
    paths = [
        world["tree"] / split / c / f"{i}.png"
        for i in range(5)
        for split in ("train", "test")
        for c in "abcd"
    ]
    paths = [p for p in paths if p.exists()][:n]
    assert len(paths) == n
    return [(f"{p.parent.parent.name}-{p.parent.name}-{p.name}", p.read_bytes()) for p in paths]


# ------------------------------------------------------------------------------- predictions, reloads
def test_predictions_equal_proteus_predict(server: Server, world: dict, capsys) -> None:
    srv, url, kb = server
    imgs = [world["tree"] / "test" / c / "0.png" for c in "abcd"]
    assert main(["predict", "--kb", str(kb), *map(str, imgs), "--json", "--top-k", "2"]) == 0
    expect = json.loads(capsys.readouterr().out)
    body, ctype = _multipart({p.parent.name + ".png": p.read_bytes() for p in imgs})
    status, got = _post(url + "/predict?top_k=2", body, ctype)
    assert status == 200 and got["kb_tasks"] == 1
    for e, g in zip(expect, got["predictions"]):
        assert {k: v for k, v in e.items() if k != "file"} == {k: v for k, v in g.items() if k != "file"}
    status, one = _post(url + "/predict", imgs[0].read_bytes())  # a raw body: one image
    assert status == 200 and one["predictions"][0]["class"] == expect[0]["class"]
    assert one["predictions"][0]["file"] == "body"
    tasks = httpx.get(url + "/tasks").json()
    assert tasks["num_tasks"] == 1 and tasks["root"] == kb.name  # not the server's absolute path
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["kb_tasks"] == 1 and health["kb"] == kb.name
    for answer in (tasks, health, got):
        assert str(kb.parent) not in json.dumps(answer)


def test_bad_uploads_are_4xx_and_the_server_goes_on(server: Server, world: dict) -> None:
    srv, url, kb = server
    status, err = _post(url + "/predict", b"not an image at all")
    assert status == 400 and "not an image" in err["error"]
    body, ctype = _multipart({"good.png": (world["tree"] / "test" / "a" / "0.png").read_bytes(),
                              "broken.png": b"\x89PNG\r\n\x1a\nbroken"})  # fmt: skip
    status, err = _post(url + "/predict", body, ctype)
    assert status == 400 and "broken.png" in err["error"] and str(kb.parent) not in err["error"]
    status, err = _post(url + "/nowhere", b"x")
    assert status == 404 and "/predict" in err["error"]
    status, ok = _post(url + "/predict", (world["tree"] / "test" / "b" / "1.png").read_bytes())
    assert status == 200 and len(ok["predictions"]) == 1


def test_concurrent_clients_and_a_commit_during_the_stream(server: Server, world: dict) -> None:
    """Four clients post continuously while ``proteus learn --task 2`` commits in another process: every
    request is answered 200, answers come from 1 task before the swap and 2 after, never anything else."""
    srv, url, kb = server
    data = (world["tree"] / "test" / "c" / "0.png").read_bytes()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "proteus", "learn", "--kb", str(kb), "--task", "2",
           *folder_args(world["tree"], world["spec"]), *TINY]  # fmt: skip
    learn = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[int] = []

    def client() -> list[int]:  # posts until the new commit answers (or 5 minutes: then the test fails)
        out: list[int] = []
        deadline = time.monotonic() + 300
        done = lambda: learn.poll() is not None and srv.reloads and out and out[-1] == 2  # noqa: E731
        while time.monotonic() < deadline and not done():
            status, res = _post(url + "/predict", data)
            assert status == 200, res
            out.append(res["kb_tasks"])
        return out

    with ThreadPoolExecutor(4) as pool:
        for r in pool.map(lambda _: client(), range(4)):
            seen += r
    assert learn.wait(timeout=300) == 0, learn.communicate()
    assert set(seen) <= {1, 2} and seen.count(1) >= 1 and seen[-1] == 2 and srv.reloads == 1


def test_a_row_does_not_depend_on_the_rest_of_the_batch(world: dict, capsys) -> None:
    imgs = [str(world["tree"] / split / c / f"{i}.png") for split in ("train", "test") for c in "abcd"
            for i in range(2)]  # fmt: skip
    assert main(["predict", "--kb", str(world["kb1"]), imgs[0], "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)[0]
    assert main(["predict", "--kb", str(world["kb1"]), *imgs[::-1], "--json"]) == 0
    batched = json.loads(capsys.readouterr().out)[-1]
    assert alone["class"] == batched["class"] and alone["task"] == batched["task"]
    for key in ("signature_score", "head_score", "p_all", "confidence"):
        assert batched[key] == pytest.approx(alone[key], rel=1e-4, abs=1e-5), key


# ---------------------------------------------------------------------------------------- errors
def test_every_error_is_json(server: Server, caplog) -> None:
    srv, url, kb = server
    caplog.set_level(logging.INFO, logger="proteus")
    r = httpx.get(url + "/predict")
    assert (
        r.status_code == 405
        and r.headers["allow"] == "POST"
        and r.headers["content-type"] == "application/json"
    )
    assert r.json() == {"error": "GET is not allowed on /predict; use POST /predict"}
    r = httpx.post(url + "/health", content=b"x")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD" and r.headers["connection"] == "close"
    r = httpx.delete(url + "/predict/batch")
    assert (
        r.status_code == 405 and r.headers["allow"] == "POST" and "POST /predict/batch" in r.json()["error"]
    )
    r = httpx.get(url + "/nowhere")
    assert r.status_code == 404 and "no such endpoint '/nowhere'" in r.json()["error"]
    assert httpx.get(url + "/predict/").status_code == 404  # not a redirect without a body
    r = httpx.request("BREW", url + "/predict")
    assert r.status_code == 501 and "BREW" in r.json()["error"]
    for value in ("abc", "0", "1.5", ""):
        r = httpx.post(url + f"/predict?top_k={value}", content=b"x")
        assert r.status_code == 400 and r.json() == {"error": f"top_k must be an integer >= 1; got {value!r}"}
    r = httpx.post(url + "/predict", content=b"")
    assert r.status_code == 400 and "1 B" in r.json()["error"]
    port = srv.server_address[1]
    head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
    status, headers, err = _split(_raw(port, head + b"abc")[0])  # refused before the body is read
    assert status == 413 and headers["connection"] == "close" and str(MAX_BODY) in err["error"]
    status, headers, err = _split(_raw(port, b"NOT HTTP AT ALL\r\n\r\n")[0])
    assert status == 400 and headers["content-type"] == "application/json" and "HTTP/1.1" in err["error"]
    r = httpx.post(url + "/predict/batch", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and '"images"' in r.json()["error"]
    srv.kb.info = lambda: {}["/secret/path"]  # type: ignore[method-assign] # an internal failure
    r = httpx.get(url + "/tasks")
    assert r.status_code == 500 and "internal error" in r.json()["error"] and "secret" not in r.text
    del srv.kb.info
    assert httpx.get(url + "/health").status_code == 200  # the server goes on
    log = [rec.getMessage() for rec in caplog.records if rec.name == "proteus"]
    assert any(line.startswith("127.0.0.1 GET /predict 405 ") and line.endswith("ms") for line in log), log
    assert any(" POST /predict?top_k=abc 400 " in line for line in log), log


def test_a_stalled_body_or_stalled_headers_get_408(make_server: Callable[..., Server]) -> None:
    srv, url, kb = make_server(read_timeout=1.0)
    port = srv.server_address[1]
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    answer, seconds = _raw(port, head + b"abc")
    status, headers, err = _split(answer)
    assert status == 408 and headers["connection"] == "close" and 0.5 < seconds < 10
    promised = "the body ended after 3 of the 1000000 B its Content-Length promised"
    assert err == {"error": f"{promised} (nothing more came in 1 s)"}
    status, _, err = _split(_raw(port, head + b"abc", shut=True)[0])  # the client closed its side: 400 now
    assert status == 400 and err["error"] == promised
    answer, seconds = _raw(port, b"POST /predict HTTP/1.1\r\nHost: x\r\n")  # headers that never end
    status, headers, err = _split(answer)
    assert status == 408 and "headers did not end within 1 s" in err["error"] and 0.5 < seconds < 10
    assert _raw(port, b"")[0] == b""  # a connection that says nothing is closed
    assert httpx.get(url + "/health").status_code == 200


def test_headers_dripped_a_byte_at_a_time_get_408_from_their_first_byte(
    make_server: Callable[..., Server],
) -> None:
    """A slow client that sends its headers a byte every quarter second (a slowloris) is answered 408 once
    --read-timeout has passed since the headers began, not kept open for as long as it drips: each such
    connection would otherwise hold one of the server's file descriptors for ever."""
    srv, url, kb = make_server(read_timeout=1.0)
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30) as s:
        t0, answer = time.monotonic(), b""
        for byte in b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 60:
            try:
                s.sendall(bytes([byte]))
            except OSError:  # closed by the server
                break
            s.settimeout(0.25)
            try:
                answer = s.recv(65536)
            except TimeoutError:
                continue
            break
        seconds = time.monotonic() - t0
    assert answer, f"no answer after {seconds:.1f} s of dripped headers"
    status, headers, err = _split(answer)
    assert status == 408 and "headers did not end within 1 s" in err["error"] and seconds < 5, seconds
    assert httpx.get(url + "/health").status_code == 200


def test_a_slow_or_failed_prediction_gets_504_or_500_and_the_server_goes_on(
    make_server: Callable[..., Server], world
) -> None:
    srv, url, kb = make_server(request_timeout=1.0)
    image = (world["tree"] / "test" / "a" / "0.png").read_bytes()
    clf = srv.clf
    predict = clf.predict

    def slow(x: Any, *args: Any, **kw: Any) -> Any:
        time.sleep(2.5)
        return predict(x, *args, **kw)

    def broken(x: Any, *args: Any, **kw: Any) -> Any:
        raise RuntimeError("/secret/path")

    clf.predict = slow  # type: ignore[method-assign]
    try:
        t0 = time.monotonic()
        status, err = _post(url + "/predict", image)
        assert status == 504 and "--request-timeout" in err["error"] and time.monotonic() - t0 < 2.4
        _wait_until(lambda: srv.app.state.proteus.batcher.batches == 1)  # the slow batch finished
        clf.predict = broken  # type: ignore[method-assign]
        status, err = _post(url + "/predict", image)
        assert status == 500 and "internal error" in err["error"] and "secret" not in err["error"]
    finally:
        del clf.predict
    _wait_until(lambda: _post(url + "/predict", image)[0] == 200)


def test_a_burst_beyond_the_bound_gets_503(make_server: Callable[..., Server], world: dict) -> None:
    """One slot, one place in the queue: two requests whose bodies are still arriving hold both, a third
    is refused at once with 503 JSON and ``Retry-After``; the two then finish normally. A burst of 12 at
    two slots and two places: every answer a 200 or a 503 JSON."""
    srv, url, kb = make_server(max_concurrency=1, max_queue=1)
    port = srv.server_address[1]
    image = (world["tree"] / "test" / "a" / "0.png").read_bytes()
    head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(image)}\r\n\r\n".encode()
    holders = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        for s in holders:
            s.sendall(head + image[:10])
        _wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
        assert httpx.get(url + "/health").json()["active"] == 1
        status, err = _post(url + "/predict", image)
        assert status == 503 and "--max-concurrency" in err["error"]
        assert httpx.post(url + "/predict", content=image).headers["retry-after"] == "1"
        for s in holders:
            s.sendall(image[10:])
        for s in holders:
            answer = b""
            while (b"\r\n\r\n" not in answer or not answer.endswith(b"}")) and (chunk := s.recv(65536)):
                answer += chunk
            status, _, ok = _split(answer)
            assert status == 200 and ok["kb_tasks"] == 1
    finally:
        for s in holders:
            s.close()

    srv, url, kb = make_server(max_concurrency=2, max_queue=2)
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: _post(url + "/predict", image), range(12)))
    assert {s for s, _ in answers} <= {200, 503} and any(s == 200 for s, _ in answers)
    assert all("error" in a for s, a in answers if s == 503)


# ------------------------------------------------------------------------------- schema, batch, throughput
def test_the_openapi_document_holds_together(server: Server) -> None:
    srv, url, kb = server
    doc = httpx.get(url + "/openapi.json").json()
    schemas, error_ref = doc["components"]["schemas"], {"$ref": "#/components/schemas/Error"}
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] and doc["info"]["version"]
    assert set(doc["paths"]) == set(ENDPOINTS)
    for path, methods in ENDPOINTS.items():
        ops = doc["paths"][path]
        assert set(ops) == {m.lower() for m in methods if m != "HEAD"}, path
        for op in ops.values():
            codes = set(op["responses"])
            assert {"200", "405", "500"} <= codes, path
            if path.startswith("/predict"):
                assert {"400", "408", "413", "503", "504"} <= codes and op["requestBody"]["content"], path
            for code, answer in op["responses"].items():
                assert answer["description"] and "application/json" in answer["content"], (path, code)
                if code != "200":
                    assert answer["content"]["application/json"]["schema"] == error_ref

    def refs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            yield from ([node["$ref"]] if "$ref" in node else [])
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in set(refs(doc)):  # every reference resolves
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
    assert str(kb.parent) not in json.dumps(doc)


def test_the_batch_endpoint_answers_a_row_per_part(server: Server, world: dict) -> None:
    srv, url, kb = server
    images = _images(world, 4)
    singles = [_post(url + "/predict?top_k=2", data)[1]["predictions"][0] for _, data in images]
    parts = dict(images[:2]) | {"broken.png": b"\x89PNG\r\n\x1a\nbroken"} | dict(images[2:])
    status, got = _post(url + "/predict/batch?top_k=2", *_multipart(parts))
    assert status == 200 and got["errors"] == 1 and len(got["predictions"]) == 5
    assert got["predictions"][2]["file"] == "broken.png" and "broken.png" in got["predictions"][2]["error"]
    rows = got["predictions"][:2] + got["predictions"][3:]
    assert [r["file"] for r in rows] == [n for n, _ in images]
    _same_rows([{**r, "file": "body"} for r in rows], singles)
    doc = {"images": [{"name": n, "data": base64.b64encode(d).decode()} for n, d in images]}
    status, got = _post(url + "/predict/batch?top_k=2", json.dumps(doc).encode(), "application/json")
    assert status == 200 and got["errors"] == 0
    _same_rows([{**r, "file": "body"} for r in got["predictions"]], singles)


def test_parallel_requests_are_faster_than_sequential_ones(server: Server, world: dict) -> None:
    """20 single-image requests at once take less time than the same 20 one after another: their images
    are predicted in shared batches; every answer equals its sequential twin (to float round-off)."""
    srv, url, kb = server
    images = _images(world, 20)
    with httpx.Client(base_url=url, timeout=60) as client:
        client.post("/predict", content=images[0][1])  # warm up
        t0 = time.perf_counter()
        sequential = [client.post("/predict", content=data).json() for _, data in images]
        t_seq = time.perf_counter() - t0
    batches_before = srv.app.state.proteus.batcher.batches

    async def burst() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/predict", content=data) for _, data in images))
        return [a.json() for a in answers]

    t0 = time.perf_counter()
    parallel = asyncio.run(burst())
    t_par = time.perf_counter() - t0
    batches = srv.app.state.proteus.batcher.batches - batches_before
    print(f"\n20 requests: sequential {t_seq:.3f} s, parallel {t_par:.3f} s ({batches} batches)")
    assert all(a["kb_tasks"] == 1 for a in parallel)
    _same_rows([a["predictions"][0] for a in parallel], [a["predictions"][0] for a in sequential])
    assert batches < 20 and srv.app.state.proteus.batcher.largest > 1
    assert t_par < t_seq, (t_par, t_seq)
