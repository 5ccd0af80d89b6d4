"""Image transforms from a backbone's data config (the paper's ViT practice, Sec. 5.1).

Training with augmentation: RandomResizedCrop + horizontal flip (as RanPAC/LAMDA-PILOT). Otherwise:
resize to input_size / crop_pct then center-crop. Small images (CIFAR 32 px, digits 8 px) are resized
up directly (no crop) so that nothing of a tiny image is cut away. An image longer than :data:`MAX_ASPECT`
times its short side is first cut to the centre of that shape: the resize scales the short side, so an
8,000,000 x 8 image (64 megapixels, within the decode budget) would otherwise become gigapixels, of which the
centre crop keeps a square anyway (the cut keeps that square whole: the same crop, to the resampling's
round-off).
"""

from __future__ import annotations

from collections.abc import Callable

from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode

from proteus.backbones.base import DataConfig

_INTERP = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "nearest": InterpolationMode.NEAREST,
}


def build_transform(cfg: DataConfig, *, train: bool = False, augment: bool = False) -> Callable:
    size = cfg.input_size
    interp = _INTERP.get(cfg.interpolation, InterpolationMode.BILINEAR)
    norm = [T.ToTensor(), T.Normalize(cfg.mean, cfg.std)]
    if train and augment:
        return T.Compose(
            [
                T.RandomResizedCrop(size, scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3), interpolation=interp),
                T.RandomHorizontalFlip(),
                *norm,
            ]
        )
    return T.Compose([_ResizeForEval(size, cfg.crop_pct, interp), *norm])


#: the longest side an image keeps, in multiples of its short side, before it is resized (module doc): the
#: centre crop keeps at most the short side's length of the long one, so a cut at 4x never reaches it
MAX_ASPECT = 4


def _bounded_aspect(img: Image.Image) -> Image.Image:
    """``img`` cut to its centre ``short`` x ``MAX_ASPECT * short`` part when it is longer (module doc)."""
    w, h = img.size
    short, long = min(w, h), max(w, h)
    if long <= MAX_ASPECT * short:
        return img
    keep = MAX_ASPECT * short
    off = (long - keep) // 2
    return img.crop((off, 0, off + keep, h) if w > h else (0, off, w, off + keep))


class _ResizeForEval:
    """Resize+center-crop for large images; plain resize for images no larger than the input size."""

    def __init__(self, size: int, crop_pct: float, interp: InterpolationMode) -> None:
        self.size = size
        self.big = T.Compose(
            [T.Resize(int(round(size / crop_pct)), interpolation=interp), T.CenterCrop(size)]
        )
        self.small = T.Resize((size, size), interpolation=interp, antialias=True)

    def __call__(self, img):  # PIL image
        w, h = img.size
        return self.small(img) if max(w, h) <= self.size else self.big(_bounded_aspect(img))
