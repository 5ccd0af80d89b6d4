"""Every limit on what one input may cost, declared once: :data:`BUDGETS`.

Each :class:`Budget` has a name, a default, a unit, what it protects, and the option that raises it. Any
budget can also be changed through the environment (``PROTEUS_LIMIT_<NAME>``, e.g.
``PROTEUS_LIMIT_KB_MANIFEST_BYTES=200000000``); a command-line option, where there is one, wins over the
environment. Exceeding a budget raises :class:`BudgetError` (a :class:`~proteus.errors.ProteusError`: exit
code 2 on the command line, a 413 or 422 from ``proteus serve``) whose message names the input, the limit
and how to raise it. ``docs/reliability.md`` lists the same table (a test keeps the two equal).

This module is at the bottom of the package: it imports only :mod:`proteus.errors` and the standard
library, so that every layer can check its inputs against it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from proteus.errors import ProteusError

__all__ = ["BUDGETS", "Budget", "BudgetError", "limit", "over"]


@dataclass(frozen=True)
class Budget:
    """One limit: ``name`` (``PROTEUS_LIMIT_<NAME>`` in the environment), ``default``, ``unit``, what it
    ``protects`` and the ``option`` that raises it (besides the environment variable)."""

    name: str
    default: int
    unit: str
    protects: str
    option: str = ""
    #: whether ``$PROTEUS_LIMIT_<NAME>`` applies (False: only ``option`` does, a setting of its own)
    from_env: bool = True

    @property
    def env(self) -> str:
        return f"PROTEUS_LIMIT_{self.name.upper()}"

    @property
    def how_to_raise(self) -> str:
        ways = [self.option] if self.option else []
        return " or ".join([*ways, f"${self.env}"] if self.from_env else ways)


_MIB = 1 << 20
#: what decoding one image costs at most, in bytes per pixel of ``image_pixels`` (the samples as decoded,
#: at most 4 bytes a pixel; the decoder's buffer of one strip of the file, as large as the samples for a
#: file of one strip, such as an image of one row, 4; a high-bit-depth image's 8-bit plane and its image,
#: 1 + 1; the 8-bit RGB image, 3), beside a fixed few tens of MiB (the conversion's tiles of
#: :data:`proteus.images.STRIP_SAMPLES`): ``tests/test_fuzz.py`` holds every format, mode, bit depth and
#: aspect ratio to it
IMAGE_BYTES_PER_PIXEL = 13

#: every budget, by name (the table of docs/reliability.md)
BUDGETS: dict[str, Budget] = {
    b.name: b
    for b in (
        Budget("image_pixels", 64_000_000, "pixels",
               "memory of one decoded image: width x height read from the header, before decoding; "
               f"decoding one costs at most {IMAGE_BYTES_PER_PIXEL} bytes per pixel of the budget (its "
               "samples and the decoder's buffer, up to 4 bytes a pixel each; a high-bit-depth image's 8-bit "
               "plane; the RGB image), "
               "whatever its format, mode, bit depth or shape",
               "--max-pixels / eval.max_image_pixels", from_env=False),
        Budget("request_pixels", 256_000_000, "pixels",
               "memory and time of one `serve` request: the sum of its images' width x height, from their "
               "headers before any is decoded (each image is resized right after decoding)",
               "proteus serve --max-request-pixels"),
        Budget("decoding_pixels", 128_000_000, "pixels",
               "memory of `serve` as a whole: pixels being decoded at once by all requests together (a "
               "decode waits for room; one image alone may always use up to image_pixels)"),
        Budget("input_bytes", 1 << 30, "bytes",
               "memory of `serve` as a whole: the model inputs (the resized images) that requests hold "
               "until they are predicted, all requests together (a request waits for room for all of its "
               "images before decoding any; one request alone may always hold its own)"),
        Budget("body_bytes", 256 * _MIB, "bytes",
               "memory of `serve` as a whole: the request bodies being read and held until their images "
               "are decoded, all requests together (a request waits for room for its Content-Length, or "
               "request_bytes when it sends its body in chunks, before reading any of it; one request alone "
               "may always read its own)"),
        Budget("request_images", 1024, "images",
               "`serve`: images (multipart parts, JSON items) in one request; the multipart parser stops "
               "at the first part over it", "proteus serve --max-images"),
        Budget("request_bytes", 64 * _MIB, "bytes", "`serve`: the body of one request",
               "proteus serve --max-body"),
        Budget("part_header_bytes", 16 * 1024, "bytes",
               "`serve`: the headers of one multipart part (the parser holds them whole)"),
        Budget("kb_manifest_bytes", 64 * _MIB, "bytes",
               "memory of reading manifest.json or manifest.prev.json (checked with fstat before reading)"),
        Budget("kb_object_bytes", 2048 * _MIB, "bytes",
               "time of checking one knowledge-base object (hashed as a stream, then memory-mapped: its "
               "pages are read when used, not held for the check) and the size of a head's square "
               "statistic (head.rp_dim up to about 16,000 in float64); an object is also compared with the "
               "size its manifest records before it is read"),
        Budget("kb_total_bytes", 64 * 1024 * _MIB, "bytes",
               "time of verifying or opening a knowledge base: the sizes its manifest records for all its "
               "objects, added up before any object is read"),
        Budget("side_file_bytes", 1 * _MIB, "bytes",
               "a key file, its sequence record, the write lock's record: read whole, so capped"),
        Budget("yaml_bytes", 16 * _MIB, "bytes", "a config file or a tasks file, read whole"),
        Budget("yaml_nodes", 200_000, "nodes",
               "memory and time of a config or tasks file once parsed (aliases are refused outright: no "
               "'billion laughs')"),
        Budget("nesting_depth", 100, "levels",
               "the parsers' stack: brackets or mappings nested in a manifest, a JSON request, a YAML file "
               "or a --set value"),
        Budget("int_digits", 64, "digits",
               "time of converting an integer (quadratic in its digits) in a manifest, a JSON request, a "
               "YAML file or a --set value"),
    )
}  # fmt: skip


class BudgetError(ProteusError, ValueError):
    """An input over one of the :data:`BUDGETS` (the message names the input, the limit and how to raise
    it); ``budget`` is the budget's name."""

    def __init__(self, message: str, budget: str = "") -> None:
        super().__init__(message)
        self.budget = budget


def limit(name: str) -> int:
    """The budget ``name`` in force: ``$PROTEUS_LIMIT_<NAME>`` when it is set, else its default."""
    b = BUDGETS[name]
    raw = os.environ.get(b.env, "").strip() if b.from_env else ""
    if not raw:
        return b.default
    try:
        value = float(raw) if any(c in raw for c in ".eE") else int(raw)
    except ValueError:
        value = -1
    if not value >= 1 or value != value or value == float("inf"):
        raise BudgetError(f"${b.env} must be a number of {b.unit} >= 1; got {raw!r}", name)
    return int(value)


def over(name: str, where: str, got: int | str, limit_value: int | None = None) -> BudgetError:
    """The error for ``where`` having ``got`` (a number of the budget's unit, or words) over budget
    ``name`` (``limit_value``: the limit in force, when the caller had it from an option)."""
    b = BUDGETS[name]
    n = limit(name) if limit_value is None else limit_value
    shown = f"{got} {b.unit}" if isinstance(got, int) else got
    return BudgetError(
        f"{where}: {shown}, over the limit of {n} {b.unit} ({b.name}); raise it with {b.how_to_raise} "
        "if you trust the input",
        name,
    )
