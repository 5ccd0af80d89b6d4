"""Image transforms from a backbone's data config (the paper's ViT practice, Sec. 5.1).

Training with augmentation: RandomResizedCrop + horizontal flip (as RanPAC/LAMDA-PILOT). Otherwise:
resize to input_size / crop_pct then center-crop. Small images (CIFAR 32 px, digits 8 px) are resized
up directly (no crop) so that nothing of a tiny image is cut away.
"""

from __future__ import annotations

from collections.abc import Callable

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
        return self.small(img) if max(w, h) <= self.size else self.big(img)
