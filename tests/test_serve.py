"""``proteus serve`` with a real HTTP client on localhost (issue 15): predictions equal ``proteus predict``,
a commit by ``proteus learn`` in another process during a stream of requests is picked up without dropping
any, concurrent clients are served, bad uploads get a 4xx with a message, and nothing stops the server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from proteus.cli import main
from proteus.serve import KBServer
from tiny import TINY, folder_args

pytestmark = pytest.mark.slow


@pytest.fixture
def server(world: dict, tmp_path: Path):
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    srv = KBServer(("127.0.0.1", 0), kb, device="cpu", poll_seconds=0.2)
    srv.start_watching()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}", kb
    srv.shutdown()
    srv.server_close()


def _post(url: str, data: bytes, ctype: str = "application/octet-stream") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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


def test_predictions_equal_proteus_predict(server, world: dict, capsys) -> None:
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
    with urllib.request.urlopen(url + "/tasks", timeout=30) as r:
        tasks = json.loads(r.read())
    assert tasks["num_tasks"] == 1 and tasks["root"] == kb.name  # not the server's absolute path
    assert str(kb.parent) not in json.dumps(tasks)


def test_bad_uploads_are_4xx_and_the_server_goes_on(server, world: dict) -> None:
    srv, url, kb = server
    status, err = _post(url + "/predict", b"not an image at all")
    assert status == 400 and "not an image" in err["error"]
    body, ctype = _multipart({"good.png": (world["tree"] / "test" / "a" / "0.png").read_bytes(),
                              "broken.png": b"\x89PNG\r\n\x1a\nbroken"})  # fmt: skip
    status, err = _post(url + "/predict", body, ctype)
    assert status == 400 and "broken.png" in err["error"]
    status, err = _post(url + "/nowhere", b"x")
    assert status == 404 and "/predict" in err["error"]
    status, ok = _post(url + "/predict", (world["tree"] / "test" / "b" / "1.png").read_bytes())
    assert status == 200 and len(ok["predictions"]) == 1


def test_concurrent_clients_and_a_commit_during_the_stream(server, world: dict) -> None:
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
    for key in ("signature_score", "head_score", "p_all"):
        assert batched[key] == pytest.approx(alone[key], rel=1e-4, abs=1e-5), key
