"""VTAB benchmarks: VTAB5T (uniformly abrupt) and VTAB-Sim50 (varying) (paper Sec. 5.1, Appendix "Datasets,
Hyperparameters").

Expected layout (RevisitingCIL's VTAB archive, https://github.com/zhoudw-zdw/RevisitingCIL)::

    <root>/train/<dataset>_<class>/*.jpg     e.g. train/eurosat_AnnualCrop/0001.jpg
    <root>/test/<dataset>_<class>/*.jpg

``<root>`` may also be a folder holding ``vtab/`` or ``vtab-cil/vtab/`` with that layout. The *source
dataset* of a class folder is the part of its name before the first ``_``, unless a groups YAML
(``benchmark.tasks_file``) lists the classes of each dataset explicitly::

    groups:                  # dataset name -> class folder names; order = task order
      eurosat: [eurosat_AnnualCrop, eurosat_Forest, ...]
      pets: [pets_Abyssinian, ...]
    keep_fraction: 0.5       # VTAB-Sim50 only (default 0.5)
    min_group_classes: 3     # VTAB-Sim50 only (default 3)

Classes not listed in a groups file are left out.

**vtab5t** — one task per source dataset, in folder order (the order in which the datasets first appear
in the sorted class-folder list, or the groups file order); classes keep folder order inside a task
(RevisitingCIL uses ``class_order = arange(50)`` without shuffling). If the folder-name prefixes do not
form ``num_tasks`` (default 5) groups, the classes are cut into consecutive equal chunks in folder order,
which is exactly RevisitingCIL's split for its 50-class VTAB (5 x 10), with a warning.

**vtab-sim50** — the "varying" scenario built after AdaPromptCL (Kim et al., ICML 2024): "for each task, we
retain 50% of its classes and sample the remaining classes from other tasks". The exact recipe here, with
``rng = numpy.random.RandomState(class_order_seed)``:

1. Source datasets with fewer than ``min_group_classes`` (3) classes are excluded (the paper drops the
   2-class PatchCamelyon), with a warning; at least two must remain. Task ``i`` belongs to dataset ``i``
   (folder order or groups-file order); ``num_tasks``, if set, must equal their number.
2. For each dataset in order: ``perm = rng.permutation(n_i)`` of its classes (folder order); the first
   ``k_i = ceil(keep_fraction * n_i)`` are *kept* by its own task, the other ``n_i - k_i`` form its *pool*.
3. For each task in order: it needs ``q_i = n_i - k_i`` more classes; the candidates are the classes still in
   the pools of the *other* datasets (concatenated in dataset order, pool order); ``rng.choice(len, q_i,
   replace=False)`` picks them (fewer, with a warning, if not enough remain), and they leave their pools.
4. Task ``i`` = kept classes (permutation order) followed by borrowed classes (pick order). Classes are
   disjoint across tasks (class-incremental); classes left in pools at the end are dropped.

Every class carries all of its train and test images. The manifest records, per task, the kept and
borrowed classes and their source datasets, and the dropped classes.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from proteus.streams.base import BENCHMARKS, TaskStream, assemble_named_tasks, data_root, equal_chunks
from proteus.streams.builtin import DEFAULT_NUM_TASKS
from proteus.streams.datasets import list_class_dirs, list_images, resolve_imagefolder
from proteus.streams.errors import BenchmarkError, DataNotFoundError, TaskSpecError
from proteus.streams.options import BenchmarkConfig
from proteus.untrusted import load_yaml, read_regular_text

GROUPS_KEYS = ("groups", "keep_fraction", "min_group_classes", "description")


def _vtab_root(cfg: BenchmarkConfig, name: str, default_subdir: str) -> Path:
    given = data_root(cfg, default_subdir)
    root = resolve_imagefolder(given, ["vtab", "vtab-cil/vtab"])
    if root is None:
        raise DataNotFoundError(
            f"{name}: no VTAB ImageFolder tree at {given}. Expected {given}/train/<dataset>_<class>/* and "
            f"{given}/test/<dataset>_<class>/* (or the same under {given}/vtab or {given}/vtab-cil/vtab), "
            "as in RevisitingCIL's VTAB archive (https://github.com/zhoudw-zdw/RevisitingCIL). "
            "Point benchmark.data (or $PROTEUS_DATA) at it."
        )
    return root


def prefix_groups(classes: list[str]) -> dict[str, list[str]]:
    """Group class folder names by the part before the first ``_``, groups in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for c in classes:
        groups.setdefault(c.split("_", 1)[0], []).append(c)
    return groups


def load_groups(path: str | Path, existing: list[str]) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Read a groups YAML (see the module docstring); returns ``(groups, options)``, validated."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TaskSpecError(f"groups file not found: {p}")
    try:
        data = load_yaml(read_regular_text(p), str(p))
    except yaml.YAMLError as e:
        raise TaskSpecError(f"{p}: not valid YAML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskSpecError(f"{p}: cannot be read as a text YAML file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("groups"), dict) or not data["groups"]:
        raise TaskSpecError(f"{p}: expected 'groups: {{dataset: [class, ...], ...}}'")
    unknown_keys = sorted(set(data) - set(GROUPS_KEYS))
    if unknown_keys:
        raise TaskSpecError(
            f"{p}: unknown key(s) {', '.join(unknown_keys)}; allowed: {', '.join(GROUPS_KEYS)}"
        )
    known = set(existing)
    seen: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    unknown: list[str] = []
    for g, cs in data["groups"].items():
        if not isinstance(cs, list) or not cs:
            raise TaskSpecError(f"{p}: group {g!r} must be a non-empty list of class folder names")
        names = [str(c) for c in cs]
        for c in names:
            if c in seen:
                raise TaskSpecError(f"{p}: class {c!r} is in group {seen[c]!r} and in group {g!r}")
            seen[c] = str(g)
            if c not in known:
                unknown.append(c)
        groups[str(g)] = names
    if unknown:
        raise TaskSpecError(
            f"{p}: unknown class name(s) {', '.join(map(repr, unknown))}; class folders that exist: "
            f"{', '.join(existing)}"
        )
    return groups, {k: data[k] for k in ("keep_fraction", "min_group_classes") if k in data}


def _check_test_folders(root: Path, name: str, used: list[str]) -> None:
    for c in used:
        d = root / "test" / c
        if not d.is_dir() or not list_images(d):
            raise BenchmarkError(f"{name}: class {c!r} has no test images ({d} is missing or empty)")


# ---------------------------------------------------------------------------------------------- VTAB5T
@BENCHMARKS.register(
    "vtab5t",
    help="VTAB5T (paper: uniformly abrupt): RevisitingCIL's VTAB ImageFolder, class folders "
    "<dataset>_<class>; 5 tasks = the 5 datasets in folder order",
)
def vtab5t(cfg: BenchmarkConfig) -> TaskStream:
    """One task per VTAB source dataset (see the module docstring for layout and fallback)."""
    name = "vtab5t"
    root = _vtab_root(cfg, name, "vtab-cil/vtab")
    classes = list_class_dirs(root / "train")
    num_tasks = cfg.num_tasks if cfg.num_tasks is not None else DEFAULT_NUM_TASKS[name]
    if cfg.tasks_file:
        groups, _ = load_groups(cfg.tasks_file, classes)
        rule = f"groups file {cfg.tasks_file}"
        if cfg.num_tasks is not None and len(groups) != num_tasks:
            raise TaskSpecError(
                f"{name}: num_tasks={num_tasks} but {cfg.tasks_file} lists {len(groups)} groups"
            )
    else:
        groups = prefix_groups(classes)
        rule = "class-folder prefix before the first '_'"
        if len(groups) != num_tasks:
            chunks = equal_chunks(len(classes), num_tasks, name)
            warnings.warn(
                f"{name}: the class-folder prefixes under {root / 'train'} form {len(groups)} groups, not "
                f"{num_tasks}; using {num_tasks} consecutive chunks of {len(chunks[0])} classes in folder "
                "order",
                stacklevel=2,
            )
            groups = {f"chunk{i + 1}": [classes[j] for j in ch] for i, ch in enumerate(chunks)}
            rule = "consecutive equal chunks in folder order"
    if sum(len(v) for v in groups.values()) != 50:
        warnings.warn(
            f"{name}: RevisitingCIL's VTAB5T has 50 classes; this root gives "
            f"{sum(len(v) for v in groups.values())}",
            stacklevel=2,
        )
    _check_test_folders(root, name, [c for cs in groups.values() for c in cs])
    return assemble_named_tasks(
        name,
        cfg,
        root,
        list(groups.values()),
        {
            "format": "imagefolder",
            "class_order_rule": "folder order (no permutation)",
            "task_rule": rule,
            "task_sources": list(groups),
        },
    )


# ---------------------------------------------------------------------------------------------- VTAB-Sim50
def sim50_partition(
    groups: dict[str, list[str]],
    seed: int,
    keep_fraction: float = 0.5,
    min_group_classes: int = 3,
) -> tuple[list[list[str]], dict[str, Any]]:
    """The VTAB-Sim50 class partition (recipe in the module docstring); returns ``(tasks, record)``."""
    if not 0.0 < keep_fraction <= 1.0:
        raise TaskSpecError(f"vtab-sim50: keep_fraction must be in (0, 1], got {keep_fraction}")
    used = {g: cs for g, cs in groups.items() if len(cs) >= min_group_classes}
    excluded = [g for g in groups if g not in used]
    if excluded:
        warnings.warn(
            f"vtab-sim50: excluded source dataset(s) with fewer than {min_group_classes} classes: "
            f"{', '.join(excluded)}",
            stacklevel=2,
        )
    if len(used) < 2:
        raise TaskSpecError(
            f"vtab-sim50: needs at least 2 source datasets with >= {min_group_classes} classes; "
            f"found {len(used)} ({', '.join(used) or 'none'})"
        )
    rng = np.random.RandomState(seed)
    kept: dict[str, list[str]] = {}
    pools: dict[str, list[str]] = {}
    for g, cs in used.items():
        perm = rng.permutation(len(cs))
        k = min(len(cs), math.ceil(keep_fraction * len(cs)))
        kept[g] = [cs[int(i)] for i in perm[:k]]
        pools[g] = [cs[int(i)] for i in perm[k:]]
    tasks: list[list[str]] = []
    record: list[dict[str, Any]] = []
    for g, cs in used.items():
        quota = len(cs) - len(kept[g])
        cands = [(h, c) for h in used if h != g for c in pools[h]]
        take = min(quota, len(cands))
        if take < quota:
            warnings.warn(
                f"vtab-sim50: task {g!r} could borrow only {take} of {quota} classes from other datasets",
                stacklevel=2,
            )
        picks = rng.choice(len(cands), size=take, replace=False) if take > 0 else np.zeros(0, dtype=np.int64)
        borrowed = [cands[int(i)] for i in picks]
        for h, c in borrowed:
            pools[h].remove(c)
        tasks.append(kept[g] + [c for _, c in borrowed])
        record.append({"source": g, "kept": kept[g], "borrowed": [[h, c] for h, c in borrowed]})
    dropped = [c for g in used for c in pools[g]]
    info = {
        "keep_fraction": keep_fraction,
        "min_group_classes": min_group_classes,
        "excluded_sources": excluded,
        "composition": record,
        "dropped_classes": dropped,
    }
    return tasks, info


@BENCHMARKS.register(
    "vtab-sim50",
    help="VTAB-Sim50 (paper: varying): each task keeps 50% of its source dataset's classes and borrows the "
    "rest from other datasets (seeded, AdaPromptCL recipe)",
)
def vtab_sim50(cfg: BenchmarkConfig) -> TaskStream:
    """VTAB-Sim50 built from a VTAB ImageFolder (see the module docstring for the exact recipe)."""
    name = "vtab-sim50"
    root = _vtab_root(cfg, name, "vtab-large")
    classes = list_class_dirs(root / "train")
    opts: dict[str, Any] = {}
    if cfg.tasks_file:
        groups, opts = load_groups(cfg.tasks_file, classes)
    else:
        groups = prefix_groups(classes)
    try:
        keep_fraction = float(opts.get("keep_fraction", 0.5))
        min_group = int(opts.get("min_group_classes", 3))
    except (TypeError, ValueError):
        raise TaskSpecError(
            f"{name}: keep_fraction must be a number and min_group_classes an integer"
        ) from None
    task_names, info = sim50_partition(groups, cfg.class_order_seed, keep_fraction, min_group)
    if cfg.num_tasks is not None and cfg.num_tasks != len(task_names):
        raise TaskSpecError(
            f"{name}: num_tasks={cfg.num_tasks} but there are {len(task_names)} source datasets "
            "(one task per dataset)"
        )
    _check_test_folders(root, name, [c for t in task_names for c in t])
    return assemble_named_tasks(
        name,
        cfg,
        root,
        task_names,
        {
            "format": "imagefolder",
            "class_order_rule": "VTAB-Sim50 recipe (proteus.streams.vtab)",
            "task_rule": f"groups file {cfg.tasks_file}" if cfg.tasks_file else "class-folder prefix",
            "sim50": info,
        },
    )
