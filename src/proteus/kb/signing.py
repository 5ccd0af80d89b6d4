"""An optional signature of a knowledge base: an HMAC-SHA256 (Python's ``hmac``) of its manifest under a
secret key shared by who writes and who reads it (``proteus kb sign KB --key-file F``).

The manifest holds it as ``"signature": {"alg": "hmac-sha256", "key_id": <first 8 hex digits of
sha256(key)>, "mac": <64 hex digits>}``. The MAC covers the canonical JSON (sorted keys, no whitespace,
as :func:`~proteus.kb.files.manifest_checksum`) of the manifest without ``signature`` and ``checksum``:
every other key, time stamps included. The checksum is computed after signing, over the manifest with its
signature. Objects are covered through their sha256, which the manifest records.

A key is the bytes of a key file, trailing whitespace removed (a hex string and its newline work), at
least 16 bytes. ``KnowledgeBase.open(root, key=...)`` checks the signature, and so does every ``open``
when ``$PROTEUS_KB_KEY_FILE`` names a key file; a commit made with a key signs the new manifest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from proteus.kb.files import MANIFEST, KBError

ALG = "hmac-sha256"
#: environment variable naming the key file that every ``KnowledgeBase.open`` checks signatures with
KEY_ENV = "PROTEUS_KB_KEY_FILE"
MIN_KEY_BYTES = 16
#: keys the MAC leaves out (besides these, it covers the whole manifest)
UNSIGNED_KEYS = ("signature", "checksum")


def read_key_file(path: str | Path, source: str = "--key-file") -> bytes:
    """The key in file ``path`` (trailing whitespace removed); :class:`KBError` naming the file when it
    cannot be read or is too short. ``source`` says where the name came from."""
    path = Path(path)
    try:
        key = path.read_bytes().rstrip()
    except OSError as e:
        raise KBError(f"{path} ({source}): cannot read the key file ({e.strerror or e})") from None
    if len(key) < MIN_KEY_BYTES:
        raise KBError(
            f"{path} ({source}): a key of {len(key)} bytes is too short (at least {MIN_KEY_BYTES}); "
            'make one with: python -c "import secrets; print(secrets.token_hex(32))" > KEYFILE'
        )
    return key


def key_from_env() -> bytes | None:
    """The key of ``$PROTEUS_KB_KEY_FILE`` (None when it is unset or empty)."""
    name = os.environ.get(KEY_ENV)
    return read_key_file(name, f"${KEY_ENV}") if name else None


def key_id(key: bytes) -> str:
    """A short public name of a key: the first 8 hex digits of its sha256."""
    return hashlib.sha256(key).hexdigest()[:8]


def signed_bytes(manifest: dict[str, Any]) -> bytes:
    """What the MAC covers: the canonical JSON of ``manifest`` without :data:`UNSIGNED_KEYS` (round-tripped
    through JSON first, as the checksum is, so that what is signed is what a reader parses)."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in UNSIGNED_KEYS}))
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signature(manifest: dict[str, Any], key: bytes) -> dict[str, str]:
    """The ``signature`` entry of ``manifest`` under ``key``."""
    mac = hmac.new(key, signed_bytes(manifest), hashlib.sha256).hexdigest()
    return {"alg": ALG, "key_id": key_id(key), "mac": mac}


def signature_problem(root: Path, manifest: dict[str, Any], key: bytes, name: str = MANIFEST) -> str | None:
    """None when ``manifest`` (file ``name`` of the knowledge base at ``root``) carries a valid signature
    under ``key``, else what is wrong."""
    sig = manifest.get("signature")
    mine = key_id(key)
    if sig is None:
        return (
            f"{root}: {name} is not signed, and a key (id {mine}) was given: refuse it, or if you trust "
            f"it, sign it with `proteus kb sign {root} --key-file KEYFILE`"
        )
    if not isinstance(sig, dict) or sig.get("alg") != ALG or not isinstance(sig.get("mac"), str):
        return f"{root}: {name} has a signature this proteus cannot check (alg {_alg(sig)}, expected {ALG})"
    expected = hmac.new(key, signed_bytes(manifest), hashlib.sha256).hexdigest()
    if hmac.compare_digest(expected, sig["mac"]):
        return None
    if sig.get("key_id") != mine:
        return (
            f"{root}: signature mismatch: {name} was signed with key id {sig.get('key_id')!r}, not with the "
            f"key given (id {mine})"
        )
    return f"{root}: signature mismatch: {name} was edited after it was signed (key id {mine})"


def _alg(sig: Any) -> str:
    return repr(sig.get("alg")) if isinstance(sig, dict) else "unknown"
