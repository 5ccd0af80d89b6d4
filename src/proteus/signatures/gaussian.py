"""The Gaussian signature components of Eq. 2 / Eq. 18, stored for fast batched scoring.

Eq. 2 scores an embedding ``h`` against a signature pattern ``(m, Lambda)`` with the Mahalanobis term
``S(h) = (h - m)^T Lambda^{-1} (h - m)``; the retrieval rule of Section 3.1 uses the negative Gaussian
log-likelihood ``0.5 (S(h) + log|Lambda| + d log 2 pi)``. :class:`GaussianComponents` holds T such
patterns in one d-dimensional space, in one of three forms:

* ``"full"``: the precision Cholesky factor ``A_t`` (``Lambda_t^{-1} = A_t A_t^T``), so
  ``S_t(h) = ||A_t^T (h - m_t)||^2``: one (N, d) x (d, T d) matrix product for all components.
* ``"ppca"`` (low rank plus isotropic): ``Lambda_t = U_t diag(lam_t) U_t^T + sigma_t^2 I`` with the top-q
  eigenvectors ``U_t`` (d, q), ``lam_t`` the eigenvalues above the noise level, and ``sigma_t^2`` the mean
  of the d - q discarded eigenvalues, so the likelihood stays in the full d-dimensional space. The
  Woodbury identity gives ``S_t(h) = (||r||^2 - sum_j lam_j / (lam_j + sigma^2) (u_j^T r)^2) / sigma^2``
  (``r = h - m_t``) and ``log|Lambda_t| = sum_j log(lam_j + sigma^2) + (d - q) log sigma^2`` exactly.
  ``sigma^2`` is floored at ``1e-6`` times the mean eigenvalue (``_SIGMA2_FLOOR``).
* ``"shared"`` (shared full matrix plus per-component low rank; built by :meth:`GaussianComponents.shared`
  from a fit's factored covariances, e.g. :meth:`~proteus.signatures.dpgmm.DPGMM.posterior_factors`):
  ``Lambda_t = V diag(e)^{1/2} (iso_t + ridge_t diag(e)^{-1} + U_t^T U_t) diag(e)^{1/2} V^T``, where
  ``P = V diag(e) V^T`` is one d x d matrix per task (the DP-GMM's covariance prior, i.e. scikit-learn's
  ``W0^{-1}``) and ``U_t`` (q_t, d) lives in P's whitened space. The DP-GMM's expected covariances
  ``(W0^{-1} + N_t reg I + N_t S_t + beta_0 N_t / beta_t (xbar_t - m0)(xbar_t - m0)^T) / nu_t`` have
  exactly that form with ``U_t`` of rank ``r_t <= N_t + 1``, so the scores equal ``"full"``'s whenever
  the ``r_t`` fit the rank budget (``T * rank`` rows shared by the components; see
  :meth:`GaussianComponents.shared` for the approximation beyond it). Scoring whitens each input once,
  ``z = diag(e)^{-1/2} V^T (x - c)`` (``N d^2``), then per component uses Woodbury on the ``q_t``-dim
  core: ``S_t = ||z - mu_t||^2_{D_t^{-1}} - ||F_t^T (z - mu_t)||^2`` with ``D_t = iso_t + ridge_t / e``
  and ``F_t = D_t^{-1} U_t^T C_t^{-T}``, ``C_t C_t^T = I + U_t D_t^{-1} U_t^T`` (``N d sum_t q_t``);
  ``log|Lambda_t|`` is stored. An eigen-whitening (rather than a Cholesky factor of P) keeps the
  ``N_t reg_covar I`` term of the posterior diagonal, hence exact, in the whitened space.

Scoring is batched over samples and components on the tensors' device and always runs in float32 or
higher. Rows are centred on the mean of the component means before the products (``center``) to
limit cancellation.

Storage (:meth:`GaussianComponents.to_tensors`): the large factors (``prec_chol``, ``U`` or ``lowrank``)
take the storage dtype (float16 or float32); means, weights, eigenvalues, noise, log-determinants and the
centre stay in float32, because float16 cannot hold small variances or large log-determinants. The
shared matrix's eigenvectors (``prior_evecs``, d x d per task) stay float32 too: in float16 they moved
the NLL of a d = 768 DP-GMM signature by up to 1.5e-3 (relative), against 3e-5 for float16 ``lowrank``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proteus.signatures.errors import SignatureFitError
from proteus.signatures.shared import allocate_ranks, shared_scoring, shared_tensors

__all__ = ["GaussianComponents"]

_SIGMA2_FLOOR = 1e-6
_CHUNK_ELEMENTS = 1 << 24
_KINDS = ("full", "ppca")  # kinds built from dense covariances; "shared" comes from GaussianComponents.shared
_PER_COMPONENT = {"weights", "means", "logdet", "prec_chol", "U", "lam", "sigma2", "iso", "ridge", "ranks"}

#: kept importable from this module (tests, older callers)
_allocate_ranks = allocate_ranks


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {
        "float16": torch.float16,
        "float32": torch.float32,
        "float64": torch.float64,
        "bfloat16": torch.bfloat16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scoring dtype: float32 or higher."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dense_tensors(
    weights: Tensor, means: Tensor, covariances: Tensor, kind: str, rank: int
) -> dict[str, Tensor]:
    """The stored tensors (float64) of kinds ``"full"`` (precision Cholesky factors) and ``"ppca"`` (top-q
    eigenpairs plus the mean discarded eigenvalue) from dense covariances (T, d, d)."""
    T, d = means.shape
    w = weights.detach().to(torch.float64).reshape(T)
    m = means.detach().to(torch.float64)
    C = covariances.detach().to(torch.float64)
    C = 0.5 * (C + C.mT)
    if not bool(torch.isfinite(C).all() and torch.isfinite(m).all()):
        raise SignatureFitError("component means or covariances are not finite")
    center = m.mean(0)
    t: dict[str, Tensor] = {"weights": w, "means": m, "center": center}
    if kind == "full":
        L, info = torch.linalg.cholesky_ex(C)
        if bool((info != 0).any()):
            bad = (info != 0).nonzero().flatten().tolist()
            raise SignatureFitError(f"singular covariance: component(s) {bad} are not positive definite")
        eye = torch.eye(d, dtype=C.dtype, device=C.device).expand_as(C)
        t["prec_chol"] = torch.linalg.solve_triangular(L, eye, upper=False).mT  # A, precision = A A^T
        t["logdet"] = 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    else:
        q = max(0, min(int(rank), d - 1))
        evals, evecs = torch.linalg.eigh(C)  # ascending
        mean_eval = evals.mean(1).clamp_min(0.0)
        if bool((mean_eval <= 0).any()):
            bad = (mean_eval <= 0).nonzero().flatten().tolist()
            raise SignatureFitError(f"singular covariance: component(s) {bad} have zero variance")
        top = evals[:, d - q :].flip(-1)  # descending
        U = evecs[:, :, d - q :].flip(-1)
        sigma2 = evals[:, : d - q].mean(1).clamp_min(_SIGMA2_FLOOR * mean_eval)
        lam = (top - sigma2[:, None]).clamp_min(0.0)
        t["U"], t["lam"], t["sigma2"] = U, lam, sigma2
        t["logdet"] = torch.log(lam + sigma2[:, None]).sum(1) + (d - q) * sigma2.log()
    return t


class GaussianComponents:
    """T Gaussians ``N(m_t, Lambda_t)`` in one d-dim space, with batched Mahalanobis / NLL scoring.

    ``GaussianComponents(weights (T,), means (T, d), covariances (T, d, d), kind="full"|"ppca",
    rank=q, dtype=torch.float32)``: factors are computed in float64 from the covariances, then held in
    ``dtype`` (float32 or float64). ``rank`` is used by ``"ppca"`` only and is clipped to ``d - 1``.
    Kind ``"shared"`` needs factored covariances: build it with :meth:`shared`.
    Raises :class:`SignatureFitError` for a non-finite or non positive-definite covariance.
    """

    def __init__(
        self,
        weights: Tensor,
        means: Tensor,
        covariances: Tensor,
        kind: str = "full",
        rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if kind == "shared":
            raise ValueError(
                "kind='shared' needs the factored covariances (shared prior + per-component low-rank data "
                "term), not dense ones: build it with GaussianComponents.shared(...)"
            )
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        if means.ndim != 2 or covariances.shape != (means.shape[0], means.shape[1], means.shape[1]):
            raise ValueError(
                f"means (T, d) and covariances (T, d, d) do not match: {tuple(means.shape)}, "
                f"{tuple(covariances.shape)}"
            )
        T, d = means.shape
        if T == 0:
            raise SignatureFitError("no Gaussian components to store")
        t = _dense_tensors(weights, means, covariances, kind, rank)
        self._set({k: v.to(_compute_dtype(dtype)) for k, v in t.items()}, kind)

    @classmethod
    def shared(
        cls,
        weights: Tensor,
        means: Tensor,
        prior_evals: Tensor,
        prior_evecs: Tensor,
        scale: Tensor,
        ridge: Tensor,
        factors: list[Tensor],
        rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> GaussianComponents:
        """Components of kind ``"shared"`` from factored covariances
        ``Lambda_t = scale_t (P + ridge_t I + V F_t^T F_t V^T)`` (``P = V diag(prior_evals) V^T`` shared by
        all components, ``F_t`` (r_t, d) in P's eigenbasis, as
        :meth:`~proteus.signatures.dpgmm.DPGMM.posterior_factors` returns them), within a budget of
        ``T * rank`` factor rows: exact while the ``r_t`` fit it, see
        :func:`~proteus.signatures.shared.shared_tensors`. Computed in float64, held in ``dtype``."""
        t = shared_tensors(weights, means, prior_evals, prior_evecs, scale, ridge, factors, rank)
        obj = cls.__new__(cls)
        cdt = _compute_dtype(dtype)
        obj._set({k: (v.to(cdt) if v.is_floating_point() else v) for k, v in t.items()}, "shared")
        return obj

    # ------------------------------------------------------------------ construction from stored tensors
    def _set(self, t: dict[str, Tensor], kind: str) -> None:
        t = {k: v.contiguous() for k, v in t.items()}  # same layouts: bit-identical scores after reload
        self.kind = kind
        self.weights = t["weights"]
        self.means = t["means"]
        self.center = t["center"]
        self.logdet = t["logdet"]
        T, d = self.means.shape
        self.n_components, self.d = int(T), int(d)
        mc = self.means - self.center
        if kind == "full":
            A = t["prec_chol"]  # (T, d, d)
            self.prec_chol = A
            self._A_cat = A.permute(1, 0, 2).reshape(d, T * d).contiguous()
            self._off = torch.einsum("td,tde->te", mc, A)  # (T, d)
        elif kind == "shared":
            self._set_shared(t, mc)
        else:
            self.U, self.lam, self.sigma2 = t["U"], t["lam"], t["sigma2"]
            q = self.U.shape[2]
            self.rank = int(q)
            self._U_cat = self.U.permute(1, 0, 2).reshape(d, T * q).contiguous()
            self._off = torch.einsum("td,tdq->tq", mc, self.U)  # (T, q)
            self._shrink = self.lam / (self.lam + self.sigma2[:, None])  # (T, q)
            self._mc2 = (mc * mc).sum(1)
        self._mc = mc

    def _set_shared(self, t: dict[str, Tensor], mc: Tensor) -> None:
        """Scoring factors of kind ``"shared"`` (:func:`~proteus.signatures.shared.shared_scoring`)."""
        self.prior_evecs, self.prior_evals = t["prior_evecs"], t["prior_evals"]
        self.lowrank, self.ranks = t["lowrank"], t["ranks"].to(torch.int64)
        self.iso, self.ridge = t["iso"], t["ridge"]
        scoring = shared_scoring(t, mc)
        self.rank = max((int(x) for x in self.ranks.tolist()), default=0)
        for name, value in scoring.items():
            setattr(self, name, value)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> GaussianComponents:
        """Rebuild from :meth:`to_tensors`'s dict (float16 factors are upcast to float32)."""
        if "prec_chol" in tensors:
            kind, extra = "full", ["prec_chol"]
        elif "prior_evecs" in tensors:
            kind, extra = "shared", ["prior_evecs", "prior_evals", "lowrank", "ranks", "iso", "ridge"]
        else:
            kind, extra = "ppca", ["U", "lam", "sigma2"]
        need = ["weights", "means", "center", "logdet", *extra]
        missing = [k for k in need if k not in tensors]
        if missing:
            raise KeyError(f"GaussianComponents tensors lack {missing}")
        floats = [k for k in need if tensors[k].is_floating_point()]
        wide = max((tensors[k].dtype for k in floats), key=lambda dt: torch.finfo(dt).bits)
        cdt = _compute_dtype(wide)
        obj = cls.__new__(cls)
        obj._set({k: (tensors[k].to(cdt) if k in floats else tensors[k]) for k in need}, kind)
        return obj

    def to_tensors(self, dtype: str | torch.dtype = torch.float32) -> dict[str, Tensor]:
        """Tensors for safetensors: the big factor in ``dtype`` (float16/float32), the rest float32+."""
        sd = _dtype(dtype)
        small = self.means.dtype  # float32 (or float64 when computed in float64)
        out = {
            "weights": self.weights.to(small),
            "means": self.means.to(small),
            "center": self.center.to(small),
            "logdet": self.logdet.to(small),
        }
        if self.kind == "full":
            out["prec_chol"] = self.prec_chol.to(sd)
        elif self.kind == "shared":
            out["prior_evecs"] = self.prior_evecs.to(small)  # float32 even for float16 storage (measured)
            out["prior_evals"] = self.prior_evals.to(small)
            out["lowrank"] = self.lowrank.to(sd)
            out["ranks"] = self.ranks
            out["iso"] = self.iso.to(small)
            out["ridge"] = self.ridge.to(small)
        else:
            out["U"] = self.U.to(sd)
            out["lam"] = self.lam.to(small)
            out["sigma2"] = self.sigma2.to(small)
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    # ------------------------------------------------------------------ scoring
    @property
    def device(self) -> torch.device:
        return self.means.device

    @property
    def dtype(self) -> torch.dtype:
        return self.means.dtype

    def mahalanobis(self, X: Tensor) -> Tensor:
        """``(x - m_t)^T Lambda_t^{-1} (x - m_t)`` for all rows and components, (N, T)."""
        if X.ndim != 2 or X.shape[1] != self.d:
            raise ValueError(f"expected (N, {self.d}) embeddings, got {tuple(X.shape)}")
        X = X.to(device=self.device, dtype=self.dtype) - self.center
        N, T, d = X.shape[0], self.n_components, self.d
        out = torch.empty((N, T), dtype=self.dtype, device=self.device)
        if self.kind == "full":
            chunk = max(1, _CHUNK_ELEMENTS // (T * d))
            for s in range(0, N, chunk):
                Y = (X[s : s + chunk] @ self._A_cat).view(-1, T, d)
                Y.sub_(self._off[None])
                out[s : s + chunk] = Y.square_().sum(-1)
        elif self.kind == "shared":
            chunk = max(1, _CHUNK_ELEMENTS // max(self._F_cat.shape[1], 2 * d))
            for s in range(0, N, chunk):
                z = X[s : s + chunk] @ self._W  # whitening: once per row for all components
                base = (self._base_cat @ torch.cat([z * z, z], 1).T).T + self._mu2[None]
                P = z @ self._F_cat
                P.sub_(self._off[None])
                out[s : s + chunk] = base - P.square_() @ self._seg
        else:
            q = self.rank
            chunk = max(1, _CHUNK_ELEMENTS // max(T * q, T))
            for s in range(0, N, chunk):
                xs = X[s : s + chunk]
                r2 = (xs * xs).sum(1, keepdim=True) - 2.0 * (self._mc @ xs.T).T + self._mc2[None]
                if q > 0:
                    P = (xs @ self._U_cat).view(-1, T, q)
                    P.sub_(self._off[None])
                    r2 = r2 - (P.square_() * self._shrink[None]).sum(-1)
                out[s : s + chunk] = r2 / self.sigma2[None]
        return out.clamp_min_(0.0)

    def nll(self, X: Tensor) -> Tensor:
        """Negative Gaussian log-likelihood ``0.5 (maha + log|Lambda_t| + d log 2 pi)``, (N, T)."""
        return 0.5 * (self.mahalanobis(X) + self.logdet[None] + self.d * math.log(2.0 * math.pi))

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        """Bytes of the stored tensors (as held, i.e. in the compute dtype)."""
        return sum(v.numel() * v.element_size() for v in self.to_tensors(self.dtype).values())

    def to(self, device: torch.device | str) -> GaussianComponents:
        """Move every tensor to ``device`` (in place); returns ``self``."""
        for name, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device))
        return self

    def select(self, index: Tensor | list[int]) -> GaussianComponents:
        """A new object with the given components only."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.device)
        t = self.to_tensors(self.dtype)
        sel = {k: (v.index_select(0, idx) if k in _PER_COMPONENT else v) for k, v in t.items()}
        if self.kind == "shared":  # the rows of the selected components, in the selected order
            ends = torch.cumsum(self.ranks, 0)
            rows = [torch.arange(int(ends[i]) - int(self.ranks[i]), int(ends[i])) for i in idx.tolist()]
            sel["lowrank"] = t["lowrank"].index_select(0, torch.cat(rows).to(self.device))
        return GaussianComponents.from_tensors(sel)

    def __repr__(self) -> str:
        extra = f", rank={self.rank}" if self.kind in ("ppca", "shared") else ""
        return (
            f"GaussianComponents(T={self.n_components}, d={self.d}, kind={self.kind!r}{extra}, "
            f"dtype={self.dtype})"
        )
