"""Kind ``"shared"`` (:class:`~proteus.signatures.gaussian.SharedComponents`): the math behind it.

A task's components share one full matrix ``P = V diag(e) V^T`` (the DP-GMM's covariance prior) and each
adds a low-rank data term in P's whitened space (see the module docstring of
:mod:`~proteus.signatures.gaussian`). :func:`shared_tensors` builds the stored tensors from factored
covariances (the posterior structure of Eq. 18's DP-GMM), :func:`allocate_ranks` splits the factor-row
budget between the components, and :func:`shared_scoring` derives the Woodbury scoring factors from the
stored tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proteus.signatures.components import COVARIANCES, ComponentSource, GaussianComponents, compute_dtype
from proteus.signatures.errors import SignatureFitError
from proteus.signatures.householder import pack_orthogonal, positive_qr_signs
from proteus.signatures.posterior import PosteriorFactors
from proteus.tensor_rules import TENSOR_RULES, ShapeRule, Together

__all__ = ["SharedComponents", "allocate_ranks", "shared_scoring", "shared_tensors"]


def allocate_ranks(sizes: list[int], budget: int, d: int) -> list[int]:
    """Factor rows kept per component: ``q_t = min(r_t, tau, d)`` with the largest cap ``tau`` whose total
    fits ``budget`` (rows that small components do not need go to the large ones); the rows left below
    the budget by the integer cap go one each to the largest components."""
    need = [min(r, d) for r in sizes]
    if sum(need) <= budget:
        return need
    lo, hi = 0, max(need)
    while lo < hi:  # largest tau with sum(min(need, tau)) <= budget
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in need) <= budget:
            lo = mid
        else:
            hi = mid - 1
    out = [min(n, lo) for n in need]
    spare = budget - sum(out)
    for k in sorted(range(len(out)), key=lambda i: -need[i]):
        if spare <= 0:
            break
        if out[k] < need[k]:
            out[k] += 1
            spare -= 1
    return out


def shared_tensors(
    weights: Tensor, means: Tensor, factored: PosteriorFactors, rank: int
) -> dict[str, Tensor]:
    """Components of kind ``"shared"`` from factored covariances (``factored``, as
    :meth:`~proteus.signatures.dpgmm.DPGMM.posterior_factors` returns them)
    ``Lambda_t = scale_t (P + ridge_t I + V F_t^T F_t V^T)``: ``P = V diag(prior_evals) V^T`` is shared by
    all components and ``F_t`` (r_t, d) is given in P's eigenbasis (``prior_evecs`` = V, columns).

    In P's whitened space (``z = diag(e)^{-1/2} V^T x``) the covariance is ``scale_t (D_t + G_t^T G_t)``
    with the diagonal ``D_t = 1 + ridge_t / e`` and ``G_t = F_t diag(e)^{-1/2}``. The components share a
    budget of ``T * rank`` factor rows (:func:`allocate_ranks`): component t keeps ``q_t`` rows, all of
    them (exact) when the ``r_t`` fit the budget. A component with ``r_t > q_t`` keeps the top ``q_t``
    eigenpairs of ``M_t = D_t^{-1/2} G_t^T G_t D_t^{-1/2}`` exactly and replaces the ``d - q_t`` others,
    ``mu_j``, by one value ``s_t`` chosen to preserve the trace of the precision, ``(d - q_t) / (1 + s_t)
    = sum_j 1 / (1 + mu_j)`` (so the Mahalanobis term of inputs spread evenly over those directions is
    unbiased), i.e. ``D_t`` becomes ``(1 + s_t) D_t``; its log-determinant stays exact (computed from
    all eigenvalues of ``M_t``). Returns the stored tensors, in float64.
    """
    f64 = torch.float64
    prior_evals, prior_evecs, factors = factored.prior_evals, factored.prior_evecs, factored.factors
    if means.ndim != 2:
        raise ValueError(f"means must be (T, d), got {tuple(means.shape)}")
    T, d = means.shape
    if T == 0:
        raise SignatureFitError("no Gaussian components to store")
    if prior_evals.shape != (d,) or prior_evecs.shape != (d, d) or len(factors) != T:
        raise ValueError(
            f"shared covariance parts do not match means {tuple(means.shape)}: prior_evals "
            f"{tuple(prior_evals.shape)}, prior_evecs {tuple(prior_evecs.shape)}, {len(factors)} factors"
        )
    dev = means.device
    e = prior_evals.detach().to(device=dev, dtype=f64)
    V = prior_evecs.detach().to(device=dev, dtype=f64)
    c = factored.scale.detach().to(device=dev, dtype=f64).reshape(T)
    a = factored.ridge.detach().to(device=dev, dtype=f64).reshape(T)
    m = means.detach().to(f64)
    if not bool(torch.isfinite(e).all() and torch.isfinite(V).all() and torch.isfinite(m).all()):
        raise SignatureFitError("component means or the shared covariance are not finite")
    if float(e.min()) <= 0.0:
        raise SignatureFitError(f"singular shared covariance: smallest eigenvalue {float(e.min()):.3g}")
    if not bool(torch.isfinite(c).all() and torch.isfinite(a).all() and (c > 0).all() and (a >= 0).all()):
        raise SignatureFitError("component scales must be positive and ridges non-negative")
    Fs = [f.detach().to(device=dev, dtype=f64).reshape(-1, d) for f in factors]
    ranks = allocate_ranks([f.shape[0] for f in Fs], T * max(0, int(rank)), d)
    inv_sqrt_e = e.rsqrt()
    rows: list[Tensor] = []
    gain = torch.ones(T, dtype=f64, device=dev)
    log_core = torch.zeros(T, dtype=f64, device=dev)  # log|I + M_t| (exact)
    for k, (F, q) in enumerate(zip(Fs, ranks)):
        if not bool(torch.isfinite(F).all()):
            raise SignatureFitError(f"component {k}: covariance factor is not finite")
        G = F * inv_sqrt_e[None, :]  # (r, d): rows in P's whitened space
        r = G.shape[0]
        sqrt_D = (1.0 + a[k] / e).sqrt()
        Gt = G / sqrt_D[None, :]
        if r <= q:  # exact: the factor itself
            log_core[k] = torch.log1p(torch.linalg.eigvalsh(Gt @ Gt.T).clamp_min(0.0)).sum()
            rows.append(G)
            continue
        if r <= d:  # eigenpairs of M_t from the (r, r) Gram matrix
            mu, Ur = torch.linalg.eigh(Gt @ Gt.T)
            mu, Ur = mu.flip(0).clamp_min(0.0), Ur.flip(1)[:, :q]
            E = (Gt.T @ Ur) * torch.where(mu[:q] > 0, mu[:q], torch.ones_like(mu[:q])).rsqrt()[None, :]
        else:
            mu, E = torch.linalg.eigh(Gt.T @ Gt)
            mu, E = mu.flip(0).clamp_min(0.0), E.flip(1)[:, :q]
        log_core[k] = torch.log1p(mu).sum()
        rest = torch.cat([mu[q:], mu.new_zeros(max(0, d - mu.shape[0]))])
        s_k = (rest.numel() / (1.0 / (1.0 + rest)).sum() - 1.0) if rest.numel() else mu.new_zeros(())
        s_k = s_k.clamp_min(0.0)
        rows.append((sqrt_D[:, None] * E * (mu[:q] - s_k).clamp_min(0.0).sqrt()[None, :]).T)
        gain[k] = 1.0 + s_k
    lowrank = torch.cat(rows, 0) if rows else e.new_zeros((0, d))
    sizes = torch.tensor([x.shape[0] for x in rows], dtype=torch.int64, device=dev)
    seg = torch.repeat_interleave(torch.arange(T, device=dev), sizes)
    lowrank = lowrank * c.sqrt().index_select(0, seg)[:, None]
    iso = c * gain
    D = 1.0 + a[:, None] / e[None, :]  # (T, d)
    logdet = e.log().sum() + d * c.log() + D.log().sum(1) + log_core
    t = {
        "weights": weights.detach().to(device=dev, dtype=f64).reshape(T),
        "means": m,
        "center": m.mean(0),
        "logdet": logdet,
        "prior_evecs": V,
        "prior_evals": e,
        "lowrank": lowrank,
        "ranks": sizes,
        "iso": iso,
        "ridge": iso * a,
    }
    return t


def shared_scoring(t: dict[str, Tensor], mc: Tensor) -> dict[str, Tensor]:
    """The scoring factors of kind ``"shared"``, derived in float64 from the stored tensors (the same stored
    tensors always give the same factors): the whitening ``W = V diag(e)^{-1/2}``, the whitened means
    ``mu_t``, ``1 / D'_t`` with ``D'_t = iso_t + ridge_t / e``, and per component the Woodbury factor
    ``F_t = D'^{-1}_t U_t^T C_t^{-T}`` (d, q_t) with ``C_t C_t^T = I + U_t D'^{-1}_t U_t^T`` and ``U_t``
    (q_t, d) the component's rows of ``lowrank``. ``mc``: the component means minus
    ``center`` (T, d). Returns the attributes ``_W, _F_cat, _off, _seg, _base_cat, _mu2``."""
    f64, cdt = torch.float64, mc.dtype
    V, e = t["prior_evecs"], t["prior_evals"]
    lowrank, ranks = t["lowrank"], t["ranks"].to(torch.int64)
    iso, ridge = t["iso"], t["ridge"]
    T, d = mc.shape
    sizes = [int(x) for x in ranks.tolist()]
    if len(sizes) != T or sum(sizes) != lowrank.shape[0] or min(sizes, default=0) < 0:
        raise ValueError(f"shared factors: ranks {sizes} do not match lowrank {tuple(lowrank.shape)}")
    e64 = e.to(f64)
    W = V.to(f64) * e64.rsqrt()[None, :]
    mu = mc.to(f64) @ W  # (T, d) whitened means
    inv_D = 1.0 / (iso.to(f64)[:, None] + ridge.to(f64)[:, None] / e64[None, :])
    U = lowrank.to(f64)
    Fs, offs = [], []
    start = 0
    for k, q in enumerate(sizes):
        Uk = U[start : start + q]
        start += q
        DU = Uk.T * inv_D[k][:, None]  # (d, q)
        core = Uk @ DU
        core.diagonal().add_(1.0)
        C, info = torch.linalg.cholesky_ex(core)
        if int(info) != 0:
            raise SignatureFitError(f"singular covariance: component {k} is not positive definite")
        Fk = torch.linalg.solve_triangular(C, DU.T, upper=False).T  # (d, q)
        Fs.append(Fk)
        offs.append(mu[k] @ Fk)
    F = torch.cat(Fs, 1) if Fs else U.new_zeros((d, 0))
    seg = torch.repeat_interleave(torch.arange(T, device=U.device), ranks.to(U.device))
    W = W.to(cdt).contiguous()
    F_cat = F.to(cdt).contiguous()  # (d, Q)
    off = torch.cat(offs).to(cdt) if offs else F.new_zeros(0).to(cdt)  # (Q,)
    seg_ind = torch.zeros((F.shape[1], T), dtype=cdt, device=U.device)  # column -> component indicator
    seg_ind[torch.arange(F.shape[1], device=U.device), seg] = 1.0
    # ||y||^2_{D'^{-1}} = [z*z, z] @ [inv_D, -2 mu inv_D]^T + mu^T D'^{-1} mu: one product for all t
    base_cat = torch.cat([inv_D, -2.0 * mu * inv_D], 1).to(cdt).contiguous()  # (T, 2d)
    mu2 = (mu * mu * inv_D).sum(1).to(cdt)
    return {"_W": W, "_F_cat": F_cat, "_off": off, "_seg": seg_ind, "_base_cat": base_cat, "_mu2": mu2}


@COVARIANCES.register("shared", "one full matrix per task plus per-component low rank (Woodbury)")
class SharedComponents(GaussianComponents):
    """Kind ``"shared"``: ``SharedComponents(weights (T,), means (T, d), factors, rank=64,
    dtype=torch.float32)`` from factored covariances ``Lambda_t = scale_t (P + ridge_t I + V F_t^T F_t
    V^T)`` (``factors``: :class:`~proteus.signatures.posterior.PosteriorFactors`, ``P = V diag(prior_evals)
    V^T`` shared by all components, ``F_t`` (r_t, d) in P's eigenbasis), within a budget of ``T * rank``
    factor rows: exact while the ``r_t`` fit it, see :func:`~proteus.signatures.shared.shared_tensors`.
    Computed in float64, held in ``dtype``."""

    kind = "shared"
    factor_names = ("prior_evecs", "prior_evals", "lowrank", "ranks", "iso", "ridge")
    auto_storage = "float16"  # its low-rank rows (the eigenbasis: float32 Householder vectors)
    per_component = ("ranks", "iso", "ridge")
    #: scoring factors (:func:`~proteus.signatures.shared.shared_scoring`)
    _W: Tensor
    _F_cat: Tensor
    _off: Tensor
    _seg: Tensor
    _base_cat: Tensor
    _mu2: Tensor

    def __init__(
        self,
        weights: Tensor,
        means: Tensor,
        factors: PosteriorFactors,
        rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        t = shared_tensors(weights, means, factors, rank)
        cdt = compute_dtype(dtype)
        self._set({k: (v.to(cdt) if v.is_floating_point() else v) for k, v in t.items()})

    @classmethod
    def from_fit(
        cls, fit: ComponentSource, active: Tensor, rank: int | None, n_train: int
    ) -> GaussianComponents:
        d = fit.means.shape[1]
        pf = fit.shared_fn(active)
        q = d if rank is None else max(1, min(int(rank), d))
        return cls(fit.weights.index_select(0, active), fit.means.index_select(0, active), pf, rank=q)

    def _set_factors(self, t: dict[str, Tensor], mc: Tensor) -> None:
        """The stored tensors and the scoring factors (:func:`~proteus.signatures.shared.shared_scoring`)."""
        self.prior_evecs, self.prior_evals = t["prior_evecs"], t["prior_evals"]
        self.lowrank, self.ranks = t["lowrank"], t["ranks"].to(torch.int64)
        self.iso, self.ridge = t["iso"], t["ridge"]
        scoring = shared_scoring(t, mc)
        self.rank = max((int(x) for x in self.ranks.tolist()), default=0)
        for name, value in scoring.items():
            setattr(self, name, value)

    def _factor_tensors(self, big: torch.dtype, small: torch.dtype) -> dict[str, Tensor]:
        if big == torch.float16:
            # compact storage: the eigenvectors as their Householder vectors in float32 (half of d x d; a
            # float16 d x d basis moved the NLL by up to 1.5e-3, relative), columns signed for R = I, and
            # the low-rank rows' coordinates signed alike (the same covariances)
            if self._packed_basis is not None:  # loaded from this form: store it again as it came
                packed, signs = self._packed_basis, torch.ones(self.d, dtype=torch.float64)
            else:
                signs = positive_qr_signs(self.prior_evecs)
                packed = pack_orthogonal(self.prior_evecs.to(torch.float64) * signs[None, :])
            signs = signs.to(self.lowrank.device)
            return {
                "prior_qr": packed.to(small),
                "prior_evals": self.prior_evals.to(small),
                "lowrank": (self.lowrank.to(torch.float64) * signs[None, :]).to(big),
                "ranks": self.ranks,
                "iso": self.iso.to(small),
                "ridge": self.ridge.to(small),
            }
        return {
            "prior_evecs": self.prior_evecs.to(small),
            "prior_evals": self.prior_evals.to(small),
            "lowrank": self.lowrank.to(big),
            "ranks": self.ranks,
            "iso": self.iso.to(small),
            "ridge": self.ridge.to(small),
        }

    def _row_cost(self) -> int:
        return max(self._F_cat.shape[1], 2 * self.d)

    def _maha(self, xs: Tensor) -> Tensor:
        z = xs @ self._W  # whitening: once per row for all components
        base = (self._base_cat @ torch.cat([z * z, z], 1).T).T + self._mu2[None]
        P = z @ self._F_cat
        P.sub_(self._off[None])
        return base - P.square_() @ self._seg

    def _select_rows(self, t: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
        """The ``lowrank`` rows of the selected components, in the selected order."""
        ends = torch.cumsum(self.ranks, 0)
        rows = [torch.arange(int(ends[i]) - int(self.ranks[i]), int(ends[i])) for i in idx.tolist()]
        return {"lowrank": t["lowrank"].index_select(0, torch.cat(rows).to(self.device))}


#: the eigenbasis as ``prior_evecs`` (d, d) or, stored compactly, as ``prior_qr`` (its Householder vectors,
#: d (d - 1) / 2; signatures/householder.py), with the components' low-rank rows
TENSOR_RULES.declare(
    "signature", "shared",
    ShapeRule("prior_evecs", ("meta:d", "meta:d"), "a (d, d) eigenbasis"),
    ShapeRule("prior_evals", ("meta:d",), "one entry per embedding dimension"),
    ShapeRule("lowrank", ("total:ranks", "meta:d"),
              "the low-rank factors have one row per rank of {prefix}ranks and d columns"),
    ShapeRule("ranks", ("meta:n_active",), "one entry per signature component", "int"),
    ShapeRule("(?:iso|ridge)", ("meta:n_active",), "one entry per signature component"),
    Together("(?:prior_evecs|prior_qr|prior_evals|lowrank|ranks|iso|ridge)",
             ("prior_evals", "lowrank", "ranks", "iso", "ridge")),
)  # fmt: skip
