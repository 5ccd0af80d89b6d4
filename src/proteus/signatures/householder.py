"""A compact, exact-to-rounding store of an orthogonal matrix: its Householder vectors.

An orthogonal ``V`` (d, d) whose QR factorisation has ``R = I`` (every column's sign chosen so, see
:func:`positive_qr_signs`) equals the product of the d Householder reflectors of that factorisation; each
reflector ``I - tau v v^T`` is fixed by the part of ``v`` below its leading 1, and ``tau = 2 / v^T v``
(0 where that part is zero). The strictly-lower triangle of the reflectors, ``d (d - 1) / 2`` numbers,
therefore stores ``V``: half of the d x d matrix. Rebuilt in float64 from float32 vectors, every
reflector is exactly orthogonal, so the rebuilt matrix is orthogonal to float64 round-off and within
float32 round-off of ``V`` (about 1e-7 per reflector).

:class:`~proteus.signatures.gaussian.SharedComponents` stores its covariance prior's eigenvectors so
when its factors are stored in float16 (``signature.storage_dtype = "float16"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_orthogonal", "positive_qr_signs", "unpack_orthogonal"]


def positive_qr_signs(V: Tensor) -> Tensor:
    """Column signs ``s`` (d,) such that ``V diag(s)`` has a QR factorisation with ``R = I``."""
    _, R = torch.linalg.qr(V.to(torch.float64))
    return torch.where(R.diagonal() < 0, -1.0, 1.0).to(torch.float64)


def pack_orthogonal(V: Tensor) -> Tensor:
    """The Householder vectors of ``V`` (d, d), orthogonal with positive QR signs (:func:`positive_qr_signs`),
    packed column by column below the diagonal: (d (d - 1) / 2,) float64."""
    d = V.shape[0]
    A, _ = torch.geqrf(V.to(torch.float64))
    rows, cols = torch.tril_indices(d, d, offset=-1, device=V.device)
    order = torch.argsort(cols * d + rows)  # column-major: each reflector's entries together
    return A[rows[order], cols[order]]


def unpack_orthogonal(packed: Tensor, d: int) -> Tensor:
    """The orthogonal (d, d) float64 matrix whose Householder vectors :func:`pack_orthogonal` packed."""
    if packed.ndim != 1 or packed.numel() != d * (d - 1) // 2:
        raise ValueError(f"packed Householder vectors of a ({d}, {d}) matrix need {d * (d - 1) // 2} values, "
                         f"got shape {tuple(packed.shape)}")  # fmt: skip
    rows, cols = torch.tril_indices(d, d, offset=-1, device=packed.device)
    order = torch.argsort(cols * d + rows)
    A = torch.zeros((d, d), dtype=torch.float64, device=packed.device)
    A[rows[order], cols[order]] = packed.to(torch.float64)
    tail = (A * A).sum(0)  # ||v_tail||^2 per reflector
    tau = torch.where(tail > 0, 2.0 / (1.0 + tail), torch.zeros_like(tail))
    return torch.linalg.householder_product(A, tau)
