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

Rollback and substitution: a manifest of format 3 carries ``sequence`` (one more at every commit, ``undo``
included) and ``kb_id`` (the knowledge base's random identity), both signed. A reader with a key read from a
file (:class:`SigningKey`) records, beside the key (``<key file>.sequences``), per knowledge-base directory
(its resolved path) the identity and the highest sequence it accepted there, and refuses a lower sequence
(a signed manifest copied back over a newer one: ``cp manifest.prev.json manifest.json``, or an old signed
copy) and another identity (another knowledge base's signed manifest put in its place) by name. Copies of a
knowledge base in other directories keep separate records, so that one copy's commits never count against
another's. ``--min-sequence N`` (:attr:`SigningKey.min_sequence`) sets the floor by hand, and ``--kb-id ID``
(:attr:`SigningKey.kb_id`) pins the identity by hand (a fresh reader, or a directory replaced on purpose).
``kb verify`` (:attr:`SigningKey.strict`) refuses to vouch when the record cannot be read or written,
unless ``--min-sequence`` is given. A manifest signed without a sequence (format 2) is accepted with a
warning: sign it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from proteus.errors import ProteusError
from proteus.kb.files import EXPANDED_KEYS, MANIFEST, KBError, log
from proteus.untrusted import load_json, read_regular

ALG = "hmac-sha256"
#: environment variable naming the key file that every ``KnowledgeBase.open`` checks signatures with
KEY_ENV = "PROTEUS_KB_KEY_FILE"
MIN_KEY_BYTES = 16
#: keys the MAC leaves out (besides these, it covers the whole manifest)
UNSIGNED_KEYS = ("signature", "checksum")


class SigningKey(bytes):
    """A key (its bytes) with where it came from: ``path``, the key file (the sequences it accepted are
    recorded beside it), ``min_sequence``, the lowest sequence a signed manifest may have (None: only the
    recorded one), ``kb_id``, the identity (or its first hex digits, at least 8) the signed manifest must
    carry (None: the one recorded for its directory), and ``strict``: a record that cannot be read or
    written is a problem, not a warning, unless ``min_sequence`` is given (``kb verify``)."""

    path: Path | None
    min_sequence: int | None
    kb_id: str | None
    strict: bool

    def __new__(
        cls, key: bytes, path: Path | None = None, min_sequence: int | None = None, kb_id: str | None = None
    ) -> SigningKey:
        out = super().__new__(cls, key)
        out.path, out.min_sequence, out.kb_id, out.strict = path, min_sequence, kb_id, False
        return out


def read_key_file(
    path: str | Path, source: str = "--key-file", min_sequence: int | None = None
) -> SigningKey:
    """The key in file ``path`` (trailing whitespace removed; a regular file, never a FIFO); :class:`KBError`
    naming the file when it cannot be read, is too short, or lets anyone but its owner read or write it (its
    mode named, as ssh refuses such a private key). ``source`` says where the name came from."""
    path = Path(path)
    try:
        key = read_regular(path, "side_file_bytes").rstrip()
        mode = path.stat().st_mode & 0o777
    except OSError as e:
        raise KBError(f"{path} ({source}): cannot read the key file ({e.strerror or e})") from None
    if mode & 0o077:
        raise KBError(
            f"{path} ({source}): its mode {mode:04o} lets others than its owner use the key; make it "
            f"private: chmod 600 {path}"
        )
    if len(key) < MIN_KEY_BYTES:
        raise KBError(
            f"{path} ({source}): a key of {len(key)} bytes is too short (at least {MIN_KEY_BYTES}); "
            'make one with: (umask 077; python -c "import secrets; print(secrets.token_hex(32))" > KEYFILE)'
        )
    return SigningKey(key, path, min_sequence)


def key_from_env() -> SigningKey | None:
    """The key of ``$PROTEUS_KB_KEY_FILE`` (None when it is unset or empty)."""
    name = os.environ.get(KEY_ENV)
    return read_key_file(name, f"${KEY_ENV}") if name else None


def key_id(key: bytes) -> str:
    """A short public name of a key: the first 8 hex digits of its sha256."""
    return hashlib.sha256(key).hexdigest()[:8]


def signed_bytes(manifest: dict[str, Any]) -> bytes:
    """What the MAC covers: the canonical JSON of ``manifest`` without :data:`UNSIGNED_KEYS` (round-tripped
    through JSON first, as the checksum is, so that what is signed is what a reader parses)."""
    skip = UNSIGNED_KEYS + (
        EXPANDED_KEYS if _version(manifest) >= 4 else ()
    )  # format 4: manifest.json's fields
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in skip}))
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _version(manifest: dict[str, Any]) -> int:
    v = manifest.get("format_version")
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


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


# ------------------------------------------------------------------------------------------ sequences
def _sequence(manifest: dict[str, Any]) -> int | None:
    return _count(manifest.get("sequence"))


def _count(v: Any) -> int | None:
    """``v`` when it is an integer (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _record_path(key: bytes) -> Path | None:
    path = getattr(key, "path", None)
    return path.with_name(path.name + ".sequences") if isinstance(path, Path) else None


#: the record's key holding, per knowledge-base directory, the identity and sequence accepted there (its
#: other keys are the records of older releases: the highest sequence per identity, wherever it was read)
AT = "at"


class RecordError(ProteusError):
    """The record of accepted sequences beside a key cannot be read or written (what and why)."""


def _record(key: bytes) -> dict[str, Any]:
    """The record beside the key ({} when there is none); :class:`RecordError` when it cannot be read."""
    record = _record_path(key)
    if record is None:
        return {}
    try:
        doc = load_json(read_regular(record, "side_file_bytes"), str(record))
    except FileNotFoundError:
        return {}
    except (OSError, ProteusError) as e:
        why = getattr(e, "strerror", None) or e
        raise RecordError(f"{record}: cannot read the accepted sequences ({why})") from None
    return doc if isinstance(doc, dict) else {}


def _recorded(key: bytes, root: Path, kb_id: str | None) -> tuple[dict[str, Any] | None, int | None]:
    """What the key's record holds for directory ``root``: its entry ({"kb_id", "sequence"}) and the highest
    sequence of ``kb_id``; an older release's entry by identity counts only while no directory holds it."""
    doc = _record(key)
    at = _dirs(doc)
    entry = at.get(_where(root))
    entry = entry if isinstance(entry, dict) and isinstance(entry.get("kb_id"), str) else None
    if entry is not None:
        return entry, _count(entry.get("sequence")) if entry["kb_id"] == kb_id else None
    held = any(isinstance(e, dict) and e.get("kb_id") == kb_id for e in at.values())
    return None, _count(doc.get(kb_id)) if isinstance(kb_id, str) and not held else None


def _dirs(doc: dict[str, Any]) -> dict[str, Any]:
    """The record's entries by directory."""
    at = doc.get(AT)
    return at if isinstance(at, dict) else {}


def _where(root: Path) -> str:
    return os.path.realpath(root)


def sequence_problem(root: Path, manifest: dict[str, Any], key: bytes) -> str | None:
    """None when the (validly signed) ``manifest`` of the knowledge base at ``root`` is neither older than
    what ``key`` accepted there before nor another knowledge base's: its ``sequence`` at least
    ``key.min_sequence`` and the one recorded beside the key for its directory, its ``kb_id`` the one given
    (``key.kb_id``) or else the one recorded for its directory."""
    seq, kb_id = _sequence(manifest), manifest.get("kb_id")
    floor, pinned = getattr(key, "min_sequence", None), getattr(key, "kb_id", None)
    if pinned is not None and not (isinstance(kb_id, str) and kb_id.startswith(pinned.lower())):
        return (
            f"{root}: {MANIFEST} is of knowledge base {_short(kb_id)}, not {pinned} (--kb-id): another "
            "knowledge base's signed manifest was put in its place"
        )
    if seq is None:
        if floor is not None:
            return (
                f"{root}: {MANIFEST} has no sequence number (signed by an older proteus) but --min-sequence "
                f"{floor} was given: sign it again with `proteus kb sign`"
            )
        return None
    if floor is not None and seq < floor:
        return (
            f"{root}: rollback refused: {MANIFEST} is commit {seq}, below --min-sequence {floor}; it is an "
            "older signed state of the knowledge base"
        )
    try:
        entry, last = _recorded(key, root, kb_id if isinstance(kb_id, str) else None)
    except RecordError as e:
        if getattr(key, "strict", False) and floor is None:
            return (
                f"{e}: a rollback cannot be detected without it; give --min-sequence N to verify without it"
            )
        log.warning("%s; only --min-sequence applies", e)
        return None
    if entry is not None and pinned is None and entry["kb_id"] != kb_id:
        return (
            f"{root}: {MANIFEST} is of knowledge base {_short(kb_id)}, but this key accepted knowledge "
            f"base {_short(entry['kb_id'])} in this directory (recorded in {_record_path(key)}): another "
            "knowledge base's signed manifest was put in its place; if you replaced it on purpose, give "
            f"--kb-id {_short(kb_id)}"
        )
    if last is not None and seq < last:
        return (
            f"{root}: rollback refused: {MANIFEST} is commit {seq} of knowledge base {_short(kb_id)}, but "
            f"this key already accepted commit {last} (recorded in {_record_path(key)}): an older signed "
            "state was put back; restore the newer one, or if the rollback is intended remove its entry from "
            "that record"
        )
    return None


def _short(kb_id: Any) -> str:
    return kb_id[:8] if isinstance(kb_id, str) else "(none)"


def accept(manifest: dict[str, Any], key: bytes, root: Path) -> str | None:
    """Record beside the key that ``manifest`` (validly signed, or written with the key) was accepted in
    directory ``root``: later readers with this key refuse a lower sequence, or another identity, there.
    A record that cannot be written is a warning, or what is returned (``key.strict``, without
    ``--min-sequence``)."""
    record, seq, kb_id = _record_path(key), _sequence(manifest), manifest.get("kb_id")
    if record is None or seq is None or not isinstance(kb_id, str):
        return None
    try:
        doc = _record(key)
        at = _dirs(doc)
        entry = at.get(_where(root))
        if (
            isinstance(entry, dict)
            and entry.get("kb_id") == kb_id
            and (_count(entry.get("sequence")) or 0) >= seq > 0
        ):
            return None
        doc[AT] = {**at, _where(root): {"kb_id": kb_id, "sequence": seq}}
        _write_record(record, doc)
    except (OSError, RecordError) as e:
        problem = f"{record}: cannot record the accepted sequence ({getattr(e, 'strerror', None) or e})"
        if getattr(key, "strict", False) and getattr(key, "min_sequence", None) is None:
            return (
                f"{problem}: a later rollback could not be detected; give --min-sequence N to go without it"
            )
        log.warning("%s; rollbacks are caught with --min-sequence only", problem)
    return None


def _write_record(record: Path, doc: dict[str, Any]) -> None:
    tmp = record.with_name(f".{record.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(doc, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, record)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def describe(manifest: dict[str, Any], key: bytes) -> str:
    """What a valid signature vouches for, in words: "signed commit 7 of knowledge base 1a2b3c4d (key id
    …)"."""
    seq, kb_id = _sequence(manifest), manifest.get("kb_id")
    if seq is None:
        return (
            f"signed with key id {key_id(key)}, without a sequence number: sign it again to detect rollbacks"
        )
    ident = f" of knowledge base {kb_id[:8]}" if isinstance(kb_id, str) else ""
    return f"signed commit {seq}{ident} (key id {key_id(key)})"
