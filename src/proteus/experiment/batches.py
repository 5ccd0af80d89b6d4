"""Prediction over a stream of image files (or PIL images) in batches, with throughput: what ``proteus
predict`` on a folder runs (:func:`predict_images`).

Files are decoded with :func:`proteus.images.load_images` (the same pixels as training), a batch at a time,
so memory stays bounded for any number of files; a progress bar counts images and shows images per
second. Each batch comes back as an :class:`ImageBatch` as soon as it is predicted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Generic, TypeVar

from PIL import Image

from proteus.config import ConfigError
from proteus.engine.records import Prediction
from proteus.images import DEFAULT_MAX_PIXELS, load_images
from proteus.progress import bar as progress_bar

__all__ = ["ImageBatch", "predict_batches", "predict_images"]

ImageInput = str | os.PathLike[str] | Image.Image
#: what ``predict`` returns for a batch (a :class:`Prediction`, or features)
P = TypeVar("P")


@dataclass
class ImageBatch(Generic[P]):
    """One predicted batch. ``files``: the names of the predicted inputs in order (a path, or ``image
    <i>`` for a PIL image given directly); ``prediction`` (None when every input of the batch was
    skipped); ``skipped``: ``(path, reason)`` of unreadable files (with ``skip_unreadable``); ``done``:
    inputs handled so far (predicted and skipped), ``predicted``: predicted so far, ``seconds``: wall
    time since the first batch started (decoding included)."""

    files: list[str]
    prediction: P | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    done: int = 0
    predicted: int = 0
    seconds: float = 0.0

    @property
    def images_per_second(self) -> float:
        """Predicted images per second so far."""
        return self.predicted / self.seconds if self.seconds > 0 else 0.0


def _decode(
    chunk: list[tuple[int, ImageInput]], max_pixels: int | None, skip_unreadable: bool
) -> tuple[list[Image.Image], list[str], list[tuple[str, str]]]:
    images: list[Image.Image] = []
    names: list[str] = []
    skipped: list[tuple[str, str]] = []
    for i, item in chunk:
        if isinstance(item, Image.Image):
            images.append(item.convert("RGB") if item.mode != "RGB" else item)
            names.append(f"image {i}")
            continue
        ims, kept, skip = load_images([item], max_pixels=max_pixels, skip_unreadable=skip_unreadable)
        images += ims
        names += kept
        skipped += skip
    return images, names, skipped


def predict_batches(
    items: Iterable[ImageInput],
    predict: Callable[[list[Image.Image]], P],
    batch_size: int,
    *,
    progress: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    skip_unreadable: bool = False,
    total: int | None = None,
) -> Iterator[ImageBatch[P]]:
    """Decode ``items`` ``batch_size`` at a time and yield each batch's prediction by ``predict``."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    it = enumerate(items)
    bar = progress_bar(desc="predict", total=total, unit="img", enabled=progress)
    t0 = time.perf_counter()
    done = predicted = 0
    try:
        while chunk := list(islice(it, batch_size)):
            images, names, skipped = _decode(chunk, max_pixels, skip_unreadable)
            pred = predict(images) if images else None
            done += len(chunk)
            predicted += len(images)
            bar.update(len(chunk))
            yield ImageBatch(names, pred, skipped, done, predicted, time.perf_counter() - t0)
    finally:
        bar.close()


def predict_images(
    clf: Any,
    images: Iterable[ImageInput],
    batch_size: int | None = None,
    *,
    progress: bool | None = None,
    max_pixels: int | None = None,
    skip_unreadable: bool = False,
) -> Iterator[ImageBatch[Prediction]]:
    """A learner's ``predict`` over image files (or PIL images), decoded a batch at a time: one
    :class:`ImageBatch` per batch; ``progress`` (default: the learner's) shows a bar of images and images/s.
    Defaults: ``eval.batch_size``, ``eval.max_image_pixels``."""
    ec = clf.config.eval
    return predict_batches(
        images,
        lambda ims: clf.predict(clf.transform_images(ims)),
        batch_size or ec.batch_size,
        progress=clf.progress if progress is None else progress,
        max_pixels=max_pixels or ec.max_image_pixels,
        skip_unreadable=skip_unreadable,
    )
