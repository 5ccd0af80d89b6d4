"""Format 4 of a knowledge base: a manifest written incrementally, whatever the number of tasks.

In formats 1-3 ``manifest.json`` holds every task's record, so each commit rewrote, hashed and checked a
file that grows with every task learned. In format 4 the task records (and the evaluation rows kept with
them) live in *record segments*: JSON objects of at most :data:`SEGMENT_TASKS` consecutive records,
content-addressed like the tensor objects (``objects/records-<sha256[:16]>.json``). The manifest names each
segment (its object, sha256, size, and the tasks it holds) instead of each task; a commit writes only the
segments whose records changed -- the last one, as a rule -- so a commit writes the same few files at task
1,000 as at task 10, and the manifest holds one reference per :data:`SEGMENT_TASKS` tasks.

Each record in a segment carries its object's size (``bytes``): a reader compares a file with it before
reading it, as it does with format 3's ``object_bytes``.

In memory a knowledge base keeps the *expanded* manifest (:func:`expand`): the fields of formats 1-3
(``tasks``, ``evaluation``, ``object_bytes``) beside the manifest's own (``segments``, ``num_tasks``,
``parent``), so that everything above the store reads one form whatever the version on disk. A commit packs
the expanded form back (:meth:`Segments.pack`): a segment whose records and rows are the very objects it
was read as or written from is referenced again without being serialised.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable
from itertools import chain
from typing import Any

from proteus.kb.files import EXPANDED_KEYS, KBError
from proteus.kb.schema import SEGMENT, ClassOwners, fields_problems, total_problem
from proteus.untrusted import load_json

__all__ = ["RECORDS_FORMAT", "SEGMENT_TASKS", "Segments", "content_digest", "expand", "physical_keys"]

#: how many task records one record segment holds (the last one of a knowledge base: fewer)
SEGMENT_TASKS = 32
#: the ``format`` of a record segment's content
RECORDS_FORMAT = "proteus-kb-records"
#: the fields the expanded form adds to a manifest of format 4 (never written into its manifest.json)
EXPANDED = EXPANDED_KEYS

#: reads a segment's verified bytes: (relative path, sha256, recorded size) -> bytes
ReadSegment = Callable[[str, str, int], bytes]
#: writes a segment's bytes as an object; returns (relative path, sha256)
WriteSegment = Callable[[bytes], tuple[str, str]]


def physical_keys(manifest: dict[str, Any]) -> dict[str, Any]:
    """The fields of an expanded manifest that a manifest of format 4 writes itself (all but
    :data:`EXPANDED`)."""
    return {k: v for k, v in manifest.items() if k not in EXPANDED}


def content_digest(records: list[Any], rows: list[Any]) -> str:
    """What a segment holds, without its time stamps (each task's ``learned``) and its objects' sizes: the
    sha256 of the canonical JSON of its records and rows. The manifest's checksum covers it in place of the
    segment's name and sha256, so that two identical runs have the same checksum
    (:func:`~proteus.kb.files.manifest_checksum`)."""
    tasks = [{k: v for k, v in r.items() if k not in ("learned", "bytes")} if isinstance(r, dict) else r
             for r in records]  # fmt: skip
    body = {"tasks": tasks, "evaluation": rows}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _same(a: tuple[Any, ...] | list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


#: the records of a segment as they were read or written: their lengths and every value in order (None when
#: one is no map: such a segment is never referenced again)
Snapshot = tuple[tuple[int, ...], tuple[Any, ...]] | None


def _sizes(tasks: list[Any]) -> list[Any]:
    """Each parsed record's object size, taken out of the record (the expanded form keeps the sizes in
    ``object_bytes``): one ``pop`` per record, where a copy of each record without it cost a dict per task."""
    return [t.pop("bytes") for t in tasks]


def _fields(records: list[Any] | tuple[Any, ...]) -> Snapshot:
    """Each record's values (the objects themselves): a record edited in place since (a field set anew,
    added or removed) no longer has the same ones."""
    try:
        return tuple(map(len, records)), tuple(chain.from_iterable(map(dict.values, records)))
    except TypeError:  # a record that is no map (refused by the commit's checks)
        return None


def _unedited(fields: Snapshot, records: list[Any]) -> bool:
    """Whether every record holds the values ``fields`` says it held (the same objects, in order; compared in
    C, one pass over every field of a long stream's records)."""
    now = _fields(records)
    return (
        fields is not None
        and now is not None
        and fields[0] == now[0]
        and all(map(operator.is_, fields[1], now[1]))
    )


class Segments:
    """The record segments one :class:`~proteus.kb.store.KnowledgeBase` has read or written: by sha256, the
    records and rows as it expanded or packed them (the same dict objects), so that :meth:`pack` recognises
    an unchanged segment by identity, without serialising it."""

    def __init__(self) -> None:
        #: sha256 -> (records, rows, their objects' sizes, each record's values as it was written or read)
        self.known: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...], Snapshot]] = {}
        #: the store's record of what it checked before (:meth:`expand`)
        self.verified: Any = None
        #: the tasks whose segment the last :meth:`pack` referenced again (their records unchanged)
        self.reused: set[int] = set()
        #: the classes of those tasks, as the commit's check found them (extended by the next commit's)
        self.owners = ClassOwners()

    def expand(
        self, manifest: dict[str, Any], read: ReadSegment, where: str, verified: Any = None
    ) -> dict[str, Any]:
        """The expanded form of the checked manifest of format 4 ``manifest`` (file ``where``): its
        segments read (``read``: verified bytes), checked against :data:`~proteus.kb.schema.SEGMENT` and the
        tasks their references say they hold; a :class:`KBError` names the segment and what is wrong.
        ``verified``: the store's record (:class:`~proteus.kb.verified.Verified`): a segment whose bytes
        passed these checks before is parsed without checking it again."""
        self.verified = verified
        tasks: list[Any] = []
        rows: list[Any] = []
        sizes: dict[str, int] = {}
        short = False  # a segment with fewer rows than tasks: no later one may hold rows
        for i, ref in enumerate(manifest["segments"]):
            rel, sha = ref["object"], ref["sha256"]
            records, evaluation, objects = self._read(ref, read, f"{where}: segments[{i}] ({rel})")
            if evaluation and short:
                raise KBError(
                    f"{where}: segments[{i}] ({rel}): holds evaluation rows, but an earlier segment holds "
                    "fewer rows than tasks (the rows must follow the tasks from the first)"
                )
            short = short or len(evaluation) < len(records)
            sizes[rel] = ref["bytes"]
            for r, n in zip(records, objects, strict=True):
                sizes[r["object"]] = n
            self.known[sha] = (tuple(records), tuple(evaluation), tuple(objects), _fields(records))
            tasks += records
            rows += evaluation
        head = manifest.get("head")
        if isinstance(head, dict) and isinstance(head.get("bytes"), int):
            sizes[head["object"]] = head["bytes"]
        if problem := total_problem(sizes):
            raise KBError(f"{where}: {problem}")
        return {**manifest, "tasks": tasks, "evaluation": rows, "object_bytes": sizes}

    def _read(
        self, ref: dict[str, Any], read: ReadSegment, where: str
    ) -> tuple[list[Any], list[Any], list[int]]:
        """A segment's records (each without its ``bytes``, which the expanded form keeps in
        ``object_bytes``), rows and objects' sizes; the same objects as last time for a segment this store
        knows."""
        kept = self.known.get(ref["sha256"])
        if kept is not None and _unedited(kept[3], list(kept[0])):
            return list(kept[0]), list(kept[1]), list(kept[2])
        verified = getattr(self, "verified", None)
        data = read(ref["object"], ref["sha256"], ref["bytes"])
        if verified is not None and verified.segment_checked(ref["sha256"], ref["content"]):
            body = json.loads(data)  # the same bytes as checked before, with this content digest
            tasks = body["tasks"]
            if body["first"] == ref["first"] and len(tasks) == ref["count"]:
                return tasks, body["evaluation"], _sizes(tasks)
        body = load_json(data, where)
        if not isinstance(body, dict):
            raise KBError(f"{where}: not a record segment (a JSON {type(body).__name__}, not an object)")
        problems = fields_problems(body, SEGMENT, "")
        if not problems and body["format"] != RECORDS_FORMAT:
            problems = [f"format: is {body['format']!r}, not {RECORDS_FORMAT!r}"]
        if not problems and (body["first"] != ref["first"] or len(body["tasks"]) != ref["count"]):
            problems = [
                f"holds tasks {body['first']} .. +{len(body['tasks'])}, but the manifest says "
                f"{ref['first']} .. +{ref['count']}"
            ]
        if not problems and len(body["evaluation"]) > len(body["tasks"]):
            problems = [f"holds {len(body['evaluation'])} evaluation rows for {len(body['tasks'])} tasks"]
        if not problems and content_digest(body["tasks"], body["evaluation"]) != ref["content"]:
            problems = ["its content is not the one its reference in the manifest names (content)"]
        if problems:
            raise KBError(f"{where}: {problems[0]}; restore the file or the manifest that names it")
        if verified is not None:
            verified.segment_ok(ref["sha256"], ref["content"])
        tasks = body["tasks"]
        return tasks, list(body["evaluation"]), _sizes(tasks)

    def pack(
        self,
        manifest: dict[str, Any],
        previous: list[Any] | None,
        write: WriteSegment,
        size_of: Callable[[str], int],
    ) -> list[dict[str, Any]]:
        """The segment references of the expanded manifest ``manifest``: a segment whose records and rows are
        the objects of ``previous``'s segment at the same place (the references of the manifest
        ``manifest`` was derived from) is referenced again; any other is serialised and written (``write``),
        each record with its object's size (``size_of``)."""
        tasks: list[Any] = list(manifest.get("tasks") or [])
        rows: list[Any] = list(manifest.get("evaluation") or [])
        previous = previous if isinstance(previous, list) else []
        refs = []
        self.reused = set()
        for i, first in enumerate(range(0, len(tasks), SEGMENT_TASKS)):
            records, evaluation = tasks[first : first + SEGMENT_TASKS], rows[first : first + SEGMENT_TASKS]
            old = previous[i] if i < len(previous) and isinstance(previous[i], dict) else None
            if old is not None and old.get("first") == first and old.get("count") == len(records):
                kept = self.known.get(old.get("sha256", ""))
                if (
                    kept is not None
                    and _same(kept[0], records)
                    and _same(kept[1], evaluation)
                    and _unedited(kept[3], records)
                ):
                    refs.append(old)
                    self.reused.update(range(first, first + len(records)))
                    continue
            sizes = [size_of(r["object"]) for r in records]
            body = {
                "format": RECORDS_FORMAT,
                "first": first,
                "tasks": [{**r, "bytes": n} for r, n in zip(records, sizes, strict=True)],
                "evaluation": evaluation,
            }
            data = json.dumps(body).encode()
            rel, sha = write(data)
            self.known[sha] = (tuple(records), tuple(evaluation), tuple(sizes), _fields(records))
            content = content_digest(records, evaluation)
            if self.verified is not None:  # written here: a reader need not check it again
                self.verified.segment_ok(sha, content)
            refs.append({"object": rel, "sha256": sha, "bytes": len(data), "first": first,
                         "count": len(records), "content": content})  # fmt: skip
        return refs

    def settle(self, refs: list[Any]) -> None:
        """Keep only what the segments ``refs`` (the state committed, and the one it replaced) hold."""
        keep = {r.get("sha256") for r in refs if isinstance(r, dict)}
        self.known = {sha: v for sha, v in self.known.items() if sha in keep}


def expand(manifest: dict[str, Any], read: ReadSegment, where: str) -> dict[str, Any]:
    """:meth:`Segments.expand` with a store of its own (a manifest read once, never committed)."""
    return Segments().expand(manifest, read, where)
