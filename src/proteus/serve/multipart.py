"""A streaming ``multipart/form-data`` parser for ``proteus serve``: it is fed the body chunk by chunk as it
arrives, and stops at the first part over the request's image budget (``request_images``) or a part whose
headers are over ``part_header_bytes``, before the rest of the body is read: a small body of many empty
parts costs nothing more than its bytes (the standard library's ``email`` parser, used before, parsed a
whole body first and counted the parts after, in time quadratic in their number).

Each search for a delimiter starts where the previous one stopped, so the work is linear in the body.
Parts keep their bytes (``Content-Transfer-Encoding`` base64 and quoted-printable are decoded, as the
``email`` parser did); a part's name is its ``filename``, else its field ``name``, else ``part<i>``.
"""

from __future__ import annotations

import base64
import binascii
import email.message
import email.parser
import email.policy
import quopri

__all__ = ["MultipartError", "MultipartParser", "TooManyParts", "boundary_of"]


class MultipartError(ValueError):
    """A body that is not ``multipart/form-data`` as its ``Content-Type`` says (a 400)."""


class TooManyParts(MultipartError):
    """More parts than the request may carry, or a part's headers over their budget (a 413); ``budget``
    names the budget (:mod:`proteus.budgets`)."""

    def __init__(self, message: str, budget: str) -> None:
        super().__init__(message)
        self.budget = budget


def boundary_of(ctype: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type; :class:`MultipartError` without one."""
    msg = email.message.Message()
    msg["content-type"] = ctype
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not boundary or len(boundary) > 200:
        raise MultipartError("multipart/form-data without a boundary; let the client library build the body")
    return boundary.encode("latin-1", "replace")


_PREAMBLE, _HEADERS, _BODY, _AFTER, _DONE = range(5)

#: the most levels of nested comments ``(...)`` a part's headers may have: RFC 5322 allows them nested, the
#: standard library's header parser recurses once per level, and no client nests them at all
MAX_COMMENT_DEPTH = 16


def _comment_depth(headers: bytes) -> int:
    """The deepest nesting of comments in ``headers`` (outside quoted strings; backslash escapes skipped),
    in one pass."""
    depth = deepest = 0
    quoted = escaped = False
    for b in headers:
        if escaped:
            escaped = False
        elif b == 0x5C:  # backslash
            escaped = True
        elif b == 0x22 and not depth:  # a quoted string (inside a comment a quote is a character)
            quoted = not quoted
        elif quoted:
            continue
        elif b == 0x28:
            depth += 1
            deepest = max(deepest, depth)
        elif b == 0x29 and depth:
            depth -= 1
    return deepest


class MultipartParser:
    """Feed it the body (:meth:`feed`), then :meth:`finish` for the (name, bytes) parts."""

    def __init__(self, boundary: bytes, max_parts: int, max_header_bytes: int) -> None:
        self.delimiter = b"\r\n--" + boundary
        self.max_parts, self.max_header = max_parts, max_header_bytes
        self.parts: list[tuple[str, bytes]] = []
        self._buf = bytearray(b"\r\n")  # the first delimiter may come without its CRLF
        self._state = _PREAMBLE
        self._searched = 0  # where the next search for a delimiter starts
        self._headers: bytes = b""

    def feed(self, chunk: bytes) -> None:
        """Parse what ``chunk`` completes; :class:`TooManyParts` at the first part over the budget."""
        if self._state == _DONE or not chunk:
            return
        self._buf += chunk
        while self._step():
            pass

    def _step(self) -> bool:
        """One transition of the state machine; False when it needs more bytes."""
        buf, d = self._buf, self.delimiter
        if self._state in (_PREAMBLE, _BODY):
            i = buf.find(d, self._searched)
            if i < 0:
                self._searched = max(0, len(buf) - len(d) + 1)
                return False
            if self._state == _BODY:
                self._close_part(bytes(buf[:i]))
            del buf[: i + len(d)]
            self._searched = 0
            self._state = _AFTER
            return True
        if self._state == _AFTER:
            if len(buf) < 2:
                return False
            if buf[:2] == b"--":
                self._state = _DONE
                buf.clear()
                return False
            if len(self.parts) + 1 > self.max_parts:
                raise TooManyParts(
                    f"more than {self.max_parts} images in one request; send at most {self.max_parts} per "
                    "request",
                    "request_images",
                )
            self._state = _HEADERS
            return True
        if self._state == _HEADERS:
            line_end = buf.find(b"\r\n")  # the rest of the delimiter's line (transport padding)
            if line_end < 0:
                return self._header_room()
            end = buf.find(b"\r\n\r\n", line_end)
            if end < 0:
                return self._header_room()
            self._headers = bytes(buf[line_end + 2 : end + 2])
            del buf[: end + 4]  # the part's body starts after the blank line
            self._state = _BODY
            return True
        return False

    def _header_room(self) -> bool:
        if len(self._buf) > self.max_header:
            raise TooManyParts(
                f"the headers of part {len(self.parts) + 1} are over {self.max_header} bytes",
                "part_header_bytes",
            )
        return False

    def _close_part(self, data: bytes) -> None:
        if _comment_depth(self._headers) > MAX_COMMENT_DEPTH:  # the email parser recurses per level
            raise MultipartError(
                f"part {len(self.parts) + 1}: its headers nest comments '(...)' over "
                f"{MAX_COMMENT_DEPTH} levels"
            )
        headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(self._headers)
        name = headers.get_filename() or headers.get_param("name", header="content-disposition")
        cte = str(headers.get("content-transfer-encoding", "")).strip().lower()
        if cte == "base64":
            try:
                data = base64.b64decode(data)
            except (binascii.Error, ValueError):
                raise MultipartError(f"part {len(self.parts) + 1}: not base64 as its headers say") from None
        elif cte == "quoted-printable":
            data = quopri.decodestring(data)
        self.parts.append((name if isinstance(name, str) and name else f"part{len(self.parts)}", data))

    def finish(self) -> list[tuple[str, bytes]]:
        """The parts of a body that has ended (a last part without its closing delimiter is kept, as the
        ``email`` parser did); :class:`MultipartError` when it has none."""
        if self._state == _BODY:
            data = bytes(self._buf)
            self._close_part(data[:-2] if data.endswith(b"\r\n") else data)
        self._state = _DONE
        self._buf.clear()
        if not self.parts:
            raise MultipartError("multipart body without parts; send one or more image files")
        return self.parts
