"""Train/test split conventions of ImageNet-R and ImageNet-A (``benchmark.split``), as data.

Two conventions are in use in the continual-learning literature that PROTEUS compares with (Sec. 5.1):

* ``folders`` (the default): the RevisitingCIL archives (Zhou et al.; used by RanPAC, LAMDA-PILOT, EASE
  and the paper's ImageNet-R/A numbers), already split into ``train/<class>/*`` and ``test/<class>/*``:
  the archive's folders are the manifest.
* ``coda``: the raw ImageNet-R release (``imagenet-r/<wnid>/*.jpg``, 30,000 images, 200 classes) with the
  fixed 24,000 / 6,000 split that CODA-Prompt published as file lists and that HiDe-Prompt and InfLoRA
  reuse. The 6,000 test files are shipped here (``splits/imagenet-r-coda-test.txt.gz``: one
  ``<wnid>/<file>`` per line, sorted; its sha256 is recorded in the run's split manifest); every other image
  of the tree is a training image. ImageNet-A has no such convention (its prompt-method papers do not use
  it), so ``coda`` is refused for it by name.

(The L2P and DualPrompt ports split the raw tree 80/20 with ``torch.utils.data.random_split`` under their
global seed, a convention that depends on their seeding order; it is not provided.)
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from proteus.registry import Registry
from proteus.streams.datasets import (
    ImageFileDataset,
    imagefolder_pair,
    list_class_dirs,
    list_images,
    resolve_imagefolder,
)
from proteus.streams.errors import BenchmarkError, DataNotFoundError

__all__ = ["SPLITS", "Split", "coda_imagenet_r", "coda_split", "coda_test_files", "folders_split"]

#: what a split of benchmark ``name`` under the folder given gives: the folder it read, the train and test
#: sets, the class names (sorted folder names: the source labels) and what the stream records of its format
Split = tuple[Path, ImageFileDataset, ImageFileDataset, list[str], dict[str, Any]]

#: ``benchmark.split``: the ImageNet-R/A train/test conventions, each a function (name, folder) -> Split
SPLITS: Registry[Callable[[str, Path], Split]] = Registry("benchmark.split")


@SPLITS.register("folders", help="the archive's train/ and test/ folders (RevisitingCIL; default)")
def folders_split(name: str, given: Path) -> Split:
    """``given/{train,test}/<class>/*`` (or the same under ``given/<name>``): the RevisitingCIL archives."""
    root = resolve_imagefolder(given, [name])
    if root is None:
        raise DataNotFoundError(
            f"{name}: no ImageFolder tree found at {given}. Expected {given}/train/<class>/* and "
            f"{given}/test/<class>/* with 200 class folders (or the same under {given / name}), as in the "
            f"RevisitingCIL archives (https://github.com/zhoudw-zdw/RevisitingCIL, README 'Datasets'). "
            f"Extract the archive there, or point benchmark.data (or $PROTEUS_DATA) at its folder."
        )
    train, test, classes = imagefolder_pair(root, name)
    return root, train, test, classes, {"format": "imagefolder"}


@SPLITS.register("coda", help="raw ImageNet-R with CODA-Prompt's fixed 24,000 / 6,000 file split")
def coda_split(name: str, given: Path) -> Split:
    """Raw ImageNet-R under ``given`` and the shipped test list (:func:`coda_imagenet_r`)."""
    if name != "imagenet-r":
        raise BenchmarkError(f"{name}: benchmark.split=coda exists for imagenet-r only; use 'folders'")
    train, test, classes = coda_imagenet_r(given)
    return given, train, test, classes, {"format": "raw", "split": "coda", "split_sha256": CODA_TEST_SHA256}


_CODA_TEST = "imagenet-r-coda-test.txt.gz"
#: sha256 of the uncompressed list (checked when read)
CODA_TEST_SHA256 = "524a3ebf6dac30228a30387443c2c30a21c483b6d0d3c57768f74edd60cfecc3"


def coda_test_files(path: Path | None = None) -> list[str]:
    """The ``<wnid>/<file>`` names of CODA-Prompt's ImageNet-R test split (the shipped list, or ``path``)."""
    if path is None:
        raw = resources.files("proteus.streams").joinpath("splits").joinpath(_CODA_TEST).read_bytes()
        body = gzip.decompress(raw)
        if hashlib.sha256(body).hexdigest() != CODA_TEST_SHA256:
            raise BenchmarkError(f"the shipped split list {_CODA_TEST} is damaged; reinstall proteus")
    else:
        body = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [line for line in body.decode().splitlines() if line]


def _raw_root(given: Path) -> Path | None:
    """``given`` or ``given/imagenet-r`` when it holds the raw class folders (``n01443537`` ...)."""
    for root in (given, given / "imagenet-r"):
        if root.is_dir() and any(name.startswith("n") for name in list_class_dirs(root)):
            return root
    return None


def coda_imagenet_r(
    given: Path, test_files: list[str] | None = None
) -> tuple[ImageFileDataset, ImageFileDataset, list[str]]:
    """Train and test sets of the raw ImageNet-R tree under ``given`` split by CODA-Prompt's list (source
    label = sorted class-folder index). Every listed test file must exist: a missing one is named."""
    root = _raw_root(given)
    if root is None:
        raise DataNotFoundError(
            f"imagenet-r (benchmark.split=coda): no raw ImageNet-R tree at {given}; expected "
            f"{given}/<wnid>/*.jpg (or {given}/imagenet-r/<wnid>/*.jpg), the imagenet-r.tar release of "
            "Hendrycks et al. extracted there"
        )
    test = set(coda_test_files() if test_files is None else test_files)
    classes = list_class_dirs(root)
    paths: dict[bool, list[str]] = {True: [], False: []}
    targets: dict[bool, list[int]] = {True: [], False: []}
    seen = set()
    for label, name in enumerate(classes):
        for f in list_images(root / name):
            rel = f"{name}/{f}"
            is_test = rel in test
            if is_test:
                seen.add(rel)
            paths[is_test].append(rel)
            targets[is_test].append(label)
    missing = sorted(test - seen)
    if missing:
        raise BenchmarkError(
            f"imagenet-r (benchmark.split=coda): {len(missing)} file(s) of the test list are not under "
            f"{root}, e.g. {', '.join(missing[:3])}; is this the complete imagenet-r release?"
        )
    return (
        ImageFileDataset(root, paths[False], targets[False]),
        ImageFileDataset(root, paths[True], targets[True]),
        classes,
    )
