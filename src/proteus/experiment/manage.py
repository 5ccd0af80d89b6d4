"""Managing a knowledge base after the fact, each a commit like any other (under the write lock, atomic,
the previous state kept in ``manifest.prev.json``):

* ``proteus kb calibrate``: a new true-positive rate for the rejection of inputs from no learned task,
  from what each task stored (``--tpr``), or thresholds fitted on a folder of the user's own held-out
  images (``--images DIR``, :func:`calibrate_images`; an old KB gains rejection this way), and with them
  the confidence temperature of each task whose classes' sub-folders hold enough images;
* ``proteus kb forget``: remove a task from what can be predicted (:meth:`proteus.Proteus.forget_task`);
* ``proteus kb undo``: go back to the previous commit (what the last learn, forget or calibrate changed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from proteus.engine.confidence import MIN_ROWS, Confidence, fit_temperature
from proteus.engine.novelty import Calibration, check_tpr
from proteus.experiment.predictions import predict_batches, predict_images
from proteus.experiment.store import commit, load_learner
from proteus.kb import KBError, KnowledgeBase, write_lock
from proteus.learners import ContinualLearner, RetrievalLearner, retrieval_learner
from proteus.streams.datasets import IMG_EXTENSIONS, list_class_dirs, list_images

__all__ = [
    "calibrate_confidence", "calibrate_images", "calibrate_novelty", "calibration_images", "forget",
    "recalibrate", "undo",
]  # fmt: skip


def recalibrate(
    kb_dir: str | Path, tpr: float, wait: float | None = 0.0, key: bytes | None = None
) -> list[float]:
    """Set every task's rejection threshold to the true-positive rate ``tpr``; returns the thresholds.
    ``key``: the KB's signing key (checked on open, the new commit signed; docs/reliability.md)."""
    with write_lock(kb_dir, wait=wait):
        kb = KnowledgeBase.open(kb_dir, key=key)
        manifest = dict(kb.manifest)
        tasks = [dict(t) for t in manifest["tasks"]]
        keyed = all(t.get("calibration") for t in tasks)
        rows = any(t.get("novelty") for t in tasks)
        if not tasks or not (keyed or rows):
            raise KBError(
                f"{kb_dir}: no task stored calibration scores or rows; fit thresholds from held-out "
                "images with `proteus kb calibrate KB --images DIR`, or learn with --set "
                "retrieval.reject=true"
            )
        for t in tasks:
            if keyed:
                t["calibration"] = Calibration.from_dict(t["calibration"]).at(tpr).to_dict()
            if t.get("novelty"):
                t["novelty"] = {**t["novelty"], "tpr": check_tpr(tpr)}
        manifest["tasks"] = tasks
        kb.commit(manifest)
        if keyed:
            return [float(t["calibration"]["threshold"]) for t in tasks]
    clf = retrieval_learner(
        load_learner(KnowledgeBase.open(kb_dir, key=key), "proteus kb calibrate"), "proteus kb calibrate"
    )
    return clf.keys_.novelty_thresholds([t.classes for t in clf.records_])


def calibration_images(images_dir: str | Path, class_names: list[str]) -> tuple[list[str], list[int]]:
    """The image files of ``images_dir`` and their global labels: the files in a sub-folder named after a
    learned class get that class, a class name with ``/`` being nested folders (``cifar10-subset/cat`` is
    ``images_dir/cifar10-subset/cat/``, the layout of the ``domains*`` streams' data); files directly
    inside ``images_dir`` or inside a folder on the way to a class (``images_dir/cifar10-subset/``) get -1
    (the nearest class is taken). A sub-folder that names no learned class and leads to none is refused
    by name."""
    root = Path(images_dir)
    if not root.is_dir():
        raise KBError(f"{root}: not a folder of images (give a folder of held-out images of learned tasks)")
    index = {name: i for i, name in enumerate(class_names)}
    on_the_way = {name.rsplit("/", j)[0] for name in class_names for j in range(1, name.count("/") + 1)}
    files: list[str] = []
    labels: list[int] = []

    def walk(folder: Path, rel: str, label: int) -> None:
        names = list_images(folder)
        files.extend(str(folder / n) for n in names)
        labels.extend([label] * len(names))
        if rel and rel not in on_the_way:  # a class's own folder: its images only, as ImageFolder reads it
            return
        for sub in list_class_dirs(folder):
            name = f"{rel}/{sub}" if rel else sub
            if name not in index and name not in on_the_way:
                raise KBError(f"{folder / sub}: names no learned class ({_folder_rule(class_names)})")
            walk(folder / sub, name, index.get(name, -1))

    walk(root, "", -1)
    if not files:
        raise KBError(f"{root}: holds no image file (suffixes: {', '.join(sorted(IMG_EXTENSIONS))})")
    return files, labels


def _folder_rule(class_names: list[str]) -> str:
    """What a calibration sub-folder must be called, with the learned classes as examples."""
    shown = ", ".join(class_names[:12]) + (", ..." if len(class_names) > 12 else "")
    nested = next((n for n in class_names if "/" in n), None)
    how = f"; a name with '/' is nested folders: {nested}/ for {nested}" if nested else ""
    return f"sub-folders must be class names{how}; learned: {shown}"


def calibrate_novelty(
    clf: RetrievalLearner,
    images: Sequence[str | os.PathLike[str]],
    labels: Sequence[int],
    tpr: float | None = None,
) -> list[float]:
    """Fit the class-Gaussian thresholds of inputs from no learned task (``retrieval.novelty``) on held-out
    image files: ``labels`` their global classes (-1: unknown, the nearest class is taken), ``tpr`` a new
    true-positive rate (None: keep it). Returns each task's threshold."""
    space, classes = clf.keys_.space, clf.records_.classes()
    if space is None:  # keys under each task's own adapter: no one space, no class statistics
        return clf.keys_.calibrate(torch.zeros(0), torch.zeros(0), [], tpr)

    def embed(ims: list[Image.Image]) -> torch.Tensor:  # the key space's features (and tap statistics)
        z, taps = clf.embedder_.prefix_taps(clf.transform_images(ims))
        return torch.cat([space.embed(clf.embedder_, z, shard=False), taps], 1)

    ec = clf.config.eval
    batches = predict_batches(
        images, embed, ec.batch_size, progress=clf.progress, max_pixels=ec.max_image_pixels
    )
    both = torch.cat([b.prediction for b in batches if b.prediction is not None])  # none skipped here
    d = clf.embedder_.model.embed_dim
    X, taps = both[:, :d], both[:, d:]
    return clf.keys_.calibrate(X, torch.as_tensor(list(labels), dtype=torch.long), classes, tpr, taps)


def calibrate_confidence(
    clf: ContinualLearner, images: Sequence[str | os.PathLike[str]], labels: Sequence[int]
) -> dict[int, Confidence]:
    """Refit the confidence temperature (:mod:`proteus.engine.confidence`) of every task with at least
    :data:`~proteus.engine.confidence.MIN_ROWS` labelled held-out images (``labels`` >= 0; -1, an image
    of no known class, is left out) on the whole learner's predictions of them. Returns the new ones by
    task (0-based); the other tasks keep theirs."""
    chosen = [(f, y) for f, y in zip(images, labels, strict=True) if y >= 0]
    if not chosen:
        return {}
    files = [f for f, _ in chosen]
    batches = predict_images(clf, files, progress=clf.progress)
    logits = torch.cat([b.prediction.logits for b in batches if b.prediction is not None])
    y = torch.as_tensor([y for _, y in chosen], dtype=torch.long)
    of = clf.records_.task_of()[y]
    fitted = {}
    for k, rec in enumerate(clf.records_):
        rows = of == k
        t = fit_temperature(logits[rows], y[rows]) if int(rows.sum()) >= MIN_ROWS else None
        if t is not None and not rec.forgotten:
            rec.confidence = fitted[k] = Confidence(t, int(rows.sum()))
    return fitted


def calibrate_images(
    kb_dir: str | Path,
    images_dir: str | Path,
    tpr: float | None = None,
    wait: float | None = 0.0,
    key: bytes | None = None,
) -> tuple[list[float], dict[int, Confidence]]:
    """Fit the rejection thresholds of inputs from no learned task on the user's own held-out images
    (:func:`calibration_images`), and the confidence temperature of every task with enough images in
    its classes' sub-folders (:func:`calibrate_confidence`), and commit them; ``tpr`` a new
    true-positive rate (None: the KB's). Works on a knowledge base learned before thresholds or
    temperatures were fitted by default. Returns each task's threshold and the new temperatures."""
    with write_lock(kb_dir, wait=wait):
        kb = KnowledgeBase.open(kb_dir, key=key)
        clf = retrieval_learner(
            load_learner(kb, "proteus kb calibrate --images"), "proteus kb calibrate --images"
        )
        files, labels = calibration_images(images_dir, list(clf.classes_))
        thresholds = calibrate_novelty(clf, files, labels, tpr)
        temperatures = calibrate_confidence(clf, files, labels)
        commit(kb, clf)
        return thresholds, temperatures


def forget(kb_dir: str | Path, task: int, wait: float | None = 0.0, key: bytes | None = None) -> list[str]:
    """Forget task ``task`` (1-based, as in the CLI); returns its class names."""
    with write_lock(kb_dir, wait=wait):
        kb = KnowledgeBase.open(kb_dir, key=key)
        clf = retrieval_learner(load_learner(kb, "proteus kb forget"), "proteus kb forget")
        clf.forget_task(task - 1)
        commit(kb, clf)
        return list(clf.records_[task - 1].class_names)


def undo(kb_dir: str | Path, wait: float | None = 0.0, key: bytes | None = None) -> dict[str, Any]:
    """Make the previous commit the current state again (itself a commit, so ``undo`` twice redoes);
    returns what was restored and what it replaced (:meth:`KnowledgeBase.undo`)."""
    with write_lock(kb_dir, wait=wait):
        return KnowledgeBase.open(kb_dir, key=key).undo()
