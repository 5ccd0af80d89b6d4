"""Benchmarks: task streams for class-incremental continual fine-tuning (paper Sec. 5.1, Appendix "Datasets,
Hyperparameters, and Pre-Trained Models").

``build_benchmark(cfg.benchmark)`` returns a :class:`TaskStream`; ``BENCHMARKS.describe()`` lists the
names. Items are ``(PIL.Image RGB, int global label)``; transforms are the learner's job
(:class:`TransformedDataset`).
"""

from proteus.lazy import exports

__all__ = [
    "ArrayImageDataset",
    "BENCHMARKS",
    "BenchmarkError",
    "CorruptImageError",
    "DEFAULT_NUM_TASKS",
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

__getattr__, __dir__ = exports(
    __name__,
    {
        "BENCHMARKS": "base",
        "DEFAULT_NUM_TASKS": "builtin",
        "ArrayImageDataset": "datasets",
        "BenchmarkError": "errors",
        "CorruptImageError": "errors",
        "DataNotFoundError": "errors",
        "ImageFileDataset": "datasets",
        "LabeledImageDataset": "datasets",
        "SubsetByLabels": "datasets",
        "Task": "base",
        "TaskSpecError": "errors",
        "TaskStream": "base",
        "TransformedDataset": "datasets",
        "build_abrupt_sequence": "abrupt",
        "build_benchmark": "base",
        "equal_chunks": "base",
        "load_image": "datasets",
        "load_task_spec": "builtin",
        "seeded_class_order": "base",
        "split_sha256": "base",
        "validate_tasks": "builtin",
    },
)
