"""Input checks of the RanPAC head (:class:`~proteus.heads.ranpac.RanPACHead`): embeddings, labels and
class masks, each failing with a message that names the problem."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["allowed_mask", "check_embeddings", "check_labels"]


def check_embeddings(H: Tensor, embed_dim: int, what: str = "H") -> Tensor:
    """``H`` itself if it is a finite, real ``(N >= 1, embed_dim)`` tensor; else TypeError / ValueError."""
    if not isinstance(H, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(H).__name__}")
    if H.ndim != 2 or H.shape[1] != embed_dim:
        raise ValueError(f"{what} must have shape (N, {embed_dim}), got {tuple(H.shape)}")
    if H.shape[0] == 0:
        raise ValueError(f"{what} is empty (0 samples)")
    if not H.is_floating_point():
        raise ValueError(f"{what} must be a real floating-point tensor, got {H.dtype}")
    if not bool(torch.isfinite(H).all()):
        n_bad = int((~torch.isfinite(H)).any(dim=1).sum())
        raise ValueError(f"{what} contains NaN or inf values in {n_bad} of {H.shape[0]} rows")
    return H


def check_labels(y: Tensor, n: int, num_classes: int | None, seen: int) -> tuple[Tensor, int]:
    """``(y as long, total number of classes)`` for ``n`` integer labels, given ``seen`` classes so far."""
    if not isinstance(y, Tensor):
        raise TypeError(f"y must be a torch.Tensor of integer labels, got {type(y).__name__}")
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"y must have shape ({n},) to match H, got {tuple(y.shape)}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
    y_min, y_max = int(y.min()), int(y.max())
    if y_min < 0:
        raise ValueError(f"label {y_min} out of range: labels must be >= 0")
    if num_classes is not None:
        if int(num_classes) < seen:
            raise ValueError(f"num_classes={num_classes} is smaller than the {seen} classes already seen")
        if y_max >= int(num_classes):
            raise ValueError(f"label {y_max} out of range for num_classes={num_classes}")
        total = int(num_classes)
    else:
        total = max(seen, y_max + 1)
    return y.long(), total


def allowed_mask(classes: Tensor, n: int, c: int, device: torch.device) -> Tensor:
    """(n, c) boolean mask of the labels each row may take: ``classes`` is a 1-D tensor of labels, a
    ``(c,)`` mask or an ``(n, c)`` mask."""
    if not isinstance(classes, Tensor):
        classes = torch.as_tensor(classes)
    classes = classes.to(device)
    if classes.dtype == torch.bool:
        if classes.shape == (c,):
            mask = classes.unsqueeze(0).expand(n, c)
        elif classes.shape == (n, c):
            mask = classes
        else:
            raise ValueError(
                f"a boolean class mask must have shape ({c},) or ({n}, {c}), got {tuple(classes.shape)}"
            )
    else:
        if classes.is_floating_point() or classes.ndim != 1:
            raise ValueError("classes must be a 1-D tensor of integer labels or a boolean mask")
        if classes.numel() == 0:
            raise ValueError("classes is empty: no class to predict")
        lo, hi = int(classes.min()), int(classes.max())
        if lo < 0 or hi >= c:
            bad = lo if lo < 0 else hi
            raise ValueError(f"label {bad} in classes out of range for num_classes={c}")
        row = torch.zeros(c, dtype=torch.bool, device=device)
        row[classes.long()] = True
        mask = row.unsqueeze(0).expand(n, c)
    if not bool(mask.any(dim=1).all()):
        raise ValueError("the class mask allows no class for some rows")
    return mask
