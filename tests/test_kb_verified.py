"""What a store remembers it verified (:mod:`proteus.kb.verified`): an object file unchanged since it was
hashed is not hashed again, a state checked (or committed) by this proteus is not checked again, and
anything changed, copied or edited is verified in full."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import proteus.kb.files
import proteus.kb.objects
from proteus.kb import KBError, KnowledgeBase


class Spy:
    """Counts the tensor objects hashed and the states checked while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hashed: list[str] = []
        self.checked = 0
        sha, check = proteus.kb.files._check_sha, proteus.kb.objects.check_objects

        def spy_sha(shown: Any, want: str, got: str) -> None:
            if str(shown).endswith(".safetensors"):  # tensor objects (record segments: small, always hashed)
                self.hashed.append(str(shown))
            sha(shown, want, got)

        def spy_check(*args: Any, **kwargs: Any) -> list[str]:
            self.checked += 1
            return check(*args, **kwargs)

        monkeypatch.setattr(proteus.kb.files, "_check_sha", spy_sha)
        monkeypatch.setattr(proteus.kb.objects, "check_objects", spy_check)

    def reset(self) -> None:
        self.hashed.clear()
        self.checked = 0


def _open_and_read(kb: Path) -> None:
    KnowledgeBase.open(kb).read_state()


def test_a_verified_object_or_state_is_not_verified_again_until_it_changes(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)  # a copy: new files, never verified
    spy = Spy(monkeypatch)
    _open_and_read(kb)
    objects = sorted(p.name for p in (kb / "objects").glob("*.safetensors"))
    assert sorted(Path(h).name for h in spy.hashed) == objects and spy.checked == 1  # all of it, once
    spy.reset()
    _open_and_read(kb)
    assert spy.hashed == [] and spy.checked == 0  # verified before, unchanged since
    assert not list(kb.glob("*verified*")) and list(Path(os.environ["PROTEUS_CACHE_DIR"]).rglob("*.json"))
    # a file rewritten with the same bytes has a new identity: hashed again (the state stays checked)
    target = kb / "objects" / objects[0]
    data = target.read_bytes()
    target.unlink()
    target.write_bytes(data)
    spy.reset()
    _open_and_read(kb)
    assert [Path(h).name for h in spy.hashed] == [objects[0]] and spy.checked == 0
    # and a byte changed in place, its size kept, is refused as the first open would
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(KBError, match="checksum mismatch"):
        KnowledgeBase.open(kb)
    target.write_bytes(data)
    # PROTEUS_VERIFY=always: everything, every time
    monkeypatch.setenv("PROTEUS_VERIFY", "always")
    spy.reset()
    _open_and_read(kb)
    assert len(spy.hashed) == len(objects) and spy.checked == 1


def test_a_state_this_proteus_committed_is_not_checked_again(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner's commit records its state and objects as verified: the next process that opens it reads
    them without hashing or checking them again."""
    from proteus import Proteus

    kb = tmp_path / "kb"
    shutil.copytree(world["kb1"], kb)
    clf = Proteus.load(kb, progress=False)
    clf.save(tmp_path / "saved")  # every object written by this proteus
    spy = Spy(monkeypatch)
    _open_and_read(tmp_path / "saved")
    assert spy.hashed == [] and spy.checked == 0
