"""Prediction over image files and its readable rows: the one prediction module of ``proteus predict``,
``proteus serve`` and ``kb calibrate``, typed to the learner protocol
(:class:`~proteus.learners.ContinualLearner`).

Files are decoded a batch at a time with :func:`proteus.images.load_images` (the same pixels as training),
so memory stays bounded for any number of files (:func:`predict_images`, :func:`predict_batches`: each batch
an :class:`ImageBatch` as soon as it is predicted, a progress bar of images and images per second), and each
input's answer becomes one JSON row, the same for ``proteus predict`` and ``proteus serve``
(:func:`prediction_rows`).

The schema (docs/predict.md):

``file``        the input's name
``class``       the predicted class name; ``label`` its index among the classes learned so far (the global
                label of the stream: the position in the knowledge base's class order); ``class_index``
                its index in the source dataset (torchvision's target, the ImageFolder folder index;
                null for a knowledge base of a release before it was recorded)
``task``        the retrieved task, 1-based (null for a method without retrieval)
``component``   the retrieved signature component within that task, 1-based (null likewise)
``signature_score``  the retrieved task's key score: lower is better. For the paper's Gaussian keys it is
                the negative log-likelihood of the embedding under the best component (Eq. 2 with the log
                determinant), in nats, comparable across tasks; for LDA keys it is minus the best class
                score of the task's key head.
``head_score``  Eq. 23's score of the predicted class: the ridge (LDA) head regresses one-hot targets, so
                scores are near 1 for a confident class and near 0 for the others.
``p_task``      softmax of the head's scores over the retrieved task's classes (the probability among the
                classes the retrieval says are possible; null when Eq. 23, which scores every learned
                class, picks a class of another task); ``p_all``: the same over every learned class.
                The head is a ridge regression, not a trained classifier, so these are relative confidences
                on the scale of score differences (a difference of 1 is a factor e), not calibrated
                probabilities.
``head_softmax`` the previous name of ``p_all`` (deprecated, kept for existing scripts)
``confidence``  the calibrated probability of the predicted class among the learned classes: ``p_all``
                with the scores divided by the temperature of the class's task (fitted when the task
                was learned, :mod:`proteus.engine.confidence`); equal to ``p_all`` where the task has no
                temperature (a knowledge base learned before temperatures were fitted)
``temperature`` that temperature, null where the task has none; ``calibrated``: whether it had one
``class``       null for an input from no learned task (``known`` false); ``nearest_class`` always names
                the learned class nearest the input (``label`` is its index)
``known``       false for an input from no learned task (its retrieved task's key score is above that
                task's threshold, calibrated when it was learned with ``retrieval.reject``); null when
                the tasks are not calibrated. ``novelty``: the score minus that threshold (> 0: rejected)
``top_k``       the k best classes of the retrieved task with their ``p_task`` and ``confidence``
                (the calibrated probability among the learned classes, with the row's temperature;
                ``--top-k``)

Every number of a row depends on its own input only: rows do not change with the other inputs of the
batch (beyond float round-off).

``proteus predict --out FILE`` writes the rows as JSON Lines (one object per line, as above) or CSV
(:func:`csv_row`: the same keys as columns, ``top_k`` as ``top1_class``, ``top1_confidence``, ...); a file
skipped as unreadable gets a row with its ``file`` and ``error`` only. :class:`Summary` counts what a run
predicted.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Generic, TypeVar

import torch
from PIL import Image

from proteus.config import ConfigError
from proteus.engine.confidence import calibrated_probabilities
from proteus.engine.records import Prediction
from proteus.images import DEFAULT_MAX_PIXELS, load_images
from proteus.learners import ContinualLearner
from proteus.progress import bar as progress_bar

__all__ = [
    "CSV_COLUMNS",
    "NOT_CALIBRATED",
    "NOT_CHECKED",
    "ImageBatch",
    "Summary",
    "csv_columns",
    "csv_row",
    "format_row",
    "predict_batches",
    "predict_images",
    "prediction_rows",
]


def prediction_rows(
    clf: ContinualLearner, pred: Prediction, files: list[str], top_k: int = 1
) -> list[dict[str, Any]]:
    """The readable rows of a batch's prediction (module docstring: the schema)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be an integer >= 1; got {top_k!r}")
    names = clf.classes_
    task_classes = [t.classes for t in clf.records_]
    source = {
        g: s
        for t in clf.records_
        if t.source_classes is not None
        for g, s in zip(t.classes, t.source_classes)
    }
    p_all = torch.softmax(pred.logits.double(), 1)
    temps = clf.records_.temperatures()
    p_cal, T = calibrated_probabilities(pred.logits, pred.label, temps, clf.records_.task_of())
    rows = []
    for j, file in enumerate(files):
        c = int(pred.label[j])
        if pred.task is not None:
            k = int(pred.task[j])
            own = torch.as_tensor(task_classes[k])
        else:  # no retrieval: every learned class is possible
            k = None
            own = torch.arange(pred.logits.shape[1])
        p_own = torch.softmax(pred.logits[j, own].double(), 0)
        order = p_own.argsort(descending=True)[:top_k]
        in_task = (own == c).nonzero()
        p_task = float(p_own[in_task[0, 0]]) if len(in_task) else None
        known = None if pred.known is None else bool(pred.known[j])
        rows.append(
            {
                "file": file,
                "class": None if known is False else names[c],  # an input from no learned task has none
                "nearest_class": names[c],
                "label": c,
                "class_index": source.get(c),
                "task": None if k is None else k + 1,
                "component": None if pred.component is None else int(pred.component[j]) + 1,
                "signature_score": None if pred.score is None else float(pred.score[j]),
                "known": known,
                "novelty": None if pred.novelty is None else float(pred.novelty[j]),
                "head_score": float(pred.logits[j, c]),
                "p_task": p_task,
                "p_all": float(p_all[j, c]),
                "head_softmax": float(p_all[j, c]),  # deprecated name of p_all (kept for old scripts)
                "confidence": float(p_cal[j, c]),
                "temperature": None if torch.isnan(T[j]) else float(T[j]),
                "calibrated": not bool(torch.isnan(T[j])),
                "top_k": [
                    {
                        "class": names[int(own[i])],
                        "label": int(own[i]),
                        "class_index": source.get(int(own[i])),
                        "p_task": float(p_own[i]),
                        "confidence": float(p_cal[j, int(own[i])]),
                    }
                    for i in order
                ],
            }
        )
    return rows


def format_row(r: dict[str, Any], verbose: bool = False) -> str:
    """One line of ``proteus predict``'s text output: the class and how likely it is, the task it came
    from, or ``unknown`` when the input is from no learned task. Where the class's task has a temperature
    the number is ``p``, the calibrated probability of the class among the learned classes
    (``confidence``), and the line says so; otherwise it is ``confidence``, the uncalibrated ``p_all``, as
    knowledge bases learned before temperatures were fitted show it (:data:`NOT_CALIBRATED` is said once
    under the output). ``verbose`` adds the retrieval's raw numbers (component, signature score,
    novelty, ``p_task``, the temperature) and the top-k classes' numbers are the same kind as the line's."""
    calibrated = r.get("calibrated") is True
    if r["known"] is False:
        line = f"{r['file']}: unknown (from no learned task; nearest class {r['nearest_class']})"
    else:
        if calibrated:
            line = f"{r['file']}: {r['class']}  p = {r['confidence']:.2f} (probability among learned classes)"
        else:
            line = f"{r['file']}: {r['class']}  confidence {r['p_all']:.2f}"
        if r["task"] is not None:
            line += f"  task {r['task']}"
    if verbose:
        if r["task"] is not None:
            line += f"  [component {r['component']}, signature score {r['signature_score']:.2f}"
            line += f", novelty {r['novelty']:.2f}]" if r.get("novelty") is not None else "]"
        if r["p_task"] is not None:
            line += f"  p_task {r['p_task']:.2f}"
        if calibrated:
            line += f"  p_all {r['p_all']:.2f}, temperature {r['temperature']:.3g}"
    if len(r["top_k"]) > 1:
        key = "confidence" if calibrated else "p_task"
        line += "  top-k " + ", ".join(f"{t['class']} {t[key]:.2f}" for t in r["top_k"])
    return line


#: said once under the text output when some answer's number is not a calibrated probability
NOT_CALIBRATED = (
    "note: 'confidence' is a relative score, not a probability: this knowledge base stores no temperature "
    "for these tasks (learned before proteus fitted them; docs/predict.md)"
)


#: said once under the text output when nothing can say whether an input is from a learned task
NOT_CHECKED = (
    "note: this knowledge base has no rejection thresholds, so an input from no learned task still gets a "
    "class; fit them with `proteus kb calibrate KB --images DIR` (held-out images; docs/predict.md)"
)


#: the columns of ``predict --out FILE.csv`` (``top_k`` flattened by :func:`csv_columns`; ``head_softmax``,
#: the deprecated name of ``p_all``, left out); ``error``: why a skipped file has no prediction
CSV_COLUMNS = ("file", "class", "nearest_class", "label", "class_index", "task", "component",
               "signature_score", "known", "novelty", "head_score", "p_task", "p_all", "confidence",
               "temperature", "calibrated", "error")  # fmt: skip


def csv_columns(top_k: int) -> list[str]:
    """The CSV header for rows of ``top_k`` best classes (those columns only when ``top_k`` > 1)."""
    if top_k == 1:
        return list(CSV_COLUMNS)
    return [*CSV_COLUMNS, *(f"top{i}_{key}" for i in range(1, top_k + 1) for key in ("class", "confidence"))]


def csv_row(r: dict[str, Any], columns: list[str]) -> list[str]:
    """Row ``r`` (a prediction, or ``{"file", "error"}``) as CSV cells of ``columns``: null empty, booleans
    ``true``/``false`` as in JSON, numbers as Python writes them (every digit)."""
    flat = dict(r)
    for i, t in enumerate(r.get("top_k") or [], 1):
        flat[f"top{i}_class"], flat[f"top{i}_confidence"] = t["class"], t["confidence"]

    def cell(v: Any) -> str:
        return "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return [cell(flat.get(c)) for c in columns]


@dataclass
class Summary:
    """What a prediction over many files came to: the inputs predicted per class, those from no learned
    task (``unknown``), the files skipped as unreadable and those of the folders given that are no images."""

    classes: Counter[str] = field(default_factory=Counter)
    unknown: int = 0
    unreadable: int = 0
    ignored: int = 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Count a batch's rows."""
        for r in rows:
            if r["known"] is False:
                self.unknown += 1
            else:
                self.classes[r["class"]] += 1

    @property
    def predicted(self) -> int:
        """Inputs that got a row (a class or unknown)."""
        return sum(self.classes.values()) + self.unknown

    def line(self, seconds: float) -> str:
        """``"1000 images in 12.3 s (81.3 images/s): cat 512, dog 480, unknown 8; 2 unreadable (skipped)"``:
        the classes most predicted first."""
        n = self.predicted
        rate = f" ({n / seconds:.1f} images/s)" if seconds > 0 else ""
        counts = [f"{c} {k}" for c, k in sorted(self.classes.items(), key=lambda ck: (-ck[1], ck[0]))]
        counts += [f"unknown {self.unknown}"] if self.unknown else []
        text = f"{n} image{'s' if n != 1 else ''} in {seconds:.1f} s{rate}"
        text += f": {', '.join(counts)}" if counts else ""
        if self.unreadable:
            text += f"; {self.unreadable} unreadable (skipped)"
        if self.ignored:
            files = "file" if self.ignored == 1 else "files"
            text += f"; {self.ignored} other {files} in the folders ignored (no image)"
        return text


# ---------------------------------------------------------------------------- image files in batches
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
    clf: ContinualLearner,
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
