"""The signature fit's error type and the input checks shared by the DP-GMM, k-means and the storage."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from proteus.errors import ProteusError

__all__ = ["SignatureFitError", "as_tensor", "check_finite_rows", "like"]


class SignatureFitError(ProteusError, ValueError):
    """A signature (DP-GMM, k-means or Gaussian) could not be fitted; the message names the cause."""


def as_tensor(X: Tensor | np.ndarray, device: torch.device | str | None, dtype: torch.dtype) -> Tensor:
    """``X`` as a 2-D tensor on ``device`` (its own when None) in ``dtype``."""
    if isinstance(X, np.ndarray):
        X = torch.from_numpy(np.ascontiguousarray(X))
    if not isinstance(X, Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(X).__name__}")
    if X.ndim != 2:
        raise SignatureFitError(f"expected a 2-D (N, d) array, got shape {tuple(X.shape)}")
    return X.to(device=device if device is not None else X.device, dtype=dtype)


def like(value: Tensor | np.ndarray, X: Tensor) -> Tensor:
    """``value`` as a tensor on X's device and dtype."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    return torch.as_tensor(value).to(device=X.device, dtype=X.dtype)


def check_finite_rows(X: Tensor) -> None:
    """Raise :class:`SignatureFitError` naming how many rows contain NaN or inf."""
    nan_rows = int(torch.isnan(X).any(dim=1).sum())
    inf_rows = int(torch.isinf(X).any(dim=1).sum())
    if nan_rows or inf_rows:
        parts = []
        if nan_rows:
            parts.append(f"{nan_rows} NaN row{'s' if nan_rows != 1 else ''}")
        if inf_rows:
            parts.append(f"{inf_rows} row{'s' if inf_rows != 1 else ''} with inf")
        raise SignatureFitError(f"embeddings contain {' and '.join(parts)} (of {X.shape[0]})")
