"""Every option is validated once, with the type its key declares, before any work (issue 25, the
newcomer review's cases C01-C14, K1-K3, K9, S8-S11): ``--set``, ``--config`` files and the API's dotted keys
go through :func:`proteus.config.coercion` / :func:`proteus.presets.validate_keys`, and ``learn`` checks
the keys it is given before comparing them with an existing knowledge base. Also: SIGTERM is handled like
Ctrl-C (exit 143, the KB unchanged), ``--top-k`` is refused below 1 at parse time, and ``proteus serve``
answers JSON 405 / 400 / 408 for wrong methods, bad ``top_k`` and bodies shorter than their
Content-Length."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import proteus.cli.parser
from proteus.budgets import BudgetError
from proteus.cli import main
from proteus.config import ConfigError, RunConfig, coerce, field_type, flatten, parse_set, validate_keys
from proteus.experiment import resolve_config
from proteus.kb import KnowledgeBase
from proteus.serve import KBServer
from tiny import TINY, folder_args


# ============================================================================== types, from the schema
@pytest.mark.parametrize(
    "item, key, expected",
    [
        ("train.lr=1e-3", "train.lr", 0.001),  # YAML 1.1 reads 1e-3 as a string
        ("train.lr=1E-4", "train.lr", 1e-4),
        ("train.lr=2", "train.lr", 2.0),
        ("signature.tol=1e-3", "signature.tol", 0.001),
        ("signature.prior_dof=10", "signature.prior_dof", 10.0),  # float | None, default None
        ("signature.prior_dof=null", "signature.prior_dof", None),
        ("train.epochs=3", "train.epochs", 3),
        ("train.epochs=2.0", "train.epochs", 2),  # an integral value
        ("train.epochs=1e1", "train.epochs", 10),
        ("head.forgettable=true", "head.forgettable", True),
        ("head.forgettable=False", "head.forgettable", False),
        ("head.forgettable=yes", "head.forgettable", True),
        ("backbone.img_size=null", "backbone.img_size", None),  # int | None
        ("backbone.img_size=", "backbone.img_size", None),
        ("backbone.img_size=64", "backbone.img_size", 64),
        ("baseline.prompt_layers=[0, 2]", "baseline.prompt_layers", [0, 2]),  # list[int]
        ("baseline.prompt_layers=[]", "baseline.prompt_layers", []),
        ("train.cache_prefix=false", "train.cache_prefix", "false"),  # a str key: the text written
        ("benchmark.data=yes", "benchmark.data", "yes"),
        ("benchmark.data=2024-01-01", "benchmark.data", "2024-01-01"),
        ("device='!cpu'", "device", "!cpu"),  # a quoted string is no tag
    ],
)
def test_set_values_take_the_declared_type(item: str, key: str, expected: object) -> None:
    got = flatten(parse_set([item]))[key]
    assert got == expected and type(got) is type(expected), (got, expected)


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.epochs=2.5", "train.epochs must be an integer; got 2.5"),  # C03
        ("train.epochs=abc", "train.epochs must be an integer; got 'abc'"),  # C02
        ("train.epochs=null", "train.epochs must be an integer; got null"),
        ("train.epochs=true", "train.epochs must be an integer; got true"),
        ("train.lr=abc", "train.lr must be a number; got 'abc'"),
        ("train.lr=nan", "train.lr must be a number; got 'nan'"),
        ("train.lr=.inf", "train.lr must be a number; got inf"),
        ("train.lr={a: 1}", "train.lr must be a number; got a mapping"),
        ("head.forgettable=1", "head.forgettable must be true or false; got 1"),  # 1/0 are not booleans
        ("head.forgettable=0", "head.forgettable must be true or false; got 0"),
        ("head.forgettable=maybe", "head.forgettable must be true or false; got 'maybe'"),
        ("backbone.img_size=1.5", "backbone.img_size must be an integer or null; got 1.5"),
        ("baseline.prompt_layers=3", "baseline.prompt_layers must be a list of integers; got 3"),
        (
            "baseline.prompt_layers=[0, 2.5]",
            "baseline.prompt_layers must be a list of integers; got [0, 2.5]",
        ),
        ("method=[a, b]", "method must be a string; got ['a', 'b']"),
        ("method=null", "method must be a string; got null"),
        ("train.epoch=1", "unknown config key 'train.epoch'; known keys here: epochs, batch_size, lr"),  # C13
        ("trian.epochs=1", "unknown config key 'trian.epochs'; known keys here: method, seed, device"),
        ("train=5", "train is a section, not a value: set train.<key>=...; keys: epochs, batch_size"),  # C06
        ("train.epochs.x=1", "unknown config key 'train.epochs.x': train.epochs is a value, not a section"),
        ("train.epochs", "--set expects key=value, got 'train.epochs'"),  # C05
        ("=5", "--set expects key=value, got '=5'"),
        ("train.epochs=[1", "--set train.epochs: not a valid YAML value: '[1'"),
        (
            "train.epochs=" + "[" * 5000,
            "--set train.epochs: brackets nested too deeply, over the limit of 100 levels (nesting_depth)",
        ),  # not a RecursionError: the nesting budget (proteus.budgets)
    ],
)
def test_set_values_that_do_not_fit_are_refused_by_key(item: str, message: str) -> None:
    with pytest.raises((ConfigError, BudgetError)) as e:
        parse_set([item])
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "value",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/new:os.system [touch {marker}]",
        "!!python/name:os.system",
        "!!binary aGk=",
        "!!str 5",
        "!custom 3",
    ],
)
def test_yaml_tags_in_set_values_are_refused(value: str, tmp_path: Path) -> None:  # C04
    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match=r"^--set train\.epochs: YAML tags are not allowed"):
        parse_set([f"train.epochs={value.format(marker=marker)}"])
    assert not marker.exists()


def test_the_same_rules_for_config_files_and_the_api(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train: {lr: 1e-3, epochs: 2.0}\nhead: {forgettable: yes}\nsignature:\n")
    cfg = resolve_config("quickstart", config_files=[str(f)])
    assert (cfg.train.lr, cfg.train.epochs, cfg.head.forgettable) == (0.001, 2, True)
    assert type(cfg.train.lr) is float and type(cfg.train.epochs) is int
    for text, message in (
        ("train: {epochs: 2.5}", "train.epochs must be an integer; got 2.5"),
        ("train: {epoch: 1}", "unknown config key 'train.epoch'; known keys here: epochs"),
        ("train: 5", "train is a section, not a value"),
        ("head: {forgettable: 1}", "head.forgettable must be true or false; got 1"),
        ("train: {lr: !!binary aGk=}", "train.lr must be a number; got b'hi'"),
    ):
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            resolve_config("quickstart", config_files=[str(f)])
        assert str(e.value).startswith(f"{f}: {message}"), str(e.value)  # the file is named
    f.write_text("[" * 5000)  # refused by the nesting budget before YAML parses it (proteus.budgets)
    with pytest.raises(BudgetError, match=f"{f}: brackets nested too deeply.*nesting_depth"):
        resolve_config("quickstart", config_files=[str(f)])
    # the API's dotted keys: RunConfig.with_values, Proteus.from_method / set_params, resolve_config(dotted=)
    assert RunConfig().with_values({"train.lr": "1e-3"}).train.lr == 0.001
    with pytest.raises(ConfigError, match="train.epochs must be an integer; got 2.5"):
        RunConfig().with_values({"train.epochs": 2.5})
    with pytest.raises(ConfigError, match="train is a section"):
        resolve_config("quickstart", dotted={"train": 5, "train.epochs": 1})


def test_every_default_has_a_declared_type_it_fits() -> None:
    """The schema's declared types cover every field, and every default reads back as itself."""
    for key, value in flatten(RunConfig().to_dict()).items():
        got = coerce(value, field_type(key), key)
        assert got == value and type(got) is type(value), key


def test_ranges_and_registries_are_checked_for_given_keys_alone() -> None:
    """What ``learn`` checks before comparing with a KB: types, then registries and ranges (declared once,
    :data:`proteus.presets.RANGES`)."""
    assert validate_keys({"train.lr": "1e-3", "head.rp_dim": "0"}) == {"train.lr": 0.001, "head.rp_dim": 0}
    with pytest.raises(ConfigError, match=r"head.rp_dim must be a number in \[0, 65536\]; got -5"):  # C14
        validate_keys({"head.rp_dim": -5})
    with pytest.raises(ConfigError, match="signature.keys must be one of"):
        validate_keys({"signature.keys": "bogus"})
    with pytest.raises(ConfigError, match="unknown config key 'train.epoch'"):
        validate_keys({"train.epoch": 1})


def test_run_refuses_before_any_work(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    for item, message in (
        ("train.epoch=1", "unknown config key 'train.epoch'; known keys here: epochs"),  # C13
        ("head.rp_dim=-5", "head.rp_dim must be a number in [0, 65536]; got -5"),  # C14
        ("head.rp_dim=100000000", "head.rp_dim must be a number in [0, 65536]; got 100000000"),
        ("train.epochs=2.5", "train.epochs must be an integer; got 2.5"),
    ):
        assert main(["run", "--benchmark", "quickstart", "--out", str(out), "--set", item]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


# ============================================================================== learn into an existing KB
def _digest(kb: Path) -> dict[str, str]:
    """Every file of the KB but the lock, by content."""
    return {
        str(p.relative_to(kb)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(kb.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _learn(world: dict, kb: Path, task: int, *extra: str) -> int:
    argv = ["learn", "--kb", str(kb), "--task", str(task), *folder_args(world["tree"], world["spec"]), *TINY]
    return main([*argv, *extra])


@pytest.mark.slow
def test_bad_options_on_an_existing_kb_name_the_key_not_a_conflict(
    world: dict, tmp_path: Path, capsys
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    before = _digest(kb)
    bad_file = tmp_path / "typo.yaml"
    bad_file.write_text("train: {epoch: 1}\n")
    cases = [
        (["--set", "train.epoch=1"], "unknown config key 'train.epoch'; known keys here: epochs"),  # C01
        (["--set", "train=5"], "train is a section, not a value: set train.<key>=...; keys: epochs"),  # C06
        (["--set", "train.epochs=abc"], "train.epochs must be an integer; got 'abc'"),  # C02
        (["--set", "train.epochs=2.5"], "train.epochs must be an integer; got 2.5"),  # C03
        (["--set", "train.epochs=!!python/object/apply:os.system [true]"], "--set train.epochs: YAML tags"),
        (["--set", "train.epochs"], "--set expects key=value, got 'train.epochs'"),  # C05
        (["--set", "head.forgettable=1"], "head.forgettable must be true or false; got 1"),
        (["--set", "signature.max_components=0"], "signature.max_components must be a number in [1, inf)"),
        (["--config", str(bad_file)], f"{bad_file}: unknown config key 'train.epoch'"),
    ]
    for extra, message in cases:
        assert _learn(world, kb, 2, *extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}"), (extra, err)
        assert "conflict" not in err and "Traceback" not in err and err.count("\n") == 1, err
    # C12: a model-defining key with a valid value that differs: the conflict, typed
    assert _learn(world, kb, 2, "--set", "signature.max_components=1000000000") == 2
    assert "signature.max_components: knowledge base has 2, given 1000000000" in capsys.readouterr().err
    assert _digest(kb) == before


@pytest.mark.slow
def test_floats_like_1e_3_on_a_new_and_an_existing_kb(world: dict, tmp_path: Path, capsys) -> None:
    """``1e-3`` is a float for float keys: a per-task key (train.lr) is applied and recorded as 0.001, a
    model-defining one (signature.tol, 1e-3 in the KB) equals the KB's; a ``--config`` file's per-benchmark
    sections apply to its benchmark only (not flattened into unknown keys)."""
    kb = tmp_path / "new"
    assert _learn(world, kb, 1, "--no-eval", "--set", "train.lr=1e-3", "--set", "adapter.lam=6e-3") == 0
    m = KnowledgeBase.open(kb).manifest
    assert m["config"]["train"]["lr"] == 0.001 and m["config"]["adapter"]["lam"] == 0.006
    assert m["tasks"][0]["settings"]["train.lr"] == 0.001

    kb = tmp_path / "existing"
    shutil.copytree(world["kb1"], kb)
    f = tmp_path / "more.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "train": {"lr": "2e-3"},
                "benchmarks": {
                    "cifar10": {"benchmark": {"max_train_per_class": 3}},
                    "folder": {"signature": {"tol": "1e-3"}},
                },
            }  # fmt: skip
        )
    )
    capsys.readouterr()
    assert _learn(world, kb, 2, "--no-eval", "--config", str(f), "--set", "signature.tol=1e-3") == 0, (
        capsys.readouterr().err
    )
    tasks = KnowledgeBase.open(kb).manifest["tasks"]
    assert tasks[1]["settings"]["train.lr"] == 0.002 and type(tasks[1]["settings"]["train.lr"]) is float
    kb2 = tmp_path / "existing2"
    shutil.copytree(world["kb1"], kb2)
    assert _learn(world, kb2, 2, "--no-eval", "--set", "train.lr=1e-3") == 0
    assert KnowledgeBase.open(kb2).manifest["tasks"][1]["settings"]["train.lr"] == 0.001


# ============================================================================== --top-k
@pytest.mark.parametrize("value", ["0", "-1", "1.5", "abc", ""])
def test_top_k_below_1_or_not_an_integer_is_refused_at_parse_time(value: str, capsys) -> None:  # K1, K2
    with pytest.raises(SystemExit) as e:
        main(["predict", "--kb", "nowhere", "x.png", "--top-k", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --top-k: must be an integer >= 1; got {value!r}" in err and "Traceback" not in err


def test_serve_flags_are_checked_at_parse_time(capsys) -> None:
    for flag, value in (
        ("--port", "70000"),
        ("--poll", "0"),
        ("--read-timeout", "-1"),
        ("--read-timeout", "nan"),
    ):
        with pytest.raises(SystemExit):
            main(["serve", "--kb", "nowhere", flag, value])
        assert f"argument {flag}: must be" in capsys.readouterr().err


# ============================================================================== SIGTERM
def test_sigterm_is_like_ctrl_c(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    previous = signal.getsignal(signal.SIGTERM)

    def terminated(args: object) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # interrupted by the handler
        return 0

    monkeypatch.setattr(proteus.cli.parser, "cmd_list", terminated)
    t0 = time.monotonic()
    assert main(["list"]) == 143
    assert time.monotonic() - t0 < 5
    assert capsys.readouterr().err == "terminated (SIGTERM)\n"
    assert signal.getsignal(signal.SIGTERM) is previous  # restored


def test_the_interrupt_message_counts_the_tasks_when_the_kb_cannot_be_opened(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal that cut a lazy import short (a module left half-imported) leaves opening the knowledge base
    impossible in that process: the message still says how many tasks it holds, from its manifest."""
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    def cannot_open(*args: object, **kw: object) -> KnowledgeBase:
        raise AttributeError("module 'sympy' has no attribute 'logic'")  # what such a module raised

    monkeypatch.setattr(proteus.cli.parser, "cmd_kb_show", interrupted)
    monkeypatch.setattr(KnowledgeBase, "open", cannot_open)
    assert main(["kb", "info", str(kb)]) == 130
    assert capsys.readouterr().err == "interrupted; the knowledge base is unchanged at 1 task\n"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.slow
def test_sigterm_during_learn_exits_143_and_leaves_the_kb_unchanged(
    world: dict, tmp_path: Path, caplog
) -> None:
    """K9: ``proteus learn --task 2`` sent SIGTERM once it holds the KB's write lock (learning): exit 143
    with the Ctrl-C message, every file of the KB byte-identical, the lock released cleanly (the next writer
    takes no stale lock over)."""
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    before = _digest(kb)
    cmd = [sys.executable, "-m", "proteus", "learn", "--kb", str(kb), "--task", "2",
           *folder_args(world["tree"], world["spec"]), *TINY]  # fmt: skip
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = kb / ".lock"
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline and not (lock.exists() and lock.read_bytes()):
        time.sleep(0.01)
    assert p.poll() is None, p.communicate()
    time.sleep(0.2)  # past the lock's set-up: in the learning
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, (out, err)
    assert err.splitlines()[-1] == "terminated (SIGTERM); the knowledge base is unchanged at 1 task", err
    assert "Traceback" not in err
    assert _digest(kb) == before
    assert lock.read_bytes() == b""  # released cleanly
    caplog.set_level(logging.WARNING, logger="proteus")
    assert _learn(world, kb, 2, "--no-eval") == 0
    assert "took over" not in caplog.text
    assert len(KnowledgeBase.open(kb).manifest["tasks"]) == 2


# ============================================================================== serve
@pytest.fixture
def server(world: dict, tmp_path: Path):
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    srv = KBServer(("127.0.0.1", 0), kb, device="cpu", poll_seconds=0.5, read_timeout=1.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(data) if data else None
    finally:
        conn.close()


@pytest.mark.slow
def test_serve_wrong_methods_are_json_405(server) -> None:  # S8, S9
    _, port = server
    status, headers, body = _request(port, "GET", "/predict")
    assert status == 405 and headers["allow"] == "POST" and headers["content-type"] == "application/json"
    assert body == {"error": "GET is not allowed on /predict; use POST /predict"}
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, body = _request(port, method, "/predict", b"x")
        assert status == 405 and headers["allow"] == "POST" and "not allowed" in body["error"], method
        assert headers["connection"] == "close"  # the unread body is not taken for a next request
    status, headers, body = _request(port, "POST", "/health", b"x")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    status, headers, body = _request(port, "HEAD", "/health")
    assert status == 200 and body is None and int(headers["content-length"]) > 0
    status, _, body = _request(port, "HEAD", "/predict")
    assert status == 405 and body is None
    status, _, body = _request(port, "DELETE", "/nowhere")
    assert status == 404 and "no such endpoint '/nowhere'" in body["error"]
    status, headers, body = _request(port, "BREW", "/predict")
    assert status == 501 and headers["content-type"] == "application/json" and "BREW" in body["error"]
    assert _request(port, "GET", "/health")[0] == 200


@pytest.mark.slow
def test_serve_top_k_must_be_an_integer_of_at_least_1(server, world: dict) -> None:  # S10
    _, port = server
    image = (world["tree"] / "test" / "a" / "0.png").read_bytes()
    for value in ("abc", "0", "-5", "1.5", ""):
        status, _, body = _request(port, "POST", f"/predict?top_k={value}", image)
        assert status == 400 and body == {"error": f"top_k must be an integer >= 1; got {value!r}"}, value
    status, _, body = _request(port, "POST", "/predict?top_k=2", image)
    assert status == 200 and len(body["predictions"]) == 1


def _raw(port: int, head: bytes, body: bytes, shut: bool = False) -> tuple[bytes, float]:
    """Send a request (a body shorter than its Content-Length), read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body)
        if shut:
            s.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data, time.monotonic() - t0


@pytest.mark.slow
def test_serve_a_short_body_times_out_cleanly(server, capfd, caplog) -> None:  # S11
    srv, port = server
    caplog.set_level(logging.DEBUG, logger="proteus")
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    data, seconds = _raw(port, head, b"abc")
    assert data.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in data, data
    promised = "the body ended after 3 of the 1000000 B its Content-Length promised"
    assert json.loads(data.split(b"\r\n\r\n", 1)[1]) == {"error": f"{promised} (nothing more came in 1 s)"}
    assert 0.5 < seconds < 20
    data, _ = _raw(port, head, b"abc", shut=True)  # the client closed its side: 400 at once
    assert data.startswith(b"HTTP/1.1 400 ") and b"the body ended after 3 of the 1000000 B" in data
    # a client that leaves without reading the answer
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"abc")
    time.sleep(1.5)
    assert _request(port, "GET", "/health")[0] == 200  # the server goes on
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
