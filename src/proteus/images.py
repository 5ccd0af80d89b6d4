"""Decoding image files to 8-bit RGB, identically for training (ImageFolder datasets) and prediction.

Every image the library reads from disk goes through :func:`open_image`, so a picture gives the same
pixels whether it is in a training folder or passed to ``proteus predict``. The rules:

* **Size limit before decoding.** The header is read lazily first; an image above ``max_pixels``
  (:data:`DEFAULT_MAX_PIXELS`, 64 megapixels, by default) is refused with :class:`ImageTooLargeError`
  before any pixel is decoded. PIL's own decompression-bomb check (``Image.MAX_IMAGE_PIXELS``) is
  replaced by this explicit limit for our calls only: PIL never emits ``DecompressionBombWarning`` or
  ``DecompressionBombError`` for them, and ``Image.MAX_IMAGE_PIXELS`` is restored right after (see
  :func:`_pil_bomb_check_lifted`).
* **High bit depth is scaled, not clipped.** ``Image.convert("RGB")`` clips 16-bit grayscale at 255, so a
  16-bit PNG would come out almost white. Here:

  - 16-bit grayscale (modes ``I;16``, ``I;16B``, ``I;16L``, ``I;16N``) maps 0..65535 to 0..255 by
    ``round(v / 257)``, so a 16-bit PNG and its 8-bit version decode to the same RGB image within one
    level. A TIFF that declares fewer bits per sample (e.g. 12) is scaled by its declared maximum
    ``2**bits - 1`` instead.
  - 32-bit integer (mode ``I``): when the file declares at most 16 bits per sample, or declares
    nothing and every value lies in 0..65535 (a 16-bit image that PIL widened to ``I``), the same
    16-bit rule applies. Otherwise (true 32-bit data, or negative values) the image is min-max scaled:
    its own minimum maps to 0 and its maximum to 255 (a constant image maps to 0).
  - 32-bit float (mode ``F``): values within [0, 1] are multiplied by 255 and rounded; any other range
    is min-max scaled as above. NaN maps to 0, +inf to 255 and -inf to 0.
* **Colour modes.** Grayscale (``L``, 1-bit ``1``) is replicated to three channels; palette (``P``),
  ``CMYK``, ``YCbCr``, ``HSV`` and ``LAB`` go through PIL's (or LittleCMS's, for ``LAB``) conversion to RGB.
  **Alpha is dropped, not composited**: ``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa``/``La`` and
  palette images with a transparent index keep the colour their transparent pixels store. This is
  what torchvision's ``default_loader`` (``Image.convert("RGB")``) does, so datasets decoded before this
  module existed keep their pixels, and the pre-trained backbones see what they were trained on.
* **EXIF orientation** is applied (``ImageOps.exif_transpose``), so a photo taken on its side is upright.
  A corrupt EXIF block is ignored (the pixels are still used, unrotated).
* **Multi-frame files** (GIF, APNG, multi-page TIFF) give their first frame.

Any failure (missing file, a directory, a FIFO or device (files are opened without blocking and must be
regular files), no permission, not an image, truncated or corrupt data, an unsupported mode) raises
:class:`ImageError`, a ``ValueError`` whose message starts with the file's path and says what is wrong.

The limits (:mod:`proteus.budgets`): ``image_pixels`` per image (above); :func:`image_size` reads a
header alone, so that a caller holding several images (``proteus serve``) can check their sum
(``request_pixels``) before decoding any. :func:`check_image_file` finds what a header and a file's last
bytes can tell (not an image, empty, too large, truncated) before anything is decoded or any model loaded
(``proteus predict`` checks every input with it first).
"""

from __future__ import annotations

import io
import math
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from proteus.budgets import BUDGETS
from proteus.errors import ConfigError, ProteusError
from proteus.untrusted import file_kind

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "ImageError",
    "ImageInfo",
    "ImageTooLargeError",
    "PIXEL_WEIGHT",
    "budget_pixels",
    "check_image_file",
    "describe_skipped",
    "image_info",
    "image_size",
    "load_images",
    "open_image",
    "within_limit",
    "to_rgb",
]

#: default limit on width x height, checked on the header before decoding (64 megapixels; the budget
#: ``image_pixels`` of :mod:`proteus.budgets`)
DEFAULT_MAX_PIXELS: int = BUDGETS["image_pixels"].default

#: modes holding unsigned 16-bit samples
_UINT16_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})

#: errors PIL and its plugins raise for unreadable, truncated or corrupt data
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    struct.error,
    Image.DecompressionBombError,
)

# Serialises our temporary changes to ``Image.MAX_IMAGE_PIXELS`` (re-entrant: a caller may nest them).
_PIL_LIMIT_LOCK = threading.RLock()


class ImageError(ProteusError, ValueError):
    """An image file that cannot be used; the message starts with the file's path.

    ``path`` and ``reason`` hold the two parts of the message separately (empty when the error was
    built from a message alone, e.g. re-raised by a DataLoader worker).
    """

    def __init__(self, message: str, *, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason

    @classmethod
    def for_file(cls, path: str | os.PathLike[str], reason: str) -> ImageError:
        """The error for ``path``: message ``"PATH: REASON"``."""
        p = os.fspath(path)
        return cls(f"{p}: {reason}", path=p, reason=reason)


class ImageTooLargeError(ImageError):
    """An image whose width x height is above the pixel limit (refused before decoding)."""


# ---------------------------------------------------------------------------------------------- PIL limit
@contextmanager
def _pil_bomb_check_lifted() -> Iterator[None]:
    """Switch PIL's decompression-bomb check off while our own, explicit limit is in charge.

    PIL has no per-call limit: ``Image.open`` compares the header's size with the module-wide
    ``Image.MAX_IMAGE_PIXELS`` and warns (or raises) before we can apply ``max_pixels``. This sets it to
    ``None`` under a lock and restores the previous value on exit, whatever happens. Only the header
    read (and, for an image larger than PIL's limit that our limit allows, the decoding) runs inside.
    """
    with _PIL_LIMIT_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _check_max_pixels(max_pixels: int | None) -> None:
    if max_pixels is None:
        return
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels <= 0:
        raise ConfigError(
            f"max_pixels must be a positive integer or None (no limit), got {max_pixels!r}; "
            "set --max-pixels / eval.max_image_pixels to a number of pixels such as 64000000"
        )


def _megapixels(n: int) -> str:
    return f"{n / 1e6:.1f}" if n < 10**9 else f"{n / 1e6:.0f}"


#: how many pixels of the pixel budgets (``image_pixels``, ``decoding_pixels``, ``request_pixels``) one pixel
#: of an image counts as, by format (PIL's name; 1 for the others): the budgets declare 13 bytes a pixel
#: (:data:`proteus.budgets.IMAGE_BYTES_PER_PIXEL`), and PIL's WebP decoder holds its canvas, the frame it
#: hands over and the image at once, 16 bytes a pixel (measured at 64 megapixels)
PIXEL_WEIGHT: dict[str, float] = {"WEBP": 1.25}


def budget_pixels(fmt: str | None, width: int, height: int) -> int:
    """The pixels of the budgets an image of format ``fmt`` and size ``width`` x ``height`` counts as
    (:data:`PIXEL_WEIGHT`)."""
    return math.ceil(int(width) * int(height) * PIXEL_WEIGHT.get(fmt or "", 1.0))


# ---------------------------------------------------------------------------------------------- modes
def _declared_bits(img: Image.Image) -> int | None:
    """Bits per sample the file declares, where the format says it (TIFF's BitsPerSample tag)."""
    tags = getattr(img, "tag_v2", None)
    if tags is None:
        return None
    try:
        bits = tags.get(258)  # BitsPerSample
    except Exception:  # a broken tag directory: fall back to the mode's own range
        return None
    if isinstance(bits, (tuple, list)):
        bits = bits[0] if bits else None
    return int(bits) if isinstance(bits, int) and 1 <= bits <= 32 else None


#: the most samples a high-bit-depth conversion reads and turns into float64 at once (:func:`_tiles`): a
#: few MiB of temporaries per tile, where a whole 64-megapixel image would take gigabytes
STRIP_SAMPLES = 1 << 18


def _tiles(img: Image.Image) -> Iterator[tuple[int, int, np.ndarray]]:
    """``img``'s samples a tile at a time (its first row and column, and the tile as an array), each of at
    most :data:`STRIP_SAMPLES` samples: strips of whole rows, and a row longer than that cut into pieces
    (a 64,000,000 x 1 image is one row). No array of the whole image is made."""
    w, h = img.size
    cols = min(w, STRIP_SAMPLES)
    rows = max(1, STRIP_SAMPLES // cols)
    for i in range(0, h, rows):
        for j in range(0, w, cols):
            yield i, j, np.asarray(img.crop((j, i, min(w, j + cols), min(h, i + rows))))


def _by_strips(img: Image.Image, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``fn`` (elementwise, to uint8) applied to ``img``'s samples a tile at a time (:func:`_tiles`): the
    same bytes as one call on the whole array, with temporaries of :data:`STRIP_SAMPLES` samples."""
    w, h = img.size
    out = np.empty((h, w), dtype=np.uint8)
    for i, j, a in _tiles(img):
        out[i : i + a.shape[0], j : j + a.shape[1]] = fn(a)
    return out


def _scale_unsigned(img: Image.Image, max_value: int) -> np.ndarray:
    """Map 0..max_value to 0..255 (values above clipped to max_value), rounding half up (for 16-bit data:
    ``round(v / 257)``); by strips (:func:`_by_strips`)."""

    def scale(a: np.ndarray) -> np.ndarray:
        v = np.minimum(a, max_value).astype(np.float64)
        return np.clip(np.floor(v * (255.0 / max_value) + 0.5), 0, 255).astype(np.uint8)

    return _by_strips(img, scale)


def _finite_range(img: Image.Image) -> tuple[float, float] | None:
    """The finite minimum and maximum of ``img``'s samples (None: no finite value), by strips."""
    lo, hi = math.inf, -math.inf
    for _, _, a in _tiles(img):
        v = a[np.isfinite(a)]
        if v.size:
            lo, hi = min(lo, float(v.min())), max(hi, float(v.max()))
    return None if lo > hi else (lo, hi)


def _min_max(img: Image.Image) -> np.ndarray:
    """Map the samples' finite minimum to 0 and maximum to 255 (NaN -> 0, +inf -> 255, -inf -> 0), by
    strips."""
    span = _finite_range(img)

    def scale(a: np.ndarray) -> np.ndarray:
        v = a.astype(np.float64)
        finite = np.isfinite(v)
        out = np.zeros(v.shape, dtype=np.float64)
        if span is not None and span[1] > span[0]:
            lo, hi = span
            out[finite] = (v[finite] - lo) * (255.0 / (hi - lo))
        out[np.isposinf(v)] = 255.0
        return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)

    return _by_strips(img, scale)


def _gray_to_rgb(arr8: np.ndarray) -> Image.Image:
    return Image.fromarray(np.ascontiguousarray(arr8), mode="L").convert("RGB")


def to_rgb(img: Image.Image, bits: int | None = None) -> Image.Image:
    """Convert a decoded PIL image of any mode to 8-bit ``RGB`` (rules in the module docstring).

    ``bits`` is the bits per sample the file declares (TIFF), used for ``I;16*`` and ``I`` images; None
    means "not declared". Returns ``img`` itself when it is already RGB. Raises ``ValueError`` for a
    mode that has no conversion to RGB.
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _UINT16_MODES:
        max_value = (1 << bits) - 1 if bits is not None and 8 < bits < 16 else 65535
        return _gray_to_rgb(_scale_unsigned(img, max_value))
    if mode in ("I", "I;16S", "I;32", "I;32S"):
        span = _finite_range(img)
        lo, hi = (int(span[0]), int(span[1])) if span is not None else (0, 0)
        if bits is not None and bits <= 16 and lo >= 0:
            return _gray_to_rgb(_scale_unsigned(img, (1 << bits) - 1))
        if bits is None and lo >= 0 and hi <= 65535:
            return _gray_to_rgb(_scale_unsigned(img, 65535))
        return _gray_to_rgb(_min_max(img))
    if mode == "F":
        span = _finite_range(img)
        if span is not None and span[0] >= 0.0 and span[1] <= 1.0:

            def unit(a: np.ndarray) -> np.ndarray:
                v = np.nan_to_num(a, nan=0.0, neginf=0.0, posinf=1.0)
                return np.clip(np.floor(v * 255.0 + 0.5), 0, 255).astype(np.uint8)

            return _gray_to_rgb(_by_strips(img, unit))
        return _gray_to_rgb(_min_max(img))
    if mode == "P":
        # a palette with a transparent index goes through RGBA (PIL warns otherwise); alpha is dropped
        return img.convert("RGBA").convert("RGB") if "transparency" in img.info else img.convert("RGB")
    if mode == "La":
        return img.convert("LA").convert("RGB")
    if mode == "RGBa":
        return img.convert("RGBA").convert("RGB")
    if mode == "LAB":
        from PIL import ImageCms

        try:
            out = ImageCms.profileToProfile(
                img, ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), outputMode="RGB"
            )
        except Exception as e:  # ImageCms.PyCMSError and friends
            raise ValueError(f"LittleCMS cannot convert LAB to sRGB ({e})") from e
        if out is None:  # only with inPlace=True
            raise ValueError("LittleCMS returned no image for the LAB -> sRGB conversion")
        return out
    try:
        return img.convert("RGB")
    except ValueError as e:
        raise ValueError(f"unsupported colour mode {mode!r} ({e})") from e


def _exif_transpose(img: Image.Image) -> Image.Image:
    """``ImageOps.exif_transpose`` (a new image); the image unrotated when its EXIF block is unreadable."""
    try:
        out = ImageOps.exif_transpose(img)
    except Exception:  # corrupt EXIF must not cost the pixels; any decode error surfaces elsewhere
        return img
    return img if out is None else out


# ---------------------------------------------------------------------------------------------- public
def open_image(
    path: str | os.PathLike[str] | BinaryIO,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    *,
    name: str | None = None,
) -> Image.Image:
    """Decode the image file ``path`` (or an open binary stream, e.g. an upload, called ``name`` in
    messages) to an 8-bit ``RGB`` PIL image (rules in the module docstring).

    The header is read first and an image of more than ``max_pixels`` pixels (width x height; None: no
    limit) is refused before decoding with :class:`ImageTooLargeError`: ``"PATH: W x H = N megapixels is
    above the limit of M megapixels (raise it with --max-pixels / eval.max_image_pixels)"``. Any other
    failure raises :class:`ImageError` ``"PATH: REASON"``. The file is closed when this returns.
    """
    _check_max_pixels(max_pixels)
    stream = hasattr(path, "read")
    p = name if name is not None else ("<stream>" if stream else os.fspath(path))  # type: ignore[arg-type]
    f = path if stream else _open_regular(p)
    try:
        return _decode(f, p, stream, max_pixels)  # type: ignore[arg-type]
    finally:
        if not stream:
            f.close()  # type: ignore[union-attr]


def _open_regular(p: str) -> BinaryIO:
    """Image file ``p`` opened for reading without blocking (a FIFO never hangs), refused unless it is a
    regular file."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ImageError.for_file(p, "no such file") from None
    except PermissionError as e:
        raise ImageError.for_file(
            p, f"permission denied ({e.strerror or e}); make the file readable or pass another file"
        ) from None
    except OSError as e:
        raise ImageError.for_file(p, f"cannot be opened ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise ImageError.for_file(p, "is a directory, not an image file")
        raise ImageError.for_file(p, f"not a regular file ({file_kind(mode)}); pass an image file")
    return os.fdopen(fd, "rb")


def image_size(data: BinaryIO, name: str) -> tuple[int, int]:
    """(width, height) from the header of the image in ``data`` (a seekable stream, left at its start),
    without decoding it; :class:`ImageError` when there is no readable header."""
    info = image_info(data, name)
    return info.width, info.height


def image_info(data: BinaryIO, name: str) -> ImageInfo:
    """The format and size from the header of the image in ``data`` (a seekable stream, left at its start),
    without decoding it (:attr:`ImageInfo.budget_pixels`: what it counts in the pixel budgets);
    :class:`ImageError` when there is no readable header."""
    try:
        with _pil_bomb_check_lifted(), Image.open(data) as im:
            fmt, size = str(im.format), im.size
    except UnidentifiedImageError:
        raise ImageError.for_file(name, "not an image in a format PIL can read") from None
    except _DECODE_ERRORS as e:
        raise ImageError.for_file(name, f"cannot read the image header ({type(e).__name__}: {e})") from None
    finally:
        data.seek(0)
    return ImageInfo(fmt, int(size[0]), int(size[1]))


def _decode(path: BinaryIO, p: str, stream: bool, max_pixels: int | None) -> Image.Image:
    try:
        with _pil_bomb_check_lifted():
            im = Image.open(path)
    except FileNotFoundError:
        raise ImageError.for_file(p, "no such file") from None
    except IsADirectoryError:
        raise ImageError.for_file(p, "is a directory, not an image file") from None
    except PermissionError as e:
        raise ImageError.for_file(
            p, f"permission denied ({e.strerror or e}); make the file readable or pass another file"
        ) from None
    except UnidentifiedImageError:
        size = len(path.getbuffer()) if isinstance(path, io.BytesIO) else None if stream else _file_size(p)
        raise ImageError.for_file(p, NOT_AN_IMAGE[size == 0]) from None
    except _DECODE_ERRORS as e:
        raise ImageError.for_file(p, f"cannot read the image header ({type(e).__name__}: {e})") from e

    with im:
        width, height = im.size
        within_limit(p, width, height, max_pixels, im.format)
        pixels = width * height
        pil_limit = Image.MAX_IMAGE_PIXELS
        # PIL re-checks sizes while decoding some formats (GIF frames, TIFF tiles): lift its check only
        # when this image, which our limit allows, is above PIL's own limit
        lift = pil_limit is not None and pixels > pil_limit
        try:
            with _pil_bomb_check_lifted() if lift else nullcontext():
                im.load()
        except MemoryError:
            raise ImageError.for_file(
                p, f"not enough memory to decode {width} x {height} pixels; lower --max-pixels"
            ) from None
        except _DECODE_ERRORS as e:
            raise ImageError.for_file(
                p, f"cannot decode the image, the file is truncated or corrupt ({type(e).__name__}: {e})"
            ) from e
        bits = _declared_bits(im)
        upright = _exif_transpose(im)
        try:
            rgb = to_rgb(upright, bits=bits)
        except (ValueError, OSError) as e:
            raise ImageError.for_file(p, f"cannot convert mode {upright.mode!r} to RGB ({e})") from e
    if rgb is im:  # keep nothing that refers to the closed file
        rgb = rgb.copy()
    return rgb


#: what a refusal by ``image_pixels`` says to do, after the limit (:func:`within_limit`)
RAISE_MAX_PIXELS = " (raise it with --max-pixels / eval.max_image_pixels)"


def within_limit(
    p: str,
    width: int,
    height: int,
    max_pixels: int | None,
    fmt: str | None = None,
    hint: str = RAISE_MAX_PIXELS,
) -> int:
    """The pixels of the budgets an image of ``width`` x ``height`` in format ``fmt`` counts as (its format's
    weight, :func:`budget_pixels`); :class:`ImageTooLargeError` naming ``p`` when that is above
    ``max_pixels`` (``hint`` follows the limit in the message), :class:`ImageError` when it is empty."""
    pixels = int(width) * int(height)
    if pixels <= 0:
        raise ImageError.for_file(p, f"empty image ({width} x {height} pixels)")
    counted = budget_pixels(fmt, width, height)
    if max_pixels is not None and counted > max_pixels:
        weight = "" if counted == pixels else (
            f", which a {fmt} image counts as {_megapixels(counted)} (its decoder holds "
            f"{PIXEL_WEIGHT[str(fmt)]:g} times what the others do)"
        )  # fmt: skip
        raise ImageTooLargeError.for_file(
            p,
            f"{width} x {height} = {_megapixels(pixels)} megapixels{weight} is above the limit of "
            f"{_megapixels(max_pixels)} megapixels{hint}",
        )
    return counted


#: the reason given for a file PIL does not recognise: ``NOT_AN_IMAGE[True]`` when it is empty
NOT_AN_IMAGE = {
    False: "not an image in a format PIL can read (expected e.g. JPEG, PNG, BMP, GIF, TIFF or WebP)",
    True: "an empty file (expected e.g. JPEG, PNG, BMP, GIF, TIFF or WebP)",
}

#: how a complete file of a format ends (after any padding of NUL bytes or white space): JPEG's end-of-image
#: marker, PNG's IEND chunk with its CRC, GIF's trailer
ENDINGS = {"JPEG": b"\xff\xd9", "MPO": b"\xff\xd9", "PNG": b"IEND\xaeB`\x82", "GIF": b";"}


def check_image_file(path: str | os.PathLike[str], max_pixels: int | None = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """What can be known of an image file without decoding it, as :func:`open_image` would find it: a
    regular file, not empty, a header PIL reads (its format and size), at most ``max_pixels`` pixels, and,
    for a format whose files end in a known way (:data:`ENDINGS`; WebP and BMP: the size their header
    declares), that ending (other formats, TIFF among them, are found truncated when they are decoded). A
    file that lacks its ending is decoded, so that a truncated or corrupt one is refused with
    :func:`open_image`'s error while one with bytes after its end is accepted. Reads a header and the last
    bytes of most files; :class:`ImageError` names the file and the fault."""
    _check_max_pixels(max_pixels)
    p = os.fspath(path)
    with _open_regular(p) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ImageError.for_file(p, NOT_AN_IMAGE[True])
        try:
            with _pil_bomb_check_lifted(), Image.open(f) as im:
                fmt, (width, height) = str(im.format), im.size
        except UnidentifiedImageError:
            raise ImageError.for_file(p, NOT_AN_IMAGE[False]) from None
        except _DECODE_ERRORS as e:
            raise ImageError.for_file(p, f"cannot read the image header ({type(e).__name__}: {e})") from None
        within_limit(p, width, height, max_pixels, fmt)
        complete = _ends_complete(f, fmt, size)
    if not complete:
        open_image(p, max_pixels)  # truncated data raises here; bytes after a complete image do not
    return ImageInfo(fmt, int(width), int(height))


def _ends_complete(f: BinaryIO, fmt: str, size: int) -> bool:
    """Whether the open file ``f`` (``size`` bytes, of format ``fmt``) ends as a complete file of its format
    does (True for a format without a known ending)."""
    declared = _DECLARED_SIZE.get(fmt)  # (offset, bytes to add) of a little-endian size field
    if declared is not None:
        f.seek(declared[0])
        field = f.read(4)
        return len(field) == 4 and size >= int.from_bytes(field, "little") + declared[1]
    ending = ENDINGS.get(fmt)
    if ending is None:
        return True
    f.seek(max(0, size - 256))
    return f.read().rstrip(b"\0\r\n\t ").endswith(ending)


#: formats whose header declares the file's size: (offset of the 4-byte little-endian field, bytes it leaves
#: out): WebP's RIFF chunk size, BMP's file size
_DECLARED_SIZE = {"WEBP": (4, 8), "BMP": (2, 0)}


@dataclass(frozen=True)
class ImageInfo:
    """An image file's format (PIL's name: ``JPEG``, ``PNG`` ...) and size, read from its header."""

    format: str
    width: int
    height: int

    @property
    def budget_pixels(self) -> int:
        """The pixels of the pixel budgets it counts as (:func:`budget_pixels`)."""
        return budget_pixels(self.format, self.width, self.height)


def _file_size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def load_images(
    paths: Iterable[str | os.PathLike[str]],
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    skip_unreadable: bool = False,
) -> tuple[list[Image.Image], list[str], list[tuple[str, str]]]:
    """Decode several image files with :func:`open_image`.

    Returns ``(images, kept, skipped)``: the RGB images, the paths they came from (same order), and a
    ``(path, reason)`` pair for each file that could not be used. Without ``skip_unreadable`` the first
    bad file raises its :class:`ImageError` (so ``skipped`` is always empty).
    """
    _check_max_pixels(max_pixels)
    images: list[Image.Image] = []
    kept: list[str] = []
    skipped: list[tuple[str, str]] = []
    for path in paths:
        p = os.fspath(path)
        try:
            img = open_image(p, max_pixels=max_pixels)
        except ImageError as e:
            if not skip_unreadable:
                raise
            skipped.append((p, e.reason or str(e)))
            continue
        images.append(img)
        kept.append(p)
    return images, kept, skipped


def describe_skipped(skipped: Iterable[tuple[str, str]]) -> str:
    """One line per skipped file, ``"  PATH: REASON"`` (for a CLI warning)."""
    return "\n".join(f"  {p}: {why}" for p, why in skipped)
