"""Image datasets behind the task streams (paper Sec. 5.1 and Appendix "Datasets, Hyperparameters").

Every dataset here yields ``(PIL.Image in mode "RGB", int label)``. No transform is applied: resizing,
normalisation and augmentation belong to the learner (wrap a dataset in :class:`TransformedDataset`).

Image files are decoded by :func:`proteus.images.open_image`, the same function ``proteus predict`` uses,
so training and prediction see identical pixels: EXIF orientation applied, 16-bit grayscale scaled (not
clipped) to 8 bits, alpha dropped (transparent pixels keep the colour they store, as torchvision's
``default_loader`` does), and an image above the pixel limit refused from its header, before decoding.
See :mod:`proteus.images` for every rule.

Two storage kinds:

* :class:`ArrayImageDataset` holds uint8 pixels in memory (scikit-learn digits, torchvision's CIFAR
  arrays): fast, no file I/O.
* :class:`ImageFileDataset` holds relative file paths (ImageFolder trees) and decodes lazily; an unreadable
  file raises :class:`~proteus.streams.errors.CorruptImageError` naming its path.

Both know their labels (``targets``) and identities (``keys``: relative path or row index) without decoding
anything, which is what the manifest hashes and what :class:`SubsetByLabels` filters on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from proteus.images import DEFAULT_MAX_PIXELS, ImageError, open_image
from proteus.images import to_rgb as _to_rgb
from proteus.streams.errors import BenchmarkError, CorruptImageError, DataNotFoundError

#: file suffixes (lower case) treated as images when scanning an ImageFolder tree; other files are ignored
IMG_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"}
)

D = TypeVar("D", bound="LabeledImageDataset")


# ---------------------------------------------------------------------------------------------- loading
def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL image to ``RGB`` with the rules of :func:`proteus.images.to_rgb`."""
    return _to_rgb(img)


def load_image(path: str | os.PathLike[str], max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode one image file to RGB with :func:`proteus.images.open_image`.

    Any failure (including an image above ``max_pixels``) raises :class:`CorruptImageError` (also an
    :class:`~proteus.images.ImageError`): ``"cannot read image file PATH: REASON"``.
    """
    try:
        return open_image(path, max_pixels=max_pixels)
    except ImageError as e:
        p = e.path or os.fspath(path)
        raise CorruptImageError(
            f"cannot read image file {p}: {e.reason or e}", path=p, reason=e.reason
        ) from e


# ---------------------------------------------------------------------------------------------- base
class LabeledImageDataset(Dataset):
    """A dataset whose labels (``targets``) and identities (``keys``) are known without decoding images."""

    targets: list[int]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} items")
        return self._load(i), self.targets[i]

    # subclasses implement these three
    def _load(self, i: int) -> Image.Image:
        raise NotImplementedError

    @property
    def keys(self) -> list[str] | list[int]:
        """Identity of each item: a path relative to the benchmark root, or a row index in the source."""
        raise NotImplementedError

    def select(self: D, indices: Sequence[int] | np.ndarray) -> D:
        """A dataset of the same kind holding the items at ``indices`` (no image is decoded)."""
        raise NotImplementedError

    def _with_targets(self: D, indices: np.ndarray, targets: list[int]) -> D:
        raise NotImplementedError

    # shared helpers
    def relabel(self: D, mapping: dict[int, int]) -> D:
        """Keep items whose label is a key of ``mapping`` and give them ``mapping[label]``."""
        t = np.asarray(self.targets, dtype=np.int64)
        keep = np.flatnonzero(np.isin(t, np.fromiter(mapping.keys(), dtype=np.int64, count=len(mapping))))
        return self._with_targets(keep, [mapping[int(x)] for x in t[keep]])

    def indices_of(self, labels: Iterable[int]) -> np.ndarray:
        """Indices of the items whose label is in ``labels`` (in dataset order)."""
        wanted = np.fromiter((int(x) for x in labels), dtype=np.int64)
        return np.flatnonzero(np.isin(np.asarray(self.targets, dtype=np.int64), wanted))

    def class_counts(self, num_classes: int) -> list[int]:
        return np.bincount(np.asarray(self.targets, dtype=np.int64), minlength=num_classes).tolist()


# ---------------------------------------------------------------------------------------------- in memory
class ArrayImageDataset(LabeledImageDataset):
    """uint8 images held in memory: ``images`` is ``(N, H, W)`` or ``(N, H, W, C)`` with C in 1, 3, 4.

    ``rows`` selects the rows of ``images`` this dataset exposes (shared, never copied); the key of an
    item is its row index in ``images``, so it identifies the image in the source dataset.
    """

    def __init__(
        self,
        images: np.ndarray,
        targets: Sequence[int] | np.ndarray,
        rows: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        if images.dtype != np.uint8:
            raise TypeError(f"ArrayImageDataset expects uint8 images, got {images.dtype}")
        if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[3] not in (1, 3, 4)):
            raise ValueError(f"images must be (N,H,W) or (N,H,W,C) with C in 1,3,4; got {images.shape}")
        self._images = images
        self._rows = np.arange(len(images)) if rows is None else np.asarray(rows, dtype=np.int64)
        self.targets = [int(x) for x in targets]
        if len(self.targets) != len(self._rows):
            raise ValueError(f"{len(self.targets)} targets for {len(self._rows)} images")

    def _load(self, i: int) -> Image.Image:
        arr = self._images[self._rows[i]]
        if arr.ndim == 3 and arr.shape[2] == 1:
            arr = arr[:, :, 0]
        return to_rgb(Image.fromarray(arr))

    @property
    def keys(self) -> list[int]:
        return self._rows.tolist()

    def select(self, indices: Sequence[int] | np.ndarray) -> ArrayImageDataset:
        idx = np.asarray(indices, dtype=np.int64)
        return ArrayImageDataset(self._images, [self.targets[int(i)] for i in idx], self._rows[idx])

    def _with_targets(self, indices: np.ndarray, targets: list[int]) -> ArrayImageDataset:
        return ArrayImageDataset(self._images, targets, self._rows[np.asarray(indices, dtype=np.int64)])

    def __repr__(self) -> str:
        return f"ArrayImageDataset({len(self)} images of shape {self._images.shape[1:]})"


# ---------------------------------------------------------------------------------------------- on disk
class ImageFileDataset(LabeledImageDataset):
    """Image files under ``root`` (``paths`` relative to it, POSIX separators), decoded lazily.

    ``max_pixels`` is the per-image limit of :func:`proteus.images.open_image` (None: no limit); an image
    above it raises :class:`CorruptImageError` naming the file, before it is decoded.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        paths: Sequence[str],
        targets: Sequence[int],
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.root = Path(root)
        self.paths = list(paths)
        self.targets = [int(x) for x in targets]
        self.max_pixels = max_pixels
        if len(self.paths) != len(self.targets):
            raise ValueError(f"{len(self.targets)} targets for {len(self.paths)} paths")

    def _load(self, i: int) -> Image.Image:
        return load_image(self.root / self.paths[i], max_pixels=self.max_pixels)

    def path(self, i: int) -> Path:
        """Absolute path of item ``i``."""
        return self.root / self.paths[i]

    @property
    def keys(self) -> list[str]:
        return list(self.paths)

    def select(self, indices: Sequence[int] | np.ndarray) -> ImageFileDataset:
        idx = [int(i) for i in np.asarray(indices, dtype=np.int64)]
        return ImageFileDataset(
            self.root, [self.paths[i] for i in idx], [self.targets[i] for i in idx], self.max_pixels
        )

    def _with_targets(self, indices: np.ndarray, targets: list[int]) -> ImageFileDataset:
        return ImageFileDataset(self.root, [self.paths[int(i)] for i in indices], targets, self.max_pixels)

    def __repr__(self) -> str:
        return f"ImageFileDataset({len(self)} files under {self.root})"


# ---------------------------------------------------------------------------------------------- wrappers
class SubsetByLabels(Dataset):
    """The items of ``dataset`` whose label is in ``labels`` (order preserved).

    Uses ``dataset.targets`` when present (no decoding); otherwise reads every item once to find labels.
    """

    def __init__(self, dataset: Dataset, labels: Iterable[int]) -> None:
        self.dataset = dataset
        self.labels = sorted({int(x) for x in labels})
        targets = getattr(dataset, "targets", None)
        if targets is None:
            targets = [int(dataset[i][1]) for i in range(len(dataset))]  # type: ignore[arg-type]
        wanted = set(self.labels)
        self.indices = [i for i, t in enumerate(targets) if int(t) in wanted]
        self.targets = [int(targets[i]) for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]


class TransformedDataset(Dataset):
    """Apply ``transform`` to the image (and ``target_transform`` to the label) of each item."""

    def __init__(
        self,
        dataset: Dataset,
        transform: Callable[[Any], Any] | None,
        target_transform: Callable[[int], Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.transform = transform
        self.target_transform = target_transform

    @property
    def targets(self) -> list[int] | None:
        return getattr(self.dataset, "targets", None)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        img, label = self.dataset[i]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return img, label


# ---------------------------------------------------------------------------------------------- scanning
def _layout(split_dir: Path) -> str:
    """The valid ImageFolder layout of ``split_dir``, for error messages."""
    return (
        f"an ImageFolder split is one sub-folder per class holding that class's images, e.g. "
        f"{split_dir}/<class_a>/001.png and {split_dir}/<class_b>/001.jpg (at least 2 classes; image "
        f"suffixes: {', '.join(sorted(IMG_EXTENSIONS))})"
    )


def _scandir_names(directory: Path, what: str) -> list[os.DirEntry[str]]:
    """The entries of ``directory``; a missing, non-folder or unreadable one raises naming it."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        raise DataNotFoundError(f"{what} {directory} does not exist") from None
    except NotADirectoryError:
        raise BenchmarkError(f"{what} {directory} is a file, not a folder") from None
    except PermissionError as e:
        raise BenchmarkError(
            f"{what} {directory} cannot be read ({e.strerror}); check its permissions"
        ) from None


def list_class_dirs(split_dir: Path) -> list[str]:
    """Sorted names of the (non-hidden) class folders of an ImageFolder split, as torchvision sorts them.

    An empty list when the split holds no class folder; a split folder that does not exist raises
    :class:`DataNotFoundError`, one that cannot be read :class:`BenchmarkError`.
    """
    entries = _scandir_names(Path(split_dir), "split folder")
    return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


def list_images(class_dir: Path) -> list[str]:
    """Sorted file names of the images directly inside ``class_dir`` (by suffix, see IMG_EXTENSIONS)."""
    entries = _scandir_names(Path(class_dir), "class folder")
    return sorted(
        e.name
        for e in entries
        if not e.name.startswith(".")
        and os.path.splitext(e.name)[1].lower() in IMG_EXTENSIONS
        and e.is_file()
    )


def scan_image_folder(
    root: Path,
    split: str,
    classes: Sequence[str],
    *,
    allow_empty: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> ImageFileDataset:
    """An :class:`ImageFileDataset` over ``root/split/<class>/*``; label = index of the class in ``classes``.

    Raises :class:`BenchmarkError` naming the folder, with the valid layout, when ``classes`` is empty
    (the split holds no class folder), names a single class (nothing to tell apart), names a class
    folder that is missing, or names one that holds no image (unless ``allow_empty``).
    """
    split_dir = Path(root) / split
    if not classes:
        raise BenchmarkError(f"{split_dir} holds no class folder; {_layout(split_dir)}")
    if len(classes) == 1:
        raise BenchmarkError(
            f"{split_dir} has only one class ({classes[0]!r}), so there is nothing to tell apart; "
            f"add at least one more class folder: {_layout(split_dir)}"
        )
    paths: list[str] = []
    targets: list[int] = []
    for label, name in enumerate(classes):
        d = split_dir / name
        if not d.is_dir():
            raise BenchmarkError(
                f"missing class folder {d} (class {name!r} of the {split} split); {_layout(split_dir)}"
            )
        files = list_images(d)
        if not files and not allow_empty:
            raise BenchmarkError(
                f"class folder {d} holds no image (class {name!r} of the {split} split); put its images "
                f"directly inside it or remove the folder; {_layout(split_dir)}"
            )
        paths.extend(f"{split}/{name}/{f}" for f in files)
        targets.extend([label] * len(files))
    return ImageFileDataset(root, paths, targets, max_pixels)


def imagefolder_pair(root: Path, name: str) -> tuple[ImageFileDataset, ImageFileDataset, list[str]]:
    """Train and test sets of ``root/{train,test}/<class>/*`` with source label = sorted class-folder index.

    Train and test must hold the same class folders; a difference raises naming the classes.
    """
    classes = list_class_dirs(root / "train")
    test_classes = list_class_dirs(root / "test")
    if not classes:
        raise DataNotFoundError(f"{name}: {root / 'train'} holds no class folder (expected train/<class>/*)")
    missing = sorted(set(classes) - set(test_classes))
    extra = sorted(set(test_classes) - set(classes))
    if missing:
        raise BenchmarkError(
            f"{name}: class(es) without a test folder under {root / 'test'}: {', '.join(missing)}"
        )
    if extra:
        raise BenchmarkError(
            f"{name}: test class folder(s) with no train folder under {root / 'train'}: {', '.join(extra)}"
        )
    return scan_image_folder(root, "train", classes), scan_image_folder(root, "test", classes), classes


def is_imagefolder(root: Path) -> bool:
    """Whether ``root`` holds ``train/`` and ``test/`` folders."""
    return (root / "train").is_dir() and (root / "test").is_dir()


def resolve_imagefolder(root: Path, subdirs: list[str]) -> Path | None:
    """``root`` or the first of ``root/<subdir>`` that holds ``train/`` and ``test/`` folders; None."""
    for cand in [root, *(root / s for s in subdirs)]:
        if is_imagefolder(cand):
            return cand
    return None
