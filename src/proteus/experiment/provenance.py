"""Where a measured number comes from: the commit of the code that computed it (and whether the checkout had
uncommitted changes), the versions of the packages that compute, the device and the thread count.

Every run writes it into results.json (``provenance``); ``proteus compare`` and ``proteus reproduce`` keep
each run's beside its figures and merge them (:func:`merged`); the records behind the docs' measured tables
(``tools/docs/record_*.py``, ``docs/measured/``) carry it, and ``tests/test_measured_docs.py`` compares a
record's commit with the last commit that changed the code it measured.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "UNKNOWN", "git_state", "merged", "provenance"]

#: what a provenance field holds when it cannot be known
UNKNOWN = "unknown"
#: the distributions whose versions a result depends on
PACKAGES = ("proteus", "torch", "numpy", "scikit-learn", "scipy", "timm", "safetensors")


def git_state(where: Path | None = None) -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the git checkout holding ``where`` (this package's source by default):
    ``(UNKNOWN, None)`` outside a checkout (an installed wheel) or without git. ``dirty``: the checkout's
    tracked files under ``src/`` differ from the commit."""
    here = where or Path(__file__).resolve().parent
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if top.returncode != 0:
            return UNKNOWN, None
        root = top.stdout.strip()
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "src"],
            cwd=root, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN, None
    if head.returncode != 0:
        return UNKNOWN, None
    return head.stdout.strip(), (bool(status.stdout.strip()) if status.returncode == 0 else None)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def provenance(device: str | None = None) -> dict[str, Any]:
    """This process's provenance: commit and dirty state, package versions, the device a run used (the
    caller's resolved device; None: not known here), torch's intra-op threads, Python, the platform and
    the time (UTC)."""
    import torch

    from proteus._version import __version__

    commit, dirty = git_state()
    versions = {name: _version(name) for name in PACKAGES}
    versions["proteus"] = __version__
    versions["python"] = platform.python_version()
    return {
        "commit": commit,
        "dirty": dirty,
        "versions": versions,
        "device": device if device is not None else UNKNOWN,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def merged(items: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """The provenance of several runs in one: each field's value where they agree, else the sorted list
    of their values (``commit`` etc.; a provenance merged before counts with each of its values); a run
    without one (written by an earlier release), or a field it holds as :data:`UNKNOWN` (a record's
    ``versions``), counts as :data:`UNKNOWN` in every field. ``time``
    is the span ``[first, last]``."""
    runs: list[dict[str, Any]] = [it or {} for it in items]
    if not runs:
        return {}
    out: dict[str, Any] = {}
    keys = ("commit", "dirty", "device", "threads", "platform")
    for k in keys:  # (a merged provenance's list of values counts as each of them: no lists of lists)
        found = [it.get(k, UNKNOWN) for it in runs]
        values = sorted({json.dumps(v) for f in found for v in (f if isinstance(f, list) else [f])})
        out[k] = json.loads(values[0]) if len(values) == 1 else [json.loads(v) for v in values]
    versions = [v if isinstance(v := it.get("versions"), dict) else {} for it in runs]  # or UNKNOWN
    names = sorted({n for v in versions for n in v}) or list(PACKAGES)
    out["versions"] = {}
    for n in names:
        found = [v.get(n, UNKNOWN) for v in versions]
        values = sorted({str(x) for f in found for x in (f if isinstance(f, list) else [f])})
        out["versions"][n] = values[0] if len(values) == 1 else values
    spans = [t if isinstance(t := it.get("time"), list) else [t] for it in runs]  # a merged one: a span
    times = sorted(str(t) for span in spans for t in span if t and t != UNKNOWN)
    out["time"] = [times[0], times[-1]] if times else UNKNOWN
    out["runs"] = len(runs)
    return out
