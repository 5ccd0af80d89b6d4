"""``proteus kb calibrate --images DIR`` (issue 39): which label each held-out image gets from its folder.
A class name with ``/`` (the ``domains*`` streams: ``cifar10-subset/cat``) is nested folders; a folder
that names no learned class and leads to none is refused by name. No model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from proteus.experiment.manage import calibration_images
from proteus.kb import KBError

NAMES = ["cifar10-subset/cat", "cifar10-subset/dog", "dtd/banded", "digit_0"]


def _tree(root: Path, *files: str) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(root / rel)
    return root


def test_nested_folders_mirror_class_names_with_a_slash(tmp_path: Path) -> None:
    root = _tree(
        tmp_path, "cifar10-subset/cat/a.png", "cifar10-subset/dog/b.png", "dtd/banded/c.png", "digit_0/d.png",
        "loose.png", "cifar10-subset/on-the-way.png", "cifar10-subset/cat/deeper/ignored.png",
    )  # fmt: skip
    files, labels = calibration_images(root, NAMES)
    got = {Path(f).relative_to(root).as_posix(): y for f, y in zip(files, labels, strict=True)}
    assert got == {
        "loose.png": -1,
        "cifar10-subset/on-the-way.png": -1,  # on the way to a class: its nearest class is taken
        "cifar10-subset/cat/a.png": 0,
        "cifar10-subset/dog/b.png": 1,
        "dtd/banded/c.png": 2,
        "digit_0/d.png": 3,
    }  # a class's own folder gives its images only (cat/deeper/ is not read), as ImageFolder


@pytest.mark.parametrize("bad", ["zebra/x.png", "dtd/zebra/x.png", "cifar10-subset/cat-typo/x.png"])
def test_a_folder_of_no_class_is_refused_by_name(tmp_path: Path, bad: str) -> None:
    root = _tree(tmp_path, "dtd/banded/c.png", bad)
    with pytest.raises(KBError) as e:
        calibration_images(root, NAMES)
    msg = str(e.value)
    assert f"{(root / bad).parent}: names no learned class" in msg
    assert "cifar10-subset/cat/ for cifar10-subset/cat" in msg  # says how a name with '/' is laid out
