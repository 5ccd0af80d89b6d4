"""Tiny settings shared by the end-to-end tests: random backbone weights (no download), 32 px,
two adapted blocks, one epoch, small head and signatures. Every test that runs the real CLI builds
its arguments from here, so a change to what "tiny" means is made once. Also the small ``folder``
benchmarks of the end-to-end tests: random images in an ImageFolder tree, a task spec, their flags and
their resolved config."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from PIL import Image

if TYPE_CHECKING:
    from proteus.config import RunConfig

TINY_SETS = [
    "backbone.pretrained=false",
    "backbone.img_size=32",
    "backbone.adapt_last=2",
    "train.epochs=1",
    "head.rp_dim=256",
    "signature.max_components=2",
    "signature.max_iter=20",
    "signature.rank=8",
]


def sets(*extra: str, base: list[str] = TINY_SETS) -> list[str]:
    """``--set`` arguments for the tiny settings plus ``extra`` (later keys win)."""
    return [a for s in [*base, *extra] for a in ("--set", s)]


# ---------------------------------------------------------------------------------- folder benchmarks
#: the command-line flags of the tiny settings on a ViT-Ti, on the CPU, without progress bars
TINY = ["--backbone", "vit_ti16", "--device", "cpu", "-q", *sets()]


def write_image(path: Path, seed: int, size: tuple[int, int] = (12, 12), mode: str = "RGB") -> None:
    """A random ``size`` (width, height) image in ``mode`` saved to ``path`` (its suffix picks the format)."""
    rng = np.random.RandomState(seed)
    img = Image.fromarray(rng.randint(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    (img if mode == "RGB" else img.convert(mode)).save(path)


def make_tree(root: Path, classes: str = "abcdef", n_train: int = 6, n_test: int = 2) -> Path:
    """An ImageFolder root ``root/{train,test}/<class>/<i>.png`` with one class per letter of ``classes``."""
    for split, n in (("train", n_train), ("test", n_test)):
        for ci, c in enumerate(classes):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                write_image(root / split / c / f"{i}.png", 1000 * ci + 10 * i + (split == "test"))
    return root


def write_spec(path: Path, tasks: list[list[str]]) -> Path:
    """A ``folder`` task-spec YAML listing ``tasks`` (lists of class names)."""
    path.write_text(yaml.safe_dump({"tasks": tasks}))
    return path


def folder_args(tree: Path, spec: Path) -> list[str]:
    """The command-line flags of the ``folder`` benchmark on ``tree`` with the task spec ``spec``."""
    return ["--benchmark", "folder", "--data", str(tree), "--tasks", str(spec)]


def folder_cfg(tree: Path, spec: Path, *extra: str, method: str = "proteus") -> RunConfig:
    """The resolved config of ``method`` with the tiny settings (plus ``extra``) on a ``folder`` benchmark."""
    from proteus.experiment import resolve_config

    return resolve_config(
        "folder",
        method,
        sets=[*TINY_SETS, *extra],
        overrides={"backbone": {"name": "vit_ti16"}, "device": "cpu",
                   "benchmark": {"data": str(tree), "tasks_file": str(spec)}},
    )  # fmt: skip


def folder_stream(cfg: RunConfig) -> Any:
    """The task stream of ``cfg``'s benchmark (single-class tasks' warnings silenced)."""
    from proteus.streams import build_benchmark

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-class tasks warn
        return build_benchmark(cfg.benchmark)


def baseline_cfg(method: str, backbone: str = "vit_ti16") -> RunConfig:
    """A baseline's config for the tiny quickstart runs of the baseline tests: a random ``backbone`` at 32 px
    on the CPU, one epoch of batches of 16, 2 tasks of 8 training images per class (``baseline_stream``)."""
    from proteus.config import RunConfig, apply_method

    cfg = RunConfig()
    apply_method(cfg, method)
    cfg.device = "cpu"
    cfg.backbone.name, cfg.backbone.pretrained, cfg.backbone.img_size = backbone, False, 32
    cfg.train.epochs, cfg.train.batch_size = 1, 16
    cfg.benchmark.num_tasks, cfg.benchmark.max_train_per_class = 2, 8
    return cfg


def baseline_stream() -> Any:
    """The stream of :func:`baseline_cfg`: the quickstart, 2 tasks of 8 training images per class."""
    from proteus.streams import build_benchmark

    return build_benchmark(baseline_cfg("ranpac").benchmark)
