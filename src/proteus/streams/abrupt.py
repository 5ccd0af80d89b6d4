"""An offline "uniformly abrupt" sequence: CIFAR-10 and scikit-learn digits alternating (paper Sec. 5.1).

The paper's abrupt scenario (ImageNet-A, VTAB5T) switches semantic domain between tasks. Offline, the same
kind of shift is available from two local sources: CIFAR-10 natural images (an ImageFolder root such as
``../shared/data/cifar10-subset``) and scikit-learn's bundled 8x8 digits. :func:`build_abrupt_sequence`
writes an ImageFolder tree for the ``folder`` benchmark::

    out/train/cifar_<name>/<file>   symlinks to <cifar_root>/train/<name>/<file> (copies if links fail)
    out/test/cifar_<name>/<file>    symlinks to <cifar_root>/test/<name>/<file>
    out/train/digit_<k>/<row>.png   8x8 grayscale PNG, pixels round(v * 255 / 16); <row> = load_digits() row
    out/test/digit_<k>/<row>.png
    out/tasks.yaml                  the 5 tasks (folder benchmark task spec)
    out/abrupt_manifest.json        stamp: inputs, class choice, file counts, sha256 of the planned tree

Recipe, with ``rng = numpy.random.RandomState(seed)``:

* CIFAR classes: ``rng.permutation(C)`` of the sorted class folders of ``<cifar_root>/train`` (C >= 10);
  the first 10 are ``c0..c9``. Then digits: ``rng.permutation(10)`` gives ``d0..d9``.
* Tasks: T1 = c0..c3, T2 = d0..d3, T3 = c4..c7, T4 = d4..d7, T5 = c8, c9, d8, d9 (4 classes each).
* Digits train/test split: ``train_test_split(test_size=digits_test_fraction, stratify=labels,
  random_state=seed)``. CIFAR keeps its own train/test files.

Idempotent: re-running with the same arguments leaves the same tree (files already right are not touched,
stale files inside ``train/`` and ``test/`` are removed). An existing non-empty ``out`` without the stamp is
refused, so a mistyped path never deletes anything.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from proteus.streams.datasets import list_class_dirs, list_images
from proteus.streams.errors import BenchmarkError, DataNotFoundError

STAMP_NAME = "abrupt_manifest.json"
STAMP_VERSION = 1
#: domain of each task of the abrupt sequence
TASK_DOMAINS = ("cifar", "digits", "cifar", "digits", "mixed")


def _digits_pngs(seed: int, test_fraction: float) -> dict[str, tuple[bytes, str]]:
    """``relpath -> (png bytes, sha256 of the raw pixels)`` for the digits split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.clip(np.rint(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    labels = digits.target
    tr, te = train_test_split(
        np.arange(len(images)), test_size=test_fraction, random_state=seed, stratify=labels
    )
    out: dict[str, tuple[bytes, str]] = {}
    for split, rows in (("train", tr), ("test", te)):
        for r in sorted(int(x) for x in rows):
            buf = io.BytesIO()
            Image.fromarray(images[r]).save(buf, format="PNG")
            out[f"{split}/digit_{int(labels[r])}/{r:04d}.png"] = (
                buf.getvalue(),
                hashlib.sha256(images[r].tobytes()).hexdigest(),
            )
    return out


def _same_file(path: Path, data: bytes) -> bool:
    return (
        path.is_file()
        and not path.is_symlink()
        and path.stat().st_size == len(data)
        and path.read_bytes() == data
    )


def _write_if_changed(path: Path, data: bytes) -> None:
    if _same_file(path, data):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _link(path: Path, target: Path) -> None:
    if path.is_symlink() and os.readlink(path) == str(target):
        return
    if path.is_file() and not path.is_symlink():  # an earlier copy (no symlink support)
        if path.stat().st_size == target.stat().st_size and path.read_bytes() == target.read_bytes():
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    try:
        os.symlink(target, path)
    except OSError:
        shutil.copyfile(target, path)


def build_abrupt_sequence(
    cifar_root: Path, out: Path, seed: int = 0, digits_test_fraction: float = 0.3
) -> Path:
    """Write the CIFAR/digits abrupt sequence under ``out`` (recipe in the module docstring); return ``out``.

    Use the result with the ``folder`` benchmark: ``benchmark.name=folder``, ``benchmark.data=<out>``
    (``<out>/tasks.yaml`` is picked up by default).
    """
    cifar_root = Path(cifar_root).expanduser().resolve()
    out = Path(out).expanduser()
    if not 0.0 < digits_test_fraction < 1.0:
        raise ValueError(f"digits_test_fraction must be in (0, 1), got {digits_test_fraction}")
    for split in ("train", "test"):
        if not (cifar_root / split).is_dir():
            raise DataNotFoundError(
                f"abrupt: {cifar_root / split} is missing; --cifar must be a CIFAR-10 ImageFolder root with "
                "train/<class>/* and test/<class>/* (e.g. ../shared/data/cifar10-subset)"
            )
    classes = list_class_dirs(cifar_root / "train")
    if len(classes) < 10:
        raise BenchmarkError(
            f"abrupt: needs at least 10 class folders under {cifar_root / 'train'}, found {len(classes)}"
        )
    test_classes = set(list_class_dirs(cifar_root / "test"))
    rng = np.random.RandomState(seed)
    cifar = [classes[int(i)] for i in rng.permutation(len(classes))[:10]]
    digits = [int(i) for i in rng.permutation(10)]
    missing = [c for c in cifar if c not in test_classes]
    if missing:
        raise BenchmarkError(
            f"abrupt: class(es) without a test folder under {cifar_root / 'test'}: {missing}"
        )

    # ---- plan: relpath -> ("link", target) | ("png", bytes)
    links: dict[str, Path] = {}
    for c in cifar:
        for split in ("train", "test"):
            files = list_images(cifar_root / split / c)
            if not files:
                raise BenchmarkError(f"abrupt: {cifar_root / split / c} holds no image")
            for f in files:
                links[f"{split}/cifar_{c}/{f}"] = cifar_root / split / c / f
    pngs = _digits_pngs(seed, digits_test_fraction)

    cn = [f"cifar_{c}" for c in cifar]
    dn = [f"digit_{d}" for d in digits]
    tasks = [cn[0:4], dn[0:4], cn[4:8], dn[4:8], cn[8:10] + dn[8:10]]

    entries = sorted(
        [(p, "link", str(t)) for p, t in links.items()] + [(p, "png", h) for p, (_, h) in pngs.items()]
    )
    plan_sha = hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()
    count = {s: sum(1 for p, _, _ in entries if p.startswith(s + "/")) for s in ("train", "test")}
    stamp: dict[str, Any] = {
        "builder": "proteus.streams.abrupt.build_abrupt_sequence",
        "stamp_version": STAMP_VERSION,
        "seed": seed,
        "digits_test_fraction": digits_test_fraction,
        "cifar_root": str(cifar_root),
        "cifar_classes": cifar,
        "digit_classes": digits,
        "tasks": tasks,
        "task_domains": list(TASK_DOMAINS),
        "files": count,
        "sha256": plan_sha,
    }
    stamp_path = out / STAMP_NAME
    if out.exists() and any(out.iterdir()) and not stamp_path.is_file():
        raise BenchmarkError(
            f"abrupt: refusing to write into {out}: it is not empty and holds no {STAMP_NAME} "
            "(choose a new or empty folder)"
        )

    # ---- sync the tree
    for rel, target in links.items():
        _link(out / rel, target)
    for rel, (data, _) in pngs.items():
        _write_if_changed(out / rel, data)
    planned = set(links) | set(pngs)
    for split in ("train", "test"):
        base = out / split
        for dirpath, dirnames, filenames in os.walk(base, topdown=False):
            d = Path(dirpath)
            for f in filenames:
                rel = (d / f).relative_to(out).as_posix()
                if rel not in planned:
                    (d / f).unlink()
            for sub in dirnames:
                p = d / sub
                if p.is_symlink():
                    p.unlink()
                elif not any(p.iterdir()):
                    p.rmdir()

    spec = {
        "description": f"PROTEUS abrupt sequence: CIFAR-10 and scikit-learn digits alternating (seed {seed})",
        "meta": {"builder": stamp["builder"], "seed": seed, "task_domains": list(TASK_DOMAINS)},
        "tasks": tasks,
    }
    _write_if_changed(out / "tasks.yaml", yaml.safe_dump(spec, sort_keys=False).encode())
    _write_if_changed(stamp_path, (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode())
    return out
