"""Mahalanobis factors of the DP-GMM's components (Eq. 18's learner), dense or by the Woodbury identity.

In the eigenbasis of the covariance prior, the unnormalised covariance of component k is
``Num_k = diag(D_k) + B_k^T B_k`` with ``D_k = e + N_k reg_covar`` and ``B_k`` (r_k, d) the component's
responsibility-weighted, centred points plus one mean-shrinkage row
(:meth:`~proteus.signatures.dpgmm.DPGMM._m_step`). :func:`factorise` turns every component into rows of
one stacked factor matrix so that all Mahalanobis terms of an E-step are one matrix product:

* a *dense* component (``r_k >= d``, or a Woodbury core too ill-conditioned): ``FT_k = L_k^{-1}`` with
  ``L_k L_k^T = Num_k``, and ``maha/dof = ||FT_k (x - m_k)||^2``;
* a *Woodbury* component (``r_k < d``): ``Num_k^{-1} = D_k^{-1} - D_k^{-1} B_k^T (I + B_k D_k^{-1}
  B_k^T)^{-1} B_k D_k^{-1}``, so with ``G G^T = I + B_k D_k^{-1} B_k^T`` and ``FT_k = G^{-1} B_k
  D_k^{-1}``, ``maha/dof = ||x - m_k||^2_{D_k^{-1}} - ||FT_k (x - m_k)||^2``; cost ``O(N d r_k)``.

:func:`maha_over_dof` evaluates all pairs (optionally in float32 with an error magnitude, the
screening pass), :func:`marginal_bounds` lower-bounds them from low-dimensional marginals and
:func:`maha_pairs` computes selected pairs exactly (see ``DPGMM._weighted_log_prob``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from proteus.signatures.errors import SignatureFitError
from proteus.signatures.kmeans import mm_nt

__all__ = [
    "MahalanobisFactors", "augment_bf16", "base_term", "bf16_is_fast", "factorise", "maha_bf16",
    "maha_over_dof", "maha_pairs", "marginal_bounds",
]  # fmt: skip


@dataclass
class MahalanobisFactors:
    """Stacked Mahalanobis factors of all components (rotated basis), see :func:`factorise`.

    For a dense component, ``maha/dof = ||FT_k (x - m_k)||^2``; for a Woodbury one,
    ``maha/dof = ||x - m_k||^2_{D_k^{-1}} - ||FT_k (x - m_k)||^2``. Component k owns the rows
    ``bounds[k][0]:bounds[k][1]`` of ``FT``.
    """

    parts: list[Tensor]  # T factor blocks (r_k, d): component k's rows of FT
    part_off: list[Tensor]  # T offsets (r_k,): FT_k m_k
    S: Tensor  # (R, T) signed component indicator: +1 dense, -1 Woodbury
    bounds: list[tuple[int, int]]
    wood: Tensor  # (T,) bool
    inv_D: Tensor  # (T, d) 1 / (e + N_k reg_covar)
    logdet_num: Tensor  # (T,) log|Num_k|
    low: tuple[Tensor, Tensor] | None = None  # float32 copies of (FT, off) for the screening pass
    bf16: Tensor | None = None  # bfloat16 [FT, -off] (R, d + 1) for the bfloat16 screening pass
    marg: tuple[Tensor, Tensor, Tensor] | None = None  # marginal factors, offsets, block sums
    _stacked: tuple[Tensor, Tensor] | None = None

    @property
    def FT(self) -> Tensor:
        """(R, d) stacked factor rows (built on first use)."""
        return self._stack()[0]

    @property
    def off(self) -> Tensor:
        """(R,) ``FT`` row . m_k."""
        return self._stack()[1]

    def _stack(self) -> tuple[Tensor, Tensor]:
        if self._stacked is None:
            self._stacked = (torch.cat(self.parts, 0), torch.cat(self.part_off, 0))
        return self._stacked

    def all_finite(self) -> bool:
        """Whether every factor and log-determinant is finite (a non-finite entry makes its sum so)."""
        sums = torch.stack([p.sum() for p in self.parts] + [self.logdet_num.sum()])
        return bool(torch.isfinite(sums).all())


def factorise(B_list: list[Tensor], D: Tensor, means: Tensor) -> MahalanobisFactors:
    """Per component, Mahalanobis factors of ``Num_k = diag(D_k) + B_k^T B_k`` (``means``: the rotated
    component means ``m_k``, (T, d))."""
    T, d = D.shape
    dtype, device = D.dtype, D.device
    eps = float(torch.finfo(dtype).eps)
    inv_D = 1.0 / D
    log_D = D.log().sum(1)
    FT: list[Tensor | None] = [None] * T
    sign = [1.0] * T
    logdet = [torch.zeros((), dtype=dtype, device=device)] * T
    dense: list[int] = []
    for k in range(T):
        B = B_list[k]
        r = B.shape[0]
        if r >= d:
            dense.append(k)
            continue
        Bh = B * inv_D[k].sqrt()[None, :]
        core = Bh @ Bh.T
        if float(core.diagonal().sum()) > 1e-3 / eps:  # Woodbury would cancel badly: go dense
            dense.append(k)
            continue
        core.diagonal().add_(1.0)
        G, info = torch.linalg.cholesky_ex(core)
        if int(info) != 0:
            raise SignatureFitError(f"component {k}: Woodbury core matrix is not positive definite")
        FT[k] = torch.linalg.solve_triangular(G, B * inv_D[k][None, :], upper=False)
        sign[k] = -1.0
        logdet[k] = log_D[k] + 2.0 * G.diagonal().log().sum()
    if dense:
        nums = []
        for k in dense:
            B = B_list[k]
            num = B.T @ B
            num.diagonal().add_(D[k])
            nums.append(num)
        L, info = torch.linalg.cholesky_ex(torch.stack(nums))
        if bool((info != 0).any()):
            bad = [dense[i] for i in (info != 0).nonzero().flatten().tolist()]
            raise SignatureFitError(
                f"covariance of component(s) {bad} is not positive definite (ill-defined empirical "
                "covariance; increase reg_covar or regularise the covariance prior)"
            )
        eye = torch.eye(d, dtype=dtype, device=device).expand_as(L)
        Linv = torch.linalg.solve_triangular(L, eye, upper=False)
        ld = 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        for i, k in enumerate(dense):
            FT[k] = Linv[i]
            logdet[k] = ld[i]
    rows = [f for f in FT if f is not None]
    assert len(rows) == T
    sizes = [f.shape[0] for f in rows]
    R = sum(sizes)
    ends = np.cumsum(sizes).tolist()
    bounds = [(e - n, e) for n, e in zip(sizes, ends)]
    seg = torch.repeat_interleave(torch.arange(T, device=device), torch.tensor(sizes, device=device))
    offs = [rows[k] @ means[k] for k in range(T)]
    sign_t = torch.tensor(sign, dtype=dtype, device=device)
    S = torch.zeros((R, T), dtype=dtype, device=device)
    S[torch.arange(R, device=device), seg] = sign_t.index_select(0, seg)
    return MahalanobisFactors(
        parts=rows,
        part_off=offs,
        S=S,
        bounds=bounds,
        wood=sign_t < 0,
        inv_D=inv_D,
        logdet_num=torch.stack(logdet),
    )


def base_term(f: MahalanobisFactors, m: Tensor, xs: Tensor, xs2: Tensor | None) -> Tensor:
    """``||x - m_k||^2_{D_k^{-1}}`` (N, T) (the Woodbury components' leading term)."""
    m_invD = m * f.inv_D
    if xs2 is None:
        xs2 = xs * xs
    return mm_nt(xs2, f.inv_D) - 2.0 * mm_nt(xs, m_invD) + (m * m_invD).sum(1)[None, :]


def maha_over_dof(
    f: MahalanobisFactors, m: Tensor, Xr: Tensor, x2: Tensor | None, low: bool, chunk_elements: int
) -> tuple[Tensor, Tensor | None]:
    """``(x - m_k)^T Num_k^{-1} (x - m_k)`` for all rows and components, (N, T).

    With ``low=True`` the big product runs in float32 (the screening pass) and a magnitude (N, T)
    that bounds the rounding error (relative) is returned as well.
    """
    T = f.S.shape[1]
    N = Xr.shape[0]
    out = torch.empty((N, T), dtype=Xr.dtype, device=Xr.device)
    mag = torch.empty((N, T), dtype=Xr.dtype, device=Xr.device) if low else None
    if low:
        if f.low is None:
            f.low = (f.FT.float(), f.off.float())
        FT, off = f.low
        S, Sabs = f.S.float(), f.S.abs().float()
    else:
        FT, off, S, Sabs = f.FT, f.off, f.S, f.S
    R = FT.shape[0]
    chunk = max(1, chunk_elements // max(R, T, 1))
    any_wood = bool(f.wood.any())
    wood = f.wood[None, :]
    for s in range(0, N, chunk):
        xs = Xr[s : s + chunk]
        Y = xs.to(FT.dtype) @ FT.T
        Y.sub_(off[None, :]).square_()
        q = (Y @ S).to(Xr.dtype)
        m2 = (Y @ Sabs).to(Xr.dtype) if mag is not None else None
        if any_wood:
            base = base_term(f, m, xs, x2[s : s + chunk] if x2 is not None else None)
            base = torch.where(wood, base, torch.zeros_like(base))
            q = q + base
            if m2 is not None:
                m2 = m2 + base
        out[s : s + chunk] = q
        if mag is not None and m2 is not None:
            mag[s : s + chunk] = m2
    return out.clamp_min_(0.0), mag


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bfloat16 matrix products are native here (a CPU with AVX512-BF16 or AMX through oneDNN:
    several times float32's throughput; elsewhere they are emulated and slower)."""
    if device.type != "cpu":
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def augment_bf16(Xr: Tensor) -> Tensor:
    """``[Xr, 1]`` in bfloat16 (N, d + 1): the input of :func:`maha_bf16`."""
    return torch.cat([Xr, Xr.new_ones((Xr.shape[0], 1))], 1).to(torch.bfloat16)


def maha_bf16(
    f: MahalanobisFactors, m: Tensor, Xr: Tensor, A: Tensor, x2: Tensor | None, chunk_elements: int
) -> tuple[Tensor, Tensor]:
    """:func:`maha_over_dof` with the big product in bfloat16 (the first screening pass), and a magnitude
    (N, T) that bounds its rounding error (relative). ``A``: :func:`augment_bf16` of ``Xr``.

    The offsets ``FT m_k`` enter the product as an extra column (``[x, 1] . [FT_j, -off_j]``), so each
    output is ``FT_j (x - m_k)`` rounded once to bfloat16 relative to itself; the squares, the sums per
    component and the Woodbury components' leading term are float32 / input dtype. The error is then a
    few bfloat16 units (2^-8) of the magnitude ``sum_j |FT_j (x - m_k)|^2 + ||x - m_k||^2_{D^-1}``.
    """
    T = f.S.shape[1]
    N = Xr.shape[0]
    if f.bf16 is None:
        f.bf16 = torch.cat(
            [torch.cat([p, -o[:, None]], 1).to(torch.bfloat16) for p, o in zip(f.parts, f.part_off)], 0
        )
    Bm = f.bf16
    ind = f.S.abs().float()  # (R, T) component indicator
    R = Bm.shape[0]
    ssq = torch.empty((N, T), dtype=torch.float32, device=Xr.device)  # sum_j |FT_j (x - m_k)|^2
    chunk = max(1, chunk_elements // max(R, T, 1))
    for s in range(0, N, chunk):
        Y = (A[s : s + chunk] @ Bm.T).float()
        Y.square_()
        ssq[s : s + chunk] = Y @ ind
    mag = ssq.to(Xr.dtype)
    q = mag * torch.where(f.wood, -1.0, 1.0).to(Xr.dtype)[None, :]
    if bool(f.wood.any()):
        base = base_term(f, m, Xr, x2)
        base = torch.where(f.wood[None, :], base, torch.zeros_like(base))
        q += base
        mag += base
    return q.clamp_min_(0.0), mag


def marginal_bounds(
    f: MahalanobisFactors, B_list: list[Tensor], m: Tensor, Xr: Tensor, p: int, chunk_elements: int
) -> Tensor:
    """Lower bounds (N, T) on ``maha/dof``: the Mahalanobis term of each component's marginal on the
    ``p`` leading eigen-directions of the covariance prior (a marginal's Mahalanobis distance never
    exceeds the joint one: ``v^T A^{-1} v >= v_P^T (A_PP)^{-1} v_P`` for SPD ``A``)."""
    T, d = m.shape
    if f.marg is None:
        sub = []
        for k in range(T):
            Bp = B_list[k][:, d - p :]
            A = Bp.T @ Bp
            A.diagonal().add_(1.0 / f.inv_D[k, d - p :])
            sub.append(A)
        L, info = torch.linalg.cholesky_ex(torch.stack(sub))
        if bool((info != 0).any()):
            raise SignatureFitError("a component covariance is not positive definite")
        eye = torch.eye(p, dtype=L.dtype, device=L.device).expand_as(L)
        Linv = torch.linalg.solve_triangular(L, eye, upper=False)  # (T, p, p)
        W = Linv.permute(2, 0, 1).reshape(p, T * p)  # column (k, i) = row i of Linv_k
        off = torch.einsum("tij,tj->ti", Linv, m[:, d - p :]).reshape(T * p)
        blocks = torch.eye(T, dtype=L.dtype, device=L.device).repeat_interleave(p, dim=0)  # (T p, T)
        f.marg = (W, off, blocks)
    W, off, blocks = f.marg
    N = Xr.shape[0]
    out = torch.empty((N, T), dtype=Xr.dtype, device=Xr.device)
    chunk = max(1, chunk_elements // (T * p))
    for s in range(0, N, chunk):
        Y = Xr[s : s + chunk, d - p :] @ W
        Y.sub_(off[None, :])
        out[s : s + chunk] = Y.square_() @ blocks
    return out


def maha_pairs(
    f: MahalanobisFactors, m: Tensor, Xr: Tensor, cand: Tensor
) -> list[tuple[Tensor, int, Tensor]]:
    """Exact ``maha/dof`` for the (row, component) pairs marked in ``cand`` (N, T): per component,
    ``(rows, k, values)``."""
    out = []
    for k in range(len(f.bounds)):
        rows = cand[:, k].nonzero().flatten()
        if rows.numel() == 0:
            continue
        xs = Xr.index_select(0, rows)
        Y = xs @ f.parts[k].T - f.part_off[k][None, :]
        q = (Y * Y).sum(1)
        if bool(f.wood[k]):
            diff = xs - m[k]
            q = (diff * diff * f.inv_D[k]).sum(1) - q
        out.append((rows, k, q.clamp_min(0.0)))
    return out
