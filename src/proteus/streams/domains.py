"""Multi-domain task streams on local data: the paper's "uniformly abrupt" (VTAB5T) and "varying"
(VTAB-Sim50) shapes, and a stream that mixes mild and abrupt steps (paper Sec. 5.1, Table 1).

``ROOT`` (``--data``, else ``$PROTEUS_DATA``) holds one ImageFolder tree per visual domain::

    ROOT/cifar10-subset/{train,test}/<class>/*      e.g. ../shared/data
    ROOT/imagenette/{train,test}/<class>/*
    ROOT/dtd/{train,test}/<class>/*
    ROOT/fashion-mnist/{train,test}/<class>/*

Every sub-folder of ``ROOT`` holding ``train/`` and ``test/`` is a domain named after the folder.
scikit-learn's handwritten digits (bundled, the quickstart's split) are a built-in domain ``digits``
unless ``ROOT`` has a folder of that name. A groups YAML (``benchmark.tasks_file``) may instead list the
domains to use, in order: ``domains: [cifar10-subset, dtd, digits]``. Images differ in size and channels
(28x28 grayscale to 128x128 colour): the backbone's transform resizes them, nothing here is per dataset.

Orders, with ``rng = numpy.random.RandomState(class_order_seed)``: the domains ``rng.permutation`` of their
sorted names (or the groups file's order, kept), then inside each domain, in that order,
``rng.permutation`` of its sorted class folders. A class's name is ``<domain>/<class>``.

* **domains5** (uniformly abrupt, the shape of VTAB5T): one task per domain holding every class of it; the
  first ``num_tasks`` domains (default: all).
* **domains-sim** (varying, the shape of VTAB-Sim50): the class partition of
  :func:`proteus.streams.vtab.sim50_partition`, the same code as ``vtab-sim50`` (each task keeps half of
  its domain's classes and borrows the rest from the other domains), with the same seed.
* **domains-mixed** (mild and abrupt steps): every domain's classes cut in two halves (tasks ``Xa``,
  ``Xb``); domains taken in blocks of one and two alternately: a block of one domain gives ``Xa Xb`` (a mild
  step), a block of two interleaves them, ``Xa Ya Xb Yb`` (abrupt steps that come back to a domain). Five
  domains give 10 tasks: ``Aa Ab | Ba Ca Bb Cb | Da Db | Ea Eb``. The manifest records each step's kind.

``benchmark.max_train_per_class`` caps the training images of every class (recorded in the manifest;
``--config mobilenet_cpu`` sets it for these streams so that a run fits a CPU); test sets are never capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from proteus.streams.base import BENCHMARKS, TaskStream, assemble_stream, data_root
from proteus.streams.builtin import digits_split
from proteus.streams.datasets import LabeledImageDataset, imagefolder_pair
from proteus.streams.errors import DataNotFoundError, TaskSpecError
from proteus.streams.options import BenchmarkConfig
from proteus.streams.vtab import sim50_partition

__all__ = ["BUILTIN_DOMAINS", "ConcatImageDataset", "Domain", "find_domains", "mixed_order"]

#: domains that need no folder: name -> what it is (built by :func:`_builtin_domain`)
BUILTIN_DOMAINS = {"digits": "scikit-learn's bundled 8x8 handwritten digits (the quickstart's 70/30 split)"}
#: keys allowed in a domains groups file
GROUPS_KEYS = ("domains", "description")


class ConcatImageDataset(LabeledImageDataset):
    """Items of several labelled datasets side by side (domains of different storage kinds). An item's
    key is its part's name and its key in that part (``"dtd/train/banded/0001.jpg"``, ``"digits/17"``)."""

    def __init__(
        self,
        parts: Sequence[LabeledImageDataset],
        names: Sequence[str],
        part: np.ndarray | None = None,
        item: np.ndarray | None = None,
        targets: Sequence[int] | None = None,
    ) -> None:
        self.parts, self.names = list(parts), list(names)
        if part is None or item is None or targets is None:
            part = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(self.parts)])
            item = np.concatenate([np.arange(len(p), dtype=np.int64) for p in self.parts])
            targets = [t for p in self.parts for t in p.targets]
        self._part, self._item = part, item
        self.targets = [int(t) for t in targets]

    def _load(self, i: int) -> Image.Image:
        return self.parts[int(self._part[i])][int(self._item[i])][0]

    @property
    def keys(self) -> list[str]:
        part_keys = [p.keys for p in self.parts]
        return [
            f"{self.names[p]}/{part_keys[p][j]}" for p, j in zip(self._part.tolist(), self._item.tolist())
        ]

    def select(self, indices: Sequence[int] | np.ndarray) -> ConcatImageDataset:
        idx = np.asarray(indices, dtype=np.int64)
        return self._with_targets(idx, [self.targets[int(i)] for i in idx])

    def _with_targets(self, indices: np.ndarray, targets: list[int]) -> ConcatImageDataset:
        idx = np.asarray(indices, dtype=np.int64)
        return ConcatImageDataset(self.parts, self.names, self._part[idx], self._item[idx], targets)

    def __repr__(self) -> str:
        return f"ConcatImageDataset({len(self)} images from {', '.join(self.names)})"


@dataclass
class Domain:
    """One visual domain: its name, class names (sorted), train/test sets labelled by class index, where it
    comes from, and the stream's order of its classes (indices into ``classes``)."""

    name: str
    classes: list[str]
    train: LabeledImageDataset
    test: LabeledImageDataset
    source: str
    order: list[int] = field(default_factory=list)


def _builtin_domain(name: str) -> Domain:
    train, test = digits_split()
    return Domain(name, [f"digit_{i}" for i in range(10)], train, test, BUILTIN_DOMAINS[name])


def _is_domain_folder(p: Path) -> bool:
    return p.is_dir() and not p.name.startswith(".") and (p / "train").is_dir() and (p / "test").is_dir()


def _load_groups(path: str) -> list[str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise TaskSpecError(f"domains file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TaskSpecError(f"{p}: not valid YAML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskSpecError(f"{p}: cannot be read as a text YAML file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("domains"), list) or not data["domains"]:
        raise TaskSpecError(f"{p}: expected 'domains: [name, name, ...]' (folders of the data root)")
    unknown = sorted(set(data) - set(GROUPS_KEYS))
    if unknown:
        raise TaskSpecError(f"{p}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(GROUPS_KEYS)}")
    names = [str(d) for d in data["domains"]]
    dup = sorted({d for d in names if names.count(d) > 1})
    if dup:
        raise TaskSpecError(f"{p}: domain(s) listed twice: {', '.join(dup)}")
    return names


def find_domains(root: Path, seed: int, listed: list[str] | None = None) -> list[Domain]:
    """The domains under ``root`` (and the built-in ones), in stream order: ``listed`` as given, else a
    ``RandomState(seed)`` permutation of their sorted names. Raises naming ``root`` when there are fewer
    than two."""
    if not root.is_dir():
        raise DataNotFoundError(
            f"no data root {root}: point --data (or $PROTEUS_DATA) at a folder holding one ImageFolder tree "
            "per domain, e.g. ROOT/cifar10-subset/{train,test}/<class>/*"
        )
    folders = {p.name: p for p in sorted(root.iterdir()) if _is_domain_folder(p)}
    available = sorted({*folders, *BUILTIN_DOMAINS})
    if listed is not None:
        missing = [d for d in listed if d not in available]
        if missing:
            raise TaskSpecError(
                f"domain(s) {', '.join(missing)} not found under {root}; available: {', '.join(available)}"
            )
        names = listed
    else:
        names = available
    if len(names) < 2:
        raise DataNotFoundError(
            f"{root}: found {len(folders)} domain folder(s) ({', '.join(folders) or 'none'}); a multi-domain "
            "stream needs at least two (each ROOT/<domain>/train/<class>/* and ROOT/<domain>/test/<class>/*)"
        )
    rng = np.random.RandomState(seed)
    if listed is None:
        names = [names[int(i)] for i in rng.permutation(len(names))]
    out = []
    for name in names:
        if name in folders:
            train, test, classes = imagefolder_pair(folders[name], name)
            out.append(Domain(name, classes, train, test, str(folders[name])))
        else:
            out.append(_builtin_domain(name))
    for d in out:  # the class order inside each domain, drawn after the domain order
        d.order = [int(i) for i in rng.permutation(len(d.classes))]
    return out


def mixed_order(n_domains: int) -> list[tuple[int, int]]:
    """``(domain, half)`` of each task of ``domains-mixed``: blocks of one and two domains alternately,
    a block of one gives its halves back to back, a block of two interleaves them."""
    out: list[tuple[int, int]] = []
    d, size = 0, 1
    while d < n_domains:
        block = list(range(d, min(d + size, n_domains)))
        out += [(b, h) for h in (0, 1) for b in block]
        d += len(block)
        size = 3 - size
    return out


#: how a benchmark of local domains cuts them into tasks: (the tasks' class names, what its ``extra`` says)
Partition = Callable[
    [str, BenchmarkConfig, Path, list["Domain"], dict[str, list[str]]], tuple[list[list[str]], dict[str, Any]]
]


def by_domain(
    name: str, cfg: BenchmarkConfig, root: Path, domains: list[Domain], groups: dict[str, list[str]]
) -> tuple[list[list[str]], dict[str, Any]]:
    """One task per domain, every class of it (``domains5``)."""
    n = cfg.num_tasks if cfg.num_tasks is not None else len(domains)
    if not 1 <= n <= len(domains):
        raise TaskSpecError(f"{name}: num_tasks={n} but {root} gives {len(domains)} domains")
    return [groups[d.name] for d in domains[:n]], {"task_domains": [d.name for d in domains[:n]]}


def by_sim50(
    name: str, cfg: BenchmarkConfig, root: Path, domains: list[Domain], groups: dict[str, list[str]]
) -> tuple[list[list[str]], dict[str, Any]]:
    """Each task half of its domain's classes and the rest borrowed (``domains-sim``: VTAB-Sim50's cut)."""
    task_names, info = sim50_partition(groups, cfg.class_order_seed)
    if cfg.num_tasks is not None and cfg.num_tasks != len(task_names):
        raise TaskSpecError(f"{name}: num_tasks={cfg.num_tasks} but there are {len(task_names)} domains")
    return task_names, {"sim50": info}


def by_halves(
    name: str, cfg: BenchmarkConfig, root: Path, domains: list[Domain], groups: dict[str, list[str]]
) -> tuple[list[list[str]], dict[str, Any]]:
    """Two tasks per domain (its halves), in :func:`mixed_order` (``domains-mixed``)."""
    plan = mixed_order(len(domains))
    if cfg.num_tasks is not None and cfg.num_tasks != len(plan):
        raise TaskSpecError(f"{name}: num_tasks={cfg.num_tasks} but {len(domains)} domains give {len(plan)}")
    task_names = []
    for di, half in plan:
        g = groups[domains[di].name]
        cut = math.ceil(len(g) / 2)
        task_names.append(g[:cut] if half == 0 else g[cut:])
    steps = ["mild" if plan[i][0] == plan[i - 1][0] else "abrupt" for i in range(1, len(plan))]
    return task_names, {"task_domains": [f"{domains[di].name}:{'ab'[h]}" for di, h in plan], "steps": steps}


def _domain_stream(name: str, cfg: BenchmarkConfig, partition: Partition) -> TaskStream:
    root = data_root(cfg, "")
    listed = _load_groups(cfg.tasks_file) if cfg.tasks_file else None
    domains = find_domains(root, cfg.class_order_seed, listed)
    # global class list: the domains in stream order, each domain's classes in their drawn order
    names: list[str] = []
    offset: dict[str, int] = {}
    for d in domains:
        offset[d.name] = len(names)
        names += [f"{d.name}/{d.classes[i]}" for i in range(len(d.classes))]

    def source(d: Domain, local: list[int]) -> list[str]:
        return [f"{d.name}/{d.classes[i]}" for i in local]

    groups = {d.name: source(d, d.order) for d in domains}
    extra: dict[str, Any] = {
        "format": "domains",
        "domains": [{"name": d.name, "source": d.source, "classes": len(d.classes)} for d in domains],
        "class_order_rule": f"RandomState({cfg.class_order_seed}): domain order, then each domain's classes",
    }
    task_names, more = partition(name, cfg, root, domains, groups)
    extra.update(more)
    order_names = [c for t in task_names for c in t]
    index = {c: i for i, c in enumerate(names)}
    tasks, pos = [], 0
    for t in task_names:
        tasks.append(list(range(pos, pos + len(t))))
        pos += len(t)
    train = ConcatImageDataset(
        [d.train.relabel({i: offset[d.name] + i for i in range(len(d.classes))}) for d in domains],
        [d.name for d in domains],
    )
    test = ConcatImageDataset(
        [d.test.relabel({i: offset[d.name] + i for i in range(len(d.classes))}) for d in domains],
        [d.name for d in domains],
    )
    return assemble_stream(
        name,
        root=root,
        train=train,
        test=test,
        source_class_names=names,
        order=[index[c] for c in order_names],
        tasks=tasks,
        seed=cfg.class_order_seed,
        max_train_per_class=cfg.max_train_per_class,
        extra=extra,
        source_index=[i for d in domains for i in range(len(d.classes))],
    )


@BENCHMARKS.register(
    "domains5",
    help="uniformly abrupt (VTAB5T's shape) on local domains: one task per domain folder of --data "
    "(+ scikit-learn digits), every class of it",
)
def domains5(cfg: BenchmarkConfig) -> TaskStream:
    return _domain_stream("domains5", cfg, by_domain)


@BENCHMARKS.register(
    "domains-sim",
    help="varying (VTAB-Sim50's shape) on local domains: each task keeps half of its domain's classes and "
    "borrows the rest from the others (the vtab-sim50 code)",
)
def domains_sim(cfg: BenchmarkConfig) -> TaskStream:
    return _domain_stream("domains-sim", cfg, by_sim50)


@BENCHMARKS.register(
    "domains-mixed",
    help="mild and abrupt steps on local domains: two tasks per domain, domains alone or interleaved in "
    "pairs (Aa Ab | Ba Ca Bb Cb | ...)",
)
def domains_mixed(cfg: BenchmarkConfig) -> TaskStream:
    return _domain_stream("domains-mixed", cfg, by_halves)
