"""What the ``record_*`` scripts share: their command line (``--command``, ``--out``, and ``--name`` where a
record is named), the provenance every record carries and writing a record as JSON under ``docs/measured/``
for ``tests/test_measured_docs.py``.

A record's ``provenance``: the ``commit`` of the code that computed its numbers (``dirty`` when the checkout
had uncommitted changes under ``src/``), the package ``versions``, the ``device`` and ``threads``, and the
``command``; a field that cannot be known honestly is ``"unknown"``. ``measures``: the paths of the code that
computes the numbers (``MEASURES``); ``tests/test_measured_docs.py`` calls a record stale when a commit after
its own changed one of them, and then wants the record's ``stale`` note and the page to say so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: where the records live
MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measured"

#: the code a record's numbers depend on, by the kind of record: the learners and everything they run on,
#: the packaged configs and the loop; a long-stream record also its knowledge base and harness
_LEARNING = (
    "src/proteus/adapters", "src/proteus/backbones", "src/proteus/baselines", "src/proteus/core",
    "src/proteus/engine", "src/proteus/heads", "src/proteus/signatures", "src/proteus/streams",
    "src/proteus/configs", "src/proteus/metrics.py", "src/proteus/images.py",
    "src/proteus/experiment/loop.py", "src/proteus/experiment/evaluate.py",
    # how a run is configured and its learner found: the config and the options it reads, the registries
    # and the learner protocol (the knowledge base's loader)
    "src/proteus/config", "src/proteus/options.py", "src/proteus/registry.py", "src/proteus/learners.py",
    "src/proteus/devices.py",
)  # fmt: skip
#: what a reader of a knowledge base runs besides the store itself: the checks of what it reads and the
#: collector paused around the reading
_READING = (
    "src/proteus/tensor_rules.py", "src/proteus/untrusted.py", "src/proteus/collector.py",
    "src/proteus/heap.py",
)  # fmt: skip
#: what the records that run PROTEUS alone depend on (no baseline's code)
_PROTEUS = tuple(p for p in _LEARNING if p != "src/proteus/baselines")
MEASURES: dict[str, tuple[str, ...]] = {
    "reproduce": _LEARNING,
    "compare": _LEARNING,
    "long": (*_PROTEUS, "src/proteus/kb", *_READING, "tools/perf/perf_long.py"),
    "shortlist": (*_PROTEUS, "tools/studies/shortlist.py"),
    "rivals_predict": (*_LEARNING, "tools/perf/perf_rivals_predict.py"),
    # the fuzz run passes through every part a user's input reaches
    "fuzz": (
        "src/proteus",
        "tests/test_fuzz.py",
        "tests/served.py",
        "tests/kbfiles.py",
        "tests/tiny.py",
        "tests/conftest.py",
    ),
}
#: what every record's provenance holds
PROVENANCE_KEYS = ("commit", "dirty", "versions", "device", "threads", "command")


def parser(
    doc: str | None, folder: str = "", named: bool = True, command: bool = True
) -> argparse.ArgumentParser:
    """A recorder's argument parser (the caller adds its inputs); records go to ``MEASURED/folder``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if named:
        ap.add_argument("--name", required=True, help="the record's name: the page's section names it")
    ap.add_argument(
        "--command", required=command, help="the command that made it (shown in the docs)", default=None
    )
    ap.add_argument("--out", type=Path, default=MEASURED / folder, help="the folder of the records")
    return ap


def from_checkout(command: str, device: str = "unknown", threads: Any = "unknown") -> dict[str, Any]:
    """A provenance for measurements whose output does not carry one: this checkout's commit and package
    versions (the record is made from the checkout that ran the measurement), with ``source`` saying so."""
    from proteus.experiment.provenance import provenance

    p = provenance(device)
    p["threads"] = threads
    return {**p, "command": command, "source": "the checkout the record was made from"}


def write(out_dir: Path, name: str, record: dict[str, Any], kind: str) -> Path:
    """Write ``record`` as ``out_dir/name.json`` with what it ``measures`` (``MEASURES[kind]``); its
    ``provenance`` must hold every :data:`PROVENANCE_KEYS` field (``"unknown"`` where it cannot be known).
    Returns its path."""
    prov = record.get("provenance") or {}
    missing = [k for k in PROVENANCE_KEYS if k not in prov]
    if missing:
        raise SystemExit(f"{name}: the record's provenance lacks {', '.join(missing)}")
    record = {**record, "measures": list(MEASURES[kind])}
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def _git(*args: str) -> str | None:
    import subprocess

    try:
        r = subprocess.run(["git", *args], cwd=MEASURED, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def in_git_checkout() -> bool:
    return _git("rev-parse", "--is-inside-work-tree") is not None


def staleness(record: dict[str, Any]) -> str | None:
    """Why ``record`` may no longer be what the code computes, or None: its commit is unknown (or had
    uncommitted changes, or is not in this repository's history), or a later commit changed the code it
    ``measures``. The reason names the record's commit only, so that it stays the same as code changes."""
    prov = record.get("provenance") or {}
    commit = prov.get("commit")
    commits = commit if isinstance(commit, list) and commit else [commit]  # runs made at several commits
    if not all(isinstance(c, str) and c != "unknown" for c in commits):
        at = prov.get("committed_in")
        where = f" (made at or before `{at[:7]}`)" if isinstance(at, str) and at else ""
        return f"its runs predate recorded provenance{where}: their commit is unknown"
    named = ", ".join(f"`{c[:7]}`" for c in commits)
    dirty = prov.get("dirty")
    if dirty is True or (isinstance(dirty, list) and True in dirty):
        return f"measured on {named} with uncommitted changes"
    paths = [f":(top){m}" for m in record.get("measures", ())]  # the repository's paths, from any folder
    for c in commits:
        if _git("cat-file", "-e", f"{c}^{{commit}}") is None:
            return f"measured on `{c[:7]}`, which is not in this repository's history"
        changed = _git("log", "--format=%h", f"{c}..HEAD", "--", *paths)
        if changed is None:
            return f"measured on {named}; git cannot tell what changed since"
        if changed.strip():
            return f"measured on {named}; the code it measured has changed since"
    return None


#: the page that shows each kind of record (its section is headed by the record's name)
PAGES = {
    "reproduce": "docs/experiments.md", "compare": "docs/retrieval.md", "long": "docs/performance.md",
    "rivals_predict": "docs/performance.md", "fuzz": "docs/reliability.md",
}  # fmt: skip
#: how a page says that the record of its section is stale
STALE_MARK = "**Stale record.**"
