"""Hostile knowledge bases from the adversarial review (docs/reliability.md, "A knowledge base from someone
else" and "Budgets"): manifests that are links, FIFOs or devices, a sparse object of 3 GB, JSON nested
deep or with huge integers or duplicate keys, a lowered format version, a signed KB rolled back, class names
that would drive a terminal, a FIFO key file or image. Each command ends quickly with exit code 1 (``kb
verify``) or 2, never an internal error, and leaves the knowledge base as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import proteus.kb as kbmod
from kbfiles import read_manifest, write_manifest
from proteus.cli import main
from proteus.kb import KBError, KnowledgeBase, manifest_checksum
from tiny import TINY, folder_args

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A hang is a failure (30 s), not a stuck test run."""

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError("hung for 30 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def kb2(world: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kb = tmp_path_factory.mktemp("hostile") / "kb"
    shutil.copytree(world["kb1"], kb)
    assert (
        main(["learn", "--kb", str(kb), "--task", "2", *folder_args(world["tree"], world["spec"]), *TINY])
        == 0
    )
    assert kbmod.problems(kb) == []
    return kb


def _files(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name != ".lock" and not p.is_symlink() and p.is_file():
            h = hashlib.sha256()
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "internal error" not in text and "Traceback" not in text, text
    return rc, text


def _commands(kb: Path, img: Path) -> list[tuple[list[str], int]]:
    return [
        (["kb", "verify", str(kb)], 1),
        (["kb", "info", str(kb)], 2),
        (["predict", "--kb", str(kb), str(img), "-q"], 2),
    ]


def _img(world: dict) -> Path:
    return world["tree"] / "test" / "a" / "0.png"


def _manifest(kb: Path, name: str = "manifest.json") -> dict[str, Any]:
    """Manifest ``name`` with its task records (format 4: read from its record segments)."""
    return read_manifest(kb, name)


def _write(kb: Path, m: dict[str, Any], name: str = "manifest.json") -> None:
    write_manifest(kb, m, name)


def _edit_segment(kb: Path, edit: Any) -> None:
    """Edit the text of the first record segment as someone who received the knowledge base could: the
    segment written under the name of its new hash, its reference and the manifest's checksum updated."""
    m = json.loads((kb / "manifest.json").read_text())
    ref = m["segments"][0]
    data = edit((kb / ref["object"]).read_text()).encode()
    sha = hashlib.sha256(data).hexdigest()
    ref.update(object=f"objects/records-{sha[:16]}.json", sha256=sha, bytes=len(data))
    (kb / ref["object"]).write_bytes(data)
    m["checksum"] = manifest_checksum(m)
    (kb / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("attack", ["outside", "etc-passwd", "dev-zero", "fifo", "directory"])
def test_a_manifest_that_is_not_a_regular_file_inside_the_kb_is_refused(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], attack: str
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    outside = tmp_path / "outside.json"
    outside.write_bytes((kb / "manifest.json").read_bytes())  # a valid manifest, outside the KB
    (kb / "manifest.json").unlink()
    if attack == "fifo":
        os.mkfifo(kb / "manifest.json")
    elif attack == "directory":
        (kb / "manifest.json").mkdir()
    else:
        target = {"outside": outside, "etc-passwd": Path("/etc/passwd"), "dev-zero": Path("/dev/zero")}[
            attack
        ]
        (kb / "manifest.json").symlink_to(target)
    before = _files(kb)
    for argv, expected in _commands(kb, _img(world)):
        rc, text = _run(argv, capsys)
        assert rc == expected, (argv, text)
        assert "manifest.json" in text and ("symbolic link" in text or "not a regular file" in text), text
    assert _files(kb) == before


@pytest.mark.parametrize("attack", ["fifo", "dev-zero", "outside"])
def test_a_previous_manifest_that_is_not_a_regular_file_is_reported_and_nothing_hangs(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], attack: str
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    outside = tmp_path / "outside.json"
    outside.write_bytes((kb / "manifest.prev.json").read_bytes())
    (kb / "manifest.prev.json").unlink()
    if attack == "fifo":
        os.mkfifo(kb / "manifest.prev.json")
    else:
        (kb / "manifest.prev.json").symlink_to(outside if attack == "outside" else Path("/dev/zero"))
    before = _files(kb)
    rc, text = _run(["kb", "verify", str(kb)], capsys)
    assert rc == 1 and "manifest.prev.json" in text, text
    assert _run(["kb", "info", str(kb)], capsys)[0] == 0
    assert _run(["predict", "--kb", str(kb), str(_img(world)), "-q"], capsys)[0] == 0
    rc, text = _run(["kb", "gc", str(kb)], capsys)  # unreadable: nothing swept, the lock released
    assert rc == 0 and "removed 0 file(s)" in text, text
    assert _run(["kb", "undo", str(kb)], capsys)[0] == 2
    assert _files(kb) == before and kbmod.lock_holder(kb) is None


def test_a_sparse_object_is_refused_by_its_size_before_it_is_read(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    obj = kb / _manifest(kb)["tasks"][0]["object"]
    obj.unlink()
    with obj.open("wb") as f:
        f.truncate(3 << 30)  # 3 GB, no disk space
    for argv, expected in _commands(kb, _img(world)):
        rc, text = _run(argv, capsys)
        assert rc == expected and "size mismatch" in text and "3221225472" in text, (argv, text)
    m = _manifest(kb)  # a manifest of format 2 records no size: the budget refuses it
    for key in ("object_bytes", "kb_id", "sequence", "segments", "parent", "num_tasks"):
        del m[key]
    m["format_version"] = 2
    (kb / "manifest.prev.json").unlink()
    _write(kb, m)
    rc, text = _run(["kb", "verify", str(kb)], capsys)
    assert rc == 1 and "over the limit of 2147483648 bytes (kb_object_bytes)" in text, text


def test_objects_whose_recorded_sizes_add_up_over_the_total_budget_are_refused_before_any_is_read(
    kb2: Path,
    world: dict,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sizes a manifest records for its objects, added up, over ``kb_total_bytes``: every command names
    the budget (each object alone within ``kb_object_bytes``), and the environment raises it."""
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    total = sum(p.stat().st_size for p in (kb / "objects").iterdir())
    monkeypatch.setenv("PROTEUS_LIMIT_KB_TOTAL_BYTES", str(total // 2))
    for argv, expected in _commands(kb, _img(world)):
        rc, text = _run(argv, capsys)
        assert rc == expected and "(kb_total_bytes)" in text and "PROTEUS_LIMIT_KB_TOTAL_BYTES" in text, text
    monkeypatch.setenv("PROTEUS_LIMIT_KB_TOTAL_BYTES", str(2 * total))
    assert _run(["kb", "verify", str(kb)], capsys)[0] == 0


#: a child that checks a knowledge base (``kb verify``'s check: argv[1]) once to import what checking needs,
#: then another (argv[2]), and prints how far its peak resident memory rose during the second, in MiB
_CHECK_PEAK = r"""
import sys
from pathlib import Path
import proteus.kb as kbmod

def hwm():
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))

kbmod.check(sys.argv[1])
before = hwm()
report = kbmod.check(sys.argv[2])
print((hwm() - before) >> 10, len(report.errors))
print("\n".join(report.errors))
"""


def test_a_sparse_object_of_its_recorded_size_and_sha256_is_checked_in_bounded_memory(
    kb2: Path, tmp_path: Path
) -> None:
    """An object of 512 MiB of zeros (a sparse file: nothing on disk) whose true size and sha256 the manifest
    records, as an attacker who writes the manifest can: `kb verify` hashes it as a stream and finds it is
    no safetensors file, its peak resident memory rising by a few MiB, not by the object (it used to read
    the object whole and copy it twice: 4.9 GB for one of 2 GiB)."""
    import subprocess
    import sys

    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    size = 512 << 20
    h, block = hashlib.sha256(), bytes(1 << 24)
    for _ in range(size // len(block)):
        h.update(block)
    sha = h.hexdigest()
    m = read_manifest(kb)
    name = f"objects/task000-{sha[:16]}.safetensors"
    with (kb / name).open("wb") as f:
        f.truncate(size)
    m["tasks"][0].update(object=name, sha256=sha, bytes=size)
    write_manifest(kb, m)
    out = subprocess.run(
        [sys.executable, "-c", _CHECK_PEAK, str(kb2), str(kb)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    rise, n_errors = map(int, out[0].split())
    assert n_errors >= 1 and any(name in e and "not a valid safetensors file" in e for e in out[1:]), out
    assert rise < 128, f"the check's peak resident memory rose {rise} MiB for an object of 512 MiB"


@pytest.mark.parametrize(
    ("edit", "words", "where"),
    [
        (lambda text: "[" * 200_000 + "]" * 200_000, "nested too deeply", "manifest"),
        (lambda text: text.replace('"segments":', '"n": ' + "9" * 5000 + ', "segments":', 1), "5000 digits",
         "manifest"),
        (lambda text: '{"segments": [], ' + text[1:], "appears twice", "manifest"),
        (lambda text: text.replace('"class_names": ["', '"class_names": ["\\ud800', 1), "lone surrogate",
         "segment"),
        (lambda text: '{"tasks": [], ' + text[1:], "appears twice", "segment"),
        (lambda text: text.replace('"tasks":', '"n": ' + "9" * 5000 + ', "tasks":', 1), "5000 digits",
         "segment"),
    ],
)  # fmt: skip
def test_json_the_parser_refuses(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, words: str,
    where: str,
) -> None:  # fmt: skip
    """manifest.json, and a record segment (format 4) renamed to its new hash and named in a manifest whose
    checksum was recomputed: every JSON the parser refuses is refused by name."""
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    if where == "segment":
        _edit_segment(kb, edit)
    else:
        (kb / "manifest.json").write_text(edit((kb / "manifest.json").read_text()))
    before = _files(kb)
    for argv, expected in _commands(kb, _img(world)):
        rc, out = _run(argv, capsys)
        assert rc == expected and words in out, (argv, out)
    assert _files(kb) == before


def test_a_lowered_format_version_is_refused(
    kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    m = _manifest(kb)
    m["tasks"][0]["class_names"][0] = "edited"
    m["format_version"] = 1
    del m["checksum"]
    (kb / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError, match="which only version 3 writes: the version was lowered by hand"):
        KnowledgeBase.open(kb)
    for key in ("sequence", "kb_id", "object_bytes"):
        del m[key]
    (kb / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError, match="which only version 4 writes: the version was lowered by hand"):
        KnowledgeBase.open(kb)
    for key in ("segments", "parent", "num_tasks"):
        del m[key]
    (kb / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KBError, match="the previous commit has version 5: the version was lowered by hand"):
        KnowledgeBase.open(kb)
    rc, text = _run(["kb", "verify", str(kb)], capsys)
    assert rc == 1 and "downgrade" in text


def test_a_signed_kb_cannot_be_rolled_back(
    kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    key = tmp_path / "kb.key"
    key.write_text("0123456789abcdef" * 4)
    key.chmod(0o600)
    assert _run(["kb", "sign", str(kb), "--key-file", str(key)], capsys)[0] == 0
    m = json.loads((kb / "manifest.json").read_text())
    rc, text = _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)
    assert rc == 0 and f"OK, signed commit {m['sequence']} of knowledge base {m['kb_id'][:8]}" in text, text
    recorded = {"at": {os.path.realpath(kb): {"kb_id": m["kb_id"], "sequence": m["sequence"]}}}
    assert json.loads((tmp_path / "kb.key.sequences").read_text()) == recorded
    shutil.copy(kb / "manifest.prev.json", kb / "manifest.json")  # one task lost, validly signed
    rc, text = _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)
    assert rc == 1 and f"rollback refused: manifest.json is commit {m['sequence'] - 1}" in text, text
    assert _run(["kb", "info", str(kb), "--key-file", str(key)], capsys)[0] == 2
    other = tmp_path / "copy.key"  # the same key elsewhere, nothing recorded beside it: the history of
    other.write_text("0123456789abcdef" * 4)  # commits (format 4) still holds the newer one
    other.chmod(0o600)
    rc, text = _run(["kb", "verify", str(kb), "--key-file", str(other)], capsys)
    assert rc == 1 and f"is commit {m['sequence']} of the same knowledge base" in text and "put back" in text
    rc, text = _run(
        ["kb", "verify", str(kb), "--key-file", str(other), "--min-sequence", str(m["sequence"])], capsys
    )
    assert rc == 1 and "below --min-sequence" in text
    # duplicate keys in front of a validly signed manifest
    (kb / "manifest.json").write_text('{"tasks": [], "backbone": {"name": "NOT"}, ' + json.dumps(m)[1:])
    rc, text = _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)
    assert rc == 1 and "appears twice" in text
    # an undo with the key is a new commit: its sequence goes up
    (kb / "manifest.json").write_text(json.dumps(m))
    assert _run(["kb", "undo", str(kb), "--key-file", str(key)], capsys)[0] == 0
    assert _manifest(kb)["sequence"] == m["sequence"] + 1
    assert _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)[0] == 0


def _signed(kb: Path, key: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert _run(["kb", "sign", str(kb), "--key-file", str(key)], capsys)[0] == 0
    return json.loads((kb / "manifest.json").read_text())


def test_another_knowledge_base_signed_with_the_key_is_refused_in_its_place_and_copies_count_apart(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One key, several knowledge bases: the signed manifest of another one (its objects copied too) put in
    this one's directory is refused by name, unless ``--kb-id`` names it; a copy of a knowledge base in
    another directory commits under the key without its sequences counting against the original; a record
    beside the key that cannot be read makes ``kb verify`` refuse to vouch unless ``--min-sequence`` is
    given."""
    key = tmp_path / "kb.key"
    key.write_text("0123456789abcdef" * 4)
    key.chmod(0o600)
    kb, other = tmp_path / "kb", tmp_path / "other"
    shutil.copytree(kb2, kb)
    assert (
        main(["learn", "--kb", str(other), "--task", "1", *folder_args(world["tree"], world["spec"]), *TINY])
        == 0
    )
    mine, theirs = _signed(kb, key, capsys), _signed(other, key, capsys)
    assert mine["kb_id"] != theirs["kb_id"]
    assert _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)[0] == 0
    for p in (other / "objects").iterdir():
        shutil.copy(p, kb / "objects" / p.name)
    shutil.copy(other / "manifest.json", kb / "manifest.json")
    rc, text = _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)
    assert rc == 1 and f"is of knowledge base {theirs['kb_id'][:8]}, but this key accepted" in text, text
    assert f"--kb-id {theirs['kb_id'][:8]}" in text
    assert _run(["kb", "info", str(kb), "--key-file", str(key)], capsys)[0] == 2
    rc, text = _run(["kb", "verify", str(kb), "--key-file", str(key), "--kb-id", mine["kb_id"][:8]], capsys)
    assert rc == 1 and f"not {mine['kb_id'][:8]} (--kb-id)" in text, text
    rc, text = _run(
        ["kb", "verify", str(kb), "--key-file", str(key), "--kb-id", theirs["kb_id"][:12]], capsys
    )
    assert rc == 0, text  # replaced on purpose: now the one accepted here
    assert _run(["kb", "verify", str(kb), "--key-file", str(key)], capsys)[0] == 0
    # a copy elsewhere moves on (an undo with the key is a commit); the original's sequence still verifies
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    shutil.copytree(kb2, orig)
    first = _signed(orig, key, capsys)
    shutil.copytree(orig, copy)
    rc, text = _run(["kb", "undo", str(copy), "--key-file", str(key)], capsys)
    assert rc == 0, text
    assert json.loads((copy / "manifest.json").read_text())["sequence"] > first["sequence"]
    assert _run(["kb", "verify", str(orig), "--key-file", str(key)], capsys)[0] == 0
    # an unreadable record: verify will not vouch (exit 1) unless --min-sequence stands in for it
    (tmp_path / "kb.key.sequences").write_text("{not json")
    rc, text = _run(["kb", "verify", str(orig), "--key-file", str(key)], capsys)
    assert rc == 1 and "cannot read the accepted sequences" in text and "--min-sequence" in text, text
    rc, text = _run(["kb", "verify", str(orig), "--key-file", str(key), "--min-sequence", "0"], capsys)
    assert rc == 0, text


def test_special_key_files_and_images(kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rc, text = _run(["kb", "verify", str(kb2), "--key-file", str(fifo)], capsys)
    assert rc == 2 and "not a regular file (a FIFO" in text
    rc, text = _run(["predict", "--kb", str(kb2), str(fifo), "-q"], capsys)
    assert rc == 2 and "not a regular file (a FIFO" in text
    rc, text = _run(["predict", "--kb", str(kb2), "/dev/zero", "-q"], capsys)
    assert rc == 2 and "character device" in text


def test_class_names_cannot_drive_the_terminal(
    kb2: Path, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)
    m = _manifest(kb)
    m["tasks"][0]["class_names"] = ["\x1b[31mred\x1b[0m", "\u202eevil\u202c\n  task 9: fake line"]
    (kb / "manifest.prev.json").unlink()
    _write(kb, m)
    for argv in (
        ["kb", "list", str(kb)],
        ["kb", "info", str(kb)],
        ["predict", "--kb", str(kb), str(_img(world))],
    ):
        rc, text = _run(argv, capsys)
        assert (
            rc == 0
            and "\x1b" not in text
            and "\u202e" not in text
            and "task 9: fake" not in text.split("\n")[0]
        )
        assert "task 9: fake line" not in [line.strip() for line in text.splitlines()], text
    rc, text = _run(["kb", "list", str(kb)], capsys)
    assert "\\x1b[31mred" in text and "\\u202eevil" in text


def test_two_identical_states_have_the_same_checksum(
    kb2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum covers content: time stamps and the KB's random identity are outside it."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(kb2, a)
    shutil.copytree(kb2, b)
    import proteus.kb.commit

    for root, stamp in ((a, "2026-01-01T00:00:00Z"), (b, "2027-06-01T12:00:00Z")):
        monkeypatch.setattr(proteus.kb.commit, "_now", lambda stamp=stamp: stamp)
        kb = KnowledgeBase.open(root)
        m = dict(kb.manifest)
        m["tasks"] = [{**t, "learned": stamp} for t in m["tasks"]]
        kb.commit(m)
    ma, mb = _manifest(a), _manifest(b)
    assert ma["updated"] != mb["updated"] and ma["tasks"][0]["learned"] != mb["tasks"][0]["learned"]
    assert ma["checksum"] == mb["checksum"]
    assert manifest_checksum({**ma, "kb_id": "another"}) == ma["checksum"]


def test_a_full_disk_lets_gc_run_and_ends_other_writes_in_one_line(
    kb2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk the write lock's holder record cannot be written: the lock (a flock) still holds, so
    `kb gc`, the command that frees space, runs; a write the disk refuses ends in one line naming the file
    and what to do (exit 2), not an internal error."""
    import errno

    import proteus.kb.lock as lock

    kb = tmp_path / "kb"
    shutil.copytree(kb2, kb)

    def full(*a: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock.os, "pwrite", full)
    rc, text = _run(["kb", "gc", str(kb)], capsys)
    assert rc == 0, text
    monkeypatch.undo()

    def refused(self: KnowledgeBase) -> list[str]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(kb / "objects" / "x.tmp"))

    monkeypatch.setattr(KnowledgeBase, "gc", refused)
    rc, text = _run(["kb", "gc", str(kb)], capsys)
    assert rc == 2 and f"error: {kb / 'objects' / 'x.tmp'}: No space left on device; free some space" in text
    assert "internal error" not in text and len(text.strip().splitlines()) == 1, text
