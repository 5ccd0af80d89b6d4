"""Reading what someone else wrote, within :mod:`proteus.budgets`: regular files only, JSON and YAML parsers
with limits.

* :func:`read_regular` opens a file without blocking (a FIFO never hangs a command), refuses anything but a
  regular file (after ``fstat`` on the open file), and refuses one larger than its budget before reading
  it; with ``follow=False`` a symbolic link is refused too (``O_NOFOLLOW``).
* :func:`load_json`: duplicate keys refused (a reader that keeps the first key and one that keeps the last
  must not see two documents), nesting and integer size capped (``nesting_depth``, ``int_digits``), lone
  surrogates refused (they cannot be printed or encoded).
* :func:`load_yaml`: PyYAML's safe loader without aliases (no "billion laughs") or duplicate keys, with a
  node count, a nesting depth (checked on the brackets before the scanner runs, which is quadratic in flow
  nesting) and the same integer size.

Every refusal is a :class:`~proteus.errors.ProteusError` naming the input (``where``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Any

import yaml

from proteus.budgets import BudgetError, limit, over
from proteus.errors import ProteusError

__all__ = [
    "InputError",
    "SpecialFileError",
    "file_kind",
    "load_json",
    "load_yaml",
    "read_regular",
    "read_regular_text",
    "yaml_has_tag",
]


class InputError(ProteusError, ValueError):
    """A document that cannot be used (not JSON or YAML, a duplicate key, an alias ...): the message names
    it (``where``) and says what is wrong (``reason``)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


class SpecialFileError(ProteusError, OSError):
    """A path that is not a regular file (a FIFO, a device, a directory, a symbolic link where none may
    be); ``strerror`` says which."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO (named pipe)", "a regular file" ...)."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def read_fd(fd: int, budget: str, shown: str) -> bytes:
    """The bytes of the open file ``fd`` (not closed here): refused unless it is a regular file of at most
    ``limit(budget)`` bytes; never reads more than that (a file growing meanwhile is refused too)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SpecialFileError(errno.EINVAL, f"not a regular file ({file_kind(st.st_mode)})", shown)
    cap = limit(budget)
    if st.st_size > cap:
        raise over(budget, shown, st.st_size, cap)
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, min(max(st.st_size - got, 0) + 1, 1 << 24))
        if not chunk:
            return b"".join(chunks)
        got += len(chunk)
        if got > cap:
            raise over(budget, shown, f"more than {cap} bytes (the file grew while it was read)", cap)
        chunks.append(chunk)


def read_regular(
    path: str | os.PathLike[str], budget: str, *, follow: bool = True, dir_fd: int | None = None
) -> bytes:
    """The bytes of the regular file ``path`` (relative to ``dir_fd`` when given), opened without blocking;
    ``follow=False`` refuses a symbolic link. ``OSError`` as ``os.open`` raises it (a symbolic link under
    ``follow=False``: :class:`SpecialFileError`), :class:`SpecialFileError` for anything but a regular
    file, :class:`~proteus.budgets.BudgetError` for one over ``budget`` bytes."""
    shown = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise SpecialFileError(
                errno.ELOOP, "a symbolic link, which is not followed here", shown
            ) from None
        raise
    try:
        return read_fd(fd, budget, shown)
    finally:
        os.close(fd)


def read_regular_text(path: str | os.PathLike[str], budget: str = "yaml_bytes") -> str:
    """:func:`read_regular`, decoded as UTF-8 (``UnicodeDecodeError`` as ``bytes.decode`` raises it)."""
    return read_regular(path, budget).decode("utf-8")


# ------------------------------------------------------------------------------------------------ JSON
def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Duplicate(dup)
    return out


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


class _BigInt(Exception):
    def __init__(self, digits: int) -> None:
        self.digits = digits


def _int(cap: int) -> Any:
    def parse(s: str) -> int:
        n = len(s) - (s[0] == "-")
        if n > cap:
            raise _BigInt(n)
        return int(s)

    return parse


def _printable_key(key: str) -> str:
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_tree(doc: Any, where: str) -> None:
    """Nesting depth and lone surrogates of a parsed document (iterative: no recursion)."""
    cap = limit("nesting_depth")
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > cap:
                raise over("nesting_depth", where, "nested too deeply", cap)
            for k, v in node.items():
                if isinstance(k, str):
                    _check_str(k, where)
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                elif isinstance(v, str):
                    _check_str(v, where)
        elif isinstance(node, list):
            if depth > cap:
                raise over("nesting_depth", where, "nested too deeply", cap)
            for v in node:
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                elif isinstance(v, str):
                    _check_str(v, where)
        elif isinstance(node, str):
            _check_str(node, where)


def _check_str(s: str, where: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            where,
            f"a string holds a lone surrogate ({s[e.start]!r} at position {e.start}), which is not text; "
            "fix the file that wrote it",
        ) from None


def load_json(data: bytes | str, where: str) -> Any:
    """Parse JSON from someone else: :class:`InputError` for invalid JSON (with the position), a duplicate
    key or a lone surrogate; :class:`~proteus.budgets.BudgetError` past ``nesting_depth`` or
    ``int_digits``."""
    cap = limit("int_digits")
    try:
        doc = json.loads(data, object_pairs_hook=_pairs, parse_int=_int(cap))
    except _Duplicate as e:
        raise InputError(
            where,
            f"the key {_printable_key(e.key)} appears twice in one object; a JSON document with duplicate "
            "keys is refused (readers would not agree on its value)",
        ) from None
    except _BigInt as e:
        raise over("int_digits", where, f"an integer of {e.digits} digits", cap) from None
    except RecursionError:
        depth = limit("nesting_depth")
        raise over("nesting_depth", where, "nested too deeply", depth) from None
    except UnicodeDecodeError as e:
        raise InputError(where, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise InputError(where, f"not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") from None
    _check_tree(doc, where)
    return doc


# ------------------------------------------------------------------------------------------------ YAML
_BRACKETS = re.compile(r"[][{}]")


def _check_flow_depth(text: str, where: str) -> None:
    """Refuse flow brackets nested past ``nesting_depth`` before PyYAML's scanner (quadratic in them)
    runs; brackets inside quoted strings count too (a harmless over-estimate)."""
    cap = limit("nesting_depth")
    depth = 0
    for m in _BRACKETS.finditer(text):
        depth += 1 if m.group() in "[{" else -1
        if depth > cap:
            raise over("nesting_depth", where, "brackets nested too deeply", cap)


class _Loader(yaml.SafeLoader):
    """The safe loader without aliases, with a node count, a depth and an integer size."""

    where = "<yaml>"

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0
        self._max_nodes = limit("yaml_nodes")
        self._max_depth = limit("nesting_depth")
        self._max_digits = limit("int_digits")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise InputError(
                self.where,
                f"YAML aliases (*{event.anchor}, line {event.start_mark.line + 1}) are not allowed here; "
                "write the value out in full",
            )
        self._nodes += 1
        if self._nodes > self._max_nodes:
            raise over("yaml_nodes", self.where, f"more than {self._max_nodes} nodes", self._max_nodes)
        self._depth += 1
        if self._depth > self._max_depth:
            raise over("nesting_depth", self.where, "nested too deeply", self._max_depth)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        """A mapping, refused when a key appears twice (PyYAML would keep the last one silently)."""
        if isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if (key.tag, key.value) in seen:
                        raise InputError(
                            self.where,
                            f"the key {_printable_key(key.value)} appears twice in one mapping (line "
                            f"{key.start_mark.line + 1}); keep one",
                        )
                    seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> int:
        value = str(self.construct_scalar(node))
        digits = sum(c.isalnum() for c in value)
        if digits > self._max_digits:
            raise over("int_digits", self.where, f"an integer of {digits} digits", self._max_digits)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def load_yaml(text: str, where: str) -> Any:
    """Parse YAML from someone else (:class:`_Loader`); ``yaml.YAMLError`` for invalid YAML, as
    ``yaml.safe_load`` raises it, :class:`InputError` for an alias or a lone surrogate,
    :class:`~proteus.budgets.BudgetError` past a budget."""
    _check_flow_depth(text, where)
    loader = _Loader(text)
    loader.where = where
    try:
        doc = loader.get_single_data()
    except RecursionError:
        depth = limit("nesting_depth")
        raise over("nesting_depth", where, "nested too deeply", depth) from None
    finally:
        loader.dispose()
    _check_tree(doc, where)
    return doc


def yaml_has_tag(raw: str, where: str = "<yaml>") -> bool:
    """Whether the YAML text ``raw`` holds a tag (``!!python/object``); its nesting checked first."""
    _check_flow_depth(raw, where)
    return any(isinstance(t, yaml.TagToken) for t in yaml.scan(raw, Loader=yaml.SafeLoader))


def refuse(e: BaseException) -> bool:
    """Whether ``e`` is one of this module's refusals (for callers that report them as a document's
    problem)."""
    return isinstance(e, (InputError, BudgetError, SpecialFileError))


# ------------------------------------------------------------------------------------------- terminal
#: characters a terminal would act on rather than show: C0 and C1 controls, DEL, the bidirectional
#: overrides, embeddings, isolates and marks, the line and paragraph separators, and lone surrogates
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    )


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control characters (ANSI escapes, newlines), bidirectional
    controls (a right-to-left override) and lone surrogates written as escapes (``\\x1b``, ``\\n``,
    ``\\u202e``); everything else unchanged."""
    return _UNPRINTABLE.sub(_escape, text)
