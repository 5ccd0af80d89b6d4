"""A knowledge base's manifests as files, for the tests that edit them by hand (as someone who received the
knowledge base could): :func:`read_manifest` gives a manifest with its task records whatever its format
(format 4 keeps them in record segments: they are read back into ``tasks``, ``evaluation`` and
``object_bytes``, without any check), :func:`write_manifest` writes such a manifest back, packing the records
into new record segments the way the store names them (its checksum recomputed unless told otherwise), so
that only what the test changed differs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from proteus.kb import manifest_checksum
from proteus.kb.segments import RECORDS_FORMAT, SEGMENT_TASKS, content_digest

EXPANDED = ("tasks", "evaluation", "object_bytes")


def _v4(m: dict[str, Any]) -> bool:
    v = m.get("format_version")
    return isinstance(v, int) and v >= 4


def read_manifest(kb: Path, name: str = "manifest.json") -> dict[str, Any]:
    """Manifest file ``name`` of ``kb`` with its records in ``tasks`` (format 4: read from its segments)."""
    path = kb / name if "/" not in name else kb / name
    m = json.loads(path.read_text())
    if not (isinstance(m, dict) and _v4(m) and isinstance(m.get("segments"), list)):
        return m
    tasks: list[Any] = []
    rows: list[Any] = []
    sizes: dict[str, Any] = {}
    for ref in m["segments"]:
        body = json.loads((kb / ref["object"]).read_text())
        for t in body["tasks"]:
            n = t.pop("bytes", None)
            if isinstance(t.get("object"), str):
                sizes[t["object"]] = n
            tasks.append(t)
        rows += body["evaluation"]
    head = m.get("head")
    if isinstance(head, dict):
        sizes[head.get("object")] = head.get("bytes")
    return {**m, "tasks": tasks, "evaluation": rows, "object_bytes": sizes}


def segment_refs(kb: Path, m: dict[str, Any]) -> list[dict[str, Any]]:
    """Record segments holding ``m``'s ``tasks`` and ``evaluation`` (written into ``kb/objects``), each record
    with its object's size (from ``object_bytes``, else the file's, else 0)."""
    tasks = m.get("tasks") or []
    rows = m.get("evaluation") or []
    sizes = m.get("object_bytes") if isinstance(m.get("object_bytes"), dict) else {}
    refs = []
    for first in range(0, len(tasks), SEGMENT_TASKS):
        records = []
        for t in tasks[first : first + SEGMENT_TASKS]:
            if isinstance(t, dict):
                n = sizes.get(t["object"]) if isinstance(t.get("object"), str) else None  # (a hostile value)
                if n is None and isinstance(t.get("object"), str) and (kb / t["object"]).is_file():
                    n = (kb / t["object"]).stat().st_size
                t = {**t, "bytes": n if n is not None else 0}
            records.append(t)
        part = rows[first : first + SEGMENT_TASKS] if isinstance(rows, list) else rows  # (a hostile value)
        body = {"format": RECORDS_FORMAT, "first": first, "tasks": records, "evaluation": part}
        data = json.dumps(body).encode()
        sha = hashlib.sha256(data).hexdigest()
        rel = f"objects/records-{sha[:16]}.json"
        (kb / rel).write_bytes(data)
        refs.append({"object": rel, "sha256": sha, "bytes": len(data), "first": first, "count": len(records),
                     "content": content_digest(records, part if isinstance(part, list) else [])})  # fmt: skip
    return refs


def write_manifest(kb: Path, m: dict[str, Any], name: str = "manifest.json", checksum: bool = True) -> None:
    """Write ``m`` (from :func:`read_manifest`, edited) as manifest file ``name`` of ``kb``: format 4's
    records packed into new record segments (``tasks`` not a list: written into the manifest as it is)."""
    if not isinstance(m, dict):
        (kb / name).write_text(json.dumps(m))
        return
    if _v4(m) and isinstance(m.get("tasks"), list):
        out = {k: v for k, v in m.items() if k not in EXPANDED}
        out["segments"] = segment_refs(kb, m)
        out["num_tasks"] = len(m["tasks"])
        head = out.get("head")
        sizes = m.get("object_bytes") if isinstance(m.get("object_bytes"), dict) else {}
        if isinstance(head, dict) and isinstance(head.get("object"), str):
            n = sizes.get(head["object"])
            if n is None and (kb / head["object"]).is_file():
                n = (kb / head["object"]).stat().st_size
            out["head"] = {**head, "bytes": n if n is not None else 0}
        m = out
    if checksum:
        m["checksum"] = manifest_checksum(m)
    (kb / name).write_text(json.dumps(m, indent=1))


def as_released(m: dict[str, Any], version: int = 3) -> dict[str, Any]:
    """``m`` (from :func:`read_manifest`) as a release that wrote format ``version`` (1, 2 or 3) wrote it:
    every record in the manifest, no record segment, no parent; format 3 with its sequence, identity and
    objects' sizes, format 2 with a checksum over every field but its time stamps, format 1 without one."""
    dropped = ("segments", "parent", "num_tasks", "checksum", "signature")
    out = {k: v for k, v in m.items() if k not in dropped}
    out["format_version"] = version
    if isinstance(out.get("head"), dict):
        out["head"] = {k: v for k, v in out["head"].items() if k != "bytes"}
    refs = {t.get("object") for t in out.get("tasks") or [] if isinstance(t, dict)}
    refs.add(out["head"].get("object") if isinstance(out.get("head"), dict) else None)
    sizes = out.get("object_bytes") if isinstance(out.get("object_bytes"), dict) else {}
    out["object_bytes"] = {k: v for k, v in sizes.items() if k in refs}
    if version < 3:
        for key in ("sequence", "kb_id", "object_bytes"):
            out.pop(key, None)
    if version >= 2:
        out["checksum"] = manifest_checksum(out)
    return out
