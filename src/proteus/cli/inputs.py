"""What a command is given, checked before anything heavy loads: the knowledge base's folder and manifest
(:func:`check_kb`), the image files of ``proteus predict`` (:func:`image_inputs`: folders walked, globs
expanded, paths read from standard input, every file's header checked by
:func:`proteus.images.check_image_file`) and an output file (:func:`output_format`).

Nothing here imports torch (tests/test_cli_fast.py): a missing knowledge base, a run folder given for its
``kb/``, an unreadable manifest or a bad image is refused in a fraction of a second of CPU, before torch,
the knowledge base's objects or a backbone load.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from proteus.budgets import BudgetError
from proteus.errors import ProteusError
from proteus.kb.files import FORMAT, HISTORY, MANIFEST, OBJECTS, PREV_MANIFEST, KBError, read_kb_file
from proteus.untrusted import InputError, load_json

__all__ = ["OUTPUT_FORMATS", "Inputs", "check_kb", "image_inputs", "kb_eval_setting", "output_format"]

#: what a knowledge base's folder holds beside its manifest: a folder holding one of these but no
#: manifest.json is a damaged knowledge base (the loader says what became of it), not a wrong path
_KB_PARTS = (OBJECTS, PREV_MANIFEST, HISTORY)


class UsageError(ProteusError, ValueError):
    """A command line that cannot be carried out (exit code 2)."""


def check_kb(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of the knowledge base at ``path``, checked as far as it can be without
    loading anything: the folder exists, its manifest is a regular file within its budget, JSON, an object
    of a proteus knowledge base. A folder that holds a knowledge base one or two levels down (a run's folder
    given for its ``kb/``) is named in the message. None where no manifest is found but the folder holds a
    knowledge base's other files: the loader says what became of it (an interrupted first commit, a
    deleted manifest and how to restore it)."""
    root = Path(path)
    if not root.exists():
        raise KBError(f"{root}: no knowledge base here (no such directory){_did_you_mean(root)}")
    data = read_kb_file(root, MANIFEST)  # a file given for the folder, a FIFO, a link, over budget: refused
    if data is None:
        if any((root / part).exists() for part in _KB_PARTS):
            return None
        raise KBError(f"{root}: no knowledge base here (missing {MANIFEST}){_did_you_mean(root)}")
    where = str(root / MANIFEST)
    hint = f"restore it or {PREV_MANIFEST}"
    try:
        manifest = load_json(data, where)
    except InputError as e:
        raise KBError(f"{where}: corrupt manifest ({e.reason}); {hint}") from None
    except BudgetError as e:
        raise KBError(f"{e}; {hint}") from None
    if not isinstance(manifest, dict):
        raise KBError(f"{where}: corrupt manifest (a JSON {type(manifest).__name__}, not an object); {hint}")
    if manifest.get("format") != FORMAT:
        shown = repr(manifest.get("format"))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise KBError(f"{where}: not a proteus knowledge base (format={shown})")
    return manifest


def _did_you_mean(root: Path, most: int = 3) -> str:
    """``"; did you mean runs/quickstart/kb?"``: the knowledge bases one or two levels below ``root`` (a run
    folder holds its knowledge base in ``kb/``), or those beside it when ``root`` does not exist."""
    if root.is_dir():
        found = sorted({m.parent for m in (*root.glob(f"*/{MANIFEST}"), *root.glob(f"*/*/{MANIFEST}"))})
    else:
        found = [root.parent / "kb"] if (root.parent / "kb" / MANIFEST).is_file() else []
    if not found:
        return ""
    more = f" (or {len(found) - most} more)" if len(found) > most else ""
    return f"; did you mean {' or '.join(str(p) for p in found[:most])}{more}?"


def kb_eval_setting(manifest: dict[str, Any] | None, key: str, default: int) -> int:
    """The knowledge base's ``eval.<key>`` from its manifest's config (``default`` where it holds none): what
    the loaded learner will use, known before it loads."""
    config = manifest.get("config") if manifest else None
    section = config.get("eval") if isinstance(config, dict) else None
    value = section.get(key) if isinstance(section, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


# ------------------------------------------------------------------------------------------------ images
@dataclass
class Inputs:
    """The image files of a command line: ``files`` to predict, in order; ``skipped``: (path, reason) of the
    unreadable ones (with ``skip_unreadable``); ``ignored``: the files of the folders given that are no
    images (neither by content nor by name: a README, a .DS_Store)."""

    files: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: int = 0


#: a glob's special characters: an argument holding one that names no file is expanded
_GLOB = frozenset("*?[")


def _listed(specs: Iterable[str], stdin: IO[str]) -> Iterator[tuple[str, bool]]:
    """(path, named) of every input: a file as given (named: True), the files of a folder recursively in
    sorted order (hidden ones left out), a glob's matches (folders walked likewise), ``-``'s lines read from
    ``stdin`` (each a path, a folder or a glob)."""
    for spec in specs:
        if spec == "-":
            lines = (line.rstrip("\r\n") for line in stdin)
            yield from _listed((line for line in lines if line.strip()), stdin)
            continue
        if os.path.isdir(spec):
            yield from _walk(spec)
        elif not os.path.lexists(spec) and _GLOB & set(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise UsageError(f"{spec}: no file matches this pattern")
            for m in matches:
                yield from _walk(m) if os.path.isdir(m) else [(m, True)]
        else:
            yield spec, True


def _walk(folder: str) -> Iterator[tuple[str, bool]]:
    for top, dirs, files in os.walk(folder, onerror=_unreadable_folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield os.path.join(top, name), False


def _unreadable_folder(e: OSError) -> None:
    raise UsageError(f"{e.filename}: cannot list the folder ({e.strerror or e})")


def _image_suffixes() -> frozenset[str]:
    from PIL import Image

    Image.init()
    return frozenset(Image.registered_extensions())


def image_inputs(
    specs: Iterable[str],
    *,
    max_pixels: int | None,
    skip_unreadable: bool = False,
    stdin: IO[str] | None = None,
) -> Inputs:
    """Every image file ``specs`` give (files, folders, globs, ``-`` for paths on ``stdin``), each checked by
    its header (:func:`proteus.images.check_image_file`). A file inside a folder counts as an image by its
    content or, failing that, by its name (``.jpg`` ...): a folder's other files are ignored, and an
    unreadable file with an image's name is reported like a file given by name. The first unreadable file
    raises its :class:`ImageError` (how many more there are in the message), unless ``skip_unreadable``."""
    import sys

    from proteus.images import NOT_AN_IMAGE, ImageError, check_image_file

    out = Inputs()
    suffixes = _image_suffixes()
    for path, named in _listed(specs, stdin if stdin is not None else sys.stdin):
        try:
            check_image_file(path, max_pixels)
        except ImageError as e:
            not_image = e.reason in NOT_AN_IMAGE.values()
            if not named and not_image and os.path.splitext(path)[1].lower() not in suffixes:
                out.ignored += 1
                continue
            out.skipped.append((path, e.reason or str(e)))
            continue
        out.files.append(path)
    if out.skipped and not skip_unreadable:
        path, reason = out.skipped[0]
        more = len(out.skipped) - 1
        tail = f"; {more} more unreadable file{'s' if more > 1 else ''}" if more else ""
        hint = f"--skip-unreadable goes on without {'them' if more else 'it'}"
        raise ImageError(f"{path}: {reason}{tail} ({hint})", path=path, reason=reason)
    return out


# ------------------------------------------------------------------------------------------------ output
#: the formats of ``predict --out FILE``, by the file's suffix: one JSON object per line, or CSV
OUTPUT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def output_format(path: str | os.PathLike[str]) -> str:
    """The format of output file ``path`` by its suffix (:data:`OUTPUT_FORMATS`), checked before any work:
    a folder, a missing parent folder or another suffix is refused."""
    p = Path(path)
    kind = OUTPUT_FORMATS.get(p.suffix.lower())
    if kind is None:
        raise UsageError(f"--out {p}: write .jsonl (JSON Lines) or .csv; got {p.suffix or 'no suffix'!r}")
    if p.is_dir():
        raise UsageError(f"--out {p}: is a folder; give a file name ending in .jsonl or .csv")
    if not p.parent.is_dir():
        raise UsageError(f"--out {p}: the folder {p.parent} does not exist")
    return kind
