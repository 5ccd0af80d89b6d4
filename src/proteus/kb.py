"""The knowledge base (KB) of Algorithm 1: per task a value (the adapter) and a multi-key (the signature),
plus the head's statistics G and e(c). It is the only memory of data that no longer exists.

On disk::

    kb/manifest.json                     the commit point (JSON, no pickle)
    kb/objects/<kind>-<sha256[:16]>.safetensors   content-addressed tensor files

A commit writes the new objects first (temporary name, fsync, rename), then a new manifest to a
temporary name, fsyncs it, and renames it over ``manifest.json`` (atomic on POSIX), then fsyncs the
directory. Objects are never overwritten (their names carry their hash), so a process killed at any
moment leaves either the old manifest with all its objects, or the new one. Unreferenced objects and
temporary files are swept on the next commit. Every object's sha256 is recorded in the manifest and
verified when it is read: a truncated or edited file is detected, never loaded.

Crash points (:func:`proteus.faults.crash_point`) mark the commit's steps for the crash-safety tests
(``tests/test_crash_safety.py`` kills ``proteus learn`` at each of them and at random times).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from proteus.faults import crash_point

FORMAT = "proteus-kb"
FORMAT_VERSION = 1


class KBError(RuntimeError):
    """A knowledge base that cannot be opened or used as asked (the message names file, task or key)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, point: str | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if point:
        crash_point(point)  # tests: killed with the data in its temporary file (proteus.faults)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class KnowledgeBase:
    """A directory holding a PROTEUS knowledge base. Use :meth:`open` or :meth:`create`."""

    def __init__(self, root: str | Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest

    # ------------------------------------------------------------------ open / create
    @staticmethod
    def exists(root: str | Path) -> bool:
        return (Path(root) / "manifest.json").is_file()

    @classmethod
    def create(cls, root: str | Path, header: dict[str, Any]) -> KnowledgeBase:
        root = Path(root)
        if cls.exists(root):
            raise KBError(f"{root}: a knowledge base already exists here")
        (root / "objects").mkdir(parents=True, exist_ok=True)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **header,
            "tasks": [],
            "head": None,
        }
        kb = cls(root, manifest)
        _atomic_write(root / "manifest.json", json.dumps(manifest, indent=1).encode())
        return kb

    @classmethod
    def open(cls, root: str | Path, verify: bool = True) -> KnowledgeBase:
        root = Path(root)
        path = root / "manifest.json"
        if not path.is_file():
            raise KBError(f"{root}: no knowledge base here (missing {path.name})")
        try:
            manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KBError(f"{path}: corrupt manifest ({e})") from None
        if manifest.get("format") != FORMAT:
            raise KBError(f"{path}: not a proteus knowledge base (format={manifest.get('format')!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise KBError(
                f"{path}: knowledge base format version {manifest.get('format_version')} is not supported "
                f"by this proteus (it reads version {FORMAT_VERSION})"
            )
        kb = cls(root, manifest)
        if verify:
            kb.verify()
        return kb

    # ------------------------------------------------------------------ objects
    def _objects(self) -> list[tuple[str, str]]:
        refs = [(t["object"], t["sha256"]) for t in self.manifest["tasks"]]
        if self.manifest.get("head"):
            refs.append((self.manifest["head"]["object"], self.manifest["head"]["sha256"]))
        return refs

    def verify(self) -> None:
        """Check that every referenced object exists and has the recorded sha256."""
        for rel, sha in self._objects():
            self._read_verified(rel, sha)

    def _read_verified(self, rel: str, sha: str) -> bytes:
        path = self.root / rel
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise KBError(f"{path}: missing from the knowledge base") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha:
            raise KBError(
                f"{path}: checksum mismatch (expected {sha[:16]}…, found {actual[:16]}…): "
                "the file was truncated or edited"
            )
        return data

    def read(self, rel: str, sha: str) -> dict[str, torch.Tensor]:
        data = self._read_verified(rel, sha)
        try:
            return st_load(data)
        except Exception as e:  # safetensors raises several types for bad headers
            raise KBError(f"{self.root / rel}: not a valid safetensors file ({e})") from None

    def write_object(self, kind: str, tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
        """Write a content-addressed object; returns (relative path, sha256). Not yet committed."""
        data = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        sha = hashlib.sha256(data).hexdigest()
        rel = f"objects/{kind}-{sha[:16]}.safetensors"
        path = self.root / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, data, "commit:tmp")
        return rel, sha

    # ------------------------------------------------------------------ commit
    def commit(self, manifest: dict[str, Any]) -> None:
        """Make ``manifest`` the KB's state (atomic), then sweep unreferenced objects."""
        manifest = dict(manifest)
        manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        crash_point("commit:objects")
        data = json.dumps(manifest, indent=1).encode()
        _atomic_write(self.root / "manifest.json", data, "commit:manifest-tmp")
        self.manifest = manifest
        crash_point("commit:manifest")
        self.sweep()

    def sweep(self) -> None:
        keep = {Path(rel).name for rel, _ in self._objects()}
        for p in (self.root / "objects").glob("*"):
            if p.name not in keep:
                p.unlink(missing_ok=True)
        for p in self.root.glob(".manifest.json.tmp-*"):
            p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ checks
    def check_backbone(self, identity: dict[str, Any]) -> None:
        """Refuse a KB written under another backbone, other weights or another adapted split."""
        mine = self.manifest.get("backbone", {})
        for key in ("name", "weights_id", "weights_sha256", "embed_dim", "split"):
            if mine.get(key) != identity.get(key):
                raise KBError(
                    f"{self.root}: knowledge base was written with backbone {key}={mine.get(key)!r}, "
                    f"but this run uses {key}={identity.get(key)!r}"
                )

    def nbytes(self) -> dict[str, int]:
        out = {"manifest": (self.root / "manifest.json").stat().st_size}
        for t in self.manifest["tasks"]:
            out[f"task{t['index']}"] = (self.root / t["object"]).stat().st_size
        if self.manifest.get("head"):
            out["head"] = (self.root / self.manifest["head"]["object"]).stat().st_size
        return out
