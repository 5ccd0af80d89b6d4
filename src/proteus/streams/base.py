"""Task streams for class-incremental continual fine-tuning (paper Sec. 5.1, Appendix "Datasets,
Hyperparameters").

A benchmark turns a dataset into a :class:`TaskStream`: a sequence of :class:`Task` objects with disjoint
class sets. Class ordering follows PyCIL / RanPAC / LAMDA-PILOT: a seeded permutation
``numpy.random.RandomState(seed).permutation(num_classes)`` of the original class indices (seed 1993 by
default), the classes are relabelled so that the global label of a class is its position in that order, and
the tasks are consecutive equal chunks of the order (``num_tasks`` must divide the number of classes).

Every stream carries a JSON-serialisable manifest that pins the split exactly: the class order (original
class names), the tasks, and for each split the number of items and a sha256 over the sorted list of
``(relative path or source index, global label)`` pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from proteus.registry import Registry
from proteus.streams.datasets import LabeledImageDataset, list_class_dirs, scan_image_folder
from proteus.streams.errors import BenchmarkError, TaskSpecError
from proteus.streams.options import BenchmarkConfig

#: manifest schema version; bump when a key changes meaning
MANIFEST_VERSION = 1

#: environment variable naming the folder that holds the datasets when ``benchmark.data`` is not set
DATA_ENV = "PROTEUS_DATA"

BenchmarkFactory = Callable[[BenchmarkConfig], "TaskStream"]

#: name -> factory(cfg: BenchmarkConfig) -> TaskStream
BENCHMARKS: Registry[BenchmarkFactory] = Registry(
    "benchmark", plugins=("proteus.streams.builtin", "proteus.streams.domains", "proteus.streams.vtab")
)


@dataclass
class Task:
    """One task of the stream: its classes (global labels) and its train and test sets.

    Items of ``train`` and ``test`` are ``(PIL.Image RGB, int global label)``; no transform is applied.
    """

    index: int
    classes: list[int]
    class_names: list[str]
    train: Dataset
    test: Dataset
    #: each class's index in its source dataset (torchvision's target, the ImageFolder folder index, ...)
    source_classes: list[int] | None = None
    #: the number of tasks of its stream (set by :class:`TaskStream`; a pool or threshold schedule of a
    #: baseline is divided over them)
    stream_tasks: int | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)


@dataclass
class TaskStream:
    """A benchmark's ordered tasks, the names of all classes (indexed by global label) and its manifest."""

    name: str
    tasks: list[Task]
    class_names: list[str]
    manifest: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.tasks:
            t.stream_tasks = len(self.tasks)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def task_of_label(self) -> list[int]:
        """``out[label]`` = index of the task holding global label ``label`` (the true task of a sample)."""
        out = [-1] * self.num_classes
        for t in self.tasks:
            for c in t.classes:
                out[c] = t.index
        return out

    def write_manifest(self, path: str | os.PathLike[str]) -> None:
        """Write the manifest as indented, key-sorted JSON (parent folders are created)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")

    def summary(self) -> str:
        """A few human-readable lines: name, classes, and per task its classes and split sizes."""
        lines = [f"{self.name}: {self.num_tasks} tasks, {self.num_classes} classes"]
        for t in self.tasks:
            names = ", ".join(t.class_names[:6]) + (", ..." if len(t.class_names) > 6 else "")
            lines.append(
                f"  task {t.index + 1}: {t.num_classes} classes ({names}); "
                f"{len(t.train)} train / {len(t.test)} test"  # type: ignore[arg-type]
            )
        return "\n".join(lines)


def build_benchmark(cfg: BenchmarkConfig) -> TaskStream:
    """Build the task stream named by ``cfg.name`` (see ``BENCHMARKS.describe()`` for the choices; the
    package's ``__init__`` imports the modules that register them)."""
    return BENCHMARKS.get(cfg.name)(cfg)


# ---------------------------------------------------------------------------------------------- helpers
def data_root(cfg: BenchmarkConfig, default_subdir: str) -> Path:
    """``cfg.data`` if set, else ``$PROTEUS_DATA/<default_subdir>``, else ``./data/<default_subdir>``."""
    if cfg.data:
        return Path(cfg.data).expanduser()
    return Path(os.environ.get(DATA_ENV, "data")).expanduser() / default_subdir


def seeded_class_order(num_classes: int, seed: int) -> list[int]:
    """PyCIL's class order: ``np.random.RandomState(seed).permutation(num_classes)`` (original indices)."""
    return [int(x) for x in np.random.RandomState(seed).permutation(num_classes)]


def equal_chunks(num_classes: int, num_tasks: int, benchmark: str) -> list[list[int]]:
    """Global labels ``0..num_classes-1`` cut into ``num_tasks`` consecutive equal chunks."""
    if num_tasks < 1 or num_classes % num_tasks != 0:
        divisors = [d for d in range(1, num_classes + 1) if num_classes % d == 0]
        raise TaskSpecError(
            f"{benchmark}: num_tasks={num_tasks} does not divide its {num_classes} classes into equal tasks; "
            f"choose one of {divisors}"
        )
    k = num_classes // num_tasks
    return [list(range(i * k, (i + 1) * k)) for i in range(num_tasks)]


def split_sha256(keys: Sequence[str] | Sequence[int], targets: Sequence[int]) -> str:
    """sha256 of the JSON of the sorted ``[key, label]`` pairs of a split (stable across runs, machines)."""
    pairs = sorted(zip(keys, (int(t) for t in targets)))
    payload = json.dumps([[k, t] for k, t in pairs], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def cap_per_class(ds: LabeledImageDataset, cap: int | None, seed: int) -> LabeledImageDataset:
    """Keep at most ``cap`` items per label, chosen by ``RandomState(seed)`` (labels visited in sorted order).

    Kept items stay in dataset order. ``cap=None`` returns ``ds`` unchanged.
    """
    if cap is None:
        return ds
    if cap < 1:
        raise TaskSpecError(f"max_train_per_class must be a positive integer, got {cap}")
    rng = np.random.RandomState(seed)
    t = np.asarray(ds.targets, dtype=np.int64)
    keep: list[np.ndarray] = []
    for label in np.unique(t):
        idx = np.flatnonzero(t == label)
        if len(idx) > cap:
            idx = np.sort(rng.choice(idx, size=cap, replace=False))
        keep.append(idx)
    return ds.select(np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64))


def assemble_stream(
    name: str,
    *,
    root: Path | str | None,
    train: LabeledImageDataset,
    test: LabeledImageDataset,
    source_class_names: Sequence[str],
    order: Sequence[int],
    tasks: Sequence[Sequence[int]],
    seed: int,
    max_train_per_class: int | None = None,
    extra: dict[str, Any] | None = None,
    source_index: Sequence[int] | None = None,
) -> TaskStream:
    """Relabel, cap, split into tasks and write the manifest.

    ``train``/``test`` carry *source* labels (indices into ``source_class_names``); ``order`` lists the
    source indices in stream order, so global label ``g`` is source class ``order[g]``; ``tasks`` lists the
    global labels of each task (disjoint, covering ``range(len(order))``). Source classes not in ``order``
    are dropped. ``source_index[i]``: source class i's index in its dataset (torchvision's target, the
    ImageFolder folder index); default ``i``, when ``source_class_names`` is the dataset's whole class list.
    """
    n = len(order)
    if len(set(order)) != n:
        raise TaskSpecError(f"{name}: the class order repeats a class")
    flat = [c for t in tasks for c in t]
    if sorted(flat) != list(range(n)):
        raise TaskSpecError(f"{name}: tasks must partition the global labels 0..{n - 1}")
    class_names = [str(source_class_names[o]) for o in order]
    mapping = {int(o): g for g, o in enumerate(order)}
    tr = train.relabel(mapping)
    te = test.relabel(mapping)
    tr = cap_per_class(tr, max_train_per_class, seed)
    tr_counts, te_counts = tr.class_counts(n), te.class_counts(n)
    for split, counts in (("train", tr_counts), ("test", te_counts)):
        empty = [class_names[g] for g in range(n) if counts[g] == 0]
        if empty:
            raise BenchmarkError(f"{name}: no {split} images for class(es) {', '.join(empty)}")

    task_objs: list[Task] = []
    task_meta: list[dict[str, Any]] = []
    for i, labels in enumerate(tasks):
        labels = [int(c) for c in labels]
        t_tr = tr.select(tr.indices_of(labels))
        t_te = te.select(te.indices_of(labels))
        source = [int(order[c]) if source_index is None else int(source_index[order[c]]) for c in labels]
        task_objs.append(Task(i, labels, [class_names[c] for c in labels], t_tr, t_te, source))
        task_meta.append({"train": len(t_tr), "test": len(t_te)})

    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "benchmark": name,
        "root": None if root is None else str(Path(root).resolve()),
        "seed": int(seed),
        "num_classes": n,
        "num_tasks": len(tasks),
        "class_order": class_names,
        "source_index": [int(o) if source_index is None else int(source_index[o]) for o in order],
        "tasks": [[int(c) for c in t] for t in tasks],
        "task_sizes": task_meta,
        "max_train_per_class": max_train_per_class,
        # the per-class cap draws with RandomState(seed), labels visited in sorted order (cap_per_class)
        "max_train_per_class_seed": int(seed) if max_train_per_class is not None else None,
        "splits": {
            "train": {"count": len(tr), "sha256": split_sha256(tr.keys, tr.targets), "per_class": tr_counts},
            "test": {"count": len(te), "sha256": split_sha256(te.keys, te.targets), "per_class": te_counts},
        },
    }
    if extra:
        manifest.update(extra)
    return TaskStream(name=name, tasks=task_objs, class_names=class_names, manifest=manifest)


def assemble_named_tasks(
    name: str, cfg: BenchmarkConfig, root: Path, task_names: Sequence[Sequence[str]], extra: dict[str, Any]
) -> TaskStream:
    """A stream whose tasks are lists of ImageFolder class folders under ``root/{train,test}`` (``folder``,
    ``vtab5t``, ``vtab-sim50``): classes in task order, every class's source index its position among the
    sorted class folders of ``train/`` (torchvision's ImageFolder index)."""
    used = [c for t in task_names for c in t]
    folders = {c: i for i, c in enumerate(list_class_dirs(root / "train"))}
    tasks, pos = [], 0
    for t in task_names:
        tasks.append(list(range(pos, pos + len(t))))
        pos += len(t)
    return assemble_stream(
        name,
        root=root,
        train=scan_image_folder(root, "train", used),
        test=scan_image_folder(root, "test", used),
        source_class_names=used,
        order=list(range(len(used))),
        tasks=tasks,
        seed=cfg.class_order_seed,
        max_train_per_class=cfg.max_train_per_class,
        extra=extra,
        source_index=[folders[c] for c in used],
    )
