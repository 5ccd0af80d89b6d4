"""Benchmarks: task streams for class-incremental continual fine-tuning (paper Sec. 5.1, Appendix "Datasets,
Hyperparameters, and Pre-Trained Models").

``build_benchmark(cfg.benchmark)`` returns a :class:`TaskStream`; ``BENCHMARKS.describe()`` lists the
names. Items are ``(PIL.Image RGB, int global label)``; transforms are the learner's job
(:class:`TransformedDataset`).
"""

from proteus.streams import builtin as _builtin  # noqa: F401  (registers quickstart, cifar, imagenet, folder)
from proteus.streams import domains as _domains  # noqa: F401  (registers domains5, domains-sim, domains-mixed)
from proteus.streams import vtab as _vtab  # noqa: F401  (registers vtab5t, vtab-sim50)
from proteus.streams.abrupt import build_abrupt_sequence
from proteus.streams.base import (
    BENCHMARKS,
    Task,
    TaskStream,
    build_benchmark,
    equal_chunks,
    seeded_class_order,
    split_sha256,
)
from proteus.streams.builtin import DEFAULT_NUM_TASKS, load_task_spec, validate_tasks
from proteus.streams.datasets import (
    ArrayImageDataset,
    ImageFileDataset,
    LabeledImageDataset,
    SubsetByLabels,
    TransformedDataset,
    load_image,
)
from proteus.streams.errors import BenchmarkError, CorruptImageError, DataNotFoundError, TaskSpecError

__all__ = [
    "BENCHMARKS",
    "DEFAULT_NUM_TASKS",
    "ArrayImageDataset",
    "BenchmarkError",
    "CorruptImageError",
    "DataNotFoundError",
    "ImageFileDataset",
    "LabeledImageDataset",
    "SubsetByLabels",
    "Task",
    "TaskSpecError",
    "TaskStream",
    "TransformedDataset",
    "build_abrupt_sequence",
    "build_benchmark",
    "equal_chunks",
    "load_image",
    "load_task_spec",
    "seeded_class_order",
    "split_sha256",
    "validate_tasks",
]
