"""``benchmark.*``: which task stream, where its data is and how it is cut into tasks (Sec. 5.1)."""

from __future__ import annotations

from dataclasses import dataclass

from proteus.options import AT_LEAST_1, option

__all__ = ["BenchmarkConfig"]


@dataclass
class BenchmarkConfig:
    """The task stream: its name, data and class order (Sec. 5.1)."""

    name: str = option("quickstart", help="the task stream (proteus list benchmarks)")
    data: str | None = option(None, help="the dataset's root folder", per_task=True)
    num_tasks: int | None = option(
        None, help="the number of tasks (null: the stream's own)", range=AT_LEAST_1
    )
    tasks_file: str | None = option(
        None,
        help="a YAML file listing each task's classes (the folder benchmark's; an override)",
        per_task=True,
    )
    class_order_seed: int = option(1993, help="the seed of the class order (1993, as the baselines' code)")
    max_train_per_class: int | None = option(
        None, help="cap per-class training images (null: all); test sets are never capped", range=AT_LEAST_1
    )
    download: bool = option(
        False,
        help="let torchvision download CIFAR-10/100 into benchmark.data when they are missing (online)",
        per_task=True,
    )
    split: str = option(
        "folders",
        help="ImageNet-R/A's train/test convention: folders (the RevisitingCIL archives' train/ and test/) "
        "or coda (raw ImageNet-R, CODA-Prompt's shipped test list)",
        choices="benchmark.split",
    )
