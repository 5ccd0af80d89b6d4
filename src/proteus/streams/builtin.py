"""Built-in benchmarks: quickstart, CIFAR-10/100, ImageNet-R/A and any ImageFolder (paper Sec. 5.1, Appendix
"Datasets, Hyperparameters").

The paper's "uniformly mild" scenario is CIFAR-100 (10 tasks of 10 classes, torchvision) and ImageNet-R
(10 tasks of 20); "uniformly abrupt" includes ImageNet-A (10 tasks of 20). ImageNet-R/A use the ImageFolder
archives of RevisitingCIL (https://github.com/zhoudw-zdw/RevisitingCIL): ``<root>/train/<class>/*`` and
``<root>/test/<class>/*``. Class order: ``RandomState(class_order_seed).permutation`` (PyCIL, seed 1993),
then consecutive equal tasks. ``folder`` takes its tasks from a YAML file instead (no permutation).

VTAB5T and VTAB-Sim50 live in :mod:`proteus.streams.vtab`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from proteus.streams.base import (
    BENCHMARKS,
    TaskStream,
    assemble_named_tasks,
    assemble_stream,
    data_root,
    equal_chunks,
    seeded_class_order,
)
from proteus.streams.datasets import (
    ArrayImageDataset,
    imagefolder_pair,
    is_imagefolder,
    list_class_dirs,
    list_images,
)
from proteus.streams.errors import BenchmarkError, DataNotFoundError, TaskSpecError
from proteus.streams.options import BenchmarkConfig
from proteus.streams.splits import SPLITS
from proteus.untrusted import load_yaml, read_regular_text

#: default number of tasks per benchmark (the paper's setting)
DEFAULT_NUM_TASKS: dict[str, int] = {
    "quickstart": 5,
    "cifar10": 5,
    "cifar100": 10,
    "imagenet-r": 10,
    "imagenet-a": 10,
    "vtab5t": 5,
}

QUICKSTART_TEST_FRACTION = 0.3
QUICKSTART_SPLIT_SEED = 0

_TORCHVISION_DIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
#: torchvision's dataset class of each CIFAR benchmark (``torchvision.datasets.<name>``)
_TORCHVISION_CLASSES = {"cifar10": "CIFAR10", "cifar100": "CIFAR100"}
_NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet-r": 200, "imagenet-a": 200}
#: the classes a benchmark's ImageFolder tree must hold, exactly (CIFAR-10's, in torchvision's order)
_CLASS_NAMES = {
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}


def _num_tasks(cfg: BenchmarkConfig, name: str) -> int:
    return cfg.num_tasks if cfg.num_tasks is not None else DEFAULT_NUM_TASKS[name]


def _permuted_stream(
    name: str,
    cfg: BenchmarkConfig,
    root: Path | None,
    train: Any,
    test: Any,
    class_names: list[str],
    extra: dict[str, Any],
) -> TaskStream:
    n = len(class_names)
    tasks = equal_chunks(n, _num_tasks(cfg, name), name)
    return assemble_stream(
        name,
        root=root,
        train=train,
        test=test,
        source_class_names=class_names,
        order=seeded_class_order(n, cfg.class_order_seed),
        tasks=tasks,
        seed=cfg.class_order_seed,
        max_train_per_class=cfg.max_train_per_class,
        extra={"class_order_rule": f"RandomState({cfg.class_order_seed}).permutation({n})", **extra},
    )


# ---------------------------------------------------------------------------------------------- ImageFolder
def _check_class_count(name: str, found: int, expected: int, root: Path, strict: bool) -> None:
    if found == expected:
        return
    msg = f"{name}: expected {expected} classes, found {found} class folders under {root / 'train'}"
    if strict:
        raise BenchmarkError(msg + "; for another class set use the 'folder' benchmark")
    warnings.warn(msg, stacklevel=3)


# ---------------------------------------------------------------------------------------------- quickstart
def digits_split() -> tuple[ArrayImageDataset, ArrayImageDataset]:
    """scikit-learn's digits as 8x8 uint8 images (pixels 0..16 scaled to 0..255, rounded), split by
    ``train_test_split(test_size=0.3, stratify=labels, random_state=0)``; keys are ``load_digits()`` rows."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.clip(np.rint(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    idx = np.arange(len(images))
    tr_idx, te_idx = train_test_split(
        idx, test_size=QUICKSTART_TEST_FRACTION, random_state=QUICKSTART_SPLIT_SEED, stratify=labels
    )
    tr_idx, te_idx = np.sort(tr_idx), np.sort(te_idx)
    return ArrayImageDataset(images, labels[tr_idx], rows=tr_idx), ArrayImageDataset(
        images, labels[te_idx], rows=te_idx
    )


@BENCHMARKS.register(
    "quickstart",
    help="scikit-learn's bundled 8x8 digits (no download): 10 classes -> 5 tasks of 2, fixed stratified "
    "70/30 split",
)
def quickstart(cfg: BenchmarkConfig) -> TaskStream:
    """scikit-learn's digits as a tiny offline stream.

    Pixels 0..16 are scaled to 0..255 (rounded) and returned as 8x8 RGB images (the learner resizes). The
    train/test split is ``train_test_split(test_size=0.3, stratify=labels, random_state=0)``, fixed whatever
    ``class_order_seed`` is; keys in the manifest are row indices of ``load_digits()``.
    """
    train, test = digits_split()
    names = [f"digit_{i}" for i in range(10)]
    return _permuted_stream(
        "quickstart",
        cfg,
        None,
        train,
        test,
        names,
        {
            "source": "sklearn.datasets.load_digits",
            "split": {
                "test_fraction": QUICKSTART_TEST_FRACTION,
                "split_seed": QUICKSTART_SPLIT_SEED,
                "stratified": True,
            },
        },
    )


# ---------------------------------------------------------------------------------------------- CIFAR
def _cifar_missing(name: str, root: Path) -> DataNotFoundError:
    tv = _TORCHVISION_DIRS[name]
    cls = _TORCHVISION_CLASSES[name]
    return DataNotFoundError(
        f"{name}: no data found at {root}. Expected one of:\n"
        f"  (a) torchvision's format: {root / tv}/ (the extracted python-version archive)\n"
        f"  (b) an ImageFolder tree: {root}/train/<class>/*.png|jpg and {root}/test/<class>/*\n"
        f"Put the data there, or point benchmark.data (--set benchmark.data=PATH) or $PROTEUS_DATA at it. "
        f"When online, add --set benchmark.download=true (torchvision's {cls} downloads it there)"
    )


def _download_cifar(name: str, root: Path) -> None:
    """torchvision's download of ``name`` into ``root`` (``benchmark.download``), its failure one line."""
    import torchvision

    cls = getattr(torchvision.datasets, _TORCHVISION_CLASSES[name])
    try:
        root.mkdir(parents=True, exist_ok=True)
        for train in (True, False):
            cls(str(root), train=train, download=True)
    except (OSError, RuntimeError) as e:  # offline: URLError is an OSError
        raise DataNotFoundError(
            f"{name}: could not download it into {root} ({e}); put the data there"
        ) from None


def load_cifar(name: str, root: Path, download: bool = False) -> tuple[Any, Any, list[str], str, Path]:
    """``(train, test, class_names, format, resolved_root)`` for ``cifar10``/``cifar100`` under ``root``.

    Accepts torchvision's format (``root/cifar-10-batches-py`` or ``root/cifar-100-python``, or that folder
    itself) held in memory, or an ImageFolder tree ``root/{train,test}/<class>/*`` loaded lazily; with
    ``download`` and neither there, torchvision downloads its format into ``root`` first.
    """
    tv = _TORCHVISION_DIRS[name]
    if (
        download
        and not (root / tv).is_dir()
        and not (root.name == tv and root.is_dir())
        and not is_imagefolder(root)
    ):
        _download_cifar(name, root)
    tv_root: Path | None = None
    if (root / tv).is_dir():
        tv_root = root
    elif root.name == tv and root.is_dir():
        tv_root = root.parent
    if tv_root is not None:
        import torchvision

        cls = getattr(torchvision.datasets, _TORCHVISION_CLASSES[name])
        try:
            tr = cls(str(tv_root), train=True, download=False)
            te = cls(str(tv_root), train=False, download=False)
        except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
            raise DataNotFoundError(f"{name}: {tv_root / tv} is incomplete or corrupted ({e})") from e
        train = ArrayImageDataset(np.asarray(tr.data, dtype=np.uint8), tr.targets)
        test = ArrayImageDataset(np.asarray(te.data, dtype=np.uint8), te.targets)
        return train, test, list(tr.classes), "torchvision", tv_root
    if is_imagefolder(root):
        train_f, test_f, classes = imagefolder_pair(root, name)
        _check_class_count(name, len(classes), _NUM_CLASSES[name], root, strict=True)
        expected = _CLASS_NAMES.get(name)
        if expected is not None and sorted(classes) != sorted(expected):
            raise BenchmarkError(
                f"{name}: {root} holds the classes {', '.join(sorted(classes))}, not {name}'s "
                f"({', '.join(expected)}); for another dataset use --benchmark folder with a task list"
            )
        return train_f, test_f, classes, "imagefolder", root
    raise _cifar_missing(name, root)


def _cifar(name: str, cfg: BenchmarkConfig) -> TaskStream:
    train, test, classes, fmt, root = load_cifar(name, data_root(cfg, ""), download=cfg.download)
    return _permuted_stream(name, cfg, root, train, test, classes, {"format": fmt})


@BENCHMARKS.register(
    "cifar10",
    help="CIFAR-10, 5 tasks of 2 (seeded class order); torchvision format or ImageFolder train/ and test/",
)
def cifar10(cfg: BenchmarkConfig) -> TaskStream:
    return _cifar("cifar10", cfg)


@BENCHMARKS.register(
    "cifar100",
    help="CIFAR-100 (paper: uniformly mild), 10 tasks of 10 (50 also valid); torchvision format or "
    "ImageFolder",
)
def cifar100(cfg: BenchmarkConfig) -> TaskStream:
    return _cifar("cifar100", cfg)


# ---------------------------------------------------------------------------------------------- ImageNet-R/A
def _imagenet(name: str, cfg: BenchmarkConfig) -> TaskStream:
    root, train, test, classes, extra = SPLITS.get(cfg.split)(name, data_root(cfg, name))
    _check_class_count(name, len(classes), _NUM_CLASSES[name], root, strict=False)
    return _permuted_stream(name, cfg, root, train, test, classes, extra)


@BENCHMARKS.register(
    "imagenet-r",
    help="ImageNet-R (paper: uniformly mild), 200 classes, 10 tasks of 20 (100 also valid); RevisitingCIL "
    "ImageFolder",
)
def imagenet_r(cfg: BenchmarkConfig) -> TaskStream:
    return _imagenet("imagenet-r", cfg)


@BENCHMARKS.register(
    "imagenet-a",
    help="ImageNet-A (paper: uniformly abrupt), 200 classes, 10 tasks of 20; RevisitingCIL ImageFolder",
)
def imagenet_a(cfg: BenchmarkConfig) -> TaskStream:
    return _imagenet("imagenet-a", cfg)


# ---------------------------------------------------------------------------------------------- folder
#: keys allowed at the top level of a task-spec YAML file
TASK_SPEC_KEYS = ("tasks", "shuffle_tasks", "description", "meta")


def load_task_spec(path: str | Path) -> dict[str, Any]:
    """Read a task-spec YAML: ``tasks: [[classA, classB], [classC, ...], ...]``.

    Optional keys: ``shuffle_tasks`` (bool, default false: permute the task order with the class-order
    seed), ``description`` and ``meta`` (free-form, copied into the manifest). Class names are folder names;
    quote names YAML would read as numbers or booleans (``"01"``, ``"yes"``).
    """
    p = Path(path)
    if not p.is_file():
        raise TaskSpecError(f"task spec file not found: {p}")
    try:
        data = load_yaml(read_regular_text(p), str(p))
    except yaml.YAMLError as e:
        raise TaskSpecError(f"{p}: not valid YAML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskSpecError(f"{p}: cannot be read as a text YAML file ({e})") from None
    if not isinstance(data, dict) or "tasks" not in data:
        raise TaskSpecError(
            f"{p}: expected a mapping with a 'tasks' key: tasks: [[classA, classB], [classC]]"
        )
    unknown = sorted(set(data) - set(TASK_SPEC_KEYS))
    if unknown:
        raise TaskSpecError(f"{p}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(TASK_SPEC_KEYS)}")
    if not isinstance(data["tasks"], list):
        raise TaskSpecError(f"{p}: 'tasks' must be a list of lists of class names")
    if not isinstance(data.get("shuffle_tasks", False), bool):
        raise TaskSpecError(f"{p}: 'shuffle_tasks' must be true or false")
    return data


def validate_tasks(tasks: Any, existing: list[str], where: str) -> list[list[str]]:
    """Check a list of tasks (lists of class names) against the class folders that exist.

    Errors: a task that is not a list, an empty task, a class named twice in one task, a class in two
    tasks (naming it and both task indices, 1-based), unknown class names (naming them and listing what
    exists). A task with a single class is allowed but warns.
    """
    out: list[list[str]] = []
    seen: dict[str, int] = {}
    unknown: list[str] = []
    known = set(existing)
    for i, task in enumerate(tasks):
        if not isinstance(task, list):
            raise TaskSpecError(f"{where}: task {i + 1} must be a list of class names, got {task!r}")
        if not task:
            raise TaskSpecError(f"{where}: task {i + 1} is empty")
        names = [str(c) for c in task]
        for c in names:
            if c in seen:
                if seen[c] == i:
                    raise TaskSpecError(f"{where}: class {c!r} is listed twice in task {i + 1}")
                raise TaskSpecError(f"{where}: class {c!r} is in task {seen[c] + 1} and in task {i + 1}")
            seen[c] = i
            if c not in known:
                unknown.append(c)
        if len(names) == 1:
            warnings.warn(f"{where}: task {i + 1} has a single class ({names[0]!r})", stacklevel=2)
        out.append(names)
    if not out:
        raise TaskSpecError(f"{where}: 'tasks' lists no task")
    if unknown:
        raise TaskSpecError(
            f"{where}: unknown class name(s) {', '.join(map(repr, unknown))}; "
            f"class folders that exist: {', '.join(existing) if existing else '(none)'}"
        )
    return out


@BENCHMARKS.register(
    "folder",
    help="any ImageFolder root (train/ and test/) with tasks from a YAML file (benchmark.tasks_file, "
    "default <root>/tasks.yaml)",
)
def folder(cfg: BenchmarkConfig) -> TaskStream:
    """Any ImageFolder tree ``<root>/{train,test}/<class>/*`` with the tasks listed in a YAML file.

    The YAML (``cfg.tasks_file``, else ``<root>/tasks.yaml``) lists class folder names per task; global
    labels follow the YAML order (no permutation unless ``shuffle_tasks: true``, which permutes the order of
    the tasks with ``RandomState(class_order_seed)``). Class folders not named in the YAML are ignored.
    Every named class needs a non-empty ``test/<class>`` folder.
    """
    if not cfg.data:
        raise TaskSpecError(
            "folder: set benchmark.data to an ImageFolder root holding train/<class>/* and test/<class>/*"
        )
    root = Path(cfg.data).expanduser()
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise DataNotFoundError(
                f"folder: missing {root / split}; expected {root}/train/<class>/* and {root}/test/<class>/*"
            )
    if cfg.tasks_file:
        spec_path = Path(cfg.tasks_file).expanduser()
    elif (root / "tasks.yaml").is_file():
        spec_path = root / "tasks.yaml"
    else:
        raise TaskSpecError(
            f"folder: no task spec; set benchmark.tasks_file or write {root / 'tasks.yaml'} as "
            "'tasks: [[classA, classB], [classC, classD]]'"
        )
    spec = load_task_spec(spec_path)
    existing = list_class_dirs(root / "train")
    task_names = validate_tasks(spec["tasks"], existing, str(spec_path))
    if cfg.num_tasks is not None and cfg.num_tasks != len(task_names):
        raise TaskSpecError(
            f"folder: benchmark.num_tasks={cfg.num_tasks} but {spec_path} lists {len(task_names)} tasks"
        )
    if spec.get("shuffle_tasks", False):
        perm = np.random.RandomState(cfg.class_order_seed).permutation(len(task_names))
        task_names = [task_names[int(i)] for i in perm]
    used = [c for t in task_names for c in t]
    for c in used:
        d = root / "test" / c
        if not d.is_dir():
            raise BenchmarkError(f"folder: class {c!r} has no test folder ({d} is missing)")
        if not list_images(d):
            raise BenchmarkError(f"folder: class {c!r} has an empty test folder ({d} holds no image)")
    extra: dict[str, Any] = {
        "format": "imagefolder",
        "tasks_file": str(spec_path.resolve()),
        "shuffle_tasks": bool(spec.get("shuffle_tasks", False)),
        "class_order_rule": "tasks file order"
        + (" (task order permuted)" if spec.get("shuffle_tasks") else ""),
    }
    for k in ("description", "meta"):
        if k in spec:
            extra[k] = spec[k]
    return assemble_named_tasks("folder", cfg, root, task_names, extra)
